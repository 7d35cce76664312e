"""Point-to-point end to end: real rank processes, a real progress process, real shared memory.

Bodies live in tests/bodies_p2p.py; the same bodies run at 1, 2 and 4 ranks where they make sense.
The conftest fixture checks after every test that no segment, socket or process of ours is left.
"""
from __future__ import annotations

import os

import pytest

from tests.harness import run_ranks

BODY = "tests.bodies_p2p:"


@pytest.mark.parametrize("n", [1, 2, 4])
def test_ring_every_dtype_and_size(n):
    res = run_ranks(BODY + "ring_all_dtypes", n, timeout=240)
    assert all(r["checked"] == 14 * 5 * 2 for r in res.results)


@pytest.mark.parametrize("n", [1, 3])
def test_send_to_self(n):
    run_ranks(BODY + "self_send", n, timeout=60)


def test_tags_select_and_messages_do_not_overtake():
    run_ranks(BODY + "tags_and_order", 2, timeout=60)


def test_group_longer_than_the_record_pool():
    res = run_ranks(BODY + "group_many", 2, timeout=120)
    assert res.results[1]["k"] == 300


def test_group_nests_posts_on_exceptions_and_refuses_a_closed_comm():
    run_ranks(BODY + "group_semantics", 2, timeout=60)


def test_test_and_waitall():
    run_ranks(BODY + "test_and_waitall", 2, timeout=60)


def test_wait_and_test_finish_in_c_and_return_every_slot():
    res = run_ranks(BODY + "wait_and_test_in_c", 2, timeout=120)
    assert res.results[0]["status"] == "Status(source=1, tag=299, nbytes=24)"


@pytest.mark.parametrize("n", [1, 2])
def test_bad_input_raises_before_posting_and_comm_stays_usable(n):
    run_ranks(BODY + "bad_input", n, timeout=60)


def test_truncation_writes_nothing():
    run_ranks(BODY + "truncation", 2, timeout=60)


def test_dtype_mismatch_is_reported_to_both_sides():
    run_ranks(BODY + "dtype_mismatch", 2, timeout=60)


def test_timeout_names_what_is_pending_and_abort_reaches_peers():
    run_ranks(BODY + "timeout_names_pending", 2, timeout=60)


def test_an_exception_in_the_with_block_reaches_peers_with_its_origin():
    res = run_ranks(BODY + "with_block_error_names_root_cause", 2, timeout=60)
    assert "the root cause" in res.results[1]["error"]


@pytest.mark.slow
def test_message_larger_than_4_gib():
    """64-bit counts end to end: one 4.5 GiB message between registered buffers."""
    res = run_ranks(BODY + "big_message", 2, timeout=280, args=(9 << 29,))
    assert res.results[1]["seconds"] > 0


def test_progress_process_runs_the_ranks_code_not_a_proxy_package_in_their_directory(tmp_path):
    """`python -m shmproxy.engine.progress` started from the ranks' directory would import a `shmproxy` package
    found there first. The decoy records that it was imported and refuses to work."""
    decoy = tmp_path / "shmproxy"
    decoy.mkdir()
    marker = tmp_path / "decoy-imported"
    (decoy / "__init__.py").write_text(
        f"open({str(marker)!r}, 'a').write('imported\\n')\n"
        "raise ImportError('the decoy shmproxy package was imported')\n")
    res = run_ranks(BODY + "started_beside_another_proxy_package", 2, timeout=60, args=(str(tmp_path),))
    assert not marker.exists(), marker.read_text()
    assert res.results[0]["proxy_cwd"] == str(tmp_path)   # back in the ranks' directory once started


# ------------------------------------------------------------------------------------ faults
@pytest.mark.parametrize("victim", [0, 1])
def test_kill9_rank_every_survivor_raises_peer_died(victim):
    res = run_ranks(BODY + "victim_rank_dies", 3, timeout=90, args=(victim,), expect_fail={victim})
    survivors = [r for i, r in enumerate(res.results) if i != victim]
    for r in survivors:
        assert r["seconds"] < 30, r
        assert f"rank {victim}" in r["message"]


def test_kill9_progress_process_every_rank_raises():
    res = run_ranks(BODY + "proxy_dies", 3, timeout=90)
    assert all(r["seconds"] < 30 for r in res.results), res.results


def test_kill9_progress_process_and_local_rank0_leave_nothing_behind():
    """The leak fixture fails the test if the socket file or the pool outlives the job."""
    res = run_ranks(BODY + "proxy_and_local_rank0_die", 3, timeout=90, expect_fail={0})
    assert all("died" in r["message"] for r in res.results[1:]), res.results


def test_kill9_rank_holding_the_pool_mutex():
    res = run_ranks(BODY + "dies_holding_mutex", 3, timeout=90, args=(1,), expect_fail={1})
    for i in (0, 2):
        assert res.results[i]["seconds"] < 30
        assert "rank 1" in res.results[i]["message"], res.results[i]


def test_a_rank_joining_a_failed_communicator_is_told_who_died(tmp_path):
    """The progress process keeps its service up after a failure until every local rank can learn of
    it (FAIL_LINGER_S): a rank that joins after another died gets that death from init, at once."""
    fifo = tmp_path / "failed"
    os.mkfifo(fifo)
    res = run_ranks(BODY + "joins_after_a_death", 3, timeout=90, args=(str(fifo),), expect_fail={1})
    assert "rank 1" in res.results[0]["message"], res.results[0]
    late = res.results[2]
    assert "rank 1" in late["message"] and "joined" in late["message"], late
    assert late["seconds"] < 10, late


# ------------------------------------------------------------------------------------ observability
def test_dump_of_a_live_job_outside_and_by_signal():
    res = run_ranks(BODY + "dump_live", 2, timeout=120, env={"SHMPROXY_DUMP_SIGNAL": "SIGUSR1"})
    r0 = res.results[0]
    assert r0["outside_pid"] > 0 and r0["text_has_ranks"]
    assert any("recv rank 1 peer 0 tag 42" in u for u in r0["unmatched"]), r0["unmatched"]


def test_profile_writes_a_chrome_trace(tmp_path):
    import json
    path = tmp_path / "trace-%p.json"
    # the fast path off: its messages and collectives (up to 256 KiB on a crowded node) never reach
    # the progress process whose trace this is; and the collectives on the workers' path, which
    # streams (the loop's own, up to COLL_INLINE_BYTES, does not)
    run_ranks(BODY + "profile_trace", 2, timeout=60, args=(str(path),),
              env={"SHMPROXY_PROFILE": "1", "SHMPROXY_PROFILE_FILE": str(path),
                   "SHMPROXY_STREAMING_MIN_BYTES": "1M", "SHMPROXY_FAST_BYTES": "0",
                   "SHMPROXY_COLL_INLINE_BYTES": "64K"})
    files = list(tmp_path.glob("trace-*.json"))
    assert len(files) == 1
    events = json.loads(files[0].read_text())["traceEvents"]
    names = {e["name"] for e in events}
    assert {"msg 0->1", "msg 1->0", "sleep"} <= names, names
    # a collective's span says whether it was written with streaming stores (above the threshold)
    streamed = {e["name"]: e["args"]["streaming"] for e in events if e["name"].startswith("Allreduce")}
    assert streamed == {"Allreduce #1": 0, "Allreduce #2": 1}, streamed
    msgs = [e for e in events if e["name"].startswith("msg ")]
    assert len(msgs) == 40 and {e["args"]["via"] for e in msgs} == {"ranks"}, msgs[:3]


def test_profile_traces_the_fast_path_messages_the_progress_process_delivers(tmp_path):
    """A receive posted before its send (Irecv) waits in the progress process, so the sender's
    fast-path cell is drained and delivered there, as a buffered send: its span is in the trace too,
    marked so (it was missing: 1 span of 40 with 256 KiB cells)."""
    import json
    path = tmp_path / "trace-%p.json"
    run_ranks(BODY + "profile_trace", 2, timeout=60, args=(str(path),),
              env={"SHMPROXY_PROFILE": "1", "SHMPROXY_PROFILE_FILE": str(path),
                   "SHMPROXY_FAST_BYTES": "256K"})
    events = json.loads(next(tmp_path.glob("trace-*.json")).read_text())["traceEvents"]
    msgs = [e for e in events if e["name"].startswith("msg ")]
    assert sorted({e["name"] for e in msgs}) == ["msg 0->1", "msg 1->0"]
    assert len(msgs) == 40, [(e["name"], e["args"]) for e in msgs]
    assert "buffered" in {e["args"]["via"] for e in msgs}
    assert all(e["args"]["bytes"] == 1 << 18 for e in msgs)
