"""shmproxy.util: mpi4py.util's pure-Python layers over shmproxy.MPI.

A program that imports ``from mpi4py.util import pkl5`` (or dtlib, sync, pool) writes
``from shmproxy.util import pkl5`` instead. The submodules are written over what shmproxy.MPI
provides, not copied from mpi4py: shmproxy.MPI has no one-sided windows and no Spawn, so the parts
of mpi4py.util built on those (sync's Counter/Mutex/Condition/Semaphore, pool's workers) are built
here over point-to-point messages and a helper thread instead (each module's header says how).
Submodules load on first use, as mpi4py.util's do.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["dtlib", "pkl5", "pool", "sync"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
