import time, cupy as cp
def t(f, n=20000):
    t0 = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t0) / n * 1e6
def dev():
    with cp.cuda.Device(0): pass
print(f"with Device(0) {t(dev):.2f} us; runtime.getDevice {t(cp.cuda.runtime.getDevice):.2f}; "
      f"get_current_stream {t(cp.cuda.get_current_stream):.2f}; Device(0) alone {t(lambda: cp.cuda.Device(0)):.2f}", flush=True)
