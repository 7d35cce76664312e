#!/bin/bash
# The 64 KiB overlap diagnosis (session6/diag/ovdiag.py, 8 ranks, summary by ovsum.py) under several
# environments, interleaved: CFGS="X=1 SHMPROXY_PROXY_CPUS=12-15" REPS=2 OUT=$OUT bash .../cfgs.sh
set -u
ROOT=$PWD; HERE=$ROOT/docs/bench/h100-16core/session13
DIAG=$ROOT/docs/bench/h200x2-32core/session6/diag/ovdiag.py
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=$ROOT
R=$OUT/cfgs; mkdir -p "$R"
for rep in $(seq ${REPS:-2}); do
  for c in ${CFGS:-X=1}; do
    d=$R/r${rep}_${c//[^A-Za-z0-9_-]/_}; mkdir -p "$d"
    fwd=(); envs=()
    for kv in ${c//,/ }; do fwd+=(-x "${kv%%=*}"); envs+=("$kv"); done
    env "${envs[@]}" XOUT=$d timeout 120 mpirun -n 8 --allow-run-as-root --oversubscribe --bind-to core \
      -x PYTHONPATH -x XOUT "${fwd[@]}" python3 "$DIAG" ${SIZE:-65536} ${ITERS:-3000} > "$d/log.txt" 2>&1
    echo "$c: $(python3 "$HERE/ovsum.py" "$d")"
  done
done
tar -czf "$OUT/cfgs.tgz" -C "$OUT" cfgs && rm -rf "$R"
