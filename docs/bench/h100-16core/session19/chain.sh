set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
patch -p1 -s < docs/bench/h100-16core/session19/chain.patch || exit 1
for c in ${CS:-1 0}; do
for size in 67108864 8; do
  rm -f /tmp/chain_*.json
  timeout 120 mpirun -n 2 --allow-run-as-root --bind-to core -x PYTHONPATH -x SHMPROXY_CUDA_DEVICE_COMPLETES=$c python3 docs/bench/h100-16core/session19/chain.py $size 2000
  echo "== completes=$c"; python3 docs/bench/h100-16core/session19/chain_an.py $size
done; done
patch -R -p1 -s < docs/bench/h100-16core/session19/chain.patch
