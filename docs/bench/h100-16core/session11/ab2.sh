#!/bin/bash
# The A/B of ab.sh again with the final streaming rule (half the LLC, at most 16 MiB; ab.sh's tree B
# streamed above min(LLC, 32 MiB)): Allreduce at 8 and 16 ranks against Open MPI, 2 ranks too.
# Tree A as in ab.sh (scratch/treeA = f215cc9). REPS=3 OUT=$OUT bash docs/bench/h100-16core/session11/ab2.sh
set -u
ROOT=$PWD
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
(cd scratch/treeA && python3 -c "from setuptools import setup; setup()" build_ext --inplace -q >/dev/null 2>&1) || echo "treeA build failed"
python3 -c "from setuptools import setup; setup()" build_ext --inplace -q >/dev/null 2>&1 || echo "tree B build failed"
R=$OUT/ab2; mkdir -p "$R"
run() {  # tree name nranks bench-args...
  local tree=$1 name=$2 n=$3; shift 3
  local PP=$ROOT; [ "$tree" = A ] && PP=$ROOT/scratch/treeA
  (cd "$PP" && PYTHONPATH=$PP timeout 200 mpirun -n "$n" --allow-run-as-root --oversubscribe --bind-to core \
     -x PYTHONPATH python3 -m proxy.bench "$@" --json "$R/$name.json" > "$R/$name.txt" 2>&1)
  echo "$name rc=$? $(grep -E '^ +[0-9]' "$R/$name.txt" | awk '{printf "%s:%s(%s) ", $1, $4, $(NF-1)}')"
}
for rep in $(seq ${REPS:-2}); do
  for tree in A B; do
    run $tree ar8_${tree}_$rep 8 allreduce -b 1M -e 16M -f 2 --peers mpi4py
    run $tree ar16_${tree}_$rep 16 allreduce -b 1M -e 16M -f 2 --peers mpi4py
    run $tree ar2_${tree}_$rep 2 allreduce -b 1M -e 16M -f 2 --peers mpi4py
  done
done
tar -czf "$OUT/ab2.tgz" -C "$OUT" ab2 && rm -rf "$R"
