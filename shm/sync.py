"""Process-shared synchronisation living inside a mapping: robust mutex, condvar, futex words.

Lock protocol of the ops pool (docs/architecture.md, "The ops pool" and "Lock protocol"):
- The mutex protects exactly: the posted chain (head/tail) and the per-rank shared free lists.
  Nothing else in the pool is ever written under it; counters have one writer each and need none.
- The mutex is robust: if its owner dies holding it, the next locker gets OWNERDEAD. The protected
  chain may then be half spliced, so the locker marks the mutex consistent (so nobody deadlocks) and
  the *communicator* is failed: ``on_owner_dead`` reports the death instead of trusting the state.
- Every wait is bounded (timed lock, timed condvar wait on CLOCK_MONOTONIC, timed futex wait) so that
  the abort flag and dead peers are always noticed by the waiter's caller.
- Futex words (uint32) wake sleeping ranks: the waker increments the word then calls FUTEX_WAKE; the
  sleeper reads the word, re-checks its condition, and sleeps only if the word is unchanged, so a
  wake-up between the check and the sleep cannot be lost.
"""
from __future__ import annotations

from typing import Callable

from shmproxy.core import errors
from shmproxy.shm import _native, _poster

OK, OWNERDEAD, TIMEDOUT, BUSY = _native.OK, _native.OWNERDEAD, _native.TIMEDOUT, _native.BUSY
MUTEX_SIZE = _native.MUTEX_SIZE
COND_SIZE = _native.COND_SIZE


class SharedMutex:
    """A PTHREAD_PROCESS_SHARED | PTHREAD_MUTEX_ROBUST mutex at a fixed address."""

    def __init__(self, addr: int, on_owner_dead: Callable[[], None] | None = None):
        self.addr = addr
        self.on_owner_dead = on_owner_dead

    def initialize(self) -> None:
        _native.mutex_init(self.addr)

    def _handle(self, rc: int) -> None:
        if rc == OWNERDEAD:
            _native.consistent(self.addr)
            if self.on_owner_dead is not None:
                self.on_owner_dead()

    def lock(self, timeout: float) -> None:
        """Lock within ``timeout`` seconds or raise Timeout. A dead owner is repaired and reported."""
        rc = _native.lock(self.addr, timeout)
        if rc == TIMEDOUT:
            raise errors.Timeout(f"pool mutex not acquired within {timeout:.1f} s (held by a wedged process?)")
        self._handle(rc)

    def trylock(self) -> bool:
        rc = _native.trylock(self.addr)
        if rc == BUSY:
            return False
        self._handle(rc)
        return True

    def unlock(self) -> None:
        _native.unlock(self.addr)


class SharedCond:
    """A process-shared condition variable on CLOCK_MONOTONIC, used with one SharedMutex."""

    def __init__(self, addr: int, mutex: SharedMutex):
        self.addr = addr
        self.mutex = mutex

    def initialize(self) -> None:
        _native.cond_init(self.addr)

    def wait(self, timeout: float) -> bool:
        """Wait (mutex held) at most ``timeout`` s. Returns False on timeout. Spurious wake-ups happen."""
        rc = _native.cond_wait(self.addr, self.mutex.addr, timeout)
        self.mutex._handle(rc)
        return rc != TIMEDOUT

    def signal(self) -> None:
        _native.cond_signal(self.addr)

    def broadcast(self) -> None:
        _native.cond_broadcast(self.addr)


def futex_wait(addr: int, expected: int, timeout: float) -> bool:
    """Sleep while the uint32 at ``addr`` equals ``expected``, at most ``timeout`` s. False on timeout."""
    return _native.futex_wait(addr, expected & 0xFFFFFFFF, timeout) != TIMEDOUT


def set_lock_spin(us: float) -> None:
    """How long this process's contended pool locks retry before they sleep (SHMPROXY_LOCK_SPIN_US;
    shm/_pool_lock.h). Each C module that locks the pool keeps its own copy: set both."""
    ns = int(us * 1000)
    _native.set_lock_spin(ns)
    _poster.set_lock_spin(ns)


def futex_bump_and_wake(addr: int) -> None:
    """Increment the futex word (atomically: it has several writers) and wake every sleeper."""
    _native.fetch_add_u32(addr, 1)
    _native.futex_wake(addr, 0x7FFFFFFF)
