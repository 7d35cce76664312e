"""Buffered-mode sends (Bsend, Ibsend, Bsend_init, bsend, ibsend) and the buffer they draw on
(MPI.Attach_buffer / Detach_buffer), and MPI.Alloc_mem / Free_mem.

A buffered send completes locally: the caller may reuse its buffer at once, whether or not a receive
matched. Here the message is copied into memory of this layer and sent from there with an ordinary
nonblocking send; the attached buffer is the budget those copies draw on, as in MPI: a message takes
its size plus BSEND_OVERHEAD bytes until its send completes, and a send that does not fit fails with
ERR_BUFFER (MPI leaves it erroneous; failing loudly is allowed). Detach_buffer waits for every
buffered send still in flight, as MPI's does, and gives the buffer back. The attached object itself
is not written to (the copies live in separate memory), which no program can tell apart.

Alloc_mem gives ordinary process memory (an MPI.buffer of that many bytes, membuf.py); Free_mem
releases it. Nothing here is shared with other processes.
"""
from __future__ import annotations

import pickle
from typing import Any

from shmproxy.mpi.exceptions import ERR_BUFFER, error

BSEND_OVERHEAD = 64      # bytes a buffered message takes besides its data

_attached: Any = None
_capacity = 0
_pending: list[tuple[Any, int]] = []     # (MPI request of the send, bytes it takes)


def attach(buf: Any) -> None:
    global _attached, _capacity
    if _attached is not None:
        raise error(ERR_BUFFER, "Attach_buffer: a buffer is already attached (Detach_buffer it first)")
    from shmproxy.mpi.buffers import parse
    # writable, as in MPI (the library may write the attached memory): a read-only one is BufferError
    _capacity = parse(buf, "Attach_buffer", True).nbytes
    _attached = buf


def detach() -> Any:
    """Wait for every buffered send in flight; the buffer that was attached."""
    global _attached, _capacity
    while _pending:
        req, _n = _pending.pop(0)
        req.Wait()
    buf, _attached, _capacity = _attached, None, 0
    return buf


def flush() -> None:
    """MPI.Flush_buffer (MPI 4.1): wait until every buffered send in flight has gone; the buffer
    stays attached."""
    while _pending:
        req, _n = _pending.pop(0)
        req.Wait()


def Flush_buffer() -> None:  # noqa: N802 - mpi4py's name
    flush()


def Iflush_buffer() -> Any:  # noqa: N802 - mpi4py's name
    from shmproxy.mpi.exceptions import unsupported
    unsupported("MPI.Iflush_buffer", "the layer is MPI 3.1; MPI.Flush_buffer waits for buffered sends")


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


def alloc_mem(size: int, info: Any = None) -> Any:
    """MPI.Alloc_mem: an MPI.buffer of ``size`` bytes, as mpi4py gives (membuf.py)."""
    from shmproxy.mpi.membuf import alloc_mem as _alloc
    return _alloc(size, info)


def free_mem(mem: Any) -> None:
    """MPI.Free_mem: the buffer is released (address 0, 0 bytes afterwards)."""
    from shmproxy.mpi.membuf import free_mem as _free
    _free(mem)
