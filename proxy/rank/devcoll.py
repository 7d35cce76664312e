"""Device Allreduce as the ranks' own kernels on their own streams, between GPUs of their own.

A device Allreduce through the progress process costs the post, the loop's fetch and launch, and
the completion's way back: tens of microseconds before and after the GPU's few (BENCHMARKS.md); and
there one kernel on one GPU does the whole reduction. NCCL's all-reduce is one kernel per rank that
moves data over the GPUs' link itself. These are such kernels, for an Allreduce of device memory on
a communicator of one node whose ranks each have a GPU of their own: up to DEVICE_ONESHOT_BYTES the
*one-shot* kernel (every rank reads every peer's input and reduces all of it: one exchange, for
latency), above it *two-shot* kernels (each rank reduces a 1/N share, then hands it to its peers:
each byte crosses the link twice in all, for bandwidth), up to DEVICE_TWOSHOT_BYTES; and
Reduce_scatter_block and Allgather kernels of their own. Their CUDA C is shmproxy.rank.devkernels;
how a call is cut to fit the scratch is ``Sizing`` (tests/test_devcoll_sizing.py checks it).

- **Set-up, once per communicator**, at its first such call, which every rank makes alike (a
  collective, as the call is): each rank allocates a *scratch* on its device (per peer and block
  two flags and a signature, and two data halves), the ranks exchange the scratches' CUDA IPC handles
  and their GPUs' PCI bus ids (an object allgather), and each maps its peers' scratches. If two
  ranks share a GPU (their kernels would spin against each other on one GPU that runs one process's
  work at a time; unless DEVICE_KERNELS_SHARED_GPU says it runs under MPS) or a rank cannot map a
  peer's memory, every rank learns it from a second allgather, and the communicator never takes
  this path again. The same allgather decides the copy-engine path: every rank's stream can store a
  64-bit flag, or none uses it.
- **A one-shot call** launches one kernel on the caller's stream, after its queued work, as NCCL's
  kernels are. Each block copies its slice of the input into half ``epoch & 1`` of this rank's
  scratch, then, after a system-scope fence, stores the call's signature and (a release) its flag
  into its slots in every peer's scratch; it waits in its own scratch until every peer's flag for
  that block reached the call's (an acquire), then reduces the slice from every rank's scratch in
  rank order into the output: every rank gets the same bits, and the same as the progress
  process's fused kernel (shmproxy.core.kernels).
- **A two-shot call** is one kernel per window of DEVICE_TWOSHOT_WINDOW bytes. Each block's slice is
  cut in N parts, rank q reducing part q: the block writes each peer's part of its input into that
  peer's scratch and flags it; once its peers' values of its own part are there it reduces them in
  rank order with its own input's into its output and into every peer's scratch, and flags that;
  once its peers' reduced parts are there it copies them into its output. A block moves its parts in
  chunks of DEVICE_TWOSHOT_CHUNK, the steps of successive chunks overlapping. A flag's value is the
  epoch above 20 bits and the chunks delivered below, so it only grows, whichever kernel stored it.
- **A copy-engine two-shot call** (from DEVICE_CE_BYTES) moves the same bytes into the same slots
  by the GPUs' copy engines instead of the SMs' stores: shmproxy.rank.copyengines.
- **Why two halves are enough**: a rank writes half ``e & 1`` of its own scratch or a peer's (and
  its signature slots of that parity) again at epoch e + 2 only after its kernel of epoch e + 1 saw
  every peer's first flag of e + 1, which each peer stored after its kernel of epoch e had read what
  it needed. So a rank's kernels must run one after another: a call on another stream than the last
  call's first makes its stream wait for the last kernel (an event recorded behind each). A
  copy-engine window counts as a kernel: a rank's P of epoch e + 2 copies after its R of e + 1 saw
  every peer's flags of e + 1, which each peer's P stored after its R and L of epoch e were done.
- **Bounds**: a waiting block reads, every thousand spins, a host-mapped abort word, set once the
  communicator failed (``release``: from the rank's failure path, which its failure watch thread
  runs when the host is held by the GPU: shmproxy.rank.device), and the GPU's clock against TIMEOUT;
  either ends the kernel with a status in host-mapped memory. A peer whose signature (count, dtype,
  op) differs ends it at once. A blocking call reads the status after its synchronize; the torch
  backend at the group's next call. A rank that finds a kernel failed fails the communicator (Abort)
  before it raises, so no peer waits for a bound of its own. A rank that passed host memory where its
  peers passed device memory, or called Iallreduce (which stays with the progress process) where
  they called Allreduce, posts to the progress process while they wait in their kernels: they end at
  TIMEOUT (mismatched calls, which no side can see before it starts).
- **Deadlock freedom** needs a block to wait only for the same block of its peers, and GPUs to start
  a kernel's blocks in index order (they do), so that the lowest unfinished block of every rank is
  running.
"""
from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Iterator

import numpy as np

from shmproxy.core import errors, log
from shmproxy.core.kernels import C_TYPES, REDUCE_EXPR
from shmproxy.core.ops import DTYPE_BFLOAT16, IN_PLACE, ReduceOp
from shmproxy.rank.copyengines import CopyEngines
from shmproxy.rank.devkernels import (BLOCK, DATA, EXTRA_PARAMS, MAX_BLOCKS, MAX_RANKS, SIG_ALLGATHER,
                                      SIG_REDUCE_SCATTER, ST_ABORTED, ST_MISMATCH, W_ABORT, W_PEER, W_STATUS,
                                      kernel_source, signature)
from shmproxy.transports.cuda_driver import Driver

_log = log.get("RANK")

PER_THREAD = 2         # 16-byte packs a thread copies and reduces, up to DEVICE_ONESHOT_BLOCKS blocks:
                       # the loads of a peer's memory are each a round trip over the link, so they go
                       # wide (blocks, then the unrolled loop's loads in flight together), not deep
_C_TYPE = {np.dtype(name): ctype for name, ctype in C_TYPES.items()}   # by dtype (its .name is slow)
_MAPPED = 3            # cudaHostAllocPortable | cudaHostAllocMapped
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


def eligible(comm: Any, nbytes: int, dtype: np.dtype, op: int) -> bool:
    """Whether a collective of this signature (an Allreduce's, or a share's of Reduce_scatter_block or
    Allgather) takes the ranks' kernels, if its buffers are device memory: the same answer on every
    rank of a correct program (nothing here is the rank's own)."""
    p = comm.params
    return (0 < nbytes <= max(p.DEVICE_ONESHOT_BYTES, p.DEVICE_TWOSHOT_BYTES) and comm.local_size == comm.size
            and 2 <= comm.size <= MAX_RANKS and dtype in _C_TYPE and op in REDUCE_EXPR
            and comm.__dict__.get("_oneshot") is not False)


def allreduce(comm: Any, sendbuf: Any, recvbuf: Any, op: int, stream: Any) -> bool:
    """A blocking Allreduce of device arrays through the ranks' kernels, done on return (the data
    in place, as after the progress process's path); False where the call does not take it (the
    caller posts it). Host and device mixed in one call raise here, as on the posted path."""
    send, recv, mem = comm._posting.device_args("Allreduce", sendbuf, recvbuf)
    if not mem or recv is None:
        return False
    dev = comm._posting.device
    if dev.dtype_code(recv) == DTYPE_BFLOAT16:
        return False
    in_place = sendbuf is IN_PLACE
    if not in_place and (send is None or send.dtype != recv.dtype or send.size != recv.size):
        return False   # the posted path names what is wrong
    if not eligible(comm, recv.nbytes, recv.dtype, op):
        return False
    src = recv.data.ptr if in_place else send.data.ptr
    return _blocking(comm, recv, stream,
                     lambda shot, sp: shot.launch(src, recv.data.ptr, recv.size, recv.dtype, op, sp))


def allgather(comm: Any, sendbuf: Any, recvbuf: Any, stream: Any) -> bool:
    """A blocking Allgather of device arrays through the ranks' kernels, as ``allreduce``."""
    send, recv, mem = comm._posting.device_args("Allgather", sendbuf, recvbuf)
    if not mem or recv is None:
        return False
    count, in_place = recv.size // comm.size, sendbuf is IN_PLACE
    fits = in_place or (send is not None and send.dtype == recv.dtype and send.size == count)
    if recv.size != count * comm.size or not fits:
        return False   # the posted path names what is wrong
    src = recv.data.ptr + comm.rank * count * recv.dtype.itemsize if in_place else send.data.ptr
    return _run_shares(comm, "shmproxy_allgather", src, recv, count, ReduceOp.SUM, stream)


def reduce_scatter_block(comm: Any, sendbuf: Any, recvbuf: Any, op: int, stream: Any) -> bool:
    """A blocking Reduce_scatter_block of device arrays through the ranks' kernels, as ``allreduce``
    (IN_PLACE stays with the progress process: a rank's result would overwrite the first share of
    its input while its peers' may still be read)."""
    if sendbuf is IN_PLACE:
        return False
    send, recv, mem = comm._posting.device_args("Reduce_scatter_block", sendbuf, recvbuf)
    if not mem or recv is None or send is None:
        return False
    if send.dtype != recv.dtype or send.size != recv.size * comm.size:
        return False
    return _run_shares(comm, "shmproxy_reduce_scatter", send.data.ptr, recv, recv.size, op, stream)


def _run_shares(comm: Any, name: str, src: int, recv: Any, count: int, op: int, stream: Any) -> bool:
    dev = comm._posting.device
    if count == 0 or dev.dtype_code(recv) == DTYPE_BFLOAT16:
        return False
    if not eligible(comm, count * recv.dtype.itemsize, recv.dtype, op):
        return False
    return _blocking(comm, recv, stream,
                     lambda shot, sp: shot.launch_shares(name, src, recv.data.ptr, count, recv.dtype, op, sp))


def _blocking(comm: Any, recv: Any, stream: Any, launch: Any) -> bool:
    """Queue ``launch(kernels, stream pointer)`` on ``stream`` (else cupy's current one) of the
    output's GPU and wait for it, raising a kernel's failure; False where the ranks declined."""
    did = recv.device.id
    shot = shared(comm, did)
    if shot is None:
        return False
    dev = comm._posting.device
    s = dev.as_stream(stream, did)
    sp = (s if s is not None else dev.cp.cuda.get_current_stream()).ptr
    launch(shot, sp)
    shot.synchronize(sp)
    shot.check(comm)
    return True


def shared(comm: Any, device: int) -> "PeerKernels | None":
    """The communicator's kernels and scratch, set up at its first call that takes them (a collective);
    None where its ranks cannot use them, which every rank learns alike."""
    shot: PeerKernels | None | bool = comm.__dict__.get("_oneshot")
    if shot is None:
        shot = comm.__dict__["_oneshot"] = PeerKernels.set_up(comm, device) or False
    if not isinstance(shot, PeerKernels):
        return None
    if device != shot.device:
        raise errors.InvalidArgument(
            f"Allreduce: the buffers are on GPU {device}, and this communicator's device Allreduce runs on "
            f"GPU {shot.device}, where its first one's buffers were: a rank keeps one GPU per communicator")
    return shot


class Sizing:
    """How large a scratch half is, and how a call is cut into kernels and blocks to fit it: the same
    on every rank (it depends on the parameters and the call's count only)."""

    def __init__(self, nranks: int, oneshot_bytes: int, twoshot_bytes: int, window: int, blocks: int,
                 blocks2: int, chunk: int, ce_bytes: int = 0, ce_chunk: int = 4 << 20, ce_blocks: int = 32):
        self.nranks = nranks
        self.oneshot_bytes = oneshot_bytes
        self.window = min(window, twoshot_bytes) if twoshot_bytes > oneshot_bytes else 0
        # a half holds one one-shot call's data, or one two-shot window's slots: 2 (NR - 1) of them, each
        # a 1/NR share of the window (and a pack per block of rounding)
        twoshot_half = 2 * (nranks - 1) * (self.window // nranks + MAX_BLOCKS * 16) if self.window else 0
        self.cap = (max(oneshot_bytes, twoshot_half) + 255) // 256 * 256   # the halves stay 256-byte aligned
        self.blocks = min(max(blocks, 1), MAX_BLOCKS)     # a one-shot kernel's most
        self.blocks2 = min(max(blocks2, 1), MAX_BLOCKS)   # a two-shot (and share) kernel's
        self.chunk = max(chunk // 16 * 16, 16)            # a two-shot step's bytes
        self.ce_bytes = ce_bytes                          # two-shot calls from this size: copy engines
        self.ce_chunk = max(ce_chunk // 16 * 16, 16)      # ... their step's bytes
        self.ce_blocks = min(max(ce_blocks, 1), MAX_BLOCKS)

    @staticmethod
    def grid(count: int, itemsize: int, most: int) -> int:
        per_block = BLOCK * PER_THREAD * 16 // itemsize
        return min((count + per_block - 1) // per_block, most)

    def window_count(self, itemsize: int) -> int:
        """The most elements of one two-shot kernel: its 2 (NR - 1) slots, of a 1/NR share of each of
        the most blocks' slices (rounded up to NR packs: the kernel's rounding), fit in a half."""
        vec = 16 // itemsize
        nr = self.nranks
        sub = self.cap // (2 * (nr - 1) * self.blocks2 * itemsize) // vec * vec   # a part per block
        return min(sub * nr * self.blocks2, self.window // itemsize)

    def share_window(self, itemsize: int) -> int:
        """The most elements of each rank's share in one Reduce_scatter_block or Allgather kernel: its
        N - 1 slots, each of the share and a pack of rounding per block, fit in a half."""
        vec = 16 // itemsize
        room = self.cap // ((self.nranks - 1) * itemsize) - self.blocks2 * vec   # a slot, less the rounding
        return room // vec * vec


class PeerKernels:
    """A rank's scratch, its peers' mapped scratches, its one-shot and two-shot kernels and the host-mapped
    words."""

    def __init__(self, cp: Any, device: int, rank: int, sizing: Sizing, timeout_s: float):
        self.cp, self.device, self.rank, self.nranks = cp, device, rank, sizing.nranks
        self.sizing = sizing
        self.cap, self.chunk = sizing.cap, sizing.chunk
        self.timeout_ns = int(timeout_s * 1e9)
        self.drv = Driver()
        rt = cp.cuda.runtime
        self.epoch = 0                  # the calls' (or windows') count: a flag's high bits, a half's parity
        self.peers: list[int] = []      # every rank's scratch as this device sees it (ours included)
        self._opened: list[int] = []    # the peers' mappings, closed at close
        self._kernels: dict[tuple[str, int, str], Any] = {}   # (dtype char, op, kernel) -> its Launch
        self._modules: list[Any] = []   # the compiled kernels, loaded as long as their launches live
        self._last_stream: int | None = None
        self.failed = False
        self.closed = False
        with cp.cuda.Device(device):
            self.scratch = rt.malloc(DATA + 2 * self.cap)
            rt.memset(self.scratch, 0, DATA + 2 * self.cap)
            self.words_host = rt.hostAlloc(64, _MAPPED)
            ctypes.memset(self.words_host, 0, 64)
            self.words = self.drv.host_device_pointer(self.words_host)
            rt.deviceSynchronize()   # the zeroed flags, before any peer maps them
            self.handle = bytes(rt.ipcGetMemHandle(self.scratch))
            self.bus_id = rt.deviceGetPCIBusId(device)
            self._after = cp.cuda.Event(disable_timing=True)   # recorded behind each kernel
            self._before = cp.cuda.Event(disable_timing=True)  # on the caller's stream (``after``)
            self.ce: CopyEngines | None = None   # the copy-engine path, where every rank has it (set_up)
            if sizing.ce_bytes > 0 and self._can_store_flags():
                self.ce = CopyEngines(cp, self.drv, rank, sizing, self.cap, self.peers, self._kernel,
                                      self._next_epoch)

    def _can_store_flags(self) -> bool:
        """Whether a stream can store a 64-bit flag (the copy-engine path's signal): one store tried."""
        try:
            s = self.cp.cuda.Stream(non_blocking=True)
            self.drv.write_value64(s.ptr, self.scratch + 8 * self.rank * MAX_BLOCKS, 0)   # a slot no peer uses
            s.synchronize()
            return True
        except Exception as exc:   # SystemError_ from the driver, InvalidArgument where the entry is missing
            _log.info("rank %d: no copy-engine device Allreduce: %s", self.rank, exc)
            return False

    @classmethod
    def set_up(cls, comm: Any, device: int) -> "PeerKernels | None":
        """Every rank's part of the set-up (see the header): the state, or None on every rank alike."""
        dev = comm._posting.device_memory()
        shot: PeerKernels | None = None
        mine: tuple[str, bytes] | None = None
        try:
            cp = dev.cp if dev.cp is not None else dev._cupy()
            p = comm.params
            sizing = Sizing(comm.size, p.DEVICE_ONESHOT_BYTES, p.DEVICE_TWOSHOT_BYTES, p.DEVICE_TWOSHOT_WINDOW,
                            p.DEVICE_ONESHOT_BLOCKS, p.DEVICE_TWOSHOT_BLOCKS, p.DEVICE_TWOSHOT_CHUNK,
                            p.DEVICE_CE_BYTES, p.DEVICE_CE_CHUNK, p.DEVICE_CE_BLOCKS)
            shot = cls(cp, device, comm.rank, sizing, p.TIMEOUT)
            mine = (shot.bus_id, shot.handle)
        except Exception as exc:   # whatever cupy raises for memory it cannot allocate or export
            _log.info("rank %d: no one-shot device Allreduce on GPU %d: %s", comm.rank, device, exc)
        infos = comm.allgather(mine)
        own_gpus = all(i is not None for i in infos) and len({i[0] for i in infos}) == comm.size
        ok = shot is not None and all(i is not None for i in infos) and (own_gpus or p.DEVICE_KERNELS_SHARED_GPU)
        if shot is not None and ok:
            try:
                shot.map_peers([i[1] for i in infos])
            except Exception as exc:   # whatever cupy raises for a peer's memory it cannot map
                _log.info("rank %d: cannot map its peers' one-shot scratch: %s", comm.rank, exc)
                ok = False
        oks = comm.allgather((ok, shot is not None and shot.ce is not None))
        if shot is not None and not all(ce for _, ce in oks):
            shot.ce = None   # the same on every rank: it decides what a call queues
        if not all(o for o, _ in oks):
            if shot is not None:
                shot.close(barrier=None)
            _log.info("rank %d: device Allreduce stays with the progress process (%s)", comm.rank,
                      "ranks share a GPU" if all(i is not None for i in infos) else "a rank has no scratch")
            return None
        assert shot is not None
        dev.watch()   # a failure must reach kernels that wait while the host is held by the GPU
        return shot

    def map_peers(self, handles: list[bytes]) -> None:
        rt = self.cp.cuda.runtime
        with self.cp.cuda.Device(self.device):
            for r, h in enumerate(handles):
                if r == self.rank:
                    self.peers.append(self.scratch)
                    continue
                ptr = rt.ipcOpenMemHandle(h, _LAZY_PEER_ACCESS)
                self._opened.append(ptr)
                self.peers.append(ptr)

    def _kernel(self, dtype: np.dtype, op: int, name: str) -> Any:
        key = (dtype.char, op, name)
        launch = self._kernels.get(key)
        if launch is None:
            k = self.cp.RawKernel(kernel_source(_C_TYPE[dtype], op, self.nranks, self.chunk), name)
            extra = EXTRA_PARAMS.get(name, 0)
            launch = self._kernels[key] = self.drv.launcher(k.kernel.ptr, 10 + self.nranks + extra)
            launch.set((0, 0, 0, 0, self.rank, self.cap, self.words, self.timeout_ns, 0, 0, *self.peers)
                       + (0,) * extra)
            self._modules.append(k)
        return launch

    def launch(self, src: int, dst: int, count: int, dtype: np.dtype, op: int, stream: int,
               after: int | None = None) -> None:
        """Queue one Allreduce of ``count`` elements from ``src`` into ``dst`` on ``stream`` (this
        device's), after the work queued so far on stream ``after`` too (the caller's, where the
        kernel runs on a stream of its own, as NCCL's do); ``check`` before, so a kernel that failed
        is reported before another is queued. Up to DEVICE_ONESHOT_BYTES one one-shot kernel, above
        it two-shot kernels of a window each (the same choice on every rank: it is the call's size)."""
        with self._ordered(stream, after):
            isz, z = dtype.itemsize, self.sizing
            if count * isz <= z.oneshot_bytes or not z.window:
                self._queue(self._kernel(dtype, op, "shmproxy_oneshot"), src, dst, count, dtype, op, stream,
                            z.blocks)
            elif self.ce is not None and count * isz >= z.ce_bytes:
                self.ce.allreduce(src, dst, count, dtype, op, stream)
            else:
                launch, step = self._kernel(dtype, op, "shmproxy_twoshot"), z.window_count(isz)
                for off in range(0, count, step):
                    self._queue(launch, src + off * isz, dst + off * isz, min(step, count - off), dtype, op,
                                stream, z.blocks2)

    def launch_shares(self, name: str, src: int, dst: int, count: int, dtype: np.dtype, op: int, stream: int,
                      after: int | None = None) -> None:
        """Queue a Reduce_scatter_block (``op``) or an Allgather (``op`` None) of ``count`` elements
        per rank, as ``launch`` queues an Allreduce; in windows of ``share_window`` elements of each
        share."""
        reduce = name == "shmproxy_reduce_scatter"
        isz = dtype.itemsize
        stride = count * isz
        with self._ordered(stream, after):
            if self.ce is not None and count * self.nranks * isz >= self.sizing.ce_bytes:
                self.ce.shares(reduce, src, dst, count, dtype, op, stream)
                return
            launch, step = self._kernel(dtype, op if reduce else ReduceOp.SUM, name), self.sizing.share_window(isz)
            for off in range(0, count, step):
                n = min(step, count - off)
                launch.values[10 + self.nranks] = count   # in elements: the kernel's strides
                self._queue(launch, src + off * isz, dst + off * isz, n, dtype,
                            (SIG_REDUCE_SCATTER | op) if reduce else SIG_ALLGATHER, stream, self.sizing.blocks2,
                            aligned=not stride & 15)

    @contextlib.contextmanager
    def _ordered(self, stream: int, after: int | None) -> Iterator[None]:
        """This device current, ``stream`` after ``after``'s work and after our last kernel (see the
        header) for what is queued inside; the last kernel's event recorded behind it."""
        rt = self.cp.cuda.runtime
        prev = rt.getDevice()
        if prev != self.device:
            rt.setDevice(self.device)
        try:
            if after is not None:
                self.drv.record(self._before.ptr, after)
                self.drv.wait(stream, self._before.ptr)
            if self._last_stream is not None and stream != self._last_stream:
                # one kernel after another (see the header): the new stream waits for the last kernel
                self.drv.wait(stream, self._after.ptr)
            self._last_stream = stream
            yield
            self.drv.record(self._after.ptr, stream)
        finally:
            if prev != self.device:
                rt.setDevice(prev)

    @property
    def ce_windows(self) -> int:
        """Windows moved by the copy engines so far (the tests ask)."""
        return self.ce.windows if self.ce is not None else 0

    def _next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def _queue(self, launch: Any, src: int, dst: int, count: int, dtype: np.dtype, op: int, stream: int,
               blocks: int, aligned: bool = True) -> None:
        v = launch.values   # the call's own; the rest were set with the kernel (_kernel)
        v[0], v[1], v[2], v[3] = src, dst, count, self._next_epoch()
        v[8] = signature(count, dtype, op)
        v[9] = aligned and not ((src | dst) & 15)       # 16-byte packs
        launch(Sizing.grid(count, dtype.itemsize, blocks), BLOCK, stream)

    def synchronize(self, stream: int) -> None:
        self.cp.cuda.runtime.streamSynchronize(stream)

    def status(self) -> tuple[int, int]:
        """(status, peer) of a kernel that failed; status 0 while none did."""
        words = (ctypes.c_uint64 * 3).from_address(self.words_host)
        st = words[W_STATUS]
        return (st, words[W_PEER]) if st else (0, 0)

    def check(self, comm: Any) -> None:
        """Raise a kernel's failure: the communicator's own error when it failed (ST_ABORTED), else
        the kernel's, after failing the communicator on every rank."""
        st, peer = self.status()
        if not st:
            return
        self.failed = True
        if st == ST_ABORTED:
            comm._check_usable()
        if st == ST_MISMATCH:
            exc: errors.ProxyError = errors.InvalidUsage(
                f"rank {comm.rank}: device Allreduce #{self.epoch}: rank {peer} passed another count, dtype or op")
        else:
            exc = errors.Timeout(
                f"rank {comm.rank}: device Allreduce #{self.epoch}: rank {peer} did not join within "
                f"{self.timeout_ns / 1e9:.0f} s (a rank that passed host memory, or called another collective)")
        comm.Abort(str(exc))
        raise exc

    def release(self) -> None:
        """The communicator failed: every kernel of ours still waiting ends (ST_ABORTED)."""
        self.failed = True
        if self.closed:
            return
        ctypes.c_uint64.from_address(self.words_host + 8 * W_ABORT).value = 1

    def close(self, barrier: Any) -> None:
        """Free the scratch once no kernel may read it: this rank's ended (the device synchronized) and
        every peer's (``barrier``, the communicator's, after each peer synchronized too). Without one
        (a failed communicator) a peer may still read ours until it learns of the failure: the
        memory is then left to the process's exit, unless no kernel ever ran (a declined set-up)."""
        if self.closed:
            return
        if self.epoch and (barrier is None or self.failed):
            self.release()
            return
        rt = self.cp.cuda.runtime
        with self.cp.cuda.Device(self.device):
            if self.epoch:
                rt.deviceSynchronize()
                barrier()
            for ptr in self._opened:
                rt.ipcCloseMemHandle(ptr)
            self._opened.clear()
            self.closed = True
            rt.free(self.scratch)
            rt.freeHost(self.words_host)
