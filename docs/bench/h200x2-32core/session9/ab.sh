#!/bin/bash
# A/B on the GPU host (ninth session): tree A (the previous commit, built in scratch/treeA) against
# tree B (the working tree), interleaved: the per-iteration 64 KiB overlap diagnosis of session6/diag,
# then Allreduce 8 B..64 KiB at 8 and 16 ranks. Make tree A first, from the repository root:
#   mkdir -p scratch/treeA && git archive 981742d proxy shm transports pyproject.toml setup.cfg README.md | tar -x -C scratch/treeA
# then: PINS=0 REPS=4 OUT=$OUT bash docs/bench/h200x2-32core/session9/ab.sh
# PINS="0 1" also sets XPIN_LOOP=1, which the loop-pinning experiment read (a patch to
# ProgressEngine.apply_affinity that pinned the loop's thread to its first core; not kept, so not in
# the tree: without it the two settings are the same).
set -u
ROOT=$PWD
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
(cd scratch/treeA && python3 -c "from setuptools import setup; setup()" build_ext --inplace -q >/dev/null 2>&1) || echo "treeA build failed"
ls scratch/treeA/shm/*.so | wc -l
D=docs/bench/h200x2-32core/session6/diag
T=$(mktemp -d)
nproc; lscpu | grep -i "model name\|socket\|numa node(s)"
for rep in $(seq ${REPS:-3}); do
 for tree in A B; do
  for pin in ${PINS:-0 1}; do
   if [ $tree = A ]; then PP=$ROOT/scratch/treeA; else PP=$ROOT; fi
   d=$T/r${rep}_${tree}_pin$pin; mkdir -p $d
   (cd $PP && PYTHONPATH=$PP XPIN_LOOP=$pin XOUT=$d SHMPROXY_PROFILE=1 SHMPROXY_PROFILE_FILE=$d/prof%p.json timeout 120 \
    mpirun -n 8 --allow-run-as-root --oversubscribe --bind-to core -x PYTHONPATH -x XOUT -x XPIN_LOOP \
    -x SHMPROXY_PROFILE -x SHMPROXY_PROFILE_FILE python3 $ROOT/$D/ovdiag.py ${SIZE:-65536} 3000 > $d/log.txt 2>&1)
   rc=$?; grep -h "imported" $d/log.txt | head -1; echo "rep $rep tree $tree pin $pin rc $rc $(python3 $D/ovan.py $d 2>&1 | grep -E 'overlap %|^ post|t_total' | tr '\n' ' ' | cut -c1-400)"
  done
 done
done
for rep in 1 2; do for tree in A B; do for n in 8 16; do
  if [ $tree = A ]; then PP=$ROOT/scratch/treeA; else PP=$ROOT; fi
  (cd $PP && PYTHONPATH=$PP timeout 100 mpirun -n $n --allow-run-as-root --oversubscribe --bind-to core -x PYTHONPATH \
     python3 -m proxy.bench allreduce -b 8 -e 64K -f 8 -n 2000 --peers mpi4py > $T/ar_${tree}_${n}_$rep.txt 2>&1)
  echo "allreduce $tree n=$n rep $rep: $(grep -E '^ +[0-9]' $T/ar_${tree}_${n}_$rep.txt | awk '{printf "%s:%s/%s ", $1, $4, $10}')"
done; done; done
tar czf $OUT/ab.tgz -C $T .
