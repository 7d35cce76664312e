"""Buffers that reach the MPI layer through DLPack or the CUDA array interface in host memory, seen as
numpy views; and the test that tells device memory from host memory behind such an object.

mpi4py takes, besides the buffer protocol, any object with ``__dlpack__`` / ``__dlpack_device__`` or
``__cuda_array_interface__``. Device memory never comes here: buffers.py hands an object whose memory
is on a GPU (``on_device``) to the native layer, which moves device memory itself. What comes here is
host memory behind those protocols:

- DLPack on the CPU (or in CUDA pinned host memory); any other device raises NotImplementedError
  naming it. The capsule is read here, without consuming it (not renamed): the view keeps both the
  capsule and the exporting object alive, and the producer's deleter runs when the capsule goes, as
  the DLPack protocol says for a capsule nobody consumed.
- The CUDA array interface over host memory: pinned or registered memory, or a host array that
  merely exports the interface (mpi4py's own tests do). ``on_device`` asks the CUDA driver what the
  pointer is; without a driver no pointer can be device memory.

The result is a numpy array over the memory, never a copy, read-only where the exporter says so.
"""
from __future__ import annotations

import ctypes
import sys
import warnings
from typing import Any

import numpy as np

from shmproxy.mpi.exceptions import ERR_BUFFER, buffer_error, error, unsupported

_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13
_DL_READ_ONLY = 1
# DLDataTypeCode -> numpy kind
_DL_KIND = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManaged(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedVersioned(ctypes.Structure):
    _fields_ = [("version", _DLVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_api = ctypes.pythonapi
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def is_foreign(obj: Any) -> bool:
    return hasattr(obj, "__dlpack__") or hasattr(obj, "__cuda_array_interface__")


def _contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> bool:
    """C or Fortran contiguous (strides in bytes; None means C order)."""
    if strides is None or 0 in shape:
        return True
    for order in (reversed(range(len(shape))), range(len(shape))):
        step = itemsize
        ok = True
        for i in order:
            if shape[i] != 1 and strides[i] != step:
                ok = False
                break
            step *= shape[i]
        if ok:
            return True
    return False


def _view(addr: int, nbytes: int, dtype: np.dtype, readonly: bool, keep: tuple[Any, ...]) -> np.ndarray:
    """A 1-D array of ``dtype`` over ``nbytes`` at ``addr`` that keeps ``keep`` alive."""
    if nbytes == 0:
        return np.empty(0, dtype)
    raw = (ctypes.c_char * nbytes).from_address(addr)
    raw._shmproxy_keep = keep      # type: ignore[attr-defined]  # the exporter outlives the view
    arr = np.frombuffer(raw, dtype)   # type: ignore[call-overload]  # ctypes arrays export the protocol
    if readonly:
        arr.flags.writeable = False
    return arr


def _from_dlpack(obj: Any, what: str) -> np.ndarray:
    dev = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else (_KDL_CPU, 0)
    devtype = int(dev[0])
    # CUDA device or managed memory where no CUDA driver loads is host memory (on_device)
    host_cuda = devtype in (_KDL_CUDA, _KDL_CUDA_MANAGED) and _libcuda() is None
    if devtype not in (_KDL_CPU, _KDL_CUDA_HOST) and not host_cuda:
        unsupported(f"{what} on DLPack device type {devtype}",
                    "shmproxy moves host memory only (a CPU or pinned-host DLPack buffer works)")
    # DLPack's stream argument: None for CPU memory, -1 (no synchronisation) for a CUDA device's
    stream = None if devtype in (_KDL_CPU, _KDL_CUDA_HOST) else -1
    try:
        capsule = obj.__dlpack__(stream=stream, max_version=(1, 0))
    except TypeError:           # an exporter of the protocol before version 1
        capsule = obj.__dlpack__(stream=stream)
    readonly = False
    if _api.PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        mv = _DLManagedVersioned.from_address(_api.PyCapsule_GetPointer(capsule, b"dltensor_versioned"))
        t, readonly = mv.dl_tensor, bool(mv.flags & _DL_READ_ONLY)
    elif _api.PyCapsule_IsValid(capsule, b"dltensor"):
        t = _DLManaged.from_address(_api.PyCapsule_GetPointer(capsule, b"dltensor")).dl_tensor
    else:
        raise error(ERR_BUFFER, f"{what}: __dlpack__ gave no DLPack capsule (or one already used)")
    kind, lanes, bits = _DL_KIND.get(t.dtype.code), t.dtype.lanes, int(t.dtype.bits)
    if kind == "f" and lanes == 2:      # a complex number as two lanes of its real type
        kind, lanes, bits = "c", 1, bits * 2
    dtype: np.dtype
    if kind is None or lanes != 1:
        # as mpi4py: an element type with no buffer format (an opaque code, several lanes) is its
        # bytes, (bits * lanes + 7) // 8 of them per element
        if not bits * lanes:
            raise error(ERR_BUFFER, f"{what}: DLPack dtype code {t.dtype.code} bits {t.dtype.bits} lanes "
                        f"{t.dtype.lanes} has no size")
        dtype, itemsize = np.dtype(np.uint8), (bits * lanes + 7) // 8
    elif bits % 8:
        raise error(ERR_BUFFER, f"{what}: DLPack dtype code {t.dtype.code} bits {t.dtype.bits} lanes "
                    f"{t.dtype.lanes} has no buffer format")
    else:
        dtype = np.dtype(f"{kind}{bits // 8}") if kind != "b" else np.dtype(np.bool_)
        itemsize = dtype.itemsize
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = None if not t.strides else tuple(t.strides[i] * itemsize for i in range(t.ndim))
    if not _contiguous(shape, strides, itemsize):
        raise buffer_error(f"{what} is not contiguous (a strided DLPack tensor)")
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return _view((t.data or 0) + t.byte_offset, n * itemsize, dtype, readonly, (obj, capsule))


# typestr kind -> the numpy kinds whose C types mpi4py gives a format ("b" bool, "i", "u", "f", "c");
# any other kind (or size) travels as bytes
_CAI_KINDS = {"b": "b", "i": "i", "u": "u", "f": "f", "c": "c"}


def read_cai(obj: Any, what: str) -> tuple[int, int, bool, np.dtype]:
    """(address, nbytes, readonly, element dtype) of a CUDA-array-interface object, checked as
    mpi4py checks one, with its errors: KeyError for a missing data/typestr/shape, TypeError for an
    entry of the wrong type, ValueError for a data pair of another length or a typestr without a
    size, BufferError for a byte order not this machine's, a mask, a negative size or strides that
    are neither C nor Fortran contiguous. A ``descr`` other than the typestr's own is a
    RuntimeWarning; where it lists fields of one type that fill the typestr's size ("|V24" over three
    "<f8"), the elements are read as that type (mpi4py moves their bytes). Other kinds are bytes."""
    cai = obj.__cuda_array_interface__
    if not isinstance(cai, dict):
        raise TypeError(f"{what}: __cuda_array_interface__ is {type(cai).__name__}, not a dict")
    data, typestr, shape = cai["data"], cai["typestr"], cai["shape"]
    strides, descr, mask = cai.get("strides"), cai.get("descr"), cai.get("mask")
    for name, v, t in (("data", data, tuple), ("typestr", typestr, str), ("shape", shape, tuple),
                       ("strides", strides, tuple), ("descr", descr, list)):
        if v is None and name in ("strides", "descr"):
            continue
        if not isinstance(v, t):
            raise TypeError(f"{what}: __cuda_array_interface__[{name!r}] is {type(v).__name__}, "
                            f"not a {t.__name__}")
    if len(data) != 2:
        raise ValueError(f"{what}: __cuda_array_interface__['data'] has {len(data)} items, not 2")
    ptr, readonly = data
    size = 1
    for n in shape:
        size *= int(n)
    if ptr is None and size == 0:
        ptr = 0
    if not isinstance(ptr, int):
        raise TypeError(f"{what}: __cuda_array_interface__ data pointer is {type(ptr).__name__}")
    order, kind, itemsize = typestr[0:1], typestr[1:2], int(typestr[2:])
    native = "<" if sys.byteorder == "little" else ">"
    if order in "<>" and order != native:
        raise buffer_error(f"{what}: __cuda_array_interface__ typestr {typestr!r} with non-native byte "
                           "order")
    if order not in ("<", ">", "|"):
        raise buffer_error(f"{what}: __cuda_array_interface__ typestr {typestr!r} with unrecognized "
                           "byte order")
    if mask is not None:
        raise buffer_error(f"{what}: __cuda_array_interface__: cannot handle masked arrays")
    if size < 0:
        raise buffer_error(f"{what}: __cuda_array_interface__ buffer with negative size (shape {shape})")
    if strides is not None and not _contiguous(tuple(int(n) for n in shape), tuple(int(x) for x in strides),
                                               itemsize):
        raise buffer_error(f"{what} is not contiguous (shape {shape}, strides {strides}, itemsize "
                           f"{itemsize})")
    dtype = np.dtype(np.uint8)
    if kind in _CAI_KINDS:
        try:
            dtype = np.dtype(f"{_CAI_KINDS[kind]}{itemsize}")
        except TypeError:        # a size of no such type: its bytes
            dtype = np.dtype(np.uint8)
    if descr is not None and (len(descr) != 1 or tuple(descr[0]) != ("", typestr)):
        warnings.warn(f"{what}: __cuda_array_interface__: ignoring 'descr' key", RuntimeWarning, stacklevel=3)
        fields = {tuple(f)[1] for f in descr if len(f) >= 2}
        if kind == "V" and len(fields) == 1 and all(tuple(f)[0] == "" for f in descr):
            try:
                field = np.dtype(fields.pop())
            except TypeError:
                field = None
            if field is not None and field.isnative and field.itemsize * len(descr) == itemsize:
                dtype = field
    return int(ptr), size * itemsize, bool(readonly), dtype


def _from_cai(obj: Any, what: str) -> np.ndarray:
    addr, nbytes, readonly, dtype = read_cai(obj, what)
    if nbytes % dtype.itemsize:
        dtype = np.dtype(np.uint8)
    return _view(addr, nbytes, dtype, readonly, (obj,))


def as_array(obj: Any, what: str) -> np.ndarray:
    """The host view of a DLPack or CUDA-array-interface object in host memory (see the module doc)."""
    if hasattr(obj, "__dlpack__") and not hasattr(obj, "__cuda_array_interface__"):
        return _from_dlpack(obj, what)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cai(obj, what)
    return _from_dlpack(obj, what)


_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, _CU_MEMORYTYPE_DEVICE = 2, 2
_driver: list[Any] = []   # [libcuda or None], found once


def _libcuda() -> Any:
    if not _driver:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuInit.argtypes = [ctypes.c_uint]
            lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
            _driver.append(lib if lib.cuInit(0) == 0 else None)
        except (OSError, AttributeError):
            _driver.append(None)   # no driver: no pointer can be device memory
    return _driver[0]


def on_device(obj: Any) -> bool:
    """Whether a device-array object's memory is on a GPU (the native layer's business) rather than
    host memory behind the CUDA array interface or DLPack (this module's). Without a CUDA driver no
    pointer can be device memory (mpi4py's own tests export host arrays as CUDA ones); with one, the
    driver says where a CUDA-array-interface pointer is, and DLPack's device type is believed."""
    lib = _libcuda()
    if lib is None:
        return False   # no CUDA driver: no pointer can be device memory
    if not hasattr(obj, "__cuda_array_interface__"):
        return True   # DLPack on a CUDA device (memory.device_array_kind said so)
    cai = obj.__cuda_array_interface__
    if not isinstance(cai, dict):
        return False   # a malformed interface: read_cai refuses it with mpi4py's error
    kind = ctypes.c_uint(0)
    try:
        addr = int(cai["data"][0] or 0)
    except (KeyError, TypeError, IndexError, ValueError):
        return False   # a malformed interface: read_cai refuses it with mpi4py's error
    if lib.cuPointerGetAttribute(ctypes.byref(kind), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr) != 0:
        return False   # not memory CUDA knows: plain host memory
    return kind.value == _CU_MEMORYTYPE_DEVICE
