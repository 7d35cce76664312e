"""The communicator's other nodes, as one node's progress process sees them: Nodes, a component of the
engine (``engine.nodes``).

A communicator that spans nodes has a progress process per node. The ranks learn the layout at the
job's rendezvous (shmproxy.control.rendezvous: which node each rank runs on, every node's connect-info,
the job's secret) and hand it to their progress process with CONNECT (``setup``). The transport
between nodes (the first allowed one with ``proxy_shared_init``: socket) then links this node to
every other one.

From then on the two halves of a message may live on different nodes (engine/p2p.py, "Across
nodes": a send's envelope leaves through its connector's transport, an envelope from another node
enters the receive half), and a send to another node completes when its transport says so
(``complete_send``: eager at once, else once its bytes left, or with the receiver's verdict).

News crosses too: a local rank that closes is announced to every node (``tell_closed``; the
point-to-point half there fails what waits on it), and so is the first failure (``tell_failed``, a
listener of Failures), so that every survivor on every node raises the same error. A link that
breaks is a failure naming the lost node and its ranks.

The component owns the layout (``map``, a NodeMap: replaced whole at the first CONNECT, which the
loop runs for the service thread) and the transport between nodes (``net``); it takes the loop's
state (the rank tables), the completion path and the transports' context.
"""
from __future__ import annotations

from shmproxy.core import errors, log
from shmproxy.core.ops import Op
from shmproxy.engine.completion import Completion
from shmproxy.engine.context import EngineContext
from shmproxy.engine.failure import Failures
from shmproxy.engine.state import LoopState
from shmproxy.transports.base import PeerInfo, Transport

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
    def __init__(self, st: LoopState, failures: Failures, completion: Completion, ctx: EngineContext):
        self.st, self.completion, self.ctx = st, completion, ctx
        self.size = st.size
        self.map = NodeMap(st.size)
        # Across nodes: the first allowed transport that links progress processes listens at start, so
        # that INIT can tell the ranks where (``info``).
        self.net: Transport | None = None
        self.info = b""
        failures.on_first_error.append(self.tell_failed)

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
            self.info = self.net.proxy_shared_init(self.ctx)   # type: ignore[misc]

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
        nlocal = self.st.nlocal
        if len(mine) != nlocal or rank not in mine:
            raise errors.InvalidUsage(f"the rendezvous put ranks {mine} on this node (node {layout.node}), but "
                                      f"{nlocal} local ranks started here, rank {rank} among them")
        if self.net is None:
            raise errors.InvalidUsage("the communicator spans nodes, but no allowed transport links nodes "
                                      "(SHMPROXY_TRANSPORTS)")
        self.map = layout   # one reference store: the loop sees the old layout or the new one whole
        self.net.proxy_shared_connect(self.ctx, layout.infos)   # type: ignore[misc]
        _log.info("node %d of %d: ranks %s here", layout.node, layout.nnodes, mine)

    def peer_info(self, rank: int) -> PeerInfo:
        lr = self.st.local_of.get(rank)
        if lr is not None:
            r = self.st.ranks[lr]
            return PeerInfo(r.rank, r.local_rank, r.host, r.pid, self.node)
        n = self.map.rank_node[rank]
        if n == self.node:
            raise errors.InternalError(f"rank {rank} of this node has not joined")
        return PeerInfo(rank, -1, self.map.hosts[n], 0, n)

    def is_local(self, rank: int) -> bool:
        """``rank`` runs on this node (joined or not)."""
        return self.map.rank_node[rank] == self.map.node

    # ------------------------------------------------------------------ sends to other nodes
    def complete_send(self, op: Op, code: int, nbytes: int, peer_dtype: int = 0) -> None:
        """A transport's verdict on a send whose receiver is on another node."""
        self.completion.complete(op, code, nbytes, source=op.peer, tag=op.tag, peer_dtype=peer_dtype)

    # ------------------------------------------------------------------ news for the other nodes
    def tell_closed(self, rank: int) -> None:
        """Loop: local rank ``rank`` closed (after the collective notes it left were flushed)."""
        if self.map.nnodes > 1 and self.net is not None:
            self.net.proxy_rank_closed(self.ctx, rank)   # type: ignore[misc]

    def tell_failed(self, code: int, message: str, rank: int | None) -> None:
        if self.map.nnodes > 1 and self.net is not None:
            self.net.proxy_abort(self.ctx, code, message, rank)   # type: ignore[misc]
