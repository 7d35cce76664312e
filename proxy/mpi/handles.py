"""Handle numbers of the MPI layer's objects, and mpi4py's unsafe handle helpers.

mpi4py gives every handle object a ``handle`` (an integer, 0 for the null handle) and a
``fromhandle`` that turns the integer back into an equal handle. The MPI layer has no C handles, so
the integer here is a number naming the Python object that holds the handle's state while some
object of that handle lives (``id`` of it): it round-trips within this process, which is all a
program can do with it, and it is not an address any C code could use. mpi4py's ``_sizeof`` and
``_addressof`` (the size and address of the C handle inside the object, for ctypes/cffi) give the
memory that holds the handle here: a status's int64 fields, or a 64-bit cell holding the number.
"""
from __future__ import annotations

import ctypes
import operator
import weakref
from typing import TYPE_CHECKING, Any

from shmproxy.mpi.exceptions import error


class HandleNumber:
    """mpi4py's other names of a handle object's number: ``toint`` and ``py2f`` give ``handle``;
    ``fromint`` and ``f2py`` are the class's ``fromhandle``. A class defines those two."""

    __slots__ = ()
    if TYPE_CHECKING:   # each class defines it, as a read-only property
        @property
        def handle(self) -> int: ...

    def toint(self) -> int:
        return self.handle

    def py2f(self) -> int:
        return self.handle

    @classmethod
    def fromhandle(cls, handle: Any) -> Any:
        raise NotImplementedError(f"{cls.__name__}.fromhandle")

    @classmethod
    def fromint(cls, handle: Any) -> Any:
        return cls.fromhandle(handle)

    f2py = fromint


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


def _check_object(obj: Any, what: str) -> None:
    if isinstance(obj, type) or not isinstance(obj, _handle_types()):
        raise TypeError(f"MPI.{what}() takes an MPI handle object, not {type(obj).__name__}")


def _sizeof(obj: Any) -> int:
    """mpi4py's size of the C handle of an object or class: a status's fields (``Status._f``, five
    int64), else a handle number (64 bits)."""
    _check(obj, "_sizeof")
    from shmproxy import MPI
    if obj is MPI.Status or isinstance(obj, MPI.Status):
        f = MPI.Status()._f
        return f.itemsize * len(f)
    return ctypes.sizeof(ctypes.c_uint64)


# id(object) -> (a weak reference to it, the cell holding its handle number): one cell per live
# object, dropped with the object (weakref.finalize), so an address stays valid while the object lives.
_cells: dict[int, tuple[weakref.ref, ctypes.c_uint64]] = {}


def _addressof(obj: Any) -> int:
    """mpi4py's address of the C handle inside an object, for ctypes/cffi code that reads it. A
    status: the address of its fields (source, tag, error, bytes, cancelled; int64 each). Any other
    handle: the address of a 64-bit cell that holds its handle number (written at each call, so it
    follows a handle the object was given since), valid while the object lives."""
    from shmproxy import MPI
    _check_object(obj, "_addressof")
    if isinstance(obj, MPI.Status):
        return int(obj._f.buffer_info()[0])
    key = id(obj)
    held = _cells.get(key)
    if held is None or held[0]() is not obj:
        held = (weakref.ref(obj), ctypes.c_uint64())
        _cells[key] = held
        weakref.finalize(obj, _drop_cell, key, held[1])
    held[1].value = int(obj.handle)
    return ctypes.addressof(held[1])


def _drop_cell(key: int, cell: ctypes.c_uint64) -> None:
    held = _cells.get(key)
    if held is not None and held[1] is cell:   # (a later object with the same id has its own)
        del _cells[key]


def _handleof(obj: Any) -> int:
    """The object's handle number (its ``handle``); a status has none and gives the address of its
    fields, as mpi4py gives the address of its C MPI_Status."""
    from shmproxy import MPI
    _check_object(obj, "_handleof")
    if isinstance(obj, MPI.Status):
        return _addressof(obj)
    return int(obj.handle)
