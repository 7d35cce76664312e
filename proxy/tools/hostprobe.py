"""What the host itself allows, measured without shmproxy in the way (`tools/host_probe`).

Three questions that benchmark figures depend on (BENCHMARKS.md):

- ``bandwidth``: how many GB/s of copies and additions T threads get, each on its own 64 MiB arrays,
  the GIL released for every whole call. The ceiling of what the progress process's workers can move.
- ``interference``: how much slower pure-Python work on one CPU runs while one other process streams
  memory on another CPU, for every other CPU. On a virtual machine whose vCPUs share physical cores
  (hyperthreads the guest cannot see) or memory bandwidth, some pairs slow the work by far more than
  others: this bounds the overlap any library can show in the OSU test, where the work runs while a
  collective streams memory on other cores.
- ``speed``: the same pure-Python work timed alone on each CPU in turn, a few rounds. On a host whose
  physical cores are shared with other guests, a busy sibling hyperthread can halve a vCPU's speed
  without any steal time, and which vCPUs are slow changes from round to round (what lent hosts
  showed: docs/decisions.md, "What the lent 16-core hosts do to the 64 KiB overlap"). Figures that
  depend on one core keeping its pace (OSU's overlap at 64 KiB) move with it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import numpy as np

from shmproxy.tools.bench.stats import StealMeter
from shmproxy.shm import _native

ARRAY_BYTES = 64 << 20


def bandwidth(threads: int, kind: str, reps: int = 5) -> float:
    """GB/s moved (bytes read + written, write-allocate not counted) by ``threads`` threads."""
    n = ARRAY_BYTES // 4
    bufs = [(np.ones(n, np.float32), np.ones(n, np.float32), np.ones(n, np.float32)) for _ in range(threads)]

    def work(i: int) -> None:
        a, b, c = bufs[i]
        for _ in range(reps):
            if kind == "copy":
                _native.memcopy(c.ctypes.data, a.ctypes.data, ARRAY_BYTES)
            elif kind == "stream":
                _native.memcopy_nt(c.ctypes.data, a.ctypes.data, ARRAY_BYTES)
            else:
                np.add(a, b, out=c)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    moved = (3 if kind == "add" else 2) * ARRAY_BYTES * reps * threads
    return moved / (time.perf_counter() - t0) / 1e9


def _python_work(n: int = 300_000) -> int:
    s = 0
    for i in range(n):
        s += i * i
    return s


def _timed_work(cpu: int) -> float:
    os.sched_setaffinity(0, [cpu])
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        _python_work()
        best = min(best, time.perf_counter() - t)
    return best


_STREAMER = ("import os, sys, numpy as np\nfrom shm import _native\nos.sched_setaffinity(0, [int(sys.argv[1])])\n"
             "a = np.ones(32 << 20, np.uint8); b = np.ones(32 << 20, np.uint8)\n"
             "while True:\n    _native.memcopy_nt(b.ctypes.data, a.ctypes.data, a.size)\n")


def interference(cpu: int, others: list[int]) -> list[tuple[float, int]]:
    """(slowdown, other CPU) of pure-Python work on ``cpu`` while a process streams memory on each
    other CPU in turn, worst first. The caller's CPU affinity is restored afterwards."""
    saved = os.sched_getaffinity(0)
    out = []
    try:
        alone = _timed_work(cpu)
        for other in others:
            streamer = subprocess.Popen([sys.executable, "-c", _STREAMER, str(other)])
            try:
                time.sleep(0.3)   # let it start streaming; this is a measurement, not synchronisation
                out.append((_timed_work(cpu) / alone, other))
            finally:
                streamer.kill()
                streamer.wait()
    finally:
        os.sched_setaffinity(0, saved)
    return sorted(out, reverse=True)


def speed(cpus: list[int], rounds: int = 2) -> list[tuple[dict[int, float], float | None]]:
    """Per round: ({cpu: seconds of the work on it, best of five}, steal % meanwhile or None). The
    caller's CPU affinity is restored afterwards."""
    saved = os.sched_getaffinity(0)
    out = []
    try:
        for _ in range(rounds):
            meter = StealMeter()
            with meter:
                times = {cpu: _timed_work(cpu) for cpu in cpus}
            out.append((times, meter.pct))
    finally:
        os.sched_setaffinity(0, saved)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="host_probe", description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["bandwidth", "interference", "speed"])
    ap.add_argument("--threads", default="1,2,4,8,16", help="bandwidth: thread counts")
    ap.add_argument("--cpus", default="1", help="interference: CPUs whose work is timed")
    ap.add_argument("--rounds", type=int, default=3, help="speed: how many times every CPU is timed")
    ns = ap.parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    if ns.what == "bandwidth":
        for kind in ("copy", "stream", "add"):
            print(kind, " ".join(f"T={t}: {bandwidth(int(t), kind):.1f} GB/s" for t in ns.threads.split(",")),
                  flush=True)
    elif ns.what == "speed":
        for i, (times, steal) in enumerate(speed(allowed, ns.rounds)):
            cells = " ".join(f"{c}:{t * 1e3:.1f}" for c, t in times.items())
            spread = max(times.values()) / min(times.values())
            where = "unknown" if steal is None else f"{steal:.1f} %"
            print(f"round {i + 1}: ms per CPU {cells} | slowest/fastest {spread:.2f}x | steal {where}",
                  flush=True)
    else:
        for cpu in (int(c) for c in ns.cpus.split(",")):
            res = interference(cpu, [c for c in allowed if c != cpu])
            worst = " ".join(f"{o}: {r:.2f}x" for r, o in res[:6])
            print(f"CPU {cpu}: median slowdown {res[len(res) // 2][0]:.2f}x; worst partners {worst}", flush=True)
    return 0
