"""The wire of the TCP transport: frames, the handshake, and a link of sockets to one peer node.

Everything here runs on helper threads of the progress process; none of it touches the engine. A
``Link`` hands what it reads to the transport (shmproxy.transports.net_socket) through callbacks,
which the transport turns into loop events (``ctx.post_event``): the loop owns every decision.

Handshake
---------
A connection starts with a fixed HELLO: magic, the job's 16-byte secret, the communicator id, the
connecting node, the socket's index and the link's socket count. The accepting side reads it with a
deadline and compares the secret in constant time; anything else (a port scanner, another job, a
truncated or oversized hello) is logged and dropped, and the job goes on. Only node i < j connects
to node j, so each pair has exactly one link, made of ``nsocks`` sockets.

Frames
------
A 32-byte little-endian header ``(type u16, flags u16, length u32, a i64, b i64, c i64)`` followed by
``length`` payload bytes. Every length is checked against the largest frame its type may have
before a byte of the payload is read, and every offset against the landing it names (the transport's
business): a peer that breaks the protocol loses its link, which fails the communicator.

Ordering: control frames (envelopes, clear-to-send, closes, aborts) all go through socket 0, in the
order the loop queued them, which keeps MPI's non-overtaking across nodes. Bulk frames carry where
they land: a message's data chunks go round-robin over every socket (its bandwidth is that of
several streams). A collective's chunks take sockets of their own, numbered after these and driven
by C threads that never take the GIL (shm/_wire.c, the link's ``wire``: each chunk split over all of
them); without a wire (NET_COLL_SOCKETS=0) they take the last of the sockets here, since every
Python thread busy queues for the GIL with the loop's per-chunk work (docs/decisions.md, "A
collective's chunks between nodes: C threads, split over sockets, folded as they land").

Hand-offs. Sending: a control frame on an idle socket is written by the thread that makes it (the
loop, or a reader answering DONE), without blocking; only what does not fit, or what finds frames
queued ahead of it, goes to the socket's writer thread, so frames keep their order. Receiving: each
socket's reader (``Inbox``) takes whatever has arrived with one ``recv`` into its buffer and parses
every whole frame in it; the news of one such batch reaches the loop as one event (one wake), in
arrival order, and it is posted before the reader blocks again, so no news waits on later bytes.
Payloads too large for the buffer are read straight into their landing, and bulk frames written,
by one C loop of syscalls with the GIL released once (shm/_native_net.c): a Python ``recv_into`` or
``sendmsg`` per partial transfer would queue for the GIL behind the loop after each.

Closing: the side that is done sends BYE on every socket (behind what is queued there) and shuts
down its write halves, then reads until the peer's EOF (bounded). A peer that reads BYE on a socket
lets that socket's writer finish and shuts down its half in turn. An EOF or reset on a socket that
brought no BYE is a lost link. Unread data at close would turn a FIN into a reset and lose the BYE;
the drain is what prevents it.
"""
from __future__ import annotations

import ctypes
import hmac
import os
import collections
import socket
import struct
import threading
from typing import Any, Callable

from shmproxy.core import log
from shmproxy.shm import _native

_log = log.get("NET")

MAGIC = b"SHMPXN01"
HELLO = struct.Struct("<8s16sIIII")    # magic, secret, comm id, from node, socket index, nsocks
HEADER = struct.Struct("<HHIqqq")      # type, flags, payload length, a, b, c
HELLO_TIMEOUT_S = 10.0
CLOSE_DRAIN_S = 2.0

# Frame types
RTS, CTS, DATA, COLL, CLOSED, ABORT, BYE, NOTE, DONE = range(1, 10)
TYPE_NAMES = {RTS: "RTS", CTS: "CTS", DATA: "DATA", COLL: "COLL", CLOSED: "CLOSED", ABORT: "ABORT",
              BYE: "BYE", NOTE: "NOTE", DONE: "DONE"}
F_EAGER = 1          # RTS: the message's bytes follow the envelope
ENVELOPE = struct.Struct("<iiiI")      # RTS payload head: source rank, destination rank, dtype, memory word
MAX_CONTROL = 8192   # the largest control payload (an ABORT's message, an RTS without eager bytes)


class ProtocolError(Exception):
    """A peer sent something the protocol does not allow (its link is dropped)."""


def address_view(addr: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``addr`` (registered memory this process mapped), for
    ``recv_into``/``sendmsg`` straight from and into it: no staging copy."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def tune(sock: socket.socket, keepalive_s: float) -> None:
    """TCP_NODELAY (small frames leave at once), keepalive and a user timeout, so that a cut link is
    an error after about three keepalive intervals instead of never."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(keepalive_s))
    intvl = max(1, idle // 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, intvl)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, (idle + 3 * intvl) * 1000)


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False on a clean EOF before the first byte, ProtocolError on an EOF
    inside it."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return False
            raise ProtocolError(f"connection closed inside a frame ({got} of {n} bytes)")
        got += k
    return True


def _advance(views: list, n: int) -> None:
    """Drop the first ``n`` bytes that a sendmsg took off the front of ``views``."""
    while n:
        if n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def send_all(sock: socket.socket, parts: list) -> None:
    """sendmsg every part (bytes or memoryviews), resuming after partial writes."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        _advance(views, sock.sendmsg(views))


def send_some(sock: socket.socket, parts: list) -> list:
    """sendmsg without blocking; returns what is left of ``parts`` (empty when all went out)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        try:
            _advance(views, sock.sendmsg(views, [], socket.MSG_DONTWAIT))
        except BlockingIOError:
            return views
    return views


INBOX_BYTES = 1 << 17   # a reader's buffer: many small frames, or a whole eager message, per recv
# A payload remainder at least this large is read straight into its destination; a bulk frame at most
# this large is written by its caller at once when its socket is idle.
DIRECT_BYTES = 1 << 14


class Inbox:
    """The read side of one socket, used by its reader thread only: a buffer that each ``recv`` fills
    with whatever has arrived, read frame by frame. News for the loop (``later``) gathers in
    ``events`` and is posted as one loop event (``flush``) before the reader blocks in ``recv`` again,
    or when it stops."""

    def __init__(self, sock: socket.socket, post: Callable[[Callable[[], None]], None]):
        self.sock, self.post = sock, post
        self.buf = bytearray(INBOX_BYTES)
        self.mv = memoryview(self.buf)
        self.lo = self.hi = 0   # buffered bytes not read yet: buf[lo:hi]
        self.events: list[Callable[[], None]] = []

    def later(self, fn: Callable[[], None]) -> None:
        self.events.append(fn)

    def flush(self) -> None:
        if not self.events:
            return
        fns, self.events = self.events, []
        self.post(fns[0] if len(fns) == 1 else _batch(fns, self.post))

    def _recv(self, view: memoryview) -> int:
        self.flush()   # the reader may block now: what it learnt goes to the loop first
        return self.sock.recv_into(view)

    def read_into(self, view: memoryview) -> bool:
        """Fill ``view``; False on a clean EOF before its first byte, ProtocolError on an EOF inside it."""
        n = len(view)
        got = min(n, self.hi - self.lo)
        if got:
            view[:got] = self.mv[self.lo:self.lo + got]
            self.lo += got
        while got < n:
            if n - got >= DIRECT_BYTES:
                # the rest of a large payload: one C loop, the GIL released once (shm/_native_net.c)
                self.flush()
                rest = view[got:]
                k = _native.sock_recv_into(self.sock.fileno(), _native.buffer_info(rest, True)[0], n - got)
                if k < n - got:
                    if got + k == 0:
                        return False
                    raise ProtocolError(f"connection closed inside a frame ({got + k} of {n} bytes)")
                return True
            else:
                if self.lo == self.hi:
                    self.lo = self.hi = 0
                k = self._recv(self.mv[self.hi:])
                self.hi += k
                take = min(k, n - got)
                view[got:got + take] = self.mv[self.lo:self.lo + take]
                self.lo += take
                k = take
            if k == 0:
                if got == 0:
                    return False
                raise ProtocolError(f"connection closed inside a frame ({got} of {n} bytes)")
            got += k
        return True

    def payload(self, n: int) -> bytes:
        """The next ``n`` bytes, which the frame's header promised."""
        if self.hi - self.lo >= n:
            data = bytes(self.mv[self.lo:self.lo + n])
            self.lo += n
            return data
        buf = bytearray(n)
        if n and not self.read_into(memoryview(buf)):
            raise ProtocolError("connection closed inside a frame")
        return bytes(buf)


def _batch(fns: list, post: Callable[[Callable[[], None]], None]) -> Callable[[], None]:
    """One loop event running ``fns`` in order; if one raises, the rest are posted again, as they
    would have stayed queued had each been an event of its own."""
    def run() -> None:
        todo = collections.deque(fns)
        try:
            while todo:
                todo.popleft()()
        finally:
            if todo:
                post(_batch(list(todo), post))
    return run


def make_hello(secret: bytes, comm_id: int, node: int, index: int, nsocks: int) -> bytes:
    return HELLO.pack(MAGIC, secret, comm_id & 0xFFFFFFFF, node, index, nsocks)


def check_hello(data: bytes, secret: bytes, comm_id: int, nnodes: int, me: int) -> tuple[int, int, int]:
    """(from node, socket index, nsocks) of a valid HELLO; ProtocolError naming what is wrong."""
    if len(data) != HELLO.size:
        raise ProtocolError(f"hello of {len(data)} bytes")
    magic, sec, cid, node, index, nsocks = HELLO.unpack(data)
    if magic != MAGIC:
        raise ProtocolError("bad magic")
    if not hmac.compare_digest(sec, secret):
        raise ProtocolError("wrong job secret")
    if cid != comm_id & 0xFFFFFFFF:
        raise ProtocolError(f"communicator {cid}, not {comm_id}")
    if not 0 <= node < me:   # only lower nodes connect to us
        raise ProtocolError(f"node {node} may not connect to node {me} of {nnodes}")
    if not 0 < nsocks <= 256 or not 0 <= index < nsocks:
        raise ProtocolError(f"socket {index} of {nsocks}")
    return node, index, nsocks


class _Writer:
    """One socket's outgoing queue and the thread that drains it. Items: (parts, on_sent or None).

    A small frame put on an idle socket (nothing queued, nobody sending) is written at once by the
    caller, without blocking (MSG_DONTWAIT): a control frame then costs no thread hand-off. Whatever
    does not fit goes to the head of the queue, for the thread. ``busy`` (under ``cv``) says someone is
    writing, so that two writers never interleave their bytes and frames keep their order."""

    def __init__(self, link: "Link", index: int):
        self.link, self.index = link, index
        self.queue: collections.deque = collections.deque()
        self.cv = threading.Condition()
        self.sock: socket.socket | None = None
        self.closing = False
        self.busy = False
        self.thread: threading.Thread | None = None

    def put(self, parts: list, on_sent: Callable[[], None] | None = None, direct: bool = False) -> None:
        with self.cv:
            idle = self.sock is not None and not self.queue and not self.busy and not self.closing
            if not (direct and idle):
                self.queue.append((parts, on_sent))
                self.cv.notify()
                return
            self.busy = True
        left: list = []
        try:
            left = send_some(self.sock, parts)   # type: ignore[arg-type]
        except OSError as exc:
            self.link.broken(f"send on socket {self.index} failed: {exc}")
        with self.cv:
            self.busy = False
            if left:
                self.queue.appendleft((left, on_sent))
            if self.queue:
                self.cv.notify()
        if not left:
            self.link.bytes_out += sum(len(p) for p in parts)
            if on_sent is not None:
                on_sent()

    def start(self, sock: socket.socket) -> None:
        with self.cv:
            self.sock = sock
        self.thread = threading.Thread(target=self.run, name=f"shmproxy-net-w{self.link.peer}.{self.index}",
                                       daemon=True)
        self.thread.start()

    def run(self) -> None:
        link = self.link
        while True:
            with self.cv:
                while ((not self.queue or self.busy)
                       and not (self.closing and not self.busy and not self.queue)):
                    self.cv.wait()
                if not self.queue:
                    return
                parts, on_sent = self.queue.popleft()
                self.busy = True
            try:
                # the whole frame in one C loop, the GIL released once (shm/_native_net.c)
                _native.sock_send_parts(self.sock.fileno(), parts)   # type: ignore[union-attr]
            except OSError as exc:
                link.broken(f"send on socket {self.index} failed: {exc}")
                return
            finally:
                with self.cv:
                    self.busy = False
            n = sum(len(p) for p in parts)
            link.bytes_out += n
            if on_sent is not None:
                on_sent()

    def stop(self) -> None:
        with self.cv:
            self.closing = True
            self.cv.notify()


class Link:
    """The sockets between this progress process and one peer node's, with a writer and a reader
    thread per socket. ``on_frame(link, index, header, inbox)`` is called on a reader thread for every
    frame; it must consume exactly the frame's payload from the ``Inbox`` and hands its news for the
    loop to ``inbox.later``, which ``post`` delivers in batches. ``on_lost(link, reason)`` once, when
    the link broke without a BYE (after the news read before it).

    ``wire``, when given (a ``shm._wire.Wire`` of ``wire.nsocks`` sockets), carries the collectives'
    frames on sockets of its own, numbered after the ``nsocks`` above and driven by C threads
    (shm/_wire.c); the link only hands it those sockets and closes it."""

    def __init__(self, peer: int, nsocks: int, on_frame: Callable[..., None],
                 on_lost: Callable[["Link", str], None], keepalive_s: float,
                 post: Callable[[Callable[[], None]], None], direct_write: int = DIRECT_BYTES,
                 wire: Any = None, wire_socks: int = 0):
        self.peer, self.nsocks = peer, nsocks
        self.wire, self.wire_socks = wire, wire_socks
        self.total = nsocks + wire_socks   # sockets a HELLO counts
        self.direct_write = direct_write   # bulk frames up to this size are written by their caller when idle
        self.on_frame, self.on_lost, self.keepalive_s, self.post = on_frame, on_lost, keepalive_s, post
        self.writers = [_Writer(self, i) for i in range(nsocks)]
        self.socks: list[socket.socket | None] = [None] * nsocks
        self.readers: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.next_bulk = 0
        self.bytes_out = self.bytes_in = 0
        self.got_bye = self.sent_bye = False
        self.byes = [False] * nsocks   # BYE read on each socket
        self.lost: str | None = None
        self.closing = False
        self.nattached = 0
        self.ready = threading.Event()

    def attach(self, index: int, sock: socket.socket) -> None:
        """Socket ``index`` of this link is connected and past the handshake: start its threads (the
        wire's, from ``nsocks`` on)."""
        tune(sock, self.keepalive_s)
        sock.settimeout(None)
        if index >= self.nsocks:
            fd = sock.detach()   # the wire owns the descriptor from here (it closes it on OSError too)
            try:
                self.wire.attach(index - self.nsocks, fd)
            except ValueError as exc:   # refused before it took the descriptor
                os.close(fd)
                raise ProtocolError(f"socket {index} of the link to node {self.peer}: {exc}") from exc
            with self.lock:
                self.nattached += 1
                if self.nattached == self.total:
                    self.ready.set()
            return
        with self.lock:
            if self.socks[index] is not None:
                raise ProtocolError(f"socket {index} of the link to node {self.peer} connected twice")
            self.socks[index] = sock
            self.nattached += 1
            full = self.nattached == self.total
        self.writers[index].start(sock)
        t = threading.Thread(target=self._read, args=(index, sock), name=f"shmproxy-net-r{self.peer}.{index}",
                             daemon=True)
        self.readers.append(t)
        t.start()
        if full:
            self.ready.set()

    # ---------------------------------------------------------------- sending (any thread)
    def control(self, ftype: int, a: int = 0, b: int = 0, c: int = 0, payload: bytes | memoryview = b"",
                flags: int = 0, on_sent: Callable[[], None] | None = None) -> None:
        """Queue a control frame on socket 0 (ordered with every other control frame); written at once
        when the socket is idle."""
        self.writers[0].put([HEADER.pack(ftype, flags, len(payload), a, b, c), payload], on_sent, direct=True)

    def bulk(self, ftype: int, a: int, b: int, parts: list, on_sent: Callable[[], None] | None,
             spread: bool = True) -> None:
        """Queue a bulk frame (``parts`` after the header) on the next socket, round-robin, or, not
        ``spread``, on the link's last socket. ``on_sent`` runs on whichever thread wrote its last byte
        (this one, when it was written at once)."""
        n = sum(len(p) for p in parts)
        if not spread:
            i = self.nsocks - 1
        else:
            with self.lock:
                i = self.next_bulk
                self.next_bulk = (i + 1) % self.nsocks
        # one up to ``direct_write`` is written at once on an idle socket, as control frames are (what
        # does not fit goes to the writer); a larger one would hold the calling thread (the loop)
        # while the kernel copies it, so it is the writer's (NET_DIRECT_WRITE_BYTES)
        self.writers[i].put([HEADER.pack(ftype, 0, n, a, b, 0), *parts], on_sent,
                            direct=n <= self.direct_write)

    # ---------------------------------------------------------------- reading (its threads)
    def _read(self, index: int, sock: socket.socket) -> None:
        inbox = Inbox(sock, self.post)
        hdr = bytearray(HEADER.size)
        view = memoryview(hdr)
        try:
            while True:
                if not inbox.read_into(view):
                    if self.byes[index] or self.closing:
                        return
                    self.broken(f"socket {index}: connection closed by node {self.peer} without a goodbye")
                    return
                fields = HEADER.unpack(hdr)
                if fields[0] == BYE:
                    inbox.flush()
                    self.byes[index] = self.got_bye = True
                    self._half_close(index, sock)
                    continue
                self.bytes_in += HEADER.size + fields[2]
                self.on_frame(self, index, fields, inbox)
        except ProtocolError as exc:
            inbox.flush()   # the frames before the bad one were good: their news comes before the loss
            self.broken(f"socket {index}: protocol error from node {self.peer}: {exc}")
        except OSError as exc:
            inbox.flush()
            if not (self.got_bye or self.closing):
                self.broken(f"socket {index}: {exc}")

    def broken(self, reason: str) -> None:
        with self.lock:
            if self.lost is not None or self.got_bye or self.closing:
                return
            self.lost = reason
        _log.warning("link to node %d lost: %s", self.peer, reason)
        self.on_lost(self, reason)

    # ---------------------------------------------------------------- closing
    def _half_close(self, index: int, sock: socket.socket) -> None:
        """After the peer's BYE on socket ``index``: its writer finishes what is queued, then our half
        of it shuts down, so that the peer's drain sees EOF and can close."""
        w = self.writers[index]
        w.stop()
        if w.thread is not None:
            w.thread.join(CLOSE_DRAIN_S)
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            _log.info("link to node %d, socket %d: shutdown after goodbye: %s", self.peer, index, exc)

    def close(self, bounded_s: float = CLOSE_DRAIN_S) -> None:
        """Send BYE, let the writers drain, shut our half down, read until the peer's EOF (bounded),
        then close every socket. Safe in any state."""
        self.closing = True
        if not self.sent_bye and self.lost is None:
            self.sent_bye = True
            for w in self.writers:
                if w.sock is not None:
                    w.put([HEADER.pack(BYE, 0, 0, 0, 0, 0)])
        for w in self.writers:
            w.stop()
        for w in self.writers:
            if w.thread is not None:
                w.thread.join(bounded_s)
        for s in self.socks:
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_WR)
                except OSError:
                    continue
        if self.wire is not None:   # its writers and readers drain beside ours, within the same bound
            self.wire.close(bounded_s)
        for t in self.readers:
            t.join(bounded_s)
        for s in self.socks:
            if s is not None:
                s.close()

    def describe(self) -> dict:
        d = {"node": self.peer, "sockets": sum(s is not None for s in self.socks), "of": self.nsocks,
             "bytes_out": self.bytes_out, "bytes_in": self.bytes_in,
             "queued": sum(len(w.queue) for w in self.writers),
             "state": "lost" if self.lost else ("closed" if self.got_bye or self.closing
                                                else ("up" if self.ready.is_set() else "connecting"))}
        if self.wire is not None:
            d["collectives"] = self.wire.describe()
        return d


def connect(addr: tuple, family: int, deadline_s: float) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(deadline_s)
    try:
        sock.connect(addr)
    except OSError:
        sock.close()
        raise
    return sock
