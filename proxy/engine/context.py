"""The engine as its transports see it: shmproxy.transports.base.TransportContext, implemented.

A transport gets this object, never the ProgressEngine: what it may use is listed here, so that a
transport can be read, tested and replaced without knowing the loop. Values are copied at
construction (they do not change while the process runs); the copy engine is looked up in the loop's
state on each use, since the engine replaces it once the CPU affinity is decided.

The context is made before the components that take it (nodes, connections, collectives, point-to-
point, armed routes); what it offers of those is bound once they exist (``bind``), before the
loop or the service runs anything.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from shmproxy.core.ops import Op
from shmproxy.engine.args import Args, CollWork, Sub
from shmproxy.engine.completion import Completion
from shmproxy.engine.events import LoopEvents
from shmproxy.engine.failure import Failures
from shmproxy.engine.state import LoopState
from shmproxy.shm import _native, pool as P
from shmproxy.transports.base import Connector, Transport

if TYPE_CHECKING:  # pragma: no cover
    from shmproxy.coll.runner import CollRunner
    from shmproxy.engine.armed import ArmedRoutes
    from shmproxy.engine.nodes import Nodes
    from shmproxy.engine.p2p import PointToPoint


class EngineContext:
    __slots__ = ("_st", "_coll", "_nodes", "_armed", "_argspool", "_n_args", "_finish_sub", "steps", "chunk",
                 "eager", "parallel_threshold", "buffers", "memcopy", "start_entry", "start_schedule", "post_event",
                 "on_events", "wake_pool", "completion_items", "completion_slots", "coll_items", "complete_coll",
                 "refuse_coll", "params", "transport_state", "timeout", "comm_id", "net_ip", "arrive", "finish",
                 "complete_send", "remote_closed", "fail", "note")

    def __init__(self, st: LoopState, events: LoopEvents, completion: Completion, failures: Failures,
                 comm_id: int, net_ip: str):
        params = st.params
        self._st = st
        self.steps: int = params.STEPS
        self.chunk: int = params.CHUNK_SIZE
        self.eager: int = st.eager
        self.parallel_threshold: int = params.PARALLEL_THRESHOLD
        self.buffers = st.buffers            # the registry itself: registrations show at once
        self.memcopy = _native.memcopy
        self.post_event = events.post        # a transport's own threads wake the loop through it
        self.on_events = events.on_events    # ... or, C threads, through the pool's EVENTS word
        self.wake_pool: int = st.seg_addr
        self.completion_items = completion.completion_items   # a device that publishes a message's completion
        self.completion_slots = completion.completion_slots
        self.coll_items = completion.coll_items
        self.complete_coll = completion.complete_coll
        self.refuse_coll = completion.refuse_coll
        self.finish = completion.finish_transfer
        self._finish_sub = completion.sub_finished
        self._argspool = st.argspool
        self._n_args = P.CTRL_OFF // 8 + P.CTRL_N_ARGS
        # between nodes (engine/nodes.py)
        self.params = params
        self.transport_state: dict[str, Any] = {}
        self.timeout: float = params.TIMEOUT
        self.comm_id: int = comm_id
        self.net_ip: str = net_ip
        self.fail = failures.fail

    def bind(self, coll: "CollRunner", nodes: "Nodes", p2p: "PointToPoint", armed: "ArmedRoutes") -> None:
        """What the context offers of the components made after it (see the header)."""
        self._coll, self._nodes, self._armed = coll, nodes, armed
        self.start_entry = coll.start_entry
        self.start_schedule = coll.start_schedule
        self.note = coll.across.on_note
        self.arrive = p2p.arrive_remote
        self.remote_closed = p2p.remote_closed
        self.complete_send = nodes.complete_send

    def disarm_routes(self) -> None:
        """Forget every armed route (engine/armed.py) before a launch one of them holds is destroyed."""
        self._armed.disarm_all()

    @property
    def node(self) -> int:
        return self._nodes.node

    @property
    def nnodes(self) -> int:
        return self._nodes.nnodes

    @property
    def secret(self) -> bytes:
        return self._nodes.map.secret

    @property
    def coll_chunk_max(self) -> int:
        return max(self._coll.coll_chunk, self.params.NET_CHUNK_SIZE)

    def rank_node(self, rank: int) -> int:
        rn = self._nodes.map.rank_node
        return rn[rank] if 0 <= rank < len(rn) else -1

    def node_ranks(self, node: int) -> list[int]:
        ro = self._nodes.map.ranks_of
        return ro[node] if 0 <= node < len(ro) else []

    def node_host(self, node: int) -> str:
        hosts = self._nodes.map.hosts
        return hosts[node] if 0 <= node < len(hosts) else "?"

    @staticmethod
    def entry_done(sch: Any, e: Any) -> None:
        sch.entry_done(e)

    @property
    def nworkers(self) -> int:
        return self._st.copy.nworkers

    def copy(self, sub: Sub, dst: int, src: int, nbytes: int) -> bool:
        return self._st.copy.copy(sub, dst, src, nbytes)

    def args_for(self, conn: Connector, opcount: int) -> Args:
        st = self._st
        key = (conn.key, opcount)
        args = st.ready.get(key)
        if args is None:
            args = self._argspool.get_args(conn.key, opcount, conn.transport)
            st.ready[key] = args
            st.active.append(args)
            st.q[self._n_args] += 1
        return args

    def coll_sub(self, t: Transport, ops: list[Op], nbytes: int, keep: list, published: bool = False) -> Sub:
        work = CollWork(ops, nbytes, keep, time.monotonic_ns())
        work.published = published
        args = self._argspool.get_args((-1, -1), ops[0].opcount, t)
        args.coll = work
        self._st.active.append(args)
        self._st.q[self._n_args] += 1
        sub = self._argspool.add_sub(args, work, 0, 0, nbytes, nbytes)
        sub.posted = 1
        return sub

    def add_sub(self, args: Args, work: Any, src: int, dst: int, nbytes: int, chunk: int) -> Sub:
        return self._argspool.add_sub(args, work, src, dst, nbytes, chunk)

    def settle(self, sub: Sub, before: tuple[int, int]) -> bool:
        if (sub.posted, sub.done) != before:   # waiting on workers is idle: the loop then blocks on
            self._st.progressed = True      # their queue, with the GIL released (copyengine.py)
        self._argspool.mirror(sub)
        if sub.done < sub.nsteps:
            return False
        self._finish_sub(sub)
        return True
