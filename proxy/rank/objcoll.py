"""The object layer's collectives (mpi4py's lower-case calls), over the wire format and the sends and
receives of shmproxy.rank.objects, as module functions that take the communicator first.

- One result for every rank: bcast, gather, allgather, allreduce, barrier. allgather, allreduce and
  barrier gather to rank 0, which combines in rank order and broadcasts the result
  (``_rooted_result``, over the gather-and-deliver skeleton ``_at_root``).
- Each rank its own result: scatter, alltoall, reduce, scan and exscan. Every contribution goes to one
  rank (the root, or rank 0), which computes the results in rank order (a reduction folds
  op(op(o0, o1), o2)..., so every run gives the same result) and sends each rank its own.

Every rank raises when any contribution, the user's reducer or a result failed, after the protocol
completed, so the communicator stays usable.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from shmproxy.core import errors
from shmproxy.rank.objects import (OBJ_COLL_TAG, OP_ALLGATHER, OP_ALLREDUCE, OP_ALLTOALL, OP_BARRIER, OP_BCAST,
                                   OP_EXSCAN, OP_GATHER, OP_REDUCE, OP_SCAN, OP_SCATTER, _dumps, _In, _Out,
                                   _post_send)
from shmproxy.rank.objstate import _complete_sends, _enter, _next_seq, _peer, _public, _reducer

__all__ = ["bcast", "gather", "allgather", "allreduce", "barrier", "scatter", "alltoall", "reduce", "scan",
           "exscan"]


# ------------------------------------------------------------------------------ one result for every rank
def _bcast_out(comm: Any, out: _Out, root: int, op: int, seq: int) -> None:
    """Root side of a broadcast: send ``out`` to every other rank."""
    if comm.size == 1:
        return
    with comm.group():
        reqs = [r for peer in range(comm.size) if peer != root
                for r in _post_send(comm, out, peer, OBJ_COLL_TAG, op, seq)]
    _complete_sends(comm, reqs)


def _bcast_in(comm: Any, root: int, op: int, seq: int, what: str) -> _In:
    inc = _In(comm, root, OBJ_COLL_TAG)
    inc.post_body(comm, OBJ_COLL_TAG, op, seq, what)
    inc.wait(what)
    return inc


def _gather(comm: Any, out: _Out, root: int, op: int, seq: int, what: str) -> list[_In | _Out] | None:
    """Everyone's ``out`` to ``root``; the root gets them in rank order (its own as the _Out)."""
    if comm.rank != root:
        with comm.group():
            reqs = _post_send(comm, out, root, OBJ_COLL_TAG, op, seq)
        _complete_sends(comm, reqs)
        return None
    incs: dict[int, _In] = {}
    with comm.group():
        for peer in range(comm.size):
            if peer != root:
                incs[peer] = _In(comm, peer, OBJ_COLL_TAG)
    for inc in incs.values():       # rank order: post each body as soon as its header is in
        inc.post_body(comm, OBJ_COLL_TAG, op, seq, what)
    for inc in incs.values():
        inc.wait(what)
    return [out if peer == root else incs[peer] for peer in range(comm.size)]


def _contribution(comm: Any, obj: Any, what: str) -> tuple[_Out, errors.InvalidArgument | None]:
    """Pickle our contribution to a collective; on failure, an error marker to send instead."""
    try:
        return _dumps(obj, what), None
    except errors.InvalidArgument as exc:
        cause = exc.__cause__
        return _Out.error(f"rank {comm.rank} cannot pickle its object (a {type(obj).__name__}): "
                          f"{type(cause).__name__}: {cause}"), exc


def _collect(comm: Any, items: list[_In | _Out], what: str) -> tuple[list[Any], BaseException | None, str]:
    """Unpickle gathered contributions in rank order. The first failure (a rank's error marker, or a
    contribution that does not unpickle here) is returned with a text naming its rank, instead of
    raised, so that the caller can finish the protocol."""
    values: list[Any] = []
    first: BaseException | None = None
    text = ""
    for item in items:
        try:
            values.append(item.copy(what) if isinstance(item, _Out) else item.load(what))
        except errors.ProxyError as exc:
            values.append(None)
            if first is None:
                first = exc
                text = getattr(exc, "marker", None) or f"rank {comm.rank}: {exc}"
    return values, first, text


@_public
def bcast(comm: Any, obj: Any, root: int = 0) -> Any:
    """``obj`` of ``root`` to every rank; every rank (the root too) returns a copy of it."""
    _enter(comm)
    root = _peer(comm, root, "root")
    seq = _next_seq(comm)
    what = f"bcast from root {root}"
    if comm.rank == root:
        out, mine = _contribution(comm, obj, what)
        _bcast_out(comm, out, root, OP_BCAST, seq)
        if mine is not None:
            raise mine
        return out.copy(what)
    return _bcast_in(comm, root, OP_BCAST, seq, what).load(what)


@_public
def gather(comm: Any, obj: Any, root: int = 0) -> list | None:
    """Every rank's ``obj`` to ``root``: the root returns them as a list in rank order, others None."""
    _enter(comm)
    root = _peer(comm, root, "root")
    seq = _next_seq(comm)
    what = f"gather to root {root}"
    out, mine = _contribution(comm, obj, what)
    items = _gather(comm, out, root, OP_GATHER, seq, what)
    if mine is not None:
        raise mine
    if items is None:
        return None
    values, first, _ = _collect(comm, items, what)
    if first is not None:
        raise first
    return values


def _at_root(comm: Any, obj: Any, root: int, op: int, what: str, compute: Callable[[list[Any]], Any],
             failed: str, deliver: Callable[[Any, BaseException | None, str, int], tuple[BaseException | None, Any]]
             ) -> Any:
    """Gather every rank's ``obj`` to ``root``, ``compute`` there from the values in rank order, and
    ``deliver`` the outcome (or the error text) to the other ranks, which receive it as one message
    from ``root``: the skeleton of every collective below but bcast, gather and scatter. ``failed``
    names a ``compute`` that raised; ``deliver(computed, error, text, seq)`` returns the error (its own
    too) and the root's result. Every rank raises if any contribution, the computation or a result
    failed, after the protocol completed (the communicator stays usable)."""
    seq = _next_seq(comm)
    out, mine = _contribution(comm, obj, what)
    items = _gather(comm, out, root, op, seq, what)
    if comm.rank != root:
        inc = _bcast_in(comm, root, op, seq, what)
        if mine is not None:
            raise mine
        return inc.load(what)
    assert items is not None
    values, first, text = _collect(comm, items, what)
    computed = None
    if first is None:
        try:
            computed = compute(values)
        except Exception as exc:  # the user's reducer or a malformed argument: every rank must hear of it
            first, text = exc, f"{failed}: {type(exc).__name__}: {exc}"
    first, result = deliver(computed, first, text, seq)
    if mine is not None:
        raise mine
    if first is not None:
        raise first
    return result


def _rooted_result(comm: Any, obj: Any, op: int, what: str,
                   combine: Callable[[list[Any]], Any]) -> Any:
    """Gather to rank 0, ``combine`` the values there, broadcast the result: allgather, allreduce and
    barrier."""
    def broadcast(result: Any, first: BaseException | None, text: str, seq: int) -> tuple[BaseException | None, Any]:
        if first is None:
            res_out, res_err = _contribution(comm, result, what + " (its result)")
            if res_err is not None:
                first, text = res_err, f"rank 0 cannot pickle the result: {res_err.__cause__}"
        if first is not None:
            res_out = _Out.error(text)
        _bcast_out(comm, res_out, 0, op, seq)
        return first, result
    return _at_root(comm, obj, 0, op, what, combine, "the reduction failed on rank 0", broadcast)


@_public
def allgather(comm: Any, obj: Any) -> list:
    """Every rank's ``obj`` to every rank, as a list in rank order (copies everywhere)."""
    _enter(comm)
    return _rooted_result(comm, obj, OP_ALLGATHER, "allgather", lambda values: values)


@_public
def allreduce(comm: Any, obj: Any, op: Any) -> Any:
    """Reduce every rank's ``obj`` with ``op`` in rank order (op(op(o0, o1), o2)...); every rank
    returns the identical result. ``op``: "SUM", "PROD", "MIN", "MAX" (a string or an enum with that
    name) or a callable of two arguments."""
    _enter(comm)
    fn = _reducer(op)
    return _rooted_result(comm, obj, OP_ALLREDUCE, "allreduce", lambda values: functools.reduce(fn, values))


@_public
def barrier(comm: Any) -> None:
    """Return once every rank has entered the barrier."""
    _enter(comm)
    if comm.size > 1:
        _rooted_result(comm, None, OP_BARRIER, "barrier", lambda values: None)


# ------------------------------------------------------------------------------ one result per rank
def _scatter_out(comm: Any, outs: dict[int, _Out], op: int, seq: int) -> None:
    """Root side of a scatter: ``outs[peer]`` to each other rank."""
    if not outs:
        return
    with comm.group():
        reqs = [r for peer, out in outs.items() for r in _post_send(comm, out, peer, OBJ_COLL_TAG, op, seq)]
    _complete_sends(comm, reqs)


def _results_out(comm: Any, root: int, results: list[Any] | None, first: BaseException | None, text: str,
                 op: int, seq: int, what: str) -> tuple[BaseException | None, Any]:
    """Root: pickle and send each other rank its result (or every rank the error text); returns the
    error and the root's own result."""
    outs: dict[int, _Out] = {}
    if first is None:
        assert results is not None
        for peer in range(comm.size):
            if peer != root:
                outs[peer], err = _contribution(comm, results[peer], f"{what} (the result for rank {peer})")
                if err is not None:
                    first = err
                    text = f"rank {root} cannot pickle the result for rank {peer}: {err.__cause__}"
                    break
    if first is not None:
        outs = {peer: _Out.error(text) for peer in range(comm.size) if peer != root}
    _scatter_out(comm, outs, op, seq)
    return first, (results[root] if first is None and results is not None else None)


def _each_from_root(comm: Any, obj: Any, root: int, op: int, what: str,
                    compute: Callable[[list[Any]], list[Any]]) -> Any:
    """Gather every rank's ``obj`` to ``root``, ``compute`` one result per rank there (in rank order),
    send each rank its own: alltoall, scan and exscan."""
    def scatter_results(results: Any, first: BaseException | None, text: str,
                        seq: int) -> tuple[BaseException | None, Any]:
        return _results_out(comm, root, results, first, text, op, seq, what)
    return _at_root(comm, obj, root, op, what, compute, f"{what} failed on rank {root}", scatter_results)


def _per_rank(values: Any, size: int, who: str, what: str) -> list[Any]:
    try:
        items = list(values)
    except TypeError:
        raise errors.InvalidArgument(f"{what}: {who} passed a {type(values).__name__}, not a sequence of "
                                     f"{size} objects") from None
    if len(items) != size:
        raise errors.InvalidArgument(f"{what}: {who} passed {len(items)} objects for {size} ranks")
    return items


@_public
def scatter(comm: Any, sendobj: Any = None, root: int = 0) -> Any:
    """Item r of the root's sequence ``sendobj`` (``size`` objects) to rank r; returns this rank's."""
    _enter(comm)
    root = _peer(comm, root, "root")
    seq = _next_seq(comm)
    what = f"scatter from root {root}"
    if comm.rank != root:
        return _bcast_in(comm, root, OP_SCATTER, seq, what).load(what)
    first: BaseException | None = None
    text = ""
    items = None
    try:
        items = _per_rank(sendobj, comm.size, f"the root (rank {root})", what)
    except errors.InvalidArgument as exc:
        first, text = exc, str(exc)
    first, mine = _results_out(comm, root, items, first, text, OP_SCATTER, seq, what)
    if first is not None:
        raise first
    return _dumps(mine, what).copy(what)   # a copy, as every other rank gets


@_public
def alltoall(comm: Any, sendobj: Any) -> list:
    """Item q of rank r's sequence (``size`` objects) to rank q: returns [item me of rank 0's, ...]."""
    _enter(comm)
    size = comm.size
    what = "alltoall"

    def transpose(values: list[Any]) -> list[Any]:
        rows = [_per_rank(v, size, f"rank {r}", what) for r, v in enumerate(values)]
        return [[rows[r][q] for r in range(size)] for q in range(size)]
    return _each_from_root(comm, sendobj, 0, OP_ALLTOALL, what, transpose)


@_public
def reduce(comm: Any, sendobj: Any, op: Any = "SUM", root: int = 0) -> Any:
    """Reduce every rank's object with ``op`` in rank order at ``root``; the others return None."""
    _enter(comm)
    root = _peer(comm, root, "root")
    fn = _reducer(op)
    what = f"reduce to root {root}"

    def at_root(values: list[Any]) -> list[Any]:
        result = functools.reduce(fn, values)
        return [result if r == root else None for r in range(len(values))]
    return _each_from_root(comm, sendobj, root, OP_REDUCE, what, at_root)


def _prefixes(fn: Callable[[Any, Any], Any], values: list[Any], exclusive: bool) -> list[Any]:
    out: list[Any] = []
    acc = None
    for r, v in enumerate(values):
        if exclusive:
            out.append(acc)
        acc = v if r == 0 else fn(acc, v)
        if not exclusive:
            out.append(acc)
    return out


@_public
def scan(comm: Any, sendobj: Any, op: Any = "SUM") -> Any:
    """op over ranks 0..me's objects, folded in rank order."""
    _enter(comm)
    fn = _reducer(op)
    return _each_from_root(comm, sendobj, 0, OP_SCAN, "scan", lambda values: _prefixes(fn, values, False))


@_public
def exscan(comm: Any, sendobj: Any, op: Any = "SUM") -> Any:
    """op over ranks 0..me-1's objects, folded in rank order; None on rank 0."""
    _enter(comm)
    fn = _reducer(op)
    return _each_from_root(comm, sendobj, 0, OP_EXSCAN, "exscan", lambda values: _prefixes(fn, values, True))
