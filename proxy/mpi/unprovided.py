"""MPI.Win, MPI.File, MPI.Session: handle classes of features shmproxy does not provide.

One-sided windows, MPI-IO and sessions are not part of shmproxy, but mpi4py programs (and mpi4py's
tests) compare against WIN_NULL, FILE_NULL and SESSION_NULL, subclass these classes, and try a
constructor to learn whether the feature exists. So each class is real and minimal: its only
objects are null handles (``Win()``, ``Win(WIN_NULL)``), which compare, pickle, take weak references
and refuse hashing as mpi4py's handles do; every constructor (Win.Create, File.Open, Session.Init)
and every operation raises NotImplementedError (an MPI.Exception of class ERR_UNSUPPORTED_OPERATION)
naming the missing feature. The data-movement calls of windows (Put, Get, Accumulate, ...) first
read their origin and target arguments as mpi4py does, so that a malformed message is still a
ValueError, as it would be with windows; only then do they say windows are missing.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

from shmproxy.mpi.exceptions import ERR_ARG, ERR_FILE, ERR_SESSION, ERR_WIN, error, unsupported
from shmproxy.mpi.handles import HandleNumber, Numbers

_ONE_SIDED = "one-sided windows (MPI_Win) are not part of shmproxy"
_MPI_IO = "MPI-IO is not part of shmproxy"
_SESSIONS = "MPI sessions are not part of shmproxy (COMM_WORLD is the world model)"


class _Unprovided(HandleNumber):
    """The handle model shared by the three classes (each object is a null handle: no constructor
    of a live one exists)."""

    __slots__ = ("__weakref__",)
    _why = ""
    _null_name = ""
    _numbers: Numbers

    def __new__(cls, handle: Any = None) -> Any:
        # the class itself, not a subclass: MyWin(MPI.Win) must also take a handle of MPI.Win
        base = _BASES[cls._null_name]
        if handle is not None and not isinstance(handle, base):
            raise TypeError(f"MPI.{base.__name__}() takes an MPI.{base.__name__}, not {type(handle).__name__}")
        return object.__new__(cls)

    def __init__(self, handle: Any = None) -> None:
        pass    # __new__ checked it; there is no state: every object is a null handle

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _BASES[self._null_name]):
            return NotImplemented
        return True     # both null handles

    __hash__ = None  # type: ignore[assignment]  # as mpi4py's handles

    def __repr__(self) -> str:
        return f"<MPI.{self._null_name}>"

    def __reduce__(self) -> Any:
        if self is _NULLS.get(self._null_name):
            return self._null_name
        return (type(self), ())

    # handle numbers: 0 names the null handle, the only one there is
    @property
    def handle(self) -> int:
        return 0

    @classmethod
    def fromhandle(cls, handle: Any) -> Any:
        cls._numbers.lookup(handle)    # raises for anything but 0
        return cls()

    def free(self) -> None:
        """mpi4py's safe free: nothing to do on a null handle."""


def _refuse(cls_name: str, name: str, why: str, check: Callable[..., None] | None = None,
            static: bool = False) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        if check is not None:
            check(*(args if static else args[1:]), **kwargs)
        unsupported(f"{cls_name}.{name}", why)
    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"Not provided: {why}."
    return classmethod(lambda cls, *a, **k: call(cls, *a, **k)) if static else call


def _target(target: Any) -> None:
    """A window's target argument, read as mpi4py reads it: None, an integral displacement, or a
    list/tuple (displacement[, count[, datatype]])."""
    from shmproxy.mpi.datatypes import Datatype
    if target is None:
        return
    if isinstance(target, (list, tuple)):
        if len(target) > 3:
            raise error(ERR_ARG, "target: expecting 3 items at most (displacement, count, datatype), "
                        f"got {len(target)}")
        for v, what in zip(target[:2], ("displacement", "count")):
            if v is not None:
                operator.index(v)     # TypeError, as mpi4py's
        if len(target) == 3 and target[2] is not None and not isinstance(target[2], Datatype):
            raise TypeError(f"target: the datatype must be an MPI.Datatype, not {type(target[2]).__name__}")
        return
    try:
        operator.index(target)
    except TypeError:
        raise error(ERR_ARG, "target: expecting an integral displacement or a list/tuple "
                    f"(displacement, count, datatype), not {type(target).__name__}") from None


def _rma_check(readonly: bool, n_buffers: int) -> Callable[..., None]:
    """The argument check of one data-movement call: its ``n_buffers`` buffer specs (the first is
    read when ``readonly``, the others written), the target rank and the target."""
    def check(*args: Any, **kwargs: Any) -> None:
        from shmproxy.mpi.buffers import parse
        names = ["origin", "result"][:n_buffers] if n_buffers <= 2 else ["origin", "compare", "result"]
        bound = dict(zip(names + ["target_rank", "target"], args))
        bound.update(kwargs)
        for name in names:
            parse(bound.get(name), f"{name} buffer", name == "result" or (name == "origin" and not readonly))
        if "target_rank" in bound:
            operator.index(bound["target_rank"])
        _target(bound.get("target"))
    return check


class Win(_Unprovided):
    """A one-sided window handle: only WIN_NULL exists (see the module header)."""

    __slots__ = ()
    _why = _ONE_SIDED
    _null_name = "WIN_NULL"
    _numbers = Numbers("window", ERR_WIN)


class File(_Unprovided):
    """An MPI-IO file handle: only FILE_NULL exists (see the module header)."""

    __slots__ = ()
    _why = _MPI_IO
    _null_name = "FILE_NULL"
    _numbers = Numbers("file", ERR_FILE)


class Session(_Unprovided):
    """An MPI session handle: only SESSION_NULL exists (see the module header)."""

    __slots__ = ()
    _why = _SESSIONS
    _null_name = "SESSION_NULL"
    _numbers = Numbers("session", ERR_SESSION)


_BASES: dict[str, type] = {"WIN_NULL": Win, "FILE_NULL": File, "SESSION_NULL": Session}

# mpi4py's API of each class: constructors (class methods) and operations (methods)
_ERRHANDLING = ("Get_errhandler", "Set_errhandler", "Call_errhandler", "Get_attr", "Set_attr",
                "Delete_attr", "Get_name", "Set_name", "Get_info", "Set_info", "Get_group")
_API: dict[type[_Unprovided], tuple[tuple[str, ...], tuple[str, ...]]] = {
    Win: (("Create", "Allocate", "Allocate_shared", "Create_dynamic", "Create_keyval", "Free_keyval",
           "Create_errhandler"),
          _ERRHANDLING + ("Free", "Attach", "Detach", "Shared_query", "Fence", "Start", "Complete", "Post",
                          "Wait", "Test", "Lock", "Unlock", "Lock_all", "Unlock_all", "Flush", "Flush_all",
                          "Flush_local", "Flush_local_all", "Sync", "tomemory")),
    File: (("Open", "Delete", "Create_errhandler"),
           _ERRHANDLING + ("Close", "Get_size", "Set_size", "Preallocate", "Get_amode", "Set_view", "Get_view",
                           "Read_at", "Read_at_all", "Write_at", "Write_at_all", "Iread_at", "Iread_at_all",
                           "Iwrite_at", "Iwrite_at_all", "Read", "Read_all", "Write", "Write_all", "Iread",
                           "Iread_all", "Iwrite", "Iwrite_all", "Seek", "Get_position", "Get_byte_offset",
                           "Read_shared", "Write_shared", "Iread_shared", "Iwrite_shared", "Read_ordered",
                           "Write_ordered", "Seek_shared", "Get_position_shared", "Read_at_all_begin",
                           "Read_at_all_end", "Write_at_all_begin", "Write_at_all_end", "Read_all_begin",
                           "Read_all_end", "Write_all_begin", "Write_all_end", "Read_ordered_begin",
                           "Read_ordered_end", "Write_ordered_begin", "Write_ordered_end", "Get_type_extent",
                           "Set_atomicity", "Get_atomicity", "Sync")),
    Session: (("Init", "Create_errhandler"),
              ("Get_errhandler", "Set_errhandler", "Call_errhandler", "Finalize", "Get_num_psets",
               "Get_nth_pset", "Get_info", "Get_pset_info", "Create_group", "Attach_buffer", "Detach_buffer",
               "Flush_buffer", "Iflush_buffer")),
}
# the window calls that move data: (origin read-only?, how many buffer specs come before the rank)
_RMA: dict[str, tuple[bool, int]] = {
    "Put": (True, 1), "Get": (False, 1), "Accumulate": (True, 1), "Get_accumulate": (True, 2),
    "Fetch_and_op": (True, 2), "Compare_and_swap": (True, 3), "Rput": (True, 1), "Rget": (False, 1),
    "Raccumulate": (True, 1), "Rget_accumulate": (True, 2),
}

for _cls, (_classmethods, _methods) in _API.items():
    for _name in _classmethods:
        setattr(_cls, _name, _refuse(_cls.__name__, _name, _cls._why, static=True))
    for _name in _methods:
        setattr(_cls, _name, _refuse(_cls.__name__, _name, _cls._why))
for _name, (_readonly, _nbuf) in _RMA.items():
    setattr(Win, _name, _refuse("Win", _name, _ONE_SIDED, _rma_check(_readonly, _nbuf)))

# mpi4py's properties of the handles (win.group, file.size, ...): reading one is an operation too
for _cls, _props in ((Win, ("attrs", "flavor", "model", "info", "group", "group_size", "group_rank", "name")),
                     (File, ("size", "amode", "atomicity", "info", "group", "group_size", "group_rank")),
                     (Session, ("info",))):
    for _name in _props:
        # (mypy cannot infer a lambda whose defaults bind the loop variables against property's fget)
        setattr(_cls, _name, property(lambda self, _n=_name, _c=_cls: unsupported(  # type: ignore[misc]
            f"{_c.__name__}.{_n}", _c._why)))

WIN_NULL = Win()
FILE_NULL = File()
SESSION_NULL = Session()
_NULLS: dict[str, Any] = {"WIN_NULL": WIN_NULL, "FILE_NULL": FILE_NULL, "SESSION_NULL": SESSION_NULL}
