"""mpi4py's per-communicator lock table (MPI._comm_lock_table, MPI._comm_lock).

mpi4py keeps, for each communicator, a dict of ``threading.Lock`` by operation name, made on first
use; its pickle-based bcast holds the "bcast" lock so that two threads of one process calling bcast
on one communicator do not interleave their messages. The MPI layer does the same: a lock per
(native communicator, name), so that every handle of one communicator (Dup'd handles are other
communicators; ``MPI.Comm(comm)`` is the same one) shares it, and the table goes with the
communicator.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

_table_lock = threading.Lock()
_tables: "weakref.WeakKeyDictionary[Any, dict[str, threading.Lock]]" = weakref.WeakKeyDictionary()


def _comm_lock_table(comm: Any) -> dict[str, threading.Lock]:
    """The communicator's locks by name (the dict itself, as mpi4py gives it)."""
    from shmproxy.mpi.comm import Comm
    if not isinstance(comm, Comm):
        raise TypeError(f"MPI._comm_lock_table() takes an MPI.Comm, not {type(comm).__name__}")
    native = comm._c     # COMM_NULL or a freed handle: ERR_COMM, as any call on it
    with _table_lock:
        table = _tables.get(native)
        if table is None:
            table = _tables[native] = {}
        return table


def _comm_lock(comm: Any, key: str) -> threading.Lock:
    """The lock named ``key`` of the communicator, made on first use."""
    table = _comm_lock_table(comm)
    with _table_lock:
        lock = table.get(key)
        if lock is None:
            lock = table[key] = threading.Lock()
        return lock
