"""The calls that are timed: for each operation one builder per library, which returns one iteration
(``Builder``), or a (post, wait) pair for ``overlap``; and each library's own barrier (``BARRIERS``).

In place (``--in-place``, allreduce / allgather / reduce_scatter) follows MPI: allreduce reduces the
receive buffer; allgather finds each rank's block already at its place in the receive buffer;
reduce_scatter takes its input (n blocks) from the receive buffer and leaves the result in the first
block (MPI_IN_PLACE; nccl puts it at block ``rank``).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from shmproxy.tools.bench.libraries import GlooLib, Library, MpiLib, ShmproxyLib
from shmproxy.tools.bench.operation import Builder, Ctx
from shmproxy.tools.bench.patterns import SENTINEL
from shmproxy.tools.bench.traffic import TAG_OP


def _pingpong(ctx: Ctx, lib: Library, send: Any, recv: Any) -> Callable[[], None] | None:
    s, r = lib.send, lib.recv
    if ctx.rank == 0:
        def it() -> None:
            s(send, 1, TAG_OP)
            r(recv, 1, TAG_OP)
    elif ctx.rank == 1:
        def it() -> None:
            r(recv, 0, TAG_OP)
            s(send, 0, TAG_OP)
    else:
        return None
    return it


def _sendrecv(ctx: Ctx, lib: Library, send: Any, recv: Any) -> Callable[[], None]:
    right, left = (ctx.rank + 1) % ctx.size, (ctx.rank - 1) % ctx.size
    isend, irecv, waitall = lib.isend, lib.irecv, lib.waitall

    def it() -> None:
        waitall([isend(send, right, TAG_OP), irecv(recv, left, TAG_OP)])
    return it


# ---- collectives: one builder per library. ``send``/``recv`` are the library's views (torch tensors
# for gloo); the reduction and in place come from ctx.args; the root of reduce/bcast is 0.

def _in_place(ctx: Ctx) -> bool:
    return bool(getattr(ctx.args, "in_place", False))


def _allreduce_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> Callable[[], Any]:
    import shmproxy
    f, op, s = lib.comm.Allreduce, lib.redop(ctx.args.redop), shmproxy.IN_PLACE if _in_place(ctx) else send
    return lambda: f(s, recv, op)


def _allreduce_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, op, s = lib.world.Allreduce, lib.redop(ctx.args.redop), lib.MPI.IN_PLACE if _in_place(ctx) else send
    return lambda: f(s, recv, op)


def _allreduce_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, op = lib.dist.all_reduce, lib.redop(ctx.args.redop)     # in place on recv (native_in_place)
    return lambda: f(recv, op=op)


def _reduce_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, op = lib.comm.Reduce, lib.redop(ctx.args.redop)
    return lambda: f(send, recv, op, 0)


def _reduce_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, op = lib.world.Reduce, lib.redop(ctx.args.redop)
    return lambda: f(send, recv, op, root=0)


def _reduce_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, op = lib.dist.reduce, lib.redop(ctx.args.redop)         # in place on recv (native_in_place)
    return lambda: f(recv, 0, op=op)


def _bcast_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, buf = lib.comm.Bcast, send if ctx.rank == 0 else recv
    return lambda: f(buf, 0)


def _bcast_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, buf = lib.world.Bcast, send if ctx.rank == 0 else recv
    return lambda: f(buf, root=0)


def _bcast_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, buf = lib.dist.broadcast, send if ctx.rank == 0 else recv
    return lambda: f(buf, 0)


def _my_block(ctx: Ctx, recv: Any) -> Any:
    b = recv.shape[0] // ctx.size
    return recv[ctx.rank * b:(ctx.rank + 1) * b]


def _allgather_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> Callable[[], Any]:
    import shmproxy
    f, s = lib.comm.Allgather, shmproxy.IN_PLACE if _in_place(ctx) else send
    return lambda: f(s, recv)


def _allgather_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, s = lib.world.Allgather, lib.MPI.IN_PLACE if _in_place(ctx) else send
    return lambda: f(s, recv)


def _allgather_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> Callable[[], Any]:
    f = lib.fn("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
    s = _my_block(ctx, recv) if _in_place(ctx) else send       # in place: our block of the output
    return lambda: f(recv, s)


def _reduce_scatter_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> Callable[[], Any]:
    import shmproxy
    f, op = lib.comm.Reduce_scatter_block, lib.redop(ctx.args.redop)
    s = shmproxy.IN_PLACE if _in_place(ctx) else send
    return lambda: f(s, recv, op)


def _reduce_scatter_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, op = lib.world.Reduce_scatter_block, lib.redop(ctx.args.redop)
    s = lib.MPI.IN_PLACE if _in_place(ctx) else send
    return lambda: f(s, recv, op)


def _reduce_scatter_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> Callable[[], Any]:
    f = lib.fn("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")
    op = lib.redop(ctx.args.redop)
    return lambda: f(recv, send, op=op)


def _alltoall_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> Callable[[], Any]:
    f = lib.comm.Alltoall
    return lambda: f(send, recv)


def _alltoall_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> Callable[[], Any]:
    f = lib.world.Alltoall
    return lambda: f(send, recv)


def _alltoall_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> Callable[[], Any]:
    f = lib.dist.all_to_all_single
    return lambda: f(recv, send)


def _barrier_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> Callable[[], Any]:
    return lib.comm.Barrier


def _barrier_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> Callable[[], Any]:
    return lib.world.Barrier


def _barrier_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> Callable[[], Any]:
    return lib.dist.barrier


BARRIERS: dict[str, Builder] = {"shmproxy": _barrier_shm, "mpi4py": _barrier_mpi, "gloo": _barrier_gloo,
                                "nccl": _barrier_gloo, "shmproxy.MPI": _barrier_mpi}
"""Each library's own barrier: the calls of the ``barrier`` operation, and the untimed barrier after
every iteration of ``overlap`` (OSU's MPI_Barrier)."""


# overlap: (post, wait) pairs of the nonblocking allreduce


PostWait = tuple[Callable[[], Any], Callable[[Any], Any]]


def _iallreduce_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> PostWait:
    f, op = lib.comm.Iallreduce, lib.redop(ctx.args.redop)
    return (lambda: f(send, recv, op)), (lambda req: req.Wait())


def _iallreduce_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> PostWait:
    f, op = lib.world.Iallreduce, lib.redop(ctx.args.redop)
    return (lambda: f(send, recv, op)), (lambda req: req.Wait())


def _iallreduce_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> PostWait:
    f, op = lib.dist.all_reduce, lib.redop(ctx.args.redop)     # in place on recv (native_in_place)
    return (lambda: f(recv, op=op, async_op=True)), (lambda work: work.wait())


def _place_block(rank: int, size: int, send: np.ndarray, recv: np.ndarray) -> None:
    """In-place allgather: our block of the receive buffer holds our input, the rest the sentinel."""
    recv.fill(SENTINEL)
    b = send.shape[0]
    recv[rank * b:(rank + 1) * b] = send
