"""The outside dump (shmproxy-dump --pid P --outside, nothing prepared) says who waits for what from
whom, and names near-matches and collectives some ranks have not joined as problems."""
from __future__ import annotations

from tests.harness import run_ranks

BODY = "tests.bodies_dump_pending:"


def test_a_near_match_is_a_problem_naming_both_sides():
    text = run_ranks(BODY + "near_match", 2, timeout=90).results[0]["dump"]
    assert "rank 1 waits for 4 B from rank 0, tag 41" in text, text
    assert "rank 0's 1048576 B message to rank 1, tag 42, is not received" in text, text
    assert "near-match: rank 1 waits for tag 41 from rank 0, but rank 0's 1048576 B message to it has tag 42" in text
    assert "== problems: 1 ==" in text, text


def test_a_collective_not_joined_is_a_problem_naming_who_is_missing():
    text = run_ranks(BODY + "unjoined_collective", 2, timeout=90).results[0]["dump"]
    assert "collective #1 Barrier" in text and "ranks [0] entered it" in text and "ranks [1] have not" in text, text
