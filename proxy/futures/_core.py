"""The executor of shmproxy.futures: tasks of rank ``root`` run by the other ranks of a communicator.

Why this shape: mpi4py.futures spawns its workers (MPI Spawn), which shmproxy.MPI does not have. Here
the workers are ranks of a static job: in ``MPICommExecutor(comm, root)`` the other ranks of
``comm``, and in ``MPIPoolExecutor`` under ``mpiexec -n N python -m shmproxy.futures script.py``
ranks 1..N-1 of COMM_WORLD (``__main__.py`` starts them serving before rank 0 runs the script).

Messages: the ranks talk on a duplicate of the communicator (made collectively when the pool
starts), so they never match the program's own messages. The root's manager thread is the only
thread of the root that touches the duplicate (shmproxy.MPI serialises threads per communicator);
``submit`` hands it tasks through a queue. It sends ``(id, fn, args, kwargs)`` to an idle worker
(tag _TASK), polls with iprobe for ``(id, ok, value)`` replies (tag _RESULT), and ``None`` (tag _TASK)
stops a worker. The task travels pickled inside the message (pickled by the manager, unpickled by
the worker), so a task whose function cannot be found on the worker fails its future, not the
worker; the worker ranks of ``python -m shmproxy.futures`` load the script as ``__main__`` first, so
that functions of the script resolve. Polls sleep at most 1 ms between two looks, and every wait
(shutdown, a worker's wait for its next task) ends when the pool is stopped or the runtime reports a failure.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import pickle
import queue
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from shmproxy import MPI

_TASK, _RESULT = 11, 12
_POLL_MAX = 1e-3


def _sleep(delay: float) -> float:
    delay = min(max(delay * 2, 1e-5), _POLL_MAX)
    time.sleep(delay)
    return delay


def serve(comm: Any, root: int) -> None:
    """A worker's loop on ``comm`` (a duplicate): run tasks from ``root`` until it sends None."""
    delay = 0.0
    while True:
        if not comm.iprobe(root, _TASK):
            delay = _sleep(delay)
            continue
        delay = 0.0
        task = comm.recv(source=root, tag=_TASK)
        if task is None:
            return
        tid, payload = task
        try:
            fn, args, kwargs = pickle.loads(payload)
            reply = (tid, True, fn(*args, **kwargs))
        except BaseException as exc:   # noqa: BLE001 - the task's exception goes back to its future
            reply = (tid, False, exc)
        try:
            comm.send(reply, root, _RESULT)
        except Exception as exc:        # noqa: BLE001 - an unpicklable result: say why instead
            comm.send((tid, False, RuntimeError(f"the task's result could not be sent: {exc!r}")),
                      root, _RESULT)


class _Manager:
    """The root's side: the duplicate, the workers' ranks, and the thread that feeds them."""

    def __init__(self, comm: Any, root: int, workers: list[int]) -> None:
        self.comm, self.root, self.workers = comm, root, workers
        self.tasks: "queue.SimpleQueue[tuple[cf.Future, Callable, tuple, dict] | None]" = queue.SimpleQueue()
        self.stopped = threading.Event()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="shmproxy-futures", daemon=True)
        self.thread.start()

    def submit(self, future: cf.Future, fn: Callable, args: tuple, kwargs: dict) -> None:
        if self.failure is not None:
            raise RuntimeError(f"the executor's manager thread failed: {self.failure!r}")
        self.tasks.put((future, fn, args, kwargs))

    def _run(self) -> None:
        idle = collections.deque(self.workers)
        pending: collections.deque = collections.deque()
        running: dict[int, cf.Future] = {}
        ids = itertools.count()
        status = MPI.Status()
        closing = False
        delay = 0.0
        try:
            while not (closing and not pending and not running):
                busy = False
                while True:
                    try:
                        item = self.tasks.get_nowait()
                    except queue.Empty:
                        break
                    busy = True
                    if item is None:
                        closing = True
                    else:
                        pending.append(item)
                while pending and idle:
                    future, fn, args, kwargs = pending.popleft()
                    if not future.set_running_or_notify_cancel():
                        continue
                    tid = next(ids)
                    worker = idle.popleft()
                    try:    # pickled here: a task that cannot be pickled fails its future only
                        payload = pickle.dumps((fn, args, kwargs), pickle.HIGHEST_PROTOCOL)
                    except Exception as exc:   # noqa: BLE001
                        future.set_exception(exc)
                        idle.append(worker)
                        continue
                    self.comm.send((tid, payload), worker, _TASK)
                    running[tid] = future
                    busy = True
                while running and self.comm.iprobe(MPI.ANY_SOURCE, _RESULT, status):
                    worker = status.Get_source()
                    tid, ok, value = self.comm.recv(source=worker, tag=_RESULT)
                    future = running.pop(tid)
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(value)
                    idle.append(worker)
                    busy = True
                delay = 0.0 if busy else _sleep(delay)
        except BaseException as exc:    # noqa: BLE001 - fails every future; submit raises it
            self.failure = exc
            for future in [*running.values(), *(p[0] for p in pending)]:
                if not future.done():
                    future.set_exception(exc)
        finally:
            self.stopped.set()

    def close(self, wait: bool) -> None:
        self.tasks.put(None)
        if wait:
            while not self.stopped.wait(1.0):
                if not self.thread.is_alive():
                    break


class _Executor(cf.Executor):
    """concurrent.futures.Executor over a _Manager (what MPIPoolExecutor and MPICommExecutor give)."""

    def __init__(self, manager: "_Manager | _SharedManager | None",
                 on_shutdown: Callable[[], None] | None = None) -> None:
        self._manager = manager
        self._on_shutdown = on_shutdown
        self._local = cf.ThreadPoolExecutor(1) if manager is None or not manager.workers else None
        self._shutdown = False
        self._lock = threading.Lock()
        self._futures: "list[cf.Future]" = []

    @property
    def num_workers(self) -> int:
        return 1 if self._local is not None else len(self._manager.workers)  # type: ignore[union-attr]

    def bootup(self, wait: bool = True) -> "_Executor":
        return self

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> cf.Future:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit after shutdown")
            if self._local is not None:
                return self._local.submit(fn, *args, **kwargs)
            future: cf.Future = cf.Future()
            assert self._manager is not None
            self._manager.submit(future, fn, args, kwargs)
            self._futures = [f for f in self._futures if not f.done()] + [future]
            return future

    def map(self, fn: Callable, *iterables: Iterable, timeout: float | None = None, chunksize: int = 1,
            buffersize: int | None = None, unordered: bool = False) -> Iterator:
        return self.starmap(fn, zip(*iterables), timeout, chunksize, unordered)

    def starmap(self, fn: Callable, iterable: Iterable, timeout: float | None = None, chunksize: int = 1,
                unordered: bool = False) -> Iterator:
        chunksize = max(int(chunksize), 1)
        items = iter(iterable)
        chunks = iter(lambda: list(itertools.islice(items, chunksize)), [])
        futures = [self.submit(_run_chunk, fn, chunk) for chunk in chunks]
        return _results(futures, timeout, unordered)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
        if cancel_futures:
            for f in self._futures:
                f.cancel()
        if self._local is not None:
            self._local.shutdown(wait, cancel_futures=cancel_futures)
        if self._manager is not None:
            self._manager.close(wait)
        if self._on_shutdown is not None:
            self._on_shutdown()


def _run_chunk(fn: Callable, chunk: list) -> list:
    return [fn(*args) for args in chunk]


def _results(futures: list, timeout: float | None, unordered: bool) -> Iterator:
    end = None if timeout is None else time.monotonic() + timeout
    try:
        order = cf.as_completed(futures, timeout) if unordered else iter(futures)
        for future in order:
            left = None if end is None else max(end - time.monotonic(), 0)
            yield from future.result(left)
    finally:
        for future in futures:
            future.cancel()


# ---- the static world pool of ``python -m shmproxy.futures``
_world: dict[str, Any] = {}


def world_pool_start(prepare: Callable[[], None] | None = None) -> bool:
    """Every rank (from __main__): duplicate COMM_WORLD; ranks > 0 run ``prepare`` (load the script
    as __main__) and serve, then return False."""
    world = MPI.COMM_WORLD
    comm = world.Dup()
    _world["comm"] = comm
    if world.Get_rank() != 0:
        if prepare is not None:
            prepare()
        serve(comm, 0)
        comm.Free()
        return False
    _world["manager"] = _Manager(comm, 0, list(range(1, comm.Get_size()))) if comm.Get_size() > 1 else None
    return True


def world_pool_stop() -> None:
    """Rank 0, after the script: stop the workers (every submitted task runs first)."""
    manager = _world.pop("manager", None)
    comm = _world.pop("comm", None)
    if manager is not None:
        manager.close(True)
        for worker in manager.workers:
            comm.send(None, worker, _TASK)
    if comm is not None:
        comm.Free()


class MPIPoolExecutor(_Executor):
    """Tasks run by the worker ranks of ``python -m shmproxy.futures`` (ranks 1..N-1 of COMM_WORLD).

    Without them (not started that way) there is nothing to run tasks on: mpi4py would Spawn new
    processes, which shmproxy.MPI does not provide, so NotImplementedError says so. ``max_workers``
    and the spawn options are accepted and ignored (the pool is the job's ranks).
    """

    def __init__(self, max_workers: int | None = None, initializer: Callable | None = None,
                 initargs: tuple = (), **kwargs: Any) -> None:
        if "comm" not in _world:
            raise NotImplementedError(
                "shmproxy.futures.MPIPoolExecutor needs worker ranks: run the program as "
                "`mpiexec -n N python -m shmproxy.futures script.py` (MPI Spawn, which mpi4py uses "
                "otherwise, is not provided by shmproxy.MPI), or use MPICommExecutor")
        manager = _world.get("manager")
        super().__init__(_SharedManager(manager) if manager is not None else None)
        if initializer is not None:
            for worker in range(max(self.num_workers, 1)):
                self.submit(initializer, *initargs).result()


class _SharedManager:
    """The world pool's manager, seen by one MPIPoolExecutor: shutdown waits for this executor's
    tasks, and leaves the workers to the next executor (``world_pool_stop`` stops them)."""

    def __init__(self, manager: _Manager) -> None:
        self._m, self.workers = manager, manager.workers
        self._futures: list[cf.Future] = []

    def submit(self, future: cf.Future, fn: Callable, args: tuple, kwargs: dict) -> None:
        self._futures.append(future)
        self._m.submit(future, fn, args, kwargs)

    def close(self, wait: bool) -> None:
        if wait:
            cf.wait(self._futures)


class MPICommExecutor:
    """``with MPICommExecutor(comm, root) as executor``: an executor on ``root`` (None elsewhere), the
    other ranks of ``comm`` running its tasks until the block ends there (collective over ``comm``)."""

    def __init__(self, comm: Any = None, root: int = 0, **kwargs: Any) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        if comm.Is_inter():
            raise ValueError("expecting an intracommunicator")
        if not 0 <= root < comm.Get_size():
            raise ValueError("expecting root in range(comm.size)")
        self._comm, self._root = comm, int(root)
        self._executor: _Executor | None = None

    def __enter__(self) -> _Executor | None:
        if self._executor is not None:
            raise RuntimeError("executor already started")
        dup = self._comm.Dup()
        rank, size = dup.Get_rank(), dup.Get_size()
        if rank != self._root:
            try:
                serve(dup, self._root)
            finally:
                dup.Free()
            return None
        workers = [r for r in range(size) if r != self._root]
        manager = _Manager(dup, self._root, workers) if workers else None

        def stop_workers() -> None:     # after the manager thread has ended: this thread may use dup
            if manager is not None:
                manager.close(True)
            for worker in workers:
                dup.send(None, worker, _TASK)
            dup.Free()
        self._executor = _Executor(manager, stop_workers)
        return self._executor

    def __exit__(self, *exc: Any) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
