"""The operations of the shmproxy process group, as *builders*: each validates its tensors, posts
the communicator's requests for one torch call and returns them, filling a ``Staged`` with the
temporaries and the copies back to run at completion. Builders run with the group's lock held
(process_group.py), so coalesced calls can run several inside one ``with comm.group():``.

Mapping onto the native API (shmproxy.Comm), and where the native has no equivalent:

- allreduce, broadcast, reduce, barrier, allgather into one tensor, reduce_scatter from one tensor
  and all_to_all_single with equal splits are the native Iallreduce, Ibcast, Ireduce, Ibarrier,
  Iallgather, Ireduce_scatter_block and Ialltoall.
- The list forms (allgather into a list, reduce_scatter from a list) go through one contiguous
  temporary and the native collective, with copies in or out.
- all_to_all_single with uneven splits, alltoall of lists, gather and scatter have no native
  collective: they are Isend/Irecv pairs posted inside one ``comm.group()`` (one opCount), on tags
  reserved for them (messages of one source, destination and tag never overtake each other, and
  every rank calls the collectives of a group in the same order, so the pairs always match). A
  rank's own block is copied directly.

CUDA tensors take the same builders: ``tensors.for_move`` and friends give flat CUDA tensors instead of
numpy arrays, and every native call gets ``**st.kw`` (torch's current stream; empty for CPU calls).
The one-buffer collectives hand the native call ``tensors.native_view`` of them (a cached cupy view:
converting a tensor at every post was most of a small call's cost); the point-to-point forms keep
tensors, whose own-block copies must run on torch's stream, not cupy's. See shmproxy.torch.cuda for
the stream order and completion.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

import shmproxy
from shmproxy.core import errors
from shmproxy.core.ops import ReduceOp
from shmproxy.rank import devcoll
from shmproxy.torch import cuda, tensors as T

# Tags of the collectives made of point-to-point messages: far from any tag a torch user passes.
TAG_ALLTOALLV = -(2 ** 62) + 1
TAG_ALLTOALL_LIST = -(2 ** 62) + 2
TAG_GATHER = -(2 ** 62) + 3
TAG_SCATTER = -(2 ** 62) + 4

_RED: Any = dist.ReduceOp.RedOpType   # its members are not in torch's stubs
# Keyed by the op's number: hashing and comparing torch's enum members costs more than the small call.
_OPS = {int(_RED.SUM): shmproxy.SUM, int(_RED.PRODUCT): shmproxy.PROD, int(_RED.MIN): shmproxy.MIN,
        int(_RED.MAX): shmproxy.MAX, int(_RED.AVG): shmproxy.AVG}
_AVG, _MIN, _MAX = int(_RED.AVG), int(_RED.MIN), int(_RED.MAX)


def redop(op: Any, t: torch.Tensor) -> shmproxy.ReduceOp:
    """shmproxy's op for torch's ReduceOp; a clear error for the ones this backend has not."""
    kind = getattr(op, "op", op)
    code = int(kind)
    rop = _OPS.get(code)
    if rop is None:
        name = str(kind).split(".")[-1]
        raise errors.InvalidArgument(
            f"shmproxy backend: ReduceOp.{name} is not supported (supported: SUM, PRODUCT, MIN, MAX, AVG)")
    if code == _AVG and not (t.is_floating_point() or t.is_complex()):
        raise errors.InvalidArgument(
            f"shmproxy backend: ReduceOp.AVG needs a floating-point tensor, got {t.dtype}"
            " (use SUM and divide)")
    if t.dtype == torch.bool and code != _MIN and code != _MAX:
        raise errors.InvalidArgument(
            f"shmproxy backend: bool tensors reduce with MIN or MAX only, not {kind}")
    return rop


def one(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise errors.InvalidArgument(f"shmproxy backend: {what} takes exactly one tensor per call, got"
                                     f" {len(tensors)} (one device per process)")
    T.check_tensor(tensors[0], what)
    return tensors[0]


def _root(pg: Any, root: int, what: str) -> int:
    if not 0 <= root < pg.size():
        raise errors.InvalidArgument(f"shmproxy backend: {what}: root {root} is not a rank of this group"
                                     f" (size {pg.size()})")
    return root


def _same(ts: Sequence[torch.Tensor], ref: torch.Tensor, what: str) -> None:
    for i, t in enumerate(ts):
        T.check_tensor(t, f"{what}[{i}]")
        if t.dtype != ref.dtype or t.numel() != ref.numel():
            raise errors.InvalidArgument(
                f"shmproxy backend: {what}[{i}] is {t.dtype} x {t.numel()}, but the input is {ref.dtype} x "
                f"{ref.numel()}: every block must match it")


# ---------------------------------------------------------------------------------------------------
# Native collectives

def allreduce_on_gpus(pg: Any, t: torch.Tensor, op: Any, side: torch.cuda.Stream | None) -> bool:
    """An all_reduce of a CUDA tensor as the ranks' own kernels (shmproxy.rank.devcoll), ordered
    after the current stream's queued work, as NCCL's: on the current stream itself (a blocking call:
    the stream's later work follows it, nothing for the host to wait for), or on ``side`` (an async
    one, which the caller's later kernels overlap until Work.wait). False where the call does not
    take that path (decided by what every rank passes alike). The group's lock held."""
    dt = T.numpy_dtype(t.dtype)
    if dt is None or not t.is_contiguous():
        return False
    rop = int(redop(op, t))
    if not devcoll.eligible(pg.comm, t.numel() * t.element_size(), dt, rop):
        return False
    return _on_gpus(pg, lambda shot, s, after: shot.launch(t.data_ptr(), t.data_ptr(), t.numel(), dt, rop, s, after),
                    (t,), side)


def all_gather_on_gpus(pg: Any, out: torch.Tensor, inp: torch.Tensor, side: torch.cuda.Stream | None) -> bool:
    """all_gather_into_tensor of CUDA tensors as the ranks' own kernels, as ``allreduce_on_gpus``
    (the input may be the output's block of this rank: in place)."""
    dt = _shares_dtype(pg, inp, out)
    count = inp.numel()
    if dt is None:
        return False   # the posted path names what is wrong
    if not devcoll.eligible(pg.comm, count * out.element_size(), dt, int(ReduceOp.SUM)):
        return False
    return _on_gpus(pg, lambda shot, s, after: shot.launch_shares(
        "shmproxy_allgather", inp.data_ptr(), out.data_ptr(), count, dt, int(ReduceOp.SUM), s, after),
        (out, inp), side)


def reduce_scatter_on_gpus(pg: Any, out: torch.Tensor, inp: torch.Tensor, op: Any,
                           side: torch.cuda.Stream | None) -> bool:
    """reduce_scatter_tensor of CUDA tensors as the ranks' own kernels, as ``allreduce_on_gpus``; an
    output that overlaps the input stays with the progress process (the kernels would overwrite a
    share a peer still reads)."""
    dt = _shares_dtype(pg, out, inp)
    count = out.numel()
    if dt is None:
        return False
    o_lo, i_lo = out.data_ptr(), inp.data_ptr()
    if o_lo < i_lo + inp.numel() * inp.element_size() and i_lo < o_lo + count * out.element_size():
        return False
    rop = int(redop(op, inp))
    if not devcoll.eligible(pg.comm, count * out.element_size(), dt, rop):
        return False
    return _on_gpus(pg, lambda shot, s, after: shot.launch_shares(
        "shmproxy_reduce_scatter", i_lo, o_lo, count, dt, rop, s, after), (out, inp), side)


def _shares_dtype(pg: Any, share: torch.Tensor, shares: torch.Tensor) -> Any:
    """The numpy dtype of a (one rank's share, every rank's shares) pair of CUDA tensors the kernels
    take: one dtype, one device, contiguous, ``shares`` the group's size times ``share``; else None."""
    dt = T.numpy_dtype(shares.dtype)
    if (dt is None or share.dtype != shares.dtype or not share.is_cuda or share.device != shares.device
            or not (share.is_contiguous() and shares.is_contiguous()) or shares.numel() != share.numel() * pg.size()):
        return None
    return dt


def _on_gpus(pg: Any, launch: Any, tensors: tuple, side: torch.cuda.Stream | None) -> bool:
    """Queue ``launch(kernels, stream, after)`` on the current stream, or on ``side`` after it, with
    ``tensors`` kept by the allocator until ``side`` is past them; False where the communicator's
    ranks declined the kernels (a collective set-up at the first call)."""
    comm = pg.comm
    t = tensors[0]
    comm._check_usable()   # the group's error, before a set-up or a kernel that would wait for nobody
    shot = devcoll.shared(comm, t.device.index)
    if shot is None:
        return False
    shot.check(comm)       # a kernel of an earlier call that failed: its error now
    cur = cuda.current_stream_handle(t.device.index)
    if side is None:
        launch(shot, cur, None)
    else:
        launch(shot, side.cuda_stream, cur)
        for x in tensors:
            x.record_stream(side)   # the allocator keeps its memory until the side stream is past the kernel
    return True


def allreduce(pg: Any, t: torch.Tensor, op: Any, st: T.Staged) -> list:
    rop = redop(op, t)
    arr = T.native_view(T.for_reduce(t, st, output=True))
    return [pg.comm.Iallreduce(shmproxy.IN_PLACE, arr, rop, **st.kw)]


def broadcast(pg: Any, t: torch.Tensor, root: int, st: T.Staged) -> list:
    root = _root(pg, root, "broadcast")
    arr = T.native_view(T.for_move(t, st, output=pg.rank() != root))
    return [pg.comm.Ibcast(arr, root, **st.kw)]


def reduce(pg: Any, t: torch.Tensor, op: Any, root: int, st: T.Staged) -> list:
    rop = redop(op, t)
    root = _root(pg, root, "reduce")
    arr = T.native_view(T.for_reduce(t, st, output=pg.rank() == root))
    if pg.rank() == root:
        return [pg.comm.Ireduce(shmproxy.IN_PLACE, arr, rop, root, **st.kw)]
    return [pg.comm.Ireduce(arr, None, rop, root, **st.kw)]


def barrier(pg: Any, st: T.Staged) -> list:
    return [pg.comm.Ibarrier()]


def all_gather_single(pg: Any, out: torch.Tensor, inp: torch.Tensor, st: T.Staged) -> list:
    T.check_tensor(out, "all_gather output")
    T.check_tensor(inp, "all_gather input")
    n = pg.size()
    if out.dtype != inp.dtype or out.numel() != inp.numel() * n:
        raise errors.InvalidArgument(
            f"shmproxy backend: all_gather_into_tensor: output {out.dtype} x {out.numel()} must be the"
            f" input's dtype and {n} x its {inp.numel()} elements")
    rarr = T.native_view(T.for_move(out, st, output=True))
    blk = inp.numel() * inp.element_size()
    if out.is_contiguous() and inp.is_contiguous() and inp.data_ptr() == out.data_ptr() + pg.rank() * blk:
        return [pg.comm.Iallgather(shmproxy.IN_PLACE, rarr, **st.kw)]
    return [pg.comm.Iallgather(T.native_view(T.for_move(inp, st, output=False)), rarr, **st.kw)]


def allgather_list(pg: Any, outs: Sequence[torch.Tensor], inp: torch.Tensor, st: T.Staged) -> list:
    T.check_tensor(inp, "all_gather input")
    n = pg.size()
    if len(outs) != n:
        raise errors.InvalidArgument(
            f"shmproxy backend: all_gather: {len(outs)} output tensors for a group of {n}")
    _same(outs, inp, "all_gather output")
    k = inp.numel()
    tmp, tarr = T.scratch(k * n, inp, st)

    def scatter_out() -> None:
        for r, o in enumerate(outs):
            o.copy_(tmp[r * k:(r + 1) * k].view(o.shape))
    st.after.append(scatter_out)
    return [pg.comm.Iallgather(T.for_move(inp, st, output=False), tarr, **st.kw)]


def reduce_scatter_single(pg: Any, out: torch.Tensor, inp: torch.Tensor, op: Any, st: T.Staged) -> list:
    T.check_tensor(out, "reduce_scatter output")
    T.check_tensor(inp, "reduce_scatter input")
    rop = redop(op, inp)
    n = pg.size()
    if out.dtype != inp.dtype or inp.numel() != out.numel() * n:
        raise errors.InvalidArgument(
            f"shmproxy backend: reduce_scatter_tensor: input {inp.dtype} x {inp.numel()} must be the"
            f" output's dtype and {n} x its {out.numel()} elements")
    sarr = T.native_view(T.for_reduce(inp, st, output=False))
    rarr = T.native_view(T.for_reduce(out, st, output=True))
    return [pg.comm.Ireduce_scatter_block(sarr, rarr, rop, **st.kw)]


def reduce_scatter_list(pg: Any, out: torch.Tensor, ins: Sequence[torch.Tensor], op: Any,
                        st: T.Staged) -> list:
    T.check_tensor(out, "reduce_scatter output")
    rop = redop(op, out)
    n = pg.size()
    if len(ins) != n:
        raise errors.InvalidArgument(
            f"shmproxy backend: reduce_scatter: {len(ins)} input tensors for a group of {n}")
    _same(ins, out, "reduce_scatter input")
    k = out.numel()
    tmp, tarr = T.scratch(k * n, out, st, reduce=True)
    for r, x in enumerate(ins):
        tmp[r * k:(r + 1) * k].copy_(x.reshape(-1))
    return [pg.comm.Ireduce_scatter_block(tarr, T.for_reduce(out, st, output=True), rop, **st.kw)]


# ---------------------------------------------------------------------------------------------------
# Blocking calls run on the calling thread (ProcessGroupShmproxy._direct: small CPU tensors, no
# bfloat16), as the communicator's blocking collectives: no Staged, nothing after.

def _in_place(t: torch.Tensor, run: Callable[[np.ndarray], object]) -> None:
    """``run`` on an array over ``t``; a strided ``t`` through a contiguous copy, copied back after."""
    if t.is_contiguous():
        run(T.bits_view(t))
        return
    tmp = t.contiguous()
    run(T.bits_view(tmp))
    t.copy_(tmp)


def allreduce_now(pg: Any, t: torch.Tensor, op: Any) -> None:
    rop = redop(op, t)
    _in_place(t, lambda a: pg.comm.Allreduce(shmproxy.IN_PLACE, a, rop))


def broadcast_now(pg: Any, t: torch.Tensor, root: int) -> None:
    root = _root(pg, root, "broadcast")
    _in_place(t, lambda a: pg.comm.Bcast(a, root))


def reduce_now(pg: Any, t: torch.Tensor, op: Any, root: int) -> None:
    rop = redop(op, t)
    root = _root(pg, root, "reduce")
    if pg.rank() == root:
        _in_place(t, lambda a: pg.comm.Reduce(shmproxy.IN_PLACE, a, rop, root))
    else:
        _in_place(t, lambda a: pg.comm.Reduce(a, None, rop, root))


# ---------------------------------------------------------------------------------------------------
# Collectives made of point-to-point messages

def _splits(given: Sequence[int], t: torch.Tensor, n: int, what: str) -> list[int]:
    rows = t.shape[0] if t.dim() else 1
    if not given:
        if rows % n:
            raise errors.InvalidArgument(f"shmproxy backend: all_to_all_single: {what} has {rows} rows, not a"
                                         f" multiple of the group size {n} (pass split sizes)")
        return [rows // n] * n
    sp = [int(s) for s in given]
    if len(sp) != n or any(s < 0 for s in sp) or sum(sp) != rows:
        raise errors.InvalidArgument(f"shmproxy backend: all_to_all_single: {what} split sizes {sp} must"
                                     f" be {n} non-negative numbers adding up to its {rows} rows")
    return sp


def all_to_all_single(pg: Any, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
                      in_splits: Sequence[int], st: T.Staged) -> list:
    T.check_tensor(out, "all_to_all output")
    T.check_tensor(inp, "all_to_all input")
    if out.dtype != inp.dtype:
        raise errors.InvalidArgument(
            f"shmproxy backend: all_to_all_single: output {out.dtype} != input {inp.dtype}")
    n, me = pg.size(), pg.rank()
    osp, isp = _splits(out_splits, out, n, "output"), _splits(in_splits, inp, n, "input")
    oarr = T.for_move(out, st, output=True)
    iarr = T.for_move(inp, st, output=False)
    if len(set(osp)) == 1 and len(set(isp)) == 1 and osp[0] == isp[0]:
        return [pg.comm.Ialltoall(iarr, oarr, **st.kw)]
    orow = out.numel() // max(out.shape[0], 1) if out.dim() else 1
    irow = inp.numel() // max(inp.shape[0], 1) if inp.dim() else 1
    ooff = np.concatenate([[0], np.cumsum(osp)]) * orow
    ioff = np.concatenate([[0], np.cumsum(isp)]) * irow
    recv = [oarr[ooff[r]:ooff[r + 1]] for r in range(n)]
    return _pairs(pg, recv, [iarr[ioff[r]:ioff[r + 1]] for r in range(n)], TAG_ALLTOALLV, me, st)


def alltoall_list(pg: Any, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], st: T.Staged) -> list:
    n = pg.size()
    if len(outs) != n or len(ins) != n:
        raise errors.InvalidArgument(f"shmproxy backend: all_to_all: {len(outs)} outputs and {len(ins)}"
                                     f" inputs for a group of {n}")
    for i, t in enumerate([*outs, *ins]):
        T.check_tensor(t, f"all_to_all tensor {i}")
    recv = [T.for_move(o, st, output=True) for o in outs]
    return _pairs(pg, recv, [T.for_move(x, st, output=False) for x in ins], TAG_ALLTOALL_LIST, pg.rank(), st)


def _pairs(pg: Any, recv: list[Any], send: list[Any], tag: int, me: int, st: T.Staged) -> list:
    """Block r of ``send`` to rank r, block r of ``recv`` from rank r (flat numpy arrays, or flat CUDA
    tensors); empty blocks travel nowhere (both sides know they are empty), and the rank's own block
    is copied here (for CUDA tensors on the current stream, which the posts are ordered after)."""
    comm, reqs = pg.comm, []
    if len(recv[me]) != len(send[me]):
        raise errors.InvalidArgument(f"shmproxy backend: all_to_all: rank {me} sends itself {len(send[me])}"
                                     f" elements but expects {len(recv[me])}")
    recv[me][...] = send[me]
    with comm.group():
        for r in range(len(recv)):
            if r != me and len(recv[r]):
                reqs.append(comm.Irecv(recv[r], r, tag, **st.kw))
        for r in range(len(send)):
            if r != me and len(send[r]):
                reqs.append(comm.Isend(send[r], r, tag, **st.kw))
    return reqs


def gather(pg: Any, outs: Sequence[torch.Tensor], inp: torch.Tensor, root: int, st: T.Staged) -> list:
    T.check_tensor(inp, "gather input")
    root, me, comm = _root(pg, root, "gather"), pg.rank(), pg.comm
    if me != root:
        return [comm.Isend(T.for_move(inp, st, output=False), root, TAG_GATHER, **st.kw)]
    if len(outs) != pg.size():
        raise errors.InvalidArgument(
            f"shmproxy backend: gather: {len(outs)} outputs for a group of {pg.size()}")
    _same(outs, inp, "gather output")
    outs[me].copy_(inp.reshape(outs[me].shape))
    with comm.group():
        return [comm.Irecv(T.for_move(o, st, output=True), r, TAG_GATHER, **st.kw)
                for r, o in enumerate(outs) if r != me]


def scatter(pg: Any, out: torch.Tensor, ins: Sequence[torch.Tensor], root: int, st: T.Staged) -> list:
    T.check_tensor(out, "scatter output")
    root, me, comm = _root(pg, root, "scatter"), pg.rank(), pg.comm
    if me != root:
        return [comm.Irecv(T.for_move(out, st, output=True), root, TAG_SCATTER, **st.kw)]
    if len(ins) != pg.size():
        raise errors.InvalidArgument(
            f"shmproxy backend: scatter: {len(ins)} inputs for a group of {pg.size()}")
    _same(ins, out, "scatter input")
    out.copy_(ins[me].reshape(out.shape))
    with comm.group():
        return [comm.Isend(T.for_move(x, st, output=False), r, TAG_SCATTER, **st.kw)
                for r, x in enumerate(ins) if r != me]


# ---------------------------------------------------------------------------------------------------
# Point-to-point

def send_or_isend(pg: Any, t: torch.Tensor, dst: int, tag: int) -> Any:
    """A small CPU send: through the ranks' fast path at once (None: sent, the bytes copied), else the
    posted Isend's request (which holds its array)."""
    return pg.comm._send_or_isend(T.bits_view(t if t.is_contiguous() else t.contiguous()), dst, tag)


def try_recv(pg: Any, t: torch.Tensor, src: int, tag: int) -> Any:
    """A small CPU receive through the ranks' fast path if it takes the message within its spin:
    the Status, else None with nothing posted (and ``t``'s values unchanged)."""
    got: list = []
    _in_place(t, lambda a: got.append(pg.comm._try_recv(a, src, tag)))
    return got[0]


def send(pg: Any, t: torch.Tensor, dst: int, tag: int, st: T.Staged) -> list:
    return [pg.comm.Isend(T.for_move(t, st, output=False), dst, tag, **st.kw)]


def recv(pg: Any, t: torch.Tensor, src: int, tag: int, st: T.Staged) -> list:
    return [pg.comm.Irecv(T.for_move(t, st, output=True), src, tag, **st.kw)]
