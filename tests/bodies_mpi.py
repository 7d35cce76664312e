"""Rank bodies of the shmproxy.MPI tests (tests/test_mpi_ranks.py), written as an mpi4py program
would be: ``from shmproxy import MPI``, COMM_WORLD, mpi4py's names and signatures. Each raises on any
mismatch and ends with MPI.Finalize()."""
from __future__ import annotations

import array

from typing import Any

import numpy as np
import pytest

from shmproxy import MPI


def p2p_status() -> dict:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    assert size == 2 and comm.rank == rank
    other = 1 - rank
    st = MPI.Status()
    # Sends are synchronous natively: the ranks take turns rather than both sending first.
    if rank == 0:
        comm.Send([np.arange(5, dtype="d"), MPI.DOUBLE], dest=1, tag=11)
        comm.Send([np.arange(10, dtype="i"), 3, MPI.INT], dest=1, tag=12)
        comm.Send(array.array("i", [7, 8]), dest=1, tag=13)
        comm.Send(bytearray(b"hello"), dest=1, tag=14)
    else:
        buf = np.zeros(8)
        comm.Recv([buf, MPI.DOUBLE], source=0, tag=11, status=st)
        assert (st.Get_source(), st.Get_tag(), st.Get_count(MPI.DOUBLE)) == (0, 11, 5), st
        assert st.Get_elements(MPI.DOUBLE) == 5 and st.Get_count(MPI.BYTE) == 40
        assert st.Get_error() == MPI.SUCCESS
        assert buf[:5].tolist() == [0, 1, 2, 3, 4]
        ib = np.full(6, -1, "i")
        comm.Recv([ib, (3, 2), MPI.INT], MPI.ANY_SOURCE, MPI.ANY_TAG, st)     # into elements 2..4
        assert ib.tolist() == [-1, -1, 0, 1, 2, -1] and st.tag == 12 and st.source == 0
        a = array.array("i", [0, 0])
        comm.Recv(a, 0, 13)
        assert a.tolist() == [7, 8]
        b = bytearray(8)
        comm.Recv([b, MPI.BYTE], 0, MPI.ANY_TAG, st)
        assert bytes(b[:5]) == b"hello" and st.Get_count(MPI.BYTE) == 5 and st.tag == 14
    # a receive too small: ERR_TRUNCATE, nothing written
    if rank == 0:
        comm.Send(np.arange(4, dtype="i"), 1, 20)
    else:
        small = np.zeros(2, "i")
        with pytest.raises(MPI.Exception) as e:
            comm.Recv(small, 0, 20)
        assert e.value.Get_error_class() == MPI.ERR_TRUNCATE and small.tolist() == [0, 0]
    # PROC_NULL: no-ops, status source PROC_NULL
    comm.Send(np.zeros(3), MPI.PROC_NULL)
    comm.Recv(np.zeros(3), MPI.PROC_NULL, 5, st)
    assert st.source == MPI.PROC_NULL and st.tag == MPI.ANY_TAG and st.Get_count(MPI.DOUBLE) == 0
    req = comm.Irecv(np.zeros(3), MPI.PROC_NULL)
    req.Wait(st)
    assert st.source == MPI.PROC_NULL and not req
    # Sendrecv: both ranks exchange at once (no deadlock), and the replace form
    out = np.zeros(4, "i")
    comm.Sendrecv(np.full(4, rank, "i"), other, 30, out, other, 30, st)
    assert out.tolist() == [other] * 4 and st.source == other and st.tag == 30
    buf = np.full(3, 10 + rank, "d")
    comm.Sendrecv_replace([buf, MPI.DOUBLE], dest=other, sendtag=31, source=other, recvtag=31, status=st)
    assert buf.tolist() == [10.0 + other] * 3 and st.Get_count(MPI.DOUBLE) == 3
    # Isend/Irecv with Request.Wait(status) and Test(status); Ssend is Send
    r = comm.Irecv([out, MPI.INT], other, 40)
    s = comm.Issend(np.full(4, 100 + rank, "i"), other, 40)
    s.Wait()
    r.Wait(st)
    assert r.Test() and not r      # inactive once waited for
    assert out.tolist() == [100 + other] * 4 and st.source == other
    # errors before anything is posted
    with pytest.raises(MPI.Exception) as e:
        comm.Send(np.zeros(1), 5)
    assert e.value.Get_error_class() == MPI.ERR_RANK
    with pytest.raises(MPI.Exception, match="no buffer is attached"):
        comm.Bsend(np.zeros(1), other)
    # buffered mode: complete at once, the attached buffer is the budget
    mem = MPI.Alloc_mem(2 * (8 + MPI.BSEND_OVERHEAD))
    MPI.Attach_buffer(mem)
    data = np.full(1, 7.0 + rank)
    comm.Bsend(data, other, 60)
    data[0] = -1.0                 # the message was copied: changing the buffer changes nothing sent
    comm.Ibsend(np.full(1, 9.0), other, 61).Wait()
    with pytest.raises(MPI.Exception, match="do not fit"):
        comm.Bsend(np.zeros(100), other, 62)   # more than the attached buffer holds
    got = np.zeros(1)
    comm.Recv(got, other, 60)
    assert got[0] == 7.0 + other
    comm.Recv(got, other, 61)
    assert got[0] == 9.0
    assert MPI.Detach_buffer() is mem
    MPI.Free_mem(mem)
    # Isendrecv: one request for both halves
    inbox = np.zeros(2, "i")
    req = comm.Isendrecv(np.full(2, rank, "i"), other, 70, inbox, other, 70)
    req.Wait(st)
    assert inbox.tolist() == [other] * 2 and st.source == other and st.tag == 70
    # the object layer
    if rank == 0:
        comm.send({"a": [1, 2]}, 1, tag=50)
    else:
        assert comm.recv(source=0, tag=50, status=st) == {"a": [1, 2]} and st.source == 0
    comm.Barrier()
    MPI.Finalize()
    assert MPI.Is_finalized()
    return {"rank": rank}


def persistent_and_waitany() -> dict:
    comm = MPI.COMM_WORLD
    rank = comm.rank
    other = 1 - rank
    data = np.zeros(3, "d")
    sbuf = np.zeros(3, "d")
    send = comm.Send_init(sbuf, other, 1)
    recv = comm.Recv_init([data, MPI.DOUBLE], other, 1)
    for i in range(5):
        sbuf[:] = i * 10 + rank
        MPI.Prequest.Startall([recv, send])
        MPI.Request.Waitall([recv, send])
        assert data.tolist() == [i * 10 + other] * 3, (i, data)
    send.Free()
    recv.Free()
    # Waitany / Waitsome / Testany / Testall over receives that complete in an order of the sender's
    n = 6
    bufs = [np.zeros(2, "i") for _ in range(n)]
    reqs = [comm.Irecv(bufs[k], other, 100 + k) for k in range(n)]
    seen = []
    first, flag = MPI.Request.Testany(reqs)    # the peer's sends may have arrived already
    if flag:
        assert first != MPI.UNDEFINED
        seen.append(first)
    sends = [comm.Isend(np.full(2, k, "i"), other, 100 + k) for k in reversed(range(n))]
    st = MPI.Status()
    k = MPI.Request.Waitany(reqs, st)
    seen.append(k)
    assert st.tag == 100 + k and bufs[k].tolist() == [k, k]
    while len(seen) < n:
        statuses: list = []
        done = MPI.Request.Waitsome(reqs, statuses)
        assert done, done
        for j, idx in enumerate(done):
            assert statuses[j].tag == 100 + idx and bufs[idx].tolist() == [idx, idx]
        seen.extend(done)
    assert sorted(seen) == list(range(n))
    assert MPI.Request.Waitany(reqs) == MPI.UNDEFINED     # all inactive now
    assert MPI.Request.Waitsome(reqs) is None
    assert MPI.Request.Testall(reqs)
    MPI.Request.Waitall(sends)
    # Get_status_some reports complete requests and leaves them active; Testsome frees the same ones
    reqs = [comm.Irecv(bufs[k], other, 200 + k) for k in range(n)]
    sends = [comm.Isend(np.full(2, -k, "i"), other, 200 + k) for k in range(n)]
    got: set = set()
    while len(got) < n:
        statuses = []
        peeked = MPI.Request.Get_status_some(reqs, statuses)
        assert peeked is not None
        for j, idx in enumerate(peeked):
            assert statuses[j].tag == 200 + idx and reqs[idx] != MPI.REQUEST_NULL, (idx, statuses[j].tag)
        statuses = []
        done = MPI.Request.Testsome(reqs, statuses)
        assert done is not None and set(peeked) <= set(done), (peeked, done)
        for j, idx in enumerate(done):
            assert statuses[j].tag == 200 + idx and bufs[idx].tolist() == [-idx, -idx]
            assert reqs[idx] == MPI.REQUEST_NULL
        got |= set(done)
    assert MPI.Request.Testsome(reqs) is None and MPI.Request.Get_status_some(reqs) is None
    MPI.Request.Waitall(sends)
    # PROC_NULL persistent requests complete at once
    p = comm.Recv_init(np.zeros(1), MPI.PROC_NULL)
    p.Start()
    p.Wait(st)
    assert st.source == MPI.PROC_NULL
    comm.Barrier()
    MPI.Finalize()
    return {"seen": seen}


def collectives() -> dict:
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    buf = np.arange(4, dtype="d") if rank == 1 else np.zeros(4)
    comm.Bcast([buf, MPI.DOUBLE], root=1)
    assert buf.tolist() == [0, 1, 2, 3]
    x = np.full(3, rank + 1, "i")
    total = np.zeros(3, "i")
    comm.Allreduce([x, MPI.INT], [total, MPI.INT], op=MPI.SUM)
    assert total.tolist() == [sum(range(1, size + 1))] * 3
    comm.Allreduce(MPI.IN_PLACE, x, op=MPI.MAX)
    assert x.tolist() == [size] * 3
    root_out = np.zeros(3, "i") if rank == 0 else None
    comm.Reduce(np.full(3, rank, "i"), root_out, op=MPI.PROD, root=0)
    if rank == 0:
        assert root_out.tolist() == [0] * 3
    gathered = np.full(2 * size, -1, "q")
    gathered[2 * rank:2 * rank + 2] = rank
    comm.Allgather(MPI.IN_PLACE, [gathered, MPI.LONG_LONG])
    assert gathered.tolist() == [r for r in range(size) for _ in range(2)]
    send = np.array([rank * 10 + q for q in range(size)], "i")
    recv = np.zeros(size, "i")
    comm.Alltoall(send, recv)
    assert recv.tolist() == [q * 10 + rank for q in range(size)]
    rsb = np.zeros(2, "d")
    comm.Reduce_scatter_block(np.arange(2 * size, dtype="d"), rsb, op=MPI.SUM)
    assert rsb.tolist() == [size * (2 * rank), size * (2 * rank + 1)]
    comm.Reduce_scatter(np.ones(2 * size, "d"), rsb, recvcounts=[2] * size, op=MPI.SUM)
    assert rsb.tolist() == [size, size]
    # the engine's Gather, Scan and Reduce_scatter with unequal counts (tests/test_coll_more.py has the rest)
    g2 = np.zeros(2 * size, "i") if rank == 1 else None
    comm.Gather([np.full(2, rank, "i"), MPI.INT], g2, root=1)
    assert rank != 1 or g2.tolist() == [r for r in range(size) for _ in range(2)]
    sc = np.zeros(1, "l")
    comm.Scan(np.array([rank], "l"), sc)
    assert sc[0] == sum(range(rank + 1))
    uneq = np.zeros(rank + 1)
    comm.Reduce_scatter(np.ones(size * (size + 1) // 2), uneq, [r + 1 for r in range(size)])
    assert uneq.tolist() == [size] * (rank + 1)
    req = comm.Iallreduce(np.full(2, 1.5), rsb, MPI.SUM)
    req.Wait()
    assert rsb.tolist() == [1.5 * size] * 2
    MPI.Request.Waitall([comm.Ibarrier(), comm.Ibcast(buf, root=0)])
    # objects
    assert comm.bcast({"k": rank} if rank == 2 else None, root=2) == {"k": 2}
    g = comm.gather(rank * rank, root=1)
    assert g == ([r * r for r in range(size)] if rank == 1 else None)
    assert comm.allgather(str(rank)) == [str(r) for r in range(size)]
    assert comm.allreduce(rank, op=MPI.SUM) == sum(range(size))
    assert comm.allreduce((rank % 2, rank), op=MPI.MAXLOC) == (1, 1)
    assert comm.allreduce(rank == 0, op=MPI.LOR) is True
    assert comm.reduce(rank, op=MPI.MAX, root=2) == (size - 1 if rank == 2 else None)
    comm.barrier()
    # ops and types the engine lacks: the ranks reduce them in rank order, blocking or not
    bx = np.zeros(size, "i")
    comm.Allreduce(send, bx, op=MPI.BXOR)
    want = np.zeros(size, "i")
    for r in range(size):
        want ^= np.array([r * 10 + q for q in range(size)], "i")
    assert bx.tolist() == want.tolist()
    bx2 = np.zeros(size, "i")
    req = comm.Iallreduce(send, bx2, op=MPI.BXOR)     # nonblocking: folded when its completion is seen
    assert req.Wait() and bx2.tolist() == want.tolist()
    ld = np.zeros(2, np.longdouble)
    req = comm.Iscan(np.full(2, rank + 0.5, np.longdouble), ld, op=MPI.SUM)   # long double: the ranks
    while not req.Test():
        pass
    assert ld.tolist() == [sum(r + 0.5 for r in range(rank + 1))] * 2
    ld[:] = -1
    comm.Iexscan(np.full(2, rank + 0.5, np.longdouble), ld, op=MPI.SUM).Wait()
    assert ld.tolist() == ([-1, -1] if rank == 0 else [sum(r + 0.5 for r in range(rank))] * 2)

    def digits(inbuf: Any, inout: Any, datatype: Any) -> None:    # associative, not commutative
        a, b = np.frombuffer(inbuf, "i"), np.frombuffer(inout, "i")
        b[:] = [int(f"{x}{y}") for x, y in zip(a, b)]
    cat = MPI.Op.Create(digits, commute=False)
    one = np.zeros(1, "i")
    comm.Allreduce(np.array([rank + 1], "i"), one, op=cat)
    assert one[0] == int("".join(str(r + 1) for r in range(size)))
    comm.Scan(np.array([rank + 1], "i"), one, op=cat)
    assert one[0] == int("".join(str(r + 1) for r in range(rank + 1)))
    pairs = np.zeros(2, MPI.DOUBLE_INT.dtype)
    pairs["value"], pairs["index"] = [rank % 2, -rank], rank
    best = np.zeros(2, MPI.DOUBLE_INT.dtype)
    comm.Allreduce([pairs, MPI.DOUBLE_INT], [best, MPI.DOUBLE_INT], op=MPI.MAXLOC)
    assert best.tolist() == [(1.0, 1), (0.0, 0)]
    cat.Free()
    assert comm.scatter([r * 10 for r in range(size)] if rank == 0 else None, root=0) == rank * 10
    comm.Barrier()
    MPI.Finalize()
    return {"rank": rank}


def topology_and_groups() -> dict:
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    assert size == 3
    # a periodic ring: Shift and a Sendrecv along it
    ring = comm.Create_cart([size], periods=[True])
    assert ring.Get_topology() == MPI.CART and ring.Get_topo() == ([3], [True], [rank])
    src, dst = ring.Shift(0, 1)
    assert (src, dst) == ((rank - 1) % size, (rank + 1) % size)
    got = np.zeros(1, "i")
    ring.Sendrecv(np.array([rank], "i"), dst, 0, got, src, 0)
    assert got[0] == src
    # a non-periodic line: PROC_NULL at the ends, and a Sendrecv that uses it
    line = comm.Create_cart([size], periods=[False])
    src, dst = line.Shift(0, 1)
    assert src == (MPI.PROC_NULL if rank == 0 else rank - 1)
    assert dst == (MPI.PROC_NULL if rank == size - 1 else rank + 1)
    got[0] = -7
    line.Sendrecv(np.array([rank], "i"), dst, 0, got, src, 0)
    assert got[0] == (-7 if rank == 0 else rank - 1)
    # a 1 x 3 grid and its sub-grids
    grid = comm.Create_cart(MPI.Compute_dims(size, 2), periods=[False, False])
    assert grid.dims == [3, 1] and grid.Get_coords(rank) == [rank, 0]
    assert grid.Get_cart_rank([rank, 0]) == rank
    row = grid.Sub([True, False])
    col = grid.Sub([False, True])
    assert row.Get_size() == 3 and col.Get_size() == 1 and row.dims == [3]
    # groups, Create (collective over comm) and Create_group (members only)
    world = comm.Get_group()
    assert world.size == 3 and world.rank == rank
    pair = world.Incl([2, 0])
    sub = comm.Create(pair)
    if rank == 1:
        assert sub == MPI.COMM_NULL and not sub
    else:
        assert sub.Get_size() == 2 and sub.Get_rank() == (0 if rank == 2 else 1)
        assert MPI.Group.Translate_ranks(sub.Get_group(), [0, 1], world) == [2, 0]
        v = np.zeros(1, "i")
        sub.Allreduce(np.array([rank], "i"), v)
        assert v[0] == 2
        sub.Free()
    if rank != 1:
        only = comm.Create_group(pair, tag=3)     # rank 1 does not take part at all
        assert only.Get_size() == 2
        only.Barrier()
        assert MPI.Comm.Compare(only, only) == MPI.IDENT
        only.Free()
    # Split and Dup
    half = comm.Split(color=rank % 2, key=-rank)
    assert half.Get_size() == (2 if rank % 2 == 0 else 1)
    if rank % 2 == 0:
        assert half.Get_rank() == (0 if rank == 2 else 1)
    dup = comm.Dup()
    assert MPI.Comm.Compare(dup, comm) == MPI.CONGRUENT
    dup.Set_name("dup")
    assert dup.Get_name() == "dup"
    dup.Barrier()
    # COMM_SELF: made on first use, without the other ranks
    assert MPI.COMM_SELF.Get_size() == 1
    self_out = np.zeros(2)
    MPI.COMM_SELF.Allreduce(np.full(2, 3.0), self_out)
    assert self_out.tolist() == [3.0, 3.0]
    for c in (ring, line, grid, row, col, half, dup):
        c.Free()
    comm.Barrier()
    MPI.Finalize()
    return {"rank": rank}


def abort_reaches_peers() -> dict:
    """Rank 1 calls Abort(3) while rank 0 waits in Recv: rank 1 exits with status 3, rank 0 gets an
    MPI.Exception that is also the native Aborted (or PeerDiedError, if it saw the exit first)."""
    import time
    comm = MPI.COMM_WORLD
    comm.Barrier()
    if comm.rank == 1:
        comm.Abort(3)
        raise AssertionError("Abort returned")
    t0 = time.monotonic()
    with pytest.raises(MPI.Exception) as e:
        comm.Recv(np.zeros(1), 1, 0)
    assert e.value.Get_error_class() in (MPI.ERR_REVOKED, MPI.ERR_PROC_FAILED), e.value
    return {"seconds": time.monotonic() - t0, "error": str(e.value)}


class _HostBehindCai:
    """Host memory exported through the CUDA array interface (as mpi4py's own tests' fake GPU arrays)."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr
        self.__cuda_array_interface__ = {"data": (arr.ctypes.data, False), "typestr": arr.dtype.str,
                                         "shape": arr.shape, "version": 3}


def cuda_array_interface_over_host_memory() -> dict:
    """A CUDA-array-interface object whose memory is host memory (no CUDA driver knows it as device
    memory) is read as host memory in every buffer form; device memory would go to the native layer
    (tests/test_gpu*.py)."""
    comm = MPI.COMM_WORLD
    r = comm.rank
    a = np.full(4, r + 1.0)
    x = _HostBehindCai(a)
    comm.Allreduce(MPI.IN_PLACE, [x, 4, MPI.DOUBLE])
    b = np.full(4, 7.0) if r == 0 else np.zeros(4)
    comm.Bcast(_HostBehindCai(b), root=0)
    comm.Barrier()
    return {"allreduce": a.tolist(), "bcast": b.tolist()}


class _Index:
    """An integer only through __index__ (operator.index reads it; int() would not)."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


def _type_error(cls: int, fn: Any, *args: Any, **kw: Any) -> None:
    """``fn`` refuses a non-integer before posting anything: a TypeError that is an MPI.Exception."""
    with pytest.raises(TypeError) as e:
        fn(*args, **kw)
    assert isinstance(e.value, MPI.Exception) and e.value.Get_error_class() == cls, e.value


def integer_arguments() -> dict:
    """Ranks, tags, roots, colors, keys and counts as numpy integers, numpy and Python bools and
    __index__ objects (mpi4py reads them with operator.index); floats and strings refused on every
    rank alike (so that no rank is left inside a call)."""
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    assert size == 3
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    # Split: a bool color (numpy's too), numpy keys
    sub = comm.Split(np.True_, np.int64(-rank))
    assert sub.size == size and sub.rank == size - 1 - rank
    sub.Free()
    sub = comm.Split(rank == 0, _Index(rank))
    assert sub.size == (1 if rank == 0 else 2)
    sub.Free()
    sub = comm.Split(np.bool_(rank > 0), np.int8(0))
    assert sub.size == (1 if rank == 0 else 2)
    sub.Free()
    # point-to-point: numpy and __index__ ranks and tags
    out = np.zeros(2, "i")
    comm.Sendrecv(np.full(2, rank, "i"), np.int64(nxt), np.int32(7), out, _Index(prv), np.uint8(7))
    assert out.tolist() == [prv, prv]
    req = comm.Irecv(out, source=np.intc(prv), tag=_Index(9))
    comm.Send(np.full(2, 10 + rank, "i"), dest=_Index(nxt), tag=np.int16(9))
    req.Wait()
    assert out.tolist() == [10 + prv] * 2
    assert comm.sendrecv(rank, dest=np.int64(nxt), source=np.int64(prv)) == prv
    # roots: True is rank 1
    buf = np.arange(3, dtype="d") if rank == 1 else np.zeros(3)
    comm.Bcast(buf, root=True)
    assert buf.tolist() == [0, 1, 2]
    got = np.zeros(3, "i") if rank == 2 else None
    comm.Reduce(np.full(3, rank, "i"), got, op=MPI.SUM, root=np.intc(2))
    assert rank != 2 or got.tolist() == [3, 3, 3]
    g = np.full(2 * size, -1, "i")
    comm.Gatherv(np.full(1, rank, "i"), [g, (np.int64(1), np.int64(2)), MPI.INT] if rank == 1 else None,
                 root=_Index(1))
    if rank == 1:        # one count for every rank, blocks 2 apart
        assert g.tolist() == [0, -1, 1, -1, 2, -1]
    sc = np.zeros(1, "i")
    comm.Scatter(np.arange(size, dtype="i") if rank == 0 else None, sc, root=np.False_)
    assert sc.tolist() == [rank]
    assert comm.bcast(rank * 10, root=np.int64(2)) == 20
    assert comm.gather(rank, root=_Index(0)) == ([0, 1, 2] if rank == 0 else None)
    assert comm.reduce(rank, root=np.uint64(1)) == (3 if rank == 1 else None)
    rs = np.zeros(rank + 1)
    comm.Reduce_scatter(np.ones(6), rs, np.array([1, 2, 3]), op=MPI.SUM)
    assert rs.tolist() == [3.0] * (rank + 1)
    # groups and a grid
    grp = comm.Get_group().Incl([np.int64(2), True])
    assert grp.Translate_ranks([np.int8(0), _Index(1)], comm.Get_group()) == [2, 1]
    cart = comm.Create_cart([np.int64(3)], periods=[np.True_])
    assert cart.Shift(np.int64(0), np.int32(1)) == (prv, nxt)
    assert cart.Get_coords(_Index(2)) == [2]
    cart.Free()
    # non-integers: TypeError and MPI.Exception, on every rank, before anything is posted
    _type_error(MPI.ERR_RANK, comm.Send, np.zeros(1), 1.0)
    _type_error(MPI.ERR_TAG, comm.Recv, np.zeros(1), 0, "3")
    _type_error(MPI.ERR_ROOT, comm.Bcast, np.zeros(1), root=0.0)
    _type_error(MPI.ERR_ROOT, comm.bcast, 1, root="0")
    _type_error(MPI.ERR_ARG, comm.Split, 0.5, 0)
    _type_error(MPI.ERR_COUNT, comm.Allgatherv, np.zeros(1), [np.zeros(3), (1.0, 1), MPI.DOUBLE])
    comm.Barrier()
    MPI.Finalize()
    return {"rank": rank}


def persistent_collectives() -> None:
    """Every persistent collective (MPI 4's Xxx_init) against numpy, each started three times with
    the buffers changed between rounds (a round reads the buffers as they are when it starts), and
    Startall over several at once; an active one refuses a second Start."""
    from shmproxy import MPI
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    k = 5
    send = np.zeros(k, np.int64)
    red = np.zeros(k, np.int64)
    gat = np.zeros(n * k, np.int64)
    a2a_s, a2a_r = np.zeros(n * k, np.int64), np.zeros(n * k, np.int64)
    bc = np.zeros(k, np.int64)
    scan = np.zeros(k, np.int64)
    rsb = np.zeros(k, np.int64)
    big = np.zeros(n * k, np.int64)
    sca = np.zeros(k, np.int64)
    reqs = {
        "allreduce": comm.Allreduce_init(send, red, op=MPI.SUM),
        "allgather": comm.Allgather_init(send, gat),
        "alltoall": comm.Alltoall_init(a2a_s, a2a_r),
        "bcast": comm.Bcast_init(bc, root=n - 1),
        "scan": comm.Scan_init(send, scan, op=MPI.SUM),
        "reduce_scatter_block": comm.Reduce_scatter_block_init(big, rsb, op=MPI.MAX),
        "scatter": comm.Scatter_init(big if me == 0 else None, sca, root=0),
        "barrier": comm.Barrier_init(),
    }
    for rnd in range(3):
        send[:] = np.arange(k) + 10 * me + 100 * rnd
        a2a_s[:] = np.arange(n * k) + 1000 * me + rnd
        big[:] = np.arange(n * k) * (me + 1) + rnd
        if me == n - 1:
            bc[:] = np.arange(k) * 7 + rnd
        for name, req in reqs.items():     # one at a time, in the same order on every rank
            req.Start()
            req.Wait()
        base = np.arange(k) + 100 * rnd
        assert np.array_equal(red, n * base + 10 * sum(range(n))), red
        assert np.array_equal(gat.reshape(n, k), base + 10 * np.arange(n)[:, None]), gat
        assert np.array_equal(a2a_r.reshape(n, k), np.arange(me * k, (me + 1) * k) + 1000 * np.arange(n)[:, None]
                              + rnd), a2a_r
        assert np.array_equal(bc, np.arange(k) * 7 + rnd), bc
        assert np.array_equal(scan, (me + 1) * base + 10 * sum(range(me + 1))), scan
        assert np.array_equal(rsb, np.arange(me * k, (me + 1) * k) * n + rnd), rsb
        assert np.array_equal(sca, np.arange(me * k, (me + 1) * k) + rnd), sca
    # several in flight at once, started together
    send[:] = me + 1
    MPI.Prequest.Startall([reqs["allreduce"], reqs["allgather"]])
    try:
        reqs["allreduce"].Start()
    except MPI.Exception as exc:
        assert exc.Get_error_class() == MPI.ERR_REQUEST, exc
    else:
        raise AssertionError("a second Start of an active persistent collective was taken")
    MPI.Request.Waitall([reqs["allreduce"], reqs["allgather"]])
    assert (red == n * (n + 1) // 2).all() and np.array_equal(gat.reshape(n, k)[:, 0], np.arange(1, n + 1))
    for req in reqs.values():
        req.Free()
        assert not req


def mprobe_of_own_objects() -> None:
    """A matched probe takes an object the rank sent itself (by its rank or ANY_SOURCE, by tag or
    ANY_TAG) out of matching, with its status; the Message's recv hands it over, once; an issend to
    itself completes once probed; objects from other ranks still come after."""
    from shmproxy import MPI
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    comm.send({"a": me}, me, tag=3)
    comm.send([me, 1], me, tag=4)
    st = MPI.Status()
    m = comm.mprobe(MPI.ANY_SOURCE, 4, st)
    assert (st.Get_source(), st.Get_tag()) == (me, 4) and st.Get_count(MPI.BYTE) > 0
    assert comm.iprobe(me, 3) and not comm.iprobe(me, 4)
    assert m.recv() == [me, 1] and not m
    m2 = comm.improbe(me, MPI.ANY_TAG)
    assert m2 is not None and m2.recv() == {"a": me}
    assert comm.improbe(me, MPI.ANY_TAG) is None
    req = comm.issend("sync", me, tag=5)
    assert not req.test()[0]
    msg = comm.mprobe(me, 5)
    assert req.test()[0], "an issend to itself completes once a matched probe took it"
    assert msg.recv() == "sync"
    if n > 1:
        comm.send(me, (me + 1) % n, tag=6)
        assert comm.mprobe(MPI.ANY_SOURCE, 6).recv() == (me - 1) % n
    comm.Barrier()
