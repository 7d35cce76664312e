"""Failures of ranks and of the communicator, seen by the progress process: Failures, a component of
the engine (``engine.failures``).

The loop never raises into a void: the first error is kept in the pool's asyncResult fields with its
context (who, what was in flight), the abort flag is set and every rank is woken, so that each
raises it at its next call or wait. After a failure the service stays up a bounded while
(FAIL_LINGER_S) so that a rank still joining learns who failed.

The component owns the failure state (``failed``, the first ``error``, who was ``told``, the mutex
owner's death) and the service thread's condition (``joins``). It takes the loop's state (the pool,
the rank table, what is active), the loop's calls (a death is reported through the loop) and the
matcher (what a dead rank leaves in flight). Those a failure must reach register themselves: the
first error goes to ``on_first_error`` listeners (the other nodes), every failure wakes the
``on_abort`` ones (completion wakes every rank, the fast path its collective's sleepers); so this
component calls none of them by name, and every component may take it.

Threads. ``fail`` is the one entry any thread may call (a rank's ABORT on the service thread, a
handler's error): a failure must end the job even while the loop is busy, so it does not wait for
the loop; it writes only the pool's error record and abort flag and wakes sleepers, and its lock
keeps the first error the one recorded. A rank's death is reported through the loop (``rank_died``),
which owns what the report lists in flight, unless the loop does not take it within DEATH_REPORT_S.
``told`` and ``joins`` are the service thread's.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

from shmproxy.core import errors, log
from shmproxy.engine.loopcall import LoopCalls
from shmproxy.engine.matching import Matcher
from shmproxy.engine.ranks import RankInfo
from shmproxy.engine.state import LoopState
from shmproxy.shm import pool as P

_log = log.get("PROXY")
OWNER_DEAD_GRACE_S = 2.0     # how long the pidfd watcher may take to name who died holding the mutex
DEATH_REPORT_S = 1.0         # how long a death waits for the loop to list what was in flight with it
MASK64 = (1 << 64) - 1


class Failures:
    def __init__(self, st: LoopState, calls: LoopCalls, matcher: Matcher):
        self.st, self.calls, self.matcher = st, calls, matcher
        self.failed = False
        self.error: errors.ProxyError | None = None   # the first error, for ranks still joining
        self.told: set[int] = set()     # local ranks whose join the service refused with it
        self.joins = threading.Condition()  # notified by the service thread on every message and exit
        self.owner_died_at = 0.0
        self._first = threading.Lock()      # fail(): one first error, whichever thread gets there first
        self.on_first_error: list[Callable[[int, str, int | None], None]] = []   # (code, message, rank)
        self.on_abort: list[Callable[[], None]] = []   # every fail(), after the abort flag is set

    def not_told(self) -> list[int]:
        """The local ranks that cannot yet learn of the failure without the service: none of mapping the
        pool (its error record), dying, closing, or having its join refused with the failure happened."""
        out = []
        for lr in range(self.st.nlocal):
            info = self.st.ranks.get(lr)
            if lr not in self.told and not (info is not None and (info.mapped or info.dead or info.closed)):
                out.append(lr)
        return out

    def wait_until_told(self, bound_s: float) -> None:
        """After a failure, keep the service answering (ControlHandler refuses every join with the
        failure) until not_told is empty, at most ``bound_s``: a rank still joining when another died
        learns who died, instead of finding the service gone (a reset, or no socket until its
        TIMEOUT)."""
        deadline = time.monotonic() + bound_s
        with self.joins:
            while left_out := self.not_told():
                left = deadline - time.monotonic()
                if left <= 0:
                    _log.info("failed; local ranks %s never learned it from the service", left_out)
                    return
                self.joins.wait(left)

    def rank_died(self, info: RankInfo, how: str = "") -> None:
        """A rank's process exited (the service thread's pidfd watch; the loop for a dead mutex owner)."""
        try:
            self.calls.run(lambda: self._died(info, how), bound_s=DEATH_REPORT_S)
        except errors.Timeout:   # the loop is busy: the failure cannot wait for the list of what was in flight
            self._died(info, how, inflight=False)

    def _died(self, info: RankInfo, how: str, inflight: bool = True) -> None:
        if info.closed or info.dead:
            return
        info.dead = True
        listed = self._inflight_with(info.rank) if inflight else ""
        if self.owner_died_at and not how:
            how = "holding the ops pool mutex"
        self.fail(errors.PeerDiedError.code,
                  f"rank {info.rank} (local rank {info.local_rank}, pid {info.pid}) died"
                  + (f" {how}" if how else "")
                  + (f"; in flight with it: {listed}" if listed else ""),
                  rank=info.rank, pid=info.pid)

    def fail(self, code: int, message: str, rank: int | None = None, pid: int | None = None) -> None:
        """Keep the first error (asyncResult), abort the communicator, wake everybody."""
        st = self.st
        q, base = st.q, P.CTRL_OFF // 8
        with self._first:
            first, self.failed = not self.failed, True
        if first:
            self.error = errors.from_code(code, message, rank=rank, pid=pid)
            data = message.encode("utf-8", "replace")[: P.ERR_MSG_BYTES - 1] + b"\0"
            st.view.buf[P.ERR_MSG_OFF:P.ERR_MSG_OFF + len(data)] = data
            q[base + P.CTRL_ERR_CODE] = code
            q[base + P.CTRL_ERR_RANK] = P.NO_RANK if rank is None else rank & MASK64
            q[base + P.CTRL_ERR_PID] = pid or 0
            q[base + P.CTRL_ERR_SEQ] = 1
            _log.warning("communicator failed: %s", message)
            for tell in self.on_first_error:   # the other nodes (engine/nodes.py)
                tell(code, message, rank)
        q[base + P.CTRL_ABORT] = 1
        for wake in self.on_abort:   # every rank, and those asleep in a small collective
            wake()

    def mutex_owner_died(self) -> None:
        """We got the pool mutex with EOWNERDEAD. The kernel releases a robust mutex early in the
        owner's exit, before the process is a zombie, so asking now "who is dead?" can find nobody:
        stop trusting the posted chain, and let the pidfd watcher (rank_died) name the dead rank;
        tick() falls back to an anonymous report after OWNER_DEAD_GRACE_S."""
        dead = [r for r in list(self.st.ranks.values()) if not _alive(r.pid)]
        if dead:
            self.rank_died(dead[0], "holding the ops pool mutex")
        elif not self.owner_died_at:
            self.owner_died_at = time.monotonic()

    def _inflight_with(self, rank: int) -> str:
        items = []
        m = self.matcher
        for dst in m.dests():
            for src, _tag, op in list(m.posted(dst)) + list(m.unexpected(dst)):
                if rank in (dst, src):
                    items.append(op.describe())
        for a in self.st.active:
            if rank in a.conn:
                items.append(f"args {a.id} {a.conn[0]}->{a.conn[1]} opCount {a.opcount} ({len(a.subs)} subs)")
        return "; ".join(items[:8]) + (f" (+{len(items) - 8} more)" if len(items) > 8 else "")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
