"""The whole benchmark on one rank (``run``): open the peers, print the header, sweep the sizes with
every library in turn, gather the ranks' figures on rank 0, print one row per size, write the JSON.

How a figure is made
--------------------
- Sizes go from ``-b`` to ``-e``, multiplying by ``-f``, and always end at ``-e`` (nccl-tests stops
  at the last power below it: ``-b 8 -e 64M -f 8`` would never measure 64 MiB). A size becomes
  ``max(1, size // itemsize)`` elements; the table shows the bytes actually moved.
- For each size, shmproxy runs first and then each peer, so that slow drift of the machine (another
  job, thermal, page cache) hits every library alike. On a noisy virtual machine the drift is faster
  than one library's measurement: ``--rounds R`` (timed sweeps: pingpong, sendrecv, the collectives)
  splits each library's ``-n`` iterations into R slices run in turn (shmproxy, peers, shmproxy, ...;
  each slice after its own warm-up and barrier) and pools their times before the median is taken.
- Where /proc/stat reports it, the steal time during each library's measurement (the share of CPU time
  the hypervisor gave to other guests while our vCPUs were ready to run) is kept in the JSON
  (``steal_pct``, per size and library) and summarized under the table: figures taken under steal
  are about the neighbours as much as about the libraries.
- Each library gets its buffers once, at the largest size, and each size uses a prefix of them. The
  peers use plain numpy arrays, and so does the row "shmproxy", the one the ratios compare with: the
  buffers users have. On host buffers a second row, "shmproxy:alloc", measures memory from
  ``comm.alloc`` (the zero-copy path); ``--alloc`` keeps only that (as the row "shmproxy"),
  ``--no-alloc`` only the plain arrays.
- A measurement is: a barrier, ``-w`` warm-up iterations, the receive buffer filled with a sentinel, a
  barrier, then ``-n`` iterations each timed alone with ``time.perf_counter``. A rank's figure is the
  median over its iterations (and the 99th percentile: with few iterations that is nearly the maximum);
  the reported figure is the maximum over the ranks of these medians. The ranks' figures travel to rank
  0 through shmproxy itself (Send/Recv of a float64 array), as does every barrier.
- Defaults adapt to the size (``default_iters``): many iterations for small messages, few for large
  ones, so that a sweep to 64 MiB takes well under a minute on 2 cores.
- pingpong: one iteration is a round trip between ranks 0 and 1 (other ranks idle); time = half of it
  (one-way latency); bandwidth = bytes / one-way time. sendrecv: each rank Isends to its right and
  Irecvs from its left, then Waitall; algbw = bytes / time, busbw = algbw.
- ratio = peer time / shmproxy time, which is also shmproxy bandwidth / peer bandwidth: above 1,
  shmproxy is faster.
- After the timed loop, every received buffer is compared with the pattern its sender wrote (unless
  ``--no-check``); the exit status is 1 on every rank if any check failed anywhere, 2 for a usage
  error.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

import numpy as np

from shmproxy.tools.bench import rawsock
from shmproxy.tools.bench.libraries import RAW_PEERS, Library, ShmproxyLib
from shmproxy.tools.bench import device as bench_device
from shmproxy.tools.bench.measure import IDLE_SETTLE_S, RAW_TIMES, _finish_check, measure_idle, measure_post
from shmproxy.tools.bench.operation import Ctx, Operation, row_size
from shmproxy.tools.bench.overlap import measure_overlap
from shmproxy.tools.bench.peers import open_gloo, open_mpi, open_mpi_layer, open_nccl, peer_unsupported, probe
from shmproxy.tools.bench.progress_bar import Progress
from shmproxy.tools.bench.report import _write_json, build_report, collect_environment, plot_report
from shmproxy.tools.bench.sizes import default_iters, default_warmup
from shmproxy.tools.bench.stats import StealMeter, steal_note, summarize
from shmproxy.tools.bench.table import format_header, format_row, ratio_note, ratios, reduce_result
from shmproxy.tools.bench.traffic import agree, bcast, gather


def op_notes(op: Operation, args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """The '#' lines that say how a collective or the overlap is measured."""
    if not op.probe:
        return []
    out = []
    what = [f"reduction {args.redop}"] if op.reduces else []
    what += [f"root {op.root}"] if op.root is not None else []
    what += ["in place" if args.in_place else "out of place"] if op.in_place_ok else []
    if op.sized:
        out.append(f"# {op.name}: {', '.join(what + [''])}size = max(send, recv) bytes of one rank, "
                   f"count = the call's count argument (nccl-tests); busbw = algbw x {op.bus_note}")
    else:
        out.append(f"# {op.name}: no data; time only")
    native = [lib for lib in names if lib in op.native_in_place]
    if native:
        out.append(f"# {', '.join(native)}: the call works in place on the receive tensor (no copy timed);"
                   f" its checked call gets the input copied in first")
    if op.measure is measure_overlap:
        out.append("# overlap (OSU osu_iallreduce): t_comm = Iallreduce+Wait alone; t_total = post, pure-Python"
                   " work for t_comm of wall time, Wait; t_comp = that work's time; post, wait = the two"
                   " calls' own times in it (t_total - t_comp = post + wait); a barrier after every iteration;"
                   " means over iterations and ranks; overlap = 100*max(0, 1-(t_total-t_comp)/t_comm)")
    out.append("# checked: one more call after the timed ones, against the expected result"
               + (" (off: --no-check)" if not args.check else ""))
    return out


SAY_BUFFERS = {
    "plain+alloc": "plain numpy arrays as the peers' (shmproxy; the ratios) and comm.alloc memory (shmproxy:alloc, "
                   "zero-copy)",
    "plain": "plain numpy arrays, as the peers'",
    "alloc": "comm.alloc (zero-copy)",
}


def shmproxy_rows(comm: Any, alloc: bool | None, one: bool) -> list[Library]:
    """shmproxy's rows: plain arrays and comm.alloc memory (``alloc`` None), or the one asked for;
    one row where buffers do not matter (``one``: device buffers, the idle measurement)."""
    if alloc is None and not one:
        return [ShmproxyLib(comm, False), ShmproxyLib(comm, True, ShmproxyLib.ALLOC_ROW)]
    return [ShmproxyLib(comm, bool(alloc) if alloc is not None else False)]


def buffers_of(alloc: bool | None) -> str:
    return {None: "plain+alloc", True: "alloc", False: "plain"}[alloc]


def run_config(ctx: Ctx, op: Operation, sizes: list[int], dtype: np.dtype) -> dict[str, Any]:
    args = ctx.args
    return {"sizes": sizes, "dtype": dtype.name, "iters": args.iters, "warmup": args.warmup_iters,
            "rounds": args.rounds,
            "shmproxy_buffers": buffers_of(args.alloc), "check": args.check, "peers": list(args.peers),
            "group_size": args.group_size, "idle_seconds": args.idle_seconds,
            "redop": args.redop if op.reduces else None, "in_place": bool(args.in_place), "root": op.root,
            "inject_error": args.inject_error}


def run(ctx: Ctx, op: Operation, sizes: list[int], dtype: np.dtype) -> int:
    """The whole benchmark on one rank; returns the exit status (the same on every rank)."""
    comm, args, is_root = ctx.comm, ctx.args, ctx.rank == 0
    say = (lambda *a: print(*a, flush=True)) if is_root else (lambda *a: None)
    pids = gather(comm, [os.getpid()])
    ctx.pids = [] if pids is None else [int(p) for p in pids[:, 0]]

    on_gpu = getattr(args, "device", "host") == "cuda"
    libs: list[Library] = shmproxy_rows(comm, args.alloc, on_gpu or op.measure is measure_idle)
    skipped: dict[str, str] = {}
    if on_gpu:
        gpu = bench_device.local_gpu(ctx)
        bench_device.enable(libs[0], gpu)
    for name in args.peers:
        why = bench_device.peer_unsupported(name, op.name) if on_gpu else bench_device.host_unsupported(name)
        if why:
            skipped[name] = why
            say(f"# {name} skipped: {why}")
            continue
        if name in RAW_PEERS:
            why = rawsock.unsupported(name, op.name)
            if why:
                skipped[name] = why
                say(f"# {name} skipped: {why}")
                continue
            lib, why = rawsock.open_tcp(ctx, name)
        else:
            opener = {"mpi4py": open_mpi, "shmproxy.MPI": open_mpi_layer, "nccl": open_nccl}.get(name, open_gloo)
            lib, why = opener(ctx)
        if lib is not None and on_gpu:
            bench_device.enable(lib, gpu)
        if not agree(comm, lib is not None):
            if lib is not None:
                lib.close()
            lib, why = None, why or "not available on every rank"
        if lib is not None and op.probe:             # can it do this operation as asked?
            why = peer_unsupported(op, lib, args)
            if not agree(comm, not why):
                why = why or "unsupported on another rank"
            elif not agree(comm, not (why := probe(ctx, op, lib, dtype))):
                why = f"a first {op.name} call failed: {why or 'on another rank'}"
            if why:
                lib.close()
                lib = None
        if lib is None:
            skipped[name] = why
            say(f"# {name} skipped: {why}")
        else:
            libs.append(lib)
    names = [lib.name for lib in libs]

    env = collect_environment(ctx, libs) if is_root else {}
    say(f"# shmproxy-bench {op.name}: {op.summary}")
    say(f"# {ctx.size} ranks on {env.get('host')} ({env.get('nproc')} CPUs; rank CPUs "
        f"{' | '.join(map(str, env.get('rank_affinity', [])))}, progress process CPUs "
        f"{env.get('proxy_affinity')}); "
        + ", ".join(f"{lib.name} {lib.version}" for lib in libs))
    if op.measure is measure_idle:
        say(f"# window {args.idle_seconds:g} s after {IDLE_SETTLE_S:g} s to settle; proxy = the progress"
            f" process (% of one core, voluntary wake-ups/s), waiting = the busiest rank blocked in recv")
    elif on_gpu:
        say(f"# device buffers on {bench_device.placement(ctx)} (cupy arrays for shmproxy, torch CUDA "
            f"tensors for gloo and nccl); time = median over iterations, max over ranks; p99 likewise")
        note = bench_device.nccl_note(ctx, args.peers)
        if note:
            say(note)
    else:
        say(f"# shmproxy buffers: {SAY_BUFFERS[buffers_of(args.alloc)]};"
            f" time = median over iterations, max over ranks; p99 likewise"
            + (f"; group = {args.group_size} posts" if op.measure is measure_post else ""))
    for line in op_notes(op, args, names):
        say(line)
    if args.rounds > 1:
        say(f"# rounds: each library's iterations ran as {args.rounds} interleaved slices ({' -> '.join(names)},"
            f" then again), each after its warm-up; the times of all slices are pooled")
    if ratio_note(op):
        say(ratio_note(op))
    for line in format_header(op, names):
        say(line)

    in_place = bool(args.in_place)
    shapes = [row_size(op, nbytes, ctx.size, in_place, dtype.itemsize) for nbytes in sizes]
    max_send, max_recv = max(sh[0] for sh in shapes), max(sh[1] for sh in shapes)
    recv_shape = (args.group_size, max_recv) if op.group_recv else max_recv
    bufs = {lib.name: (lib.array(max_send, dtype), lib.array(recv_shape, dtype)) for lib in libs}
    rows: list[dict[str, Any]] = []
    nf = len(op.fields)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    bar = Progress(len(shapes), op.name, enabled=bool(is_root and show))
    raw = RAW_TIMES.get(op.measure)
    for n_send, n_recv, count, nbytes in shapes:
        bar.step(f"{nbytes} B")
        iters = args.iters if args.iters is not None else default_iters(nbytes)
        warmup = args.warmup_iters if args.warmup_iters is not None else default_warmup(iters)
        if raw is not None:
            per_round = -(-iters // args.rounds)
            iters = per_round * args.rounds
        figures: dict[str, list[float]] = {}
        times: dict[str, list[float]] = {name: [] for name in names}
        checks = dict.fromkeys(names, 1.0)
        steal = {name: StealMeter() for name in names}
        for _ in range(args.rounds):
            for lib in libs:
                send_full, recv_full = bufs[lib.name]
                send, recv = send_full[:n_send], recv_full[..., :n_recv]
                np.copyto(send, op.fill(ctx.rank, n_send, dtype, args.redop))
                with steal[lib.name]:
                    if raw is None:
                        figures[lib.name] = op.measure(ctx, op, lib, send, recv, iters, warmup)
                    else:
                        times[lib.name] += raw(ctx, op, lib, send, recv, per_round, warmup)
                checks[lib.name] = min(checks[lib.name], _finish_check(ctx, op, lib, recv, count))
        mine: list[float] = []
        for name in names:
            mine += [*(figures[name] if raw is None else summarize(times[name], op.time_divisor)), checks[name]]
        table = gather(comm, mine)
        if table is None:
            continue
        results = {lib: reduce_result(op, table[:, i * (nf + 1):(i + 1) * (nf + 1)], nbytes, ctx.size,
                                      args.check)
                   for i, lib in enumerate(names)}
        for name in names:
            results[name]["steal_pct"] = steal[name].pct
        row = {"bytes": nbytes, "count": count, "dtype": dtype.name, "iters": iters,
               "warmup": warmup, "results": results, "ratio": ratios(op, results)}
        rows.append(row)
        say(format_row(op, row, names))
        if args.json:                                 # after every row: a run cut short keeps its rows
            _write_json(args.json, build_report(op, rows, names, skipped, run_config(ctx, op, sizes, dtype),
                                                env, complete=False))

    bar.close()
    status = 0.0
    if is_root:
        note = steal_note(rows, names)
        if note:
            say(note)
        report = build_report(op, rows, names, skipped, run_config(ctx, op, sizes, dtype), env)
        failed = sum(1 for row in rows for r in row["results"].values() if r["check"] == "FAIL")
        say("# checks: " + ("not run (--no-check)" if not args.check else
                            f"{failed} FAILED" if failed else "all passed"))
        if args.json:
            _write_json(args.json, report)
            say(f"# JSON written to {args.json}")
        if args.plot:
            say(plot_report(report, args.plot))
        status = 1.0 if failed else 0.0
    status = bcast(comm, [status] if is_root else None, 1)[0]
    for lib in libs[1:]:
        lib.close()
    return int(status)
