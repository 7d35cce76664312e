"""Device arrays at the rank: locating them for the progress process, and ordering by stream.

A device buffer is never staged: the progress process maps the rank's own allocation and copies
from or into it on its GPU streams (transports/cuda.py). Three things happen here, and only once a
device array first appears (cupy is imported then, never for a host-only job):

- **Which allocation.** An array's pointer usually lies inside a larger allocation (cupy's pool
  carves many arrays out of one cudaMalloc), and a CUDA IPC handle names a whole allocation. The
  driver tells the range (start, size), a buffer id that is never reused within the process, the
  device, and whether the legacy IPC handles can export it (cuPointerGetAttributes). An allocation
  is registered once (REGISTER, kind cuda, with its IPC handle as ``info``) and cached by its start
  address and buffer id: an op then names (buf_id, offset from the start). An address whose buffer id
  changed is a new allocation at a reused address: the old registration is dropped (DEREGISTER) and
  the new one registered, so the progress process can never write into memory that was freed. A cupy
  array over memory cupy owns keeps its location for as long as it lives (``DeviceMemory.locate``).
  A call repeated on the same arrays reuses the record its first call checked (``posted``); over
  memory cupy does not own (the torch backend's views of tensors), once the driver's buffer id says
  the allocation under the address is still the registered one (one attribute query, where the
  checks and the lookup cost a torch call's post more than the rest of it).
- **Stream order, as NCCL's.** An op on device memory must see the work the rank queued on its current
  stream before the call. At post time the rank has that stream store the request's sequence number
  (its low 32 bits) into the request's completion slot, in the word SLOT_STREAM_SEQ, once the work
  queued so far is done (cuStreamWriteValue32 on host memory the rank pinned and mapped for its
  GPUs), and flags the op FLAG_STREAM_WORD; the progress process's stream waits for that value before
  it copies (transports/cuda_order.py, which says why a word and not an interprocess event). A post
  on an idle stream stores nothing and goes unflagged: there is nothing to order after. The slot is
  the request's alone until it completes, so each op has a word of its own; only a store still
  queued on another stream from the slot's previous request (one that completed without being
  waited for: an error, or no bytes) could land after the new one, so the new store is first made to
  wait for it (``_Words.store``).
- **Completion.** The progress process completes the request once the copies have finished on the
  GPU, so a blocking call returns with the data in place, and the rank's later stream work sees it.
  With ``stream=`` (another stream than cupy's current one: a cupy or torch stream, or a raw
  cudaStream_t) the op is ordered after that stream's work instead; its result is visible to every
  stream once ``Wait``/``Test`` reported completion (the wait is the synchronisation: work queued on
  the stream before that is not ordered after the op, unlike NCCL's stream-enqueued kernels). Or a
  stream waits on the GPU for the completion (``Request.wait_on_stream``: for the slot's done_seq,
  ``_Words``) while the host goes on, as after NCCL's ``work.wait()``.

bfloat16 has no cupy dtype: a torch bfloat16 tensor (or an array whose dtype is named bfloat16) is
viewed as 16-bit words, which the copies move as they are, and the op record carries
``DTYPE_BFLOAT16`` so that the progress process reduces it with its own kernels (shmproxy.transports.cuda_coll).
Host bfloat16 is not supported (numpy has no such dtype).

``alloc`` is the device counterpart of ``comm.alloc``: an allocation of its own (cudaMalloc, not
cupy's pool), registered once at creation, deregistered and freed when the last array over it is
dropped.
"""
from __future__ import annotations

import ctypes
import functools
import sys
import threading
import weakref
from typing import Any, Callable

import numpy as np

from shmproxy.core import errors
from shmproxy.core.memory import MemKind, device_array_kind, mem_word
from shmproxy.core.ops import DTYPE_BFLOAT16, DTYPE_CODE, IN_PLACE as _IN_PLACE, SUPPORTED_DTYPES, ReduceOp
from shmproxy.shm import pool as P
from shmproxy.transports.cuda_driver import Driver
from shmproxy.transports.cuda_order import HostSlots, word_address

# Whether a post has its stream store the word even when the stream is idle (see DeviceMemory.record):
# False but for measuring what the skip saves (tests/bodies_gpu.py bench).
RECORD_ON_IDLE_STREAMS = False
_LOCATED_MAX = 4096     # live arrays whose location is cached (see DeviceMemory.locate)

# CUpointer_attribute values of the driver API (cuda.h)
_BUFFER_ID, _DEVICE_ORDINAL, _IPC_CAPABLE, _RANGE_START, _RANGE_SIZE = 7, 9, 10, 11, 12

_cupy: Any = None


def _import_cupy(need: str) -> Any:
    """cupy, imported on first need; InvalidArgument saying who ``need``s it when it cannot be."""
    global _cupy
    if _cupy is None:
        try:
            import cupy
        except ImportError as exc:
            raise errors.InvalidArgument(f"{need}, which cannot be imported here: {exc}") from None
        _cupy = cupy
    return _cupy


def cupy_module(what: str, obj: Any) -> Any:
    """cupy, for a buffer that is device memory; InvalidArgument naming the buffer when it cannot be had."""
    return _import_cupy(f"{what} is cuda device memory ({type(obj).__name__}); device buffers need cupy")


class _Driver:
    """The one driver call the runtime API lacks: an address's allocation range and identity."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise errors.InvalidArgument(f"the CUDA driver (libcuda.so.1) cannot be loaded: {exc}") from None
        self.lib.cuPointerGetAttributes.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_int),
                                                    ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64]
        # the call's arguments, built once: ctypes objects cost microseconds each on every post
        self._out = (ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_uint64(), ctypes.c_int(), ctypes.c_int())
        self._attrs = (ctypes.c_int * 5)(_RANGE_START, _RANGE_SIZE, _BUFFER_ID, _DEVICE_ORDINAL, _IPC_CAPABLE)
        self._data = (ctypes.c_void_p * 5)(*(ctypes.addressof(x) for x in self._out))
        self.lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        self._bid_ref = ctypes.addressof(self._out[2])

    def buffer_id(self, ptr: int) -> int:
        """The buffer id of the allocation holding ``ptr`` (0: none): one attribute, for ``posted``."""
        bid = self._out[2]
        bid.value = 0
        self.lib.cuPointerGetAttribute(self._bid_ref, _BUFFER_ID, ptr)
        return bid.value

    def allocation(self, ptr: int) -> tuple[int, int, int, int, bool]:
        """(start, size, buffer id, device, IPC-capable) of the allocation holding ``ptr``."""
        start, size, bid, dev, ipc = self._out
        start.value = 0
        rc = self.lib.cuPointerGetAttributes(5, self._attrs, self._data, ptr)
        if rc != 0 or not start.value:
            raise errors.InvalidArgument(f"address {ptr:#x} is not device memory the CUDA driver knows "
                                         f"(cuPointerGetAttributes: error {rc})")
        return start.value, size.value, bid.value, dev.value, bool(ipc.value)


class DeviceMemory:
    """This rank's device registrations and its stream-order words (one per communicator)."""

    def __init__(self, register: Callable[[dict], None], new_id: Callable[[], int], dead_ids: Callable[[], list],
                 slots: tuple[int, int, int], failed: Callable[[], bool], slice_s: float):
        self._register = register     # sends one REGISTER payload (kind cuda), waits for the answer
        # whether the communicator failed (recording it, which lets the streams go), and how often a
        # _FailureWatch asks
        self._failed, self._slice_s = failed, slice_s
        self._watch: _FailureWatch | None = None
        self._new_id = new_id
        self._dead_ids = dead_ids     # the registry's DEREGISTER queue, sent with the next message
        self._allocs: dict[int, tuple[int, int, int]] = {}   # start -> (buffer id, size, buf_id)
        # this rank's completion slots in the pool: (address of the pool's slot 0, first slot, count)
        self._slots = slots
        self._words: _Words | None = None                     # the slots pinned for stream stores (record)
        self._bus: dict[int, str] = {}                        # device -> its PCI bus id (_bus_id)
        self._driver: _Driver | None = None
        self._streams: dict[tuple[int, int], Any] = {}        # (handle, device) -> cupy ExternalStream
        self._located: dict[int, tuple[Any, tuple[int, int, int]]] = {}   # id(array) -> (weakref, locate())
        self.posts: dict[tuple, tuple] = {}   # collective calls on live arrays -> record fields (posted)
        # id -> array of the bfloat16 views made by the current call's as_array (cleared per call;
        # holding the arrays keeps their ids unique meanwhile)
        self._bf16: dict[int, Any] = {}
        self._stage: tuple[np.ndarray, int] | None = None   # host_stage's buffer and its address
        self.cp: Any = None

    def begin_call(self) -> None:
        self._bf16.clear()

    def as_array(self, obj: Any, what: str) -> Any:
        """``obj`` as a cupy array without copying (CUDA array interface or DLPack), C-contiguous;
        a bfloat16 tensor as its 16-bit words (``dtype_code`` then says bfloat16)."""
        cp = self.cp = cupy_module(what, obj)
        bf16 = False
        if isinstance(obj, cp.ndarray):
            arr = obj
        else:
            src = obj
            if str(getattr(obj, "dtype", "")).rpartition(".")[2] == "bfloat16":
                src, bf16 = _bf16_words(obj, what), True
            try:
                arr = cp.asarray(src) if hasattr(src, "__cuda_array_interface__") else cp.from_dlpack(src)
            except Exception as exc:  # whatever the foreign object raises: say which buffer it was
                raise errors.InvalidArgument(f"{what} ({type(obj).__name__}) cannot be read as a device "
                                             f"array: {exc}") from None
        if not arr.flags.c_contiguous:
            raise errors.InvalidArgument(f"{what} is not C-contiguous (device buffers are never staged)")
        if bf16 or (arr.dtype.char not in DTYPE_CODE and arr.dtype.name == "bfloat16"):
            arr = arr.view(cp.uint16)
            self._bf16[id(arr)] = arr
        return arr

    def dtype_code(self, arr: Any) -> int | None:
        """The record's dtype code of an array ``as_array`` returned in this call (None: unsupported)."""
        if id(arr) in self._bf16:
            return DTYPE_BFLOAT16
        return DTYPE_CODE.get(arr.dtype.char)

    def host_stage(self, nbytes: int) -> tuple[np.ndarray, int]:
        """A page-locked host buffer of at least ``nbytes`` bytes and its address: where the fast path
        stages a small device collective (shmproxy.rank.fastpath). Made once per communicator (the
        fast path's size limit), so that a copy to or from it is a plain DMA on the rank's stream."""
        st = self._stage
        if st is None or st[0].nbytes < nbytes:
            mem = self.cp.cuda.alloc_pinned_memory(max(nbytes, 64))
            host = np.frombuffer(mem, np.uint8, max(nbytes, 64))   # holds ``mem`` alive
            st = self._stage = (host, host.ctypes.data)
        return st

    def as_stream(self, stream: Any, device: int) -> Any:
        """A ``stream=`` argument as a cupy stream of ``device``: a cupy Stream, a torch Stream, or a
        raw cudaStream_t (int); None stays None (the current stream). InvalidArgument otherwise."""
        if stream is None:
            return None
        cp = self.cp
        if isinstance(stream, (cp.cuda.Stream, cp.cuda.ExternalStream)):
            dev = getattr(stream, "device_id", -1)
            handle = None
        elif hasattr(stream, "cuda_stream"):   # torch.cuda.Stream
            handle = int(stream.cuda_stream)
            dev = getattr(getattr(stream, "device", None), "index", None)
            dev = device if dev is None else int(dev)
        elif isinstance(stream, (int, np.integer)) and not isinstance(stream, bool) and int(stream) >= 0:
            handle, dev = int(stream), device
        else:
            raise errors.InvalidArgument(f"stream must be a cupy or torch CUDA stream or a cudaStream_t "
                                         f"handle (int), got {type(stream).__name__}")
        if dev not in (device, -1):
            raise errors.InvalidArgument(f"stream is on device {dev}, the buffers on device {device}")
        if handle is None:
            return stream
        s = self._streams.get((handle, device))
        if s is None:
            if len(self._streams) > 64:
                self._streams.clear()
            s = self._streams[(handle, device)] = cp.cuda.ExternalStream(handle, device)
        return s

    def _cupy(self) -> Any:
        self.cp = _import_cupy("comm.alloc(device=...) needs cupy")
        return self.cp

    def current_device(self) -> int:
        """This process's current CUDA device, as cupy sees it."""
        return int(self._cupy().cuda.runtime.getDevice())

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype, device: int) -> Any:
        """A zeroed cupy array in an allocation of its own on ``device``, registered now (see the header)."""
        cp = self._cupy()
        if dtype.char not in DTYPE_CODE:
            raise errors.InvalidArgument(f"unsupported dtype {dtype}; supported: {SUPPORTED_DTYPES}")
        ndev = cp.cuda.runtime.getDeviceCount()
        if not isinstance(device, (int, np.integer)) or isinstance(device, bool) or not 0 <= int(device) < ndev:
            raise errors.InvalidArgument(f"device {device!r} is not a CUDA device index of this process")
        device = int(device)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        with cp.cuda.Device(device):
            ptr = cp.cuda.runtime.malloc(max(nbytes, 1))
            owner = _Allocation()
            mem = cp.cuda.UnownedMemory(ptr, max(nbytes, 1), owner, device)
            arr = cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))
            cp.cuda.runtime.memset(ptr, 0, max(nbytes, 1))
            cp.cuda.Stream.null.synchronize()   # zeroed before any stream of the rank's uses it
            if nbytes:
                self.locate(arr)
        # dropped: the DEREGISTER goes with the rank's next message; the memory is freed at once (an op
        # still in flight on it would be the caller's error, as for any buffer). Not at exit: the
        # process's end frees it, and the progress process closes its mappings of a closed rank.
        fin = weakref.finalize(owner, _free_allocation, cp.cuda.runtime, device, ptr, self._allocs,
                               self._allocs.get(ptr), self._dead_ids)
        fin.atexit = False
        return arr

    def locate(self, arr: Any) -> tuple[int, int, int]:
        """(buf_id, offset, mem word) of a device array's bytes, registering its allocation first.

        Cached per live cupy array whose memory cupy owns (its pool's or its own cudaMalloc): while
        the array lives its allocation cannot be freed, so the registration found for it stays the
        one of its bytes. An array over memory cupy does not own (a torch tensor's, a raw pointer's)
        is looked up every time: the owner may free or swap that memory under it."""
        hit = self._located.get(id(arr))
        if hit is not None and hit[0]() is arr:
            return hit[1]
        ptr = arr.data.ptr
        if not arr.nbytes:
            return 0, 0, mem_word(MemKind.CUDA, arr.device.id)
        loc = self._locate(arr, ptr)
        if type(arr.data.mem) is not self.cp.cuda.UnownedMemory:
            if len(self._located) >= _LOCATED_MAX:
                self._located.clear()
            key = id(arr)
            self._located[key] = (weakref.ref(arr, functools.partial(self._forget, key)), loc)
        return loc

    def posted(self, key: tuple | None, sendbuf: Any, recvbuf: Any = None) -> tuple | None:
        """The record fields of an earlier call with this key (``call_key``, ``message_key``) on these
        same live cupy arrays (``remember_post``), or None. Such a call passed every check then, and
        passes them now: a live array keeps its dtype, size, device and location (see ``locate``);
        an array over memory cupy does not own (a torch tensor's) keeps its location for as long as
        the allocation under it is the one registered, which its buffer id tells (one driver call)."""
        hit = self.posts.get(key) if key is not None else None
        if hit is None or (hit[0] is not None and hit[0]() is not sendbuf) or (
                hit[1] is not None and hit[1]() is not recvbuf):
            return None
        for ptr, bid in hit[3]:
            if self._driver is None or self._driver.buffer_id(ptr) != bid:
                return None
        return hit[2]

    def remember_post(self, key: tuple | None, sendbuf: Any, recvbuf: Any, fields: tuple) -> None:
        """After a call on device arrays was checked and posted: its record fields, for ``posted``
        (cupy arrays; over memory cupy does not own, with the buffer id to check: see ``posted``)."""
        if key is None:
            return
        refs: list[weakref.ref | None] = []
        checks: list[tuple[int, int]] = []
        for b in (sendbuf, recvbuf):
            if b is None or b is _IN_PLACE:   # immortal sentinels: their ids in the key say it all
                refs.append(None)
            elif type(b) is self.cp.ndarray:
                refs.append(weakref.ref(b))
                if type(b.data.mem) is self.cp.cuda.UnownedMemory and b.nbytes:
                    ptr = b.data.ptr
                    known = self._allocs.get(self._driver.allocation(ptr)[0]) if self._driver else None
                    if known is None:
                        return
                    checks.append((ptr, known[0]))
            else:
                return
        if len(self.posts) >= _LOCATED_MAX:
            self.posts.clear()
        self.posts[key] = (refs[0], refs[1], fields, tuple(checks))

    def is_cupy_array(self, obj: Any) -> bool:
        """Whether ``obj`` is a cupy array, known without probing (cupy builds an array's
        ``__cuda_array_interface__`` on every access); False before cupy was first needed."""
        return self.cp is not None and type(obj) is self.cp.ndarray

    def _forget(self, key: int, _ref: Any = None) -> None:
        """The weakref callback of a located array (its key bound): drop its entry if it is gone."""
        hit = self._located.get(key)
        if hit is not None and hit[0]() is None:
            del self._located[key]

    def _locate(self, arr: Any, ptr: int) -> tuple[int, int, int]:
        if self._driver is None:
            self._driver = _Driver()
        start, size, bid, dev, ipc = self._driver.allocation(ptr)
        known = self._allocs.get(start)
        if known is not None and known[0] == bid:
            return known[2], ptr - start, mem_word(MemKind.CUDA, dev)
        if not ipc:
            raise errors.InvalidArgument(f"device memory at {ptr:#x} (device {dev}) cannot be shared with "
                                         f"CUDA IPC handles (stream-ordered or virtual-memory allocations "
                                         f"are not supported yet): allocate it with cudaMalloc, e.g. "
                                         f"cupy's default memory pool")
        if known is not None:   # the address was freed and allocated again: a new allocation
            self._dead_ids().append(known[2])
            del self._allocs[start]
        handle = self.cp.cuda.runtime.ipcGetMemHandle(start)
        buf_id = self._new_id()
        self._register({"buf_id": buf_id, "bytes": size, "kind": "cuda", "device": dev,
                        "info": {"handle": bytes(handle).hex(), "bus": self._bus_id(dev)}})
        self._allocs[start] = (bid, size, buf_id)
        return buf_id, ptr - start, mem_word(MemKind.CUDA, dev)

    def record(self, slot: int, seq: int, device: int, stream: Any = None) -> bool:
        """Order the op in request ``slot`` (sequence number ``seq``) after the work queued on ``stream``
        (None: this thread's current stream of ``device``): the stream stores ``seq``'s low 32 bits into
        the slot's word once that work is done, unless the stream is idle. True if it will (the op then
        carries FLAG_STREAM_WORD).

        An idle stream has nothing to wait for, and a store on it would still be GPU work of this
        process's context, which the progress process's copy then depends on: where processes share
        a GPU without MPS, the GPU switches between their contexts to settle it, and that switch
        dominates a small message."""
        cp = self.cp
        with cp.cuda.Device(device):
            if stream is None:
                stream = cp.cuda.get_current_stream()
            if stream.done and not RECORD_ON_IDLE_STREAMS:
                return False
            words = self._words
            if words is None:
                words = self._words = _Words(*self._slots)
            words.store(slot, seq & 0xFFFFFFFF, device, stream.ptr)
        return True

    def stream_device(self, stream: Any) -> int:
        """The device of a ``stream=`` argument (a raw cudaStream_t: the current device)."""
        cp = self.cp if self.cp is not None else self._cupy()
        if isinstance(stream, (cp.cuda.Stream, cp.cuda.ExternalStream)):
            return int(stream.device_id)
        dev = getattr(getattr(stream, "device", None), "index", None)   # a torch.cuda.Stream
        return int(dev) if dev is not None else self.current_device()

    def wait_done(self, slot: int, seq: int, device: int, stream: Any) -> None:
        """Have ``stream`` (a cupy stream of ``device``; None: the current one) wait on the GPU until
        request ``seq`` in ``slot`` completed (Request.wait_on_stream)."""
        words = self._words
        if words is None:
            words = self._words = _Words(*self._slots)
        self.watch()
        with self.cp.cuda.Device(device):
            if stream is None:
                stream = self.cp.cuda.get_current_stream()
            words.wait_done(slot, seq, device, stream.ptr)

    def release_waits(self, code: int) -> None:
        """The communicator failed or is closing: no stream may wait any longer for a completion that
        may never come (``_Words.release``)."""
        if self._words is not None:
            self._words.release(code)

    def watch(self) -> None:
        """From now until close, a failure of the communicator reaches the GPU's waits even while the
        host is held by them (``_FailureWatch``)."""
        if self._watch is None:
            self._watch = _FailureWatch(self._failed, self._slice_s)

    def stop_watch(self) -> None:
        """Before the communicator's views of the pool go: the failure watch asks no more."""
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def close(self) -> None:
        """Before the pool is unmapped: unpin the slots once no store of ours into them is queued (no
        stream waits for a completion by then: ``release_waits``)."""
        self.stop_watch()
        if self._words is not None:
            self._words.release(errors.Closed.code)
            self._words.close(self.cp)
            self._words = None

    def _bus_id(self, device: int) -> str:
        """The PCI bus id of this process's device ``device``: the progress process checks that its own
        device of that number is the same GPU (transports/cuda_gpu.py, ``Gpu.check_device``)."""
        bus = self._bus.get(device)
        if bus is None:
            bus = self._bus[device] = self.cp.cuda.runtime.deviceGetPCIBusId(device)
        return bus


class _FailureWatch:
    """A thread that learns of the communicator's failure for a rank whose host is held by the GPU.

    A stream that waits for a request (``wait_done``) holds the GPU's later work until the request
    completes. If the communicator fails first (a peer died, an abort, the progress process died),
    the rank lets such streams go once it learns of the failure (``_Words.release``), and it learns at
    its next call. A host that waits for that GPU work instead (DDP's reducer synchronizing an
    iteration's events behind ``work.wait()``, a stream's synchronize) makes no next call: this thread
    asks in its place, every WAIT_SLICE_MS, from the first stream wait until the communicator closes
    or fails. NCCL's watchdog thread does the same for its kernels."""

    def __init__(self, failed: Callable[[], bool], slice_s: float):
        self._failed, self._slice_s = failed, slice_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shmproxy-stream-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # No exception is caught here: one from the check would be a bug, which the thread's excepthook
        # prints; the rank's own calls still find the failure as before.
        while not self._stop.wait(self._slice_s):
            if self._failed():
                return

    def stop(self) -> None:
        """Ends the thread; on return it reads the communicator no more (its check takes microseconds,
        and a failure it found released the waits under their lock)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


class _Words:
    """This rank's completion slots pinned and mapped for its GPUs: the stream stores into them, and
    the streams' waits for their completions.

    ``store`` queues the store of a request's value into its slot's SLOT_STREAM_SEQ word on a stream.
    ``last``: per slot, the stream and value of its latest store, for the one case the header names: a
    store of the slot's previous request still queued on another stream is waited for first (a
    host read of the word tells whether it landed).

    ``wait_done`` queues on a stream a wait for a request's completion: for its slot's done_seq to
    reach the request's sequence number (the low 32 bits, compared in wrap-around order), which the
    progress process stores, or its GPU behind the copy (transports/cuda_publish.py). done_seq only
    ever grows within a slot (each request's completion stores its own, later, number, and a post
    does not clear it), so a wait still queued when the slot has passed to a later request is
    satisfied all the same. A completion that never comes (the progress process died) would hold the
    stream forever: ``awaited`` keeps each slot's latest wait, and ``release`` completes those not
    reached, with an error, once the communicator failed or closes."""

    def __init__(self, pool_slots: int, first: int, count: int, drv: Any = None):
        self.drv = drv if drv is not None else Driver()
        self.first = first                               # this rank's first slot
        self.pinned = HostSlots(self.drv, (pool_slots + P.SLOT_BYTES * first, P.SLOT_BYTES * count, count))
        self.last: dict[int, tuple[int, int, int]] = {}  # slot -> (stream, value, device) of its latest store
        self.awaited: dict[int, int] = {}                # slot -> the seq of its latest stream wait
        # ``release`` may run on the failure watch's thread while the rank queues a wait
        self._lock = threading.Lock()

    def word(self, slot: int) -> int:
        return word_address(self.pinned.addr, slot - self.first)

    def _slot_word(self, slot: int, field: int) -> int:
        return self.pinned.addr + P.SLOT_BYTES * (slot - self.first) + 8 * field

    def wait_done(self, slot: int, seq: int, device: int, stream: int) -> None:
        """On ``stream`` of ``device`` (current): hold the stream's later work until request ``seq`` in
        ``slot`` completed."""
        addr = self._slot_word(slot, P.SLOT_DONE_SEQ)
        with self._lock:
            self.drv.wait_value(stream, addr + self.pinned.delta(device), seq & 0xFFFFFFFF, at_least=True)
            self.awaited[slot] = seq

    def release(self, code: int) -> None:
        """Complete with error ``code`` every request a stream waits for whose completion has not come
        (the communicator failed or is closing: no request is posted into these slots again)."""
        with self._lock:
            for slot, seq in self.awaited.items():
                done = ctypes.c_int64.from_address(self._slot_word(slot, P.SLOT_DONE_SEQ))
                if done.value < seq:
                    ctypes.c_uint64.from_address(self._slot_word(slot, P.SLOT_STATUS)).value = code
                    done.value = seq   # after the status: the rank reads the status once it sees this
            self.awaited.clear()

    def store(self, slot: int, value: int, device: int, stream: int) -> None:
        """On ``stream`` of ``device`` (current): store ``value`` into ``slot``'s word after its work."""
        delta = self.pinned.delta(device)
        addr = self.word(slot)
        last = self.last.get(slot)
        if last is not None and last[0] != stream and ctypes.c_uint32.from_address(addr).value != last[1]:
            self.drv.wait_value(stream, addr + delta, last[1])   # the older store lands first
        self.drv.write_value(stream, addr + delta, value)
        self.last[slot] = (stream, value, device)

    def close(self, cp: Any) -> None:
        """Unpin, after waiting for the devices whose streams still have a store of ours queued (the
        memory stops being theirs to write)."""
        pending = {d for slot, (_s, value, d) in self.last.items()
                   if ctypes.c_uint32.from_address(self.word(slot)).value != value}
        for device in sorted(pending):
            with cp.cuda.Device(device):
                cp.cuda.runtime.deviceSynchronize()
        self.pinned.close()


def call_key(coll: int, sendbuf: Any, recvbuf: Any, op: Any, root: Any) -> tuple | None:
    """What remembers a collective call (DeviceMemory.posted); None where op or root is not a plain int."""
    if type(op) is not int:
        if not isinstance(op, ReduceOp):
            return None
        op = int(op)
    if type(root) is not int:
        return None
    return coll, id(sendbuf), id(recvbuf), op, root


def message_key(kind: int, buf: Any, flags: int, peer: Any, tag: Any) -> tuple | None:
    """What remembers a Send or Recv (DeviceMemory.posted); None where peer or tag is not a plain int.
    Its kind is negative, so that no collective's key (a Coll, >= 0) equals it."""
    return (-kind, id(buf), flags, peer, tag) if type(peer) is int and type(tag) is int else None


class _Allocation:
    """The owner of an ``alloc`` allocation: cupy's memory object holds it, its finalizer frees."""


def _free_allocation(rt: Any, device: int, ptr: int, allocs: dict, entry: Any, dead_ids: Callable) -> None:
    if entry is not None and allocs.get(ptr) == entry:
        del allocs[ptr]
        dead_ids().append(entry[2])
    prev = rt.getDevice()
    rt.setDevice(device)
    try:
        rt.free(ptr)
    finally:
        rt.setDevice(prev)


def _bf16_words(obj: Any, what: str) -> Any:
    """A bfloat16 tensor viewed as int16 words (torch: ``view(torch.int16)``), without copying."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(obj, "view"):
        raise errors.InvalidArgument(f"{what} is bfloat16 ({type(obj).__name__}); device bfloat16 is read "
                                     f"from torch tensors only")
    return obj.view(torch.int16)


def is_device(obj: Any) -> bool:
    return device_array_kind(obj) is not None
