"""Point-to-point semantics of the matching engine: receive wildcards in MPI's order, sends waiting for
a receiver that closes, and a send posted before its receiver joined (real ranks, real progress
process). The matching rules alone are tested in tests/test_matching.py."""
from __future__ import annotations

import pytest

from tests.harness import run_ranks

BODY = "tests.bodies_semantics:"


def test_wildcard_receives_match_in_mpi_order_and_report_the_real_envelope():
    res = run_ranks(BODY + "wildcards_in_mpi_order", 3, timeout=90)
    assert len(res.results[0]["got"]) == 6


@pytest.mark.parametrize("nranks", [1, 2])
def test_wildcards_are_refused_on_sends_before_anything_is_posted(nranks):
    run_ranks(BODY + "wildcard_arguments_are_for_receives", nranks, timeout=60)


def test_sends_waiting_for_a_receiver_that_closes_fail_at_once():
    res = run_ranks(BODY + "sends_fail_when_their_receiver_closes", 3, timeout=90,
                    env={"SHMPROXY_TIMEOUT": "30"})
    assert all(max(r["took"]) < 5 for r in res.results[:2])


def test_a_send_posted_before_its_receiver_joined_is_delivered(tmp_path):
    run_ranks(BODY + "send_before_the_receiver_joins", 2, timeout=90, args=(str(tmp_path / "posted"),))


@pytest.mark.parametrize("nranks", [1, 2])
def test_memory_kinds_are_checked_at_the_rank_and_at_registration(nranks):
    run_ranks(BODY + "memory_kinds_are_checked_end_to_end", nranks, timeout=60)


def test_a_timeout_in_a_with_block_ends_the_rank_in_one_bound():
    res = run_ranks(BODY + "timeout_in_a_with_block_ends_in_one_bound", 2, timeout=90, env={"SHMPROXY_TIMEOUT": "4"})
    r0, r1 = res.results
    assert r1["timed_out"] and 3.5 < r1["elapsed"] < 6.5, r1   # twice the bound was 8 s and more
    assert not r0["timed_out"] and r0["elapsed"] < r1["elapsed"] + 3, r0   # told when rank 1 closed
    assert res.stderr[1].count("Timeout") == 0   # raised once, caught by the body: nothing printed again


def test_a_rank_exiting_with_an_unmatched_receive_is_prompt_and_names_it():
    res = run_ranks(BODY + "exit_with_an_unmatched_receive_is_prompt_and_says_so", 2, timeout=90,
                    env={"SHMPROXY_TIMEOUT": "20"})
    assert res.results[1]["close_s"] < 5, res.results[1]
    assert "rank 1 closed with 1 request(s) still pending, abandoned: recv of 16 B from rank 0 tag 41" in res.stderr[1]
    assert "pending" not in res.stderr[0]


def test_a_rank_exiting_after_its_sender_closed_names_the_receive_and_does_not_raise():
    res = run_ranks(BODY + "exit_after_the_sender_closed_names_the_receive", 2, timeout=90,
                    env={"SHMPROXY_TIMEOUT": "20"})
    assert res.results[1]["close_s"] < 5, res.results[1]
    assert "rank 1 closed with 1 request(s) still pending, abandoned: recv of 16 B from rank 0 tag 41" in res.stderr[1]


def test_a_bad_reduction_op_is_refused_naming_what_was_passed():
    run_ranks(BODY + "a_bad_op_names_what_was_passed", 2, timeout=60)


def test_a_second_init_of_the_same_job_is_refused_on_every_rank():
    res = run_ranks(BODY + "second_init_is_refused", 2, timeout=90)
    for r in res.results:
        assert "joined communicator 0 of this job already" in r["second"] and r["sum"] == 2.0, r
