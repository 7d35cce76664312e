"""shmproxy.util.pkl5: object messages of any size, pickled with protocol 5 (mpi4py.util.pkl5's API).

Why it exists: mpi4py's object layer sends one pickle per message, whose size MPI's int counts
bound, and copies large buffers into the pickle. pkl5 sends an object as several plain buffer
messages on the same (source, tag): a header of int64 sizes [pickle length, buffer 1 length, ...],
then the pickle, then each out-of-band buffer (numpy arrays travel without a copy into the pickle).
MPI's non-overtaking rule keeps the messages of one send together in order, and ``_comm_lock``
keeps two threads of one process from interleaving theirs. A message larger than
``_bigmpi.blocksize`` bytes travels as one element of a contiguous derived datatype.

Receives probe the header first (Probe/Mprobe), so matched probes (``mprobe``/``improbe``) give a
pkl5.Message that holds the matched header and data messages. ``irecv`` is not possible in this
protocol (the sizes are only known after the header arrives) and raises RuntimeError, as mpi4py's.

Collectives (bcast, gather, scatter, allgather, alltoall) run as point-to-point messages (bcast: three
Bcasts: header size, header, data) on a duplicate of the communicator made on first use (one per
native communicator, ``_commctx_intra``), so they never match the program's own messages. On an
intercommunicator they are shmproxy.MPI.Intercomm's own (intercomm semantics: root MPI.ROOT,
MPI.PROC_NULL or a remote rank), which pickle with protocol 5 too and move each pickle through one
native collective of the intercommunicator's, so they never match its messages either.
"""
from __future__ import annotations

import pickle as _stdpickle
import struct
import threading
import weakref
from typing import Any, Callable, Iterable, Sequence

from shmproxy import MPI
from shmproxy.core import log
from shmproxy.mpi.exceptions import unsupported

ANY_SOURCE, ANY_TAG, PROC_NULL, ROOT = MPI.ANY_SOURCE, MPI.ANY_TAG, MPI.PROC_NULL, MPI.ROOT
Status = MPI.Status
_log = log.get("MPI")

__all__ = ["Pickle", "pickle", "Request", "Message", "Comm", "Intracomm", "Intercomm"]

_DEFAULT_THRESHOLD = 1 << 18     # mpi4py's default out-of-band threshold (0.25 MiB)


class Pickle:
    """mpi4py's MPI.Pickle: dumps/loads with a protocol, and an out-of-band threshold in bytes."""

    def __init__(self, dumps: Callable[..., bytes] | None = None, loads: Callable[..., Any] | None = None,
                 protocol: int | None = None, threshold: int | None = None) -> None:
        self._dumps = dumps or _stdpickle.dumps
        self._loads = loads or _stdpickle.loads
        self._protocol: int | None = None
        self._threshold = _DEFAULT_THRESHOLD
        self.PROTOCOL = protocol
        self.THRESHOLD = threshold

    @property
    def PROTOCOL(self) -> int | None:
        return self._protocol

    @PROTOCOL.setter
    def PROTOCOL(self, protocol: int | None) -> None:
        if protocol is None and self._dumps is _stdpickle.dumps:
            protocol = _stdpickle.HIGHEST_PROTOCOL
        self._protocol = protocol

    @property
    def THRESHOLD(self) -> int:
        return self._threshold

    @THRESHOLD.setter
    def THRESHOLD(self, threshold: int | None) -> None:
        self._threshold = _DEFAULT_THRESHOLD if threshold is None else int(threshold)

    def dumps(self, obj: Any) -> bytes:
        if self._protocol is None:
            return self._dumps(obj)
        return self._dumps(obj, self._protocol)

    def loads(self, data: Any) -> Any:
        return self._loads(data)

    def dumps_oob(self, obj: Any) -> tuple[bytes, list[Any]]:
        """The pickle (protocol 5 at least) and the buffers of ``THRESHOLD`` bytes or more, out of band,
        each an MPI.buffer over the object's own memory (as mpi4py gives them; no copy)."""
        protocol = max(_stdpickle.HIGHEST_PROTOCOL if self._protocol is None else self._protocol, 5)
        bufs: list[Any] = []
        threshold = self._threshold

        def out_of_band(pb: _stdpickle.PickleBuffer) -> bool:
            view = pb.raw()
            if view.nbytes >= threshold:
                bufs.append(MPI.buffer(view))
                return False
            return True
        data = self._dumps(obj, protocol, buffer_callback=out_of_band)
        return data, bufs

    def loads_oob(self, data: Any, buffers: Iterable[Any]) -> Any:
        return self._loads(data, buffers=buffers)


pickle = Pickle()


class _BigMPI:
    """Buffer specs for messages of any size: above ``blocksize`` bytes, one contiguous element."""

    blocksize = (1 << 63) - 1

    def __init__(self) -> None:
        self.cache: dict[int, Any] = {}

    def __enter__(self) -> "_BigMPI":
        return self

    def __exit__(self, *exc: Any) -> None:
        for dtype in self.cache.values():
            dtype.Free()
        self.cache.clear()

    def __call__(self, buf: Any) -> list:
        view = memoryview(buf).cast("B")
        count = view.nbytes
        if count <= self.blocksize:
            return [view, count, MPI.BYTE]
        dtype = self.cache.get(count)
        if dtype is None:
            dtype = self.cache[count] = MPI.BYTE.Create_contiguous(count).Commit()
        return [view, 1, dtype]


_bigmpi = _BigMPI()


class _Methods:
    """``_M.Send(comm, ...)`` is ``comm.Send(...)``: the call of comm's own class (an Intercomm maps
    remote ranks), where mpi4py calls MPI.Comm's method, which dispatches on the handle."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return lambda comm, *args: getattr(comm, name)(*args)


_M = _Methods()
_INFO = MPI.INT64_T
_INFO_SIZE = 8


def _pack(info: Sequence[int]) -> bytearray:
    return bytearray(struct.pack(f"{len(info)}q", *info))


def _unpack(raw: Any) -> tuple[int, ...]:
    return struct.unpack(f"{len(raw) // _INFO_SIZE}q", raw)


# ---- per-communicator state: thread locks and the duplicate for collectives, keyed by the native comm
_state_lock = threading.Lock()
_locks: "weakref.WeakKeyDictionary[Any, dict[str, threading.RLock]]" = weakref.WeakKeyDictionary()
_dup_keyval: list[int] = []   # the keyval under which a communicator holds its duplicate (made once)


def _comm_lock(comm: Any, kind: str) -> threading.RLock:
    """The lock that keeps the messages of one send (or receive) of this process together."""
    with _state_lock:
        table = _locks.setdefault(comm._c, {})
        return table.setdefault(kind, threading.RLock())


def _commctx_intra(comm: Any) -> tuple[Any, int]:
    """A duplicate of ``comm`` for collectives (collective on first use) and the next tag on it.

    The duplicate is an attribute of ``comm`` whose delete callback frees it, as mpi4py's pkl5 keeps
    it: so it goes at ``comm.Free()``, a point every rank reaches in the same order. Freeing it when
    the garbage collector took ``comm``'s last handle (a finalizer) ran a collective close at a
    different moment on each rank: one rank's close waited for the others' inside whatever they
    were doing (creating an intercommunicator, say), a deadlock. A communicator dropped without
    Free keeps its duplicate until the job ends, as any communicator not freed."""
    if comm.Is_inter():
        unsupported("pkl5's own collectives on an intercommunicator", "pkl5.Intercomm runs MPI.Intercomm's")
    with _state_lock:
        if not _dup_keyval:
            _dup_keyval.append(MPI.Comm.Create_keyval(delete_fn=_free_dup))
    entry = comm.Get_attr(_dup_keyval[0])
    if entry is None:
        entry = [MPI.Intracomm.Dup(comm), 0]
        comm.Set_attr(_dup_keyval[0], entry)
    entry[1] = (entry[1] + 1) % (1 << 30)
    return entry[0], entry[1]


def _free_dup(comm: Any, keyval: int, entry: list) -> None:
    """Delete callback of the duplicate's attribute (``comm.Free()``, or Delete_attr)."""
    try:
        entry[0].Free()
    except MPI.Exception as exc:   # its job may already be failing: the parent's Free goes on
        _log.warning("freeing pkl5's duplicate communicator: %s", exc)


# ---- point-to-point
def _send_raw(comm: Any, send: Callable, data: Any, bufs: list, dest: int, tag: int) -> None:
    info = [len(data), *(memoryview(b).nbytes for b in bufs)]
    send(comm, [_pack(info), _INFO], dest, tag)
    with _bigmpi as big:
        send(comm, big(data), dest, tag)
        for b in bufs:
            send(comm, big(b), dest, tag)


def _send(comm: Any, send: Callable, obj: Any, dest: int, tag: int) -> None:
    if dest == PROC_NULL:
        send(comm, [None, 0, MPI.BYTE], dest, tag)
        return
    data, bufs = pickle.dumps_oob(obj)
    with _comm_lock(comm, "send"):
        _send_raw(comm, send, data, bufs, dest, tag)


def _isend(comm: Any, isend: Callable, obj: Any, dest: int, tag: int) -> "Request":
    reqs: list = []
    _send(comm, lambda c, b, d, t: reqs.append(isend(c, b, d, t)), obj, dest, tag)
    return Request(reqs)


def _recv_raw(comm: Any, recv: Callable, buf: Any, source: int, tag: int,
              status: Any = None) -> tuple[Any, list]:
    status = Status() if status is None else status
    _M.Probe(comm, source, tag, status)
    source, tag = status.Get_source(), status.Get_tag()
    info = bytearray(status.Get_elements(_INFO) * _INFO_SIZE)
    _M.Recv(comm, [info, _INFO], source, tag, status)
    sizes = _unpack(info)
    data: Any = None
    if buf is not None:
        view = memoryview(buf).cast("B")
        data = view[:sizes[0]] if len(view) >= sizes[0] else None
    data = bytearray(sizes[0]) if data is None else data
    bufs = [bytearray(n) for n in sizes[1:]]
    with _bigmpi as big:
        recv(comm, big(data), source, tag)
        for b in bufs:
            recv(comm, big(b), source, tag)
    status.Set_elements(MPI.BYTE, sum(sizes))
    return data, bufs


def _recv(comm: Any, recv: Callable, buf: Any, source: int, tag: int, status: Any) -> Any:
    if source == PROC_NULL:
        recv(comm, [None, 0, MPI.BYTE], source, tag, status)
        return None
    with _comm_lock(comm, "recv"):
        data, bufs = _recv_raw(comm, recv, buf, source, tag, status)
    return pickle.loads_oob(data, bufs)


def _mprobe(comm: Any, mprobe: Callable, source: int, tag: int, status: Any) -> "Message | None":
    if source == PROC_NULL:
        # a copy of MESSAGE_NO_PROC: receiving it turns the copy (not the constant) into MESSAGE_NULL
        return Message([MPI.Message(_M.Mprobe(comm, source, tag, status))])
    status = Status() if status is None else status
    with _comm_lock(comm, "recv"):
        head = mprobe(comm, source, tag, status)
        if head is None:
            return None
        parts = [head]
        source, tag = status.Get_source(), status.Get_tag()
        nbytes = 0
        for _ in range(status.Get_elements(_INFO)):
            parts.append(_M.Mprobe(comm, source, tag, status))
            nbytes += status.Get_elements(MPI.BYTE)
        status.Set_elements(MPI.BYTE, nbytes)
        return Message(parts)


def _mrecv_data(message: Sequence[Any], mrecv: Callable, status: Any = None) -> tuple[Any, list]:
    head = message[0]
    info = bytearray((len(message) - 1) * _INFO_SIZE)
    MPI.Message.Recv(head, [info, _INFO], status)
    if head == MPI.MESSAGE_NO_PROC or len(message) == 1:
        none, bufs = pickle.dumps_oob(None)
        return bytearray(none), bufs
    sizes = _unpack(info)
    data = bytearray(sizes[0])
    bufs = [bytearray(n) for n in sizes[1:]]
    with _bigmpi as big:
        mrecv(message[1], big(data))
        for part, b in zip(message[2:], bufs):
            mrecv(part, big(b))
    if status is not None:
        status.Set_elements(MPI.BYTE, sum(sizes))
    return data, bufs


class _Handles(tuple):
    """Several MPI handles standing for one (pkl5's Request and Message): built from None (the null
    handle), one handle or a sequence of them; equal to a plain handle when each of its own is."""

    _handle: type          # the plain handle's class
    _null: Any             # its null handle

    def __new__(cls, handles: Any = None) -> Any:
        if handles is None:
            handles = (cls._null,)
        elif isinstance(handles, cls._handle):
            handles = (handles,)
        return super().__new__(cls, handles)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, type(self)):
            return tuple(self) == tuple(other)
        if isinstance(other, self._handle):
            return all(h == other for h in self)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = tuple.__hash__

    def __bool__(self) -> bool:
        return any(bool(h) for h in self)


class Request(_Handles):
    """The requests of one pkl5 send or matched receive, completed together (mpi4py's pkl5.Request)."""

    _handle, _null = MPI.Request, MPI.REQUEST_NULL
    _payload: "tuple[Any, list] | None"   # a matched receive's buffers (_PayloadRequest)

    def Free(self) -> None:
        for r in self:
            r.Free()

    def free(self) -> None:
        for r in self:
            r.Free()

    def cancel(self) -> None:
        for r in self:
            r.Cancel()

    def get_status(self, status: Any = None) -> bool:
        done = [r.Get_status(status if i == 0 else None) for i, r in enumerate(self)]
        return all(done)

    def _load(self) -> Any:
        """The received object, once: a request that completed is a null request afterwards, whose
        test/wait give None (as mpi4py's do)."""
        payload = getattr(self, "_payload", None)
        if payload is None:
            return None
        self._payload = None
        return pickle.loads_oob(*payload)

    def test(self, status: Any = None) -> tuple[bool, Any]:
        flag = MPI.Request.Testall(list(self), None if status is None else [status] * len(self))
        return (True, self._load()) if flag else (False, None)

    def wait(self, status: Any = None) -> Any:
        MPI.Request.Waitall(list(self), None if status is None else [status] * len(self))
        return self._load()

    @classmethod
    def _flat(cls, requests: Sequence["Request"], statuses: list | None) -> tuple[list, list | None]:
        flat = [r for req in requests for r in req]
        if statuses is None:
            return flat, None
        if isinstance(statuses, list):
            statuses.extend(Status() for _ in range(len(requests) - len(statuses)))
        return flat, [s for req, s in zip(requests, statuses) for _ in req]

    @classmethod
    def get_status_all(cls, requests: Sequence["Request"], statuses: list | None = None) -> bool:
        if statuses is not None:
            if isinstance(statuses, list):
                statuses.extend(Status() for _ in range(len(requests) - len(statuses)))
            return all([req.get_status(s) for req, s in zip(requests, statuses)])
        return all([req.get_status() for req in requests])

    @classmethod
    def testall(cls, requests: Sequence["Request"], statuses: list | None = None) -> tuple[bool, list | None]:
        flat, sts = cls._flat(requests, statuses)
        if not MPI.Request.Testall(flat, sts):
            return False, None
        return True, [req._load() for req in requests]

    @classmethod
    def waitall(cls, requests: Sequence["Request"], statuses: list | None = None) -> list:
        flat, sts = cls._flat(requests, statuses)
        MPI.Request.Waitall(flat, sts)
        return [req._load() for req in requests]


class Message(_Handles):
    """A matched pkl5 message: its header and data messages (mpi4py's pkl5.Message)."""

    _handle, _null = MPI.Message, MPI.MESSAGE_NULL

    def free(self) -> None:
        for m in self:
            if hasattr(m, "free"):
                m.free()

    def recv(self, status: Any = None) -> Any:
        data, bufs = _mrecv_data(self, lambda m, b: MPI.Message.Recv(m, b), status)
        return pickle.loads_oob(data, bufs)

    def irecv(self) -> Request:
        reqs: list = []
        data, bufs = _mrecv_data(self, lambda m, b: reqs.append(MPI.Message.Irecv(m, b)))
        if not reqs:   # the message of a probe of PROC_NULL: a receive from PROC_NULL, active until waited
            reqs.append(MPI.Request(None, True))
        req = _PayloadRequest(reqs)
        req._payload = (data, bufs)
        return req

    @classmethod
    def probe(cls, comm: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Any = None) -> "Message":
        msg = _mprobe(comm, _M.Mprobe, source, tag, status)
        assert msg is not None
        return msg

    @classmethod
    def iprobe(cls, comm: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG,
               status: Any = None) -> "Message | None":
        return _mprobe(comm, _M.Improbe, source, tag, status)


class _PayloadRequest(Request):
    """The requests of a matched receive, with the buffers the object is loaded from at completion."""


# ---- collectives over the duplicate
def _bcast(comm: Any, obj: Any, root: int) -> Any:
    dup, _tag = _commctx_intra(comm)
    rank = dup.Get_rank()
    pickled, oob = pickle.dumps_oob(obj if rank == root else None)
    # shmproxy's Bcast takes writable buffers only, also at the root: copy the read-only ones
    data, bufs = _writable(pickled), [_writable(b) for b in oob]
    with _comm_lock(dup, "bcast"):
        if rank == root:
            info = [len(data), *(memoryview(b).nbytes for b in bufs)]
            _M.Bcast(dup, [_pack([len(info)]), _INFO], root)
            _M.Bcast(dup, [_pack(info), _INFO], root)
        else:
            head = bytearray(_INFO_SIZE)
            _M.Bcast(dup, [head, _INFO], root)
            raw = bytearray(_unpack(head)[0] * _INFO_SIZE)
            _M.Bcast(dup, [raw, _INFO], root)
            sizes = _unpack(raw)
            data, bufs = bytearray(sizes[0]), [bytearray(n) for n in sizes[1:]]
        with _bigmpi as big:
            _M.Bcast(dup, big(data), root)
            for b in bufs:
                _M.Bcast(dup, big(b), root)
    return pickle.loads_oob(data, bufs)


def _writable(buf: Any) -> Any:
    view = memoryview(buf)
    return bytearray(view) if view.readonly else view


def _p2p() -> tuple[list, Callable, Callable]:
    reqs: list = []
    return (reqs, lambda c, b, d, t: reqs.append(_M.Isend(c, b, d, t)),
            lambda c, b, s, t: _M.Recv(c, b, s, t))


def _check_root(size: int, root: int) -> None:
    if not 0 <= root < size:
        raise MPI.Exception(MPI.ERR_ROOT)


def _items(objs: Any, size: int) -> list:
    objs = [None] * size if objs is None else list(objs)
    if len(objs) != size:
        raise ValueError(f"expecting {size} items, got {len(objs)}")
    return objs


def _gather(comm: Any, obj: Any, root: int) -> list | None:
    dup, tag = _commctx_intra(comm)
    size, rank = dup.Get_size(), dup.Get_rank()
    _check_root(size, root)
    reqs, send, recv = _p2p()
    data, bufs = pickle.dumps_oob(obj)
    _send_raw(dup, send, data, bufs, root, tag)
    out = None
    if rank == root:
        out = [pickle.loads_oob(*_recv_raw(dup, recv, None, src, tag)) for src in range(size)]
    MPI.Request.Waitall(reqs)
    return out


def _scatter(comm: Any, objs: Any, root: int) -> Any:
    dup, tag = _commctx_intra(comm)
    size, rank = dup.Get_size(), dup.Get_rank()
    _check_root(size, root)
    reqs, send, recv = _p2p()
    if rank == root:
        for dest, item in enumerate(_items(objs, size)):
            _send_raw(dup, send, *pickle.dumps_oob(item), dest, tag)
    obj = pickle.loads_oob(*_recv_raw(dup, recv, None, root, tag))
    MPI.Request.Waitall(reqs)
    return obj


def _allgather(comm: Any, obj: Any) -> list:
    dup, tag = _commctx_intra(comm)
    size = dup.Get_size()
    reqs, send, recv = _p2p()
    data, bufs = pickle.dumps_oob(obj)
    for dest in range(size):
        _send_raw(dup, send, data, bufs, dest, tag)
    out = [pickle.loads_oob(*_recv_raw(dup, recv, None, src, tag)) for src in range(size)]
    MPI.Request.Waitall(reqs)
    return out


def _alltoall(comm: Any, objs: Any) -> list:
    size = comm.Get_size()
    items = _items(objs, size)      # checked before the duplicate is made: a wrong length raises alone
    dup, tag = _commctx_intra(comm)
    reqs, send, recv = _p2p()
    for dest, item in enumerate(items):
        _send_raw(dup, send, *pickle.dumps_oob(item), dest, tag)
    out = [pickle.loads_oob(*_recv_raw(dup, recv, None, src, tag)) for src in range(size)]
    MPI.Request.Waitall(reqs)
    return out


class Comm(MPI.Comm):
    """A communicator whose object methods use the pkl5 protocol (mpi4py's pkl5.Comm)."""

    __slots__ = ()

    def __init__(self, comm: Any = None) -> None:
        if isinstance(comm, MPI.Comm) and comm:
            comm._c     # noqa: B018 - COMM_WORLD/COMM_SELF join on first use: before their ranks are read
        super().__init__(comm)

    # communicators made from this one are pkl5 communicators too, as in mpi4py
    def Dup(self, info: Any = None) -> "Comm":
        return type(self)(super().Dup(info))

    def Clone(self) -> "Comm":
        return self.Dup()

    def Split(self, color: int = 0, key: int = 0) -> "Comm":
        return _same_kind(self, super().Split(color, key))

    def Split_type(self, split_type: int, key: int = 0, info: Any = None) -> "Comm":
        return _same_kind(self, super().Split_type(split_type, key, info))

    def Create(self, group: Any) -> "Comm":
        return _same_kind(self, super().Create(group))

    def Create_group(self, group: Any, tag: int = 0) -> "Comm":
        return _same_kind(self, super().Create_group(group, tag))

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        _send(self, _M.Send, obj, dest, tag)

    def bsend(self, obj: Any, dest: int, tag: int = 0) -> None:
        _send(self, _M.Bsend, obj, dest, tag)

    def ssend(self, obj: Any, dest: int, tag: int = 0) -> None:
        MPI.Request.Waitall(list(_isend(self, _M.Issend, obj, dest, tag)))

    # pkl5's Request and Message are tuples of MPI ones (as mpi4py's pkl5), not MPI.Request/Message
    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:  # type: ignore[override]
        return _isend(self, _M.Isend, obj, dest, tag)

    def ibsend(self, obj: Any, dest: int, tag: int = 0) -> Request:  # type: ignore[override]
        return _isend(self, _M.Ibsend, obj, dest, tag)

    def issend(self, obj: Any, dest: int, tag: int = 0) -> Request:  # type: ignore[override]
        return _isend(self, _M.Issend, obj, dest, tag)

    def recv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Any = None) -> Any:
        return _recv(self, _M.Recv, buf, source, tag, status)

    def irecv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Any:
        raise RuntimeError("unsupported")    # (as mpi4py's pkl5: the sizes come with the header)

    def sendrecv(self, sendobj: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = ANY_SOURCE, recvtag: int = ANY_TAG, status: Any = None) -> Any:
        sreq = _isend(self, _M.Isend, sendobj, dest, sendtag)
        obj = _recv(self, _M.Recv, recvbuf, source, recvtag, status)
        MPI.Request.Waitall(list(sreq))
        return obj

    def mprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,  # type: ignore[override]
               status: Any = None) -> Message:
        return Message.probe(self, source, tag, status)

    def improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,  # type: ignore[override]
                status: Any = None) -> Message | None:
        return Message.iprobe(self, source, tag, status)

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        return _bcast(self, obj, root)

    def gather(self, sendobj: Any, root: int = 0) -> list | None:
        return _gather(self, sendobj, root)

    def scatter(self, sendobj: Any = None, root: int = 0) -> Any:
        return _scatter(self, sendobj, root)

    def allgather(self, sendobj: Any) -> list:
        return _allgather(self, sendobj)

    def alltoall(self, sendobj: Any) -> list:
        return _alltoall(self, sendobj)


def _same_kind(comm: Comm, new: Any) -> Any:
    return type(comm)(new) if new else new


class Intracomm(Comm, MPI.Intracomm):
    """An intracommunicator with the pkl5 object methods (``pkl5.Intracomm(MPI.COMM_WORLD)``)."""

    __slots__ = ()


# Dup and _exchange come from pkl5.Comm and MPI.Intercomm's bases alike; the MRO takes pkl5's Dup (which
# returns this class) and the intercommunicator's _exchange, as intended.
class Intercomm(Comm, MPI.Intercomm):  # type: ignore[misc]
    """An intercommunicator with pkl5 point-to-point (its collectives: see the module doc)."""

    __slots__ = ()

    # the collectives of shmproxy.MPI's Intercomm (the module doc says why)
    bcast, gather, scatter = MPI.Intercomm.bcast, MPI.Intercomm.gather, MPI.Intercomm.scatter
    allgather, alltoall = MPI.Intercomm.allgather, MPI.Intercomm.alltoall

    def __init__(self, inter: Any = None) -> None:
        super().__init__(inter)
        if isinstance(inter, MPI.Intercomm):     # the remote group's layout travels with the handle
            self._setup(inter._iw, inter._loff, inter._lsize, inter._roff, inter._rsize)
            self._side = inter._side  # type: ignore[misc]  # a slot of MPI.Intercomm
