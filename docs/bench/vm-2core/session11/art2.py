"""Allreduce (float32, random inputs) median/p10/p90 per rank, in us (eleventh session: streaming stores
and chunk sizes on the VM, varied with SHMPROXY_STREAMING_MIN_BYTES / SHMPROXY_CHUNK_SIZE).
mpiexec -n 2 python art2.py NBYTES ITERS"""
import sys, time
import numpy as np
import proxy
n = int(sys.argv[1]); iters = int(sys.argv[2])
with proxy.init() as comm:
    a = comm.alloc(n // 4, np.float32); b = comm.alloc(n // 4, np.float32); a[:] = np.random.default_rng(comm.rank).random(n//4)
    for _ in range(20): comm.Allreduce(a, b)
    comm.Barrier()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter(); comm.Allreduce(a, b); ts.append(time.perf_counter() - t0)
    ts.sort()
    print(comm.rank, "med %.0f p10 %.0f p90 %.0f" % (ts[len(ts)//2]*1e6, ts[len(ts)//10]*1e6, ts[len(ts)*9//10]*1e6))
