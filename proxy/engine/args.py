"""Progress-side work items: transfers, args and subs, and the pool that recycles them.

A *transfer* is one matched message (a send op and the receive op it matched). Its bytes are moved by
one or more *subs* (one per channel: a large message is split so that several copy workers share it).
Subs of transfers on the same (connection, opCount) are appended to one *args*, as NCCL batches the
ops of one group call; an args walks Ready -> Progress -> None and returns to the pool when all its
subs are done. Each sub owns a slot of the pool's sub table, where its counters are mirrored for the
dump tool (one writer: the progress loop).

No allocation on the hot path: Args and Sub objects are made in blocks and recycled.
"""
from __future__ import annotations

from typing import Any

from shmproxy.core.errors import InternalError
from shmproxy.shm import pool as P

READY, PROGRESS, NONE = P.SUB_READY, P.SUB_PROGRESS, P.SUB_NONE
BLOCK = 64


class Transfer:
    """One matched message: completes both requests when its last sub is done."""

    __slots__ = ("send", "recv", "nbytes", "parts_left", "t_match", "t_started", "published")

    def __init__(self, send: Any, recv: Any, nbytes: int, t_match: int):
        self.send, self.recv, self.nbytes = send, recv, nbytes
        self.parts_left = 0
        self.t_match = t_match
        self.t_started = 0       # when its transport's proxy_start returned (profiling only)
        self.published = False   # its slots are published by its transport (Completion.completion_items)

    def finish(self, completion: Any) -> None:
        completion.finish_transfer(self)


class CollWork:
    """One collective (every local rank's op): completes all their requests when its last sub is
    done. ``views`` keeps the numpy views over registered memory alive while schedules use them."""

    __slots__ = ("ops", "nbytes", "parts_left", "views", "t_match", "send", "recv", "streaming", "published",
                 "event_driven")

    def __init__(self, ops: list, nbytes: int, views: list, t_match: int):
        self.ops, self.nbytes, self.views, self.t_match = ops, nbytes, views, t_match
        self.parts_left = 0
        self.streaming = False   # written with non-temporal stores (policy.streaming_threshold)
        self.published = False   # its slots are published by a GPU graph (Completion.coll_items)
        self.event_driven = False   # moves only on loop events (across nodes): the loop may sleep for them
        self.send = self.recv = ops[0]  # what the sub table shows (kind, rank, peer=root, tag)

    def finish(self, completion: Any) -> None:
        completion.coll_finished(self)   # the collective runner's (coll/runner.py: it registers it)


class Sub:
    """One channel of an args. For a message: a contiguous byte range moved in chunks. For a
    collective: chunk schedules k0 .. k0+nsteps-1 built by ``make`` (``inflight`` in order)."""

    __slots__ = ("slot", "transfer", "src", "dst", "nbytes", "chunk", "nsteps",
                 "posted", "transmitted", "received", "done", "make", "k0", "inflight", "mirrored")

    def reset(self, slot: int, transfer: Any, src: int, dst: int, nbytes: int, chunk: int) -> None:
        self.slot, self.transfer, self.src, self.dst = slot, transfer, src, dst
        self.nbytes, self.chunk = nbytes, chunk
        self.nsteps = (nbytes + chunk - 1) // chunk
        self.posted = self.transmitted = self.received = self.done = 0
        self.mirrored = (0, 0, 0, 0)   # the counters as the sub table holds them (add_sub, mirror)
        self.make: Any = None   # a collective's: chunk k -> its schedule
        self.k0 = 0
        self.inflight: Any = None   # a collective's: its chunk schedules in flight, in order (a deque)

    def chunk_done(self) -> None:
        """A copy worker finished one of this sub's chunks (called by the loop, single writer)."""
        self.transmitted += 1


class Args:
    __slots__ = ("id", "state", "conn", "opcount", "subs", "transport", "coll")

    def __init__(self) -> None:
        self.subs: list[Sub] = []
        self.id = 0
        self.state = READY
        self.conn: tuple[int, int] = (-1, -1)
        self.opcount = 0
        self.transport: Any = None
        self.coll: CollWork | None = None


class ArgsPool:
    """Args and Sub objects grown in blocks and recycled; sub-table slots managed alongside."""

    def __init__(self, view: P.PoolView):
        self.view = view
        self.free_args: list[Args] = []
        self.free_subs: list[Sub] = []
        self.free_slots = list(range(view.layout.max_subs - 1, -1, -1))
        self.next_id = 1
        self.allocated_args = 0

    def get_args(self, conn: tuple[int, int], opcount: int, transport: Any) -> Args:
        if not self.free_args:
            self.free_args.extend(Args() for _ in range(BLOCK))
            self.allocated_args += BLOCK
        a = self.free_args.pop()
        a.id, a.state, a.conn, a.opcount, a.transport = self.next_id, READY, conn, opcount, transport
        a.coll = None
        self.next_id += 1
        return a

    def add_sub(self, args: Args, transfer: Any, src: int, dst: int, nbytes: int, chunk: int) -> Sub:
        if not self.free_slots:
            raise InternalError(f"sub table full ({self.view.layout.max_subs} subs in flight); "
                                f"raise SHMPROXY_MAX_SUBS")
        if not self.free_subs:
            self.free_subs.extend(Sub() for _ in range(BLOCK))
        s = self.free_subs.pop()
        s.reset(self.free_slots.pop(), transfer, src, dst, nbytes, chunk)
        transfer.parts_left += 1
        args.subs.append(s)
        send = transfer.send
        P.SUB.pack_into(self.view.buf, self.view.layout.sub_off(s.slot), READY, send.kind, send.rank,
                        send.peer, args.opcount, nbytes, s.nsteps, 0, 0, 0, 0, args.id, send.tag)
        return s

    def mirror(self, s: Sub) -> None:
        """Publish a sub's counters to its slot in the sub table (for the dump tool), if they moved:
        a sub waiting on the GPU is settled on every pass of the loop."""
        counters = (s.posted, s.transmitted, s.received, s.done)
        if counters == s.mirrored:
            return
        s.mirrored = counters
        q = self.view.q
        base = self.view.layout.sub_off(s.slot) // 8
        q[base + P.SUB_POSTED] = s.posted
        q[base + P.SUB_TRANSMITTED] = s.transmitted
        q[base + P.SUB_RECEIVED] = s.received
        q[base + P.SUB_DONE] = s.done

    def set_state(self, args: Args, state: int) -> None:
        args.state = state
        buf, layout = self.view.buf, self.view.layout
        for s in args.subs:
            buf[layout.sub_off(s.slot):layout.sub_off(s.slot) + 4] = state.to_bytes(4, "little")

    def release(self, args: Args) -> None:
        """Return a finished args, its subs and their sub-table slots."""
        buf, layout = self.view.buf, self.view.layout
        for s in args.subs:
            buf[layout.sub_off(s.slot):layout.sub_off(s.slot) + 4] = P.SUB_FREE.to_bytes(4, "little")
            self.free_slots.append(s.slot)
            s.transfer = None  # type: ignore[assignment]
            s.make = s.inflight = None
            self.free_subs.append(s)
        args.subs.clear()
        args.state = NONE
        args.coll = None
        self.free_args.append(args)
