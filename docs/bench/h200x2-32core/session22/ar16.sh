# The 16 MiB Allreduce on 2 GPUs (one rank each): which switch changes it.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
B="python3 -m shmproxy.tools.bench allreduce --device cuda --peers none"
for v in "" SHMPROXY_CUDA_DEVICE_COMPLETES=0 SHMPROXY_CUDA_FUSED_REDUCE=0 SHMPROXY_CUDA_GRAPHS=0; do
  X=""; [ -n "$v" ] && X="-x $v"
  echo "== ${v:-default}"
  timeout 60 mpirun -n 2 --bind-to none $X -x PYTHONPATH $B -b 1M -e 64M -f 2 2>&1 | grep -E "^ +[0-9]+ |rror"
done
echo "== default, -n 200 at 16M"
timeout 60 mpirun -n 2 --bind-to none -x PYTHONPATH $B -b 16M -e 16M -n 200 2>&1 | grep -E "^ +[0-9]+ |rror"
