# Session 23, first call (2x H200): last session's GPU-only code under the suites (the leak guard
# checks the marks), the stream-order probe, and where one way of a device ping-pong goes now.
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
shm() { ls /dev/shm | grep -c '^cuda.shm' ; }
chain() {   # size iters [--per-gpu]
    D=/tmp/chain; rm -rf $D; mkdir -p $D
    SHMPROXY_PROFILE=1 SHMPROXY_PROFILE_FILE=$D/trace_%p.json timeout 90 mpirun -n 2 --bind-to core \
        -x PYTHONPATH -x SHMPROXY_PROFILE -x SHMPROXY_PROFILE_FILE python3 tools/gpu_chain_probe.py run $D "$@"
    python3 tools/gpu_chain_probe.py analyse $D
}
{ for s in 64M 8; do echo "== shared GPU 0, $s"; chain $s 2000; done
  echo "== one rank per GPU, 64M"; chain 64M 2000 --per-gpu; } > $OUT/chain.txt 2>&1
cat $OUT/chain.txt
timeout 300 python3 tools/gpu_stream_order_probe.py > $OUT/stream_order_probe.txt 2>&1; echo "probe rc=$?"
echo "cuda.shm files before the suites: $(shm)"
timeout 150 python3 -m pytest -p no:cacheprovider -v -rs -s tests/test_gpu_multi.py > $OUT/t_multi.log 2>&1; echo "multi rc=$? $(tail -1 $OUT/t_multi.log) cuda.shm $(shm)"
timeout 200 python3 -m pytest -p no:cacheprovider -v -rs -s tests/test_gpu.py > $OUT/t_gpu.log 2>&1; echo "gpu rc=$? $(tail -1 $OUT/t_gpu.log) cuda.shm $(shm)"
grep -hE "FAILED|ERROR|left shmproxy|cuda.shm" $OUT/t_*.log | head -30
ls -la /dev/shm /tmp/shmproxy* 2>/dev/null | head -20
