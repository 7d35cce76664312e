# Session 23, third call (2x H200, both ranks on GPU 0): the 64 MiB ping-pong as BENCHMARKS.md
# measures it (twice, unprofiled), then a long run sampled by py-spy in the progress process and in
# rank 1: where the Python of one message goes.
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 CUDA_VISIBLE_DEVICES=0
bench() { timeout 90 mpirun -n 2 --bind-to core -x PYTHONPATH -x CUDA_VISIBLE_DEVICES python3 -m shmproxy.tools.bench \
              pingpong --device cuda -b 64M -e 64M --peers none "$@"; }
python3 -c "import cupy as cp; a=cp.ones(64<<20,cp.uint8); b=cp.empty_like(a); s=cp.cuda.Event(); e=cp.cuda.Event()
t=[]
for _ in range(20):
    s.record(); cp.cuda.runtime.memcpyAsync(b.data.ptr,a.data.ptr,a.nbytes,3,0); e.record(); e.synchronize(); t.append(cp.cuda.get_elapsed_time(s,e))
print('D2D 64 MiB best %.1f us, %.0f GB/s' % (min(t)*1e3, a.nbytes/min(t)/1e6))" | tee $OUT/d2d.txt
for r in 1 2; do bench -n 2000; done > $OUT/pingpong64_gpu0.log 2>&1
grep -E "^ +67108864|placement|GPU" $OUT/pingpong64_gpu0.log
bench -n 60000 > $OUT/pingpong64_long.log 2>&1 &
for i in $(seq 200); do
  P=$(pgrep -f shmproxy.engine.progress | head -1); R=$(pgrep -f "shmproxy.tools.bench" | sort -n | tail -1)
  [ -n "$P" ] && [ -n "$R" ] && break; sleep 0.05
done
sleep 4   # past the start and the smaller warm-up
/tmp/site/bin/py-spy record -p $P -r 2000 -d 4 --nonblocking --format raw -o $OUT/pyspy_loop.txt > $OUT/pyspy_loop.log 2>&1 &
/tmp/site/bin/py-spy record -p $R -r 2000 -d 4 --nonblocking --format raw -o $OUT/pyspy_rank.txt > $OUT/pyspy_rank.log 2>&1
wait
grep -E "^ +67108864" $OUT/pingpong64_long.log; tail -2 $OUT/pyspy_loop.log
