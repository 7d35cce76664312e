#!/usr/bin/env bash
# tools/device_bench.sh: the whole shmproxy-bench campaign on one multi-core host, in one go (< 9 min).
#
#   tools/device_bench.sh                 # from the repository root (or anywhere: it cd's there)
#   OUT=/tmp/res tools/device_bench.sh    # results elsewhere (default ./out)
#
# Meant for a GPU host with many cores (32 cores, Open MPI's mpirun, mpi4py and torch with gloo
# preinstalled, no internet), with this repository copied there as the working tree. It:
#   1. makes shmproxy importable: posix_ipc (installed, or built from a carried sdist/wheel in
#      build/deps/ or .whl/, else a labelled pure-Python stand-in, see below), then the C helpers
#      shm._native, shm._poster, shm._reduce and shm._workers (pip install -e . --no-build-isolation --no-deps, else an in-place build_ext, else
#      gcc directly);
#   2. finds the launcher: Open MPI's mpirun (run as root allowed, --oversubscribe, --bind-to $BIND)
#      or MPICH's mpiexec, and checks that mpi4py under it sees the right world;
#   3. runs, each bounded by `timeout` and all together by a global deadline (TOTAL_S, default 530 s):
#        pingpong   8B..64M, 2 ranks                      (latency and bandwidth, shmproxy/mpi4py/gloo)
#        latency8   pingpong 8B..64K at 8 ranks            (ranks 0 and 1 talk, six ranks idle)
#        allreduce  8B..256M at 2, 4, 8 ranks              (--peers mpi4py,gloo)
#        allreduce8mid  1M..16M in steps of 2x at 8 ranks  (the mid sizes the sweep above skips)
#        overlap    Iallreduce vs pure-Python work, 8 ranks, 64K..64M
#        post       the cost of posting an Isend, 2 ranks
#        idle       CPU of the progress process while 7 ranks block, 8 ranks
#        allreduce  8B..256M at 16 ranks (last: the longest; cut short, it keeps its rows)
#   4. prints a summary table.
#
# Output, under ${OUT:-./out}: device_bench.log (everything printed), summary.txt, results.tgz (every
# run's JSON and printed table: runs/<name>.json, runs/<name>.txt). The loose runs/ folder is kept
# unless PACK=1; PACK defaults to 1 when OUT is set in the environment (the device tool returns at
# most 8 files from $OUT), else 0.
#
# Knobs (environment): OUT, TOTAL_S (global deadline, s), BIND (Open MPI --bind-to: core (default),
# none, ...), RANKS (allreduce rank counts, default "2 4 8 16"), QUICK=1 (tiny sizes: a smoke test of
# the script itself in about a minute), PYTHON (default python3), PACK, ONLY (step names to run, e.g.
# ONLY="overlap8 post"; default all).
#
# Binding: --bind-to core (one core per rank) is how MPI is benchmarked, and shmproxy's progress process
# then takes cores no rank uses. gloo's helper threads share their rank's core under it: on the 32-core
# host its small-message allreduce took 8-20 ms at 8-16 ranks. BIND=none shows gloo unconstrained.
#
# posix_ipc: shmproxy creates its ops pool with posix_ipc.SharedMemory. If the package is missing and
# no sdist/wheel was carried, a stand-in module providing exactly what shm/segment.py uses (on Linux,
# shm_open(name) is open("/dev/shm" + name) with O_NOFOLLOW|O_CLOEXEC) is written to a private folder
# and put first on PYTHONPATH; the log and the summary say so. It is on the set-up path only (creating
# and mapping the pool), never on the data path. To use the real package instead, carry build/deps
# (which holds posix_ipc-1.3.2.tar.gz) or a wheel in .whl/.
set -uo pipefail

START=$(date +%s)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
OUT_SET=${OUT+yes}
OUT=${OUT:-./out}
mkdir -p "$OUT/runs"
OUT=$(cd "$OUT" && pwd)
RUNS="$OUT/runs"
LOG="$OUT/device_bench.log"
: >"$LOG"
PACK=${PACK:-$([ -n "$OUT_SET" ] && echo 1 || echo 0)}
TOTAL_S=${TOTAL_S:-530}
BIND=${BIND:-core}
RANKS=${RANKS:-2 4 8 16}
QUICK=${QUICK:-0}
PY=${PYTHON:-$(command -v python3 || command -v python)}
STATE="${TMPDIR:-/tmp}/shmproxy-device-bench-$$"
mkdir -p "$STATE"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1

say() { echo "$@" | tee -a "$LOG"; }
elapsed() { echo $(($(date +%s) - START)); }
trap 'rm -rf "$STATE"' EXIT

say "=== shmproxy device bench: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname), $(nproc) cores," \
    "$(uname -r); repo $ROOT; results in $OUT"

# ------------------------------------------------------------------------------------------ 1. set-up
have() { "$PY" -c "import $1" >/dev/null 2>&1; }

POSIX_IPC="installed"
if ! have posix_ipc; then
    POSIX_IPC="missing"
    for src in build/deps/posix_ipc-*.tar.gz .whl/posix_ipc-*.whl; do
        [ -e "$src" ] || continue
        say "--- posix_ipc missing: installing $src"
        if "$PY" -m pip install -q --no-index --no-build-isolation --no-deps "$src" >>"$LOG" 2>&1 \
                && have posix_ipc; then
            POSIX_IPC="built from $src"
            break
        fi
        say "    (failed: see $LOG)"
    done
fi
if ! have posix_ipc; then
    mkdir -p "$STATE/site"
    cat >"$STATE/site/posix_ipc.py" <<'EOF'
"""STAND-IN for the posix_ipc package, written by tools/device_bench.sh because the package was missing
and could not be built. Only what shm/segment.py uses. On Linux, shm_open(name) is
open("/dev/shm" + name, O_NOFOLLOW | O_CLOEXEC | flags, mode), which is what this does."""
import os

O_CREAT, O_EXCL = os.O_CREAT, os.O_EXCL
O_CREX = O_CREAT | O_EXCL
STAND_IN = True


class Error(Exception):
    pass


class ExistentialError(Error):
    pass


class PermissionsError(Error):
    pass


def _path(name):
    if not name.startswith("/") or "/" in name[1:] or len(name) < 2:
        raise ValueError(f"bad shared memory name {name!r}")
    return "/dev/shm" + name


def _raise(exc):
    if isinstance(exc, (FileExistsError, FileNotFoundError)):
        raise ExistentialError(str(exc)) from exc
    if isinstance(exc, PermissionError):
        raise PermissionsError(str(exc)) from exc
    raise Error(str(exc)) from exc


class SharedMemory:
    def __init__(self, name, flags=0, mode=0o600, size=0, read_only=False):
        fl = (os.O_RDONLY if read_only else os.O_RDWR) | (flags & O_CREX) | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self.fd = os.open(_path(name), fl, mode)
            if size:
                os.ftruncate(self.fd, size)
            self.size = os.fstat(self.fd).st_size
        except OSError as exc:
            _raise(exc)
        self.name = name

    def close_fd(self):
        os.close(self.fd)

    def unlink(self):
        unlink_shared_memory(self.name)


def unlink_shared_memory(name):
    try:
        os.unlink(_path(name))
    except OSError as exc:
        _raise(exc)
EOF
    export PYTHONPATH="$STATE/site:$PYTHONPATH"
    POSIX_IPC="STAND-IN (pure-Python /dev/shm; carry build/deps for the real one)"
    say "--- WARNING: posix_ipc is missing and could not be built: using a pure-Python stand-in ($STATE/site)"
fi
say "--- posix_ipc: $POSIX_IPC"

CMODS="_native _poster _reduce _workers"   # shm/<name>.c, as pyproject.toml lists them
built() { for m in $CMODS; do "$PY" -c "import shmproxy.shm.$m" >/dev/null 2>&1 || return 1; done; }
# Without pip, the package `shmproxy` is put together from the checkout's folders as pyproject.toml maps
# them (proxy/ is shmproxy, shm/ and transports/ its subpackages), with links, for in-place builds.
link_package() {
    mkdir -p "$STATE/pkg/shmproxy"
    for f in "$PWD"/proxy/*; do ln -sfn "$f" "$STATE/pkg/shmproxy/$(basename "$f")"; done
    ln -sfn "$PWD/shm" "$STATE/pkg/shmproxy/shm"
    ln -sfn "$PWD/transports" "$STATE/pkg/shmproxy/transports"
    export PYTHONPATH="$STATE/pkg:$PYTHONPATH"
}
if ! built; then
    say "--- building shm/{${CMODS// /,}}.c: pip install -e . --no-build-isolation --no-deps"
    if ! "$PY" -m pip install -q --no-index --no-build-isolation --no-deps -e . >>"$LOG" 2>&1 || ! built; then
        say "    pip failed (setuptools < 74 reads no ext-modules from pyproject.toml?): building in place"
        link_package
        "$PY" - $CMODS >>"$LOG" 2>&1 <<'EOF' || true
import sys
from setuptools import Extension, setup
setup(name="shmproxy-native", script_args=["build_ext", "--inplace"],
      ext_modules=[Extension(f"shm.{m}", [f"shm/{m}.c"], extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off"])
                   for m in sys.argv[1:]])
EOF
    fi
    if ! built; then
        say "    build_ext failed: gcc directly"
        INC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
        SUF=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
        for m in $CMODS; do
            gcc -O3 -std=gnu11 -ffp-contract=off -shared -fPIC -I"$INC" "shm/$m.c" -o "shm/$m$SUF" -lpthread >>"$LOG" 2>&1
        done
    fi
fi
if ! "$PY" -c "import shmproxy.shm._native, shmproxy, numpy, psutil" >>"$LOG" 2>&1; then
    say "FATAL: shmproxy cannot be imported (see the end of $LOG; Python.h missing? numpy/psutil missing?)"
    tail -20 "$LOG"
    exit 1
fi

# ------------------------------------------------------------------------------------------ 2. launcher
LAUNCHER=""
if command -v mpirun >/dev/null 2>&1 \
        && mpirun --version 2>&1 | grep -qi "open mpi\|open-mpi\|openrte\|prrte"; then
    LAUNCHER=openmpi
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    MPIVER=$(mpirun --version 2>&1 | head -1 | tr -s ' ')
elif command -v mpiexec >/dev/null 2>&1; then
    LAUNCHER=mpich
    MPIVER=$(mpiexec --version 2>&1 | grep -i -m1 "version" | tr -s ' ' || echo "mpiexec")
else
    say "FATAL: neither Open MPI's mpirun nor an mpiexec is on PATH"
    exit 1
fi

launch() {  # launch NRANKS CMD...: under the launcher, with this job's environment
    local n=$1
    shift
    if [ "$LAUNCHER" = openmpi ]; then
        local fwd=() v    # every exported SHMPROXY_* tunable reaches the ranks (A/B runs of a knob)
        for v in $(compgen -e | grep '^SHMPROXY_'); do fwd+=(-x "$v"); done
        mpirun -n "$n" --allow-run-as-root --oversubscribe --bind-to "$BIND" \
            -x PYTHONPATH -x PYTHONUNBUFFERED "${fwd[@]}" "$@"
    else
        mpiexec -n "$n" "$@"
    fi
}

kill_job() {  # the processes of our job that outlived it (ranks or progress processes), by pid
    local job=$1 pid
    for pid in $(env -u SHMPROXY_JOB_ID grep -lsaxzF "SHMPROXY_JOB_ID=$job" /proc/[0-9]*/environ 2>/dev/null |
                 cut -d/ -f3); do
        [ "$pid" != "$$" ] && kill -9 "$pid" 2>/dev/null && say "    killed leftover pid $pid of job $job"
    done
}

say "--- launcher: $LAUNCHER ($MPIVER); python $("$PY" -c 'import sys; print(sys.version.split()[0])')"
export SHMPROXY_JOB_ID="devbench-check-$$"
cat >"$STATE/mpicheck.py" <<'EOF'
from mpi4py import MPI
w = MPI.COMM_WORLD
if w.Get_rank() == 0:
    print("world of", w.Get_size(), "ranks;", " ".join(MPI.Get_library_version().split()[:4]))
EOF
CHECK=$(timeout -k 5 60 bash -c "$(declare -f launch); LAUNCHER=$LAUNCHER BIND=$BIND; "'launch "$@"' \
    _ 2 "$PY" "$STATE/mpicheck.py" 2>&1 | tail -3)
say "--- mpi4py under the launcher: ${CHECK:-nothing} (expected: world of 2 ranks)"
kill_job "$SHMPROXY_JOB_ID"
"$PY" - 2>&1 <<'EOF' | tee -a "$LOG"
import importlib.metadata as md, os, platform
def v(name):
    try:
        return md.version(name)
    except Exception:
        return "missing"
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(f"--- {cpu}; {os.cpu_count()} CPUs; numpy {v('numpy')}, mpi4py {v('mpi4py')}, torch {v('torch')}, "
      f"psutil {v('psutil')}, posix_ipc {v('posix_ipc')}; {platform.platform()}")
EOF

# ------------------------------------------------------------------------------------------ 3. runs
if [ "$QUICK" = 1 ]; then      # a smoke test of this script: tiny sizes, few iterations
    PP_E=64K; LAT_E=4K; AR_E=64K; MID_B=64K; MID_E=256K; OV_B=64K; OV_E=256K; IDLE_S=2; ITERS=(-n 10 -w 2)
else                          # iterations: the bench's defaults (1000 up to 64K, then ~64 MiB a size, >= 10)
    PP_E=64M; LAT_E=64K; AR_E=256M; MID_B=1M; MID_E=16M; OV_B=64K; OV_E=64M; IDLE_S=5; ITERS=()
fi
DEADLINE=$((START + TOTAL_S))
STEPS=()

step() {  # step NAME CAP_S NRANKS BENCH-ARGS...: one bounded run, its table and JSON under runs/
    local name=$1 cap=$2 n=$3
    shift 3
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
        return
    fi
    local left=$((DEADLINE - $(date +%s)))
    local t=$((cap < left ? cap : left))
    if [ "$t" -lt 15 ]; then
        say "=== $name: SKIPPED (global deadline: ${left}s left)"
        STEPS+=("$name|$n|skipped|0")
        return
    fi
    export SHMPROXY_JOB_ID="devbench-$name-$$"
    say ""
    say "=== $name: $n ranks, timeout ${t}s (t=$(elapsed)s): shmproxy-bench $*"
    local t0 rc
    t0=$(date +%s)
    timeout -k 10 "$t" bash -c "$(declare -f launch); LAUNCHER=$LAUNCHER BIND=$BIND; "'launch "$@"' \
        _ "$n" "$PY" -m shmproxy.tools.bench "$@" ${ITERS[@]+"${ITERS[@]}"} --json "$RUNS/$name.json" 2>&1 |
        tee "$RUNS/$name.txt" | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && say "=== $name: TIMED OUT after ${t}s (rows so far are in its JSON)"
    kill_job "$SHMPROXY_JOB_ID"
    STEPS+=("$name|$n|$rc|$(($(date +%s) - t0))")
}

# Caps from a run on the 2 x H200 host (32 cores, --bind-to core): pingpong 9 s, latency8 7 s, allreduce
# 26/43/76 s at 2/4/8 ranks and ~150 s at 16 (gloo's small messages take 16-20 ms each there: ~100 s of
# it), overlap8 89 s, post 6 s, idle8 7 s. The largest allreduce goes last, so that a slow one can only
# cut itself short (its JSON keeps the rows done), never starve the others.
step pingpong 60 2 pingpong -b 8 -e "$PP_E" -f 4 --peers mpi4py,gloo
step latency8 45 8 pingpong -b 8 -e "$LAT_E" -f 8 --peers mpi4py,gloo
LAST=""
for n in $RANKS; do
    [ "$n" -ge 16 ] && { LAST="$LAST $n"; continue; }
    cap=$((n <= 2 ? 60 : n <= 4 ? 80 : 120))
    step "allreduce$n" "$cap" "$n" allreduce -b 8 -e "$AR_E" -f 8 --peers mpi4py,gloo
done
step allreduce8mid 90 8 allreduce -b "$MID_B" -e "$MID_E" -f 2 --peers mpi4py,gloo
step overlap8 150 8 overlap -b "$OV_B" -e "$OV_E" -f 4 --peers mpi4py,gloo
step post 30 2 post --peers mpi4py,gloo
step idle8 30 8 idle --idle-seconds "$IDLE_S"
for n in $LAST; do
    step "allreduce$n" 220 "$n" allreduce -b 8 -e "$AR_E" -f 8 --peers mpi4py,gloo
done

# ------------------------------------------------------------------------------------------ 4. summary
say ""
printf '%s\n' "${STEPS[@]}" >"$STATE/steps"
"$PY" - "$RUNS" "$STATE/steps" "$POSIX_IPC" "$LAUNCHER ($MPIVER), --bind-to $BIND" "$(elapsed)" \
    2>&1 <<'EOF' | tee "$OUT/summary.txt" | tee -a "$LOG"
import json, math, os, sys

runs, steps_file, posix_ipc, launcher, total = sys.argv[1:6]
LIBS = ("shmproxy", "mpi4py", "gloo")


def num(v, fmt="{:.2f}"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def at(rows, nbytes):
    """The row of that size, else the largest below it."""
    best = None
    for row in rows:
        if row["bytes"] <= nbytes and (best is None or row["bytes"] > best["bytes"]):
            best = row
    return best


def key_figures(name, rep):
    rows = rep.get("results", [])
    out = {}
    if not rows:
        return out, "no rows"
    small, large = rows[0], rows[-1]
    for lib in rep["libraries"]:
        s, l = small["results"].get(lib, {}), large["results"].get(lib, {})
        if rep["op"] == "pingpong":
            out[lib] = f"{num(s.get('time_us'))} us / {num(l.get('busbw_GBps'))} GB/s"
        elif rep["op"] == "allreduce":
            out[lib] = f"{num(s.get('time_us'))} us / {num(l.get('busbw_GBps'))} GB/s"
        elif rep["op"] == "overlap":
            out[lib] = "/".join(num(r["results"].get(lib, {}).get("overlap_pct"), "{:.0f}") for r in rows)
        elif rep["op"] == "post":
            out[lib] = f"{num(s.get('single_us'))} us ({num(s.get('group_us_per_op'))} grouped)"
        elif rep["op"] == "idle":
            out[lib] = (f"proxy {num(s.get('proxy_cpu_percent'), '{:.1f}')}%, "
                        f"{num(s.get('proxy_wakeups_per_s'), '{:.0f}')}/s wake-ups, "
                        f"waiting ranks {num(s.get('waiting_cpu_percent'), '{:.1f}')}%")
    what = {"pingpong": f"{small['bytes']}B one-way / {large['bytes']}B bw",
            "allreduce": f"{small['bytes']}B time / {large['bytes']}B busbw",
            "overlap": "overlap % at " + ",".join(f"{r['bytes'] >> 10}K" for r in rows),
            "post": "Isend post", "idle": "idle CPU"}.get(rep["op"], "")
    return out, what


print("=== SUMMARY (figures: median over iterations, max over ranks; ratio > 1 = shmproxy faster)")
print(f"    launcher {launcher}; posix_ipc {posix_ipc}; total {total}s")
head = f"{'run':<12}{'ranks':>5}{'rc':>8}{'secs':>6}  {'check':<8}"
print(head + "".join(f"{lib:>30}" for lib in LIBS) + "  figure")
for line in open(steps_file).read().split("\n"):
    if not line:
        continue
    name, n, rc, secs = line.split("|")
    path = os.path.join(runs, f"{name}.json")
    rep = json.load(open(path)) if os.path.exists(path) else {}
    figs, what = key_figures(name, rep) if rep else ({}, "no JSON")
    if rep:
        check = "ok" if rep.get("ok") else "FAIL"
        if not rep.get("complete", True):
            check += "/part"
    else:
        check = "-"
    status = {"0": "ok", "124": "timeout", "137": "killed", "skipped": "skipped"}.get(rc, f"rc={rc}")
    row = f"{name:<12}{n:>5}{status:>8}{secs:>6}  {check:<8}"
    for lib in LIBS:
        row += f"{figs.get(lib, 'skipped' if lib in rep.get('skipped', {}) else '-'):>30}"
    print(row + "  " + what)
    for lib, why in rep.get("skipped", {}).items():
        print(f"{'':>12}  {lib} skipped: {why}")
EOF

if [ -d "$RUNS" ]; then
    tar -C "$OUT" -czf "$OUT/results.tgz" runs
    [ "$PACK" = 1 ] && rm -rf "$RUNS"
fi
say "=== done in $(elapsed)s: $OUT/summary.txt, $OUT/results.tgz$([ "$PACK" = 1 ] || echo ", $RUNS/"), $LOG"
