"""The engine as its transports see it: shmproxy.transports.base.TransportContext, implemented.

A transport gets this object, never the ProgressEngine: what it may use is listed here, so that a
transport can be read, tested and replaced without knowing the loop. Values are copied at
construction (they do not change while the process runs); the copy engine is looked up on each use,
since the engine replaces it once the CPU affinity is decided.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from shmproxy.core.ops import Op
from shmproxy.engine.args import Args, CollWork, Sub
from shmproxy.shm import _native, pool as P
from shmproxy.transports.base import Connector, Transport

if TYPE_CHECKING:  # pragma: no cover
    from shmproxy.engine.progress import ProgressEngine


class EngineContext:
    __slots__ = ("_engine", "steps", "chunk", "eager", "parallel_threshold", "buffers", "memcopy",
                 "start_entry", "start_schedule", "post_event", "on_events", "wake_pool", "completion_items",
                 "completion_slots", "coll_items", "complete_coll", "refuse_coll",
                 "_argspool",
                 "_n_args", "params",
                 "transport_state", "timeout", "comm_id", "net_ip", "arrive", "finish", "complete_send",
                 "remote_closed", "fail", "note")

    def __init__(self, engine: "ProgressEngine"):
        self._engine = engine
        self.steps: int = engine.steps
        self.chunk: int = engine.chunk
        self.eager: int = engine.eager
        self.parallel_threshold: int = engine.params.PARALLEL_THRESHOLD
        self.buffers = engine.buffers            # the registry itself: registrations show at once
        self.memcopy = _native.memcopy
        self.start_entry = engine.coll.start_entry
        self.start_schedule = engine.coll.start_schedule
        self.post_event = engine.post_event   # a transport's own threads wake the loop through it
        self.on_events = engine.on_events     # ... or, C threads, through the pool's EVENTS word
        self.wake_pool: int = engine.seg.addr
        self.completion_items = engine.completion.completion_items   # a device that publishes a message's completion
        self.completion_slots = engine.completion.completion_slots
        self.coll_items = engine.completion.coll_items
        self.complete_coll = engine.completion.complete_coll
        self.refuse_coll = engine.completion.refuse_coll
        self._argspool = engine.argspool
        self._n_args = P.CTRL_OFF // 8 + P.CTRL_N_ARGS
        # between nodes (engine/nodes.py)
        self.params = engine.params
        self.transport_state: dict[str, Any] = {}
        self.timeout: float = engine.params.TIMEOUT
        self.comm_id: int = engine.comm_id
        self.net_ip: str = engine.net_ip
        self.arrive = engine.nodes.arrive
        self.finish = engine.completion.finish_transfer
        self.complete_send = engine.nodes.complete_send
        self.remote_closed = engine.nodes.remote_closed
        self.fail = engine.failures.fail
        self.note = engine.coll.across.on_note

    def disarm_routes(self) -> None:
        """Forget every armed route (engine/armed.py) before a launch one of them holds is destroyed."""
        self._engine.armed.disarm_all()

    @property
    def node(self) -> int:
        return self._engine.nodes.node

    @property
    def nnodes(self) -> int:
        return self._engine.nodes.nnodes

    @property
    def secret(self) -> bytes:
        return self._engine.nodes.map.secret

    @property
    def coll_chunk_max(self) -> int:
        return max(self._engine.coll.coll_chunk, self._engine.params.NET_CHUNK_SIZE)

    def rank_node(self, rank: int) -> int:
        rn = self._engine.nodes.map.rank_node
        return rn[rank] if 0 <= rank < len(rn) else -1

    def node_ranks(self, node: int) -> list[int]:
        ro = self._engine.nodes.map.ranks_of
        return ro[node] if 0 <= node < len(ro) else []

    def node_host(self, node: int) -> str:
        hosts = self._engine.nodes.map.hosts
        return hosts[node] if 0 <= node < len(hosts) else "?"

    @staticmethod
    def entry_done(sch: Any, e: Any) -> None:
        sch.entry_done(e)

    @property
    def nworkers(self) -> int:
        return self._engine.copy.nworkers

    def copy(self, sub: Sub, dst: int, src: int, nbytes: int) -> bool:
        return self._engine.copy.copy(sub, dst, src, nbytes)

    def args_for(self, conn: Connector, opcount: int) -> Args:
        engine = self._engine
        key = (conn.key, opcount)
        args = engine.ready.get(key)
        if args is None:
            args = self._argspool.get_args(conn.key, opcount, conn.transport)
            engine.ready[key] = args
            engine.active.append(args)
            engine.q[self._n_args] += 1
        return args

    def coll_sub(self, t: Transport, ops: list[Op], nbytes: int, keep: list, published: bool = False) -> Sub:
        work = CollWork(ops, nbytes, keep, time.monotonic_ns())
        work.published = published
        args = self._argspool.get_args((-1, -1), ops[0].opcount, t)
        args.coll = work
        self._engine.active.append(args)
        self._engine.q[self._n_args] += 1
        sub = self._argspool.add_sub(args, work, 0, 0, nbytes, nbytes)
        sub.posted = 1
        return sub

    def add_sub(self, args: Args, work: Any, src: int, dst: int, nbytes: int, chunk: int) -> Sub:
        return self._argspool.add_sub(args, work, src, dst, nbytes, chunk)

    def settle(self, sub: Sub, before: tuple[int, int]) -> bool:
        if (sub.posted, sub.done) != before:   # waiting on workers is idle: the loop then blocks on
            self._engine.progressed = True      # their queue, with the GIL released (copyengine.py)
        self._argspool.mirror(sub)
        if sub.done < sub.nsteps:
            return False
        self._engine.completion.sub_finished(sub)
        return True
