"""Rank bodies for tests/test_gpu.py: device (cupy) buffers through shmproxy, ranks sharing one GPU.

Inputs are deterministic functions of (rank, size, dtype), small integers, so every rank computes every
other rank's contribution and checks its own output against a cupy reference exactly (AVG within a
tolerance). Each body returns the number of cases it checked, and the mismatches it found.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

import shmproxy

DTYPES = ["int32", "int64", "float16", "float32", "float64", "uint8", "complex64"]
SIZES = [0, 1, 7, 1000, 1 << 20]


def gpu_of_rank() -> int:
    """This rank's GPU: 0, every rank sharing it, or with SPTEST_GPU_SPREAD=1 (tests/test_gpu_multi.py)
    its local rank modulo the GPUs, one rank per GPU where there are enough; with SPTEST_GPU_SPREAD=rank
    (simulated nodes on one host: tests/test_gpu_nodes.py) its rank modulo the GPUs."""
    spread = os.environ.get("SPTEST_GPU_SPREAD")
    if spread not in ("1", "rank"):
        return 0
    import cupy
    which = "RANK" if spread == "rank" else "LOCAL_RANK"
    return int(os.environ.get(which, "0")) % cupy.cuda.runtime.getDeviceCount()


def _cp() -> Any:
    """cupy, with this rank's GPU current (and torch's, where the body imported torch first)."""
    import cupy
    dev = gpu_of_rank()
    cupy.cuda.Device(dev).use()
    if "torch" in sys.modules:
        sys.modules["torch"].cuda.set_device(dev)
    return cupy


def _input(cp: Any, rank: int, n: int, dtype: str, salt: int = 0) -> Any:
    x = (cp.arange(n, dtype=cp.int64) * 7 + rank * 3 + salt) % 5 + 1
    return x.astype(dtype)


def p2p_every_dtype_and_size() -> dict:
    """Send/Recv and Isend/Irecv of device arrays around a ring (rank r sends to r + 1, receives from
    r - 1), so any rank count works: with 3 ranks on 2 GPUs one message stays on a GPU and two cross.
    Even ranks post the receive first and send blocking, odd ranks the reverse: every form runs. Then
    host<->device messages the same way."""
    cp = _cp()
    bad, cases = [], 0
    with shmproxy.init() as comm:
        me = comm.rank
        right, left = (me + 1) % comm.size, (me - 1) % comm.size
        for dtype in DTYPES:
            for n in SIZES:
                mine = _input(cp, me, n, dtype)
                out = cp.zeros(n, dtype)
                if me % 2 == 0:
                    r = comm.Irecv(out, left, tag=n)
                    comm.Send(mine, right, tag=n)
                    st = r.Wait()
                else:
                    s = comm.Isend(mine, right, tag=n)
                    st = comm.Recv(out, left, tag=n)
                    s.Wait()
                cases += 1
                if st.nbytes != out.nbytes:
                    bad.append(f"{dtype} {n}: status nbytes {st.nbytes}")
                if not bool((out == _input(cp, left, n, dtype)).all()):
                    bad.append(f"{dtype} {n}: data differs")
        # a host array sent into a device array, and a device array into a host array
        host = np.arange(1000, dtype=np.float32) + me
        dev = cp.zeros(1000, cp.float32)
        r = comm.Irecv(dev, left, tag=7)
        comm.Send(host, right, tag=7)
        r.Wait()
        if not bool((dev.get() == np.arange(1000, dtype=np.float32) + left).all()):
            bad.append("host -> device: data differs")
        back = np.zeros(1000, np.float32)
        r = comm.Irecv(back, left, tag=8)
        comm.Send(dev, right, tag=8)
        r.Wait()
        if not (back == np.arange(1000, dtype=np.float32) + (left - 1) % comm.size).all():
            bad.append("device -> host: data differs")
        cases += 2
    return {"cases": cases, "bad": bad}


_SPIN = r"""
extern "C" __global__ void spin_then_fill(float* x, long long n, float v, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) x[i] = v;
}
"""


def stream_order() -> dict:
    """Work queued on a non-default stream before the call is seen: the sender's kernel spins for
    ~100 ms before writing the data, and the send is posted right after, with no synchronize; and a
    receiver's kernel still writing its output buffer when the call is made does not overwrite the
    result."""
    cp = _cp()
    kern = cp.RawKernel(_SPIN, "spin_then_fill")
    n = 1 << 20
    bad = []
    with shmproxy.init() as comm:
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            x = cp.zeros(n, cp.float32)
            s.synchronize()
            t0 = time.monotonic()
            if comm.rank == 0:
                kern((64,), (256,), (x, cp.int64(n), cp.float32(42.0), cp.int64(200_000_000)))
                comm.Send(x, 1)
            else:
                comm.Recv(x, 0)
                if not bool((x == 42.0).all()):
                    bad.append("receiver saw the buffer before the sender's stream wrote it")
            # collectives too: every rank's input is written by a slow kernel just before the call
            y = cp.zeros(n, cp.float32)
            kern((64,), (256,), (y, cp.int64(n), cp.float32(comm.rank + 1), cp.int64(100_000_000)))
            out = cp.zeros(n, cp.float32)
            comm.Allreduce(y, out)
            expect = comm.size * (comm.size + 1) / 2
            if not bool((out == expect).all()):
                bad.append(f"Allreduce saw inputs before they were written: {float(out[0])} != {expect}")
            # outputs too: a buffer the stream is still writing when the call is made ends with the
            # call's result, not the kernel's late value (write after write); the root's input is ready
            z = cp.full(n, 7.0, cp.float32) if comm.rank == 0 else cp.zeros(n, cp.float32)
            if comm.rank != 0:
                kern((64,), (256,), (z, cp.int64(n), cp.float32(-1.0), cp.int64(100_000_000)))
            comm.Bcast(z, 0)
            if not bool((z == 7.0).all()):
                bad.append(f"Bcast's result overwritten by the stream's earlier work: {float(z[0])} != 7")
            if comm.rank < 2:
                r = cp.full(n, 9.0, cp.float32) if comm.rank == 0 else cp.zeros(n, cp.float32)
                if comm.rank == 0:
                    comm.Send(r, 1, tag=3)
                else:
                    kern((64,), (256,), (r, cp.int64(n), cp.float32(-1.0), cp.int64(100_000_000)))
                    comm.Recv(r, 0, tag=3)
                    if not bool((r == 9.0).all()):
                        bad.append(f"Recv's message overwritten by the stream's earlier work: {float(r[0])} != 9")
            dt = time.monotonic() - t0
    return {"bad": bad, "seconds": dt}


def _ref_reduce(cp: Any, xs: list, op: str) -> Any:
    acc = xs[0].copy()
    for x in xs[1:]:
        if op in ("SUM", "AVG"):
            acc = acc + x
        elif op == "PROD":
            acc = acc * x
        elif op == "MIN":
            acc = cp.minimum(acc, x)
        else:
            acc = cp.maximum(acc, x)
    if op == "AVG":
        acc = acc / len(xs)
    return acc


def _same(cp: Any, a: Any, b: Any, op: str) -> bool:
    if op == "AVG":
        return bool(cp.allclose(a.astype(cp.complex128), b.astype(cp.complex128), rtol=1e-2))
    return bool((a == b).all())


def collectives() -> dict:
    """Every buffer collective on device arrays (in place where MPI has it), against cupy references."""
    cp = _cp()
    bad, cases = [], 0
    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        for dtype in DTYPES:
            for n in SIZES:
                xs = [_input(cp, r, n, dtype) for r in range(size)]
                ops = ["SUM", "MAX", "MIN", "PROD"] + (["AVG"] if dtype[0] in "fc" else [])
                if dtype.startswith("complex"):
                    ops = ["SUM", "PROD", "AVG"]
                for op in ops:
                    ref = _ref_reduce(cp, xs, op).astype(dtype)
                    out = cp.zeros(n, dtype)
                    comm.Allreduce(xs[me], out, getattr(shmproxy, op))
                    inplace = xs[me].copy()
                    comm.Allreduce(shmproxy.IN_PLACE, inplace, getattr(shmproxy, op))
                    root = n % size
                    rout = cp.zeros(n, dtype) if me == root else None
                    comm.Reduce(xs[me], rout, getattr(shmproxy, op), root=root)
                    cases += 3
                    for what, got in (("Allreduce", out), ("Allreduce in place", inplace)) + (
                            (("Reduce", rout),) if me == root else ()):
                        if not _same(cp, got, ref, op):
                            bad.append(f"{what} {op} {dtype} n={n}")
                # Bcast from every root
                for root in range(size):
                    buf = xs[me].copy()
                    comm.Bcast(buf, root)
                    cases += 1
                    if not bool((buf == xs[root]).all()):
                        bad.append(f"Bcast root {root} {dtype} n={n}")
                # Allgather, Alltoall, Reduce_scatter_block
                g = cp.zeros(n * size, dtype)
                comm.Allgather(xs[me], g)
                gi = cp.zeros(n * size, dtype)
                gi[me * n:(me + 1) * n] = xs[me]
                comm.Allgather(shmproxy.IN_PLACE, gi)
                full = [_input(cp, r, n * size, dtype, salt=1) for r in range(size)]
                a = cp.zeros(n * size, dtype)
                comm.Alltoall(full[me], a)
                rs = cp.zeros(n, dtype)
                comm.Reduce_scatter_block(full[me], rs)
                rsi = full[me].copy()
                comm.Reduce_scatter_block(shmproxy.IN_PLACE, rsi)
                cases += 5
                gref = cp.concatenate(xs)
                aref = cp.concatenate([f[me * n:(me + 1) * n] for f in full])
                rsref = _ref_reduce(cp, [f[me * n:(me + 1) * n] for f in full], "SUM").astype(dtype)
                for what, got, ref in (("Allgather", g, gref), ("Allgather in place", gi, gref),
                                       ("Alltoall", a, aref), ("Reduce_scatter_block", rs, rsref),
                                       ("Reduce_scatter_block in place", rsi[:n], rsref)):
                    if not bool((got == ref).all()):
                        bad.append(f"{what} {dtype} n={n}")
        # nonblocking collectives overlapping device compute on the rank's stream
        x = cp.full(1 << 22, me + 1, cp.float32)
        out = cp.zeros_like(x)
        req = comm.Iallreduce(x, out)
        busy = cp.ones((512, 512), cp.float32)
        for _ in range(20):
            busy = busy @ busy / 512
        req.Wait()
        cases += 1
        if not bool((out == size * (size + 1) / 2).all()):
            bad.append("Iallreduce overlapping compute")
    return {"cases": cases, "bad": bad}


def mixed_is_refused() -> dict:
    """Host and device buffers mixed in one call: InvalidArgument before anything is posted; the
    communicator goes on."""
    cp = _cp()
    refused = 0
    with shmproxy.init() as comm:
        dev, host = cp.zeros(4, cp.float32), np.zeros(4, np.float32)
        for call in (lambda: comm.Allreduce(dev, host), lambda: comm.Allreduce(host, dev),
                     lambda: comm.Allgather(dev, np.zeros(4 * comm.size, np.float32)),
                     lambda: comm.Alltoall(host, cp.zeros(4 * comm.size, cp.float32))):
            try:
                call()
            except shmproxy.InvalidArgument as exc:
                assert "host and device buffers mixed" in str(exc), exc
                refused += 1
        out = cp.zeros(4, cp.float32)
        comm.Allreduce(cp.full(4, comm.rank + 1, cp.float32), out)
        ok = bool((out == comm.size * (comm.size + 1) / 2).all())
    return {"refused": refused, "ok": ok}


def torch_tensors() -> dict:
    """torch CUDA tensors (the CUDA array interface / DLPack) through Allreduce and Send/Recv."""
    import torch
    _cp()
    with shmproxy.init() as comm:
        t = torch.full((1000,), float(comm.rank + 1), device="cuda")
        out = torch.zeros(1000, device="cuda")
        comm.Allreduce(t, out)
        ok = bool((out == comm.size * (comm.size + 1) / 2).all())
        if comm.size >= 2:
            if comm.rank == 0:
                comm.Send(torch.arange(100, device="cuda", dtype=torch.float64), 1)
            elif comm.rank == 1:
                r = torch.zeros(100, device="cuda", dtype=torch.float64)
                comm.Recv(r, 0)
                torch.cuda.current_stream().synchronize()
                ok &= bool((r == torch.arange(100, device="cuda", dtype=torch.float64)).all())
    return {"ok": ok}


def victim_dies_in_device_allreduce() -> dict:
    """The last rank SIGKILLs itself right before posting its second device Allreduce: the others'
    calls raise PeerDiedError naming it."""
    import signal
    cp = _cp()
    with shmproxy.init() as comm:
        x = cp.ones(16 << 20, cp.float32)
        out = cp.zeros_like(x)
        comm.Allreduce(x, out)
        cp.cuda.get_current_stream().synchronize()
        if comm.rank == comm.size - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.Allreduce(x, out)
        except shmproxy.PeerDiedError as exc:
            return {"raised": type(exc).__name__, "message": str(exc)[:200]}
    return {"raised": None}


def wait_on_stream(rounds: int = 40) -> dict:
    """Request.wait_on_stream: another stream waits on the GPU for a collective and the host goes on.
    The last rank's input is written by a kernel that spins ~100 ms first, so the Allreduce completes
    late on every rank; each rank's second stream waits for it and doubles the result: the host
    returns from wait_on_stream at once and the doubled values are right. Then ``rounds`` calls in a
    row, each waited for on the second stream only (the slots are reused meanwhile; nothing waits on
    the host until the end)."""
    cp = _cp()
    kern = cp.RawKernel(_SPIN, "spin_then_fill")
    n = 1 << 20
    bad: list[str] = []
    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        want = size * (size + 1) / 2
        s, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
        x = cp.zeros(n, cp.float32)
        warm = comm.Iallreduce(shmproxy.IN_PLACE, x, shmproxy.SUM, stream=s)
        warm.wait_on_stream(other)   # the first pins this rank's completion slots for the device
        warm.Wait()
        cp.cuda.Device().synchronize()
        comm.Barrier()
        cycles = 200_000_000 if me == size - 1 else 0
        kern((64,), (256,), (x, cp.int64(n), cp.float32(me + 1), cp.int64(cycles)), stream=s)
        req = comm.Iallreduce(shmproxy.IN_PLACE, x, shmproxy.SUM, stream=s)
        t0 = time.monotonic()
        armed = req.wait_on_stream(other)
        host_s = time.monotonic() - t0
        with other:
            y = x * 2
        other.synchronize()
        if not armed:
            bad.append("wait_on_stream declined a pending device Allreduce")
        if float(y.min()) != 2 * want or float(y.max()) != 2 * want:
            bad.append(f"the stream ran ahead of the Allreduce: {float(y.min())}..{float(y.max())}, not {2 * want}")
        req.Wait()
        if req.wait_on_stream(other):
            bad.append("wait_on_stream armed a wait for a request already complete")
        acc = cp.zeros(n, cp.float32)
        reqs = []
        for i in range(rounds):
            with s:
                x.fill(me + 1 + i)
            r = comm.Iallreduce(shmproxy.IN_PLACE, x, shmproxy.SUM, stream=s)
            r.wait_on_stream(other)
            with other:
                acc += x
                other_done = cp.cuda.Event()
                other_done.record(other)
            s.wait_event(other_done)   # the next fill waits until this round's sum was read
            reqs.append(r)
        shmproxy.Request.Waitall(reqs)
        other.synchronize()
        expect = sum(want + size * i for i in range(rounds))
        if float(acc.min()) != expect or float(acc.max()) != expect:
            bad.append(f"{rounds} rounds waited on the stream: {float(acc.min())}..{float(acc.max())}, not {expect}")
    return {"bad": bad, "host_s": host_s}


def stream_let_go_when_peer_dies(host_waits: bool = True) -> dict:
    """A stream waits (Request.wait_on_stream) for an Allreduce whose last rank SIGKILLs itself
    instead of posting its part (once rank 0 told it its stream waits): the survivors' Wait raises
    PeerDiedError, and their waiting stream is let go (its synchronize returns) instead of holding
    the GPU forever. Without ``host_waits`` the survivors synchronize the stream first, making no call
    of ours that would learn of the death (as DDP's reducer does behind work.wait()): the stream must
    be let go all the same, and the next call raise."""
    import signal
    cp = _cp()
    with shmproxy.init() as comm:
        x = cp.ones(1 << 16, cp.float32)
        other = cp.cuda.Stream(non_blocking=True)
        comm.Allreduce(shmproxy.IN_PLACE, x)
        cp.cuda.Device().synchronize()
        comm.Barrier()
        if comm.rank == comm.size - 1:
            comm.Recv(np.zeros(1), 0, tag=3)   # rank 0's stream waits by now
            os.kill(os.getpid(), signal.SIGKILL)
        req = comm.Iallreduce(shmproxy.IN_PLACE, x)
        armed = req.wait_on_stream(other)
        if comm.rank == 0:
            comm.Send(np.zeros(1), comm.size - 1, tag=3)
        t0 = time.monotonic()
        if not host_waits:
            other.synchronize()
        try:
            req.Wait()
        except shmproxy.PeerDiedError as exc:
            raised = type(exc).__name__
        else:
            raised = None
        if host_waits:
            t0 = time.monotonic()
            other.synchronize()
        return {"raised": raised, "armed": armed, "sync_s": time.monotonic() - t0}


def remembered_call_after_realloc(rounds: int = 6) -> dict:
    """The same cupy array object over memory it does not own (as the torch backend's cached views of
    tensors are), whose allocation is freed and allocated again at the same address between calls:
    a repeated call reuses its checked record (DeviceMemory.posted), so the new allocation must be
    told from the old by its buffer id and registered afresh; through the old registration the
    progress process would write the freed allocation, and the array would keep its old values."""
    cp = _cp()
    rt = cp.cuda.runtime
    n = 1 << 20
    nbytes = 4 * n
    bad: list[str] = []
    same = 0
    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        want = size * (size + 1) / 2
        ptr = rt.malloc(nbytes)
        v = cp.ndarray((n,), cp.float32, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, nbytes, None), 0))
        for i in range(rounds):
            for k in range(2):
                v.fill(me + 1 + k)
                comm.Allreduce(shmproxy.IN_PLACE, v, shmproxy.SUM)
                got = float(v.min()), float(v.max())
                if got != (want + size * k,) * 2:
                    bad.append(f"round {i} call {k}: {got}, not {want + size * k}")
            cp.cuda.Device().synchronize()
            rt.free(ptr)
            again = rt.malloc(nbytes)
            if again == ptr:
                same += 1
            else:   # not the case this is about: a new array over the new address
                ptr = again
                v = cp.ndarray((n,), cp.float32,
                               cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, nbytes, None), 0))
        rt.free(ptr)
    return {"bad": bad, "same_address": same}
