"""Collective schedules, in the MPICH style, executed by the progress process.

A collective becomes, for each chunk of its data, a small *schedule*: a list of entries

    SEND / RECV   move a chunk to / from another schedule (matched by key) through a connector
    REDUCE        outs = op(ins): one call of the C kernel shm._reduce over every rank's chunk (no GIL);
                  for float16 and complex MIN/MAX (and AVG's division), a ufunc over the regions
    COPY          memcpy between registered buffers (GIL released)
    NOP           nothing (a place to hang a barrier)
    CB            a Python callback

each with a status (NOT_STARTED, STARTED, COMPLETE, FAILED) and an ``is_barrier`` flag: a barrier
entry starts only once every entry before it has completed. Entries between barriers run in
parallel on the copy workers. Chunks are independent schedules, so while chunk c copies its result
out, chunk c+1 is being reduced on another worker: the stages pipeline.

Entries name memory as *regions* (address, count, dtype): never as numpy views, so that a schedule
says what to do and an *executor* (shmproxy.coll.executor: the CPU one today, a GPU one next) does it
on the memory's own device. The algorithms that build schedules are in shmproxy.coll.algorithms.

Inside one node the progress process sees every rank's buffers, so reductions are direct (read every
input once, write the result once, copy it out). SEND/RECV are the seam for the hierarchical
multi-node schedules (local reduce, exchange between progress processes, local broadcast): they are
started on the connector to the peer node's progress process, whose transport moves the chunk; the
node's own loopback connector is the one-node case (shm: a SEND and the RECV with the same key meet
and become one copy), which is also how the hierarchy is tested within one process.

Reduction order is fixed (rank 0, 1, ...; for Reduce the root's own input first), so Allreduce
gives bit-identical results on every rank and run.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

# The collective vocabulary of op records is core's (shmproxy.core.ops), re-exported here so that
# sched.Coll, sched.ReduceOp, ... keep working.
from shmproxy.core.ops import COLL_NAMES, DTYPE_CODE, REDUCE_OP_NAMES, Coll, ReduceOp  # noqa: F401
# ... and so are the entry kinds and states, and the ranks' check of an op against a dtype
from shmproxy.core.ops import (CB, COMPLETE, COPY, FAILED, NOP, NOT_STARTED, RECV, REDUCE, SEND,  # noqa: F401
                               STARTED, check_op)
from shmproxy.shm import _reduce

KIND_NAMES = {SEND: "SEND", RECV: "RECV", REDUCE: "REDUCE", COPY: "COPY", NOP: "NOP", CB: "CB"}


UFUNCS: dict[int, Any] = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum,
                          ReduceOp.MAX: np.maximum, ReduceOp.AVG: np.add}


class Region:
    """``count`` elements of ``dtype`` at ``addr`` in the memory an executor knows (host, device)."""

    __slots__ = ("addr", "count", "dtype")

    def __init__(self, addr: int, count: int, dtype: np.dtype):
        self.addr, self.count, self.dtype = addr, count, dtype

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    def part(self, lo: int, hi: int) -> "Region":
        """Elements [lo, hi) of this region."""
        return Region(self.addr + lo * self.dtype.itemsize, hi - lo, self.dtype)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Region) and (self.addr, self.count, self.dtype) ==
                (other.addr, other.count, other.dtype))

    def __hash__(self) -> int:
        return hash((self.addr, self.count))

    def __repr__(self) -> str:
        return f"Region({self.addr:#x}, {self.count} x {self.dtype})"


class Entry:
    __slots__ = ("kind", "is_barrier", "status", "dst", "src", "nbytes", "ufunc", "a", "b", "out", "kw", "fn",
                 "key", "peer", "args", "fold", "chain")

    def __init__(self, kind: int, is_barrier: bool = False):
        self.kind, self.is_barrier, self.status = kind, is_barrier, NOT_STARTED
        self.dst = self.src = self.nbytes = 0
        self.peer = -1
        self.ufunc: Any = None
        self.a: Region | None = None                   # REDUCE (ufunc form): out = ufunc(a, b)
        self.b: Region | int | None = None
        self.out: Region | None = None
        self.fn: Callable[[], None] | None = None      # CB
        self.key: Any = None
        self.args: tuple[int, int, int, list[int], list[int]] | None = None   # REDUCE (C form)
        self.fold: tuple[int, int, int] | None = None   # RECV: (op, dtype code, first operand's address)
        self.chain = 0   # SEND, RECV: handed to its transport ahead of the schedule (core.ops.FORWARDING)
        self.kw: dict = {}

    def __repr__(self) -> str:
        return f"<{KIND_NAMES[self.kind]}{' barrier' if self.is_barrier else ''} status={self.status}>"


def copy(dst: int, src: int, nbytes: int, barrier: bool = False) -> Entry:
    e = Entry(COPY, barrier)
    e.dst, e.src, e.nbytes = dst, src, nbytes
    return e


def reduce(ufunc: Any, a: Region, b: Region | int, out: Region, barrier: bool = False, **kw: Any) -> Entry:
    """out = ufunc(a, b) as a ufunc (the dtypes and ops the C kernel does not take, and AVG's division
    by a scalar ``b``)."""
    e = Entry(REDUCE, barrier)
    e.ufunc, e.a, e.b, e.out, e.kw = ufunc, a, b, out, kw
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


def send(key: Any, peer: int, src: int, nbytes: int, barrier: bool = False) -> Entry:
    """Send ``nbytes`` at ``src`` to the schedule of node ``peer`` whose RECV has the same key."""
    e = Entry(SEND, barrier)
    e.key, e.peer, e.src, e.nbytes = key, peer, src, nbytes
    return e


def recv(key: Any, peer: int, dst: int, nbytes: int, barrier: bool = False,
         fold: tuple[int, int, int] | None = None) -> Entry:
    """Receive ``nbytes`` into ``dst`` from the SEND of node ``peer`` with the same key. ``fold`` =
    (op, dtype code, address a): land ``a op incoming`` instead (the C kernel's op and dtype: a
    receive and the reduction after it as one step, which a transport may do as the bytes arrive)."""
    e = Entry(RECV, barrier)
    e.key, e.peer, e.dst, e.nbytes, e.fold = key, peer, dst, nbytes, fold
    return e


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


def on_loop_schedules(make: Callable[[int], "Schedule"]) -> Callable[[int], "Schedule"]:
    """The builder ``make``, with every schedule it builds run by the progress loop itself (its data
    entries inline, none handed to a copy worker): for the collectives across nodes."""
    def make_on_loop(k: int) -> Schedule:
        sch = make(k)
        sch.on_loop = True
        return sch
    return make_on_loop


def native_code(op: int, dtype: np.dtype) -> int:
    """The dtype code when the C kernel reduces ``dtype`` with ``op``, else 0 (a ufunc does)."""
    code = DTYPE_CODE.get(dtype.char, 0)
    return code if code and _reduce.supported(op, code) else 0


class Schedule:
    """The entries of one chunk, started in order up to each barrier. ``keep`` holds what must live
    as long as the schedule (scratch memory its regions point into)."""

    __slots__ = ("entries", "next", "pending", "token", "streaming", "keep", "on_loop")

    def __init__(self, entries: Sequence[Entry], keep: Any = None):
        self.entries = list(entries)
        self.next = 0
        self.pending = 0
        self.token: Any = None
        self.streaming = False   # write with non-temporal stores (streaming_schedules)
        self.keep = keep
        self.on_loop = False     # run by the loop, no entry on a copy worker (on_loop_schedules)

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

    def claim(self) -> None:
        """Mark every entry started: the schedule is handed whole to one worker."""
        for e in self.entries:
            e.status = STARTED
        self.next = len(self.entries)
        self.pending = 1

    def all_done(self) -> None:
        """The worker finished the whole schedule (loop side)."""
        for e in self.entries:
            e.status = COMPLETE
        self.pending = 0
