import time, os
from shmproxy.shm import pool as P
from shmproxy.core.ops import Op
fields = P.RECORD.unpack_from(bytes(P.RECORD_BYTES))
def b():
    n=200000
    t=time.perf_counter()
    for i in range(n): Op(1, fields, 0, 5)
    a=(time.perf_counter()-t)/n*1e6
    t=time.perf_counter()
    for i in range(n): time.monotonic_ns()
    m=(time.perf_counter()-t)/n*1e6
    print(f"pid {os.getpid()} cpu {os.sched_getaffinity(0) if len(os.sched_getaffinity(0))<4 else 'many'}: Op() {a:.3f} us, monotonic_ns {m:.3f} us", flush=True)
b()
