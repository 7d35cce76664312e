# what a GPU-side completion write costs the calling thread (us per call, median of 2000)
import ctypes, mmap, time, statistics as st
import cupy as cp
from shmproxy.transports.cuda_driver import Driver
d = Driver(); dev = cp.cuda.Device(0); dev.use()
s = cp.cuda.Stream(non_blocking=True)
page = mmap.mmap(-1, 1 << 16); buf = (ctypes.c_uint64 * 8192).from_buffer(page); addr = ctypes.addressof(buf)
d.host_register(addr, 1 << 16); dptr = d.host_device_pointer(addr)
print("delta", dptr - addr)
src = cp.zeros(8, cp.uint8); dst = cp.zeros(8, cp.uint8)
def bench(name, fn, n=2000):
    ts = []
    for i in range(n):
        t0 = time.perf_counter_ns(); fn(i); ts.append(time.perf_counter_ns() - t0)
        if i % 50 == 49: s.synchronize()
    s.synchronize()
    print(f"{name:40s} {st.median(ts)/1e3:6.2f} us  p90 {sorted(ts)[int(.9*n)]/1e3:6.2f}")
bench("write64 host word", lambda i: d.write64(dptr + 8 * (i % 64), i, s.ptr))
bench("write64 x2", lambda i: (d.write64(dptr + 8 * (i % 64), i, s.ptr), d.write64(dptr + 8 * (i % 64) + 4096, i, s.ptr)))
bench("memcpy 8 B", lambda i: d.memcpy(dst.data.ptr, src.data.ptr, 8, s.ptr))
ev = cp.cuda.Event(block=False, disable_timing=True)
bench("event record", lambda i: d.record(ev.ptr, s.ptr))
bench("event query", lambda i: d.done(ev.ptr))
# write64 after a memcpy each time (as in the loop)
bench("memcpy + write64 x2", lambda i: (d.memcpy(dst.data.ptr, src.data.ptr, 8, s.ptr), d.write64(dptr + 8 * (i % 64), i, s.ptr), d.write64(dptr + 8 * (i % 64) + 4096, i, s.ptr)))
# a device-memory target for comparison
w = cp.zeros(64, cp.uint64)
bench("write64 device word", lambda i: d.write64(w.data.ptr + 8 * (i % 64), i, s.ptr))
lib = ctypes.CDLL("libcuda.so.1")
# cuStreamBatchMemOp_v2(stream, count, CUstreamBatchMemOpParams*, flags): union of 48 bytes; writeValue: operation(u32)=2 WRITE_VALUE_64=5? 
d.host_unregister(addr)
