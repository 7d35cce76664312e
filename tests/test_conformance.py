"""Transport conformance: what every registered transport must do, whichever carries the bytes.

Each case runs real rank processes (tests/harness.py run_ranks, bodies in tests/bodies_conformance.py)
with SHMPROXY_TRANSPORTS set to one transport's name, so that the progress process may use that
transport alone (a transport between nodes: every rank on a simulated node of its own, with shm for
a rank's messages to itself); the cases are parametrised over ``shmproxy.transports.REGISTRY``. A new transport
(TCP, CUDA, RDMA, ...) joins the suite by being registered there: nothing in this file names one.
Run one transport's cases with ``-k <name>``, e.g.

    python -m pytest -q tests/test_conformance.py -k shm

What is checked: connection set-up between every pair; messages from 0 B to several chunks above
PARALLEL_THRESHOLD, on both sides of EAGER_BYTES, from comm.alloc memory and from plain numpy arrays,
byte-exact and with nothing written past them; truncation (error, nothing written, communicator goes
on) and short messages into larger buffers; MPI's non-overtaking rule with many messages pending on
one (source, tag) whichever side posts first, and across interleaved tags; empty messages; sends to
self; every pair moving large messages at once; dtype mismatch reported to both sides; and a peer
SIGKILLed before or during a transfer reported as PeerDiedError within seconds.

Every case runs with the fast path on and off (``fast_path``). Every case is small enough for a 2-core
machine and runs under the harness's hard deadline.
"""
from __future__ import annotations

import pytest

import shmproxy.transports
from tests.harness import run_ranks

BODY = "tests.bodies_conformance:"
# Transports of host memory: the cases pass numpy arrays. A device transport's suite is its own
# (tests/test_gpu*.py), since its buffers are device arrays.
TRANSPORTS = [t.name for t in shmproxy.transports.REGISTRY if shmproxy.transports.MemKind.HOST in t.kinds]

pytestmark = pytest.mark.parametrize("transport", TRANSPORTS)


@pytest.fixture(autouse=True, params=["fast", "nofast"])
def fast_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case with the fast path (small blocking calls the ranks complete themselves, shm/_fast.h)
    on and off: the ranks inherit the environment."""
    if request.param == "nofast":
        monkeypatch.setenv("SHMPROXY_FAST_BYTES", "0")


BETWEEN_NODES = {t.name for t in shmproxy.transports.REGISTRY if t.proxy_shared_init is not None}


def run(transport: str, body: str, nranks: int, timeout: float = 60, **kw):
    """run_ranks with the progress process restricted to ``transport``. A transport between nodes runs
    every rank on a simulated node of its own, beside shm (which carries only a rank's messages to
    itself then), so that every pair of distinct ranks is its business."""
    if transport in BETWEEN_NODES:
        return run_ranks(BODY + body, nranks, timeout=timeout, env={"SHMPROXY_TRANSPORTS": f"shm,{transport}"},
                         nodes=nranks, **kw)
    return run_ranks(BODY + body, nranks, timeout=timeout, env={"SHMPROXY_TRANSPORTS": transport}, **kw)


def test_connect_every_pair(transport):
    res = run(transport, "connect_every_pair", 3)
    assert [r["peers"] for r in res.results] == [2, 2, 2]


def test_eager_and_large_messages_byte_exact(transport):
    res = run(transport, "eager_and_large", 2, timeout=120)
    sizes = res.results[0]["sizes"]
    assert sizes[0] == 0 and sizes[-1] > 8 << 20, sizes
    assert res.results[0]["messages"] == res.results[1]["messages"] == 4 * len(sizes)


def test_truncation_writes_nothing_and_comm_goes_on(transport):
    res = run(transport, "truncation", 2, timeout=90)
    assert res.results[1]["cases"] == 6


@pytest.mark.parametrize("order", ["recvs_first", "sends_first", "interleaved"])
def test_tags_select_and_messages_do_not_overtake(transport, order):
    run(transport, "tags_and_order", 2, args=(order,))


def test_zero_byte_messages(transport):
    run(transport, "zero_bytes", 2)


@pytest.mark.parametrize("nranks", [1, 2])
def test_send_to_self(transport, nranks):
    res = run(transport, "self_send", nranks, timeout=90)
    assert all(r["messages"] == 16 for r in res.results)


def test_every_pair_moves_large_messages_at_once(transport):
    res = run(transport, "concurrent_large", 3, timeout=120)
    assert all(r["bytes"] > 8 << 20 for r in res.results)


@pytest.mark.parametrize("large", [False, True], ids=["eager", "large"])
def test_dtype_mismatch_is_reported_to_both_sides(transport, large):
    # An eager send across nodes is complete (buffered) before the receiver matches it: only the
    # receiver can be told.
    res = run(transport, "dtype_mismatch", 2, args=(large, large or transport not in BETWEEN_NODES))
    assert "send" in res.results[0] and "recv" in res.results[1], res.results


@pytest.mark.parametrize("when", ["before", "mid"])
@pytest.mark.parametrize("victim", [0, 1])
def test_peer_killed_during_transfer_raises_peer_died(transport, when, victim):
    """The victim SIGKILLs itself (harness: expect_fail); the survivor's Wait raises PeerDiedError
    within 5 s (asserted in the body). Victim 0 is the rank that started the progress process."""
    res = run(transport, "peer_dies", 2, timeout=90, args=(when, victim), expect_fail={victim})
    r = res.results[1 - victim]
    assert r["seconds"] < 5 and f"rank {victim}" in r["message"], r
    if when == "mid":
        assert r["arrived"] >= 1, r
