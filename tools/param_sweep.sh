#!/usr/bin/env bash
# tools/param_sweep.sh: one shmproxy-bench command under several values of one tunable, side by side.
#
#   tools/param_sweep.sh NRANKS VAR "V1 V2 ..." BENCH-ARGS...
#   e.g. tools/param_sweep.sh 8 SHMPROXY_COLL_MIN_CHUNK "64K 256K" allreduce -b 64K -e 16M -f 2 --peers mpi4py
#
# Each value runs as its own job (Open MPI's mpirun when present, else mpiexec), bounded by `timeout`
# (CAP_S, default 120 s); the tables go to stdout and the JSON to $OUT/sweep-VAR-VALUE.json
# (OUT default ./out). Values run in the order given, then once more in reverse order, so that a drift
# of the host during the sweep shows instead of being read as an effect of the tunable.
set -u
[ $# -ge 4 ] || { sed -n 2,10p "$0"; exit 2; }
N=$1 VAR=$2 VALUES=$3
shift 3
OUT=${OUT:-./out}
CAP_S=${CAP_S:-120}
mkdir -p "$OUT"
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
if command -v mpirun >/dev/null 2>&1 && mpirun --version 2>&1 | grep -qi "open mpi\|open-mpi"; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    launch() { mpirun -n "$N" --allow-run-as-root --oversubscribe --bind-to core -x PYTHONPATH -x "$VAR" "$@"; }
else
    launch() { mpiexec -n "$N" "$@"; }
fi
ORDER=$(for v in $VALUES; do echo "$v"; done; for v in $VALUES; do echo "$v"; done | tac)
pass=0
for v in $ORDER; do
    pass=$((pass + 1))
    echo "=== $VAR=$v (run $pass): shmproxy-bench $*"
    export "$VAR=$v"
    timeout -k 5 "$CAP_S" bash -c "$(declare -f launch); N=$N VAR=$VAR; launch \"\$@\"" _ \
        python3 -m shmproxy.tools.bench "$@" --json "$OUT/sweep-$VAR-$v-$pass.json" 2>&1 | grep -v "^# JSON"
done
