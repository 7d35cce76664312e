#!/bin/bash
# Fourteenth session, 1x H200 with 16 cores: does the 64 KiB overlap follow the host's vCPU speeds?
# REPS times: `tools/host_probe speed` (the benchmark's kind of work timed alone on each CPU), the
# benchmark's 64 KiB overlap at 8 ranks (OSU's method; ranks on CPUs 0-7, the progress process on
# 8-15), the probe again.
#   REPS=8 OUT=$OUT bash docs/bench/h200-16core/session14/corr.sh
set -u
ROOT=$PWD
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
python3 -c "from setuptools import setup; setup()" build_ext --inplace -q >/dev/null 2>&1 || echo "build failed"
R=$OUT/corr; mkdir -p "$R"
for rep in $(seq ${REPS:-8}); do
  python3 tools/host_probe speed --rounds 1 | sed "s/^/before $rep /" | tee -a "$R/probe.txt"
  name=ov64_$rep
  timeout 120 mpirun -n 8 --allow-run-as-root --oversubscribe --bind-to core -x PYTHONPATH=$ROOT \
     python3 -m proxy.bench overlap -b 64K -e 64K --peers none --json "$R/$name.json" > "$R/$name.txt" 2>&1
  echo "$name rc=$? $(grep -E '^ +[0-9]' "$R/$name.txt")"
  python3 tools/host_probe speed --rounds 1 | sed "s/^/after $rep /" | tee -a "$R/probe.txt"
done
tar -czf "$OUT/corr.tgz" -C "$OUT" corr && rm -rf "$R"
