"""The communicator's other nodes, as one node's progress process sees them: Nodes, a component of the
engine (``engine.nodes``).

A communicator that spans nodes has a progress process per node. The ranks learn the layout at the
job's rendezvous (shmproxy.control.rendezvous: which node each rank runs on, every node's connect-info,
the job's secret) and hand it to their progress process with CONNECT (``setup``). The transport
between nodes (the first allowed one with ``proxy_shared_init``: socket) then links this node to
every other one.

From then on the two halves of a message may live on different nodes:

- a send to a rank of another node leaves through ``remote_send``: its connector's transport ships
  the envelope (``proxy_send_envelope``), and the send completes when that transport says so
  (``complete_send``: eager at once, else once its bytes left, or with the receiver's verdict);
- an envelope from another node enters through ``arrive``: the receive half matches it like a local
  one, and the match hands it to the connector of (sender, receiver), which lands its bytes.

News crosses too: a local rank that closes is announced to every node (``remote_closed`` there fails
what waits on it), and so is the first failure (``tell_failed``), so that every survivor on every
node raises the same error. A link that breaks is a failure naming the lost node and its ranks.

The component owns the layout (``map``, a NodeMap: replaced whole at the first CONNECT, which the
loop runs for the service thread) and the transport between nodes (``net``); it takes the engine for
the rank tables, the connectors, the point-to-point half (matching, buffered sends, probes) and the
completion and failure paths.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shmproxy.core import errors, log
from shmproxy.core.memory import mem_kind
from shmproxy.core.ops import FLAG_SYNC, Op
from shmproxy.transports.base import MemKind, PeerInfo, Transport

if TYPE_CHECKING:  # pragma: no cover
    from shmproxy.engine.progress import ProgressEngine

_log = log.get("NET")


class NodeMap:
    """Which node each rank runs on. One node until the ranks say otherwise at CONNECT."""

    __slots__ = ("node", "rank_node", "hosts", "ranks_of", "secret", "infos")

    def __init__(self, size: int, node: int = 0, rank_node: list[int] | None = None, hosts: list[str] | None = None,
                 secret: bytes = b"", infos: list[bytes] | None = None):
        self.node = node
        self.rank_node = rank_node if rank_node is not None else [0] * size
        nnodes = max(self.rank_node) + 1 if self.rank_node else 1
        self.hosts = hosts or [""] * nnodes
        self.ranks_of: list[list[int]] = [[] for _ in range(nnodes)]
        for r, n in enumerate(self.rank_node):
            self.ranks_of[n].append(r)
        self.secret, self.infos = secret, infos or []

    @property
    def nnodes(self) -> int:
        return len(self.ranks_of)

    def leader(self, node: int) -> int:
        """The lowest rank of ``node``: the end its collectives' entries travel between."""
        return self.ranks_of[node][0]


class Nodes:
    def __init__(self, engine: "ProgressEngine", size: int):
        self.e = engine
        self.size = size
        self.map = NodeMap(size)
        # Across nodes: the first allowed transport that links progress processes listens at start, so
        # that INIT can tell the ranks where (``info``).
        self.net: Transport | None = None
        self.info = b""

    @property
    def node(self) -> int:
        """This progress process's node in the communicator (0 until the layout is known)."""
        return self.map.node

    @property
    def nnodes(self) -> int:
        return self.map.nnodes

    def start(self, transports: tuple[Transport, ...] | list[Transport]) -> None:
        """At start, when the communicator may span nodes: listen with the first transport that can."""
        self.net = next((t for t in transports if t.proxy_shared_init is not None), None)
        if self.net is not None:
            self.info = self.net.proxy_shared_init(self.e.ctx)   # type: ignore[misc]

    # ------------------------------------------------------------------ set-up (CONNECT)
    def setup(self, net: dict, rank: int) -> None:
        """The layout a rank sent with CONNECT: taken from the first, checked against the others."""
        try:
            layout = NodeMap(self.size, int(net["node"]), [int(n) for n in net["rank_node"]],
                             [str(h) for h in net["hosts"]], bytes.fromhex(net["secret"]),
                             [bytes.fromhex(i) for i in net["infos"]])
        except (KeyError, TypeError, ValueError) as exc:
            raise errors.InvalidArgument(f"CONNECT from rank {rank}: malformed node layout ({exc!r})") from exc
        if len(layout.rank_node) != self.size or len(layout.infos) != layout.nnodes or len(layout.secret) != 16:
            raise errors.InvalidArgument(f"CONNECT from rank {rank}: node layout of the wrong size")
        if self.map.nnodes > 1:
            old = self.map
            if (old.node, old.rank_node, old.secret, old.infos) != (layout.node, layout.rank_node, layout.secret,
                                                                    layout.infos):
                raise errors.InvalidUsage(f"rank {rank} was told another node layout than the first rank of "
                                          f"this node: the rendezvous went wrong")
            return
        mine = [r for r, n in enumerate(layout.rank_node) if n == layout.node]
        nlocal = self.e.nlocal
        if len(mine) != nlocal or rank not in mine:
            raise errors.InvalidUsage(f"the rendezvous put ranks {mine} on this node (node {layout.node}), but "
                                      f"{nlocal} local ranks started here, rank {rank} among them")
        if self.net is None:
            raise errors.InvalidUsage("the communicator spans nodes, but no allowed transport links nodes "
                                      "(SHMPROXY_TRANSPORTS)")
        self.map = layout   # one reference store: the loop sees the old layout or the new one whole
        self.net.proxy_shared_connect(self.e.ctx, layout.infos)   # type: ignore[misc]
        _log.info("node %d of %d: ranks %s here", layout.node, layout.nnodes, mine)

    def peer_info(self, rank: int) -> PeerInfo:
        lr = self.e.local_of.get(rank)
        if lr is not None:
            r = self.e.ranks[lr]
            return PeerInfo(r.rank, r.local_rank, r.host, r.pid, self.node)
        n = self.map.rank_node[rank]
        if n == self.node:
            raise errors.InternalError(f"rank {rank} of this node has not joined")
        return PeerInfo(rank, -1, self.map.hosts[n], 0, n)

    # ------------------------------------------------------------------ the send half, across nodes
    def remote_send(self, send: Any) -> None:
        """A send (an Op, or the Buffered copy that stands for it) to a rank of another node."""
        e = self.e
        dst = send.peer
        if dst in e.gone:
            e.completion.complete(send, errors.InvalidUsage.code, 0)   # the receiver closed first
            return
        n = send.nbytes
        if e.p2p.net_eager < n <= e.p2p.send_buffer and not (send.flags & FLAG_SYNC or send.mem):
            b = e.p2p.buffered_copy(send)   # standard mode, buffered here (engine/p2p.py)
            if b is not None:
                e.p2p.adopt_buffered(send, b)
                send = b
        kind = mem_kind(send.mem)
        conn = e.conns.get((send.rank, dst, kind))
        try:
            if conn is None:
                conn = e.p2p.connect(send.rank, dst, MemKind(kind))
            done = conn.transport.proxy_send_envelope(e.ctx, conn, send)   # type: ignore[misc]
        except errors.InvalidArgument as exc:
            e.completion.complete(send, exc.code, 0)
            return
        except errors.InvalidUsage as exc:   # no transport for the pair: the job cannot work
            e.failures.fail(exc.code, str(exc))
            return
        conn.nmsgs += 1
        if done:
            e.completion.complete(send, 0, send.nbytes, source=dst, tag=send.tag)

    def complete_send(self, op: Op, code: int, nbytes: int, peer_dtype: int = 0) -> None:
        """A transport's verdict on a send whose receiver is on another node."""
        self.e.completion.complete(op, code, nbytes, source=op.peer, tag=op.tag, peer_dtype=peer_dtype)

    # ------------------------------------------------------------------ the receive half, across nodes
    def arrive(self, env: Any) -> None:
        """Loop: the envelope of a send posted on another node (transports.net_socket.RemoteSend)."""
        e = self.e
        dst = env.peer
        if dst in e.gone:
            env.reply(errors.InvalidUsage.code, 0)   # the receiver closed first
            return
        recv = e.p2p.matcher.arrive(dst, env.rank, env.tag, env)
        if recv is not None:
            e.p2p.match(env, recv)
        elif e.p2p.probes:
            e.p2p.wake_probes(dst, env)   # engine/p2p.py

    def remote_closed(self, rank: int) -> None:
        """Loop: ``rank`` of another node closed: the receives posted here for it fail."""
        e = self.e
        e.gone.add(rank)
        for op in e.p2p.matcher.drop(lambda dst, src, tag, op: src == rank, unexpected=False):
            e.completion.complete(op, errors.InvalidUsage.code, 0)

    # ------------------------------------------------------------------ news for the other nodes
    def tell_closed(self, rank: int) -> None:
        if self.map.nnodes > 1 and self.net is not None:
            self.e.coll.across.flush_notes()   # its last collectives are checked too (coll/multinode.py)
            self.net.proxy_rank_closed(self.e.ctx, rank)   # type: ignore[misc]

    def tell_failed(self, code: int, message: str, rank: int | None) -> None:
        if self.map.nnodes > 1 and self.net is not None:
            self.net.proxy_abort(self.e.ctx, code, message, rank)   # type: ignore[misc]
