"""The fast path (shm/_fast.h): small blocking Send/Recv through the pair's cells and small blocking
collectives between the ranks, mixed with everything the progress process carries. Each property is
checked with the fast path on (SHMPROXY_FAST_BYTES at its default) and, where it applies, off; the
conformance suite (tests/test_conformance.py) and the random collectives (tests/test_coll.py) run
both ways too. Rank bodies: tests/bodies_fastpath.py."""
from __future__ import annotations

import os
import tempfile

import pytest

from tests.harness import run_ranks

BODY = "tests.bodies_fastpath:"
OFF = {"SHMPROXY_FAST_BYTES": "0"}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("fast", ["on", "off"])
def test_small_and_large_messages_keep_mpi_order(seed, fast):
    res = run_ranks(BODY + "order_mixed", 2, timeout=120, args=(seed, 60),
                    env=OFF if fast == "off" else None)
    assert res.results[1]["received"] == 60


def test_any_source_from_two_senders_keeps_each_senders_order():
    run_ranks(BODY + "two_senders_any_source", 3, timeout=90, args=(200,))


def test_probes_see_cells_and_errors_name_the_message():
    res = run_ranks(BODY + "probes_and_errors", 2, timeout=90)
    r = res.results[1]
    assert r["truncation"] and "128" in r["truncation"], r
    assert r["mismatch"] is not None, r


@pytest.mark.parametrize("n,seed", [(2, 5), (3, 6), (4, 7)])
def test_random_small_and_large_collectives(n, seed):
    res = run_ranks(BODY + "small_collectives", n, timeout=180, args=(seed, 60))
    assert all(r["small"] > 0 for r in res.results), res.results   # some did run between the ranks


def test_results_are_the_same_with_the_fast_path_off():
    on = run_ranks(BODY + "off_matches_on", 3, timeout=90, args=(11,))
    off = run_ranks(BODY + "off_matches_on", 3, timeout=90, args=(11,), env=OFF)
    assert all(r["fast"] >= 512 for r in on.results) and [r["fast"] for r in off.results] == [0] * 3
    assert [r["digest"] for r in on.results] == [r["digest"] for r in off.results]


def test_blocking_collective_against_nonblocking_is_a_mismatch_on_every_rank():
    res = run_ranks(BODY + "blocking_against_nonblocking", 3, timeout=90, env={"SHMPROXY_TIMEOUT": "60"})
    for rank, r in enumerate(res.results):
        assert r["error"] == "InvalidUsage" and "llreduce" in r["message"], (rank, r)
        assert r["seconds"] < 10, (rank, r)


def test_small_collective_timeout_fails_the_communicator_once():
    res = run_ranks(BODY + "small_collective_timeout", 2, timeout=90, env={"SHMPROXY_TIMEOUT": "2"})
    r0, r1 = res.results
    assert r0["error"] and "Barrier" in r0["error"] and 1.5 < r0["seconds"] < 10, r0
    assert r1["later"] is not None and r1["seconds"] < 10, r1


@pytest.mark.parametrize("where", ["recv", "allreduce"])
def test_peer_killed_while_a_rank_waits_on_the_fast_path(where):
    res = run_ranks(BODY + "killed_while_waiting", 2, timeout=90, args=(where,), expect_fail={0},
                    env={"SHMPROXY_TIMEOUT": "60"})
    r = res.results[1]
    assert r["error"] == "PeerDiedError" and r["seconds"] < 5, r


def test_outside_dump_names_a_small_collective_not_joined():
    marker = os.path.join(tempfile.mkdtemp(prefix="sptest-fast-"), "read")
    res = run_ranks(BODY + "dump_small_collective", 2, timeout=120, args=(marker,))
    text = res.results[0]["dump"]
    assert "small collective #1 (Barrier" in text and "ranks [0] entered it, ranks [1] have not" in text, text
    os.unlink(marker)
    os.rmdir(os.path.dirname(marker))


def test_a_cell_behind_a_slow_send_reaches_a_receive_waiting_in_the_progress_process():
    res = run_ranks(BODY + "cell_behind_slow_send", 3, timeout=120, args=(300,),
                    env={"SHMPROXY_TIMEOUT": "20"})
    assert res.results[0]["rounds"] == 300
