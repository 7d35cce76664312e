"""shmproxy.util.pool: multiprocessing.pool's interface (mpi4py.util.pool's Pool and ThreadPool) over
shmproxy.futures.

Why it is thin: each call maps onto an executor. ``Pool`` runs tasks on MPIPoolExecutor's worker
ranks (so, as shmproxy.futures says, the program runs under ``mpiexec -n N python -m
shmproxy.futures``; there is no Spawn to start workers otherwise); ``ThreadPool`` on
concurrent.futures' ThreadPoolExecutor. The ``*_async`` calls return AsyncResult objects over a future;
the async map forms collect their results in a helper thread pool of the Pool, shut down by
``join``. ``maxtasksperchild`` and ``context`` are not supported: a value other than None warns,
as in mpi4py.
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import operator
import os
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator

from shmproxy.futures import MPIPoolExecutor

__all__ = ["Pool", "ThreadPool", "AsyncResult", "ApplyResult", "MapResult"]


class Pool:
    """A pool of worker processes (the worker ranks of shmproxy.futures)."""

    Executor: Any = MPIPoolExecutor

    def __init__(self, processes: int | None = None, initializer: Callable | None = None,
                 initargs: Iterable = (), **kwargs: Any) -> None:
        if processes is not None and processes < 1:
            raise ValueError("number of processes must be at least 1")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        for name in ("maxtasksperchild", "context"):
            if kwargs.pop(name, None) is not None:
                warnings.warn(f"argument {name!r} is not supported", stacklevel=2)
        self.executor = self.Executor(processes, initializer=initializer, initargs=tuple(initargs), **kwargs)
        self._helper: cf.ThreadPoolExecutor | None = None
        self._helper_lock = threading.Lock()

    def _async(self) -> cf.ThreadPoolExecutor:
        with self._helper_lock:
            if self._helper is None:
                self._helper = cf.ThreadPoolExecutor(min(32, (os.cpu_count() or 1) + 4))
                weakref.finalize(self, self._helper.shutdown, False)
            return self._helper

    def _workers(self) -> int:
        return int(getattr(self.executor, "_max_workers", 0) or getattr(self.executor, "num_workers", 0) or 0)

    def _chunks(self, iterable: Iterable, chunksize: int | None) -> tuple[Iterable, int]:
        if chunksize is not None:
            return iterable, chunksize
        workers = self._workers()
        if workers <= 0:
            return iterable, 1
        tasks = operator.length_hint(iterable)
        if tasks == 0:
            iterable = list(iterable)
            tasks = len(iterable)
        quot, rem = divmod(tasks, workers * 4)
        return iterable, max(quot + bool(rem), 1)

    def apply(self, func: Callable, args: Iterable = (), kwds: dict | None = None) -> Any:
        return self.executor.submit(func, *args, **(kwds or {})).result()

    def apply_async(self, func: Callable, args: Iterable = (), kwds: dict | None = None,
                    callback: Callable | None = None,
                    error_callback: Callable | None = None) -> "ApplyResult":
        return ApplyResult(self.executor.submit(func, *args, **(kwds or {})), callback, error_callback)

    def map(self, func: Callable, iterable: Iterable, chunksize: int | None = None) -> list:
        iterable, chunksize = self._chunks(iterable, chunksize)
        return list(self.imap(func, iterable, chunksize))

    def map_async(self, func: Callable, iterable: Iterable, chunksize: int | None = None,
                  callback: Callable | None = None, error_callback: Callable | None = None) -> "MapResult":
        iterable, chunksize = self._chunks(iterable, chunksize)
        results = self.executor.map(func, iterable, chunksize=chunksize)
        return MapResult(self._async().submit(list, results), callback, error_callback)

    def imap(self, func: Callable, iterable: Iterable, chunksize: int = 1) -> Iterator:
        return self.executor.map(func, iterable, chunksize=chunksize)

    def imap_unordered(self, func: Callable, iterable: Iterable, chunksize: int = 1) -> Iterator:
        if isinstance(self.executor, MPIPoolExecutor):
            return self.executor.map(func, iterable, chunksize=chunksize, unordered=True)
        futures = [self.executor.submit(func, item) for item in iterable]
        return (f.result() for f in cf.as_completed(futures))

    def starmap(self, func: Callable, iterable: Iterable, chunksize: int | None = None) -> list:
        iterable, chunksize = self._chunks(iterable, chunksize)
        return list(self.istarmap(func, iterable, chunksize))

    def starmap_async(self, func: Callable, iterable: Iterable, chunksize: int | None = None,
                      callback: Callable | None = None,
                      error_callback: Callable | None = None) -> "MapResult":
        iterable, chunksize = self._chunks(iterable, chunksize)
        return MapResult(self._async().submit(list, self.istarmap(func, iterable, chunksize)),
                         callback, error_callback)

    def istarmap(self, func: Callable, iterable: Iterable, chunksize: int = 1) -> Iterator:
        if isinstance(self.executor, MPIPoolExecutor):
            return self.executor.starmap(func, iterable, chunksize=chunksize)
        return self.executor.map(functools.partial(_star, func), iterable, chunksize=chunksize)

    def istarmap_unordered(self, func: Callable, iterable: Iterable, chunksize: int = 1) -> Iterator:
        if isinstance(self.executor, MPIPoolExecutor):
            return self.executor.starmap(func, iterable, chunksize=chunksize, unordered=True)
        futures = [self.executor.submit(func, *args) for args in iterable]
        return (f.result() for f in cf.as_completed(futures))

    def close(self) -> None:
        self.executor.shutdown(wait=False)

    def terminate(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def join(self) -> None:
        self.executor.shutdown(wait=True)
        with self._helper_lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=True)

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.terminate()


def _star(func: Callable, args: Iterable) -> Any:
    return func(*args)


class ThreadPool(Pool):
    """The same interface over threads of this process."""

    Executor = cf.ThreadPoolExecutor


class AsyncResult:
    """The result of an ``*_async`` call: ``get``, ``wait``, ``ready``, ``successful``."""

    def __init__(self, future: cf.Future, callback: Callable | None = None,
                 error_callback: Callable | None = None) -> None:
        self.future = future
        self._event = threading.Event()
        future.add_done_callback(functools.partial(_on_done, event=self._event, callback=callback,
                                                   error_callback=error_callback))

    def get(self, timeout: float | None = None) -> Any:
        """The result (or the call's exception, raised); TimeoutError when not there within ``timeout``."""
        self.wait(timeout)
        if not self.ready():
            raise TimeoutError
        try:
            return self.future.result()
        except cf.CancelledError:
            raise TimeoutError from None

    def wait(self, timeout: float | None = None) -> None:
        self._event.wait(timeout)

    def ready(self) -> bool:
        return self._event.is_set()

    def successful(self) -> bool:
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        try:
            return self.future.exception() is None
        except cf.CancelledError:
            return False


class ApplyResult(AsyncResult):
    """What ``apply_async`` returns."""


class MapResult(AsyncResult):
    """What ``map_async`` and ``starmap_async`` return."""


def _on_done(future: cf.Future, event: threading.Event, callback: Callable | None,
             error_callback: Callable | None) -> None:
    try:
        try:
            exception = future.exception()
        except cf.CancelledError:
            exception = TimeoutError()
        if exception is not None:
            if error_callback is not None:
                error_callback(exception)
        elif callback is not None:
            callback(future.result())
    finally:
        event.set()
