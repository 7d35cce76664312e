#!/usr/bin/env bash
# Run the GPU suite on a host with a CUDA GPU and cupy: tests/test_gpu.py; tests/test_gpu_multi.py (ranks
# on GPUs of their own, where the host has 2 or more); tests/test_gpu_torch.py where torch is installed
# (the torch backend on CUDA tensors). Then the device benchmark and the 8 B Allreduce latency
# breakdown (test_bench, test_latency_breakdown).
#   tools/gpu_tests.sh [extra pytest args]        output also in gpu_tests.log (GPU_TESTS_LOG overrides)
#   GPU_PROBE=1 also runs tools/gpu_latency_probe.py (two bare processes: the GPU's share of a message)
#   and tools/gpu_launch_probe.py (what an op's CUDA calls cost, separate or as one graph launch), and
#   tools/gpu_stream_order_probe.py (stream order through a host word instead of interprocess events)
# Needs shmproxy installed (pip install -e .) and cupy for the host's CUDA; torch is optional.
set -o pipefail
cd "$(dirname "$0")/.."
log=${GPU_TESTS_LOG:-gpu_tests.log}
{
  echo "== $(date -u +%FT%TZ) $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  nvidia-smi topo -m 2>&1   # how the GPUs are linked (NVLink, PCIe), for the multi-GPU figures
  python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)" 2>&1
  python3 -m pytest -p no:cacheprovider -v -rs -s \
    tests/test_gpu.py tests/test_gpu_multi.py tests/test_gpu_torch.py "$@"
  rc=$?
  SPTEST_GPU_BENCH=1 python3 -m pytest -p no:cacheprovider -q -s -rs tests/test_gpu.py -k "bench or latency" "$@"
  if [ -n "$GPU_PROBE" ]; then
    python3 tools/gpu_latency_probe.py   # where a small message's time goes
    python3 tools/gpu_launch_probe.py    # separate driver calls against one graph launch
    timeout 300 python3 tools/gpu_stream_order_probe.py   # bounded: a stalled stream is what it looks for
  fi
  exit $rc
} 2>&1 | tee "$log"
