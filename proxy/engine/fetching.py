"""Taking what the ranks posted, and the loop's waits for it: Fetcher, a component of the engine
(``engine.fetcher``).

``fetch`` copies posted records out of the pool under the mutex (at most APPEND_BATCH_SIZE opCount
groups, in one C call that also returns each record to its owner's free list), lets armed routes
fire from them (engine/armed.py), unpacks them into Op objects in C and hands each to the engine
(``append``). Before a blocking fetch the loop spins for up to PROXY_SPIN_US, then sleeps on the pool
condvar; with only GPU work in flight whose end shows in memory it waits in C instead
(``wait_watched``), and after a graph's ack it takes the ranks' next posts before retiring.

The component owns the take buffers (records copied out under the mutex, unpacked after it) and the
bounds of its spins and waits; the loop state's ``spin_skip`` is set by the completion half
(Completion.complete_large). It takes the loop's state (the pool, the rank table, what is active,
the exit test), the loop's news (its count ends a sleep), the failure state, completion (its
relayed wake-ups bound a sleep), the armed routes (which fire from the taken records before they are
unpacked), the point-to-point half each op goes to (``append``) and the transports' context (their
watched words).
"""
from __future__ import annotations

import os
import time
import numpy as np

from shmproxy.core import errors
from shmproxy.core.ops import Op
from shmproxy.engine.armed import ArmedRoutes
from shmproxy.engine.completion import RELAY_GRACE_NS, Completion
from shmproxy.engine.context import EngineContext
from shmproxy.engine.events import EVENTS_Q as _EVENTS_Q, LoopEvents
from shmproxy.engine.failure import Failures
from shmproxy.engine.p2p import PointToPoint
from shmproxy.engine.policy import FetchMode
from shmproxy.engine.state import LoopState
from shmproxy.shm import _native, pool as P, sync

_native.bind_op(Op)   # the class whose instances _unpack_taken's C call makes
_MASK_Q = P.PENDING_MASK_OFF // 8   # the pending mask: ranks handed chains off (shm/_pool_lock.h)
_F_TRY = FetchMode.TRY
# How long the loop sleeps in C for the news of a collective across nodes when nothing else is in
# flight: news, a post or the abort flag end it at once; the bound only keeps the heartbeat going.
EVENT_WAIT_NS = 1_000_000
NET_WAIT_PASSES, NET_WAIT_SPIN, NET_WAIT_SLEEP = 0, 1, 2   # NET_LOOP_WAIT


class Fetcher:
    """The engine's take of posted ops: its take buffers, and the bounds of its spin, watch and linger."""

    def __init__(self, st: LoopState, events: LoopEvents, failures: Failures, completion: Completion,
                 armed: ArmedRoutes, p2p: PointToPoint, ctx: EngineContext):
        self.st, self.events, self.failures, self.completion = st, events, failures, completion
        self.armed, self.p2p, self.ctx = armed, p2p, ctx
        params, crowded = st.params, st.crowded
        self.view, self.q, self.layout, self.seg_addr = st.view, st.q, st.layout, st.seg_addr
        self.timeout = params.TIMEOUT
        self.sleep_s = params.PROXY_SLEEP_MS / 1000.0
        self.batch = params.APPEND_BATCH_SIZE
        self.spin_ns = int(params.PROXY_SPIN_US * 1000)
        self.watch_ns = int(params.PROXY_WATCH_US * 1000)
        self.linger_ns = int(params.PROXY_LINGER_US * 1000)
        # a crowded node's loop does not spin for the network's news: the link's threads need the CPU
        self.net_loop_wait = params.NET_LOOP_WAIT if params.NET_LOOP_WAIT >= 0 else (0 if crowded else 1)
        # fetch() copies records here under the mutex (shm._native.take_posted) and unpacks them after
        nrecords = self.layout.nrecords
        self.take_out = bytearray(2 * P.RECORD_BYTES * nrecords)   # two takes: fetch(pair=True)
        self.take_idx = np.zeros(2 * nrecords, np.int32)
        self.take_out_addr = _native.buffer_info(self.take_out, True)[0]
        self.take_idx_addr = _native.buffer_info(self.take_idx, True)[0]

    def _stopped(self) -> bool:
        """The communicator failed, or a process died holding the pool's mutex: take nothing more."""
        failures = self.failures
        return bool(failures.failed or failures.owner_died_at)

    def fetch(self, mode: FetchMode, pair: bool = False) -> int:
        """Take what the ranks posted and process it. ``pair``: where this fetch claims the first half
        of an armed route (engine/armed.py), wait up to PROXY_LINGER_US for the other half and take it
        too, before any of it is processed, so that the route fires at once."""
        view, i32 = self.view, self.view.i32
        head_i = P.NEXT_OPS_OFF // 4
        if mode != _F_TRY:
            self.spin_for_work()
        if (i32[head_i] != -1 or self.q[_MASK_Q]) and not self._stopped():
            n = self._fetch_posted(mode != _F_TRY)   # lock, take, unlock: one C call
        elif mode == _F_TRY:
            return 0
        else:
            view.mutex.lock(self.timeout)
            try:
                if i32[head_i] == -1 and not self.q[_MASK_Q] and not self.st.should_exit():
                    self.sleep_locked()
                n = self._take_locked() if not self._stopped() else 0
            finally:
                view.mutex.unlock()
        armed: tuple[list, list, list] | None = None
        routes = self.armed
        if n and routes.live:   # engine/armed.py
            armed = ([], [], [])
            routes.fire(self.take_out_addr, 0, n, armed)
            if pair and routes.claims_waiting(armed) and self.wait_posted(self.linger_ns) and not self._stopped():
                n2 = self._fetch_posted(False, at=n)
                if n2:
                    routes.fire(self.take_out_addr, n, n + n2, armed)
                    n += n2
        ops = self._unpack_taken(n)
        if armed is not None and (armed[0] or armed[1] or armed[2]):
            routes.process(ops, armed)
        else:
            append = self.p2p.append
            for op in ops:
                append(op)
        if ops:
            self.q[P.CTRL_OFF // 8 + P.CTRL_N_FETCH] += 1
            self.q[P.CTRL_OFF // 8 + P.CTRL_N_OPS] += len(ops)
        return len(ops)

    def spin_for_work(self) -> None:
        spin_ns = self.spin_ns
        if self.st.spin_skip:   # the ranks just woken need the CPUs (Completion.complete_large)
            self.st.spin_skip = False
            return
        if spin_ns <= 0:
            return
        i32, head_i, q = self.view.i32, P.NEXT_OPS_OFF // 4, self.q
        deadline = time.monotonic_ns() + spin_ns
        seen = self.events.seen
        should_exit = self.st.should_exit
        while (i32[head_i] == -1 and not q[_MASK_Q] and q[_EVENTS_Q] == seen and time.monotonic_ns() < deadline
               and not should_exit()):
            os.sched_yield()

    def sleep_locked(self) -> None:
        """Sleep on the pool's condvar (mutex held) until a post, news, a hand-off or the bound."""
        st = self.st
        self.q[P.CTRL_OFF // 8 + P.CTRL_N_SLEEP] += 1
        t0 = time.monotonic_ns()
        # While a guard has a wake-up to deliver, wake in time to deliver it ourselves (check_relayed).
        # Not at all if a rank handed a chain off meanwhile (shm/_pool_lock.h, "Hand-off").
        rc = _native.sleep_unless_posted(self.seg_addr, RELAY_GRACE_NS / 1e9 if self.completion.relayed
                                         else self.sleep_s, self.events.seen)
        self.view.mutex._handle(rc)
        if st.profiler.enabled:
            st.profiler.span("sleep", t0, time.monotonic_ns())

    def _fetch_posted(self, blocking: bool, at: int = 0) -> int:
        """_take_locked with the lock and unlock in the same C call (_native.fetch_posted): no interpreter
        inside the critical section. 0 when a trylock lost. ``at``: records already taken by this
        fetch, after which these go (take_out holds two full takes)."""
        layout = self.layout
        out, idx = self.take_out_addr + at * P.RECORD_BYTES, self.take_idx_addr + 4 * at
        n, err, at, rc = _native.fetch_posted(self.seg_addr, layout.records_off, layout.rank_area_off,
                                              layout.nrecords, layout.max_ops, self.batch, out, idx, blocking,
                                              self.timeout)
        if rc == sync.TIMEDOUT:
            raise errors.Timeout(f"pool mutex not acquired within {self.timeout:.1f} s "
                                 f"(held by a wedged process?)")
        if rc == sync.OWNERDEAD:
            self.failures.mutex_owner_died()
            return 0
        return self._check_taken(n, err, at)

    def _take_locked(self) -> int:
        """Take at most APPEND_BATCH_SIZE opCount groups off the posted chain (mutex held): in C, which
        copies the records to ``take_out`` and returns each to its owner's free list (NCCL's freeOps),
        so that ranks posting meanwhile wait nanoseconds per record, not the microsecond of unpacking."""
        layout = self.layout
        n, err, at = _native.take_posted(self.seg_addr, layout.records_off, layout.rank_area_off,
                                         layout.nrecords, layout.max_ops, self.batch, self.take_out_addr,
                                         self.take_idx_addr)
        return self._check_taken(n, err, at)

    def _check_taken(self, n: int, err: int, at: int) -> int:
        if err == 1:
            self.failures.fail(errors.InternalError.code, f"ops pool corrupt: posted chain links to record {at}")
            return 0
        if err == 2:
            self.failures.fail(errors.InternalError.code, f"ops pool corrupt: record {at} claims owner "
                               f"{self.view.read_record(at)[5]}, region of {at // self.layout.max_ops}")
            return 0
        return n

    def _unpack_taken(self, n: int) -> list[Op]:
        """The ``n`` records that _take_locked copied, as Op objects (after the mutex is released), in
        one C call (shm/_native_ops.c: what Op(index, fields, rank, t_fetch) makes, without Python
        per record)."""
        if not n:
            return []
        return _native.unpack_ops(self.take_out_addr, n, self.take_idx_addr, self.st.ranks, time.monotonic_ns())

    def wait_watched(self) -> bool:
        """With nothing in flight but work whose end its transports show in memory (``proxy_watch``:
        a GPU graph's ack word), wait for that, a post, news or the abort flag in one C call of at
        most PROXY_WATCH_US (GIL released), instead of Python passes whose every step costs
        microseconds: a post then waits for no pass to end. False where it cannot (the caller yields).

        A collective across nodes (CollWork.event_driven) moves only when news comes (its chunks'
        SEND/RECV end as loop events from the link's threads) and needs no word: with nothing else in
        flight the loop waits until news, a post or the abort flag, spinning in C or (no spare core)
        asleep on the pool's condvar (NET_LOOP_WAIT), so that it holds no GIL the link's threads queue
        for while they move the chunks (docs/decisions.md, "The link's threads never queue for the
        GIL behind the loop")."""
        st = self.st
        if self.watch_ns <= 0 or st.hooks.armed:   # deferred work (engine/hooks.py) is polled, not watched
            return False
        words: list = []
        polled = {a.transport for a in st.active if a.coll is None or not a.coll.event_driven}
        for t in polled:
            got = t.proxy_watch(self.ctx) if t.proxy_watch is not None else None
            if got is None:
                return False
            words += got
        if not words:
            if polled or not self.net_loop_wait:
                return False
            if self.net_loop_wait == NET_WAIT_SLEEP:
                # no spare core: sleep on the pool's condvar, which news (post_event) and posts end
                self.view.mutex.lock(self.timeout)
                try:
                    if self.view.i32[P.NEXT_OPS_OFF // 4] == -1 and not self.q[_MASK_Q] and not st.should_exit():
                        self.sleep_locked()
                finally:
                    self.view.mutex.unlock()
            elif self._watch((), max(self.watch_ns, EVENT_WAIT_NS)) == _native.WATCH_TIMEOUT:
                os.sched_yield()
            return True
        why = self._watch(words, self.watch_ns)
        if why == _native.WATCH_TIMEOUT:
            os.sched_yield()   # the CPU's other threads get their turn between waits
        elif why == _native.WATCH_WORD and self.armed.history and self.linger_ns > 0:
            # The ranks saw their completions with this ack and post their next message's halves now:
            # take them before retiring what ended, so that an armed route fires at once from C
            # (engine/armed.py) and the retiring overlaps its copy.
            if self.wait_posted(self.linger_ns):
                self.fetch(_F_TRY, pair=True)
        return True

    def wait_posted(self, ns: int) -> bool:
        """Wait in C at most ``ns`` for a post (news and the abort flag end it too): True if one came."""
        return self._watch((), ns) == _native.WATCH_POSTED

    def _watch(self, words: tuple | list, ns: int) -> int:
        """_native.watch_words on this pool: a post, news, the abort flag or one of ``words``, at most ``ns``."""
        return _native.watch_words(self.seg_addr, self.events.seen, self.seg_addr + P.CTRL_OFF + 8 * P.CTRL_ABORT,
                                   words, ns)
