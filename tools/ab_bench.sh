#!/usr/bin/env bash
# tools/ab_bench.sh: an interleaved A/B of two trees of shmproxy on this host, with shmproxy-bench.
#
#   tools/ab_bench.sh BASE_TREE [PAIRS]        # from anywhere; the current tree is the B side
#   OUT=/tmp/ab NRANKS=8 tools/ab_bench.sh /tmp/base 3
#
# BASE_TREE is a checkout of the older commit (e.g. `git archive <commit> | tar -x -C DIR`): both the
# layout before the single `shmproxy` import name (top-level proxy/, shm/) and the one after work.
# Neither tree is pip-installed: each gets its C extensions built in place with gcc from its own
# pyproject.toml, and is put on PYTHONPATH (the newer layout through a folder of links that maps the
# package as pyproject.toml does), so the two never see each other.
#
# Each pair runs every step on A then B, the order swapped every other pair, so that a host that
# slows down over the run does not favour one side. Steps (ranks: 2, and NRANKS where it says N):
#   lat, bw      pingpong 8 B, and 4M..64M, with mpi4py in the same run (one-way latency, bandwidth)
#   mid          pingpong 64K..1M (one-way time), with mpi4py
#   arN, arbwN   allreduce 8 B, and 4M..64M, at N ranks, with mpi4py (time, busbw)
#   post   the cost of posting an Isend (single, grouped)
#   idleN  CPU of the progress process while N-1 ranks block
#   ovN    Iallreduce overlap with Python work, 64K..1M, N ranks
# The summary gives, per figure, the median over pairs of each side and B/A (and each side's ratio
# to mpi4py measured in the same run, which cancels much of a host's drift).
# Knobs: OUT (default ./ab-out), NRANKS (default 2), PYTHON, TIMEOUT_S (per step, default 240), ONLY (the
# steps to run, e.g. ONLY="lat ar8"; default all).
set -uo pipefail
BASE=$(cd "${1:?usage: tools/ab_bench.sh BASE_TREE [PAIRS]}" && pwd)
PAIRS=${2:-3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$(mkdir -p "${OUT:-./ab-out}" && cd "${OUT:-./ab-out}" && pwd)
NRANKS=${NRANKS:-2}
PY=${PYTHON:-$(command -v python3 || command -v python)}
TIMEOUT_S=${TIMEOUT_S:-240}
STATE=$(mktemp -d "${TMPDIR:-/tmp}/shmproxy-ab-XXXXXX")
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
say() { echo "$@" | tee -a "$OUT/ab.log"; }

build() {  # build TREE: its C extensions in place (gcc, the sources and flags of its pyproject.toml)
    local tree=$1
    "$PY" - "$tree" <<'EOF' || return 1
import os, subprocess, sys, sysconfig
try:
    import tomllib
except ModuleNotFoundError:          # Python 3.10
    import tomli as tomllib
tree = sys.argv[1]
cfg = tomllib.load(open(os.path.join(tree, "pyproject.toml"), "rb"))["tool"]["setuptools"]
inc, suf = sysconfig.get_paths()["include"], sysconfig.get_config_var("EXT_SUFFIX")
for ext in cfg["ext-modules"]:
    out = os.path.join(tree, "shm", ext["name"].rsplit(".", 1)[1] + suf)
    cmd = (["gcc", "-shared", "-fPIC", f"-I{inc}", *ext.get("extra-compile-args", [])]
           + [os.path.join(tree, s) for s in ext["sources"]] + ["-o", out]
           + [f"-l{lib}" for lib in ext.get("libraries", [])])
    subprocess.run(cmd, check=True)
print("built", len(cfg["ext-modules"]), "extensions in", tree)
EOF
}

pypath() {  # pypath TREE SIDE: what goes on PYTHONPATH for that tree, and how to run its bench
    local tree=$1 side=$2
    if [ -d "$tree/proxy/core" ]; then      # one import name: shmproxy = proxy/, with shm/ and transports/
        mkdir -p "$STATE/$side/shmproxy"
        for f in "$tree"/proxy/*; do ln -sfn "$f" "$STATE/$side/shmproxy/$(basename "$f")"; done
        ln -sfn "$tree/shm" "$STATE/$side/shmproxy/shm"
        ln -sfn "$tree/transports" "$STATE/$side/shmproxy/transports"
        echo "$STATE/$side|shmproxy.tools.bench"
    else
        echo "$tree|proxy.bench"
    fi
}

launch() {  # launch NRANKS CMD...
    local n=$1
    shift
    if mpirun --version 2>&1 | grep -qi "open mpi\|openrte\|prrte"; then
        mpirun -n "$n" --allow-run-as-root --oversubscribe --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED "$@"
    else
        mpiexec -n "$n" "$@"
    fi
}

for side in A B; do
    tree=$([ $side = A ] && echo "$BASE" || echo "$ROOT")
    build "$tree" >>"$OUT/ab.log" 2>&1 || { say "FATAL: building $tree failed (see $OUT/ab.log)"; exit 1; }
    IFS='|' read -r path mod < <(pypath "$tree" $side)
    eval "PATH_$side=\$path MOD_$side=\$mod"
    say "--- $side: $tree ($([ -e "$tree/.git" ] && git -C "$tree" rev-parse --short HEAD || echo 'not a checkout')), python -m $mod"
done

N=$NRANKS
cd "$STATE" || exit 1   # `python -m` looks in the working directory first: neither tree's folders may be there
STEPS=("lat|2|pingpong -b 8 -e 8 --peers mpi4py"
       "bw|2|pingpong -b 4M -e 64M -f 4 --peers mpi4py"
       "mid|2|pingpong -b 64K -e 1M -f 4 --peers mpi4py"
       "ar$N|$N|allreduce -b 8 -e 8 --peers mpi4py"
       "arbw$N|$N|allreduce -b 4M -e 64M -f 4 --peers mpi4py"
       "post|2|post --peers mpi4py"
       "idle$N|$N|idle --idle-seconds 3"
       "ov$N|$N|overlap -b 64K -e 1M -f 4 --peers none")
for ((pair = 1; pair <= PAIRS; pair++)); do
    order=$([ $((pair % 2)) = 1 ] && echo "A B" || echo "B A")
    for step in "${STEPS[@]}"; do
        IFS='|' read -r name n args <<<"$step"
        if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
            continue
        fi
        for side in $order; do
            path=PATH_$side mod=MOD_$side
            json="$OUT/$name-$side-$pair.json"
            say "=== pair $pair $side $name ($n ranks): $args"
            # shellcheck disable=SC2086
            PYTHONPATH="${!path}${PYTHONPATH:+:$PYTHONPATH}" SHMPROXY_JOB_ID="ab-$$-$name-$side-$pair" timeout -k 10 "$TIMEOUT_S" \
                bash -c "$(declare -f launch); launch \"\$@\"" _ "$n" "$PY" -m "${!mod}" $args --json "$json" \
                >>"$OUT/ab.log" 2>&1 || say "    exit $? (the rows done are in its JSON)"
        done
    done
done

"$PY" - "$OUT" "$PAIRS" "$N" <<'EOF' | tee "$OUT/summary.txt"
import glob, json, os, statistics, sys
out, pairs, n = sys.argv[1], int(sys.argv[2]), sys.argv[3]


def rows(name, side, pair):
    try:
        return json.load(open(os.path.join(out, f"{name}-{side}-{pair}.json")))["results"]
    except (OSError, ValueError, KeyError):
        return []


def pick(rs, nbytes, lib, key):
    for r in rs:
        if r["bytes"] == nbytes:
            return r["results"].get(lib, {}).get(key)
    return None


FIGS = [("lat", 8, "time_us", "8 B one-way latency, us", -1), ("bw", 4 << 20, "busbw_GBps", "4 MiB ping-pong, GB/s", 1),
        ("bw", 64 << 20, "busbw_GBps", "64 MiB ping-pong, GB/s", 1),
        ("mid", 64 << 10, "time_us", "64 KiB ping-pong one way, us", -1),
        ("mid", 1 << 20, "time_us", "1 MiB ping-pong one way, us", -1),
        (f"ar{n}", 8, "time_us", f"8 B Allreduce at {n} ranks, us", -1),
        (f"arbw{n}", 4 << 20, "busbw_GBps", f"4 MiB Allreduce busbw at {n}, GB/s", 1),
        (f"arbw{n}", 64 << 20, "busbw_GBps", f"64 MiB Allreduce busbw at {n}, GB/s", 1),
        ("post", None, "single_us", "Isend post, us", -1), ("post", None, "group_us_per_op", "grouped post per op, us", -1),
        (f"idle{n}", None, "proxy_cpu_percent", f"idle progress-process CPU at {n} ranks, %", -1),
        (f"ov{n}", 64 << 10, "overlap_pct", f"overlap at 64 KiB, {n} ranks, %", 1),
        (f"ov{n}", 256 << 10, "overlap_pct", f"overlap at 256 KiB, {n} ranks, %", 1),
        (f"ov{n}", 1 << 20, "overlap_pct", f"overlap at 1 MiB, {n} ranks, %", 1)]
print(f"A/B over {pairs} interleaved pairs (median over pairs; each run's figure is the bench's median)")
print(f"{'figure':<42}{'A':>10}{'B':>10}{'B/A':>8}   {'A vs mpi4py':>12}{'B vs mpi4py':>12}   per pair (A | B)")
for name, nbytes, key, label, better in FIGS:
    vals, mpi = {"A": [], "B": []}, {"A": [], "B": []}
    for side in "AB":
        for p in range(1, pairs + 1):
            rs = rows(name, side, p)
            if not rs:
                continue
            b = nbytes if nbytes is not None else rs[0]["bytes"]
            v = pick(rs, b, "shmproxy", key)
            if v is not None:
                vals[side].append(v)
                m = pick(rs, b, "mpi4py", key)
                if m:
                    mpi[side].append(m / v if better < 0 else v / m)
    if not vals["A"] or not vals["B"]:
        print(f"{label:<42}{'-':>10}{'-':>10}")
        continue
    a, b = statistics.median(vals["A"]), statistics.median(vals["B"])
    ma = f"{statistics.median(mpi['A']):.2f}x" if mpi["A"] else "-"
    mb = f"{statistics.median(mpi['B']):.2f}x" if mpi["B"] else "-"
    per = " ".join(f"{x:.3g}" for x in vals["A"]) + " | " + " ".join(f"{x:.3g}" for x in vals["B"])
    print(f"{label:<42}{a:>10.3g}{b:>10.3g}{b / a if a else float('nan'):>8.2f}   {ma:>12}{mb:>12}   {per}")
print("(vs mpi4py: > 1 means shmproxy is better, for times and for bandwidths alike)")
EOF
rm -rf "$STATE"
