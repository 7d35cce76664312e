"""Generalized requests of shmproxy.MPI in real rank processes (bodies in tests/bodies_mpi_grequest.py):
completion from another thread, Grequests mixed with native requests in the Wait/Test families,
the callbacks and their errors, and waits that end on a timeout or a peer's abort, never hang."""
from __future__ import annotations

from tests.harness import run_ranks

BODY = "tests.bodies_mpi_grequest:"


def test_grequests_complete_from_threads_and_mix_with_native_requests():
    run_ranks(BODY + "mixed_waits", 2, timeout=120)


def test_a_grequest_never_completed_times_out():
    res = run_ranks(BODY + "never_completed_times_out", 2, timeout=120, env={"SHMPROXY_TIMEOUT": "4"})
    for r in res.results:
        assert 3 < r["seconds"] < 30, r


def test_a_peers_abort_ends_a_grequest_wait():
    res = run_ranks(BODY + "abort_ends_a_grequest_wait", 2, timeout=120, expect_fail={1})
    assert res.returncodes[1] == 3
    assert res.results[0]["seconds"] < 20, res.results[0]
