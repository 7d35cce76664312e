# Session 24, sixth call (1x H200): the loop takes a route's two halves in one fetch where they come
# together (PROXY_LINGER_PAIR_US). The chain probe, then the bench's 64 MiB ping-pong (BENCHMARKS.md's
# command), armed routes on and off, interleaved.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || exit 1
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 CUDA_VISIBLE_DEVICES=0
for v in "1 5" "1 0"; do
  set -- $v
  D=/tmp/chain$1$2; rm -rf $D; mkdir -p $D
  SHMPROXY_PROXY_LINGER_PAIR_US=$2 SHMPROXY_PROFILE=1 SHMPROXY_PROFILE_FILE=$D/trace_%p.json timeout 90 mpirun -n 2 \
    --bind-to core -x PYTHONPATH -x CUDA_VISIBLE_DEVICES -x SHMPROXY_PROFILE -x SHMPROXY_PROFILE_FILE \
    -x SHMPROXY_PROXY_LINGER_PAIR_US python3 tools/gpu_chain_probe.py run $D 64M 2000 >/dev/null 2>&1
  echo "== armed, pair wait $2 us"; python3 tools/gpu_chain_probe.py analyse $D
done | tee $OUT/chain.txt
for r in 1 2 3 4; do
  for a in 1 0; do
    echo -n "armed=$a "
    SHMPROXY_CUDA_ARMED_ROUTES=$a timeout 60 mpirun -n 2 --bind-to core -x PYTHONPATH -x CUDA_VISIBLE_DEVICES \
        -x SHMPROXY_CUDA_ARMED_ROUTES python3 -m shmproxy.tools.bench pingpong --device cuda -b 64M -e 64M \
        -n 2000 --peers none 2>&1 | grep -E "^ +67108864" || echo "(failed)"
  done
done | tee $OUT/pingpong64.log
