# A/B of CUDA_DEVICE_COMPLETES in one run, interleaved: 64 MiB and 8 B ping-pong, 8 B Allreduce
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
B="python3 -m shmproxy.tools.bench"
d2d() { python3 -c "
import cupy as cp
s=cp.ones(64<<20,cp.float32); d=cp.empty_like(s); cp.copyto(d,s); cp.cuda.Device().synchronize()
e0,e1=cp.cuda.Event(),cp.cuda.Event(); e0.record()
for _ in range(20): cp.copyto(d,s)
e1.record(); e1.synchronize(); print('D2D copy 256 MiB: %.0f GB/s' % (s.nbytes*20/(cp.cuda.get_elapsed_time(e0,e1)/1e3)/1e9))"; }
d2d
for i in ${RUNS:-1 2 3}; do
for c in 1 0; do
MPI="timeout 120 mpirun -n 2 --allow-run-as-root --bind-to ${BIND:-core} -x PYTHONPATH -x SHMPROXY_CUDA_DEVICE_COMPLETES=$c"
echo "== completes=$c run $i"
$MPI $B pingpong --device cuda -b 64M -e 64M -n 300 --peers none 2>&1 | grep -E "^ +[0-9]+ |rror"
$MPI $B pingpong --device cuda -b 8 -e 8 -n 2000 --peers none 2>&1 | grep -E "^ +[0-9]+ |rror"
$MPI $B allreduce --device cuda -b 8 -e 8 -n 3000 --peers none 2>&1 | grep -E "^ +[0-9]+ |rror"
done; done
d2d
