"""Progress-process event recorder, exported as a Chrome trace (chrome://tracing, Perfetto).

Records idle/active transitions, sleeps and wake-ups on the condvar, fetch/append counts and per-op
timestamps (post by the rank, fetch, match, done). Off by default (SHMPROXY_PROFILE=1); when off,
``enabled`` is False and callers skip the call entirely, so the hot path pays one attribute test.
Bounded: the newest MAX_EVENTS are kept.
"""
from __future__ import annotations

import collections
import json
import os
import time

MAX_EVENTS = 200_000


class Profiler:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.events: collections.deque = collections.deque(maxlen=MAX_EVENTS)
        self.pid = os.getpid()

    def instant(self, name: str, **args: object) -> None:
        self.events.append(("i", name, time.monotonic_ns(), 0, args))

    def span(self, name: str, start_ns: int, end_ns: int, **args: object) -> None:
        self.events.append(("X", name, start_ns, end_ns - start_ns, args))

    def to_chrome_trace(self) -> dict:
        out = []
        for ph, name, ts, dur, args in self.events:
            ev = {"name": name, "ph": ph, "ts": ts / 1000.0, "pid": self.pid, "tid": 0, "args": args}
            if ph == "X":
                ev["dur"] = dur / 1000.0
            else:
                ev["s"] = "p"
            out.append(ev)
        return {"traceEvents": out, "displayTimeUnit": "ns"}

    def write(self, path: str) -> None:
        path = path.replace("%p", str(self.pid))
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_chrome_trace(), f)
        os.replace(tmp, path)
