"""MPI datatypes: the predefined ones, each a name over a numpy dtype the native layer carries.

A buffer travels as a numpy view of its memory with the datatype's dtype (buffers.py), so the native
layer's own checks apply: a receive matched by a message of another dtype raises InvalidUsage, as a
type-signature mismatch is erroneous in MPI. Types with the same C representation share a dtype
(LONG and LONG_LONG are both int64 here; CHAR is int8, BYTE and UNSIGNED_CHAR uint8).

Derived datatypes (Create_contiguous, Create_vector, ...) are shmproxy.mpi.typemap.Derived: block
lists that the progress process gathers and scatters by (see typemap.py's header).
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from shmproxy.core.ops import DTYPE_CODE
from shmproxy.mpi.exceptions import ERR_TYPE, error, unsupported


class Datatype:
    """A predefined MPI datatype: ``name``, ``dtype`` (numpy), size and extent in bytes."""

    __slots__ = ("name", "dtype", "size", "_pair")

    def __init__(self, name: str, dtype: Any, pair: tuple[Any, Any] | None = None):
        self.name = name
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.size = 0 if self.dtype is None else self.dtype.itemsize
        self._pair = pair

    # ---- queries of mpi4py's Datatype
    def Get_size(self) -> int:
        return self.size

    def Get_extent(self) -> tuple[int, int]:
        """(lower bound, extent): predefined types are dense, so (0, size)."""
        return 0, self.size

    def Get_true_extent(self) -> tuple[int, int]:
        return 0, self.size

    def Get_name(self) -> str:
        return self.name

    def Set_name(self, name: str) -> None:
        raise error(ERR_TYPE, f"the name of the predefined datatype {self.name} cannot be changed")

    @property
    def extent(self) -> int:
        return self.size

    @property
    def lb(self) -> int:
        return 0

    @property
    def ub(self) -> int:
        return self.size

    @property
    def is_predefined(self) -> bool:
        return True

    @property
    def is_named(self) -> bool:
        return True

    def Get_envelope(self) -> tuple[int, int, int, int]:
        return 0, 0, 0, COMBINER_NAMED

    @property
    def combiner(self) -> int:
        return COMBINER_NAMED

    def Commit(self) -> "Datatype":
        return self    # predefined types need no commit

    def Free(self) -> None:
        if self is not DATATYPE_NULL:
            raise error(ERR_TYPE, f"the predefined datatype {self.name} cannot be freed")

    def Dup(self) -> "Datatype":
        return self    # immutable: a duplicate is indistinguishable

    def tocode(self) -> str:
        return "" if self.dtype is None else self.dtype.char

    # ---- derived datatypes (flattened into block lists: shmproxy.mpi.typemap)
    def Create_contiguous(self, count: int) -> "Datatype":
        return _tm().contiguous(self, count)

    def Create_vector(self, count: int, blocklength: int, stride: int) -> "Datatype":
        return _tm().vector(self, count, blocklength, stride)

    def Create_hvector(self, count: int, blocklength: int, stride: int) -> "Datatype":
        return _tm().hvector(self, count, blocklength, stride)

    def Create_indexed(self, blocklengths: Any, displacements: Any) -> "Datatype":
        return _tm().indexed(self, blocklengths, displacements)

    def Create_indexed_block(self, blocklength: int, displacements: Any) -> "Datatype":
        return _tm().indexed_block(self, blocklength, displacements)

    def Create_hindexed(self, blocklengths: Any, displacements: Any) -> "Datatype":
        return _tm().hindexed(self, blocklengths, displacements)

    def Create_hindexed_block(self, blocklength: int, displacements: Any) -> "Datatype":
        return _tm().indexed_block(self, blocklength, displacements, hbytes=True)

    def Create_subarray(self, sizes: Any, subsizes: Any, starts: Any, order: int = 0) -> "Datatype":
        return _tm().subarray(self, sizes, subsizes, starts, order)

    def Create_darray(self, *a: Any, **k: Any) -> "Datatype":
        unsupported("Datatype.Create_darray", "use Create_subarray with the block this rank owns")

    def Create_resized(self, lb: int, extent: int) -> "Datatype":
        return _tm().resized(self, lb, extent)

    @classmethod
    def Create_struct(cls, blocklengths: Any, displacements: Any, datatypes: Any) -> "Datatype":
        return _tm().struct(blocklengths, displacements, datatypes)

    def Pack(self, *a: Any, **k: Any) -> int:
        unsupported("Datatype.Pack")

    def Unpack(self, *a: Any, **k: Any) -> int:
        unsupported("Datatype.Unpack")

    def __repr__(self) -> str:
        return f"<shmproxy.MPI.{self.name}>"

    def __reduce__(self) -> str:
        return self.name   # pickles as the module-level constant of the same name


COMBINER_NAMED = 1

_C_LONG = np.dtype(f"i{ctypes.sizeof(ctypes.c_long)}")
_C_ULONG = np.dtype(f"u{ctypes.sizeof(ctypes.c_long)}")
_C_WCHAR = np.dtype(f"u{ctypes.sizeof(ctypes.c_wchar)}")

# name -> numpy dtype; DATATYPE_NULL and the pair types are added below
_TABLE: dict[str, Any] = {
    "BYTE": np.uint8, "PACKED": np.uint8, "CHAR": np.int8, "SIGNED_CHAR": np.int8, "UNSIGNED_CHAR": np.uint8,
    "WCHAR": _C_WCHAR, "SHORT": np.int16, "UNSIGNED_SHORT": np.uint16, "INT": np.int32, "UNSIGNED": np.uint32,
    "UNSIGNED_INT": np.uint32, "LONG": _C_LONG, "UNSIGNED_LONG": _C_ULONG, "LONG_LONG": np.int64,
    "LONG_LONG_INT": np.int64, "UNSIGNED_LONG_LONG": np.uint64, "FLOAT": np.float32, "DOUBLE": np.float64,
    "C_BOOL": np.bool_, "BOOL": np.bool_, "CXX_BOOL": np.bool_, "INT8_T": np.int8, "INT16_T": np.int16,
    "INT32_T": np.int32, "INT64_T": np.int64, "UINT8_T": np.uint8, "UINT16_T": np.uint16,
    "UINT32_T": np.uint32, "UINT64_T": np.uint64, "AINT": np.int64, "OFFSET": np.int64, "COUNT": np.int64,
    "C_FLOAT_COMPLEX": np.complex64, "C_COMPLEX": np.complex64, "C_DOUBLE_COMPLEX": np.complex128,
    "COMPLEX": np.complex64, "DOUBLE_COMPLEX": np.complex128, "CXX_FLOAT_COMPLEX": np.complex64,
    "CXX_DOUBLE_COMPLEX": np.complex128, "REAL": np.float32, "DOUBLE_PRECISION": np.float64,
    "INTEGER": np.int32, "LOGICAL": np.int32, "CHARACTER": np.int8, "REAL4": np.float32,
    "REAL8": np.float64, "INTEGER1": np.int8, "INTEGER2": np.int16, "INTEGER4": np.int32,
    "INTEGER8": np.int64, "COMPLEX8": np.complex64, "COMPLEX16": np.complex128,
    "FLOAT16": np.float16,
}
PREDEFINED: dict[str, Datatype] = {name: Datatype(name, dt) for name, dt in _TABLE.items()}
DATATYPE_NULL = Datatype("DATATYPE_NULL", None)
PREDEFINED["DATATYPE_NULL"] = DATATYPE_NULL

# The (value, index) pair types of MAXLOC/MINLOC: structured dtypes no native reduction takes.
for _name, _v in (("FLOAT_INT", np.float32), ("DOUBLE_INT", np.float64), ("LONG_INT", _C_LONG),
                  ("SHORT_INT", np.int16), ("2INT", np.int32), ("LONG_DOUBLE_INT", np.longdouble)):
    _dt = np.dtype([("value", _v), ("index", np.int32)], align=True)
    PREDEFINED[_name] = Datatype(_name, _dt, pair=(_v, np.int32))
TWOINT = PREDEFINED["2INT"]

# Long double and the Fortran/C++ long double complex have no native dtype code; they exist as names
# so that programs referring to them import, and buffers of them are refused (ERR_TYPE) when used.
for _name, _v in (("LONG_DOUBLE", np.longdouble), ("C_LONG_DOUBLE_COMPLEX", np.clongdouble),
                  ("CXX_LONG_DOUBLE_COMPLEX", np.clongdouble)):
    PREDEFINED[_name] = Datatype(_name, _v)

# numpy dtype char -> the datatype a buffer of that dtype gets when the program names none
_BY_CHAR: dict[str, Datatype] = {}
for _name in ("C_BOOL", "SIGNED_CHAR", "UNSIGNED_CHAR", "SHORT", "UNSIGNED_SHORT", "INT", "UNSIGNED",
              "LONG", "UNSIGNED_LONG", "LONG_LONG", "UNSIGNED_LONG_LONG", "FLOAT16", "FLOAT", "DOUBLE",
              "C_FLOAT_COMPLEX", "C_DOUBLE_COMPLEX", "INT8_T", "UINT8_T", "INT16_T", "UINT16_T", "INT32_T",
              "UINT32_T", "INT64_T", "UINT64_T"):   # C names first, as mpi4py's type-code table
    _dt = PREDEFINED[_name].dtype
    _BY_CHAR.setdefault(_dt.char, PREDEFINED[_name])
_BY_CHAR.setdefault("c", PREDEFINED["CHAR"])   # 'c' (a 1-byte char array) travels as int8


def _tm() -> Any:
    from shmproxy.mpi import typemap   # typemap subclasses Datatype: imported on first use
    return typemap


def of_dtype(dt: np.dtype) -> Datatype:
    """The datatype of a buffer whose element type is the numpy dtype ``dt``; ERR_TYPE if none."""
    d = _BY_CHAR.get(dt.char)
    if d is None and dt.kind in "iu":     # 'q' where 'l' is 64-bit (array.array('q')), and the like
        d = _BY_CHAR.get(np.dtype(dt.name).char)
    if d is None or (dt.char != "c" and dt.char not in DTYPE_CODE and d.dtype.char not in DTYPE_CODE):
        raise error(ERR_TYPE, f"no MPI datatype for the buffer's element type {dt}: pass [buf, MPI.BYTE] "
                    "to send its bytes")
    return d


def check_native(d: Datatype, what: str) -> np.dtype:
    """The numpy dtype ``d`` travels as; ERR_TYPE where the native layer has no code for it."""
    dt = d.dtype
    if dt is None and not d.is_predefined:
        raise error(ERR_TYPE, f"{what}: a derived datatype is not supported in this call (point-to-point "
                    "and the buffer collectives take them)")
    if d._pair is not None:
        return dt      # travels as its bytes (buffers.wire); the ranks reduce it (localred.py)
    if dt is None or dt.char not in DTYPE_CODE:
        raise error(ERR_TYPE, f"{what}: MPI.{d.name} cannot travel (the native layer carries bool, "
                    "int8..uint64, float16/32/64 and complex64/128)")
    return dt


def from_typecode(code: str) -> Datatype:
    """mpi4py's ``MPI.Datatype.fromcode`` / ``MPI._typedict``: numpy/array type characters."""
    try:
        return of_dtype(np.dtype(code))
    except TypeError:
        raise error(ERR_TYPE, f"unknown type code {code!r}") from None


globals().update(PREDEFINED)   # MPI.INT, MPI.DOUBLE, ... (and "2INT", which is also TWOINT)
