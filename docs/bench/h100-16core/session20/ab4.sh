# 64 MiB ping-pong only: A (before), B (watch 50 us), W0 (no watch), W500 (watch 500 us), order rotated per run
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
B="python3 -m shmproxy.tools.bench"
[ -d /tmp/base_site/shmproxy ] || python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/base_site .ab/base >/dev/null 2>&1
order=(A B W0 W500)
for i in ${RUNS:-1 2 3 4 5}; do
  for k in 0 1 2 3; do
    side=${order[$(( (k + i) % 4 ))]}
    PP=$PYTHONPATH; W=""
    case $side in A) PP=/tmp/base_site:$PYTHONPATH;; B) W="-x SHMPROXY_PROXY_WATCH_US=50";; W0) W="-x SHMPROXY_PROXY_WATCH_US=0";; W500) W="-x SHMPROXY_PROXY_WATCH_US=500";; esac
    r=$(timeout 100 mpirun -n 2 --allow-run-as-root --bind-to core -x PYTHONPATH=$PP $W $B pingpong --device cuda -b 64M -e 64M -n 2000 --peers none 2>&1 | grep -E "^ +[0-9]+ |rror")
    echo "run $i $side $r"
  done
done
