"""Copy workers of the progress process.

Large chunks are copied and reduced by worker threads pinned to the progress process's cores, so
that N workers move bytes on N cores while the progress loop keeps fetching and matching. Small
chunks are copied inline by the loop: handing them over would cost more than the copy.

The workers are C threads (shm/_workers.c) that never take the GIL: the loop hands them a job (one
copy, or the steps of a collective's chunk: copies and C-kernel reductions) and later ``drain``s the
tokens of finished jobs, advancing the counters itself so that they keep a single writer. Handing a
job to a Python thread used to cost a queue wake-up and two GIL acquisitions, hundreds of
microseconds on a crowded host; through the C pool a job's round trip is one wake-up (the figures
are in docs/bench/HISTORY.md).

What only numpy does (float16 reductions, complex PROD/MIN/MAX, an in-place Reduce_scatter_block's
scratch buffers: ``submit(token, fn, arg)``) runs on Python threads, started on first use. They
report through the same finished list (``Workers.done``), so the loop waits in one place. A Python
task never raises into a void: its exception is kept and re-raised by ``drain`` in the loop, which
fails the communicator with it.

When the loop has nothing else to do while jobs are in flight, it blocks in ``wait`` (GIL
released) instead of spinning, or, on a node with no spare core (``LOOP_COPIES``), first runs queued
jobs itself (``help``).
"""
from __future__ import annotations

import queue
import threading
from typing import Any

from shmproxy.engine import affinity
from shmproxy.core import log
from shmproxy.shm import _native, _workers

_log = log.get("PROXY")
INLINE_BYTES = 64 << 10


class CopyEngine:
    def __init__(self, nthreads: int, cpus: list[int] | None, spread: bool = False):
        """``spread``: the loop runs jobs too (caller-runs); pin worker i to ``cpus[i % len(cpus)]`` alone,
        and a job the loop queues wakes none on the loop's CPU (shm/_workers.c, "Wake-ups")."""
        self.pool = _workers.Workers(nthreads, cpus, spread) if nthreads else None
        self.cpus = cpus
        self.nthreads = nthreads
        self.spread = spread
        self.in_flight = 0
        self.error: BaseException | None = None
        self.py_tasks: queue.SimpleQueue | None = None   # Python callables, on threads started lazily
        self.py_threads: list[threading.Thread] = []
        if nthreads:
            _log.info("copy engine: %d worker thread(s) on cpus %s%s", nthreads, cpus if cpus else "any",
                      ", one CPU each" if spread else "")

    @property
    def nworkers(self) -> int:
        return self.nthreads

    @property
    def jobs(self) -> int:
        """Jobs handed to the workers since the start (the dump's copy_jobs)."""
        return self.pool.submitted if self.pool is not None else 0

    def copy(self, sub: Any, dst: int, src: int, n: int) -> bool:
        """Copy one chunk: inline when small (returns True: done now), else on a worker (False)."""
        if n < INLINE_BYTES or self.pool is None:
            _native.memcopy(dst, src, n)
            return True
        self.pool.copy(sub, dst, src, n)
        self.in_flight += 1
        return False

    def run(self, token: Any, steps: list[tuple], streaming: bool = False) -> None:
        """Run native steps (shm/_workers.c: COPY and REDUCE tuples) in order on one worker, writing
        with non-temporal stores if ``streaming``."""
        self.pool.run(token, steps, streaming)  # type: ignore[union-attr]
        self.in_flight += 1

    def submit(self, token: Any, fn: Any, arg: Any) -> None:
        """Run ``fn(arg)`` on a Python worker thread; ``token`` comes back from ``drain`` when done."""
        if self.pool is None:
            raise RuntimeError("copy engine without workers")
        if self.py_tasks is None:
            self.py_tasks = queue.SimpleQueue()
            self.py_threads = [threading.Thread(target=self._py_worker, daemon=True, name=f"shmproxy-py-{i}")
                               for i in range(self.nthreads)]
            for t in self.py_threads:
                t.start()
        self.py_tasks.put((token, fn, arg))
        self.in_flight += 1

    def _py_worker(self) -> None:
        if self.cpus:
            affinity.pin_thread(self.cpus)
        tasks, pool = self.py_tasks, self.pool
        while True:
            task = tasks.get()  # type: ignore[union-attr]
            if task is None:
                return
            token, fn, arg = task
            try:
                fn(arg)
            except BaseException as exc:  # kept and re-raised in the loop by drain()
                self.error = exc
            pool.done(token)  # type: ignore[union-attr]
            # Drop our references now: a task holds numpy views of a rank's buffer, which could not
            # be unmapped while this idle worker still held it.
            del task, token, fn, arg

    def drain(self) -> list[Any]:
        """Tokens of the jobs finished since the last call (a sub per chunk copy)."""
        if self.error is not None:
            raise self.error
        if self.pool is None:
            return []
        out = self.pool.drain()
        self.in_flight -= len(out)
        return out

    def wait(self, timeout: float, poll: float = 0.0, watch: tuple[int, int] | None = None) -> None:
        """Block (GIL released) until a job has finished or ``timeout`` s pass, polling the first
        ``poll`` s; the finished job stays for the next ``drain``. ``watch`` = (address, seen): the
        poll ends too once that u64 differs from ``seen`` (the pool's EVENTS word)."""
        if self.pool is not None:
            if watch is not None:
                self.pool.wait(timeout, poll, *watch)
            else:
                self.pool.wait(timeout, poll)

    def help(self) -> bool:
        """Run one queued job on this thread, GIL released, as a worker would (its token comes back
        from ``drain``); False when none is queued. For a loop with no core of its own (_workers.c,
        "Caller-runs")."""
        return self.pool is not None and self.pool.help(1) > 0

    def stop(self) -> None:
        if self.py_tasks is not None:
            for _ in self.py_threads:
                self.py_tasks.put(None)
            for t in self.py_threads:
                t.join(timeout=5.0)
        if self.pool is not None:
            self.pool.stop()
