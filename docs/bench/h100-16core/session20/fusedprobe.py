# 2-rank Allreduce's device work, bare (one process, cupy): cupy add into out0 then a copy to out1,
# against shmproxy's fused kernel writing both outputs (coll/gpu.py fused_kernel), same grid rule.
import cupy as cp, numpy as np
from shmproxy.core.ops import ReduceOp
from shmproxy.coll.gpu import fused_kernel, _FUSED_BLOCK
for nbytes in (1 << 20, 16 << 20, 64 << 20, 256 << 20):
    n = nbytes // 4
    a, b = cp.random.rand(n, dtype=cp.float32), cp.random.rand(n, dtype=cp.float32)
    o0, o1 = cp.empty_like(a), cp.empty_like(a)
    k = fused_kernel(cp, ReduceOp.SUM, np.dtype(np.float32), 2, 2)
    grid = min((n + _FUSED_BLOCK - 1) // _FUSED_BLOCK, 1024)
    def ufunc():
        cp.add(a, b, out=o0); cp.cuda.runtime.memcpyAsync(o1.data.ptr, o0.data.ptr, nbytes, 3, cp.cuda.get_current_stream().ptr)
    def fused(g=grid):
        k((g,), (_FUSED_BLOCK,), (a.data.ptr, b.data.ptr, o0.data.ptr, o1.data.ptr, np.int64(n)))
    def bigfused():
        fused((n + _FUSED_BLOCK - 1) // _FUSED_BLOCK)
    res = {}
    for name, f in (("ufunc+copy", ufunc), ("fused grid<=1024", fused), ("fused full grid", bigfused)) * 2:
        f(); cp.cuda.Device().synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event(); e0.record()
        for _ in range(20): f()
        e1.record(); e1.synchronize()
        t = cp.cuda.get_elapsed_time(e0, e1) / 20 / 1e3
        res.setdefault(name, []).append(nbytes / t / 1e9)
    assert cp.allclose(o1, a + b) and cp.allclose(o0, a + b)
    print(f"{nbytes >> 20:4d} MiB algbw GB/s: " + ", ".join(f"{k} {max(v):.0f}" for k, v in res.items()), flush=True)
