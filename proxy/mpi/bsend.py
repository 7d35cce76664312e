"""Buffered-mode sends (Bsend, Ibsend, Bsend_init, bsend, ibsend) and the buffer they draw on
(MPI.Attach_buffer / Detach_buffer), and MPI.Alloc_mem / Free_mem.

A buffered send completes locally: the caller may reuse its buffer at once, whether or not a receive
matched. Here the message is copied into memory of this layer and sent from there with an ordinary
nonblocking send; the attached buffer is the budget those copies draw on, as in MPI: a message takes
its size plus BSEND_OVERHEAD bytes until its send completes, and a send that does not fit fails with
ERR_BUFFER (MPI leaves it erroneous; failing loudly is allowed). Detach_buffer waits for every
buffered send still in flight, as MPI's does, and gives the buffer back. The attached object itself
is not written to (the copies live in separate memory), which no program can tell apart.

Alloc_mem gives ordinary process memory (a writable memoryview of that many bytes); Free_mem
releases it. Nothing here is shared with other processes.
"""
from __future__ import annotations

import pickle
from typing import Any

from shmproxy.mpi.exceptions import ERR_BUFFER, ERR_NO_MEM, as_int, error

BSEND_OVERHEAD = 64      # bytes a buffered message takes besides its data

_attached: Any = None
_capacity = 0
_pending: list[tuple[Any, int]] = []     # (MPI request of the send, bytes it takes)


def attach(buf: Any) -> None:
    global _attached, _capacity
    if _attached is not None:
        raise error(ERR_BUFFER, "Attach_buffer: a buffer is already attached (Detach_buffer it first)")
    from shmproxy.mpi.buffers import parse
    _capacity = parse(buf, "Attach_buffer", False).nbytes
    _attached = buf


def detach() -> Any:
    """Wait for every buffered send in flight; the buffer that was attached."""
    global _attached, _capacity
    while _pending:
        req, _n = _pending.pop(0)
        req.Wait()
    buf, _attached, _capacity = _attached, None, 0
    return buf


def _in_use() -> int:
    _pending[:] = [(r, n) for r, n in _pending if not r.Test()]
    return sum(n for _r, n in _pending)


def reserve(nbytes: int, what: str) -> int:
    """Room for a message of ``nbytes`` in the attached buffer (ERR_BUFFER where there is none)."""
    need = nbytes + BSEND_OVERHEAD
    if _attached is None:
        raise error(ERR_BUFFER, f"{what}: no buffer is attached (MPI.Attach_buffer)")
    used = _in_use()
    if used + need > _capacity:
        raise error(ERR_BUFFER, f"{what}: {need} bytes do not fit the attached buffer ({used} of "
                    f"{_capacity} bytes are taken by buffered sends in flight)")
    return need


def track(req: Any, taken: int) -> None:
    _pending.append((req, taken))


def object_size(obj: Any) -> int:
    """What an object's buffered send takes: its pickled size."""
    return len(pickle.dumps(obj, protocol=5))


def alloc_mem(size: int, info: Any = None) -> memoryview:
    size = as_int(size, "Alloc_mem: size", ERR_NO_MEM)
    if size < 0:
        raise error(ERR_NO_MEM, f"Alloc_mem: size must be a non-negative int, got {size!r}")
    return memoryview(bytearray(size))


def free_mem(mem: Any) -> None:
    if isinstance(mem, memoryview):
        mem.release()
