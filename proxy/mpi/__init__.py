"""shmproxy.MPI: mpi4py's documented API over the native shmproxy API, for programs written for mpi4py.

    from shmproxy import MPI          # instead of: from mpi4py import MPI
    comm = MPI.COMM_WORLD
    comm.Send([buf, MPI.DOUBLE], dest=1, tag=7)

This package (import name ``shmproxy.mpi``) is the implementation, split by subject: exceptions.py
(error classes), datatypes.py, status.py, ops.py, buffers.py (buffer specs -> numpy views),
request.py, group.py, comm.py (communicators, point-to-point, objects), coll.py (collectives),
topology.py (Cartesian grids), graph.py (graph topologies), neighbor.py (neighbour collectives),
intercomm.py (intercommunicators), info.py (MPI.Info), env.py (COMM_WORLD, Init/Finalize, clocks).
``shmproxy.MPI`` (proxy/MPI.py) re-exports the names below. What is not provided raises
NotImplementedError (an MPI.Exception of class ERR_UNSUPPORTED_OPERATION) naming what is missing; the
README lists it.
"""
from __future__ import annotations

from typing import Any

from shmproxy.core.ops import ANY_SOURCE, ANY_TAG, IN_PLACE, UNDEFINED
from shmproxy.mpi import datatypes as _datatypes
from shmproxy.mpi import exceptions as _exceptions
from shmproxy.mpi.buffers import BOTTOM, BUFFER_AUTOMATIC
from shmproxy.mpi.comm import (APPNUM, COMM_NULL, HOST, IO, KEYVAL_INVALID, LASTUSEDCODE, TAG_UB,
                               UNIVERSE_SIZE, WTIME_IS_GLOBAL, Comm, Intracomm)
from shmproxy.mpi.datatypes import Datatype
from shmproxy.mpi.env import (COMM_SELF, COMM_TYPE_SHARED, COMM_WORLD, ERRHANDLER_NULL, ERRORS_ABORT,
                              ERRORS_ARE_FATAL, ERRORS_RETURN, MAX_ERROR_STRING, MAX_LIBRARY_VERSION_STRING,
                              MAX_PROCESSOR_NAME, SUBVERSION, THREAD_FUNNELED, THREAD_MULTIPLE,
                              THREAD_SERIALIZED, THREAD_SINGLE, VERSION, Alloc_mem, Attach_buffer, Close_port,
                              Detach_buffer, Errhandler, Finalize, Free_mem, Get_library_version,
                              Get_processor_name, Get_version, Init, Init_thread, attach_world, get_vendor,
                              Is_finalized, Is_initialized, Is_thread_main, Lookup_name, Open_port,
                              Pcontrol, Publish_name, Query_thread, Unpublish_name, Wtick, Wtime)
from shmproxy.mpi.unprovided import FILE_NULL, SESSION_NULL, WIN_NULL, File, Session, Win
from shmproxy.mpi.handles import _addressof, _handleof, _sizeof
from shmproxy.mpi.commlock import _comm_lock, _comm_lock_table
from shmproxy.mpi.exceptions import Exception, Get_error_class, Get_error_string  # noqa: A004
from shmproxy.mpi.exceptions import (Add_error_class, Add_error_code, Add_error_string, Remove_error_class,
                                     Remove_error_code, Remove_error_string)
from shmproxy.mpi.env import Get_hw_resource_info  # noqa: E402
from shmproxy.mpi.env import (MODE_APPEND, MODE_CREATE, MODE_DELETE_ON_CLOSE, MODE_EXCL, MODE_RDONLY,
                              MODE_RDWR, MODE_SEQUENTIAL, MODE_UNIQUE_OPEN, MODE_WRONLY)
from shmproxy.mpi.group import CONGRUENT, GROUP_EMPTY, GROUP_NULL, IDENT, SIMILAR, UNEQUAL, Group
from shmproxy.mpi.ops import (BAND, BOR, BXOR, LAND, LOR, LXOR, MAX, MAXLOC, MIN, MINLOC, NO_OP, OP_NULL,
                              PROD, REPLACE, SUM, Op)
from shmproxy.mpi.message import MESSAGE_NO_PROC, MESSAGE_NULL, Message
from shmproxy.mpi.request import REQUEST_NULL, Prequest, Request
from shmproxy.mpi.grequest import Grequest
from shmproxy.mpi.status import PROC_NULL, Status
from shmproxy.mpi.topology import CART, DIST_GRAPH, GRAPH, Cartcomm, Compute_dims, Topocomm
from shmproxy.mpi.graph import UNWEIGHTED, WEIGHTS_EMPTY, Distgraphcomm, Graphcomm
from shmproxy.mpi.intercomm import ROOT, Intercomm
from shmproxy.mpi.info import INFO_ENV, INFO_NULL, MAX_INFO_KEY, MAX_INFO_VAL, Info

# Every predefined datatype (MPI.INT, MPI.DOUBLE, ...) and error class (MPI.ERR_TRUNCATE, ...).
globals().update(_datatypes.PREDEFINED)
from shmproxy.mpi import typemap as _typemap   # noqa: E402  (derived datatypes: COMBINER_*, ORDER_*)
globals().update({k: v for k, v in vars(_typemap).items() if k.startswith(("COMBINER_", "ORDER_"))})
COMBINER_NAMED = _datatypes.COMBINER_NAMED
from shmproxy.mpi import dtintro as _dtintro   # noqa: E402  (F90 types, DISTRIBUTE_*, TYPECLASS_*)
globals().update({k: v for k, v in vars(_dtintro).items()
                  if k.startswith(("COMBINER_", "ORDER_", "TYPECLASS_", "DISTRIBUTE_"))})
globals().update({k: v for k, v in vars(_exceptions).items()
                  if (k.startswith("ERR_") or k == "SUCCESS") and isinstance(v, int)})
TWOINT = INT_INT = _datatypes.TWOINT

# mpi4py's datatype names that are synonyms of predefined ones (the same C type), and the names of
# types this layer cannot carry: those are DATATYPE_NULL, which is how mpi4py itself presents a type
# the MPI library lacks. A name datatypes.py defines is never replaced.
for _alias, _of in (("SIGNED_SHORT", "SHORT"), ("SIGNED_INT", "INT"), ("SIGNED_LONG", "LONG"),
                    ("SIGNED_LONG_LONG", "LONG_LONG"), ("SINT8_T", "INT8_T"), ("SINT16_T", "INT16_T"),
                    ("SINT32_T", "INT32_T"), ("SINT64_T", "INT64_T")):
    globals().setdefault(_alias, globals()[_of])
for _missing in ("BFLOAT16_T", "FLOAT16_T", "FLOAT32_T", "FLOAT64_T", "COMPLEX4", "COMPLEX32", "REAL2",
                 "REAL16", "INTEGER16", "LOGICAL1", "LOGICAL2", "LOGICAL4", "LOGICAL8", "LOGICAL16",
                 "F_BOOL", "F_INT", "F_FLOAT", "F_DOUBLE", "F_COMPLEX", "F_FLOAT_COMPLEX",
                 "F_DOUBLE_COMPLEX"):
    globals().setdefault(_missing, _datatypes.DATATYPE_NULL)
from shmproxy.mpi.bsend import BSEND_OVERHEAD, Flush_buffer, Iflush_buffer   # noqa: E402
from shmproxy.mpi.membuf import buffer, memory   # noqa: E402  (mpi4py's MPI.buffer)
from shmproxy.mpi.dtintro import _typealign   # noqa: E402  (mpi4py.util.dtlib asks it)
from shmproxy.mpi.pickler import Pickle, pickle   # noqa: E402

# mpi4py's type-code table (MPI._typedict): numpy/array type characters -> datatypes.
_typedict = {ch: d for ch, d in _datatypes._BY_CHAR.items()}


def Get_address(location: Any) -> int:
    """The address of a buffer (any form buffers.py reads: the buffer protocol, DLPack, the CUDA
    array interface over host memory); with MPI.BOTTOM, the w collectives take such addresses."""
    from shmproxy.mpi.wcoll import address_of
    return address_of(location)


def __getattr__(name: str) -> Any:
    # A name mpi4py has and this layer does not: say so, rather than a bare AttributeError.
    raise AttributeError(f"shmproxy.MPI has no attribute {name!r}: not provided by shmproxy's MPI layer "
                         "(see README.md, 'mpi4py programs')")
