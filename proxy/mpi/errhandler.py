"""MPI.Errhandler: the error-handler handles and the handler each communicator holds.

shmproxy raises every error of a call as an MPI.Exception, whichever handler is set (what mpi4py's
default, ERRORS_RETURN, gives a program): the handler a communicator holds is kept so that
Get_errhandler gives back what Set_errhandler set, and Call_errhandler runs it (a handler of the
program's own from Create_errhandler is called with the communicator and the error code;
ERRORS_ARE_FATAL and ERRORS_ABORT abort the communicator on an error code; ERRORS_RETURN does
nothing). As in MPI, a handle is a reference: Free makes the handle null (ERRHANDLER_NULL), not the
handler; the predefined handles pickle by name and unpickle as themselves.
"""
from __future__ import annotations

from typing import Any, Callable

from shmproxy.mpi.exceptions import ERR_ARG, ERR_COMM, ERR_INTERN, SUCCESS, as_int, error

# MPI implementations hold user error handlers in a fixed table; mpi4py's tests expect the 33rd live
# one to be refused (an MPI.Exception, a RuntimeError), as MPICH and Open MPI do.
MAX_USER_ERRHANDLERS = 32


class _Handler:
    """One error handler; every handle of it shares this object."""

    __slots__ = ("name", "fn", "refs", "index")

    def __init__(self, name: str | None, fn: Callable[[Any, int], Any] | None, index: int):
        self.name, self.fn, self.refs, self.index = name, fn, 0, index


_RETURN = _Handler("ERRORS_RETURN", None, 2)
_FATAL = _Handler("ERRORS_ARE_FATAL", None, 1)
_ABORT = _Handler("ERRORS_ABORT", None, 3)
_BY_INDEX: dict[int, _Handler] = {h.index: h for h in (_RETURN, _FATAL, _ABORT)}
_next_index = [16]


class Errhandler:
    """An error-handler handle (mpi4py's MPI.Errhandler). ``Errhandler()`` is a null handle,
    ``Errhandler(eh)`` a second handle to ``eh``'s handler."""

    __slots__ = ("_h", "__weakref__")
    __module__ = "shmproxy.MPI"     # pickles name "shmproxy.MPI.ERRORS_RETURN" and so on

    def __init__(self, errhandler: "Errhandler | None" = None) -> None:
        if errhandler is not None and not isinstance(errhandler, Errhandler):
            raise TypeError(f"MPI.Errhandler() takes an MPI.Errhandler, not {type(errhandler).__name__}")
        self._h: _Handler | None = None if errhandler is None else errhandler._h

    @classmethod
    def _of(cls, h: _Handler | None) -> "Errhandler":
        eh = cls()
        eh._h = h
        return eh

    def Free(self) -> None:
        """The handle becomes ERRHANDLER_NULL (a predefined constant stays itself, as in mpi4py)."""
        h = self._h
        if h is None:
            raise error(ERR_ARG, "Errhandler.Free of MPI.ERRHANDLER_NULL")
        if self in _CONSTANTS_IDS:
            return
        if h.fn is not None and h.refs > 0:
            h.refs -= 1
            if h.refs == 0:
                _BY_INDEX.pop(h.index, None)
        self._h = None

    def free(self) -> None:
        if self._h is not None:
            self.Free()

    def __bool__(self) -> bool:
        return self._h is not None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Errhandler):
            return NotImplemented
        return self._h is other._h

    __hash__ = None  # type: ignore[assignment]  # as mpi4py: a handle's handler changes under Free

    def toint(self) -> int:
        """A number naming the handler while a handle of it lives (0 for the null handle)."""
        if self._h is None:
            return 0
        _BY_INDEX.setdefault(self._h.index, self._h)
        return self._h.index

    py2f = toint

    @classmethod
    def fromint(cls, handle: int) -> "Errhandler":
        n = as_int(handle, "Errhandler.fromint: handle")
        if n == 0:
            return cls()
        h = _BY_INDEX.get(n)
        if h is None:
            raise error(ERR_ARG, f"no error handler has the handle {n}")
        return cls._of(h)

    f2py = fromhandle = fromint

    @property
    def handle(self) -> int:
        return self.toint()

    def __reduce__(self) -> Any:
        for name, const in _CONSTANTS.items():
            if self is const:
                return name
        if self._h is None:
            return (type(self), ())     # type(self): a subclass of the program's unpickles as itself
        if self._h.fn is not None:
            raise ValueError(f"cannot pickle {self!r}: a handler of the program's own is no value to send")
        return (type(self), (_CONSTANTS[self._h.name or ""],))

    def __repr__(self) -> str:
        h = self._h
        if h is None:
            return "<MPI.ERRHANDLER_NULL>"
        return f"<MPI.{h.name}>" if h.name else f"<MPI.Errhandler {h.fn!r}>"


ERRORS_RETURN = Errhandler._of(_RETURN)
ERRORS_ARE_FATAL = Errhandler._of(_FATAL)
ERRORS_ABORT = Errhandler._of(_ABORT)
ERRHANDLER_NULL = Errhandler()
_CONSTANTS = {"ERRORS_RETURN": ERRORS_RETURN, "ERRORS_ARE_FATAL": ERRORS_ARE_FATAL,
              "ERRORS_ABORT": ERRORS_ABORT, "ERRHANDLER_NULL": ERRHANDLER_NULL}


class _IdSet:
    """Membership by identity (Errhandler has no hash and compares by handler)."""

    def __contains__(self, obj: object) -> bool:
        return any(obj is c for c in _CONSTANTS.values())


_CONSTANTS_IDS = _IdSet()

# the handler each communicator holds, by the id of its native communicator (two handles of one
# communicator share it); mpi4py sets ERRORS_RETURN on every communicator, which is the default here
_HELD: dict[int, _Handler] = {}


def create(fn: Callable[[Any, int], Any]) -> Errhandler:
    if not callable(fn):
        raise TypeError(f"Create_errhandler takes a function (comm, error_code), not {type(fn).__name__}")
    live = sum(1 for h in _BY_INDEX.values() if h.fn is not None)
    if live >= MAX_USER_ERRHANDLERS:
        raise error(ERR_INTERN, f"Create_errhandler: {MAX_USER_ERRHANDLERS} error handlers of the program's "
                    "own are in use (free some)")
    _next_index[0] += 1
    h = _Handler(None, fn, _next_index[0])
    h.refs = 1
    _BY_INDEX[h.index] = h
    return Errhandler._of(h)


def get(native: Any) -> Errhandler:
    """A new handle to the handler ``native``'s communicator holds (the caller Frees it)."""
    h = _HELD.get(id(native), _RETURN)
    if h.fn is not None:
        h.refs += 1
    return Errhandler._of(h)


def set_(native: Any, errhandler: Any) -> None:
    if not isinstance(errhandler, Errhandler):
        raise TypeError(f"Set_errhandler takes an MPI.Errhandler, not {type(errhandler).__name__}")
    if errhandler._h is None:
        raise error(ERR_ARG, "Set_errhandler(MPI.ERRHANDLER_NULL): not an error handler")
    _HELD[id(native)] = errhandler._h


def forget(native: Any) -> None:
    """The communicator was freed: its handler goes with it."""
    _HELD.pop(id(native), None)


def call(comm: Any, native: Any, errorcode: Any) -> None:
    """Call_errhandler: run the handler ``comm`` holds for ``errorcode``."""
    code = as_int(errorcode, "Call_errhandler: errorcode")
    h = _HELD.get(id(native), _RETURN)
    if h.fn is not None:
        h.fn(comm, code)
    elif h is not _RETURN and code != SUCCESS:
        comm.Abort(code)


def check_comm_error(what: str) -> Exception:
    return error(ERR_COMM, f"{what}: invalid communicator (MPI.COMM_NULL, or freed)")
