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
from typing import Any

import numpy as np

from shmproxy.mpi.exceptions import ERR_BUFFER, error, unsupported

_KDL_CPU, _KDL_CUDA_HOST = 1, 3
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
    arr = np.frombuffer(raw, dtype)
    if readonly:
        arr.flags.writeable = False
    return arr


def _from_dlpack(obj: Any, what: str) -> np.ndarray:
    dev = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else (_KDL_CPU, 0)
    if int(dev[0]) not in (_KDL_CPU, _KDL_CUDA_HOST):
        unsupported(f"{what} on DLPack device type {int(dev[0])}",
                    "shmproxy moves host memory only (a CPU or pinned-host DLPack buffer works)")
    try:
        capsule = obj.__dlpack__(stream=None, max_version=(1, 0))
    except TypeError:           # an exporter of the protocol before version 1
        capsule = obj.__dlpack__(stream=None)
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
    if kind is None or lanes != 1 or bits % 8:
        raise error(ERR_BUFFER, f"{what}: DLPack dtype code {t.dtype.code} bits {t.dtype.bits} lanes "
                    f"{t.dtype.lanes} has no buffer format")
    dtype = np.dtype(f"{kind}{bits // 8}") if kind != "b" else np.dtype(np.bool_)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = None if not t.strides else tuple(t.strides[i] * dtype.itemsize for i in range(t.ndim))
    if not _contiguous(shape, strides, dtype.itemsize):
        raise error(ERR_BUFFER, f"{what} is not contiguous (a strided DLPack tensor)")
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return _view((t.data or 0) + t.byte_offset, n * dtype.itemsize, dtype, readonly, (obj, capsule))


def _from_cai(obj: Any, what: str) -> np.ndarray:
    cai = obj.__cuda_array_interface__
    addr, readonly = cai["data"]
    dtype = np.dtype(cai["typestr"])
    shape = tuple(int(s) for s in cai["shape"])
    strides = cai.get("strides")
    if cai.get("mask") is not None:
        raise error(ERR_BUFFER, f"{what}: a masked CUDA array interface buffer")
    if not _contiguous(shape, None if strides is None else tuple(strides), dtype.itemsize):
        raise error(ERR_BUFFER, f"{what} is not contiguous (a strided CUDA array interface buffer)")
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return _view(int(addr or 0), n * dtype.itemsize, dtype, bool(readonly), (obj,))


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
    host memory behind the CUDA array interface (this module's). DLPack says so itself."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        return True   # DLPack on a CUDA device (memory.device_array_kind said so)
    lib = _libcuda()
    if lib is None:
        return False
    kind = ctypes.c_uint(0)
    addr = int(cai["data"][0] or 0)
    if lib.cuPointerGetAttribute(ctypes.byref(kind), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr) != 0:
        return False   # not memory CUDA knows: plain host memory
    return kind.value == _CU_MEMORYTYPE_DEVICE
