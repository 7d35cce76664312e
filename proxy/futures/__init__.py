"""shmproxy.futures: mpi4py.futures' executors over shmproxy.MPI, in a static world (no Spawn).

    mpiexec -n 4 python -m shmproxy.futures script.py     # rank 0 runs script.py, 1..3 run tasks

    from shmproxy.futures import MPIPoolExecutor
    with MPIPoolExecutor() as executor:
        print(list(executor.map(pow, [2, 3], [5, 7])))

``MPICommExecutor(comm, root)`` works in any program (collective over comm: the root gets the
executor, the other ranks run its tasks until the root leaves the block). The implementation and why
it has this shape: _core.py. ``as_completed``, ``wait`` and the rest are concurrent.futures', as in
mpi4py.futures.
"""
from __future__ import annotations

from concurrent.futures import (ALL_COMPLETED, FIRST_COMPLETED, FIRST_EXCEPTION, BrokenExecutor,
                                CancelledError, Executor, Future, InvalidStateError, TimeoutError,
                                as_completed, wait)

from shmproxy.futures._core import MPICommExecutor, MPIPoolExecutor

__all__ = ["MPIPoolExecutor", "MPICommExecutor", "Future", "Executor", "wait", "as_completed",
           "FIRST_COMPLETED", "FIRST_EXCEPTION", "ALL_COMPLETED", "CancelledError", "TimeoutError",
           "InvalidStateError", "BrokenExecutor"]
