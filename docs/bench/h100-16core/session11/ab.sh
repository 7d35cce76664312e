#!/bin/bash
# A/B on a GPU host (eleventh session, the 1x H100 16-core kind; the 2x H200 kind was withheld):
# tree A (f215cc9, before the session's collective changes, built in scratch/treeA) against tree B
# (the working tree), interleaved. B streams only collectives whose outputs exceed min(LLC, 32 MiB)
# and, where the loop runs copy jobs (16 ranks on 16 cores), cuts collectives in one chunk per CPU.
#   8 ranks: Allreduce 1-64 MiB against Open MPI, the Iallreduce overlap 64 KiB-4 MiB (OSU's method)
#   16 ranks (crowded): Allreduce 1-16 MiB against Open MPI
#   2 ranks: ping-pong 1-16 MiB against Open MPI
# Make tree A first, from the repository root:
#   mkdir -p scratch/treeA && git archive f215cc9 proxy shm transports pyproject.toml setup.cfg README.md | tar -x -C scratch/treeA
# then: REPS=3 OUT=$OUT bash docs/bench/h100-16core/session11/ab.sh   (results tarred into $OUT/ab.tgz)
set -u
ROOT=$PWD
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
(cd scratch/treeA && python3 -c "from setuptools import setup; setup()" build_ext --inplace -q >/dev/null 2>&1) || echo "treeA build failed"
python3 -c "from setuptools import setup; setup()" build_ext --inplace -q >/dev/null 2>&1 || echo "tree B build failed"
nproc; lscpu | grep -i "model name\|socket\|numa node(s)\|L3"
R=$OUT/ab; mkdir -p "$R"
run() {  # tree name nranks bench-args...
  local tree=$1 name=$2 n=$3; shift 3
  local PP=$ROOT; [ "$tree" = A ] && PP=$ROOT/scratch/treeA
  (cd "$PP" && PYTHONPATH=$PP timeout 200 mpirun -n "$n" --allow-run-as-root --oversubscribe --bind-to core \
     -x PYTHONPATH python3 -m proxy.bench "$@" --json "$R/$name.json" > "$R/$name.txt" 2>&1)
  echo "$name rc=$? $(grep -E '^ +[0-9]' "$R/$name.txt" | awk '{printf "%s:%s ", $1, $4}')"
}
for rep in $(seq ${REPS:-2}); do
  for tree in A B; do
    run $tree ar8_${tree}_$rep 8 allreduce -b 1M -e 64M -f 2 --peers mpi4py
    run $tree ov8_${tree}_$rep 8 overlap -b 64K -e 4M -f 4 --peers none
    run $tree ar16_${tree}_$rep 16 allreduce -b 1M -e 16M -f 2 --peers mpi4py
    run $tree pp2_${tree}_$rep 2 pingpong -b 1M -e 16M -f 2 --peers mpi4py
  done
done
tar -czf "$OUT/ab.tgz" -C "$OUT" ab && rm -rf "$R"
