"""Starting a collective whose ranks span nodes: MultiNodeColl, the part of the collectives component
(CollRunner.across) that does it.

Once this node's ranks have all arrived (CollRunner.coll_arrive, which checked their fingerprints),
the collective runs as chunk schedules built by shmproxy.coll.hierarchy, with SEND/RECV entries to
the other nodes' progress processes, which run the same collective (the same sequence number) for
their ranks. There is no inline path: a SEND or RECV completes when another process acts, so every
collective goes through the args the loop progresses. Chunks are NET_CHUNK_SIZE, the same on every
node, so that the entries of one chunk meet.

Mismatches between nodes: every other node tells node 0 the fingerprint of each collective it starts
(and its first rank); node 0 compares them with its own and fails the communicator naming both calls
and ranks. The fingerprints go in batches (``flush_notes``: at each heartbeat, before this node's
ranks' CLOSED, or once a note is full), not one note per collective: a note cost the sender's loop
~30 us before its first frame and the receiver's loop a reader thread's turn on the GIL, on every
small collective's path (docs/decisions.md). The check never held a collective back (a node never
waits for node 0's verdict); it now comes up to a heartbeat later. A chunk whose size differs from
its partner's is refused where it lands too (transports/net_coll.py), so a mismatch never writes
past a buffer.
"""
from __future__ import annotations

import ctypes
import json
import time
from typing import TYPE_CHECKING

import numpy as np

from shmproxy.coll import hierarchy, vector
from shmproxy.coll.sched import Region
from shmproxy.core import counts, errors, log
from shmproxy.core.ops import CODE_DTYPE, COLL_LAST_NATIVE, FLAG_IN_PLACE, Coll, Op
from shmproxy.engine.args import CollWork

if TYPE_CHECKING:  # pragma: no cover
    from shmproxy.coll.runner import CollRunner

_log = log.get("COLL")


NOTE_FINGERPRINT = 1
NOTE_MAX = 8000   # below the transports' largest control payload
NOTE_BATCH = 64   # fingerprints a node holds before it notes them (else at the next heartbeat)


class MultiNodeColl:
    def __init__(self, runner: "CollRunner"):
        self.runner = runner
        self.failures, self.nodes, self.ctx, self.params = runner.failures, runner.nodes, runner.ctx, runner.params
        self.fingerprints: dict[int, list] = {}   # node 0: seq -> (node, rank, fingerprint)s seen
        self.claims_seen: dict[int, dict] = {}    # node 0: seq -> the v-collectives' counts claimed
        self.unsent: list[list] = []              # other nodes: [seq, rank, fingerprint, claims] not noted yet

    def start(self, ops: list[Op]) -> None:
        op0 = ops[0]
        runner = self.runner
        fp = runner.fingerprint(op0)
        # The v-collectives' counts: what this node's ranks say must agree with the other nodes' ranks
        # (counts.claims), compared on node 0 with the fingerprints.
        claims = vector.claims_of(runner, ops, runner.size) if op0.coll > COLL_LAST_NATIVE else []
        if self.nodes.node == 0:
            self.fingerprint_seen(op0.coll_seq, 0, op0.rank, fp, claims)
        else:
            self.unsent.append([op0.coll_seq, op0.rank, fp, claims])
            if len(self.unsent) >= NOTE_BATCH:
                self.flush_notes()
        try:
            work, builder, nchunks, chunk_bytes = self.build(ops)
        except errors.ProxyError as exc:
            # A node that cannot take part would leave the others waiting: fail the communicator.
            self.failures.fail(exc.code, f"collective #{ops[0].coll_seq} across nodes: {exc}")
            return
        if nchunks == 0:
            runner.finish_coll(work)
            return
        runner.run_schedules(work, builder, nchunks, chunk_bytes, across=True)

    def flush_notes(self) -> None:
        """Loop, on a node but node 0: note the fingerprints not noted yet, as few notes as fit them."""
        if not self.unsent:
            return
        unsent, self.unsent = self.unsent, []
        net, ctx = self.nodes.net, self.ctx

        def note(batch: list[str]) -> None:
            net.proxy_note(ctx, 0, NOTE_FINGERPRINT, len(batch),  # type: ignore[union-attr,misc]
                           ("[" + ",".join(batch) + "]").encode())

        batch: list[str] = []
        size = 2   # the brackets
        for seq, rank, fp, claims in unsent:
            item = json.dumps([seq, rank, list(fp), claims])
            if len(item) > NOTE_MAX - 2:   # too many counts to note: a size mismatch is still refused where it lands
                item = json.dumps([seq, rank, list(fp), []])
            if batch and size + len(item) + 1 > NOTE_MAX:
                note(batch)
                batch, size = [], 2
            batch.append(item)
            size += len(item) + 1
        note(batch)

    def on_note(self, node: int, kind: int, value: int, payload: bytes) -> None:
        """Loop: another node's note (transports' proxy_note): ``value`` fingerprints."""
        if kind != NOTE_FINGERPRINT or self.nodes.node != 0:
            self.failures.fail(errors.InternalError.code, f"unexpected note {kind} from node {node}")
            return
        try:
            seen = []
            for seq, rank, fp, claims in json.loads(payload):
                seen.append((int(seq), int(rank), tuple(int(x) for x in fp),
                             [(tuple(key), int(r), int(n)) for key, r, n in claims]))
            if len(seen) != value:
                raise ValueError(f"{len(seen)} fingerprints in a note of {value}")
        except (ValueError, TypeError) as exc:
            self.failures.fail(errors.InternalError.code, f"malformed fingerprint note from node {node}: {exc!r}")
            return
        for seq, rank, fp, claims in seen:
            self.fingerprint_seen(seq, node, rank, fp, claims)

    def fingerprint_seen(self, seq: int, node: int, rank: int, fp: tuple, claims: list | None = None) -> None:
        """Node 0: compare every node's fingerprint of collective ``seq`` with the first one seen, and
        the counts its ranks claim with the other nodes' (the v-collectives)."""
        fail, describe = self.failures.fail, self.runner.describe_fingerprint
        if claims:
            seen_claims = self.claims_seen.setdefault(seq, {})
            msg = counts.check(fp[0], seq, claims, seen_claims)
            if msg is not None:
                fail(errors.InvalidUsage.code, msg)
                return
        seen = self.fingerprints.setdefault(seq, [])
        for other_node, other_rank, other_fp in seen[:1]:
            if other_fp != fp:
                fail(errors.InvalidUsage.code,
                     f"collective #{seq} mismatch: rank {other_rank} (node {other_node}) called "
                     f"{describe(other_fp)} but rank {rank} (node {node}) called {describe(fp)}")
                return
        seen.append((node, rank, fp))
        if len(seen) == self.nodes.nnodes:
            del self.fingerprints[seq]
            self.claims_seen.pop(seq, None)

    def build(self, ops: list[Op]) -> tuple:
        op0 = ops[0]
        c, n = op0.coll, op0.count
        runner, params = self.runner, self.params
        if c > COLL_LAST_NATIVE:
            return vector.build(runner, ops, across=True)
        nodes, node = self.nodes.map, self.nodes.node
        nnodes, total = nodes.nnodes, runner.size
        key = op0.coll_seq
        now = time.monotonic_ns()
        if c == Coll.BARRIER:
            nchunks, make = hierarchy.barrier(node, nnodes, key)
            return CollWork(ops, 0, [], now), make, nchunks, 1
        dt = CODE_DTYPE.get(op0.dtype)
        if dt is None:
            raise errors.InvalidArgument(f"{op0.describe()}: unknown dtype code {op0.dtype}")
        itemsize = dt.itemsize
        per_bytes = params.NET_CHUNK_SIZE
        per = max(1, per_bytes // itemsize)
        ranks = [op.rank for op in ops]
        in_place = [bool(op.flags & FLAG_IN_PLACE) for op in ops]
        pins: dict = {}

        def reg(op: Op, second: bool, count: int) -> Region:
            return runner.region(op, second, count, pins)

        def work(nbytes: int, *keep: object) -> CollWork:
            return CollWork(ops, nbytes, [*pins.values(), *keep], now)

        if c == Coll.ALLREDUCE:
            outs = [reg(op, True, n) for op in ops]
            ins = [outs[i] if in_place[i] else reg(op, False, n) for i, op in enumerate(ops)]
            nchunks, make = hierarchy.allreduce(ins, outs, op0.redop, per, node, nnodes, total, key,
                                                ring_min=params.NET_RING_MIN_BYTES)
            return work(n * itemsize), make, nchunks, per * itemsize
        if c == Coll.BCAST:
            root = op0.peer
            bufs = [reg(op, True, n) for op in ops]
            root_node = nodes.rank_node[root]
            root_local = ranks.index(root) if root_node == node else -1
            nchunks, make = hierarchy.bcast(bufs, node, root_node, root_local, nnodes, per_bytes, key)
            return work(n * itemsize), make, nchunks, per_bytes
        if c == Coll.REDUCE:
            root = op0.peer
            root_node = nodes.rank_node[root]
            root_local = ranks.index(root) if root_node == node else -1
            out = reg(ops[root_local], True, n) if root_local >= 0 else None
            ins = [out if (in_place[i] and i == root_local and out is not None) else reg(op, False, n)
                   for i, op in enumerate(ops)]
            nchunks, make = hierarchy.reduce_to_root(ins, out, op0.redop, per, node, root_node, root_local,
                                                     nnodes, total, n, dt, key)
            return work(n * itemsize), make, nchunks, per * itemsize
        if c == Coll.ALLGATHER:
            outs = [reg(op, True, n * total) for op in ops]
            ins = [outs[i].part(ranks[i] * n, (ranks[i] + 1) * n) if in_place[i] else reg(op, False, n)
                   for i, op in enumerate(ops)]
            nchunks, make = hierarchy.allgather(ins, outs, ranks, nodes.rank_node, node, n * itemsize, per_bytes, key)
            return work(n * itemsize * total), make, nchunks, per_bytes
        if c == Coll.ALLTOALL:
            outs = [reg(op, True, n * total) for op in ops]
            ins = [reg(op, False, n * total) for op in ops]
            nchunks, make = hierarchy.alltoall(ins, outs, ranks, nodes.rank_node, node, n * itemsize, per_bytes, key)
            return work(n * itemsize * total), make, nchunks, per_bytes
        if c == Coll.REDUCE_SCATTER_BLOCK:
            if any(in_place) and not all(in_place):
                raise errors.InvalidUsage("Reduce_scatter_block: IN_PLACE must be used by every rank or none")
            keep = []
            if in_place[0]:
                full = [reg(op, True, n * total) for op in ops]
                # The results land in the inputs' first blocks while other chunks still read them:
                # reduce from copies (taken now: every local rank has posted, its input is final).
                # (a ctypes array exports its buffer; numpy's stubs do not list it)
                copies = [np.frombuffer((ctypes.c_char * f.nbytes).from_address(f.addr),  # type: ignore[call-overload]
                                        dtype=dt).copy() for f in full]
                keep = copies
                ins = [Region(cp.ctypes.data, n * total, dt) for cp in copies]
                outs = [f.part(0, n) for f in full]
            else:
                ins = [reg(op, False, n * total) for op in ops]
                outs = [reg(op, True, n) for op in ops]
            nchunks, make = hierarchy.reduce_scatter_block(ins, outs, ranks, op0.redop, per, node, nnodes, total, key)
            return work(n * itemsize * total, *keep), make, nchunks, per * itemsize
        raise errors.InvalidArgument(f"unknown collective {c}")
