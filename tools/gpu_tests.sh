#!/usr/bin/env bash
# Run the GPU suite on a host with a CUDA GPU and cupy: tests/test_gpu.py; tests/test_gpu_multi.py (ranks
# on GPUs of their own, where the host has 2 or more); tests/test_gpu_torch.py where torch is installed
# (the torch backend on CUDA tensors). Device figures against NCCL: shmproxy-bench --device cuda
# (tools/gpu_multi.sh, BENCHMARKS.md).
#   tools/gpu_tests.sh [extra pytest args]        output also in gpu_tests.log (GPU_TESTS_LOG overrides)
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
    tests/test_gpu.py tests/test_gpu_multi.py tests/test_gpu_nodes.py tests/test_gpu_torch.py "$@"
  exit $?
} 2>&1 | tee "$log"
