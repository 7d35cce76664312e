"""Rank bodies of tests/test_mpi_rc.py: shmproxy.rc, mpi4py's runtime configuration, read when
shmproxy.MPI joins the job (thread_level, threads, errors), and Is_thread_main from other threads.
Each body runs in fresh rank processes: the options are set before the first MPI call."""
from __future__ import annotations

import threading
from typing import Any, Callable

import shmproxy.rc
from shmproxy import MPI


def _in_threads(fn: Callable[[], Any], n: int = 3) -> list[Any]:
    out: list[Any] = []
    threads = [threading.Thread(target=lambda: out.append(fn())) for _ in range(n)]
    for t in threads:
        t.start()
        t.join(60)      # one at a time: THREAD_SERIALIZED or below
    return out


def options_before_first_use() -> dict:
    rc = shmproxy.rc
    try:
        rc.thread_levl = "single"
    except TypeError:
        pass
    else:
        raise AssertionError("a misspelt option was accepted")
    try:
        rc(initialise=False)
    except TypeError:
        pass
    else:
        raise AssertionError("a misspelt option was accepted")
    rc(thread_level="funneled", errors="fatal")
    assert (rc.thread_level, rc.errors, rc.irecv_bufsz) == ("funneled", "fatal", 32768)
    assert not MPI.Is_initialized() and MPI.Query_thread() == MPI.THREAD_FUNNELED
    comm = MPI.COMM_WORLD
    comm.Barrier()                     # joins the job, on first use, from the main thread
    assert MPI.Query_thread() == MPI.THREAD_FUNNELED
    for c in (comm, MPI.COMM_SELF):
        eh = c.Get_errhandler()
        assert eh == MPI.ERRORS_ARE_FATAL, eh
    assert MPI.Is_thread_main() and _in_threads(MPI.Is_thread_main) == [False] * 3
    rc.thread_level = "multiple"       # read at the join only, as mpi4py reads it at import
    assert MPI.Query_thread() == MPI.THREAD_FUNNELED
    return {"rank": comm.rank}


def init_from_a_thread() -> dict:
    """MPI's main thread is the one that called Init; the level is the lower of rc's and
    THREAD_SERIALIZED, what shmproxy provides."""
    flags: dict[str, Any] = {}

    def init() -> None:
        MPI.Init()
        flags["worker"] = MPI.Is_thread_main()

    t = threading.Thread(target=init)
    t.start()
    t.join(120)
    assert flags == {"worker": True}, flags
    assert not MPI.Is_thread_main()
    assert MPI.Query_thread() == MPI.THREAD_SERIALIZED
    assert MPI.COMM_WORLD.Get_errhandler() == MPI.ERRORS_RETURN
    MPI.COMM_WORLD.Barrier()
    return {"rank": MPI.COMM_WORLD.rank}


def no_threads_and_bad_values() -> dict:
    shmproxy.rc.thread_level = "several"
    try:
        MPI.Init()
    except ValueError as exc:      # an MPI.Exception of class ERR_ARG too, before the join
        assert isinstance(exc, MPI.Exception) and exc.Get_error_class() == MPI.ERR_ARG, exc
    else:
        raise AssertionError("a bad thread_level was accepted")
    assert not MPI.Is_initialized()
    shmproxy.rc.thread_level, shmproxy.rc.threads = "multiple", False
    MPI.Init()
    assert MPI.Query_thread() == MPI.THREAD_SINGLE and MPI.Is_thread_main()
    MPI.COMM_WORLD.Barrier()
    return {"rank": MPI.COMM_WORLD.rank}
