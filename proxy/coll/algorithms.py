"""Collective algorithms: the builders of chunk schedules (shmproxy.coll.sched) for one node's ranks.
Across nodes: shmproxy.coll.hierarchy (and vector.py for the rooted, vector and prefix collectives).

Each builder takes the ranks' buffers as regions (address, count, dtype) and returns
``(chunk_count, make)``, where ``make(k)`` builds the schedule of chunk k. ``ins[r]`` is local rank r's
send side, ``outs[r]`` its receive side. Chunks are independent, so they pipeline on the executor.

Reduction order is fixed: rank 0, 1, ... (for Reduce the root's own input first), and across nodes
node 0, 1, ..., so that results are bit-identical on every rank, run and executor.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shmproxy.coll.sched import (NOP, UFUNCS, Entry, Region, ReduceOp, Schedule, copy, native_code, reduce,
                                 reduce_all)


def _chunks(n: int, per: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + per, n)) for lo in range(0, n, per)] if n else []


def _reduce_into(ufunc: Any, out: Region, inputs: list[Region]) -> list[Entry]:
    """out = inputs[0] op inputs[1] op ...; each step waits for the previous (same output)."""
    es = [reduce(ufunc, inputs[0], inputs[1], out)]
    for x in inputs[2:]:
        es.append(reduce(ufunc, out, x, out, barrier=True))
    return es


def _finish_avg(out: Region, n: int, op: int) -> list[Entry]:
    return [reduce(np.divide, out, n, out, barrier=True, casting="unsafe")] if op == ReduceOp.AVG else []


def _native_reductions(groups: list[tuple[list[Region], list[Region]]], op: int, per: int):
    """Chunk schedules of one C-kernel REDUCE per (inputs, outputs) group: chunk k of every output of
    a group = op over chunk k of its inputs."""
    out0 = groups[0][1][0]
    n, itemsize, code = out0.count, out0.dtype.itemsize, native_code(op, out0.dtype)
    chunks = _chunks(n, per)
    addrs = [([x.addr for x in xs], [o.addr for o in os_]) for xs, os_ in groups]

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        off = lo * itemsize
        return Schedule([reduce_all(op, code, hi - lo, itemsize, [a + off for a in srcs], [a + off for a in dsts])
                         for srcs, dsts in addrs])
    return len(chunks), make


def allreduce(ins: list[Region], outs: list[Region], op: int, per: int):
    n, ufunc, size = outs[0].count, UFUNCS[op], len(outs)
    if size > 1 and native_code(op, outs[0].dtype):
        return _native_reductions([(ins, outs)], op, per)
    chunks = _chunks(n, per)

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        acc = outs[0].part(lo, hi)
        if size == 1:
            es = [] if ins[0] == outs[0] else [copy(acc.addr, ins[0].part(lo, hi).addr, acc.nbytes)]
        else:
            es = _reduce_into(ufunc, acc, [x.part(lo, hi) for x in ins])
        es += _finish_avg(acc, size, op)
        es += [copy(o.part(lo, hi).addr, acc.addr, acc.nbytes, barrier=(i == 0)) for i, o in enumerate(outs[1:])]
        return Schedule(es or [Entry(NOP)])
    return len(chunks), make


def reduce_to_root(ins: list[Region], out: Region, op: int, root: int, per: int):
    n, ufunc, size = out.count, UFUNCS[op], len(ins)
    order = [root] + [r for r in range(size) if r != root]
    if size > 1 and native_code(op, out.dtype):
        return _native_reductions([([ins[r] for r in order], [out])], op, per)
    chunks = _chunks(n, per)

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        acc = out.part(lo, hi)
        if size == 1:
            es = [] if ins[0] == out else [copy(acc.addr, ins[0].part(lo, hi).addr, acc.nbytes)]
        else:
            es = _reduce_into(ufunc, acc, [ins[r].part(lo, hi) for r in order])
        es += _finish_avg(acc, size, op)
        return Schedule(es or [Entry(NOP)])
    return len(chunks), make


def bcast(bufs: list[Region], root: int, per_bytes: int):
    src = bufs[root]
    nbytes = src.nbytes
    chunks = _chunks(nbytes, per_bytes)
    dsts = [b.addr for r, b in enumerate(bufs) if r != root and nbytes]

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        return Schedule([copy(d + lo, src.addr + lo, hi - lo) for d in dsts] or [Entry(NOP)])
    return len(chunks), make


def _block_copies(pairs: list[tuple[int, int]], block: int, per_bytes: int):
    """Copy ``block`` bytes for each (dst, src) pair of addresses, chunk by chunk."""
    chunks = _chunks(block, per_bytes)

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        return Schedule([copy(d + lo, s + lo, hi - lo) for d, s in pairs] or [Entry(NOP)])
    return len(chunks), make


def allgather(ins: list[Region], outs: list[Region], block: int, per_bytes: int):
    """outs[q] block r <- ins[r]; ins[r] may be outs[r]'s own block r (IN_PLACE: then skipped)."""
    size = len(outs)
    pairs = []
    for q in range(size):
        for r in range(size):
            dst = outs[q].addr + r * block
            if dst != ins[r].addr:
                pairs.append((dst, ins[r].addr))
    return _block_copies(pairs, block, per_bytes) if block else (0, None)


def alltoall(ins: list[Region], outs: list[Region], block: int, per_bytes: int):
    """outs[q] block r <- ins[r] block q."""
    size = len(outs)
    pairs = [(outs[q].addr + r * block, ins[r].addr + q * block) for q in range(size) for r in range(size)]
    return _block_copies(pairs, block, per_bytes) if block else (0, None)


def reduce_scatter_block(ins: list[Region], outs: list[Region], op: int, per: int, in_place: bool):
    """outs[r] = op over k of ins[k] block r.

    In place, ins[r] is rank r's recvbuf (size blocks) and outs[r] its first block, so writing rank
    r's result would destroy block 0 of its input, which rank 0's result still needs: then every
    result of a chunk is reduced into scratch memory of the progress process first (held by the
    schedule), and copied out after a barrier."""
    size, ufunc = len(outs), UFUNCS[op]
    count = outs[0].count
    if size > 1 and not in_place and native_code(op, outs[0].dtype):
        return _native_reductions([([x.part(r * count, (r + 1) * count) for x in ins], [outs[r]])
                                   for r in range(size)], op, per)
    chunks = _chunks(count, per)

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        es: list[Entry] = []
        results = []
        scratch = []
        for r in range(size):
            out = outs[r].part(lo, hi)
            if in_place:
                buf = np.empty(hi - lo, out.dtype)
                scratch.append(buf)
                acc = Region(buf.ctypes.data, hi - lo, out.dtype)
            else:
                acc = out
            blocks = [ins[x].part(r * count + lo, r * count + hi) for x in range(size)]
            if size == 1:
                es.append(copy(acc.addr, blocks[0].addr, acc.nbytes))
            else:
                es += _reduce_into(ufunc, acc, blocks)
            es += _finish_avg(acc, size, op)
            results.append((out, acc))
        if in_place:
            es += [copy(out.addr, acc.addr, acc.nbytes, barrier=(i == 0)) for i, (out, acc) in enumerate(results)]
        return Schedule(es or [Entry(NOP)], keep=scratch)
    return len(chunks), make
