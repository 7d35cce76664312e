"""Which CPUs slow a progress-loop-like task on another CPU while they run pure-Python work (as the
overlap benchmark's ranks do): hyperthread siblings, or a host whose vCPUs share physical cores.
The task: a pure-Python loop plus one 8-input 64 KiB float32 reduction into 8 outputs (the inline
Allreduce's C call). Prints the slowdown of the task on each CPU of TIMED for a spinner on each
other CPU, then for spinners on every CPU of BUSY together.
    python3 siblings.py [TIMED=8,12,15] [BUSY=0-7]"""
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.getcwd())
from shm import _reduce  # noqa: E402
from proxy.params import parse_cpu_list  # noqa: E402

SPIN = "import os, sys\nos.sched_setaffinity(0, [int(sys.argv[1])])\nx = 1\nwhile True:\n    x = (x * 1103515245 + 7) & 0xFFFFFFFF\n"
n = 16384
srcs = [np.ones(n, np.float32) for _ in range(8)]
dsts = [np.empty(n, np.float32) for _ in range(8)]
SUM = 1   # proxy.ReduceOp.SUM's code; the float32 code below


def task() -> float:
    best = float("inf")
    for _ in range(20):
        t = time.perf_counter()
        s = 0
        for i in range(2000):
            s += i * i
        for _ in range(4):
            _reduce.reduce(SUM, DT, n, [a.ctypes.data for a in srcs], [b.ctypes.data for b in dsts], False)
        best = min(best, time.perf_counter() - t)
    return best


def with_spinners(cpu: int, others: list[int]) -> float:
    procs = [subprocess.Popen([sys.executable, "-c", SPIN, str(o)]) for o in others]
    try:
        time.sleep(0.2)   # a measurement: let them start
        os.sched_setaffinity(0, [cpu])
        return task()
    finally:
        for p in procs:
            p.kill()
            p.wait()


from proxy.ops import DTYPE_CODE  # noqa: E402
DT = DTYPE_CODE[np.dtype(np.float32).char]
timed = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "8,12,15").split(",")]
busy = parse_cpu_list(sys.argv[2] if len(sys.argv) > 2 else "0-7")
allc = sorted(os.sched_getaffinity(0))
for c in timed:
    os.sched_setaffinity(0, [c])
    alone = task()
    row = []
    for o in allc:
        if o != c:
            row.append((with_spinners(c, [o]) / alone, o))
    worst = sorted(row, reverse=True)[:4]
    print(f"cpu {c}: alone {alone * 1e6:.1f} us; worst single spinners " +
          ", ".join(f"cpu {o}: {s:.2f}x" for s, o in worst) +
          f"; median {np.median([s for s, _ in row]):.2f}x; all of {sys.argv[2] if len(sys.argv) > 2 else '0-7'}: "
          f"{with_spinners(c, [b for b in busy if b != c]) / alone:.2f}x", flush=True)
