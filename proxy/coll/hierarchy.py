"""Collectives across nodes: the chunk schedules of one node's progress process for its local ranks.

Every builder takes this node's ranks' buffers as regions (local rank order), the layout (this
node, the node of every rank) and ``key`` (the collective's sequence number, equal on every rank),
and returns ``(chunk_count, make)`` as the one-node builders of algorithms.py do. Data within the
node moves with COPY and REDUCE entries; between nodes with SEND/RECV entries whose keys
``(key, chunk, what, ...)`` meet their partners on the peer node (transports/net_socket.py). Every
node must cut the same chunks: ``per`` comes from NET_CHUNK_SIZE, a parameter every node shares.

The shapes. Each fixes the order of a reduction (local ranks in rank order, then the nodes' partials
in an order every node follows), so that every rank gets bit-identical results:

- Barrier: dissemination (round r: tell node + 2**r, hear node - 2**r), ceil(log2 n) rounds.
- Allreduce, Reduce_scatter_block (and the v-collectives' reductions, shmproxy.coll.vector): local
  reduce, then between nodes recursive doubling below NET_RING_MIN_BYTES per chunk (log2 rounds,
  pairs combining the lower node's partial first) and a ring from it (reduce-scatter, then
  allgather); each rank then takes its part.
- Reduce: a binomial tree to the root's node (the root's own input first there; each node combines
  its children nearest first).
- Bcast: a binomial tree from the root's node; each node's first rank takes the chunk, which is
  passed on to the node's children and copied to its other ranks.
- Allgather, Alltoall: every block goes straight to the node of the rank that needs it.

Every chunk is a schedule of its own and up to STEPS of them are in flight, so the local reduction of
one chunk, the network transfer of another and the local copies out of a third overlap.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shmproxy.coll.algorithms import _chunks, _finish_avg, _reduce_into
from shmproxy.coll.sched import (NOP, UFUNCS, Entry, Region, ReduceOp, Schedule, copy, native_code, recv, reduce,
                                 reduce_all, send)


def _sum_for(op: int) -> int:
    """AVG reduces as SUM and divides by the world size once, at the end."""
    return int(ReduceOp.SUM) if op == ReduceOp.AVG else op


def _local_reduce(inputs: list[Region], acc: Region, op: int) -> list[Entry]:
    """acc = op over ``inputs`` (in that order), one C call where the kernel has the reduction."""
    red = _sum_for(op)
    if len(inputs) == 1:
        return [] if inputs[0].addr == acc.addr else [copy(acc.addr, inputs[0].addr, acc.nbytes)]
    code = native_code(red, acc.dtype)
    if code:
        return [reduce_all(red, code, acc.count, acc.dtype.itemsize, [x.addr for x in inputs], [acc.addr])]
    return _reduce_into(UFUNCS[red], acc, inputs)


def _combine_into(out: Region, a: Region, b: Region, op: int) -> Entry:
    """out = a op b, after every earlier entry; ``a`` is the first operand (a NaN's payload, for one,
    follows it)."""
    red = _sum_for(op)
    code = native_code(red, out.dtype)
    if code:
        return reduce_all(red, code, out.count, out.dtype.itemsize, [a.addr, b.addr], [out.addr],
                          barrier=True)
    return reduce(UFUNCS[red], a, b, out, barrier=True)


def _combine(acc: Region, part: Region, op: int) -> Entry:
    return _combine_into(acc, acc, part, op)


def _scratch(count: int, dtype: np.dtype, keep: list) -> Region:
    buf = np.empty(count, dtype)
    keep.append(buf)
    return Region(buf.ctypes.data, count, dtype)


def _rd_exchange(acc: Region, op: int, node: int, nnodes: int, total: int, tag: tuple,
                 keep: list, src: Region | None = None) -> list[Entry]:
    """After the local reduce into ``acc``: recursive doubling between the nodes; ``acc`` holds the
    global result on every node afterwards (MPICH's allreduce for short messages). ``src``: where this
    node's partial is when no local reduce wrote it into ``acc`` (one rank, out of place: ``_partial``);
    its first send and combine then read it there, and no copy is made.

    With p the largest power of two <= nnodes, node p+i first hands its partial to node i (which
    combines it) and gets the result back at the end. Among the p nodes, round r pairs node with node
    ^ 2**r: both send their partial and combine the other's, the lower node's first, so the pair holds
    the same bits; log2(p) rounds, each one message each way at once, where a tree to node 0 costs
    two one-way trips and node 0 takes every partial in turn."""
    es: list[Entry] = []
    cur = acc if src is None else src   # where this node's partial is now
    p = 1 << (nnodes.bit_length() - 1)
    if node >= p:   # folded in: give the partial to node - p, take the result from it
        es.append(send((*tag, "fold", node), node - p, cur.addr, acc.nbytes, barrier=True))
        es.append(recv((*tag, "unfold", node), node - p, acc.addr, acc.nbytes, barrier=True))
        return es
    if node + p < nnodes:
        part = _scratch(acc.count, acc.dtype, keep)
        es.append(recv((*tag, "fold", node + p), node + p, part.addr, part.nbytes))
        es.append(_combine_into(acc, cur, part, op))
        cur = acc
    mask = 1
    while mask < p:
        peer = node ^ mask
        part = _scratch(acc.count, acc.dtype, keep)
        es.append(send((*tag, "rd", mask, peer), peer, cur.addr, acc.nbytes, barrier=True))
        es.append(recv((*tag, "rd", mask, node), peer, part.addr, part.nbytes))
        # the lower node's partial first on both nodes of the pair, so that both compute the same bits
        es.append(_combine_into(acc, part, cur, op) if peer < node else _combine_into(acc, cur, part, op))
        cur = acc
        mask <<= 1
    if cur is not acc:   # no round wrote the result (one node)
        es.append(copy(acc.addr, cur.addr, acc.nbytes, barrier=True))
    es += _finish_avg(acc, total, op)
    if node + p < nnodes:
        es.append(send((*tag, "unfold", node + p), node + p, acc.addr, acc.nbytes, barrier=True))
    return es


def binomial(rel: int, n: int) -> tuple[int, list[int]]:
    """(parent, children) of node ``rel`` in the binomial tree of ``n`` nodes rooted at 0 (MPICH's),
    numbered relative to the root; parent -1 at the root; children farthest first (the largest
    subtree first: the order a broadcast sends in; a reduction combines them nearest first). A node
    sends or takes at most log2(n) messages, where a tree of depth one puts n - 1 on the root."""
    parent, mask = -1, 1
    while mask < n:
        if rel & mask:
            parent = rel - mask
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if rel + mask < n:
            children.append(rel + mask)
        mask >>= 1
    return parent, children


def barrier(node: int, nnodes: int, key: Any):
    """The dissemination barrier: in round r every node tells node + 2**r and waits for node - 2**r;
    after ceil(log2 n) rounds each has heard, directly or not, from every other. One one-way trip at
    2 nodes, where a round trip through node 0 was two, and no node takes n - 1 messages."""
    def make(k: int) -> Schedule:
        es: list[Entry] = []
        dist, r = 1, 0
        while dist < nnodes:
            to, frm = (node + dist) % nnodes, (node - dist) % nnodes
            es.append(send((key, "d", r, to), to, 0, 0, barrier=True))   # after the previous round's news
            es.append(recv((key, "d", r, node), frm, 0, 0))
            dist, r = dist << 1, r + 1
        es.append(Entry(NOP, True))
        return Schedule(es)
    return 1, make


def _ring_exchange(acc: Region, op: int, node: int, nnodes: int, total: int, tag: tuple, keep: list,
                   src: Region | None = None) -> list[Entry]:
    """After the local reduce into ``acc``: a ring between the nodes. ``acc`` is cut into one segment
    per node; in nnodes-1 steps each node passes a segment to the next and reduces the one it gets
    from the previous (reduce-scatter: segment s ends complete on node s-1), then nnodes-1 steps pass
    the complete segments on (allgather). Every link carries 2(n-1)/n of the chunk, at once in both
    directions, where the tree sends the whole chunk up and then down. Each segment is reduced in ring
    order from a different start, once, then copied: every rank still gets the same bits.

    ``src`` (one rank, out of place: ``_partial``): this node's partial, read where it is. The first
    send and every combine of the reduce-scatter touch a segment of it for the first time (each
    segment is combined once, and the one sent first never is: it comes back complete in the
    allgather), so the ring writes ``acc`` without a copy of the input into it first."""
    nxt, prv = (node + 1) % nnodes, (node - 1) % nnodes
    bounds = [acc.count * s // nnodes for s in range(nnodes + 1)]
    seg = [acc.part(bounds[s], bounds[s + 1]) for s in range(nnodes)]
    mine = seg if src is None else [src.part(bounds[s], bounds[s + 1]) for s in range(nnodes)]
    es: list[Entry] = []
    red = _sum_for(op)
    code = native_code(red, acc.dtype)
    for step in range(nnodes - 1):       # reduce-scatter
        out_s, in_s = (node - step) % nnodes, (node - step - 1) % nnodes
        out = mine[out_s] if step == 0 else seg[out_s]   # later steps pass on what the last one combined
        es.append(send((*tag, "rs", step, nxt), nxt, out.addr, out.nbytes, barrier=True))
        if code:   # the segment combined as it lands (sched.recv's fold): no scratch, no pass after
            es.append(recv((*tag, "rs", step, node), prv, seg[in_s].addr, seg[in_s].nbytes,
                           fold=(red, code, mine[in_s].addr)))
            continue
        part = _scratch(seg[in_s].count, acc.dtype, keep)
        es.append(recv((*tag, "rs", step, node), prv, part.addr, part.nbytes))
        es.append(_combine_into(seg[in_s], mine[in_s], part, op) if seg[in_s].count else Entry(NOP, True))
    done = (node + 1) % nnodes          # the segment this node completed
    if op == ReduceOp.AVG and seg[done].count:
        es += _finish_avg(seg[done], total, op)
    for step in range(nnodes - 1):       # allgather
        out_s, in_s = (done - step) % nnodes, (done - step - 1) % nnodes
        es.append(send((*tag, "ag", step, nxt), nxt, seg[out_s].addr, seg[out_s].nbytes, barrier=True))
        es.append(recv((*tag, "ag", step, node), prv, seg[in_s].addr, seg[in_s].nbytes))
    es.append(Entry(NOP, True))
    return es


def _partial(inputs: list[Region], acc: Region, op: int) -> tuple[list[Entry], Region | None]:
    """This node's partial of one chunk: (entries of the local reduce into ``acc``, None), or, for one
    rank out of place, ([], its input): the exchange then reads the input itself (the copy into
    ``acc`` was a pass over the chunk on the loop for nothing)."""
    if len(inputs) == 1 and inputs[0].addr != acc.addr and inputs[0].count == acc.count:
        return [], inputs[0]
    return _local_reduce(inputs, acc, op), None


def allreduce(ins: list[Region], outs: list[Region], op: int, per: int, node: int, nnodes: int, total: int, key: Any,
              ring_min: int = 1 << 62):
    """Local reduce, then between nodes a ring for chunks of at least ``ring_min`` bytes, recursive
    doubling below."""
    chunks = _chunks(outs[0].count, per)

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        acc = outs[0].part(lo, hi)
        keep: list[Any] = []
        es, src = _partial([x.part(lo, hi) for x in ins], acc, op)
        exchange = _ring_exchange if acc.nbytes >= ring_min and acc.count >= nnodes else _rd_exchange
        es += exchange(acc, op, node, nnodes, total, (key, k), keep, src)
        es += [copy(o.part(lo, hi).addr, acc.addr, acc.nbytes, barrier=(i == 0)) for i, o in enumerate(outs[1:])]
        return Schedule(es or [Entry(NOP)], keep=keep)
    return len(chunks), make


def reduce_to_root(ins: list[Region], out: Region | None, op: int, per: int, node: int, root_node: int,
                   root_local: int, nnodes: int, total: int, count: int, dtype: np.dtype, key: Any):
    """``out``: the root's receive buffer (on the root's node only). A binomial tree between the nodes
    (``binomial``, numbered from the root's node): each node reduces its ranks (the root's own input
    first on its node), combines its children's partials nearest first, and sends the result to its
    parent; a fixed order, so the same bits every run."""
    chunks = _chunks(count, per)
    rel = (node - root_node) % nnodes
    parent, children = binomial(rel, nnodes)

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        keep: list = []
        if node == root_node:
            assert out is not None
            acc = out.part(lo, hi)
            order = [root_local] + [r for r in range(len(ins)) if r != root_local]
            es = _local_reduce([ins[r].part(lo, hi) for r in order], acc, op)
        else:
            acc = _scratch(hi - lo, dtype, keep)
            es = _local_reduce([x.part(lo, hi) for x in ins], acc, op)
        for child in reversed(children):   # nearest first
            src = (child + root_node) % nnodes
            part = _scratch(hi - lo, dtype, keep)
            es.append(recv((key, k, "r", src), src, part.addr, part.nbytes))
            es.append(_combine(acc, part, op))
        if parent < 0:
            es += _finish_avg(acc, total, op)
        else:
            es.append(send((key, k, "r", node), (parent + root_node) % nnodes, acc.addr, acc.nbytes, barrier=True))
        return Schedule(es or [Entry(NOP)], keep=keep)
    return len(chunks), make


def bcast(bufs: list[Region], node: int, root_node: int, root_local: int, nnodes: int, per_bytes: int, key: Any):
    """A binomial tree between the nodes (``binomial``, numbered from the root's node): a node takes
    the chunk from its parent into its first rank's buffer, passes it to its children, farthest
    first, and copies it to its other ranks meanwhile."""
    nbytes = bufs[0].nbytes
    chunks = _chunks(nbytes, per_bytes)
    rel = (node - root_node) % nnodes
    parent, children = binomial(rel, nnodes)
    kids = [(c + root_node) % nnodes for c in children]

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        n = hi - lo
        if node == root_node:
            src = bufs[root_local].addr + lo
            es = [send((key, k, "b", j), j, src, n) for j in kids]
            es += [copy(b.addr + lo, src, n) for i, b in enumerate(bufs) if i != root_local]
        else:
            dst = bufs[0].addr + lo
            es = [recv((key, k, "b", node), (parent + root_node) % nnodes, dst, n)]
            # after the chunk is in (the first entry past the receive waits for it), all at once
            es += [send((key, k, "b", j), j, dst, n, barrier=(i == 0)) for i, j in enumerate(kids)]
            es += [copy(b.addr + lo, dst, n, barrier=(i == 0 and not kids)) for i, b in enumerate(bufs[1:])]
        return Schedule(es or [Entry(NOP)])
    return len(chunks), make


def allgather(ins: list[Region], outs: list[Region], ranks: list[int], rank_node: list[int], node: int,
              block: int, per_bytes: int, key: Any):
    """outs[q] block r <- rank r's input; ``ranks``: the global ranks of this node's ins/outs."""
    size = len(rank_node)
    others = sorted({n for n in rank_node if n != node})
    remote = [r for r in range(size) if rank_node[r] != node]
    chunks = _chunks(block, per_bytes)

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        n = hi - lo
        out0 = outs[0].addr
        es: list[Entry] = []
        for q, gq in enumerate(ranks):
            src = ins[q].addr + lo
            es += [send((key, k, "g", gq), j, src, n) for j in others]
            if out0 + gq * block + lo != src:
                es.append(copy(out0 + gq * block + lo, src, n))
        es += [recv((key, k, "g", r), rank_node[r], out0 + r * block + lo, n) for r in remote]
        first = True
        for o in outs[1:]:
            for r in range(size):
                es.append(copy(o.addr + r * block + lo, out0 + r * block + lo, n, barrier=first))
                first = False
        return Schedule(es or [Entry(NOP)])
    return (len(chunks), make) if block else (0, None)


def alltoall(ins: list[Region], outs: list[Region], ranks: list[int], rank_node: list[int], node: int,
             block: int, per_bytes: int, key: Any):
    """outs[q] block r <- rank r's input block q (global ranks)."""
    size = len(rank_node)
    local_index = {g: i for i, g in enumerate(ranks)}
    chunks = _chunks(block, per_bytes)

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        n = hi - lo
        es: list[Entry] = []
        for q, gq in enumerate(ranks):
            for r in range(size):
                if rank_node[r] == node:
                    es.append(copy(outs[local_index[r]].addr + gq * block + lo, ins[q].addr + r * block + lo, n))
                else:
                    es.append(send((key, k, "a", gq, r), rank_node[r], ins[q].addr + r * block + lo, n))
                    es.append(recv((key, k, "a", r, gq), rank_node[r], outs[q].addr + r * block + lo, n))
        return Schedule(es or [Entry(NOP)])
    return (len(chunks), make) if block else (0, None)


def reduce_scatter_block(ins: list[Region], outs: list[Region], ranks: list[int], op: int, per: int, node: int,
                         nnodes: int, total: int, key: Any):
    """outs[q] = op over every rank's block ranks[q]; ``ins`` are whole vectors (total blocks each),
    never the outputs' memory (an in-place caller passes copies)."""
    count = outs[0].count
    dtype = outs[0].dtype
    itemsize = dtype.itemsize
    chunks = _chunks(count * total, per)

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        keep: list = []
        acc = _scratch(hi - lo, dtype, keep)
        es = _local_reduce([x.part(lo, hi) for x in ins], acc, op)
        es += _rd_exchange(acc, op, node, nnodes, total, (key, k), keep)
        first = True
        for q, gq in enumerate(ranks):
            a, b = max(lo, gq * count), min(hi, (gq + 1) * count)
            if a < b:
                es.append(copy(outs[q].addr + (a - gq * count) * itemsize, acc.addr + (a - lo) * itemsize,
                               (b - a) * itemsize, barrier=first))
                first = False
        return Schedule(es or [Entry(NOP)], keep=keep)
    return len(chunks), make
