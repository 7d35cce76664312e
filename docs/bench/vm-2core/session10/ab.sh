#!/usr/bin/env bash
# Interleaved A/B on the VM: A = $TREE_A (the previous commit, built in place with
# `python -c "from setuptools import setup; setup()" build_ext --inplace`), B = $TREE_B (this one).
# Usage: TREE_A=/tmp/treeA TREE_B=/work/main OUTDIR=/tmp/ab ab.sh NAME PAIRS -- <proxy.bench args>
# e.g.   ab.sh pp4 4 -- pingpong -b 1M -e 16M -f 2 -r 5 --peers mpi4py
# Summary: python3 abrep.py OUTDIR NAME
name=$1; pairs=$2; shift 3
: "${TREE_A:=/tmp/treeA}" "${TREE_B:=$PWD}" "${OUTDIR:=/tmp/ab}"
mkdir -p "$OUTDIR"
for i in $(seq 1 "$pairs"); do
  for side in A B; do
    if [ $side = A ]; then dir=$TREE_A; else dir=$TREE_B; fi
    (cd "$dir" && PYTHONPATH=$dir timeout 600 mpiexec -n 2 python -m proxy.bench "$@" \
        --json "$OUTDIR/$name-$side-$i.json" > "$OUTDIR/$name-$side-$i.txt" 2>&1)
  done
done
