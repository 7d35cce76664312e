# Where a rank's device post goes (2 ranks under mpirun): cupy calls record() makes, and Isend's post.
import statistics as st, time, sys
import cupy as cp, numpy as np
import shmproxy
N = 20000
def t(f, n=N):
    t0 = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t0) / n * 1e6
with shmproxy.init() as comm:
    me = comm.rank
    if me == 0:
        s = cp.cuda.get_current_stream()
        def dev():
            with cp.cuda.Device(0): pass
        print(f"with Device(0): {t(dev):.2f} us; get_current_stream {t(cp.cuda.get_current_stream):.2f}; "
              f"stream.done {t(lambda: s.done):.2f}", flush=True)
    for size, what in ((8, "8 B"), (64 << 20, "64 MiB")):
        a = cp.ones(size, cp.uint8); cp.cuda.Device().synchronize()
        comm.Barrier()
        posts, waits = [], []
        for i in range(2000):
            if me == 0:
                t0 = time.perf_counter_ns(); r = comm.Isend(a, 1, 5); t1 = time.perf_counter_ns(); r.Wait(); t2 = time.perf_counter_ns()
                posts.append(t1 - t0); waits.append(t2 - t1)
                comm.Recv(a, 1, 6)
            else:
                comm.Recv(a, 0, 5)
                t0 = time.perf_counter_ns(); r = comm.Isend(a, 0, 6); t1 = time.perf_counter_ns(); r.Wait()
                posts.append(t1 - t0)
        print(f"rank {me} {what}: Isend post median {st.median(posts[200:])/1e3:.2f} us"
              + (f", its Wait {st.median(waits[200:])/1e3:.2f}" if waits else ""), flush=True)
        host = np.ones(size, np.uint8)
