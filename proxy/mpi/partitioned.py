"""Partitioned point-to-point communication (MPI 4.0): Psend_init, Precv_init, Pready, Parrived.

A partitioned message is one buffer in ``partitions`` equal parts; the sender marks parts ready
(Pready) in any order, the receiver may see parts arrive (Parrived) before the whole message is in.
Here each part travels as a message of its own on the native layer, and the receiver posts one
receive per part when it starts. Matching relies on the native layer's non-overtaking order between
one pair of ranks and one tag, so parts are *sent in partition order*: Pready(i) sends every part
from the first not yet sent up to the first one not yet ready. Part i therefore always meets receive
i, whatever order the sender marks them in; a part marked ready early waits for the ones before it.

The parts use a tag of the runtime's reserved range (core.ops: ANY_TAG never takes it, so no
receive of the user's can match a part), derived from the user's tag: partitioned tags are limited
to [0, PART_TAG_SPAN). Two partitioned operations active at once between the same pair of ranks
with the same tag would interleave their parts, as MPI leaves their order to the implementation
only across different tags; their rounds (Start .. Wait) must not overlap.
"""
from __future__ import annotations

from typing import Any

from shmproxy.core import errors
from shmproxy.core.ops import RESERVED_TAG_LO
from shmproxy.mpi import buffers
from shmproxy.mpi.exceptions import (ERR_ARG, ERR_COUNT, ERR_RANK, ERR_REQUEST, ERR_TAG, as_int, convert, error,
                                     unsupported)
from shmproxy.mpi.request import Prequest
from shmproxy.mpi.status import ANY_SOURCE, PROC_NULL
from shmproxy.rank.typed import TypedBuffer

PART_TAG_SPAN = 2**31
_PART_TAG_BASE = RESERVED_TAG_LO + 1     # RESERVED_TAG_LO itself: typedcoll.py's self-messages


class _PartStatus:
    """What the receive's status says: the user's source and tag, the whole message's bytes."""

    __slots__ = ("source", "tag", "nbytes", "cancelled")

    def __init__(self, source: int, tag: int, nbytes: int):
        self.source, self.tag, self.nbytes, self.cancelled = source, tag, nbytes, False


class _Round:
    """One round (Start .. Wait) of a partitioned operation, as a native-like request: complete when
    every part's native request is. A send's parts are posted as they become ready (``posted`` grows
    to ``nparts``); a receive's all at Start."""

    __slots__ = ("_comm", "reqs", "nparts", "status", "what")
    reqs: list[Any]     # the parts' native requests, posted so far

    def __init__(self, comm: Any, nparts: int, status: Any, what: str):
        self._comm, self.reqs, self.nparts, self.status, self.what = comm, [], nparts, status, what

    def Test(self) -> bool:
        return len(self.reqs) == self.nparts and all(r.Test() for r in self.reqs)

    def Wait(self) -> Any:
        if len(self.reqs) < self.nparts:
            # the missing parts can only be sent by this process, which would be waiting here forever
            raise errors.InvalidUsage(f"{self.what}: Wait before every partition was marked ready "
                                      f"({len(self.reqs)} of {self.nparts} sent): call Pready for the others")
        for r in self.reqs:
            r.Wait()
        return self.status

    def Cancel(self) -> None:
        raise errors.InvalidUsage(f"{self.what}: a partitioned operation cannot be cancelled")

    def describe(self) -> str:
        return f"{self.what} ({len(self.reqs)} of {self.nparts} parts posted)"


def _parts(spec: Any, nparts: int, what: str, writable: bool) -> list[Any]:
    arr = buffers.parse(spec, what, writable)
    if type(arr) is TypedBuffer:
        unsupported(f"{what} of a derived datatype", "partitioned messages of predefined datatypes only")
    if arr is None or arr is buffers.BOTTOM or arr is buffers.IN_PLACE:
        raise error(ERR_ARG, f"{what}: a partitioned message needs a buffer")
    flat = arr.reshape(-1)
    if flat.size % nparts:
        raise error(ERR_COUNT, f"{what}: {flat.size} elements do not split into {nparts} equal partitions")
    k = flat.size // nparts
    return [buffers.wire(flat[i * k:(i + 1) * k]) for i in range(nparts)]


class _Partitioned(Prequest):
    """State shared by both sides: the native communicator, the parts, the peer and tags."""

    __slots__ = ("_comm", "_parts_", "_peer", "_utag", "_wire_tag", "_nbytes", "_what")

    def __init__(self, comm: Any, parts: list[Any], peer: int, tag: int, what: str):
        super().__init__(self._post_round, ())
        self._comm, self._parts_, self._peer, self._utag = comm, parts, peer, tag
        self._wire_tag = _PART_TAG_BASE + tag
        self._nbytes = sum(int(p.nbytes) for p in parts)
        self._what = what

    def _post_round(self) -> _Round:
        raise NotImplementedError   # each side's own

    def _partition(self, i: Any) -> int:
        i = as_int(i, "partition")
        if not 0 <= i < len(self._parts_):
            raise error(ERR_ARG, f"{self._what}: partition {i} out of range [0, {len(self._parts_)})")
        return i

    def _round(self, op: str) -> _Round:
        r = self._r
        if type(r) is not _Round:
            raise error(ERR_REQUEST, f"{self._what}.{op}: the request is not active (Start it first)")
        return r


class Psend(_Partitioned):
    """A partitioned send (Comm.Psend_init)."""

    __slots__ = ("_ready", "_next")

    def __init__(self, comm: Any, parts: list[Any], dest: int, tag: int):
        super().__init__(comm, parts, dest, tag, "Psend")
        self._ready: list[bool] = []
        self._next = 0

    def _post_round(self) -> _Round:
        self._ready, self._next = [False] * len(self._parts_), 0
        return _Round(self._comm, len(self._parts_), None, "Psend")

    def Pready(self, partition: Any) -> None:
        self._mark([self._partition(partition)], "Pready")

    def Pready_range(self, partition_low: Any, partition_high: Any) -> None:
        lo, hi = self._partition(partition_low), self._partition(partition_high)
        self._mark(list(range(lo, hi + 1)), "Pready_range")

    def Pready_list(self, partitions: Any) -> None:
        self._mark([self._partition(p) for p in partitions], "Pready_list")

    def _mark(self, which: list[int], op: str) -> None:
        rnd = self._round(op)
        for i in which:
            if self._ready[i]:
                raise error(ERR_ARG, f"Psend.{op}: partition {i} is already marked ready in this round")
            self._ready[i] = True
        ready, parts, c = self._ready, self._parts_, self._comm
        try:
            while self._next < len(parts) and ready[self._next]:
                rnd.reqs.append(c.Isend(parts[self._next], self._peer, self._wire_tag))
                self._next += 1
        except errors.ProxyError as exc:
            raise convert(exc) from None


class Precv(_Partitioned):
    """A partitioned receive (Comm.Precv_init)."""

    __slots__ = ()

    def __init__(self, comm: Any, parts: list[Any], source: int, tag: int):
        super().__init__(comm, parts, source, tag, "Precv")

    def _post_round(self) -> _Round:
        c = self._comm
        rnd = _Round(c, len(self._parts_), _PartStatus(self._peer, self._utag, self._nbytes), "Precv")
        rnd.reqs = [c.Irecv(p, self._peer, self._wire_tag) for p in self._parts_]
        return rnd

    def Parrived(self, partition: Any) -> bool:
        i = self._partition(partition)
        try:
            return bool(self._round("Parrived").reqs[i].Test())
        except errors.ProxyError as exc:
            raise convert(exc) from None


class PartitionedP2P:
    """Comm.Psend_init and Comm.Precv_init (``_c``: the native communicator)."""

    __slots__ = ()
    _c: Any

    def _part_args(self, peer: Any, tag: Any, partitions: Any, what: str) -> tuple[int, int, int]:
        nparts = as_int(partitions, "partitions")
        if nparts < 1:
            raise error(ERR_ARG, f"{what}: partitions must be at least 1, not {nparts}")
        peer = as_int(peer, "peer", ERR_RANK)
        if peer == PROC_NULL or peer == ANY_SOURCE or not 0 <= peer < self._c.size:
            raise error(ERR_RANK, f"{what}: peer {peer} is not a rank of the communicator (partitioned "
                        f"operations take neither PROC_NULL nor ANY_SOURCE)")
        tag = as_int(tag, "tag", ERR_TAG)
        if not 0 <= tag < PART_TAG_SPAN:
            raise error(ERR_TAG, f"{what}: partitioned tags are in [0, {PART_TAG_SPAN}), not {tag}")
        return peer, tag, nparts

    def Psend_init(self, buf: Any, partitions: Any, dest: Any, tag: Any = 0, info: Any = None) -> Psend:
        dest, tag, n = self._part_args(dest, tag, partitions, "Psend_init")
        return Psend(self._c, _parts(buf, n, "Psend_init buffer", False), dest, tag)

    def Precv_init(self, buf: Any, partitions: Any, source: Any, tag: Any = 0, info: Any = None) -> Precv:
        source, tag, n = self._part_args(source, tag, partitions, "Precv_init")
        return Precv(self._c, _parts(buf, n, "Precv_init buffer", True), source, tag)


__all__ = ["PART_TAG_SPAN", "PartitionedP2P", "Precv", "Psend"]
