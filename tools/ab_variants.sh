#!/usr/bin/env bash
# tools/ab_variants.sh: one shmproxy-bench command, run in interleaved rounds on an older tree (A), this
# tree (B) and this tree under extra settings (more B variants): which condition makes a figure move.
#
#   tools/ab_variants.sh BASE_TREE ROUNDS 'pingpong -b 64K -e 1M -f 4' [NAME:VAR=VAL,VAR=VAL ...]
#   e.g. OUT=/tmp/v tools/ab_variants.sh .ab/base 6 'pingpong -b 64K -e 1M -f 4' Bf0:SHMPROXY_FAST_BYTES=0
#
# BASE_TREE as for tools/ab_bench.sh (which builds both trees' C extensions in place; this script
# calls it for that). 2 ranks (NRANKS to change), unbound, mpi4py measured in the same runs. The
# order of the variants rotates every round. Prints, per variant and size, shmproxy's and mpi4py's
# figure of every round (the bench's own median) and the median over rounds.
set -uo pipefail
BASE=$(cd "${1:?usage: tools/ab_variants.sh BASE_TREE ROUNDS 'BENCH ARGS' [NAME:VAR=VAL,...]...}" && pwd)
ROUNDS=${2:?rounds}
ARGS=${3:?bench arguments}
shift 3
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$(mkdir -p "${OUT:-./variants-out}" && cd "${OUT:-./variants-out}" && pwd)
NRANKS=${NRANKS:-2}
PY=${PYTHON:-$(command -v python3 || command -v python)}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
OUT=$OUT/build ONLY=none bash "$ROOT/tools/ab_bench.sh" "$BASE" 1 >"$OUT/build.log" 2>&1 ||
    { echo "building the trees failed: $OUT/build.log"; exit 1; }
ST=$(mktemp -d "${TMPDIR:-/tmp}/shmproxy-var-XXXXXX")
trap 'rm -rf "$ST"' EXIT
for side in A B; do   # each tree as the package `shmproxy`, as tools/ab_bench.sh maps them
    tree=$([ $side = A ] && echo "$BASE" || echo "$ROOT")
    mkdir -p "$ST/$side/shmproxy"
    for f in "$tree"/proxy/*; do ln -sfn "$f" "$ST/$side/shmproxy/$(basename "$f")"; done
    ln -sfn "$tree/shm" "$ST/$side/shmproxy/shm"
    ln -sfn "$tree/transports" "$ST/$side/shmproxy/transports"
done
VARIANTS=("A:" "B:" "$@")
OMPI=$(mpirun --version 2>&1 | grep -qi "open mpi\|openrte\|prrte" && echo 1 || echo 0)
cd "$ST" || exit 1
for ((r = 1; r <= ROUNDS; r++)); do
    n=${#VARIANTS[@]}
    for ((k = 0; k < n; k++)); do
        v=${VARIANTS[$(((k + r) % n))]}
        name=${v%%:*} settings=${v#*:}
        tree=$([ "$name" = A ] && echo A || echo B)
        envs=() fwd=()
        IFS=',' read -ra pairs <<<"$settings"
        for p in "${pairs[@]}"; do [ -n "$p" ] && envs+=("$p") && fwd+=(-x "${p%%=*}"); done
        if [ "$OMPI" = 1 ]; then launcher=(mpirun -n "$NRANKS" --allow-run-as-root --oversubscribe --bind-to none
                                           -x PYTHONPATH -x PYTHONUNBUFFERED "${fwd[@]}")
        else launcher=(mpiexec -n "$NRANKS"); fi   # MPICH's hydra passes the environment on
        # shellcheck disable=SC2086
        env "${envs[@]}" PYTHONPATH="$ST/$tree${PYTHONPATH:+:$PYTHONPATH}" SHMPROXY_JOB_ID="var-$$-$name-$r" \
            timeout -k 5 120 "${launcher[@]}" "$PY" -m shmproxy.tools.bench $ARGS --peers mpi4py \
            --json "$OUT/$name-$r.json" >"$OUT/$name-$r.log" 2>&1 || echo "$name round $r: exit $?"
    done
done
"$PY" - "$OUT" "${VARIANTS[@]}" <<'EOF' | tee "$OUT/summary.txt"
import collections, json, os, statistics, sys
out, names = sys.argv[1], [v.split(":", 1)[0] for v in sys.argv[2:]]
rows = collections.defaultdict(list)
for name in names:
    r = 1
    while os.path.exists(os.path.join(out, f"{name}-{r}.json")):
        try:
            for row in json.load(open(os.path.join(out, f"{name}-{r}.json")))["results"]:
                res = row["results"]
                rows[(row["bytes"], name)].append((res["shmproxy"]["time_us"], res["mpi4py"]["time_us"]))
        except (OSError, ValueError, KeyError) as exc:
            print(f"{name} round {r}: {exc}")
        r += 1
print("time_us per round (the bench's median); med = median over rounds")
for (nbytes, name), v in sorted(rows.items()):
    s, m = [a for a, _ in v], [b for _, b in v]
    print(f"{nbytes:>9} {name:>5}: shmproxy med {statistics.median(s):7.1f} [{' '.join(f'{x:.1f}' for x in s)}]"
          f"  mpi4py med {statistics.median(m):7.1f}")
EOF
