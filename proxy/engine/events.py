"""News from the progress process's other threads, run by the loop: LoopEvents (``engine.events``).

The loop thread owns the engine's state (engine/state.py). Another thread of the process (the service
thread, a transport's helper threads) that has news posts a callable (``post``), which the loop runs
on its own thread at its next pass; C threads of a transport queue their news in C and bump the
pool's EVENTS word, and the loop runs the polls registered with ``on_events`` every time the word
moved. ``seen`` is the EVENTS count the loop has handled: the fetcher's sleeps and watches end when
the word differs from it, so a post cannot be lost between a look and a sleep
(_native.post_event against sleep_unless_posted), and ranks never pay for it.
"""
from __future__ import annotations

import collections
from typing import Callable

from shmproxy.core import log
from shmproxy.shm import _native, pool as P, sync

_log = log.get("PROXY")
EVENTS_Q = P.CTRL_OFF // 8 + P.CTRL_EVENTS


class LoopEvents:
    def __init__(self, q: memoryview, seg_addr: int, timeout: float) -> None:
        self.q, self.seg_addr, self.timeout = q, seg_addr, timeout
        self.queue: collections.deque[Callable[[], None]] = collections.deque()
        self.polls: list[Callable[[], None]] = []   # run after the events (on_events)
        self.seen = 0
        self.addr = seg_addr + 8 * EVENTS_Q   # the EVENTS word

    def post(self, fn: Callable[[], None]) -> None:
        """Any thread of this process: have the loop run ``fn`` soon, on its own thread, waking it if it
        sleeps."""
        self.queue.append(fn)
        rc = _native.post_event(self.seg_addr, self.timeout)
        if rc == sync.TIMEDOUT:
            _log.warning("pool mutex not acquired within %.1f s to wake the loop; it wakes at its bound",
                         self.timeout)

    def on_events(self, fn: Callable[[], None]) -> None:
        """Have the loop run ``fn`` after the posted events, every time news came: C threads of a
        transport queue their news in C and bump EVENTS (shm/_wire.c); ``fn`` collects it."""
        self.polls.append(fn)

    def run(self) -> None:
        """Loop thread: run what other threads posted, oldest first, then the polls of on_events."""
        self.seen = self.q[EVENTS_Q]   # read before draining: a later post is seen next time
        queue = self.queue
        while queue:
            queue.popleft()()
        for poll in self.polls:
            poll()
