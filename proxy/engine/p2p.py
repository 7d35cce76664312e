"""Point-to-point in the progress process (a component of ProgressEngine: ``engine.p2p``): the two
halves of a message.

A message has a *send half* and a *receive half*, so that the two can live in different progress
processes once ranks span nodes:

- the send half takes a fetched send op and delivers its *envelope* (source, tag, communicator,
  size, dtype: the op itself within a node) to the receive half of the destination's node. For a
  local destination that is a call; a remote one goes through the connector of the pair (the
  envelope is the rendezvous's request-to-send, RTS).
- the receive half keeps, per destination rank, the posted receives and the unexpected messages
  (engine/matching.py: MPI's matching order, with ANY_SOURCE and ANY_TAG). A receive that finds its
  envelope, or an envelope that finds its receive, is a match. The receive half then decides what
  only it can (truncation against the receive buffer, dtype agreement), which status each side gets
  back, and hands the pair to the connector of (sender, receiver, memory kind): the match is the
  clear-to-send (CTS), and the transport moves the bytes, eagerly or in chunks (its own policy).

Within a node the shm transport copies source to destination once, so RTS and CTS cost no message:
the envelope and the match are calls. Across nodes the same steps become messages between progress
processes (RTS with the envelope, CTS with the receive buffer, a completion with the status).

**Standard mode, buffered** (MPI's "a send may complete before its receive is posted"). A send to a
rank of this node that finds no posted receive, of at most SEND_BUFFER_BYTES, in host memory and not
synchronous (FLAG_SYNC: Ssend/Issend), is copied at arrival into memory of this process (a
``Buffered``, registered in ``buffers`` under the owner BUFFERED_OWNER) and its request completes at
once: two ranks that both Send and then Recv do not wait for each other. Not quite at arrival: the
copy waits until the batch of ops the send came with is matched, and then a grace of about the copy's
own time (SEND_BUFFER_GRACE_US_PER_KIB; ``buffer_later``, due in ``buffer_due``). In an exchange the
receive is often a microsecond behind the send; taken within the grace, the message costs one copy,
not two. The Buffered takes the send's place in its unexpected queue (Matcher.replace_unexpected), so
matching order and non-overtaking are those of the unbuffered send; the later match hands it to the
transport like any send (its bytes are found through ``buffers``), and only the receive completes.
Flow control: at most SEND_BUFFER_PER_PEER bytes may wait buffered for one destination; beyond it a
send stays unbuffered and waits for its receive, as a large one does. Across nodes the same bound
applies on the sender's node: a send above the socket transport's own eager size (NET_EAGER_BYTES,
which completes at once anyway) is copied before its envelope leaves (``remote_send``, below) and
completes then; its Buffered is what the transport later moves, and is freed by the transport's verdict.

**Probes.** A probe (KIND_PROBE) asks what a receive (source, tag) would match now. Probe/Iprobe leave
the message in place: the answer is the first unexpected message it accepts, or, for a blocking probe,
the first that arrives unexpected later (``probes``: waiting probes per destination). Mprobe/Improbe
(FLAG_PROBE_MATCHED) take the message out of matching and hold it (``held``, keyed by the probe's
owner and request sequence); a blocking one waits in the matcher as a receive would, so MPI's order
holds. A receive with FLAG_MPROBED names that key in its tag and receives exactly the held message.

**Cancel.** A KIND_CANCEL record names one of its rank's requests (slot, sequence). A receive still
posted (or a probe still waiting, or a send still unexpected and unbuffered) is removed and completes
with STATUS_CANCELLED; one already matched is left to complete. The cancel's own request says which
(nbytes 1: cancelled). A closing rank cancels its pending sends this way, so that close abandons the
ones no receive took instead of waiting for them.

A rank that closes fails, on this loop's thread, the receives posted for it from that rank and the
messages waiting for it to receive them ("peer closed first"): nobody is left waiting for a rank
that is gone. Receives from ANY_SOURCE stay posted, as MPI has it. The closing rank's own receives,
which its close abandoned, are dropped, so that a later message to it fails instead of landing.

**Across nodes.** A send to a rank of another node leaves through ``remote_send``: its connector's
transport ships the envelope (``proxy_send_envelope``), and the send completes when that transport
says so (Nodes.complete_send). An envelope from another node enters through ``arrive_remote``: the
receive half matches it like a local one, and the match hands it to the connector of (sender,
receiver), which lands its bytes. A rank of another node that closed (``remote_closed``) fails the
receives posted here for it.

The component owns matching (the Matcher it is given, which the fast path and armed routes watch),
buffered sends, probes, held messages and derived datatypes. It takes the loop's state, the failure
and completion paths, the other nodes, the connections, the collectives (a collective's op arrives
here with the rest), the fast path and the transports' context; the armed routes, which put ops
back in through ``append``, are bound after both exist (``bind``).
"""
from __future__ import annotations

import collections

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from shmproxy.core import errors, log
from shmproxy.core.memory import mem_kind
from shmproxy.core.ops import (FLAG_MPROBED, FLAG_PROBE_BLOCK, FLAG_PROBE_MATCHED, FLAG_SYNC, FLAG_TYPED,
                               KIND_CANCEL,
                               KIND_COLL, KIND_PROBE, KIND_RECV, KIND_SEND, STATUS_CANCELLED,
                               STATUS_NO_MESSAGE, Op)
from shmproxy.shm import typed
from shmproxy.engine.args import Transfer
from shmproxy.engine.matching import ANY_SOURCE, ANY_TAG, Matcher, _accepts
from shmproxy.shm import _native
from shmproxy.shm import pool as P
from shmproxy.engine.ranks import RankInfo
from shmproxy.transports.base import MemKind

if TYPE_CHECKING:
    from shmproxy.coll.runner import CollRunner
    from shmproxy.engine.armed import ArmedRoutes
    from shmproxy.engine.completion import Completion
    from shmproxy.engine.connections import Connections
    from shmproxy.engine.context import EngineContext
    from shmproxy.engine.failure import Failures
    from shmproxy.engine.fastpath import FastPath
    from shmproxy.engine.nodes import Nodes
    from shmproxy.engine.state import LoopState

_log = log.get("PROXY")
_KINDS = frozenset(int(k) for k in MemKind)


_N_BUFFERED_Q = P.CTRL_OFF // 8 + P.CTRL_N_BUFFERED
BUFFERED_OWNER = -2   # the owner of buffered sends' copies in ``buffers`` (no rank's local rank)


class Buffered:
    """A buffered send: its bytes copied into this process, its sender's request already complete. It
    stands in for the send's op in matching (the attributes of Op that matching, the receive half and
    transports read) and is its own registered buffer (``addr``, ``size``, ``close``) under
    (BUFFERED_OWNER, buf_id). Completing it (``reply``: a truncation, a closed receiver) only frees it."""

    __slots__ = ("kind", "rank", "peer", "tag", "nbytes", "count", "dtype", "mem", "flags", "opcount",
                 "t_post", "t_fetch", "owner", "buf_id", "offset", "req_slot", "req_seq", "addr", "size",
                 "data", "mm", "release", "tmap")

    def __init__(self, send: Op, buf_id: int, data: np.ndarray, release: Any):
        self.kind, self.rank, self.peer, self.tag = KIND_SEND, send.rank, send.peer, send.tag
        self.nbytes, self.count, self.dtype, self.mem, self.flags = send.nbytes, send.count, send.dtype, 0, 0
        self.opcount, self.t_post, self.t_fetch = send.opcount, send.t_post, send.t_fetch
        self.owner, self.buf_id, self.offset, self.req_slot, self.req_seq = BUFFERED_OWNER, buf_id, 0, -1, -1
        self.data: np.ndarray | None = data   # None once released (close, release_buffered)
        self.mm: np.ndarray | None = data     # what the socket transport views (a MemfdBuffer's mapping)
        self.addr = _native.buffer_info(data, True)[0] if self.nbytes else 0
        self.size = self.nbytes
        self.release = release
        self.tmap = None   # a typed send's bytes were packed into ``data``: contiguous from here

    @classmethod
    def from_cell(cls, src: int, dst: int, tag: int, dtype: int, nbytes: int, count: int, t_post: int,
                  buf_id: int, data: np.ndarray, release: Any) -> "Buffered":
        """A message the progress process drained from a fast-path cell (engine/fastpath.py): its sender
        returned when it wrote the cell, so it is a buffered send from the start."""
        b = cls.__new__(cls)
        b.kind, b.rank, b.peer, b.tag = KIND_SEND, src, dst, tag
        b.nbytes, b.count, b.dtype, b.mem, b.flags = nbytes, count, dtype, 0, 0
        b.opcount, b.t_post, b.t_fetch = 0, t_post, time.monotonic_ns()
        b.owner, b.buf_id, b.offset, b.req_slot, b.req_seq = BUFFERED_OWNER, buf_id, 0, -1, -1
        b.data = b.mm = data
        b.addr = _native.buffer_info(data, True)[0] if nbytes else 0
        b.size = nbytes
        b.release = release
        b.tmap = None
        return b

    def reply(self, code: int, nbytes: int, peer_dtype: int = 0) -> None:
        self.release(self)

    def close(self) -> None:
        self.data = self.mm = None

    def describe(self) -> str:
        return f"send rank {self.rank} peer {self.peer} tag {self.tag} {self.nbytes} B buffered"


class PointToPoint:
    """The engine's point-to-point (see the header)."""

    armed: "ArmedRoutes"   # bound once made (bind)

    def __init__(self, st: "LoopState", matcher: Matcher, failures: "Failures", completion: "Completion",
                 nodes: "Nodes", connections: "Connections", coll: "CollRunner", fastpath: "FastPath",
                 ctx: "EngineContext") -> None:
        self.st, self.failures, self.completion, self.nodes = st, failures, completion, nodes
        self.connections, self.coll, self.fastpath, self.ctx = connections, coll, fastpath, ctx
        self.conns = connections.conns
        params = st.params
        self.size, self.nlocal, self.fast, self.gone = st.size, st.nlocal, st.fast, st.gone
        self.matcher = matcher   # the receive half of point-to-point
        self.send_buffer = params.SEND_BUFFER_BYTES
        self.send_buffer_peer = params.SEND_BUFFER_PER_PEER
        self.net_eager = params.NET_EAGER_BYTES    # sends to other nodes up to this complete at once anyway
        self.buffered: dict[int, int] = {}         # destination rank -> bytes buffered for it
        self.buffered_ids = 0
        self.grace_ns_per_byte = params.SEND_BUFFER_GRACE_US_PER_KIB * 1e3 / 1024
        self.buffer_later: collections.deque = collections.deque()   # (due ns, send): to buffer then
        # while sends wait out their grace the loop looks for posts without sleeping
        self.hook = st.hooks.register("sends waiting out their buffering grace", self._buffer_due_now,
                                      no_sleep=True)
        self.probes: dict[int, list[Op]] = {}      # destination rank -> blocking Probes waiting
        self.held: dict[tuple[int, int], Any] = {}  # (owner, probe's sequence) -> what a matched probe took
        self.types: dict[tuple[int, int], typed.TypeMap] = {}   # (local rank, type id) -> derived datatype
        self.types_pending: dict[tuple[int, int], list[int]] = {}   # TYPE_REGISTER parts not yet complete

    def bind(self, armed: "ArmedRoutes") -> None:
        """The armed routes (engine/armed.py), made after this component: they take its ``append``."""
        self.armed = armed

    def append(self, op: Op) -> None:
        """A fetched op: a collective's arrival, or one half of a message."""
        if op.rank < 0:
            self.failures.fail(errors.InternalError.code, f"op from local rank {op.owner}, which never initialised")
            return
        kind = op.kind
        if op.flags & FLAG_TYPED and kind <= KIND_RECV:   # a derived datatype (shm/typed.py)
            why = typed.resolve(self.types, op)
            if why is not None:
                _log.warning("%s", why)
                self.completion.complete(op, errors.InvalidArgument.code, 0)
                return
        if kind == KIND_SEND:
            self.send_half(op)
        elif kind == KIND_RECV:
            self.recv_half_post(op)
        elif kind == KIND_COLL:
            self.coll.coll_arrive(op)
        elif kind == KIND_PROBE:
            self.probe_post(op)
        elif kind == KIND_CANCEL:
            self.cancel_post(op)
        else:
            self.completion.complete(op, errors.InternalError.code, 0)

    # ------------------------------------------------------------------ send half
    # Every message of every size passes through these few methods: they read attributes once and
    # call as little as they can (a Python call costs about as much as the rest of a small message).
    def send_half(self, send: Op) -> None:
        """A fetched send: its envelope goes to the receive half of its destination's node. For a local
        destination that receive half is this process's, inline here: the envelope arrives at the
        matcher, and meets a posted receive or waits as unexpected."""
        dst = send.peer
        if not 0 <= dst < self.size or send.tag == ANY_TAG:   # the rank checks both: a bug or a forgery
            self.completion.complete(send, errors.InvalidArgument.code, 0)
        elif self.nlocal == self.size or dst in self.st.local_of or self.nodes.is_local(dst):
            d = self.st.local_of.get(dst) if self.fast and send.pair_seq else None
            if d is not None and not self.fastpath.send_in(send, d):
                if dst in self.matcher.armed:   # a later send of the pair must not fire before it
                    self.armed.disarm_dest(dst)
                return   # held behind a fast-path cell the receiver is taking (engine/fastpath.py)
            if d is None and self.fast and send.pair_seq:
                self.fastpath.early[(send.owner, dst)] = send.pair_seq   # its receiver has not joined yet
            self.send_local(send, d)
        else:
            # The destination's receive half lives in another node's progress process: the envelope
            # travels over the pair's connector (remote_send).
            self.remote_send(send)

    def send_local(self, send: Op, d: int | None) -> None:
        """A send whose receive half is this process's: the envelope arrives at the matcher, and meets
        a posted receive or waits as unexpected (buffered where it may be). ``d``: the receiver's local
        rank when the fast path orders this pair."""
        dst, op = send.peer, send
        recv = self.matcher.arrive(dst, send.rank, send.tag, send)
        if recv is not None:
            self.match(send, recv)
        elif self.gone and dst in self.gone and dst != send.rank:
            self.matcher.take(dst, send)
            self.completion.complete(send, errors.InvalidUsage.code, 0)   # the receiver closed first
        else:
            if send.nbytes <= self.send_buffer and not (send.flags & FLAG_SYNC or send.mem):
                self.buffer_later.append((send.t_fetch + int(send.nbytes * self.grace_ns_per_byte), send))
                self.st.hooks.arm(self.hook)
            if self.probes:
                self.wake_probes(dst, send)
            if send.mem and self.armed.history:
                self.armed.arm(send, False)   # its receive may fire it from C (engine/armed.py)
        if d is not None:
            self.fastpath.sent(op, d)

    def deliver_buffered(self, b: Buffered) -> None:
        """A message buffered from its start (a fast-path cell) arrives at the matcher."""
        dst = b.peer
        recv = self.matcher.arrive(dst, b.rank, b.tag, b)
        if recv is not None:
            self.match(b, recv)
        elif self.gone and dst in self.gone and dst != b.rank:
            self.matcher.take(dst, b)
            self.release_buffered(b)   # the receiver closed first: nobody will take it
        elif self.probes:
            self.wake_probes(dst, b)

    # ------------------------------------------------------------------ receive half

    def recv_half_post(self, recv: Op) -> None:
        """A posted receive: match it with the earliest unexpected envelope it accepts, or keep it."""
        if self.fast and (self.fastpath.early or self.fastpath.cells_waiting(recv.owner)):
            self.fastpath.drain_to(recv.owner)   # cells to this rank come first (engine/fastpath.py)
        src = recv.peer
        if recv.flags & FLAG_MPROBED:
            held = self.held.pop((recv.owner, recv.tag), None)
            if held is None:
                self.completion.complete(recv, errors.InvalidArgument.code, 0)   # no such message handle
            else:
                self.match(held, recv)
            return
        if not 0 <= src < self.size and src != ANY_SOURCE:
            self.completion.complete(recv, errors.InvalidArgument.code, 0)
            return
        send = self.matcher.post(recv.rank, src, recv.tag, recv)
        if send is not None:
            self.match(send, recv)
        elif self.gone and src in self.gone and src != recv.rank:
            self.matcher.cancel(recv.rank, recv)
            self.completion.complete(recv, errors.InvalidUsage.code, 0)   # the sender closed first
        elif recv.mem and self.armed.history:
            self.armed.arm(recv, True)   # its send may fire it from C (engine/armed.py)

    def close_half(self, info: RankInfo) -> None:
        """Loop thread, once ``info``'s rank closed: fail what waits on it (see the module header), and
        from now on whatever arrives for it (``gone``: the closed ranks, as this thread learned them)."""
        gone = info.rank
        self.gone.add(gone)
        if self.fast:
            self.fastpath.drain_from(info.local_rank)   # its messages in cells were sent (engine/fastpath.py)

        def waits_on_gone(dst: int, src: int, tag: int, op: Op) -> bool:
            # receives (and blocking matched probes) from it, its own (abandoned by its close), and
            # messages to it
            return (src == gone or dst == gone) if op.kind != KIND_SEND else dst == gone

        for op in self.matcher.drop(waits_on_gone):
            if op.rank != gone or op.owner == BUFFERED_OWNER:
                self.completion.complete(op, errors.InvalidUsage.code, 0)
        for dst, waiting in list(self.probes.items()):
            keep = [p for p in waiting if dst != gone and p.peer != gone]
            for p in waiting:
                if p.peer == gone and dst != gone:
                    self.completion.complete(p, errors.InvalidUsage.code, 0)
            if keep:
                self.probes[dst] = keep
            else:
                del self.probes[dst]
        for key in [k for k, m in self.held.items() if m.peer == gone]:
            self.completion.complete(self.held.pop(key), errors.InvalidUsage.code, 0)
        if self.nodes.nnodes > 1:
            self.coll.across.flush_notes()   # its last collectives are checked too (coll/multinode.py)
            self.nodes.tell_closed(gone)

    def match(self, send: Op | Buffered, recv: Op) -> None:
        """A send met its receive: check what only the pair can tell (truncation, dtype), then hand the
        message to the connector of (sender, receiver, memory kind), which moves it. A matched probe
        in the place of the receive takes the message instead (hold)."""
        if recv.kind != KIND_RECV:
            self.hold(send, recv)
            return
        n = send.nbytes
        if n > recv.nbytes:
            self.completion.complete(recv, errors.TruncationError.code, n, source=send.rank, tag=send.tag)
            self.completion.complete(send, 0, n)
            return
        if send.dtype != recv.dtype:
            self.completion.complete(recv, errors.InvalidUsage.code, n, source=send.rank, tag=send.tag,
                                     peer_dtype=send.dtype)
            self.completion.complete(send, errors.InvalidUsage.code, n, source=recv.rank, tag=send.tag,
                                     peer_dtype=recv.dtype)
            return
        # Device memory on either side makes it a device transfer: the transport that moves device memory
        # also copies between host and device; shm moves host memory only.
        kind = max(mem_kind(send.mem), mem_kind(recv.mem)) if send.mem | recv.mem else 0
        if kind not in _KINDS:
            self._refuse(send, recv, errors.InvalidArgument(f"unknown memory kind {kind} in a record"))
            return
        conn = self.conns.get((send.rank, recv.rank, kind))   # every message: no call when it exists
        if conn is None:
            try:
                conn = self.connections.connect(send.rank, recv.rank, MemKind(kind))
            except errors.InvalidUsage as exc:   # no allowed transport: the job cannot work, say so loudly
                self.failures.fail(exc.code, str(exc))
                return
        t = Transfer(send, recv, n, time.monotonic_ns())
        try:
            done = conn.transport.proxy_start(self.ctx, conn, t)
        except errors.InvalidArgument as exc:
            self._refuse(send, recv, exc)
            return
        conn.nmsgs += 1
        if self.st.profiler.enabled:
            t.t_started = time.monotonic_ns()
        if done:
            self.completion.finish_transfer(t)
        elif t.published and self.armed.on:
            self.armed.remember(t, conn)   # the same message may come back: arm it then (engine/armed.py)

    def _refuse(self, send: Op | Buffered, recv: Op, exc: errors.ProxyError) -> None:
        """A matched pair that cannot move (a bad buffer or record): both requests fail, nothing moved."""
        _log.warning("%s -> %s: %s", send.describe(), recv.describe(), exc)
        self.completion.complete(recv, exc.code, send.nbytes, source=send.rank, tag=send.tag)
        self.completion.complete(send, exc.code, send.nbytes)

    # ------------------------------------------------------------------ buffered sends
    def _buffer_due_now(self) -> bool:
        """The loop's poll hook while sends wait out their grace: True while some still do."""
        self.buffer_due(time.monotonic_ns())
        return bool(self.buffer_later)

    def buffer_due(self, now: int) -> None:
        """Buffer the sends of ``buffer_later`` in arrival order, up to the first whose grace is not
        over at ``now``."""
        later = self.buffer_later
        while later and later[0][0] <= now:
            send = later.popleft()[1]
            if self.matcher.is_unexpected(send.peer, send.rank, send.tag, send):
                self.buffer_send(send)

    def buffer_send(self, send: Op) -> None:
        """``send`` waits unexpected: copy its bytes into this process and complete it, unless its
        destination has SEND_BUFFER_PER_PEER bytes waiting already (flow control) or its buffer does
        not check out (left to the match, which refuses it naming why)."""
        b = self.buffered_copy(send)
        if b is not None and self.matcher.replace_unexpected(send.peer, send.rank, send.tag, send, b):
            self.adopt_buffered(send, b)
            self.st.q[_N_BUFFERED_Q] += 1

    def buffered_copy(self, send: Op) -> Buffered | None:
        """A Buffered copy of ``send``'s bytes, or None (flow control, or a buffer that does not check out)."""
        n = send.nbytes
        if self.buffered.get(send.peer, 0) + n > self.send_buffer_peer:
            return None
        buf = self.st.buffers.get((send.owner, send.buf_id))
        if buf is None or (send.offset + n > buf.size and send.tmap is None):
            return None
        if send.tmap is not None:   # a derived datatype: packed here, contiguous from now on
            try:
                data = typed.pack(self.st.buffers, send)
            except errors.InvalidArgument:
                return None
        else:
            data = np.empty(n, np.uint8)
            if n:
                self.ctx.memcopy(_native.buffer_info(data, True)[0], buf.addr + send.offset, n)
        self.buffered_ids += 1
        return Buffered(send, self.buffered_ids, data, self.release_buffered)

    def adopt_buffered(self, send: Op, b: Buffered) -> None:
        """``b`` stands in for ``send`` from now on: register its bytes, count them, complete the send."""
        self.st.buffers[(BUFFERED_OWNER, b.buf_id)] = b
        self.buffered[send.peer] = self.buffered.get(send.peer, 0) + send.nbytes
        self.completion.complete(send, 0, send.nbytes, source=send.peer, tag=send.tag)

    def release_buffered(self, b: Buffered) -> None:
        """A buffered send's bytes were delivered, or will never be: its memory goes back."""
        if self.st.buffers.pop((BUFFERED_OWNER, b.buf_id), None) is not None:
            self.buffered[b.peer] -= b.nbytes
        b.data = b.mm = None

    def cell_in(self, src: int, dst: int, got: tuple) -> None:
        """A fast-path cell the progress process drained (engine/fastpath.py, ``got`` from
        _native.fast_take) enters matching as a send buffered from its start: its sender returned
        when it wrote the cell."""
        tag, code, nbytes, count, t_post, data = got
        self.buffered_ids += 1
        b = Buffered.from_cell(src, dst, tag, code, nbytes, count, t_post, self.buffered_ids,
                               np.frombuffer(data, np.uint8), self.release_buffered)
        self.st.buffers[(BUFFERED_OWNER, b.buf_id)] = b
        self.buffered[dst] = self.buffered.get(dst, 0) + nbytes
        self.deliver_buffered(b)

    # ------------------------------------------------------------------ across nodes
    def remote_send(self, send: Any) -> None:
        """A send (an Op, or the Buffered copy that stands for it) to a rank of another node."""
        dst = send.peer
        if dst in self.gone:
            self.completion.complete(send, errors.InvalidUsage.code, 0)   # the receiver closed first
            return
        n = send.nbytes
        if self.net_eager < n <= self.send_buffer and not (send.flags & FLAG_SYNC or send.mem):
            b = self.buffered_copy(send)   # standard mode, buffered here (the header)
            if b is not None:
                self.adopt_buffered(send, b)
                send = b
        try:
            conn = self.connections.get(send.rank, dst, mem_kind(send.mem))
            done = conn.transport.proxy_send_envelope(self.ctx, conn, send)   # type: ignore[misc]
        except errors.InvalidArgument as exc:
            self.completion.complete(send, exc.code, 0)
            return
        except errors.InvalidUsage as exc:   # no transport for the pair: the job cannot work
            self.failures.fail(exc.code, str(exc))
            return
        conn.nmsgs += 1
        if done:
            self.completion.complete(send, 0, send.nbytes, source=dst, tag=send.tag)

    def arrive_remote(self, env: Any) -> None:
        """Loop: the envelope of a send posted on another node (transports.net_socket.RemoteSend)."""
        dst = env.peer
        if dst in self.gone:
            env.reply(errors.InvalidUsage.code, 0)   # the receiver closed first
            return
        recv = self.matcher.arrive(dst, env.rank, env.tag, env)
        if recv is not None:
            self.match(env, recv)
        elif self.probes:
            self.wake_probes(dst, env)

    def remote_closed(self, rank: int) -> None:
        """Loop: ``rank`` of another node closed: the receives posted here for it fail."""
        self.gone.add(rank)
        for op in self.matcher.drop(lambda dst, src, tag, op: src == rank, unexpected=False):
            self.completion.complete(op, errors.InvalidUsage.code, 0)

    # ------------------------------------------------------------------ probes and cancel
    def probe_post(self, probe: Op) -> None:
        """Probe/Iprobe/Mprobe/Improbe (see the module header): answer now, or wait for a message."""
        src, tag, dst, flags = probe.peer, probe.tag, probe.rank, probe.flags
        if dst in self.matcher.armed:   # a message an armed route holds out of matching must show
            self.armed.disarm_dest(dst)
        if self.fast:
            self.fastpath.drain_to(probe.owner)
        if not 0 <= src < self.size and src != ANY_SOURCE:
            self.completion.complete(probe, errors.InvalidArgument.code, 0)
            return
        block = flags & FLAG_PROBE_BLOCK
        if flags & FLAG_PROBE_MATCHED:
            if block:
                send = self.matcher.post(dst, src, tag, probe)   # waits as a receive would
                if send is not None:
                    self.hold(send, probe)
                    return
            else:
                send = self.matcher.probe(dst, src, tag)
                if send is not None:
                    self.matcher.take(dst, send)
                    self.hold(send, probe)
                    return
        else:
            send = self.matcher.probe(dst, src, tag)
            if send is not None:
                self.completion.complete(probe, 0, send.nbytes, source=send.rank, tag=send.tag)
                return
            if block:
                self.probes.setdefault(dst, []).append(probe)
        if not block:
            self.completion.complete(probe, STATUS_NO_MESSAGE, 0)
        elif self.gone and src in self.gone and src != dst:   # nothing can come any more
            self.cancel_target(probe.owner, probe.req_slot, probe.req_seq)
            self.completion.complete(probe, errors.InvalidUsage.code, 0)

    def hold(self, send: Any, probe: Op) -> None:
        """A matched probe took ``send``: keep it for the receive that names the probe's handle."""
        self.held[(probe.owner, probe.req_seq)] = send
        self.completion.complete(probe, 0, send.nbytes, source=send.rank, tag=send.tag)

    def wake_probes(self, dst: int, send: Any) -> None:
        """``send`` arrived unexpected for ``dst``: answer the blocking Probes that accept it."""
        waiting = self.probes.get(dst)
        if not waiting:
            return
        keep = []
        for p in waiting:
            if _accepts(p.peer, p.tag, send.rank, send.tag):
                self.completion.complete(p, 0, send.nbytes, source=send.rank, tag=send.tag)
            else:
                keep.append(p)
        if keep:
            self.probes[dst] = keep
        else:
            del self.probes[dst]

    def cancel_post(self, op: Op) -> None:
        """KIND_CANCEL: cancel the owner's request (slot = peer, sequence = tag) if nothing matched it."""
        found = self.cancel_target(op.owner, op.peer, op.tag)
        if found is not None:
            self.completion.complete(found, STATUS_CANCELLED, 0, source=found.peer, tag=found.tag, wake=False)
        self.completion.complete(op, 0, int(found is not None))

    def cancel_target(self, owner: int, slot: int, seq: int) -> Op | None:
        """Remove the owner's pending op of request (slot, seq) from matching or the waiting probes."""
        def target(_dst: int, _src: int, _tag: int, item: Any) -> bool:
            return item.owner == owner and item.req_slot == slot and item.req_seq == seq

        found = self.matcher.drop(target)
        if found:
            return found[0]
        for dst, waiting in self.probes.items():
            for i, p in enumerate(waiting):
                if target(dst, 0, 0, p):
                    del waiting[i]
                    return p
        return None
