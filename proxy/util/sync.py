"""shmproxy.util.sync: synchronisation across ranks (mpi4py.util.sync's Sequential, Counter, Mutex,
Condition, Semaphore) without one-sided windows.

Why a service thread: mpi4py keeps a Counter's value and a Mutex's queue in an RMA window, so any rank
updates them at any time while the owner computes (passive target). shmproxy.MPI has no windows.
Here each object's state lives in one process, the ``root`` rank (0 of ``comm``), in a daemon thread
that answers requests: every rank sends ``(operation, args)`` as an object message on a duplicate of
``comm`` made by the constructor (collective, as mpi4py's window creation is), and the thread
replies, at once or, for a blocked acquire or a condition wait, when the lock is released or the
condition notified. Only that thread touches the duplicate on the root (shmproxy.MPI serialises
threads per communicator): the root's own calls go to the thread through a queue. The semantics are
mpi4py's: a Counter's ``next`` is an atomic fetch-and-add (values wrap like the C type of
``typecode``), the Mutex is FIFO-fair across ranks and optionally recursive, a Condition's wait
releases its mutex and gets it back after a notify (no lost wake-ups: the waiter is queued before it
releases), a Semaphore is a Counter under a Condition. ``free()`` is collective, as mpi4py's.

Waits: a rank waiting for a reply polls with iprobe and a back-off sleep of at most 1 ms; a lock may
be held for as long as its holder likes (as a threading.Lock), so the wait for a grant has no overall
bound, but each sleep is bounded and a dead root ends it with the runtime's error. The service thread
stops at ``free()`` (joined with a bound) or with the process.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from shmproxy import MPI

__all__ = ["Sequential", "Counter", "Mutex", "Condition", "Semaphore"]

_REQ, _REP = 1, 2              # tags on the object's duplicate communicator
_POLL_MAX = 1e-3               # longest sleep between two polls (seconds)
_JOIN_S = 60.0                 # bound of the wait for the service thread at free()
_DEFER = object()              # a handler's answer when the reply comes later
_ERRORS = {"RuntimeError": RuntimeError, "ValueError": ValueError}


class Sequential:
    """A section that the ranks of ``comm`` enter one after another, in rank order."""

    def __init__(self, comm: Any, tag: int = 0) -> None:
        self.comm, self.tag = comm, int(tag)

    def __enter__(self) -> "Sequential":
        self.begin()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end()

    def begin(self) -> None:
        """Wait for the rank before this one to leave the section."""
        rank = self.comm.Get_rank()
        if rank > 0:
            self.comm.Recv([bytearray(), 0, MPI.BYTE], rank - 1, self.tag)

    def end(self) -> None:
        """Let the next rank in."""
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        if rank < size - 1:
            self.comm.Send([bytearray(), 0, MPI.BYTE], rank + 1, self.tag)


class _Local:
    """The reply slot of a call the root makes to its own service thread."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None

    def set(self, value: Any) -> None:
        self.value = value
        self.event.set()


class _Service:
    """A duplicate of ``comm``, and on its root the thread that runs ``state``'s handlers."""

    def __init__(self, comm: Any, state: Any, root: int = 0) -> None:
        if comm.Is_inter():
            raise ValueError("an intracommunicator is required")
        self.parent = comm         # free()'s barrier: the thread owns the duplicate on the root
        self.comm = comm.Dup()
        self.root = int(root)
        self.rank = self.comm.Get_rank()
        self.state = state
        self._queue: "queue.SimpleQueue[tuple[_Local, str, tuple]]" = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        if self.rank == self.root:
            state.answer = self._answer
            self._thread = threading.Thread(target=self._serve, name="shmproxy-sync", daemon=True)
            self._thread.start()

    # ---- the root's thread
    def _answer(self, caller: Any, value: Any) -> None:
        if isinstance(caller, _Local):
            caller.set(value)
        else:
            self.comm.send(value, caller, _REP)

    def _handle(self, who: int, caller: Any, op: str, args: tuple) -> None:
        # who: the calling rank (the identity a lock is held by); caller: where its reply goes
        try:
            value = getattr(self.state, "op_" + op)(who, caller, *args)
        except (RuntimeError, ValueError) as exc:
            value = ("error", type(exc).__name__, str(exc))
        else:
            value = ("ok", value)
        if value[0] == "error" or value[1] is not _DEFER:
            self._answer(caller, value)

    def _serve(self) -> None:
        delay = 0.0
        status = MPI.Status()
        try:
            while not self._stop.is_set():
                busy = False
                while not self._queue.empty():
                    slot, op, args = self._queue.get_nowait()
                    self._handle(self.rank, slot, op, args)
                    busy = True
                if self.comm.iprobe(MPI.ANY_SOURCE, _REQ, status):
                    source = status.Get_source()
                    op, args = self.comm.recv(source=source, tag=_REQ)
                    self._handle(source, source, op, args)
                    busy = True
                delay = 0.0 if busy else min(max(delay * 2, 1e-5), _POLL_MAX)
                if delay:
                    time.sleep(delay)
        except BaseException as exc:    # noqa: BLE001 - kept, and raised by the next local call
            self._failure = exc

    # ---- every rank
    def call(self, op: str, *args: Any) -> Any:
        if self.comm == MPI.COMM_NULL:
            raise RuntimeError("synchronisation object already freed")
        if self.rank == self.root:
            slot = _Local()
            self._queue.put((slot, op, args))
            while not slot.event.wait(0.1):
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError(f"the sync service thread ended: {self._failure!r}")
            reply = slot.value
        else:
            self.comm.send((op, args), self.root, _REQ)
            delay = 0.0
            while not self.comm.iprobe(self.root, _REP):
                delay = min(max(delay * 2, 1e-5), _POLL_MAX)
                time.sleep(delay)
            reply = self.comm.recv(source=self.root, tag=_REP)
        if reply[0] == "error":
            raise _ERRORS.get(reply[1], RuntimeError)(reply[2])
        return reply[1]

    def free(self) -> None:
        """Collective: once every rank is here (its requests answered), stop the thread, free the
        duplicate."""
        if self.comm == MPI.COMM_NULL:
            return
        self.parent.Barrier()
        if self._thread is not None:
            self._stop.set()
            self._thread.join(_JOIN_S)
            if self._thread.is_alive():
                raise RuntimeError(f"the sync service thread did not stop within {_JOIN_S} s")
            self._thread = None
        self.comm.Free()
        self.comm = MPI.COMM_NULL


class _CounterState:
    answer: Callable[[Any, Any], None]

    def __init__(self, start: int, typecode: str) -> None:
        self.dtype = np.dtype(MPI.Datatype.fromcode(typecode).tocode())
        self.value = self._wrap(start)

    def _wrap(self, value: int) -> int:
        return int(np.array(value).astype(self.dtype))     # C's wrap-around of the counter's type

    def op_add(self, _who: int, _caller: Any, incr: int) -> int:
        old = self.value
        self.value = self._wrap(old + int(incr))
        return old


class Counter:
    """A global counter: ``next()`` is an atomic fetch-and-add on the root's value."""

    def __init__(self, start: int = 0, step: int = 1, *, typecode: str = "i", comm: Any = MPI.COMM_SELF,
                 info: Any = MPI.INFO_NULL, root: int = 0) -> None:
        self._start, self._step = start, step
        self._service = _Service(comm, _CounterState(start, typecode), root)

    def __iter__(self) -> "Counter":
        return self

    def __next__(self) -> int:
        return self.next()

    def next(self, incr: int | None = None) -> int:
        """The current value, then add ``incr`` (default: the step) to it."""
        return self._service.call("add", self._step if incr is None else incr)

    def free(self) -> None:
        self._service.free()


class _LockState:
    """The root's view of a mutex: its holder, recursion count and FIFO of blocked ranks."""

    answer: Callable[[Any, Any], None]

    def __init__(self, recursive: bool) -> None:
        self.recursive = recursive
        self.holder: int | None = None
        self.count = 0
        self.waiting: collections.deque = collections.deque()

    def op_acquire(self, who: int, caller: Any, blocking: bool) -> Any:
        if self.holder == who:
            if not self.recursive:
                raise RuntimeError("cannot acquire already held mutex")
            self.count += 1
            return True
        if self.holder is None:
            self.holder, self.count = who, 1
            return True
        if not blocking:
            return False
        self.waiting.append((who, caller))
        return _DEFER

    def op_release(self, who: int, _caller: Any) -> Any:
        if self.holder != who:
            raise RuntimeError("cannot release unheld mutex")
        self.count -= 1
        if self.count == 0:
            self._hand_on()
        return None

    def op_release_all(self, who: int, _caller: Any) -> int:
        """Release whatever the recursion count; the count, for acquire_restore (Condition.wait)."""
        if self.holder != who:
            raise RuntimeError("cannot release unheld mutex")
        count, self.count = self.count, 0
        self._hand_on()
        return count

    def op_set_count(self, who: int, _caller: Any, count: int) -> None:
        if self.holder == who:
            self.count = int(count)

    def _hand_on(self) -> None:
        self.holder = None
        if self.waiting:
            (self.holder, caller), self.count = self.waiting.popleft(), 1
            self.answer(caller, ("ok", True))

    def op_locked(self, who: int, _caller: Any) -> bool:
        return self.holder == who

    def op_count(self, who: int, _caller: Any) -> int:
        return self.count if self.holder == who else 0


class Mutex:
    """Mutual exclusion across the ranks of ``comm`` (held by one rank at a time)."""

    def __init__(self, *, recursive: bool = False, comm: Any = MPI.COMM_SELF,
                 info: Any = MPI.INFO_NULL) -> None:
        self._recursive = bool(recursive)
        self._service = _Service(comm, _LockState(self._recursive))

    def __enter__(self) -> "Mutex":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _check(self, what: str = "mutex") -> None:
        if self._service.comm == MPI.COMM_NULL:
            raise RuntimeError(f"{what} already freed")

    def acquire(self, blocking: bool = True) -> bool:
        """Hold the mutex (waiting, FIFO, if ``blocking``); whether it is held."""
        self._check()
        return bool(self._service.call("acquire", bool(blocking)))

    def release(self) -> None:
        self._check()
        self._service.call("release")

    def locked(self) -> bool:
        """Whether this rank holds the mutex."""
        self._check()
        return bool(self._service.call("locked"))

    def count(self) -> int:
        """This rank's recursion count (0 when it does not hold the mutex)."""
        self._check()
        return int(self._service.call("count"))

    def _release_save(self) -> int:
        return int(self._service.call("release_all"))

    def _acquire_restore(self, count: int) -> None:
        self._service.call("acquire", True)
        self._service.call("set_count", count)

    def free(self) -> None:
        """Collective: release the mutex if this rank holds it, then free it."""
        if self._service.comm == MPI.COMM_NULL:
            return
        if self.locked():
            self._service.call("release_all")
        self._service.free()


class _CondState:
    """The root's queue of waiters: a ticket per wait, notified in FIFO order."""

    answer: Callable[[Any, Any], None]

    def __init__(self) -> None:
        self.next_ticket = 0
        self.queued: collections.deque = collections.deque()
        self.notified: set[int] = set()
        self.sleeping: dict[int, Any] = {}

    def op_enqueue(self, _who: int, _caller: Any) -> int:
        self.next_ticket += 1
        self.queued.append(self.next_ticket)
        return self.next_ticket

    def op_sleep(self, _who: int, caller: Any, ticket: int) -> Any:
        if ticket in self.notified:
            self.notified.discard(ticket)
            return True
        self.sleeping[ticket] = caller
        return _DEFER

    def op_notify(self, _who: int, _caller: Any, n: int) -> int:
        woken = 0
        while self.queued and woken < n:
            ticket = self.queued.popleft()
            woken += 1
            caller = self.sleeping.pop(ticket, None)
            if caller is None:
                self.notified.add(ticket)      # it has not gone to sleep yet: it will not
            else:
                self.answer(caller, ("ok", True))
        return woken


class Condition:
    """A condition variable across ranks, over ``mutex`` (a new recursive Mutex by default)."""

    def __init__(self, mutex: Mutex | None = None, *, recursive: bool = True, comm: Any = MPI.COMM_SELF,
                 info: Any = MPI.INFO_NULL) -> None:
        self._own = mutex is None
        self._mutex = Mutex(recursive=recursive, comm=comm, info=info) if mutex is None else mutex
        self._service = _Service(comm, _CondState())

    def __enter__(self) -> "Condition":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _check(self) -> None:
        if self._service.comm == MPI.COMM_NULL:
            raise RuntimeError("condition already freed")

    def acquire(self, blocking: bool = True) -> bool:
        self._check()
        return self._mutex.acquire(blocking)

    def release(self) -> None:
        self._check()
        self._mutex.release()

    def locked(self) -> bool:
        self._check()
        return self._mutex.locked()

    def wait(self) -> bool:
        """Release the mutex, sleep until notified, hold the mutex again; always True."""
        self._check()
        if not self.locked():
            raise RuntimeError("cannot wait on unheld mutex")
        ticket = self._service.call("enqueue")
        count = self._mutex._release_save()
        self._service.call("sleep", ticket)
        self._mutex._acquire_restore(count)
        return True

    def wait_for(self, predicate: Callable[[], Any]) -> Any:
        result = predicate()
        while not result:
            self.wait()
            result = predicate()
        return result

    def notify(self, n: int = 1) -> int:
        """Wake up to ``n`` waiting ranks; how many were woken."""
        self._check()
        if not self.locked():
            raise RuntimeError("cannot notify on unheld mutex")
        return int(self._service.call("notify", int(n)))

    def notify_all(self) -> int:
        return self.notify((1 << 31) - 1)

    def free(self) -> None:
        """Collective: free the condition (and the mutex it made itself)."""
        if self._own:
            self._mutex.free()
        self._service.free()


class Semaphore:
    """A counting semaphore across ranks: a Counter under a Condition, as mpi4py's."""

    def __init__(self, value: int = 1, *, bounded: bool = True, comm: Any = MPI.COMM_SELF,
                 info: Any = MPI.INFO_NULL) -> None:
        if value < 0:
            raise ValueError("initial value must be non-negative")
        self._bounded = bool(bounded)
        self._counter = Counter(value, comm=comm, info=info)
        self._condvar = Condition(recursive=False, comm=comm, info=info)

    def __enter__(self) -> "Semaphore":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self, blocking: bool = True) -> bool:
        with self._condvar:
            while self._counter.next(0) == 0:
                if not blocking:
                    return False
                self._condvar.wait()
            self._counter.next(-1)
            return True

    def release(self, n: int = 1) -> None:
        if n < 1:
            raise ValueError("increment must be one or more")
        with self._condvar:
            if self._bounded and self._counter.next(0) + n > self._counter._start:
                raise ValueError("semaphore released too many times")
            self._counter.next(n)
            self._condvar.notify(n)

    def free(self) -> None:
        self._counter.free()
        self._condvar.free()
