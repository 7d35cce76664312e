"""Rank bodies of tests/test_gpu_torch.py: the "shmproxy" torch.distributed backend on CUDA tensors,
ranks sharing one GPU. References are gloo's results in the same job: gloo on the same data as CPU
tensors for the op-by-op comparison (gloo's CUDA support does not cover every op), gloo on CUDA for
DDP. Each body returns a JSON-encodable report listing every mismatch.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from tests.bodies_torch import _cases, _groups, _model

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "int64": torch.int64}
SLEEP_CYCLES = 100_000_000     # torch.cuda._sleep: tens of milliseconds of one GPU thread spinning


def _cpu(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return [_cpu(y) for y in x]
    return x.detach().cpu()


def _close(a: Any, b: Any, exact: bool) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, exact) for x, y in zip(a, b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if exact:
        return torch.equal(a, b)
    return torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def ops_vs_gloo(n: int = 1000) -> dict[str, Any]:
    """Every op of the process group on CUDA tensors against gloo on CPU copies of the same data."""
    torch.cuda.set_device(0)
    gloo, shm = _groups()
    diffs, gloo_refused, ran = [], [], 0
    for dname, dtype in DTYPES.items():
        ref_cases, cuda_cases = _cases(dtype, n, "cpu"), _cases(dtype, n, "cuda")
        for name, run in cuda_cases.items():
            try:
                ref = ref_cases[name](gloo)
            except RuntimeError as exc:   # gloo lacks it for this dtype: nothing to compare with
                gloo_refused.append(f"{name} {dname}: {str(exc).splitlines()[0][:120]}")
                continue
            got = run(shm)
            ran += 1
            if not _close(_cpu(ref), _cpu(got), exact="AVG" not in name):
                diffs.append(f"{name} {dname}")
    dist.barrier(group=shm)
    dist.barrier()
    dist.destroy_process_group()
    return {"diffs": diffs, "gloo_refused": gloo_refused, "ran": ran}


def stream_order() -> dict[str, Any]:
    """Work queued on a stream before the call is seen by the op; after ``wait`` the result is seen by
    the current stream and by any stream ordered after it (NCCL's contract), a Future's in its
    callback; a call on a side stream waits for that stream only."""
    torch.cuda.set_device(0)
    _gloo, shm = _groups()
    me, ws = dist.get_rank(), dist.get_world_size()
    want = float(sum(range(1, ws + 1)))
    out: dict[str, Any] = {"bad": []}
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    n = 1 << 22

    def check(name: str, t: torch.Tensor, value: float) -> None:
        other.wait_stream(torch.cuda.current_stream())   # ordered after the current stream's wait
        with torch.cuda.stream(other):
            got = t.float().min().item(), t.float().max().item()
        if got != (value, value):
            out["bad"].append(f"{name}: {got} instead of {value}")

    for trial in range(3):
        # 1. fill queued behind a long kernel on a side stream, the call made under that stream
        t = torch.zeros(n, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            t.fill_(me + 1)
            w = dist.all_reduce(t, group=shm, async_op=True)
            if trial == 0:
                out["pending_right_after_call"] = not w.is_completed()
        w.wait()
        check(f"side stream trial {trial}", t, want)
        # 2. the same on the current (default) stream, synchronous call
        u = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
        torch.cuda._sleep(SLEEP_CYCLES)
        u.fill_(me + 1)
        dist.all_reduce(u, group=shm)
        check(f"default stream trial {trial}", u, want)
        # 3. a Future's callback (the completion thread) sees the result on the device
        v = torch.zeros(n, device="cuda")
        torch.cuda._sleep(SLEEP_CYCLES)
        v.fill_(me + 1)
        fut = dist.all_reduce(v, group=shm, async_op=True).get_future()
        seen = fut.then(lambda f: float(f.value()[0].min().item())).wait()
        if seen != want:
            out["bad"].append(f"future trial {trial}: callback saw {seen}")
        # 4. copies back at completion (an all_gather into non-contiguous list outputs)
        src = torch.zeros(64, 32, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            src.fill_(me + 1)
            outs = [torch.zeros(32, 64, device="cuda").t() for _ in range(ws)]
            w = dist.all_gather(outs, src, group=shm, async_op=True)
        w.wait()
        for r, o in enumerate(outs):
            check(f"all_gather non-contiguous trial {trial} block {r}", o, float(r + 1))
        # 5. send/recv ordered after the sender's stream
        buf = torch.zeros(n, device="cuda", dtype=torch.int64)
        if me == 0:
            torch.cuda._sleep(SLEEP_CYCLES)
            buf.fill_(7 + trial)
            dist.send(buf, dst=1, group=shm)
        elif me == 1:
            dist.recv(buf, src=0, group=shm)
            check(f"send/recv trial {trial}", buf, float(7 + trial))
    dist.barrier(group=shm)
    dist.destroy_process_group()
    return out


def wait_lets_the_host_go() -> dict[str, Any]:
    """``Work.wait`` on CUDA tensors as NCCL's: with the stream busy (a long kernel queued before the
    call), wait returns while the kernel still runs, and work queued after it sees the result; the
    blocking call alike; a small call too; and the Work's Future with a callback chained (DDP's
    way), whose wait lets the host go too."""
    torch.cuda.set_device(0)
    _gloo, shm = _groups()
    me, ws = dist.get_rank(), dist.get_world_size()
    want = float(sum(range(1, ws + 1)))
    out: dict[str, Any] = {"bad": [], "waited_s": []}
    torch.cuda.synchronize()
    t0 = time.monotonic()
    torch.cuda._sleep(SLEEP_CYCLES)
    torch.cuda.synchronize()
    out["sleep_s"] = time.monotonic() - t0
    for n in (1 << 22, 2):   # the first calls set up (registrations, the words, streams): not timed
        dist.all_reduce(torch.zeros(n, device="cuda"), group=shm)
        fut = dist.all_reduce(torch.zeros(n, device="cuda"), group=shm, async_op=True).get_future()
        fut.then(lambda f: f.value()[0] * 2).wait()
    out["forms"] = []
    for trial in range(3):
        for n, form in ((1 << 22, "async"), (1 << 22, "blocking"), (2, "blocking"), (1 << 22, "future")):
            x = torch.zeros(n, device="cuda")
            torch.cuda.synchronize()
            dist.barrier(group=shm)
            torch.cuda._sleep(SLEEP_CYCLES)
            x.fill_(me + 1)
            t0 = time.monotonic()
            doubled = None
            if form == "async":
                dist.all_reduce(x, group=shm, async_op=True).wait()
            elif form == "future":
                # DDP's way: a callback chained on the Work's Future, then a wait on the chained one
                fut = dist.all_reduce(x, group=shm, async_op=True).get_future()
                doubled = fut.then(lambda f: f.value()[0] * 2)
                doubled.wait()
            else:
                dist.all_reduce(x, group=shm)
            out["waited_s"].append(time.monotonic() - t0)
            out["forms"].append(f"{form} {n}")
            # queued after the wait: runs once the result is there
            y = x * 2 if doubled is None else doubled.value()
            torch.cuda.synchronize()
            got = float(y.min().item()), float(y.max().item())
            if got != (2 * want, 2 * want):
                out["bad"].append(f"trial {trial} {form} n={n}: {got}, not {2 * want}")
    dist.barrier(group=shm)
    dist.destroy_process_group()
    return out


def blocking_loop(iters: int = 300, nbytes: int = 1 << 20) -> dict[str, Any]:
    """A training loop's plainest shape: blocking all_reduce calls one after another, each followed
    by torch.cuda.synchronize(), one rank per GPU where there are two. Each wait() arms a word its
    stream waits on while the completion thread may be completing the same Work: a word armed after
    the completion looked would leave the stream waiting forever (the harness's timeout says so)."""
    torch.cuda.set_device(int(os.environ["RANK"]) % torch.cuda.device_count())   # torchrun's
    _gloo, shm = _groups()
    # MAX keeps the values as they are from the first call on: no kernel of ours between the calls,
    # so each call finds its stream idle, as after a synchronize (the window of the race)
    t = torch.full((nbytes // 4,), float(dist.get_rank() + 1), device="cuda")
    bad = []
    for i in range(iters):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=shm)
        torch.cuda.synchronize()
        if i % 50 == 0 and not bool((t == 2.0).all()):
            bad.append(f"call {i}: {t[:4].tolist()}")
    dist.barrier(group=shm)
    dist.destroy_process_group()
    return {"bad": bad, "device": torch.cuda.current_device()}


def mixed_is_refused() -> dict[str, str]:
    """CPU and CUDA tensors in one call: a clear error, nothing posted; the group stays usable."""
    torch.cuda.set_device(0)
    _gloo, shm = _groups()
    ws = dist.get_world_size()
    out: dict[str, str] = {}

    def attempt(name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            out[name] = "no error"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    cuda_in = torch.ones(4, device="cuda")
    attempt("into tensor", lambda: dist.all_gather_into_tensor(torch.empty(4 * ws), cuda_in, group=shm))
    attempt("list", lambda: dist.all_gather([torch.empty(4), *[torch.empty(4, device="cuda")] * (ws - 1)],
                                            cuda_in, group=shm))
    attempt("alltoall", lambda: dist.all_to_all_single(torch.empty(4 * ws, device="cuda"),
                                                       torch.ones(4 * ws), group=shm))
    ok = torch.ones(4, device="cuda")
    dist.all_reduce(ok, group=shm)
    out["still usable"] = str(float(ok[0]))
    dist.barrier(group=shm)
    dist.destroy_process_group()
    return out


def _train(group: Any, steps: int, hook: bool) -> list[torch.Tensor]:
    model = torch.nn.parallel.DistributedDataParallel(_model(7).cuda(), device_ids=[0], process_group=group,
                                                      bucket_cap_mb=0.01)
    if hook:
        def allreduce_avg(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations only
            t = bucket.buffer()
            t.div_(dist.get_world_size(group))
            fut = dist.all_reduce(t, group=group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])
        model.register_comm_hook(None, allreduce_avg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        xb, yb = torch.randn(16, 32, generator=g).cuda(), torch.randn(16, 8, generator=g).cuda()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().cpu() for p in model.parameters()]


def ddp_equal(steps: int = 20, hook: bool = False) -> dict[str, Any]:
    """The same DDP training of a CUDA model over gloo and over shmproxy: the largest weight difference."""
    torch.cuda.set_device(0)
    gloo, shm = _groups()
    a = _train(gloo, steps, hook)
    b = _train(shm, steps, hook)
    diff = max(float((x - y).abs().max()) for x, y in zip(a, b))
    dist.barrier(group=shm)
    dist.destroy_process_group()
    return {"max_diff": diff, "params": len(a)}


def killed_rank(kill_at: int = 5, ddp: bool = True) -> dict[str, Any]:
    """shmproxy as the default group on CUDA tensors; rank 1 SIGKILLs itself mid-training (or mid-way
    through a loop of all_reduce); the survivor must raise."""
    torch.cuda.set_device(0)
    dist.init_process_group("shmproxy")
    me = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(_model(3).cuda(), device_ids=[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.ones(1 << 20, device="cuda")
    try:
        for step in range(1000):
            if me == 1 and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if not ddp:
                dist.all_reduce(x)
                continue
            loss = model(torch.randn(8, 32, device="cuda")).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        # wait() on CUDA lets the host go on (NCCL's semantics): a loop of all_reduce may end before
        # the death is known, and then the group's next call raises it
        dist.barrier()
    except Exception as exc:   # the survivor's error: what the test checks
        return {"step": step, "error": f"{type(exc).__name__}: {exc}"}
    return {"step": -1, "error": ""}
