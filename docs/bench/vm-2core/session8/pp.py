"""Ping-pong percentiles of rank 0, one-way us: p10 p25 p50 p75 p90 p99 (the eighth session printed
p10 p25 p50 p90; p75 and p99 were added in the tenth), after WARMUP round trips (default 20, what
sessions 8-11 ran; the twelfth passed 1000: 20 left most of a short run before the progress process
had applied its affinity and started its copy workers).
mpiexec -n 2 python pp.py NBYTES ITERS TAG [WARMUP]"""
import sys, time
import numpy as np
import proxy
n = int(sys.argv[1]); iters = int(sys.argv[2]); tagname = sys.argv[3]
warmup = int(sys.argv[4]) if len(sys.argv) > 4 else 20
with proxy.init() as comm:
    a = comm.alloc(n, np.uint8); b = comm.alloc(n, np.uint8)
    def rt():
        if comm.rank == 0:
            comm.Send(a, 1); comm.Recv(b, 1)
        else:
            comm.Recv(b, 0); comm.Send(a, 0)
    for _ in range(warmup): rt()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter(); rt(); ts.append((time.perf_counter() - t0) * 5e5)
    if comm.rank == 0:
        q = np.percentile(ts, [10, 25, 50, 75, 90, 99])
        print(tagname, " ".join(f"{x:.0f}" for x in q))
