"""Gather, Scatter, Gatherv, Scatterv, Allgatherv, Alltoallv, Reduce_scatter (with counts), Scan and
Exscan on device memory: what transports/cuda_coll.py queues for them on the cuda transport's stream.

The counts come from the same place as on the host: each rank's counts table (a small registered
host staging buffer, shmproxy.core.counts), checked pairwise by the engine (shmproxy.coll.vector) before
the collective reaches the transport, so a mismatch fails the communicator naming both ranks exactly
as on the host. ``plan`` then resolves and
bounds-checks every address (the blocks against each op's own buffer, the buffer against its
allocation) before anything is queued, and returns the work as a function of the executor.

- Block movers: one cudaMemcpyAsync per non-empty (source, destination) block, from the host
  builder's own plan (vector._plan_moves), so both paths move the same blocks.
- Reduce_scatter: each destination block is the left fold of every rank's block in rank order (AVG:
  the sum divided by the number of ranks after), the host's element-wise order. Where a rank is IN_PLACE
  its output overlaps vector elements other blocks still read (uneven counts shift them), so every
  block is reduced into device scratch first and copied out after.
- Scan, Exscan: prefix r = prefix r-1 op input r, in rank order, as on the host. Scan writes each
  prefix straight to its output (an in-place output aliases only its own input, element for element).
  Exscan's next prefix reads input r, which an in-place output r overwrites: with any rank in place
  the running prefix lives in two scratch buffers, the next one computed before output r is written.
  Rank 0's Exscan output is left untouched.
Scratch is device memory of the progress process, held by the collective until its event is done.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from shmproxy.coll import vector
from shmproxy.coll.sched import Region
from shmproxy.core import counts, errors
from shmproxy.core.memory import mem_device
from shmproxy.core.ops import FLAG_IN_PLACE, Coll, Op

if TYPE_CHECKING:
    from shmproxy.transports.base import TransportContext

COLLS = frozenset((Coll.GATHER, Coll.SCATTER, Coll.GATHERV, Coll.SCATTERV, Coll.ALLGATHERV, Coll.ALLTOALLV,
                   Coll.REDUCE_SCATTER, Coll.SCAN, Coll.EXSCAN))

Body = Callable[[Any, list], None]   # (GpuExecutor, keep list for scratch) -> queues the work


def plan(ctx: "TransportContext", ops: list[Op], gpu: Any, dt: np.dtype) -> tuple[int, Body] | None:
    """(bytes moved, body) of one of these collectives; None when there is nothing to queue (the ops
    are completed here then). Raises ProxyError for a wrong buffer, nothing queued."""
    op0 = ops[0]
    c, size, isz = op0.coll, len(ops), dt.itemsize
    vs = vector.views(ctx.buffers, ops, size)
    # mapped in the context of the device the collective runs on (transports/cuda_coll.py, _queue)
    on, kernel = mem_device(op0.mem), c in (Coll.REDUCE_SCATTER, Coll.SCAN, Coll.EXSCAN)
    reg = vector.regions(lambda op, second, nbytes: Region(
        gpu.address(ctx, op, second, nbytes, on, kernel) if nbytes else 0, nbytes // isz, dt))

    def at(op: Op, second: bool, off: int, n: int, what: str) -> int:
        region = reg(op, second)
        if off + n > region.count:
            raise errors.InvalidArgument(f"{op.describe()}: {what} of {n} elements at {off} is outside its "
                                         f"buffer of {region.count}")
        return region.addr + off * isz

    if c in counts.MOVES:
        local, _out, _in, moved = vector._plan_moves(c, ops, vs, op0.peer, size, [0] * size, reg, isz)
        if not local:
            return None

        def moves(x: Any, keep: list) -> None:
            for dst, src, nbytes in local:
                x.copy(dst, src, nbytes)
        return moved, moves

    redop = op0.redop
    in_place = [bool(op.flags & FLAG_IN_PLACE) for op in ops]
    if c == Coll.REDUCE_SCATTER:
        t = vs[0].table
        assert t is not None
        rc, rd = [int(v) for v in t[counts.RCOUNTS]], [int(v) for v in t[counts.RDISPLS]]
        total = sum(rc)
        if not total:
            return None
        ins = [at(op, ip, 0, total, "the vector") for op, ip in zip(ops, in_place)]
        outs = [at(op, True, 0, rc[r], "the result") if rc[r] else 0 for r, op in enumerate(ops)]

        def reduce_scatter(x: Any, keep: list) -> None:
            if any(in_place):
                base = _scratch(x, total, dt, keep)
                for d in range(size):
                    if rc[d]:
                        x.reduce(redop, dt, rc[d], [a + rd[d] * isz for a in ins], base + rd[d] * isz, size)
                for d in range(size):
                    x.copy(outs[d], base + rd[d] * isz, rc[d] * isz)
            else:
                for d in range(size):
                    if rc[d]:
                        x.reduce(redop, dt, rc[d], [a + rd[d] * isz for a in ins], outs[d], size)
        return total * isz, reduce_scatter

    if c in (Coll.SCAN, Coll.EXSCAN):
        n = op0.count
        nb = n * isz
        if not n or (c == Coll.EXSCAN and size < 2):
            return None
        outs = [at(op, True, 0, n, "recvbuf") for op in ops]
        ins = [o if ip else at(op, False, 0, n, "sendbuf") for op, o, ip in zip(ops, outs, in_place)]

        def scan(x: Any, keep: list) -> None:
            x.copy(outs[0], ins[0], nb)
            for r in range(1, size):
                x.reduce(redop, dt, n, [outs[r - 1], ins[r]], outs[r], size)

        def exscan(x: Any, keep: list) -> None:
            if not any(in_place):
                x.copy(outs[1], ins[0], nb)
                for r in range(2, size):
                    x.reduce(redop, dt, n, [outs[r - 1], ins[r - 1]], outs[r], size)
                return
            cur, nxt = _scratch(x, n, dt, keep), _scratch(x, n, dt, keep)
            x.copy(cur, ins[0], nb)
            for r in range(1, size):
                if r + 1 < size:   # prefix r + 1 reads input r before output r overwrites it
                    x.reduce(redop, dt, n, [cur, ins[r]], nxt, size)
                x.copy(outs[r], cur, nb)
                cur, nxt = nxt, cur
        return nb, scan if c == Coll.SCAN else exscan
    raise errors.InvalidArgument(f"{op0.describe()}: collective {c} has no device path")


def _scratch(x: Any, count: int, dt: np.dtype, keep: list) -> int:
    """Device memory of ``count`` elements on the executor's device and stream, kept by the collective."""
    with x.stream:
        arr = x.cp.empty((count,), dt)
    keep.append(arr)
    return int(arr.data.ptr)
