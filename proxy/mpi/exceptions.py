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
ERR_INFO_KEY = 29         # Info: a key too long / Get_nthkey past the end
ERR_INFO_VALUE = 30
ERR_INFO_NOKEY = 31       # Info.Delete of a key the info lacks
ERR_PROC_FAILED = 75      # as ULFM's MPIX_ERR_PROC_FAILED: a peer or the progress process died
ERR_REVOKED = 77          # as ULFM's MPIX_ERR_REVOKED: the communicator was aborted
ERR_LASTCODE = 100

_NAMES = {v: k for k, v in globals().items() if k.startswith("ERR_") or k == "SUCCESS"}

# Error classes and codes the program adds (MPI_Add_error_class/_code/_string): code -> its class,
# and the strings set on them. They are numbered past ERR_LASTCODE, as MPI requires.
_USER_CLASS_OF: dict[int, int] = {}
_USER_STRING: dict[int, str] = {}
_last_used = [ERR_LASTCODE]


def Get_error_string(errorcode: int) -> str:
    """The name of an error class, as MPI_Error_string gives a short text; for a class or code the
    program added, the string it set ("" until then)."""
    code = int(errorcode)
    if code in _USER_CLASS_OF:
        return _USER_STRING.get(code, "")
    return _NAMES.get(code, f"unknown error {errorcode}")


def Get_error_class(errorcode: int) -> int:
    """Error codes are error classes here, but for codes the program added (Add_error_code)."""
    code = int(errorcode)
    return _USER_CLASS_OF.get(code, code)


def last_used_code() -> int:
    """COMM_WORLD's attribute LASTUSEDCODE: the highest error class or code in use."""
    return _last_used[0]


def Add_error_class() -> int:
    """A new error class, past every predefined one (its string is "" until Add_error_string)."""
    _last_used[0] += 1
    code = _last_used[0]
    _USER_CLASS_OF[code] = code
    return code


def Add_error_code(errorclass: int) -> int:
    """A new error code of ``errorclass`` (a predefined class or one from Add_error_class)."""
    cls = as_int(errorclass, "Add_error_code: errorclass")
    if cls not in _NAMES and _USER_CLASS_OF.get(cls) != cls:
        raise error(ERR_ARG, f"Add_error_code: {cls} is no error class")
    _last_used[0] += 1
    code = _last_used[0]
    _USER_CLASS_OF[code] = cls
    return code


def Add_error_string(errorcode: int, string: str) -> None:
    code = as_int(errorcode, "Add_error_string: errorcode")
    if code not in _USER_CLASS_OF:
        raise error(ERR_ARG, f"Add_error_string: {code} is no error class or code the program added")
    _USER_STRING[code] = str(string)


def _user(code: Any, what: str, is_class: bool) -> int:
    c = as_int(code, what)
    if c not in _USER_CLASS_OF or (_USER_CLASS_OF[c] == c) != is_class:
        raise error(ERR_ARG, f"{what}: {c} is no error {'class' if is_class else 'code'} the program added")
    return c


def Remove_error_class(errorclass: int) -> None:
    """MPI 4.1: only a class with no codes and no string left can go."""
    c = _user(errorclass, "Remove_error_class", True)
    if c in _USER_STRING or any(v == c and k != c for k, v in _USER_CLASS_OF.items()):
        raise error(ERR_ARG, f"Remove_error_class: class {c} still has codes or a string")
    del _USER_CLASS_OF[c]


def Remove_error_code(errorcode: int) -> None:
    c = _user(errorcode, "Remove_error_code", False)
    if c in _USER_STRING:
        raise error(ERR_ARG, f"Remove_error_code: code {c} still has a string")
    del _USER_CLASS_OF[c]


def Remove_error_string(errorcode: int) -> None:
    c = as_int(errorcode, "Remove_error_string")
    if c not in _USER_CLASS_OF:
        raise error(ERR_ARG, f"Remove_error_string: {c} is no error class or code the program added")
    _USER_STRING.pop(c, None)


class Exception(RuntimeError):  # noqa: A001 - the name is mpi4py's: MPI.Exception
    """An MPI error, with its error class (``Get_error_class()``, ``error_class``) and code.

    ``MPI.Exception(ierr)`` behaves as mpi4py's: its str is the error string, its repr
    ``MPI.Exception(ierr)``, and it compares, orders and hashes as its error code (an int); a code
    below SUCCESS is ERR_UNKNOWN. The layer's own errors carry a message instead."""

    default_class = ERR_OTHER

    def __init__(self, message: Any = None, error_class: int | None = None, *rest: Any):
        if error_class is None and hasattr(type(message), "__index__") and not isinstance(message, str):
            # MPI.Exception(MPI.ERR_ARG), as in mpi4py (any object with __index__)
            code = operator.index(message)
            code = ERR_UNKNOWN if code < SUCCESS else code
            message, error_class = Get_error_string(code), code
        super().__init__(message, *rest) if message is not None else super().__init__()
        self.error_code = self.default_class if error_class is None else int(error_class)

    @property
    def error_class(self) -> int:
        return Get_error_class(self.error_code)

    @property
    def error_string(self) -> str:
        return str(self) or Get_error_string(self.error_code)

    def Get_error_class(self) -> int:
        return self.error_class

    def Get_error_code(self) -> int:
        return self.error_code

    def Get_error_string(self) -> str:
        return self.error_string

    def __int__(self) -> int:
        return self.error_code

    def __index__(self) -> int:
        return self.error_code

    def __bool__(self) -> bool:
        return self.error_code != SUCCESS

    def __repr__(self) -> str:
        if type(self) is Exception:
            return f"MPI.Exception({self.error_code})"
        return super().__repr__()

    def _other(self, other: object) -> int | None:
        if isinstance(other, Exception):
            return other.error_code
        if isinstance(other, int):
            return other
        return None

    def __eq__(self, other: object) -> bool:
        o = self._other(other)
        return NotImplemented if o is None else self.error_code == o

    def __ne__(self, other: object) -> bool:
        o = self._other(other)
        return NotImplemented if o is None else self.error_code != o

    def __lt__(self, other: object) -> bool:
        o = self._other(other)
        return NotImplemented if o is None else self.error_code < o

    def __le__(self, other: object) -> bool:
        o = self._other(other)
        return NotImplemented if o is None else self.error_code <= o

    def __gt__(self, other: object) -> bool:
        o = self._other(other)
        return NotImplemented if o is None else self.error_code > o

    def __ge__(self, other: object) -> bool:
        o = self._other(other)
        return NotImplemented if o is None else self.error_code >= o

    def __hash__(self) -> int:
        return hash(self.error_code)


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
    return error_also(ERR_BUFFER, message, BufferError)


def type_error(error_class: int, message: str) -> Exception:
    """An MPI.Exception for an argument of the wrong type: also Python's TypeError (what mpi4py raises
    for a non-integer rank or count) and ValueError (as error())."""
    return error_also(error_class, message, TypeError)


def error_also(error_class: int, message: str, pyclass: type) -> Exception:
    """An MPI.Exception that is also Python's ``pyclass`` (KeyError, IndexError, ...), for a call
    whose plain-Python form raised that before: both ``except`` clauses keep catching it."""
    base = _combined(errors.InvalidArgument)
    cls = _COMBINED.get(pyclass)
    if cls is None:
        cls = _COMBINED[pyclass] = type(base.__name__, (base, pyclass), {"__module__": "shmproxy.MPI"})
    return cls(message, error_class)


def attr_error(error_class: int, message: str) -> Exception:
    """An MPI.Exception for an attribute a null handle lacks: also AttributeError, so that hasattr()
    on a null handle stays False rather than raising."""
    return error_also(error_class, message, AttributeError)


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
