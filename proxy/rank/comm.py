"""The rank-side API: ``shmproxy.init()`` and ``shmproxy.Comm``.

A Comm is attached to the progress process of its node (started by local rank 0) through two
channels: the service socket for control (init, buffer registration, close) and the ops pool for the
data path. Posting an operation never talks to the socket:

    validate (raise before anything is posted) -> find or stage the buffer -> take a record from the
    private free list -> pack it -> splice it onto the posted chain under the pool mutex, in one call
    into shm._native, signalling the progress process only if the chain was empty.

Inside ``with comm.group():`` records are linked privately and spliced once at the end (one lock for
the whole group, and one opCount, so the progress process batches them into one args).

Waiting spins briefly in C (Request.Wait/Test in shm/_poster.c), then sleeps on the rank's futex
word in bounded slices that check for failures between them: never a silent hang (waiting.py).

The Comm is its public calls, here, over one part, its lifecycle (lifecycle.py: start and attach to
the progress process, failure, Abort/close, teardown; it declares the state it sets), and two
components it holds, made when the pool is mapped: its posting (``_posting``, posting.py: validation,
buffer location and staging, the Python post path) and its waiter (``_waiter``, waiting.py: the sleep
of Wait/Test, the free records and slots and the pending requests, which it owns). What a call runs
is visible here: which calls each communicator binds to C entry points (POSTER_ENTRIES,
FAST_ENTRIES), and what the methods they fall back to ask of the posting.

A Comm is meant to be used by one thread at a time (like MPI_THREAD_SERIALIZED).
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from shmproxy.control import bootstrap
from shmproxy.core import errors, log, params as params_mod
from shmproxy.rank import arena, collpost, devcoll, fastpath, objcoll, objects, objp2p, splitting
from shmproxy.core.ops import (ANY_SOURCE, ANY_TAG, DTYPE_CODE, FLAG_PROBE_BLOCK, FLAG_PROBE_MATCHED,
                               FLAG_SYNC, IN_PLACE, KIND_RECV, KIND_SEND, SUPPORTED_DTYPES, UNDEFINED, Coll,
                               ReduceOp)
# _DTYPES and _probes: what a C poster is built with (tests build one from this module's names).
from shmproxy.rank.lifecycle import Lifecycle, _DTYPES, _probes  # noqa: F401
from shmproxy.rank.request import Message, Request, Status
from shmproxy import transports


_NO_KW: dict = {}
# the collectives whose C entry falls back to its method by the collective's code
_NONBLOCKING = {Coll.BCAST: "Ibcast", Coll.REDUCE: "Ireduce", Coll.ALLGATHER: "Iallgather",
                Coll.REDUCE_SCATTER_BLOCK: "Ireduce_scatter_block", Coll.ALLTOALL: "Ialltoall"}


def _stream_kw(stream: Any) -> dict:
    """A blocking call's ``stream`` passed on to its nonblocking form only when given: the C post
    path an instance binds declines unknown keywords, and host calls should keep it."""
    return _NO_KW if stream is None else {"stream": stream}


def init(timeout: float | None = None, **overrides: Any) -> "Comm":
    """Join the job: read the launcher's environment, start or find the node's progress process.

    ``overrides`` may set rank, size, local_rank, local_size (they win over the launcher) and any
    parameter by name (e.g. ``chunk_size='1M'``). ``timeout`` bounds every step (SHMPROXY_TIMEOUT).
    Raises InvalidArgument for bad parameters, Timeout when the rendezvous does not complete,
    PeerDiedError when the progress process dies while starting.
    """
    launch = {k: overrides.pop(k) for k in ("rank", "size", "local_rank", "local_size") if k in overrides}
    if timeout is not None:
        overrides["TIMEOUT"] = timeout
    params = params_mod.Params(overrides=overrides) if overrides else params_mod.get()
    log.configure(params)
    transports.allowed(params.TRANSPORTS)   # an unknown name fails here, before a process is started
    info = bootstrap.detect(**launch)
    log.set_rank(info.rank)
    return Comm._create(info, params, comm_id=0)


class Comm(Lifecycle):
    """A communicator. Attributes: rank, size, local_rank, local_size."""

    # ------------------------------------------------------------------ what a call runs
    # Each communicator binds these calls of its own to C entry points of its poster (shm/_poster.c):
    # a post then costs no Python frame, a large share of a sub-microsecond post. What an entry
    # declines (anything uncommon) falls back to the method of the same name below, the full path
    # with every check and its message.
    POSTER_ENTRIES = ("Isend", "Irecv", "Iallreduce", "Ibarrier", "Ibcast", "Ireduce", "Iallgather",
                      "Ireduce_scatter_block", "Ialltoall")
    # ... and, on a communicator whose ranks are all on this node, these to the fast path's entries
    # (rank/fastpath.py): a small blocking call the ranks complete between themselves, anything else
    # through the posted path (Allreduce: shmproxy.rank.fastpath.allreduce, which runs a device
    # Allreduce as the ranks' own kernels where it can: shmproxy.rank.devcoll).
    FAST_ENTRIES = ("Send", "Recv", "Barrier", "Allreduce", "Bcast", "Reduce", "_send_or_isend", "_try_recv")

    def _bind_entries(self, seg_addr: int, layout: Any) -> None:
        pp, cls = self._pp, type(self)
        pp.send_fallback, pp.recv_fallback = cls.Isend.__get__(self), cls.Irecv.__get__(self)
        pp.allreduce_fallback, pp.in_place = cls.Iallreduce.__get__(self), IN_PLACE
        pp.barrier_fallback = cls.Ibarrier.__get__(self)
        pp.rank = self.rank
        for coll, name in _NONBLOCKING.items():
            pp.set_coll_fallback(coll, getattr(cls, name).__get__(self))
        for name in self.POSTER_ENTRIES:
            setattr(self, name, getattr(pp, name.lower()))
        if fastpath.bind(self, seg_addr, layout):
            for name in self.FAST_ENTRIES:
                setattr(self, name, getattr(pp, name.lower().lstrip("_")))

    def _bind_arena(self) -> None:
        """Once the numpy arena is registered (or not): the middle collectives of the fast path's
        Allreduce, Bcast and Reduce (fastpath.bind_arena)."""
        fastpath.bind_arena(self, arena.held() if self._arena_held else None)

    # ------------------------------------------------------------------ buffers
    def alloc(self, shape: int | tuple[int, ...], dtype: Any = np.float32, device: int | None = None) -> Any:
        """A zeroed numpy array in registered shared memory: the zero-copy path for Send/Recv (a block of
        the numpy arena where there is one, else a memfd of its own registered with this communicator).
        ``device=N``: a zeroed cupy array on GPU N in an allocation of its own, registered with the
        progress process once, deregistered and freed when the last array over it is dropped."""
        self._check_usable()
        dt = np.dtype(dtype)
        if dt.char not in DTYPE_CODE:
            raise errors.InvalidArgument(f"unsupported dtype {dt}; supported: {SUPPORTED_DTYPES}")
        shp = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if any(int(s) < 0 for s in shp):
            raise errors.InvalidArgument(f"negative dimension in shape {shp}")
        if device is not None:
            return self._posting.device_memory().alloc(tuple(int(s) for s in shp), dt, device)
        if self._arena_held:   # registered with every communicator: one arena (shmproxy.rank.arena)
            return arena.array(tuple(int(s) for s in shp), dt)
        return self._registry.alloc(tuple(int(s) for s in shp), dt)

    def alloc_device(self, shape: int | tuple[int, ...], dtype: Any = np.float32,
                     device: int | None = None) -> Any:
        """``alloc(shape, dtype, device=device)``; without ``device``, on this process's current CUDA
        device (cupy's, as ``cupy.empty`` would use), not GPU 0."""
        if device is None:
            device = self._posting.device_memory().current_device()
        return self.alloc(shape, dtype, device)

    # ------------------------------------------------------------------ point-to-point API
    def Isend(self, buf: np.ndarray, dest: int, tag: int = 0, stream: Any = None) -> Request:
        """Post a send of ``buf`` to ``dest``; returns a Request. ``buf`` must stay unchanged until
        the request completes (arrays outside comm.alloc memory are copied at post time).

        Each communicator binds its own ``Isend``/``Irecv`` to the C post path (shm/_poster.c); these
        methods are what that path falls back to, so they go straight to the full Python path.

        ``stream`` (device buffers; every buffer operation takes it): order the operation after the
        work queued on that stream (a cupy or torch CUDA stream, or a raw cudaStream_t) instead of
        cupy's current one. Its result is visible to every stream once Wait/Test reported completion
        (the wait is the synchronisation point). Host buffers ignore it."""
        return self._posting.post(KIND_SEND, buf, dest, tag, stream=stream)

    def _send_or_isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request | None:
        """A small send done at once through a cell of the ranks' fast path (None), else Isend's
        request, posted and not waited for: for a caller whose send must not block (the torch
        backend's, which torch's isend returns unwaited; a declined Send would wait for its Isend).
        Bound to the C entry where the fast path is on (rank/fastpath.py); without it, Isend."""
        return self.Isend(buf, dest, tag)

    def _try_recv(self, buf: np.ndarray, source: int, tag: int = 0) -> Status | None:
        """Recv's fast path alone (a cell of the ranks' fast path taken, after its bounded spin): the
        Status, or None with nothing posted. Bound to the C entry where the fast path is on
        (rank/fastpath.py); without it, None."""
        return None

    def Irecv(self, buf: np.ndarray, source: int, tag: int = 0, stream: Any = None) -> Request:
        """Post a receive into ``buf`` (writable, C-contiguous) from ``source``; returns a Request.
        (The C path bound per communicator falls back to this method, as for Isend.)"""
        return self._posting.post(KIND_RECV, buf, source, tag, stream=stream)

    def Send(self, buf: np.ndarray, dest: int, tag: int = 0, stream: Any = None) -> None:
        """Blocking send in MPI's standard mode: returns once ``buf`` may be reused. A message of at
        most SHMPROXY_SEND_BUFFER_BYTES to a rank of this node is buffered by the progress process if
        no receive waits for it (so it returns at once, within SEND_BUFFER_PER_PEER bytes waiting per
        destination); a larger one returns once its receive took it."""
        self.Isend(buf, dest, tag, **_stream_kw(stream)).Wait()

    def Issend(self, buf: np.ndarray, dest: int, tag: int = 0, stream: Any = None) -> Request:
        """Synchronous-mode Isend: the request completes only once a matching receive took the
        message, never from a buffer."""
        return self._posting.post(KIND_SEND, buf, dest, tag, FLAG_SYNC, stream)

    def Ssend(self, buf: np.ndarray, dest: int, tag: int = 0, stream: Any = None) -> None:
        """Blocking synchronous send: returns once the receive matched (see Issend)."""
        self.Issend(buf, dest, tag, stream).Wait()

    def Recv(self, buf: np.ndarray, source: int = ANY_SOURCE, tag: int = ANY_TAG, stream: Any = None) -> Any:
        """Blocking receive; returns the Status (source, tag, nbytes)."""
        return self.Irecv(buf, source, tag, **_stream_kw(stream)).Wait()

    def Probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Status:
        """Wait for a message that a receive (source, tag) would match and return its Status
        (source, tag, nbytes), leaving it to be received."""
        st = self._posting.probe(source, tag, FLAG_PROBE_BLOCK).Wait()
        assert st is not None   # a blocking probe returns a message's
        return st

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Status | None:
        """The Status of a message a receive (source, tag) would match now, or None (a round trip to
        the progress process)."""
        return self._posting.probe(source, tag, 0).Wait()

    def Mprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Message:
        """Wait for a message a receive (source, tag) would match and take it out of matching: only
        the returned Message's Recv can receive it (no other receive or probe sees it any more)."""
        req = self._posting.probe(source, tag, FLAG_PROBE_BLOCK | FLAG_PROBE_MATCHED)
        st = req.Wait()
        assert st is not None   # a blocking probe returns a message's
        return Message(self, req._seq, st)

    def Improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Message | None:
        """Mprobe that answers at once: a Message, or None when nothing matches now."""
        req = self._posting.probe(source, tag, FLAG_PROBE_MATCHED)
        st = req.Wait()
        return None if st is None else Message(self, req._seq, st)

    def group(self) -> Any:
        """``with comm.group():`` everything posted inside is spliced onto the pool under one lock, as
        one opCount, when the outermost group ends (also if the block raises). Groups nest. The
        context manager is the poster's (shm/_poster.c)."""
        return self._pp

    # ------------------------------------------------------------------ collectives
    def Iallreduce(self, sendbuf: Any, recvbuf: np.ndarray, op: Any = ReduceOp.SUM,
                   stream: Any = None) -> Request:
        """Nonblocking Allreduce; ``sendbuf`` may be shmproxy.IN_PLACE. (Each communicator binds its own
        Iallreduce to the C post path, which falls back to this method for everything uncommon.)"""
        return self._posting.collective(Coll.ALLREDUCE, sendbuf, recvbuf, op, 0, stream)

    def Allreduce(self, sendbuf: Any, recvbuf: np.ndarray, op: Any = ReduceOp.SUM,
                  stream: Any = None) -> None:
        """recvbuf = op over every rank's sendbuf (or recvbuf, with IN_PLACE), on every rank. (A
        communicator of one node binds its own to the fast path's C entry, which falls back to the
        same function: shmproxy.rank.fastpath.allreduce.)"""
        fastpath.allreduce(self, sendbuf, recvbuf, op, stream)

    def Ireduce(self, sendbuf: Any, recvbuf: np.ndarray | None, op: Any = ReduceOp.SUM, root: int = 0,
                stream: Any = None) -> Request:
        return self._posting.collective(Coll.REDUCE, sendbuf, recvbuf, op, root, stream)

    def Reduce(self, sendbuf: Any, recvbuf: np.ndarray | None, op: Any = ReduceOp.SUM, root: int = 0,
               stream: Any = None) -> None:
        """The root's recvbuf = op over every rank's sendbuf; recvbuf may be None elsewhere."""
        self.Ireduce(sendbuf, recvbuf, op, root, **_stream_kw(stream)).Wait()

    def Ibcast(self, buf: np.ndarray, root: int = 0, stream: Any = None) -> Request:
        return self._posting.collective(Coll.BCAST, buf, None, 0, root, stream)

    def Bcast(self, buf: np.ndarray, root: int = 0, stream: Any = None) -> None:
        """Every rank's buf = the root's buf."""
        self.Ibcast(buf, root, **_stream_kw(stream)).Wait()

    def Iallgather(self, sendbuf: Any, recvbuf: np.ndarray, stream: Any = None) -> Request:
        return self._posting.collective(Coll.ALLGATHER, sendbuf, recvbuf, 0, 0, stream)

    def Allgather(self, sendbuf: Any, recvbuf: np.ndarray, stream: Any = None) -> None:
        """Block r of every rank's recvbuf = rank r's sendbuf (IN_PLACE: already in block r). Device
        arrays, a GPU per rank: the ranks' own kernels (shmproxy.rank.devcoll), else posted."""
        if type(recvbuf) is not np.ndarray and devcoll.allgather(self, sendbuf, recvbuf, stream):
            return
        self.Iallgather(sendbuf, recvbuf, **_stream_kw(stream)).Wait()

    def Ireduce_scatter_block(self, sendbuf: Any, recvbuf: np.ndarray, op: Any = ReduceOp.SUM,
                              stream: Any = None) -> Request:
        return self._posting.collective(Coll.REDUCE_SCATTER_BLOCK, sendbuf, recvbuf, op, 0, stream)

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: np.ndarray, op: Any = ReduceOp.SUM,
                             stream: Any = None) -> None:
        """Rank r's recvbuf = op over every rank's block r of sendbuf. Device arrays, a GPU per rank:
        the ranks' own kernels (shmproxy.rank.devcoll), else posted."""
        if type(recvbuf) is not np.ndarray:
            o = fastpath.reduce_op(op)
            if o is not None and devcoll.reduce_scatter_block(self, sendbuf, recvbuf, o, stream):
                return
        self.Ireduce_scatter_block(sendbuf, recvbuf, op, **_stream_kw(stream)).Wait()

    def Ialltoall(self, sendbuf: np.ndarray, recvbuf: np.ndarray, stream: Any = None) -> Request:
        return self._posting.collective(Coll.ALLTOALL, sendbuf, recvbuf, 0, 0, stream)

    def Alltoall(self, sendbuf: np.ndarray, recvbuf: np.ndarray, stream: Any = None) -> None:
        """Block r of rank q's recvbuf = block q of rank r's sendbuf."""
        self.Ialltoall(sendbuf, recvbuf, **_stream_kw(stream)).Wait()

    # Collectives past the C post path (shmproxy.rank.collpost posts them; the progress process runs
    # them). Counts and displacements are sequences of ints, in elements; displacements default to
    # the blocks packed in rank order. Arguments only the root reads may be None elsewhere.
    def Igather(self, sendbuf: Any, recvbuf: np.ndarray | None, root: int = 0, stream: Any = None) -> Request:
        return collpost.post(self._posting, Coll.GATHER, sendbuf, recvbuf, root=root, stream=stream)

    def Gather(self, sendbuf: Any, recvbuf: np.ndarray | None, root: int = 0, stream: Any = None) -> None:
        """Block r of the root's recvbuf = rank r's sendbuf (IN_PLACE on the root: its block is there)."""
        self.Igather(sendbuf, recvbuf, root, **_stream_kw(stream)).Wait()

    def Iscatter(self, sendbuf: np.ndarray | None, recvbuf: Any, root: int = 0,
                 stream: Any = None) -> Request:
        return collpost.post(self._posting, Coll.SCATTER, sendbuf, recvbuf, root=root, stream=stream)

    def Scatter(self, sendbuf: np.ndarray | None, recvbuf: Any, root: int = 0, stream: Any = None) -> None:
        """Rank r's recvbuf = block r of the root's sendbuf (recvbuf IN_PLACE on the root: kept)."""
        self.Iscatter(sendbuf, recvbuf, root, **_stream_kw(stream)).Wait()

    def Igatherv(self, sendbuf: Any, recvbuf: np.ndarray | None, recvcounts: Any = None, displs: Any = None,
                 root: int = 0, stream: Any = None) -> Request:
        return collpost.post(self._posting, Coll.GATHERV, sendbuf, recvbuf, root=root, rcounts=recvcounts,
                             rdispls=displs, stream=stream)

    def Gatherv(self, sendbuf: Any, recvbuf: np.ndarray | None, recvcounts: Any = None, displs: Any = None,
                root: int = 0, stream: Any = None) -> None:
        """The root's recvbuf[displs[r]:displs[r] + recvcounts[r]] = rank r's sendbuf."""
        self.Igatherv(sendbuf, recvbuf, recvcounts, displs, root, **_stream_kw(stream)).Wait()

    def Iscatterv(self, sendbuf: np.ndarray | None, recvbuf: Any, sendcounts: Any = None, displs: Any = None,
                  root: int = 0, stream: Any = None) -> Request:
        return collpost.post(self._posting, Coll.SCATTERV, sendbuf, recvbuf, root=root, scounts=sendcounts,
                             sdispls=displs, stream=stream)

    def Scatterv(self, sendbuf: np.ndarray | None, recvbuf: Any, sendcounts: Any = None, displs: Any = None,
                 root: int = 0, stream: Any = None) -> None:
        """Rank r's recvbuf = the root's sendbuf[displs[r]:displs[r] + sendcounts[r]]."""
        self.Iscatterv(sendbuf, recvbuf, sendcounts, displs, root, **_stream_kw(stream)).Wait()

    def Iallgatherv(self, sendbuf: Any, recvbuf: np.ndarray, recvcounts: Any, displs: Any = None,
                    stream: Any = None) -> Request:
        return collpost.post(self._posting, Coll.ALLGATHERV, sendbuf, recvbuf, rcounts=recvcounts,
                             rdispls=displs, stream=stream)

    def Allgatherv(self, sendbuf: Any, recvbuf: np.ndarray, recvcounts: Any, displs: Any = None,
                   stream: Any = None) -> None:
        """Every rank's recvbuf[displs[r]:displs[r] + recvcounts[r]] = rank r's sendbuf."""
        self.Iallgatherv(sendbuf, recvbuf, recvcounts, displs, **_stream_kw(stream)).Wait()

    def Ialltoallv(self, sendbuf: np.ndarray, sendcounts: Any, sdispls: Any, recvbuf: np.ndarray,
                   recvcounts: Any, rdispls: Any, stream: Any = None) -> Request:
        return collpost.post(self._posting, Coll.ALLTOALLV, sendbuf, recvbuf, scounts=sendcounts,
                             sdispls=sdispls, rcounts=recvcounts, rdispls=rdispls, stream=stream)

    def Alltoallv(self, sendbuf: np.ndarray, sendcounts: Any, sdispls: Any, recvbuf: np.ndarray,
                  recvcounts: Any, rdispls: Any, stream: Any = None) -> None:
        """Rank q's block r of recvbuf (recvcounts[r] at rdispls[r]) = rank r's block q of sendbuf
        (sendcounts[q] at sdispls[q]); displacements may be None (packed)."""
        self.Ialltoallv(sendbuf, sendcounts, sdispls, recvbuf, recvcounts, rdispls,
                        **_stream_kw(stream)).Wait()

    def Ireduce_scatter(self, sendbuf: Any, recvbuf: np.ndarray, recvcounts: Any = None,
                        op: Any = ReduceOp.SUM, stream: Any = None) -> Request:
        return collpost.post(self._posting, Coll.REDUCE_SCATTER, sendbuf, recvbuf, op=op, rcounts=recvcounts,
                             stream=stream)

    def Reduce_scatter(self, sendbuf: Any, recvbuf: np.ndarray, recvcounts: Any = None,
                       op: Any = ReduceOp.SUM, stream: Any = None) -> None:
        """Rank r's recvbuf[:recvcounts[r]] = op over every rank's block r of sendbuf (blocks packed in
        rank order); IN_PLACE: the vector is in recvbuf. No recvcounts: each rank's recvbuf's size."""
        self.Ireduce_scatter(sendbuf, recvbuf, recvcounts, op, **_stream_kw(stream)).Wait()

    def Iscan(self, sendbuf: Any, recvbuf: np.ndarray, op: Any = ReduceOp.SUM, stream: Any = None) -> Request:
        return collpost.post(self._posting, Coll.SCAN, sendbuf, recvbuf, op=op, stream=stream)

    def Scan(self, sendbuf: Any, recvbuf: np.ndarray, op: Any = ReduceOp.SUM, stream: Any = None) -> None:
        """Rank r's recvbuf = op over ranks 0..r's sendbufs, folded in rank order."""
        self.Iscan(sendbuf, recvbuf, op, **_stream_kw(stream)).Wait()

    def Iexscan(self, sendbuf: Any, recvbuf: np.ndarray, op: Any = ReduceOp.SUM,
                stream: Any = None) -> Request:
        return collpost.post(self._posting, Coll.EXSCAN, sendbuf, recvbuf, op=op, stream=stream)

    def Exscan(self, sendbuf: Any, recvbuf: np.ndarray, op: Any = ReduceOp.SUM, stream: Any = None) -> None:
        """Rank r's recvbuf = op over ranks 0..r-1's sendbufs (rank 0's recvbuf is left as it was)."""
        self.Iexscan(sendbuf, recvbuf, op, **_stream_kw(stream)).Wait()

    def Ibarrier(self) -> Request:
        return self._posting.collective(Coll.BARRIER, None, None)

    def Barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        self.Ibarrier().Wait()

    # ------------------------------------------------------------------ objects (mpi4py lower case)
    # Pickle protocol 5 with out-of-band buffers; the wire format is in proxy/rank/objects.py.
    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Send any picklable object (large arrays inside travel without a pickle copy)."""
        objects.send(self, obj, dest, tag)

    def recv(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Any:
        """Receive an object sent with ``send`` (no size needs to be known in advance); ANY_SOURCE and
        ANY_TAG take the earliest object in MPI's matching order. objects.recv_status also returns
        its Status."""
        return objects.recv(self, source, tag)

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Any:
        """Nonblocking object send: an objp2p.ObjRequest whose wait() returns None."""
        return objp2p.isend(self, obj, dest, tag)

    def irecv(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Any:
        """Nonblocking object receive: an objp2p.ObjRequest whose wait() returns the object."""
        return objp2p.irecv(self, source, tag)

    def sendrecv(self, sendobj: Any, dest: int, sendtag: int = 0, source: int = ANY_SOURCE,
                 recvtag: int = ANY_TAG) -> Any:
        """Send ``sendobj`` to ``dest`` and receive an object from ``source`` (no deadlock between
        ranks that exchange with each other)."""
        return objp2p.sendrecv(self, sendobj, dest, sendtag, source, recvtag)

    def probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Status:
        """Wait for an object message (source, tag) and return its Status; the object stays to recv."""
        return objp2p.probe(self, source, tag)

    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Status | None:
        return objp2p.iprobe(self, source, tag)

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        return objcoll.bcast(self, obj, root)

    def gather(self, obj: Any, root: int = 0) -> list | None:
        return objcoll.gather(self, obj, root)

    def allgather(self, obj: Any) -> list:
        return objcoll.allgather(self, obj)

    def allreduce(self, obj: Any, op: Any = ReduceOp.SUM) -> Any:
        """Reduce objects in rank order (op: shmproxy.SUM/PROD/MIN/MAX or a callable); same result everywhere."""
        return objcoll.allreduce(self, obj, op)

    def barrier(self) -> None:
        objcoll.barrier(self)

    def scatter(self, sendobj: Any = None, root: int = 0) -> Any:
        """Item r of the root's sequence of ``size`` objects to rank r."""
        return objcoll.scatter(self, sendobj, root)

    def alltoall(self, sendobj: Any) -> list:
        """Item q of every rank's sequence of ``size`` objects to rank q, as a list in rank order."""
        return objcoll.alltoall(self, sendobj)

    def reduce(self, sendobj: Any, op: Any = ReduceOp.SUM, root: int = 0) -> Any:
        """Reduce objects in rank order at ``root`` (None elsewhere); op as for allreduce."""
        return objcoll.reduce(self, sendobj, op, root)

    def scan(self, sendobj: Any, op: Any = ReduceOp.SUM) -> Any:
        """op over ranks 0..me's objects, in rank order."""
        return objcoll.scan(self, sendobj, op)

    def exscan(self, sendobj: Any, op: Any = ReduceOp.SUM) -> Any:
        """op over ranks 0..me-1's objects, in rank order; None on rank 0."""
        return objcoll.exscan(self, sendobj, op)

    # ------------------------------------------------------------------ sub-communicators
    def Split(self, color: int, key: int = 0) -> "Comm | None":
        """A new communicator of the ranks that pass the same ``color``, ordered by (key, rank);
        ``shmproxy.UNDEFINED`` gives None. Collective over this communicator. The new communicator has
        its own progress process and ops pool, and progresses independently of this one."""
        for name, v in (("color", color), ("key", key)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise errors.InvalidArgument(f"Split: {name} must be an int, got {type(v).__name__}")
        if color < 0 and color != UNDEFINED:
            raise errors.InvalidArgument(f"Split: color must be >= 0 or shmproxy.UNDEFINED, got {color}")
        table = np.zeros((self.size, 2), np.int64)
        self.Allgather(np.array([color, key], np.int64), table)
        self._nchildren += 1
        if self.node_layout is not None:
            return self._split_across_nodes(table, color)
        if color == UNDEFINED:
            return None
        members = sorted((int(table[r, 1]), r) for r in range(self.size) if table[r, 0] == color)
        ranks = [r for _k, r in members]
        me = ranks.index(self.rank)
        info = bootstrap.LaunchInfo(rank=me, size=len(ranks), local_rank=me, local_size=len(ranks),
                                    launcher="split")
        child = Comm._create(info, self.params, self._child_id(color), key=self._job_key)
        child.parent_ranks = ranks
        return child

    def _child_id(self, color: int) -> int:
        digest = hashlib.blake2b(f"{self._comm_id}/{self._nchildren}/{color}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") & 0x7FFFFFFF or 1

    def _split_across_nodes(self, table: np.ndarray, color: int) -> "Comm | None":
        """Split of a communicator that spans nodes: each node's members of a color share a progress
        process; a child that spans nodes too gets its layout from one more Allgather over this
        communicator, which every rank makes (whatever its color), so that the sequence of
        collectives stays the same on every rank."""
        layout = splitting.ChildLayouts(self, table)
        if color == UNDEFINED:
            layout.exchange(b"")
            return None
        child_id = self._child_id(color)
        info, child_layout = layout.child_info(color, child_id)
        child = Comm._create(info, self.params, child_id, key=self._job_key,
                             split_layout=child_layout if child_layout.spans_nodes else None)
        if not child_layout.spans_nodes:
            layout.exchange(b"")   # this rank's share of the Allgather a child across nodes needs
        child.parent_ranks = layout.members(color)
        return child

    def Dup(self) -> "Comm":
        """A new communicator with the same ranks (its own progress process and ops pool)."""
        child = self.Split(0, self.rank)
        assert child is not None
        return child

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("failed" if self._failure else "open")
        return f"<shmproxy.Comm rank {self.rank}/{self.size} local {self.local_rank}/{self.local_size} {state}>"
