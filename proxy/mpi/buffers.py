"""Buffer arguments in mpi4py's forms, turned into the numpy views the native layer takes.

Accepted (``buf`` is any object of the buffer protocol: numpy arrays, bytearray, bytes for sends,
array.array, mmap, memoryview, ctypes arrays; DLPack and CUDA-array-interface objects over host
memory, foreign.py). Device arrays (memory on a GPU: cupy, torch) are handed to the native
layer as they are, which moves device memory itself (a CUDA-aware MPI, as mpi4py's users of cupy
expect), in the forms ``buf`` and ``[buf, its datatype]``; other forms with them raise
NotImplementedError.

    buf                                   every element, datatype from the buffer's format
    [buf, datatype]  /  (buf, datatype)   datatype: an MPI.Datatype or a type code such as "d"
    [buf, count]                          the first ``count`` elements
    [buf, count, datatype]
    [buf, (count, displ), datatype]       ``count`` elements from element ``displ``
    [buf, count, displ, datatype]
    [buf, (counts, displs), datatype]     vector forms, for the v-collectives (``parse_v``, which reads
    [buf, counts, displs, datatype]       every form mpi4py reads: counts and displs each a sequence of
    [buf, counts, datatype], [buf, count] one per rank, or one integer (one count for every rank; a
                                          displacement *stride*), or left out (counts split from the
                                          buffer's size; displs packed))
    None, MPI.IN_PLACE, MPI.BOTTOM        kept as they are; the calls decide where they are allowed

The result is a 1-D numpy view of the caller's memory (never a copy), with the datatype's dtype: a
receive writes straight into the caller's object. Every bad spec raises MPI.Exception (ERR_BUFFER,
ERR_TYPE, ERR_COUNT) here, before the call posts anything. Counts and displacements are read as mpi4py
reads them, through ``__index__`` (numpy integers, bools); anything else is an ERR_COUNT that is also
a TypeError. Counts in collectives are per block (per rank), as in MPI: ``[buf, count, type]`` as
Allgather's recvbuf means ``count`` elements per rank.

A numpy array with no datatype is the common case and takes a short path (no conversion at all);
the calls' own fast paths test for it inline (``FAST_DTYPES``, a C-contiguous exact ndarray), so that
the common call costs no more than a few attribute reads over the native one.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from shmproxy.core.memory import device_array_kind
from shmproxy.core.ops import DTYPE_CODE, IN_PLACE, AddressConstant
from shmproxy.mpi.datatypes import Datatype, check_native, from_typecode, of_dtype
from shmproxy.mpi import foreign
from shmproxy.mpi.exceptions import (ERR_BUFFER, ERR_COUNT, ERR_TYPE, as_int, buffer_error, error,
                                     is_integral, type_error, unsupported)
from shmproxy.mpi.foreign import is_foreign
from shmproxy.mpi.typemap import Derived, typed_buffer


class BottomType(AddressConstant):
    """MPI.BOTTOM: address 0, from which the w collectives' displacements count as absolute addresses."""

    __module__ = "shmproxy.MPI"


class BufferAutomaticType(AddressConstant):
    """MPI.BUFFER_AUTOMATIC (MPI 4.1): the library's own buffer for buffered sends; a constant only
    here (Attach_buffer takes a real buffer)."""

    __module__ = "shmproxy.MPI"


BOTTOM = BottomType._make("BOTTOM", 0)
BUFFER_AUTOMATIC = BufferAutomaticType._make("BUFFER_AUTOMATIC", -2)

# The dtypes a plain array goes to the native layer with as it is: a type the native layer has a code
# for, in this machine's byte order (a byte-swapped dtype compares unequal, so it is not in the set).
FAST_DTYPES: frozenset = frozenset(np.dtype(c) for c in DTYPE_CODE)


class VSpec(NamedTuple):
    """A vector buffer: ``array`` (1-D, the datatype's dtype), per-rank ``counts`` and ``displs``."""
    array: np.ndarray
    counts: tuple[int, ...]
    displs: tuple[int, ...]
    datatype: Datatype


def _as_array(obj: Any, writable: bool, what: str) -> np.ndarray:
    """A 1-D uint8/typed view of a buffer-protocol object, C or Fortran contiguous; no copy."""
    if isinstance(obj, np.ndarray):
        arr = obj if type(obj) is np.ndarray else obj.view(np.ndarray)   # np.memmap, subclasses
    else:
        try:
            mv = memoryview(obj)
        except TypeError:
            if _on_device(obj):
                unsupported(f"{what}: a device buffer in this form (pass the device array itself)")
            if is_foreign(obj):
                return _checked(foreign.as_array(obj, what), obj, writable, what)
            raise type_error(ERR_BUFFER, f"{what}: expected a buffer (numpy array, bytearray, array.array, "
                             f"...) or an mpi4py buffer spec, got {type(obj).__name__}") from None
        try:
            arr = np.asarray(mv)
        except (ValueError, TypeError, NotImplementedError):  # a format numpy cannot read: its bytes
            arr = np.frombuffer(mv.cast("B") if mv.c_contiguous else mv, np.uint8)
    return _checked(arr, obj, writable, what)


def _on_device(obj: Any) -> bool:
    """A device array whose memory is on a GPU (foreign.on_device), not host memory behind the CUDA
    array interface."""
    return device_array_kind(obj) is not None and foreign.on_device(obj)


def _device_dtype(obj: Any) -> np.dtype | None:
    """The dtype a device array says it has (cupy, torch: ``dtype``; else its CUDA array interface)."""
    try:
        return np.dtype(obj.__cuda_array_interface__["typestr"])
    except (AttributeError, KeyError, TypeError):
        try:
            return np.dtype(str(obj.dtype).replace("torch.", ""))
        except (AttributeError, TypeError):
            return None


def _checked(arr: np.ndarray, obj: Any, writable: bool, what: str) -> np.ndarray:
    if writable and not arr.flags.writeable:   # BufferError too, as mpi4py raises for it
        raise buffer_error(f"{what} is read-only ({type(obj).__name__})")
    if arr.ndim != 1:
        if arr.flags.c_contiguous:
            arr = arr.reshape(-1)
        elif arr.flags.f_contiguous:
            arr = arr.reshape(-1, order="F")    # memory order: still a view
        else:
            raise error(ERR_BUFFER, f"{what} is not contiguous: pass a contiguous array (or a copy)")
    elif not arr.flags.c_contiguous:
        raise error(ERR_BUFFER, f"{what} is not contiguous (a strided view): pass a contiguous array")
    return arr


def _as_datatype(t: Any, what: str) -> Datatype:
    if isinstance(t, Datatype):
        return t
    if isinstance(t, str):
        return from_typecode(t)
    raise error(ERR_TYPE, f"{what}: expected an MPI.Datatype or a type code, got {t!r}")


def _retype(arr: np.ndarray, d: Datatype | None, what: str) -> tuple[np.ndarray, Datatype]:
    """``arr`` seen as elements of ``d`` (the buffer's own type when None)."""
    if d is None:
        dt = arr.dtype
        if not dt.isnative:
            raise buffer_error(f"{what}: a buffer of {dt.str} is not in this machine's byte order (name its "
                               "datatype, [buf, MPI.INT], to move its bytes as they are)")
        if dt.char not in DTYPE_CODE:
            d = of_dtype(dt)
            dt = check_native(d, what)
            arr = arr.view(dt)
        else:
            d = of_dtype(dt)
        return arr, d
    dt = check_native(d, what)
    if arr.dtype != dt:
        if arr.nbytes % dt.itemsize:
            raise error(ERR_BUFFER, f"{what}: {arr.nbytes} bytes are not a whole number of {d.name} "
                        f"elements ({dt.itemsize} bytes each)")
        arr = arr.view(dt)
    return arr, d


def as_count(v: Any, name: str, what: str) -> int:
    """A count or displacement: any integer mpi4py takes (``operator.index``: ints, bools, numpy
    integers, 0-d integer arrays), not negative."""
    v = as_int(v, f"{what}: {name}", ERR_COUNT)
    if v < 0:
        raise error(ERR_COUNT, f"{what}: negative {name} {v}")
    return v


def _split(spec: Any, what: str) -> tuple[Any, Any, Any, Any]:
    """(buf, count-or-None, displ-or-None, datatype-or-None) of a list/tuple spec; counts may be a
    (counts, displs) pair of sequences (the vector form)."""
    n = len(spec)
    if n == 0 or n > 4:
        raise error(ERR_BUFFER, f"{what}: a buffer spec is [buf, datatype], [buf, count, datatype] or "
                    f"[buf, (count, displ), datatype]; got a {type(spec).__name__} of {n} items")
    buf = spec[0]
    if n == 1:
        return buf, None, None, None
    if n == 2:
        second = spec[1]
        if isinstance(second, (Datatype, str)):
            return buf, None, None, second
        return buf, second, None, None
    if n == 3:
        return buf, spec[1], None, spec[2]
    return buf, spec[1], spec[2], spec[3]


def parse(spec: Any, what: str, writable: bool, blocks: int = 1) -> Any:
    """The numpy view of one buffer spec; None, IN_PLACE and BOTTOM come back unchanged.

    ``blocks``: how many per-rank blocks the buffer holds (a count in the spec is per block)."""
    if type(spec) is np.ndarray:     # the short path: a plain array of a native dtype
        flags = spec.flags
        if (spec.dtype.char in DTYPE_CODE and spec.dtype.isnative and flags.c_contiguous
                and (flags.writeable or not writable)):
            return spec
        arr = _as_array(spec, writable, what)
        return _retype(arr, None, what)[0]
    if spec is None or spec is IN_PLACE or spec is BOTTOM:
        return spec
    if not isinstance(spec, (list, tuple)):
        if _on_device(spec):
            return spec      # device memory: the native layer moves it (CUDA-aware, as mpi4py's users expect)
        return _retype(_as_array(spec, writable, what), None, what)[0]
    if len(spec) == 2:     # [array, MPI.DOUBLE] with the array's own dtype: the second short path
        buf, d = spec
        if type(buf) is np.ndarray:    # host memory (asked first: the device test costs more)
            if type(d) is Datatype and d.dtype is not None and buf.dtype == d.dtype and d._pair is None:
                flags = buf.flags
                if buf.dtype.char in DTYPE_CODE and flags.c_contiguous and (flags.writeable or not writable):
                    return buf
        elif _on_device(buf):
            if type(d) is Datatype and d.dtype is not None and d._pair is None and _device_dtype(buf) == d.dtype:
                return buf
            unsupported(f"{what}: a device buffer with a datatype other than its own dtype")
    buf, count, displ, dtype = _split(spec, what)
    if type(buf) is not np.ndarray and _on_device(buf):
        unsupported(f"{what}: a device buffer with a count or displacement (pass the device array, or "
                    f"[array, its datatype])")
    if buf is None or buf is BOTTOM:
        if count in (None, 0) and dtype is not None:
            return np.empty(0, check_native(_as_datatype(dtype, what), what))
        raise error(ERR_BUFFER, f"{what}: a None/BOTTOM buffer needs derived datatypes, which are not "
                    "supported")
    arr = _as_array(buf, writable, what)
    if type(dtype) is Derived:   # a block list the progress process gathers/scatters (typemap.py)
        if isinstance(count, (list, tuple)) and len(count) == 2 and displ is None:
            count, displ = count
        return typed_buffer(arr, dtype, None if count is None else as_count(count, "count", what) * blocks,
                            displ, what, writable)
    arr, _d = _retype(arr, None if dtype is None else _as_datatype(dtype, what), what)
    if isinstance(count, (list, tuple)):
        if len(count) != 2 or displ is not None:
            raise error(ERR_BUFFER, f"{what}: expected [buf, (count, displ), datatype]")
        count, displ = count
        if isinstance(count, (list, tuple, np.ndarray)):
            raise error(ERR_BUFFER, f"{what}: a vector spec ([buf, (counts, displs), type]) is for the "
                        "v-collectives only")
    start = 0 if displ is None else as_count(displ, "displacement", what)
    if count is None:
        if start > arr.size:
            raise error(ERR_COUNT, f"{what}: displacement {start} beyond the buffer's {arr.size} elements")
        return arr[start:] if start else arr
    n = as_count(count, "count", what) * blocks
    if start + n > arr.size:
        raise error(ERR_COUNT, f"{what}: {n} elements from element {start} do not fit the buffer's "
                    f"{arr.size} elements")
    return arr[start:start + n] if (start or n != arr.size) else arr


def _is_pair(v: Any) -> bool:
    """Whether the second item of a vector spec is a ``(counts, displs)`` pair. mpi4py reads every
    tuple as one (so ``(count, displ)`` of two ints is a pair, never two counts); a list of two items
    whose first is a sequence is read as one too, since a list of counts never holds sequences. A
    tuple of another length is a tuple of counts (mpi4py refuses it; it has one meaning only)."""
    if isinstance(v, tuple):
        return len(v) == 2
    return (isinstance(v, list) and len(v) == 2
            and (isinstance(v[0], (list, tuple)) or (isinstance(v[0], np.ndarray) and v[0].ndim > 0)))


def _split_v(spec: Any, what: str) -> tuple[Any, Any, Any, Any]:
    """(buf, counts, displs, datatype) of a vector spec, each None where the spec leaves it out, as
    mpi4py's ``message_vector`` unpacks it: ``buf``, ``[buf, datatype]``, ``[buf, counts]``,
    ``[buf, (counts, displs)]``, ``[buf, counts, datatype]``, ``[buf, (counts, displs), datatype]``,
    ``[buf, counts, displs, datatype]``."""
    if not isinstance(spec, (list, tuple)):
        return spec, None, None, None
    n = len(spec)
    if n == 1:       # [buf]: as parse() reads it (mpi4py asks for 2 to 4 items)
        return spec[0], None, None, None
    if n not in (2, 3, 4):
        raise error(ERR_BUFFER, f"{what}: a vector spec is [buf, counts, displs, datatype], [buf, (counts, "
                    f"displs), datatype], [buf, counts, datatype] or [buf, counts]; got {n} items")
    if n == 4:
        return spec[0], spec[1], spec[2], spec[3]
    buf, counts = spec[0], spec[1]
    dtype = spec[2] if n == 3 else None
    if n == 2 and isinstance(counts, (Datatype, str)):
        return buf, None, None, counts
    if _is_pair(counts):
        return buf, counts[0], counts[1], dtype
    return buf, counts, None, dtype


def parse_v(spec: Any, what: str, writable: bool, size: int) -> VSpec:
    """A vector spec for ``size`` ranks (blocks), read as mpi4py reads one (``_split_v`` for its forms):

    counts: a sequence (or 1-D array) of ``size`` counts; one integer, that count for every rank; or
    left out, the buffer's elements split as evenly as they go (the first ``n % size`` ranks one more).
    displs: a sequence of ``size`` displacements; one integer, a stride (rank r's block at r * displ);
    or left out / None, the blocks one after another from element 0."""
    buf, counts, displs, dtype = _split_v(spec, what)
    if buf is not None and buf is not BOTTOM and _on_device(buf):
        unsupported(f"{what}: device buffers in the vector collectives")
    d = None if dtype is None else _as_datatype(dtype, what)
    derived = type(d) is Derived
    if buf is None or buf is BOTTOM:     # no memory: only zero counts fit in it
        if d is None:     # left-out counts are split from its size, 0, as mpi4py splits them
            raise error(ERR_BUFFER, f"{what}: a None/BOTTOM buffer needs a datatype")
        arr = np.empty(0, np.uint8 if derived else check_native(d, what))
    else:
        arr = _as_array(buf, writable, what)
    if not derived:
        arr, d = _retype(arr, d, what)
    if counts is None:    # in instances of the datatype (a derived one: of its extent)
        total = arr.nbytes // max(d.extent, 1) if derived else arr.size   # type: ignore[union-attr]
        cs = tuple(total // size + (r < total % size) for r in range(size))
    else:
        cs = _per_rank(counts, size, "count", what)
    if displs is None:
        dsp, acc = [], 0
        for c in cs:
            dsp.append(acc)
            acc += c
        ds = tuple(dsp)
    else:
        ds = _per_rank(displs, size, "displacement", what, stride=True)
    if derived:
        return _parse_v_derived(arr, d, cs, ds, what, writable)   # type: ignore[arg-type]
    for r, (c, x) in enumerate(zip(cs, ds)):
        if c and x + c > arr.size:
            raise error(ERR_COUNT, f"{what}: block {r} ({c} elements at {x}) does not fit the buffer's "
                        f"{arr.size} elements")
    return VSpec(arr, cs, ds, d)   # type: ignore[arg-type]


def _per_rank(v: Any, size: int, name: str, what: str, stride: bool = False) -> tuple[int, ...]:
    """``size`` counts or displacements from mpi4py's forms: a sequence (or 1-D array) of ``size``
    integers, or one integer: the same for every rank, or with ``stride`` (displacements) a stride,
    rank r's block at r * v."""
    if is_integral(v):
        one = as_count(v, name, what)
        return tuple(one * r for r in range(size)) if stride else (one,) * size
    try:
        if isinstance(v, (str, bytes)):     # iterable, but never integers
            raise TypeError(v)
        items = list(v)
    except TypeError:
        raise type_error(ERR_COUNT, f"{what}: {name}s must be an integer or a sequence of {size}, got "
                         f"{type(v).__name__}") from None
    if len(items) != size:
        raise error(ERR_COUNT, f"{what}: {len(items)} {name}s for {size} ranks")
    return tuple(as_count(x, name, what) for x in items)


def _parse_v_derived(arr: np.ndarray, d: Datatype, cs: tuple[int, ...], ds: tuple[int, ...], what: str,
                     writable: bool) -> VSpec:
    """A vector spec of a derived type: the buffer of every instance up to the last block's end (a
    TypedBuffer, or a plain view when dense), counts and displacements scaled from instances to the
    elements of its contiguous form (shmproxy.mpi.typedcoll)."""
    n = max((x + c for c, x in zip(cs, ds) if c), default=0)
    buf = typed_buffer(arr, d, n, None, what, writable)   # type: ignore[arg-type]
    item = buf.temp_dtype().itemsize if type(buf) is not np.ndarray else buf.dtype.itemsize
    k = d.size // item
    return VSpec(buf, tuple(c * k for c in cs), tuple(x * k for x in ds), d)


def datatype_named(spec: Any) -> Datatype | None:
    """The datatype a spec names, or its buffer's own (None where neither is known)."""
    if isinstance(spec, (list, tuple)) and len(spec) >= 2 and isinstance(spec[-1], (Datatype, str)):
        return _as_datatype(spec[-1], "buffer spec")
    try:
        return of_dtype(_as_array(spec[0] if isinstance(spec, (list, tuple)) else spec, False, "").dtype)
    except (ValueError, TypeError):   # no known type: a user op gets None
        return None


def wire(x: Any) -> Any:
    """What the native layer is handed for a parsed buffer: a dtype it has no code for (the
    (value, index) pair types) travels as its bytes; anything else unchanged."""
    if type(x) is np.ndarray and x.dtype.char not in DTYPE_CODE:
        return x.view(np.uint8)
    return x


def datatype_of(spec: Any, what: str) -> Datatype:
    """The datatype a spec names or implies (for Status.Get_count in tests and Probe-like calls)."""
    arr = parse(spec, what, writable=False)
    return of_dtype(arr.dtype)
