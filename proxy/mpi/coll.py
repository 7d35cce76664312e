"""The buffer collectives of MPI.Comm under mpi4py's names and signatures (a mixin of comm.Comm).

Each one the engine runs natively (Barrier, Bcast, Reduce, Allreduce, Allgather, Alltoall,
Reduce_scatter_block and their nonblocking forms) parses its buffer specs (a count in a spec is per
rank, as MPI's recvcount) and calls the native collective. Reduce_scatter with equal counts is
Reduce_scatter_block. The collectives the engine lacks (Gather, Scatter, the v- and w-variants,
Scan, Exscan, neighbour collectives) raise NotImplementedError naming themselves: they are not
emulated with point-to-point here, they belong in the engine.
"""
from __future__ import annotations

from typing import Any

from shmproxy.core import errors
from shmproxy.core.ops import IN_PLACE
from shmproxy.mpi import buffers
from shmproxy.mpi.exceptions import ERR_COUNT, convert, error, unsupported
from shmproxy.mpi.ops import SUM, as_op
from shmproxy.mpi.request import Request

_parse = buffers.parse
_MISSING = "the engine has no such collective yet (it runs Barrier, Bcast, Reduce, Allreduce, Allgather, " \
           "Alltoall and Reduce_scatter_block)"


class Collectives:
    """Buffer collectives; ``self._c`` is the native communicator."""

    __slots__ = ()
    _c: Any

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except errors.ProxyError as exc:
            raise convert(exc) from None

    # ---- barrier, broadcast
    def Barrier(self) -> None:
        self._call(self._c.Barrier)

    def Ibarrier(self) -> Request:
        return Request(self._call(self._c.Ibarrier))

    def Bcast(self, buf: Any, root: int = 0) -> None:
        self._call(self._c.Bcast, _parse(buf, "Bcast buffer", True), root)

    def Ibcast(self, buf: Any, root: int = 0) -> Request:
        return Request(self._call(self._c.Ibcast, _parse(buf, "Ibcast buffer", True), root))

    # ---- reductions
    def _reduce_args(self, name: str, sendbuf: Any, recvbuf: Any, op: Any) -> tuple:
        o = as_op(op, name).for_buffers(name)
        sb = _parse(sendbuf, f"{name} sendbuf", False)
        rb = None if recvbuf is None else _parse(recvbuf, f"{name} recvbuf", True)
        return sb, rb, o

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM, root: int = 0) -> None:
        sb, rb, o = self._reduce_args("Reduce", sendbuf, recvbuf, op)
        self._call(self._c.Reduce, sb, rb, o, root)

    def Ireduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM, root: int = 0) -> Request:
        sb, rb, o = self._reduce_args("Ireduce", sendbuf, recvbuf, op)
        return Request(self._call(self._c.Ireduce, sb, rb, o, root))

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        sb, rb, o = self._reduce_args("Allreduce", sendbuf, recvbuf, op)
        self._call(self._c.Allreduce, sb, rb, o)

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> Request:
        sb, rb, o = self._reduce_args("Iallreduce", sendbuf, recvbuf, op)
        return Request(self._call(self._c.Iallreduce, sb, rb, o))

    def _rsb_args(self, name: str, sendbuf: Any, recvbuf: Any, op: Any) -> tuple:
        o = as_op(op, name).for_buffers(name)
        size = self._c.size
        sb = _parse(sendbuf, f"{name} sendbuf", False, blocks=size)
        rb = _parse(recvbuf, f"{name} recvbuf", True, blocks=size if sb is IN_PLACE else 1)
        return sb, rb, o

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        sb, rb, o = self._rsb_args("Reduce_scatter_block", sendbuf, recvbuf, op)
        self._call(self._c.Reduce_scatter_block, sb, rb, o)

    def Ireduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> Request:
        sb, rb, o = self._rsb_args("Ireduce_scatter_block", sendbuf, recvbuf, op)
        return Request(self._call(self._c.Ireduce_scatter_block, sb, rb, o))

    def _equal_counts(self, name: str, recvbuf: Any, recvcounts: Any) -> Any:
        """Reduce_scatter's recvbuf as a per-rank block, provided every rank gets the same count."""
        size = self._c.size
        if recvcounts is None:
            return recvbuf
        counts = [int(c) for c in recvcounts]
        if len(counts) != size:
            raise error(ERR_COUNT, f"{name}: {len(counts)} recvcounts for {size} ranks")
        if len(set(counts)) > 1:
            unsupported(f"{name} with unequal recvcounts", _MISSING)
        rb = _parse(recvbuf, f"{name} recvbuf", True)
        return rb if rb is IN_PLACE or rb is None else rb[:counts[0] if counts else 0]

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = SUM) -> None:
        """Equal recvcounts (or none: the recvbuf's size) only: that is Reduce_scatter_block."""
        self.Reduce_scatter_block(sendbuf, self._equal_counts("Reduce_scatter", recvbuf, recvcounts), op)

    def Ireduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = SUM) -> Request:
        rb = self._equal_counts("Ireduce_scatter", recvbuf, recvcounts)
        return self.Ireduce_scatter_block(sendbuf, rb, op)

    # ---- data movement
    def _ag_args(self, name: str, sendbuf: Any, recvbuf: Any) -> tuple:
        return (_parse(sendbuf, f"{name} sendbuf", False),
                _parse(recvbuf, f"{name} recvbuf", True, blocks=self._c.size))

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        self._call(self._c.Allgather, *self._ag_args("Allgather", sendbuf, recvbuf))

    def Iallgather(self, sendbuf: Any, recvbuf: Any) -> Request:
        return Request(self._call(self._c.Iallgather, *self._ag_args("Iallgather", sendbuf, recvbuf)))

    def _a2a_args(self, name: str, sendbuf: Any, recvbuf: Any) -> tuple:
        size = self._c.size
        if sendbuf is IN_PLACE:
            unsupported(f"{name} with IN_PLACE", "the engine's Alltoall needs separate buffers")
        return (_parse(sendbuf, f"{name} sendbuf", False, blocks=size),
                _parse(recvbuf, f"{name} recvbuf", True, blocks=size))

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        self._call(self._c.Alltoall, *self._a2a_args("Alltoall", sendbuf, recvbuf))

    def Ialltoall(self, sendbuf: Any, recvbuf: Any) -> Request:
        return Request(self._call(self._c.Ialltoall, *self._a2a_args("Ialltoall", sendbuf, recvbuf)))

    # ---- what the engine lacks
    def _missing(self, name: str) -> Any:
        unsupported(f"Comm.{name}", _MISSING)

    def Gather(self, *a: Any, **k: Any) -> None:
        self._missing("Gather")

    def Igather(self, *a: Any, **k: Any) -> Request:
        return self._missing("Igather")

    def Gatherv(self, *a: Any, **k: Any) -> None:
        self._missing("Gatherv")

    def Igatherv(self, *a: Any, **k: Any) -> Request:
        return self._missing("Igatherv")

    def Scatter(self, *a: Any, **k: Any) -> None:
        self._missing("Scatter")

    def Iscatter(self, *a: Any, **k: Any) -> Request:
        return self._missing("Iscatter")

    def Scatterv(self, *a: Any, **k: Any) -> None:
        self._missing("Scatterv")

    def Iscatterv(self, *a: Any, **k: Any) -> Request:
        return self._missing("Iscatterv")

    def Allgatherv(self, *a: Any, **k: Any) -> None:
        self._missing("Allgatherv")

    def Iallgatherv(self, *a: Any, **k: Any) -> Request:
        return self._missing("Iallgatherv")

    def Alltoallv(self, *a: Any, **k: Any) -> None:
        self._missing("Alltoallv")

    def Ialltoallv(self, *a: Any, **k: Any) -> Request:
        return self._missing("Ialltoallv")

    def Alltoallw(self, *a: Any, **k: Any) -> None:
        self._missing("Alltoallw")

    def Ialltoallw(self, *a: Any, **k: Any) -> Request:
        return self._missing("Ialltoallw")

    def Scan(self, *a: Any, **k: Any) -> None:
        self._missing("Scan")

    def Iscan(self, *a: Any, **k: Any) -> Request:
        return self._missing("Iscan")

    def Exscan(self, *a: Any, **k: Any) -> None:
        self._missing("Exscan")

    def Iexscan(self, *a: Any, **k: Any) -> Request:
        return self._missing("Iexscan")

    def Neighbor_allgather(self, *a: Any, **k: Any) -> None:
        self._missing("Neighbor_allgather")

    def Neighbor_alltoall(self, *a: Any, **k: Any) -> None:
        self._missing("Neighbor_alltoall")

    def Neighbor_allgatherv(self, *a: Any, **k: Any) -> None:
        self._missing("Neighbor_allgatherv")

    def Neighbor_alltoallv(self, *a: Any, **k: Any) -> None:
        self._missing("Neighbor_alltoallv")

    def neighbor_allgather(self, *a: Any, **k: Any) -> None:
        self._missing("neighbor_allgather")

    def neighbor_alltoall(self, *a: Any, **k: Any) -> None:
        self._missing("neighbor_alltoall")
