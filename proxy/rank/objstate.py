"""What every object call of objects.py does besides moving messages: check its arguments, keep the
state the object layer holds on a Comm between calls, and pick the reducer of allreduce.

The state is three attributes set on the Comm: the object-collective counter (``_objects_coll_seq``,
the seq word of every collective's headers), the buffered sends not yet known complete
(``_objects_unwaited``, reaped and their errors raised at the end of each public call, see
``_public``), and the self channel (``_objects_to_self``, one FIFO of pickled objects per tag).

The reserved tag space is here too, since the argument checks enforce it (objects.py's module doc
says why one reserved tag is enough).
"""
from __future__ import annotations

import enum
import functools
import operator
from typing import Any, Callable

import numpy as np

from shmproxy.core import errors
from shmproxy.core.ops import TAG_MAX
from shmproxy.rank.request import Request

# Tags below this are reserved for shmproxy's own traffic (user tags are int64: [-2**63, 2**63)).
OBJ_TAG_BASE = -(2**62)
OBJ_COLL_TAG = OBJ_TAG_BASE - 1

_SEQ_ATTR = "_objects_coll_seq"     # per-communicator counter of object collectives
_UNWAITED_ATTR = "_objects_unwaited"  # per-communicator buffered sends not yet known complete
_SELF_ATTR = "_objects_to_self"      # per-communicator {tag: deque of objects a rank sent itself}


# ------------------------------------------------------------------------------ argument checks
def _as_int(value: Any, name: str) -> int:
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise errors.InvalidArgument(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def _peer(comm: Any, value: Any, name: str) -> int:
    p = _as_int(value, name)
    if not 0 <= p < comm.size:
        raise errors.InvalidArgument(f"{name} {p} out of range: the communicator has {comm.size} ranks")
    return p


def _user_tag(value: Any) -> int:
    t = _as_int(value, "tag")
    if not OBJ_TAG_BASE <= t <= TAG_MAX:
        raise errors.InvalidArgument(f"tag {t} is reserved: object tags must lie in "
                                     f"[OBJ_TAG_BASE = -2**62, 2**63 - 1]")
    return t


def _enter(comm: Any) -> None:
    comm._check_usable()    # closed / failed communicators raise even where nothing is sent (size 1)


def _public(fn: Callable) -> Callable:
    """An operation of the API: once it completed, reap the buffered sends that completed and raise
    the error of one that failed. At the end, not the start, so that a rank never skips its part of
    a collective because of an earlier send."""
    @functools.wraps(fn)
    def op(comm: Any, *args: Any, **kwargs: Any) -> Any:
        result = fn(comm, *args, **kwargs)
        if getattr(comm, _UNWAITED_ATTR, None):
            _check_buffered(comm)
        return result
    return op


def _check_buffered(comm: Any) -> None:
    """Forget the buffered sends that completed; raise the error of one that failed."""
    pending: list[Request] = getattr(comm, _UNWAITED_ATTR)
    left = []
    first: errors.ProxyError | None = None
    for req in pending:
        try:
            if not req.Test():
                left.append(req)
        except errors.ProxyError as exc:
            first = first or exc
    setattr(comm, _UNWAITED_ATTR, left)
    if first is not None:
        raise first


def _complete_sends(comm: Any, reqs: list[Request]) -> None:
    """Return once no request still needs the caller's memory: those whose buffer the runtime copied
    into staging memory at post time (every array: shmproxy.rank.objects) are left to complete on
    their own, like MPI's buffered eager sends; any other (a header in registered memory) is waited
    for. Errors of the former are raised at the end of a later object call (_public)."""
    wait = [r for r in reqs if getattr(r, "_stage", None) is None]
    if len(wait) < len(reqs):
        buffered = [r for r in reqs if getattr(r, "_stage", None) is not None]
        pending = getattr(comm, _UNWAITED_ATTR, None)
        if pending is None:
            pending = []
            setattr(comm, _UNWAITED_ATTR, pending)
        pending.extend(buffered)
    Request.Waitall(wait)


def _next_seq(comm: Any) -> int:
    seq = getattr(comm, _SEQ_ATTR, 0) + 1
    setattr(comm, _SEQ_ATTR, seq)
    return seq


# ------------------------------------------------------------------------------ reductions of objects
def _min(a: Any, b: Any) -> Any:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.minimum(a, b)
    return min(a, b)


def _max(a: Any, b: Any) -> Any:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.maximum(a, b)
    return max(a, b)


# operator.add / mul work elementwise on numpy arrays (np.add / np.multiply) and concatenate lists,
# tuples and strings, as mpi4py's SUM and PROD do on objects; MIN / MAX switch to np.minimum /
# np.maximum when an array is involved (the builtins cannot compare arrays).
_OPS: dict[str, Callable[[Any, Any], Any]] = {"SUM": operator.add, "PROD": operator.mul, "MIN": _min,
                                              "MAX": _max}


def _reducer(op: Any) -> Callable[[Any, Any], Any]:
    if isinstance(op, enum.Enum):
        name = op.name
    elif isinstance(op, str):
        name = op
    elif callable(op):
        return op
    else:
        raise errors.InvalidArgument(f"op must be a callable or one of {sorted(_OPS)}, got {op!r}")
    fn = _OPS.get(name.upper())
    if fn is None:
        raise errors.InvalidArgument(f"reduction {name!r} is not supported on objects; "
                                     f"use one of {sorted(_OPS)} or a callable")
    return fn
