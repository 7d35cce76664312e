"""MPI.Grequest: generalized requests, operations the program runs itself and completes with Complete.

``MPI.Grequest.Start(query_fn, free_fn, cancel_fn, args, kwargs)`` makes an active request that no
runtime operation stands behind: it completes when the program calls ``Complete()``, typically from
a thread of its own that does the work. Its state (``GState``) sits where a native request sits in
an MPI.Request (``_r``), with the same three calls a native request has (``Test``, ``Wait``,
``describe``), so Waitall, Testall, Waitany and the rest take Grequests mixed with the layer's other
requests (request.py).

Waiting: a Wait sleeps on one condition variable that every Complete notifies, so a completion from
another thread ends it at once; the sleep is cut into slices (SHMPROXY_WAIT_SLICE_MS, as native
waits) only to look at COMM_WORLD's failure state between them (an abort or a dead peer is an error
here too, never a hang), and the whole wait is bounded by COMM_WORLD's timeout (SHMPROXY_TIMEOUT),
raising shmproxy.Timeout as every other wait. Nothing polls: without a Complete, a waiter wakes
once per slice.

The callbacks are mpi4py's: ``query_fn(status, *args, **kwargs)`` fills the status of a completed
request (a fresh one says ANY_SOURCE, ANY_TAG, no bytes, not cancelled, which is what a request
without query_fn reports); ``free_fn(*args, **kwargs)`` runs once when the request is freed: by the
Wait or Test that completes it, or by Free (at Complete if Free came first);
``cancel_fn(completed, *args, **kwargs)`` runs on each Cancel. An exception a callback raises is
printed and raised as an MPI.Exception of its class (callbacks.py): from the Wait or Test that ran
query_fn and free_fn (both run, the request ends either way), from Cancel, from Free. mpi4py's
lower-case ``complete(obj)`` completes with an object that ``wait()``/``test()`` return.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from shmproxy.core import errors
from shmproxy.mpi import callbacks
from shmproxy.mpi.exceptions import ERR_REQUEST, convert, error
from shmproxy.mpi.request import Request
from shmproxy.mpi.status import Status

# one condition for every generalized request: Complete is rare, and one condition lets a Waitany
# over several Grequests sleep until any of them completes
_CV = threading.Condition()
_DEFAULT_SLICE_S = 0.2


class GState:
    """One generalized request, shared by every handle of it (``MPI.Grequest(greq)``)."""

    __slots__ = ("query_fn", "free_fn", "cancel_fn", "args", "kwargs", "done", "result", "_status",
                 "_finished", "_free_pending")

    def __init__(self, query_fn: Callable[..., Any] | None, free_fn: Callable[..., Any] | None,
                 cancel_fn: Callable[..., Any] | None, args: tuple, kwargs: dict):
        for what, fn in (("query_fn", query_fn), ("free_fn", free_fn), ("cancel_fn", cancel_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"Grequest.Start: {what} must be callable or None, not {type(fn).__name__}")
        self.query_fn, self.free_fn, self.cancel_fn = query_fn, free_fn, cancel_fn
        self.args, self.kwargs = args, kwargs
        self.done = False
        self.result: Any = None
        self._status: Status | None = None
        self._finished = False        # query_fn and free_fn have run
        self._free_pending = False    # Free came before Complete: free_fn runs at Complete

    # ---- what a native request offers (request.py's helpers call these)
    def Test(self) -> bool:
        """Whether Complete was called (no callback runs)."""
        return self.done

    def Wait(self, timeout: float | None = None) -> None:
        """Until Complete is called (no callback runs); bounded and failure-aware (module header)."""
        if self.done:
            return
        wait_any([self], timeout)

    def describe(self) -> str:
        return "a generalized request (MPI.Grequest) not Completed yet"

    @property
    def status(self) -> Status:
        """The completed request's status, for a plain MPI.Request handle of it: ends it as Wait does."""
        return self.finish()

    # ---- generalized-request semantics
    def complete(self, result: Any = None) -> None:
        with _CV:
            if self.done:
                raise error(ERR_REQUEST, "Grequest.Complete: the request is already complete")
            self.done, self.result = True, result
            _CV.notify_all()
        if self._free_pending:
            self._free_pending = False
            self._run_free("Grequest.Complete")

    def query(self, what: str) -> Status:
        """A status filled by query_fn (MPI_Request_get_status and the end of Wait/Test)."""
        st = Status()
        if self.query_fn is not None:
            try:
                self.query_fn(st, *self.args, **self.kwargs)
            except BaseException as exc:    # noqa: BLE001 - reported as MPI reports a callback's error
                callbacks.report(exc)
                raise callbacks.failed(f"{what}: query_fn", exc) from exc
        return st

    def finish(self, what: str = "Request.Wait") -> Status:
        """Once, for the Wait or Test that ends the request: query_fn, then free_fn even if query_fn
        raised (the request is freed either way), then the first error, if any."""
        if self._finished:
            return self._status or Status()
        self._finished = True
        first: BaseException | None = None
        try:
            self._status = self.query(what)
        except BaseException as exc:    # noqa: BLE001 - raised once free_fn ran
            first = exc
        try:
            self._run_free(what)
        except BaseException as exc:    # noqa: BLE001
            first = first or exc
        if first is not None:
            raise first
        return self._status or Status()

    def _run_free(self, what: str) -> None:
        if self.free_fn is None:
            return
        try:
            self.free_fn(*self.args, **self.kwargs)
        except BaseException as exc:    # noqa: BLE001 - reported as MPI reports a callback's error
            callbacks.report(exc)
            raise callbacks.failed(f"{what}: free_fn", exc) from exc

    def cancel(self) -> None:
        if self.cancel_fn is None:
            return
        try:
            self.cancel_fn(self.done, *self.args, **self.kwargs)
        except BaseException as exc:    # noqa: BLE001 - reported as MPI reports a callback's error
            callbacks.report(exc)
            raise callbacks.failed("Grequest.Cancel: cancel_fn", exc) from exc

    def free(self) -> None:
        """MPI_Request_free: free_fn now if complete, else at Complete."""
        if self._finished:
            return
        if self.done:
            self._finished = True
            self._run_free("Request.Free")
        else:
            self._free_pending = True


def wait_any(states: list[GState], timeout: float | None = None) -> None:
    """Sleep until one of ``states`` is complete (see the module header for the bounds)."""
    from shmproxy.mpi import env
    world = env._state["world"]
    limit = timeout if timeout is not None else getattr(world, "_timeout", None)
    if limit is None:
        from shmproxy.core import params
        limit = params.get().TIMEOUT
    waiter = getattr(world, "_waiter", None)
    slice_s = waiter.slice_s if waiter is not None else _DEFAULT_SLICE_S
    deadline = time.monotonic() + limit
    while True:
        with _CV:
            if _CV.wait_for(lambda: any(s.done for s in states),
                            timeout=max(0.0, min(slice_s, deadline - time.monotonic()))):
                return
        failure = world.get_async_error() if world is not None else None
        if failure is not None:
            raise convert(failure)
        if time.monotonic() >= deadline:
            who = f"rank {world.rank}" if world is not None else "this process"
            raise convert(errors.Timeout(f"{who}: timed out after {limit:g} s waiting for "
                                         f"{len(states)} generalized request(s) (MPI.Grequest): "
                                         "Complete() was not called"))


class Grequest(Request):
    """A generalized request (see the module header)."""

    __slots__ = ("_g",)

    def __init__(self, request: Any = None):
        if request is not None and not isinstance(request, Grequest) and (
                not isinstance(request, Request) or request):     # REQUEST_NULL: a null handle
            raise TypeError("MPI.Grequest() takes a generalized request")
        super().__init__(request)
        self._g: GState | None = request._g if isinstance(request, Grequest) else None

    @classmethod
    def Start(cls, query_fn: Callable[..., Any] | None = None, free_fn: Callable[..., Any] | None = None,
              cancel_fn: Callable[..., Any] | None = None, args: tuple | None = None,
              kwargs: dict | None = None) -> "Grequest":
        g = GState(query_fn, free_fn, cancel_fn, tuple(args or ()), dict(kwargs or {}))
        greq = cls()
        greq._r = greq._g = g
        return greq

    def _state(self, what: str) -> GState:
        g = self._g
        if g is None:
            raise error(ERR_REQUEST, f"{what}: MPI.Grequest() null handle (no generalized request)")
        return g

    def Complete(self) -> None:
        self._state("Grequest.Complete").complete()

    def complete(self, obj: Any = None) -> None:
        """mpi4py's lower-case form: complete with ``obj``, which wait() and test() return."""
        self._state("Grequest.complete").complete(obj)

    def _end(self, g: GState, status: Status | None, what: str) -> Any:
        """The Wait or Test that completes the request: the callbacks run, the request is inactive."""
        self._r = None
        st = g.finish(what)
        if status is not None:
            status._f[:] = st._f
        return g.result

    # the upper- and lower-case forms share _wait/_test, never calling each other: mpi4py's subclasses
    # override the lower-case ones with other signatures (test(self) calling Test())
    def Wait(self, status: Status | None = None) -> bool:
        self._wait(status)
        return True

    def wait(self, status: Status | None = None) -> Any:
        return self._wait(status)

    def Test(self, status: Status | None = None) -> bool:
        return self._test(status)[0]

    def test(self, status: Status | None = None) -> tuple[bool, Any]:
        return self._test(status)

    def _wait(self, status: Status | None) -> Any:
        g = self._r
        if not isinstance(g, GState):
            Request.Wait(self, status)       # inactive: an empty status, as any request's
            return None
        g.Wait()
        return self._end(g, status, "Grequest.Wait")

    def _test(self, status: Status | None) -> tuple[bool, Any]:
        g = self._r
        if not isinstance(g, GState):
            return Request.Test(self, status), None
        if not g.done:
            return False, None
        return True, self._end(g, status, "Grequest.Test")

    def Get_status(self, status: Status | None = None) -> bool:
        g = self._r
        if not isinstance(g, GState):
            return Request.Get_status(self, status)
        if not g.done:
            return False
        if status is not None:
            status._f[:] = g.query("Grequest.Get_status")._f
        return True

    def Cancel(self) -> None:
        if not self._active():
            raise error(ERR_REQUEST, "Request.Cancel: the request is MPI.REQUEST_NULL (inactive)")
        self._state("Grequest.Cancel").cancel()

    cancel = Cancel

    def Free(self) -> None:
        if not self._active():
            raise error(ERR_REQUEST, "Request.Free: the request is MPI.REQUEST_NULL (inactive)")
        g = self._state("Grequest.Free")
        self._r = None
        g.free()

    def __repr__(self) -> str:
        g = self._r
        if not isinstance(g, GState):
            return "<MPI.Grequest inactive>"
        return "<MPI.Grequest " + ("complete>" if g.done else "active>")
