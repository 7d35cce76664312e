"""The connectors of the progress process: Connections, a component of the engine (``engine.connections``).

A connector carries the messages of one (source rank, destination rank, memory kind) over one
transport, as NCCL's connectors do a channel's peer. It is made the first time that triple is
needed: at CONNECT (the rank asks for its host connections up front), at a message's match
(engine/p2p.py), or for a collective's entries between nodes (coll/runner.py). Making one picks the
first allowed transport that can carry it (transports.select) and runs both sides' setup and
connect here, in this process: within a node the connect-info blobs are handed over by this call;
a transport between nodes set up the link of the two nodes beforehand (proxy_shared_connect), so its
per-pair blobs are empty.

The component owns the table (``conns``); it takes the loop's state (the allowed transports), the
other nodes (who the peer is and where) and the transports' context. Loop thread only.
"""
from __future__ import annotations

from shmproxy import transports
from shmproxy.core import log
from shmproxy.engine.context import EngineContext
from shmproxy.engine.nodes import Nodes
from shmproxy.engine.state import LoopState
from shmproxy.transports.base import CONN_CONNECTED, CONN_SETUP, Connector, MemKind

_log = log.get("PROXY")


class Connections:
    def __init__(self, st: LoopState, nodes: Nodes, ctx: EngineContext):
        self.st, self.nodes, self.ctx = st, nodes, ctx
        # (src, dst global ranks, memory kind): a MemKind, or the int a record carries (equal keys)
        self.conns: dict[tuple[int, int, int], Connector] = {}

    def get(self, src: int, dst: int, kind: int) -> Connector:
        """The connector of (src, dst, kind), made now if it is the first use. Raises InvalidUsage
        when no allowed transport can carry it."""
        conn = self.conns.get((src, dst, kind))
        return conn if conn is not None else self.connect(src, dst, MemKind(kind))

    def connect(self, src: int, dst: int, kind: MemKind) -> Connector:
        """Make the connector of (src, dst, kind): both sides set up and connected."""
        me, peer = self.nodes.peer_info(src), self.nodes.peer_info(dst)
        t = transports.select(me, peer, kind, self.st.transports)
        conn = Connector(t, me, peer, kind)
        ctx = self.ctx
        send_info = t.send_setup(ctx, conn)
        recv_info = t.recv_setup(ctx, conn)
        conn.state = CONN_SETUP
        t.send_connect(ctx, conn, recv_info)
        t.recv_connect(ctx, conn, send_info)
        conn.send_info, conn.recv_info, conn.state = send_info, recv_info, CONN_CONNECTED
        self.conns[(src, dst, kind)] = conn
        _log.info("connection %d->%d (%s memory) over %s", src, dst, kind.name.lower(), t.name)
        return conn
