#!/bin/bash
# A/B on a 16-core GPU host (thirteenth session): tree A (the previous commit, in scratch/treeA) against
# tree B (the working tree), interleaved, 8 ranks: the per-iteration 64 KiB overlap diagnosis
# (session6/diag/ovdiag.py: each rank's post, work and Wait times; summary by ovsum.py) and the
# benchmark's overlap at 64 KiB-1 MiB (OSU's method), the 8 B-64 KiB Allreduce and the post. Make tree A first, from the repository root:
#   mkdir -p scratch/treeA && git archive HEAD proxy shm transports pyproject.toml setup.cfg README.md | tar -x -C scratch/treeA
# then: REPS=3 OUT=$OUT bash docs/bench/h100-16core/session13/ab.sh
set -u
ROOT=$PWD
HERE=$ROOT/docs/bench/h100-16core/session13
DIAG=$ROOT/docs/bench/h200x2-32core/session6/diag/ovdiag.py
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
(cd scratch/treeA && python3 -c "from setuptools import setup; setup()" build_ext --inplace -q >/dev/null 2>&1) || echo "treeA build failed"
python3 -c "from setuptools import setup; setup()" build_ext --inplace -q >/dev/null 2>&1 || echo "tree B build failed"
nproc; lscpu | grep -i "model name\|socket\|numa node(s)\|thread(s) per core"
R=$OUT/ab; mkdir -p "$R"
for rep in $(seq ${REPS:-2}); do
  for tree in A B; do
    PP=$ROOT; [ "$tree" = A ] && PP=$ROOT/scratch/treeA
    d=$R/diag_${tree}_$rep; mkdir -p "$d"
    (cd "$PP" && XOUT=$d PYTHONPATH=$PP timeout 120 mpirun -n 8 --allow-run-as-root --oversubscribe --bind-to core \
       -x PYTHONPATH -x XOUT python3 "$DIAG" 65536 ${ITERS:-3000}) > "$d/log.txt" 2>&1
    python3 "$HERE/ovsum.py" "$d" | tee "$d/summary.txt"
    name=ov8_${tree}_$rep
    (cd "$PP" && PYTHONPATH=$PP timeout 150 mpirun -n 8 --allow-run-as-root --oversubscribe --bind-to core \
       -x PYTHONPATH python3 -m proxy.bench overlap -b 64K -e 1M -f 4 --peers none --json "$R/$name.json" > "$R/$name.txt" 2>&1)
    echo "$name rc=$? $(grep -E '^ +[0-9]' "$R/$name.txt" | awk '{printf "%s:%s ", $1, $(NF-1)}')"
    name=ar8small_${tree}_$rep
    (cd "$PP" && PYTHONPATH=$PP timeout 150 mpirun -n 8 --allow-run-as-root --oversubscribe --bind-to core \
       -x PYTHONPATH python3 -m proxy.bench allreduce -b 8 -e 64K -f 8 -n 2000 --peers none --json "$R/$name.json" > "$R/$name.txt" 2>&1)
    echo "$name rc=$? $(grep -E '^ +[0-9]' "$R/$name.txt" | awk '{printf "%s:%s ", $1, $4}')"
    name=post8_${tree}_$rep
    (cd "$PP" && PYTHONPATH=$PP timeout 150 mpirun -n 8 --allow-run-as-root --oversubscribe --bind-to core \
       -x PYTHONPATH python3 -m proxy.bench post --peers none --json "$R/$name.json" > "$R/$name.txt" 2>&1)
    echo "$name rc=$? $(grep -v '^#' "$R/$name.txt" | tr -s ' ' | tr '\n' '|')"
  done
done
rm -f "$R"/diag_*/rank*.npz.tmp
tar -czf "$OUT/ab.tgz" -C "$OUT" ab && rm -rf "$R"
