"""Where one way of a ping-pong goes: the ranks' own times against the progress process's trace.

    D=/tmp/chain; rm -rf $D; mkdir -p $D
    SHMPROXY_PROFILE=1 SHMPROXY_PROFILE_FILE=$D/trace_%p.json mpirun -n 2 -x SHMPROXY_PROFILE \\
        -x SHMPROXY_PROFILE_FILE python3 tools/gpu_chain_probe.py run $D 64M 2000   # cupy buffers
    python3 tools/gpu_chain_probe.py analyse $D                                       # once all exited

``run --host`` uses registered host memory instead of cupy (with SHMPROXY_FAST_BYTES=0 its messages
go through the progress process too): the probe's own check, on a machine without a GPU. ``run
--per-gpu``: rank r's buffers on GPU r (the default: both on the current device, GPU 0).

Each rank stamps CLOCK_MONOTONIC (one clock for every process of the host) around its blocking calls;
the progress process's "msg" spans (engine/completion.py ``_trace_msg``) carry each message's posts,
fetch, match, start (a GPU copy: launched) and retirement on the same clock. Printed, medians and
(p10, p90) over the iterations after the first fifth, in microseconds, for one way:

    later post -> fetch     the second of the pair's two posts until the loop took it off the chain
    fetch -> match          the loop's unpacking and matching
    match -> started        the transport's start (addresses, stream order, the copy's launch)
    started -> returned     until the receiver's blocking Recv returned (the copy, its publication)
    started -> retired      until the loop retired the message
    returned -> next post   the receiver's return until its next Send was posted
    one way                 later post to the next message's later post
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys
import time

from shmproxy.core.params import parse_size


def run(out: str, nbytes: int, iters: int, host: bool, per_gpu: bool) -> None:
    import shmproxy
    with shmproxy.init() as comm:
        if comm.size != 2:
            raise SystemExit("gpu_chain_probe: run it with exactly 2 ranks")
        if host:
            send, recv = comm.alloc(nbytes, "uint8"), comm.alloc(nbytes, "uint8")
        else:
            import cupy as cp
            if per_gpu:
                cp.cuda.Device(comm.rank).use()
            send, recv = cp.ones(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)
            cp.cuda.get_current_stream().synchronize()
        stamps = []
        clock = time.monotonic_ns
        comm.Barrier()
        for _ in range(iters):
            if comm.rank == 0:
                t0 = clock()
                comm.Send(send, 1, 5)
                t1 = clock()
                comm.Recv(recv, 1, 5)
                stamps.append((t0, t1, clock()))    # before the Send, its return, the Recv's return
            else:
                comm.Recv(recv, 0, 5)
                t0 = clock()
                comm.Send(send, 0, 5)
                stamps.append((t0, clock()))        # the Recv's return, the Send's return
        comm.Barrier()
        with open(os.path.join(out, f"rank{comm.rank}.json"), "w") as f:
            json.dump({"nbytes": nbytes, "stamps": stamps}, f)


def _stats(label: str, values: list[int]) -> str:
    v = sorted(values)
    n = len(v)
    return (f"  {label:24s} {statistics.median(v) / 1e3:8.1f}  ({v[n // 10] / 1e3:.1f}, "
            f"{v[9 * n // 10] / 1e3:.1f})")


def analyse(out: str) -> None:
    r0, r1 = (json.load(open(os.path.join(out, f"rank{r}.json"))) for r in (0, 1))
    nbytes = r0["nbytes"]
    spans: dict[str, list[dict]] = {"msg 0->1": [], "msg 1->0": []}
    for path in glob.glob(os.path.join(out, "trace_*.json")):
        for ev in json.load(open(path))["traceEvents"]:
            if ev["name"] in spans and ev["args"].get("bytes") == nbytes:
                spans[ev["name"]].append(ev["args"] | {"end_ns": int((ev["ts"] + ev["dur"]) * 1000)})
    fwd, back = (sorted(spans[k], key=lambda a: a["last_post_ns"]) for k in ("msg 0->1", "msg 1->0"))
    s0, s1 = r0["stamps"], r1["stamps"]
    n = min(len(fwd), len(back), len(s0), len(s1))
    if n < 10:
        raise SystemExit(f"gpu_chain_probe: {n} traced iterations (was the profile on? SHMPROXY_PROFILE=1)")
    cols: dict[str, list[int]] = {}

    def add(label: str, value: int) -> None:
        cols.setdefault(label, []).append(value)

    for i in range(n // 5, n - 1):
        # iteration i: fwd[i] (rank 0's Send, received by rank 1 at s1[i][0]), then back[i] (rank 1's
        # Send, received by rank 0 at s0[i][2]); the next message after back[i] is fwd[i + 1]
        for m, returned, nxt in ((fwd[i], s1[i][0], back[i]), (back[i], s0[i][2], fwd[i + 1])):
            add("later post -> fetch", m["fetch_ns"] - m["last_post_ns"])
            add("fetch -> match", m["match_ns"] - m["fetch_ns"])
            if m["started_ns"]:
                add("match -> started", m["started_ns"] - m["match_ns"])
                add("started -> returned", returned - m["started_ns"])
                add("started -> retired", m["end_ns"] - m["started_ns"])
            add("returned -> next post", nxt["send_post_ns"] - returned)
            add("one way", nxt["last_post_ns"] - m["last_post_ns"])
    print(f"CHAIN {nbytes} B, {n} iterations ({len(cols['one way'])} messages counted), "
          f"medians (p10, p90) us:")
    for label, values in cols.items():
        print(_stats(label, values))


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "run":
        rest = [a for a in argv[2:] if not a.startswith("--")]
        run(argv[1], parse_size(rest[0]) if rest else 64 << 20, int(rest[1]) if len(rest) > 1 else 2000,
            "--host" in argv, "--per-gpu" in argv)
    elif len(argv) == 2 and argv[0] == "analyse":
        analyse(argv[1])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
