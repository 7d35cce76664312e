"""Handle numbers of the MPI layer's objects, and mpi4py's unsafe handle helpers.

mpi4py gives every handle object a ``handle`` (an integer, 0 for the null handle) and a
``fromhandle`` that turns the integer back into an equal handle. The MPI layer has no C handles, so
the integer here is a number naming the Python object that holds the handle's state while some
object of that handle lives (``id`` of it): it round-trips within this process, which is all a
program can do with it, and it is not an address any C code could use. mpi4py's ``_sizeof`` and
``_addressof`` exist only for ctypes/cffi (the size and address of the C handle inside the object):
there is no C handle, so they raise NotImplementedError naming that.
"""
from __future__ import annotations

import operator
import weakref
from typing import Any

from shmproxy.mpi.exceptions import error, unsupported

_NO_C_HANDLES = "C-level interop: shmproxy.MPI's handles are Python objects, with no C handle to size or address"


class Numbers:
    """The numbers of one handle class: ``number(state)`` names the state object a handle holds
    (None: the null handle, 0) while it lives; ``lookup(n)`` gives it back."""

    __slots__ = ("_what", "_error_class", "_by")

    def __init__(self, what: str, error_class: int) -> None:
        self._what, self._error_class = what, error_class
        # weak: a number must not keep a freed object's state alive
        self._by: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()

    def number(self, state: Any) -> int:
        if state is None:
            return 0
        self._by[id(state)] = state
        return id(state)

    def lookup(self, handle: Any) -> Any:
        """The state a number names; None for 0; ERR_<class> when no live handle has it."""
        n = operator.index(handle)
        if n == 0:
            return None
        state = self._by.get(n)
        if state is None:
            raise error(self._error_class, f"no {self._what} has the handle {n}")
        return state


def _handle_types() -> tuple[type, ...]:
    from shmproxy import MPI
    return (MPI.Datatype, MPI.Request, MPI.Info, MPI.Errhandler, MPI.Group, MPI.Op, MPI.Message, MPI.Comm,
            MPI.Win, MPI.File, MPI.Session, MPI.Status)


def _check(obj: Any, what: str) -> None:
    if not isinstance(obj, _handle_types()) and not (isinstance(obj, type) and issubclass(obj, _handle_types())):
        raise TypeError(f"MPI.{what}() takes an MPI handle object or class, not {type(obj).__name__}")


def _sizeof(obj: Any) -> int:
    """mpi4py's size of the C handle of an object or class: there is none here."""
    _check(obj, "_sizeof")
    unsupported("MPI._sizeof", _NO_C_HANDLES)


def _addressof(obj: Any) -> int:
    """mpi4py's address of the C handle inside an object: there is none here."""
    _check(obj, "_addressof")
    unsupported("MPI._addressof", _NO_C_HANDLES)


def _handleof(obj: Any) -> int:
    """The object's handle number (its ``handle``). A status has no handle: mpi4py gives the address
    of its C MPI_Status, which does not exist here."""
    from shmproxy import MPI
    if isinstance(obj, type) or not isinstance(obj, _handle_types()):
        raise TypeError(f"MPI._handleof() takes an MPI handle object, not {type(obj).__name__}")
    if isinstance(obj, MPI.Status):
        unsupported("MPI._handleof of a Status", _NO_C_HANDLES)
    return int(obj.handle)
