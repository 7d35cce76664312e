"""Copy workers of the progress process.

Large chunks are copied by worker threads pinned to the progress process's cores: the copy itself
(shm._native.memcopy) runs without the GIL, so N workers move bytes on N cores while the progress loop
keeps fetching and matching. Small chunks are copied inline by the loop: handing them to a thread
would cost more than the copy.

Handoff: the loop submits (sub, dst, src, n); a worker copies and puts the sub on ``finished``; the
loop ``drain``s it and advances the sub's counters itself, so the counters keep a single writer. A
worker never raises into a void: an exception is kept and re-raised by ``drain`` in the loop, which
fails the communicator with it.

The GIL matters here. A worker leaving the GIL-free copy must take the GIL back; if the loop spins
in Python meanwhile, the worker waits for the interpreter's switch interval (5 ms by default: a
256 KiB message took 5.7 ms instead of 0.17). So when the loop has nothing else to do while chunks
are in flight, it blocks in ``wait`` (on the queue, GIL released) instead of spinning, and the
progress process also shortens the switch interval.
"""
from __future__ import annotations

import queue
import threading
from typing import Any

from proxy import affinity, log
from shm import _native

_log = log.get("PROXY")
INLINE_BYTES = 64 << 10


class CopyEngine:
    def __init__(self, nthreads: int, cpus: list[int] | None):
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.finished: queue.SimpleQueue = queue.SimpleQueue()
        self.in_flight = 0
        self.error: BaseException | None = None
        self.threads = [threading.Thread(target=self._worker, args=(cpus,), daemon=True,
                                         name=f"shmproxy-copy-{i}") for i in range(nthreads)]
        for t in self.threads:
            t.start()
        _log.info("copy engine: %d worker thread(s) on cpus %s", nthreads, cpus if cpus else "any")

    @property
    def nworkers(self) -> int:
        return len(self.threads)

    def _worker(self, cpus: list[int] | None) -> None:
        if cpus:
            affinity.pin_thread(cpus)
        memcopy = _native.memcopy
        while True:
            task = self.tasks.get()
            if task is None:
                return
            token, fn, arg = task
            try:
                if fn is None:
                    memcopy(*arg)
                else:
                    fn(arg)
            except BaseException as exc:  # kept and re-raised in the loop by drain()
                self.error = exc
            self.finished.put(token)
            # Drop our references now: an entry holds numpy views of a rank's buffer, which could
            # not be unmapped while this idle worker still held it.
            del task, token, fn, arg

    def copy(self, sub: Any, dst: int, src: int, n: int) -> bool:
        """Copy one chunk: inline when small (returns True: done now), else on a worker (False)."""
        if n < INLINE_BYTES or not self.threads:
            _native.memcopy(dst, src, n)
            return True
        self.tasks.put((sub, None, (dst, src, n)))
        self.in_flight += 1
        return False

    def submit(self, token: Any, fn: Any, arg: Any) -> None:
        """Run ``fn(arg)`` on a worker; ``token`` comes back from ``drain`` when it is done."""
        self.tasks.put((token, fn, arg))
        self.in_flight += 1

    def drain(self) -> list[Any]:
        """Tokens of the tasks finished since the last call (a sub per chunk copy)."""
        if self.error is not None:
            raise self.error
        out = []
        finished = self.finished
        while not finished.empty():
            out.append(finished.get_nowait())
        self.in_flight -= len(out)
        return out

    def wait(self, timeout: float) -> None:
        """Block (GIL released) until a worker finishes a chunk or ``timeout`` s pass; the finished
        chunk stays queued for the next ``drain``."""
        try:
            sub = self.finished.get(timeout=timeout)
        except queue.Empty:
            return
        self.finished.put(sub)

    def stop(self) -> None:
        for _ in self.threads:
            self.tasks.put(None)
        for t in self.threads:
            t.join(timeout=5.0)
