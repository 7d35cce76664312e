"""shmproxy.rc: mpi4py's runtime configuration (``mpi4py.rc``), for programs written for mpi4py.

    import shmproxy.rc                     # instead of: import mpi4py.rc
    shmproxy.rc.thread_level = "funneled"  # or shmproxy.rc(thread_level="funneled")
    from shmproxy import MPI

The options are mpi4py's, with its defaults; setting a name mpi4py's rc lacks is a TypeError, as
there. mpi4py reads them when ``from mpi4py import MPI`` initialises MPI; shmproxy.MPI joins the job
later, at ``MPI.Init()`` or at the first use of COMM_WORLD (importing it starts nothing), and reads
them then (shmproxy/mpi/env.py), so a program that sets them before its first MPI call gets what it
asked for. What each one means here:

- ``thread_level`` ("multiple", "serialized", "funneled", "single") and ``threads`` (False asks for
  "single"): the level an implicit or plain ``MPI.Init()`` asks for; ``MPI.Query_thread()`` reports
  the lower of it and THREAD_SERIALIZED, which is what shmproxy provides (a communicator is used by
  one thread at a time). ``MPI.Init_thread(required)`` asks for ``required`` instead.
- ``errors`` ("exception", "default", "abort", "fatal"): the error handler COMM_WORLD and COMM_SELF
  hold from Init: ERRORS_RETURN for "exception" and "default" (the layer's default: shmproxy has no
  MPI library whose own default would differ), ERRORS_ABORT for "abort", ERRORS_ARE_FATAL for
  "fatal". As for any handler, ``Get_errhandler`` gives it back and ``Call_errhandler`` runs it, but
  every error of a call is still raised as an MPI.Exception (see the README).

Accepted and ignored, with the reason:

- ``initialize``: shmproxy never initialises at import; the job is joined by ``MPI.Init()`` or on
  first use either way, so there is nothing to turn off.
- ``finalize``: the native layer closes every communicator at exit (pending sends complete first)
  whether or not the program calls ``MPI.Finalize()``; there is no library that would be left
  unfinalised.
- ``fast_reduce``: the object reductions (``comm.reduce``, ``allreduce``) are the native object layer's,
  computed in rank order so that every rank gets the same result; there is no tree variant to pick.
- ``recv_mprobe``: an object ``recv`` is one native object message, which carries its size; there is
  no probe-then-receive sequence that a matched probe would make atomic.
- ``irecv_bufsz``: ``irecv`` without a buffer needs no size guess for the same reason.
"""
from __future__ import annotations

import sys
import types
from typing import Any

initialize: bool = True
threads: bool = True
thread_level: str = "multiple"
finalize: bool | None = None
fast_reduce: bool = True
recv_mprobe: bool = True
irecv_bufsz: int = 32768
errors: str = "exception"

_OPTIONS = ("initialize", "threads", "thread_level", "finalize", "fast_reduce", "recv_mprobe",
            "irecv_bufsz", "errors")


class _Rc(types.ModuleType):
    """This module, callable and closed to new names as mpi4py's rc object is."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _OPTIONS and not name.startswith("__"):
            raise TypeError(f"shmproxy.rc has no option {name!r} (the options: {', '.join(_OPTIONS)})")
        super().__setattr__(name, value)

    def __call__(self, **kwargs: Any) -> None:
        """Set several options at once: ``shmproxy.rc(threads=False, errors="fatal")``."""
        for key in kwargs:
            if key not in _OPTIONS:
                raise TypeError(f"shmproxy.rc: unexpected argument {key!r} (the options: {', '.join(_OPTIONS)})")
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return "<shmproxy.rc>"


sys.modules[__name__].__class__ = _Rc
