# Session 23, fifth call: the fetched ops built in C (shm/_native_ops.c). Both ranks on GPU 0: the
# 64 MiB ping-pong as BENCHMARKS.md measures it, three runs, then where one way goes (the chain
# probe, as chain_before.txt), then the GPU suite's point-to-point tests.
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 CUDA_VISIBLE_DEVICES=0
for r in 1 2 3; do
  timeout 60 mpirun -n 2 --bind-to core -x PYTHONPATH -x CUDA_VISIBLE_DEVICES python3 -m shmproxy.tools.bench \
      pingpong --device cuda -b 64M -e 64M -n 2000 --peers none 2>&1 | grep -E "^ +67108864"
done | tee $OUT/pingpong64.log
D=/tmp/chain; rm -rf $D; mkdir -p $D
SHMPROXY_PROFILE=1 SHMPROXY_PROFILE_FILE=$D/trace_%p.json timeout 90 mpirun -n 2 --bind-to core -x PYTHONPATH \
    -x CUDA_VISIBLE_DEVICES -x SHMPROXY_PROFILE -x SHMPROXY_PROFILE_FILE python3 tools/gpu_chain_probe.py run $D 64M 2000
python3 tools/gpu_chain_probe.py analyse $D | tee $OUT/chain.txt
timeout 120 python3 -m pytest -p no:cacheprovider -q -rs tests/test_gpu.py -k "p2p or pingpong or repeated" 2>&1 | tail -3
ls /dev/shm
# then, on the same warm machine: five more runs of the ping-pong and the D2D copy limit
# (256 MiB, best of 20), into call5_pingpong64.log and call5_d2d.txt
