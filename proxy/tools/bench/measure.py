"""How one library is measured at one size: the timed loop of point to point (``measure_loop``), the
posting cost (``measure_post``), the idle CPU (``measure_idle``) and the timed collectives
(``measure_coll``); before a checked collective call the receive buffer is reset (``_prepare``), after
the timed loop the received data is checked (``_finish_check``). The overlap is in ``overlap.py``.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, Callable

import numpy as np

from shmproxy.tools.bench.calls import _in_place
from shmproxy.tools.bench.libraries import Library
from shmproxy.tools.bench.operation import Ctx, Operation
from shmproxy.tools.bench.patterns import SENTINEL, CheckSpec
from shmproxy.tools.bench.stats import summarize
from shmproxy.tools.bench.traffic import TAG_OP, barrier

IDLE_SETTLE_S = 0.5
"""Before the idle window, let the receivers post and the progress process finish its spin phase."""

_perf = time.perf_counter


def _timed_loop(it: Callable[[], Any], iters: int) -> list[float]:
    times = [0.0] * iters
    for i in range(iters):
        t0 = _perf()
        it()
        times[i] = _perf() - t0
    return times


def _finish_check(ctx: Ctx, op: Operation, lib: Library, recv: np.ndarray, count: int = 0) -> float:
    """1.0 when the received data is right (or unchecked), 0.0 when wrong; applies --inject-error."""
    if ctx.args.check:
        lib.fetch(recv)   # device buffers (--device cuda): what the calls wrote
    if ctx.inject_pending and lib.name == "shmproxy" and op.takes_data(ctx.rank, ctx.size):
        ctx.inject_pending = False
        recv[(0,) * recv.ndim] = SENTINEL
    if not ctx.args.check:
        return 1.0
    if op.verify is not None:
        spec = CheckSpec(getattr(ctx.args, "redop", None) or "sum", _in_place(ctx), count)
        return 1.0 if op.verify(ctx.rank, ctx.size, recv, spec) else 0.0
    return 1.0 if op.check_received(ctx.rank, ctx.size, recv) else 0.0


def _prepare(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray) -> None:
    """Before a checked collective call: the receive buffer holds the sentinel, or, where the call
    works in place (--in-place, or a library whose call is in place by nature), the input."""
    if _in_place(ctx) or lib.kind in op.native_in_place:
        (op.place_input or _copy_input)(ctx.rank, ctx.size, send, recv)
    else:
        recv.fill(SENTINEL)
    lib.refresh(recv)


def _copy_input(rank: int, size: int, send: np.ndarray, recv: np.ndarray) -> None:
    np.copyto(recv, send)


def loop_times(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray, iters: int,
               warmup: int) -> list[float]:
    """Per-iteration seconds of one library at one size: warm up, reset the receive buffer, time."""
    it = op.calls[lib.kind](ctx, lib, lib.wrap(send), lib.wrap(recv))
    barrier(ctx.comm)
    if it is not None:
        for _ in range(warmup):
            it()
    recv.fill(SENTINEL)
    lib.refresh(recv)
    barrier(ctx.comm)
    if it is None:
        return []
    return _timed_loop(it, iters)


def measure_loop(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray, iters: int,
                 warmup: int) -> list[float]:
    """[time_us, p99_us] of one library at one size (``loop_times``)."""
    return list(summarize(loop_times(ctx, op, lib, send, recv, iters, warmup), op.time_divisor))


def measure_post(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray, iters: int,
                 warmup: int) -> list[float]:
    """[single_us, single_p99_us, group_us_per_op] on rank 0, posting to rank 1.

    single: each Isend post timed alone (the wait for its completion is outside the timed region).
    group: ``--group-size`` Isends posted back to back inside ``lib.group()`` (shmproxy: one splice
    for all of them; the peers have no such call, so the posts simply follow each other), the time
    from before the first post to after the group is closed, divided by the number of posts.
    Rank 1 receives every message (the group ones into distinct rows, posted as a group of Irecvs)."""
    gsize = recv.shape[0]
    reps = max(10, iters // gsize)
    wreps = max(1, warmup // gsize)
    isend, irecv, wait, waitall, group = lib.isend, lib.irecv, lib.wait, lib.waitall, lib.group
    barrier(ctx.comm)
    out = [math.nan, math.nan, math.nan]
    if ctx.rank == 0:
        s = lib.wrap(send)
        single = []
        for i in range(warmup + iters):
            t0 = _perf()
            req = isend(s, 1, TAG_OP)
            t1 = _perf()
            wait(req)
            if i >= warmup:
                single.append(t1 - t0)
        grouped = []
        for i in range(wreps + reps):
            t0 = _perf()
            with group():
                reqs = [isend(s, 1, TAG_OP) for _ in range(gsize)]
            t1 = _perf()
            waitall(reqs)
            if i >= wreps:
                grouped.append((t1 - t0) / gsize)
        out = [*summarize(single), summarize(grouped)[0]]
    elif ctx.rank == 1:
        rows = [lib.wrap(recv[j]) for j in range(gsize)]
        recv_one = lib.recv
        for _ in range(warmup + iters):
            recv_one(rows[0], 0, TAG_OP)
        for i in range(wreps + reps):
            if i == wreps:
                recv.fill(SENTINEL)
            with group():
                reqs = [irecv(rows[j], 0, TAG_OP) for j in range(gsize)]
            waitall(reqs)
    return out


def _cpu_seconds(pid: int) -> float:
    import psutil
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _voluntary_switches(pid: int) -> int:
    """Voluntary context switches of every thread of ``pid`` (each is a sleep, i.e. a wake-up)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
        except FileNotFoundError:
            pass                                      # a thread that ended meanwhile
    return total


def measure_idle(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray, iters: int,
                 warmup: int) -> list[float]:
    """[proxy %core, proxy wake-ups/s, waiting ranks' %core (max)] over --idle-seconds.

    Every rank but 0 blocks in a receive (as an application waiting for work does); rank 0 samples
    the CPU time of the progress process and of the waiting ranks, then sends them their message."""
    barrier(ctx.comm)
    if ctx.rank != 0:
        recv.fill(SENTINEL)
        lib.recv(lib.wrap(recv), 0, TAG_OP)
        return [math.nan, math.nan, math.nan]
    proxy_pid = ctx.comm._proxy.pid
    waiting = ctx.pids[1:]
    time.sleep(IDLE_SETTLE_S)
    c0 = [_cpu_seconds(p) for p in [proxy_pid, *waiting]]
    v0 = _voluntary_switches(proxy_pid)
    t0 = _perf()
    time.sleep(ctx.args.idle_seconds)
    wall = _perf() - t0
    c1 = [_cpu_seconds(p) for p in [proxy_pid, *waiting]]
    v1 = _voluntary_switches(proxy_pid)
    s = lib.wrap(send)
    for dst in range(1, ctx.size):
        lib.send(s, dst, TAG_OP)
    pct = [100.0 * (b - a) / wall for a, b in zip(c0, c1)]
    return [pct[0], (v1 - v0) / wall, max(pct[1:], default=math.nan)]


def coll_times(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray, iters: int,
               warmup: int) -> list[float]:
    """Per-call seconds of one collective at one size; then one more call, the checked one.

    Warm up, barrier, ``iters`` calls each timed alone; then the receive buffer is reset (``_prepare``:
    the sentinel, or the input for a call that works in place, whose timed calls overwrote it),
    a barrier, and one call whose result ``_finish_check`` compares with the expected one."""
    it = op.calls[lib.kind](ctx, lib, lib.wrap(send), lib.wrap(recv))
    _prepare(ctx, op, lib, send, recv)
    barrier(ctx.comm)
    for _ in range(warmup):
        it()
    barrier(ctx.comm)
    times = _timed_loop(it, iters)
    _prepare(ctx, op, lib, send, recv)
    barrier(ctx.comm)
    it()
    return times


def measure_coll(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray, iters: int,
                 warmup: int) -> list[float]:
    """[time_us, p99_us] of one collective at one size (``coll_times``)."""
    return list(summarize(coll_times(ctx, op, lib, send, recv, iters, warmup), op.time_divisor))


# The measures whose figures are the median and p99 of per-iteration times: with --rounds, the times
# of every round are pooled before they are summarized.
RAW_TIMES = {measure_loop: loop_times, measure_coll: coll_times}
