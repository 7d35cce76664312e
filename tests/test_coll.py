"""Buffer collectives end to end: real rank processes, real progress processes, real shared memory.

Bodies live in tests/bodies_coll.py, tests/bodies_coll_nonblocking.py and tests/bodies_coll_faults.py.
The conftest fixture checks after every test that no segment, socket or process of ours is left behind
(the kill -9 tests rely on it for the clean /dev/shm).

Property tests: hypothesis draws a list of cases in the pytest process (collective, dtype, op valid
or not for the dtype, root, shape of 0..5000 elements in 1-3 dims, in place, alloc or plain
buffers, blocking or nonblocking with Wait / Test / deferred Waitall), and ONE job per rank count
runs them all; each rank checks its outputs against a numpy reference computed from every rank's
deterministic inputs. Hypothesis never starts a job per example: a @given function that only
collects examples runs inside the test (its first example is the minimal one, the others are
random), so no shrinking either; a failure names its case (with its seed), which is enough to
reproduce it. Set SPTEST_COLL_SEED=<int> to draw the same case lists again.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, seed as hseed, settings, strategies as st

from tests import bodies_coll as B, bodies_coll_faults as BF
from tests.harness import run_ranks

BODY = "tests.bodies_coll:"
BODY_NB = "tests.bodies_coll_nonblocking:"
BODY_FAULTS = "tests.bodies_coll_faults:"

# --------------------------------------------------------------------------------- case strategy
_SHAPES = st.one_of(
    st.integers(0, 5000).map(lambda k: [k]),
    st.lists(st.integers(0, 17), min_size=1, max_size=3),
    st.tuples(st.integers(0, 70), st.integers(0, 70)).map(list),
    st.sampled_from([[0], [1], [2, 0, 3], [1, 1, 1]]),
)


@st.composite
def case_strategy(draw) -> dict:
    coll = draw(st.sampled_from(B.COLLS))
    dtype = draw(st.sampled_from(B.DTYPES))
    op, invalid = None, False
    if coll in B.REDUCING:
        bad = B.invalid_ops(dtype)
        if bad and draw(st.integers(0, 7)) == 0:
            op, invalid = draw(st.sampled_from(bad)), True
        else:
            op = draw(st.sampled_from(B.valid_ops(dtype)))
    nb = draw(st.booleans())
    return {
        "i": -1, "coll": coll, "dtype": dtype, "op": op, "invalid": invalid,
        "opvia": draw(st.sampled_from(["const", "enum"])),
        "root": draw(st.integers(0, 11)), "shape": draw(_SHAPES),
        "inplace": coll in ("Allreduce", "Reduce", "Allgather") and draw(st.booleans()),
        "alloc": draw(st.booleans()), "pad": draw(st.sampled_from([0, 0, 1, 3, 8])),
        "none_recv": draw(st.booleans()),
        "alt": draw(st.booleans()), "alt2": draw(st.booleans()),
        "nb": nb, "wait": draw(st.sampled_from(["wait", "test", "later"])) if nb else None,
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def draw_cases(k: int) -> list[dict]:
    """k cases drawn by hypothesis in this process (no job per example)."""
    got: list[dict] = []

    @settings(max_examples=k, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case_strategy())
    def collect(case):
        got.append(case)

    fixed = os.environ.get("SPTEST_COLL_SEED")
    if fixed:
        collect = hseed(int(fixed))(collect)
    collect()
    for i, c in enumerate(got):
        c["i"] = i
    return got


def _failures(res) -> list[str]:
    return [f for r in res.results for f in r["failures"]]


def _run_property(n: int, k: int, env: dict | None = None, timeout: float = 200):
    cases = draw_cases(k)
    assert len(cases) >= k // 2, len(cases)
    res = run_ranks(BODY + "run_cases", n, timeout=timeout, args=(cases,), env=env)
    fails = _failures(res)
    assert not fails, f"{len(fails)} wrong results:\n" + "\n".join(fails[:30])
    assert all(r["ncases"] == len(cases) for r in res.results)
    return cases, res


# --------------------------------------------------------------------------------- property tests
def test_api_surface():
    """The names the tests rely on, without starting a job."""
    import shmproxy
    for name in ("SUM", "PROD", "MIN", "MAX", "AVG"):
        assert getattr(shmproxy, name) == getattr(shmproxy.ReduceOp, name), name
    assert shmproxy.IN_PLACE is not None and shmproxy.UNDEFINED is not None
    for m in ("Allreduce", "Reduce", "Bcast", "Allgather", "Reduce_scatter_block", "Alltoall", "Barrier",
              "Iallreduce", "Ireduce", "Ibcast", "Iallgather", "Ireduce_scatter_block", "Ialltoall",
              "Ibarrier", "Split", "Dup"):
        assert callable(getattr(shmproxy.Comm, m, None)), m


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_property_random_collectives(n):
    _run_property(n, 40)


@pytest.mark.parametrize("n", [2, 3])
def test_property_random_collectives_fast_path_off(n):
    """The same cases through the progress process alone (small blocking collectives otherwise run
    between the ranks: rank/fastpath.py)."""
    _run_property(n, 40, env={"SHMPROXY_FAST_BYTES": "0"})


@pytest.mark.parametrize("n,loop_copies", [(2, "1"), (3, "0")])
def test_property_random_collectives_small_chunks(n, loop_copies):
    """The same, with everything chunked and queued: 4 KiB chunks, 2 slots, no eager path, parallel
    split from 8 KiB, few records per rank; the loop running queued copy jobs itself or not; every
    collective written with streaming stores (by default only those that outgrow the cache are)."""
    _run_property(n, 30, env={"SHMPROXY_CHUNK_SIZE": "4096", "SHMPROXY_COLL_CHUNK_SIZE": "4096",
                              "SHMPROXY_STEPS": "2",
                              "SHMPROXY_EAGER_BYTES": "0", "SHMPROXY_COLL_INLINE_BYTES": "0",
                              "SHMPROXY_STREAMING_MIN_BYTES": "0",
                              "SHMPROXY_PARALLEL_THRESHOLD": "8192",
                              "SHMPROXY_MAX_OPS_PER_RANK": "64", "SHMPROXY_LOOP_COPIES": loop_copies})


def test_property_many_outstanding_with_few_records():
    """Every nonblocking case deferred (up to 40 outstanding) with 16 records per rank, 4 KiB chunks
    and one slot: posting has to wait for records and slots while collectives are queued."""
    cases = draw_cases(80)
    for c in cases:
        if c["nb"]:
            c["wait"] = "later"
    res = run_ranks(BODY + "run_cases", 3, timeout=200, args=(cases, 40),
                    env={"SHMPROXY_CHUNK_SIZE": "4096", "SHMPROXY_COLL_CHUNK_SIZE": "4096",
                         "SHMPROXY_STEPS": "1", "SHMPROXY_EAGER_BYTES": "0",
                         "SHMPROXY_COLL_INLINE_BYTES": "0",
                         "SHMPROXY_MAX_OPS_PER_RANK": "16", "SHMPROXY_MAX_SUBS": "64"})
    fails = _failures(res)
    assert not fails, f"{len(fails)} wrong results:\n" + "\n".join(fails[:30])


def test_case_strategy_reaches_every_variant():
    """The strategy itself (no job): a few hundred draws cover every collective, dtype and flag."""
    cases = draw_cases(300)
    assert {c["coll"] for c in cases} == set(B.COLLS)
    assert len({c["dtype"] for c in cases}) >= 10   # hypothesis's draws are skewed; the sweep covers all
    assert any(c["invalid"] for c in cases) and any(c["inplace"] for c in cases)
    assert any(c["pad"] for c in cases) and any(c["alloc"] and c["nb"] for c in cases)
    assert {c["wait"] for c in cases if c["nb"]} == {"wait", "test", "later"}
    assert any(int(np.prod(c["shape"])) == 0 for c in cases)
    assert any(int(np.prod(c["shape"])) > 1000 for c in cases)
    json.dumps(cases)


def sweep_cases() -> list[dict]:
    """Every collective x dtype x op (the invalid ones included), one small odd shape each, with the
    flags varied deterministically: the coverage the random lists do not guarantee."""
    out = []
    rng = np.random.default_rng(1234)
    for coll in B.COLLS:
        for dtype in B.DTYPES:
            if coll in B.REDUCING:
                ops = [(o, False) for o in B.valid_ops(dtype)] + [(o, True) for o in B.invalid_ops(dtype)]
            else:
                ops = [(None, False)]
            for op, invalid in ops:
                k = len(out)
                nb = bool(k % 2)
                out.append({
                    "i": k, "coll": coll, "dtype": dtype, "op": op, "invalid": invalid,
                    "opvia": "enum" if k % 3 == 0 else "const", "root": k % 5,
                    "shape": [[3, 5, 7], [37], [4, 33]][k % 3],
                    "inplace": coll in ("Allreduce", "Reduce", "Allgather") and k % 4 < 2,
                    "alloc": k % 5 < 2, "pad": k % 4, "none_recv": bool(k % 2),
                    "alt": k % 3 == 1, "alt2": k % 7 < 3,
                    "nb": nb, "wait": ["wait", "test", "later"][k % 3] if nb else None,
                    "seed": int(rng.integers(0, 2**32 - 1)),
                })
    return out


@pytest.mark.parametrize("n", [1, 3, 4])
def test_sweep_every_collective_dtype_and_op(n):
    cases = sweep_cases()
    res = run_ranks(BODY + "run_cases", n, timeout=200, args=(cases,))
    fails = _failures(res)
    assert not fails, f"{len(fails)} wrong results:\n" + "\n".join(fails[:30])
    assert res.results[0]["counts"]["invalid"] == sum(c["invalid"] for c in cases)


# --------------------------------------------------------------------------------- deterministic
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_collective_across_chunk_boundaries_every_root(n):
    """1, 1000, one chunk + 1 (131073 float32 = 512 KiB + 4 B) and 300000 float32 (> PARALLEL_THRESHOLD),
    every root, in place and not, registered and plain buffers."""
    counts = [1, 1000] if n == 1 else [1, 1000, 131073, 300_000]
    res = run_ranks(BODY + "sizes_every_root", n, timeout=240, args=(counts,))
    assert all(r["checked"] > 0 for r in res.results)


@pytest.mark.parametrize("n,in_place", [(2, False), (2, True), (3, False)])
def test_allreduce_64mib(n, in_place):
    res = run_ranks(BODY + "big_allreduce", n, timeout=240, args=(64 << 20, in_place))
    assert all(r["seconds"] > 0 for r in res.results)


@pytest.mark.slow
def test_allreduce_64mib_4_ranks():
    run_ranks(BODY + "big_allreduce", 4, timeout=280, args=(64 << 20, False))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_1000_small_allreduces_leave_nothing_behind(n):
    res = run_ranks(BODY + "many_small_allreduces", n, timeout=240, args=(1000, 50))
    for rank, s in enumerate(res.results):
        assert s["clean"], f"rank {rank}: pool not clean after 2000 Allreduces: {s}"


def test_small_allreduces_with_few_records():
    """Windows of nonblocking collectives with only 32 records per rank: posting waits for records
    and slots, never deadlocks, and everything is returned."""
    res = run_ranks(BODY + "many_small_allreduces", 3, timeout=240, args=(300, 8),
                    env={"SHMPROXY_MAX_OPS_PER_RANK": "32"})
    for rank, s in enumerate(res.results):
        assert s["clean"], f"rank {rank}: {s}"


@pytest.mark.parametrize("n", [2, 3])
def test_nonblocking_collectives_overlap_point_to_point(n):
    run_ranks(BODY_NB + "overlap_with_p2p", n, timeout=180, args=(3,))


def test_blocking_collectives_while_nonblocking_ones_are_outstanding():
    run_ranks(BODY_NB + "outstanding_then_blocking", 3, timeout=90)


@pytest.mark.parametrize("n", [3, 4])
def test_dup_and_split_progress_independently(n):
    res = run_ranks(BODY_NB + "multi_comm", n, timeout=180)
    assert [r["split"]["color"] for r in res.results] == [q % 2 for q in range(n)]


@pytest.mark.parametrize("n", [1, 3])
def test_empty_buffers_every_dtype(n):
    res = run_ranks(BODY_FAULTS + "empty_and_single", n, timeout=120)
    assert res.results[0]["calls"] == 14 * 2 * 14


def test_bad_arguments_raise_before_posting():
    res = run_ranks(BODY_FAULTS + "bad_arguments", 2, timeout=90)
    wrong = {k: v for r in res.results for k, v in r["wrong"].items()}
    assert not wrong, json.dumps(wrong, indent=1)


# --------------------------------------------------------------------------------- mismatches
_BOTH = {
    "coll": [r"Allreduce", r"Bcast"],
    "count": [r"\b(1234|4936)\b", r"\b(4321|17284)\b"],
    "dtype": [r"\bfloat32\b", r"\bint32\b"],
    "root": [r"root\D{0,4}0\b", r"root\D{0,4}2\b"],
    "op": [r"(?i)\bsum\b", r"(?i)\bmax\b"],
    "nonblocking": [r"(?i)allreduce", r"(?i)bcast"],
    "dtype_bcast": [r"\bfloat32\b", r"\bint32\b"],
    "count_alltoall": [r"\b(1234|3702|2468|7404)\b", r"\b(4321|12963|8642|25926)\b"],
    "last_rank": [r"\bReduce\b", r"\bAllreduce\b"],
}


@pytest.mark.parametrize("kind", BF.MISMATCH_KINDS)
def test_mismatch_every_rank_raises_invalid_usage_naming_both_sides(kind):
    """Rank 0 disagrees with ranks 1 and 2 at the same position of the collective sequence."""
    res = run_ranks(BODY_FAULTS + "mismatch", 3, timeout=120, args=(kind,), env={"SHMPROXY_TIMEOUT": "60"})
    problems = []
    for rank, r in enumerate(res.results):
        if not r["is_invalid_usage"]:
            problems.append(f"rank {rank}: {r['error']}: {r['message']!r} after {r['seconds']:.2f}s")
            continue
        missing = [p for p in _BOTH[kind] if not re.search(p, r["message"])]
        if missing:
            problems.append(f"rank {rank}: message does not name both sides {missing}: {r['message']!r}")
        if r["seconds"] >= 30:
            problems.append(f"rank {rank}: took {r['seconds']:.1f}s")
        if r["later"] is None:
            problems.append(f"rank {rank}: a later collective on the failed communicator did not raise")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------- faults
@pytest.mark.parametrize("victim", [0, 2])
@pytest.mark.parametrize("when", ["before", "after", "during"])
def test_kill9_during_32mib_allreduce_every_survivor_raises(victim, when):
    res = run_ranks(BODY_FAULTS + "victim_dies_in_allreduce", 3, timeout=120, args=(victim, when, 32 << 20),
                    expect_fail={victim}, env={"SHMPROXY_TIMEOUT": "60"})
    for rank, r in enumerate(res.results):
        if rank == victim:
            continue
        assert r["error"] == "PeerDiedError", f"rank {rank}: {r}"
        assert r["seconds"] < 30, f"rank {rank}: {r}"
        assert r["rank"] == victim and f"rank {victim}" in r["message"], f"rank {rank}: {r}"


def test_kill9_progress_process_during_32mib_allreduce():
    res = run_ranks(BODY_FAULTS + "proxy_dies_in_allreduce", 3, timeout=120, args=(32 << 20,),
                    env={"SHMPROXY_TIMEOUT": "60"})
    for rank, r in enumerate(res.results):
        assert r["error"] == "PeerDiedError" and r["rank"] == -1, f"rank {rank}: {r}"
        assert r["seconds"] < 30, f"rank {rank}: {r}"


# --------------------------------------------------------------------------------- buffer lifetime
@pytest.mark.parametrize("n", [2, 3])
def test_registered_buffers_freed_between_collectives(n):
    """comm.alloc buffers used by one collective above the eager size and dropped right after it:
    their deregistration must not disturb the progress process (nor the next collectives)."""
    run_ranks(BODY + "alloc_free_churn", n, timeout=120, args=(16385, 20))


# --------------------------------------------------------------------------------- more semantics
@pytest.mark.parametrize("n", [2, 3])
def test_nonblocking_collective_returns_before_peers_post(n):
    res = run_ranks(BODY_NB + "nonblocking_is_nonblocking", n, timeout=90)
    assert res.results[0]["post_s"] < 5, res.results[0]


@pytest.mark.parametrize("n", [3, 4])
def test_six_large_nonblocking_collectives_outstanding(n):
    run_ranks(BODY_NB + "many_outstanding_large", n, timeout=180, args=(200_000,))


def test_five_dups_at_once():
    res = run_ranks(BODY_NB + "many_comms", 3, timeout=180, args=(5,))
    assert res.results[0]["proxies"] in (0, 5), res.results[0]


@pytest.mark.parametrize("n", [3, 4])
def test_split_orders_by_key_then_rank_nested_and_solo(n):
    run_ranks(BODY_NB + "split_orders", n, timeout=120)


def test_mismatch_on_a_sub_communicator_leaves_sibling_and_parent_working():
    """Beyond the brief's letter: a sub-communicator has its own pool and progress process, so its
    failure should not fail the parent or a sibling."""
    res = run_ranks(BODY_FAULTS + "sub_mismatch", 4, timeout=120, env={"SHMPROXY_TIMEOUT": "60"})
    for rank, r in enumerate(res.results):
        if r["color"] == 0:
            assert r["error"] and "Allreduce" in r["error"] and "Bcast" in r["error"], (rank, r)


@pytest.mark.slow
def test_collectives_with_more_than_2_31_elements():
    res = run_ranks(BODY + "huge_count", 2, timeout=280, args=((1 << 31) + 77,))
    assert res.results[0]["allreduce_s"] > 0


@pytest.mark.parametrize("n", [2, 3])
def test_barrier_waits_for_the_last_rank(n):
    delay = 0.5
    res = run_ranks(BODY_NB + "barrier_synchronizes", n, timeout=90, args=(delay,))
    for rank, r in enumerate(res.results[:-1]):
        for name, t in r.items():
            assert t > delay * 0.6, f"rank {rank} left {name} after {t:.3f}s, before the last rank entered"


def test_close_with_outstanding_nonblocking_collectives():
    run_ranks(BODY_NB + "close_with_outstanding", 3, timeout=90)


def test_wait_timeout_on_a_collective_then_it_completes():
    res = run_ranks(BODY_NB + "wait_timeout_then_complete", 3, timeout=90)
    msg = res.results[0]["timeout_message"]
    assert msg is not None, "Wait(timeout=0.3) did not raise Timeout while a peer had not posted"
    assert "llreduce" in msg, msg


def test_abort_reaches_ranks_inside_a_collective():
    res = run_ranks(BODY_FAULTS + "abort_during_allreduce", 3, timeout=90)
    for rank, r in enumerate(res.results[1:], 1):
        assert r["error"] == "Aborted" and "coll test over" in r["message"], (rank, r)
        assert r["seconds"] < 30, (rank, r)


@pytest.mark.parametrize("coll", ["Bcast", "Reduce"])
def test_noncontiguous_buffer_is_accepted_or_rejected_on_every_rank_alike(coll):
    res = run_ranks(BODY_FAULTS + "noncontiguous_consistent", 3, timeout=90, args=(coll,),
                    env={"SHMPROXY_TIMEOUT": "30"})
    outcomes = [r["outcome"] for r in res.results]
    assert len(set(outcomes)) == 1, f"ranks disagree on whether the call is valid: {res.results}"
    assert all(r["correct"] in (None, True) for r in res.results), res.results
    assert all(r["after"] is None for r in res.results), res.results
