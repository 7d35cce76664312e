"""Gather, Scatter, Gatherv, Scatterv, Allgatherv, Alltoallv, Reduce_scatter (with counts), Scan and
Exscan, blocking and nonblocking, end to end (bodies in tests/bodies_coll_more.py).

Property tests: hypothesis draws the cases here, in the pytest process, for one rank count at a time
(counts of 0..~300 elements per block, zero-sized blocks, displacements in any order with gaps,
roots, IN_PLACE, alloc'ed or plain buffers, dtypes, ops); ONE job per rank count runs them all and
each rank checks its receive buffer against the pure-numpy model of bodies_coll_more.expected. No
job per example, so no shrinking: a failure prints its case. SPTEST_COLL_SEED=<int> draws the same
cases again. The same cases run on two simulated nodes (run_ranks(nodes=2)).
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, seed as hseed, settings, strategies as st

from tests.harness import run_ranks

BODY = "tests.bodies_coll_more:"
COLLS = ["Gather", "Scatter", "Gatherv", "Scatterv", "Allgatherv", "Alltoallv", "Reduce_scatter", "Scan",
         "Exscan"]
DTYPES = ["bool", "int8", "uint16", "int32", "int64", "float16", "float32", "float64", "complex64"]
SMALL_CHUNKS = {"SHMPROXY_NET_CHUNK_SIZE": "64K", "SHMPROXY_COLL_CHUNK_SIZE": "4K",
                "SHMPROXY_COLL_MIN_CHUNK": "4K",
                "SHMPROXY_COLL_INLINE_BYTES": "0"}


def _ops(dtype: str, prefix: bool) -> list[str]:
    kind = dtype[0]
    if dtype == "bool":
        return ["MIN", "MAX"]
    if dtype.startswith(("int", "uint")):
        return ["SUM", "PROD", "MIN", "MAX"]
    if dtype.startswith("float"):
        return ["SUM", "PROD", "MIN", "MAX"] + ([] if prefix else ["AVG"])
    assert kind == "c"
    return ["SUM", "PROD"] + ([] if prefix else ["AVG"])


_COUNT = st.one_of(st.just(0), st.integers(1, 9), st.integers(10, 300), st.sampled_from([1, 7, 257, 9001]))


@st.composite
def _layout(draw, counts: list[int]) -> tuple[list[int], int]:
    """Displacements of blocks of these counts: any order, gaps, a buffer with a tail."""
    order = draw(st.permutations(list(range(len(counts)))))
    displs = [0] * len(counts)
    at = 0
    for r in order:
        at += draw(st.sampled_from([0, 0, 1, 5]))
        displs[r] = at
        at += counts[r]
    return displs, at + draw(st.sampled_from([0, 0, 3]))


@st.composite
def case_strategy(draw, n: int) -> dict:
    coll = draw(st.sampled_from(COLLS))
    dtype = draw(st.sampled_from(DTYPES))
    c: dict = {"i": -1, "coll": coll, "dtype": dtype, "root": draw(st.integers(0, 7)),
               "nb": draw(st.booleans()), "alloc": draw(st.booleans()),
               "seed": draw(st.integers(0, 2**32 - 1)),
               "inplace": coll != "Alltoallv" and draw(st.booleans())}
    if coll in ("Gather", "Scatter", "Scan", "Exscan"):
        c["count"] = draw(_COUNT)
    elif coll in ("Gatherv", "Scatterv", "Allgatherv"):
        c["counts"] = [draw(_COUNT) for _ in range(n)]
        c["displs"], c["bufsize"] = draw(_layout(c["counts"]))
    elif coll == "Alltoallv":
        c["mat"] = [[draw(_COUNT) for _ in range(n)] for _ in range(n)]
        c["sd"], c["sbuf"], c["rd"], c["rbuf"] = [], [], [], []
        for r in range(n):
            d, size = draw(_layout(c["mat"][r]))
            c["sd"].append(d)
            c["sbuf"].append(size)
            d, size = draw(_layout([c["mat"][q][r] for q in range(n)]))
            c["rd"].append(d)
            c["rbuf"].append(size)
    else:   # Reduce_scatter
        c["counts"] = [draw(_COUNT) for _ in range(n)]
        c["pad"] = draw(st.sampled_from([0, 2]))
    if coll in ("Reduce_scatter", "Scan", "Exscan"):
        c["op"] = draw(st.sampled_from(_ops(dtype, coll != "Reduce_scatter")))
    return c


def draw_cases(n: int, k: int) -> list[dict]:
    got: list[dict] = []

    @settings(max_examples=k, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case_strategy(n))
    def collect(case):
        got.append(case)

    fixed = os.environ.get("SPTEST_COLL_SEED")
    if fixed:
        collect = hseed(int(fixed))(collect)
    collect()
    return got


def every_collective(n: int) -> list[dict]:
    """Each collective at least once, blocking and nonblocking, with odd counts and a zero block."""
    out = []
    for nb in (False, True):
        for coll in COLLS:
            dtype = "float64" if coll in ("Scan", "Exscan") else "int32"
            c: dict = {"coll": coll, "dtype": dtype, "root": n - 1, "nb": nb, "alloc": False, "seed": 7,
                       "inplace": nb and coll != "Alltoallv"}
            counts = [(2 * r + 3) * (r != 1) for r in range(n)]
            if coll in ("Gather", "Scatter", "Scan", "Exscan"):
                c["count"] = 13
            elif coll == "Alltoallv":
                c["mat"] = [[(r + 2 * q + 1) % 4 for q in range(n)] for r in range(n)]
                c["sd"] = [[sum(c["mat"][r][:q]) for q in range(n)] for r in range(n)]
                c["sbuf"] = [sum(c["mat"][r]) for r in range(n)]
                c["rd"] = [[sum(c["mat"][x][r] for x in range(q)) for q in range(n)] for r in range(n)]
                c["rbuf"] = [sum(c["mat"][q][r] for q in range(n)) for r in range(n)]
            else:
                c["counts"] = counts
                c["displs"] = [sum(counts[:r]) + r for r in range(n)]
                c["bufsize"] = sum(counts) + n
                c["pad"] = 1
            if coll in ("Reduce_scatter", "Scan", "Exscan"):
                c["op"] = "SUM"
            out.append(c)
    # Blocks over several chunks (NET_CHUNK_SIZE between nodes, the copy workers within one).
    big = [20011 + 3 * r for r in range(n)]
    out.append({"coll": "Allgatherv", "dtype": "float64", "root": 0, "nb": True, "alloc": True, "seed": 3,
                "inplace": False, "counts": big, "displs": [sum(big[:r]) for r in range(n)], "bufsize": sum(big)})
    mat = [[5003 * ((r + q) % 3) for q in range(n)] for r in range(n)]
    out.append({"coll": "Alltoallv", "dtype": "int64", "root": 0, "nb": False, "alloc": False, "seed": 4,
                "inplace": False, "mat": mat, "sd": [[sum(mat[r][:q]) for q in range(n)] for r in range(n)],
                "sbuf": [sum(mat[r]) for r in range(n)],
                "rd": [[sum(mat[x][r] for x in range(q)) for q in range(n)] for r in range(n)],
                "rbuf": [sum(mat[q][r] for q in range(n)) for r in range(n)]})
    for coll in ("Scan", "Exscan"):
        out.append({"coll": coll, "dtype": "float32", "root": 0, "nb": False, "alloc": False, "seed": 5,
                    "inplace": True, "count": 70001, "op": "SUM"})
    out.append({"coll": "Reduce_scatter", "dtype": "float64", "root": 0, "nb": True, "alloc": False, "seed": 6,
                "inplace": False, "counts": big, "pad": 0, "op": "MAX"})
    return out


def _number(cases: list[dict]) -> list[dict]:
    for i, c in enumerate(cases):
        c["i"] = i
    return cases


def _run(n: int, cases: list[dict], nodes: int = 1, env: dict | None = None, timeout: float = 240) -> None:
    res = run_ranks(BODY + "run_cases", n, timeout=timeout, args=(_number(cases),), nodes=nodes, env=env)
    fails = [f for r in res.results for f in r["failures"]]
    assert not fails, f"{len(fails)} wrong results:\n" + "\n".join(fails[:20])
    assert all(r["ncases"] == len(cases) for r in res.results)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_collective_and_property_cases(n):
    _run(n, every_collective(n) + draw_cases(n, 60))


def test_property_cases_small_chunks():
    """Blocks over many chunks, the schedule path (not only the inline one)."""
    _run(3, draw_cases(3, 40), env=SMALL_CHUNKS)


@pytest.mark.parametrize("n", [2, 4])
def test_across_two_simulated_nodes(n):
    _run(n, every_collective(n) + draw_cases(n, 40), nodes=2, env=SMALL_CHUNKS, timeout=300)


def test_bad_arguments_raise_before_posting():
    res = run_ranks(BODY + "argument_errors", 3, timeout=60)
    assert len(res.results[0]["messages"]) == 9


@pytest.mark.parametrize("which", ["alltoallv", "gatherv", "reduce_scatter"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_counts_mismatch_names_both_ranks(which, nodes):
    n = 3
    res = run_ranks(BODY + "counts_mismatch", n, timeout=60, args=(which,), nodes=nodes)
    for r in res.results:
        err = r["error"]
        assert "counts disagree" in err, err
        assert f"rank {n - 1}" in err and "rank 0" in err, err


@pytest.mark.parametrize("n", [1, 3])
def test_mpi_layer_buffer_specs(n):
    run_ranks(BODY + "mpi_specs", n, timeout=60)


@pytest.mark.parametrize("n,nodes", [(1, 1), (3, 1), (4, 2)])
def test_object_scatter_alltoall_reduce_scan_exscan(n, nodes):
    run_ranks(BODY + "objects", n, timeout=90, nodes=nodes)
