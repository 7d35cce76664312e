"""Our own traffic through shmproxy: barrier, gather to rank 0, broadcast from rank 0. It carries the
ranks' figures and their agreements between measurements, on tags that never match a measured message.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

# Tags of our own traffic; the measured operations use TAG_OP. Distinct tags keep a barrier or a
# gather from ever matching a measured message.
TAG_OP, TAG_BARRIER, TAG_GATHER, TAG_BCAST, TAG_SETUP = 17, 0x5B0001, 0x5B0002, 0x5B0003, 0x5B0004


def barrier(comm: Any) -> None:
    """Dissemination barrier over shmproxy point-to-point (log2(n) rounds)."""
    n, r = comm.size, comm.rank
    token, got = np.zeros(1, np.uint8), np.zeros(1, np.uint8)
    k = 1
    while k < n:
        req = comm.Isend(token, (r + k) % n, TAG_BARRIER)
        comm.Recv(got, (r - k) % n, TAG_BARRIER)
        req.Wait()
        k *= 2


def gather(comm: Any, values: Sequence[float]) -> np.ndarray | None:
    """Every rank's ``values`` (same length everywhere) as rows of a float64 matrix on rank 0."""
    row = np.asarray(values, dtype=np.float64).reshape(-1)
    if comm.rank != 0:
        comm.Send(row, 0, TAG_GATHER)
        return None
    out = np.empty((comm.size, row.size), np.float64)
    out[0] = row
    for src in range(1, comm.size):
        comm.Recv(out[src], src, TAG_GATHER)
    return out


def bcast(comm: Any, values: Sequence[float] | None, length: int) -> np.ndarray:
    """Rank 0's ``values`` (``length`` float64) on every rank."""
    if comm.rank == 0:
        buf = np.asarray(values, dtype=np.float64).reshape(length)
        for dst in range(1, comm.size):
            comm.Send(buf, dst, TAG_BCAST)
        return buf
    buf = np.empty(length, np.float64)
    comm.Recv(buf, 0, TAG_BCAST)
    return buf


def agree(comm: Any, ok: bool) -> bool:
    """True on every rank when ``ok`` is true on every rank."""
    rows = gather(comm, [1.0 if ok else 0.0])
    return bool(bcast(comm, None if rows is None else [float(rows.min())], 1)[0])
