"""Collective schedules, in the MPICH style, executed by the progress process.

A collective becomes, for each chunk of its data, a small *schedule*: a list of entries

    SEND / RECV   move a chunk to / from another progress process's schedule (matched by key)
    REDUCE        outs = op(ins): one call of the C kernel shm._reduce over every rank's chunk (no GIL);
                  for float16 and complex MIN/MAX, out = ufunc(a, b) on numpy views instead
    COPY          memcpy between registered buffers (GIL released)
    NOP           nothing (a place to hang a barrier)
    CB            a Python callback (e.g. the division of AVG)

each with a status (NOT_STARTED, STARTED, COMPLETE, FAILED) and an ``is_barrier`` flag: a barrier
entry starts only once every entry before it has completed. Entries between barriers run in
parallel on the copy workers. Chunks are independent schedules, so while chunk c copies its result
out, chunk c+1 is being reduced on another worker: the stages pipeline.

Inside one node the progress process sees every rank's buffers, so reductions are direct (read every
input once, write the result once, copy it out). SEND/RECV are the seam for the hierarchical
multi-node schedules (local reduce, exchange between progress processes, local broadcast): within
one process a SEND and the RECV with the same key meet in a rendezvous table and become one copy,
which is also how they are tested here.

Reduction order is fixed (rank 0, 1, ...; for Reduce the root's own input first), so Allreduce
gives bit-identical results on every rank and run.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from shmproxy.core import errors
# The collective vocabulary of op records is core's (shmproxy.core.ops), re-exported here so that
# sched.Coll, sched.ReduceOp, ... keep working.
from shmproxy.core.ops import COLL_NAMES, DTYPE_CODE, REDUCE_OP_NAMES, Coll, ReduceOp  # noqa: F401
from shmproxy.shm import _native, _reduce, _workers

SEND, RECV, REDUCE, COPY, NOP, CB = range(6)
KIND_NAMES = {SEND: "SEND", RECV: "RECV", REDUCE: "REDUCE", COPY: "COPY", NOP: "NOP", CB: "CB"}
NOT_STARTED, STARTED, COMPLETE, FAILED = range(4)


UFUNCS: dict[int, Any] = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum,
                          ReduceOp.MAX: np.maximum, ReduceOp.AVG: np.add}


def check_op(op: int, dtype: np.dtype) -> None:
    """Raise InvalidArgument when ``op`` is not defined for ``dtype`` (checked before posting)."""
    if op not in UFUNCS:
        raise errors.InvalidArgument(f"unknown reduction op {op!r}; use shmproxy.SUM, PROD, MIN, MAX or AVG")
    if dtype.kind == "b" and op not in (ReduceOp.MIN, ReduceOp.MAX):
        raise errors.InvalidArgument(f"{ReduceOp(op).name} is not defined for bool; use MIN (and) or MAX (or)")
    if op == ReduceOp.AVG and dtype.kind not in "fc":
        raise errors.InvalidArgument(f"AVG needs a floating or complex dtype, not {dtype}")


class Entry:
    __slots__ = ("kind", "is_barrier", "status", "dst", "src", "nbytes", "ufunc", "a", "b", "out", "fn", "key",
                 "args")

    def __init__(self, kind: int, is_barrier: bool = False):
        self.kind, self.is_barrier, self.status = kind, is_barrier, NOT_STARTED
        self.dst = self.src = self.nbytes = 0
        self.ufunc = self.a = self.b = self.out = self.fn = self.key = self.args = None

    def __repr__(self) -> str:
        return f"<{KIND_NAMES[self.kind]}{' barrier' if self.is_barrier else ''} status={self.status}>"


def copy(dst: int, src: int, nbytes: int, barrier: bool = False) -> Entry:
    e = Entry(COPY, barrier)
    e.dst, e.src, e.nbytes = dst, src, nbytes
    return e


def reduce(ufunc: Any, a: np.ndarray, b: np.ndarray, out: np.ndarray, barrier: bool = False) -> Entry:
    """out = ufunc(a, b) with numpy (the dtypes and ops the C kernel does not take)."""
    e = Entry(REDUCE, barrier)
    e.ufunc, e.a, e.b, e.out = ufunc, a, b, out
    e.nbytes = out.nbytes
    return e


def reduce_all(op: int, code: int, count: int, itemsize: int, srcs: list[int], dsts: list[int],
               barrier: bool = False) -> Entry:
    """dsts[j] = op over srcs, ``count`` elements at each address, in one C call (shm/_reduce.c)."""
    e = Entry(REDUCE, barrier)
    e.args = (op, code, count, srcs, dsts)
    e.nbytes = count * itemsize * len(srcs)
    return e


def callback(fn: Callable[[], None], barrier: bool = False) -> Entry:
    e = Entry(CB, barrier)
    e.fn = fn
    return e


def send(key: Any, src: int, nbytes: int, barrier: bool = False) -> Entry:
    e = Entry(SEND, barrier)
    e.key, e.src, e.nbytes = key, src, nbytes
    return e


def recv(key: Any, dst: int, nbytes: int, barrier: bool = False) -> Entry:
    e = Entry(RECV, barrier)
    e.key, e.dst, e.nbytes = key, dst, nbytes
    return e


_reduce_all = _reduce.reduce
# How many blocks of ``count`` elements a collective of ``p`` ranks writes, all outputs together
_BLOCKS_WRITTEN: dict[int, Callable[[int], int]] = {
    Coll.BARRIER: lambda p: 0, Coll.BCAST: lambda p: p - 1, Coll.REDUCE: lambda p: 1,
    Coll.ALLREDUCE: lambda p: p, Coll.ALLGATHER: lambda p: p * p, Coll.REDUCE_SCATTER_BLOCK: lambda p: p,
    Coll.ALLTOALL: lambda p: p * p}


def written_bytes(coll: int, count: int, itemsize: int, size: int) -> int:
    """Bytes a collective of ``count`` elements (the op records' count) writes into all ``size`` ranks'
    outputs together: what decides whether it streams (streaming_schedules)."""
    return count * itemsize * _BLOCKS_WRITTEN[coll](size)


def streaming_schedules(make: Callable[[int], "Schedule"]) -> Callable[[int], "Schedule"]:
    """The builder ``make``, with every schedule it builds writing through non-temporal stores: for
    collectives whose outputs outgrow the cache (the progress process decides: engine/policy.py)."""
    def make_streaming(k: int) -> Schedule:
        sch = make(k)
        sch.streaming = True
        return sch
    return make_streaming


def native_code(op: int, dtype: np.dtype) -> int:
    """The dtype code when the C kernel reduces ``dtype`` with ``op``, else 0 (numpy does)."""
    code = DTYPE_CODE.get(dtype.char, 0)
    return code if code and _reduce.supported(op, code) else 0


def execute(e: Entry, streaming: bool = False) -> None:
    """Run one data entry (in a copy worker or inline), writing with non-temporal stores if
    ``streaming`` (COPY and C-kernel REDUCE). SEND/RECV never get here."""
    k = e.kind
    if k == COPY:
        (_native.memcopy_nt if streaming else _native.memcopy)(e.dst, e.src, e.nbytes)
    elif k == REDUCE:
        if e.args is not None:
            _reduce_all(*e.args, streaming)
        else:
            e.ufunc(e.a, e.b, out=e.out)
    elif k == CB:
        e.fn()
    elif k != NOP:
        raise errors.InternalError(f"entry {e!r} cannot be executed directly")


def native_step(e: Entry) -> tuple | None:
    """The entry as a step of the C workers (shm/_workers.c), or None when it needs Python."""
    if e.kind == COPY:
        return (_workers.COPY, e.dst, e.src, e.nbytes)
    if e.kind == REDUCE and e.args is not None:
        return (_workers.REDUCE, *e.args)
    return None


class Schedule:
    """The entries of one chunk, started in order up to each barrier."""

    __slots__ = ("entries", "next", "pending", "token", "streaming")

    def __init__(self, entries: Sequence[Entry]):
        self.entries = list(entries)
        self.next = 0
        self.pending = 0
        self.token: Any = None
        self.streaming = False   # write with non-temporal stores (streaming_schedules)

    @property
    def complete(self) -> bool:
        return self.next == len(self.entries) and self.pending == 0

    def advance(self, start: Callable[["Schedule", Entry], bool]) -> bool:
        """Start every entry that may start; ``start`` returns True when it finished inline.
        Returns True once the whole schedule is complete."""
        entries = self.entries
        while self.next < len(entries):
            e = entries[self.next]
            if e.is_barrier and self.pending:
                break
            self.next += 1
            e.status = STARTED
            if start(self, e):
                e.status = COMPLETE
            else:
                self.pending += 1
        return self.next == len(entries) and self.pending == 0

    def entry_done(self, e: Entry) -> None:
        e.status = COMPLETE
        self.pending -= 1

    @property
    def local_only(self) -> bool:
        """True when no entry needs another schedule (no SEND/RECV): it can run start to end on
        one worker, which keeps a chunk's result in that core's cache for the copies out."""
        return all(e.kind != SEND and e.kind != RECV for e in self.entries)

    def native_steps(self) -> list[tuple] | None:
        """Every data entry as a C worker step, in order (NOPs dropped), or None when one needs Python."""
        steps = []
        for e in self.entries:
            if e.kind == NOP:
                continue
            step = native_step(e)
            if step is None:
                return None
            steps.append(step)
        return steps

    def claim(self) -> None:
        """Mark every entry started: the schedule is handed whole to one worker."""
        for e in self.entries:
            e.status = STARTED
        self.next = len(self.entries)
        self.pending = 1

    def run_all(self) -> None:
        """Execute every entry in order (each barrier is trivially respected). Worker side."""
        for e in self.entries:
            execute(e, self.streaming)

    def all_done(self) -> None:
        """The worker finished ``run_all`` (loop side)."""
        for e in self.entries:
            e.status = COMPLETE
        self.pending = 0


class Rendezvous:
    """Where a SEND meets the RECV of the same key (one progress process: the loopback form)."""

    def __init__(self) -> None:
        self.waiting: dict[Any, tuple[Schedule, Entry]] = {}

    def offer(self, sched: Schedule, e: Entry) -> list[tuple[Schedule, Entry]]:
        """Register a started SEND/RECV; when its partner is there, copy and return both (to be
        marked complete by the caller)."""
        other = self.waiting.pop(e.key, None)
        if other is None:
            self.waiting[e.key] = (sched, e)
            return []
        osched, oe = other
        snd, rcv = (e, oe) if e.kind == SEND else (oe, e)
        if snd.kind != SEND or rcv.kind != RECV or snd.nbytes != rcv.nbytes:
            raise errors.InternalError(f"schedule rendezvous {e.key!r} pairs {snd!r} with {rcv!r}")
        _native.memcopy(rcv.dst, snd.src, snd.nbytes)
        return [(sched, e), (osched, oe)]


# ---------------------------------------------------------------------------------- builders
# Each builder returns (chunk_count, make) where make(k) builds the schedule of chunk k. Views are
# numpy arrays over registered memory, one per local rank: ins[r] (send side), outs[r] (receive side).

def _chunks(n: int, per: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + per, n)) for lo in range(0, n, per)] if n else []


def _addr(a: np.ndarray) -> int:
    return _native.buffer_info(a, False)[0]


def _reduce_into(ufunc: Any, out: np.ndarray, inputs: list[np.ndarray]) -> list[Entry]:
    """out = inputs[0] op inputs[1] op ...; each step waits for the previous (same output)."""
    es = [reduce(ufunc, inputs[0], inputs[1], out)]
    for x in inputs[2:]:
        es.append(reduce(ufunc, out, x, out, barrier=True))
    return es


def _finish_avg(out: np.ndarray, n: int, op: int) -> list[Entry]:
    if op != ReduceOp.AVG:
        return []

    def divide() -> None:
        np.divide(out, n, out=out, casting="unsafe")
    return [callback(divide, barrier=True)]


def _native_reductions(groups: list[tuple[list[np.ndarray], list[np.ndarray]]], op: int, per: int):
    """Chunk schedules of one C-kernel REDUCE per (inputs, outputs) group: chunk k of every output of
    a group = op over chunk k of its inputs. Addresses are taken once; a chunk only offsets them."""
    out0 = groups[0][1][0]
    n, itemsize, code = out0.size, out0.itemsize, native_code(op, out0.dtype)
    chunks = _chunks(n, per)
    addrs = [([_addr(x) for x in xs], [_addr(o) for o in os_]) for xs, os_ in groups] if n else []

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        off = lo * itemsize
        return Schedule([reduce_all(op, code, hi - lo, itemsize, [a + off for a in srcs], [a + off for a in dsts])
                         for srcs, dsts in addrs])
    return len(chunks), make


def allreduce(ins: list[np.ndarray], outs: list[np.ndarray], op: int, per: int):
    n, ufunc, size = outs[0].size, UFUNCS[op], len(outs)
    if size > 1 and native_code(op, outs[0].dtype):
        return _native_reductions([(ins, outs)], op, per)
    chunks = _chunks(n, per)

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        acc = outs[0][lo:hi]
        if size == 1:
            es = [] if ins[0] is outs[0] else [copy(_addr(acc), _addr(ins[0][lo:hi]), acc.nbytes)]
        else:
            es = _reduce_into(ufunc, acc, [x[lo:hi] for x in ins])
        es += _finish_avg(acc, size, op)
        es += [copy(_addr(o[lo:hi]), _addr(acc), acc.nbytes, barrier=(i == 0)) for i, o in enumerate(outs[1:])]
        return Schedule(es or [Entry(NOP)])
    return len(chunks), make


def reduce_to_root(ins: list[np.ndarray], out: np.ndarray, op: int, root: int, per: int):
    n, ufunc, size = out.size, UFUNCS[op], len(ins)
    order = [root] + [r for r in range(size) if r != root]
    if size > 1 and native_code(op, out.dtype):
        return _native_reductions([([ins[r] for r in order], [out])], op, per)
    chunks = _chunks(n, per)

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        acc = out[lo:hi]
        if size == 1:
            es = [] if ins[0] is out else [copy(_addr(acc), _addr(ins[0][lo:hi]), acc.nbytes)]
        else:
            es = _reduce_into(ufunc, acc, [ins[r][lo:hi] for r in order])
        es += _finish_avg(acc, size, op)
        return Schedule(es or [Entry(NOP)])
    return len(chunks), make


def bcast(bufs: list[np.ndarray], root: int, per_bytes: int):
    src = bufs[root]
    nbytes = src.nbytes
    chunks = _chunks(nbytes, per_bytes)
    base = _addr(src) if nbytes else 0
    dsts = [_addr(b) for r, b in enumerate(bufs) if r != root and nbytes]

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        return Schedule([copy(d + lo, base + lo, hi - lo) for d in dsts] or [Entry(NOP)])
    return len(chunks), make


def _block_copies(pairs: list[tuple[int, int]], block: int, per_bytes: int):
    """Copy ``block`` bytes for each (dst, src) pair, chunk by chunk."""
    chunks = _chunks(block, per_bytes)

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        return Schedule([copy(d + lo, s + lo, hi - lo) for d, s in pairs] or [Entry(NOP)])
    return len(chunks), make


def allgather(ins: list[np.ndarray], outs: list[np.ndarray], block: int, per_bytes: int):
    """outs[q] block r <- ins[r]; ins[r] may be outs[r]'s own block r (IN_PLACE: then skipped)."""
    size = len(outs)
    pairs = []
    for q in range(size):
        for r in range(size):
            dst = _addr(outs[q]) + r * block
            src = _addr(ins[r])
            if dst != src:
                pairs.append((dst, src))
    return _block_copies(pairs, block, per_bytes) if block else (0, None)


def alltoall(ins: list[np.ndarray], outs: list[np.ndarray], block: int, per_bytes: int):
    """outs[q] block r <- ins[r] block q."""
    size = len(outs)
    pairs = [(_addr(outs[q]) + r * block, _addr(ins[r]) + q * block) for q in range(size) for r in range(size)]
    return _block_copies(pairs, block, per_bytes) if block else (0, None)


def reduce_scatter_block(ins: list[np.ndarray], outs: list[np.ndarray], op: int, per: int, in_place: bool):
    """outs[r] = op over k of ins[k] block r.

    In place, ins[r] is rank r's recvbuf (size blocks) and outs[r] its first block, so writing rank
    r's result would destroy block 0 of its input, which rank 0's result still needs: then every
    result of a chunk is reduced into scratch memory of the progress process first, and copied out
    after a barrier."""
    size, ufunc = len(outs), UFUNCS[op]
    count = outs[0].size
    if size > 1 and not in_place and native_code(op, outs[0].dtype):
        return _native_reductions([([x[r * count:(r + 1) * count] for x in ins], [outs[r]]) for r in range(size)],
                                  op, per)
    chunks = _chunks(count, per)

    def make(k: int) -> Schedule:
        lo, hi = chunks[k]
        es: list[Entry] = []
        results = []
        for r in range(size):
            out = outs[r][lo:hi]
            acc = np.empty_like(out) if in_place else out
            blocks = [ins[x][r * count + lo: r * count + hi] for x in range(size)]
            if size == 1:
                es.append(copy(_addr(acc), _addr(blocks[0]), acc.nbytes))
            else:
                es += _reduce_into(ufunc, acc, blocks)
            es += _finish_avg(acc, size, op)
            results.append((out, acc))
        if in_place:
            es += [copy(_addr(out), _addr(acc), acc.nbytes, barrier=(i == 0))
                   for i, (out, acc) in enumerate(results)]
            # the scratch arrays must live until the copies ran
            es.append(callback(lambda: results.clear(), barrier=True))
        return Schedule(es or [Entry(NOP)])
    return len(chunks), make
