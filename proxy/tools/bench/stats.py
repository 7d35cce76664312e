"""Statistics of the timings (median and p99, bandwidth, the slowest rank), and the steal time of a
virtual machine's host while they were taken (``StealMeter``, from /proc/stat).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np


def summarize(times_s: Sequence[float], divisor: float = 1.0) -> tuple[float, float]:
    """(median, p99) in microseconds of per-iteration times in seconds, each divided by ``divisor``."""
    t = np.asarray(times_s, dtype=np.float64) * (1e6 / divisor)
    if t.size == 0:
        return math.nan, math.nan
    return float(np.median(t)), float(np.percentile(t, 99))


def cpu_ticks() -> tuple[int, int] | None:
    """(steal, all) clock ticks of this host's CPUs since boot, from /proc/stat; None where unknown.
    Steal is the time a virtual CPU was ready to run but the hypervisor ran something else."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest is in user)
    return ticks[7], sum(ticks)


class StealMeter:
    """Steal time during the spans it wraps (``with meter:``), as a percentage of all CPU time in
    them: on a virtual machine, how much of the host the other guests took while we measured."""

    def __init__(self) -> None:
        self.steal = self.total = 0
        self.known = True
        self._start: tuple[int, int] | None = None

    def __enter__(self) -> "StealMeter":
        self._start = cpu_ticks()
        return self

    def __exit__(self, *exc: object) -> None:
        end = cpu_ticks()
        if self._start is None or end is None:
            self.known = False
            return
        self.steal += end[0] - self._start[0]
        self.total += end[1] - self._start[1]

    @property
    def pct(self) -> float | None:
        return 100.0 * self.steal / self.total if self.known and self.total > 0 else None


def steal_note(rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> str:
    """The '#' line on steal time during each library's measurements ('' when the host reports none)."""
    parts = []
    for name in names:
        pcts = [r["results"][name].get("steal_pct") for r in rows]
        pcts = [p for p in pcts if p is not None]
        if pcts:
            parts.append(f"{name} {min(pcts):.1f}-{max(pcts):.1f} %")
    if not parts:
        return ""
    return ("# steal (the hypervisor ran other guests on our CPUs) while each library was measured, over the sizes: "
            + ", ".join(parts))


def gbps(nbytes: int, time_us: float) -> float:
    """GB/s (10**9 bytes per second) for ``nbytes`` in ``time_us`` microseconds."""
    if not time_us > 0:
        return math.nan
    return nbytes / time_us / 1e3


def max_over_ranks(values: Sequence[float]) -> float:
    """The largest non-NaN value (NaN marks a rank that did not take part); NaN if none took part."""
    v = [x for x in values if not math.isnan(x)]
    return max(v) if v else math.nan
