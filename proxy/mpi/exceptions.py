"""MPI error classes and ``MPI.Exception``, mapped from shmproxy's own errors (shmproxy.core.errors).

An mpi4py program catches ``MPI.Exception`` and asks ``Get_error_class()``; a shmproxy program
catches ``shmproxy.Timeout`` or ``ValueError``. Both must keep working for the same failure, so an
error of the native layer is re-raised as a class that derives from *both* MPI.Exception and the
native class (made once per native class, cached): ``except MPI.Exception`` and ``except
shmproxy.Timeout`` catch the same object, and the native attributes (``rank``, ``pid``, ``errno``)
are kept. Calls that shmproxy does not have raise ``NotImplementedError`` that is also an
MPI.Exception of class ERR_UNSUPPORTED_OPERATION, naming what is missing.

The numeric values of the error classes follow the order of the MPI standard's table; programs
compare against the constants, never against numbers.
"""
from __future__ import annotations

import operator
from typing import Any, NoReturn

import numpy as np

from shmproxy.core import errors

SUCCESS = 0
ERR_BUFFER = 1
ERR_COUNT = 2
ERR_TYPE = 3
ERR_TAG = 4
ERR_COMM = 5
ERR_RANK = 6
ERR_ROOT = 7
ERR_GROUP = 8
ERR_OP = 9
ERR_TOPOLOGY = 10
ERR_DIMS = 11
ERR_ARG = 12
ERR_UNKNOWN = 13
ERR_TRUNCATE = 14
ERR_OTHER = 15
ERR_INTERN = 16
ERR_IN_STATUS = 17
ERR_PENDING = 18
ERR_REQUEST = 19
ERR_KEYVAL = 48
ERR_NO_MEM = 34
ERR_INFO = 28
ERR_WIN = 45
ERR_SPAWN = 42
ERR_PORT = 38
ERR_UNSUPPORTED_OPERATION = 52
ERR_FILE = 27             # the classes of objects shmproxy lacks (files, sessions): their null
ERR_SESSION = 78          # handles name them in errors, as MPI does
ERR_ERRHANDLER = 79
ERR_PROC_FAILED = 75      # as ULFM's MPIX_ERR_PROC_FAILED: a peer or the progress process died
ERR_REVOKED = 77          # as ULFM's MPIX_ERR_REVOKED: the communicator was aborted
ERR_LASTCODE = 100

_NAMES = {v: k for k, v in globals().items() if k.startswith("ERR_") or k == "SUCCESS"}


def Get_error_string(errorcode: int) -> str:
    """The name of an error class, as MPI_Error_string gives a short text."""
    return _NAMES.get(int(errorcode), f"unknown error {errorcode}")


def Get_error_class(errorcode: int) -> int:
    """Error codes are error classes here (no implementation-specific codes)."""
    return int(errorcode)


class Exception(RuntimeError):  # noqa: A001 - the name is mpi4py's: MPI.Exception
    """An MPI error, with its error class (``Get_error_class()``, ``error_class``)."""

    default_class = ERR_OTHER

    def __init__(self, message: Any = None, error_class: int | None = None, *rest: Any):
        if isinstance(message, int) and error_class is None:   # MPI.Exception(MPI.ERR_ARG), as in mpi4py
            message, error_class = Get_error_string(message), message
        super().__init__(message, *rest) if message is not None else super().__init__()
        self.error_class = self.default_class if error_class is None else int(error_class)

    @property
    def error_code(self) -> int:
        return self.error_class

    @property
    def error_string(self) -> str:
        return str(self) or Get_error_string(self.error_class)

    def Get_error_class(self) -> int:
        return self.error_class

    def Get_error_code(self) -> int:
        return self.error_class

    def Get_error_string(self) -> str:
        return self.error_string

    def __int__(self) -> int:
        return self.error_class

    def __eq__(self, other: object) -> bool:
        if isinstance(other, int):
            return self.error_class == other
        return other is self

    __hash__ = RuntimeError.__hash__


class Unsupported(Exception, NotImplementedError):
    """A call of mpi4py's API that shmproxy does not provide (yet)."""

    default_class = ERR_UNSUPPORTED_OPERATION


def unsupported(what: str, why: str = "") -> NoReturn:
    """Raise NotImplementedError (an MPI.Exception too) naming the missing call and, if known, why."""
    raise Unsupported(f"shmproxy.MPI: {what} is not supported" + (f": {why}" if why else ""))


def error(error_class: int, message: str) -> Exception:
    """An MPI.Exception for an argument the MPI layer itself refused (before anything was posted).
    It is also a ValueError, like the native layer's InvalidArgument."""
    return _combined(errors.InvalidArgument)(message, error_class)


def buffer_error(message: str) -> Exception:
    """An ERR_BUFFER MPI.Exception that is also Python's BufferError (as mpi4py raises for a buffer
    it cannot describe, e.g. one not in this machine's byte order)."""
    base = _combined(errors.InvalidArgument)
    cls = _COMBINED.get(BufferError)
    if cls is None:
        cls = _COMBINED[BufferError] = type(base.__name__, (base, BufferError), {"__module__": "shmproxy.MPI"})
    return cls(message, ERR_BUFFER)


def type_error(error_class: int, message: str) -> Exception:
    """An MPI.Exception for an argument of the wrong type: also Python's TypeError (what mpi4py raises
    for a non-integer rank or count) and ValueError (as error())."""
    base = _combined(errors.InvalidArgument)
    cls = _COMBINED.get(TypeError)
    if cls is None:
        cls = _COMBINED[TypeError] = type(base.__name__, (base, TypeError), {"__module__": "shmproxy.MPI"})
    return cls(message, error_class)


def as_int(v: Any, what: str, error_class: int = ERR_ARG) -> int:
    """The integer an argument stands for, read as mpi4py reads one (``operator.index``): an int, a
    bool, a numpy integer, a 0-d integer array, any object with ``__index__``. numpy's bool lost
    ``__index__`` in numpy 2, yet mpi4py's C int arguments take it (``Split(color=np.True_)``), so it
    is read too. Anything else (floats, strings, None, sequences) raises ``type_error``."""
    if type(v) is int:
        return v
    try:
        return operator.index(v)
    except TypeError:
        if isinstance(v, np.bool_) or (isinstance(v, np.ndarray) and v.shape == () and v.dtype == np.bool_):
            return int(v)
        raise type_error(error_class, f"{what} must be an integer, got {type(v).__name__} "
                         f"{v!r:.40}") from None


def is_integral(v: Any) -> bool:
    """mpi4py's ``is_integral``: one integer (an object with ``__index__`` that is not a sequence with a
    length: an int, a numpy integer, a 0-d array), as opposed to a sequence of them; numpy's bool
    counts as one (as_int)."""
    if isinstance(v, (list, tuple)):
        return False
    if isinstance(v, np.ndarray):
        return v.ndim == 0
    return isinstance(v, (int, np.integer, np.bool_)) or hasattr(type(v), "__index__")


# native class -> MPI error class; the first base found in a class's MRO decides
_CLASS_OF: dict[type, int] = {
    errors.TruncationError: ERR_TRUNCATE,
    errors.InvalidArgument: ERR_ARG,
    errors.InvalidUsage: ERR_OTHER,
    errors.PeerDiedError: ERR_PROC_FAILED,
    errors.Timeout: ERR_PENDING,
    errors.Closed: ERR_COMM,
    errors.Aborted: ERR_REVOKED,
    errors.InternalError: ERR_INTERN,
    errors.SystemError_: ERR_OTHER,
    errors.RemoteError: ERR_OTHER,
    errors.ProxyError: ERR_OTHER,
}
_COMBINED: dict[type, type] = {}


def _combined(native: type) -> type:
    cls = _COMBINED.get(native)
    if cls is None:
        error_class = next(_CLASS_OF[c] for c in native.__mro__ if c in _CLASS_OF)

        def init(self: Any, message: Any = None, error_class: int | None = None) -> None:
            Exception.__init__(self, message, error_class)

        cls = type(native.__name__, (Exception, native),
                   {"default_class": error_class, "__init__": init, "__module__": "shmproxy.MPI",
                    "__doc__": f"shmproxy.{native.__name__} as an MPI.Exception"})
        _COMBINED[native] = cls
    return cls


def convert(exc: BaseException) -> BaseException:
    """The MPI.Exception for a native error (same message, cause and attributes); others unchanged."""
    if isinstance(exc, Exception) or not isinstance(exc, errors.ProxyError):
        return exc
    new = _combined(type(exc))(str(exc))
    for name in ("rank", "pid", "errno", "marker"):
        if name in exc.__dict__:
            setattr(new, name, exc.__dict__[name])
    new.__cause__ = exc.__cause__
    new.__traceback__ = exc.__traceback__
    return new
