#!/bin/bash
# Non-temporal (streaming) stores in collectives, on and off, on a GPU host (eleventh session; the
# 1x H100 16-core kind): 8- and 2-rank Allreduce 1-64 MiB, interleaved, with the host's cache sizes.
# The question: above which working set do streaming stores pay, against the last-level cache?
# Run from the repository root: REPS=2 OUT=$OUT bash docs/bench/h100-16core/session11/streaming.sh
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
python3 -c "from setuptools import setup; setup()" build_ext --inplace -q >/dev/null 2>&1 || echo "build failed"
nproc; lscpu | grep -i "model name\|socket\|numa node(s)\|cache"
for i in /sys/devices/system/cpu/cpu0/cache/index*; do echo "$i $(cat $i/level) $(cat $i/type) $(cat $i/size) $(cat $i/shared_cpu_list)"; done
run() {  # name nranks streaming bench-args...
  local name=$1 n=$2 s=$3; shift 3
  PYTHONPATH=$PWD timeout 200 mpirun -n "$n" --allow-run-as-root --oversubscribe --bind-to core \
     -x PYTHONPATH -x SHMPROXY_COPY_STREAMING=$s python3 -m proxy.bench "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$? $(grep -E '^ +[0-9]' "$OUT/$name.txt" | awk '{printf "%s:%s ", $1, $4}')"
}
for rep in $(seq ${REPS:-2}); do
  for s in ${STREAMS:-0 1}; do
    run ar8_s${s}_$rep 8 $s allreduce -b 1M -e 64M -f 2 --peers none
    run ar2_s${s}_$rep 2 $s allreduce -b 1M -e 64M -f 2 --peers none
  done
done
