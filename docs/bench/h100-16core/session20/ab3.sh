# A/B on the device: A = the tree before this session's change (.ab/base, built into /tmp/base_site),
# B = this tree, W0 = this tree with SHMPROXY_PROXY_WATCH_US=0 (the C launch without the C wait).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
B="python3 -m shmproxy.tools.bench"
if [ ! -d /tmp/base_site/shmproxy ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/base_site .ab/base >/tmp/base_build.log 2>&1 || { echo "BASE BUILD FAILED"; tail -20 /tmp/base_build.log; }
fi
for side in A B; do
  PP=$PYTHONPATH; [ $side = A ] && PP=/tmp/base_site:$PYTHONPATH
  echo "$side: $(PYTHONPATH=$PP python3 -c 'import shmproxy, shmproxy.shm._native as n; print(shmproxy.__file__, hasattr(n, "publish_launch"))')"
done
d2d() { python3 -c "
import cupy as cp
s=cp.ones(64<<20,cp.float32); d=cp.empty_like(s); cp.copyto(d,s); cp.cuda.Device().synchronize()
e0,e1=cp.cuda.Event(),cp.cuda.Event(); e0.record()
for _ in range(20): cp.copyto(d,s)
e1.record(); e1.synchronize(); print('D2D copy 256 MiB: %.0f GB/s' % (s.nbytes*20/(cp.cuda.get_elapsed_time(e0,e1)/1e3)/1e9))"; }
d2d
for i in ${RUNS:-1}; do
for side in ${SIDES:-A B W0}; do
  PP=$PYTHONPATH; W="-x SHMPROXY_PROXY_WATCH_US=50"
  [ $side = A ] && PP=/tmp/base_site:$PYTHONPATH && W=""
  [ $side = W0 ] && W="-x SHMPROXY_PROXY_WATCH_US=0"
  MPI="timeout 150 mpirun -n 2 --allow-run-as-root --bind-to ${BIND:-core} -x PYTHONPATH=$PP $W"
  echo "== side=$side run $i"
  $MPI $B pingpong --device cuda -b 64M -e 64M -n ${N64:-1000} --peers none 2>&1 | grep -E "^ +[0-9]+ |rror"
  $MPI $B pingpong --device cuda -b 8 -e 8 -n 2000 --peers none 2>&1 | grep -E "^ +[0-9]+ |rror"
  $MPI $B allreduce --device cuda -b 8 -e 8 -n 3000 --peers none 2>&1 | grep -E "^ +[0-9]+ |rror"
  $MPI $B allreduce --device cuda -b 256M -e 256M -n 50 --peers none 2>&1 | grep -E "^ +[0-9]+ |rror"
done; done
d2d
