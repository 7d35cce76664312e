"""The rank's fast path, Python side: binding, the calls the C path declines, and its failures.

On a communicator whose ranks all share this node, the pool has a fast region (shm/_fast.h) and each
Comm binds Send, Recv, Barrier, Allreduce, Bcast and Reduce to C entry points of its poster
(shm/_poster_fast.c, shm/_poster_coll.c). What they decline comes here:

- Send and Recv go to the progress process as before (Isend/Irecv and a Wait): declining a message
  is always correct (the C path only declines before it changed anything). ``_send_or_isend``
  (the torch backend's send) is Send's cell without the wait: declined, it returns the Isend;
  ``_try_recv`` is Recv's cell without the post: declined, None.
- A collective is small or not by what every rank passes alike (its kind, bytes per rank, dtype and
  op: ``small``), never by where a rank's buffer lies, since all ranks must take the same path. So a
  small collective the C path declined for a rank-local reason (a strided input, which is copied
  here as the progress process's path would stage it; a ``stream=``, which host memory ignores)
  still runs between the ranks (``coll_fast``); only a signature that is not small goes to the
  progress process, and so do arguments that its checks refuse (they raise there, before anything is
  posted, naming why).
- **Device arrays** (cupy, the CUDA array interface, DLPack) of a small Bcast run between the ranks
  too (``_device``; a Barrier has no buffers): the rank orders itself after the work queued on the
  stream (``stream=`` or cupy's current one) by copying its input into a page-locked host buffer on
  that stream and synchronizing it, runs ``coll_fast`` on the host copy, and copies the result back
  on the same stream, synchronized again, so a blocking call returns with the result in place and
  the caller's later work on any stream sees it. The host copy is used in place (one buffer; the
  fingerprint does not tell in-place from not, and the reduction's order and kernel are the host's),
  so a device rank and a host rank of the same small call meet in one collective with the same bits.
  A small **Allreduce** of device arrays runs as the ranks' own kernels first, where each rank has a
  GPU of its own (shmproxy.rank.devcoll); where they share one:
  **Allreduce and Reduce** of device arrays take the same way only with FAST_DEVICE_REDUCTIONS: off,
  because each rank then queues two copies per call, and where the ranks share a GPU without MPS
  the GPU switching between their contexts made that slower than the progress process's path
  (BENCHMARKS.md, the device section); off, every rank posts them to the progress process at any size.
  Hence **host on one rank and device on another** in one collective: a small Bcast or Barrier works
  on both (each stages or not on its own side); a small Allreduce or Reduce is a mismatch (the host
  rank runs it between the ranks, the device rank posts it), which fails the communicator with
  InvalidUsage on every rank; a large one goes to the progress process on both, which refuses the mix
  with InvalidArgument on every rank alike. Host and device mixed within one call is refused by the
  call's own checks (``Posting.device_args``), as before, before anything is posted.
  **bfloat16** stays with the progress process at every size: the device path reduces it step by
  step through float32 with rounding back each step, which the C kernels of the host path do not
  do, and a bfloat16 call is device memory on every rank (numpy has no such dtype), so every rank
  of it takes the progress process's path alike.

Failures: the C wait hands its outcome to ``fast_failed``: the communicator's own error when its
flags are up, or a Timeout / mismatch that first fails the communicator on every rank (through the
progress process, as a mismatch it detects itself does), so that no peer waits for a bound of its own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shmproxy.control.protocol import MsgType
from shmproxy.core import errors, log
from shmproxy.core.ops import (CODE_DTYPE, COLL_NAMES, DTYPE_BFLOAT16, DTYPE_CODE, IN_PLACE, REDUCE_OP_NAMES,
                               Coll, ReduceOp)
from shmproxy.rank import arena, devcoll
from shmproxy.shm import _poster, pool as P

if TYPE_CHECKING:
    from shmproxy.rank.comm import Comm

_log = log.get("RANK")
# shm/_poster_coll.c's outcomes of a wait
CW_FAILED, CW_TIMEOUT, CW_MISMATCH, CW_GONE = 1, 2, 3, 4
_H2D, _D2H = 1, 2   # cudaMemcpyKind
_DTYPE_NAMES = {code: dt.name for code, dt in CODE_DTYPE.items()}


def bind(comm: "Comm", seg_addr: int, layout: P.Layout) -> bool:
    """Turn the fast path on in ``comm``'s poster if its pool has the region (every rank on this
    node); whether it did (Comm._bind_entries then binds the calls to its entries)."""
    if not layout.fast_bytes or comm.local_size != comm.size:
        return False
    pp = comm._pp
    fallbacks = (lambda: _barrier(comm), lambda *a, **k: allreduce(comm, *a, **k),
                 lambda *a, **k: _bcast(comm, *a, **k), lambda *a, **k: _reduce(comm, *a, **k))
    pp.set_fast(seg_addr, layout.fast_off, layout.fast_bytes, layout.rank_area_off, layout.nlocal,
                comm.params.WAIT_SLICE_MS * 1e-3, fallbacks, lambda code, detail: fast_failed(comm, code, detail),
                lambda: fast_check(comm), comm._proxy.pidfd)
    comm._fast_bytes = layout.fast_bytes
    return True


def bind_arena(comm: "Comm", held: tuple[int, int, int] | None) -> None:
    """Turn on the middle collectives (shm/_poster_coll.c): an Allreduce, Bcast or Reduce of host
    arrays above the fast path's cells and up to FAST_MAPPED_BYTES per rank runs between the ranks
    through their numpy arenas (shmproxy.rank.arena). ``held``: this rank's arena (base, size, fd),
    None where it has none (every rank then declines such a collective alike, and posts it). Every
    rank turns it on alike (a parameter), whatever its own arena, so that ``small`` agrees."""
    mapped, least = comm.params.FAST_MAPPED_BYTES, comm.params.FAST_MAPPED_MIN_BYTES
    least_reduce = least
    if least < 0:   # automatic (FAST_MAPPED_MIN_BYTES): measured crossovers, lower for a Reduce
        least, least_reduce = (8 << 10) // comm.size, (2 << 10) // comm.size
    if not comm._fast_bytes or mapped <= least:
        return
    base = size = scratch = 0
    fd = -1
    if held is not None:
        base, size, fd = held
        scratch = comm._arena_scratch = arena.block(2 * mapped)
    comm._pp.set_arena(mapped, least, least_reduce, base, size, fd, scratch)
    comm._mapped_bytes, comm._mapped_min, comm._mapped_min_reduce = mapped, least, least_reduce
    p = comm.params
    if held is not None and p.FAST_REF_MAX_BYTES:
        comm._pp.set_ref(p.FAST_REF_MIN_BYTES, p.FAST_REF_MAX_BYTES,
                         lambda code, dest, nbytes: ref_failed(comm, code, dest, nbytes))


def _decline_middle(comm: "Comm", coll: int, arr: Any, op: int, root: int) -> None:
    """A device rank's part of what host ranks run as a middle collective (``bind_arena``): their
    handshake, declined, so that every rank posts the call alike and the progress process decides
    (it refuses host and device mixed in one collective on every rank, and the communicator goes on).
    Nothing where the signature is not a middle one."""
    if not comm._mapped_bytes or arr is None or arr is IN_PLACE or not comm._posting.is_device_array(arr):
        return   # not a device array (a derived datatype, a bad argument): the posted path judges it
    a = comm._posting.device_args(COLL_NAMES[coll], arr, None)[0]
    code = DTYPE_CODE.get(a.dtype.char) if a is not None else None
    least = comm._mapped_min_reduce if coll == Coll.REDUCE else comm._mapped_min
    if (code is None or code == DTYPE_BFLOAT16 or not (a.nbytes > comm._fast_bytes or a.nbytes > least)
            or not small(comm, coll, a.nbytes, a.dtype, op)):
        return
    comm._pp.coll_decline(int(coll), a.nbytes, code, a.size, op, root)


def small(comm: "Comm", coll: int, nbytes: int, dtype: np.dtype, op: int, middle: bool = True) -> bool:
    """Whether a collective of this signature runs between the ranks (the same answer on every rank
    of a correct program): through the fast path's cells, or (``middle``: host arrays) through the
    ranks' arenas (``bind_arena``)."""
    limit = max(comm._fast_bytes, comm._mapped_bytes) if middle else comm._fast_bytes
    if not comm._fast_bytes or nbytes > limit:
        return False
    if coll in (Coll.ALLREDUCE, Coll.REDUCE):
        code = DTYPE_CODE.get(dtype.char)
        return code is not None and _poster.fast_kernel(int(op), code)
    return True


def _host(a: Any) -> bool:
    return type(a) is np.ndarray


def reduce_op(op: Any) -> int | None:
    """``op`` as a ReduceOp value, or None where it is none (a callable, a bad value: the posted path says)."""
    if isinstance(op, (int, np.integer)) and not isinstance(op, bool):
        return int(op) if int(op) in ReduceOp._value2member_map_ else None
    return None


def _out(a: Any) -> bool:
    """An output the progress process's path takes too (it refuses the others, naming why)."""
    return _host(a) and a.flags.writeable and a.flags.c_contiguous


def _run(comm: "Comm", coll: int, send: np.ndarray | None, recv: np.ndarray | None, op: int, root: int) -> bool:
    """coll_fast with a contiguous copy of a strided input (as the progress process's path stages it);
    False where every rank declined a middle collective (the caller posts it)."""
    return comm._pp.coll_fast(int(coll), None if send is None else np.ascontiguousarray(send), recv, op,
                              root) is not Ellipsis


def _barrier(comm: "Comm") -> None:
    comm.Ibarrier().Wait()


def _not_host(*bufs: Any) -> bool:
    """Whether a buffer of the call may be device memory (``_device`` then looks)."""
    return any(b is not None and b is not IN_PLACE and type(b) is not np.ndarray for b in bufs)


def allreduce(comm: "Comm", sendbuf: Any, recvbuf: Any, op: Any = ReduceOp.SUM, stream: Any = None) -> None:
    """A blocking Allreduce, whichever way it runs: between the ranks (small host arrays), as the
    ranks' own kernels (device arrays: shmproxy.rank.devcoll), through host copies
    (FAST_DEVICE_REDUCTIONS), or posted. The C entry's fallback, and Comm.Allreduce's where the fast
    path is off (nothing then runs between the ranks: ``small`` says no)."""
    o = reduce_op(op)
    if (o is not None and _out(recvbuf)
            and (sendbuf is IN_PLACE or (_host(sendbuf) and sendbuf.dtype == recvbuf.dtype
                                         and sendbuf.size == recvbuf.size))
            and small(comm, Coll.ALLREDUCE, recvbuf.nbytes, recvbuf.dtype, o)):
        if _run(comm, Coll.ALLREDUCE, None if sendbuf is IN_PLACE else sendbuf, recvbuf, o, 0):
            return   # else every rank declined a middle one: posted below
    if o is not None and _not_host(sendbuf, recvbuf):
        if devcoll.allreduce(comm, sendbuf, recvbuf, o, stream):
            return
        if comm.params.FAST_DEVICE_REDUCTIONS and _device(comm, Coll.ALLREDUCE, sendbuf, recvbuf, o, 0, stream):
            return
        _decline_middle(comm, Coll.ALLREDUCE, recvbuf if sendbuf is IN_PLACE else sendbuf, o, 0)
    comm.Iallreduce(sendbuf, recvbuf, op, **({} if stream is None else {"stream": stream})).Wait()


def _bcast(comm: "Comm", buf: Any, root: int = 0, stream: Any = None) -> None:
    ok_root = isinstance(root, (int, np.integer)) and 0 <= int(root) < comm.size
    if (ok_root and _out(buf) and small(comm, Coll.BCAST, buf.nbytes, buf.dtype, 0)
            and _run(comm, Coll.BCAST, None, buf, 0, int(root))):
        return   # else every rank declined a middle one: posted below
    if ok_root and _not_host(buf):
        if _device(comm, Coll.BCAST, buf, None, 0, int(root), stream):
            return
        _decline_middle(comm, Coll.BCAST, buf, 0, int(root))
    comm.Ibcast(buf, root, **({} if stream is None else {"stream": stream})).Wait()


def _reduce(comm: "Comm", sendbuf: Any, recvbuf: Any, op: Any = ReduceOp.SUM, root: int = 0,
            stream: Any = None) -> None:
    o = reduce_op(op)
    ok_root = isinstance(root, (int, np.integer)) and 0 <= int(root) < comm.size
    at_root = ok_root and int(root) == comm.rank
    sig = recvbuf if sendbuf is IN_PLACE else sendbuf
    if (o is not None and ok_root and _host(sig)
            and (not at_root or (_out(recvbuf) and recvbuf.dtype == sig.dtype
                                 and recvbuf.size == sig.size))
            and (sendbuf is not IN_PLACE or at_root)
            and (at_root or recvbuf is None or _out(recvbuf))   # checked as the root's (Comm._coll)
            and small(comm, Coll.REDUCE, sig.nbytes, sig.dtype, o)):
        if _run(comm, Coll.REDUCE, None if sendbuf is IN_PLACE else sendbuf, recvbuf if at_root else None, o,
                int(root)):
            return   # else every rank declined a middle one: posted below
    if o is not None and ok_root and _not_host(sendbuf, recvbuf):
        if comm.params.FAST_DEVICE_REDUCTIONS and _device(comm, Coll.REDUCE, sendbuf, recvbuf, o, int(root), stream):
            return
        _decline_middle(comm, Coll.REDUCE, recvbuf if sendbuf is IN_PLACE else sendbuf, o, int(root))
    comm.Ireduce(sendbuf, recvbuf, op, root, **({} if stream is None else {"stream": stream})).Wait()


def _device(comm: "Comm", coll: int, sendbuf: Any, recvbuf: Any, op: int, root: int, stream: Any) -> bool:
    """A small collective on device arrays, run between the ranks through a host copy (see the header);
    False where the call is not one (the caller posts it, and the progress process's checks raise
    for arguments they refuse). Host and device mixed in one call raise here, as there."""
    send, recv, mem = comm._posting.device_args(COLL_NAMES[coll], sendbuf, recvbuf)
    if not mem:
        return False
    dev = comm._posting.device_memory()   # made by device_args
    in_place = sendbuf is IN_PLACE
    at_root = coll == Coll.ALLREDUCE or root == comm.rank
    for a in (send, recv):
        if a is not None and a is not IN_PLACE and dev.dtype_code(a) in (None, DTYPE_BFLOAT16):
            return False
    if coll == Coll.BCAST:
        src = dst = send
        if root == comm.rank:
            dst = None                 # the root's buffer is only read
        else:
            src = None                 # the others' input is not read
    else:
        sig = recv if in_place else send
        if sig is None or (in_place and not at_root) or (at_root and recv is None):
            return False
        if at_root and not in_place and (recv.dtype != send.dtype or recv.size != send.size):
            return False
        src, dst = sig, (recv if at_root else None)
    arr = send if coll == Coll.BCAST else sig
    nbytes = arr.nbytes
    if not small(comm, coll, nbytes, arr.dtype, op, middle=False):   # the cells only: device arrays keep
        return False                                                   # their own path above them
    cp = dev.cp
    rt = cp.cuda.runtime
    did = arr.device.id
    s = dev.as_stream(stream, did)
    prev = rt.getDevice()
    if prev != did:
        rt.setDevice(did)
    try:
        sp = (s if s is not None else cp.cuda.get_current_stream()).ptr
        host, addr = dev.host_stage(comm._fast_bytes)
        view = host[:nbytes].view(arr.dtype)
        if src is not None and nbytes:
            # after the stream's queued work: the input is what that work left
            _copy(rt, addr, src.data.ptr, nbytes, _D2H, sp)
        # in place on the host: one buffer, the same fingerprint and reduction as any rank's
        if coll == Coll.REDUCE and not at_root:
            comm._pp.coll_fast(int(coll), view, None, op, root)
        else:
            comm._pp.coll_fast(int(coll), None, view, op, root)
        if dst is not None and nbytes:
            _copy(rt, dst.data.ptr, addr, nbytes, _H2D, sp)
    finally:
        if prev != did:
            rt.setDevice(prev)
    return True


def _copy(rt: Any, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
    """A small copy between device and host, after the work queued on ``stream``, done on return."""
    rt.memcpyAsync(dst, src, nbytes, kind, stream)
    rt.streamSynchronize(stream)


def fast_check(comm: "Comm") -> None:
    """Between a small collective's sleeps: the progress process must still be there."""
    if comm._proxy.dead():
        raise comm._record_failure()


def describe(fp: int, size: str | None = None) -> str:
    """A small collective's fingerprint (shm/_poster_coll.c) in words; ``size`` instead of its bytes
    (a collective posted to the progress process, whose fingerprint carries no size)."""
    coll, op, code, root, nbytes = fp & 0xF, (fp >> 4) & 0xF, (fp >> 8) & 0xFF, (fp >> 16) & 0xFFFF, fp >> 32
    out = f"{COLL_NAMES.get(coll, coll)} of {size or f'{nbytes} B'}"
    if coll != Coll.BARRIER:
        out += f" {_DTYPE_NAMES.get(code, code)}"
    if coll in (Coll.ALLREDUCE, Coll.REDUCE):
        out += f" op {REDUCE_OP_NAMES.get(op, op)}"
    if coll in (Coll.BCAST, Coll.REDUCE):
        out += f" root {root}"
    return out


def fast_failed(comm: "Comm", code: int, detail: tuple[int, ...]) -> None:
    """Raise what a failed small collective must (shm/_poster_coll.c calls this with its wait's
    outcome and (collective number, its fingerprint, the other rank, that rank's fingerprint, and the
    fingerprint and count of what that rank posted to the progress process instead))."""
    if code == CW_FAILED and comm._pp.group_depth:
        comm._check_usable()
        raise errors.InvalidUsage(f"rank {comm.rank}: a blocking collective inside comm.group() cannot complete")
    _failed_or_closed(comm, code, "a small collective", "a collective")
    n, fp, other, other_fp, slow_fp, slow_count = detail
    exc: errors.ProxyError
    if code == CW_TIMEOUT:
        exc = errors.Timeout(f"rank {comm.rank}: {describe(fp)} (small collective #{n}): not every rank arrived "
                             f"within {comm._timeout:g} s")
    elif other_fp:
        exc = errors.InvalidUsage(f"small collective #{n} mismatch: rank {comm.rank} called {describe(fp)} but "
                                  f"rank {other} called {describe(other_fp)}")
    else:
        what = describe(slow_fp, f"{slow_count} elements") if slow_fp else "a collective"
        exc = errors.InvalidUsage(
            f"collective mismatch: rank {comm.rank} called a blocking {describe(fp)}, which runs between the "
            f"ranks, but rank {other} posted {what} to the progress process instead (a nonblocking "
            f"collective, which never matches a blocking one, a device Allreduce or Reduce, bfloat16, or one "
            f"above SHMPROXY_FAST_BYTES and SHMPROXY_FAST_MAPPED_BYTES)")
    fail_everywhere(comm, exc)
    raise exc


def ref_failed(comm: "Comm", code: int, dest: int, nbytes: int) -> None:
    """Raise what a blocking Send by reference (shm/_fast.h) must when the wait for its receiver failed.
    Its cell names the sender's buffer, which the program may reuse once Send returns: past a timeout
    the communicator cannot go on, so it fails everywhere."""
    _failed_or_closed(comm, code, "a Send by reference", "a Send")
    exc = errors.Timeout(f"rank {comm.rank}: Send of {nbytes} B to rank {dest}: not received within "
                         f"{comm._timeout:g} s")
    fail_everywhere(comm, exc)
    raise exc


def _failed_or_closed(comm: "Comm", code: int, what: str, during: str) -> None:
    """A fast-path wait (shm/_poster_coll.c's _sp_fast_wait) that ended in the communicator's failure
    or its close: raise that (``what``, ``during``: the call, in the messages)."""
    if code == CW_FAILED:
        comm._check_usable()
        raise errors.InternalError(f"rank {comm.rank}: {what} saw the communicator fail, but no error")
    if code == CW_GONE:
        raise errors.Closed(f"rank {comm.rank}: the communicator was closed during {during}")


def fail_everywhere(comm: "Comm", exc: errors.ProxyError) -> None:
    """Fail the communicator on every rank with ``exc``'s message, through the progress process; if it
    cannot be asked, this rank alone fails."""
    try:
        comm._control(MsgType.ABORT, {"code": exc.code, "message": str(exc)})
    except errors.ProxyError as why:
        _log.info("could not fail the communicator through the progress process: %s", why)
    comm._set_failure(exc)
