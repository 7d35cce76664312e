#!/bin/bash
# Fourteenth session, 1x H200 with 16 cores (the 2x H200 kind withheld): is the 64 KiB overlap on a host
# of this kind decided by our code or by the host? First the host's own noise: the same pure-Python
# loop timed alone on each of the 16 CPUs, twice (a spread between CPUs, or between the two rounds, is
# other guests on the physical cores; steal from /proc/stat around it). Then, REPS times, the
# per-iteration diagnosis (session6/diag/ovdiag.py, 3000 iterations, ovsum.py) and the benchmark's
# overlap at 64 KiB-1 MiB against Open MPI and gloo in the same run (OSU's method), each followed by the
# CPU probe again, so that a bad run can be matched with a slow host.
#   REPS=3 OUT=$OUT bash docs/bench/h200-16core/session14/run.sh
set -u
ROOT=$PWD
S13=$ROOT/docs/bench/h100-16core/session13
DIAG=$ROOT/docs/bench/h200x2-32core/session6/diag/ovdiag.py
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
python3 -c "from setuptools import setup; setup()" build_ext --inplace -q >/dev/null 2>&1 || echo "build failed"
nproc; lscpu | grep -i "model name\|socket\|numa node(s)\|thread(s) per core\|hypervisor"
R=$OUT/s14; mkdir -p "$R"
probe() {   # ms per 200k iterations of the benchmark's work, on each CPU in turn, and the steal meanwhile
  python3 - "$@" <<'PY'
import os, time
def steal():
    f = open('/proc/stat').readline().split()[1:]
    v = list(map(int, f)); return v[7], sum(v)
s0, t0 = steal()
out = []
for cpu in sorted(os.sched_getaffinity(0)):
    os.sched_setaffinity(0, [cpu])
    best = 1e9
    for _ in range(5):
        t = time.perf_counter(); x = 1
        for i in range(200000):
            x = (x * 1103515245 + i) & 0xFFFFFFFF
        best = min(best, time.perf_counter() - t)
    out.append(f"{cpu}:{best*1e3:.1f}")
s1, t1 = steal()
print("cpu probe (ms, best of 5):", " ".join(out), f"| steal {100*(s1-s0)/max(1,t1-t0):.1f} %")
PY
}
probe | tee "$R/probe_0.txt"
for rep in $(seq ${REPS:-3}); do
  d=$R/diag_$rep; mkdir -p "$d"
  XOUT=$d timeout 120 mpirun -n 8 --allow-run-as-root --oversubscribe --bind-to core \
     -x PYTHONPATH=$ROOT -x XOUT python3 "$DIAG" 65536 ${ITERS:-3000} > "$d/log.txt" 2>&1
  python3 "$S13/ovsum.py" "$d" | tee "$d/summary.txt"
  name=ov8_$rep
  timeout 240 mpirun -n 8 --allow-run-as-root --oversubscribe --bind-to core -x PYTHONPATH=$ROOT \
     python3 -m proxy.bench overlap -b 64K -e 1M -f 4 --peers ${PEERS:-mpi4py,gloo} --json "$R/$name.json" > "$R/$name.txt" 2>&1
  echo "$name rc=$?"; grep -E '^ +[0-9]' "$R/$name.txt"
  probe | tee "$R/probe_$rep.txt"
done
rm -f "$R"/diag_*/rank*.npz.tmp
tar -czf "$OUT/s14.tgz" -C "$OUT" s14 && rm -rf "$R"
