"""Copy workers of the progress process.

Large chunks are copied by worker threads pinned to the progress process's cores: the copy itself
(shm._native.memcopy) runs without the GIL, so N workers move bytes on N cores while the progress loop
keeps fetching and matching. Small chunks are copied inline by the loop: handing them to a thread
would cost more than the copy.

Handoff: the loop ``submit``s (sub, dst, src, n); a worker copies and appends the sub to ``finished``
(collections.deque.append is atomic under the GIL); the loop ``drain``s it and advances the sub's
counters itself, so the counters keep a single writer. A worker never raises into a void: an
exception is kept and re-raised by ``drain`` in the loop, which fails the communicator with it.
"""
from __future__ import annotations

import collections
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
        self.finished: collections.deque = collections.deque()
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
            sub, dst, src, n = task
            try:
                memcopy(dst, src, n)
            except BaseException as exc:  # kept and re-raised in the loop by drain()
                self.error = exc
            self.finished.append(sub)

    def copy(self, sub: Any, dst: int, src: int, n: int) -> bool:
        """Copy one chunk: inline when small (returns True: done now), else on a worker (False)."""
        if n < INLINE_BYTES or not self.threads:
            _native.memcopy(dst, src, n)
            return True
        self.tasks.put((sub, dst, src, n))
        return False

    def drain(self) -> list[Any]:
        """Subs whose worker copies finished since the last call (one entry per chunk)."""
        if self.error is not None:
            raise self.error
        out = []
        finished = self.finished
        while finished:
            out.append(finished.popleft())
        return out

    def stop(self) -> None:
        for _ in self.threads:
            self.tasks.put(None)
        for t in self.threads:
            t.join(timeout=5.0)
