"""shmproxy: a communication runtime for Python jobs of many processes.

    import shmproxy
    with shmproxy.init() as comm:               # under mpiexec, torchrun or srun
        buf = comm.alloc(1 << 20, "float32")    # registered shared memory: the zero-copy path
        if comm.rank == 0:
            comm.Send(buf, dest=1, tag=7)
        elif comm.rank == 1:
            comm.Recv(buf, source=0, tag=7)

The package's folders say which process runs a line (docs/architecture.md): ``shmproxy.rank`` (the
API a rank calls), ``shmproxy.engine`` (the progress process), ``shmproxy.coll`` (collectives),
``shmproxy.control`` (bootstrap and the service socket), ``shmproxy.tools`` (dump, bench, probe),
over the low layer ``shmproxy.core`` (errors, params, logging, the op vocabulary) that
``shmproxy.shm`` and ``shmproxy.transports`` import as well.
"""
from shmproxy.core.errors import (Aborted, Closed, InternalError, InvalidArgument, InvalidUsage, PeerDiedError,
                                  ProxyError, RemoteError, Timeout, TruncationError)
from shmproxy.core.ops import ANY_SOURCE, ANY_TAG, IN_PLACE, UNDEFINED
from shmproxy.core.ops import ReduceOp
from shmproxy.rank.comm import Comm, init
from shmproxy.rank.request import Message, Request, Status

SUM, PROD, MIN, MAX, AVG = ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG

__all__ = ["init", "Comm", "Message", "Request", "Status", "ProxyError", "InvalidArgument", "InvalidUsage",
           "RemoteError", "PeerDiedError", "Timeout", "Closed", "Aborted", "InternalError",
           "TruncationError", "ReduceOp", "SUM", "PROD", "MIN", "MAX", "AVG", "IN_PLACE", "UNDEFINED",
           "ANY_SOURCE", "ANY_TAG"]
__version__ = "0.2.0"


def __getattr__(name: str) -> object:
    # ``shmproxy.MPI`` (the mpi4py-style layer, proxy/MPI.py over proxy/mpi/) is imported on first
    # access, not by ``import shmproxy``: programs of the native API never load it. (``from shmproxy
    # import MPI`` and ``import shmproxy.MPI`` import the submodule themselves; this hook serves
    # ``import shmproxy; shmproxy.MPI``.)
    if name in ("MPI", "mpi"):
        import importlib
        return importlib.import_module(f"shmproxy.{name}")
    raise AttributeError(f"module 'shmproxy' has no attribute {name!r}")
