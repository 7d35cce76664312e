"""Ping-pong percentiles of rank 0, one-way us: p10 p25 p50 p75 p90 p99 (the eighth session printed
p10 p25 p50 p90; p75 and p99 were added in the tenth). mpiexec -n 2 python pp.py NBYTES ITERS TAG"""
import sys, time
import numpy as np
import proxy
n = int(sys.argv[1]); iters = int(sys.argv[2]); tagname = sys.argv[3]
with proxy.init() as comm:
    a = comm.alloc(n, np.uint8); b = comm.alloc(n, np.uint8)
    def rt():
        if comm.rank == 0:
            comm.Send(a, 1); comm.Recv(b, 1)
        else:
            comm.Recv(b, 0); comm.Send(a, 0)
    for _ in range(20): rt()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter(); rt(); ts.append((time.perf_counter() - t0) * 5e5)
    if comm.rank == 0:
        q = np.percentile(ts, [10, 25, 50, 75, 90, 99])
        print(tagname, " ".join(f"{x:.0f}" for x in q))
