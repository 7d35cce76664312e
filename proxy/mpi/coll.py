"""The buffer collectives of MPI.Comm under mpi4py's names and signatures (a mixin of comm.Comm).

Each one the engine runs natively (Barrier, Bcast, Reduce, Allreduce, Allgather, Alltoall,
Reduce_scatter_block, Reduce_scatter with counts, Gather, Scatter, Gatherv, Scatterv, Allgatherv,
Alltoallv, Scan, Exscan and their nonblocking forms) parses its buffer specs (a count in a spec is per
rank, as MPI's recvcount; a vector spec [buf, (counts, displs), datatype] gives each rank's block) and
calls the native collective. Arguments only the root reads are parsed on the root only. The
collectives the engine lacks (Alltoallw, neighbour collectives) raise NotImplementedError naming
themselves: they are not emulated with point-to-point here, they belong in the engine.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shmproxy.core import errors
from shmproxy.core.ops import IN_PLACE
from shmproxy.mpi import buffers
from shmproxy.mpi.datatypes import Datatype
from shmproxy.mpi.exceptions import ERR_COUNT, convert, error, unsupported
from shmproxy.mpi.ops import SUM, as_op
from shmproxy.mpi import typedcoll
from shmproxy.mpi.request import Request
from shmproxy.rank.typed import TypedBuffer

_parse = buffers.parse
_MISSING = "the engine has no such collective yet (it runs Barrier, Bcast, Reduce, Allreduce, Allgather, " \
           "Alltoall, Reduce_scatter(_block), Gather(v), Scatter(v), Allgatherv, Alltoallv, Scan and Exscan)"


class Collectives:
    """Buffer collectives; ``self._c`` is the native communicator."""

    __slots__ = ()
    _c: Any

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except errors.ProxyError as exc:
            if any(type(a) is TypedBuffer for a in args):   # derived datatypes: nothing was posted
                return typedcoll.call(self._c, fn, args)
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

    def _rs_args(self, name: str, sendbuf: Any, recvbuf: Any, recvcounts: Any, op: Any) -> tuple:
        o = as_op(op, name).for_buffers(name)
        size = self._c.size
        sb = _parse(sendbuf, f"{name} sendbuf", False)
        rb = _parse(recvbuf, f"{name} recvbuf", True)
        if recvcounts is None:
            return sb, rb, None, o
        counts = list(recvcounts) if not isinstance(recvcounts, (int, np.integer)) else None
        if counts is None or len(counts) != size:
            raise error(ERR_COUNT, f"{name}: recvcounts must be a sequence of {size} counts, got "
                        f"{recvcounts!r}")
        return sb, rb, [int(c) for c in counts], o

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = SUM) -> None:
        """recvcounts, when given, are every rank's block of the vector (packed in rank order)."""
        self._call(self._c.Reduce_scatter, *self._rs_args("Reduce_scatter", sendbuf, recvbuf, recvcounts, op))

    def Ireduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = SUM) -> Request:
        args = self._rs_args("Ireduce_scatter", sendbuf, recvbuf, recvcounts, op)
        return Request(self._call(self._c.Ireduce_scatter, *args))

    def _scan_args(self, name: str, sendbuf: Any, recvbuf: Any, op: Any) -> tuple:
        o = as_op(op, name).for_buffers(name)
        return _parse(sendbuf, f"{name} sendbuf", False), _parse(recvbuf, f"{name} recvbuf", True), o

    def Scan(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        self._call(self._c.Scan, *self._scan_args("Scan", sendbuf, recvbuf, op))

    def Iscan(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> Request:
        return Request(self._call(self._c.Iscan, *self._scan_args("Iscan", sendbuf, recvbuf, op)))

    def Exscan(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        self._call(self._c.Exscan, *self._scan_args("Exscan", sendbuf, recvbuf, op))

    def Iexscan(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> Request:
        return Request(self._call(self._c.Iexscan, *self._scan_args("Iexscan", sendbuf, recvbuf, op)))

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

    # ---- rooted and vector collectives
    def _rooted(self, root: int) -> bool:
        return self._c.rank == root

    def _gather_args(self, name: str, sendbuf: Any, recvbuf: Any, root: int) -> tuple:
        sb = _parse(sendbuf, f"{name} sendbuf", False)
        rb = _parse(recvbuf, f"{name} recvbuf", True, blocks=self._c.size) if self._rooted(root) else None
        return sb, rb, root

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        self._call(self._c.Gather, *self._gather_args("Gather", sendbuf, recvbuf, root))

    def Igather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        return Request(self._call(self._c.Igather, *self._gather_args("Igather", sendbuf, recvbuf, root)))

    def _scatter_args(self, name: str, sendbuf: Any, recvbuf: Any, root: int) -> tuple:
        sb = _parse(sendbuf, f"{name} sendbuf", False, blocks=self._c.size) if self._rooted(root) else None
        return sb, _parse(recvbuf, f"{name} recvbuf", True), root

    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        self._call(self._c.Scatter, *self._scatter_args("Scatter", sendbuf, recvbuf, root))

    def Iscatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        return Request(self._call(self._c.Iscatter, *self._scatter_args("Iscatter", sendbuf, recvbuf, root)))

    def _vector(self, spec: Any, what: str, writable: bool) -> tuple:
        """(array, counts, displs) of a vector spec; a plain buffer is ``size`` equal blocks."""
        size = self._c.size
        if isinstance(spec, (list, tuple)) and len(spec) >= 2 and \
                not isinstance(spec[1], (Datatype, str, int, np.integer)):
            v = buffers.parse_v(spec, what, writable, size)
            return v.array, list(v.counts), list(v.displs)
        arr = _parse(spec, what, writable)
        if arr.size % size:
            raise error(ERR_COUNT, f"{what}: {arr.size} elements are not {size} equal blocks: pass "
                        f"[buf, (counts, displs), datatype]")
        k = arr.size // size
        return arr, [k] * size, [k * r for r in range(size)]

    def _gatherv_args(self, name: str, sendbuf: Any, recvbuf: Any, root: int) -> tuple:
        sb = _parse(sendbuf, f"{name} sendbuf", False)
        if self._rooted(root):
            rb, counts, displs = self._vector(recvbuf, f"{name} recvbuf", True)
            return sb, rb, counts, displs, root
        return sb, None, None, None, root

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        self._call(self._c.Gatherv, *self._gatherv_args("Gatherv", sendbuf, recvbuf, root))

    def Igatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        return Request(self._call(self._c.Igatherv, *self._gatherv_args("Igatherv", sendbuf, recvbuf, root)))

    def _scatterv_args(self, name: str, sendbuf: Any, recvbuf: Any, root: int) -> tuple:
        rb = _parse(recvbuf, f"{name} recvbuf", True)
        if self._rooted(root):
            sb, counts, displs = self._vector(sendbuf, f"{name} sendbuf", False)
            return sb, rb, counts, displs, root
        return None, rb, None, None, root

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        self._call(self._c.Scatterv, *self._scatterv_args("Scatterv", sendbuf, recvbuf, root))

    def Iscatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        args = self._scatterv_args("Iscatterv", sendbuf, recvbuf, root)
        return Request(self._call(self._c.Iscatterv, *args))

    def _allgatherv_args(self, name: str, sendbuf: Any, recvbuf: Any) -> tuple:
        sb = _parse(sendbuf, f"{name} sendbuf", False)
        rb, counts, displs = self._vector(recvbuf, f"{name} recvbuf", True)
        return sb, rb, counts, displs

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        self._call(self._c.Allgatherv, *self._allgatherv_args("Allgatherv", sendbuf, recvbuf))

    def Iallgatherv(self, sendbuf: Any, recvbuf: Any) -> Request:
        args = self._allgatherv_args("Iallgatherv", sendbuf, recvbuf)
        return Request(self._call(self._c.Iallgatherv, *args))

    def _alltoallv_args(self, name: str, sendbuf: Any, recvbuf: Any) -> tuple:
        if sendbuf is IN_PLACE:
            unsupported(f"{name} with IN_PLACE", "the engine's Alltoallv needs separate buffers")
        sb, sc, sd = self._vector(sendbuf, f"{name} sendbuf", False)
        rb, rc, rd = self._vector(recvbuf, f"{name} recvbuf", True)
        return sb, sc, sd, rb, rc, rd

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        self._call(self._c.Alltoallv, *self._alltoallv_args("Alltoallv", sendbuf, recvbuf))

    def Ialltoallv(self, sendbuf: Any, recvbuf: Any) -> Request:
        return Request(self._call(self._c.Ialltoallv, *self._alltoallv_args("Ialltoallv", sendbuf, recvbuf)))

    # ---- what the engine lacks
    def _missing(self, name: str) -> Any:
        unsupported(f"Comm.{name}", _MISSING)

    def Alltoallw(self, *a: Any, **k: Any) -> None:
        self._missing("Alltoallw")

    def Ialltoallw(self, *a: Any, **k: Any) -> Request:
        return self._missing("Ialltoallw")

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
