"""Allreduce (float32) percentiles of rank 0 and the median iteration's CLOCK_MONOTONIC span (for perf sched).
mpiexec -n 2 python art.py NBYTES ITERS"""
import sys, time
import numpy as np
import proxy
n = int(sys.argv[1]); iters = int(sys.argv[2])
with proxy.init() as comm:
    a = comm.alloc(n // 4, np.float32); b = comm.alloc(n // 4, np.float32); a[:] = 1
    for _ in range(20): comm.Allreduce(a, b)
    ts = []
    for _ in range(iters):
        t0 = time.clock_gettime(time.CLOCK_MONOTONIC); comm.Allreduce(a, b); t1 = time.clock_gettime(time.CLOCK_MONOTONIC); ts.append((t0, t1))
    if comm.rank == 0:
        d = sorted(((t1 - t0) * 1e6, t0, t1) for t0, t1 in ts)
        print("p10/med/p90 %.0f %.0f %.0f" % (d[len(d)//10][0], d[len(d)//2][0], d[len(d)*9//10][0]))
        for q in (len(d)//2, len(d)//2+1):
            print(f"ar {d[q][0]:.0f} us  from {d[q][1]:.6f} to {d[q][2]:.6f}")
