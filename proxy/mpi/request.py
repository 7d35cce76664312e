"""MPI.Request and MPI.Prequest over the native requests (shmproxy.Request). Generalized requests
(MPI.Grequest) are grequest.py's: their state stands where a native request does.

A Request wraps one native request, or none: a request to or from PROC_NULL completes at once
without touching the runtime (its status says source PROC_NULL, as MPI defines), and a request that
completed becomes inactive, like MPI_REQUEST_NULL: Waitany and friends skip it, waiting on it again
returns at once with an empty status.

Waitany/Waitsome have no native counterpart yet. They test every request, then sleep on the futex
word of a communicator the requests belong to (Comm._waiter.sleep_slice, the same bounded sleep that
native Wait uses) for at most ANY_SLICE_S: every completion the progress process publishes for this
rank bumps that word and wakes the sleeper, so a completion ends the sleep at once; the short bound
only covers a completion that lands between the test and the sleep (the sleep reads the word itself),
and requests of other communicators, whose words this sleep does not watch. No core is burnt, every
wait is bounded by SHMPROXY_TIMEOUT, and failures (a dead peer, an abort) are raised by the sleep.
Generalized requests among them are seen by the same tests (a Complete lands within one short
slice); when nothing but generalized requests is pending, the wait is grequest.py's (a condition
variable).
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Iterable, Sequence

from shmproxy.core import errors
from shmproxy.core.ops import UNDEFINED
from shmproxy.mpi.exceptions import ERR_REQUEST, convert, error, unsupported
from shmproxy.mpi.status import Status
from shmproxy.mpi.handles import HandleNumber

ANY_SLICE_S = 0.002   # longest sleep of Waitany/Waitsome between two tests of every request


class Request(HandleNumber):
    """A nonblocking operation: Wait, Test, Free, Get_status and the Wait/Test families."""

    __slots__ = ("_r", "_null", "_h", "__weakref__")
    _r: Any                 # the native request while active (grequest.py: a GState), else None
    _null: bool             # an active operation with PROC_NULL: completes without the runtime
    _h: Request | None      # the request whose handle this one is a copy of

    def __new__(cls, *_a: Any, **_k: Any) -> "Request":
        return object.__new__(cls)     # (mpi4py's subclasses call it with the request to wrap)

    def __init__(self, native: Any = None, proc_null: bool = False):
        if isinstance(native, Request):   # mpi4py's MPI.Request(req): a second object of req's handle
            self._r, self._null, self._h = native._r, native._null, native._hid()
            return
        if native is not None and not callable(getattr(native, "describe", None)):
            # what the layer wraps is a native request (or one of nativereq's stand-ins): every one
            # of them describes itself; a handle of another class, a number or a string is not one
            raise TypeError(f"MPI.{type(self).__name__}() takes an MPI.Request, not {type(native).__name__}")
        self._r = native          # the native request while active, else None
        self._null = proc_null    # an active operation with PROC_NULL: completes without the runtime
        self._h = None    # the request whose handle this one is a copy of

    def _hid(self) -> "Request":
        return self if self._h is None else self._h

    # handles, as mpi4py gives them: an int naming the request while some object of it lives
    @property
    def handle(self) -> int:
        h = self._hid()
        _HANDLES[id(h)] = h
        return id(h)

    @classmethod
    def fromhandle(cls, handle: int) -> "Request":
        h = _HANDLES.get(int(handle))
        if h is None:
            raise error(ERR_REQUEST, f"no request has the handle {handle}")
        return cls(h)

    def _active(self) -> bool:
        return self._r is not None or self._null

    def _complete(self, status: Status | None) -> None:
        """The active operation is done: fill ``status`` and become inactive."""
        r = self._r
        if status is not None:
            if r is None:
                status._fill_null()
            else:
                status._fill(r.status)
        self._r, self._null = None, False

    def Wait(self, status: Status | None = None) -> bool:
        r = self._r
        if r is not None:
            try:
                r.Wait()
            except errors.ProxyError as exc:
                self._r = None
                raise convert(exc) from None
            if status is not None:
                status._fill(r.status)
            self._r = None
            return True
        if status is not None:
            if self._null:
                status._fill_null()
            else:
                status._fill(None)
        self._null = False
        return True

    def Test(self, status: Status | None = None) -> bool:
        r = self._r
        if r is not None:
            try:
                if not r.Test():
                    return False
            except errors.ProxyError as exc:
                self._r = None
                raise convert(exc) from None
            if status is not None:
                status._fill(r.status)
            self._r, self._null = None, False
            return True
        if self._null:
            self._complete(status)
        elif status is not None:
            status._fill(None)
        return True

    def Get_status(self, status: Status | None = None) -> bool:
        """Whether complete, without making the request inactive (MPI_Request_get_status)."""
        r = self._r
        if r is not None:
            try:
                done = r.Test()
            except errors.ProxyError as exc:
                raise convert(exc) from None
            if done and status is not None:
                status._fill(r.status)
            return bool(done)
        if status is not None:
            status._fill_null() if self._null else status._fill(None)
        return True

    def Free(self) -> None:
        """Forget the request: the operation still completes and the runtime reaps it. Freeing an
        inactive request (REQUEST_NULL) is an error, as MPI_Request_free of MPI_REQUEST_NULL."""
        if not self._active():
            raise error(ERR_REQUEST, "Request.Free: the request is MPI.REQUEST_NULL (inactive)")
        self._r, self._null = None, False

    def free(self) -> None:
        """mpi4py's safe free: Free unless the request is already REQUEST_NULL (every kind's own Free)."""
        if self:
            self.Free()

    def Cancel(self) -> None:
        """Cancel the operation if nothing matched it yet (a posted receive, an unbuffered send): it
        then completes with Status.Is_cancelled() true; otherwise it completes as usual."""
        if not self._active():
            raise error(ERR_REQUEST, "Request.Cancel: the request is MPI.REQUEST_NULL (inactive)")
        r = self._r
        if r is not None:
            try:
                r.Cancel()
            except errors.ProxyError as exc:
                raise convert(exc) from None

    # mpi4py's lower-case forms (the object layer's requests override them)
    def get_status(self, status: Status | None = None) -> bool:
        return self.Get_status(status)

    def wait(self, status: Status | None = None) -> Any:
        self.Wait(status)
        return None

    def test(self, status: Status | None = None) -> tuple[bool, Any]:
        return self.Test(status), None

    def __bool__(self) -> bool:
        """False for an inactive request (mpi4py: a request is true until it is REQUEST_NULL)."""
        return self._active()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Request):
            return NotImplemented
        return self._hid() is other._hid() or (not self and not other)

    # as mpi4py's handles: a request may be freed (or completed) in place, so its hash would change
    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> Any:
        if self._active():
            raise ValueError("an active request cannot be pickled: it names an operation of this process")
        return "REQUEST_NULL" if self is REQUEST_NULL else (type(self), ())

    def __repr__(self) -> str:
        if self._r is not None:
            return f"<MPI.Request {self._r.describe()}>"
        return "<MPI.Request PROC_NULL>" if self._null else "<MPI.REQUEST_NULL>"

    # ---------------------------------------------------------------- the Wait/Test families
    @staticmethod
    def Waitall(requests: Sequence["Request"], statuses: list | None = None) -> bool:
        """Wait for every request; every one completes before the first error is raised."""
        reqs = _check(requests)
        first: BaseException | None = None
        for i, r in enumerate(reqs):
            st = _status_at(statuses, i)
            try:
                r.Wait(st)
            except Exception as exc:   # noqa: BLE001 - kept, and raised once all are done
                if isinstance(exc, (errors.PeerDiedError, errors.Aborted, errors.Closed, errors.Timeout)):
                    raise
                first = first or exc
        if first is not None:
            raise first
        return True

    @staticmethod
    def Testall(requests: Sequence["Request"], statuses: list | None = None) -> bool:
        """True (and every request completed) if all are complete, else False and none is changed."""
        reqs = _check(requests)
        for r in reqs:
            if r._active() and not _done(r):
                return False
        for i, r in enumerate(reqs):
            r.Test(_status_at(statuses, i))
        return True

    @staticmethod
    def Testany(requests: Sequence["Request"], status: Status | None = None) -> tuple[int, bool]:
        """(index, True) for one completed request; (UNDEFINED, True) if none is active;
        (UNDEFINED, False) if none is complete yet."""
        reqs = _check(requests)
        i = _first_done(reqs)
        if i is None:
            if not any(r._active() for r in reqs):
                if status is not None:
                    status._fill(None)
                return UNDEFINED, True
            return UNDEFINED, False
        reqs[i].Wait(status)
        return i, True

    @staticmethod
    def Waitany(requests: Sequence["Request"], status: Status | None = None) -> int:
        """The index of a completed request (now inactive); UNDEFINED if none is active."""
        reqs = _check(requests)
        i = _wait_some(reqs)
        if i is None:
            if status is not None:
                status._fill(None)
            return UNDEFINED
        reqs[i].Wait(status)
        return i

    @staticmethod
    def Testsome(requests: Sequence["Request"], statuses: list | None = None) -> list[int] | None:
        """Indices of the requests complete now (possibly none); None if none is active."""
        return _complete_now(requests, statuses, lambda r, st: r.Wait(st))

    @staticmethod
    def Waitsome(requests: Sequence["Request"], statuses: list | None = None) -> list[int] | None:
        """Indices of at least one completed request; None if none is active."""
        reqs = _check(requests)
        if _wait_some(reqs) is None:
            return None
        return Request.Testsome(reqs, statuses)

    # mpi4py's lower-case families: like the upper-case ones, with the objects received
    @staticmethod
    def waitall(requests: Sequence["Request"], statuses: list | None = None) -> list:
        return [r.wait(_status_at(statuses, i)) for i, r in enumerate(_check(requests))]

    @staticmethod
    def testall(requests: Sequence["Request"], statuses: list | None = None) -> tuple[bool, list | None]:
        reqs = _check(requests)
        if not all(not r._active() or _done(r) for r in reqs):
            return False, None
        return True, [r.wait(_status_at(statuses, i)) for i, r in enumerate(reqs)]

    @staticmethod
    def waitany(requests: Sequence["Request"], status: Status | None = None) -> tuple[int, Any]:
        reqs = _check(requests)
        i = _wait_some(reqs)
        if i is None:
            if status is not None:
                status._fill(None)
            return UNDEFINED, None
        return i, reqs[i].wait(status)

    @staticmethod
    def testany(requests: Sequence["Request"], status: Status | None = None) -> tuple[int, bool, Any]:
        reqs = _check(requests)
        i = _first_done(reqs)
        if i is None:
            if not any(r._active() for r in reqs):
                if status is not None:
                    status._fill(None)
                return UNDEFINED, True, None
            return UNDEFINED, False, None
        return i, True, reqs[i].wait(status)

    @staticmethod
    def waitsome(requests: Sequence["Request"], statuses: list | None = None) -> tuple[list | None, list | None]:
        reqs = _check(requests)
        if _wait_some(reqs) is None:
            return None, None
        return Request.testsome(reqs, statuses)

    @staticmethod
    def testsome(requests: Sequence["Request"], statuses: list | None = None) -> tuple[list | None, list | None]:
        reqs = _check(requests)
        if not any(r._active() for r in reqs):
            return None, None
        done = [i for i, r in enumerate(reqs) if r._active() and _done(r)]
        return done, [reqs[i].wait(_status_at(statuses, k)) for k, i in enumerate(done)]

    # MPI 4.1's Get_status families: whether complete, leaving every request as it is
    @staticmethod
    def Get_status_any(requests: Sequence["Request"], status: Status | None = None) -> tuple[int, bool]:
        reqs = _check(requests)
        if not any(r._active() for r in reqs):
            if status is not None:
                status._fill(None)
            return UNDEFINED, True
        i = _first_done(reqs)
        if i is None:
            return UNDEFINED, False
        reqs[i].Get_status(status)
        return i, True

    @staticmethod
    def Get_status_all(requests: Sequence["Request"], statuses: Sequence | None = None) -> bool:
        reqs = _check(requests)
        if not all(not r._active() or _done(r) for r in reqs):
            return False
        for i, r in enumerate(reqs):
            r.Get_status(_status_at(statuses, i))
        return True

    @staticmethod
    def Get_status_some(requests: Sequence["Request"], statuses: Sequence | None = None) -> list[int] | None:
        return _complete_now(requests, statuses, lambda r, st: r.Get_status(st))

    get_status_any, get_status_all, get_status_some = Get_status_any, Get_status_all, Get_status_some

    @staticmethod
    def Startall(requests: Sequence["Prequest"]) -> None:
        for r in _check(requests):
            if not isinstance(r, Prequest):
                raise error(ERR_REQUEST, "Startall takes persistent requests (Send_init, Recv_init)")
            r.Start()


class Prequest(Request):
    """A persistent request (Send_init, Recv_init): Start posts it again, Wait completes one round."""

    __slots__ = ("_post", "_args", "_live")

    def __init__(self, post: Any = None, args: tuple = (), proc_null: bool = False):
        if isinstance(post, Request):      # MPI.Prequest(preq): a second object of its handle
            if not isinstance(post, Prequest):
                if post:     # an active request of another kind cannot be restarted
                    raise TypeError("MPI.Prequest() takes a persistent request")
                super().__init__(post)      # MPI.Prequest(MPI.REQUEST_NULL): a null handle, as mpi4py's
                self._post, self._args, self._live = None, (), False
                return
            super().__init__(post)
            self._post, self._args, self._live = post._post, post._args, post._live
            return
        super().__init__(None, False)
        self._post = None if proc_null else post   # the native Isend/Irecv, None for PROC_NULL
        self._args = args
        self._live = post is not None or proc_null  # a persistent request is not REQUEST_NULL until freed

    def __bool__(self) -> bool:
        return self._live or self._active()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Request):
            return NotImplemented
        return self._hid() is other._hid() or (not self and not other)

    __hash__ = None  # type: ignore[assignment]

    def Start(self) -> None:
        if self._active():
            raise error(ERR_REQUEST, "Start on a persistent request that is still active (Wait for it first)")
        if self._post is None:
            self._null = True
            return
        try:
            self._r = self._post(*self._args)
        except errors.ProxyError as exc:
            raise convert(exc) from None

    def Free(self) -> None:
        # an inactive persistent request is still a request (not REQUEST_NULL) until freed
        if not (self._live or self._active()):
            raise error(ERR_REQUEST, "Request.Free: the request is MPI.REQUEST_NULL (already freed)")
        self._r, self._null = None, False
        self._post, self._args, self._live = None, (), False

    def __repr__(self) -> str:
        return "<MPI.Prequest " + ("active>" if self._active() else "inactive>")


class ObjRequest(Request):
    """The request of the object layer's isend/irecv (shmproxy.rank.objp2p.ObjRequest): ``wait`` returns
    the object received (None for isend), ``test`` returns (flag, object)."""

    __slots__ = ("_o",)

    def __init__(self, obj_request: Any):
        super().__init__(None, False)
        self._o = obj_request

    def _active(self) -> bool:
        return self._o is not None

    def wait(self, status: Status | None = None) -> Any:
        o = self._o
        if o is None:
            if status is not None:
                status._fill(None)
            return None
        try:
            value = o.wait()
        except errors.ProxyError as exc:
            self._o = None
            raise convert(exc) from None
        self._o = None
        if status is not None:
            status._fill(o.status)
        return value

    def test(self, status: Status | None = None) -> tuple[bool, Any]:
        o = self._o
        if o is None:
            return True, None
        try:
            done, value = o.test()
        except errors.ProxyError as exc:
            self._o = None
            raise convert(exc) from None
        if done:
            self._o = None
            if status is not None:
                status._fill(o.status)
        return done, value

    def Wait(self, status: Status | None = None) -> bool:
        self.wait(status)
        return True

    def Test(self, status: Status | None = None) -> bool:
        return self.test(status)[0]

    def Get_status(self, status: Status | None = None) -> bool:
        """Whether complete, the request staying active (the object layer keeps what it received)."""
        o = self._o
        if o is None:
            if status is not None:
                status._fill(None)
            return True
        try:
            done = o.test()[0]
        except errors.ProxyError as exc:
            raise convert(exc) from None
        if done and status is not None:
            status._fill(o.status)
        return bool(done)

    def Cancel(self) -> None:
        """Only an issend of a rank to itself can be cancelled (an object is several messages)."""
        cancel = getattr(self._o, "cancel", None)
        if cancel is None:
            unsupported("Request.Cancel on an object request", "an object is several messages")
        cancel()

    cancel = Cancel

    def Free(self) -> None:
        self._o = None

    def __repr__(self) -> str:
        return "<MPI.Request object " + ("active>" if self._o is not None else "inactive>")


REQUEST_NULL = Request()
_HANDLES: "weakref.WeakValueDictionary[int, Request]" = weakref.WeakValueDictionary()


# ---------------------------------------------------------------- helpers
def _check(requests: Iterable[Any]) -> list[Request]:
    reqs = list(requests)
    for r in reqs:
        if not isinstance(r, Request):
            raise error(ERR_REQUEST, f"expected MPI.Request objects, got {type(r).__name__}")
    return reqs


def _status_at(statuses: Sequence | None, i: int) -> Status | None:
    """The i-th status to fill: a list grows to hold it (as mpi4py's), other sequences only give
    the ones they have."""
    if statuses is None:
        return None
    if not isinstance(statuses, list):
        return statuses[i] if i < len(statuses) and isinstance(statuses[i], Status) else None
    while len(statuses) <= i:
        statuses.append(Status())
    st = statuses[i]
    return st if isinstance(st, Status) else None


def _complete_now(requests: Sequence[Request], statuses: Sequence | None,
                  take: Callable[[Request, Status | None], Any]) -> list[int] | None:
    """The indices of the active requests complete now, each given to ``take`` with its status (Wait,
    which frees it, or Get_status, which does not); None if none is active."""
    reqs = _check(requests)
    if not any(r._active() for r in reqs):
        return None
    done = [i for i, r in enumerate(reqs) if r._active() and _done(r)]
    for k, i in enumerate(done):
        take(reqs[i], _status_at(statuses, k))
    return done


def _done(r: Request) -> bool:
    """Complete (or PROC_NULL); errors surface when the caller Waits on it."""
    if isinstance(r, ObjRequest):
        try:    # an object request keeps what its test completed: its wait() returns it
            return r._o is None or bool(r._o.test()[0])
        except errors.ProxyError:
            return True
    if r._r is None:
        return r._null
    try:
        return bool(r._r.Test())
    except errors.ProxyError:
        return True    # failed: complete, its Wait raises the error


def _first_done(reqs: list[Request]) -> int | None:
    for i, r in enumerate(reqs):
        if r._active() and _done(r):
            return i
    return None


def _wait_some(reqs: list[Request]) -> int | None:
    """Block until some active request is complete; its index, or None if none is active."""
    active = [r for r in reqs if r._active()]
    if not active:
        return None
    if len(active) == 1:
        r = active[0]
        if r._r is not None or isinstance(r, ObjRequest):
            try:
                r._o.wait() if isinstance(r, ObjRequest) else r._r.Wait()
            except (errors.Timeout, errors.PeerDiedError, errors.Aborted, errors.Closed) as exc:
                raise convert(exc) from None
            except errors.ProxyError:
                return reqs.index(r)    # complete with its own error: the caller's Wait raises it
        return reqs.index(r)
    from shmproxy.mpi.grequest import GState, wait_any
    natives = [r._r for r in active if r._r is not None]
    owners = [n._comm for n in natives if not isinstance(n, GState)]
    owners += [r._o._comm for r in active if isinstance(r, ObjRequest)]
    comms = list({id(c): c for c in owners}.values())
    if not comms:       # only generalized requests and PROC_NULL operations (complete already)
        i = _first_done(reqs)
        if i is None:
            wait_any([n for n in natives if isinstance(n, GState)])
            i = _first_done(reqs)
        return i
    deadline = time.monotonic() + (comms[0]._timeout if comms else 0.0)
    turn = 0
    while True:
        i = _first_done(reqs)
        if i is not None:
            return i
        comm = comms[turn % len(comms)]
        turn += 1
        if comm._pp.group_depth:
            raise error(ERR_REQUEST, "Waitany/Waitsome inside comm.group(): the group's ops are posted "
                        "at its end")
        now = time.monotonic()
        if now >= deadline:
            pending = "; ".join(n.describe() for n in natives[:4])
            raise convert(errors.Timeout(f"rank {comm.rank}: timed out waiting for any of {len(natives)} "
                                         f"requests ({pending})"))
        try:
            comm._waiter.sleep_slice(min(deadline, now + ANY_SLICE_S), f"any of {len(natives)} requests")
        except errors.Timeout:
            continue    # our short slice ran out: test again (the overall deadline is checked above)
        except errors.ProxyError as exc:
            raise convert(exc) from None
