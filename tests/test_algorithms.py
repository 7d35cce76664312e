"""Collective algorithms on regions, run by the CPU executor in this process: every builder against
numpy, the ufunc paths the C kernel lacks, and the hierarchical Allreduce with several simulated
nodes whose SEND/RECV entries meet through the shm transport's loopback connector."""
from __future__ import annotations

import types

import numpy as np
import pytest

from shmproxy.coll import algorithms, hierarchy, sched
from shmproxy.coll.executor import CpuExecutor, host_view
from shmproxy.coll.sched import Region, ReduceOp
from shmproxy.engine.copyengine import CopyEngine
from shmproxy.shm import _native
from shmproxy.transports.base import Connector, MemKind, PeerInfo
from shmproxy.transports.shm import ShmTransport

EXEC = CpuExecutor(lambda: CopyEngine(0, None))   # no workers: every entry runs inline


def region(a: np.ndarray) -> Region:
    return Region(a.ctypes.data, a.size, a.dtype)


def run(nchunks: int, make) -> None:
    for k in range(nchunks):
        sch = make(k)
        while not sch.advance(EXEC.start_inline):
            pass


def ranks_data(n: int, size: int, dtype, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * 10).astype(dtype) if np.dtype(dtype).kind == "f" else
            rng.integers(-50, 50, n).astype(dtype) for _ in range(size)]


@pytest.mark.parametrize("dtype,op", [(np.float32, ReduceOp.SUM), (np.float16, ReduceOp.MIN),
                                      (np.complex64, ReduceOp.SUM), (np.float64, ReduceOp.AVG),
                                      (np.int32, ReduceOp.MAX)])
@pytest.mark.parametrize("size", [1, 3])
def test_allreduce_and_reduce_on_regions_match_numpy_in_rank_order(dtype, op, size):
    n = 1000
    ins = ranks_data(n, size, dtype)
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum, ReduceOp.AVG: np.add}[op]
    want = ins[0].copy()
    for x in ins[1:]:
        want = ufunc(want, x)
    if op == ReduceOp.AVG:
        want = want / size
    outs = [np.zeros(n, dtype) for _ in range(size)]
    run(*algorithms.allreduce([region(x) for x in ins], [region(o) for o in outs], op, 128))
    for o in outs:
        assert np.array_equal(o, want.astype(dtype)), (o[:4], want[:4])
    root, out = size - 1, np.zeros(n, dtype)
    run(*algorithms.reduce_to_root([region(x) for x in ins], region(out), op, root, 100))
    want_root = ins[root].copy()
    for r in range(size):
        if r != root:
            want_root = ufunc(want_root, ins[r])
    if op == ReduceOp.AVG:
        want_root = want_root / size
    assert np.array_equal(out, want_root.astype(dtype))


@pytest.mark.parametrize("in_place", [False, True])
def test_copies_and_reduce_scatter_on_regions(in_place):
    size, n = 3, 50
    ins = ranks_data(n * size, size, np.float16, seed=1)
    gathered = [np.zeros(n * size, np.float16) for _ in range(size)]
    run(*algorithms.allgather([region(x[:n]) for x in ins], [region(g) for g in gathered], n * 2, 64))
    assert all(np.array_equal(g, np.concatenate([x[:n] for x in ins])) for g in gathered)
    outs = [np.zeros(n * size, np.float16) for _ in range(size)]
    run(*algorithms.alltoall([region(x) for x in ins], [region(o) for o in outs], n * 2, 40))
    for q in range(size):
        assert np.array_equal(outs[q], np.concatenate([ins[r][q * n:(q + 1) * n] for r in range(size)]))
    bufs = [x.copy() for x in ins]
    run(*algorithms.bcast([region(b) for b in bufs], 1, 30))
    assert all(np.array_equal(b, ins[1]) for b in bufs)
    # float16 MIN: the ufunc path (the C kernel lacks it); in place, results go through scratch first
    src = [x.copy() for x in ins]
    res = [x if in_place else np.zeros(n, np.float16) for x in src]
    run(*algorithms.reduce_scatter_block([region(x) for x in src], [region(r[:n]) for r in res],
                                         ReduceOp.MIN, 16, in_place))
    for r in range(size):
        want = np.minimum.reduce([ins[x][r * n:(r + 1) * n] for x in range(size)])
        assert np.array_equal(res[r][:n], want), r


def test_host_view_and_the_executor_refuse_what_they_cannot_run():
    a = np.arange(10, dtype=np.float32)
    v = host_view(region(a))
    assert np.shares_memory(v, a) and np.array_equal(v, a) and host_view(Region(0, 0, a.dtype)).size == 0
    with pytest.raises(Exception, match="cannot be executed"):
        EXEC.execute(sched.send("k", 0, a.ctypes.data, 4))
    step = EXEC.native_step(sched.copy(1, 2, 3))
    assert step is not None and EXEC.native_step(sched.reduce(np.add, region(a), region(a), region(a))) is None


def _loopback() -> tuple:
    me = PeerInfo(0, 0, "h", 1)
    conn = Connector(ShmTransport(), me, me, MemKind.HOST)
    ctx = types.SimpleNamespace(memcopy=_native.memcopy)
    return conn, ctx


def _run_nodes(built: list) -> None:
    """Run every node's schedules of one collective (``built``: (nchunks, make) per node) in this
    process, their SEND/RECV entries meeting on one loopback connector, until all complete."""
    conn, ctx = _loopback()

    def start(sch, e):
        if e.kind in (sched.SEND, sched.RECV):
            matched = conn.transport.proxy_coll_entry(ctx, conn, sch, e)
            for osch, oe in matched:
                if oe is not e:
                    osch.entry_done(oe)
            return any(oe is e for _s, oe in matched)
        return EXEC.start_inline(sch, e)

    schedules = [make(k) for nchunks, make in built for k in range(nchunks)]
    for _ in range(200):
        if all([s.advance(start) for s in schedules]):
            break
    else:
        raise AssertionError("the nodes' schedules did not complete")
    assert not conn.send_state   # every SEND met its RECV


@pytest.mark.parametrize("ring", [False, True], ids=["tree", "ring"])
@pytest.mark.parametrize("nnodes,local,dtype,op", [(2, 2, np.float32, ReduceOp.SUM), (3, 1, np.int64, ReduceOp.MAX),
                                                   (4, 3, np.float16, ReduceOp.MIN), (3, 2, np.int32, ReduceOp.SUM)])
def test_allreduce_across_simulated_nodes_through_the_loopback_connector(nnodes, local, dtype, op, ring):
    """Every node's schedules (shmproxy.coll.hierarchy) run in this process, their SEND/RECV entries
    meeting on one loopback connector (what the socket transport carries between nodes): local reduce,
    a tree through node 0 or a ring between the nodes, local copy-out. Every rank of every node gets
    the same bits: the reduction over all ranks (in node order for the tree; the ring reduces each
    segment once from another start, equal for these exact cases)."""
    n, per = 777, 100
    ins = [ranks_data(n, local, dtype, seed=node) for node in range(nnodes)]
    outs = [[np.zeros(n, dtype) for _ in range(local)] for _ in range(nnodes)]
    built = [hierarchy.allreduce([region(x) for x in ins[node]], [region(o) for o in outs[node]], op, per, node,
                                 nnodes, nnodes * local, key=7, ring_min=0 if ring else 1 << 62)
             for node in range(nnodes)]
    assert all(b[0] == built[0][0] for b in built)
    _run_nodes(built)
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum, ReduceOp.PROD: np.multiply}[op]
    partial = []
    for node in range(nnodes):
        acc = ins[node][0].copy()
        for x in ins[node][1:]:
            acc = ufunc(acc, x)
        partial.append(acc)
    want = partial[0]
    for p in partial[1:]:
        want = ufunc(want, p)
    for node in range(nnodes):
        for o in outs[node]:
            assert np.array_equal(o, want), (node, o[:3], want[:3])


@pytest.mark.parametrize("ring", [False, True], ids=["tree", "ring"])
@pytest.mark.parametrize("nnodes", [2, 4, 5])
@pytest.mark.parametrize("in_place", [False, True])
def test_allreduce_with_one_rank_per_node_reads_its_input_where_it_is(nnodes, ring, in_place):
    """One rank per node, out of place: the exchange reads the rank's input itself (no copy into the
    output first), and must still leave that input as it was; in place the output is the input. Sums
    of floats whose order matters, so a segment combined from the wrong buffer or twice shows."""
    n, per = 1000, 300
    rng = np.random.default_rng(5)
    ins = [rng.standard_normal(n).astype(np.float32) for _ in range(nnodes)]
    before = [x.copy() for x in ins]
    outs = ins if in_place else [np.full(n, np.nan, np.float32) for _ in range(nnodes)]
    built = [hierarchy.allreduce([region(ins[node])], [region(outs[node])], ReduceOp.SUM, per, node, nnodes,
                                 nnodes, key=3, ring_min=0 if ring else 1 << 62)
             for node in range(nnodes)]
    _run_nodes(built)
    for node in range(nnodes):
        assert np.array_equal(outs[node], outs[0]), node   # the same bits on every node
        if not in_place:
            assert np.array_equal(ins[node], before[node]), node
    assert np.allclose(outs[0], np.sum(before, axis=0), atol=1e-4)


@pytest.mark.parametrize("nnodes", [1, 2, 3, 4, 5, 8, 9])
def test_binomial_tree_reaches_every_node_once_in_log_steps(nnodes):
    for root in range(nnodes):
        seen, depth = {0}, {0: 0}
        for rel in range(nnodes):
            parent, children = hierarchy.binomial(rel, nnodes)
            assert (parent < 0) == (rel == 0)
            if parent >= 0:
                assert rel in hierarchy.binomial(parent, nnodes)[1]
            assert len(children) <= max(1, nnodes - 1).bit_length()
        order = [0]
        for rel in order:
            for c in hierarchy.binomial(rel, nnodes)[1]:
                assert c not in seen
                seen.add(c)
                depth[c] = depth[rel] + 1
                order.append(c)
        assert seen == set(range(nnodes)) and max(depth.values()) <= (nnodes - 1).bit_length()


@pytest.mark.parametrize("nnodes,local", [(2, 1), (3, 2), (4, 1), (5, 2), (8, 1), (9, 1)])
def test_bcast_reduce_and_barrier_between_simulated_nodes(nnodes, local):
    """Bcast and Reduce over the binomial tree from every root node (and root rank within it), and the
    dissemination barrier, every node's schedules in this process (chunks of 100 elements, 777)."""
    n, per = 777, 100
    total = nnodes * local
    for root_node in range(nnodes):
        root_local = root_node % local
        data = np.arange(n, dtype=np.int64) * 3 + root_node
        bufs = [[data.copy() if (node, i) == (root_node, root_local) else np.zeros(n, np.int64)
                 for i in range(local)] for node in range(nnodes)]
        _run_nodes([hierarchy.bcast([region(b) for b in bufs[node]], node, root_node, root_local, nnodes, per * 8,
                                    key=("b", root_node)) for node in range(nnodes)])
        for node in range(nnodes):
            for b in bufs[node]:
                assert np.array_equal(b, data), (root_node, node)
        ins = [ranks_data(n, local, np.float64, seed=10 * node + 1) for node in range(nnodes)]
        out = np.zeros(n)
        _run_nodes([hierarchy.reduce_to_root([region(x) for x in ins[node]],
                                             region(out) if node == root_node else None, ReduceOp.SUM, per, node,
                                             root_node, root_local, nnodes, total, n, np.dtype(np.float64),
                                             key=("r", root_node)) for node in range(nnodes)])
        assert np.allclose(out, sum(x for node in ins for x in node)), root_node
    _run_nodes([hierarchy.barrier(node, nnodes, key="bar") for node in range(nnodes)])


def test_loopback_rendezvous_refuses_a_mismatched_pair():
    conn, ctx = _loopback()
    a = np.zeros(4, np.uint8)
    s = sched.Schedule([])
    assert conn.transport.proxy_coll_entry(ctx, conn, s, sched.send("k", 0, a.ctypes.data, 4)) == []
    with pytest.raises(Exception, match="pairs"):
        conn.transport.proxy_coll_entry(ctx, conn, s, sched.recv("k", 0, a.ctypes.data, 3))
