#!/usr/bin/env bash
# tools/small_ops_bench.sh: small operations (8 B to 64 KiB) against mpi4py in the same runs, with the fast
# path on and off (SHMPROXY_FAST_BYTES=0), on one host: the figures of issue 25 (docs/architecture.md,
# "The fast path").
#
#   tools/small_ops_bench.sh              # from the repository root, shmproxy importable
#   OUT=/tmp/res RANKS="2 8 16" tools/small_ops_bench.sh
#
# Steps, each under `timeout`, for FAST in on off:
#   pingpong 8 B..64 KiB at 2 ranks and at 8 ranks (ranks 0 and 1 talk, the others idle in Recv)
#   allreduce 8 B..64 KiB and barrier at each rank count of RANKS above 2
# Launcher: Open MPI's mpirun (--bind-to core, as MPI is benchmarked; root allowed) or MPICH's mpiexec.
# Output under ${OUT:-./small-out}: small_ops.log (every table) and one JSON per run (runs/*.json).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=$(mkdir -p "${OUT:-./small-out}/runs" && cd "${OUT:-./small-out}" && pwd)
RANKS=${RANKS:-"2 8 16"}
STEP_S=${STEP_S:-120}
PY=${PYTHON:-$(command -v python3)}
LOG="$OUT/small_ops.log"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
say() { echo "$@" | tee -a "$LOG"; }

if command -v mpirun >/dev/null 2>&1 && mpirun --version 2>&1 | grep -qi "open mpi\|open-mpi\|prrte"; then
    launch() { local n=$1; shift; mpirun -n "$n" --bind-to core -x PYTHONPATH -x PYTHONUNBUFFERED \
               -x SHMPROXY_FAST_BYTES "$@"; }
    say "launcher: $(mpirun --version 2>&1 | head -1)"
else
    launch() { local n=$1; shift; mpiexec -n "$n" "$@"; }
    say "launcher: $(mpiexec --version 2>&1 | grep -i -m1 version)"
fi
say "host: $(nproc) CPUs; $("$PY" -c 'import shmproxy, sys; print("shmproxy", shmproxy.__version__, "python", sys.version.split()[0])')"

run() {  # run NAME NRANKS ARGS...: one shmproxy-bench run, its table to the log, its JSON kept
    local name=$1 n=$2
    shift 2
    say "=== $name ($n ranks, fast path $FAST): shmproxy-bench $*"
    timeout "$STEP_S" bash -c "$(declare -f launch); launch $n $PY -m shmproxy.tools.bench $* --peers mpi4py \
        --no-progress --json $OUT/runs/$name-$FAST.json" 2>&1 | grep -v '^\s*$' | tee -a "$LOG"
}

for FAST in on off; do
    if [ "$FAST" = off ]; then export SHMPROXY_FAST_BYTES=0; else export SHMPROXY_FAST_BYTES=auto; fi
    run pingpong2 2 pingpong -b 8 -e 64K -f 8
    for n in $RANKS; do
        [ "$n" -le 2 ] && continue
        [ "$n" -eq 8 ] && run pingpong8 8 pingpong -b 8 -e 64K -f 8
        run "allreduce$n" "$n" allreduce -b 8 -e 64K -f 8
        run "barrier$n" "$n" barrier
    done
done
say "done"
