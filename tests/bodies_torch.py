"""Rank bodies of tests/test_torch_backend.py: the "shmproxy" torch.distributed backend against gloo,
in the same job (gloo is the default group, shmproxy a group over the same ranks, or the reverse).

Each body returns a JSON-encodable report (mismatches as strings), so that the test shows every
difference at once instead of the first assertion.
"""
from __future__ import annotations

import gc
import os
import signal
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

import shmproxy.torch  # noqa: F401  (registers the backend)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
          "bfloat16": torch.bfloat16}
R = dist.ReduceOp


def _groups() -> tuple[Any, Any]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    return dist.group.WORLD, dist.new_group(backend="shmproxy")


def _data(dtype: torch.dtype, n: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + salt)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 4).to(dtype)
    return torch.randint(-3, 4, (n,), generator=g).to(dtype)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _cases(dtype: torch.dtype, n: int, device: str = "cpu") -> dict[str, Callable[[Any], Any]]:
    """Each case runs one op on a group and returns the tensors it produced (on ``device``)."""
    ws, me = dist.get_world_size(), dist.get_rank()
    x = _data(dtype, n * ws, 1).to(device)

    def allreduce(op: Any) -> Callable[[Any], Any]:
        def run(g: Any) -> Any:
            t = x.clone()
            dist.all_reduce(t, op=op, group=g)
            return t
        return run

    def bcast(root: int) -> Callable[[Any], Any]:
        def run(g: Any) -> Any:
            t = x.clone()
            dist.broadcast(t, src=root, group=g)
            return t
        return run

    def gather_list(g: Any) -> Any:
        outs = [torch.empty(n * ws, dtype=dtype, device=device) for _ in range(ws)]
        dist.all_gather(outs, x, group=g)
        return outs

    def gather_tensor(g: Any) -> Any:
        out = torch.empty(n * ws * ws, dtype=dtype, device=device)
        dist.all_gather_into_tensor(out, x, group=g)
        return out

    def rs_list(op: Any) -> Callable[[Any], Any]:
        def run(g: Any) -> Any:
            out = torch.empty(n, dtype=dtype, device=device)
            dist.reduce_scatter(out, list(x.chunk(ws)), op=op, group=g)
            return out
        return run

    def rs_tensor(g: Any) -> Any:
        out = torch.empty(n, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(out, x, group=g)
        return out

    def a2a_equal(g: Any) -> Any:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=g)
        return out

    def a2a_uneven(g: Any) -> Any:
        # Rank r sends (r + q + 1) rows of 3 elements to rank q.
        ins = [me + q + 1 for q in range(ws)]
        rows = _data(dtype, 3 * sum(ins), 2).view(-1, 3).to(device)
        outs = [q + me + 1 for q in range(ws)]
        out = torch.empty(sum(outs), 3, dtype=dtype, device=device)
        dist.all_to_all_single(out, rows, output_split_sizes=outs, input_split_sizes=ins, group=g)
        return out

    def a2a_list(g: Any) -> Any:
        ins = [_data(dtype, 5, 3 + q).to(device) for q in range(ws)]   # gloo takes equal sizes only
        outs = [torch.empty(5, dtype=dtype, device=device) for _ in range(ws)]
        try:
            dist.all_to_all(outs, ins, group=g)
        except RuntimeError as exc:
            # gloo before torch 2.11 has no list all_to_all ("does not support alltoall"): the reference
            # is the same exchange through its all_to_all_single, so the supported range's oldest
            # release still checks shmproxy's list form against something
            if dist.get_backend(g) != "gloo" or "does not support alltoall" not in str(exc):
                raise
            flat = torch.empty(5 * ws, dtype=dtype, device=device)
            dist.all_to_all_single(flat, torch.cat(ins), group=g)
            outs = list(flat.split(5))
        return outs

    def reduce_root1(g: Any) -> Any:
        t = x.clone()
        dist.reduce(t, dst=1, op=R.SUM, group=g)
        return t if me == 1 else torch.zeros(0, device=device)

    def gather_root0(g: Any) -> Any:
        outs = [torch.empty(n * ws, dtype=dtype, device=device) for _ in range(ws)] if me == 0 else None
        dist.gather(x, outs, dst=0, group=g)
        return outs if me == 0 else []

    def scatter_root1(g: Any) -> Any:
        out = torch.empty(n, dtype=dtype, device=device)
        dist.scatter(out, list(x.chunk(ws)) if me == 1 else None, src=1, group=g)
        return out

    def p2p(g: Any) -> Any:
        peer = (me + 1) % ws
        got = torch.empty_like(x)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (me + 1) % ws, g, tag=5),
                                       dist.P2POp(dist.irecv, got, (me - 1) % ws, g, tag=5)])
        for r in reqs:
            r.wait()
        back = torch.empty_like(x)
        if me == 0:
            dist.send(got, dst=peer, group=g, tag=9)
            dist.recv(back, src=(me - 1) % ws, group=g, tag=9)
        else:
            dist.recv(back, src=(me - 1) % ws, group=g, tag=9)
            dist.send(got, dst=peer, group=g, tag=9)
        return [got, back]

    def noncontig(g: Any) -> Any:
        t = x.clone().view(2, -1).t()   # a transposed view: not contiguous
        dist.all_reduce(t, op=R.SUM, group=g)
        return t.contiguous()

    def coalesced(g: Any) -> Any:
        ts = [x.clone(), (x[: n] * 2).clone()]
        dist.all_reduce_coalesced(ts, group=g)
        return ts

    cases: dict[str, Callable[[Any], Any]] = {
        "all_reduce SUM": allreduce(R.SUM), "all_reduce PRODUCT": allreduce(R.PRODUCT),
        "all_reduce MIN": allreduce(R.MIN), "all_reduce MAX": allreduce(R.MAX),
        "broadcast root 0": bcast(0), "broadcast root 1": bcast(1),
        "all_gather list": gather_list, "all_gather_into_tensor": gather_tensor,
        "reduce_scatter list SUM": rs_list(R.SUM), "reduce_scatter list MAX": rs_list(R.MAX),
        "reduce_scatter_tensor": rs_tensor,
        "all_to_all_single equal": a2a_equal, "all_to_all_single uneven": a2a_uneven,
        "all_to_all list": a2a_list,
        "reduce dst 1": reduce_root1, "gather dst 0": gather_root0, "scatter src 1": scatter_root1,
        "send/recv and batch_isend_irecv": p2p, "all_reduce non-contiguous": noncontig,
        "all_reduce_coalesced": coalesced,
    }
    if dtype.is_floating_point:
        def avg(g: Any) -> Any:
            t = x.clone()
            if g is dist.group.WORLD:   # gloo has no AVG: its SUM, divided by the size
                dist.all_reduce(t, op=R.SUM, group=g)
                return t / ws
            dist.all_reduce(t, op=R.AVG, group=g)
            return t
        cases["all_reduce AVG"] = avg
    return cases


def ops_vs_gloo(n: int = 1000) -> dict[str, Any]:
    """Every op and dtype on gloo and on shmproxy; the cases whose results differ, and gloo's refusals."""
    gloo, shm = _groups()
    diffs, gloo_refused, ran = [], [], 0
    for dname, dtype in DTYPES.items():
        for name, run in _cases(dtype, n).items():
            try:
                ref = run(gloo)
            except RuntimeError as exc:   # gloo lacks it for this dtype: nothing to compare with
                gloo_refused.append(f"{name} {dname}: {str(exc).splitlines()[0][:120]}")
                continue
            got = run(shm)
            ran += 1
            if not _same(ref, got):
                diffs.append(f"{name} {dname}")
    dist.barrier(group=shm)
    dist.barrier()
    dist.destroy_process_group()
    return {"diffs": diffs, "gloo_refused": gloo_refused, "ran": ran}


def async_futures() -> dict[str, Any]:
    """async_op=True: Work.wait/is_completed/exception, futures with chained callbacks."""
    _gloo, shm = _groups()
    me, ws = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    t = torch.full((1 << 16,), float(me + 1))
    work = dist.all_reduce(t, group=shm, async_op=True)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    out["wait"] = work.wait(timeout=timedelta(seconds=30))
    out["completed"] = work.is_completed()
    out["exception"] = repr(work.exception())
    out["chained"] = float(fut.wait()[0])
    out["value"] = float(t[0])
    # Several in flight at once, completed in any order.
    ts = [torch.full((1000 * (i + 1),), float(i)) for i in range(6)]
    works = [dist.all_reduce(x, group=shm, async_op=True) for x in ts]
    torch.futures.wait_all([w.get_future() for w in works])
    out["many"] = [float(x[0]) for x in ts]
    # irecv posted before the matching isend exists; the receive's Future completes when it arrives.
    got = torch.zeros(4)
    rw = dist.irecv(got, src=(me - 1) % ws, group=shm, tag=3)
    sw = dist.isend(torch.full((4,), float(me)), dst=(me + 1) % ws, group=shm, tag=3)
    sw.wait()
    rw.get_future().wait()
    out["irecv"] = float(got[0])
    # recv from any source: torch returns the sender.
    anyt = torch.zeros(2)
    if me == 0:
        out["any_source"] = dist.recv(anyt, group=shm, tag=4)
    else:
        dist.send(torch.ones(2), dst=0, group=shm, tag=4)
    # A tensor in the group's registered memory (no staging copy), bfloat16 included.
    for dtype in (torch.float32, torch.bfloat16):
        reg = shm.alloc_tensor((3, 5), dtype)
        reg.fill_(me + 1)
        dist.all_reduce(reg, group=shm)
        out[f"registered {dtype}"] = float(reg[2, 4])
    # More groups: a second shmproxy group over every rank, and one of rank 1 alone.
    other = dist.new_group(backend="shmproxy")
    alone = dist.new_group([1], backend="shmproxy")
    t2 = torch.ones(3)
    dist.all_reduce(t2, group=other)
    if me == 1:
        dist.all_reduce(t2, group=alone)
    out["groups"] = float(t2[0])
    dist.barrier(group=shm)
    dist.destroy_process_group()
    return out


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _train(group: Any, steps: int, no_sync_every: int = 0, hook: bool = False) -> list[torch.Tensor]:
    model = torch.nn.parallel.DistributedDataParallel(_model(7), process_group=group, bucket_cap_mb=0.01)
    if hook:
        def allreduce_avg(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations only
            t = bucket.buffer()
            t.div_(dist.get_world_size(group))
            fut = dist.all_reduce(t, group=group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])
        model.register_comm_hook(None, allreduce_avg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for step in range(steps):
        xb, yb = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        if no_sync_every and step % no_sync_every:
            with model.no_sync():
                torch.nn.functional.mse_loss(model(xb), yb).backward()
            continue
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _train_wide(group: Any, width: int, seed: int, data_seed: int, steps: int) -> list[torch.Tensor]:
    """DDP training of a wider MLP in 1 MB buckets (large tensors: what adoption and the group's
    staging see); the weights after ``steps`` steps."""
    torch.manual_seed(seed)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(data_seed)
    for _ in range(steps):
        xb, yb = torch.randn(8, width, generator=g), torch.randn(8, 4, generator=g)
        torch.nn.functional.mse_loss(ddp(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ddp.parameters()]


def ddp_equal(steps: int = 20, no_sync_every: int = 0, hook: bool = False) -> dict[str, Any]:
    """The same DDP training over gloo and over shmproxy: the largest weight difference (0 = bitwise)."""
    gloo, shm = _groups()
    a = _train(gloo, steps, no_sync_every, hook)
    b = _train(shm, steps, no_sync_every, hook)
    diff = max(float((x - y).abs().max()) for x, y in zip(a, b))
    dist.barrier(group=shm)
    dist.destroy_process_group()
    return {"max_diff": diff, "params": len(a)}


def _train_fsdp2(group: Any, steps: int, device: str = "cpu") -> tuple[list[float], list[torch.Tensor]]:
    """fully_shard (FSDP2) on a mesh of ``device`` ("cpu", "cuda") over ``group``: each Linear a unit,
    then the whole model; the mean loss of every step and the full weights at the end (on the CPU)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh.from_group(group, device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(48, 48), torch.nn.ReLU())])
    model = model.to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(16, 48, generator=g).to(device)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t, group=group)
        losses.append(float(t))
    weights = [p.full_tensor().detach().cpu() for p in model.parameters()]   # DTensor shards, gathered
    return losses, weights


def fsdp2_equal(steps: int = 8) -> dict[str, Any]:
    """The same FSDP2 training over gloo and over shmproxy (all_gather_into_tensor and
    reduce_scatter_tensor of the shards, found through the group's name): losses and weights."""
    gloo, shm = _groups()
    la, wa = _train_fsdp2(gloo, steps)
    lb, wb = _train_fsdp2(shm, steps)
    diff = max(float((x - y).abs().max()) for x, y in zip(wa, wb))
    dist.barrier(group=shm)
    dist.destroy_process_group()
    return {"losses_gloo": la, "losses_shmproxy": lb, "max_diff": diff, "params": len(wa)}


def killed_rank(kill_at: int = 5, ddp: bool = True) -> dict[str, Any]:
    """DDP over shmproxy as the default group; rank 1 kills itself with SIGKILL mid-training; the
    survivor must raise (the test runs it under a deadline: a hang fails)."""
    dist.init_process_group("shmproxy")
    me = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(_model(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        for step in range(1000):
            if me == 1 and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if not ddp:
                dist.all_reduce(torch.ones(1000))
                continue
            loss = model(torch.randn(8, 32)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    except Exception as exc:   # the survivor's error: what the test checks
        return {"step": step, "error": f"{type(exc).__name__}: {exc}"}
    return {"step": -1, "error": ""}


def unsupported() -> dict[str, str]:
    """Unsupported ops and dtypes: the error each gives (the group stays usable after each)."""
    _gloo, shm = _groups()
    out: dict[str, str] = {}

    def attempt(name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            out[name] = "no error"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    t = torch.ones(4)
    attempt("BAND", lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=R.BAND, group=shm))
    attempt("PREMUL_SUM", lambda: dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0), group=shm))
    attempt("AVG int", lambda: dist.all_reduce(torch.ones(4, dtype=torch.int64), op=R.AVG, group=shm))
    attempt("float8", lambda: dist.all_reduce(torch.ones(4).to(torch.float8_e4m3fn), group=shm))
    attempt("meta device", lambda: dist.all_reduce(torch.ones(4, device="meta"), group=shm))
    attempt("mixed devices", lambda: dist.all_gather_into_tensor(torch.empty(4 * dist.get_world_size()),
                                                                 torch.ones(4, device="meta"), group=shm))
    attempt("uneven all_gather", lambda: dist.all_gather([torch.ones(3), torch.ones(4)], t, group=shm))
    ok = torch.ones(4)
    dist.all_reduce(ok, group=shm)
    out["still usable"] = str(float(ok[0]))
    dist.barrier(group=shm)
    dist.destroy_process_group()
    return out


def adoption() -> dict[str, Any]:
    """Reused large tensors move into registered memory: DDP with buckets past the adoption threshold
    gives gloo's weights bitwise; an all_reduce result stays right across the move; a tensor the user
    views through numpy is never moved; a Work's Future completes with nobody waiting on the Work."""
    import threading
    gloo, shm = _groups()
    me, ws = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"how": shm.adopter.how}

    a, b = _train_wide(gloo, 384, 3, 200 + me, 8), _train_wide(shm, 384, 3, 200 + me, 8)
    out["ddp_max_diff"] = max(float((x - y).abs().max()) for x, y in zip(a, b))
    out["ddp_adopted"] = shm.adopter.adopted
    t = torch.zeros(1 << 17)
    seen = []
    for i in range(4):
        t.fill_(float(me + i))
        dist.all_reduce(t, group=shm)
        seen.append(float(t[-1]))
    out["reused"] = seen
    # The adopted storage's memory is registered while it lives, and only then: a view keeps it alive.
    registry = shm.comm._registry
    view, start, nbytes = t[5:9], t.data_ptr(), t.numel() * t.element_size()
    out["registered"] = registry.find(start, nbytes) is not None
    out["shared"] = t.untyped_storage().is_shared()
    del t
    gc.collect()
    out["registered with a view left"] = registry.find(start, nbytes) is not None
    out["view"] = [float(x) for x in view]
    del view
    gc.collect()
    out["registered after its death"] = registry.find(start, nbytes) is not None
    kept = torch.zeros(1 << 17)
    view = kept.numpy()
    before = shm.adopter.adopted
    for _ in range(3):
        dist.all_reduce(kept.fill_(1.0), group=shm)
    out["numpy_viewed_moved"] = shm.adopter.adopted != before
    out["numpy_view"] = float(view[7])
    done = threading.Event()
    w = dist.all_reduce(torch.ones(1 << 16), group=shm, async_op=True)
    w.get_future().then(lambda f: done.set())
    out["completed_unwaited"] = done.wait(60) and w.is_completed()
    out["ws"] = ws
    dist.barrier(group=shm)
    dist.destroy_process_group()
    return out


def staged_large() -> dict[str, Any]:
    """Large tensors outside registered memory go through the group's own staging buffers (a view at an
    offset of a larger storage, a numpy-backed tensor, a tensor seen once): the results equal gloo's,
    and DDP without adoption trains to gloo's weights bitwise."""
    import numpy as np
    gloo, shm = _groups()
    me, ws = dist.get_rank(), dist.get_world_size()
    n = 1 << 18
    diffs: list[str] = []

    def cases(g: Any) -> dict[str, torch.Tensor]:
        big = torch.arange(3 * n, dtype=torch.float32) + me
        mid = big[n:2 * n]                                   # storage offset: never adopted
        dist.all_reduce(mid, group=g)
        npb = torch.from_numpy(np.full(n, float(me + 1), np.float64))   # numpy-backed: never adopted
        dist.all_reduce(npb, op=R.MAX, group=g)
        b = torch.full((n,), float(me), dtype=torch.bfloat16)
        dist.broadcast(b, src=1, group=g)
        out = torch.empty(n * ws)
        dist.all_gather_into_tensor(out, torch.full((n,), float(me) + 0.5), group=g)
        sends = [[n + 7 * (i - j) for j in range(ws)] for i in range(ws)]   # rank i sends rank j this many
        inp = torch.arange(sum(sends[me]), dtype=torch.int64) * (me + 1)
        a2a = torch.empty(sum(sends[i][me] for i in range(ws)), dtype=torch.int64)
        dist.all_to_all_single(a2a, inp, [sends[i][me] for i in range(ws)], sends[me], group=g)
        rs = torch.empty(n)
        dist.reduce_scatter_tensor(rs, torch.ones(n * ws) * (me + 2), group=g)
        return {"offset view": big, "numpy": npb, "bcast bf16": b, "allgather": out, "a2a": a2a, "rs": rs}
    ref, got = cases(gloo), cases(shm)
    for k in ref:
        if not torch.equal(ref[k], got[k]):
            diffs.append(k)

    shm.adopter.enabled = False
    lent = shm.stage_pool.lent
    a, b = _train_wide(gloo, 512, 5, 300 + me, 6), _train_wide(shm, 512, 5, 300 + me, 6)
    res = {"diffs": diffs, "ddp_max_diff": max(float((x - y).abs().max()) for x, y in zip(a, b)),
           "ddp_lent": shm.stage_pool.lent - lent, "lent": lent}
    dist.barrier(group=shm)
    dist.destroy_process_group()
    return res


def small_calls_on_their_own_thread() -> dict:
    """Blocking small calls complete on the calling thread, with no pass of the completion thread (no
    hand-off there and back); two threads, each on a group of its own, call at once and each gets its
    own results; an async small call whose Future is taken is still completed by the completer."""
    import threading
    _, shm = _groups()
    other = dist.new_group(backend="shmproxy")
    me, ws = dist.get_rank(), dist.get_world_size()
    total = float(sum(range(1, ws + 1)))
    before = shm.completer.passes
    t = torch.zeros(2)
    for i in range(200):
        t.fill_(float(me + 1 + i))
        dist.all_reduce(t, group=shm)
        assert float(t[0]) == total + ws * i, (i, t)
    dist.barrier(group=shm)
    out: dict[str, Any] = {"passes": shm.completer.passes - before}
    got: dict[str, list] = {"a": [], "b": []}

    def caller(name: str, group: Any, salt: float) -> None:
        x = torch.zeros(4)
        for i in range(100):
            x.fill_(salt * (me + 1) + i)
            if i % 2:
                dist.all_reduce(x, group=group)
            else:
                dist.all_reduce(x, group=group, async_op=True).wait()
            got[name].append(float(x[0]))

    ts = [threading.Thread(target=caller, args=("a", shm, 1.0)),
          threading.Thread(target=caller, args=("b", other, 10.0))]
    for th in ts:
        th.start()
    for th in ts:
        th.join(120)
    out["a_ok"] = got["a"] == [total + ws * i for i in range(100)]
    out["b_ok"] = got["b"] == [10 * total + ws * i for i in range(100)]
    w = dist.all_reduce(torch.ones(2), group=shm, async_op=True)
    out["future"] = float(w.get_future().wait()[0][0])
    dist.destroy_process_group()
    return out


def blocking_direct() -> dict:
    """Blocking small calls (opts.asyncOp False, as torch's functions pass) run on the calling thread and
    give a completed Work whose Future holds the outputs (strided tensors too, through a copy); async
    ones are posted, and so are CPU tensors above the limit and bfloat16; results equal gloo's."""
    gloo, shm = _groups()
    me, ws = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    t = torch.full((4,), float(me + 1))
    w = shm.allreduce([t], opts)
    out["blocking"] = type(w).__name__
    out["value"] = float(t[0])
    out["future"] = float(w.get_future().wait()[0][0])
    out["completed"] = w.is_completed() and w.is_success() and w.exception() is None
    opts.asyncOp = True
    w = shm.allreduce([t], opts)
    w.wait()
    out["async"] = type(w).__name__
    kinds = {}
    for name, x in [("large", torch.ones(1 << 15, dtype=torch.float32)),   # 128 KiB
                    ("strided", torch.ones(8, 2)[:, 0]), ("bfloat16", torch.ones(4, dtype=torch.bfloat16))]:
        opts.asyncOp = False
        w = shm.allreduce([x], opts)
        w.wait()
        kinds[name] = (type(w).__name__, float(x[0]))
    out["kinds"] = kinds
    # Reduce to each root, broadcast from each root and a barrier, against gloo, through torch's functions.
    same = []
    for root in range(ws):
        for op in (R.SUM, R.MAX):
            a, b = _data(torch.float64, 33, root), _data(torch.float64, 33, root)
            dist.reduce(a, dst=root, op=op, group=gloo)
            dist.reduce(b, dst=root, op=op, group=shm)
            same.append(torch.equal(a, b) if me == root else True)
        a, b = _data(torch.int32, 17, 5), _data(torch.int32, 17, 5)
        dist.broadcast(a, src=root, group=gloo)
        dist.broadcast(b, src=root, group=shm)
        same.append(torch.equal(a, b))
        dist.barrier(group=shm)
    out["same"] = all(same)
    dist.destroy_process_group()
    return out


def async_op_mismatch() -> dict:
    """Rank 0 calls a small all_reduce blocking, the others async: a blocking collective never matches a
    nonblocking one, so every rank gets an error saying so (not a hang)."""
    _, shm = _groups()
    me = dist.get_rank()
    t = torch.ones(4)
    try:
        if me == 0:
            dist.all_reduce(t, group=shm)
        else:
            dist.all_reduce(t, group=shm, async_op=True).wait()
        err = ""
    except Exception as exc:   # what each rank sees is the result
        err = f"{type(exc).__name__}: {exc}"
    return {"error": err}


def p2p_small(n: int = 300) -> dict:
    """Small CPU send and recv (issue 43): a send goes through the ranks' fast path at once, a receive
    is deferred to its wait (or posted as soon as anything else needs it). MPI's order holds under
    every mix of send/isend and recv/irecv, waited in either order; Futures, is_completed, ANY_SOURCE,
    strided and bfloat16 tensors, a deferred irecv across a blocking barrier, a large message."""
    _gloo, shm = _groups()
    me = dist.get_rank()
    out: dict[str, Any] = {"bad": []}

    def bad(msg: str) -> None:
        out["bad"].append(msg)

    t = torch.zeros(4)
    for i in range(n):   # a ping-pong of blocking calls
        if me == 0:
            t.fill_(i)
            dist.send(t, 1, group=shm)
            dist.recv(t, 1, group=shm)
            if float(t[0]) != i + 0.5:
                bad(f"ping-pong {i}: {float(t[0])}")
        else:
            dist.recv(t, 0, group=shm)
            t += 0.5
            dist.send(t, 0, group=shm)
    # order on one (source, tag): rank 1 sends 1, 2, 3; rank 0 posts a, b, waits b first, then c
    if me == 1:
        ws = [dist.isend(torch.full((3,), 1.0), 0, group=shm, tag=5)]
        out["isend"] = type(ws[0]).__name__
        dist.send(torch.full((3,), 2.0), 0, group=shm, tag=5)
        ws.append(dist.isend(torch.full((3,), 3.0), 0, group=shm, tag=5))
        for w in ws:
            w.wait()
    else:
        a, b, c = torch.zeros(3), torch.zeros(3), torch.zeros(3)
        wa = dist.irecv(a, 1, group=shm, tag=5)
        wb = dist.irecv(b, 1, group=shm, tag=5)
        wb.wait()
        wa.wait()
        dist.recv(c, 1, group=shm, tag=5)
        if (float(a[0]), float(b[0]), float(c[0])) != (1.0, 2.0, 3.0):
            bad(f"order: {float(a[0])}, {float(b[0])}, {float(c[0])}, not 1, 2, 3")
    # a deferred irecv across a blocking barrier, then one through its Future, one polled
    x = torch.zeros(2)
    if me == 0:
        w = dist.irecv(x, 1, group=shm, tag=6)
        dist.barrier(group=shm)
        w.wait()
        if float(x[0]) != 6.0:
            bad(f"across a barrier: {float(x[0])}")
        fut = dist.irecv(x, 1, group=shm, tag=7).get_future()
        got = fut.wait()
        if float(got[0][0]) != 7.0:
            bad(f"future: {float(got[0][0])}")
        w = dist.irecv(x, 1, group=shm, tag=8)
        deadline = time.monotonic() + 30
        while not w.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)
        if not w.is_completed() or float(x[0]) != 8.0:
            bad(f"polled: completed {w.is_completed()}, {float(x[0])}")
    else:
        dist.send(torch.full((2,), 6.0), 0, group=shm, tag=6)
        dist.barrier(group=shm)
        dist.send(torch.full((2,), 7.0), 0, group=shm, tag=7)
        dist.send(torch.full((2,), 8.0), 0, group=shm, tag=8)
    # any source, strided and bfloat16 tensors, a large message (through the progress process)
    if me == 1:
        dist.send(torch.full((2,), 9.0), 0, group=shm, tag=9)
        dist.send(torch.arange(8.0)[::2], 0, group=shm, tag=10)
        dist.send(torch.full((4,), 3.0, dtype=torch.bfloat16), 0, group=shm, tag=11)
        dist.send(torch.arange(float(1 << 18)), 0, group=shm, tag=12)
    else:
        y = torch.zeros(2)
        out["any_source"] = dist.recv(y, group=shm, tag=9)
        if float(y[0]) != 9.0:
            bad(f"any source: {float(y[0])}")
        z = torch.zeros(8)[::2]
        dist.recv(z, 1, group=shm, tag=10)
        if z.tolist() != [0.0, 2.0, 4.0, 6.0]:
            bad(f"strided: {z.tolist()}")
        h = torch.zeros(4, dtype=torch.bfloat16)
        dist.recv(h, 1, group=shm, tag=11)
        if h.float().tolist() != [3.0] * 4:
            bad(f"bfloat16: {h.float().tolist()}")
        big = torch.zeros(1 << 18)
        dist.recv(big, 1, group=shm, tag=12)
        if not torch.equal(big, torch.arange(float(1 << 18))):
            bad("large message differs")
    dist.barrier(group=shm)
    dist.destroy_process_group()
    return out


def p2p_two_threads(rounds: int = 20) -> dict:
    """Two threads of rank 0 on one group: A receives what rank 1 sends only after it got B's message.
    A receive's wait must not hold the group's lock (B's send needs it): each round deadlocked, until
    the timeout, when the wait held it."""
    import threading
    _gloo, shm = _groups()
    me = dist.get_rank()
    out: dict[str, Any] = {"bad": []}
    for i in range(rounds):
        if me == 0:
            x = torch.zeros(2)
            a = threading.Thread(target=lambda: dist.recv(x, 1, group=shm, tag=21))
            a.start()
            dist.send(torch.full((2,), float(i)), 1, group=shm, tag=22)
            a.join(60)
            if a.is_alive() or float(x[0]) != i + 1:
                out["bad"].append(f"round {i}: receiver {'hung' if a.is_alive() else float(x[0])}")
                break
        else:
            y = torch.zeros(2)
            dist.recv(y, 0, group=shm, tag=22)
            dist.send(y + 1, 0, group=shm, tag=21)
    dist.barrier(group=shm)
    dist.destroy_process_group()
    return out
