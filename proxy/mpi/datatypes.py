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
from typing import TYPE_CHECKING, Any

import numpy as np

from shmproxy.core.ops import DTYPE_CODE
from shmproxy.mpi.attributes import DATATYPE, Cached
from shmproxy.mpi.exceptions import ERR_TYPE, error
from shmproxy.mpi.handles import HandleNumber, Numbers

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Self     # (typing.Self: Python >= 3.11)


class Datatype(HandleNumber, Cached):
    """A predefined MPI datatype: its symbol (``_sym``: "INT"), ``dtype`` (numpy), size and extent in
    bytes. ``_h`` is the handle: ``MPI.Datatype(d)`` is a second Python object of the same handle
    (equal, not identical), as in mpi4py; ``MPI.Datatype()`` one of DATATYPE_NULL."""

    __slots__ = ("_sym", "_label", "dtype", "size", "_pair", "_h", "__weakref__")
    _sym: str
    _label: str
    dtype: np.dtype | None
    size: int
    _pair: tuple[Any, Any] | None
    _h: Datatype

    def __new__(cls, datatype: Any = None) -> "Datatype":
        if datatype is None:
            datatype = DATATYPE_NULL
        if not isinstance(datatype, Datatype):
            raise TypeError(f"MPI.Datatype() takes an MPI.Datatype, got {type(datatype).__name__}")
        if type(datatype) is not Datatype and not issubclass(cls, type(datatype)):
            return datatype._copy()    # a derived type's state lives in typemap.Derived's slots
        return datatype._copy(cls)

    def __init__(self, datatype: Any = None) -> None:
        pass    # __new__ did it all

    @classmethod
    def _make(cls, sym: str, dtype: Any, pair: tuple[Any, Any] | None = None) -> Self:
        self = object.__new__(cls)
        self._sym, self._label = sym, "MPI_" + sym
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.size = 0 if self.dtype is None else self.dtype.itemsize
        self._pair = pair
        self._h = self
        return self

    def _copy(self, cls: type | None = None) -> "Datatype":
        """A second Python object of this handle (mpi4py's ``MPI.Datatype(d)``), of class ``cls``
        (a subclass of the program's) or this object's."""
        new: Datatype = object.__new__(type(self) if cls is None else cls)
        for slot in _STATE:
            setattr(new, slot, getattr(self, slot))
        return new

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Datatype):
            return NotImplemented
        return self._h is other._h

    # as mpi4py's handles: not hashable, since free() turns a handle into DATATYPE_NULL in place
    __hash__ = None  # type: ignore[assignment]

    def __bool__(self) -> bool:
        return self._h is not DATATYPE_NULL

    # handles, as mpi4py gives them: a number naming the type while some object of it lives (0 names
    # DATATYPE_NULL); fromhandle gives another object of the same handle
    @property
    def handle(self) -> int:
        return 0 if self._h is DATATYPE_NULL else _NUMBERS.number(self._h)

    @classmethod
    def fromhandle(cls, handle: Any) -> "Datatype":
        h = _NUMBERS.lookup(handle)
        return cls(DATATYPE_NULL if h is None else h)

    # ---- queries of mpi4py's Datatype
    def Get_size(self) -> int:
        return self.size

    def Get_extent(self) -> tuple[int, int]:
        """(lower bound, extent): predefined types are dense, so (0, size)."""
        return 0, self.size

    def Get_true_extent(self) -> tuple[int, int]:
        return 0, self.size

    def Get_name(self) -> str:
        return self._h._label

    def Set_name(self, name: str) -> None:
        self._h._label = str(name)

    @property
    def name(self) -> str:
        return self.Get_name()

    @name.setter
    def name(self, value: str) -> None:
        self.Set_name(value)

    @property
    def extent(self) -> int:
        return self.Get_extent()[1]

    @property
    def lb(self) -> int:
        return self.Get_extent()[0]

    @property
    def ub(self) -> int:
        lb, ext = self.Get_extent()
        return lb + ext

    @property
    def true_lb(self) -> int:
        return self.Get_true_extent()[0]

    @property
    def true_ub(self) -> int:
        lb, ext = self.Get_true_extent()
        return lb + ext

    @property
    def true_extent(self) -> int:
        return self.Get_true_extent()[1]

    @property
    def is_predefined(self) -> bool:
        return True

    @property
    def is_named(self) -> bool:
        return True

    def Get_envelope(self) -> tuple[int, int, int, int, int]:
        """(integers, addresses, large counts, datatypes, combiner), as mpi4py 4 gives it."""
        return 0, 0, 0, 0, COMBINER_NAMED

    @property
    def envelope(self) -> tuple[int, int, int, int, int]:
        return self.Get_envelope()

    def Get_contents(self) -> tuple[list[int], list[int], list[int], list["Datatype"]]:
        raise error(ERR_TYPE, f"Datatype.Get_contents: {self.name} is a named datatype (it has no contents)")

    @property
    def contents(self) -> tuple[list[int], list[int], list[int], list["Datatype"]]:
        return self.Get_contents()

    @property
    def combiner(self) -> int:
        return self.Get_envelope()[-1]

    def decode(self) -> tuple["Datatype", str, dict]:
        """(old type, combiner name, the constructor's keyword arguments), as mpi4py's decode."""
        return self, "NAMED", {}

    def Commit(self) -> "Datatype":
        if self._h is DATATYPE_NULL:
            raise error(ERR_TYPE, "Commit of MPI.DATATYPE_NULL")    # as MPI: an invalid datatype
        return self    # predefined types need no commit

    def Free(self) -> None:
        raise error(ERR_TYPE, f"the predefined datatype {self.name} cannot be freed")   # DATATYPE_NULL too

    def free(self) -> None:
        """mpi4py's safe free: a predefined constant and DATATYPE_NULL stay what they are; any other
        handle (a second object of a predefined type, a derived type) becomes DATATYPE_NULL."""
        h = self._h
        if h is DATATYPE_NULL or self is h and self.is_predefined:
            return
        if not h.is_predefined and not getattr(self, "freed", False):
            self.Free()    # a derived type's own Free (typemap.py): the type is released
        self._h = DATATYPE_NULL

    def Dup(self) -> "Datatype":
        return _tm().dup(self)

    Create_dup = Dup

    # attributes (Get_attr, Set_attr, Delete_attr, Create_keyval, ...): attributes.Cached, filed under
    # the handle every object of one type shares; a derived type's Free runs their delete callbacks
    _attr_kind = DATATYPE

    def _attr_owner(self) -> Any:
        h = self._h
        if h is DATATYPE_NULL:
            raise error(ERR_TYPE, "attribute call on MPI.DATATYPE_NULL (or a freed datatype)")
        return h

    # ---- type codes (mpi4py's tocode/fromcode/typechar/typestr)
    def tocode(self) -> str:
        if self.dtype is None or self._pair is not None:
            raise error(ERR_TYPE, f"{self.name} has no type code")
        return "c" if self._sym in ("CHAR", "CHARACTER") else self.dtype.char

    @classmethod
    def fromcode(cls, code: str) -> "Datatype":
        return from_typecode(code)

    @property
    def typechar(self) -> str:
        if self.dtype is None:
            return ""
        return "V" if self._pair is not None else self.tocode()

    @property
    def typestr(self) -> str:
        if self.dtype is None:
            return ""
        if self._pair is not None:
            return f"V{self.extent}"
        return "S1" if self.typechar == "c" else self.dtype.str.lstrip("<>|=")

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

    def Create_darray(self, size: int, rank: int, gsizes: Any, distribs: Any, dargs: Any, psizes: Any,
                      order: int = 0) -> "Datatype":
        return _tm().darray(self, size, rank, gsizes, distribs, dargs, psizes, order)

    def Create_resized(self, lb: int, extent: int) -> "Datatype":
        return _tm().resized(self, lb, extent)

    @classmethod
    def Create_struct(cls, blocklengths: Any, displacements: Any, datatypes: Any) -> "Datatype":
        return _tm().struct(blocklengths, displacements, datatypes)

    @classmethod
    def Create_f90_integer(cls, r: int) -> "Datatype":
        return _intro().f90("F90_INTEGER", r=r)

    @classmethod
    def Create_f90_real(cls, p: int, r: int) -> "Datatype":
        return _intro().f90("F90_REAL", p=p, r=r)

    @classmethod
    def Create_f90_complex(cls, p: int, r: int) -> "Datatype":
        return _intro().f90("F90_COMPLEX", p=p, r=r)

    @classmethod
    def Get_value_index(cls, value: "Datatype", index: "Datatype") -> "Datatype":
        return _intro().value_index(value, index)

    @classmethod
    def Match_size(cls, typeclass: int, size: int) -> "Datatype":
        return _intro().match_size(typeclass, size)

    # ---- packing (shmproxy.mpi.pack): the signature's bytes, or external32's big-endian ones
    def Pack(self, inbuf: Any, outbuf: Any, position: int, comm: Any) -> int:
        return _pack().pack(self, inbuf, outbuf, position, comm)

    def Unpack(self, inbuf: Any, position: int, outbuf: Any, comm: Any) -> int:
        return _pack().unpack(self, inbuf, position, outbuf, comm)

    def Pack_size(self, count: int, comm: Any) -> int:
        return _pack().pack_size(self, count, comm)

    def Pack_external(self, datarep: str, inbuf: Any, outbuf: Any, position: int) -> int:
        return _pack().pack_external(self, datarep, inbuf, outbuf, position)

    def Unpack_external(self, datarep: str, inbuf: Any, position: int, outbuf: Any) -> int:
        return _pack().unpack_external(self, datarep, inbuf, position, outbuf)

    def Pack_external_size(self, datarep: str, count: int) -> int:
        return _pack().pack_external_size(self, datarep, count)

    def __repr__(self) -> str:
        return f"<shmproxy.MPI.{self._sym}>"

    def __reduce__(self) -> Any:
        if self._h is self:
            return self._sym   # the module-level constant of the same name
        if type(self) is Datatype:
            return _handle_of, (self._h._sym,)
        return type(self), (self._h,)    # a subclass of the program's unpickles as itself


def _handle_of(sym: str) -> Datatype:
    """Unpickling a second object of a predefined handle: another one, equal, not identical."""
    return PREDEFINED[sym]._copy()


_STATE = ("_sym", "_label", "dtype", "size", "_pair", "_h")    # what a handle holds (not __weakref__)


COMBINER_NAMED = 1
_NUMBERS = Numbers("datatype", ERR_TYPE)

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
PREDEFINED: dict[str, Datatype] = {name: Datatype._make(name, dt) for name, dt in _TABLE.items()}
DATATYPE_NULL = Datatype._make("DATATYPE_NULL", None)
PREDEFINED["DATATYPE_NULL"] = DATATYPE_NULL

# The (value, index) pair types of MAXLOC/MINLOC: structured dtypes no native reduction takes.
for _name, _v in (("FLOAT_INT", np.float32), ("DOUBLE_INT", np.float64), ("LONG_INT", _C_LONG),
                  ("SHORT_INT", np.int16), ("2INT", np.int32), ("LONG_DOUBLE_INT", np.longdouble)):
    _dt = np.dtype([("value", _v), ("index", np.int32)], align=True)
    PREDEFINED[_name] = Datatype._make(_name, _dt, pair=(_v, np.int32))
TWOINT = PREDEFINED["2INT"]
INT_INT = TWOINT          # mpi4py's Python name of MPI_2INT

# Long double and its complex have no native dtype code: they travel as their bytes (buffers.wire) and
# the ranks reduce them (localred.py), so only the blocking reductions take them.
for _name, _v in (("LONG_DOUBLE", np.longdouble), ("C_LONG_DOUBLE_COMPLEX", np.clongdouble),
                  ("CXX_LONG_DOUBLE_COMPLEX", np.clongdouble)):
    PREDEFINED[_name] = Datatype._make(_name, _v)

# numpy dtype char -> the datatype a buffer of that dtype gets when the program names none (C names
# first, as mpi4py's type-code table)
_BY_CHAR: dict[str, Datatype] = {}
for _name in ("C_BOOL", "SIGNED_CHAR", "UNSIGNED_CHAR", "SHORT", "UNSIGNED_SHORT", "INT", "UNSIGNED",
              "LONG", "UNSIGNED_LONG", "LONG_LONG", "UNSIGNED_LONG_LONG", "FLOAT16", "FLOAT", "DOUBLE",
              "C_FLOAT_COMPLEX", "C_DOUBLE_COMPLEX", "INT8_T", "UINT8_T", "INT16_T", "UINT16_T", "INT32_T",
              "UINT32_T", "INT64_T", "UINT64_T", "LONG_DOUBLE", "C_LONG_DOUBLE_COMPLEX"):
    _dt = PREDEFINED[_name].dtype  # type: ignore[assignment]  # each type named here has a dtype
    _BY_CHAR.setdefault(_dt.char, PREDEFINED[_name])
_BY_CHAR.setdefault("c", PREDEFINED["CHAR"])   # 'c' (a 1-byte char array) travels as int8
_BYTES_ONLY = frozenset(("LONG_DOUBLE", "C_LONG_DOUBLE_COMPLEX", "CXX_LONG_DOUBLE_COMPLEX"))


def _tm() -> Any:
    from shmproxy.mpi import typemap   # typemap subclasses Datatype: imported on first use
    return typemap


def _pack() -> Any:
    from shmproxy.mpi import pack
    return pack


def _intro() -> Any:
    from shmproxy.mpi import dtintro
    return dtintro


def of_dtype(dt: np.dtype) -> Datatype:
    """The datatype of a buffer whose element type is the numpy dtype ``dt``; ERR_TYPE if none."""
    d = _BY_CHAR.get(dt.char)
    if d is None and dt.kind in "iu":     # 'q' where 'l' is 64-bit (array.array('q')), and the like
        d = _BY_CHAR.get(np.dtype(dt.name).char)
    if d is None or (dt.char != "c" and dt.char not in DTYPE_CODE
                     and d.dtype.char not in DTYPE_CODE  # type: ignore[union-attr]  # _BY_CHAR's have dtypes
                     and d._sym not in _BYTES_ONLY):
        raise error(ERR_TYPE, f"no MPI datatype for the buffer's element type {dt}: pass [buf, MPI.BYTE] "
                    "to send its bytes")
    return d


def check_native(d: Datatype, what: str) -> np.dtype:
    """The numpy dtype ``d`` travels as; ERR_TYPE where the native layer has no code for it."""
    dt = d.dtype
    if dt is None and not d.is_predefined:
        raise error(ERR_TYPE, f"{what}: a derived datatype is not supported in this call (point-to-point "
                    "and the buffer collectives take them)")
    if d._pair is not None or d._sym in _BYTES_ONLY:
        # travels as its bytes (buffers.wire); the ranks reduce it (localred.py). (Not None: the pair
        # and long double types have dtypes.)
        return dt  # type: ignore[return-value]
    if dt is None or dt.char not in DTYPE_CODE:
        raise error(ERR_TYPE, f"{what}: {d.name} cannot travel (the native layer carries bool, "
                    "int8..uint64, float16/32/64 and complex64/128)")
    return dt


_UNKNOWN_CODE: list[type] = []


def _unknown_code(code: Any) -> Exception:
    """An unknown type code: ERR_TYPE, a ValueError (mpi4py's fromcode raises one) and a KeyError
    (its buffer specs look codes up in a dict: ``[buf, "\0"]`` raises KeyError)."""
    exc = error(ERR_TYPE, f"unknown type code {code!r}")
    if not _UNKNOWN_CODE:
        _UNKNOWN_CODE.append(type(type(exc).__name__, (type(exc), KeyError), {"__module__": "shmproxy.MPI"}))
    return _UNKNOWN_CODE[0](str(exc), ERR_TYPE)


def from_typecode(code: str) -> Datatype:
    """mpi4py's ``MPI.Datatype.fromcode`` / ``MPI._typedict``: numpy/array type characters. numpy
    reads some strings that are no type code ("\0" is its bool): only printable codes are asked."""
    if not isinstance(code, str) or not code or not code.isprintable() or code != code.strip():
        raise _unknown_code(code)
    try:
        return of_dtype(np.dtype(code))
    except TypeError:
        raise _unknown_code(code) from None


globals().update(PREDEFINED)   # MPI.INT, MPI.DOUBLE, ... (and "2INT", which is also TWOINT)
