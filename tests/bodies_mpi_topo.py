"""Rank bodies of tests/test_mpi_topo.py: Cartesian, graph and distributed-graph topologies with the
neighbour collectives, and intercommunicators, written as mpi4py programs. The expected neighbours
and blocks are computed here from what MPI specifies (not from the implementation's own queries,
except where the query itself is what is checked)."""
from __future__ import annotations

import numpy as np

from shmproxy import MPI


def _cart_expect(comm: MPI.Cartcomm) -> list[tuple[int, int]]:
    """Per receive block i: (source, the source's send block that lands there); PROC_NULL edges: (-2, -1).
    MPI: per dimension the negative then the positive neighbour; a block sent in the positive
    direction lands in the receiver's negative-direction block and vice versa."""
    out = []
    coords, dims, periods = comm.coords, comm.dims, comm.periods
    for d in range(len(dims)):
        for step, sender_slot in ((-1, 2 * d + 1), (1, 2 * d)):
            c = list(coords)
            c[d] += step
            if not 0 <= c[d] < dims[d] and not periods[d]:
                out.append((MPI.PROC_NULL, -1))
                continue
            c[d] %= dims[d]
            r = 0
            for x, n in zip(c, dims):
                r = r * n + x
            out.append((r, sender_slot))
    return out


def _check_neighbour_collectives(comm: MPI.Topocomm, expect: list[tuple[int, int]], outdeg: int) -> None:
    rank, indeg = comm.Get_rank(), len(expect)
    # Neighbor_allgather: block i = in-neighbour i's sendbuf (2 elements)
    send = np.array([rank * 10, rank * 10 + 1], "i")
    recv = np.full(2 * indeg, -1, "i")
    comm.Neighbor_allgather(send, recv)
    want = []
    for src, _slot in expect:
        want += [-1, -1] if src < 0 else [src * 10, src * 10 + 1]
    assert recv.tolist() == want, (rank, recv.tolist(), want)
    # Neighbor_alltoall: send block j = rank*100 + j (3 elements each)
    send = np.repeat(np.arange(outdeg) + rank * 100, 3).astype("d")
    recv = np.full(3 * indeg, -1.0)
    comm.Neighbor_alltoall([send, 3, MPI.DOUBLE], [recv, 3, MPI.DOUBLE])
    want = []
    for src, slot in expect:
        want += [-1.0] * 3 if src < 0 else [float(src * 100 + slot)] * 3
    assert recv.tolist() == want, (rank, recv.tolist(), want)
    # nonblocking
    recv[:] = -1
    req = comm.Ineighbor_alltoall(send, recv)
    req.Wait()
    assert recv.tolist() == want
    recv[:] = -1    # advanced by Test alone (several rounds where a peer is listed twice)
    req = comm.Ineighbor_alltoall(send, recv)
    while not req.Test():
        pass
    assert recv.tolist() == want
    recv[:] = -1
    other = np.full(2 * indeg, -1, "i")
    reqs = [comm.Ineighbor_alltoall(send, recv),
            comm.Ineighbor_allgather(np.array([rank * 10, rank * 10 + 1], "i"), other)]
    done = {MPI.Request.Waitany(reqs)}
    done.add(MPI.Request.Waitany(reqs))
    assert done == {0, 1} and recv.tolist() == want
    # Neighbor_alltoallv: block j has j+1 elements; receive blocks packed with a gap of one element
    scounts = [j + 1 for j in range(outdeg)]
    sdispls = np.concatenate(([0], np.cumsum(scounts)[:-1])).astype(int).tolist() if outdeg else []
    send = np.concatenate([np.full(j + 1, rank * 100 + j, "q") for j in range(outdeg)] or [np.empty(0, "q")])
    rcounts = [slot + 1 if src >= 0 else 0 for src, slot in expect]
    rdispls, at = [], 0
    for c in rcounts:
        rdispls.append(at)
        at += c + 1
    recv = np.full(max(at, 1), -1, "q")
    comm.Neighbor_alltoallv([send, (scounts, sdispls), MPI.INT64_T], [recv, (rcounts, rdispls), MPI.INT64_T])
    want_v = np.full(max(at, 1), -1, "q")
    for (src, slot), c, d in zip(expect, rcounts, rdispls):
        if src >= 0:
            want_v[d:d + c] = src * 100 + slot
    assert recv.tolist() == want_v.tolist(), (rank, recv.tolist(), want_v.tolist())
    # Neighbor_allgatherv: rank r sends r+1 elements
    send = np.full(rank + 1, rank, "i")
    rcounts = [src + 1 if src >= 0 else 0 for src, _ in expect]
    recv = np.full(max(sum(rcounts), 1), -1, "i")
    comm.Ineighbor_allgatherv(send, [recv, rcounts, MPI.INT]).Wait()
    want_g = [src for src, _ in expect if src >= 0 for _ in range(src + 1)]
    assert recv[:sum(rcounts)].tolist() == want_g, (rank, recv.tolist(), want_g)
    # object forms
    got = comm.neighbor_allgather({"from": rank})
    assert got == [None if src < 0 else {"from": src} for src, _ in expect], (rank, got)
    got = comm.neighbor_alltoall([(rank, j) for j in range(outdeg)])
    assert got == [None if src < 0 else (src, slot) for src, slot in expect], (rank, got)


def cartesian() -> dict:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    ring = world.Create_cart([size], periods=[True])
    assert ring.topology == MPI.CART
    expect = _cart_expect(ring)
    assert expect[0][0] == (rank - 1) % size and expect[1][0] == (rank + 1) % size
    assert ring.inedges == ring.outedges == [(rank - 1) % size, (rank + 1) % size]
    assert ring.degrees == (2, 2) and ring.indegree == ring.outdegree == 2
    _check_neighbour_collectives(ring, expect, 2)
    line = world.Create_cart([size], periods=[False])
    _check_neighbour_collectives(line, _cart_expect(line), 2)
    grid = world.Create_cart(MPI.Compute_dims(size, 2), periods=[True, True])
    _check_neighbour_collectives(grid, _cart_expect(grid), 4)
    mixed = world.Create_cart(MPI.Compute_dims(size, 2), periods=[True, False])
    _check_neighbour_collectives(mixed, _cart_expect(mixed), 4)
    for c in (ring, line, grid, mixed):
        c.Free()
    MPI.Finalize()
    return {"rank": rank}


def _graph_expect(lists: list[list[int]], me: int) -> list[tuple[int, int]]:
    """For a symmetric graph given as each rank's neighbour list: per receive block i (from s =
    lists[me][i], the j-th occurrence of s there), s's send block at its j-th occurrence of me."""
    out, seen = [], {}
    for s in lists[me]:
        j = seen.get(s, 0)
        seen[s] = j + 1
        slots = [k for k, d in enumerate(lists[s]) if d == me]
        out.append((s, slots[j]))
    return out


def graphs() -> dict:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    # a ring as a general graph (neighbours both ways, no duplicates)
    lists = [sorted({(r - 1) % size, (r + 1) % size} - {r}) for r in range(size)]
    index, edges, acc = [], [], 0
    for lst in lists:
        acc += len(lst)
        index.append(acc)
        edges += lst
    g = world.Create_graph(index, edges)
    assert g.Get_topology() == MPI.GRAPH and g.topology == MPI.GRAPH
    assert g.Get_dims() == (size, len(edges)) and g.Get_topo() == (index, edges)
    assert g.Get_neighbors(rank) == lists[rank] and g.Get_neighbors_count(rank) == len(lists[rank])
    assert g.neighbors == lists[rank] and g.nnodes == size
    _check_neighbour_collectives(g, _graph_expect(lists, rank), len(lists[rank]))
    g.Free()

    # an irregular weighted multigraph with self-loops, given edge by edge in this global order
    n = size
    all_edges = [(0, 1 % n, 5), (0, 1 % n, 6), (1 % n, 0, 7), (0, 0, 8), (n - 1, 0, 9), (1 % n, n - 1, 3)]
    all_edges += [(r, (r + 1) % n, 10 + r) for r in range(n)]
    srcs = [s for s, d, _w in all_edges if d == rank]
    sw = [w for s, d, w in all_edges if d == rank]
    dsts = [d for s, d, _w in all_edges if s == rank]
    dw = [w for s, d, w in all_edges if s == rank]
    dg = world.Create_dist_graph_adjacent(srcs, dsts, sourceweights=sw, destweights=dw)
    assert dg.Get_topology() == MPI.DIST_GRAPH
    assert dg.Get_dist_neighbors_count() == (len(srcs), len(dsts), True)
    assert dg.Get_dist_neighbors() == (srcs, dsts, (sw, dw))
    assert dg.inedges == srcs and dg.outedges == dsts and dg.degrees == (len(srcs), len(dsts))
    outs = [[d for s, d, _w in all_edges if s == r] for r in range(n)]
    expect, seen = [], {}
    for s in srcs:
        j = seen.get(s, 0)
        seen[s] = j + 1
        expect.append((s, [k for k, d in enumerate(outs[s]) if d == rank][j]))
    _check_neighbour_collectives(dg, expect, len(dsts))
    unweighted = world.Create_dist_graph_adjacent(srcs, dsts)
    assert unweighted.Get_dist_neighbors() == (srcs, dsts, None)
    assert unweighted.Get_dist_neighbors_count()[2] is False

    # the same edges given by arbitrary ranks (edge i by rank i % n): in/out lists in that order
    mine = [e for i, e in enumerate(all_edges) if i % n == rank]
    dg2 = world.Create_dist_graph([s for s, _d, _w in mine], [1] * len(mine), [d for _s, d, _w in mine],
                                  weights=[w for _s, _d, w in mine])
    given = [e for g in range(n) for i, e in enumerate(all_edges) if i % n == g]
    want_srcs = [s for s, d, _w in given if d == rank]
    want_dsts = [d for s, d, _w in given if s == rank]
    want_w = ([w for s, d, w in given if d == rank], [w for s, d, w in given if s == rank])
    assert dg2.Get_dist_neighbors() == (want_srcs, want_dsts, want_w), (rank, dg2.Get_dist_neighbors())
    outs2 = [[d for s, d, _w in given if s == r] for r in range(n)]
    expect2, seen = [], {}
    for s in want_srcs:
        j = seen.get(s, 0)
        seen[s] = j + 1
        expect2.append((s, [k for k, d in enumerate(outs2[s]) if d == rank][j]))
    got = dg2.neighbor_alltoall([(rank, j) for j in range(len(want_dsts))])
    assert got == expect2, (rank, got, expect2)
    # an edge given at one end only: the queries take it (as MPI libraries do), the first neighbour
    # collective fails on every rank before anything is posted, not in a hang
    bad = [(rank + 1) % n] if rank == 0 else []
    lopsided = world.Create_dist_graph_adjacent([], bad)
    assert lopsided.Get_dist_neighbors() == ([], bad, None)
    try:
        lopsided.neighbor_allgather(rank)
    except MPI.Exception as exc:
        assert exc.Get_error_class() == MPI.ERR_TOPOLOGY
    else:
        raise AssertionError("a neighbour collective on an inconsistent dist graph was accepted")
    lopsided.Barrier()      # nothing was posted: the communicator still works
    lopsided.Free()
    MPI.Finalize()
    return {"rank": rank}


def intercomm() -> dict:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    half = size // 2
    color = 0 if rank < half else 1
    local = world.Split(color, rank)
    groups = [list(range(half)), list(range(half, size))]
    mine, other = groups[color], groups[1 - color]
    inter = local.Create_intercomm(0, world, other[0], tag=77)
    assert inter.Is_inter() and inter.is_inter and not inter.is_intra
    assert inter.Get_size() == len(mine) and inter.Get_rank() == mine.index(rank)
    assert inter.Get_remote_size() == inter.remote_size == len(other)
    assert inter.Get_remote_group().members == tuple(other) and inter.Get_group().members == tuple(mine)
    lrank = inter.Get_rank()

    # point-to-point addresses remote ranks; statuses name remote ranks
    st = MPI.Status()
    if color == 0 and lrank == 0:
        inter.Send(np.arange(4, dtype="i"), dest=len(other) - 1, tag=5)
        buf = np.zeros(2, "d")
        req = inter.Irecv(buf, source=MPI.ANY_SOURCE, tag=6)
        req.Wait(st)
        assert st.Get_source() == 0 and st.Get_tag() == 6 and buf.tolist() == [1.5, 2.5], (st, buf)
    if color == 1 and lrank == len(mine) - 1:
        buf = np.zeros(4, "i")
        inter.Recv(buf, source=MPI.ANY_SOURCE, tag=5, status=st)
        assert st.Get_source() == 0 and buf.tolist() == [0, 1, 2, 3], st
    if color == 1 and lrank == 0:
        inter.Send(np.array([1.5, 2.5]), dest=0, tag=6)
    inter.Barrier()

    # Bcast from group 0's local rank 0 to group 1
    data = np.arange(5, dtype="i") + 40 if (color == 0 and lrank == 0) else np.zeros(5, "i")
    if color == 0:
        inter.Bcast(data, root=MPI.ROOT if lrank == 0 else MPI.PROC_NULL)
        if lrank != 0:
            assert data.tolist() == [0] * 5
    else:
        inter.Bcast(data, root=0)
        assert data.tolist() == list(range(40, 45))
    # and back from group 1's last rank, a PROC_NULL member passing no buffer at all
    data = np.full(3, rank, "q")
    if color == 1:
        last = lrank == len(mine) - 1
        inter.Bcast(data if last else None, root=MPI.ROOT if last else MPI.PROC_NULL)
    else:
        inter.Bcast(data, root=len(other) - 1)
        assert data.tolist() == [size - 1] * 3
    # Allgather: the remote group's contributions in its rank order
    recv = np.zeros(2 * len(other), "i")
    inter.Allgather(np.array([rank, -rank], "i"), recv)
    assert recv.tolist() == [v for r in other for v in (r, -r)], recv
    # Allreduce: op over the remote group's sendbufs
    out = np.zeros(2)
    inter.Allreduce(np.array([rank + 1.0, 2.0 ** rank]), out, op=MPI.SUM)
    assert out.tolist() == [sum(r + 1.0 for r in other), sum(2.0 ** r for r in other)], out
    out = np.zeros(1, "i")
    inter.Allreduce(np.array([rank], "i"), out, op=MPI.MAX)
    assert out[0] == max(other)

    # Merge: the group passing high=False first; on a tie, both groups in the same agreed order
    merged = inter.Merge(high=(color == 0))
    order = groups[1] + groups[0]
    assert merged.Get_size() == size and merged.Get_rank() == order.index(rank), merged
    assert merged.Get_group().members == tuple(order)
    total = np.zeros(1, "i")
    merged.Allreduce(np.array([rank], "i"), total)
    assert total[0] == sum(range(size))
    tie = inter.Merge(False)
    assert tie.Get_group().members in (tuple(groups[0] + groups[1]), tuple(groups[1] + groups[0]))
    assert tie.allgather(rank) == list(tie.Get_group().members)
    for c in (merged, tie, inter, local):
        c.Free()
    MPI.Finalize()
    return {"rank": rank}


# ---------------------------------------------------------------- topologies in mpi4py's forms
def _expect_raises(fn, error_class: int | None = None, kind: type = MPI.Exception) -> None:
    try:
        fn()
    except kind as exc:
        if error_class is not None:
            assert isinstance(exc, MPI.Exception) and exc.Get_error_class() == error_class, exc
    else:
        raise AssertionError(f"{fn} did not raise {kind.__name__}")


def topo_forms() -> dict:
    """Grids and graphs of fewer processes than ranks, Cart_map/Graph_map, mpi4py's argument forms
    and handle constructors, dist graphs with None/WEIGHTS_EMPTY."""
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    assert not world.is_topo and world.Get_topology() == MPI.UNDEFINED
    # periods as one bool; reorder=True keeps ranks, and Cart_map says where each rank goes
    ring = world.Create_cart([size], periods=True, reorder=True)
    assert ring.is_topo and ring.dim == ring.ndim == 1 and ring.periods == [True]
    assert ring.topo == ([size], [True], [rank]) and ring.degrees == (2, 2)
    assert world.Cart_map([size], True) == ring.Get_rank() == rank
    # handles: a second handle shares the topology; another topology's class is a TypeError
    again = MPI.Cartcomm(ring)
    assert again == ring and type(again) is MPI.Cartcomm and again.dims == [size]
    assert type(MPI.Topocomm(ring)) is MPI.Cartcomm
    for cls in (MPI.Graphcomm, MPI.Distgraphcomm):
        _expect_raises(lambda cls=cls: cls(ring), kind=TypeError)
    _expect_raises(lambda: MPI.Topocomm(world), kind=TypeError)
    dup = ring.Dup()
    assert type(dup) is MPI.Cartcomm and dup.topo == ring.topo and dup != ring
    # Sub keeping nothing: a 0-d grid of this rank alone
    point = ring.Sub([False])
    assert point.Get_size() == 1 and point.dim == 0 and point.coords == [] and point.inoutedges == ([], [])
    assert point.Get_cart_rank([]) == 0
    # a grid of fewer processes: the last rank (when there are several) is left out
    n = max(size - 1, 1)
    part = world.Create_cart([n], periods=[False])
    if rank < n:
        assert part.Get_size() == n and part.coords == [rank]
        left, right = rank - 1 if rank else MPI.PROC_NULL, rank + 1 if rank + 1 < n else MPI.PROC_NULL
        assert part.Shift(0, 1) == (left, right)
    else:
        assert part == MPI.COMM_NULL
    assert world.Cart_map([n]) == (rank if rank < n else MPI.UNDEFINED)
    zero = world.Create_cart([])
    assert (zero == MPI.COMM_NULL) == (rank > 0)
    _expect_raises(lambda: world.Create_cart([size + 1]), kind=ValueError)
    _expect_raises(lambda: world.Create_cart([size], [True, False]), kind=ValueError)
    _expect_raises(lambda: ring.Get_cart_rank([0, 0]), kind=ValueError)
    _expect_raises(lambda: ring.Shift(1, 1), error_class=MPI.ERR_DIMS)

    # a ring graph of n nodes in the standard adjacency form (index with a leading 0)
    lists = [[(i - 1) % n, (i + 1) % n] for i in range(n)]
    index, edges = [0], []
    for lst in lists:
        index.append(index[-1] + len(lst))
        edges += lst
    g = world.Create_graph(index, edges, reorder=True)
    mapped = rank if rank < n else MPI.UNDEFINED
    assert world.Graph_map(index, edges) == world.Graph_map(index[1:], edges) == mapped
    if rank < n:
        assert g.nnodes == n and g.index == index[1:] and g.edges == edges and g.topo == (index[1:], edges)
        assert g.neighbors == lists[rank] and g.inoutedges == (lists[rank], lists[rank])
        _check_neighbour_collectives(g, _graph_expect(lists, rank), 2)
        assert type(MPI.Graphcomm(g)) is MPI.Graphcomm
        _expect_raises(lambda: MPI.Cartcomm(g), kind=TypeError)
        g.Free()
    else:
        assert g == MPI.COMM_NULL
    _expect_raises(lambda: world.Create_graph([2] * (size + 1), [0] * 2), error_class=MPI.ERR_TOPOLOGY)
    _expect_raises(lambda: world.Create_graph([1], [size]), error_class=MPI.ERR_RANK)

    # dist graphs: None for no neighbours, WEIGHTS_EMPTY for weighted with none
    srcs = [(rank - 1) % size, (rank - 2) % size]
    d = world.Create_dist_graph_adjacent(srcs, None, MPI.UNWEIGHTED, None)
    assert d.Get_dist_neighbors_count() == (2, 0, False) and d.Get_dist_neighbors() == (srcs, [], None)
    assert d.is_topo and d.topology == MPI.DIST_GRAPH and type(MPI.Topocomm(d)) is MPI.Distgraphcomm
    e = world.Create_dist_graph_adjacent([], [], MPI.WEIGHTS_EMPTY, MPI.WEIGHTS_EMPTY)
    assert e.Get_dist_neighbors_count() == (0, 0, True) and e.Get_dist_neighbors() == ([], [], ([], []))
    assert e.neighbor_allgather(rank) == []
    _expect_raises(lambda: world.Create_dist_graph_adjacent([0], [0], MPI.WEIGHTS_EMPTY, MPI.WEIGHTS_EMPTY),
                   kind=ValueError)
    for c in (ring, again, dup, point, part, zero, d, e):
        if c != MPI.COMM_NULL and c is not again:
            c.Free()
    MPI.Finalize()
    return {"rank": rank}


# ---------------------------------------------------------------- the w collectives
_KINDS = [("i", MPI.INT), ("d", MPI.DOUBLE), ("h", MPI.SHORT)]


def _payload(i: int, j: int, symmetric: bool = False) -> np.ndarray:
    """What rank i sends rank j: a kind and a count that depend on the pair (on the unordered pair
    when ``symmetric``, for IN_PLACE)."""
    kind = (i + j) % 3 if symmetric else (2 * i + j) % 3
    count = 1 + ((i + j) % 3 if symmetric else (i * j + j) % 3)
    code = _KINDS[kind][0]
    return (np.arange(count) + 1000 * i + 10 * j).astype(code)


def _layout(blocks: list[np.ndarray], gap: int = 3) -> tuple[np.ndarray, list[int], list[int]]:
    """Blocks packed into one byte buffer with ``gap`` bytes of 0xEE between them: (buffer, byte
    displacements, counts)."""
    displs, at = [], 0
    for b in blocks:
        displs.append(at)
        at += b.nbytes + gap
    raw = np.full(max(at, 1), 0xEE, np.uint8)
    for b, x in zip(blocks, displs):
        raw[x:x + b.nbytes] = b.view(np.uint8)
    return raw, displs, [b.size for b in blocks]


def _mpitype(a: np.ndarray) -> MPI.Datatype:
    return {c: t for c, t in _KINDS}[a.dtype.char]


def alltoallw() -> dict:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    # blocking, mixed datatypes, byte displacements with gaps
    out = [_payload(rank, j) for j in range(size)]
    want = [_payload(i, rank) for i in range(size)]
    sbuf, sd, sc = _layout(out)
    rbuf = np.full(sbuf.size + 64 * size, 0x11, np.uint8)
    expect, rd, rc = _layout(want, gap=5)
    rbuf[:expect.size] = 0x11
    smsg = [sbuf, (sc, sd), [_mpitype(a) for a in out]]
    rmsg = [rbuf, rc, rd, [_mpitype(a) for a in want]]
    world.Alltoallw(smsg, rmsg)
    for a, x in zip(want, rd):
        assert (rbuf[x:x + a.nbytes] == a.view(np.uint8)).all(), (rank, rbuf.tolist())
    gaps = np.ones(rbuf.size, bool)
    for a, x in zip(want, rd):
        gaps[x:x + a.nbytes] = False
    assert (rbuf[gaps] == 0x11).all(), "Alltoallw wrote outside its blocks"

    # a receive of a derived type: the ints of block i every other int (a vector type), the same
    # type signature as the sender's contiguous ints; nonblocking
    recv_types, rd2, at = [], [], 0
    for a in want:
        t = _mpitype(a)
        if a.dtype.char == "i":
            t = MPI.INT.Create_vector(a.size, 1, 2).Commit()
        recv_types.append(t)
        rd2.append(at)
        at += 8 * a.size + 8
    rb2 = np.full(at, -7, np.int32).view(np.uint8)
    counts2 = [1 if t is not _mpitype(a) else a.size for t, a in zip(recv_types, want)]
    req = world.Ialltoallw(smsg, [rb2, (counts2, rd2), recv_types])
    req.Wait()
    ints = rb2.view(np.int32)
    for a, x, t in zip(want, rd2, recv_types):
        if a.dtype.char == "i":
            got = ints[x // 4: x // 4 + 2 * a.size]
            assert got[0::2].tolist() == a.tolist() and (got[1::2] == -7).all(), (rank, got.tolist(), a)
            t.Free()
        else:
            assert (rb2[x:x + a.nbytes] == a.view(np.uint8)).all()

    # IN_PLACE: what block i holds goes to rank i (symmetric signatures)
    mine = [_payload(rank, j, True) for j in range(size)]
    buf, d3, c3 = _layout(mine)
    world.Alltoallw(MPI.IN_PLACE, [buf, (c3, d3), [_mpitype(a) for a in mine]])
    for i, x in enumerate(d3):
        a = _payload(i, rank, True)
        assert (buf[x:x + a.nbytes] == a.view(np.uint8)).all(), (rank, i)

    # MPI.BOTTOM: displacements are addresses
    sarr = [np.array(o) for o in out]
    rarr = [np.zeros_like(a) for a in want]
    world.Alltoallw([MPI.BOTTOM, [a.size for a in sarr], [MPI.Get_address(a) for a in sarr],
                     [_mpitype(a) for a in sarr]],
                    [MPI.BOTTOM, ([a.size for a in rarr], [MPI.Get_address(a) for a in rarr]),
                     [_mpitype(a) for a in rarr]])
    for got, a in zip(rarr, want):
        assert got.tolist() == a.tolist(), (rank, got, a)

    # bad specs are refused before anything is posted; the next collective is unaffected
    _expect_raises(lambda: world.Alltoallw([sbuf, sc, sd, [MPI.INT] * size, None], rmsg), MPI.ERR_BUFFER)
    _expect_raises(lambda: world.Alltoallw([sbuf, sc, sd, [MPI.INT] * (size + 1)], rmsg), MPI.ERR_ARG)
    _expect_raises(lambda: world.Alltoallw([sbuf, [1 << 20] * size, sd, [MPI.INT] * size], rmsg),
                   MPI.ERR_BUFFER)
    _expect_raises(lambda: world.Alltoallw([MPI.BOTTOM, None, sd, [MPI.INT] * size], rmsg), MPI.ERR_BUFFER)
    rbuf[:] = 0
    world.Alltoallw(smsg, rmsg)
    assert all((rbuf[x:x + a.nbytes] == a.view(np.uint8)).all() for a, x in zip(want, rd))
    MPI.Finalize()
    return {"rank": rank}


def neighbor_alltoallw() -> dict:
    """Per-edge datatypes on grids (PROC_NULL edges keep their blocks) and a graph of fewer nodes."""
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    line = world.Create_cart([size], periods=[False])
    ring = world.Create_cart([size], periods=[True])
    n = max(size - 1, 1)
    lists = [[(i + 1) % n, (i - 1) % n, i] for i in range(n)]
    index = list(np.cumsum([len(x) for x in lists]))
    g = world.Create_graph(index, [e for x in lists for e in x])
    topos = [(line, _cart_expect(line)), (ring, _cart_expect(ring))]
    if rank < n:
        topos.append((g, _graph_expect(lists, rank)))

    def block(src: int, slot: int) -> np.ndarray:     # what ``src`` sends on its out-edge ``slot``
        if slot % 2:
            return np.array([src + slot / 10.0])
        return np.array([src * 100 + slot, -src], np.int32)

    for comm, expect in topos:
        outdeg = comm.Get_topology() == MPI.CART and 2 or len(lists[rank])
        out = [block(rank, j) for j in range(outdeg)]
        sbuf, sd, sc = _layout(out, gap=1)
        # receive: the doubles as they are, the ints as every other int (a vector type)
        vec = MPI.INT.Create_vector(2, 1, 2).Commit()
        rtypes, rcounts, rdispls = [], [], []
        for i, (src, slot) in enumerate(expect):
            rdispls.append(24 * i)
            ints = (slot % 2 == 0) if src >= 0 else (i % 2 == 0)
            rtypes.append(vec if ints else MPI.DOUBLE)
            rcounts.append(1)
        for blocking in (True, False):
            rbuf = np.full(24 * len(expect) + 8, 0x5A, np.uint8)
            smsg = [sbuf, sc, sd, [_mpitype(a) for a in out]]
            rmsg = [rbuf, (rcounts, rdispls), rtypes]
            if blocking:
                comm.Neighbor_alltoallw(smsg, rmsg)
            else:
                comm.Ineighbor_alltoallw(smsg, rmsg).Wait()
            want = np.full_like(rbuf, 0x5A)
            for (src, slot), x, t in zip(expect, rdispls, rtypes):
                if src < 0:
                    continue        # PROC_NULL: the block stays as it was
                a = block(src, slot)
                if t is vec:
                    w = want[x:x + 12].view(np.int32)
                    w[0], w[2] = a
                else:
                    want[x:x + 8] = a.view(np.uint8)
            assert rbuf.tolist() == want.tolist(), (rank, comm.Get_topology(), blocking, rbuf, want)
        vec.Free()
    for c in (line, ring) + ((g,) if rank < n else ()):
        c.Free()
    MPI.Finalize()
    return {"rank": rank}
