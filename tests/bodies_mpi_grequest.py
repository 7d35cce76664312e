"""Rank bodies of tests/test_mpi_grequest.py: generalized requests (shmproxy/mpi/grequest.py).
Complete from another thread ends a Wait; Grequests mix with native requests in Waitall, Testall and
Waitany; query_fn fills the status, free_fn runs once, cancel_fn sees whether the request completed;
callback errors are printed and raised with their class; a Grequest never completed times out, and
one waited on while a peer aborts fails with the abort, as every other wait."""
from __future__ import annotations

import contextlib
import io
import threading
import time
from typing import Any

import numpy as np

import shmproxy
from shmproxy import MPI


class _Work:
    """A generalized request whose work runs on a thread of its own, started once ``go`` is set."""

    def __init__(self, source: int, tag: int) -> None:
        self.source, self.tag, self.freed, self.cancels = source, tag, 0, []
        self.go = threading.Event()
        self.greq = MPI.Grequest.Start(self.query, self.free, self.cancel, args=(source,), kwargs={"k": tag})
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.go.wait(60)
        self.greq.Complete()

    def query(self, status: Any, source: int, k: int) -> None:
        status.Set_source(source)
        status.Set_tag(k)
        status.Set_elements(MPI.BYTE, 3)

    def free(self, source: int, k: int) -> None:
        self.freed += 1

    def cancel(self, completed: bool, source: int, k: int) -> None:
        self.cancels.append(completed)


def mixed_waits() -> dict:
    comm = MPI.COMM_WORLD
    rank, peer = comm.rank, 1 - comm.rank

    # Wait until another thread completes it: the status is query_fn's, free_fn runs once
    w = _Work(5, 9)
    assert not w.greq.Test() and not w.greq.Get_status()
    w.greq.Cancel()
    w.go.set()
    st = MPI.Status()
    w.greq.Wait(st)
    assert (st.Get_source(), st.Get_tag(), st.Get_count(MPI.BYTE), st.Get_error()) == (5, 9, 3, MPI.SUCCESS)
    assert w.freed == 1 and w.cancels == [False] and not w.greq
    w.greq.Wait()
    assert w.freed == 1

    # Waitany over a receive that cannot complete yet and a Grequest: the Grequest wins, then the
    # receive completes once the peer sends
    w = _Work(1, 2)
    buf = np.zeros(4)
    reqs = [comm.Irecv(buf, peer, 7), w.greq]
    w.go.set()
    st = MPI.Status()
    assert MPI.Request.Waitany(reqs, st) == 1 and st.Get_tag() == 2
    comm.Barrier()
    comm.Send(np.full(4, float(rank)), peer, 7)
    assert MPI.Request.Waitany(reqs) == 0 and buf[0] == peer
    assert MPI.Request.Waitany(reqs) == MPI.UNDEFINED

    # Testall is false while a Grequest is pending and changes nothing; Waitall then ends them all
    w = _Work(3, 4)
    reqs = [comm.Isend(np.ones(2), peer, 8), comm.Irecv(np.zeros(2), peer, 8), w.greq]
    assert not MPI.Request.Testall(reqs) and w.greq and w.freed == 0
    w.go.set()
    statuses: list = []
    MPI.Request.Waitall(reqs, statuses)
    assert statuses[2].Get_source() == 3 and w.freed == 1 and not any(reqs)

    # Waitany over Grequests only sleeps until one completes; Waitsome, Testany
    a, b = _Work(0, 0), _Work(0, 1)
    b.go.set()
    assert MPI.Request.Waitany([a.greq, b.greq]) == 1
    assert MPI.Request.Testany([a.greq, b.greq]) == (MPI.UNDEFINED, False)
    a.go.set()
    assert MPI.Request.Waitsome([a.greq, b.greq]) == [0]

    # mpi4py's lower-case forms: complete(obj) is what wait() returns
    g = MPI.Grequest.Start()
    g.complete({"x": 1})
    assert g.wait() == {"x": 1} and g.test() == (True, None)
    # handles: a second Grequest handle, and a plain Request handle, of the same request
    g = MPI.Grequest.Start(w.query, args=(6,), kwargs={"k": 6})
    assert MPI.Grequest(g) == g and MPI.Request(g) == g and MPI.Grequest.fromhandle(g.handle) == g
    g.Complete()
    st = MPI.Status()
    MPI.Request(g).Wait(st)
    assert st.Get_source() == 6

    # Free before Complete: free_fn runs at Complete
    w = _Work(0, 0)
    w.greq.Free()
    assert w.freed == 0 and not w.greq
    w.go.set()
    w.thread.join(60)
    assert w.freed == 1

    # callback errors: printed, raised with the exception's class (ERR_OTHER for a non-MPI one)
    def bad_query(status: Any) -> None:
        raise ZeroDivisionError("query went wrong")

    freed: list = []
    g = MPI.Grequest.Start(bad_query, lambda: freed.append(1))
    g.Complete()
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            g.Wait()
        except MPI.Exception as exc:
            assert exc.Get_error_class() == MPI.ERR_OTHER
        else:
            raise AssertionError("Wait raised nothing")
    assert err.getvalue().startswith("Traceback") and "ZeroDivisionError" in err.getvalue()
    assert freed == [1] and not g      # free_fn still ran, the request ended

    def refuse(completed: bool) -> None:
        raise MPI.Exception(MPI.ERR_PENDING)

    g = MPI.Grequest.Start(None, None, refuse)
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            g.Cancel()
        except MPI.Exception as exc:
            assert exc.Get_error_class() == MPI.ERR_PENDING
        else:
            raise AssertionError("Cancel raised nothing")
    g.Complete()
    g.Wait()
    comm.Barrier()
    return {"rank": rank}


def never_completed_times_out() -> dict:
    """Run with a short SHMPROXY_TIMEOUT: a Grequest nobody completes is a Timeout, not a hang."""
    comm = MPI.COMM_WORLD
    comm.Barrier()
    g = MPI.Grequest.Start()
    t0 = time.monotonic()
    try:
        g.Wait()
    except shmproxy.Timeout as exc:
        assert isinstance(exc, MPI.Exception) and "Complete() was not called" in str(exc), exc
    else:
        raise AssertionError("Wait returned")
    return {"seconds": time.monotonic() - t0}


def abort_ends_a_grequest_wait() -> dict:
    """Rank 1 aborts while rank 0 waits on a Grequest nobody completes: rank 0's wait fails with the
    abort (or the dead peer) promptly."""
    comm = MPI.COMM_WORLD
    comm.Barrier()
    if comm.rank == 1:
        comm.Abort(3)
        raise AssertionError("Abort returned")
    g = MPI.Grequest.Start()
    t0 = time.monotonic()
    try:
        g.Wait()
    except MPI.Exception as exc:
        assert exc.Get_error_class() in (MPI.ERR_REVOKED, MPI.ERR_PROC_FAILED), exc
    else:
        raise AssertionError("Wait returned")
    return {"seconds": time.monotonic() - t0}
