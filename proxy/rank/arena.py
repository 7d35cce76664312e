"""numpy arrays born in registered memory: when the arena (shm/_arena.c) is on, and its registrations.

A program that passes its own numpy arrays (an mpi4py program after the import change) would have
every one of them copied into staging memory at the post and out of it at completion: the progress
process can only move memory it has mapped. The arena makes the arrays it allocates mappable from
birth: one memfd per process, reserved sparse at NUMPY_ARENA_BYTES and mapped once, from which numpy
takes the data of every array of at least NUMPY_ARENA_MIN_BYTES (NEP 49's memory handler). Each
communicator registers the arena once with its progress process, as comm.alloc memory, so such an
array is zero-copy to every operation and the post path finds it by the same range lookup.

- **Which arrays.** Those allocated after the first ``init`` in the thread that called it (numpy's
  handler is a context variable) and until the last communicator closes; an array made before, in
  another thread, or after is numpy's and staged as before. numpy frees each array through the
  handler that made it, so an arena array freed after ``close`` goes back to the arena.
- **Lifetime.** The arena outlives the communicators (arrays may): it is anonymous memory of the
  process, nothing in /dev/shm, gone with the process whatever its exit; a progress process unmaps
  its view when it ends.
- **fork.** The child's view becomes private (``_arena.after_fork_child``): its writes do not reach
  the parent; docs/decisions.md says what differs from malloc's snapshot.
- Where the arena cannot be made (numpy older than 1.22, memfd refused) the arrays are numpy's and
  a warning says so once.
"""
from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import Any

import numpy as np

from shmproxy.core import errors, host, log
from shmproxy.rank.buffers import Registry

_log = log.get("SHM")
_lock = threading.Lock()
_made: dict[str, int] = {}   # fd, base, size: the process's arena once made
_users = 0                   # communicators open with the handler installed
_failed = False


def _arena() -> Any:
    from shmproxy.shm import _arena as mod
    return mod


def _make(params: Any) -> bool:
    """The arena, made once per process; whether there is one."""
    global _failed
    if _made:
        return True
    if _failed:
        return False
    mod = _arena()
    size = params.NUMPY_ARENA_BYTES or 2 * host.memory_bytes()
    try:
        fd, base = mod.create(size, params.NUMPY_ARENA_MIN_BYTES, params.NUMPY_ARENA_KEEP_BYTES)
    except OSError as exc:
        _failed = True
        _log.warning("numpy arrays stay numpy's (staged at each operation): the arena cannot be made: %s", exc)
        return False
    _made.update(fd=fd, base=base, size=mod.stats()["size"])
    os.register_at_fork(after_in_child=_after_fork_child)
    return True


def _after_fork_child() -> None:
    global _users
    _users = 0
    _arena().after_fork_child()


def attach(registry: Registry, params: Any) -> bool:
    """At a communicator's init: register the arena with its progress process and (first user)
    install numpy's handler. Whether the communicator has it."""
    global _users
    if not params.NUMPY_ARENA:
        return False
    with _lock:
        if not _make(params) or _arena().stats()["forked"]:
            return False
        try:
            registry.adopt(_made["fd"], _made["base"], _made["size"])
        except (errors.PeerDiedError, errors.Aborted, errors.Closed, errors.Timeout):
            raise
        except errors.ProxyError as exc:   # e.g. an address-space limit (ulimit -v) in the progress process
            _log.warning("numpy arrays are staged on this communicator: its progress process cannot map "
                         "the arena: %s", exc)
            return False
        if _users == 0:
            try:
                _arena().configure(params.NUMPY_ARENA_MIN_BYTES, params.NUMPY_ARENA_KEEP_BYTES)
                _arena().install()
            except RuntimeError as exc:   # numpy without memory handlers (< 1.22)
                _log.warning("numpy arrays stay numpy's (staged at each operation): %s", exc)
                return False
        _users += 1
    return True


def detach() -> None:
    """At a communicator's close (one that attached): the last one puts numpy's handler back."""
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            _arena().uninstall()


def held() -> tuple[int, int, int]:
    """The arena (base, bytes, fd), where attach said this process has one: the middle collectives
    publish it to their peers, which map it (shm/_poster_coll.c)."""
    return _made["base"], _made["size"], _made["fd"]


def block(nbytes: int, zero: bool = False) -> int:
    """The address of ``nbytes`` of the arena for shmproxy's own use (a communicator's scratch)."""
    return int(_arena().block(nbytes, zero))


def array(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zeroed array of its own block of the arena, the block given back with the array's last view:
    comm.alloc's, where there is an arena (registered with every communicator, and the middle
    collectives read it in place)."""
    count = int(np.prod(shape, dtype=np.int64)) if shape != () else 1
    nbytes = max(count * dtype.itemsize, 1)
    addr = block(nbytes, zero=True)
    buf = (ctypes.c_char * nbytes).from_address(addr)
    weakref.finalize(buf, release, addr)
    return np.frombuffer(memoryview(buf), dtype=dtype, count=count).reshape(shape)


def release(addr: int) -> None:
    _arena().release(addr)


def stats() -> dict[str, Any]:
    """The arena's counters (for tests and the dump); empty where there is none."""
    return dict(_arena().stats()) if _made else {}


def owns(addr: int) -> bool:
    return bool(_made) and bool(_arena().owns(addr))
