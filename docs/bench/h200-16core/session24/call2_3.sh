python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || exit 1
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 CUDA_VISIBLE_DEVICES=0 SHMPROXY_DUMP_SIGNAL=SIGUSR1
for v in "1 20" "0 20" "1 20" "0 20" "1 50"; do
  set -- $v
  echo "== armed=$1 linger=$2"
  SHMPROXY_CUDA_ARMED_ROUTES=$1 SHMPROXY_PROXY_LINGER_US=$2 timeout 60 mpirun -n 2 --bind-to core -x PYTHONPATH \
     -x CUDA_VISIBLE_DEVICES -x SHMPROXY_DUMP_SIGNAL -x SHMPROXY_CUDA_ARMED_ROUTES -x SHMPROXY_PROXY_LINGER_US \
     python3 docs/bench/h200-16core/session24/armed_probe.py 2000 2>&1 | tail -4
done | tee $OUT/probe.log
