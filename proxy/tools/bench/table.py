"""The printed table (nccl-tests style): one library's figures at one size reduced over the
ranks (the slowest rank's), the ratios to shmproxy, and the header, row and note lines.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from shmproxy.tools.bench.operation import Operation
from shmproxy.tools.bench.stats import gbps, max_over_ranks


def reduce_result(op: Operation, per_rank: np.ndarray, nbytes: int, nranks: int,
                  checked: bool) -> dict[str, Any]:
    """One library's figures at one size from the gathered per-rank matrix.

    ``per_rank`` has one row per rank: ``op.fields`` then check (1/0)."""
    nf = len(op.fields)
    res: dict[str, Any] = {k: max_over_ranks(per_rank[:, i].tolist()) for i, k in enumerate(op.fields)}
    res["ranks"] = {k: [None if math.isnan(v) else v for v in per_rank[:, i].tolist()]
                    for i, k in enumerate(op.fields)}
    if "time_us" in res and op.sized:
        res["algbw_GBps"] = gbps(nbytes, res["time_us"])
        res["busbw_GBps"] = res["algbw_GBps"] * op.bus_factor(nranks)
    if op.derive is not None:
        op.derive(res, per_rank[:, :nf])
    res["check"] = ("ok" if per_rank[:, nf].min() == 1.0 else "FAIL") if checked else "skipped"
    return res


# shmproxy's own rows: the ratios compare the peers with the first (the buffers users have)
OWN_ROWS = ("shmproxy", "shmproxy:alloc")


def ratios(op: Operation, results: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """peer figure / shmproxy figure of ``op.ratio_key`` for each peer (time: > 1 = shmproxy faster)."""
    if op.ratio_key is None:
        return {}
    base = results["shmproxy"].get(op.ratio_key, math.nan)
    out: dict[str, float | None] = {}
    for lib, r in results.items():
        if lib in OWN_ROWS:
            continue
        v = r.get(op.ratio_key, math.nan)
        out[lib] = v / base if base > 0 and v > 0 else None
    return out


LEAD = (("size", "(B)", 12), ("count", "(elems)", 11), ("type", "", 8))
COL_W = 9
RATIO_W = 11


def format_value(v: Any) -> str:
    """Numbers for the table: '-' for missing, fewer decimals as they grow."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, (str, int, np.integer)):
        return str(v)
    a = abs(v)
    if a >= 1e5:
        return f"{v:.0f}"
    if a >= 1e3:
        return f"{v:.1f}"
    return f"{v:.2f}"


def ratio_width(peer: str) -> int:
    """The width of the ratio column against ``peer``: its title ('vs <peer>') never runs into the last."""
    return max(RATIO_W, len(peer) + 4)


def format_header(op: Operation, libs: Sequence[str]) -> list[str]:
    """The table's header (three '#' lines, nccl-tests style)."""
    lead_w = sum(w for _, _, w in LEAD)
    group_w = COL_W * len(op.columns)
    peers = [lib for lib in libs if lib not in OWN_ROWS] if op.ratio_key else []
    l1 = "#" + " " * (lead_w - 1) + "".join(f"{lib:>{group_w}}" for lib in libs)
    l2 = "".join(f"{t:>{w}}" for t, _, w in LEAD)
    l3 = "".join(f"{u:>{w}}" for _, u, w in LEAD)
    for _ in libs:
        l2 += "".join(f"{c.title:>{COL_W}}" for c in op.columns)
        l3 += "".join(f"{'(' + c.unit + ')':>{COL_W}}" for c in op.columns)
    for p in peers:
        l2 += f"{'vs ' + p:>{ratio_width(p)}}"
        l3 += f"{'(ratio)':>{ratio_width(p)}}"
    l2 += "  check"
    return [l1, "#" + l2[1:], "#" + l3[1:]]


def format_row(op: Operation, row: Mapping[str, Any], libs: Sequence[str]) -> str:
    cells = [row["bytes"], row["count"], row["dtype"]]
    line = "".join(f"{format_value(v):>{w}}" for v, (_, _, w) in zip(cells, LEAD))
    for lib in libs:
        r = row["results"][lib]
        line += "".join(f"{format_value(r.get(c.key)):>{COL_W}}" for c in op.columns)
    if op.ratio_key:
        for lib in libs:
            if lib not in OWN_ROWS:
                line += f"{format_value(row['ratio'].get(lib)):>{ratio_width(lib)}}"
    return line + "  " + check_word(row["results"])


def ratio_note(op: Operation) -> str:
    if op.ratio_key is None:
        return ""
    if op.ratio_key == "time_us":
        return ("# ratio = peer time / shmproxy time (= shmproxy bandwidth / peer bandwidth);"
                " > 1: shmproxy is faster")
    title = next(c.title for c in op.columns if c.key == op.ratio_key)
    return f"# ratio = peer {title} time / shmproxy {title} time; > 1: shmproxy is cheaper"


def check_word(results: Mapping[str, Mapping[str, Any]]) -> str:
    """'ok', '-' (nothing checked), or 'FAIL:<libraries>' for one row."""
    failed = [lib for lib, r in results.items() if r.get("check") == "FAIL"]
    if failed:
        return "FAIL:" + ",".join(failed)
    if all(r.get("check") == "skipped" for r in results.values()):
        return "-"
    return "ok"
