# The GPU suite after this session's fixes, on a 2-GPU host: every step bounded, logs under $OUT.
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
shm() { ls /dev/shm | grep -c '^cuda.shm' ; }
echo "cuda.shm files before: $(shm)"
timeout 150 python3 -m pytest -p no:cacheprovider -v -rs -s tests/test_gpu_multi.py > $OUT/t_multi.log 2>&1; echo "multi rc=$? $(tail -1 $OUT/t_multi.log) cuda.shm $(shm)"
timeout 230 python3 -m pytest -p no:cacheprovider -v -rs -s tests/test_gpu.py > $OUT/t_gpu.log 2>&1; echo "gpu rc=$? $(tail -1 $OUT/t_gpu.log) cuda.shm $(shm)"
timeout 110 python3 -m pytest -p no:cacheprovider -v -rs -s tests/test_gpu_torch.py > $OUT/t_torch.log 2>&1; echo "torch rc=$? $(tail -1 $OUT/t_torch.log) cuda.shm $(shm)"
SPTEST_GPU_BENCH=1 timeout 40 python3 -m pytest -p no:cacheprovider -q -s -rs tests/test_gpu.py -k "bench or latency" > $OUT/t_bench.log 2>&1; echo "bench rc=$?"
grep -hE "FAILED|ERROR|left shmproxy|cuda.shm" $OUT/t_*.log | head -30
ls -la /dev/shm | head -20
