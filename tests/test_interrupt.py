"""Ctrl-C ends a job promptly, as an interrupt: every rank raises KeyboardInterrupt (not an abort raced
ahead of it by the progress process), and nothing is left behind (the autouse leak check)."""
from __future__ import annotations

from tests.harness import run_ranks


def test_ctrl_c_ends_every_rank_as_an_interrupt():
    res = run_ranks("tests.bodies_interrupt:ctrl_c_in_a_loop", 2, timeout=60, expect_fail={0, 1})
    assert res.duration < 20, res.duration
    for r, err in enumerate(res.stderr):
        assert "KeyboardInterrupt" in err, (r, err)
        assert "Aborted" not in err.split("KeyboardInterrupt")[0], (r, err)
