"""Overlap of a nonblocking allreduce with pure-Python work, measured as OSU's osu_iallreduce: the
work and its calibration, the measurement (``measure_overlap``) and the overlap percentage.

Overlap (OSU method)
--------------------
As OSU's osu_iallreduce (``osu_util.c``: ``do_compute_cpu``, ``calculate_and_print_stats``), for each
size and library:

1. ``t_comm``: (Iallreduce; Wait) alone, each iteration followed by the library's own barrier
   (untimed), as OSU does; this rank's mean over ``-n`` iterations.
2. The work: pure-Python integer arithmetic (it holds the GIL, as an application's Python does) in
   chunks of ~2 us, repeated until this rank's ``t_comm`` of wall time has passed (OSU computes for
   a time, not an amount: ``do_compute_cpu`` loops until ``latency_in_secs`` have elapsed).
3. ``t_total``: (post Iallreduce; the work; Wait), each iteration followed by the barrier (untimed);
   ``t_compute`` = the work's time inside those iterations (OSU's "Compute" column). Means over the
   iterations.

Each figure is then averaged over the ranks (OSU reduces with MPI_SUM and divides by the number of
processes), and ``overlap % = 100 * max(0, 1 - (t_total - t_compute) / t_comm)`` (clipped to 100): the
fraction of the communication hidden behind the work. 100 means communicating cost nothing; 0 that it
was all added. mpi4py: ``Iallreduce`` + ``Wait`` and ``Barrier``; gloo: ``dist.all_reduce(async_op=True)``
+ ``work.wait()`` and ``dist.barrier``.

``post`` and ``wait`` split what was not hidden (``t_total - t_compute``): the post's own cost on the
rank, and the Wait after the work: its cost when the collective completed during the work, and what
was left of the collective when it did not.

``work_slowdown`` (in the JSON) says what OSU's method does not: how much less work a rank got done
per second while the collective was in flight than alone (the same chunks, timed alone ``-n`` times).
Above 1, communicating slowed the rank's own computation (shared cores, memory bandwidth, or a host
whose vCPUs share physical cores: ``tools/host_probe interference``).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from shmproxy.tools.bench.calls import BARRIERS
from shmproxy.tools.bench.libraries import Library
from shmproxy.tools.bench.measure import _perf, _prepare
from shmproxy.tools.bench.operation import Ctx, Operation
from shmproxy.tools.bench.traffic import barrier


def overlap_percent(t_comm: float, t_compute: float, t_total: float) -> float:
    """OSU: 100 * max(0, 1 - (t_total - t_compute) / t_comm), at most 100; NaN without a t_comm."""
    if not (t_comm > 0) or math.isnan(t_compute) or math.isnan(t_total):
        return math.nan
    return 100.0 * min(1.0, max(0.0, 1.0 - (t_total - t_compute) / t_comm))


def spin(units: int) -> int:
    """The overlap benchmark's work: pure-Python integer arithmetic (holds the GIL throughout)."""
    x = 1
    for i in range(units):
        x = (x * 1103515245 + i) & 0xFFFFFFFF
    return x


def rescale_units(units: int, measured_s: float, target_s: float) -> int:
    """Work units that should take ``target_s``, given that ``units`` took ``measured_s``."""
    if not measured_s > 0:
        return max(1, units * 2)
    return max(1, int(round(units * target_s / measured_s)))


def calibrate(target_s: float, work: Callable[[int], Any] = spin, rounds: int = 3) -> int:
    """Units of ``work`` taking about ``target_s`` on this core: a first rate from a ~2 ms run, then
    ``rounds`` corrections from the fastest of three runs at the current guess (the fastest: a run
    that was preempted says nothing about the work's cost)."""
    units, took = 256, 0.0
    while True:
        t0 = _perf()
        work(units)
        took = _perf() - t0
        if took >= 2e-3 or units >= 1 << 26:
            break
        units *= 4
    units = rescale_units(units, took, target_s)
    for _ in range(rounds):
        runs = []
        for _ in range(3):
            t0 = _perf()
            work(units)
            runs.append(_perf() - t0)
        units = rescale_units(units, min(runs), target_s)
    return units


WORK_CHUNK_S = 2e-6     # one chunk of the overlap benchmark's work (OSU's compute_on_host: ~1 us)


def work_for(seconds: float, chunk: int) -> int:
    """The overlap benchmark's work: ``spin(chunk)`` until ``seconds`` of wall time have passed (at
    least once), as OSU's do_compute_cpu. Returns the chunks done."""
    t0, n = _perf(), 0
    while True:
        spin(chunk)
        n += 1
        if _perf() - t0 >= seconds:
            return n


def measure_overlap(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray, iters: int,
                    warmup: int) -> list[float]:
    """[t_comm_us, t_compute_us, t_total_us, work_slowdown, post_us, wait_us] at one size, as OSU's osu_iallreduce
    (see the module's "Overlap" section): means over ``iters`` iterations, each followed by the
    library's barrier; the work runs for this rank's t_comm of wall time."""
    post, wait = op.calls[lib.kind](ctx, lib, lib.wrap(send), lib.wrap(recv))
    lib_barrier = BARRIERS[lib.kind](ctx, lib, None, None)   # OSU's MPI_Barrier, untimed
    _prepare(ctx, op, lib, send, recv)
    barrier(ctx.comm)
    for _ in range(warmup):
        wait(post())
        lib_barrier()
    t_comm = [0.0] * iters
    for i in range(iters):
        t0 = _perf()
        wait(post())
        t_comm[i] = _perf() - t0
        lib_barrier()
    target = float(np.mean(t_comm))
    chunk = calibrate(WORK_CHUNK_S)
    rate_alone = []
    for _ in range(iters):
        t0 = _perf()
        n = work_for(target, chunk)
        rate_alone.append(n / (_perf() - t0))
    barrier(ctx.comm)
    for _ in range(min(warmup, 3)):
        req = post()
        work_for(target, chunk)
        wait(req)
        lib_barrier()
    total, during, rate, posting, waiting = ([0.0] * iters for _ in range(5))
    for i in range(iters):
        t0 = _perf()
        req = post()
        t1 = _perf()
        n = work_for(target, chunk)
        t2 = _perf()
        wait(req)
        t3 = _perf()
        total[i], during[i], rate[i], posting[i], waiting[i] = t3 - t0, t2 - t1, n / (t2 - t1), t1 - t0, t3 - t2
        lib_barrier()
    _prepare(ctx, op, lib, send, recv)
    barrier(ctx.comm)
    wait(post())
    slowdown = float(np.median(rate_alone) / np.median(rate)) if min(rate) > 0 else math.nan
    return ([float(np.mean(x)) * 1e6 for x in (t_comm, during, total)] + [slowdown]
            + [float(np.mean(x)) * 1e6 for x in (posting, waiting)])


def _derive_overlap(res: dict[str, Any], per_rank: np.ndarray) -> None:
    """OSU: each figure averaged over the ranks, then the overlap of those means; per rank from each
    rank's own figures."""
    means = [float(np.nanmean(per_rank[:, i])) for i in range(per_rank.shape[1])]
    (res["t_comm_us"], res["t_compute_us"], res["t_total_us"], res["work_slowdown"], res["post_us"],
     res["wait_us"]) = means
    res["overlap_pct"] = overlap_percent(*means[:3])
    res["ranks"]["overlap_pct"] = [
        None if math.isnan(v := overlap_percent(row[0], row[1], row[2])) else v for row in per_rank.tolist()]
