"""MPI.Status: what a completed receive got, filled from the native Status (source, tag, nbytes).

The native layer counts bytes; counts in elements are derived from the datatype the program asks
about, as MPI_Get_count does (UNDEFINED when the bytes are not a whole number of elements).
"""
from __future__ import annotations

from array import array
from typing import Any

from shmproxy.core.ops import ANY_SOURCE, ANY_TAG, UNDEFINED
from shmproxy.mpi.datatypes import BYTE, Datatype  # type: ignore[attr-defined]
from shmproxy.mpi.exceptions import ERR_TYPE, SUCCESS, as_int, error

PROC_NULL = -2


class Status:
    """MPI.Status: ``source``, ``tag``, ``error`` attributes and mpi4py's Get_*/Set_* methods.

    The fields live in one small int64 array so that ``tomemory()`` can hand out a writable view of
    them, as mpi4py's does (a program may fill a status through it)."""

    __slots__ = ("_f", "__weakref__")

    def __init__(self, status: "Status | None" = None):
        if status is None:
            self._f = array("q", (ANY_SOURCE, ANY_TAG, SUCCESS, 0, 0))
        elif isinstance(status, Status):
            self._f = array("q", status._f)
        else:
            raise TypeError(f"MPI.Status() takes an MPI.Status to copy, got {type(status).__name__}")

    def _fill(self, native: Any) -> None:
        """Copy a native shmproxy.Status (or None: a request with nothing to report)."""
        f = self._f
        if native is None:
            f[0], f[1], f[3] = ANY_SOURCE, ANY_TAG, 0
        else:
            f[0], f[1], f[3] = native.source, native.tag, native.nbytes
        f[2], f[4] = SUCCESS, bool(getattr(native, "cancelled", False))

    def _fill_null(self) -> None:
        """A receive from PROC_NULL: source PROC_NULL, tag ANY_TAG, count 0 (as MPI defines)."""
        f = self._f
        f[0], f[1], f[2], f[3], f[4] = PROC_NULL, ANY_TAG, SUCCESS, 0, 0

    source = property(lambda self: self._f[0], lambda self, v: self._f.__setitem__(0, as_int(v, "source")))
    tag = property(lambda self: self._f[1], lambda self, v: self._f.__setitem__(1, as_int(v, "tag")))
    error = property(lambda self: self._f[2], lambda self, v: self._f.__setitem__(2, as_int(v, "error")))
    nbytes = property(lambda self: self._f[3], lambda self, v: self._f.__setitem__(3, as_int(v, "nbytes")))
    cancelled = property(lambda self: bool(self._f[4]), lambda self, v: self._f.__setitem__(4, bool(v)))

    def tomemory(self) -> memoryview:
        """A writable view of the fields (source, tag, error, bytes received, cancelled)."""
        return memoryview(self._f)

    def Get_source(self) -> int:
        return self.source

    def Set_source(self, source: int) -> None:
        self.source = source

    def Get_tag(self) -> int:
        return self.tag

    def Set_tag(self, tag: int) -> None:
        self.tag = tag

    def Get_error(self) -> int:
        return self.error

    def Set_error(self, error_class: int) -> None:
        self.error = error_class

    def Get_count(self, datatype: Datatype = BYTE) -> int:
        """Elements of ``datatype`` received; UNDEFINED if the bytes are not whole elements."""
        size = _size(datatype)
        if size == 0:
            return 0 if self.nbytes == 0 else UNDEFINED
        q, r = divmod(self.nbytes, size)
        return UNDEFINED if r else q

    def Get_elements(self, datatype: Datatype = BYTE) -> int:
        """Basic elements received: for the predefined types here, the same as Get_count."""
        return self.Get_count(datatype)

    def Set_elements(self, datatype: Datatype, count: int) -> None:
        self.nbytes = as_int(count, "Set_elements: count") * _size(datatype)

    def Is_cancelled(self) -> bool:
        return self.cancelled

    def Set_cancelled(self, flag: bool) -> None:
        self.cancelled = bool(flag)

    @property
    def count(self) -> int:
        return self.Get_count(BYTE)

    @count.setter
    def count(self, value: int) -> None:
        self.Set_elements(BYTE, value)

    def py2f(self) -> list[int]:
        return list(self._f[:4])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Status) and self._f == other._f

    def __reduce__(self) -> tuple:
        # the class too: a subclass of the program's unpickles as itself (as mpi4py's)
        return _rebuild, (list(self._f), type(self))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<MPI.Status source={self.source} tag={self.tag} bytes={self.nbytes} error={self.error}>"


def _size(datatype: Any) -> int:
    if not isinstance(datatype, Datatype):
        raise error(ERR_TYPE, f"expected an MPI.Datatype, got {type(datatype).__name__}")
    if not datatype:
        raise error(ERR_TYPE, "MPI.DATATYPE_NULL has no size: a count of it is undefined")
    return datatype.size


def _rebuild(fields: list[int], cls: type = Status) -> Status:
    st = cls()
    st._f = array("q", fields)
    return st
