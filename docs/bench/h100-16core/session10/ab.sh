#!/bin/bash
# A/B on a GPU host (tenth session; run on the 1x H100, 16-core kind: the 2x H200 kind was withheld): tree A (the previous commit, built in scratch/treeA) against
# tree B (the working tree), interleaved: Allreduce 1-16 MiB at 8 ranks, the Iallreduce overlap at
# 64 KiB-4 MiB (OSU's method), and the 2-rank ping-pong 1-16 MiB. The change under test touches only
# how copy workers are woken (shm/_workers.c, "Wake-ups"); on this host the loop does not run copy jobs
# itself and does not poll, so B should match A. Make tree A first, from the repository root:
#   mkdir -p scratch/treeA && git archive 803bc72 proxy shm transports pyproject.toml setup.cfg README.md | tar -x -C scratch/treeA
# then: REPS=2 OUT=$OUT bash docs/bench/h100-16core/session10/ab.sh
set -u
ROOT=$PWD
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
(cd scratch/treeA && python3 -c "from setuptools import setup; setup()" build_ext --inplace -q >/dev/null 2>&1) || echo "treeA build failed"
python3 -c "from setuptools import setup; setup()" build_ext --inplace -q >/dev/null 2>&1 || echo "tree B build failed"
nproc; lscpu | grep -i "model name\|socket\|numa node(s)"
run() {  # tree name nranks bench-args...
  local tree=$1 name=$2 n=$3; shift 3
  local PP=$ROOT; [ "$tree" = A ] && PP=$ROOT/scratch/treeA
  (cd "$PP" && PYTHONPATH=$PP timeout 150 mpirun -n "$n" --allow-run-as-root --oversubscribe --bind-to core \
     -x PYTHONPATH python3 -m proxy.bench "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1)
  echo "$name rc=$? $(grep -E '^ +[0-9]' "$OUT/$name.txt" | awk '{printf "%s:%s ", $1, $4}')"
}
for rep in $(seq ${REPS:-2}); do
  for tree in A B; do
    run $tree ar8_${tree}_$rep 8 allreduce -b 1M -e 16M -f 2 --peers mpi4py
    run $tree ov8_${tree}_$rep 8 overlap -b 64K -e 4M -f 4 --peers none
    run $tree pp2_${tree}_$rep 2 pingpong -b 1M -e 16M -f 2 --peers mpi4py
  done
done
