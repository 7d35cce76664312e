"""Reductions the progress process does not run, done in the ranks: Op.Reduce_local, and the blocking
buffer reductions with an op or a datatype it has no kernel for (MAXLOC/MINLOC on pair types, the
logical and bitwise ops, user ops from Op.Create).

The progress process reduces SUM, PROD, MIN and MAX over its native dtypes. For anything else each
rank's contribution travels as bytes through a native collective that only moves data (Allgather, or
Gather for a rooted Reduce) and every rank that needs a result folds the contributions itself, in rank
order: result = x0 op (x1 op (... op x_{p-1})), so a non-commutative user op sees its operands in the
order MPI defines and every rank computes the same value. The cost is p contributions per rank, which
is why this is the path of the ops the engine lacks and not of the common ones. Nonblocking forms are
not provided on this path (NotImplementedError): a blocking gather under an Ixxx call could deadlock
a program that is correct under MPI.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shmproxy.core.ops import DTYPE_CODE, IN_PLACE
from shmproxy.mpi.exceptions import ERR_ARG, ERR_BUFFER, ERR_OP, error

_UFUNC = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
          "LAND": np.logical_and, "LOR": np.logical_or, "LXOR": np.logical_xor,
          "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}


def needs_ranks(op: Any, *arrays: Any) -> bool:
    """True when the progress process cannot reduce this (op, dtype): the ranks must."""
    if op.native is None:
        return True
    for a in arrays:
        if isinstance(a, np.ndarray) and a.dtype.char not in DTYPE_CODE:
            return True
    return False


def apply(op: Any, inbuf: np.ndarray, inout: np.ndarray, datatype: Any = None) -> None:
    """inout = inbuf op inout, elementwise (both 1-D arrays of one dtype and length)."""
    if inbuf.dtype != inout.dtype:
        raise error(ERR_BUFFER, f"Reduce_local: the buffers' element types differ ({inbuf.dtype} and "
                    f"{inout.dtype})")
    if inbuf.size != inout.size:
        raise error(ERR_BUFFER, f"Reduce_local: {inbuf.size} elements against {inout.size}")
    name = op.name if op.is_predefined else None
    dt = inout.dtype
    if name is None:                     # a user op: mpi4py's function(inbuf, inoutbuf, datatype)
        op._fn(memoryview(inbuf), memoryview(inout), datatype)
        return
    if name in ("MAXLOC", "MINLOC"):
        if dt.names is None or len(dt.names) != 2:
            raise error(ERR_OP, f"MPI.{name} needs a (value, index) pair type (MPI.DOUBLE_INT, ...)")
        v, i = dt.names
        a, b = inbuf[v], inout[v]
        better = (a > b) if name == "MAXLOC" else (a < b)
        take = better | ((a == b) & (inbuf[i] < inout[i]))
        inout[take] = inbuf[take]
        return
    if name == "REPLACE":
        inout[...] = inbuf
        return
    if name == "NO_OP":
        return
    fn = _UFUNC.get(name)
    if fn is None or dt.names is not None:
        raise error(ERR_OP, f"MPI.{name} is not defined on {dt}")
    if name in ("MIN", "MAX") and dt.kind == "c":
        raise error(ERR_OP, f"MPI.{name} is not defined on complex numbers")
    if name.startswith("B") and dt.kind not in "iub":
        raise error(ERR_OP, f"MPI.{name} is defined on integers only, not {dt}")
    with np.errstate(over="ignore"):      # integer wrap-around, as the C types do
        if name.startswith("L"):
            inout[...] = fn(inbuf, inout).astype(dt)
        else:
            fn(inbuf, inout, out=inout)


def _fold(op: Any, parts: np.ndarray, upto: int, out: np.ndarray, datatype: Any) -> None:
    """out = parts[0] op (parts[1] op ... parts[upto-1]) (rows of ``parts``, rank order)."""
    acc = parts[upto - 1].copy()
    for r in range(upto - 2, -1, -1):
        apply(op, parts[r], acc, datatype)
    out[...] = acc


def _mine(sb: Any, rb: Any) -> np.ndarray:
    return (rb if sb is IN_PLACE else sb).copy()


def _gathered(comm: Any, mine: np.ndarray, root: int | None) -> np.ndarray | None:
    """Every rank's ``mine`` (same dtype and size on all), rows in rank order; None off the root."""
    size = comm.size
    rows = np.empty((size, mine.size), mine.dtype)
    if mine.nbytes == 0:      # nothing moves (the sizes agree on every rank in a correct program)
        return rows if root is None or comm.rank == root else None
    raw_in, raw_out = mine.view(np.uint8), rows.reshape(-1).view(np.uint8)
    if root is None:
        comm.Allgather(raw_in, raw_out)
        return rows
    comm.Gather(raw_in, raw_out if comm.rank == root else None, root)
    return rows if comm.rank == root else None


def allreduce(comm: Any, sb: Any, rb: np.ndarray, op: Any, datatype: Any) -> None:
    mine = _mine(sb, rb)
    if mine.size != rb.size:
        raise error(ERR_BUFFER, f"Allreduce: sendbuf has {mine.size} elements, recvbuf {rb.size}")
    _fold(op, _gathered(comm, mine, None), comm.size, rb, datatype)


def reduce(comm: Any, sb: Any, rb: Any, op: Any, root: int, datatype: Any) -> None:
    if comm.rank != root and sb is IN_PLACE:
        raise error(ERR_ARG, "Reduce: IN_PLACE is allowed on the root only")
    mine = _mine(sb, rb)
    rows = _gathered(comm, mine, root)
    if rows is not None:
        _fold(op, rows, comm.size, rb, datatype)


def scan(comm: Any, sb: Any, rb: np.ndarray, op: Any, exclusive: bool, datatype: Any) -> None:
    rows = _gathered(comm, _mine(sb, rb), None)
    upto = comm.rank if exclusive else comm.rank + 1
    if upto:                  # Exscan leaves rank 0's recvbuf as it was: MPI defines no value there
        _fold(op, rows, upto, rb, datatype)


def reduce_scatter(comm: Any, sb: Any, rb: np.ndarray, counts: list[int], op: Any, datatype: Any) -> None:
    """Block r (counts[r] elements, packed in rank order) of the reduced vector to rank r."""
    full = _mine(sb, rb)
    total = sum(counts)
    if full.size < total:
        raise error(ERR_BUFFER, f"Reduce_scatter: the vector has {full.size} elements, the counts add up "
                    f"to {total}")
    rows = _gathered(comm, full[:total].copy(), None)
    reduced = np.empty(total, full.dtype)
    _fold(op, rows, comm.size, reduced, datatype)
    me = comm.rank
    start = sum(counts[:me])
    rb[:counts[me]] = reduced[start:start + counts[me]]
