#!/usr/bin/env bash
# tools/gpu_multi.sh: what a host with two or more GPUs settles, in one go (about 15 minutes).
#
#   OUT=/tmp/out tools/gpu_multi.sh        # from the repository root of a lent GPU host
#   STEPS="limits bench" tools/gpu_multi.sh   # some steps only (default: tests limits bench): a lent
#                                             # machine's command is bounded (10 min), so split there
#   STEPS=ce tools/gpu_multi.sh       # the copy-engine exchanges against the kernels' (4, below)
#   BENCH_TIMEOUT_S=150 (default 400) bounds each bench run; TESTS_TIMEOUT_S (default 900) the suite
#
#   1. the GPU suite (tools/gpu_tests.sh): ranks sharing GPU 0, then one rank per GPU
#      (tests/test_gpu_multi.py), then the torch backend on CUDA tensors;
#   2. the limits of the same host: each GPU's device-to-device copy, and the peer copy between
#      GPUs 0 and 1 (cupy, peer access enabled), one way and both ways at once, 256 MiB, best of 20;
#   3. shmproxy against NCCL and gloo on device buffers, one rank per GPU, under torchrun:
#      allreduce 8 B..256 MiB and pingpong 8 B..64 MiB (gloo takes no CUDA tensors in send/recv);
#   4. (STEPS=ce only) Allreduce, Allgather, Reduce_scatter 16 MiB..1 GiB and DDP's step with the
#      copy-engine exchanges off and on (chunks 2-8 MiB), NCCL beside them: ce.log.
# Output under $OUT (default ./out): gpu_tests.log, limits.txt, bench_*.log and bench_*.json.
# Needs shmproxy importable (pip install -e . or the device_bench.sh set-up), cupy, torch with NCCL.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-./out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
NGPU=$("$PY" -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())' 2>/dev/null || echo 0)
echo "== $(date -u +%FT%TZ): $NGPU GPU(s)"
nvidia-smi topo -m 2>&1 | tee "$OUT/topo.txt"

STEPS=${STEPS:-"tests limits bench"}
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
tests_rc=0
if has tests; then
    GPU_TESTS_LOG="$OUT/gpu_tests.log" timeout "${TESTS_TIMEOUT_S:-900}" tools/gpu_tests.sh
    tests_rc=$?
fi

has limits && "$PY" - <<'EOF' 2>&1 | tee "$OUT/limits.txt"
import time

import cupy as cp
n = cp.cuda.runtime.getDeviceCount()
nbytes, reps = 256 << 20, 20


def best(copy, device):
    with cp.cuda.Device(device):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(reps):
            s.record()
            copy()
            e.record()
            e.synchronize()
            times.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    return nbytes / min(times) / 1e9


bufs = []
for d in range(n):
    with cp.cuda.Device(d):
        a, b = cp.ones(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)
        bufs.append((a, b))
        d2d = best(lambda: cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, 3,   # DeviceToDevice
                                                       cp.cuda.get_current_stream().ptr), d)
        print(f"GPU {d}: device-to-device copy {d2d:.0f} GB/s (cudaMemcpyAsync)")
if n >= 2:
    with cp.cuda.Device(1):
        ok = cp.cuda.runtime.deviceCanAccessPeer(1, 0)
        if ok:
            cp.cuda.runtime.deviceEnablePeerAccess(0)
    src, dst = bufs[0][0], bufs[1][1]
    gbs = best(lambda: cp.cuda.runtime.memcpyPeerAsync(dst.data.ptr, 1, src.data.ptr, 0, nbytes,
                                                       cp.cuda.get_current_stream().ptr), 1)
    print(f"GPU 0 -> GPU 1 peer copy (peer access {'on' if ok else 'unavailable'}): {gbs:.0f} GB/s")
    # both directions busy at once, as in an exchange: each GPU's stream pushes to the other
    with cp.cuda.Device(0):
        if cp.cuda.runtime.deviceCanAccessPeer(0, 1):
            cp.cuda.runtime.deviceEnablePeerAccess(1)
    streams = []
    for d in (0, 1):
        with cp.cuda.Device(d):
            streams.append(cp.cuda.Stream(non_blocking=True))
    times = []
    for _ in range(reps):
        for d in (0, 1):
            with cp.cuda.Device(d):
                cp.cuda.Device(d).synchronize()
        t = time.perf_counter()
        for d in (0, 1):
            cp.cuda.runtime.memcpyPeerAsync(bufs[1 - d][1].data.ptr, 1 - d, bufs[d][0].data.ptr, d, nbytes,
                                            streams[d].ptr)
        for s in streams:
            s.synchronize()
        times.append(time.perf_counter() - t)
    print(f"GPU 0 <-> GPU 1 peer copies both ways at once: {nbytes / min(times) / 1e9:.0f} GB/s each way")
EOF

if ! has bench; then
    :
elif [ "$NGPU" -ge 2 ]; then
    for spec in "allreduce -b 8 -e 256M -f 8 --peers nccl,gloo" "pingpong -b 8 -e 64M -f 8 --peers nccl"; do
        name=bench_${spec%% *}
        # shellcheck disable=SC2086
        OMP_NUM_THREADS=1 timeout "${BENCH_TIMEOUT_S:-400}" "$PY" -m torch.distributed.run --nproc-per-node "$NGPU" \
            -m shmproxy.tools.bench $spec --device cuda --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
    done
else
    echo "fewer than 2 GPUs: the NCCL comparison needs a GPU per rank; skipped"
fi
# the copy-engine exchanges (DEVICE_CE_BYTES) against the kernels', in one machine start: what decides
# that parameter's default (docs/decisions.md, "The two-shot exchanges by the copy engines")
if has ce && [ "$NGPU" -ge 2 ]; then
    for op in allreduce allgather reduce_scatter; do
        for cfg in "0 4M" "16M 2M" "16M 4M" "16M 8M"; do
            set -- $cfg
            echo "== $op, DEVICE_CE_BYTES=$1 DEVICE_CE_CHUNK=$2" | tee -a "$OUT/ce.log"
            SHMPROXY_DEVICE_CE_BYTES=$1 SHMPROXY_DEVICE_CE_CHUNK=$2 OMP_NUM_THREADS=1 timeout "${BENCH_TIMEOUT_S:-400}" \
                "$PY" -m torch.distributed.run --nproc-per-node 2 -m shmproxy.tools.bench "$op" -b 16M -e 1G -f 4 \
                --device cuda --peers nccl 2>&1 | grep -E "^ +[0-9]|checks|Error" | tee -a "$OUT/ce.log"
        done
    done
    for ce in 0 16M; do
        echo "== DDP, DEVICE_CE_BYTES=$ce" | tee -a "$OUT/ce.log"
        SHMPROXY_DEVICE_CE_BYTES=$ce OMP_NUM_THREADS=1 timeout "${BENCH_TIMEOUT_S:-400}" "$PY" -m torch.distributed.run \
            --nproc-per-node 2 tools/torch_bench.py --device cuda --peers nccl --sizes "" --params 200M --layers 12 \
            --overlap-size 0 --steps 6 2>&1 | grep -E "^DDP|Error" | tee -a "$OUT/ce.log"
    done
fi
exit $tests_rc
