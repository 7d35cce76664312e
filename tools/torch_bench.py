#!/usr/bin/env python3
"""torch.distributed on shmproxy against gloo, in the same job: all_reduce time by size and a DDP
training step, with the ratios.

    torchrun --nproc-per-node 2 tools/torch_bench.py [--sizes 1M,4M,16M,64M] [--iters 10]
                                                     [--params 10M] [--steps 6] [--json FILE]

gloo is the default group and shmproxy a group over the same ranks. Each all_reduce figure is the
median of ``--iters`` timed calls of float32 SUM (after a barrier of the same group). The DDP step
is forward + backward + SGD step of an MLP of about ``--params`` parameters (batch 32), median over
``--steps`` steps after two warm-up steps; the same model, seed and data on both backends. "hidden"
is the fraction of DDP's communication that overlapped backward: 1 - (step - step without
communication) / (all_reduce time of all gradients at once), clipped to [0, 1].
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import shmproxy.torch  # noqa: F401  (registers the backend)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B")
    return int(float(t[:-1]) * units[t[-1]]) if t[-1] in units else int(t)


def _median(fn: Any, iters: int, group: Any) -> float:
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_allreduce(groups: dict[str, Any], nbytes: int, iters: int) -> dict[str, float]:
    out = {}
    for name, g in groups.items():
        t = torch.ones(nbytes // 4)
        dist.all_reduce(t, group=g)  # warm-up: staging buffers, first-touch pages
        out[name] = _median(lambda: dist.all_reduce(t, group=g), iters, g)
    return out


def _model(params: int) -> torch.nn.Module:
    torch.manual_seed(0)
    width = max(64, int((params / 4) ** 0.5))   # 4 layers of width x width
    nn = torch.nn
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.ReLU())])


def bench_ddp(groups: dict[str, Any], params: int, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, g in groups.items():
        ddp = torch.nn.parallel.DistributedDataParallel(_model(params), process_group=g)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        width = ddp.module[0].in_features
        x = torch.randn(32, width)

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
        t_step = _median(step, steps, g)
        t_local = _median(lambda: step(False), steps, g)
        flat = torch.zeros(sum(p.numel() for p in ddp.parameters()))
        t_comm = _median(lambda: dist.all_reduce(flat, group=g), steps, g)
        hidden = 1.0 - (t_step - t_local) / t_comm if t_comm > 0 else 0.0
        out[name] = {"step_s": t_step, "no_comm_step_s": t_local, "allreduce_all_grads_s": t_comm,
                     "hidden": min(max(hidden, 0.0), 1.0), "params": flat.numel()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,4M,16M,64M")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--params", default="10M")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    groups = {"gloo": dist.group.WORLD, "shmproxy": dist.new_group(backend="shmproxy")}
    me = dist.get_rank()
    report: dict[str, Any] = {"ranks": dist.get_world_size(), "allreduce": {}, "ddp": {}}
    for s in a.sizes.split(","):
        r = bench_allreduce(groups, _size(s), a.iters)
        report["allreduce"][s] = r
        if me == 0:
            print(f"all_reduce {s:>5}: gloo {r['gloo'] * 1e3:9.2f} ms  shmproxy {r['shmproxy'] * 1e3:9.2f} ms"
                  f"  speed-up {r['gloo'] / r['shmproxy']:5.2f}x", flush=True)
    d = bench_ddp(groups, _size(a.params), a.steps)
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
