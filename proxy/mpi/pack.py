"""Datatype.Pack/Unpack/Pack_size and the external32 forms (Pack_external, Unpack_external,
Pack_external_size), as mpi4py calls them:

    position = dt.Pack(inbuf, outbuf, position, comm)       inbuf: every whole instance of dt it holds
    position = dt.Unpack(inbuf, position, outbuf, comm)     outbuf: as many instances as it holds
    nbytes = dt.Pack_size(count, comm)
    position = dt.Pack_external("external32", inbuf, outbuf, position)   (and Unpack_external)
    nbytes = dt.Pack_external_size("external32", count)

``inbuf``/``outbuf`` are raw buffers (the buffer protocol, MPI.buffer, DLPack or CUDA-array-interface
objects in host memory), read as bytes as mpi4py reads them: the number of instances is the buffer's
size over the type's extent. The packed form is the type signature's bytes, one instance after
another, without a header (Pack_size is count times the type's size), so a message packed here may
be sent as MPI.PACKED (or MPI.BYTE) and unpacked on any rank. A derived type is read through its
block list (typemap.py); its blocks must lie inside the buffer, as everywhere in this layer.

external32 is MPI's portable representation: every element big-endian, long double as IEEE binary128
(x86's 80-bit extended converts exactly both ways). Sizes are this machine's, so LONG is 8 bytes (MPI's
table says 4): a derived type only remembers its elements' numpy type, and a type must pack the same
alone and inside another. A derived type mixing element types has no single element type to convert,
so it raises NotImplementedError in the external32 calls (native Pack takes it).

Errors are raised before anything is written: a position outside the buffer, an output too small
(ERR_TRUNCATE), a datarep other than "external32", a type of extent 0 or less with data.
"""
from __future__ import annotations

import operator
import sys
from typing import Any

import numpy as np

from shmproxy.core.memory import device_array_kind
from shmproxy.mpi import foreign
from shmproxy.mpi.datatypes import Datatype
from shmproxy.mpi.exceptions import (ERR_ARG, ERR_BUFFER, ERR_TRUNCATE, ERR_TYPE, buffer_error, error,
                                     unsupported)

_LD = np.dtype(np.longdouble)
# x86's 80-bit extended precision in 16 bytes, little-endian: converted to binary128 bit by bit
_LD_X87 = _LD.itemsize == 16 and np.finfo(np.longdouble).nmant == 63 and sys.byteorder == "little"
_LD_QUAD = _LD.itemsize == 16 and np.finfo(np.longdouble).nmant == 112


def _bytes(obj: Any, writable: bool, what: str) -> np.ndarray:
    """The bytes of a buffer as a 1-D uint8 view (never a copy): the buffer protocol (MPI.buffer
    included), or DLPack / the CUDA array interface over host memory (foreign.py). Read-only memory
    asked for writing is BufferError, as in mpi4py."""
    try:
        mv = memoryview(obj)
    except TypeError:
        if not foreign.is_foreign(obj):
            raise TypeError(f"{what}: expected a buffer, got {type(obj).__name__}") from None
        if device_array_kind(obj) is not None and foreign.on_device(obj):
            unsupported(f"{what} of device memory", "Pack and Unpack read host memory")
        arr = foreign.as_array(obj, what)
        if writable and not arr.flags.writeable:
            raise buffer_error(f"{what}: the output buffer is read-only") from None
        return arr.view(np.uint8).reshape(-1)
    if writable and mv.readonly:
        raise buffer_error(f"{what}: the output buffer is read-only")
    if not mv.contiguous:
        raise buffer_error(f"{what}: the buffer is not contiguous")
    if not mv.nbytes:
        return np.zeros(0, np.uint8)
    if mv.c_contiguous:
        return np.frombuffer(mv, np.uint8)
    # Fortran order (mpi4py takes either contiguity): its memory order, still a view
    return np.asarray(mv).reshape(-1, order="F").view(np.uint8)


def _type(d: Datatype, what: str) -> Datatype:
    if not isinstance(d, Datatype):
        raise TypeError(f"{what}: expected an MPI.Datatype, got {type(d).__name__}")
    if not d:
        raise error(ERR_TYPE, f"{what}: DATATYPE_NULL")
    if not d.is_predefined:
        d.usable(what)   # type: ignore[attr-defined]  # committed, not freed
    return d


def _index_of(d: Datatype, count: int) -> np.ndarray | None:
    """Byte indices (into the buffer) of ``count`` instances' data in type-map order; None when the
    instances are dense (bytes 0 .. count * size, in order)."""
    if d.is_predefined or d.dense:       # type: ignore[attr-defined]
        return None
    blocks = d.blocks                     # type: ignore[attr-defined]
    starts = (np.arange(count, dtype=np.int64)[:, None] * d.extent + blocks[:, 0][None, :]).reshape(-1)
    lens = np.tile(blocks[:, 1], count)
    total = int(lens.sum())
    if not total:
        return np.zeros(0, np.int64)
    # each block's bytes: start + 0 .. len-1, vectorised (the offset a byte's block adds to a global count)
    shift = np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
    return shift + np.arange(total, dtype=np.int64)


def _instances(nbytes: int, d: Datatype, what: str) -> int:
    """How many whole instances of ``d`` a buffer of ``nbytes`` holds (mpi4py: size // extent)."""
    ext = d.extent
    if ext <= 0:
        if nbytes and d.size:
            raise error(ERR_TYPE, f"{what}: a datatype of extent {ext} cannot count a buffer's instances")
        return 0
    return nbytes // ext


def _position(position: Any, what: str) -> int:
    pos = operator.index(position)
    if pos < 0:
        raise error(ERR_ARG, f"{what}: negative position {pos}")
    return pos


def _gather(src: np.ndarray, d: Datatype, count: int, what: str) -> np.ndarray:
    """The packed bytes of ``count`` instances of ``d`` in ``src``."""
    n = count * d.size
    idx = _index_of(d, count)
    if idx is None:
        if n > src.size:
            raise error(ERR_BUFFER, f"{what}: {count} instances need {n} B, the buffer has {src.size}")
        return src[:n]
    if idx.size and (idx.min() < 0 or idx.max() >= src.size):
        raise error(ERR_BUFFER, f"{what}: the datatype's blocks reach outside the buffer's {src.size} B")
    return src[idx]


def _scatter(dst: np.ndarray, d: Datatype, count: int, data: np.ndarray, what: str) -> None:
    idx = _index_of(d, count)
    if idx is None:
        if data.size > dst.size:
            raise error(ERR_BUFFER, f"{what}: {data.size} B do not fit the buffer's {dst.size}")
        dst[:data.size] = data
        return
    if idx.size and (idx.min() < 0 or idx.max() >= dst.size):
        raise error(ERR_BUFFER, f"{what}: the datatype's blocks reach outside the buffer's {dst.size} B")
    dst[idx] = data


def pack_size(d: Datatype, count: Any, comm: Any = None) -> int:
    d = _type(d, "Pack_size")
    n = operator.index(count)
    if n < 0:
        raise error(ERR_ARG, f"Pack_size: negative count {n}")
    return n * d.size


def pack(d: Datatype, inbuf: Any, outbuf: Any, position: Any, comm: Any = None,
         external: bool = False) -> int:
    what = "Pack_external" if external else "Pack"
    d = _type(d, what)
    pos = _position(position, what)
    src = _bytes(inbuf, False, what)
    dst = _bytes(outbuf, True, what)
    count = _instances(src.size, d, what)
    data = _gather(src, d, count, what)
    if external:
        data = _to_external(data, d, what)
    if pos > dst.size or pos + data.size > dst.size:
        raise error(ERR_TRUNCATE, f"{what}: {data.size} B from position {pos} do not fit the output "
                    f"buffer's {dst.size} B")
    dst[pos:pos + data.size] = data
    return pos + int(data.size)


def unpack(d: Datatype, inbuf: Any, position: Any, outbuf: Any, comm: Any = None,
           external: bool = False) -> int:
    what = "Unpack_external" if external else "Unpack"
    d = _type(d, what)
    pos = _position(position, what)
    src = _bytes(inbuf, False, what)
    dst = _bytes(outbuf, True, what)
    count = _instances(dst.size, d, what)
    n = count * (external_size(d, what) if external else d.size)
    if pos > src.size or pos + n > src.size:
        raise error(ERR_TRUNCATE, f"{what}: {count} instances need {n} B from position {pos}; the input "
                    f"buffer has {src.size} B")
    data = src[pos:pos + n]
    if external:
        data = _from_external(data, d, what)
    _scatter(dst, d, count, data, what)
    return pos + n


def _datarep(datarep: Any, what: str) -> None:
    if not isinstance(datarep, str):
        raise TypeError(f"{what}: datarep must be a str, got {type(datarep).__name__}")
    if datarep != "external32":
        raise error(ERR_ARG, f"{what}: data representation {datarep!r} (only 'external32' is defined)")


def pack_external(d: Datatype, datarep: Any, inbuf: Any, outbuf: Any, position: Any) -> int:
    _datarep(datarep, "Pack_external")
    return pack(d, inbuf, outbuf, position, external=True)


def unpack_external(d: Datatype, datarep: Any, inbuf: Any, position: Any, outbuf: Any) -> int:
    _datarep(datarep, "Unpack_external")
    return unpack(d, inbuf, position, outbuf, external=True)


def pack_external_size(d: Datatype, datarep: Any, count: Any) -> int:
    _datarep(datarep, "Pack_external_size")
    d = _type(d, "Pack_external_size")
    n = operator.index(count)
    if n < 0:
        raise error(ERR_ARG, f"Pack_external_size: negative count {n}")
    return n * external_size(d, "Pack_external_size")


# ---- external32 conversion

def _element(d: Datatype, what: str) -> np.dtype:
    """The one numpy element type of ``d``'s signature (see the module header)."""
    if d.is_predefined:
        if d._pair is not None:
            unsupported(f"{what} of the pair type {d.name}", "external32 takes types of one element type")
        assert d.dtype is not None
        return d.dtype
    base = d.base    # type: ignore[attr-defined]
    if base is None:
        if not d.size:
            return np.dtype(np.uint8)
        unsupported(f"{what} of a derived datatype mixing element types",
                    "external32 takes types of one element type (native Pack takes any)")
    return np.dtype(base)


def _ext_itemsize(el: np.dtype) -> int:
    """An element's external32 size: binary128 for long double (and two for its complex)."""
    if el.char == "g":
        return 16
    if el.char == "G":
        return 32
    return el.itemsize


def external_size(d: Datatype, what: str) -> int:
    """The bytes one instance of ``d`` takes in external32."""
    if not d.size:
        return 0
    el = _element(d, what)
    return d.size // el.itemsize * _ext_itemsize(el)


def _to_external(data: np.ndarray, d: Datatype, what: str) -> np.ndarray:
    if not data.size:
        return data
    el = _element(d, what)
    if el.char in "gG":
        return _ld_to_quad(data, what)
    if el.itemsize == 1:
        return data
    return np.frombuffer(data.tobytes(), el).astype(el.newbyteorder(">")).view(np.uint8)


def _from_external(data: np.ndarray, d: Datatype, what: str) -> np.ndarray:
    if not data.size:
        return data
    el = _element(d, what)
    if el.char in "gG":
        return _quad_to_ld(data, what)
    if el.itemsize == 1:
        return data
    return np.frombuffer(data.tobytes(), el.newbyteorder(">")).astype(el).view(np.uint8)


_M63 = np.uint64((1 << 63) - 1)


def _ld_to_quad(data: np.ndarray, what: str) -> np.ndarray:
    """Native long doubles (bytes) -> big-endian IEEE binary128 (bytes)."""
    if _LD_QUAD:
        return np.frombuffer(data.tobytes(), _LD).astype(_LD.newbyteorder(">")).view(np.uint8)
    if not _LD_X87:
        unsupported(f"{what} of long double", "this machine's long double is neither x87 extended nor "
                    "binary128")
    words = np.frombuffer(data.tobytes(), np.dtype("<u8")).reshape(-1, 2)
    mant = words[:, 0] & _M63                      # the fraction (x87 keeps the integer bit explicit)
    sign_exp = words[:, 1] & np.uint64(0xFFFF)     # sign and 15-bit exponent: the same bias in both
    hi = (sign_exp << np.uint64(48)) | (mant >> np.uint64(15))
    lo = (mant & np.uint64(0x7FFF)) << np.uint64(49)
    out = np.empty((len(words), 2), np.dtype(">u8"))
    out[:, 0], out[:, 1] = hi, lo
    return out.view(np.uint8).reshape(-1)


def _quad_to_ld(data: np.ndarray, what: str) -> np.ndarray:
    """Big-endian IEEE binary128 (bytes) -> native long doubles (bytes); x87 keeps 63 of the 112
    fraction bits (round toward zero), exactly the bits _ld_to_quad wrote."""
    if _LD_QUAD:
        return np.frombuffer(data.tobytes(), _LD.newbyteorder(">")).astype(_LD).view(np.uint8)
    if not _LD_X87:
        unsupported(f"{what} of long double", "this machine's long double is neither x87 extended nor "
                    "binary128")
    words = np.frombuffer(data.tobytes(), np.dtype(">u8")).reshape(-1, 2)
    hi, lo = words[:, 0].astype(np.uint64), words[:, 1].astype(np.uint64)
    sign_exp = hi >> np.uint64(48)
    mant = ((hi & np.uint64((1 << 48) - 1)) << np.uint64(15)) | (lo >> np.uint64(49))
    integer_bit = np.where((sign_exp & np.uint64(0x7FFF)) != 0, np.uint64(1 << 63), np.uint64(0))
    out = np.zeros((len(words), 2), np.dtype("<u8"))
    out[:, 0], out[:, 1] = mant | integer_bit, sign_exp
    return out.view(np.uint8).reshape(-1)
