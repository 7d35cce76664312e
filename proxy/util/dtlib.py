"""shmproxy.util.dtlib: numpy dtypes <-> MPI datatypes (mpi4py.util.dtlib's from_numpy_dtype and
to_numpy_dtype) over shmproxy.MPI's datatypes.

Why it is small: shmproxy.MPI's named datatypes carry their numpy dtype (``Datatype.dtype``), and its
derived datatypes answer ``decode()`` as mpi4py's do, so both directions are a walk over the type's
structure: a numpy struct becomes Create_struct + Create_resized to the itemsize, a subarray dtype
Create_contiguous (one dimension) or Create_subarray; the other way, each MPI combiner becomes the numpy
dtype of the same memory layout (fields at the displacements, ``aligned`` when every field sits at
a multiple of its alignment, as a C compiler would lay it out). Layouts numpy cannot express
(a strided subarray, darrays) raise ValueError, as mpi4py's.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shmproxy import MPI

__all__ = ["from_numpy_dtype", "to_numpy_dtype"]

# the dtype constructor; a test (mpi4py's testMissingNumPy) sets it to None, and then to_numpy_dtype
# gives the dtype specifications themselves (a code, a tuple, a dict) instead of dtypes
_np_dtype: Any = np.dtype


def _dt(spec: Any, **kw: Any) -> Any:
    if _np_dtype is None:
        return (spec, kw) if kw else spec
    return _np_dtype(spec, **kw)


_PAIRS = ("SHORT", "INT", "LONG", "FLOAT", "DOUBLE", "LONG_DOUBLE")


def _alignment(datatype: Any) -> int:
    """A named datatype's alignment: its dtype's (a pair type's: the larger of its two)."""
    dt = getattr(datatype, "dtype", None)
    if dt is not None:
        return max(int(dt.alignment), 1)
    return max(int(datatype.Get_size()), 1)


def _free(datatype: Any) -> None:
    if not datatype.is_predefined:
        datatype.Free()


def _aligned(datatype: Any, offset: int = 0) -> bool:
    """Whether every named type inside ``datatype`` placed at ``offset`` sits on its alignment."""
    if datatype.is_predefined:
        return offset == 0 or offset % _alignment(datatype) == 0
    combiner = datatype.combiner
    base, _name, info = datatype.decode()
    parts, disps = [base], [0]
    try:
        if combiner == MPI.COMBINER_RESIZED:
            disps = [info["extent"]]
        elif combiner == MPI.COMBINER_STRUCT:
            parts, disps = list(info["datatypes"]), list(info["displacements"])
        elif combiner == MPI.COMBINER_HVECTOR:
            disps = [info["stride"] if info["count"] > 1 else 0]
        elif combiner in (MPI.COMBINER_HINDEXED, MPI.COMBINER_HINDEXED_BLOCK):
            disps = list(info["displacements"])
        return all(_aligned(t, offset + d) for t, d in zip(parts, disps))
    finally:
        for t in {id(t): t for t in parts}.values():
            _free(t)


def from_numpy_dtype(dtype: Any) -> Any:
    """The MPI datatype of numpy dtype ``dtype`` (a new handle: the caller frees it)."""
    if _np_dtype is None:
        raise RuntimeError("NumPy is not available")
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise ValueError("NumPy datatype with object entries")
    if not dtype.isnative:
        raise ValueError("NumPy datatype with non-native byteorder")
    if dtype.fields:
        types: list[Any] = []
        try:
            for name in dtype.names or ():
                ftype, fdisp = dtype.fields[name][:2]
                types.append((from_numpy_dtype(ftype), fdisp))
            struct = MPI.Datatype.Create_struct([1] * len(types), [d for _t, d in types],
                                                [t for t, _d in types])
        finally:
            for t, _d in types:
                _free(t)
        try:
            return struct.Create_resized(0, dtype.itemsize)
        finally:
            struct.Free()
    if dtype.subdtype:
        base, shape = dtype.subdtype
        inner = from_numpy_dtype(base)
        try:
            if len(shape) == 1:
                return inner.Create_contiguous(shape[0])
            return inner.Create_subarray(shape, shape, (0,) * len(shape))
        finally:
            _free(inner)
    return MPI.Datatype.fromcode(dtype.char).Dup()


def _record(names_formats_offsets: list[tuple[str, Any, int]], aligned: bool, itemsize: int | None) -> Any:
    spec: dict[str, Any] = {"names": [n for n, _f, _o in names_formats_offsets],
                            "formats": [f for _n, f, _o in names_formats_offsets],
                            "offsets": [o for _n, _f, o in names_formats_offsets], "aligned": aligned}
    if itemsize is not None:
        spec["itemsize"] = itemsize
    return _dt(spec)


def _named(datatype: Any) -> Any:
    pairs = [getattr(MPI, f"{name}_INT", None) for name in _PAIRS]
    if datatype in pairs:
        value = getattr(MPI, _PAIRS[pairs.index(datatype)])
        return _dt(f"{value.tocode()},i", align=True)
    return _dt(datatype.tocode())


def to_numpy_dtype(datatype: Any) -> Any:
    """The numpy dtype of MPI datatype ``datatype``'s memory layout; ValueError where numpy has none."""
    if datatype == MPI.DATATYPE_NULL:
        raise ValueError("cannot convert null MPI datatype to NumPy")
    combiner = datatype.combiner
    if combiner == MPI.COMBINER_NAMED:
        return _named(datatype)
    if combiner in (MPI.COMBINER_F90_INTEGER, MPI.COMBINER_F90_REAL, MPI.COMBINER_F90_COMPLEX):
        return _dt(datatype.tocode())
    if combiner == MPI.COMBINER_DUP and _has_code(datatype):
        return _dt(datatype.tocode())      # a dup of a type with a code (F90 types too): no decode
    base, _name, info = datatype.decode()
    owned = [base]
    try:
        if combiner == MPI.COMBINER_DUP:
            return to_numpy_dtype(base)
        if combiner == MPI.COMBINER_CONTIGUOUS:
            return _dt((to_numpy_dtype(base), (info["count"],)))
        if combiner == MPI.COMBINER_SUBARRAY:
            sizes, subsizes, starts = list(info["sizes"]), list(info["subsizes"]), list(info["starts"])
            if sizes != subsizes or any(starts):
                raise ValueError("cannot convert subarray MPI datatype to NumPy")
            if info["order"] == MPI.ORDER_FORTRAN:
                sizes = sizes[::-1]
            return _dt((to_numpy_dtype(base), tuple(sizes)))
        if combiner == getattr(MPI, "COMBINER_VALUE_INDEX", None):
            value, index = to_numpy_dtype(info["value"]), to_numpy_dtype(info["index"])
            return _dt([("f0", value), ("f1", index)], align=True)
        aligned = True
        if combiner == MPI.COMBINER_RESIZED and base.combiner == MPI.COMBINER_STRUCT:
            aligned = _aligned(base, info["extent"])
            _b, _n, info = base.decode()
            combiner = MPI.COMBINER_STRUCT
        if combiner == MPI.COMBINER_STRUCT:
            types = list(info["datatypes"])
            owned.extend(types)
            fields = [(f"f{i}", _fmt(t, n), d)
                      for i, (t, n, d) in enumerate(zip(types, info["blocklengths"], info["displacements"]))]
            aligned &= all(_aligned(t, d) for t, d in zip(types, info["displacements"]))
            return _record(fields, aligned, datatype.extent)
        if combiner in (MPI.COMBINER_VECTOR, MPI.COMBINER_HVECTOR):
            inner = to_numpy_dtype(base)
            count, blocklength, stride = info["count"], info["blocklength"], info["stride"]
            if combiner == MPI.COMBINER_VECTOR:
                stride *= base.extent
                aligned = _aligned(base)
            else:
                stride = stride if count > 1 else 0
                aligned = _aligned(base, stride)
            fields = [(f"f{i}", (inner, (blocklength,)), stride * i) for i in range(count)]
            return _record(fields, aligned, datatype.extent)
        indexed = (MPI.COMBINER_INDEXED, MPI.COMBINER_HINDEXED, MPI.COMBINER_INDEXED_BLOCK,
                   MPI.COMBINER_HINDEXED_BLOCK)
        if combiner in indexed:
            inner = to_numpy_dtype(base)
            disps = list(info["displacements"])
            if combiner in (MPI.COMBINER_INDEXED, MPI.COMBINER_HINDEXED):
                blocks = list(info["blocklengths"])
            else:
                blocks = [info["blocklength"]] * len(disps)
            aligned = _aligned(base)
            if combiner in (MPI.COMBINER_INDEXED, MPI.COMBINER_INDEXED_BLOCK):
                scale = base.extent
            else:
                scale = 1
                aligned &= all(_aligned(base, d) for d in disps)
            fields = [(f"f{i}", (inner, (b,)), d * scale) for i, (b, d) in enumerate(zip(blocks, disps))]
            return _record(fields, aligned, None)
        raise ValueError("cannot convert MPI datatype to NumPy")
    finally:
        for t in {id(t): t for t in owned}.values():
            _free(t)


def _has_code(datatype: Any) -> bool:
    try:
        datatype.tocode()
    except MPI.Exception:
        return False
    return True


def _fmt(datatype: Any, count: int) -> Any:
    dtype = to_numpy_dtype(datatype)
    return dtype if count == 1 else (dtype, count)
