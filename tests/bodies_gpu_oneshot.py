"""Rank bodies for the ranks' own device Allreduce kernels (shmproxy.rank.devcoll): results against numpy in
rank order, bit for bit, at every element type and op of the kernel, around its block slices and its
size limit, in place or not, on two streams in turn; a peer killed while the kernels wait; torch's
all_reduce on CUDA tensors through it. Each says which path ran ("oneshot": the ranks' kernels,
"progress": ranks that share a GPU, which the set-up declines)."""
from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

import shmproxy
from shmproxy.core import params as params_mod
from shmproxy.rank import devcoll
from tests.bodies_gpu import _cp

_OPS = {"SUM": shmproxy.SUM, "PROD": shmproxy.PROD, "MIN": shmproxy.MIN, "MAX": shmproxy.MAX,
        "AVG": shmproxy.ReduceOp.AVG}


def _path(comm: Any) -> str:
    shot = comm.__dict__.get("_oneshot")
    return "oneshot" if isinstance(shot, devcoll.PeerKernels) else "progress"


def _values(n: int, dtype: str, rank: int, salt: int) -> np.ndarray:
    x = (np.arange(n, dtype=np.int64) * 7 + rank * 3 + salt) % 5 + 1
    if np.dtype(dtype).kind == "f":
        return (x.astype(np.float64) * (1.25 + 0.5 * rank) - 2.0).astype(dtype)
    return x.astype(dtype)


def _reference(n: int, dtype: str, nranks: int, op: str, salt: int) -> np.ndarray:
    """op over the ranks' inputs in rank order, as the kernels combine them (AVG: sum, then divide)."""
    a = _values(n, dtype, 0, salt)
    fn = {"SUM": np.add, "AVG": np.add, "PROD": np.multiply, "MIN": np.fmin, "MAX": np.fmax}[op]
    for r in range(1, nranks):
        a = fn(a, _values(n, dtype, r, salt)).astype(dtype)
    if op == "AVG":
        a = (a / np.array(nranks, dtype=dtype)).astype(dtype)
    return a


def _check_allreduce(comm: Any, sizes: Any, prod_up_to: int, offsets: tuple = (0,)) -> tuple[list, int]:
    """Allreduce of ``_values`` at every element type and op, each size of ``sizes(itemsize)``, in place
    or not, on two streams in turn, from arrays starting ``offsets`` elements into their allocation
    (1: not 16-byte aligned, the kernels' element-by-element path); the mismatches, and the count."""
    cp = _cp()
    bad: list[str] = []
    cases = 0
    streams = [cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)]
    for dtype in ("float32", "float64", "int32", "int64", "uint8"):
        for n in sizes(np.dtype(dtype).itemsize):
            for op in ("SUM", "PROD", "MIN", "MAX", "AVG"):
                if op == "AVG" and np.dtype(dtype).kind != "f":
                    continue
                if op == "PROD" and n > prod_up_to:
                    continue   # the sizes above tell nothing more about PROD
                for in_place in (False, True):
                    for off in offsets:
                        cases += 1
                        salt = cases % 11
                        s = streams[cases % 2]
                        with s:
                            x = cp.empty(n + off, dtype)[off:]
                            x[...] = cp.asarray(_values(n, dtype, comm.rank, salt))
                            out = cp.full(n + off, 99, dtype)[off:]
                            if in_place:
                                comm.Allreduce(shmproxy.IN_PLACE, x, _OPS[op])
                                got = x
                            else:
                                comm.Allreduce(x, out, _OPS[op])
                                got = out
                            host = cp.asnumpy(got, stream=s)
                        s.synchronize()
                        want = _reference(n, dtype, comm.size, op, salt)
                        if not np.array_equal(host, want, equal_nan=True):
                            k = int(np.flatnonzero(host != want)[0])
                            bad.append(f"{dtype} n={n} {op} in_place={in_place} offset={off}: "
                                       f"[{k}] {host[k]} != {want[k]}")
    return bad, cases


def _launched(comm: Any) -> int:
    shot = comm.__dict__.get("_oneshot")
    return shot.epoch if isinstance(shot, devcoll.PeerKernels) else 0


def oneshot_results() -> dict:
    limit = params_mod.get().DEVICE_ONESHOT_BYTES
    with shmproxy.init(DEVICE_TWOSHOT_BYTES=0) as comm:   # one past the limit: the progress process's
        bad, cases = _check_allreduce(comm, lambda item: (1, 7, 4099, (16 << 10) // item + 1, (256 << 10) // item,
                                                          limit // item, limit // item + 3), 4099)
        return {"bad": bad[:10], "cases": cases, "path": _path(comm), "launched": _launched(comm)}


def twoshot_results() -> dict:
    """Sizes around the switch from one-shot to two-shot kernels (DEVICE_ONESHOT_BYTES, small here),
    around a two-shot window and its packs, several windows, with aligned and unaligned arrays."""
    p = params_mod.get()
    one, window = p.DEVICE_ONESHOT_BYTES, p.DEVICE_TWOSHOT_WINDOW
    with shmproxy.init() as comm:
        shot = devcoll.shared(comm, _cp().cuda.runtime.getDevice())
        step = shot.sizing.window_count if shot is not None else (lambda item: window // item)

        def sizes(item: int) -> tuple:
            w = step(item)
            return (one // item, one // item + 1, one // item + 16 // item * comm.size + 3, w - 1, w, w + 5,
                    3 * w + 7)
        bad, cases = _check_allreduce(comm, sizes, one // 4 + 1, offsets=(0, 1))
        return {"bad": bad[:10], "cases": cases, "path": _path(comm), "launched": _launched(comm),
                "windows": {i: step(i) for i in (1, 4, 8)}, "ce_windows": shot.ce_windows if shot is not None else 0}


def shares_results() -> dict:
    """Reduce_scatter_block (bit for bit against numpy in rank order) and Allgather (IN_PLACE too) as
    the ranks' kernels: every element type, SUM/MIN/AVG, shares of 1 element to several windows,
    aligned and not (offset 1: the element-by-element path), on two streams in turn."""
    cp = _cp()
    bad: list[str] = []
    cases = 0
    with shmproxy.init() as comm:
        n = comm.size
        shot = devcoll.shared(comm, cp.cuda.runtime.getDevice())
        launched0 = _launched(comm)
        streams = [cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)]
        for dtype in ("float32", "float64", "int32", "int64", "uint8"):
            item = np.dtype(dtype).itemsize
            w = shot.sizing.share_window(item) if shot is not None else 1 << 16
            for count in (1, 7, 4099, w - 1, w, 2 * w + 5):
                for off in (0, 1):
                    cases += 1
                    salt = cases % 7
                    s = streams[cases % 2]
                    full = [_values(count * n, dtype, r, salt) for r in range(n)]
                    for opname in ("SUM", "MIN", "AVG"):
                        if opname == "AVG" and np.dtype(dtype).kind != "f":
                            continue
                        with s:
                            x = cp.empty(count * n + off, dtype)[off:]
                            x[...] = cp.asarray(full[comm.rank])
                            out = cp.full(count + off, 99, dtype)[off:]
                            comm.Reduce_scatter_block(x, out, _OPS[opname])
                            got = cp.asnumpy(out, stream=s)
                        s.synchronize()
                        fn = {"SUM": np.add, "AVG": np.add, "MIN": np.fmin}[opname]
                        want = full[0][comm.rank * count:(comm.rank + 1) * count]
                        for r in range(1, n):
                            want = fn(want, full[r][comm.rank * count:(comm.rank + 1) * count]).astype(dtype)
                        if opname == "AVG":
                            want = (want / np.array(n, dtype=dtype)).astype(dtype)
                        if not np.array_equal(got, want):
                            k = int(np.flatnonzero(got != want)[0])
                            bad.append(f"Reduce_scatter_block {dtype} count={count} {opname} offset={off}: "
                                       f"[{k}] {got[k]} != {want[k]}")
                    for in_place in (False, True):
                        mine = full[comm.rank][:count]
                        with s:
                            out = cp.full(count * n + off, 99, dtype)[off:]
                            if in_place:
                                out[comm.rank * count:(comm.rank + 1) * count] = cp.asarray(mine)
                                comm.Allgather(shmproxy.IN_PLACE, out)
                            else:
                                x = cp.empty(count + off, dtype)[off:]
                                x[...] = cp.asarray(mine)
                                comm.Allgather(x, out)
                            got = cp.asnumpy(out, stream=s)
                        s.synchronize()
                        want = np.concatenate([full[r][:count] for r in range(n)])
                        if not np.array_equal(got, want):
                            k = int(np.flatnonzero(got != want)[0])
                            bad.append(f"Allgather {dtype} count={count} in_place={in_place} offset={off}: "
                                       f"[{k}] {got[k]} != {want[k]}")
        return {"bad": bad[:10], "cases": cases, "path": _path(comm), "launched": _launched(comm) - launched0,
                "ce_windows": shot.ce_windows if shot is not None else 0}


def oneshot_peer_dies(count: int = 1 << 10) -> dict:
    """The last rank SIGKILLs itself instead of joining a device Allreduce of ``count`` floats (one-shot,
    or two-shot above DEVICE_ONESHOT_BYTES): the others' kernels wait until their failure watch learns
    of it, and the call raises PeerDiedError well inside TIMEOUT."""
    cp = _cp()
    with shmproxy.init() as comm:
        x = cp.ones(count, cp.float32)
        for _ in range(3):
            comm.Allreduce(shmproxy.IN_PLACE, x)
        comm.Barrier()
        if comm.rank == comm.size - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        shot = comm.__dict__.get("_oneshot")
        ce = shot.ce_windows if isinstance(shot, devcoll.PeerKernels) else 0
        try:
            comm.Allreduce(shmproxy.IN_PLACE, x)
        except shmproxy.PeerDiedError as exc:
            return {"raised": type(exc).__name__, "s": time.monotonic() - t0, "path": _path(comm), "ce": ce}
        return {"raised": None, "s": time.monotonic() - t0, "path": _path(comm), "ce": ce}


def oneshot_torch(rounds: int = 50) -> dict:
    """torch's all_reduce of CUDA tensors through the ranks' kernels: blocking, async with wait(), and
    through get_future (the device's Future), against the values every rank can compute; and
    all_gather_into_tensor (in place too) and reduce_scatter_tensor, blocking and async."""
    import torch
    import torch.distributed as dist
    import shmproxy.torch  # noqa: F401  (registers the backend)
    cp = _cp()
    dev = cp.cuda.runtime.getDevice()
    bad: list[str] = []
    dist.init_process_group("shmproxy")
    try:
        me, n = dist.get_rank(), dist.get_world_size()
        total = n * (n + 1) / 2
        for i in range(rounds):
            for numel, dtype in ((1, torch.float32), (1000, torch.int64), (65536, torch.float32)):
                t = torch.full((numel,), me + 1, dtype=dtype, device=f"cuda:{dev}")
                if i % 3 == 0:
                    dist.all_reduce(t)
                elif i % 3 == 1:
                    dist.all_reduce(t, async_op=True).wait()
                else:
                    fut = dist.all_reduce(t, async_op=True).get_future()
                    t = fut.wait()[0]
                t2 = t * 2   # the stream's next work sees the result
                if not bool((t2 == 2 * total).all()):
                    bad.append(f"round {i} {dtype} x {numel}: {t2[0].item()} != {2 * total}")
            x = torch.full((4096,), float(me + 1), device=f"cuda:{dev}")
            dist.all_reduce(x, op=dist.ReduceOp.AVG)
            if not bool((x == total / n).all()):
                bad.append(f"round {i} AVG: {x[0].item()} != {total / n}")
            # all_gather_into_tensor (and in place, from the output's block) and reduce_scatter_tensor
            for numel in (3, 1 << 16):
                src = torch.arange(numel, dtype=torch.float32, device=f"cuda:{dev}") + 1000 * me
                out = torch.empty(numel * n, dtype=torch.float32, device=f"cuda:{dev}")
                w = dist.all_gather_into_tensor(out, src, async_op=i % 2 == 1)
                if w is not None:
                    w.wait()
                want = torch.cat([torch.arange(numel, dtype=torch.float32, device=f"cuda:{dev}") + 1000 * r
                                  for r in range(n)])
                if not bool((out * 1 == want).all()):
                    bad.append(f"round {i} all_gather_into_tensor x {numel}")
                inplace = torch.zeros(numel * n, dtype=torch.float32, device=f"cuda:{dev}")
                inplace[me * numel:(me + 1) * numel] = src
                dist.all_gather_into_tensor(inplace, inplace[me * numel:(me + 1) * numel])
                if not bool((inplace == want).all()):
                    bad.append(f"round {i} all_gather_into_tensor in place x {numel}")
                rs_in = torch.arange(numel * n, dtype=torch.float32, device=f"cuda:{dev}") * (me + 1)
                rs_out = torch.empty(numel, dtype=torch.float32, device=f"cuda:{dev}")
                w = dist.reduce_scatter_tensor(rs_out, rs_in, async_op=i % 2 == 1)
                if w is not None:
                    w.wait()
                rs_want = torch.arange(me * numel, (me + 1) * numel, dtype=torch.float32,
                                       device=f"cuda:{dev}") * total
                if not bool((rs_out * 1 == rs_want).all()):
                    bad.append(f"round {i} reduce_scatter_tensor x {numel}")
        torch.cuda.synchronize()
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device(f"cuda:{dev}"))
        comm = getattr(backend, "comm", None)
        return {"bad": bad[:10], "path": _path(comm) if comm is not None else f"unknown ({type(backend).__name__})"}
    finally:
        dist.destroy_process_group()


def fsdp2_against_nccl(steps: int = 8) -> dict:
    """fully_shard (FSDP2) of a CUDA model, a GPU per rank, trained over NCCL and then over shmproxy
    (whose all_gather_into_tensor and reduce_scatter_tensor of the shards are the ranks' own kernels):
    the losses of both and the largest weight difference."""
    import torch
    import torch.distributed as dist
    import shmproxy.torch  # noqa: F401  (registers the backend)
    from tests.bodies_torch import _train_fsdp2
    torch.cuda.set_device(_cp().cuda.runtime.getDevice())
    dist.init_process_group("nccl")
    try:
        shm = dist.new_group(backend="shmproxy")
        la, wa = _train_fsdp2(dist.group.WORLD, steps, "cuda")
        lb, wb = _train_fsdp2(shm, steps, "cuda")
        torch.cuda.synchronize()
        backend = shm._get_backend(torch.device("cuda"))
        comm = getattr(backend, "comm", None)
        diff = max(float((x - y).abs().max()) for x, y in zip(wa, wb))
        dist.barrier(group=shm)
        return {"losses_nccl": la, "losses_shmproxy": lb, "max_diff": diff, "params": len(wa),
                "path": _path(comm) if comm is not None else f"unknown ({type(backend).__name__})"}
    finally:
        dist.destroy_process_group()
