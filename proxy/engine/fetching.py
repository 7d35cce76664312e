"""Taking what the ranks posted, and the loop's waits for it (a mixin of ProgressEngine).

``fetch`` copies posted records out of the pool under the mutex (at most APPEND_BATCH_SIZE opCount
groups, in one C call that also returns each record to its owner's free list), lets armed routes
fire from them (engine/armed.py), unpacks them into Op objects in C and hands each to the engine
(``append``). Before a blocking fetch the loop spins for up to PROXY_SPIN_US, then sleeps on the pool
condvar; with only GPU work in flight whose end shows in memory it waits in C instead
(``wait_watched``), and after a graph's ack it takes the ranks' next posts before retiring.
"""
from __future__ import annotations

import os
import time

from shmproxy.core import errors
from shmproxy.core.ops import Op
from shmproxy.engine.completion import RELAY_GRACE_NS
from shmproxy.engine.policy import FetchMode
from shmproxy.shm import _native, pool as P, sync

_native.bind_op(Op)   # the class whose instances _unpack_taken's C call makes
_MASK_Q = P.PENDING_MASK_OFF // 8   # the pending mask: ranks handed chains off (shm/_pool_lock.h)
_EVENTS_Q = P.CTRL_OFF // 8 + P.CTRL_EVENTS   # news for the loop from this process's other threads
_F_TRY = FetchMode.TRY
# How long the loop sleeps in C for the news of a collective across nodes when nothing else is in
# flight: news, a post or the abort flag end it at once; the bound only keeps the heartbeat going.
EVENT_WAIT_NS = 1_000_000
NET_WAIT_PASSES, NET_WAIT_SPIN, NET_WAIT_SLEEP = 0, 1, 2   # NET_LOOP_WAIT


class Fetching:
    """The engine's take of posted ops: uses its pool view, take buffers, spin, watch and linger bounds."""

    def fetch(self, mode: FetchMode, pair: bool = False) -> int:
        """Take what the ranks posted and process it. ``pair``: where this fetch claims the first half
        of an armed route (engine/armed.py), wait up to PROXY_LINGER_US for the other half and take it
        too, before any of it is processed, so that the route fires at once."""
        view, i32 = self.view, self.view.i32
        head_i = P.NEXT_OPS_OFF // 4
        if mode != _F_TRY:
            self._spin_for_work()
        if (i32[head_i] != -1 or self.q[_MASK_Q]) and not (self.failures.failed or self.failures.owner_died_at):
            n = self._fetch_posted(mode != _F_TRY)   # lock, take, unlock: one C call
        elif mode == _F_TRY:
            return 0
        else:
            view.mutex.lock(self.timeout)
            try:
                if i32[head_i] == -1 and not self.q[_MASK_Q] and not self._should_exit():
                    self._sleep_locked()
                n = self._take_locked() if not (self.failures.failed or self.failures.owner_died_at) else 0
            finally:
                view.mutex.unlock()
        armed = None
        if n and self.arm_live:   # engine/armed.py
            armed = ([], [], [])
            self.fire_armed(0, n, armed)
            if (pair and self.claims_waiting(armed) and self._wait_posted(self.linger_ns)
                    and not (self.failures.failed or self.failures.owner_died_at)):
                n2 = self._fetch_posted(False, at=n)
                if n2:
                    self.fire_armed(n, n + n2, armed)
                    n += n2
        ops = self._unpack_taken(n)
        if armed is not None and (armed[0] or armed[1] or armed[2]):
            self.process_armed(ops, armed)
        else:
            for op in ops:
                self.append(op)
        if ops:
            self.q[P.CTRL_OFF // 8 + P.CTRL_N_FETCH] += 1
            self.q[P.CTRL_OFF // 8 + P.CTRL_N_OPS] += len(ops)
        return len(ops)

    def _spin_for_work(self) -> None:
        spin_ns = self.spin_ns
        if self.spin_skip:
            self.spin_skip = False
            return
        if spin_ns <= 0:
            return
        i32, head_i, q = self.view.i32, P.NEXT_OPS_OFF // 4, self.q
        deadline = time.monotonic_ns() + spin_ns
        seen = self.events_seen
        while (i32[head_i] == -1 and not q[_MASK_Q] and q[_EVENTS_Q] == seen and time.monotonic_ns() < deadline
               and not self._should_exit()):
            os.sched_yield()

    def _sleep_locked(self) -> None:
        self.q[P.CTRL_OFF // 8 + P.CTRL_N_SLEEP] += 1
        t0 = time.monotonic_ns()
        # While a guard has a wake-up to deliver, wake in time to deliver it ourselves (check_relayed).
        # Not at all if a rank handed a chain off meanwhile (shm/_pool_lock.h, "Hand-off").
        rc = _native.sleep_unless_posted(self.seg.addr, RELAY_GRACE_NS / 1e9 if self.completion.relayed
                                         else self.params.PROXY_SLEEP_MS / 1000.0, self.events_seen)
        self.view.mutex._handle(rc)
        if self.profiler.enabled:
            self.profiler.span("sleep", t0, time.monotonic_ns())

    def _fetch_posted(self, blocking: bool, at: int = 0) -> int:
        """_take_locked with the lock and unlock in the same C call (_native.fetch_posted): no interpreter
        inside the critical section. 0 when a trylock lost. ``at``: records already taken by this
        fetch, after which these go (take_out holds two full takes)."""
        layout = self.layout
        out, idx = self.take_out_addr + at * P.RECORD_BYTES, self.take_idx_addr + 4 * at
        n, err, at, rc = _native.fetch_posted(self.seg.addr, layout.records_off, layout.rank_area_off,
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
        n, err, at = _native.take_posted(self.seg.addr, layout.records_off, layout.rank_area_off,
                                         layout.nrecords, layout.max_ops, self.batch, self.take_out_addr,
                                         self.take_idx_addr)
        return self._check_taken(n, err, at)

    def _check_taken(self, n: int, err: int, at: int) -> int:
        if err == 1:
            self.failures.fail(errors.InternalError.code, f"ops pool corrupt: posted chain links to record {at}")
            return 0
        if err == 2:
            self.failures.fail(errors.InternalError.code, f"ops pool corrupt: record {at} claims owner "
                               f"{self.view.read_record(at)[5]}, region of "
                               f"{at // self.layout.max_ops}")
            return 0
        return n

    def _unpack_taken(self, n: int) -> list[Op]:
        """The ``n`` records that _take_locked copied, as Op objects (after the mutex is released), in
        one C call (shm/_native_ops.c: what Op(index, fields, rank, t_fetch) makes, without Python
        per record)."""
        if not n:
            return []
        return _native.unpack_ops(self.take_out_addr, n, self.take_idx_addr, self.ranks, time.monotonic_ns())

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
        fp = self.fastpath
        if self.watch_ns <= 0 or self.buffer_later or self.completion.relayed or fp.held or fp.retry:
            return False
        words: list = []
        polled = {a.transport for a in self.active if a.coll is None or not a.coll.event_driven}
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
                    if self.view.i32[P.NEXT_OPS_OFF // 4] == -1 and not self.q[_MASK_Q] and not self._should_exit():
                        self._sleep_locked()
                finally:
                    self.view.mutex.unlock()
            elif self._watch((), max(self.watch_ns, EVENT_WAIT_NS)) == _native.WATCH_TIMEOUT:
                os.sched_yield()
            return True
        why = self._watch(words, self.watch_ns)
        if why == _native.WATCH_TIMEOUT:
            os.sched_yield()   # the CPU's other threads get their turn between waits
        elif why == _native.WATCH_WORD and self.arm_history and self.linger_ns > 0:
            # The ranks saw their completions with this ack and post their next message's halves now:
            # take them before retiring what ended, so that an armed route fires at once from C
            # (engine/armed.py) and the retiring overlaps its copy.
            if self._wait_posted(self.linger_ns):
                self.fetch(_F_TRY, pair=True)
        return True

    def _wait_posted(self, ns: int) -> bool:
        """Wait in C at most ``ns`` for a post (news and the abort flag end it too): True if one came."""
        return self._watch((), ns) == _native.WATCH_POSTED

    def _watch(self, words: tuple | list, ns: int) -> int:
        """_native.watch_words on this pool: a post, news, the abort flag or one of ``words``, at most ``ns``."""
        return _native.watch_words(self.seg.addr, self.events_seen, self.seg.addr + P.CTRL_OFF + 8 * P.CTRL_ABORT,
                                   words, ns)
