#!/usr/bin/env python3
"""Where a torch-backend all_reduce of CUDA tensors spends its time, against the native Allreduce on the
same tensors in the same job (a probe, for BENCHMARKS.md; ranks may share one GPU).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/torch_cuda_probe.py

Each row is the median of 40 calls, each after a barrier of the shmproxy group and ending with
``torch.cuda.synchronize()``, at 8 B, 1 MiB and 256 MiB float32 (the in-place rows keep doubling the
tensor: the values overflow, the time does not change).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

import shmproxy
import shmproxy.torch  # noqa: F401  (registers the backend)


def _median_us(fn: Callable[[], object], group: object, iters: int = 40) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    dist.init_process_group("gloo")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    shm = dist.new_group(backend="shmproxy")
    comm = shm.comm
    for nbytes in (8, 1 << 20, 256 << 20):
        t = torch.ones(max(nbytes // 4, 1), device="cuda")
        y = torch.empty_like(t)
        s = torch.cuda.current_stream()
        rows: dict[str, Callable[[], object]] = {
            "dist.all_reduce (in place)": lambda: dist.all_reduce(t, group=shm),
            "native Allreduce IN_PLACE, torch stream": lambda: comm.Allreduce(shmproxy.IN_PLACE, t, stream=s),
            "native Allreduce x->y, torch stream": lambda: comm.Allreduce(t, y, stream=s),
            "native Allreduce x->y, no stream=": lambda: comm.Allreduce(t, y),
            "dist.all_reduce async + wait": lambda: dist.all_reduce(t, group=shm, async_op=True).wait(),
        }
        for name, fn in rows.items():
            fn()
            us = _median_us(fn, shm)
            if dist.get_rank() == 0:
                print(f"probe {nbytes:>10} B  {name:<42} {us:9.1f} us", flush=True)
    dist.barrier(group=shm)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
