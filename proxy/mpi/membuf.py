"""MPI.buffer: mpi4py's buffer object, a window of memory (an address and a length in bytes) that
exports itself through the buffer protocol as unsigned bytes.

    MPI.buffer()                          empty (address 0, 0 bytes)
    MPI.buffer(obj)                       obj's memory (buffer protocol, DLPack, CUDA array interface),
                                          read-only where obj is
    MPI.buffer.allocate(n, clear=False)   n new bytes (zeroed with clear); MPI.Alloc_mem gives these
    MPI.buffer.frombuffer(obj, readonly=False)   obj's memory, writable unless readonly
    MPI.buffer.fromaddress(address, n, readonly=False)   n bytes at an address nobody owns here
    buf.address, buf.nbytes, buf.readonly, buf.obj, buf.format ("B"), buf.itemsize (1), len(buf)
    buf[i], buf[a:b] (a buffer over those bytes), buf[i] = v, buf[a:b] = v (an int fills, a buffer of
    the same length copies), buf.cast(fmt, shape), buf.tobytes(), buf.toreadonly(), buf.release()

The buffer protocol half is compiled (shm/_membuf.c: Python 3.11 cannot export it from Python); this
module is the rest, with mpi4py's errors: TypeError for what is no buffer or a write to a read-only
one, ValueError for a negative size, a NULL address or a slice of another length, IndexError for an
index out of range or a slice with a step, BufferError for memory the CPU cannot read (DLPack on a GPU,
the CUDA array interface) and for a writable view of read-only memory. Memory on a GPU is held (its
address and size), never read here.
"""
from __future__ import annotations

import ctypes
import operator
from typing import Any

import numpy as np

from shmproxy.mpi import foreign
from shmproxy.shm._membuf import Base

_KDL_CUDA = 2
# DLPack device types whose memory the CPU reads (shm/_membuf.c's cpu_accessible): the buffer
# protocol (0), CPU, CUDA host, ROCm host, CUDA managed.
_CPU_KINDS = frozenset((0, 1, 3, 11, 13))


def _check_cpu(buf: Base) -> None:
    if buf._kind not in _CPU_KINDS:
        raise BufferError("buffer is not CPU-accessible")


def _index(item: Any, n: int) -> int:
    """A byte index as mpi4py reads one (``__index__``; negative from the end), IndexError outside."""
    try:
        i = operator.index(item)
    except OverflowError:
        raise IndexError("index out of range") from None
    if i < 0:
        i += n
    if i < 0 or i >= n:
        raise IndexError("index out of range")
    return i


def _span(item: slice, n: int) -> tuple[int, int]:
    """(start, length) of a slice of n bytes; mpi4py takes no step but 1."""
    start, stop, step = item.indices(n)
    if step != 1:
        raise IndexError("slice with step not supported")
    return start, max(stop - start, 0)


def dlpack_region(obj: Any, writable: bool = False) -> tuple[int, int, bool, int, str | None]:
    """(address, nbytes, readonly, device type, None) of a DLPack exporter's tensor, or (0, 0, False,
    device type, what is wrong) as mpi4py checks one: a device pair of ints, a capsule not yet used,
    version 1 or later, ndim >= 0 with non-negative sizes, contiguous strides. The capsule lives in
    this frame only (never in an exception's traceback: the exporter counts references to its
    memory), so problems come back as text for the caller to raise."""
    dev = (foreign._KDL_CPU, 0)
    if hasattr(obj, "__dlpack_device__"):
        dev = obj.__dlpack_device__()      # None as the attribute: TypeError, as in mpi4py
        if not isinstance(dev, tuple):
            raise TypeError(f"__dlpack_device__() gave {type(dev).__name__}, not a tuple")
        if len(dev) != 2:
            raise ValueError(f"__dlpack_device__() gave {len(dev)} items, not 2")
        if not all(isinstance(x, int) for x in dev):
            raise TypeError("__dlpack_device__() items must be integers")
    kind = int(dev[0])
    # DLPack's stream argument: None for CPU memory, -1 (no synchronisation) for device memory
    stream = None if kind in (foreign._KDL_CPU, foreign._KDL_CUDA_HOST) else -1
    try:
        capsule = obj.__dlpack__(stream=stream, max_version=(1, 0))
    except TypeError:           # an exporter of the protocol before version 1
        capsule = obj.__dlpack__(stream=stream)
    api = foreign._api
    readonly = False
    if api.PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        m = foreign._DLManagedVersioned.from_address(api.PyCapsule_GetPointer(capsule, b"dltensor_versioned"))
        if m.version.major < 1:
            return 0, 0, False, kind, (f"DLPack version {m.version.major}.{m.version.minor} in a "
                                       "versioned capsule")
        t, readonly = m.dl_tensor, bool(m.flags & foreign._DL_READ_ONLY)
    elif api.PyCapsule_IsValid(capsule, b"dltensor"):
        t = foreign._DLManaged.from_address(api.PyCapsule_GetPointer(capsule, b"dltensor")).dl_tensor
    else:
        return 0, 0, False, kind, "__dlpack__ gave no DLPack capsule (or one already used)"
    if t.ndim < 0:
        return 0, 0, False, kind, f"a DLPack tensor of ndim {t.ndim}"
    if t.ndim and not t.shape:
        return 0, 0, False, kind, "a DLPack tensor with no shape"
    shape = tuple(int(t.shape[k]) for k in range(t.ndim))
    if any(n < 0 for n in shape):
        return 0, 0, False, kind, f"a DLPack tensor of shape {shape}"
    item = max(int(t.dtype.bits) * int(t.dtype.lanes) // 8, 1)
    strides = None if not t.strides or not t.ndim else tuple(int(t.strides[k]) * item for k in range(t.ndim))
    if not foreign._contiguous(shape, strides, item):
        return 0, 0, False, kind, "a strided DLPack tensor (not contiguous)"
    if writable and readonly:
        return 0, 0, False, kind, "the DLPack tensor is read-only"
    n = 1
    for s in shape:
        n *= s
    return (t.data or 0) + int(t.byte_offset), n * item, readonly, kind, None


def _cai_region(obj: Any, writable: bool) -> tuple[int, int, bool]:
    """(address, nbytes, readonly) of a CUDA-array-interface object, with mpi4py's errors."""
    addr, n, readonly, _dtype = foreign.read_cai(obj, "buffer")
    if writable and readonly:
        raise BufferError("the CUDA array interface buffer is read-only")
    return addr, n, readonly


class buffer(Base):  # noqa: N801 - mpi4py's name: MPI.buffer
    """mpi4py's MPI.buffer (see the module header)."""

    __slots__ = ()

    def __new__(cls, *args: Any) -> "buffer":
        self = super().__new__(cls)
        if len(args) > 1:
            raise TypeError(f"buffer() takes at most 1 argument ({len(args)} given)")
        if args:
            _bind(self, args[0], None)
        return self

    # ---- constructors
    @staticmethod
    def allocate(nbytes: Any, clear: bool = False) -> "buffer":
        """``nbytes`` new bytes of process memory, zeroed when ``clear``; ``obj`` is their owner."""
        size = operator.index(nbytes)     # None, a float: TypeError, as in mpi4py
        if size < 0:
            raise ValueError("expecting non-negative size")
        # numpy's allocation is aligned (16+ bytes) and never at address 0, not even for 0 bytes
        owner = np.zeros(size, np.uint8) if clear else np.empty(size, np.uint8)
        buf = buffer()
        buf._wrap(owner, owner.__array_interface__["data"][0], size, False, 0)
        return buf

    @staticmethod
    def frombuffer(obj: Any, readonly: bool = False) -> "buffer":
        """``obj``'s memory, writable unless ``readonly`` (a read-only object: BufferError)."""
        buf = buffer()
        _bind(buf, obj, bool(readonly))
        return buf

    @staticmethod
    def fromaddress(address: Any, nbytes: Any, readonly: bool = False) -> "buffer":
        """``nbytes`` bytes at ``address``; nothing here keeps that memory alive."""
        if not isinstance(address, int):
            address = operator.index(address)
        size = operator.index(nbytes)
        if size < 0:
            raise ValueError("expecting non-negative buffer length")
        if size > 0 and not address:
            raise ValueError("expecting non-NULL address")
        buf = buffer()
        buf._wrap(None, address, size, bool(readonly), 0)
        return buf

    # ---- mpi4py's properties besides address, nbytes, readonly (compiled)
    @property
    def obj(self) -> Any:
        """The object exposing the memory (allocate's: the array owning it; fromaddress's: None)."""
        return self._owner

    @property
    def format(self) -> str:
        return "B"

    @property
    def itemsize(self) -> int:
        return 1

    # ---- memoryview's methods
    def cast(self, format: str, shape: Any = ...) -> memoryview:  # noqa: A002 - mpi4py's argument name
        _check_cpu(self)
        mv: Any = memoryview(self)     # any struct format: typeshed lists literal ones only
        return mv.cast(format) if shape is Ellipsis else mv.cast(format, shape)

    def tobytes(self, order: str | None = None) -> bytes:
        _check_cpu(self)
        return bytes(memoryview(self))

    def toreadonly(self) -> "buffer":
        """A read-only buffer over the same memory, with the same ``obj``."""
        owner, new = self._owner, buffer()
        if owner is None or isinstance(owner, buffer) or self._kind:
            # no exporter to ask again (fromaddress), a slice of another buffer (keep the window), or
            # DLPack/CAI memory (held by address): the same bytes, owned by what owns them now
            new._wrap(owner if owner is not None else self, self.address, self.nbytes, True, self._kind)
        else:
            new._import(owner, False)
            new._set_readonly(True)
        return new

    def release(self) -> None:
        """Give the memory back (the exporter's, or allocate's); the buffer is empty again."""
        self._release()

    # ---- the sequence protocol over bytes
    def __getitem__(self, item: Any) -> Any:
        _check_cpu(self)
        n = self.nbytes
        if isinstance(item, slice):
            start, length = _span(item, n)
            sub = buffer()
            sub._wrap(self, self.address + start, length, self.readonly, self._kind)
            return sub
        if not hasattr(type(item), "__index__"):
            raise TypeError("index must be integer or slice")
        return memoryview(self)[_index(item, n)]

    def __setitem__(self, item: Any, value: Any) -> None:
        _check_cpu(self)
        if self.readonly:
            raise TypeError("buffer is read-only")
        n = self.nbytes
        if isinstance(item, slice):
            start, length = _span(item, n)
            if hasattr(type(value), "__index__"):
                byte = operator.index(value)
                if not 0 <= byte <= 255:
                    raise OverflowError(f"value {byte} does not fit an unsigned byte")
                if length:
                    ctypes.memset(self.address + start, byte, length)
                return
            src = _bytes_of(value)
            if src.size != length:
                raise ValueError("slice length does not match buffer")
            if length:
                np.frombuffer(self, np.uint8)[start:start + length] = src   # numpy copies overlaps right
            return
        if not hasattr(type(item), "__index__"):
            raise TypeError("index must be integer or slice")
        memoryview(self)[_index(item, n)] = value

    def __delitem__(self, item: Any) -> None:
        raise NotImplementedError("buffer items cannot be deleted")

    def __repr__(self) -> str:
        return f"<MPI.buffer address=0x{self.address:x} nbytes={self.nbytes} readonly={self.readonly}>"


memory = buffer    # mpi4py's older name of the same class


def _bytes_of(value: Any) -> np.ndarray:
    """The bytes of a buffer-like value (buffer protocol, DLPack, CUDA array interface in host
    memory), as a 1-D uint8 array; contiguous only."""
    try:
        return np.frombuffer(value, np.uint8)
    except (TypeError, ValueError, BufferError):
        if not foreign.is_foreign(value):
            raise
    return np.frombuffer(buffer(value), np.uint8)


def _bind(buf: Base, obj: Any, readonly: bool | None) -> None:
    """Point ``buf`` at ``obj``'s memory. ``readonly`` None: as the object says (mpi4py's
    ``buffer(obj)``); else frombuffer's: writable unless True."""
    writable = readonly is False
    try:
        buf._import(obj, writable)
    except TypeError:
        if hasattr(obj, "__dlpack__"):
            addr, n, ro, kind, problem = dlpack_region(obj, writable)
            if problem is not None:
                raise BufferError(problem) from None
        elif hasattr(obj, "__cuda_array_interface__"):
            addr, n, ro = _cai_region(obj, writable)
            kind = _KDL_CUDA     # as mpi4py: the interface says device memory
        else:
            raise
        buf._wrap(obj, addr, n, ro if readonly is None else readonly, kind)
        return
    if readonly is not None:
        buf._set_readonly(readonly)


def alloc_mem(size: Any, info: Any = None) -> buffer:
    """MPI.Alloc_mem: ``size`` bytes of process memory as an MPI.buffer (mpi4py gives one)."""
    from shmproxy.mpi.exceptions import ERR_NO_MEM, as_int, error
    n = as_int(size, "Alloc_mem: size", ERR_NO_MEM)
    if n < 0:
        raise error(ERR_NO_MEM, f"Alloc_mem: size must be a non-negative int, got {size!r}")
    return buffer.allocate(n)


def free_mem(mem: Any) -> None:
    """MPI.Free_mem: the buffer gives its memory back and is empty (address 0, 0 bytes)."""
    if isinstance(mem, Base):
        mem.release()
    elif isinstance(mem, memoryview):
        mem.release()
