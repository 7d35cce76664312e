"""Collectives of one node's ranks, run by the progress process: CollRunner, a component of the engine
(``engine.coll``).

Every local rank posts its op of a collective with the collective's sequence number; once all have
arrived (``coll_arrive``) their fingerprints (collective, dtype, count, op, root) must agree, or every
rank is told who called what (the communicator fails: a mismatched collective would otherwise
corrupt memory or hang). Then one of two paths runs it:

- the latency path (``small_coll``): a Barrier, or at most COLL_INLINE_BYTES per rank, done at once
  with one C call per copy or reduction, on addresses resolved and bounds-checked before any byte
  moves;
- the schedule path: the collective is cut in chunks, each a small MPICH-style schedule
  (shmproxy.coll.algorithms builds them) whose data entries the executor runs (shmproxy.coll.executor:
  inline, or on the copy workers) and whose SEND/RECV entries go through connectors;
  the chunks are subs of one args that the node's loopback transport progresses (a collective is
  ready for STEPS chunks in flight per sub, like a message).

The component owns the collectives in arrival (``colls``: sequence number -> each local rank's op),
the chunking policy (coll_inline, coll_chunk, coll_min_chunk) and the executor; collectives across
nodes are its ``across`` part (shmproxy.coll.multinode). It takes the loop's state (registered buffers,
args pool and active list, copy engine and streaming threshold, profiler), the failure and completion
paths (registering with the latter how a collective's work finishes), the other nodes, the
connections and the transports' context.
"""
from __future__ import annotations

import collections
import time
from typing import Any


from shmproxy.coll import algorithms, sched, vector
from shmproxy.coll.executor import CpuExecutor
from shmproxy.coll.multinode import MultiNodeColl
from shmproxy.coll.sched import Region
from shmproxy.core import errors, log
from shmproxy.core.memory import MemKind, mem_kind
from shmproxy.core.ops import CODE_DTYPE, COLL_LAST_NATIVE, FLAG_IN_PLACE, Coll, Op
from shmproxy.engine.args import CollWork
from shmproxy.engine.completion import Completion
from shmproxy.engine.connections import Connections
from shmproxy.engine.context import EngineContext
from shmproxy.engine.failure import Failures
from shmproxy.engine.nodes import Nodes
from shmproxy.engine.policy import coll_chunk_limit
from shmproxy.engine.state import LoopState
from shmproxy.shm import _native, _reduce, pool as P
from shmproxy.transports.base import Connector, HostBuffer

_log = log.get("COLL")
# Collective kinds as plain ints for the per-op path: looking up an IntEnum member costs more than a
# plain int compare, and a small collective's whole budget in this process is a few microseconds.
_BARRIER, _BCAST, _REDUCE, _ALLREDUCE = (int(sched.Coll.BARRIER), int(sched.Coll.BCAST), int(sched.Coll.REDUCE),
                                         int(sched.Coll.ALLREDUCE))
_ALLGATHER, _RSB, _ALLTOALL = (int(sched.Coll.ALLGATHER), int(sched.Coll.REDUCE_SCATTER_BLOCK),
                               int(sched.Coll.ALLTOALL))
_BLOCK_PER_RANK = frozenset((_ALLGATHER, _RSB, _ALLTOALL))  # a rank's buffer holds one block per rank
_WITH_REDOP = frozenset(map(int, (sched.Coll.REDUCE, sched.Coll.ALLREDUCE, sched.Coll.REDUCE_SCATTER_BLOCK)))
_WITH_ROOT = frozenset(map(int, (sched.Coll.BCAST, sched.Coll.REDUCE, sched.Coll.GATHER, sched.Coll.SCATTER,
                                 sched.Coll.GATHERV, sched.Coll.SCATTERV)))
_WITH_REDOP = _WITH_REDOP | frozenset(map(int, (sched.Coll.REDUCE_SCATTER, sched.Coll.SCAN,
                                                sched.Coll.EXSCAN)))
# Counts that differ per rank by design: not in the fingerprint (shmproxy.core.counts checks them pairwise)
_PER_RANK_COUNT = frozenset(map(int, (sched.Coll.GATHERV, sched.Coll.SCATTERV, sched.Coll.ALLGATHERV,
                                      sched.Coll.ALLTOALLV, sched.Coll.REDUCE_SCATTER)))
_LAST_NATIVE = int(COLL_LAST_NATIVE)
_ITEMSIZE = {code: dt.itemsize for code, dt in CODE_DTYPE.items()}


class CollRunner:
    def __init__(self, st: LoopState, failures: Failures, completion: Completion, nodes: Nodes,
                 connections: Connections, ctx: EngineContext):
        self.st, self.failures, self.completion, self.nodes = st, failures, completion, nodes
        self.connections, self.ctx = connections, ctx
        params = self.params = st.params
        self.nlocal, self.size = st.nlocal, st.size
        self.coll_min_chunk = params.COLL_MIN_CHUNK
        self.coll_inline = params.coll_inline_bytes(st.nlocal)
        self.coll_chunk = coll_chunk_limit(params, st.loop_copies)
        self.colls: dict[int, list[Op | None]] = {}   # collective seq -> each local rank's op
        self.executor = CpuExecutor(lambda: st.copy)   # runs collectives' copies and reductions
        # across nodes: a chunk's local steps on the copy workers (docs/decisions.md, "... on the workers")
        self.local_workers = bool(params.NET_LOCAL_WORKERS if params.NET_LOCAL_WORKERS >= 0 else not st.crowded)
        self.across = MultiNodeColl(self)   # collectives whose ranks span nodes
        completion.coll_finished = self.finish_coll

    def coll_arrive(self, op: Op) -> None:
        """Collect every local rank's op of one collective (by sequence number), then start it."""
        ops = self.colls.get(op.coll_seq)
        if ops is None:
            ops = self.colls[op.coll_seq] = [None] * self.nlocal
        if ops[op.owner] is not None:
            self.failures.fail(errors.InternalError.code, f"{op.describe()}: local rank {op.owner} posted collective "
                               f"#{op.coll_seq} twice")
            return
        ops[op.owner] = op
        if None not in ops:
            del self.colls[op.coll_seq]
            self.start_coll(ops)  # type: ignore[arg-type]

    @staticmethod
    def fingerprint(op: Op) -> tuple:
        c = op.coll
        if c == _BARRIER:
            return (c, 0, 0, 0, -1)
        return (c, op.dtype, 0 if c in _PER_RANK_COUNT else op.count, op.redop if c in _WITH_REDOP else 0,
                op.peer if c in _WITH_ROOT else -1)

    @staticmethod
    def describe_fingerprint(fp: tuple) -> str:
        c, dtype, count, redop, root = fp
        parts = [CODE_DTYPE[dtype].name if dtype in CODE_DTYPE else f"dtype {dtype}"]
        if c not in _PER_RANK_COUNT:
            parts.append(f"count {count}")
        if redop:
            parts.append(sched.REDUCE_OP_NAMES.get(redop, str(redop)))
        if root >= 0:
            parts.append(f"root {root}")
        return f"{sched.COLL_NAMES.get(c, c)}({', '.join(parts)})"

    def start_coll(self, ops: list[Op]) -> None:
        fingerprint = self.fingerprint
        op0 = ops[0]
        first = fingerprint(op0)
        for other in ops[1:]:
            fp = fingerprint(other)
            if fp != first:
                self.failures.fail(errors.InvalidUsage.code,
                                   f"collective #{ops[0].coll_seq} mismatch: rank {ops[0].rank} called "
                                   f"{self.describe_fingerprint(first)} but rank {other.rank} called "
                                   f"{self.describe_fingerprint(fp)}")
                return
        if op0.coll > _LAST_NATIVE and not vector.check(self, ops, self.size):
            return
        if any(op.mem for op in ops):   # device memory: the transport of that memory runs it whole
            self.start_on_device(ops)
            return
        if self.nodes.nnodes > 1:
            self.across.start(ops)
            return
        try:
            if self.small_coll(ops):
                return
            work, builder, nchunks, chunk_bytes = self.build_coll(ops)
        except errors.ProxyError as exc:
            self.completion.refuse_coll(ops, exc.code)
            _log.warning("collective #%d refused: %s", ops[0].coll_seq, exc)
            return
        if nchunks == 0:
            self.finish_coll(work)
            return
        if work.nbytes <= self.coll_inline:
            # Small: run every chunk schedule now, inline (the latency path).
            for k in range(nchunks):
                sch = builder(k)
                while not sch.advance(self.start_entry_inline):
                    pass
            self.finish_coll(work)
            return
        written = (work.nbytes if op0.coll > _LAST_NATIVE else
                   sched.written_bytes(op0.coll, op0.count, _ITEMSIZE.get(op0.dtype, 1), len(ops)))
        if written > self.st.streaming_min:
            builder = sched.streaming_schedules(builder)
            work.streaming = True
        self.run_schedules(work, builder, nchunks, chunk_bytes)

    def start_on_device(self, ops: list[Op]) -> None:
        """A collective on device memory: handed whole to the first allowed transport that moves that
        kind and runs collectives (``proxy_start_coll``: the cuda transport, transports/cuda_coll.py)."""
        if self.nodes.nnodes > 1:
            # the ranks stage device buffers through host memory across nodes (rank/devstage.py)
            self.failures.fail(errors.InvalidUsage.code, f"collective #{ops[0].coll_seq}: device buffers "
                               f"reached a collective across nodes unstaged")
            return
        kind = next(mem_kind(op.mem) for op in ops if op.mem)
        t = next((t for t in self.st.transports if kind in t.kinds and t.proxy_start_coll is not None), None)
        if t is None:
            self.completion.refuse_coll(ops, errors.InvalidUsage.code)
            _log.warning("collective #%d refused: no allowed transport runs collectives on %s memory "
                         "(SHMPROXY_TRANSPORTS)", ops[0].coll_seq, MemKind(kind).name.lower())
            return
        t.proxy_start_coll(self.ctx, ops)   # type: ignore[misc]  # a hook, not None here

    def run_schedules(self, work: CollWork, builder: Any, nchunks: int, chunk_bytes: int,
                      across: bool = False) -> None:
        """The collective's chunk schedules as subs of one args on the node's loopback transport."""
        op0 = work.ops[0]
        conn = (-1, -1)
        try:   # the node's collectives run on its loopback connector's transport
            transport = self.coll_connector(self.nodes.node).transport
            if transport.proxy_progress_coll is None:
                raise errors.InvalidUsage(f"transport {transport.name} runs no collectives between the ranks of "
                                          f"a node")
        except errors.InvalidUsage as exc:   # no allowed transport can: the job cannot work, say so loudly
            self.failures.fail(exc.code, str(exc))
            return
        args = self.st.argspool.get_args(conn, op0.opcount, transport)
        args.coll = work
        self.st.active.append(args)
        self.st.q[P.CTRL_OFF // 8 + P.CTRL_N_ARGS] += 1
        channels = max(1, min(self.st.copy.nworkers or 1, nchunks))
        if across:
            # Across nodes every chunk waits on the network between its local steps: the loop runs
            # those steps itself, one channel, and wakes no copy worker per chunk (each wake-up of a
            # worker on another CPU stalled the chunk behind it: docs/decisions.md, "Collectives
            # across nodes run on the loop").
            channels = 1
            builder = sched.on_loop_schedules(builder)
            work.event_driven = True
            if nchunks == 1:
                # One chunk (every small collective): its first entries start now, not a loop pass
                # later; the sub takes the schedule as it stands (advance resumes where it stopped).
                first = builder(0)
                first.advance(self.start_entry)
                builder = lambda _k: first   # noqa: E731
        per = -(-nchunks // channels)
        k0 = 0
        while k0 < nchunks:
            n = min(per, nchunks - k0)
            s = self.st.argspool.add_sub(args, work, 0, 0, n * chunk_bytes, chunk_bytes)
            s.nsteps, s.make, s.k0, s.inflight = n, builder, k0, collections.deque()
            k0 += n

    def small_coll(self, ops: list[Op]) -> bool:
        """The latency path: a Barrier, or a collective of at most COLL_INLINE_BYTES per rank, done here
        and now with one C call per copy or reduction, without numpy views or schedules (those cost
        tens of microseconds of this process's Python per small collective). Every address is resolved
        (and bounds-checked) before any byte moves. False when it does not apply: one rank, empty, a
        reduction the C kernel does not do, an in-place Reduce_scatter_block (whose blocks alias
        across the steps); the general path then runs."""
        op0 = ops[0]
        c = op0.coll
        if c == _BARRIER:
            self.completion.complete_coll(ops, 0)
            self._profile_coll(ops, 0)
            return True
        if c > _LAST_NATIVE:   # shmproxy.coll.vector's: schedules only
            return False
        size, n, itemsize = len(ops), op0.count, _ITEMSIZE.get(op0.dtype, 0)
        blk = n * itemsize
        nbytes = blk * size if c in _BLOCK_PER_RANK else blk
        if size < 2 or not 0 < nbytes <= self.coll_inline:
            return False
        if c in _WITH_REDOP and not _reduce.supported(op0.redop, op0.dtype):
            return False
        addr, copy, reduce = self.buffer_addr, _native.memcopy, _reduce.reduce
        if c == _ALLREDUCE:
            dsts = [addr(op, True, blk) for op in ops]
            srcs = [d if op.flags & FLAG_IN_PLACE else addr(op, False, blk) for op, d in zip(ops, dsts)]
            reduce(op0.redop, op0.dtype, n, srcs, dsts, False)
        elif c == _BCAST:
            root = op0.peer
            bufs = [addr(op, True, blk) for op in ops]
            for i, dst in enumerate(bufs):
                if i != root:
                    copy(dst, bufs[root], blk)
        elif c == _REDUCE:
            dst = addr(ops[op0.peer], True, blk)
            srcs = [dst if op.flags & FLAG_IN_PLACE else addr(op, False, blk) for op in ops]
            reduce(op0.redop, op0.dtype, n, srcs, [dst], False)
        elif c == _ALLGATHER:
            outs = [addr(op, True, nbytes) for op in ops]
            ins = [outs[r] + r * blk if op.flags & FLAG_IN_PLACE else addr(op, False, blk) for r, op in enumerate(ops)]
            for r, src in enumerate(ins):
                for d, out in enumerate(outs):
                    if out + r * blk != src:   # a rank's own block, in place, is already there
                        copy(out + r * blk, src, blk)
        elif c == _ALLTOALL:
            ins = [addr(op, False, nbytes) for op in ops]
            outs = [addr(op, True, nbytes) for op in ops]
            for q, out in enumerate(outs):
                for r, src in enumerate(ins):
                    copy(out + r * blk, src + q * blk, blk)
        elif c == _RSB:
            if any(op.flags & FLAG_IN_PLACE for op in ops):
                return False
            ins = [addr(op, False, nbytes) for op in ops]
            outs = [addr(op, True, blk) for op in ops]
            for d, out in enumerate(outs):
                reduce(op0.redop, op0.dtype, n, [src + d * blk for src in ins], [out], False)
        else:
            return False
        self.completion.complete_coll(ops, nbytes)
        self._profile_coll(ops, nbytes)
        return True

    def _profile_coll(self, ops: list[Op], nbytes: int, **extra: int) -> None:
        """A finished collective's span: first post to now, with the last post and fetch times."""
        if self.st.profiler.enabled:
            op0 = ops[0]
            self.st.profiler.span(f"{sched.COLL_NAMES.get(op0.coll, op0.coll)} #{op0.coll_seq}",
                                  min(op.t_post for op in ops), time.monotonic_ns(), bytes=nbytes,
                                  last_post_ns=max(op.t_post for op in ops), fetch_ns=max(op.t_fetch for op in ops),
                                  **extra)

    def buffer_of(self, op: Op, second: bool, nbytes: int) -> tuple[HostBuffer, int]:
        """(registered buffer, offset) of ``nbytes`` of an op's send (second=False) or receive
        buffer, bounds-checked."""
        key = (op.owner, op.buf2_id if second else op.buf_id)
        off = op.offset2 if second else op.offset
        buf = self.st.buffers.get(key)
        if buf is None or off + nbytes > buf.size:
            raise errors.InvalidArgument(f"{op.describe()}: buffer {key[1]} offset {off} + {nbytes} B is "
                                         f"outside the registered buffer")
        return buf, off

    def buffer_addr(self, op: Op, second: bool, nbytes: int) -> int:
        if second:
            buf, off = self.st.buffers.get((op.owner, op.buf2_id)), op.offset2
        else:
            buf, off = self.st.buffers.get((op.owner, op.buf_id)), op.offset
        if buf is None or off + nbytes > buf.size:
            buf, off = self.buffer_of(op, second, nbytes)  # raises the error
        return buf.addr + off

    def region(self, op: Op, second: bool, count: int, pins: dict) -> Region:
        """An op's send (second=False) or receive buffer as a region, bounds-checked. The buffer is
        pinned in ``pins`` (an exported view of its mapping) so that a DEREGISTER cannot unmap it
        while the collective's schedules use it (_close_retired retries until the pins are gone)."""
        dt = CODE_DTYPE.get(op.dtype)
        if dt is None:
            raise errors.InvalidArgument(f"{op.describe()}: unknown dtype code {op.dtype}")
        buf, off = self.buffer_of(op, second, count * dt.itemsize)
        if id(buf) not in pins:
            pins[id(buf)] = memoryview(buf.mm)
        return Region(buf.addr + off, count, dt)

    def build_coll(self, ops: list[Op]) -> tuple:
        """The regions of every rank's buffers and the chunk-schedule builder of one collective."""
        op0 = ops[0]
        c, n, size = op0.coll, op0.count, len(ops)
        if c > _LAST_NATIVE:
            return vector.build(self, ops, across=False)
        dt = CODE_DTYPE.get(op0.dtype)
        itemsize = dt.itemsize if dt is not None else 1
        # COLL_CHUNK_SIZE, or less when that would leave copy workers idle (a 2 MiB Allreduce in
        # 512 KiB chunks would keep 4 of 8 busy); chunks of a reduction are per rank's buffer.
        workers = max(1, self.st.copy.nworkers)
        chunk_bytes = max(self.coll_min_chunk, min(self.coll_chunk, -(-n * itemsize // workers)))
        per = max(1, chunk_bytes // itemsize)
        now = time.monotonic_ns()
        in_place = [bool(op.flags & FLAG_IN_PLACE) for op in ops]
        pins: dict = {}

        def reg(op: Op, second: bool, count: int) -> Region:
            return self.region(op, second, count, pins)

        if c == Coll.BARRIER:
            return CollWork(ops, 0, [], now), None, 0, chunk_bytes
        if c == Coll.BCAST:
            bufs = [reg(op, True, n) for op in ops]
            nchunks, make = algorithms.bcast(bufs, op0.peer, chunk_bytes)
            return CollWork(ops, n * itemsize, list(pins.values()), now), make, nchunks, chunk_bytes
        if c == Coll.ALLREDUCE:
            outs = [reg(op, True, n) for op in ops]
            ins = [outs[i] if in_place[i] else reg(op, False, n) for i, op in enumerate(ops)]
            nchunks, make = algorithms.allreduce(ins, outs, op0.redop, per)
            return CollWork(ops, n * itemsize, list(pins.values()), now), make, nchunks, per * itemsize
        if c == Coll.REDUCE:
            root = op0.peer
            out = reg(ops[root], True, n)
            ins = [out if in_place[i] else reg(op, False, n) for i, op in enumerate(ops)]
            nchunks, make = algorithms.reduce_to_root(ins, out, op0.redop, root, per)
            return CollWork(ops, n * itemsize, list(pins.values()), now), make, nchunks, per * itemsize
        if c == Coll.ALLGATHER:
            outs = [reg(op, True, n * size) for op in ops]
            ins = [outs[i].part(i * n, (i + 1) * n) if in_place[i] else reg(op, False, n) for i, op in enumerate(ops)]
            nchunks, make = algorithms.allgather(ins, outs, n * itemsize, chunk_bytes)
            return CollWork(ops, n * itemsize * size, list(pins.values()), now), make, nchunks, chunk_bytes
        if c == Coll.ALLTOALL:
            outs = [reg(op, True, n * size) for op in ops]
            ins = [reg(op, False, n * size) for op in ops]
            nchunks, make = algorithms.alltoall(ins, outs, n * itemsize, chunk_bytes)
            return CollWork(ops, n * itemsize * size, list(pins.values()), now), make, nchunks, chunk_bytes
        if c == Coll.REDUCE_SCATTER_BLOCK:
            if any(in_place) and not all(in_place):
                raise errors.InvalidUsage("Reduce_scatter_block: IN_PLACE must be used by every rank or none")
            if in_place[0]:
                full = [reg(op, True, n * size) for op in ops]
                ins, outs = full, [f.part(0, n) for f in full]
            else:
                ins = [reg(op, False, n * size) for op in ops]
                outs = [reg(op, True, n) for op in ops]
            nchunks, make = algorithms.reduce_scatter_block(ins, outs, op0.redop, per, in_place[0])
            return CollWork(ops, n * itemsize * size, list(pins.values()), now), make, nchunks, per * itemsize
        raise errors.InvalidArgument(f"unknown collective {c}")

    def start_entry(self, sch: sched.Schedule, e: sched.Entry) -> bool:
        """Start one schedule entry: True when it completed inline. SEND and RECV go through the connector
        to their peer node (this node's loopback connector within a node); the executor runs the rest."""
        if e.kind == sched.SEND or e.kind == sched.RECV:
            conn = self.coll_connector(e.peer)
            # (the connector's transport runs collectives: coll_connector found it so)
            matched = conn.transport.proxy_coll_entry(self.ctx, conn, sch, e)  # type: ignore[misc]
            for other_sch, other in matched:
                if other is not e:
                    other_sch.entry_done(other)
            return any(other is e for _s, other in matched)
        if sch.on_loop and not (self.local_workers and e.nbytes >= self.executor.inline_bytes):
            return self.executor.start_inline(sch, e)
        return self.executor.start(sch, e)

    def start_schedule(self, sch: sched.Schedule) -> bool:
        """Hand a whole chunk schedule to the executor when it can run it alone; False otherwise."""
        if sch.on_loop:
            return False
        return self.executor.start_schedule(sch)

    def start_entry_inline(self, sch: sched.Schedule, e: sched.Entry) -> bool:
        if e.kind == sched.SEND or e.kind == sched.RECV:
            return self.start_entry(sch, e)
        return self.executor.start_inline(sch, e)

    def coll_connector(self, node: int) -> Connector:
        """The connector SEND/RECV entries for ``node`` travel on: within the node its loopback
        connector (local rank 0 to itself), else the connector between the two nodes' first ranks."""
        r = self.st.ranks[0].rank
        peer = r if node in (-1, self.nodes.node) else self.nodes.map.leader(node)
        return self.connections.get(r, peer, MemKind.HOST)

    def finish_coll(self, work: CollWork) -> None:
        if work.published:   # the GPU stored the slots (engine/completion.py, coll_items)
            for op in work.ops:
                self.completion.counted(op)
            self.completion.wake_ranks(tuple(op.owner for op in work.ops))
        else:
            self.completion.complete_coll(work.ops, work.nbytes)
        if work.nbytes > self.coll_inline:
            self.completion.complete_large()
        work.views = []
        self._profile_coll(work.ops, work.nbytes, match_ns=work.t_match, streaming=int(work.streaming))
