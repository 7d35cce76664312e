"""Point-to-point in the progress process (a mixin of ProgressEngine): matching and connections.

A send and a receive meet by (source, destination, tag) in FIFO order, which is what keeps messages
of one pair and tag from overtaking each other; a matched pair is checked for what only the pair can
tell (truncation, dtype) and handed to the connector of (sender, receiver, memory kind), whose
transport moves it (shmproxy.transports.base).
"""
from __future__ import annotations

import collections
import time


from shmproxy.core import errors, log
from shmproxy.core.ops import KIND_COLL, KIND_RECV, KIND_SEND, Op
from shmproxy.engine.args import Transfer
from shmproxy import transports
from shmproxy.transports.base import CONN_CONNECTED, CONN_SETUP, Connector, MemKind, PeerInfo, Transport

_log = log.get("PROXY")


class PointToPoint:
    def append(self, op: Op) -> None:
        if op.rank < 0:
            self.fail(errors.InternalError.code, f"op from local rank {op.owner}, which never initialised")
            return
        if op.kind == KIND_COLL:
            self.coll_arrive(op)
            return
        if not 0 <= op.peer < self.size:
            self.complete(op, errors.InvalidArgument.code, 0)
            return
        if op.kind == KIND_SEND:
            key = (op.rank, op.peer, op.tag)
            mine, theirs = self.sends, self.recvs
        elif op.kind == KIND_RECV:
            key = (op.peer, op.rank, op.tag)
            mine, theirs = self.recvs, self.sends
        else:
            self.complete(op, errors.InternalError.code, 0)
            return
        q = theirs.get(key)
        if q:
            other = q.popleft()
            if not q:
                del theirs[key]
            if op.kind == KIND_SEND:
                self.match(op, other)
            else:
                self.match(other, op)
            return
        peer_local = self.local_of.get(op.peer)
        if peer_local is not None and self.ranks[peer_local].closed and op.peer != op.rank:
            self.complete(op, errors.InvalidUsage.code, 0)
            return
        mine.setdefault(key, collections.deque()).append(op)

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
        conn = self.conns.get((send.rank, recv.rank, MemKind.HOST))
        if conn is None:
            conn = self.connect(send.rank, recv.rank, MemKind.HOST)
        t = Transfer(send, recv, n, time.monotonic_ns())
        try:
            done = conn.transport.proxy_start(self.ctx, conn, t)
        except errors.InvalidArgument as exc:
            _log.warning("%s", exc)
            self.complete(recv, exc.code, n, source=send.rank, tag=send.tag)
            self.complete(send, exc.code, n)
            return
        conn.nmsgs += 1
        conn.nbytes += n
        if done:
            self.finish_transfer(t)

    def connect(self, src: int, dst: int, kind: MemKind) -> Connector:
        """The connector of (src, dst, kind): the first allowed transport that can carry it, both
        sides set up and connected. Both sides are ranks of this node, so the connect-info blobs are
        handed over here; across nodes they travel between progress processes."""
        a = self.ranks[self.local_of[src]]
        b = self.ranks[self.local_of[dst]]
        me = PeerInfo(a.rank, a.local_rank, a.host, a.pid)
        peer = PeerInfo(b.rank, b.local_rank, b.host, b.pid)
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

    def coll_transport(self) -> Transport:
        """The transport of this node's collectives: the one a local rank's connector to itself (the
        loopback) uses, for host memory: every local buffer is mapped here."""
        r = self.ranks[0].rank
        conn = self.conns.get((r, r, MemKind.HOST)) or self.connect(r, r, MemKind.HOST)
        if conn.transport.proxy_progress_coll is None:
            raise errors.InvalidUsage(f"transport {conn.transport.name} runs no collectives between the "
                                      f"ranks of a node")
        return conn.transport
