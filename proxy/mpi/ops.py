"""MPI reduction operations as ``MPI.Op`` objects.

An Op has two uses. On buffers the progress process reduces the ``native`` ones (SUM, PROD, MIN, MAX)
over its native types; every other op (and user ops, called as mpi4py calls them:
``function(inbuf, inoutbuf, datatype)``) is applied in the ranks (shmproxy.mpi.localred), by
Reduce_local and the blocking buffer reductions. On Python objects (the lower-case allreduce, reduce) an
Op is a function of two values, applied by the object layer in rank order: every predefined op works
there, user ops from ``Op.Create`` too, as in mpi4py.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import numpy as np

from shmproxy.core.ops import ReduceOp
from shmproxy.mpi.exceptions import ERR_OP, error, unsupported


class Op:
    """A reduction: ``name``, the object function, and the native ReduceOp where there is one."""

    __slots__ = ("name", "_fn", "native", "commute")

    def __init__(self, name: str, fn: Callable[[Any, Any], Any], native: ReduceOp | None = None,
                 commute: bool = True):
        self.name, self._fn, self.native, self.commute = name, fn, native, commute

    @classmethod
    def Create(cls, function: Callable[..., Any], commute: bool = False) -> "Op":
        """A user op: on objects called as ``function(a, b)``, on buffers as mpi4py does,
        ``function(inbuf, inoutbuf, datatype)`` with memoryviews of the two buffers."""
        if not callable(function):
            raise error(ERR_OP, "Op.Create needs a callable")
        return cls(getattr(function, "__name__", "user op"), function, None, bool(commute))

    def Free(self) -> None:
        """User ops hold nothing; predefined ones cannot be freed (as in MPI)."""
        if self.name in PREDEFINED:
            raise error(ERR_OP, f"the predefined op MPI.{self.name} cannot be freed")

    def Is_commutative(self) -> bool:
        return self.commute

    @property
    def is_commutative(self) -> bool:
        return self.commute

    @property
    def is_predefined(self) -> bool:
        return self.name in PREDEFINED and PREDEFINED[self.name] is self

    def __call__(self, x: Any, y: Any) -> Any:
        """The object reduction (mpi4py's ``op(x, y)``)."""
        return self._fn(x, y)

    def Reduce_local(self, inbuf: Any, inoutbuf: Any) -> None:
        """inoutbuf = inbuf op inoutbuf, in this rank (shmproxy.mpi.localred)."""
        from shmproxy.mpi import buffers, localred
        a = buffers.parse(inbuf, "Reduce_local inbuf", False)
        b = buffers.parse(inoutbuf, "Reduce_local inoutbuf", True)
        if type(a) is not np.ndarray or type(b) is not np.ndarray:
            unsupported("Op.Reduce_local on a derived datatype or without buffers")
        localred.apply(self, a, b, buffers.datatype_named(inoutbuf))

    def __repr__(self) -> str:
        return f"<shmproxy.MPI.{self.name}>"

    def __reduce__(self) -> str:
        return self.name


def _pairwise(pick: Callable[[Any, Any], bool]) -> Callable[[Any, Any], Any]:
    """MAXLOC/MINLOC on (value, index) pairs: ``pick`` says whether x's value wins; ties take the
    lower index, as MPI defines."""
    def fn(x: Any, y: Any) -> Any:
        (xv, xi), (yv, yi) = x, y
        if xv == yv:
            return (xv, min(xi, yi))
        return (xv, xi) if pick(xv, yv) else (yv, yi)
    return fn


def _elementwise(f: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Logical ops on objects: numpy arrays elementwise, scalars as Python truth values."""
    def fn(x: Any, y: Any) -> Any:
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            return f(np.asarray(x), np.asarray(y))
        return f(x, y)
    return fn


def _min(x: Any, y: Any) -> Any:
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return np.minimum(x, y)
    return y if y < x else x


def _max(x: Any, y: Any) -> Any:
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return np.maximum(x, y)
    return y if y > x else x


def _no_op(x: Any, y: Any) -> Any:
    return x


def _replace(x: Any, y: Any) -> Any:
    return y


SUM = Op("SUM", operator.add, ReduceOp.SUM)
PROD = Op("PROD", operator.mul, ReduceOp.PROD)
MIN = Op("MIN", _min, ReduceOp.MIN)
MAX = Op("MAX", _max, ReduceOp.MAX)
LAND = Op("LAND", _elementwise(lambda a, b: np.logical_and(a, b) if isinstance(a, np.ndarray)
                                else bool(a) and bool(b)))
LOR = Op("LOR", _elementwise(lambda a, b: np.logical_or(a, b) if isinstance(a, np.ndarray)
                              else bool(a) or bool(b)))
LXOR = Op("LXOR", _elementwise(lambda a, b: np.logical_xor(a, b) if isinstance(a, np.ndarray)
                                else bool(a) != bool(b)))
BAND = Op("BAND", operator.and_)
BOR = Op("BOR", operator.or_)
BXOR = Op("BXOR", operator.xor)
MAXLOC = Op("MAXLOC", _pairwise(lambda a, b: a > b))
MINLOC = Op("MINLOC", _pairwise(lambda a, b: a < b))
REPLACE = Op("REPLACE", _replace)
NO_OP = Op("NO_OP", _no_op)
OP_NULL = Op("OP_NULL", _no_op)

PREDEFINED: dict[str, Op] = {op.name: op for op in (SUM, PROD, MIN, MAX, LAND, LOR, LXOR, BAND, BOR, BXOR,
                                                    MAXLOC, MINLOC, REPLACE, NO_OP, OP_NULL)}


def as_op(op: Any, what: str) -> Op:
    """An MPI.Op from what a program passed: an Op, or (for shmproxy programs) a native ReduceOp."""
    if isinstance(op, Op):
        return op
    if isinstance(op, ReduceOp) and op.name in PREDEFINED:
        return PREDEFINED[op.name]
    raise error(ERR_OP, f"{what}: op must be an MPI.Op (MPI.SUM, MPI.MAX, ...), got {op!r} "
                f"({type(op).__name__})")
