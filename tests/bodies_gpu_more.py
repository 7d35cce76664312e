"""More rank bodies for tests/test_gpu.py (device buffers): bfloat16 torch tensors, the ``stream=``
keyword, comm.alloc(device=...), a nonblocking collective under the rank's own kernel, where an
8 B device Allreduce's time goes, and small blocking collectives (the fast path). Shared helpers are
in tests/bodies_gpu.py.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

import shmproxy
from tests.bodies_gpu import _SPIN, _cp, gpu_of_rank


def _torch_bf16_ref(torch: Any, xs: list, op: str) -> Any:
    """Step by step in bfloat16, as torch's ops round (the order the progress process reduces in)."""
    acc = xs[0].clone()
    for x in xs[1:]:
        if op in ("SUM", "AVG"):
            acc = acc + x
        elif op == "PROD":
            acc = acc * x
        elif op == "MIN":
            acc = torch.minimum(acc, x)
        else:
            acc = torch.maximum(acc, x)
    return acc / len(xs) if op == "AVG" else acc


def bfloat16_torch() -> dict:
    """bfloat16 torch CUDA tensors through Send/Recv and every buffer collective, bit for bit against
    torch's own bfloat16 arithmetic; a bfloat16 numpy-less host buffer cannot exist, so none is tried."""
    import torch
    _cp()
    bf = torch.bfloat16
    bad, cases = [], 0

    def same(a: Any, b: Any) -> bool:
        return bool((a.view(torch.int16) == b.view(torch.int16)).all())

    def inp(r: int, n: int, salt: int = 0) -> Any:
        # up to 1000 distinct values, so that sums and products need rounding in 8 bits of mantissa
        return (((torch.arange(n, device="cuda") * 7 + r * 3 + salt) % 1000) * 0.37 + 1).to(bf)

    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        for n in (0, 1, 7, 1000, 1 << 20):
            xs = [inp(r, n) for r in range(size)]
            if size >= 2 and me < 2:
                out = torch.zeros(n, dtype=bf, device="cuda")
                if me == 0:
                    comm.Send(xs[0], 1, tag=n)
                else:
                    comm.Recv(out, 0, tag=n)
                    cases += 1
                    if not same(out, xs[0]):
                        bad.append(f"Send/Recv n={n}")
            for op in ("SUM", "PROD", "MIN", "MAX", "AVG"):
                ref = _torch_bf16_ref(torch, xs, op)
                out = torch.zeros(n, dtype=bf, device="cuda")
                comm.Allreduce(xs[me], out, getattr(shmproxy, op))
                inplace = xs[me].clone()
                comm.Allreduce(shmproxy.IN_PLACE, inplace, getattr(shmproxy, op))
                root = n % size
                rout = torch.zeros(n, dtype=bf, device="cuda") if me == root else None
                comm.Reduce(xs[me], rout, getattr(shmproxy, op), root=root)
                cases += 3
                for what, got in (("Allreduce", out), ("Allreduce in place", inplace)) + (
                        (("Reduce", rout),) if me == root else ()):
                    if not same(got, ref):
                        bad.append(f"{what} {op} bfloat16 n={n}")
            buf = xs[me].clone()
            comm.Bcast(buf, size - 1)
            g = torch.zeros(n * size, dtype=bf, device="cuda")
            comm.Allgather(xs[me], g)
            full = [inp(r, n * size, salt=1) for r in range(size)]
            a = torch.zeros(n * size, dtype=bf, device="cuda")
            comm.Alltoall(full[me], a)
            rs = torch.zeros(n, dtype=bf, device="cuda")
            comm.Reduce_scatter_block(full[me], rs)
            cases += 4
            rsref = _torch_bf16_ref(torch, [f[me * n:(me + 1) * n] for f in full], "SUM")
            for what, got, ref in (("Bcast", buf, xs[size - 1]), ("Allgather", g, torch.cat(xs)),
                                   ("Alltoall", a, torch.cat([f[me * n:(me + 1) * n] for f in full])),
                                   ("Reduce_scatter_block", rs, rsref)):
                if not same(got, ref):
                    bad.append(f"{what} bfloat16 n={n}")
        # mixed bfloat16 and another 16-bit dtype: refused before posting
        try:
            comm.Allreduce(torch.zeros(4, dtype=bf, device="cuda"),
                           torch.zeros(4, dtype=torch.float16, device="cuda"))
            bad.append("bfloat16 with float16 was accepted")
        except shmproxy.InvalidArgument:
            cases += 1
    return {"cases": cases, "bad": bad}


def stream_keyword() -> dict:
    """``stream=``: the op is ordered after the given stream's work, not cupy's current stream's. The
    data is written by a slow kernel on a stream that is not current (cupy non-blocking streams do
    not order with the legacy default stream), so only the keyword orders the op after it; a cupy
    Stream, a torch Stream and a raw handle; a bad stream refused before posting."""
    import torch
    cp = _cp()
    kern = cp.RawKernel(_SPIN, "spin_then_fill")
    n = 1 << 20
    bad, cases = [], 0
    with shmproxy.init() as comm:
        me = comm.rank
        s = cp.cuda.Stream(non_blocking=True)
        ts = torch.cuda.Stream()
        for label, make_stream in (("cupy", lambda: s), ("torch", lambda: ts), ("handle", lambda: s.ptr)):
            st = make_stream()
            ptr = st if isinstance(st, int) else getattr(st, "ptr", None) or st.cuda_stream
            x = cp.zeros(n, cp.float32)
            cp.cuda.Device().synchronize()
            launch = cp.cuda.ExternalStream(ptr)
            if me == 0:
                with launch:
                    kern((64,), (256,), (x, cp.int64(n), cp.float32(7.0), cp.int64(100_000_000)))
                comm.Send(x, 1, stream=st)
            elif me == 1:
                comm.Recv(x, 0, stream=st)
                cases += 1
                if not bool((x == 7.0).all()):
                    bad.append(f"{label}: Send ran before the stream's kernel wrote the data")
            y = cp.zeros(n, cp.float32)
            cp.cuda.Device().synchronize()
            with launch:
                kern((64,), (256,), (y, cp.int64(n), cp.float32(me + 1), cp.int64(50_000_000)))
            out = cp.zeros(n, cp.float32)
            req = comm.Iallreduce(y, out, stream=st)
            req.Wait()
            cases += 1
            expect = comm.size * (comm.size + 1) / 2
            if not bool((out == expect).all()):
                bad.append(f"{label}: Iallreduce saw inputs before the stream wrote them ({float(out[0])})")
        for wrong in ("stream", 1.5, -1):
            try:
                comm.Allreduce(cp.zeros(4, cp.float32), cp.zeros(4, cp.float32), stream=wrong)
                bad.append(f"stream={wrong!r} accepted")
            except shmproxy.InvalidArgument:
                cases += 1
        # host buffers ignore the keyword
        h = np.zeros(4, np.float32)
        comm.Allreduce(np.ones(4, np.float32), h, stream=s)
        cases += 1
        if not (h == comm.size).all():
            bad.append("host Allreduce with stream= differs")
    return {"cases": cases, "bad": bad}


def device_alloc() -> dict:
    """comm.alloc(..., device=<this rank's GPU>): a zeroed cupy array registered once at creation (its
    ops register nothing more), deregistered and freed once dropped."""
    import gc
    cp = _cp()
    gpu = gpu_of_rank()
    bad = []
    with shmproxy.init() as comm:
        dev = comm._posting.device_memory()
        a = comm.alloc(1 << 20, np.float32, device=gpu)
        b = comm.alloc_device((1 << 10, 1 << 10), "float32")
        if not isinstance(a, cp.ndarray) or a.shape != (1 << 20,) or bool(a.any()):
            bad.append(f"alloc: {type(a).__name__} {getattr(a, 'shape', None)} not zeroed")
        registered = len(dev._allocs)
        for i in range(5):
            a.fill(comm.rank + i)
            comm.Allreduce(a, b.reshape(-1))
            if not bool((b == comm.size * i + comm.size * (comm.size - 1) / 2).all()):
                bad.append(f"Allreduce into alloc'd arrays, round {i}")
        if len(dev._allocs) != registered:
            bad.append(f"ops registered more: {registered} -> {len(dev._allocs)}")
        # every rank allocates and drops alike, between barriers: the GPU's free memory is shared
        comm.Barrier()
        free0 = cp.cuda.runtime.memGetInfo()[0]
        comm.Barrier()
        big = comm.alloc(64 << 20, np.float32, device=gpu)
        comm.Bcast(big, 0)
        comm.Barrier()
        free1 = cp.cuda.runtime.memGetInfo()[0]
        comm.Barrier()
        del big
        gc.collect()
        comm.Barrier()
        free2 = cp.cuda.runtime.memGetInfo()[0]
        if len(dev._allocs) != registered or not comm._registry.dead_ids:
            bad.append(f"dropped allocation not queued for DEREGISTER ({len(dev._allocs)}, "
                       f"{comm._registry.dead_ids})")
        probe = comm.alloc(4, np.float32, device=gpu)   # a REGISTER: the DEREGISTER goes before it
        deadline = time.monotonic() + 10
        free3 = free2
        while abs(free3 - free0) > (32 << 20) and time.monotonic() < deadline:
            time.sleep(0.01)   # the progress process closes its mapping on its loop thread
            free3 = cp.cuda.runtime.memGetInfo()[0]
        if free0 - free1 < (256 << 20) or abs(free3 - free0) > (32 << 20):
            bad.append(f"256 MiB alloc: free {free0} -> {free1} -> dropped {free2} -> deregistered "
                       f"{free3} (not returned)")
        res_free = {"MiB_used_after_drop": (free0 - free2) / 2**20,
                    "MiB_used_after_deregister": (free0 - free3) / 2**20}
        del probe
        comm.Allreduce(a, b.reshape(-1))
        try:
            comm.alloc(4, np.float32, device=99)
            bad.append("device 99 accepted")
        except shmproxy.InvalidArgument:
            pass
    return {"bad": bad, **res_free}


def overlap() -> dict:
    """A nonblocking collective while the rank's own kernel runs on another stream: times alone and
    together. Ranks and the progress process are separate contexts on one GPU (no MPS), which the
    GPU time-slices: what this measures is how much of the collective the kernel's time hides."""
    cp = _cp()
    kern = cp.RawKernel(_SPIN, "spin_then_fill")
    n = 64 << 20                       # 256 MiB float32
    cycles = 60_000_000                # a few tens of ms
    res: dict = {"bad": []}
    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        x = cp.full(n, me + 1, cp.float32)
        outs = [cp.zeros(n, cp.float32) for _ in range(2)]
        side = cp.cuda.Stream(non_blocking=True)
        z = cp.zeros(1024, cp.float32)
        nreq = 8

        def coll() -> None:
            reqs = [comm.Iallreduce(x, outs[i % 2]) for i in range(nreq)]
            for r in reqs:
                r.Wait()

        def kernel() -> None:
            with side:
                kern((1,), (32,), (z, cp.int64(z.size), cp.float32(1.0), cp.int64(cycles)))

        def timed(fn: Any) -> float:
            cp.cuda.Device().synchronize()
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            side.synchronize()
            return time.perf_counter() - t0

        timed(coll)
        timed(kernel)
        t_coll = min(timed(coll) for _ in range(3))
        t_kernel = min(timed(kernel) for _ in range(3))

        def both() -> None:
            kernel()
            coll()
        t_both = min(timed(both) for _ in range(3))
        if not bool((outs[0] == size * (size + 1) / 2).all()):
            res["bad"].append("Iallreduce during the kernel: wrong result")
        res.update(coll_ms=t_coll * 1e3, kernel_ms=t_kernel * 1e3, both_ms=t_both * 1e3,
                   hidden_fraction=(t_coll + t_kernel - t_both) / t_coll)
    return res


def small_fast() -> dict:
    """Small blocking collectives on device arrays, which run between the ranks through host copies
    (shmproxy.rank.fastpath): against cupy references for several dtypes, in place and not; work
    queued on a non-default stream before the call (cupy's current stream, or ``stream=``) is seen,
    and the result is in place, for any stream, once the call returns; host buffers on rank 0 and
    device buffers elsewhere in one small call; the same mix above the fast path's limit is refused
    on every rank alike, and the communicator goes on."""
    from tests.bodies_gpu import _input, _ref_reduce, _same
    cp = _cp()
    kern = cp.RawKernel(_SPIN, "spin_then_fill")
    bad, cases = [], 0
    with shmproxy.init() as comm:
        me, size, fast = comm.rank, comm.size, comm._fast_bytes
        for dtype in ("int32", "int64", "float32", "float64", "uint8", "float16", "complex64"):
            for n in (1, 2, 7, 64):
                xs = [_input(cp, r, n, dtype) for r in range(size)]
                ops = ["SUM", "PROD", "AVG"] if dtype.startswith("complex") else (
                    ["SUM", "MAX", "MIN", "PROD"] + (["AVG"] if dtype[0] == "f" else []))
                for op in ops:
                    o = getattr(shmproxy, op)
                    ref = _ref_reduce(cp, xs, op).astype(dtype)
                    out = cp.zeros(n, dtype)
                    comm.Allreduce(xs[me], out, o)
                    inplace = xs[me].copy()
                    comm.Allreduce(shmproxy.IN_PLACE, inplace, o)
                    root = (n + len(op)) % size
                    rout = cp.zeros(n, dtype) if me == root else None
                    comm.Reduce(xs[me], rout, o, root=root)
                    rin = xs[me].copy()
                    at = me == root
                    comm.Reduce(shmproxy.IN_PLACE if at else rin, rin if at else None, o, root)
                    cases += 4
                    got = [("Allreduce", out), ("Allreduce in place", inplace)]
                    if me == root:
                        got += [("Reduce", rout), ("Reduce in place", rin)]
                    for what, g in got:
                        if not _same(cp, g, ref, op):
                            bad.append(f"{what} {op} {dtype} n={n}")
                for root in range(size):
                    buf = xs[me].copy()
                    comm.Bcast(buf, root)
                    cases += 1
                    if not bool((buf == xs[root]).all()):
                        bad.append(f"Bcast root {root} {dtype} n={n}")
                comm.Barrier()

        # stream order: a slow kernel writes the input on a non-blocking stream just before the call
        s = cp.cuda.Stream(non_blocking=True)
        expect = size * (size + 1) / 2

        def seen_elsewhere(a: Any, value: float) -> bool:   # read on a stream the call did not use
            with cp.cuda.Stream(non_blocking=True):
                return bool((a == value).all())

        for how in ("current", "keyword"):
            x, out = cp.zeros(2, cp.float32), cp.zeros(2, cp.float32)
            cp.cuda.Device().synchronize()
            with s:
                kern((1,), (32,), (x, cp.int64(2), cp.float32(me + 1), cp.int64(50_000_000)))
            if how == "current":
                with s:
                    comm.Allreduce(x, out)
            else:
                comm.Allreduce(x, out, stream=s)
            cases += 1
            if not seen_elsewhere(out, expect):
                bad.append(f"Allreduce ({how} stream) saw its input before the stream wrote it, or its "
                           f"result was not in place on return: {out.get()}")
            # the output side: a kernel queued on the stream before a Bcast writes the buffer first,
            # and the Bcast's result lands after it
            buf = cp.full(2, 5.0 if me == 0 else 0.0, cp.float32)
            cp.cuda.Device().synchronize()
            if me:
                with s:
                    kern((1,), (32,), (buf, cp.int64(2), cp.float32(99.0), cp.int64(50_000_000)))
            if how == "current":
                with s:
                    comm.Bcast(buf, 0)
            else:
                comm.Bcast(buf, 0, stream=s)
            cases += 1
            if not seen_elsewhere(buf, 5.0):
                bad.append(f"Bcast ({how} stream) result overwritten by earlier stream work: {buf.get()}")

        # host buffers on rank 0, device buffers on the others, in one small call
        def mk(vals: list) -> Any:
            a = np.array(vals, np.float32)
            return a if me == 0 else cp.asarray(a)

        buf = mk([me, me, me])
        comm.Bcast(buf, size - 1)
        comm.Barrier()
        cases += 1
        if not (cp.asnumpy(buf) == size - 1).all():
            bad.append(f"mixed ranks: Bcast {cp.asnumpy(buf)}")
        # ... and above the limit: the progress process refuses the mix on every rank alike
        big = fast // 4 + 1024
        raised = None
        try:
            comm.Allreduce(mk([1] * big), mk([0] * big))
        except shmproxy.ProxyError as exc:
            raised = type(exc).__name__
        out = cp.zeros(2, cp.float32)
        comm.Allreduce(cp.ones(2, cp.float32), out)
        cases += 1
        if not seen_elsewhere(out, size):
            bad.append("the communicator did not go on after the refused mix")
        # last (a mismatch fails the communicator): a small Allreduce and Reduce, mixed
        try:
            out = mk([0, 0])
            comm.Allreduce(mk([me + 1, 1]), out)
            red = mk([0, 0]) if me == size - 1 else None
            comm.Reduce(mk([me + 1, 2]), red, shmproxy.SUM, size - 1)
            mixed = "ok"
            if not (cp.asnumpy(out) == [expect, size]).all():
                bad.append(f"mixed ranks: Allreduce {cp.asnumpy(out)}")
            if me == size - 1 and not (cp.asnumpy(red) == [expect, 2 * size]).all():
                bad.append(f"mixed ranks: Reduce {cp.asnumpy(red)}")
        except shmproxy.ProxyError as exc:
            mixed = type(exc).__name__
    return {"cases": cases, "bad": bad, "fast": fast, "large_mix": raised, "mixed_reduce": mixed}


def mpi_layer_device_arrays() -> dict:
    """shmproxy.MPI with cupy arrays (device memory: handed to the native layer, as a CUDA-aware MPI
    takes them): Send/Recv, Allreduce in the forms buf and [buf, its datatype], Bcast, a result
    against cupy's; a counted form raises NotImplementedError."""
    import cupy as cp
    from shmproxy import MPI
    comm = MPI.COMM_WORLD
    r, n = comm.rank, comm.size
    bad = []
    x = cp.full(1000, r + 1, cp.float32)
    y = cp.zeros(1000, cp.float32)
    comm.Allreduce(x, [y, MPI.FLOAT], op=MPI.SUM)
    if not bool((y == n * (n + 1) / 2).all()):
        bad.append(("Allreduce", float(y[0])))
    b = cp.arange(64, dtype=cp.int64) if r == 0 else cp.zeros(64, cp.int64)
    comm.Bcast(b, root=0)
    if not bool((b == cp.arange(64)).all()):
        bad.append(("Bcast", int(b[1])))
    if n >= 2:
        if r == 0:
            comm.Send(cp.full(300, 5.0), 1, 3)
        elif r == 1:
            got = cp.zeros(300)
            st = MPI.Status()
            comm.Recv(got, 0, 3, st)
            if not bool((got == 5.0).all()) or st.Get_source() != 0:
                bad.append(("Recv", float(got[0]), st.Get_source()))
    try:
        comm.Allreduce(MPI.IN_PLACE, [y, 10, MPI.FLOAT])
        bad.append(("counted", "no error"))
    except NotImplementedError:
        pass
    comm.Barrier()
    return {"bad": bad}


def repeated_buffers() -> dict:
    """The same device arrays through many collectives, as a training loop calls them (the rank
    remembers a checked call, the progress process a small reduction's launch): new contents each
    time, on a busy and on an idle stream, the op and the root changing, IN_PLACE, then a new
    allocation where a freed one was."""
    cp = _cp()
    bad, cases = [], 0
    with shmproxy.init() as comm:
        me, n = comm.rank, comm.size
        x, y = cp.zeros(5, cp.float32), cp.zeros(5, cp.float32)
        ops = (shmproxy.SUM, shmproxy.MAX, shmproxy.MIN)
        for i in range(24):
            x.fill(me + i)
            if i % 2:
                cp.cuda.get_current_stream().synchronize()   # an idle stream: the op orders after nothing
            vals = [r + i for r in range(n)]
            comm.Allreduce(x, y, op=ops[i % 3])
            want = (sum(vals), max(vals), min(vals))[i % 3]
            if not bool((y == want).all()):
                bad.append(("Allreduce", i, float(y[0]), want))
            root = i % n
            comm.Reduce(x, y if me == root else None, root=root)
            if me == root and not bool((y == sum(vals)).all()):
                bad.append(("Reduce", i, float(y[0]), sum(vals)))
            y.fill(me + 1)
            comm.Allreduce(shmproxy.IN_PLACE, y)
            if not bool((y == n * (n + 1) // 2).all()):
                bad.append(("IN_PLACE", i, float(y[0])))
            cases += 3
        remembered = len(comm._posting.device.posts)
        # the same messages again and again (the progress process launches a repeated copy as a graph);
        # the tag each array goes with alternates, so a send remembered without its tag, or a copy
        # replayed into the other receive buffer, delivers the two arrays' values swapped
        a, d = cp.zeros(1000, cp.float32), cp.zeros(1000, cp.float32)
        b, c = cp.zeros(1000, cp.float32), cp.zeros(1000, cp.float32)
        right, left = (me + 1) % n, (me - 1) % n
        for i in range(8):
            a.fill(me * 100 + i)
            d.fill(-(me * 100 + i))
            if i % 2:
                cp.cuda.get_current_stream().synchronize()
            ta, td = (7, 8) if i % 2 == 0 else (8, 7)
            reqs = [comm.Irecv(b, left, tag=7), comm.Irecv(c, left, tag=8),
                    comm.Isend(a, right, tag=ta), comm.Isend(d, right, tag=td)]
            for q in reqs:
                q.Wait()
            sa = left * 100 + i   # what the left neighbour's a held; its d held -sa
            for got, tag in ((b, 7), (c, 8)):
                want = sa if tag == ta else -sa
                if not bool((got == want).all()):
                    bad.append(("Send/Recv", i, tag, float(got[0]), want))
                cases += 1
        # the same work twice at once: the second finds the first's graph in flight and goes directly,
        # published by the loop, beside the first that its graph publishes
        for i in range(3):
            x.fill(me + 7 + i)
            a.fill(me * 100 + 50 + i)
            reqs = [comm.Iallreduce(x, y), comm.Iallreduce(x, y), comm.Irecv(b, left, tag=9),
                    comm.Irecv(c, left, tag=9), comm.Isend(a, right, tag=9), comm.Isend(a, right, tag=9)]
            for q in reqs:
                q.Wait()
            if not bool((y == sum(r + 7 + i for r in range(n))).all()):
                bad.append(("twice Iallreduce", i, float(y[0])))
            for got in (b, c):
                if not bool((got == left * 100 + 50 + i).all()):
                    bad.append(("twice Isend", i, float(got[0])))
            cases += 2
        gpus = _dumped_gpus(comm) if me == 0 else None
        comm.Barrier()   # no rank frees memory (which drops registrations, and graphs) during the dump
        del x, y, a, b, c, d
        cp.get_default_memory_pool().free_all_blocks()
        x, y = cp.full(5, me + 100, cp.float32), cp.zeros(5, cp.float32)
        comm.Allreduce(x, y)
        if not bool((y == sum(r + 100 for r in range(n))).all()):
            bad.append(("new allocation", float(y[0])))
    return {"bad": bad, "cases": cases, "remembered": remembered, "gpus": gpus}


def _dumped_gpus(comm: Any) -> list:
    """What the progress process's signalled dump says of its GPUs (SHMPROXY_DUMP_SIGNAL must be set)."""
    return _dumped_state(comm)["gpus"]


def _dumped_state(comm: Any) -> dict:
    """The progress process's own view in its signalled dump (SHMPROXY_DUMP_SIGNAL must be set)."""
    import json
    import os
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "shmproxy.tools.dump_cli", "--pid", str(comm._proxy.pid), "--json", "--signal"]
    doc = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout)
    signalled = doc["processes"][0]
    os.unlink(signalled["dump_file"])   # output a person asked for: the test's to remove
    return signalled["state"]["in_process"]
