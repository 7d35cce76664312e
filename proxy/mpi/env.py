"""The environment: COMM_WORLD, COMM_SELF, Init/Finalize, clocks, threads, what is not provided.

COMM_WORLD joins the job (``shmproxy.init()``) on its first use, or at ``Init()``, not at import:
importing ``shmproxy.MPI`` starts nothing. COMM_SELF is created on its first use only, because a
native communicator of one rank has a progress process of its own (comm._member_comm); its rank and
size are known without it. ``Finalize()`` closes both (pending sends complete first, as
MPI_Finalize requires); a program that never calls it is finalised at exit by the native layer.

Threads: a native Comm is used by one thread at a time, so the level is THREAD_SERIALIZED;
Init_thread returns the lower of what was asked and that, and so does a plain or implicit Init for
the level mpi4py's runtime configuration asks for (shmproxy.rc: thread_level, threads; its
``errors`` picks the handler COMM_WORLD and COMM_SELF hold). The main thread (Is_thread_main) is
the one that called Init or Init_thread; when the job is joined on first use, the Python main
thread, where mpi4py initialises MPI (at import).
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Any

from shmproxy.core import errors
from shmproxy.mpi import attributes, bsend
from shmproxy.mpi.comm import Comm, Intracomm, _member_comm, cached_native
from shmproxy.mpi.exceptions import (ERR_ARG, ERR_COMM, ERR_FILE, ERR_OTHER, ERR_SESSION, ERR_WIN, as_int, convert,
                                     error, unsupported)

THREAD_SINGLE, THREAD_FUNNELED, THREAD_SERIALIZED, THREAD_MULTIPLE = 0, 1, 2, 3
_PROVIDED = THREAD_SERIALIZED
VERSION, SUBVERSION = 3, 1
MAX_PROCESSOR_NAME = 256
MAX_ERROR_STRING = 512
MAX_LIBRARY_VERSION_STRING = 8192
COMM_TYPE_SHARED = 1

_state: dict[str, Any] = {"world": None, "self": None, "initialized": False, "finalized": False,
                          "thread_level": None, "main_thread": None}
_LEVELS = {"single": THREAD_SINGLE, "funneled": THREAD_FUNNELED, "serialized": THREAD_SERIALIZED,
           "multiple": THREAD_MULTIPLE}
_RC_ERRHANDLERS = {"exception": "ERRORS_RETURN", "default": "ERRORS_RETURN", "abort": "ERRORS_ABORT",
                   "fatal": "ERRORS_ARE_FATAL"}


# the error handlers live in errhandler.py; MPI.ERRORS_RETURN and the others are re-exported here
from shmproxy.mpi.errhandler import (ERRHANDLER_NULL, ERRORS_ABORT, ERRORS_ARE_FATAL,  # noqa: E402,F401
                                     ERRORS_RETURN, Errhandler)


def _native_world() -> Any:
    if _state["finalized"]:
        raise error(ERR_OTHER, "MPI was finalized: COMM_WORLD cannot be used any more")
    c = _state["world"]
    if c is None:
        _init(threading.main_thread())
        c = _state["world"]
    return c


class _World(Intracomm):
    """COMM_WORLD: joins the job on first use."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        if name != "_c" or self is not COMM_WORLD:   # a second handle made null by free() stays null
            return super().__getattr__(name)
        c = _native_world()
        object.__setattr__(self, "_c", c)
        if not self._wranks:
            object.__setattr__(self, "_wranks", tuple(range(c.size)))
        return c

    def Free(self) -> None:
        raise error(ERR_COMM, "COMM_WORLD cannot be freed (call MPI.Finalize)")

    def __bool__(self) -> bool:
        return not _state["finalized"] if self is COMM_WORLD else super().__bool__()


class _SelfAttrs:
    """What COMM_SELF's attributes are filed under (attributes.py), with or without its native
    communicator."""

    __slots__ = ("__weakref__",)


class _Self(Intracomm):
    """COMM_SELF: rank 0 of 1; its native communicator is made on first communication."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        if name != "_c" or self is not COMM_SELF:   # a second handle made null by free() stays null
            return super().__getattr__(name)
        world = _native_world()
        c = _state["self"]
        if c is None:
            try:
                c = _state["self"] = _member_comm(world, [world.rank], "self")
            except errors.ProxyError as exc:
                raise convert(exc) from None
        object.__setattr__(self, "_c", c)
        object.__setattr__(self, "_wranks", (world.rank,))
        return c

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def Get_group(self) -> Any:
        from shmproxy.mpi.group import Group
        me = _native_world().rank
        return Group((me,), me)

    def Free(self) -> None:
        raise error(ERR_COMM, "COMM_SELF cannot be freed (call MPI.Finalize)")

    def _eh_key(self) -> object:
        # its handler is kept without making the native communicator (a progress process of its own)
        return "COMM_SELF"

    def _attr_owner(self) -> Any:
        # its attributes too (MPI programs hang finalisation hooks on COMM_SELF, run by Finalize)
        return _SELF_ATTRS

    def __bool__(self) -> bool:
        return not _state["finalized"] if self is COMM_SELF else super().__bool__()


_SELF_ATTRS = _SelfAttrs()
COMM_WORLD = _World(None, (), "MPI_COMM_WORLD")
COMM_SELF = _Self(None, (), "MPI_COMM_SELF")


def Get_hw_resource_info() -> Any:
    """MPI 4.1's hardware resources of this process, as an Info: the host and its CPU count."""
    import os
    from shmproxy.mpi.info import Info
    return Info.Create({"mpi_hw_resource_type": "host", "host": socket.gethostname(),
                        "ncpus": str(os.cpu_count() or 1)})


def Init() -> None:
    """Join the job (shmproxy.init()), at the thread level shmproxy.rc asks for. Idempotent; an error
    after Finalize."""
    _init(threading.current_thread())


def _init(main: threading.Thread) -> None:
    if _state["finalized"]:
        raise error(ERR_OTHER, "MPI.Init after MPI.Finalize")
    if _state["world"] is None:
        level, handler = _rc_thread_level(), _rc_errhandler()   # a bad option fails before the join
        import shmproxy
        try:
            _state["world"] = shmproxy.init()
        except errors.ProxyError as exc:
            raise convert(exc) from None
        _started(main, level, handler)


def _started(main: threading.Thread, level: int, handler: Any) -> None:
    _state["initialized"] = True
    _state["main_thread"] = main.ident
    if _state["thread_level"] is None:
        _state["thread_level"] = min(level, _PROVIDED)
    if handler is not ERRORS_RETURN:    # the layer's default: nothing to file
        from shmproxy.mpi import errhandler
        for comm in (COMM_WORLD, COMM_SELF):
            errhandler.set_(comm._eh_key(), handler)


def _rc_thread_level() -> int:
    from shmproxy import rc
    if not rc.threads:
        return THREAD_SINGLE
    level = _LEVELS.get(str(rc.thread_level).lower())
    if level is None:
        raise error(ERR_ARG, f"shmproxy.rc.thread_level = {rc.thread_level!r}: one of {', '.join(_LEVELS)}")
    return level


def _rc_errhandler() -> Any:
    from shmproxy import rc
    from shmproxy.mpi import errhandler
    name = _RC_ERRHANDLERS.get(str(rc.errors).lower())
    if name is None:
        raise error(ERR_ARG, f"shmproxy.rc.errors = {rc.errors!r}: one of {', '.join(_RC_ERRHANDLERS)}")
    return getattr(errhandler, name)


def attach_world(comm: Any) -> None:
    """shmproxy's own, not mpi4py's: make ``comm``, a native communicator this process already has
    (from ``shmproxy.init()``, or its Dup), this layer's COMM_WORLD, for a program that joined through
    the native API first (a second ``shmproxy.init()`` would try to join the job again). Before any
    use of COMM_WORLD; Finalize then closes ``comm``."""
    if _state["finalized"] or _state["world"] is not None:
        raise error(ERR_OTHER, "attach_world: COMM_WORLD is already joined (or finalized)")
    level, handler = _rc_thread_level(), _rc_errhandler()
    _state["world"] = comm
    _started(threading.main_thread(), level, handler)


def Init_thread(required: int = THREAD_MULTIPLE) -> int:
    """Init, and the thread level provided: at most THREAD_SERIALIZED (see the header)."""
    required = as_int(required, "Init_thread: required")
    _init(threading.current_thread())
    _state["thread_level"] = min(required, _PROVIDED)
    return _state["thread_level"]


def Query_thread() -> int:
    """The level provided; before the job is joined, the one Init would provide (shmproxy.rc's)."""
    level = _state["thread_level"]
    return min(_rc_thread_level(), _PROVIDED) if level is None else level


def Is_thread_main() -> bool:
    """Whether this is the thread that initialised MPI (module header)."""
    main = _state["main_thread"]
    if main is None:
        main = threading.main_thread().ident
    return threading.get_ident() == main


def Is_initialized() -> bool:
    return bool(_state["initialized"])


def Is_finalized() -> bool:
    return bool(_state["finalized"])


def Finalize() -> None:
    """Run COMM_SELF's attribute delete callbacks, then close COMM_SELF and COMM_WORLD on this rank
    (their pending sends complete first)."""
    if _state["finalized"]:
        return
    # MPI_Finalize first frees COMM_SELF's attributes, while MPI is still usable: their delete
    # callbacks are the program's finalisation hooks
    attributes.free_all(_SELF_ATTRS, COMM_SELF, "MPI.Finalize")
    _state["finalized"] = True
    first: BaseException | None = None
    for key, comm in (("self", COMM_SELF), ("world", COMM_WORLD)):
        native, _state[key] = _state[key], None
        _forget(comm)
        if native is not None:
            try:
                native.close()
            except errors.ProxyError as exc:
                first = first or convert(exc)
    if first is not None:
        raise first


def _forget(comm: Intracomm) -> None:
    """Drop the native communicator a wrapper cached, if it cached one (reading the slot directly:
    ``comm._c`` would initialise it)."""
    if cached_native(comm) is not None:
        Comm.__dict__["_c"].__delete__(comm)


def Wtime() -> float:
    """Seconds on a monotonic clock (not synchronised between ranks: WTIME_IS_GLOBAL is false)."""
    return time.monotonic()


def Wtick() -> float:
    return time.get_clock_info("monotonic").resolution


def Get_processor_name() -> str:
    return socket.gethostname()


def Get_version() -> tuple[int, int]:
    """The MPI version whose API this layer follows (a subset of it: see the README)."""
    return VERSION, SUBVERSION


def Get_library_version() -> str:
    import shmproxy
    return f"shmproxy {shmproxy.__version__} (mpi4py-style layer over the native API)"


def get_vendor() -> tuple[str, tuple[int, int, int]]:
    """mpi4py's (name, (major, minor, micro)) of the MPI library: here shmproxy's own version, so
    that vendor-specific workarounds for real MPI libraries never apply to it."""
    import shmproxy
    parts = [int(p) if p.isdigit() else 0 for p in str(shmproxy.__version__).split(".")[:3]]
    return "shmproxy", tuple((parts + [0, 0, 0])[:3])  # type: ignore[return-value]


def Pcontrol(level: int) -> None:
    """Profiling control: nothing to do."""


def _missing(what: str, why: str) -> Any:
    def fn(*_a: Any, **_k: Any) -> Any:
        unsupported(what, why)
    fn.__name__ = what.rsplit(".", 1)[-1]
    fn.__doc__ = f"Not provided: {why}."
    return fn


_ONE_SIDED = "one-sided windows and MPI memory are not part of shmproxy yet"
_DYNAMIC = "dynamic processes and ports are not part of shmproxy"
Open_port = _missing("Open_port", _DYNAMIC)
Close_port = _missing("Close_port", _DYNAMIC)
Publish_name = _missing("Publish_name", _DYNAMIC)
Unpublish_name = _missing("Unpublish_name", _DYNAMIC)
Lookup_name = _missing("Lookup_name", _DYNAMIC)
Alloc_mem, Free_mem = bsend.alloc_mem, bsend.free_mem
Attach_buffer, Detach_buffer = bsend.attach, bsend.detach


class _MissingMeta(type):
    """Every attribute of a missing class (Win.Create, File.Open, ...) raises NotImplementedError."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        unsupported(f"{cls.__name__}.{name}", cls._why)


def _missing_class(name: str, why: str) -> type:
    def init(self: Any, *_a: Any, **_k: Any) -> None:
        unsupported(name, why)
    return _MissingMeta(name, (), {"_why": why, "__init__": init, "__doc__": f"Not provided: {why}."})


Win = _missing_class("Win", _ONE_SIDED)
File = _missing_class("File", "MPI-IO is not part of shmproxy")
# MPI-IO's access modes (MPICH's values), so that a program builds its mode and then meets File.Open's
# NotImplementedError (mpi4py's tests skip on it) rather than an AttributeError
MODE_CREATE, MODE_RDONLY, MODE_WRONLY, MODE_RDWR = 1, 2, 4, 8
MODE_DELETE_ON_CLOSE, MODE_UNIQUE_OPEN, MODE_EXCL, MODE_APPEND, MODE_SEQUENTIAL = 16, 32, 64, 128, 256
Session = _missing_class("Session", "MPI sessions are not part of shmproxy (COMM_WORLD is the world model)")


class _NullHandle:
    """WIN_NULL, FILE_NULL, SESSION_NULL: the null handles of the classes shmproxy lacks, so that
    programs (and mpi4py's tests) that compare against them or pass them along run; any call on one
    raises MPI.Exception of its class (ERR_WIN, ...), as a call on a null handle does in MPI."""

    __slots__ = ("_name", "_class", "__weakref__")

    def __init__(self, name: str, error_class: int):
        self._name, self._class = name, error_class

    def free(self) -> None:
        """mpi4py's safe free: nothing to do on a null handle."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*_a: Any, **_k: Any) -> Any:
            raise error(self._class, f"MPI.{self._name}.{name}: a call on the null handle")
        return call

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<MPI.{self._name}>"

    def __reduce__(self) -> str:
        return self._name


WIN_NULL = _NullHandle("WIN_NULL", ERR_WIN)
FILE_NULL = _NullHandle("FILE_NULL", ERR_FILE)
SESSION_NULL = _NullHandle("SESSION_NULL", ERR_SESSION)
Intercomm = _missing_class("Intercomm", "intercommunicators do not exist yet")
_NO_GRAPH = "graph topologies need neighbour collectives the engine lacks"
Graphcomm = _missing_class("Graphcomm", _NO_GRAPH)
Distgraphcomm = _missing_class("Distgraphcomm", _NO_GRAPH)
