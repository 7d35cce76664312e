"""What an op record means: kinds, dtype codes, the collective vocabulary (which collective, which
reduction) and the progress-side Op built from a record.

The rank packs a record with ``pack`` (shm/pool.py RECORD layout); the progress process unpacks it
into an ``Op`` while it holds the pool mutex and returns the record to its owner's free list, so an
Op never points back into shared memory.
"""
from __future__ import annotations

from enum import IntEnum

import numpy as np

from shmproxy.core import errors
from shmproxy.shm import _membuf, pool as P

KIND_SEND = 1
KIND_RECV = 2
KIND_COLL = 3
KIND_PROBE = 4    # Probe/Iprobe/Mprobe/Improbe: peer and tag as a receive's; flags FLAG_PROBE_*
KIND_CANCEL = 5   # cancel the rank's pending op whose request is (slot = peer, sequence = tag)
KIND_NAMES = {KIND_SEND: "send", KIND_RECV: "recv", KIND_COLL: "collective", KIND_PROBE: "probe",
              KIND_CANCEL: "cancel"}

# Record flags of point-to-point ops (engine/p2p.py).
FLAG_SYNC = 4           # a send that completes only once its receive matched it (Ssend, Issend)
FLAG_MPROBED = 8        # a receive of the message a matched probe held: tag = that probe's sequence
FLAG_PROBE_BLOCK = 16   # a probe that waits for a message (Probe, Mprobe), else answers at once
FLAG_PROBE_MATCHED = 32  # a probe that takes the message out of matching (Mprobe, Improbe)
FLAG_TYPED = 64         # a send/receive of a derived datatype: its bytes lie at the blocks of the type the
                        # owner registered as id ``offset2`` (TYPE_REGISTER), ``count`` instances of it
                        # from ``offset``; ``nbytes`` is the message (count x the type's size)

# Completion statuses that are no error (the low 16 bits of a slot's status word; error codes are small).
STATUS_CANCELLED = 0x7F01   # the op was cancelled before it matched
STATUS_NO_MESSAGE = 0x7F02  # a nonblocking probe found nothing

# Record flags of collective ops.
FLAG_IN_PLACE = 1     # the send side is the receive buffer (shmproxy.IN_PLACE)
FLAG_NO_RECV = 2      # no receive buffer on this rank (Reduce on a non-root rank)

# Record flag of any op on device memory: the rank's stream will store the request's sequence number
# into its slot's stream word once the work queued before the post is done (shmproxy.rank.device).
# Without it the op's stream was idle then, and the progress process orders its copies after nothing
# of the rank's (no word read, no stream wait).
FLAG_STREAM_WORD = 128

# dtype <-> 1-byte code carried in records. Only numeric types (and bool) travel.
_DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
           np.float16, np.float32, np.float64, np.complex64, np.complex128]
DTYPE_CODE: dict[str, int] = {}
CODE_DTYPE: dict[int, np.dtype] = {}
for _code, _t in enumerate(_DTYPES, start=1):
    _dt = np.dtype(_t)
    DTYPE_CODE[_dt.char] = _code
    CODE_DTYPE[_code] = _dt
# 'l'/'L' and 'q'/'Q' may both denote 64-bit integers, 'i'/'l' 32-bit on some ABIs: map by name too.
for _ch in "bBhHiIlLqQpP":
    _dt = np.dtype(_ch)
    if _dt.char not in DTYPE_CODE:
        DTYPE_CODE[_dt.char] = DTYPE_CODE[np.dtype(_dt.name).char]
SUPPORTED_DTYPES = ", ".join(np.dtype(t).name for t in _DTYPES)
# bfloat16 of device arrays only (numpy has no such dtype, so it is not in CODE_DTYPE: a host path that
# meets the code refuses it as unknown). The device collectives reduce it as 16-bit words through
# float32 (shmproxy.transports.cuda_coll); the rank views such tensors as uint16 (shmproxy.rank.device).
DTYPE_BFLOAT16 = len(_DTYPES) + 1

# Wildcards of a receive (MPI's MPI_ANY_SOURCE and MPI_ANY_TAG): tags are int64 and the most negative
# one is reserved, so a message's tag is in [TAG_MIN, TAG_MAX] and a receive may also take ANY_TAG.
ANY_SOURCE = -1
ANY_TAG = -(2**63)
TAG_MIN, TAG_MAX = ANY_TAG + 1, 2**63 - 1
# ANY_TAG never accepts the tags of the runtime's own traffic, [RESERVED_TAG_LO, RESERVED_TAG_HI) (the
# object layer's collectives use the tag just below shmproxy.rank.objstate.OBJ_TAG_BASE = -2**62): a
# user's wildcard receive or probe must not take them.
RESERVED_TAG_HI = -(2**62)
RESERVED_TAG_LO = RESERVED_TAG_HI - 2**32


# The collective vocabulary a record carries. It lives here, not with the schedules that execute it
# (shmproxy.coll.sched, which re-exports it), so that the record's meaning needs nothing above core.
class Coll(IntEnum):
    """Collective kinds as carried in op records (KIND_COLL, field x1)."""

    BARRIER = 1
    BCAST = 2
    REDUCE = 3
    ALLREDUCE = 4
    ALLGATHER = 5
    REDUCE_SCATTER_BLOCK = 6
    ALLTOALL = 7
    # Past ALLTOALL: posted by the Python path only (shm/_poster.c's fast path stops at ALLTOALL).
    GATHER = 8
    SCATTER = 9
    GATHERV = 10
    SCATTERV = 11
    ALLGATHERV = 12
    ALLTOALLV = 13
    REDUCE_SCATTER = 14
    SCAN = 15
    EXSCAN = 16


COLL_NAMES: dict[int, str] = {
    Coll.BARRIER: "Barrier", Coll.BCAST: "Bcast", Coll.REDUCE: "Reduce", Coll.ALLREDUCE: "Allreduce",
    Coll.ALLGATHER: "Allgather", Coll.REDUCE_SCATTER_BLOCK: "Reduce_scatter_block",
    Coll.ALLTOALL: "Alltoall", Coll.GATHER: "Gather", Coll.SCATTER: "Scatter",
    Coll.GATHERV: "Gatherv", Coll.SCATTERV: "Scatterv", Coll.ALLGATHERV: "Allgatherv",
    Coll.ALLTOALLV: "Alltoallv",
    Coll.REDUCE_SCATTER: "Reduce_scatter", Coll.SCAN: "Scan", Coll.EXSCAN: "Exscan"}
# The last collective the C post path (shm/_poster.h) knows.
COLL_LAST_NATIVE = Coll.ALLTOALL
# Collectives whose per-rank counts and displacements travel in a counts table beside the record
# (its buffer id in the record's tag word: shmproxy.core.counts).
COLL_WITH_COUNTS = frozenset((Coll.GATHERV, Coll.SCATTERV, Coll.ALLGATHERV, Coll.ALLTOALLV,
                              Coll.REDUCE_SCATTER))


class ReduceOp(IntEnum):
    """Reduction ops as carried in op records (field redop)."""

    SUM = 1
    PROD = 2
    MIN = 3
    MAX = 4
    AVG = 5


REDUCE_OP_NAMES = {int(op): op.name for op in ReduceOp}


def check_op(op: int, dtype: np.dtype) -> None:
    """Raise InvalidArgument when ``op`` is not defined for ``dtype``: the ranks check before posting,
    so that nothing a collective would refuse is ever in the pool."""
    if op not in REDUCE_OP_NAMES:
        raise errors.InvalidArgument(f"unknown reduction op {op!r}; use shmproxy.SUM, PROD, MIN, MAX or AVG")
    if dtype.kind == "b" and op not in (ReduceOp.MIN, ReduceOp.MAX):
        raise errors.InvalidArgument(f"{ReduceOp(op).name} is not defined for bool; use MIN (and) or MAX (or)")
    if op == ReduceOp.AVG and dtype.kind not in "fc":
        raise errors.InvalidArgument(f"AVG needs a floating or complex dtype, not {dtype}")


# The entries of a collective's schedule (shmproxy.coll.sched) and their states: the vocabulary the
# transports' collective hooks read (a SEND or RECV entry is theirs to move), so it lives here, below
# both.
SEND, RECV, REDUCE, COPY, NOP, CB = range(6)
NOT_STARTED, STARTED, COMPLETE, FAILED = range(4)
# A SEND or RECV entry's ``chain``: handed to its transport before the schedule reached it (a SEND
# sent once the RECV before it has landed, a RECV posted ahead: transports/net_coll.py, forward_of),
# in flight, or done before the schedule reached it
FORWARDING, FORWARDED = 1, 2


def _no_arithmetic(self: object, *other: object) -> object:
    raise TypeError(f"{self!r} is an address constant: no arithmetic on it")


class AddressConstant(_membuf.AddressInt):
    """An address of MPI's C API as mpi4py makes it: an int (its C value, as MPICH's), which exports
    an empty buffer at that address, is its one instance per class (``type(c)() is c``) and pickles
    by name. Code tells one apart with ``is``: equality with its int value is the int's."""

    _instance: "AddressConstant"
    _name = ""

    def __new__(cls) -> "AddressConstant":
        return cls._instance

    @classmethod
    def _make(cls, name: str, value: int) -> "AddressConstant":
        cls._name = name
        cls._instance = int.__new__(cls, value)
        return cls._instance

    def __repr__(self) -> str:
        return self._name

    __str__ = __repr__

    def __reduce__(self) -> str:
        return self._name   # a global of the class's module (pickle's rule for a string)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _no_arithmetic
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _no_arithmetic
    __pow__ = __rpow__ = __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = _no_arithmetic
    __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = _no_arithmetic
    __neg__ = __pos__ = __abs__ = __invert__ = _no_arithmetic


class InPlaceType(AddressConstant):
    """shmproxy.IN_PLACE (and MPI.IN_PLACE): the send buffer is the receive buffer (MPI_IN_PLACE)."""

    __module__ = "shmproxy"


IN_PLACE = InPlaceType._make("IN_PLACE", -1)
UNDEFINED = -32766  # Split color for "not in any new communicator" (MPI_UNDEFINED)


class Op:
    """A posted operation as the progress process sees it (a copy of the record)."""

    __slots__ = ("index", "kind", "dtype", "redop", "flags", "owner", "peer", "tag", "opcount",
                 "req_seq", "req_slot", "buf_id", "offset", "nbytes", "count", "buf2_id",
                 "offset2", "nbytes2", "coll_seq", "t_post", "coll", "rank", "t_fetch", "mem", "tmap", "pair_seq")

    def __init__(self, index: int, fields: tuple, rank: int, t_fetch: int):
        (_next, self.kind, self.dtype, self.redop, self.flags, self.owner, self.peer, self.tag,
         self.opcount, self.req_seq, self.req_slot, self.buf_id, self.offset, self.nbytes, self.count,
         self.buf2_id, self.mem, self.offset2, self.nbytes2, self.coll_seq, self.t_post, self.coll,
         self.pair_seq) = fields   # pair_seq: a send to a local rank, its number + 1 in the pair (shm/_fast.h)
        self.index = index
        self.tmap = None   # FLAG_TYPED: the engine's TypeMap (shmproxy.shm.typed), set at fetch
        self.rank = rank
        self.t_fetch = t_fetch

    def describe(self) -> str:
        if self.kind == KIND_COLL:
            return (f"{COLL_NAMES.get(self.coll, self.coll)} #{self.coll_seq} rank {self.rank} "
                    f"{self.nbytes} B opCount {self.opcount}")
        return (f"{KIND_NAMES.get(self.kind, self.kind)} rank {self.rank} peer {self.peer} tag {self.tag} "
                f"{self.nbytes} B opCount {self.opcount}")


def pack(buf, layout: P.Layout, index: int, kind: int, dtype: int, owner: int, peer: int, tag: int,
         opcount: int, req_seq: int, req_slot: int, buf_id: int, offset: int, nbytes: int, count: int,
         t_post: int, mem: int = 0) -> None:
    P.RECORD.pack_into(buf, layout.record_off(index), -1, kind, dtype, 0, 0, owner, peer, tag, opcount,
                       req_seq, req_slot, buf_id, offset, nbytes, count, -1, mem, 0, 0, 0, t_post, 0, 0)
