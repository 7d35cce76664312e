"""Running another thread's change of engine state on the loop thread, and waiting for its answer.

The loop thread owns the engine's state: the rank table, the registered buffers, the connections,
the datatypes, the matching. The service thread (proxy/control/handler.py) answers the ranks'
requests, and what a request changes must be in place before its answer leaves (a rank posts ops
naming a buffer as soon as REGISTER answers), so it cannot merely post the change (post_event) and
reply: the loop could fetch the rank's next op before it ran the event. ``LoopCalls.run(fn)`` posts
``fn``, waits for the loop to run it and hands back its result or exception, so every write of engine
state happens on one thread, and the reply still follows the change.

Whoever runs a call claims it first, under its lock: the loop (the posted event) or, once the loop has
ended (a failure, or every rank closed; the service still answers ranks that are joining while the
process lingers), the waiting thread itself. So a call runs exactly once, and when the loop is gone
nothing runs beside it. Before the loop starts (``started`` not yet called) a call runs at once on
the caller's thread: nothing else runs engine code then. The wait has a bound (TIMEOUT): a loop
that does not answer in it is a failure, and the call, claimed back, never runs late.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Generic, TypeVar

from shmproxy.core import errors

T = TypeVar("T")
SLICE_S = 0.05   # how often a waiting thread looks whether the loop has ended


class _Call(Generic[T]):
    __slots__ = ("fn", "lock", "claimed", "done", "result", "exc")

    def __init__(self, fn: Callable[[], T]):
        self.fn = fn
        self.lock = threading.Lock()
        self.claimed = False
        self.done = threading.Event()
        self.result: T | None = None
        self.exc: BaseException | None = None

    def claim(self) -> bool:
        with self.lock:
            if self.claimed:
                return False
            self.claimed = True
            return True

    def run(self) -> None:
        """The loop's event, or the waiter once the loop is gone: run ``fn`` unless claimed already."""
        if not self.claim():
            return
        try:
            self.result = self.fn()
        except BaseException as exc:   # handed to the waiting thread, which raises it (never lost)
            self.exc = exc
        finally:
            self.done.set()


class LoopCalls:
    """The engine's one way for another thread to change its state (see the module header)."""

    def __init__(self, post_event: Callable[[Callable[[], None]], None], timeout: float):
        self._post = post_event
        self._timeout = timeout
        self._loop: int | None = None    # the loop thread's ident while it runs
        self._running = False

    def started(self) -> None:
        """The loop thread, before its first pass: calls go to it from now on."""
        self._loop = threading.get_ident()
        self._running = True

    def ended(self) -> None:
        """The loop has returned (or never will run): waiting calls run on their own threads."""
        self._running = False

    def run(self, fn: Callable[[], T], bound_s: float | None = None) -> T:
        """Run ``fn`` on the loop thread and return its result (or raise its exception); at once when
        called on the loop thread itself or when no loop runs. Raises Timeout after ``bound_s``
        (TIMEOUT when None) if the loop has not started it."""
        if not self._running or threading.get_ident() == self._loop:
            return fn()
        call = _Call(fn)
        self._post(call.run)
        bound = self._timeout if bound_s is None else bound_s
        deadline = time.monotonic() + bound
        while not call.done.wait(SLICE_S):
            if not self._running:
                call.run()   # the loop ended before it took the call (a no-op if it did take it)
            elif time.monotonic() >= deadline and call.claim():
                raise errors.Timeout(f"the progress loop did not take a request within {bound:.1f} s")
        if call.exc is not None:
            raise call.exc
        return call.result   # type: ignore[return-value]  # set by fn when it did not raise
