#!/usr/bin/env bash
# tools/netns_bench.sh: shmproxy across two "hosts" against torch gloo, in the same torchrun job.
#
#   sudo tools/netns_bench.sh            # from the repository root, as root (network namespaces)
#   OUT=/tmp/res PER=2 tools/netns_bench.sh
#   PINGPONG="" ALLREDUCE="-b 16M -e 64M -f 4" tools/netns_bench.sh   # sizes of each run ("" skips it)
#
# Two network namespaces (the hosts) are cabled to a third (a switch with a bridge), each host gets
# 10.99.0.<i+1>/24 on a veth pair, and torchrun runs with --nnodes 2 in each: shmproxy meets through
# torchrun's store and its progress processes talk over TCP between the namespaces; gloo runs in the
# same ranks (--peers gloo) over the same cable. The cable is a veth pair inside one kernel, so the
# figures say how the two libraries compare on the same path, not what a real network gives.
# Runs: pingpong with one rank per host, allreduce with PER (default 2) ranks per host. The namespaces
# are deleted on exit, whatever happens. Output under ${OUT:-./out}: netns_bench.log.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-./out}
mkdir -p "$OUT"
LOG="$OUT/netns_bench.log"
PER=${PER:-2}
PINGPONG=${PINGPONG--b 8 -e 16M -f 8}
ALLREDUCE=${ALLREDUCE--b 8 -e 16M -f 8}
PY=${PYTHON:-python3}
BENCH=$(command -v shmproxy-bench) || { echo "shmproxy-bench is not installed" >&2; exit 1; }
TAG=spb$$
SW=${TAG}sw
cleanup() { for ns in ${TAG}h0 ${TAG}h1 "$SW"; do ip netns del "$ns" 2>/dev/null; done; }
trap cleanup EXIT
ip netns add "$SW" && ip -n "$SW" link add br0 type bridge && ip -n "$SW" link set br0 up || exit 1
for i in 0 1; do
    ns=${TAG}h$i
    ip netns add "$ns" && ip -n "$ns" link set lo up &&
    ip -n "$ns" link add eth0 type veth peer name s$i netns "$SW" &&
    ip -n "$SW" link set s$i master br0 && ip -n "$SW" link set s$i up &&
    ip -n "$ns" addr add 10.99.0.$((i + 1))/24 dev eth0 && ip -n "$ns" link set eth0 up || exit 1
done
run() {   # run NPER ARGS...: shmproxy-bench under torchrun on both hosts
    local nper=$1; shift
    local port=$((20000 + RANDOM % 20000)) pids=() rc=0
    for i in 0 1; do
        ip netns exec ${TAG}h$i env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
            "$PY" -m torch.distributed.run --nnodes 2 --node-rank $i --nproc-per-node "$nper" \
            --master-addr 10.99.0.1 --master-port $port --max-restarts 0 "$BENCH" "$@" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    return $rc
}
{
    echo "=== netns_bench: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) cores, shmproxy $(git rev-parse --short HEAD)"
    if [ -n "$PINGPONG" ]; then
        echo "=== pingpong, 1 rank per host"
        timeout 300 bash -c "$(declare -f run); TAG=$TAG PY=$PY BENCH=$BENCH; run 1 pingpong $PINGPONG --peers gloo --no-progress" \
            || echo "pingpong failed"
    fi
    if [ -n "$ALLREDUCE" ]; then
        echo "=== allreduce, $PER ranks per host"
        timeout 300 bash -c "$(declare -f run); TAG=$TAG PY=$PY BENCH=$BENCH; run $PER allreduce $ALLREDUCE --peers gloo --no-progress" \
            || echo "allreduce failed"
    fi
} 2>&1 | tee "$LOG"
