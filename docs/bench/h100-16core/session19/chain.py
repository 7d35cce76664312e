# rank side of the chain measurement: ping-pong on cupy arrays, each call's start and return (monotonic ns)
import json, os, sys, time
import cupy as cp
import shmproxy
nbytes, n = int(sys.argv[1]), int(sys.argv[2])
comm = shmproxy.init()
r = comm.rank
a = cp.zeros(max(nbytes, 1), cp.uint8)[:nbytes]
rows = []
mono = time.monotonic_ns
for i in range(n):
    if r == 0:
        t0 = mono(); comm.Send(a, 1, 0); t1 = mono(); comm.Recv(a, 1, 0); t2 = mono()
    else:
        t0 = mono(); comm.Recv(a, 0, 0); t1 = mono(); comm.Send(a, 0, 0); t2 = mono()
    rows.append((t0, t1, t2))
json.dump(rows, open(f"/tmp/chain_rank{r}_{nbytes}.json", "w"))
comm.close()
