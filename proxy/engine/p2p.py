"""Point-to-point in the progress process (a mixin of ProgressEngine): the two halves of a message.

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

A rank that closes fails, on this loop's thread, the receives posted for it from that rank and the
messages waiting for it to receive them ("peer closed first"): nobody is left waiting for a rank
that is gone. Receives from ANY_SOURCE stay posted, as MPI has it. The closing rank's own receives,
which its close abandoned, are dropped, so that a later message to it fails instead of landing.
"""
from __future__ import annotations

import time

from shmproxy.core import errors, log
from shmproxy.core.memory import mem_kind
from shmproxy.core.ops import KIND_COLL, KIND_RECV, KIND_SEND, Op
from shmproxy.engine.args import Transfer
from shmproxy.engine.matching import ANY_SOURCE, ANY_TAG, Matcher
from shmproxy.engine.ranks import RankInfo
from shmproxy import transports
from shmproxy.transports.base import CONN_CONNECTED, CONN_SETUP, Connector, MemKind

_log = log.get("PROXY")
_KINDS = frozenset(int(k) for k in MemKind)


class PointToPoint:
    matcher: Matcher

    def append(self, op: Op) -> None:
        """A fetched op: a collective's arrival, or one half of a message."""
        if op.rank < 0:
            self.fail(errors.InternalError.code, f"op from local rank {op.owner}, which never initialised")
            return
        kind = op.kind
        if kind == KIND_SEND:
            self.send_half(op)
        elif kind == KIND_RECV:
            self.recv_half_post(op)
        elif kind == KIND_COLL:
            self.coll_arrive(op)
        else:
            self.complete(op, errors.InternalError.code, 0)

    # ------------------------------------------------------------------ send half
    # Every message of every size passes through these few methods: they read attributes once and
    # call as little as they can (a Python call costs about as much as the rest of a small message).
    def send_half(self, send: Op) -> None:
        """A fetched send: its envelope goes to the receive half of its destination's node. For a local
        destination that receive half is this process's, inline here: the envelope arrives at the
        matcher, and meets a posted receive or waits as unexpected."""
        dst = send.peer
        if not 0 <= dst < self.size or send.tag == ANY_TAG:   # the rank checks both: a bug or a forgery
            self.complete(send, errors.InvalidArgument.code, 0)
        elif self.nlocal == self.size or dst in self.local_of or self.nodes.rank_node[dst] == self.node:
            recv = self.matcher.arrive(dst, send.rank, send.tag, send)
            if recv is not None:
                self.match(send, recv)
            elif self.gone and dst in self.gone and dst != send.rank:
                self.matcher.take(dst, send)
                self.complete(send, errors.InvalidUsage.code, 0)   # the receiver closed first
        else:
            # The destination's receive half lives in another node's progress process: the envelope
            # travels over the pair's connector (engine/nodes.py).
            self.remote_send(send)

    # ------------------------------------------------------------------ receive half

    def recv_half_post(self, recv: Op) -> None:
        """A posted receive: match it with the earliest unexpected envelope it accepts, or keep it."""
        src = recv.peer
        if not 0 <= src < self.size and src != ANY_SOURCE:
            self.complete(recv, errors.InvalidArgument.code, 0)
            return
        send = self.matcher.post(recv.rank, src, recv.tag, recv)
        if send is not None:
            self.match(send, recv)
        elif self.gone and src in self.gone and src != recv.rank:
            self.matcher.cancel(recv.rank, recv)
            self.complete(recv, errors.InvalidUsage.code, 0)   # the sender closed first

    def close_half(self, info: RankInfo) -> None:
        """Loop thread, once ``info``'s rank closed: fail what waits on it (see the module header), and
        from now on whatever arrives for it (``gone``: the closed ranks, as this thread learned them)."""
        gone = info.rank
        self.gone.add(gone)

        def waits_on_gone(dst: int, src: int, tag: int, op: Op) -> bool:
            # receives from it, its own receives (abandoned by its close), and messages to it
            return (src == gone or dst == gone) if op.kind == KIND_RECV else dst == gone

        for op in self.matcher.drop(waits_on_gone):
            if op.rank != gone:
                self.complete(op, errors.InvalidUsage.code, 0)
        self.tell_nodes_closed(gone)

    def match(self, send: Op, recv: Op) -> None:
        """A send met its receive: check what only the pair can tell (truncation, dtype), then hand the
        message to the connector of (sender, receiver, memory kind), which moves it."""
        n = send.nbytes
        if n > recv.nbytes:
            self.complete(recv, errors.TruncationError.code, n, source=send.rank, tag=send.tag)
            self.complete(send, 0, n)
            return
        if send.dtype != recv.dtype:
            self.complete(recv, errors.InvalidUsage.code, n, source=send.rank, tag=send.tag,
                          peer_dtype=send.dtype)
            self.complete(send, errors.InvalidUsage.code, n, source=recv.rank, tag=send.tag,
                          peer_dtype=recv.dtype)
            return
        # Device memory on either side makes it a device transfer: the transport that moves device memory
        # also copies between host and device; shm moves host memory only.
        kind = max(mem_kind(send.mem), mem_kind(recv.mem)) if send.mem | recv.mem else 0
        if kind not in _KINDS:
            self._refuse(send, recv, errors.InvalidArgument(f"unknown memory kind {kind} in a record"))
            return
        conn = self.conns.get((send.rank, recv.rank, kind))
        if conn is None:
            try:
                conn = self.connect(send.rank, recv.rank, MemKind(kind))
            except errors.InvalidUsage as exc:   # no allowed transport: the job cannot work, say so loudly
                self.fail(exc.code, str(exc))
                return
        t = Transfer(send, recv, n, time.monotonic_ns())
        try:
            done = conn.transport.proxy_start(self.ctx, conn, t)
        except errors.InvalidArgument as exc:
            self._refuse(send, recv, exc)
            return
        conn.nmsgs += 1
        if done:
            self.finish_transfer(t)

    def _refuse(self, send: Op, recv: Op, exc: errors.ProxyError) -> None:
        """A matched pair that cannot move (a bad buffer or record): both requests fail, nothing moved."""
        _log.warning("%s -> %s: %s", send.describe(), recv.describe(), exc)
        self.complete(recv, exc.code, send.nbytes, source=send.rank, tag=send.tag)
        self.complete(send, exc.code, send.nbytes)

    def connect(self, src: int, dst: int, kind: MemKind) -> Connector:
        """The connector of (src, dst, kind): the first allowed transport that can carry it, both
        sides set up and connected, in this process. Within a node the connect-info blobs are handed
        over here; a transport between nodes set up the link of the two nodes beforehand
        (proxy_shared_connect), so its per-pair blobs are empty."""
        me, peer = self.peer_info(src), self.peer_info(dst)
        t = transports.select(me, peer, kind, self.transports)
        conn = Connector(t, me, peer, kind)
        send_info = t.send_setup(self.ctx, conn)
        recv_info = t.recv_setup(self.ctx, conn)
        conn.state = CONN_SETUP
        t.send_connect(self.ctx, conn, recv_info)
        t.recv_connect(self.ctx, conn, send_info)
        conn.send_info, conn.recv_info, conn.state = send_info, recv_info, CONN_CONNECTED
        self.conns[(src, dst, kind)] = conn
        _log.info("connection %d->%d (%s memory) over %s", src, dst, kind.name.lower(), t.name)
        return conn
