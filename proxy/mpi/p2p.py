"""MPI.Comm's point-to-point calls (a mixin of shmproxy.mpi.comm.Comm): buffers, probes and the object
layer's point-to-point, over the native calls (proxy/rank/comm.py, objects.py, objp2p.py).

Each call checks its peer and tag (PROC_NULL is an immediate no-op whose receive status says source
PROC_NULL, as MPI defines), parses its buffer specs (buffers.py) and calls the native method; native
errors come back as MPI.Exception subclasses that are still the native classes (exceptions.convert).

Modes: ``Send``/``Isend`` are MPI's standard mode (the progress process buffers a small message that
no receive waits for yet, so the send completes at once; engine/p2p.py), ``Ssend``/``Issend`` the
native synchronous calls, ``Rsend`` (which MPI lets an implementation run as a standard send) the
standard ones. Buffered mode (Bsend, Attach_buffer): bsend.py.

Send/Recv/Isend/Irecv first try a fast path: a plain array the buffer parser would hand over as it is
(buffers.FAST_DTYPES, C-contiguous, writable for a receive) and exact int peer and tag, a peer that
cannot be PROC_NULL; it goes straight to the native call, which checks the peer and tag itself. Only
when that raises are the layer's own checks run, so a bad peer or tag still raises this layer's
error (ERR_RANK, ERR_TAG) and nothing is posted twice.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np

from shmproxy.core import errors
from shmproxy.core.ops import ANY_SOURCE, ANY_TAG
from shmproxy.mpi import bsend, buffers
from shmproxy.mpi.exceptions import ERR_BUFFER, ERR_RANK, ERR_TAG, as_int, convert, error
from shmproxy.mpi.nativereq import Both, Done
from shmproxy.mpi.message import MESSAGE_NO_PROC, Held, Message
from shmproxy.mpi.request import ObjRequest, Prequest, Request
from shmproxy.mpi.status import PROC_NULL, Status
from shmproxy.rank import objects, objp2p

_ndarray = np.ndarray
_new = object.__new__
_FAST = buffers.FAST_DTYPES


def _parse(spec: Any, what: str, writable: bool) -> Any:
    return buffers.wire(buffers.parse(spec, what, writable))


def _ignored_buf(buf: Any, what: str) -> None:
    """mpi4py's object receives warn that a buffer argument is not used; so do these."""
    if buf is not None:
        warnings.warn(f"Comm.{what}: the buf argument is ignored (an object is received into memory of "
                      "its own)", UserWarning, stacklevel=3)


class PointToPoint:
    """Point-to-point calls of MPI.Comm (``_c``: the native communicator; ``_obj``: Comm's call of an
    object-layer function that converts native errors)."""

    __slots__ = ()
    _c: Any
    _obj: Callable[..., Any]    # Comm._obj(fn, *args): fn(self._c, *args), native errors converted

    # ------------------------------------------------------------------ point-to-point, buffers
    def _peer(self, peer: Any, what: str, wildcard: bool = False) -> int:
        if type(peer) is not int:      # numpy integers, bools, __index__ objects: as mpi4py reads them
            peer = as_int(peer, what, ERR_RANK)
        if not 0 <= peer < self._c.size and peer != PROC_NULL and not (wildcard and peer == ANY_SOURCE):
            raise error(ERR_RANK, f"{what} {peer} out of range: the communicator has {self._c.size} ranks")
        return peer

    def _tag(self, tag: Any, wildcard: bool = False) -> int:
        if type(tag) is not int:
            tag = as_int(tag, "tag", ERR_TAG)
        if tag == ANY_TAG and not wildcard:
            raise error(ERR_TAG, "ANY_TAG is for receives: a message needs a tag of its own")
        return tag

    def _failed(self, exc: errors.ProxyError, peer: int, tag: int, what: str, recv: bool) -> BaseException:
        """A fast path's native call raised: this layer's error for a bad peer or tag, else the native
        error converted."""
        self._peer(peer, what, recv)
        self._tag(tag, recv)
        return convert(exc)

    # Isend/Irecv/Send/Recv: the fast path (see the header), else the general path (_isend, ...), which
    # is what a subclass that maps peers (Intercomm) binds instead.
    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        if (type(buf) is _ndarray and type(dest) is int and type(tag) is int and dest >= 0
                and buf.dtype in _FAST and buf.flags.c_contiguous):
            try:
                req = _new(Request)     # Request(native) without its constructor's checks
                req._r, req._null, req._h = self._c.Isend(buf, dest, tag), False, None
                return req
            except errors.ProxyError as exc:
                failed = exc
            raise self._failed(failed, dest, tag, "destination", False) from None
        return self._isend(buf, dest, tag)

    def _isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        dest, tag = self._peer(dest, "destination"), self._tag(tag)
        if dest == PROC_NULL:
            return Request(None, True)
        b = _parse(buf, "send buffer", False)
        try:
            return Request(self._c.Isend(b, dest, tag))
        except errors.ProxyError as exc:
            raise convert(exc) from None

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        if (type(buf) is _ndarray and type(source) is int and type(tag) is int and source >= ANY_SOURCE
                and buf.dtype in _FAST):
            flags = buf.flags
            if flags.c_contiguous and flags.writeable:
                try:
                    req = _new(Request)
                    req._r, req._null, req._h = self._c.Irecv(buf, source, tag), False, None
                    return req
                except errors.ProxyError as exc:
                    failed = exc
                raise self._failed(failed, source, tag, "source", True) from None
        return self._irecv(buf, source, tag)

    def _irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        source, tag = self._peer(source, "source", True), self._tag(tag, True)
        if source == PROC_NULL:
            return Request(None, True)
        b = _parse(buf, "receive buffer", True)
        try:
            return Request(self._c.Irecv(b, source, tag))
        except errors.ProxyError as exc:
            raise convert(exc) from None

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        """Blocking standard-mode send: returns once ``buf`` may be reused (at once for a small message
        the progress process buffered, else once the receiver took it)."""
        if (type(buf) is _ndarray and type(dest) is int and type(tag) is int and dest >= 0
                and buf.dtype in _FAST and buf.flags.c_contiguous):
            try:
                self._c.Send(buf, dest, tag)
                return
            except errors.ProxyError as exc:
                failed = exc
            raise self._failed(failed, dest, tag, "destination", False) from None
        self._send(buf, dest, tag)

    def _send(self, buf: Any, dest: int, tag: int = 0) -> None:
        dest, tag = self._peer(dest, "destination"), self._tag(tag)
        if dest == PROC_NULL:
            return
        b = _parse(buf, "send buffer", False)
        try:
            self._c.Send(b, dest, tag)
        except errors.ProxyError as exc:
            raise convert(exc) from None

    def Issend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        """Synchronous mode: completes only once a matching receive took the message."""
        dest, tag = self._peer(dest, "destination"), self._tag(tag)
        if dest == PROC_NULL:
            return Request(None, True)
        b = _parse(buf, "send buffer", False)
        try:
            return Request(self._c.Issend(b, dest, tag))
        except errors.ProxyError as exc:
            raise convert(exc) from None

    def Ssend(self, buf: Any, dest: int, tag: int = 0) -> None:
        self.Issend(buf, dest, tag).Wait()

    def Recv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG,
             status: Status | None = None) -> None:
        if (type(buf) is _ndarray and type(source) is int and type(tag) is int and source >= ANY_SOURCE
                and buf.dtype in _FAST):
            flags = buf.flags
            if flags.c_contiguous and flags.writeable:
                try:
                    st = self._c.Recv(buf, source, tag)
                except errors.ProxyError as exc:
                    failed = exc
                else:
                    if status is not None:
                        status._fill(st)
                    return
                raise self._failed(failed, source, tag, "source", True) from None
        self._recv(buf, source, tag, status)

    def _recv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG,
              status: Status | None = None) -> None:
        source, tag = self._peer(source, "source", True), self._tag(tag, True)
        if source == PROC_NULL:
            if status is not None:
                status._fill_null()
            return
        b = _parse(buf, "receive buffer", True)
        try:
            st = self._c.Recv(b, source, tag)
        except errors.ProxyError as exc:
            raise convert(exc) from None
        if status is not None:
            status._fill(st)

    # The ready mode is the standard mode here (see the header).
    Rsend = Send
    Irsend = Isend

    def Bsend(self, buf: Any, dest: int, tag: int = 0) -> None:
        """Buffered send (bsend.py): complete at once; the message draws on the attached buffer."""
        self._bsend(buf, dest, tag, "Bsend")

    def Ibsend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        self._bsend(buf, dest, tag, "Ibsend")
        return Request(None, True)     # complete: the data is out of the caller's buffer

    def _bsend(self, buf: Any, dest: int, tag: int, what: str) -> Any:
        dest, tag = self._peer(dest, "destination"), self._tag(tag)
        if dest == PROC_NULL:
            return Request(None, True)
        b = _parse(buf, "send buffer", False)
        taken = bsend.reserve(b.nbytes, what)
        try:
            req = Request(self._c.Isend(b.copy(), dest, tag))
        except errors.ProxyError as exc:
            raise convert(exc) from None
        bsend.track(req, taken)
        return req

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = ANY_SOURCE, recvtag: int = ANY_TAG, status: Status | None = None) -> None:
        """Receive and send at once (posted together, the receive first), so that ranks exchanging
        with each other do not wait for one another's receive."""
        dest, sendtag = self._peer(dest, "destination"), self._tag(sendtag)
        source, recvtag = self._peer(source, "source", True), self._tag(recvtag, True)
        sb = None if dest == PROC_NULL else _parse(sendbuf, "Sendrecv sendbuf", False)
        rb = None
        if source != PROC_NULL:
            if recvbuf is None:
                raise error(ERR_BUFFER, "Sendrecv: recvbuf is None but the source is not PROC_NULL")
            rb = _parse(recvbuf, "Sendrecv recvbuf", True)
        self._sendrecv(sb, dest, sendtag, rb, source, recvtag, status)

    def Sendrecv_replace(self, buf: Any, dest: int, sendtag: int = 0, source: int = ANY_SOURCE,
                         recvtag: int = ANY_TAG, status: Status | None = None) -> None:
        """Send ``buf`` and receive into it: the outgoing data is copied first, since the receive may
        land (in registered memory, without staging) while the send still reads."""
        dest, sendtag = self._peer(dest, "destination"), self._tag(sendtag)
        source, recvtag = self._peer(source, "source", True), self._tag(recvtag, True)
        b = _parse(buf, "Sendrecv_replace buffer", True)
        sb = None if dest == PROC_NULL else b.copy()
        self._sendrecv(sb, dest, sendtag, None if source == PROC_NULL else b, source, recvtag, status)

    def Isendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                  source: int = ANY_SOURCE, recvtag: int = ANY_TAG) -> Request:
        """Nonblocking Sendrecv: one request, complete when both halves are; its status is the
        receive's."""
        dest, sendtag = self._peer(dest, "destination"), self._tag(sendtag)
        source, recvtag = self._peer(source, "source", True), self._tag(recvtag, True)
        sb = None if dest == PROC_NULL else _parse(sendbuf, "Isendrecv sendbuf", False)
        rb = None
        if source != PROC_NULL:
            if recvbuf is None:
                raise error(ERR_BUFFER, "Isendrecv: recvbuf is None but the source is not PROC_NULL")
            rb = _parse(recvbuf, "Isendrecv recvbuf", True)
        return self._iexchange(sb, dest, sendtag, rb, source, recvtag)

    def Isendrecv_replace(self, buf: Any, dest: int, sendtag: int = 0, source: int = ANY_SOURCE,
                          recvtag: int = ANY_TAG) -> Request:
        """Nonblocking Sendrecv_replace: the outgoing data is copied at the call, as the blocking one."""
        dest, sendtag = self._peer(dest, "destination"), self._tag(sendtag)
        source, recvtag = self._peer(source, "source", True), self._tag(recvtag, True)
        b = _parse(buf, "Isendrecv_replace buffer", True)
        sb = None if dest == PROC_NULL else b.copy()
        return self._iexchange(sb, dest, sendtag, None if source == PROC_NULL else b, source, recvtag)

    def _iexchange(self, sb: Any, dest: int, sendtag: int, rb: Any, source: int, recvtag: int) -> Request:
        if sb is None and rb is None:
            return Request(proc_null=True)
        c = self._c
        rreq = sreq = None
        try:
            with c.group():
                if rb is not None:
                    rreq = c.Irecv(rb, source, recvtag)
                if sb is not None:
                    sreq = c.Isend(sb, dest, sendtag)
        except errors.ProxyError as exc:
            raise convert(exc) from None
        return Request(Both(rreq, sreq))

    def _sendrecv(self, sb: Any, dest: int, sendtag: int, rb: Any, source: int, recvtag: int,
                  status: Status | None) -> None:
        c = self._c
        rreq = sreq = None
        try:
            with c.group():
                if rb is not None:
                    rreq = c.Irecv(rb, source, recvtag)
                if sb is not None:
                    sreq = c.Isend(sb, dest, sendtag)
            st = rreq.Wait() if rreq is not None else None
            if sreq is not None:
                sreq.Wait()
        except errors.ProxyError as exc:
            raise convert(exc) from None
        if status is not None:
            status._fill_null() if rreq is None else status._fill(st)

    def Send_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:
        dest, tag = self._peer(dest, "destination"), self._tag(tag)
        if dest == PROC_NULL:
            return Prequest(None, (), True)
        return Prequest(self._c.Isend, (_parse(buf, "send buffer", False), dest, tag), False)

    def Recv_init(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Prequest:
        source, tag = self._peer(source, "source", True), self._tag(tag, True)
        if source == PROC_NULL:
            return Prequest(None, (), True)
        return Prequest(self._c.Irecv, (_parse(buf, "receive buffer", True), source, tag), False)

    def Ssend_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:
        dest, tag = self._peer(dest, "destination"), self._tag(tag)
        if dest == PROC_NULL:
            return Prequest(None, (), True)
        return Prequest(self._c.Issend, (_parse(buf, "send buffer", False), dest, tag), False)

    Rsend_init = Send_init

    def Bsend_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:
        """Persistent buffered send: each Start is a Bsend of the buffer's contents then."""
        dest, tag = self._peer(dest, "destination"), self._tag(tag)
        if dest == PROC_NULL:
            return Prequest(None, (), True)
        _parse(buf, "send buffer", False)     # checked now, as MPI checks at init
        return Prequest(self._bsend_started, (buf, dest, tag), False)

    def _bsend_started(self, buf: Any, dest: int, tag: int) -> Any:
        self._bsend(buf, dest, tag, "Bsend_init")
        return Done()

    # ------------------------------------------------------------------ probes
    def _probe_call(self, fn: Any, source: Any, tag: Any) -> Any:
        try:
            return fn(source, tag)
        except errors.ProxyError as exc:
            raise convert(exc) from None

    def _probed(self, probe: Callable[[int, int], Any], source: int, tag: int, status: Status | None) -> bool:
        """A probe's common part: the arguments checked, PROC_NULL answered at once, ``status`` filled
        from the status ``probe(source, tag)`` found; whether it found one (None: nothing yet)."""
        source, tag = self._peer(source, "source", True), self._tag(tag, True)
        if source == PROC_NULL:
            if status is not None:
                status._fill_null()
            return True
        st = probe(source, tag)
        if st is not None and status is not None:
            status._fill(st)
        return st is not None

    def _mprobed(self, probe: Callable[[int, int], Any], source: int, tag: int,
                 status: Status | None) -> Message | None:
        """A matched probe's common part, as ``_probed``: the Message of what ``probe`` took out of
        matching, or None when it took nothing."""
        source, tag = self._peer(source, "source", True), self._tag(tag, True)
        if source == PROC_NULL:
            if status is not None:
                status._fill_null()
            return Message(MESSAGE_NO_PROC)   # a copy: receiving it makes it MESSAGE_NULL, not the constant
        m = probe(source, tag)
        if m is None:
            return None
        if status is not None:
            status._fill(m.status)
        return Message._of(m)

    def Probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None) -> bool:
        """Wait for a message a receive (source, tag) would match; ``status`` says what it is."""
        return self._probed(lambda s, t: self._probe_call(self._c.Probe, s, t), source, tag, status)

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None) -> bool:
        """Whether a message a receive (source, tag) would match is there now."""
        return self._probed(lambda s, t: self._probe_call(self._c.Iprobe, s, t), source, tag, status)

    def Mprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None) -> Message:
        """Wait for a message (source, tag) and take it out of matching: only the Message's Recv gets it."""
        m = self._mprobed(lambda s, t: self._probe_call(self._c.Mprobe, s, t), source, tag, status)
        assert m is not None   # a blocking probe returns a message
        return m

    def Improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
                status: Status | None = None) -> Message | None:
        """Mprobe that answers at once: a Message, or None when nothing matches now."""
        return self._mprobed(lambda s, t: self._probe_call(self._c.Improbe, s, t), source, tag, status)

    # ------------------------------------------------------------------ objects (lower case), point-to-point
    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        dest, tag = self._peer(dest, "destination"), self._tag(tag)
        if dest == PROC_NULL:
            return
        try:
            objects.send(self._c, obj, dest, tag)
        except errors.ProxyError as exc:
            raise convert(exc) from None

    def recv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG,
             status: Status | None = None) -> Any:
        _ignored_buf(buf, "recv")
        source, tag = self._peer(source, "source", True), self._tag(tag, True)
        if source == PROC_NULL:
            if status is not None:
                status._fill_null()
            return None
        try:
            obj, st = objects.recv_status(self._c, source, tag)
        except errors.ProxyError as exc:
            raise convert(exc) from None
        if status is not None:
            status._fill(st)
        return obj

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        dest, tag = self._peer(dest, "destination"), self._tag(tag)
        if dest == PROC_NULL:
            return Request(None, True)
        return ObjRequest(self._obj(objp2p.isend, obj, dest, tag))

    def irecv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Nonblocking object receive (``buf`` is ignored, with a warning: the object's size is its own)."""
        _ignored_buf(buf, "irecv")
        source, tag = self._peer(source, "source", True), self._tag(tag, True)
        if source == PROC_NULL:
            return Request(None, True)
        return ObjRequest(self._obj(objp2p.irecv, source, tag))

    def bsend(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Buffered object send: complete at once, drawing its pickled size on the attached buffer."""
        self._obj_bsend(obj, dest, tag, "bsend")

    def ibsend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        self._obj_bsend(obj, dest, tag, "ibsend")
        return Request(None, True)

    def _obj_bsend(self, obj: Any, dest: int, tag: int, what: str) -> None:
        dest, tag = self._peer(dest, "destination"), self._tag(tag)
        if dest == PROC_NULL:
            return
        taken = bsend.reserve(bsend.object_size(obj), what)
        bsend.track(ObjRequest(self._obj(objp2p.isend, obj, dest, tag)), taken)

    def issend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        """Synchronous object send: every message of the object goes as a synchronous send, so the
        request completes once the receiver matched the object (to itself: at once, like send)."""
        dest, tag = self._peer(dest, "destination"), self._tag(tag)
        if dest == PROC_NULL:
            return Request(None, True)
        c = self._c
        if dest == c.rank:
            if self._obj(objp2p.deliver_to_posted, obj, tag):    # an irecv of this rank took it
                return ObjRequest(_SelfSync(c, tag, [True, False]))
            token = self._obj(objects.send_self_sync, obj, tag)
            return ObjRequest(_SelfSync(c, tag, token))
        try:
            out = objects._dumps(obj, f"issend to rank {dest} tag {tag}")
            with c.group():
                reqs = objects._post_send(_Synchronous(c), out, dest, tag, objects.OP_P2P, 0)
        except errors.ProxyError as exc:
            raise convert(exc) from None
        return ObjRequest(_SyncSends(c, reqs))

    def ssend(self, obj: Any, dest: int, tag: int = 0) -> None:
        self.issend(obj, dest, tag).wait()

    def sendrecv(self, sendobj: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = ANY_SOURCE, recvtag: int = ANY_TAG, status: Status | None = None) -> Any:
        dest, sendtag = self._peer(dest, "destination"), self._tag(sendtag)
        source, recvtag = self._peer(source, "source", True), self._tag(recvtag, True)
        req = self.isend(sendobj, dest, sendtag) if dest != PROC_NULL else None
        value = self.recv(None, source, recvtag, status)
        if req is not None:
            req.wait()
        return value

    def probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None) -> bool:
        return self._probed(lambda s, t: self._obj(objp2p.probe, s, t), source, tag, status)

    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None) -> bool:
        return self._probed(lambda s, t: self._obj(objp2p.iprobe, s, t), source, tag, status)

    def mprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None) -> Message:
        """The next object (source, tag), taken out of matching: its Message's recv() returns it."""
        return self._mprobe_obj(source, tag, status, True)  # type: ignore[return-value]

    def improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
                status: Status | None = None) -> Message | None:
        return self._mprobe_obj(source, tag, status, False)

    def _mprobe_obj(self, source: Any, tag: Any, status: Status | None, block: bool) -> Message | None:
        source, tag = self._peer(source, "source", True), self._tag(tag, True)
        if source == PROC_NULL:
            if status is not None:
                status._fill_null()
            return Message(MESSAGE_NO_PROC)   # a copy: receiving it makes it MESSAGE_NULL, not the constant
        if source in (ANY_SOURCE, self._c.rank):   # an object this rank sent itself: taken now
            own = self._obj(objects._recv_self, source, tag, f"mprobe of rank {self._c.rank}'s own object")
            if own is not None:
                value, st = own
                if status is not None:
                    status._fill(st)
                return Message._of(obj=Held(value, st), comm=self._c)
        inc = self._obj(objects._start_recv, *objects._wild_peer(self._c, source, tag), block)
        if inc is None:
            return None
        if status is not None:
            status._fill(None)
            status.source, status.tag = inc.source, inc.tag
        return Message._of(obj=inc, comm=self._c)


class _SelfSync:
    """An issend of a rank to itself, in objp2p.ObjRequest's form: complete once a receive of this
    rank took the object (objects.send_self_sync)."""

    __slots__ = ("_comm", "_tag", "_token", "status")
    status: _Cancelled | None     # what a cancel leaves (MPI's status of a cancelled send)

    def __init__(self, comm: Any, tag: int, token: list):
        self._comm, self._tag, self._token, self.status = comm, tag, token, None

    def test(self) -> tuple[bool, None]:
        return bool(self._token[0] or self._token[1]), None

    def wait(self) -> None:
        if not self.test()[0]:
            raise errors.InvalidUsage(f"rank {self._comm.rank}: waiting for an issend to itself (tag "
                                      f"{self._tag}) that no receive took: it could never complete")

    def cancel(self) -> None:
        if objects.cancel_self_sync(self._comm, self._tag, self._token):
            self.status = _Cancelled()


class _Cancelled:
    source, tag, nbytes, cancelled = ANY_SOURCE, ANY_TAG, 0, True


class _Synchronous:
    """The native communicator as objects._post_send sees it, with Isend made Issend."""

    __slots__ = ("Isend",)

    def __init__(self, comm: Any):
        self.Isend = comm.Issend


class _SyncSends:
    """An object issend's native requests, under the interface of objp2p.ObjRequest: every one is
    waited for (none is left to complete on its own, as buffered sends are)."""

    __slots__ = ("_comm", "_reqs", "status")

    def __init__(self, comm: Any, reqs: list):
        self._comm, self._reqs, self.status = comm, reqs, None

    def wait(self) -> None:
        for r in self._reqs:
            r.Wait()

    def test(self) -> tuple[bool, None]:
        if all(r.Test() for r in self._reqs):
            self.wait()
            return True, None
        return False, None
