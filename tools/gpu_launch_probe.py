"""What one device op costs the progress process in CUDA calls: separate calls against one CUDA graph launch.

    python3 tools/gpu_launch_probe.py

Three processes on GPU 0, as two ranks and their progress process: each "rank" allocates 64 MiB and
passes its CUDA IPC handle; the "proxy" opens both and, with about 20 us of Python between calls (the
progress loop keeps the driver's code out of the caches, and that is what it pays), times two
rounds of each variant: a small reduction kernel and an event record, an 8 B and a 64 MiB copy and an
event record, each as separate driver calls and as one launch of an instantiated graph holding the
same work and an external event record node (transports/cuda_driver.py captures them so), and a
kernel with cuStreamWriteValue32 into a host word. Printed: the calls' cost and the trip from the
first call until the work is done (spinning on the event, or on the host word), medians in us. The
driver API is reached through ctypes, so nothing beyond cupy is needed.
"""
from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import statistics
import time
from typing import Any, Callable

import numpy as np

NBYTES = 64 << 20
ROUNDS, CALLS, SKIP = 2, 300, 30      # rounds of every variant, calls per round, warm-up calls dropped
_U64, _VP, _UINT = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint
_CAPTURE_RELAXED, _RECORD_EXTERNAL = 2, 1
# the shape of the progress process's fused reduction (proxy/coll/gpu.py): two inputs, two outputs
_KERNEL = r"""
extern "C" __global__ void k(unsigned long long i0, unsigned long long i1, unsigned long long o0,
                             unsigned long long o1, long long n) {
    for (long long k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += blockDim.x * gridDim.x) {
        float a = ((const float*)i0)[k] + ((const float*)i1)[k];
        ((float*)o0)[k] = a;
        ((float*)o1)[k] = a;
    }
}
"""


def rank(q: Any, stop: Any) -> None:
    import cupy as cp
    rt = cp.cuda.runtime
    ptr = rt.malloc(NBYTES)
    rt.memset(ptr, 1, NBYTES)
    rt.deviceSynchronize()
    q.put(bytes(rt.ipcGetMemHandle(ptr)))
    stop.wait()


def _driver() -> Any:
    drv = ctypes.CDLL("libcuda.so.1")
    for name, args in (("cuMemcpyAsync", [_U64, _U64, ctypes.c_size_t, _VP]), ("cuEventRecord", [_VP, _VP]),
                       ("cuEventQuery", [_VP]), ("cuEventRecordWithFlags", [_VP, _VP, _UINT]),
                       ("cuLaunchKernel", [_VP] + [_UINT] * 7 + [_VP, _VP, _VP]), ("cuGraphLaunch", [_VP, _VP]),
                       ("cuStreamBeginCapture_v2", [_VP, ctypes.c_int]),
                       ("cuStreamEndCapture", [_VP, ctypes.POINTER(_VP)]),
                       ("cuGraphInstantiateWithFlags", [ctypes.POINTER(_VP), _VP, ctypes.c_ulonglong]),
                       ("cuStreamWriteValue32_v2", [_VP, _U64, _UINT, _UINT]),
                       ("cuMemHostGetDevicePointer_v2", [ctypes.POINTER(_U64), _VP, _UINT])):
        getattr(drv, name).argtypes = args
    return drv


def proxy(a: int, b: int) -> dict:
    import cupy as cp
    drv = _driver()
    stream = cp.cuda.Stream(non_blocking=True)
    sp = stream.ptr
    event = cp.cuda.Event(block=False, disable_timing=True)
    evp = event.ptr
    fptr = cp.RawKernel(_KERNEL, "k").kernel.ptr
    values = (_U64 * 5)(a, a + 8, b, b + 8, 2)
    params = (_VP * 5)(*[ctypes.addressof(values) + 8 * i for i in range(5)])
    host = cp.cuda.alloc_pinned_memory(64)
    flag = np.frombuffer(host, np.uint32, 16)
    flag_dev = _U64(0)
    assert drv.cuMemHostGetDevicePointer_v2(ctypes.byref(flag_dev), flag.ctypes.data, 0) == 0

    def kernel() -> None:
        assert drv.cuLaunchKernel(fptr, 1, 1, 1, 256, 1, 1, 0, sp, params, None) == 0

    def copy(n: int) -> Callable[[], None]:
        return lambda: drv.cuMemcpyAsync(b, a, n, sp)

    def graph(work: Callable[[], None]) -> int:
        """``work`` and an external record of ``event`` as an instantiated graph."""
        assert drv.cuStreamBeginCapture_v2(sp, _CAPTURE_RELAXED) == 0
        work()
        assert drv.cuEventRecordWithFlags(evp, sp, _RECORD_EXTERNAL) == 0
        g, exe = _VP(), _VP()
        assert drv.cuStreamEndCapture(sp, ctypes.byref(g)) == 0
        assert drv.cuGraphInstantiateWithFlags(ctypes.byref(exe), g, 0) == 0
        return exe.value

    def separate(work: Callable[[], None]) -> Callable[[], None]:
        return lambda: (work(), drv.cuEventRecord(evp, sp))

    def launched(exe: int) -> Callable[[], None]:
        return lambda: drv.cuGraphLaunch(exe, sp)

    variants = {
        "kernel + record": separate(kernel), "graph(kernel, record)": launched(graph(kernel)),
        "memcpy 8 B + record": separate(copy(8)), "graph(memcpy 8 B, record)": launched(graph(copy(8))),
        "memcpy 64 MiB + record": separate(copy(NBYTES)),
        "graph(memcpy 64 MiB, record)": launched(graph(copy(NBYTES))),
        "kernel + cuStreamWriteValue32": lambda: (kernel(), drv.cuStreamWriteValue32_v2(sp, flag_dev.value, 1, 0)),
    }
    stream.synchronize()
    junk = list(range(600))

    def pollute() -> None:   # the progress loop's Python between two ops
        d = {}
        for i in junk:
            d[i] = str(i)

    res: dict = {}
    for rnd in range(ROUNDS):
        for name, fn in variants.items():
            calls, trips = [], []
            for _ in range(CALLS):
                pollute()
                flag[0] = 0
                t0 = time.perf_counter_ns()
                fn()
                t1 = time.perf_counter_ns()
                if name.endswith("WriteValue32"):
                    while flag[0] == 0:
                        pass
                else:
                    while drv.cuEventQuery(evp) != 0:
                        pass
                t2 = time.perf_counter_ns()
                calls.append(t1 - t0)
                trips.append(t2 - t0)
            res[f"{name}, round {rnd}"] = {"calls_us": round(statistics.median(calls[SKIP:]) / 1e3, 2),
                                           "trip_us": round(statistics.median(trips[SKIP:]) / 1e3, 2)}
    return res


def main() -> None:
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    ranks = [ctx.Process(target=rank, args=(q, stop)) for _ in range(2)]
    for r in ranks:
        r.start()
    try:
        handles = [q.get(timeout=120), q.get(timeout=120)]
        import cupy as cp
        cp.cuda.Device(0).use()
        a, b = (cp.cuda.runtime.ipcOpenMemHandle(h, 1) for h in handles)
        res = proxy(a, b)
        for k, v in res.items():
            print(f"{k:34s} {v['calls_us']:7.2f} us of calls, {v['trip_us']:7.2f} us until done")
        print("PROBE_JSON " + json.dumps(res))
    finally:
        stop.set()
        for r in ranks:
            r.join(30)


if __name__ == "__main__":
    main()
