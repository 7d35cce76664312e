# Session 24, tenth call (1x H200), the final code: the 64 MiB ping-pong (BENCHMARKS.md's command) and
# the limit it is held to, the device-to-device copy, in the same run on the same machine.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || exit 1
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 CUDA_VISIBLE_DEVICES=0
d2d() {
python3 - <<'PY'
import cupy as cp, time
for nbytes in (64 << 20, 256 << 20):
    a, b = cp.ones(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)
    s = cp.cuda.get_current_stream()
    best = 0.0
    for _ in range(20):
        s.synchronize(); t = time.perf_counter()
        for _ in range(10):
            cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, 3, s.ptr)
        s.synchronize(); best = max(best, 10 * nbytes / (time.perf_counter() - t) / 1e9)
    print(f"D2D {nbytes >> 20} MiB best {best:.0f} GB/s")
PY
}
{ d2d
  for r in 1 2 3 4; do
    timeout 60 mpirun -n 2 --bind-to core -x PYTHONPATH -x CUDA_VISIBLE_DEVICES python3 -m shmproxy.tools.bench \
        pingpong --device cuda -b 64M -e 64M -n 2000 --peers none 2>&1 | grep -E "^ +67108864" || echo "(failed)"
  done
  d2d; } | tee $OUT/pingpong64_and_d2d.log
