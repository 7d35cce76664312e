"""Waiting: for a request to complete, and for a free op record or request slot.

Request.Wait first spins in C (shm/_poster.c) for SHMPROXY_WAIT_SPIN_US (only for requests up to
SHMPROXY_WAIT_SPIN_MAX_BYTES: larger ones are copied by the progress process's workers, which a
spinning rank would slow down on a machine with few cores), then comes here: ``wait`` sleeps on the
rank's futex word in slices of SHMPROXY_WAIT_SLICE_MS, and between slices checks the communicator's
error, the abort flag and that the progress process is alive. So every wait is bounded and sees
failures: never a silent hang. Running out of records or slots waits the same way.

``Waiter`` is a component of shmproxy.rank.comm.Comm (``comm._waiter``), made when the ops pool is
mapped. It owns the rank's free op records and request slots and its pending requests (the C poster
pops and fills the same lists: shm/_poster.c), and takes what it needs: the pool's words, the poster
(whose open group it may have to post), and the communicator's failure state (``Failure``), which
stays the lifecycle's.
"""
from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

from shmproxy.core import errors
from shmproxy.rank.request import Request
from shmproxy.shm import _native, pool as P

OWNER_DEAD_REPORT_S = 5.0  # how long a rank that repaired the pool mutex waits to learn who died


class Failure(NamedTuple):
    """What a wait asks of the communicator's lifecycle (rank/lifecycle.py)."""
    known: Callable[[], errors.ProxyError | None]   # the failure this rank holds already, if any
    record: Callable[[], errors.ProxyError]          # the pool's error (or the progress process's death), kept
    keep: Callable[[errors.ProxyError], None]        # keep a failure this rank found itself
    proxy_dead: Callable[[], bool]


class Waiter:
    """The sleeping half of Wait/Test, the reaping of completed requests, and the records and slots
    a post takes."""

    def __init__(self, rank: int, local_rank: int, view: P.PoolView, u32: memoryview, seg_addr: int,
                 timeout: float, slice_s: float, failure: Failure):
        layout = view.layout
        self.rank, self.view, self.layout, self.q, self.i32, self.u32 = rank, view, layout, view.q, view.i32, u32
        self.timeout, self.slice_s, self.failure = timeout, slice_s, failure
        self.local_rank = local_rank
        self.rec_base = local_rank * layout.max_ops          # this rank's first op record
        self.free_records: list[int] = []
        self.free_slots = list(range(self.rec_base + layout.max_ops - 1, self.rec_base - 1, -1))
        self.pending: dict[int, Request] = {}                 # request slot -> the request, while it may complete
        self.abort_q = P.CTRL_OFF // 8 + P.CTRL_ABORT
        self.err_q = P.CTRL_OFF // 8 + P.CTRL_ERR_SEQ
        self.waiting_q = layout.rank_q(local_rank, P.RANK_WAITING)
        self.wake_addr = seg_addr + layout.wake_word_offset(local_rank)   # this rank's futex word
        self.wake_u32 = layout.wake_word_offset(local_rank) // 4
        self.poster: Any = None   # the C poster, which is made with these lists (attach)

    def attach(self, poster: Any) -> None:
        self.poster = poster

    def deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def splice_failed(self, rc: int) -> None:
        """Called by the poster when a splice did not return OK (the op is posted or lost; either way
        the communicator cannot go on)."""
        if rc == _native.OWNERDEAD:
            # We repaired the mutex, but cannot tell who died holding it; the progress process
            # learns that from the dead process's pidfd within milliseconds and records it. Wait
            # (bounded) for that report, so that this rank raises the same named error as the others.
            deadline = time.monotonic() + OWNER_DEAD_REPORT_S
            try:
                while True:
                    self.sleep_slice(deadline, "the report of who died holding the pool mutex")
            except errors.Timeout:
                self.q[self.abort_q] = 1
                exc = errors.PeerDiedError(f"rank {self.rank}: a process died holding the ops pool mutex")
                self.failure.keep(exc)
                raise exc from None
        if rc == _native.TIMEDOUT:
            raise errors.Timeout(f"rank {self.rank}: the ops pool mutex was not released within "
                                 f"{self.timeout} s (a wedged process holds it)")
        raise errors.InternalError(f"rank {self.rank}: splice returned {rc}")

    # ------------------------------------------------------------------ records and slots
    def claim(self) -> tuple[int, int]:
        """(request slot, op record) for a post, waiting (bounded) while all are in flight."""
        slot = self.free_slots.pop() if self.free_slots else self._take_slot()
        index = self.free_records.pop() if self.free_records else self._take_record()
        return slot, index

    def _take_record(self) -> int:
        free = self.free_records
        deadline = self.deadline(None)
        while True:
            self._refill_records()
            if free:
                return free.pop()
            if self.poster.group_depth and self.poster.chain_first >= 0:
                self.poster.flush()   # our own unposted group holds the records: post what we have
                continue
            self.sleep_slice(deadline, f"a free op record (all {self.layout.max_ops} are in flight)")

    def _refill_records(self) -> None:
        view, i32 = self.view, self.i32
        free_i = P.FREE_OPS_OFF // 4 + self.local_rank
        if i32[free_i] == -1:
            return
        view.mutex.lock(self.timeout)
        try:
            head = i32[free_i]
            i32[free_i] = -1
        finally:
            view.mutex.unlock()
        lo, hi = self.rec_base, self.rec_base + self.layout.max_ops
        idx, n = head, 0
        while idx != -1:
            if not lo <= idx < hi or n >= hi - lo:
                raise errors.InternalError(f"rank {self.rank}: free list corrupt at record {idx}")
            self.free_records.append(idx)
            idx = i32[self.layout.record_off(idx) // 4]
            n += 1

    def _take_slot(self) -> int:
        slots = self.free_slots
        deadline = self.deadline(None)
        while True:
            self._reap()
            if slots:
                return slots.pop()
            if self.poster.group_depth and self.poster.chain_first >= 0:
                self.poster.flush()   # requests of our own unposted group can only finish once posted
                continue
            self.sleep_slice(deadline, f"a free request slot ({self.layout.max_ops} requests pending)")

    def _reap(self) -> None:
        """Collect every completed request (their slots and staging buffers come back)."""
        q, layout = self.q, self.layout
        for slot, req in list(self.pending.items()):
            if q[layout.slot_q(slot)] == req._seq:
                self.collect(req)

    def collect(self, req: Request) -> None:
        q = self.q
        base = self.layout.slot_q(req._slot)
        nbytes, status, tag = q[base + P.SLOT_NBYTES], q[base + P.SLOT_STATUS], q[base + P.SLOT_TAG]
        del self.pending[req._slot]
        self.free_slots.append(req._slot)
        req._finish(nbytes, status, tag)

    # ------------------------------------------------------------------ waiting
    def test(self, req: Request) -> None:
        if self.q[self.layout.slot_q(req._slot)] == req._seq:
            self.collect(req)
        elif self.failure.known() is None and (self.q[self.err_q] or self.q[self.abort_q]):
            raise self.failure.record()

    def wait(self, req: Request, timeout: float | None) -> None:
        """The sleeping half of Request.Wait (the C half already spun on the slot)."""
        if self.poster.group_depth:
            raise errors.InvalidUsage("Wait() inside comm.group(): the group's ops are posted at its end")
        q, sq, seq = self.q, self.layout.slot_q(req._slot), req._seq
        if q[sq] != seq:
            deadline = self.deadline(timeout)
            while q[sq] != seq:
                self.sleep_slice(deadline, req.describe(), sq, seq)
        self.collect(req)

    def sleep_slice(self, deadline: float, what: str, sq: int = -1, seq: int = 0) -> None:
        """One bounded sleep on our futex word; raises on failure, abort, dead proxy or timeout."""
        q = self.q
        if q[self.err_q] or q[self.abort_q] or self.failure.known() is not None:
            raise self.failure.record()
        if self.failure.proxy_dead():
            raise self.failure.record()
        left = deadline - time.monotonic()
        if left <= 0:
            raise errors.Timeout(f"rank {self.rank}: timed out waiting for {what}")
        # WAITING says where we sleep and on which word: the progress process, or the keep-awake guard
        # of this CPU (shm/_workers.c, "Relayed wake-ups"), wakes us once the word moved.
        word = self.u32[self.wake_u32]
        q[self.waiting_q] = P.waiting_value(_native.getcpu(), word)
        if sq < 0 or q[sq] != seq:
            _native.futex_wait(self.wake_addr, word, min(self.slice_s, left))
        q[self.waiting_q] = 0
