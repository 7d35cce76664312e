"""shmproxy.MPI end to end: mpi4py-style programs (tests/bodies_mpi.py) in real rank processes with
real progress processes, at 2 and 3 ranks."""
from __future__ import annotations

import pytest

from tests.harness import run_ranks

BODY = "tests.bodies_mpi:"


def test_send_recv_status_sendrecv_proc_null_and_objects():
    run_ranks(BODY + "p2p_status", 2, timeout=120)


def test_persistent_requests_waitany_waitsome():
    res = run_ranks(BODY + "persistent_and_waitany", 2, timeout=120)
    assert sorted(res.results[0]["seen"]) == list(range(6))


@pytest.mark.parametrize("nranks", [1, 3])
def test_persistent_collectives_start_many_rounds_and_refuse_a_second_start(nranks):
    run_ranks(BODY + "persistent_collectives", nranks, timeout=120)


@pytest.mark.parametrize("nranks", [1, 2])
def test_matched_probe_of_objects_a_rank_sent_itself(nranks):
    run_ranks(BODY + "mprobe_of_own_objects", nranks, timeout=120)


def test_collectives_under_mpi4py_signatures():
    run_ranks(BODY + "collectives", 3, timeout=180)


def test_cartesian_topologies_groups_create_and_comm_self():
    run_ranks(BODY + "topology_and_groups", 3, timeout=240)


def test_abort_ends_the_caller_with_its_code_and_fails_the_peers_promptly():
    res = run_ranks(BODY + "abort_reaches_peers", 2, timeout=120, expect_fail={1})
    assert res.returncodes[1] == 3
    assert res.results[0]["seconds"] < 20, res.results[0]


def test_cuda_array_interface_over_host_memory_is_read_as_host_memory():
    res = run_ranks(BODY + "cuda_array_interface_over_host_memory", 2, timeout=120)
    for r in res.results:
        assert r["allreduce"] == [3.0] * 4 and r["bcast"] == [7.0] * 4, r


def test_integer_arguments_through_index_and_type_errors_for_the_rest():
    run_ranks(BODY + "integer_arguments", 3, timeout=120)
