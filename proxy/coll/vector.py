"""Gather, Scatter, Gatherv, Scatterv, Allgatherv, Alltoallv, Reduce_scatter (with counts), Scan and
Exscan: their checks and chunk schedules, within one node and across nodes.

The builders here are node-aware: each node's progress process builds the schedules of its own
ranks, with COPY and REDUCE entries within the node and SEND/RECV entries (keys ``(seq, chunk, ...)``)
to the other nodes. Within one node (``nnodes`` 1, every rank local) they reduce to COPY and
REDUCE entries only, so one builder serves both: the one-node runner (shmproxy.coll.runner) and the
across-nodes one (shmproxy.coll.multinode).

- Block movers (Gather .. Alltoallv): every (source rank, destination rank) block, from the two
  ranks' own arguments (shmproxy.core.counts.sends/recvs), cut in chunks of ``per_bytes``: a COPY
  when both ranks are local, else a SEND on the source's node and a RECV on the destination's. A
  zero-sized block moves nothing on either side; both sides agree on the size (counts.check).
- Reduce_scatter: the whole vector reduced as Allreduce does (local ranks in rank order, partials to
  node 0, combined in node order, the result back), each rank then takes its block.
- Scan, Exscan: node 0 takes every rank's input (RECV for the other nodes' ranks), computes each
  rank's prefix in rank order into scratch memory, and hands each rank its prefix (COPY, or SEND to
  its node). A strict left fold in rank order, so results are bit-identical on every rank and run;
  prefixes go to scratch first, so IN_PLACE inputs are read before any output is written.
"""
from __future__ import annotations

import ctypes
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from shmproxy.core import counts
from shmproxy.coll.algorithms import _chunks, _finish_avg
from shmproxy.coll.hierarchy import _combine_into, _local_reduce, _rd_exchange, _scratch
from shmproxy.coll.sched import NOP, Entry, Region, Schedule, copy, recv, send
from shmproxy.core import errors
from shmproxy.core.ops import CODE_DTYPE, COLL_NAMES, COLL_WITH_COUNTS, FLAG_IN_PLACE, FLAG_NO_RECV, Coll, Op
from shmproxy.engine.args import CollWork

if TYPE_CHECKING:  # pragma: no cover
    from shmproxy.coll.runner import CollRunner


# ------------------------------------------------------------------------------ the runner's side
def views(buffers: Mapping[tuple[int, int], Any], ops: list[Op], size: int) -> list[counts.View]:
    """Every op's arguments, its counts table copied out of the rank's staging buffer (in ``buffers``,
    the registered buffers, under the op's tag)."""
    out = []
    for op in ops:
        table = None
        if op.coll in COLL_WITH_COUNTS:
            table = counts.read(buffers.get((op.owner, op.tag)), size, op.describe())
        out.append(counts.View(op.rank, op.count, bool(op.flags & FLAG_IN_PLACE), table))
    return out


def claims_of(runner: "CollRunner", ops: list[Op], size: int) -> list[tuple]:
    return counts.claims(ops[0].coll, views(runner.st.buffers, ops, size), ops[0].peer, size)


def check(runner: "CollRunner", ops: list[Op], size: int) -> bool:
    """The counts of these (local) ranks agree with each other; else the communicator fails naming
    both ranks (their sequences of collectives cannot be trusted to line up any more)."""
    op0 = ops[0]
    try:
        msg = counts.check(op0.coll, op0.coll_seq, claims_of(runner, ops, size))
    except errors.ProxyError as exc:
        msg = f"collective #{op0.coll_seq} {COLL_NAMES.get(op0.coll, op0.coll)}: {exc}"
    if msg is None:
        return True
    runner.failures.fail(errors.InvalidUsage.code, msg)
    return False


def regions(resolve: Callable[[Op, bool, int], Region]) -> Callable[[Op, bool], Region]:
    """``reg(op, second)``: an op's whole buffer (second: its receive buffer) as its record declares
    it, resolved by ``resolve(op, second, nbytes)`` once per (rank, side)."""
    cache: dict = {}

    def reg(op: Op, second: bool) -> Region:
        key = (op.rank, second)
        if key not in cache:
            if second and op.flags & FLAG_NO_RECV:
                raise errors.InvalidArgument(f"{op.describe()}: no receive buffer")
            cache[key] = resolve(op, second, op.nbytes2 if second else op.nbytes)
        return cache[key]
    return reg


def build(runner: "CollRunner", ops: list[Op], across: bool) -> tuple:
    """(work, make, nchunks, chunk_bytes) of one of these collectives, for this node's ranks."""
    op0 = ops[0]
    c = op0.coll
    dt = CODE_DTYPE.get(op0.dtype)
    if dt is None:
        raise errors.InvalidArgument(f"{op0.describe()}: unknown dtype code {op0.dtype}")
    isz = dt.itemsize
    if across:
        nodes = runner.nodes
        size, node, nnodes, rank_node = runner.size, nodes.node, nodes.nnodes, nodes.map.rank_node
        per_bytes = runner.params.NET_CHUNK_SIZE
    else:
        size, node, nnodes, rank_node = len(ops), 0, 1, [0] * len(ops)
        workers = max(1, runner.st.copy.nworkers)
        per_bytes = max(runner.coll_min_chunk, min(runner.coll_chunk, -(-max(op0.count, 1) * isz // workers)))
    per = max(1, per_bytes // isz)
    vs = views(runner.st.buffers, ops, size)
    now = time.monotonic_ns()
    pins: dict = {}
    reg = regions(lambda op, second, nbytes: runner.region(op, second, nbytes // isz, pins))

    seq = op0.coll_seq
    if c in counts.MOVES:
        local, outgoing, incoming, moved = _plan_moves(c, ops, vs, op0.peer, size, rank_node, reg, isz)
        nchunks, make = moves(local, outgoing, incoming, per * isz, seq)
        return CollWork(ops, moved, list(pins.values()), now), make, nchunks, per * isz
    ranks = [op.rank for op in ops]
    if c == Coll.REDUCE_SCATTER:
        t = vs[0].table
        assert t is not None
        rc, rd = [int(x) for x in t[counts.RCOUNTS]], [int(x) for x in t[counts.RDISPLS]]
        total = sum(rc)
        keep: list = []
        ins, outs = [], []
        for op, v in zip(ops, vs):
            full = reg(op, v.in_place)
            if full.count < total:
                raise errors.InvalidArgument(f"{op.describe()}: {full.count} elements, the counts add up to "
                                             f"{total}")
            if v.in_place:   # outputs overwrite inputs that other chunks still read: reduce from a copy
                # (a ctypes array exports its buffer; numpy's stubs do not list it)
                raw = (ctypes.c_char * (total * isz)).from_address(full.addr)
                cp = np.frombuffer(raw, dtype=dt).copy() if total else np.empty(0, dt)  # type: ignore[call-overload]
                keep.append(cp)
                ins.append(Region(cp.ctypes.data, total, dt))
            else:
                ins.append(full.part(0, total))
            out = reg(op, True)
            if out.count < rc[op.rank]:
                raise errors.InvalidArgument(f"{op.describe()}: recvbuf of {out.count} elements for "
                                             f"{rc[op.rank]}")
            outs.append(out)
        nchunks, make = reduce_scatter(ins, outs, ranks, rc, rd, op0.redop, per, node, nnodes, size, seq)
        return CollWork(ops, total * isz, [*pins.values(), *keep], now), make, nchunks, per * isz
    if c in (Coll.SCAN, Coll.EXSCAN):
        n = op0.count
        ins_d, outs_d = {}, {}
        for op, v in zip(ops, vs):
            out = reg(op, True)
            inp = out if v.in_place else reg(op, False)
            if out.count < n or inp.count < n:
                raise errors.InvalidArgument(f"{op.describe()}: buffers of fewer than {n} elements")
            ins_d[op.rank], outs_d[op.rank] = inp.part(0, n), out.part(0, n)
        nchunks, make = scan(ins_d, outs_d, size, rank_node, node, op0.redop, per, n, dt, c == Coll.EXSCAN,
                             seq)
        return CollWork(ops, n * isz, list(pins.values()), now), make, nchunks, per * isz
    raise errors.InvalidArgument(f"unknown collective {c}")


def _plan_moves(c: int, ops: list[Op], vs: list[counts.View], root: int, size: int, rank_node: list[int],
                reg: Any, isz: int) -> tuple:
    """Every block this node's ranks send or receive: local copies (dst, src, bytes), outgoing
    (key, node, src, bytes) and incoming (key, node, dst, bytes); every block bounds-checked."""
    local_op = {op.rank: op for op in ops}
    recv_of = {v.rank: {src: (off, n) for src, off, n in counts.recvs(c, v, root, size)} for v in vs}
    local, outgoing, incoming = [], [], []
    moved = 0

    def at(region: Region, off: int, n: int, op: Op, what: str) -> int:
        if off + n > region.count:
            raise errors.InvalidArgument(f"{op.describe()}: {what} block of {n} elements at {off} is outside "
                                         f"its buffer of {region.count}")
        return region.addr + off * isz

    for op, v in zip(ops, vs):
        from_recv, blocks = counts.sends(c, v, root, size)
        for q, off, n in blocks:
            if not n:
                continue
            src = at(reg(op, from_recv), off, n, op, "send")
            moved += n * isz
            if q in local_op:
                got = recv_of[q].get(op.rank)
                if got is None or got[1] != n:
                    raise errors.InvalidUsage(f"{op.describe()}: rank {q} does not receive {n} elements from "
                                              f"rank {op.rank}")
                dst = at(reg(local_op[q], True), got[0], n, local_op[q], "receive")
                if dst != src:
                    local.append((dst, src, n * isz))
            else:
                outgoing.append(((op.rank, q), rank_node[q], src, n * isz))
    for op, v in zip(ops, vs):
        for r, off, n in counts.recvs(c, v, root, size):
            if n and r not in local_op:
                dst = at(reg(op, True), off, n, op, "receive")
                incoming.append(((r, op.rank), rank_node[r], dst, n * isz))
    return local, outgoing, incoming, moved


# ------------------------------------------------------------------------------ builders
def moves(local: list[tuple[int, int, int]], outgoing: list[tuple], incoming: list[tuple], per_bytes: int,
          seq: int):
    """Chunk k moves bytes [k * per_bytes, (k + 1) * per_bytes) of every block that long. A SEND/RECV key
    holds the chunk's size: where two nodes disagree on a block, their entries never meet (so no
    chunk lands in a buffer of another size) and node 0's check of the counts fails the communicator
    with a message naming both ranks."""
    longest = max([n for *_x, n in local] + [n for *_x, n in outgoing] + [n for *_x, n in incoming] + [0])
    nchunks = -(-longest // per_bytes)

    def make(k: int) -> Schedule:
        lo = k * per_bytes
        es: list[Entry] = []
        for key, node, src, n in outgoing:
            if n > lo:
                m = min(per_bytes, n - lo)
                es.append(send((seq, k, "v", *key, m), node, src + lo, m))
        for key, node, dst, n in incoming:
            if n > lo:
                m = min(per_bytes, n - lo)
                es.append(recv((seq, k, "v", *key, m), node, dst + lo, m))
        es += [copy(d + lo, s + lo, min(per_bytes, n - lo)) for d, s, n in local if n > lo]
        return Schedule(es or [Entry(NOP)])
    return nchunks, make


def reduce_scatter(ins: list[Region], outs: list[Region], ranks: list[int], rc: list[int], rd: list[int],
                   op: int, per: int, node: int, nnodes: int, world: int, seq: int):
    """outs[q] = op over every rank's elements [rd[g], rd[g] + rc[g]) of the vector, g = ranks[q]; ``ins``
    are whole vectors, never the outputs' memory (an in-place caller passes copies)."""
    total = sum(rc)
    dtype = outs[0].dtype if outs else ins[0].dtype
    isz = dtype.itemsize
    chunks = _chunks(total, per)

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        keep: list = []
        acc = _scratch(hi - lo, dtype, keep)
        es = _local_reduce([x.part(lo, hi) for x in ins], acc, op)
        if nnodes > 1:
            es += _rd_exchange(acc, op, node, nnodes, world, (seq, k, total), keep)
        else:
            es += _finish_avg(acc, world, op)
        first = True
        for q, g in enumerate(ranks):
            a, b = max(lo, rd[g]), min(hi, rd[g] + rc[g])
            if a < b:
                es.append(copy(outs[q].addr + (a - rd[g]) * isz, acc.addr + (a - lo) * isz, (b - a) * isz,
                               barrier=first))
                first = False
        return Schedule(es or [Entry(NOP)], keep=keep)
    return len(chunks), make


def scan(ins: dict[int, Region], outs: dict[int, Region], size: int, rank_node: list[int], node: int, op: int,
         per: int, count: int, dtype: np.dtype, exclusive: bool, seq: int):
    """Prefix reductions in rank order (``ins``/``outs``: this node's ranks, by global rank)."""
    chunks = _chunks(count, per)
    firsts = 1 if exclusive else 0   # the first rank that gets a result

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        n = hi - lo
        keep: list = []
        es: list[Entry] = []
        if node != 0:   # inputs to node 0, results back
            for r, x in ins.items():
                es.append(send((seq, k, "si", r), 0, x.addr + lo * dtype.itemsize, n * dtype.itemsize))
            first = True
            for r, o in outs.items():
                if r >= firsts:
                    es.append(recv((seq, k, "so", r), 0, o.addr + lo * dtype.itemsize, n * dtype.itemsize,
                                   barrier=first))
                    first = False
            return Schedule(es or [Entry(NOP)], keep=keep)
        src: list[Region] = []
        for r in range(size):
            if r in ins:
                src.append(ins[r].part(lo, hi))
            else:
                s = _scratch(n, dtype, keep)
                es.append(recv((seq, k, "si", r), rank_node[r], s.addr, s.nbytes))
                src.append(s)
        pre: list[Region | None] = [None] * size
        if exclusive:
            if size > 1:
                pre[1] = src[0]
            for r in range(2, size):
                pre[r] = _scratch(n, dtype, keep)
                es.append(_combine_into(pre[r], pre[r - 1], src[r - 1], op))   # type: ignore[arg-type]
        else:
            pre[0] = src[0]
            for r in range(1, size):
                pre[r] = _scratch(n, dtype, keep)
                es.append(_combine_into(pre[r], pre[r - 1], src[r], op))   # type: ignore[arg-type]
        first = True
        for r in range(firsts, size):
            p = pre[r]
            assert p is not None
            if r in outs:
                o = outs[r].part(lo, hi)
                if o.addr != p.addr:
                    es.append(copy(o.addr, p.addr, p.nbytes, barrier=first))
                    first = False
            else:
                es.append(send((seq, k, "so", r), rank_node[r], p.addr, p.nbytes, barrier=first))
                first = False
        return Schedule(es or [Entry(NOP)], keep=keep)
    return len(chunks), make
