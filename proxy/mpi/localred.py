"""Reductions the progress process does not run, done in the ranks: Op.Reduce_local, and the blocking
buffer reductions with an op or a datatype it has no kernel for (MAXLOC/MINLOC on pair types, the
logical and bitwise ops, user ops from Op.Create).

The progress process reduces SUM, PROD, MIN and MAX over its native dtypes. For anything else each
rank's contribution travels as bytes through a native collective that only moves data (Allgather, or
Gather for a rooted Reduce) and every rank that needs a result folds the contributions itself, in rank
order: result = x0 op (x1 op (... op x_{p-1})), so a non-commutative user op sees its operands in the
order MPI defines and every rank computes the same value. The cost is p contributions per rank, which
is why this is the path of the ops the engine lacks and not of the common ones. The gather is a
nonblocking native collective and the fold runs when its completion is seen (Folding: Wait, or a Test
that finds it complete), so the nonblocking forms (Iallreduce, ...) take this path too, in the caller's
thread, never blocking in the call itself.
"""
from __future__ import annotations

from typing import Any, Callable

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
        # (numpy's stubs give ndarray its buffer protocol, __buffer__, for Python >= 3.12 only)
        op._fn(memoryview(inbuf), memoryview(inout), datatype)  # type: ignore[arg-type]
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


class Folding:
    """A native gather of the contributions, seen as the native request of the reduction: once it is
    complete (its Wait, or a Test that says so) the rank folds them into the recvbuf, once."""

    __slots__ = ("_req", "_then", "_comm")
    _then: Callable[[], None] | None      # None once it ran

    def __init__(self, comm: Any, req: Any, then: Callable[[], None]):
        self._req, self._then, self._comm = req, then, comm

    def _finish(self) -> None:
        then, self._then = self._then, None
        if then is not None:
            then()

    def Wait(self) -> Any:
        if self._req is not None:
            self._req.Wait()
        self._finish()
        return self.status

    def Test(self) -> bool:
        if self._req is not None and not self._req.Test():
            return False
        self._finish()
        return True

    def Cancel(self) -> None:
        return None     # a collective is not cancelled (MPI: erroneous); it completes as posted

    @property
    def status(self) -> Any:
        return None if self._req is None else self._req.status

    def describe(self) -> str:
        return "reduction folded by the ranks" + ("" if self._req is None else f" ({self._req.describe()})")


def _gather(comm: Any, mine: np.ndarray, root: int | None,
            then: Callable[[np.ndarray], None]) -> Folding:
    """Start gathering every rank's ``mine`` (same dtype and size on all) as rows in rank order
    (Allgather; Gather to ``root``); ``then(rows)`` runs at completion, where the rows are there."""
    rows = np.empty((comm.size, mine.size), mine.dtype)
    here = root is None or comm.rank == root
    done: Callable[[], None] = (lambda: then(rows)) if here else (lambda: None)
    if mine.nbytes == 0:      # nothing moves (the sizes agree on every rank in a correct program)
        return Folding(comm, None, done)
    raw_in, raw_out = mine.view(np.uint8), rows.reshape(-1).view(np.uint8)
    if root is None:
        req = comm.Iallgather(raw_in, raw_out)
    else:
        req = comm.Igather(raw_in, raw_out if here else None, root)
    return Folding(comm, req, done)


def allreduce(comm: Any, sb: Any, rb: np.ndarray, op: Any, datatype: Any) -> Folding:
    mine = _mine(sb, rb)
    if mine.size != rb.size:
        raise error(ERR_BUFFER, f"Allreduce: sendbuf has {mine.size} elements, recvbuf {rb.size}")
    return _gather(comm, mine, None, lambda rows: _fold(op, rows, comm.size, rb, datatype))


def reduce(comm: Any, sb: Any, rb: Any, op: Any, root: int, datatype: Any) -> Folding:
    if comm.rank != root and sb is IN_PLACE:
        raise error(ERR_ARG, "Reduce: IN_PLACE is allowed on the root only")
    return _gather(comm, _mine(sb, rb), root, lambda rows: _fold(op, rows, comm.size, rb, datatype))


def scan(comm: Any, sb: Any, rb: np.ndarray, op: Any, exclusive: bool, datatype: Any) -> Folding:
    upto = comm.rank if exclusive else comm.rank + 1

    def then(rows: np.ndarray) -> None:
        if upto:              # Exscan leaves rank 0's recvbuf as it was: MPI defines no value there
            _fold(op, rows, upto, rb, datatype)
    return _gather(comm, _mine(sb, rb), None, then)


def reduce_scatter(comm: Any, sb: Any, rb: np.ndarray, counts: list[int], op: Any, datatype: Any) -> Folding:
    """Block r (counts[r] elements, packed in rank order) of the reduced vector to rank r."""
    full = _mine(sb, rb)
    total = sum(counts)
    if full.size < total:
        raise error(ERR_BUFFER, f"Reduce_scatter: the vector has {full.size} elements, the counts add up "
                    f"to {total}")
    me = comm.rank
    start = sum(counts[:me])

    def then(rows: np.ndarray) -> None:
        reduced = np.empty(total, full.dtype)
        _fold(op, rows, comm.size, reduced, datatype)
        rb[:counts[me]] = reduced[start:start + counts[me]]
    return _gather(comm, full[:total].copy(), None, then)
