"""The progress process's half of the fast path: FastPath, a component of the engine (``engine.fastpath``).

Small blocking Sends go into shared cells of their (sender, receiver) pair, and a blocking Recv with
nothing ahead of it takes them itself (shm/_fast.h has the protocol, shm/_poster_fast.c the rank's
half). Whatever the receiver does not take, this process takes into its matching, in the sender's
order, as a buffered send: the message then behaves as one the progress process buffered (matching
order, probes, cancel of the receive, truncation and type errors named by the match).

This half keeps the protocol's promises:

- **Order.** A slow send of a pair enters matching only after the cells written before it
  (``_drain_before``); a cell enters only after the slow sends before it (``max_slow``: the pair's
  FETCHED_SLOW, stored once a slow send is in). A cell the receiver is taking this instant (BUSY)
  holds the slow send back (``held``), retried every pass until the take is over.
- **What the receiver checks.** The pair's UNEXP (its messages waiting unexpected in matching,
  kept by the matcher's gauge) and RECV_DONE (its receives and probes completed, bumped by
  complete()) are stored before FETCHED_SLOW.
- **Cells for a rank that waits here.** When the rank posts a receive or a probe, every cell to it
  is drained first; while it has one posted, senders ring its doorbell after writing a cell, and the
  loop drains that rank's cells when it sees the bell (``check_bells``, after CTRL_EVENTS moved).
- **Failure.** fail() wakes the ranks sleeping in a small collective (``wake_coll``, a listener of
  Failures).

The component owns the fast path's state (below) and the pool's indices it reads; it takes the loop's
state (the pool, the rank tables INIT fills), the matcher (whose gauge publishes UNEXP) and the
failures it listens to; the point-to-point half, which a drained cell or a held send enters and
which calls this component on every send, is bound after both exist (``bind``).
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

from shmproxy.core import log
from shmproxy.core.ops import Op
from shmproxy.engine.failure import Failures
from shmproxy.engine.matching import Matcher
from shmproxy.engine.state import LoopState
from shmproxy.shm import _native
from shmproxy.shm import pool as P

if TYPE_CHECKING:  # pragma: no cover
    from shmproxy.engine.p2p import PointToPoint

_log = log.get("PROXY")
_TAKE_BUSY = _native.TAKE_BUSY
assert P.PAIR_UNEXP == P.PAIR_FETCHED_SLOW + 1   # a pair's UNEXP is found from its FETCHED_SLOW index


class FastPath:
    """State: ``on`` (the pool has the region), per local rank the u64 indices of its fields, the
    pair blocks' addresses, the doorbells seen, and the slow sends held behind a cell."""

    p2p: "PointToPoint"   # bound once made (bind)

    def __init__(self, st: LoopState, matcher: Matcher, failures: Failures):
        self.st = st
        self.q = st.q
        layout = st.layout
        self.nlocal = layout.nlocal
        self.layout = layout
        self.on = bool(layout.fast_bytes)
        self.held: dict[tuple[int, int], collections.deque] = {}   # (sender, receiver): sends behind a take
        self.retry: set[int] = set()   # local ranks whose drain met a cell being taken
        self.hook = st.hooks.register("fast path: held sends, drains to retry", self.pass_)
        self.early: dict[tuple[int, int], int] = {}   # (sender, rank): slow sends in before it joined
        self.f_unexp_n: dict[tuple[int, int], int] = {}   # (src, dst): messages waiting unexpected
        if not self.on:
            return
        failures.on_abort.append(self.wake_coll)
        n, base = layout.nlocal, st.seg_addr
        self.f_recv_done = [layout.frank_q(lr, P.FRANK_RECV_DONE) for lr in range(n)]
        self.f_recv_posted = [layout.rank_q(lr, P.RANK_RECV_POSTED) for lr in range(n)]
        self.f_bell = [layout.frank_q(lr, P.FRANK_DOORBELL) for lr in range(n)]
        self.f_bells_seen = [0] * n
        self.f_pair = [[base + layout.pair_off(s, d) for d in range(n)] for s in range(n)]
        self.f_fetched = [[layout.pair_off(s, d) // 8 + P.PAIR_FETCHED_SLOW for d in range(n)]
                          for s in range(n)]
        self.f_stride = layout.cell_stride
        self.f_line = [base + layout.fast_off + P.FAST_LINE * d for d in range(n)]   # fast_take counts there
        # per local rank: (cells written to it, taken by it, drained) -- any cell waiting, in three loads
        self.f_cells = [(layout.frank_q(d, P.FRANK_CELLS_WRITTEN), layout.frank_q(d, P.FRANK_CELLS_TAKEN),
                         layout.frank_q(d, P.FRANK_CELLS_DRAINED)) for d in range(n)]
        self.f_coll_word = base + layout.coll_off + P.CAREA_WORD_OFF
        matcher.gauge = self._unexp_gauge

    def bind(self, p2p: "PointToPoint") -> None:
        """The point-to-point half that held sends and drained cells enter (see the header)."""
        self.p2p = p2p

    # ------------------------------------------------------------------ order of a pair's messages
    def send_in(self, send: Op, d: int) -> bool:
        """A fetched slow send to local rank ``d``: True when it may enter matching now (the cells
        written before it are in); False when it is held (a cell before it is being taken)."""
        key = (send.owner, d)
        held = self.held.get(key)
        if held is not None:
            held.append(send)
            return False
        if not self.cells_waiting(d) or self._drain_before(send.owner, d, send.pair_seq - 1):
            return True
        self.held[key] = collections.deque((send,))
        self.st.hooks.arm(self.hook)
        return False

    def sent(self, send: Op, d: int) -> None:
        """``send`` is in matching: cells after it may follow (UNEXP was stored before this). If its
        receiver waits here, the cells its drain found blocked behind this send go in now."""
        s, q = send.owner, self.q
        q[self.f_fetched[s][d]] = send.pair_seq
        if (self.cells_waiting(d) and q[self.f_recv_posted[d]] != q[self.f_recv_done[d]]
                and not self._drain_before(s, d, send.pair_seq)):
            self.retry.add(d)
            self.st.hooks.arm(self.hook)

    def cells_waiting(self, d: int) -> bool:
        """Whether any cell to local rank ``d`` may be waiting: three loads, so that the common
        message passes with no drain at all. A sender counts a cell after it is FULL and before it
        posts anything later, so a cell that orders against a later slow send is always counted."""
        w, t, dr = self.f_cells[d]
        q = self.q
        return q[w] != q[t] + q[dr]

    def drain_from(self, s: int) -> None:
        """Local rank ``s`` closed: what it wrote into cells was sent (its Sends returned), so it goes into
        matching now, to be received or failed like its other messages."""
        q, fetched = self.q, self.f_fetched
        for d in range(self.nlocal):
            self._drain_before(s, d, q[fetched[s][d]])

    def _drain_before(self, s: int, d: int, max_slow: int) -> bool:
        """Take every cell of (s, d) with at most ``max_slow`` slow sends before it into matching;
        False if one is being taken by the receiver right now."""
        pair, stride, take, line = self.f_pair[s][d], self.f_stride, _native.fast_take, self.f_line[d]
        while True:
            got = take(pair, stride, max_slow, line)
            if type(got) is tuple:
                if len(got) == 8 and (got := self._by_reference(s, pair, line, got)) is None:
                    return False   # its sender's buffer is not known here: the receiver takes it
                self._cell_in(s, d, got)
            else:
                return got != _TAKE_BUSY

    def _by_reference(self, s: int, pair: int, line: int, got: tuple) -> tuple | None:
        """A cell by reference, claimed by fast_take (shm/_fast.h, "By reference"): its payload copied
        from this process's mapping of the sender's buffer, which frees the cell and wakes the sender;
        the message as fast_take gives one with its payload. None where the buffer is not known (a
        registration of that rank's gone: the cell is FULL again)."""
        tag, code, nbytes, count, t_post, bid, off, cell = got
        buf = self.st.buffers.get((s, bid))
        src = buf.addr + off if buf is not None and off + nbytes <= buf.size else 0
        data = _native.fast_ref_done(pair, cell, line, src, nbytes, self.f_coll_word)
        return None if data is None else (tag, code, nbytes, count, t_post, data)

    def drain_to(self, d: int) -> None:
        """Local rank ``d`` waits in matching (a receive or probe posted, or its doorbell rang): take
        every cell to it that may enter, in each pair's order."""
        q, fetched = self.q, self.f_fetched
        if self.early:   # slow sends taken in before this rank joined: publish the pair now
            ranks = self.st.ranks
            dst = ranks[d].rank
            for s in range(self.nlocal):
                n = self.early.pop((s, dst), 0)
                if n:
                    q[fetched[s][d] + 1] = self.f_unexp_n.get((ranks[s].rank, dst), 0)   # UNEXP first
                    q[fetched[s][d]] = max(n, q[fetched[s][d]])
        if not self.cells_waiting(d):
            return
        busy = False
        for s in range(self.nlocal):
            if (s, d) in self.held:
                continue   # its held send goes first; the retry drains after it
            if not self._drain_before(s, d, q[fetched[s][d]]):
                busy = True
        if busy:
            self.retry.add(d)
            self.st.hooks.arm(self.hook)

    def _cell_in(self, s: int, d: int, got: tuple) -> None:
        """A drained cell enters matching as a buffered send from local rank ``s`` to ``d``."""
        ranks = self.st.ranks
        src, dst = ranks[s].rank, ranks[d].rank
        self.p2p.cell_in(src, dst, got)
        # fast_take counted it in the pair's UNEXP while it was in neither a cell nor matching
        # (shm/_fast.h, "Draining"): the true count now that it is in
        self._unexp_gauge(src, dst, 0)

    # ------------------------------------------------------------------ the loop's share
    def pass_(self) -> bool:
        """The loop's poll hook, every pass while something waits on a cell being taken: try again.
        True while something still waits."""
        for key in list(self.held):
            s, d = key
            held = self.held[key]
            while held:
                op = held[0]
                if not self._drain_before(s, d, op.pair_seq - 1):
                    break
                held.popleft()
                self.p2p.send_local(op, d)
            if not held:
                del self.held[key]
        if self.retry:
            retry, self.retry = self.retry, set()
            for d in retry:
                self.drain_to(d)
        self.st.progressed = True   # no sleep while a take is in flight: it ends in microseconds
        return bool(self.held or self.retry)

    def check_bells(self) -> None:
        """After CTRL_EVENTS moved: drain the cells to ranks whose doorbell rang."""
        q, seen = self.q, self.f_bells_seen
        for d, idx in enumerate(self.f_bell):
            v = q[idx]
            if v != seen[d]:
                seen[d] = v
                self.drain_to(d)

    def _unexp_gauge(self, dst: int, src: int, delta: int) -> None:
        """The matcher queued (+1) or removed unexpected messages of (src, dst): publish the pair's count
        (counted whatever the ranks' state, published once both are known here)."""
        n = self.f_unexp_n.get((src, dst), 0) + delta
        self.f_unexp_n[(src, dst)] = n
        s, d = self.st.local_of.get(src), self.st.local_of.get(dst)
        if s is not None and d is not None:
            self.q[self.f_fetched[s][d] + 1] = n   # PAIR_UNEXP follows PAIR_FETCHED_SLOW

    def wake_coll(self) -> None:
        if self.on:
            _native.fast_wake_coll(self.f_coll_word)

    def describe(self) -> dict[str, Any]:
        """What the progress process holds of the fast path (the signal dump's "fast_path")."""
        if not self.on:
            return {"on": False}
        q, lay = self.q, self.layout
        ranks = []
        for lr in range(self.nlocal):
            ranks.append({"local_rank": lr, "recv_posted": q[lay.rank_q(lr, P.RANK_RECV_POSTED)],
                          "recv_done": q[self.f_recv_done[lr]]})
        return {"on": True, "bytes": lay.fast_bytes, "ranks": ranks, "held": len(self.held)}
