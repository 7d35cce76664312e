"""MPI reduction operations as ``MPI.Op`` objects.

An Op has two uses. On buffers the progress process reduces the ``native`` ones (SUM, PROD, MIN, MAX)
over its native types; every other op (and user ops, called as mpi4py calls them:
``function(inbuf, inoutbuf, datatype)``) is applied in the ranks (shmproxy.mpi.localred), by
Reduce_local and the blocking buffer reductions. On Python objects (the lower-case allreduce, reduce) an
Op is a function of two values, applied by the object layer in rank order: every predefined op works
there, user ops from ``Op.Create`` too, as in mpi4py.
"""
from __future__ import annotations

import inspect
import operator
import weakref
from typing import Any, Callable

import numpy as np

from shmproxy.core.ops import ReduceOp
from shmproxy.mpi.exceptions import ERR_INTERN, ERR_OP, error, unsupported


class Op:
    """A reduction: ``name``, the object function, and the native ReduceOp where there is one. ``_h``
    is the handle: ``MPI.Op(op)`` is a second object of it (equal, not identical), as in mpi4py."""

    __slots__ = ("name", "_fn", "native", "commute", "_nargs", "_h", "_pickles", "__weakref__")
    name: str
    _fn: Callable[..., Any]
    native: ReduceOp | None
    commute: bool
    _nargs: int
    _h: "Op"
    _pickles: bool

    def __new__(cls, op: "Op | None" = None) -> "Op":
        src = OP_NULL if op is None else op
        if not isinstance(src, Op):
            raise TypeError(f"MPI.Op() takes an MPI.Op, got {type(op).__name__}")
        new = object.__new__(cls)
        for slot in _STATE:
            setattr(new, slot, getattr(src, slot))
        return new

    def __init__(self, op: "Op | None" = None) -> None:
        pass    # __new__ did it

    @classmethod
    def _make(cls, name: str, fn: Callable[..., Any], native: ReduceOp | None = None,
              commute: bool = True) -> "Op":
        self = object.__new__(cls)
        self.name, self._fn, self.native, self.commute = name, fn, native, commute
        self._nargs, self._h, self._pickles = 2, self, True
        return self

    @classmethod
    def Create(cls, function: Callable[..., Any], commute: bool = False) -> "Op":
        """A user op, called as mpi4py calls it: ``function(inbuf, inoutbuf, datatype)`` on buffers
        (memoryviews of the two), ``function(x, y, None)`` on objects (``function(x, y)`` if it takes
        two arguments only)."""
        if not callable(function):
            raise error(ERR_OP, "Op.Create needs a callable")
        if len(_USER_OPS) >= MAX_USER_OPS:
            raise error(ERR_INTERN, f"Op.Create: {MAX_USER_OPS} user ops are in use (Free some)")
        op = cls._make(getattr(function, "__name__", "user op"), function, None, bool(commute))
        op._nargs = _positional(function)
        _USER_OPS[id(op)] = op
        return op

    def Free(self) -> None:
        """The handle becomes OP_NULL (user ops hold nothing else); predefined ones and OP_NULL
        cannot be freed (as in MPI)."""
        if self._h is OP_NULL or self.is_predefined:
            raise error(ERR_OP, f"the predefined op MPI.{self.name} cannot be freed")
        self._become_null()

    def free(self) -> None:
        """mpi4py's safe free: a predefined constant stays itself; any other handle (a user op, a
        second handle of a predefined one) becomes OP_NULL."""
        if self._h is OP_NULL or self is self._h and self.is_predefined:
            return
        self._become_null()

    def _become_null(self) -> None:
        _USER_OPS.pop(id(self._h), None)
        for slot in _STATE:
            setattr(self, slot, getattr(OP_NULL, slot))

    def Is_commutative(self) -> bool:
        return self.commute

    @property
    def is_commutative(self) -> bool:
        return self.commute

    @property
    def is_predefined(self) -> bool:
        return PREDEFINED.get(self.name) is self._h

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Op):
            return NotImplemented
        return self._h is other._h

    # as mpi4py's handles: not hashable, since free() turns a handle into OP_NULL in place
    __hash__ = None  # type: ignore[assignment]

    def __bool__(self) -> bool:
        return self._h is not OP_NULL

    def __call__(self, x: Any, y: Any) -> Any:
        """The object reduction (mpi4py's ``op(x, y)``)."""
        if self._h is OP_NULL:
            raise error(ERR_OP, "MPI.OP_NULL is not a reduction")
        return self._fn(x, y, None) if self._nargs >= 3 else self._fn(x, y)

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

    def __reduce__(self) -> Any:
        if self.is_predefined:
            if self._h is self:
                return self.name
            # a subclass of the program's unpickles as itself (as mpi4py's)
            return (_handle_of, (self.name,)) if type(self) is Op else (type(self), (self._h,))
        if not self._pickles:
            # as mpi4py: an op rebuilt from its handle number (fromint) has no function of its own
            raise ValueError("cannot pickle a user op made by Op.fromint: it carries no function")
        return Op.Create, (self._fn, self.commute)     # a new op of the same function (as mpi4py)

    # handles, as mpi4py gives them: a number naming the op while some object of it lives (0: OP_NULL)
    def toint(self) -> int:
        if self._h is OP_NULL:
            return 0
        _BY_INT[id(self._h)] = self._h
        return id(self._h)

    py2f = toint

    @property
    def handle(self) -> int:
        return self.toint()

    @classmethod
    def fromint(cls, handle: int) -> "Op":
        n = operator.index(handle)
        if n == 0:
            return cls()
        h = _BY_INT.get(n)
        if h is None:
            raise error(ERR_OP, f"no op has the handle {n}")
        op = cls(h)
        op._pickles = h.is_predefined
        return op

    f2py = fromhandle = fromint


_STATE = ("name", "_fn", "native", "commute", "_nargs", "_h", "_pickles")   # what a handle holds (not __weakref__)
# mpi4py keeps user ops in a table of 32 callbacks (so does MPICH's fixed table): the 33rd live one is
# refused with an MPI.Exception (a RuntimeError). An op Freed, or dropped, frees its slot.
MAX_USER_OPS = 32
_USER_OPS: "weakref.WeakValueDictionary[int, Op]" = weakref.WeakValueDictionary()   # by id: ops do not hash
_BY_INT: "weakref.WeakValueDictionary[int, Op]" = weakref.WeakValueDictionary()


def _handle_of(name: str) -> Op:
    return Op(PREDEFINED[name])


def _positional(fn: Callable[..., Any]) -> int:
    """How many positional arguments ``fn`` takes (3 where it takes any number)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):     # a builtin without a signature: mpi4py's form
        return 3
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 3
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _pairwise(pick: Callable[[Any, Any], bool]) -> Callable[[Any, Any], Any]:
    """MAXLOC/MINLOC on (value, index) pairs: ``pick`` says whether x's value wins; ties take the
    lower index, as MPI defines."""
    def fn(x: Any, y: Any) -> Any:
        (xv, xi), (yv, yi) = x, y
        if xv == yv:
            return (xv, xi) if not yi < xi else (yv, yi)    # the pair itself: its objects, not copies
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


SUM = Op._make("SUM", operator.add, ReduceOp.SUM)
PROD = Op._make("PROD", operator.mul, ReduceOp.PROD)
MIN = Op._make("MIN", _min, ReduceOp.MIN)
MAX = Op._make("MAX", _max, ReduceOp.MAX)
LAND = Op._make("LAND", _elementwise(lambda a, b: np.logical_and(a, b) if isinstance(a, np.ndarray)
                                     else bool(a) and bool(b)))
LOR = Op._make("LOR", _elementwise(lambda a, b: np.logical_or(a, b) if isinstance(a, np.ndarray)
                                   else bool(a) or bool(b)))
LXOR = Op._make("LXOR", _elementwise(lambda a, b: np.logical_xor(a, b) if isinstance(a, np.ndarray)
                                     else bool(a) != bool(b)))
BAND = Op._make("BAND", operator.and_)
BOR = Op._make("BOR", operator.or_)
BXOR = Op._make("BXOR", operator.xor)
MAXLOC = Op._make("MAXLOC", _pairwise(lambda a, b: a > b))
MINLOC = Op._make("MINLOC", _pairwise(lambda a, b: a < b))
REPLACE = Op._make("REPLACE", _replace)
NO_OP = Op._make("NO_OP", _no_op)
OP_NULL = Op._make("OP_NULL", _no_op)

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
