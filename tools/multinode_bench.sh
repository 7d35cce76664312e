#!/usr/bin/env bash
# tools/multinode_bench.sh: shmproxy across K simulated nodes of one host, against gloo and the raw
# sockets in the same job.
#
#   tools/multinode_bench.sh                         # from the repository root: K = 2 and 4, 1, 2, 4 ranks per node
#   NODES="2" PER="1 2" OUT=/tmp/mb tools/multinode_bench.sh
#   SIZES="-b 8 -e 1M -f 64" tools/multinode_bench.sh      # a quick look
#   PINGPONG=0 NODES="2 4" PER=1 tools/multinode_bench.sh  # Allreduce only
#   DEVICE=cuda PINGPONG=0 NODES=2 PER=1 tools/multinode_bench.sh  # device buffers, a GPU per node
#
# Each node is a torchrun of its own (--nnodes K --node-rank k, one host's rendezvous on 127.0.0.1)
# whose ranks carry a host identity of their own (SHMPROXY_HOSTNAME=simnode<k>-<job>): each node has
# its own progress process, and the nodes meet over the socket transport, on loopback
# (SHMPROXY_SOCKET_IFNAME=lo); gloo in the same ranks goes over loopback too (GLOO_SOCKET_IFNAME=lo).
# Loopback says how the libraries compare on one path, not what a network gives; for separate network
# stacks (veth between namespaces) see tools/netns_bench.sh.
#
# Runs, for every K in NODES: the ping-pong between the first two nodes (one rank per node; peers gloo,
# tcp = one raw socket, tcp-streams = as many raw sockets as shmproxy's link), then, for every P in PER,
# Allreduce at K x P ranks against gloo. Output under ${OUT:-./out}: multinode_bench.log (the tables)
# and one JSON per run (multinode_<op>_<K>x<P>.json). Exits non-zero if any run failed.
# DEVICE=cuda: device buffers (shmproxy-bench --device cuda; gloo on the same CUDA tensors), node k on
# GPU k modulo the host's GPUs (CUDA_VISIBLE_DEVICES), so two nodes of a 2-GPU host have one GPU each;
# the JSON names then end in _cuda.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-./out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/multinode_bench.log"
NODES=${NODES:-2 4}
PER=${PER:-1 2 4}
SIZES=${SIZES:--b 8 -e 64M -f 8}
PY=${PYTHON:-python3}
TIMEOUT_S=${TIMEOUT_S:-600}
PINGPONG=${PINGPONG:-1}
DEVICE=${DEVICE:-host}
NGPU=1
DEVARGS=()
SUFFIX=""
if [ "$DEVICE" = cuda ]; then
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [ "${NGPU:-0}" -ge 1 ] || { echo "DEVICE=cuda: no GPU here (nvidia-smi -L)"; exit 1; }
    DEVARGS=(--device cuda)
    SUFFIX=_cuda
fi
: >"$LOG"
"$PY" -c "import shmproxy, torch.distributed" 2>>"$LOG" || { echo "shmproxy and torch must be importable by $PY" | tee -a "$LOG"; exit 1; }

free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

run() {   # run K P NAME ARGS...: shmproxy-bench under K torchruns of P ranks each
    local k=$1 p=$2 name=$3; shift 3
    local port job pids=() rc=0
    port=$(free_port)
    job=$("$PY" -c "import uuid; print(uuid.uuid4().hex[:12])")
    echo "=== $name: $k nodes x $p ranks ($(date -u '+%H:%M:%S'))"
    for ((i = 0; i < k; i++)); do
        [ "$DEVICE" = cuda ] && export CUDA_VISIBLE_DEVICES=$((i % NGPU))
        SHMPROXY_HOSTNAME=simnode$i-$job SHMPROXY_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 \
            timeout "$TIMEOUT_S" "$PY" -m torch.distributed.run --nnodes "$k" --node-rank "$i" --nproc-per-node "$p" \
            --master-addr 127.0.0.1 --master-port "$port" --max-restarts 0 \
            -m shmproxy.tools.bench "$@" "${DEVARGS[@]}" --no-progress --json "$OUT/multinode_${name}_${k}x${p}${SUFFIX}.json" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    [ $rc -eq 0 ] || echo "!!! $name at $k x $p failed"
    return $rc
}

status=0
{
    echo "=== multinode_bench: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) CPUs, shmproxy $(git rev-parse --short HEAD 2>/dev/null), buffers: $DEVICE"
    env | grep '^SHMPROXY_' | sort | sed 's/^/=== /'
    for k in $NODES; do
        # shellcheck disable=SC2086  # SIZES is a list of arguments
        if [ "$PINGPONG" != 0 ]; then
            run "$k" 1 pingpong pingpong $SIZES --peers gloo,tcp,tcp-streams || status=1
        fi
        for p in $PER; do
            # shellcheck disable=SC2086
            run "$k" "$p" allreduce allreduce $SIZES --peers gloo || status=1
        done
    done
} 2>&1 | tee -a "$LOG"
exit $status
