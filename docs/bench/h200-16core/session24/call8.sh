# Session 24, eighth call (1x H200), on the final code: the GPU suite and its torch part, then the
# bench's 64 MiB ping-pong (BENCHMARKS.md's command) with armed routes and without, interleaved.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || exit 1
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 CUDA_VISIBLE_DEVICES=0
timeout 280 python3 -m pytest -p no:cacheprovider -q -rs tests/test_gpu.py 2>&1 | tail -6 | tee $OUT/t_gpu.log
timeout 150 python3 -m pytest -p no:cacheprovider -q -rs tests/test_gpu_torch.py 2>&1 | tail -4 | tee $OUT/t_torch.log
for r in 1 2 3; do
  for a in 1 0; do
    echo -n "armed=$a "
    SHMPROXY_CUDA_ARMED_ROUTES=$a timeout 60 mpirun -n 2 --bind-to core -x PYTHONPATH -x CUDA_VISIBLE_DEVICES \
        -x SHMPROXY_CUDA_ARMED_ROUTES python3 -m shmproxy.tools.bench pingpong --device cuda -b 64M -e 64M \
        -n 2000 --peers none 2>&1 | grep -E "^ +67108864" || echo "(failed)"
  done
done | tee $OUT/pingpong64.log
ls /dev/shm
