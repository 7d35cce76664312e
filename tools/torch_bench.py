#!/usr/bin/env python3
"""torch.distributed on shmproxy against gloo, in the same job: all_reduce time by size, a send/recv
ping-pong, the overlap of one async all_reduce with computation, and a DDP training step with the
share of its communication hidden behind backward.

    torchrun --nproc-per-node 2 tools/torch_bench.py [--sizes 1M,4M,16M,64M] [--iters 10] [--pingpong 8,4K]
                 [--host-cost 8,64K]
                 [--overlap-size 16M] [--params 10M] [--layers 16] [--batch 32] [--bucket-cap-mb 25]
                 [--steps 6] [--json FILE] [--trace] [--no-adopt] [--device cuda] [--peers gloo,nccl] [--loop]

gloo is the default group and shmproxy a group over the same ranks; every figure below is taken on
both, the same way. Each all_reduce figure is the median of ``--iters`` timed calls of float32 SUM
(after a barrier of the same group); with ``--loop``, the mean of ``--iters`` calls back to back
after one barrier, the slowest rank's (how a training loop calls: a rank that comes first waits
inside the call). "registered" is shmproxy's all_reduce of a tensor in the group's registered memory
(``alloc_tensor``: no staging copy). ``--pingpong``: one way of blocking ``dist.send``/``dist.recv``
between ranks 0 and 1, half the mean round trip of ``--iters`` round trips. ``--host-cost``: the
calling thread's time per all_reduce over ``--iters`` calls back to back, unsynchronized, and the
time per call until the device was synchronized after them.

**Overlap of one all_reduce** (OSU style, ``--overlap-size``; 0 skips it): t_comm is a blocking
all_reduce; the computation is a loop of 128x128 matmuls calibrated to last about t_comm (the largest
count of all ranks, so every rank computes the same), t_compute that loop alone, t_total the loop
between posting an ``async_op=True`` all_reduce and waiting for it. overlap = 1 - (t_total -
t_compute) / t_comm, clipped to [0, 1]: 1 when the all_reduce progressed entirely while the rank
computed, 0 when it only progressed in the wait. It needs a core for the communication besides the
ranks' (gloo's threads, shmproxy's progress process): where the ranks fill every core, both read
near 0 whatever the backend does; ``--overlap-idle`` then sleeps instead of computing, which only
a backend that progresses outside ``wait`` overlaps.

**DDP step** (``--params``; 0 skips it): forward + backward + SGD step of an MLP of ``--layers``
square Linear layers, about ``--params`` parameters in all, batch ``--batch``, DDP buckets of
``--bucket-cap-mb`` MiB (25 is DDP's default); the same model, seed and data on both backends. The
same communication hook is registered on both: it does what DDP's default does (divide the bucket
by the group size, all_reduce it with ``async_op=True``) and records, per bucket, when the reducer
called it (t_call), when it called all_reduce after the division (t_start) and when that returned,
and when the all_reduce's future completed (t_done: a callback chained on the Work's future, run on
the backend's completion thread). Definitions, per
step, median over ``--steps`` steps (after three warm-up steps: DDP rebuilds its buckets after the
first, shmproxy moves the reused buckets into registered memory on their second sighting):

- *in flight*: the union U of the intervals [t_start, t_done] of every bucket.
- *end of backward compute*, T_c: the t_call of the last bucket. DDP hands buckets to the hook in
  order, each once all its gradients are computed, so at T_c the autograd engine has produced every
  gradient; what is left of ``backward()`` after T_c is waiting for the buckets and copying their
  results into ``.grad``.
- *hidden*: the share of U that lies before T_c, i.e. of the time communication was in flight, the
  part during which backward was still computing. The last bucket is posted at T_c, so hidden stays
  below 1 even when everything else overlaps; more, smaller buckets make that share smaller.
- *exposed*: the length of U after T_c: what the step waits for communication (compare it with
  "step - step without communication").
- *post*: the time the backward thread spent inside the all_reduce calls (t_start to their return),
  taken from computation whatever the overlap says.

The older whole-step figure is kept as "hidden (step-based)": 1 - (step - step without
communication, under ``no_sync``) / (one all_reduce of all gradients at once), clipped to [0, 1]. It
charges DDP's own bucket copies and the per-bucket latency to communication, so it reads 0 whenever
those exceed what overlap saves; the interval figure above does not depend on them.

``--device cuda``: the tensors and the model are on CUDA device rank % (number of devices) (one
node), so ranks may share one GPU (gloo copies through host memory; NCCL refuses two ranks on one
GPU). Each timed call then ends with ``torch.cuda.synchronize()``; no "registered" column; a
"native" column instead: shmproxy's own ``comm.Allreduce`` of the same CUDA tensor (the figure the
backend's all_reduce should reach). ``--peers gloo,nccl`` (one rank per GPU) times NCCL too, a group
over the same ranks; every ratio is a peer's time / shmproxy's (above 1: shmproxy faster).

``--trace`` prints, for rank 0, the per-bucket timeline of the last timed DDP step of each backend,
and a timeline of one all_reduce per size and of one DDP step on shmproxy: per Work, when torch
called the group, when the post returned, when the completion thread saw it done (and how long its
test pass took: staged copies back happen there), when its Future completed, and when backward
returned (monkeypatched timestamps; off unless asked).
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

import shmproxy
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


LOOP = [False]     # --loop


def _median(fn: Any, iters: int, group: Any) -> float:
    if LOOP[0]:
        return _loop_mean(fn, iters, group)
    times = []
    for _ in range(iters):
        _sync()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _loop_mean(fn: Any, iters: int, group: Any) -> float:
    """``iters`` calls back to back, each ending with the device synchronized, after one barrier: the
    mean per call, the slowest rank's (a training loop's shape: no barrier lines the ranks up, so a
    rank that arrives first waits for the other inside the call)."""
    _sync()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
        _sync()
    return _agree((time.perf_counter() - t0) / iters)


def bench_allreduce(groups: dict[str, Any], nbytes: int, iters: int, trace: bool) -> dict[str, float]:
    out = {}
    shm = groups["shmproxy"]
    cases = [(name, g, torch.ones(max(nbytes // 4, 1), device=DEVICE[0])) for name, g in groups.items()]
    if DEVICE[0] == "cpu":
        reg = shm.alloc_tensor(nbytes // 4)
        reg.fill_(1.0)
        cases.append(("registered", shm, reg))
    else:   # shmproxy's own Allreduce of a CUDA tensor, in place as torch's, on the current stream
        cases.append(("native", shm, torch.ones(max(nbytes // 4, 1), device=DEVICE[0])))
    for name, g, t in cases:
        if name == "native":
            def call(t: torch.Tensor = t) -> None:
                shm.comm.Allreduce(shmproxy.IN_PLACE, t)
        else:
            def call(t: torch.Tensor = t, g: Any = g) -> None:
                dist.all_reduce(t, group=g)
        call()  # warm-up: staging buffers, first-touch pages, the peers' connections
        out[name] = _median(call, iters, g)
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


def bench_host_cost(groups: dict[str, Any], nbytes: int, iters: int) -> dict[str, tuple[float, float]]:
    """What one ``dist.all_reduce`` costs the calling thread: ``iters`` calls back to back with nothing
    synchronized between them, after one barrier; per group (the host's time per call until the last
    returned, the time per call until the device was synchronized too), the slowest rank's. On CUDA
    a call the host queues faster than the GPU runs it shows as the second figure growing past the
    first."""
    out = {}
    for name, g in groups.items():
        t = torch.ones(max(nbytes // 4, 1), device=DEVICE[0])
        for _ in range(20):
            dist.all_reduce(t, group=g)   # warm-up
        _sync()
        dist.barrier(group=g)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t, group=g)
        t1 = time.perf_counter()
        _sync()
        t2 = time.perf_counter()
        out[name] = (_agree((t1 - t0) / iters), _agree((t2 - t0) / iters))
    return out


def bench_pingpong(groups: dict[str, Any], nbytes: int, iters: int) -> dict[str, float]:
    """One way of a blocking ``dist.send``/``dist.recv`` ping-pong between ranks 0 and 1 (the others
    wait): half the mean round trip of ``iters`` round trips back to back (``_loop_mean``), on each
    group."""
    me = dist.get_rank()
    out = {}
    for name, g in groups.items():
        t = torch.zeros(max(nbytes // 4, 1), device=DEVICE[0])

        def round_trip(t: torch.Tensor = t, g: Any = g) -> None:
            if me == 0:
                dist.send(t, 1, group=g)
                dist.recv(t, 1, group=g)
            elif me == 1:
                dist.recv(t, 0, group=g)
                dist.send(t, 0, group=g)
        for _ in range(10):
            round_trip()
        out[name] = _loop_mean(round_trip, iters, g) / 2
    return out


def _agree(value: float, op: Any = dist.ReduceOp.MAX) -> float:
    """``value`` reduced over every rank (through gloo, the default group)."""
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t[0])


def bench_overlap(groups: dict[str, Any], nbytes: int, iters: int,
                  idle: bool = False) -> dict[str, dict[str, float]]:
    """OSU-style overlap of one async all_reduce with a matmul loop of the same duration (header).
    ``idle``: the "computation" is a sleep instead, which leaves the CPUs to communication: on a
    machine whose cores the ranks fill, it tells a backend that only progresses inside ``wait``
    (overlap 0) from one that progresses on its own but lacks a core to do it on."""
    a = torch.randn(128, 128, device=DEVICE[0])
    c = torch.empty_like(a)
    pause = [0.0]

    def compute(k: int) -> None:
        if idle:
            time.sleep(pause[0])   # a stand-in for computation elsewhere (a device kernel), not a wait
            return
        for _ in range(k):
            torch.mm(a, a, out=c)
    compute(8)
    out = {}
    for name, g in groups.items():
        t = torch.ones(max(nbytes // 4, 1), device=DEVICE[0])
        for _ in range(2):   # warm-up; the second call moves the tensor into registered memory (shmproxy)
            dist.all_reduce(t, group=g)
        t_comm = _median(lambda: dist.all_reduce(t, group=g), iters, g)
        k = 1
        if not idle:   # the matmul count, refined once on the first estimate's measured time
            per_mm = _median(lambda: compute(16), 3, g) / 16
            k = int(_agree(max(1, round(t_comm / per_mm))))
            k = int(_agree(max(1, round(k * t_comm / _median(lambda: compute(k), 3, g)))))
        pause[0] = _agree(t_comm)
        t_compute = _median(lambda: compute(k), iters, g)

        def overlapped() -> None:
            w = dist.all_reduce(t, group=g, async_op=True)
            compute(k)
            w.wait()
        t_total = _median(overlapped, iters, g)
        ov = 1.0 - (t_total - t_compute) / t_comm if t_comm > 0 else 0.0
        out[name] = {"comm_s": t_comm, "compute_s": t_compute, "total_s": t_total,
                     "overlap": min(max(ov, 0.0), 1.0), "matmuls": 0 if idle else k}
    return out


def _model(params: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    width = max(64, int((params / layers) ** 0.5))   # `layers` layers of width x width
    nn = torch.nn
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


class BucketClock:
    """The state of the timing hook: [t_call, t_start, t_posted, t_done, bytes] per bucket of the step."""

    def __init__(self, group: Any):
        self.group = group
        self.size = dist.get_world_size(group)
        self.events: list[list[float]] = []


def timed_allreduce_hook(clock, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations only
    """DDP's default hook (average over the group), with timestamps (see the header)."""
    now = time.perf_counter
    t_call = now()
    buf = bucket.buffer()
    buf.div_(clock.size)
    t_start = now()
    work = dist.all_reduce(buf, group=clock.group, async_op=True)
    ev = [t_call, t_start, now(), 0.0, float(buf.numel() * buf.element_size())]
    clock.events.append(ev)

    def done(fut: torch.futures.Future) -> torch.Tensor:
        ev[3] = now()
        return fut.value()[0]
    return work.get_future().then(done)


def in_flight(events: list[list[float]], t_end: float) -> tuple[float, float]:
    """(length of the union of the [t_start, t_done] intervals, the part of it before ``t_end``)."""
    total = before = 0.0
    cur: list[float] | None = None
    for s, e in sorted((ev[1], ev[3]) for ev in events):
        if cur is not None and s <= cur[1]:
            cur[1] = max(cur[1], e)
            continue
        if cur is not None:
            total += cur[1] - cur[0]
            before += max(0.0, min(cur[1], t_end) - cur[0])
        cur = [s, e]
    if cur is not None:
        total += cur[1] - cur[0]
        before += max(0.0, min(cur[1], t_end) - cur[0])
    return total, before


def _step_figures(clock: BucketClock, t_fwd: float, t_bwd: float, t_ret: float,
                  t_end: float) -> dict[str, float]:
    ev = clock.events
    t_c = max(e[0] for e in ev)
    total, before = in_flight(ev, t_c)
    return {"step_s": t_end - t_fwd, "backward_s": t_ret - t_bwd, "compute_s": t_c - t_bwd,
            "in_flight_s": total, "exposed_s": total - before,
            "hidden": before / total if total > 0 else 0.0,
            "post_s": sum(e[2] - e[1] for e in ev), "buckets": float(len(ev))}


def _print_buckets(name: str, clock: BucketClock, t_bwd: float, t_ret: float) -> None:
    t_c = max(e[0] for e in clock.events)
    print(f"--- buckets of one DDP step, {name} (ms from backward's start; end of compute"
          f" {(t_c - t_bwd) * 1e3:.2f}, backward returned {(t_ret - t_bwd) * 1e3:.2f})")
    for i, (a, b, c, d, n) in enumerate(clock.events):
        print(f"  bucket {i:2d} {n / 2**20:7.2f} MiB  call {(a - t_bwd) * 1e3:8.2f}"
              f"  all_reduce {(b - t_bwd) * 1e3:8.2f}  returned {(c - t_bwd) * 1e3:8.2f}"
              f"  done {(d - t_bwd) * 1e3:8.2f}", flush=True)


def bench_ddp(groups: dict[str, Any], a: argparse.Namespace, trace: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    now = time.perf_counter
    for name, g in groups.items():
        ids = None if DEVICE[0] == "cpu" else [torch.cuda.current_device()]
        ddp = torch.nn.parallel.DistributedDataParallel(
            _model(_size(a.params), a.layers).to(DEVICE[0]), device_ids=ids, process_group=g,
            bucket_cap_mb=a.bucket_cap_mb)
        clock = BucketClock(g)
        ddp.register_comm_hook(clock, timed_allreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        width = ddp.module[0].in_features
        x = torch.randn(a.batch, width, device=DEVICE[0])

        def step(sync: bool = True) -> None:
            if sync:
                ddp(x).square().mean().backward()
            else:
                with ddp.no_sync():
                    ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            _sync()
        for _ in range(3):
            step()
        if trace and name == "shmproxy":
            _trace_step(ddp, x, opt, g)
        per_step = []
        for _ in range(a.steps):
            _sync()
            dist.barrier(group=g)
            clock.events = []
            t0 = now()
            loss = ddp(x).square().mean()
            t1 = now()
            loss.backward()
            _sync()
            t2 = now()
            opt.step()
            opt.zero_grad()
            _sync()
            per_step.append(_step_figures(clock, t0, t1, t2, now()))
        if trace and dist.get_rank() == 0:
            _print_buckets(name, clock, t1, t2)
        fig = {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}
        fig["hidden_min_rank"] = _agree(fig["hidden"], dist.ReduceOp.MIN)
        fig["no_comm_step_s"] = _median(lambda: step(False), a.steps, g)
        flat = torch.zeros(sum(p.numel() for p in ddp.parameters()), device=DEVICE[0])
        fig["allreduce_all_grads_s"] = t_comm = _median(lambda: dist.all_reduce(flat, group=g), a.steps, g)
        old = 1.0 - (fig["step_s"] - fig["no_comm_step_s"]) / t_comm if t_comm > 0 else 0.0
        fig["hidden_step_based"] = min(max(old, 0.0), 1.0)
        fig["params"] = flat.numel()
        out[name] = fig
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


def _finish(report: dict[str, Any], path: str, shm: Any) -> None:
    if dist.get_rank() == 0 and path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier(group=shm)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,4M,16M,64M", help="all_reduce sizes ('' skips them)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--pingpong", default="", help="sizes of a send/recv ping-pong between ranks 0 and 1 ('': none)")
    ap.add_argument("--host-cost", default="",
                    help="sizes of all_reduce timed back to back, unsynchronized: the host's cost of a call ('': none)")
    ap.add_argument("--overlap-size", default="16M",
                    help="size of the overlap figure's all_reduce (0 skips it)")
    ap.add_argument("--params", default="10M", help="parameters of the DDP model (0 skips the DDP step)")
    ap.add_argument("--overlap-idle", action="store_true",
                    help="the overlap figure's computation is a sleep (see bench_overlap), not matmuls")
    ap.add_argument("--layers", type=int, default=16, help="Linear layers of the DDP model")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (25: its default)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default="")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--no-adopt", action="store_true",
                    help="stage every tensor (never move reused tensors into registered memory)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--loop", action="store_true",
                    help="time each figure as --iters calls back to back (the mean per call, slowest rank), "
                         "not as the median of calls each after a barrier")
    ap.add_argument("--peers", default="gloo",
                    help="the libraries timed beside shmproxy: gloo (the default group, always there), nccl "
                         "(--device cuda, one rank per GPU)")
    a = ap.parse_args()
    peers = [p for p in a.peers.split(",") if p]
    if not peers or set(peers) - {"gloo", "nccl"} or ("nccl" in peers and a.device != "cuda"):
        ap.error(f"--peers {a.peers}: gloo and/or nccl (nccl with --device cuda)")
    DEVICE[0] = a.device
    LOOP[0] = a.loop
    if a.trace:
        _install_trace()
    dist.init_process_group("gloo")
    if a.device == "cuda":   # one node: the rank picks its device as LOCAL_RANK would
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    groups = {p: dist.group.WORLD if p == "gloo" else dist.new_group(backend=p) for p in peers}
    groups["shmproxy"] = dist.new_group(backend="shmproxy")
    if a.no_adopt:
        groups["shmproxy"].adopter.enabled = False
    me = dist.get_rank()
    report: dict[str, Any] = {"ranks": dist.get_world_size(), "allreduce": {}, "overlap": {}, "ddp": {}}
    for s in filter(None, a.sizes.split(",")):
        r = bench_allreduce(groups, _size(s), a.iters, a.trace)
        report["allreduce"][s] = r
        if me == 0:
            ref = peers[0]
            extra = "".join(f"  ({what} {r[what] * 1e3:.3f} ms, {r[ref] / r[what]:.2f}x {ref})"
                            for what in ("registered", "native") if what in r)
            print(f"all_reduce {s:>5}: shmproxy {r['shmproxy'] * 1e3:9.3f} ms"
                  + "".join(f"  {p} {r[p] * 1e3:9.3f} ms ({r[p] / r['shmproxy']:5.2f}x)" for p in peers)
                  + extra, flush=True)
    for s in filter(None, a.host_cost.split(",")):
        h = bench_host_cost(groups, _size(s), a.iters)
        report.setdefault("host_cost", {})[s] = h
        if me == 0:
            print(f"host cost {s:>5}: " + "  ".join(
                f"{p} {h[p][0] * 1e6:6.1f} us a call ({h[p][1] * 1e6:6.1f} until synchronized)"
                for p in ["shmproxy", *peers]), flush=True)
    for s in filter(None, a.pingpong.split(",")):
        r = bench_pingpong(groups, _size(s), a.iters)
        report.setdefault("pingpong", {})[s] = r
        if me == 0:
            print(f"send/recv {s:>5}: shmproxy {r['shmproxy'] * 1e6:9.1f} us one way"
                  + "".join(f"  {p} {r[p] * 1e6:9.1f} us ({r[p] / r['shmproxy']:5.2f}x)" for p in peers), flush=True)
    if _size(a.overlap_size):
        o = report["overlap"] = bench_overlap(groups, _size(a.overlap_size), a.iters, a.overlap_idle)
        if me == 0:
            for name, v in o.items():
                what = "sleep" if a.overlap_idle else f"{v['matmuls']} matmuls"
                print(f"overlap {a.overlap_size} {name:>8}: {v['overlap']:.2f} (all_reduce"
                      f" {v['comm_s'] * 1e3:.2f} ms, {what} {v['compute_s'] * 1e3:.2f} ms,"
                      f" both {v['total_s'] * 1e3:.2f} ms)", flush=True)
    if _size(a.params) == 0:
        _finish(report, a.json, groups["shmproxy"])
        return
    d = report["ddp"] = bench_ddp(groups, a, a.trace)
    if me == 0:
        for name, v in d.items():
            print(f"DDP {name:>8}: step {v['step_s'] * 1e3:7.1f} ms, hidden {v['hidden']:.2f} (lowest rank"
                  f" {v['hidden_min_rank']:.2f}), exposed {v['exposed_s'] * 1e3:.1f} ms of"
                  f" {v['in_flight_s'] * 1e3:.1f} ms in flight, {v['buckets']:.0f} buckets, posts"
                  f" {v['post_s'] * 1e3:.1f} ms; backward {v['backward_s'] * 1e3:.1f} ms (compute"
                  f" {v['compute_s'] * 1e3:.1f} ms)")
            print(f"    {'':>8}  no communication {v['no_comm_step_s'] * 1e3:.1f} ms, all gradients'"
                  f" all_reduce {v['allreduce_all_grads_s'] * 1e3:.1f} ms, hidden (step-based)"
                  f" {v['hidden_step_based']:.2f}; {v['params'] / 1e6:.1f}M parameters in {a.layers} layers")
        for p in peers:
            print(f"DDP step time shmproxy/{p}: {d['shmproxy']['step_s'] / d[p]['step_s']:.2f}", flush=True)
    _finish(report, a.json, groups["shmproxy"])


if __name__ == "__main__":
    main()
