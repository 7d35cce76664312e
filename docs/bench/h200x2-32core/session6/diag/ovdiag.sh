#!/bin/bash
# device: per-iteration overlap diagnosis, 8 ranks (Open MPI). CFGS="A=1,B=2 A=0" (env per config), REPS, SIZE
# from the repository root: CFGS="SHMPROXY_LOCK_SPIN_US=0 SHMPROXY_LOCK_SPIN_US=5" REPS=2 OUT=/tmp/x bash docs/bench/h200x2-32core/session6/diag/ovdiag.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=$PWD
HERE=$(cd "$(dirname "$0")" && pwd); T=$(mktemp -d)
for rep in $(seq ${REPS:-2}); do
 for c in ${CFGS:-X=1}; do
  d=$T/r${rep}_$c; mkdir -p $d
  fwd=(); envs=()
  for kv in ${c//,/ }; do fwd+=(-x "${kv%%=*}"); envs+=("$kv"); done
  env "${envs[@]}" XOUT=$d SHMPROXY_PROFILE=1 SHMPROXY_PROFILE_FILE=$d/prof%p.json timeout 200 \
    mpirun -n 8 --allow-run-as-root --oversubscribe --bind-to core -x PYTHONPATH -x XOUT \
    -x SHMPROXY_PROFILE -x SHMPROXY_PROFILE_FILE "${fwd[@]}" python3 "$HERE/ovdiag.py" ${SIZE:-65536} 3000
  echo "rep $rep $c rc $?"
 done
done
tar czf $OUT/diag.tgz -C $T .
