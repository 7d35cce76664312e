"""Rank bodies of the derived-datatype tests (tests/test_mpi_datatypes.py): two ranks exchange with
derived types of the same signature but different shapes on each side; the progress process packs."""
from __future__ import annotations

import numpy as np

from shmproxy import MPI


def _expect_error(fn, cls) -> str:
    try:
        fn()
    except MPI.Exception as exc:
        assert exc.Get_error_class() in (cls if isinstance(cls, tuple) else (cls,)), str(exc)
        return str(exc)
    raise AssertionError("no error")


def exchange() -> dict:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    assert comm.Get_size() == 2
    a = np.arange(48, dtype="d").reshape(6, 8)
    col = MPI.DOUBLE.Create_vector(6, 1, 8).Commit()          # a column of a 6 x 8 array
    sub = MPI.DOUBLE.Create_subarray([6, 8], [2, 3], [1, 4]).Commit()
    ind = MPI.DOUBLE.Create_indexed([1, 2, 3], [7, 0, 3]).Commit()   # 6 doubles, out of order
    pair = MPI.DOUBLE.Create_vector(2, 1, 2)                   # elements 0 and 2: extent 3 doubles
    every3 = pair.Create_resized(0, 3 * 8).Commit()            # count > 1: instances 3 doubles apart
    empty = MPI.DOUBLE.Create_contiguous(0).Commit()
    rec = np.dtype([("i", "i4"), ("d", "f8"), ("s", "i2")], align=True)
    st_t = MPI.Datatype.Create_struct([1, 1, 1], [rec.fields[k][1] for k in "ids"],
                                      [MPI.INT, MPI.DOUBLE, MPI.SHORT]).Commit()
    st = MPI.Status()
    if rank == 0:
        comm.Send([a, 1, col], 1, 1)                          # strided -> contiguous
        comm.Send(np.arange(6, dtype="d") + 100, 1, 2)        # contiguous -> strided
        comm.Send([a, 1, sub], 1, 3)                          # subarray -> indexed (6 doubles each)
        comm.Send([np.arange(12, dtype="d"), 4, every3], 1, 4)   # count 4 of a resized type
        comm.Send([a, 0, col], 1, 5)
        comm.Send([a, 1, empty], 1, 6)
        recs = np.zeros(3, rec)
        recs["i"], recs["d"], recs["s"] = [1, 2, 3], [0.5, 1.5, 2.5], [-1, -2, -3]
        comm.Send([recs, 3, st_t], 1, 7)
        comm.Send([a, 1, sub], 1, 8)                          # 6 doubles into a 5-double type: truncation
        try:   # doubles into ints: a signature mismatch; the send fails too if the receive was posted first
            comm.Send([a, 1, sub], 1, 9)
        except MPI.Exception as exc:
            assert "dtype" in str(exc) or "type" in str(exc), exc
        big = np.arange(200000, dtype="d")
        comm.Send([big, 1, MPI.DOUBLE.Create_vector(50000, 2, 4).Commit()], 1, 10)   # > eager, not buffered
        r = np.zeros(6 * 8)
        comm.Sendrecv([a, 1, col], 1, 11, [r, 1, col], 1, 12)
        assert r.reshape(6, 8)[:, 0].tolist() == (a[:, 1]).tolist() and r.reshape(6, 8)[:, 1:].sum() == 0
        req = comm.Isend([a.copy(), 1, sub], 1, 13)
        req.Wait()
        comm.Send(np.arange(100000, dtype="d"), 1, 14)       # large, received into a strided type
        return {}
    got = np.zeros(6)
    comm.Recv([got, MPI.DOUBLE], 0, 1, st)
    assert got.tolist() == a[:, 0].tolist(), got
    assert st.Get_count(col) == 1 and st.Get_count(MPI.DOUBLE) == 6
    b = np.full((6, 8), -1.0)
    comm.Recv([b, 1, col], 0, 2)
    assert b[:, 0].tolist() == list(range(100, 106)) and (b[:, 1:] == -1).all(), b
    c = np.full(10, -1.0)
    comm.Recv([c, 1, ind], 0, 3)
    flat = a[1:3, 4:7].reshape(-1)
    want = np.full(10, -1.0)
    want[7], want[0:2], want[3:6] = flat[0], flat[1:3], flat[3:6]
    assert c.tolist() == want.tolist(), (c, want)
    d = np.zeros(8)
    comm.Recv([d, MPI.DOUBLE], 0, 4, st)
    src = np.arange(12, dtype="d").reshape(4, 3)[:, [0, 2]].reshape(-1)
    assert d.tolist() == src.tolist() and st.Get_count(MPI.DOUBLE) == 8, d
    e = np.full((6, 8), 5.0)
    comm.Recv([e, 0, col], 0, 5, st)
    assert st.Get_count(MPI.BYTE) == 0 and (e == 5).all()
    comm.Recv([e, 1, empty], 0, 6, st)
    assert st.Get_count(MPI.BYTE) == 0 and (e == 5).all()
    recs = np.zeros(3, rec)
    comm.Recv([recs, 3, st_t], 0, 7)
    assert recs["i"].tolist() == [1, 2, 3] and recs["d"].tolist() == [0.5, 1.5, 2.5], recs
    assert recs["s"].tolist() == [-1, -2, -3]
    five = MPI.DOUBLE.Create_vector(5, 1, 2).Commit()
    f = np.zeros(10)
    msg = _expect_error(lambda: comm.Recv([f, 1, five], 0, 8), MPI.ERR_TRUNCATE)
    assert (f == 0).all(), msg
    ints = MPI.INT.Create_vector(12, 1, 2).Commit()
    g = np.zeros(24, "i")
    _expect_error(lambda: comm.Recv([g, 1, ints], 0, 9), (MPI.ERR_TYPE, MPI.ERR_OTHER))
    h = np.zeros(100000)
    comm.Recv([h, 1, MPI.DOUBLE.Create_contiguous(100000).Commit()], 0, 10)
    assert h.tolist() == np.arange(200000, dtype="d").reshape(-1, 4)[:, :2].reshape(-1).tolist()
    r = np.zeros(6 * 8)
    comm.Sendrecv([a[:, 1:].copy(), 1, MPI.DOUBLE.Create_vector(6, 1, 7).Commit()], 0, 12, [r, 1, col], 0, 11)
    assert r.reshape(6, 8)[:, 0].tolist() == a[:, 0].tolist()
    k = np.zeros(6)
    req = comm.Irecv([k, MPI.DOUBLE], 0, 13)
    req.Wait(st)
    assert k.tolist() == a[1:3, 4:7].reshape(-1).tolist() and st.Get_count(sub) == 1
    m = np.zeros(200000)
    comm.Recv([m, 1, MPI.DOUBLE.Create_vector(50000, 2, 4).Commit()], 0, 14)
    want = np.zeros((50000, 4))
    want[:, :2] = np.arange(100000, dtype="d").reshape(-1, 2)
    assert (m == want.reshape(-1)).all()
    return {}


def collectives() -> dict:
    """Derived types in the buffer collectives at 3 ranks: packed/unpacked around the engine's call."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = size
    col = MPI.DOUBLE.Create_vector(4, 1, n).Commit()                  # a column of a 4 x n matrix
    colr = MPI.DOUBLE.Create_vector(4, 1, n).Create_resized(0, 8).Commit()   # ... successive columns
    m = np.full((4, n), -1.0)
    if rank == 0:
        m[:, 1] = [1, 2, 3, 4]
    comm.Bcast([m.reshape(-1)[1:], 1, col], root=0)   # the base address is m[0, 1]
    assert m[:, 1].tolist() == [1, 2, 3, 4] and (m[:, [0, 2]] == -1).all(), m
    x = np.arange(4 * n, dtype="d").reshape(4, n) * (rank + 1)
    y = np.zeros((4, n))
    comm.Allreduce([x, 1, col], [y, 1, col], op=MPI.SUM)
    total = sum(r + 1 for r in range(size))
    assert y[:, 0].tolist() == (np.arange(4 * n).reshape(4, n)[:, 0] * total).tolist() and (y[:, 1:] == 0).all()
    g = np.zeros((4, n))
    comm.Gather([x, 1, col], [g, 1, colr] if rank == 0 else None, root=0)   # column r of g from rank r
    if rank == 0:
        for r in range(size):
            assert g[:, r].tolist() == (np.arange(4 * n).reshape(4, n)[:, 0] * (r + 1)).tolist(), g
    # Scatterv of whole columns, one per rank, in reverse order (displacements count instances)
    s = np.arange(4 * n, dtype="d").reshape(4, n)
    got = np.zeros(4)
    comm.Scatterv([s, ([1] * n, list(range(n))[::-1]), colr] if rank == 0 else None, [got, MPI.DOUBLE], root=0)
    assert got.tolist() == s[:, n - 1 - rank].tolist(), got
    # Alltoall as a transpose: rank r sends column j of its matrix to rank j
    a = np.arange(4 * n, dtype="d").reshape(4, n) + 100 * rank
    t = np.zeros((n, 4))
    comm.Alltoall([a, 1, colr], [t, 4, MPI.DOUBLE])
    for j in range(n):
        assert t[j].tolist() == (np.arange(4 * n).reshape(4, n)[:, rank] + 100 * j).tolist(), t
    req = comm.Igather([x, 1, col], [np.zeros(4 * n), MPI.DOUBLE] if rank == 0 else None, root=0)
    req.Wait()
    # Nonblocking and persistent forms into a derived type: the user's buffer is written by the Wait
    # or Test that completes them, and the gaps between the blocks stay as they were.
    for root in range(size):
        b = np.full((4, n), -1.0)
        if rank == root:
            b[:, 2 % n] = [5, 6, 7, root]
        req = comm.Ibcast([b.reshape(-1)[2 % n:], 1, col], root=root)
        while not req.Test():
            pass
        assert b[:, 2 % n].tolist() == [5, 6, 7, root], b
        assert (np.delete(b, 2 % n, axis=1) == -1).all(), b
    ag = np.full((4, n), -1.0)
    req = comm.Iallgather([x[:, 0].copy(), MPI.DOUBLE], [ag, 1, colr])
    MPI.Request.Waitall([req])
    for r in range(size):
        assert ag[:, r].tolist() == (np.arange(4 * n).reshape(4, n)[:, 0] * (r + 1)).tolist(), ag
    pb = np.full((4, n), -1.0)
    preq = comm.Bcast_init([pb, 1, col], root=size - 1)
    for it in range(3):
        if rank == size - 1:
            pb[:, 0] = [it, it + 1, it + 2, it + 3]
        preq.Start()
        preq.Wait()
        assert pb[:, 0].tolist() == [it, it + 1, it + 2, it + 3] and (pb[:, 1:] == -1).all(), pb
    preq.Free()
    st = MPI.Datatype.Create_struct([1, 1], [0, 8], [MPI.INT, MPI.DOUBLE]).Commit()
    try:
        comm.Allreduce([np.zeros(2), 1, st], [np.zeros(2), 1, st], op=MPI.SUM)
    except MPI.Exception as exc:
        assert exc.Get_error_class() == MPI.ERR_TYPE, exc
    else:
        raise AssertionError("a reduction of a mixed struct was accepted")
    comm.Barrier()
    return {}
