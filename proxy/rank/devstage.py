"""Device buffers on a communicator that spans nodes: staged through pinned host memory at the rank.

Within a node the progress process maps a rank's device allocation and moves it on its own GPU
streams (shmproxy.rank.device). Between nodes the bytes leave from host memory (a socket), so a
device buffer is copied to host memory first, here, around the host path:

- **The copies.** A call's inputs (the send buffer; the receive buffer too when the call is in
  place; Bcast's buffer) are copied device to host on the call's stream (``stream=``, else cupy's
  current one: the call is ordered after the work queued there, as within a node) into pinned host
  buffers that are registered with the progress process, so the host path then moves them with no
  staging copy of its own. The stream is synchronised and the host operation posted. When its
  request completes, the outputs are copied host to device on a stream of the staging's own (the
  call's stream may be one that waits for this completion: the torch backend's ``Work.wait``),
  synchronised before Wait or Test returns: a blocking call returns with the data in place,
  visible to every stream, as within a node. A nonblocking call's post waits for the stream's
  earlier work (the copy in). A call with nothing to copy in (a receive, Bcast away from the root)
  records an event on the call's stream instead, which the copies back wait for: the stream may
  still be writing the output buffer when the call is made, and the result must land after that
  write, not under it.
- **Which calls.** Every collective with device buffers on a communicator that spans nodes (every
  rank of it then runs the host collective, whatever its buffers, so the ranks' calls agree), and
  a point-to-point message whose peer is on another node, or any (ANY_SOURCE). A message between two
  ranks of one node keeps the device path.
- **Why at the rank, whole.** The network is the slow leg by far (a socket moves a few GB/s; a
  pinned copy over PCIe tens), so the copies are a small share of the call (docs/decisions.md,
  "Device buffers across nodes", with the figures); done whole they need no schedule of their own,
  and every operation of the host path (vector collectives, Scan, probes) takes device buffers at once.
- **bfloat16** moves as its 16-bit words (point-to-point, Bcast, gathers, Alltoall). A reduction is
  widened on the GPU to float32 (exact), reduced on the host in float32 and rounded back to bfloat16
  (nearest even) once, on the GPU: the same bits on every rank, as every collective's, but not the
  bits of the reduction within a node, which rounds after every step as torch's bfloat16 arithmetic
  does (shmproxy.transports.cuda_coll); one rounding is the closer to the exact sum. The bytes between nodes
  double.
- **The buffers** are memfds registered once (the Registry's ranges, so that the post path finds
  them) and page-locked once (cudaHostRegister), cached by power-of-two size class up to
  SHMPROXY_STAGING_CACHE bytes; one the cache cannot keep is unpinned, deregistered and unmapped when
  its last view goes.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from shmproxy.core import log
from shmproxy.core.ops import ANY_SOURCE, DTYPE_BFLOAT16, IN_PLACE, Coll
from shmproxy.rank.buffers import Registry, StagingCache
from shmproxy.rank.device import DeviceMemory
from shmproxy.rank.request import Request
from shmproxy.shm.segment import MemfdBuffer
from shmproxy.transports.cuda_bf16 import BF16_PREAMBLE

_log = log.get("GPU")

_REDUCING = frozenset((Coll.REDUCE, Coll.ALLREDUCE, Coll.REDUCE_SCATTER_BLOCK, Coll.REDUCE_SCATTER, Coll.SCAN,
                       Coll.EXSCAN))
# where only the root's receive buffer is written
_ROOT_RECEIVES = frozenset((Coll.REDUCE, Coll.GATHER, Coll.GATHERV))
_MEMCPY_DEFAULT = 4   # cudaMemcpyDefault: the direction from the (unified) addresses


class _Pinned:
    """Registered, page-locked host buffers by size class (the module header)."""

    def __init__(self, registry: Registry, limit: int, cp: Any):
        self.registry, self.limit, self.cp = registry, limit, cp
        self.free: dict[int, list[MemfdBuffer]] = {}
        self.cached = 0
        self.pinned: set[int] = set()   # addresses cudaHostRegister took
        self.warned = False

    def get(self, nbytes: int) -> MemfdBuffer:
        cls = StagingCache.size_class(nbytes)
        lst = self.free.get(cls)
        if lst:
            self.cached -= cls
            return lst.pop()
        bid, buf = self.registry.register_new(cls, "shmproxy-devstage")
        self.registry.add(buf.addr, cls, bid)
        try:
            self.cp.cuda.runtime.hostRegister(buf.addr, cls, 0)
            self.pinned.add(buf.addr)
        except self.cp.cuda.runtime.CUDARuntimeError as exc:
            if not self.warned:   # still correct, only slower: a pageable copy
                _log.warning("device staging across nodes: cudaHostRegister failed (%s); copies are pageable", exc)
                self.warned = True
        return buf

    def put(self, buf: MemfdBuffer) -> None:
        if self.cached + buf.size <= self.limit:
            self.free.setdefault(buf.size, []).append(buf)
            self.cached += buf.size
        else:
            self.drop(buf)

    def drop(self, buf: MemfdBuffer) -> None:
        """Unpin and deregister now; the mapping goes with its last view (a request may still hold one)."""
        if buf.addr in self.pinned:
            self.pinned.discard(buf.addr)
            self.cp.cuda.runtime.hostUnregister(buf.addr)
        self.registry.remove(buf.addr)
        if buf.fd >= 0:
            os.close(buf.fd)
            buf.fd = -1

    def close(self) -> None:
        for lst in self.free.values():
            for buf in lst:
                self.drop(buf)
        self.free.clear()
        self.cached = 0


class _Staged:
    """One call's host copies: which device arrays they stand for, and the copy back at completion."""

    def __init__(self, stage: "DeviceStaging", stream: Any, device: int):
        self.stage, self.stream, self.device = stage, stream, device
        self.bufs: list[MemfdBuffer] = []
        # (device array, its host copy, widened from bfloat16) written back
        self.outs: list[tuple[Any, np.ndarray, bool]] = []
        self.synced = False   # an input was copied in: the call's stream has run its earlier work
        self.issued: Any = None   # else an event after that work, which the copies back wait for

    def host(self, arr: Any, copy_in: bool, copy_out: bool, widen: bool = False) -> np.ndarray:
        """The host copy of device array ``arr``; ``widen``: of its bfloat16 words as float32."""
        dtype = np.dtype(np.float32) if widen else arr.dtype
        buf = self.stage.pinned.get(arr.size * dtype.itemsize)
        self.bufs.append(buf)
        h = np.frombuffer(buf.mm, dtype=dtype, count=arr.size).reshape(arr.shape)
        if copy_in and arr.size:
            src = arr
            if widen:   # exact: a bfloat16 is the high half of a float32
                with self.stage.cp.cuda.Device(self.device), self.stream:
                    src = (arr.astype(self.stage.cp.uint32) << 16).view(self.stage.cp.float32)
            self.stage.copy(h.ctypes.data, src.data.ptr, h.nbytes, self.stream, self.device)
            self.synced = True
        if copy_out:
            self.outs.append((arr, h, widen))
        return h

    def ready(self) -> None:
        """Before the post: the copies back will follow the work queued on the call's stream so far
        (the module header): synchronised already where an input was copied in, else an event."""
        if self.outs and not self.synced:
            with self.stage.cp.cuda.Device(self.device):
                self.issued = self.stage.cp.cuda.Event(block=False, disable_timing=True)
                self.issued.record(self.stream)

    def done(self, ok: bool, nbytes: int = -1) -> None:
        """The request completed (``ok``: without error): copy the outputs back, give the buffers back.
        ``nbytes`` bounds a received message's copy (-1: the whole buffer). The copies run on a stream
        of the staging's own, not the call's: the caller's stream may be waiting for this very
        completion (the torch backend's Work.wait), so a copy queued behind it would never run."""
        try:
            if ok and self.outs:
                own = self.stage.own_stream(self.device)
                if self.issued is not None:
                    with self.stage.cp.cuda.Device(self.device):
                        own.wait_event(self.issued)
                for arr, h, widened in self.outs:
                    if widened and arr.size:
                        self.stage.narrow(arr, h, own, self.device)
                        continue
                    n = arr.nbytes if nbytes < 0 else min(nbytes, arr.nbytes)
                    if n:
                        self.stage.copy(arr.data.ptr, h.ctypes.data, n, own, self.device, sync=False)
                self.stage.sync(own, self.device)
        finally:
            self.give_back(reuse=ok)

    def give_back(self, reuse: bool) -> None:
        """The buffers back to the cache, or (not ``reuse``: the operation failed, and the progress
        process may still write a late chunk into them) out of it."""
        self.outs.clear()
        for buf in self.bufs:
            if reuse:
                self.stage.pinned.put(buf)
            else:
                self.stage.pinned.drop(buf)
        self.bufs.clear()

    def abandon(self) -> None:
        """The host call raised before it posted: nothing to copy back, nothing wrote the buffers."""
        self.give_back(reuse=True)


class DeviceStaging:
    """The staging of device buffers for one communicator that spans nodes (the module header).

    Needs: the communicator's device memory (arrays, dtypes, streams), its registry (the pinned
    buffers' registrations), the cache limit, and which node each rank is on."""

    def __init__(self, device: DeviceMemory, registry: Registry, limit: int, rank_node: list[int], node: int):
        self.dev, self.rank_node, self.node = device, rank_node, node
        self.cp = device.cp
        self.pinned = _Pinned(registry, limit, self.cp)
        self._narrow: Any = None   # the bfloat16 rounding kernel, made on first need
        self._own: dict[int, Any] = {}   # device -> the stream of the copies back

    def crosses(self, peer: int) -> bool:
        """Whether a message with ``peer`` (a checked rank, or ANY_SOURCE) may cross nodes."""
        return peer == ANY_SOURCE or self.rank_node[peer] != self.node

    # ------------------------------------------------------------------ copies
    def _stream(self, stream: Any, device: int) -> Any:
        s = self.dev.as_stream(stream, device)
        if s is None:
            with self.cp.cuda.Device(device):
                s = self.cp.cuda.get_current_stream()
        return s

    def copy(self, dst: int, src: int, nbytes: int, stream: Any, device: int, sync: bool = True) -> None:
        with self.cp.cuda.Device(device):
            self.cp.cuda.runtime.memcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream.ptr)
            if sync:
                stream.synchronize()

    def narrow(self, arr: Any, h: np.ndarray, stream: Any, device: int) -> None:
        """float32 host values into bfloat16 device array ``arr``, rounded to nearest even on the GPU
        (the rounding of shmproxy.transports.cuda_coll's bfloat16 reductions: transports/cuda_bf16.py)."""
        cp = self.cp
        if self._narrow is None:
            self._narrow = cp.ElementwiseKernel("float32 f", "uint16 o", "o = bf16_out(f)", "shmproxy_bf16_narrow",
                                                preamble=BF16_PREAMBLE)
        with cp.cuda.Device(device), stream:
            tmp = cp.empty(arr.size, cp.float32)
            self.copy(tmp.data.ptr, h.ctypes.data, h.nbytes, stream, device, sync=False)
            self._narrow(tmp, arr.reshape(-1))
            stream.synchronize()   # tmp is freed on return: cupy's pool could hand it out again

    def own_stream(self, device: int) -> Any:
        """The staging's stream on ``device``, for the copies back (``_Staged.done``)."""
        s = self._own.get(device)
        if s is None:
            with self.cp.cuda.Device(device):
                s = self._own[device] = self.cp.cuda.Stream(non_blocking=True)
        return s

    def sync(self, stream: Any, device: int) -> None:
        with self.cp.cuda.Device(device):
            stream.synchronize()

    @staticmethod
    def _attach(req: Request, staged: _Staged, received: bool) -> Request:
        """Run ``staged.done`` when the request completes (Request._finish)."""
        extra = req._extra
        after: Callable[[bool, int], None] = ((lambda ok, n: staged.done(ok, n)) if received
                                              else (lambda ok, n: staged.done(ok)))
        req._extra = (None, 0, after) if extra is None else (extra[0], extra[1], after)
        return req

    # ------------------------------------------------------------------ point to point
    def message(self, post: Callable[[np.ndarray], Request], arr: Any, receive: bool, stream: Any) -> Request:
        """A message of device array ``arr`` (checked: ``as_array``) through a host copy; ``post``
        posts the host message."""
        device = arr.device.id
        staged = _Staged(self, self._stream(stream, device), device)
        try:
            h = staged.host(arr, copy_in=not receive, copy_out=receive)
            staged.ready()
            req = post(h)
        except BaseException:
            staged.abandon()
            raise
        return self._attach(req, staged, received=receive)

    # ------------------------------------------------------------------ collectives
    def collective(self, coll: int, name: str, send: Any, recv: Any, recv_in: bool, root: int, me: int,
                   stream: Any, post: Callable[[Any, Any], Request]) -> Request:
        """A collective on device arrays through host copies. ``send`` and ``recv`` are the post path's
        checked cupy arrays (``Posting.device_args``; IN_PLACE or None stand for themselves); ``recv_in``:
        the receive buffer is read too (in place, or blocks the call leaves alone); ``root``: a
        checked root of a rooted collective. ``post(send, recv)`` posts the host collective."""
        codes = {self.dev.dtype_code(a) for a in (send, recv) if a is not None and a is not IN_PLACE}
        widen = coll in _REDUCING and DTYPE_BFLOAT16 in codes   # reduced in float32 (the module header)
        arr = send if recv is None else recv
        device = arr.device.id
        staged = _Staged(self, self._stream(stream, device), device)
        try:
            hsend: Any = send
            if coll == Coll.BCAST:   # one buffer, read at the root, written elsewhere
                hsend = staged.host(send, copy_in=me == root, copy_out=me != root)
            elif send is not None and send is not IN_PLACE:
                hsend = staged.host(send, copy_in=True, copy_out=False, widen=widen)
            hrecv = None
            if recv is not None:
                writes = not (coll in _ROOT_RECEIVES and me != root)
                hrecv = staged.host(recv, copy_in=recv_in, copy_out=writes, widen=widen)
            staged.ready()
            req = post(hsend, hrecv)
        except BaseException:
            staged.abandon()
            raise
        return self._attach(req, staged, received=False)

    def close(self) -> None:
        self.pinned.close()
