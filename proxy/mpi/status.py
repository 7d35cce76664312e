"""MPI.Status: what a completed receive got, filled from the native Status (source, tag, nbytes).

The native layer counts bytes; counts in elements are derived from the datatype the program asks
about, as MPI_Get_count does (UNDEFINED when the bytes are not a whole number of elements).
"""
from __future__ import annotations

from typing import Any

from shmproxy.core.ops import ANY_SOURCE, ANY_TAG, UNDEFINED
from shmproxy.mpi.datatypes import BYTE, Datatype  # type: ignore[attr-defined]
from shmproxy.mpi.exceptions import ERR_TYPE, SUCCESS, error

PROC_NULL = -2


class Status:
    """MPI.Status: ``source``, ``tag``, ``error`` attributes and mpi4py's Get_*/Set_* methods."""

    __slots__ = ("source", "tag", "error", "nbytes", "cancelled")

    def __init__(self, status: "Status | None" = None):
        if status is not None:
            self.source, self.tag, self.error = status.source, status.tag, status.error
            self.nbytes, self.cancelled = status.nbytes, status.cancelled
        else:
            self.source, self.tag, self.error = ANY_SOURCE, ANY_TAG, SUCCESS
            self.nbytes, self.cancelled = 0, False

    def _fill(self, native: Any) -> None:
        """Copy a native shmproxy.Status (or None: a request with nothing to report)."""
        if native is None:
            self.source, self.tag, self.nbytes = ANY_SOURCE, ANY_TAG, 0
        else:
            self.source, self.tag, self.nbytes = native.source, native.tag, native.nbytes
        self.error, self.cancelled = SUCCESS, bool(getattr(native, "cancelled", False))

    def _fill_null(self) -> None:
        """A receive from PROC_NULL: source PROC_NULL, tag ANY_TAG, count 0 (as MPI defines)."""
        self.source, self.tag, self.nbytes, self.error, self.cancelled = PROC_NULL, ANY_TAG, 0, SUCCESS, False

    def Get_source(self) -> int:
        return self.source

    def Set_source(self, source: int) -> None:
        self.source = int(source)

    def Get_tag(self) -> int:
        return self.tag

    def Set_tag(self, tag: int) -> None:
        self.tag = int(tag)

    def Get_error(self) -> int:
        return self.error

    def Set_error(self, error_class: int) -> None:
        self.error = int(error_class)

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
        self.nbytes = int(count) * _size(datatype)

    def Is_cancelled(self) -> bool:
        return self.cancelled

    def Set_cancelled(self, flag: bool) -> None:
        self.cancelled = bool(flag)

    @property
    def count(self) -> int:
        return self.Get_count(BYTE)

    def py2f(self) -> list[int]:
        return [self.source, self.tag, self.error, self.nbytes]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Status) and all(getattr(self, a) == getattr(other, a)
                                                 for a in self.__slots__)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<MPI.Status source={self.source} tag={self.tag} bytes={self.nbytes} error={self.error}>"


def _size(datatype: Any) -> int:
    if not isinstance(datatype, Datatype):
        raise error(ERR_TYPE, f"expected an MPI.Datatype, got {type(datatype).__name__}")
    return datatype.size
