#!/usr/bin/env python3
"""torch.distributed on shmproxy against gloo, in the same job: all_reduce time by size and a DDP
training step, with the ratios.

    torchrun --nproc-per-node 2 tools/torch_bench.py [--sizes 1M,4M,16M,64M] [--iters 10]
                                                     [--params 10M] [--steps 6] [--json FILE]
                                                     [--trace] [--no-adopt] [--device cuda]

gloo is the default group and shmproxy a group over the same ranks. Each all_reduce figure is the
median of ``--iters`` timed calls of float32 SUM (after a barrier of the same group). The DDP step
is forward + backward + SGD step of an MLP of about ``--params`` parameters (batch 32), median over
``--steps`` steps after two warm-up steps; the same model, seed and data on both backends. "hidden"
is the fraction of DDP's communication that overlapped backward: 1 - (step - step without
communication) / (all_reduce time of all gradients at once), clipped to [0, 1]. "registered" is
shmproxy's all_reduce of a tensor in the group's registered memory (``alloc_tensor``: no staging copy).

``--params 0`` skips the DDP step. ``--device cuda``: the tensors and the model are on CUDA device
rank % (number of devices) (one node), so ranks may share one GPU (gloo copies through host memory;
NCCL refuses two ranks on one GPU). Each timed call then ends with ``torch.cuda.synchronize()``, so a
figure is the time until the result is on the device; no "registered" column (host memory only).

``--trace`` prints, for rank 0, a timeline of one all_reduce per size and of one DDP step on shmproxy:
per Work, when torch called the group, when the post returned, when the completion thread saw it
done (and how long its test pass took: staged copies back happen there), when its Future completed,
and when backward returned (monkeypatched timestamps; off unless asked).
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import shmproxy.torch  # noqa: F401  (registers the backend)
from shmproxy.torch import work as _work
from shmproxy.torch.process_group import ProcessGroupShmproxy

TRACE: list[dict[str, Any]] = []   # one entry per Work while tracing is on
_tracing = [False]


def _install_trace() -> None:
    """Wrap the group's post, the Work's completion and the completer's test pass with timestamps."""
    post, complete, test_all = (ProcessGroupShmproxy._post, _work.Work._complete,
                                _work.Completer._test_all)
    now = time.perf_counter

    def traced_post(self: Any, name: str, build: Any, result: list, on_done: Any = None,
                    inputs: Any = ()) -> Any:
        t0 = now()
        w = post(self, name, build, result, on_done, inputs)
        if _tracing[0]:
            w._tr = {"name": name, "bytes": sum(t.numel() * t.element_size() for t in result),
                     "thread": threading.current_thread().name, "call": t0, "posted": now()}
            TRACE.append(w._tr)
        return w

    def traced_test_all(self: Any) -> Any:
        t0 = now()
        finished, failure, head = test_all(self)
        t1 = now()
        for w in finished:
            tr = getattr(w, "_tr", None)
            if tr is not None:
                tr["test_start"], tr["seen"] = t0, t1
        return finished, failure, head

    def traced_complete(self: Any) -> None:
        complete(self)
        tr = getattr(self, "_tr", None)
        if tr is not None:
            tr["done"] = now()

    ProcessGroupShmproxy._post = traced_post  # type: ignore[method-assign]
    _work.Completer._test_all = traced_test_all  # type: ignore[method-assign]
    _work.Work._complete = traced_complete  # type: ignore[method-assign]


def _print_trace(title: str, t_ref: float, marks: dict[str, float]) -> None:
    print(f"--- trace: {title} (ms from start; marks: "
          + ", ".join(f"{k} {(v - t_ref) * 1e3:.2f}" for k, v in marks.items()) + ")")
    print(f"{'op':<14}{'MiB':>7}{'call':>9}{'posted':>9}{'test0':>9}{'seen':>9}{'done':>9}  thread")
    for tr in TRACE:
        def ms(k: str) -> str:
            return f"{(tr[k] - t_ref) * 1e3:9.2f}" if k in tr else f"{'-':>9}"
        print(f"{tr['name'][:13]:<14}{tr['bytes'] / 2**20:7.2f}{ms('call')}{ms('posted')}{ms('test_start')}"
              f"{ms('seen')}{ms('done')}  {tr['thread']}", flush=True)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B")
    return int(float(t[:-1]) * units[t[-1]]) if t[-1] in units else int(t)


DEVICE = ["cpu"]   # --device


def _sync() -> None:
    if DEVICE[0] != "cpu":
        torch.cuda.synchronize()


def _median(fn: Any, iters: int, group: Any) -> float:
    times = []
    for _ in range(iters):
        _sync()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_allreduce(groups: dict[str, Any], nbytes: int, iters: int, trace: bool) -> dict[str, float]:
    out = {}
    shm = groups["shmproxy"]
    cases = [(name, g, torch.ones(max(nbytes // 4, 1), device=DEVICE[0])) for name, g in groups.items()]
    if DEVICE[0] == "cpu":
        reg = shm.alloc_tensor(nbytes // 4)
        reg.fill_(1.0)
        cases.append(("registered", shm, reg))
    for name, g, t in cases:
        dist.all_reduce(t, group=g)  # warm-up: staging buffers, first-touch pages
        out[name] = _median(lambda: dist.all_reduce(t, group=g), iters, g)
        if trace and g is shm:
            dist.barrier(group=g)
            TRACE.clear()
            _tracing[0] = True
            t0 = time.perf_counter()
            dist.all_reduce(t, group=g)
            t1 = time.perf_counter()
            _tracing[0] = False
            if dist.get_rank() == 0:
                _print_trace(f"all_reduce {nbytes >> 20} MiB, {name}", t0, {"returned": t1})
    return out


def _model(params: int) -> torch.nn.Module:
    torch.manual_seed(0)
    width = max(64, int((params / 4) ** 0.5))   # 4 layers of width x width
    nn = torch.nn
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.ReLU())])


def bench_ddp(groups: dict[str, Any], params: int, steps: int, trace: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, g in groups.items():
        ids = None if DEVICE[0] == "cpu" else [torch.cuda.current_device()]
        ddp = torch.nn.parallel.DistributedDataParallel(_model(params).to(DEVICE[0]), device_ids=ids,
                                                        process_group=g)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        width = ddp.module[0].in_features
        x = torch.randn(32, width, device=DEVICE[0])

        def step(sync: bool = True) -> None:
            if sync:
                ddp(x).square().mean().backward()
            else:
                with ddp.no_sync():
                    ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        for _ in range(2):
            step()
        if trace and name == "shmproxy":
            _trace_step(ddp, x, opt, g)
        t_step = _median(step, steps, g)
        t_local = _median(lambda: step(False), steps, g)
        flat = torch.zeros(sum(p.numel() for p in ddp.parameters()), device=DEVICE[0])
        t_comm = _median(lambda: dist.all_reduce(flat, group=g), steps, g)
        hidden = 1.0 - (t_step - t_local) / t_comm if t_comm > 0 else 0.0
        out[name] = {"step_s": t_step, "no_comm_step_s": t_local, "allreduce_all_grads_s": t_comm,
                     "hidden": min(max(hidden, 0.0), 1.0), "params": flat.numel()}
    return out


def _trace_step(ddp: Any, x: torch.Tensor, opt: Any, g: Any) -> None:
    dist.barrier(group=g)
    TRACE.clear()
    _tracing[0] = True
    t0 = time.perf_counter()
    loss = ddp(x).square().mean()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t3 = time.perf_counter()
    _tracing[0] = False
    if dist.get_rank() == 0:
        _print_trace("one DDP step", t0, {"forward done": t1, "backward returned": t2, "step done": t3})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,4M,16M,64M")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--params", default="10M")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default="")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--no-adopt", action="store_true",
                    help="stage every tensor (never move reused tensors into registered memory)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = ap.parse_args()
    DEVICE[0] = a.device
    if a.trace:
        _install_trace()
    dist.init_process_group("gloo")
    if a.device == "cuda":   # one node: the rank picks its device as LOCAL_RANK would
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    groups = {"gloo": dist.group.WORLD, "shmproxy": dist.new_group(backend="shmproxy")}
    if a.no_adopt:
        groups["shmproxy"].adopter.enabled = False
    me = dist.get_rank()
    report: dict[str, Any] = {"ranks": dist.get_world_size(), "allreduce": {}, "ddp": {}}
    for s in a.sizes.split(","):
        r = bench_allreduce(groups, _size(s), a.iters, a.trace)
        report["allreduce"][s] = r
        if me == 0:
            reg = (f"  (registered tensor {r['registered'] * 1e3:.2f} ms, {r['gloo'] / r['registered']:.2f}x)"
                   if "registered" in r else "")
            print(f"all_reduce {s:>5}: gloo {r['gloo'] * 1e3:9.3f} ms  shmproxy {r['shmproxy'] * 1e3:9.3f} ms"
                  f"  speed-up {r['gloo'] / r['shmproxy']:5.2f}x{reg}", flush=True)
    if _size(a.params) == 0:
        if me == 0 and a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)
        dist.barrier(group=groups["shmproxy"])
        dist.destroy_process_group()
        return
    d = bench_ddp(groups, _size(a.params), a.steps, a.trace)
    report["ddp"] = d
    if me == 0:
        for name, v in d.items():
            print(f"DDP {name:>8}: step {v['step_s'] * 1e3:8.1f} ms (no communication"
                  f" {v['no_comm_step_s'] * 1e3:.1f} ms, all gradients' all_reduce"
                  f" {v['allreduce_all_grads_s'] * 1e3:.1f} ms, hidden {v['hidden']:.2f};"
                  f" {v['params'] / 1e6:.1f}M parameters)")
        print(f"DDP step time shmproxy/gloo: {d['shmproxy']['step_s'] / d['gloo']['step_s']:.2f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)
    dist.barrier(group=groups["shmproxy"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
