"""The report of a run: the JSON document (build, validate, dump, write whole), the plot, and the
environment the figures were taken in.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import socket
import sys
from typing import Any, Mapping, Sequence

import numpy as np

from shmproxy.tools.bench.libraries import Library
from shmproxy.tools.bench.operation import Ctx, Operation
from shmproxy.tools.bench.table import ratio_note

SCHEMA = "shmproxy-bench/1"


REPORT_KEYS: dict[str, type | tuple[type, ...]] = {
    "schema": str, "op": str, "summary": str, "ok": bool, "libraries": list, "skipped": dict,
    "config": dict, "environment": dict, "columns": list, "results": list,
}
ROW_KEYS: dict[str, type | tuple[type, ...]] = {
    "bytes": int, "count": int, "dtype": str, "iters": int, "warmup": int, "results": dict, "ratio": dict,
}
ENV_KEYS = ("host", "nproc", "ranks", "python", "numpy", "shmproxy", "mpi4py", "torch", "params", "date",
            "command")


def build_report(op: Operation, rows: list[dict[str, Any]], libs: Sequence[str], skipped: Mapping[str, str],
                 config: Mapping[str, Any], environment: Mapping[str, Any],
                 complete: bool = True) -> dict[str, Any]:
    """``complete`` is False in the copies written after each row (a run that was cut short)."""
    return {
        "schema": SCHEMA, "op": op.name, "summary": op.summary, "complete": complete,
        "ok": all(r.get("check") != "FAIL" for row in rows for r in row["results"].values()),
        "libraries": list(libs), "skipped": dict(skipped), "config": dict(config),
        "environment": dict(environment),
        "columns": [dataclasses.asdict(c) for c in op.columns],
        "ratio": ratio_note(op).lstrip("# "),
        "bus_factor": op.bus_note,
        "size": ("max(send, recv) bytes of one rank; count = the call's count argument (nccl-tests)"
                 if op.probe and op.sized else "bytes of one message" if op.sized else "none"),
        "results": rows,
    }


def validate_report(report: Mapping[str, Any]) -> list[str]:
    """What is wrong with a report (empty when it follows the schema)."""
    problems = []
    for key, typ in REPORT_KEYS.items():
        if not isinstance(report.get(key), typ):
            problems.append(f"{key}: expected {typ}, got {type(report.get(key)).__name__}")
    if problems:
        return problems
    if report["schema"] != SCHEMA:
        problems.append(f"schema {report['schema']!r} is not {SCHEMA!r}")
    if "shmproxy" not in report["libraries"]:
        problems.append("libraries lacks shmproxy")
    for key in ENV_KEYS:
        if key not in report["environment"]:
            problems.append(f"environment lacks {key}")
    fields = [c["key"] for c in report["columns"]]
    for i, row in enumerate(report["results"]):
        for key, typ in ROW_KEYS.items():
            if not isinstance(row.get(key), typ):
                problems.append(f"results[{i}].{key}: expected {typ}, got {type(row.get(key)).__name__}")
        for lib in report["libraries"]:
            r = row.get("results", {}).get(lib)
            if not isinstance(r, dict):
                problems.append(f"results[{i}] lacks {lib}")
                continue
            if r.get("check") not in ("ok", "FAIL", "skipped"):
                problems.append(f"results[{i}].{lib}.check is {r.get('check')!r}")
            for f in fields:
                if f not in r:
                    problems.append(f"results[{i}].{lib} lacks {f}")
    return problems


def _json_safe(obj: Any) -> Any:
    """NaN/inf -> None (strict JSON), numpy scalars -> Python numbers."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def dumps_report(report: Mapping[str, Any]) -> str:
    return json.dumps(_json_safe(report), indent=2, allow_nan=False) + "\n"


def plot_report(report: Mapping[str, Any], path: str) -> str:
    """Latency and bandwidth against size, one line per library; returns a line saying what happened."""
    sized = any(row["bytes"] for row in report["results"])
    if "time_us" not in [c["key"] for c in report["columns"]] or not sized:
        return (f"--plot: nothing to plot for {report['op']} (only size sweeps such as pingpong, sendrecv, "
                f"allreduce)")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot: matplotlib is not installed (pip install 'shmproxy[bench]'); no plot written"
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = [row["bytes"] for row in report["results"]]
    for lib in report["libraries"]:
        t = [row["results"][lib].get("time_us") for row in report["results"]]
        b = [row["results"][lib].get("busbw_GBps") for row in report["results"]]
        ax_t.plot(sizes, [math.nan if v is None else v for v in t], marker="o", label=lib)
        ax_b.plot(sizes, [math.nan if v is None else v for v in b], marker="o", label=lib)
    for ax, what in ((ax_t, "time (us)"), (ax_b, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (B)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    env = report["environment"]
    fig.suptitle(f"shmproxy-bench {report['op']}: {env.get('ranks')} ranks on {env.get('host')} "
                 f"({env.get('nproc')} CPUs), {env.get('date', '')[:19]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"# plot written to {path}"


def _write_json(path: str, report: Mapping[str, Any]) -> None:
    """Write whole or not at all: a reader (or a kill) never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(dumps_report(report))
    os.replace(tmp, path)


def _module_version(name: str) -> str | None:
    mod = sys.modules.get(name)
    if mod is None:
        try:
            from importlib.metadata import version
            return version(name)
        except Exception:                              # not installed: say so in the report
            return None
    return getattr(mod, "__version__", None)


def collect_environment(ctx: Ctx, libs: Sequence[Library]) -> dict[str, Any]:
    """Where and how the figures were taken (rank 0; reads the other ranks' affinity by pid)."""
    import shmproxy
    from shmproxy.engine.affinity import format_cpu_list
    from shmproxy.control.bootstrap import detect

    def affinity(pid: int) -> str | None:
        try:
            return format_cpu_list(os.sched_getaffinity(pid))
        except OSError:
            return None
    return {
        "host": socket.gethostname(), "nproc": os.cpu_count(), "ranks": ctx.size,
        "launcher": detect().launcher,
        "rank_pids": ctx.pids, "rank_affinity": [affinity(p) for p in ctx.pids],
        "proxy_pid": ctx.comm._proxy.pid, "proxy_affinity": affinity(ctx.comm._proxy.pid),
        "python": sys.version, "platform": platform.platform(), "numpy": np.__version__,
        "shmproxy": shmproxy.__version__, "mpi4py": _module_version("mpi4py"), "torch": _module_version("torch"),
        "libraries": {lib.name: lib.version for lib in libs},
        "params": ctx.comm.params.as_dict(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": list(getattr(sys, "orig_argv", sys.argv)),
    }
