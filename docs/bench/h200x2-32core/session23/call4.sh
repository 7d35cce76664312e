# Session 23, fourth call (2x H200): the final tree (the stream order pins the slots only for a wait it
# needs) under the GPU suites and the bench body, then the 64 MiB ping-pong with both ranks on GPU 0,
# as BENCHMARKS.md measures it.
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
shm() { ls /dev/shm | grep -c '^cuda.shm' ; }
echo "cuda.shm files before: $(shm)"
timeout 150 python3 -m pytest -p no:cacheprovider -v -rs -s tests/test_gpu_multi.py > $OUT/t_multi.log 2>&1; echo "multi rc=$? $(tail -1 $OUT/t_multi.log) cuda.shm $(shm)"
timeout 200 python3 -m pytest -p no:cacheprovider -v -rs -s tests/test_gpu.py > $OUT/t_gpu.log 2>&1; echo "gpu rc=$? $(tail -1 $OUT/t_gpu.log) cuda.shm $(shm)"
timeout 120 python3 -m pytest -p no:cacheprovider -v -rs -s tests/test_gpu_torch.py > $OUT/t_torch.log 2>&1; echo "torch rc=$? $(tail -1 $OUT/t_torch.log) cuda.shm $(shm)"
SPTEST_GPU_BENCH=1 timeout 60 python3 -m pytest -p no:cacheprovider -q -s -rs tests/test_gpu.py -k "bench or latency" > $OUT/t_bench.log 2>&1; echo "bench rc=$?"
grep -hE "FAILED|ERROR|left shmproxy|cuda.shm" $OUT/t_*.log | head -30
grep -o '"[a-z_0-9]*": {[^}]*}' $OUT/t_bench.log | head -20
for r in 1 2; do
  CUDA_VISIBLE_DEVICES=0 timeout 60 mpirun -n 2 --bind-to core -x PYTHONPATH -x CUDA_VISIBLE_DEVICES python3 -m shmproxy.tools.bench pingpong --device cuda \
      -b 64M -e 64M -n 2000 --peers none 2>&1 | grep -E "^ +67108864"
done | tee $OUT/pingpong64.log
ls /dev/shm
