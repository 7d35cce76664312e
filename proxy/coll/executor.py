"""Executors: what runs the data entries of collective schedules (copies and reductions).

A schedule (shmproxy.coll.sched) says what to move and combine, on memory regions given as address,
count and dtype; an executor does it on the device the memory lives on. The progress process's
collectives only ever call these methods, so a GPU executor (copies and reduction kernels on its own
streams, completion by events) slots in beside this one without touching the schedules.

The CPU executor runs entries of at least ``inline_bytes`` on the copy workers (shm/_workers.c: C
threads that never take the GIL) as native steps, other ones in the loop's own thread: a worker
hand-off costs more than a small copy. Reductions the C kernel lacks (float16 and complex MIN/MAX)
run as numpy ufuncs over views made from the regions' addresses, on a worker as a Python job or
inline; so do AVG's division and any callback.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np

from shmproxy.coll.sched import CB, COPY, NOP, REDUCE, Entry, Region, Schedule
from shmproxy.core import errors
from shmproxy.shm import _native, _reduce, _workers

INLINE_ENTRY_BYTES = 64 << 10  # schedule entries smaller than this run in the loop, not on a worker


def host_view(r: Region) -> np.ndarray:
    """A numpy array over a host region (for the ufunc paths): no copy, valid while the mapping is."""
    if not r.count:
        return np.empty(0, r.dtype)
    raw = (ctypes.c_char * r.nbytes).from_address(r.addr)
    return np.frombuffer(memoryview(raw), dtype=r.dtype, count=r.count)


class CpuExecutor:
    """Copies and reductions on host memory, by the progress process's CPU cores."""

    name = "cpu"

    def __init__(self, workers: Callable[[], Any], inline_bytes: int = INLINE_ENTRY_BYTES):
        self._workers = workers          # the current CopyEngine (replaced once the affinity is decided)
        self.inline_bytes = inline_bytes

    @property
    def nworkers(self) -> int:
        return self._workers().nworkers

    # ------------------------------------------------------------------ one entry
    def execute(self, e: Entry, streaming: bool = False) -> None:
        """Run one data entry here and now, writing with non-temporal stores if ``streaming`` (COPY
        and C-kernel REDUCE). SEND/RECV never get here: they go through connectors."""
        k = e.kind
        if k == COPY:
            (_native.memcopy_nt if streaming else _native.memcopy)(e.dst, e.src, e.nbytes)
        elif k == REDUCE:
            if e.args is not None:
                _reduce.reduce(*e.args, streaming)
            else:
                a, b, out = e.a, e.b, e.out
                assert a is not None and b is not None and out is not None   # sched.reduce set them
                e.ufunc(host_view(a), host_view(b) if isinstance(b, Region) else b, out=host_view(out), **e.kw)
        elif k == CB:
            fn = e.fn
            assert fn is not None   # sched.callback set it
            fn()
        elif k != NOP:
            raise errors.InternalError(f"entry {e!r} cannot be executed by the {self.name} executor")

    @staticmethod
    def native_step(e: Entry) -> tuple | None:
        """The entry as a step of the C workers, or None when it needs Python."""
        if e.kind == COPY:
            return (_workers.COPY, e.dst, e.src, e.nbytes)
        if e.kind == REDUCE and e.args is not None:
            return (_workers.REDUCE, *e.args)
        return None

    def start(self, sch: Schedule, e: Entry) -> bool:
        """Start one data entry of ``sch``: True when it completed inline, False when a worker runs it
        (its token (sch, e) comes back from the copy engine's drain)."""
        workers = self._workers()
        if e.nbytes >= self.inline_bytes and workers.nworkers:
            step = self.native_step(e)
            if step is not None:
                workers.run((sch, e), [step], sch.streaming)
            else:
                workers.submit((sch, e), self.execute, e)   # numpy or a callback: no stores to choose
            return False
        self.execute(e, sch.streaming)
        return True

    def start_inline(self, sch: Schedule, e: Entry) -> bool:
        self.execute(e)
        return True

    def start_schedule(self, sch: Schedule) -> bool:
        """Hand a whole chunk schedule to one worker when it can run there alone (no SEND/RECV: it keeps
        a chunk's result in that core's cache for the copies out); False otherwise (the caller then
        starts it entry by entry)."""
        workers = self._workers()
        if not workers.nworkers or not sch.local_only:
            return False
        steps = self.native_steps(sch)
        sch.claim()
        if steps is not None:
            workers.run(sch, steps, sch.streaming)
        else:
            workers.submit(sch, self.run_all, sch)
        return True

    def native_steps(self, sch: Schedule) -> list[tuple] | None:
        """Every data entry of ``sch`` as a C worker step, in order (NOPs dropped), or None when one
        needs Python."""
        steps = []
        for e in sch.entries:
            if e.kind == NOP:
                continue
            step = self.native_step(e)
            if step is None:
                return None
            steps.append(step)
        return steps

    def run_all(self, sch: Schedule) -> None:
        """Execute every entry of ``sch`` in order (each barrier is trivially respected). Worker side."""
        for e in sch.entries:
            self.execute(e, sch.streaming)
