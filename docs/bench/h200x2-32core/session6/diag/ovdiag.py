"""Per-iteration overlap diagnosis: ranks record post/work/wait times (monotonic ns), the progress
process its profile; joined offline."""
import os, sys, time, json
import numpy as np
import proxy
from proxy.bench import work_for, calibrate, WORK_CHUNK_S
out = os.environ["XOUT"]
size = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
iters = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
comm = proxy.init()
n = size // 4
send = comm.alloc((n,), np.float32); recv = comm.alloc((n,), np.float32)
send[:] = 1
ns = time.monotonic_ns
for _ in range(200):
    comm.Iallreduce(send, recv).Wait(); comm.Barrier()
tc = np.zeros((iters, 2), np.int64)
for i in range(iters):
    t0 = ns(); comm.Iallreduce(send, recv).Wait(); t1 = ns(); tc[i] = (t0, t1); comm.Barrier()
target = float(np.mean(tc[:, 1] - tc[:, 0])) / 1e9
chunk = calibrate(WORK_CHUNK_S)
for _ in range(50):
    work_for(target, chunk)
comm.Barrier()
to = np.zeros((iters, 4), np.int64)
for i in range(iters):
    t0 = ns(); r = comm.Iallreduce(send, recv); t1 = ns(); work_for(target, chunk); t2 = ns(); r.Wait(); t3 = ns()
    to[i] = (t0, t1, t2, t3); comm.Barrier()
np.savez(f"{out}/rank{comm.rank}.npz", tc=tc, to=to, target=target)
comm.close()
