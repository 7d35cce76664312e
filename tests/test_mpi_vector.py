"""shmproxy.MPI's vector collectives (Gatherv, Scatterv, Allgatherv, Alltoallv and their nonblocking
forms) under every vector-spec form mpi4py reads, in real rank processes (tests/bodies_mpi_vector.py).

Property test: hypothesis draws the cases here, in the pytest process (collective, datatype, root,
and for each vector side a spec form with counts and displacements that fit it: zero counts, blocks
out of rank order with gaps, one count for every rank with a stride, counts split from the buffer's
size, ...), and ONE job per rank count runs them all, each rank checking whole receive buffers against
numpy (tests/test_coll.py does the same for the other collectives). Every form is drawn a few times:
each gets examples of its own. Set SPTEST_VEC_SEED=<int> to draw the same cases again.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, seed as hseed, settings, strategies as st

from tests import bodies_mpi_vector as B
from tests.harness import run_ranks

BODY = "tests.bodies_mpi_vector:"
COLLS = ["Gatherv", "Igatherv", "Scatterv", "Iscatterv", "Allgatherv", "Iallgatherv", "Alltoallv",
         "Ialltoallv"]
TYPES = [("i", "INT"), ("d", "DOUBLE"), ("b", "SIGNED_CHAR"), ("h", "SHORT"), ("f", "FLOAT"),
         ("q", "LONG_LONG")]
_COUNT = st.sampled_from([0, 0, 1, 2, 3, 5])     # zero counts are common
_GAP = st.integers(0, 2)


@st.composite
def layout(draw, form: str, counts: list[int]) -> dict:
    """A vector side in ``form`` for these per-rank counts: displacements and buffer size that fit it."""
    n = len(counts)
    pad = draw(_GAP)
    if form in B.GENERAL:       # blocks in any order, gaps between them
        order = draw(st.permutations(range(n)))
        displs, at = [0] * n, 0
        for r in order:
            at += draw(_GAP)
            displs[r] = at
            at += counts[r]
        return {"form": form, "counts": counts, "displs": displs, "size": at + pad}
    if form in ("scalar_pair", "np_scalar_pair"):       # one count, one stride
        stride = counts[0] + draw(_GAP)
        return {"form": form, "counts": counts, "displs": [stride * r for r in range(n)],
                "size": stride * (n - 1) + counts[0] + pad}
    displs = [sum(counts[:r]) for r in range(n)]       # packed
    return {"form": form, "counts": counts, "displs": displs,
            "size": sum(counts) + (0 if form in B.SPLIT else pad)}


def _split(total: int, n: int) -> list[int]:
    """mpi4py's counts for a buffer of ``total`` elements and no counts: as even as they go."""
    return [total // n + (r < total % n) for r in range(n)]


@st.composite
def counts_for(draw, form: str, n: int) -> list[int]:
    if form in B.UNIFORM:
        return [draw(_COUNT)] * n
    if form in B.SPLIT:
        return _split(draw(st.integers(0, 3 * n + 2)), n)
    return [draw(_COUNT) for _ in range(n)]


@st.composite
def case_strategy(draw, form: str, coll: str, n: int) -> dict:
    dtype, mpitype = draw(st.sampled_from(TYPES))
    case = {"i": -1, "coll": coll, "dtype": dtype, "mpitype": mpitype, "root": draw(st.integers(0, n - 1))}
    if "toall" not in coll:
        case["v"] = draw(layout(form, draw(counts_for(form, n))))
        case["send_form"] = draw(st.sampled_from(["plain", "typed"]))
        case["recv_pad"] = draw(st.sampled_from([0, 0, 1]))
        return case
    # Alltoallv: counts[s][d] is what rank s sends rank d; each rank's sides have forms of their own
    # (rank 0's receive side has ``form``); a form with one count for every rank makes them all equal
    recv_forms = [form] + [draw(st.sampled_from(B.FORMS)) for _ in range(n - 1)]
    send_forms = [draw(st.sampled_from(B.FORMS)) for _ in range(n)]
    if any(f in B.UNIFORM + B.SPLIT for f in recv_forms + send_forms):
        c = draw(_COUNT)
        matrix = [[c] * n for _ in range(n)]
    else:
        matrix = [[draw(_COUNT) for _ in range(n)] for _ in range(n)]
    case["send"] = [draw(layout(send_forms[s], matrix[s])) for s in range(n)]
    case["recv"] = [draw(layout(recv_forms[d], [matrix[s][d] for s in range(n)])) for d in range(n)]
    return case


def draw_cases(n: int, per_form: int) -> list[dict]:
    """``per_form`` cases for each spec form and collective, drawn by hypothesis in this process (no
    job per example): every pair is covered whatever the draw."""
    got: list[dict] = []
    for form in B.FORMS:
        for coll in COLLS:
            @settings(max_examples=per_form, phases=[Phase.generate], database=None, deadline=None,
                      suppress_health_check=list(HealthCheck))
            @given(case_strategy(form, coll, n))
            def collect(case: dict) -> None:
                got.append(case)

            fixed = os.environ.get("SPTEST_VEC_SEED")
            if fixed:
                collect = hseed(int(fixed))(collect)
            collect()
    for i, c in enumerate(got):
        c["i"] = i
    return got


@pytest.mark.parametrize("nranks, per_form", [(3, 3), (2, 1), (4, 1)])
def test_vector_collectives_in_every_spec_form_match_numpy(nranks: int, per_form: int):
    cases = draw_cases(nranks, per_form)
    res = run_ranks(BODY + "run_cases", nranks, timeout=120, args=(cases,))
    fails = [f for r in res.results for f in r["failures"]]
    assert not fails, f"{len(fails)} wrong results:\n" + "\n".join(fails[:20])
    assert all(r["ncases"] == len(cases) for r in res.results)
