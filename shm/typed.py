"""Derived datatypes in the progress process: the registered block lists, and the copies by them.

A rank registers each derived datatype it uses on a communicator once (TYPE_REGISTER: the block list,
displacements relative to the type's true lower bound, and its extent); ``engine.types`` maps (local
rank, type id) to a ``TypeMap``. A send or receive of such a type carries FLAG_TYPED, the id in its
record's ``offset2`` and the instance count in ``count`` (shmproxy.core.ops); its buffer region starts
at ``offset`` (the true lower bound of the first instance) and spans ``span(count)`` bytes, which is
what the rank registered or staged. The loop resolves the id when it fetches the op (``resolve``).

The bytes then move in this process, never in the rank: within a node the shm transport's copy of a
message becomes one ``copy`` over both sides' block lists (shm/_native_blocks.c, the GIL released;
done inline, not chunked over the copy workers); a buffered send packs into its contiguous copy
(``pack``); across nodes the sender's node packs into a contiguous temporary before the bytes leave
and the receiver's node lands them in one and scatters it (``unpack``) before the receive completes.
The two sides may have different block lists: only the byte streams' lengths must agree (and the dtype
codes, checked at the match like any message's).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shmproxy.core import errors
from shmproxy.core.ops import FLAG_TYPED
from shmproxy.shm import _native

_addr = _native.buffer_info


class TypeMap:
    """A registered block list: ``table`` (n x 2 int64: displacement from the true lower bound, length),
    ``extent`` (bytes between instances), ``size`` (bytes of one instance), ``reach`` (one instance's
    bytes end before this displacement)."""

    __slots__ = ("table", "addr", "nblocks", "extent", "size", "reach")

    def __init__(self, flat: list[int], extent: int):
        t = np.asarray(flat, np.int64).reshape(-1, 2)
        if len(t) and ((t[:, 0] < 0).any() or (t[:, 1] <= 0).any()):
            raise errors.InvalidArgument("a datatype's blocks need displacements >= 0 and lengths > 0")
        self.table = np.ascontiguousarray(t)
        self.addr = _addr(self.table, False)[0] if len(t) else 0
        self.nblocks, self.extent = len(t), int(extent)
        self.size = int(t[:, 1].sum())
        self.reach = int((t[:, 0] + t[:, 1]).max()) if len(t) else 0

    def span(self, count: int) -> int:
        return 0 if count <= 0 or not self.size else (count - 1) * self.extent + self.reach


def resolve(types: dict, op: Any) -> str | None:
    """Attach the TypeMap of a FLAG_TYPED op (``op.tmap``); the reason when the record does not check
    out (an unknown id, or a size that is not count instances)."""
    if not op.flags & FLAG_TYPED:
        return None
    tm = types.get((op.owner, op.offset2))
    if tm is None:
        return f"{op.describe()}: datatype {op.offset2} was never registered"
    if op.nbytes != op.count * tm.size:
        return f"{op.describe()}: {op.nbytes} B is not {op.count} x the datatype's {tm.size} B"
    op.tmap = tm
    return None


def _side(buffers: dict, op: Any, n: int) -> tuple[int, int, int, int]:
    """(address, table address, blocks, extent) of one side of a copy of ``n`` bytes, bounds-checked."""
    tm = getattr(op, "tmap", None)
    buf = buffers.get((op.owner, op.buf_id))
    need = n if tm is None else tm.span(op.count)
    if buf is None or op.mem & 0xFF or op.offset + need > buf.size or n > op.nbytes:
        raise errors.InvalidArgument(
            f"{op.describe()}: buffer {op.buf_id} offset {op.offset} + {need} B is outside the registered "
            f"buffer ({'unknown' if buf is None else buf.size} B)")
    if tm is None:
        return buf.addr + op.offset, 0, 0, n
    return buf.addr + op.offset, tm.addr, tm.nblocks, tm.extent


def check(buffers: dict, op: Any, n: int) -> None:
    """InvalidArgument unless ``n`` bytes of ``op`` lie inside its registered buffer."""
    _side(buffers, op, n)


def _copy(dst: tuple, dst_keep: Any, src: tuple, src_keep: Any, n: int) -> None:
    """One gather/scatter; a contiguous side (no table) becomes the one block (0, n)."""
    if not n:
        return
    if not dst[1]:
        dst_keep = np.array([[0, n]], np.int64)
        dst = (dst[0], _addr(dst_keep, False)[0], 1, n)
    if not src[1]:
        src_keep = np.array([[0, n]], np.int64)
        src = (src[0], _addr(src_keep, False)[0], 1, n)
    _native.copy_blocks(dst[0], dst[1], dst[2], dst[3], src[0], src[1], src[2], src[3], n)
    del dst_keep, src_keep


def copy(buffers: dict, send: Any, recv: Any, n: int) -> None:
    """``n`` bytes of a message from ``send``'s buffer to ``recv``'s, either or both typed."""
    s, r = _side(buffers, send, n), _side(buffers, recv, n)
    _copy(r, None, s, None, n)


def pack(buffers: dict, op: Any) -> np.ndarray:
    """A typed send's bytes gathered into a new contiguous array (InvalidArgument: a bad buffer)."""
    n = op.nbytes
    s = _side(buffers, op, n)
    data = np.empty(n, np.uint8)
    if n:
        _copy((_addr(data, True)[0], 0, 0, n), data, s, None, n)
    return data


def unpack(buffers: dict, op: Any, data: Any, n: int) -> None:
    """Scatter ``n`` bytes of ``data`` (a contiguous buffer object) into a typed receive's blocks."""
    r = _side(buffers, op, n)
    if n:
        src = np.frombuffer(data, np.uint8, n)
        _copy(r, None, (_addr(src, False)[0], 0, 0, n), src, n)
