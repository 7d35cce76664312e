"""Collectives over derived datatypes: packed and unpacked by the progress process, around the call.

The engine's collectives move contiguous buffers of one dtype. A buffer of a non-dense derived type
(a shmproxy.rank.typed.TypedBuffer) is therefore *packed* into a contiguous temporary before the
collective, by a message from the rank to itself (a typed send, a contiguous receive: the progress
process gathers the blocks, shmproxy.shm.typed), and an output buffer is *unpacked* after it the
same way (a contiguous send, a typed receive). Every typed buffer is packed first, outputs included:
an IN_PLACE or Bcast buffer is input too, and unpacking writes back, unchanged, whatever the
collective did not write. The temporary has the type's predefined dtype (so reductions work on types
built from one predefined type); a type mixing several travels as bytes and is refused in reductions.
Vector specs (Gatherv, Scatterv, Allgatherv, Alltoallv) count whole instances of the type; buffers.py
scales their counts and displacements to the temporary's elements.

A nonblocking collective is packed at once and posted; an output of a derived type is unpacked by
the Wait or Test that sees the collective complete (nativereq.Then), so the user's buffer is written
only then, as MPI allows.

The self-messages use tag RESERVED_TAG_LO, which ANY_TAG never accepts: a user's receive cannot
take them.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shmproxy.core import errors
from shmproxy.core.ops import RESERVED_TAG_LO
from shmproxy.mpi.exceptions import ERR_TYPE, convert, error
from shmproxy.mpi.nativereq import Then
from shmproxy.rank.typed import TypedBuffer

_REDUCING = ("reduce", "scan")   # collectives that compute on elements (by the native method's name)


def _pack(c: Any, tb: TypedBuffer) -> np.ndarray:
    temp = np.empty(tb.size, tb.temp_dtype())
    r = c.Irecv(temp, c.rank, RESERVED_TAG_LO)
    s = c.Isend(tb, c.rank, RESERVED_TAG_LO)
    r.Wait()
    s.Wait()
    return temp


def _unpack(c: Any, temp: np.ndarray, tb: TypedBuffer) -> None:
    r = c.Irecv(tb, c.rank, RESERVED_TAG_LO)
    s = c.Isend(temp, c.rank, RESERVED_TAG_LO)
    r.Wait()
    s.Wait()


def call(c: Any, fn: Any, args: tuple) -> Any:
    """``fn(*args)`` (a native collective) with every TypedBuffer argument packed, outputs unpacked."""
    name = getattr(fn, "__name__", "collective")
    typed = [i for i, a in enumerate(args) if type(a) is TypedBuffer]
    outs = [i for i in typed if args[i].out]
    if any(r in name.lower() for r in _REDUCING) and any(args[i].dtype.base is None for i in typed):
        raise error(ERR_TYPE, f"{name}: a derived datatype mixing several predefined types cannot be reduced")
    try:
        temps = {i: _pack(c, args[i]) for i in typed}
        res = fn(*(temps.get(i, a) for i, a in enumerate(args)))
        if outs and name.lower().startswith("i"):   # Ibcast, or the C-bound ibcast: nonblocking
            return Then(res, lambda: _unpack_all(c, [(temps[i], args[i]) for i in outs]))
        for i in outs:
            _unpack(c, temps[i], args[i])
    except errors.ProxyError as exc:
        raise convert(exc) from None
    return res


def _unpack_all(c: Any, pairs: list[tuple[np.ndarray, TypedBuffer]]) -> None:
    """Its errors stay shmproxy's: the MPI request that waits converts them, as its own."""
    for temp, tb in pairs:
        _unpack(c, temp, tb)
