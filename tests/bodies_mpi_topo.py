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
    # an edge given at one end only fails on every rank at creation, not in a later collective
    bad = [(rank + 1) % n] if rank == 0 else []
    try:
        world.Create_dist_graph_adjacent([], bad)
    except MPI.Exception as exc:
        assert exc.Get_error_class() == MPI.ERR_TOPOLOGY
    else:
        raise AssertionError("an inconsistent dist graph was accepted")
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
