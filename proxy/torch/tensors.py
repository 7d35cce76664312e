"""CPU tensors as the numpy arrays shmproxy's communicator takes, without copies where the tensor allows.

A contiguous CPU tensor's storage is viewed with ``tensor.numpy()`` (no copy; the progress process then
reads or writes the tensor's memory through staging, or directly when the tensor lies in registered
memory: ``alloc_tensor`` gives such tensors). The rules, each the reason for a copy or an error:

- **CUDA tensors** go to the device path (shmproxy.torch.cuda): never through host memory. Tensors
  of every other device: an error saying that this backend does not support them (never a silent
  copy to host memory: the caller would lose the ordering and speed they expect of a device backend).
- **Non-contiguous tensors** are copied into a contiguous temporary, and outputs are copied back
  once the operation completed (as gloo does), so that every layout works; the copy is the cost.
- **bfloat16** has no numpy dtype. Where bytes only move (broadcast, allgather, alltoall, send and
  receive, gather, scatter) the tensor is reinterpreted as int16, which moves the same bits.
  Reductions run in float32: the input is upcast into a float32 temporary, reduced there, and the
  result is rounded back to bfloat16 (round to nearest even) into the tensor. This is exactly
  gloo's result for two ranks; for more ranks it is at least as accurate, since gloo rounds to
  bfloat16 after every pairwise step.
- **Complex tensors** reach the backend as real views already (torch.distributed calls
  ``view_as_real`` before it calls a process group), so they move as float pairs.

**Adoption into registered memory** (``Adopter``). A tensor outside registered memory costs a staging
copy in at every post and out at every completion, on the rank's cores; for large tensors those two
copies take longer than the collective itself. DDP's buckets (and most tensors a training loop
reduces) are allocated once and reduced every step, so the second time a group sees the same large
tensor it moves the tensor's *storage* into registered memory once, in one of two ways (TORCH_ADOPT):

- *swap* (torch >= 2.13): a ``comm.alloc`` buffer of the storage's size gets the bytes, and the two
  storages swap their memory (``_swap_data_ptr_``); the old memory is freed with the throwaway storage.
  The adopted storage is no longer resizable (``resize_`` beyond its size raises, as for a tensor from
  numpy); its memory is returned to the communicator when the storage dies.
- *share* (every torch of the supported range; the default where swap is missing): torch's own
  ``share_memory_()`` moves the storage into an unlinked shared-memory file (torch.multiprocessing's
  file-descriptor strategy), and the file's descriptor, which the storage holds for its life, is
  registered with the progress process; a finalizer on the storage deregisters it when it dies.

Either way every view of the storage (DDP's per-parameter bucket views included) now lies in registered
memory, and from then on the C post path finds the tensor registered: no staging copy in either
direction. Only storages torch's own allocator made (resizable, not shared), wholly covered by the
contiguous tensor, are adopted: numpy-backed, memory-mapped or shared storages are left alone (their
memory belongs to someone else). A tensor adopted by one group is staged by any other group.

**Staging by the group** (``StagePool``). A large tensor that is not (yet) in registered memory (seen
once, a view at an offset of a larger storage, numpy-backed) is copied into one of the group's own
registered buffers when it is posted, and copied back from the Work's completion, *outside* the
group's lock. Left to the communicator, the copy back would run inside ``Request.Test``, under the
lock the completion thread tests with, so a posting thread (DDP's backward posting its next bucket)
would wait for the previous bucket's copy: communication would hold up computation.
"""
from __future__ import annotations

import ctypes
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from shmproxy.core import errors, log
from shmproxy.torch import cuda

_log = log.get("COLL")

# torch dtype -> numpy dtype that holds the same bits. bfloat16 is handled apart (see the header).
_NUMPY: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype(np.bool_), torch.uint8: np.dtype(np.uint8), torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16), torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64), torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}


def numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """The numpy dtype holding the same bits as ``dtype`` (None: bfloat16, or one numpy lacks)."""
    return _NUMPY.get(dtype)


SUPPORTED = ", ".join(str(d).replace("torch.", "") for d in [*_NUMPY, torch.bfloat16])


def check_tensor(t: torch.Tensor, what: str) -> None:
    """Raise before anything is posted when ``t`` cannot travel through this backend."""
    if not isinstance(t, torch.Tensor):
        raise errors.InvalidArgument(
            f"shmproxy backend: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda"):
        raise errors.InvalidArgument(
            f"shmproxy backend: {what} is on {t.device}; tensors of that device are not supported by this "
            "backend yet (CPU and CUDA are; no host copy is made): move them yourself")
    if t.dtype not in _NUMPY and t.dtype != torch.bfloat16:
        raise errors.InvalidArgument(
            f"shmproxy backend: {what} has dtype {t.dtype}, which this backend does not support; "
            f"supported: {SUPPORTED}")
    if t.is_sparse or t.layout != torch.strided:
        raise errors.InvalidArgument(f"shmproxy backend: {what} has layout {t.layout}; only dense tensors")


def bits_view(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of a contiguous CPU tensor's bytes, of a dtype with the same bits (bfloat16 ->
    int16). In as few torch calls as it takes: for a small blocking call, torch's detach and reshape
    cost as much as the collective between the ranks."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    arr = (t.detach() if t.requires_grad else t).numpy()
    return arr if arr.ndim == 1 else arr.reshape(-1)


# cupy views of CUDA tensors' memory, by (address, elements, dtype, device): see native_view.
_VIEWS: dict[tuple[int, int, torch.dtype, int], Any] = {}
_VIEWS_MAX = 1024


def native_view(t: Any) -> Any:
    """What a native call gets for a flat contiguous CUDA tensor: a cupy array over its bytes, made
    once per (address, elements, dtype, device) and kept *without* a reference to the tensor (the
    call's Staged holds the tensor until completion; a later tensor at the same address is the same
    bytes, and the native call looks the allocation up again for memory cupy does not own). The
    native post otherwise read torch's ``__cuda_array_interface__`` and built a cupy array from it
    at every call, the largest share of a small call's post on the 2x H200 host (BENCHMARKS.md).
    Anything else (CPU arrays, bfloat16, which the native path must see as a tensor to know it is
    bfloat16, an empty tensor) is returned as it is."""
    if not isinstance(t, torch.Tensor) or not t.is_cuda:
        return t
    dtype = _NUMPY.get(t.dtype)
    n = t.numel()
    if dtype is None or not n:
        return t
    key = (t.data_ptr(), n, t.dtype, t.device.index or 0)
    arr = _VIEWS.get(key)
    if arr is None:
        from shmproxy.rank.device import cupy_module
        cp = cupy_module("a CUDA tensor", t)
        mem = cp.cuda.UnownedMemory(key[0], n * t.element_size(), None, key[3])
        arr = cp.ndarray((n,), dtype.name, cp.cuda.MemoryPointer(mem, 0))
        if len(_VIEWS) >= _VIEWS_MAX:
            _VIEWS.clear()
        _VIEWS[key] = arr
    return arr


def raw_view(t: torch.Tensor) -> np.ndarray:
    """``bits_view`` made from the tensor's address: ``Tensor.numpy()`` would mark the storage not
    resizable, which is the Adopter's sign that something outside torch aliases it. The array does not
    keep the tensor alive: the caller keeps it (in a Staged)."""
    nbytes = t.numel() * t.element_size()
    dt = np.dtype(np.int16) if t.dtype == torch.bfloat16 else _NUMPY[t.dtype]
    if nbytes == 0:
        return np.empty(0, dt)
    mem: Any = (ctypes.c_char * nbytes).from_address(t.data_ptr())   # a buffer; numpy's stubs list fewer
    return np.frombuffer(mem, dtype=dt)


class Adopter:
    """Moves reused large tensors of one group into its registered memory (see the module header).
    Called with the group's lock held."""

    MIN_BYTES = 256 << 10      # below this a staging copy costs less than the bookkeeping
    MAX_SEEN = 4096            # remembered candidates; forgotten all at once past this

    def __init__(self, comm: Any, how: str = "auto"):
        self._comm = comm
        self._seen: set[tuple[int, int]] = set()
        self.how = _adopt_how(how)
        # False: never adopt (tensors whose address is shared outside torch, e.g. through DLPack).
        self.enabled = self.how != "off"
        self.adopted = 0        # storages moved (for tests and the benchmark's trace)

    def __call__(self, t: torch.Tensor) -> bool:
        """Adopt ``t``'s storage when due; False when ``t`` is no candidate at all (too small, or its
        storage is aliased outside torch), so that the caller may view it with ``Tensor.numpy()``."""
        nbytes = t.numel() * t.element_size()
        if nbytes < self.MIN_BYTES or not self.enabled:
            return False
        st = t.untyped_storage()
        # Not resizable: numpy-backed, memory-mapped, viewed by numpy (Tensor.numpy() clears the flag,
        # so a view the user holds is never left pointing at freed memory), or swapped already.
        # Shared: someone else's memory, or shared already (by this group: registered, so the C post
        # path finds it; by another group: staged here, as the module header says).
        if not st.resizable() or st.is_shared() or st.nbytes() != nbytes or t.storage_offset() != 0:
            return False
        key = (st.data_ptr(), nbytes)
        if key not in self._seen:
            if len(self._seen) >= self.MAX_SEEN:
                self._seen.clear()
            self._seen.add(key)
            return True
        self._seen.discard(key)
        if self.how == "swap":
            self._swap(st, nbytes)
        else:
            self._share(st)
        self.adopted += 1
        return True

    def _swap(self, st: torch.UntypedStorage, nbytes: int) -> None:
        reg = torch.from_numpy(self._comm.alloc(nbytes, np.uint8))
        reg.copy_(torch.empty(0, dtype=torch.uint8).set_(st))
        # st now owns the registered buffer, reg the old memory
        st._swap_data_ptr_(reg.untyped_storage())  # type: ignore[attr-defined]

    def _share(self, st: torch.UntypedStorage) -> None:
        # share_memory_() copies the bytes into an unlinked POSIX shm file and points the storage (and so
        # every view of it) there; the storage keeps the file's descriptor open for its life, and
        # _share_fd_cpu_() on a storage shared so hands it out (what torch.multiprocessing sends to
        # other processes). The mapping starts at the storage's data. A storage shared so cannot be
        # resized (torch has no allocator for it), so the range stays what was registered until the
        # storage dies, when the finalizer (the storage's Python object lives as long as its memory)
        # deregisters it before anything else can be mapped there.
        st.share_memory_()
        fd, size = st._share_fd_cpu_()  # type: ignore[attr-defined]
        start = st.data_ptr()
        registry = self._comm._registry
        registry.adopt(fd, start, size)
        weakref.finalize(st, registry.remove, start)


def _adopt_how(how: str) -> str:
    """The TORCH_ADOPT setting this torch can do (module header): "swap", "share" or "off"."""
    can_swap = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
    # share needs torch.multiprocessing's file-descriptor strategy (the default on Linux): under
    # "file_system" share_memory_() makes a named file without a descriptor to register.
    can_share = (hasattr(torch.UntypedStorage, "_share_fd_cpu_")
                 and torch.multiprocessing.get_sharing_strategy() == "file_descriptor")
    if how == "auto":
        return "swap" if can_swap else "share" if can_share else "off"
    if (how == "swap" and not can_swap) or (how == "share" and not can_share):
        _log.warning("TORCH_ADOPT=%s: this torch (%s) cannot; large tensors are staged", how, torch.__version__)
        return "off"
    return how


class StagePool:
    """Registered buffers of one group, by power-of-two size, that stage large tensors outside
    registered memory (module header). ``take`` runs with the group's lock held (it may allocate
    through the communicator); ``give`` runs on the completion thread without it."""

    MIN_BYTES = 256 << 10      # below this the communicator's own staging copy is as cheap

    def __init__(self, comm: Any, limit: int):
        self._comm = comm
        self._limit = limit            # bytes of buffers this group may hold; past it the comm stages
        self._bytes = 0
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.lent = 0                  # buffers handed out (for tests and the benchmark)

    def stage(self, arr: np.ndarray, stage: "Staged", output: bool) -> np.ndarray:
        """``arr``, or a registered copy of it (copied back into ``arr`` at completion when ``output``)."""
        n = arr.nbytes
        if n < self.MIN_BYTES or self._comm._registry.find(arr.ctypes.data, n) is not None:
            return arr
        size = 1 << (n - 1).bit_length()
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
            if buf is None:
                if self._bytes + size > self._limit:
                    return arr
                self._bytes += size
        if buf is None:
            buf = self._comm.alloc(size, np.uint8)
        view = buf[:n].view(arr.dtype)
        np.copyto(view, arr)
        stage.lent.append((self, buf))
        self.lent += 1
        if output:
            stage.after.append(lambda: np.copyto(arr, view))
        return view

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.setdefault(buf.nbytes, []).append(buf)


@dataclass
class Staged:
    """The arrays an operation posts, and what to do once it completed (copies back, casts).

    ``after`` runs in the process group's completion thread, after every request of the operation
    completed and before its Work and Future are marked completed. ``adopt`` (the group's Adopter)
    is offered every contiguous tensor the operation uses in place; ``pool`` stages the large ones
    still outside registered memory. A failed operation's buffers are not given back (the progress
    process may still write them): they are freed with the Staged."""

    keep: list = field(default_factory=list)        # temporaries that must live until completion
    after: list[Callable[[], object]] = field(default_factory=list)
    adopt: Callable[[torch.Tensor], bool] | None = None   # True: the tensor is now in registered memory
    pool: StagePool | None = None                   # the group's staging buffers (CPU calls)
    lent: list = field(default_factory=list)        # (pool, buffer) to give back once `after` ran
    # A call on CUDA tensors (shmproxy.torch.cuda.begin): their device, the keywords of every native
    # call (the stream), the event behind the call's own copies, the group's side streams.
    device: torch.device | None = None
    kw: dict = field(default_factory=dict)
    posted: Any = None
    side: Any = None

    def done(self) -> None:
        if self.device is not None:
            cuda.finish(self)
        else:
            for fn in self.after:
                fn()
            for pool, buf in self.lent:
                pool.give(buf)
        self.after.clear()
        self.lent.clear()
        self.keep.clear()


def for_move(t: torch.Tensor, stage: Staged, output: bool) -> np.ndarray:
    """An array over ``t`` (or over a contiguous copy of it) for an operation that only moves bytes.
    ``output``: the operation writes it, so a copy is copied back into ``t`` at completion. A CUDA
    tensor gives a flat CUDA tensor instead (shmproxy.torch.cuda)."""
    if t.is_cuda:
        return cuda.move_view(t, stage, output)  # type: ignore[return-value]
    if t.is_contiguous():
        if stage.adopt is not None and stage.adopt(t):
            stage.keep.append(t)
            arr = raw_view(t)
        else:
            arr = bits_view(t)
        return arr if stage.pool is None else stage.pool.stage(arr, stage, output)
    tmp = t.contiguous()
    stage.keep.append(tmp)
    if output:
        stage.after.append(lambda: t.copy_(tmp))
    return bits_view(tmp)


def for_reduce(t: torch.Tensor, stage: Staged, output: bool) -> np.ndarray:
    """An array over ``t`` for a reduction: bfloat16 goes through a float32 temporary (cast back into
    ``t`` at completion when ``output``); other dtypes, and CUDA tensors (bfloat16 reduces on the
    device), as ``for_move``."""
    if t.dtype != torch.bfloat16 or t.is_cuda:
        return for_move(t, stage, output)
    tmp = t.to(torch.float32).contiguous()
    stage.keep.append(tmp)
    if output:
        stage.after.append(lambda: t.copy_(tmp))
    return tmp.reshape(-1).numpy()


def scratch(numel: int, like: torch.Tensor, stage: Staged,
            reduce: bool = False) -> tuple[torch.Tensor, np.ndarray]:
    """A contiguous temporary of ``numel`` elements of ``like``'s dtype (float32 for a bfloat16
    reduction), kept alive until completion: (tensor, numpy view). On a CUDA ``like``: a CUDA
    temporary of the same dtype, twice."""
    if like.is_cuda:
        return cuda.scratch(numel, like, stage)  # type: ignore[return-value]
    dtype = torch.float32 if (reduce and like.dtype == torch.bfloat16) else like.dtype
    tmp = torch.empty(numel, dtype=dtype)
    stage.keep.append(tmp)
    return tmp, (tmp.numpy() if dtype != torch.bfloat16 else bits_view(tmp))


def alloc_tensor(comm: object, shape: int | tuple[int, ...],
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zeroed CPU tensor in ``comm``'s registered shared memory: operations on it need no staging
    copy. The tensor keeps the memory alive (it is returned to the communicator when the tensor and
    every view of it are gone)."""
    shp = (shape,) if isinstance(shape, int) else tuple(shape)
    if dtype == torch.bfloat16:
        arr = comm.alloc(shp, np.int16)  # type: ignore[attr-defined]
        return torch.from_numpy(arr).view(torch.bfloat16)
    if dtype not in _NUMPY:
        raise errors.InvalidArgument(
            f"shmproxy backend: alloc_tensor of dtype {dtype}; supported: {SUPPORTED}")
    return torch.from_numpy(comm.alloc(shp, _NUMPY[dtype]))  # type: ignore[attr-defined]
