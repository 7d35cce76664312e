"""Point-to-point as MPI defines it (real ranks, real progress process): standard-mode sends that the
progress process buffers below SEND_BUFFER_BYTES (bounded per destination, in matching order),
synchronous sends, Probe/Iprobe/Mprobe/Improbe, Cancel, the object layer's wildcards and nonblocking
calls, and close with sends nobody received. Rank bodies: tests/bodies_p2p_semantics.py."""
from __future__ import annotations

import pytest

from tests.harness import run_ranks

BODY = "tests.bodies_p2p_semantics:"


def test_send_then_recv_on_both_ranks_completes():
    run_ranks(BODY + "send_then_recv_exchange", 2, timeout=90, env={"SHMPROXY_TIMEOUT": "20"})


def test_buffered_bytes_are_bounded_per_destination():
    res = run_ranks(BODY + "buffered_bytes_are_bounded", 2, timeout=90, args=(8, 16384, 65536),
                    env={"SHMPROXY_SEND_BUFFER_BYTES": "16K", "SHMPROXY_SEND_BUFFER_PER_PEER": "64K"})
    assert res.results[0]["done_early"] == 4


@pytest.mark.parametrize("grace", [True, False])
def test_a_receive_posted_within_the_grace_takes_the_send_unbuffered(grace):
    res = run_ranks(BODY + "buffering_waits_out_its_grace", 2, timeout=90, args=(grace,),
                    env={"SHMPROXY_SEND_BUFFER_GRACE_US_PER_KIB": "100000" if grace else "0"})
    assert res.results[0]["buffered"] == (0 if grace else 1)


def test_buffered_and_unbuffered_messages_do_not_overtake():
    run_ranks(BODY + "buffered_and_unbuffered_do_not_overtake", 2, timeout=90)


def test_ssend_does_not_complete_before_its_receive():
    run_ranks(BODY + "ssend_waits_for_its_receive", 2, timeout=90)


def test_probe_iprobe_mprobe_improbe():
    run_ranks(BODY + "probes", 2, timeout=90)


def test_cancel():
    run_ranks(BODY + "cancel", 2, timeout=90)


@pytest.mark.parametrize("nranks", [2, 3])
def test_object_layer_wildcards_and_nonblocking(nranks):
    run_ranks(BODY + "object_wildcards_and_nonblocking", nranks, timeout=120)


def test_close_abandons_a_large_unmatched_send_promptly_and_says_so(tmp_path):
    res = run_ranks(BODY + "close_with_unmatched_sends", 2, timeout=90, args=(str(tmp_path / "closed"),),
                    env={"SHMPROXY_TIMEOUT": "20"})
    assert res.results[1]["close_s"] < 5, res.results[1]
    assert ("rank 1 closed with 1 request(s) still pending, abandoned: send of 2097152 B to rank 0 tag 42"
            in res.stderr[1]), res.stderr[1]
    assert "pending" not in res.stderr[0]


def test_mpi_namespace_point_to_point():
    run_ranks(BODY + "mpi_point_to_point", 2, timeout=120)


@pytest.mark.parametrize("body", ["send_then_recv_exchange", "probes"])
def test_across_simulated_nodes(body):
    """The same calls between two simulated nodes (the receive half and its probes on the receiver's
    node; small sends complete through the socket transport's own eager path)."""
    run_ranks(BODY + body, 2, timeout=120, nodes=2)
