"""engine/loopcall.py: another thread's change runs on the loop thread, once, and its answer follows it."""
from __future__ import annotations

import collections
import threading
import time

import pytest

from shmproxy.core import errors
from shmproxy.engine.loopcall import LoopCalls


class _Loop:
    """A loop thread as the engine runs one: it drains posted callables until told to stop."""

    def __init__(self) -> None:
        self.events: collections.deque = collections.deque()
        self.wake = threading.Event()
        self.stop = False
        self.paused = threading.Event()   # set: the loop takes no events (a busy pass)
        self.calls = LoopCalls(self.post, timeout=5.0)
        self.thread = threading.Thread(target=self.run, daemon=True)

    def post(self, fn) -> None:
        self.events.append(fn)
        self.wake.set()

    def run(self) -> None:
        self.calls.started()
        try:
            while not self.stop:
                self.wake.wait(0.01)
                self.wake.clear()
                while self.events and not self.paused.is_set():
                    self.events.popleft()()
        finally:
            self.calls.ended()

    def __enter__(self) -> "_Loop":
        self.thread.start()
        while not self.calls._running:
            time.sleep(0.001)
        return self

    def __exit__(self, *exc) -> None:
        self.stop = True
        self.paused.clear()
        self.thread.join(5)
        assert not self.thread.is_alive()


def test_a_call_runs_on_the_loop_thread_and_returns_its_result():
    with _Loop() as loop:
        got = loop.calls.run(lambda: (threading.get_ident(), 42))
        assert got == (loop.thread.ident, 42)


def test_the_loop_thread_itself_runs_a_call_at_once():
    with _Loop() as loop:
        inner: list = []
        loop.calls.run(lambda: inner.append(loop.calls.run(lambda: threading.get_ident())))
        assert inner == [loop.thread.ident]


def test_an_exception_reaches_the_caller_and_the_loop_goes_on():
    with _Loop() as loop:
        def bad():
            raise errors.InvalidArgument("refused")
        with pytest.raises(errors.InvalidArgument, match="refused"):
            loop.calls.run(bad)
        assert loop.calls.run(lambda: 7) == 7
        assert loop.thread.is_alive()


def test_without_a_loop_a_call_runs_on_the_callers_thread():
    calls = LoopCalls(lambda fn: pytest.fail("nothing should be posted before the loop starts"), 5.0)
    assert calls.run(threading.get_ident) == threading.get_ident()


def test_a_call_the_loop_never_took_runs_once_after_the_loop_ended():
    loop = _Loop().__enter__()
    loop.paused.set()
    ran: list = []
    t = threading.Thread(target=lambda: ran.append(loop.calls.run(threading.get_ident)))
    t.start()
    time.sleep(0.1)
    assert not ran
    loop.stop = True   # the loop ends with the call still queued
    loop.thread.join(5)
    t.join(5)
    assert ran == [t.ident]   # the waiter ran it, the loop (gone) never did
    assert len(loop.events) == 1
    loop.events.popleft()()   # the stale event, run late, is claimed already: a no-op
    assert ran == [t.ident]


def test_a_loop_that_never_answers_is_a_timeout_and_the_call_never_runs_late():
    with _Loop() as loop:
        loop.paused.set()
        ran: list = []
        t0 = time.monotonic()
        with pytest.raises(errors.Timeout):
            loop.calls.run(lambda: ran.append(1), bound_s=0.2)
        assert 0.2 <= time.monotonic() - t0 < 2.0
        loop.paused.clear()
        loop.wake.set()
        assert loop.calls.run(lambda: 2) == 2   # events drained in order: the timed-out one came first
        assert ran == []
