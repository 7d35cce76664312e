"""Waiting: for a request to complete, and for a free op record or request slot.

Request.Wait first spins in C (shm/_poster.c) for SHMPROXY_WAIT_SPIN_US (only for requests up to
SHMPROXY_WAIT_SPIN_MAX_BYTES: larger ones are copied by the progress process's workers, which a
spinning rank would slow down on a machine with few cores), then comes here: _wait sleeps on the
rank's futex word in slices of SHMPROXY_WAIT_SLICE_MS, and between slices checks the communicator's
error, the abort flag and that the progress process is alive. So every wait is bounded and sees
failures: never a silent hang. Running out of records or slots waits the same way.

A part of shmproxy.rank.comm.Comm (the failure state it raises is lifecycle.py's); what it reads is
declared in shmproxy.rank.state.
"""
from __future__ import annotations

import time

from shmproxy.core import errors
from shmproxy.rank.request import Request
from shmproxy.rank.state import CommState
from shmproxy.shm import _native, pool as P

OWNER_DEAD_REPORT_S = 5.0  # how long a rank that repaired the pool mutex waits to learn who died


class Waiting(CommState):
    """The sleeping half of Wait/Test, and the reaping of completed requests."""

    def _splice_failed(self, rc: int) -> None:
        """Called by the poster when a splice did not return OK (the op is posted or lost; either way
        the communicator cannot go on)."""
        if rc == _native.OWNERDEAD:
            # We repaired the mutex, but cannot tell who died holding it; the progress process
            # learns that from the dead process's pidfd within milliseconds and records it. Wait
            # (bounded) for that report, so that this rank raises the same named error as the others.
            deadline = time.monotonic() + OWNER_DEAD_REPORT_S
            try:
                while True:
                    self._sleep_slice(deadline, "the report of who died holding the pool mutex")
            except errors.Timeout:
                self._q[self._abort_q] = 1
                exc = errors.PeerDiedError(f"rank {self.rank}: a process died holding the ops pool mutex")
                self._set_failure(exc)
                raise exc from None
        if rc == _native.TIMEDOUT:
            raise errors.Timeout(f"rank {self.rank}: the ops pool mutex was not released within "
                                 f"{self._timeout} s (a wedged process holds it)")
        raise errors.InternalError(f"rank {self.rank}: splice returned {rc}")

    def _take_record(self) -> int:
        free = self._free_records
        if free:
            return free.pop()
        deadline = self._deadline(None)
        while True:
            self._refill_records()
            if free:
                return free.pop()
            if self._pp.group_depth and self._pp.chain_first >= 0:
                self._pp.flush()   # our own unposted group holds the records: post what we have
                continue
            self._sleep_slice(deadline, f"a free op record (all {self._layout.max_ops} are in flight)")

    def _refill_records(self) -> None:
        view, i32 = self._view, self._i32
        assert view is not None
        free_i = P.FREE_OPS_OFF // 4 + self.local_rank
        if i32[free_i] == -1:
            return
        view.mutex.lock(self._timeout)
        try:
            head = i32[free_i]
            i32[free_i] = -1
        finally:
            view.mutex.unlock()
        lo, hi = self._rec_base, self._rec_base + self._layout.max_ops
        idx, n = head, 0
        while idx != -1:
            if not lo <= idx < hi or n >= hi - lo:
                raise errors.InternalError(f"rank {self.rank}: free list corrupt at record {idx}")
            self._free_records.append(idx)
            idx = i32[self._layout.record_off(idx) // 4]
            n += 1

    def _take_slot(self) -> int:
        slots = self._free_slots
        if slots:
            return slots.pop()
        deadline = self._deadline(None)
        while True:
            self._reap()
            if slots:
                return slots.pop()
            if self._pp.group_depth and self._pp.chain_first >= 0:
                self._pp.flush()   # requests of our own unposted group can only finish once posted
                continue
            self._sleep_slice(deadline, f"a free request slot ({self._layout.max_ops} requests pending)")

    def _reap(self) -> None:
        """Collect every completed request (their slots and staging buffers come back)."""
        q, layout = self._q, self._layout
        for slot, req in list(self._pending.items()):
            if q[layout.slot_q(slot)] == req._seq:
                self._collect(req)

    def _collect(self, req: Request) -> None:
        q = self._q
        base = self._layout.slot_q(req._slot)
        nbytes, status, tag = q[base + P.SLOT_NBYTES], q[base + P.SLOT_STATUS], q[base + P.SLOT_TAG]
        del self._pending[req._slot]
        self._free_slots.append(req._slot)
        req._finish(nbytes, status, tag)

    # ------------------------------------------------------------------ waiting
    def _test(self, req: Request) -> None:
        if self._q[self._layout.slot_q(req._slot)] == req._seq:
            self._collect(req)
        elif self._failure is None and (self._q[self._err_q] or self._q[self._abort_q]):
            raise self._record_failure()

    def _wait(self, req: Request, timeout: float | None) -> None:
        """The sleeping half of Request.Wait (the C half already spun on the slot)."""
        if self._pp.group_depth:
            raise errors.InvalidUsage("Wait() inside comm.group(): the group's ops are posted at its end")
        q, sq, seq = self._q, self._layout.slot_q(req._slot), req._seq
        if q[sq] != seq:
            deadline = self._deadline(timeout)
            while q[sq] != seq:
                self._sleep_slice(deadline, req.describe(), sq, seq)
        self._collect(req)

    def _sleep_slice(self, deadline: float, what: str, sq: int = -1, seq: int = 0) -> None:
        """One bounded sleep on our futex word; raises on failure, abort, dead proxy or timeout."""
        q = self._q
        if q[self._err_q] or q[self._abort_q] or self._failure is not None:
            raise self._record_failure()
        if self._proxy_dead():
            raise self._record_failure()
        left = deadline - time.monotonic()
        if left <= 0:
            raise errors.Timeout(f"rank {self.rank}: timed out waiting for {what}")
        # WAITING says where we sleep and on which word: the progress process, or the keep-awake guard
        # of this CPU (shm/_workers.c, "Relayed wake-ups"), wakes us once the word moved.
        word = self._u32[self._wake_u32]
        q[self._waiting_q] = P.waiting_value(_native.getcpu(), word)
        if sq < 0 or q[sq] != seq:
            _native.futex_wait(self._wake_addr, word, min(self._slice_s, left))
        q[self._waiting_q] = 0
