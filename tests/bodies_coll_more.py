"""Rank bodies for tests/test_coll_more.py: Gather, Scatter, Gatherv, Scatterv, Allgatherv, Alltoallv,
Reduce_scatter (with counts), Scan and Exscan, blocking and nonblocking, against a pure-numpy model.

A case (drawn in the pytest process, tests/test_coll_more.py) holds everything every rank needs:
the collective, dtype, root, op, every rank's counts and displacements, IN_PLACE, blocking or not,
and a seed. Every rank's input is a deterministic function of (seed, rank, salt), so each rank builds
its expected output from every rank's inputs (``expected``) and compares. Receive buffers start
filled with a sentinel: elements no block covers (gaps between displacements, Exscan on rank 0)
must keep it. Reductions fold in rank order in the buffer's dtype, as the runtime does; Scan and
Exscan take random floats, so an order other than the rank order shows as a bit difference.
"""
from __future__ import annotations

from typing import Any

import numpy as np

import shmproxy
from shmproxy import IN_PLACE

UFUNC = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum, "AVG": np.add}


def vals(seed: int, rank: int, salt: int, count: int, dtype: np.dtype, normal: bool = False) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, salt])
    if normal and dtype.kind == "f" and dtype.itemsize >= 4:
        return rng.standard_normal(count).astype(dtype)
    v = rng.integers(0, 6, count)
    if dtype.kind == "b":
        return (v % 2).astype(bool)
    if dtype.kind == "c":
        return (v + 1j * rng.integers(0, 6, count)).astype(dtype)
    return v.astype(dtype)


def sentinel(count: int, dtype: np.dtype) -> np.ndarray:
    return np.full(count, True if dtype.kind == "b" else 77, dtype)


def fold(xs: list[np.ndarray], op: str) -> np.ndarray:
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = UFUNC[op](acc, x).astype(acc.dtype)
    if op == "AVG":
        acc = (acc / len(xs)).astype(acc.dtype)
    return acc


def inputs(c: dict, n: int, me: int) -> np.ndarray | None:
    """Rank ``me``'s send data of case ``c`` (None where it sends nothing)."""
    coll, dt, seed, root = c["coll"], np.dtype(c["dtype"]), c["seed"], c["root"] % n
    if coll == "Gather":
        return vals(seed, me, 1, c["count"], dt)
    if coll == "Scatter":
        return vals(seed, me, 1, n * c["count"], dt) if me == root else None
    if coll in ("Gatherv", "Allgatherv"):
        return vals(seed, me, 1, c["counts"][me], dt)
    if coll == "Scatterv":
        return vals(seed, me, 1, c["bufsize"], dt) if me == root else None
    if coll == "Alltoallv":
        return vals(seed, me, 1, c["sbuf"][me], dt)
    if coll == "Reduce_scatter":
        return vals(seed, me, 1, sum(c["counts"]), dt)
    return vals(seed, me, 1, c["count"], dt, normal=True)   # Scan, Exscan


def recv_size(c: dict, n: int, me: int) -> int:
    coll, root = c["coll"], c["root"] % n
    if coll == "Gather":
        return n * c["count"] if me == root else 0
    if coll == "Scatter":
        return c["count"]
    if coll == "Gatherv":
        return c["bufsize"] if me == root else 0
    if coll == "Scatterv":
        return c["counts"][me]
    if coll == "Allgatherv":
        return c["bufsize"]
    if coll == "Alltoallv":
        return c["rbuf"][me]
    if coll == "Reduce_scatter":
        return sum(c["counts"]) if c["inplace"] else c["counts"][me] + c.get("pad", 0)
    return c["count"]


def expected(c: dict, n: int, me: int, initial: np.ndarray) -> np.ndarray:
    """The pure-numpy model: rank ``me``'s receive buffer after the call, from ``initial``."""
    coll, root = c["coll"], c["root"] % n
    out = initial.copy()
    ins = [inputs(c, n, r) for r in range(n)]
    if coll == "Gather":
        if me == root:
            out[:] = np.concatenate(ins) if n else out
    elif coll == "Scatter":
        if not (me == root and c["inplace"]):
            k = c["count"]
            out[:] = ins[root][me * k:(me + 1) * k]
    elif coll in ("Gatherv", "Allgatherv"):
        if coll == "Allgatherv" or me == root:
            for r in range(n):
                out[c["displs"][r]:c["displs"][r] + c["counts"][r]] = ins[r]
    elif coll == "Scatterv":
        if not (me == root and c["inplace"]):
            out[:] = ins[root][c["displs"][me]:c["displs"][me] + c["counts"][me]]
    elif coll == "Alltoallv":
        for q in range(n):
            k = c["mat"][q][me]
            out[c["rd"][me][q]:c["rd"][me][q] + k] = ins[q][c["sd"][q][me]:c["sd"][q][me] + k]
    elif coll == "Reduce_scatter":
        lo = sum(c["counts"][:me])
        k = c["counts"][me]
        out[:k] = fold([x[lo:lo + k] for x in ins], c["op"]) if k else out[:k]
    elif coll == "Scan":
        out[:] = fold(ins[:me + 1], c["op"])
    elif coll == "Exscan":
        if me > 0:
            out[:] = fold(ins[:me], c["op"])
    return out


def _call(comm: Any, c: dict, send: Any, recv: Any) -> None:
    """One call of case ``c`` with these buffers (blocking, or nonblocking and waited)."""
    n, me = comm.size, comm.rank
    coll, root = c["coll"], c["root"] % n
    name = ("I" + coll.lower()) if c["nb"] else coll
    fn = getattr(comm, name)
    op = getattr(shmproxy, c["op"]) if c.get("op") else None
    if coll in ("Gather", "Scatter"):
        res = fn(send, recv, root)
    elif coll == "Gatherv":
        res = fn(send, recv, c["counts"] if me == root else None, c["displs"] if me == root else None, root)
    elif coll == "Scatterv":
        res = fn(send, recv, c["counts"] if me == root else None, c["displs"] if me == root else None, root)
    elif coll == "Allgatherv":
        res = fn(send, recv, c["counts"], c["displs"])
    elif coll == "Alltoallv":
        res = fn(send, c["mat"][me], c["sd"][me], recv, [c["mat"][q][me] for q in range(n)], c["rd"][me])
    elif coll == "Reduce_scatter":
        res = fn(send, recv, c["counts"], op)
    else:
        res = fn(send, recv, op)
    if c["nb"]:
        res.Wait()


def run_case(comm: Any, c: dict) -> list[str]:
    n, me = comm.size, comm.rank
    coll, dt, root = c["coll"], np.dtype(c["dtype"]), c["root"] % n
    send = inputs(c, n, me)
    rsize = recv_size(c, n, me)
    has_recv = rsize > 0 or coll not in ("Gather", "Gatherv") or me == root
    recv = sentinel(rsize, dt) if has_recv else None
    if c.get("alloc") and recv is not None:
        a = comm.alloc(rsize, dt)
        a[:] = recv
        recv = a
    in_place = c["inplace"] and (coll not in ("Gather", "Gatherv", "Scatter", "Scatterv") or me == root)
    send_arg: Any = send
    recv_arg: Any = recv
    if in_place:
        if coll in ("Scatter", "Scatterv"):
            recv_arg = IN_PLACE
        elif coll == "Gather":
            recv[me * c["count"]:(me + 1) * c["count"]] = send
            send_arg = IN_PLACE
        elif coll in ("Gatherv", "Allgatherv"):
            recv[c["displs"][me]:c["displs"][me] + c["counts"][me]] = send
            send_arg = IN_PLACE
        else:   # Reduce_scatter, Scan, Exscan: the input is in recvbuf
            recv[:send.size] = send
            send_arg = IN_PLACE
    initial = None if recv is None else recv.copy()
    send_before = None if send is None else send.copy()
    _call(comm, c, send_arg, recv_arg)
    fails = []
    if send is not None and not in_place and not np.array_equal(send, send_before):
        fails.append(f"case {c['i']} rank {me}: the send buffer changed: {c}")
    if recv is not None:
        exp = expected(c, n, me, initial)
        if coll == "Reduce_scatter" and in_place:
            k = c["counts"][me]
            got, exp = recv[:k], exp[:k]
        else:
            got = recv
        # Bit-identical where the order is the rank order everywhere (Scan, Exscan, data movement);
        # Reduce_scatter across nodes combines per-node partials (the sign of a zero product may differ).
        ok = (np.allclose(got, exp) if c.get("op") == "AVG" else
              np.array_equal(got, exp) and (coll == "Reduce_scatter" or got.tobytes() == exp.tobytes()))
        if not ok:
            fails.append(f"case {c['i']} rank {me}: got {got[:12]!r}... expected {exp[:12]!r}...: {c}")
    return fails


def run_cases(cases: list[dict]) -> dict:
    """Every case in order on one communicator; wrong results collected, exceptions end the rank."""
    with shmproxy.init() as comm:
        fails: list[str] = []
        for c in cases:
            try:
                fails += run_case(comm, c)
            except Exception as exc:
                raise AssertionError(f"case {c['i']} rank {comm.rank}: {type(exc).__name__}: {exc}: "
                                     f"{c}") from exc
        comm.Barrier()
        return {"failures": fails, "ncases": len(cases)}


def argument_errors() -> dict:
    """Bad arguments raise InvalidArgument on the caller before anything is posted (the communicator
    stays usable)."""
    with shmproxy.init() as comm:
        n, me = comm.size, comm.rank
        x = np.zeros(4)
        bad = [
            lambda: comm.Allgatherv(x, np.zeros(4 * n), [4] * (n + 1)),          # counts for n+1 ranks
            lambda: comm.Allgatherv(x, np.zeros(4 * n), [5] * n),                # sendbuf disagrees
            lambda: comm.Allgatherv(x, np.zeros(3), [4] * n),                    # blocks beyond recvbuf
            lambda: comm.Alltoallv(x, [1] * n, None, np.zeros(n), [1] * n, [-1] * n),  # negative displ
            lambda: comm.Gather(x, np.zeros(1), root=n),                          # root out of range
            lambda: comm.Scan(x, np.zeros(4), op=shmproxy.AVG),                   # AVG: no prefix
            lambda: comm.Scan(x, np.zeros(5)),                                    # sizes differ
            lambda: comm.Alltoallv(IN_PLACE, [0] * n, None, np.zeros(0), [0] * n, None),
            lambda: comm.Gatherv(x, np.zeros(4, np.float32), [4] * n, None, me),  # dtypes differ (root)
        ]
        seen = []
        for i, f in enumerate(bad):
            try:
                f()
            except shmproxy.InvalidArgument as exc:
                seen.append(str(exc))
            else:
                raise AssertionError(f"bad call {i} did not raise")
        y = np.zeros(4 * n)
        comm.Allgatherv(np.full(4, float(me)), y, [4] * n)   # still usable
        assert (y == np.repeat(np.arange(n, dtype=float), 4)).all()
        return {"messages": seen}


def counts_mismatch(which: str) -> dict:
    """Ranks disagree on counts: every rank gets InvalidUsage naming both ranks, from the call or (a
    sender whose part completed before the mismatch was found on another node) from the next one."""
    with shmproxy.init() as comm:
        n, me = comm.size, comm.rank
        try:
            if which == "alltoallv":
                # the last rank expects one element more from rank 0 than rank 0 sends it
                rc = [1] * n
                if me == n - 1:
                    rc[0] = 2
                comm.Alltoallv(np.zeros(n), [1] * n, None, np.zeros(sum(rc)), rc, None)
            elif which == "gatherv":
                comm.Gatherv(np.zeros(3 if me == n - 1 else 2), np.zeros(2 * n) if me == 0 else None,
                             [2] * n if me == 0 else None, None, 0)
            else:   # reduce_scatter: recvcounts differ
                counts = [1] * n
                if me == n - 1:
                    counts[0] = 2
                comm.Reduce_scatter(np.zeros(sum(counts)), np.zeros(counts[me]), counts)
            comm.Barrier()
        except shmproxy.InvalidUsage as exc:
            return {"error": str(exc)}
        raise AssertionError("no error")


def mpi_specs() -> dict:
    """shmproxy.MPI's forms: mpi4py buffer specs, vector specs [buf, (counts, displs), type], the
    nonblocking forms, IN_PLACE."""
    from shmproxy import MPI
    comm = MPI.COMM_WORLD
    n, me = comm.Get_size(), comm.Get_rank()
    counts = [r + 1 for r in range(n)]
    displs = [sum(counts[:r]) + 2 * r for r in range(n)]
    size = displs[-1] + counts[-1]
    root = n - 1
    # Gather / Igather, Scatter / Iscatter
    g = np.full(3 * n, -1, "i") if me == root else None
    comm.Gather([np.full(3, me, "i"), MPI.INT], [g, MPI.INT] if g is not None else None, root=root)
    assert me != root or g.tolist() == [r for r in range(n) for _ in range(3)]
    s = np.zeros(2, "d")
    comm.Iscatter(np.arange(2 * n, dtype="d") if me == root else None, s, root=root).Wait()
    assert s.tolist() == [2 * me, 2 * me + 1]
    # Gatherv with a vector spec, IN_PLACE on the root
    gv = np.full(size, -1.0)
    if me == root:
        gv[displs[me]:displs[me] + counts[me]] = me
    comm.Gatherv(MPI.IN_PLACE if me == root else np.full(counts[me], float(me)),
                 [gv, (counts, displs), MPI.DOUBLE] if me == root else None, root=root)
    if me == root:
        for r in range(n):
            assert (gv[displs[r]:displs[r] + counts[r]] == r).all()
    # Scatterv, Allgatherv (nonblocking), Alltoallv
    sv = np.zeros(counts[me])
    spec = [np.arange(size, dtype="d"), (counts, displs), MPI.DOUBLE]
    comm.Scatterv(spec if me == root else None, sv, root)
    assert sv.tolist() == list(range(displs[me], displs[me] + counts[me]))
    av = np.full(size, -1, "q")
    comm.Iallgatherv(np.full(counts[me], me, "q"), [av, (counts, displs), MPI.LONG_LONG]).Wait()
    assert all((av[displs[r]:displs[r] + counts[r]] == r).all() for r in range(n))
    sc = [(me + q) % 3 for q in range(n)]
    rc = [(q + me) % 3 for q in range(n)]
    sbuf = np.concatenate([np.full(sc[q], 10 * me + q, "i") for q in range(n)])
    rbuf = np.zeros(sum(rc), "i")
    comm.Alltoallv([sbuf, sc], [rbuf, rc])
    assert rbuf.tolist() == [10 * q + me for q in range(n) for _ in range(rc[q])]
    # Reduce_scatter with counts, Scan / Iexscan
    rs = np.zeros(counts[me])
    comm.Reduce_scatter(np.arange(sum(counts), dtype="d"), rs, counts, MPI.SUM)
    lo = sum(counts[:me])
    assert rs.tolist() == [n * x for x in range(lo, lo + counts[me])]
    sc1 = np.zeros(1, "i")
    comm.Scan(np.array([me + 1], "i"), sc1, MPI.PROD)
    assert sc1[0] == int(np.prod(np.arange(1, me + 2)))
    ex = np.full(1, -5, "i")
    comm.Iexscan(np.array([me], "i"), ex, MPI.SUM).Wait()
    assert ex[0] == (-5 if me == 0 else sum(range(me)))
    comm.Barrier()
    return {"ok": True}


def objects() -> dict:
    """The object layer's scatter, alltoall, reduce, scan, exscan: values, order, errors."""
    with shmproxy.init() as comm:
        n, me = comm.size, comm.rank
        for root in {0, n - 1}:
            items = [{"to": q, "a": np.full(q + 1, q)} for q in range(n)] if me == root else None
            got = comm.scatter(items, root=root)
            assert got["to"] == me and (got["a"] == me).all(), got
            r = comm.reduce([me], op=shmproxy.SUM, root=root)   # list concatenation: the order shows
            assert r == (list(range(n)) if me == root else None), r
        got = comm.alltoall([(me, q) for q in range(n)])
        assert got == [(r, me) for r in range(n)], got
        assert comm.scan(str(me), op=lambda a, b: a + b) == "".join(map(str, range(me + 1)))
        ex = comm.exscan([me], op=shmproxy.SUM)
        assert ex == (None if me == 0 else list(range(me))), ex
        assert comm.scan(me + 1, op=shmproxy.PROD) == int(np.prod(np.arange(1, me + 2)))
        # a bad argument on one rank: every rank raises, the communicator stays usable
        for call in (lambda: comm.alltoall([0] * (n + (me == n - 1))),
                     lambda: comm.scatter([1] * (n + 1) if me == 0 else None, root=0)):
            try:
                call()
            except shmproxy.ProxyError as exc:
                assert "objects for" in str(exc), exc
            else:
                raise AssertionError("no error")
        assert comm.scan(1) == me + 1
        return {"ok": True}
