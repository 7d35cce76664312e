"""The dump: shmproxy.tools.dump (pool reader and text report) and shmproxy.tools.dump_cli (shmproxy-dump).

Pools are built in-process by hand (records packed with shmproxy.core.ops.pack and linked, sub slots packed),
so every shape the reader must recognise can be made exactly: a posted chain, shared and private free
lists, a leaked record, loops, out-of-range links, garbage. The end-to-end tests run the tool against
a child process that holds such a pool with its name already unlinked, like a real progress process.

This file tests the reader and the text report in-process; tests/test_dump_cli.py runs the tool.
"""
from __future__ import annotations

import glob
import json
import os
import random
import signal
import threading
import time

import pytest

from shmproxy.tools import dump, dump_cli as dump_tool
from shmproxy.core.ops import DTYPE_CODE, KIND_RECV, KIND_SEND, pack
from shmproxy.shm import pool as P
from shmproxy.shm.segment import Segment

from tests.dump_helpers import SUB_LINE, TAG


LAYOUT = P.Layout(2, 16, 64)
F32 = DTYPE_CODE["f"]


def leftovers() -> list[str]:
    return glob.glob(f"/dev/shm/shmproxy-{TAG}*")


@pytest.fixture
def pool():
    seg = Segment.create(TAG, LAYOUT.total_bytes)
    view = None
    try:
        view = P.PoolView.initialize(seg.mm, seg.addr, LAYOUT)
        yield view
    finally:
        if view is not None:
            view.release()
        seg.close()
    assert leftovers() == []


def rec(view: P.PoolView, idx: int, kind: int = KIND_SEND, peer: int = 1, tag: int = 7, nbytes: int = 4096,
        opcount: int = 2) -> None:
    owner = idx // view.layout.max_ops
    pack(view.buf, view.layout, idx, kind, F32, owner, peer, tag, opcount, 100 + idx, idx, 1, 0, nbytes,
         nbytes // 4, time.monotonic_ns())


def link(view: P.PoolView, idxs: list[int], tail_next: int = -1) -> None:
    for a, b in zip(idxs, idxs[1:] + [tail_next]):
        view.i32[view.layout.record_off(a) // 4] = b


def post(view: P.PoolView, idxs: list[int]) -> None:
    """Records become the posted chain (filled, linked, head/tail set), as a poster would leave it."""
    for i in idxs:
        rec(view, i)
    link(view, idxs)
    view.i32[P.NEXT_OPS_OFF // 4] = idxs[0]
    view.i32[P.NEXT_OPS_END_OFF // 4] = idxs[-1]


def set_free_head(view: P.PoolView, rank: int, head: int) -> None:
    view.i32[P.FREE_OPS_OFF // 4 + rank] = head


def typical(view: P.PoolView) -> None:
    """Rank 0 took its whole free list (records 0-15 private) and posted 0, 1, 2; rank 1 posted 16 and
    its shared free list is 17-31 minus record 20, which is in no list at all (leaked)."""
    set_free_head(view, 0, -1)
    set_free_head(view, 1, 17)
    link(view, [19], tail_next=21)    # unlink 20 from rank 1's list
    link(view, [20])                  # ... and from everything
    post(view, [0, 1, 2, 16])


# ------------------------------------------------------------------------------------ read_pool
def test_fresh_pool_has_everything_in_shared_free_lists(pool):
    state = dump.read_pool(pool)
    assert state["problems"] == []
    assert state["posted_chain"]["length"] == 0
    assert [r["free_list"]["length"] for r in state["ranks"]] == [16, 16]
    assert [r["not_in_shared_list"]["count"] for r in state["ranks"]] == [0, 0]
    assert state["subs"]["count"] == 0
    assert state["error"] is None
    assert state["control"]["heartbeat_age_ms"] is None
    assert state["header"]["nlocal"] == 2 and state["header"]["max_ops"] == 16
    json.dumps(state)  # JSON-ready as is


def test_posted_chain_free_lists_and_records_in_no_list(pool):
    typical(pool)
    state = dump.read_pool(pool)
    assert state["problems"] == []
    chain = state["posted_chain"]
    assert (chain["head"], chain["tail"], chain["length"], chain["problem"]) == (0, 16, 4, None)
    assert [r["index"] for r in chain["records"]] == [0, 1, 2, 16]
    assert chain["per_rank"] == [3, 1]
    r0 = chain["records"][0]
    assert (r0["kind"], r0["owner"], r0["peer"], r0["tag"], r0["nbytes"], r0["opcount"], r0["dtype"]) == \
        ("send", 0, 1, 7, 4096, 2, "float32")
    assert "corrupt" not in r0
    rank0, rank1 = state["ranks"]
    assert rank0["free_list"]["length"] == 0
    assert rank1["free_list"] == {"head": 17, "length": 14, "problem": None}
    # Rank 0's private free list: 3-15 still linked, one chain; rank 1's leaked record 20: a singleton.
    nl0, nl1 = rank0["not_in_shared_list"], rank1["not_in_shared_list"]
    assert (nl0["count"], nl0["indices"]) == (13, "3-15")
    assert nl0["chains"] == [{"head": 3, "length": 13}]
    assert (nl1["count"], nl1["indices"]) == (1, "20")
    assert nl1["chains"] == [{"head": 20, "length": 1}]
    assert "held privately by the rank, or leaked" in nl1["note"]
    assert (rank0["in_posted_chain"], rank1["in_posted_chain"]) == (3, 1)


def test_error_rank_pid_and_message(pool):
    from shmproxy.core.errors import PeerDiedError
    msg = b"rank 1 (local rank 1, pid 4321) died\0"
    pool.buf[P.ERR_MSG_OFF:P.ERR_MSG_OFF + len(msg)] = msg
    pool.set_ctrl(P.CTRL_ERR_CODE, PeerDiedError.code)
    pool.set_ctrl(P.CTRL_ERR_RANK, 1)
    pool.set_ctrl(P.CTRL_ERR_PID, 4321)
    assert dump.read_pool(pool)["error"] is None  # not published until ERR_SEQ
    pool.set_ctrl(P.CTRL_ERR_SEQ, 1)
    err = dump.read_pool(pool)["error"]
    assert err == {"code": 6, "class": "PeerDiedError", "rank": 1, "pid": 4321,
                   "message": "rank 1 (local rank 1, pid 4321) died"}
    pool.set_ctrl(P.CTRL_ERR_RANK, P.NO_RANK)
    pool.set_ctrl(P.CTRL_ERR_CODE, 250)
    err = dump.read_pool(pool)["error"]
    assert err["rank"] is None and "unknown error code 250" in err["class"]
    assert "== first error ==\nunknown error code 250" in dump.format_text(dump.read_pool(pool))


def test_control_counters_and_rank_areas(pool):
    pool.set_ctrl(P.CTRL_PROXY_PID, 999)
    pool.set_ctrl(P.CTRL_STATE, P.PROXY_RUNNING)
    pool.set_ctrl(P.CTRL_HEARTBEAT, time.monotonic_ns() - 50_000_000)
    pool.set_ctrl(P.CTRL_N_OPS, 17)
    pool.set_ctrl(P.CTRL_SLEEPING, 1)
    lay = pool.layout
    pool.q[lay.rank_q(1, P.RANK_PID)] = 555
    pool.q[lay.rank_q(1, P.RANK_WAITING)] = 2 | (7 << 32)   # asleep on CPU 1, on futex word 7
    pool.q[lay.rank_q(1, P.RANK_POSTED)] = 9
    pool.q[lay.rank_q(1, P.RANK_COMPLETED)] = 8
    pool.q[lay.rank_q(1, P.RANK_CONN_STATE)] = 4
    pool.q[lay.rank_q(0, P.RANK_CONN_STATE)] = 77
    state = dump.read_pool(pool)
    ctl = state["control"]
    assert (ctl["proxy_pid"], ctl["state_name"], ctl["sleeping"]) == (999, "RUNNING", 1)
    assert ctl["stats"]["ops"] == 17
    assert 50 <= ctl["heartbeat_age_ms"] < 50_000
    r1 = state["ranks"][1]
    assert (r1["pid"], r1["waiting"], r1["posted"], r1["completed"]) == (555, 1, 9, 8)
    assert r1["waiting_cpu"] == 1 and state["ranks"][0]["waiting_cpu"] is None
    assert r1["conn_state_name"] == "CONNECTED"
    assert state["ranks"][0]["conn_state_name"] == "77"  # unknown value: the number, no exception
    pool.set_ctrl(P.CTRL_STATE, 42)
    assert dump.read_pool(pool)["control"]["state_name"] == "unknown(42)"


def test_active_sub_with_letter_and_text_line(pool):
    P.SUB.pack_into(pool.buf, pool.layout.sub_off(3), P.SUB_PROGRESS, KIND_SEND, 0, 1, 5, 1 << 20, 8,
                    4, 3, 3, 3, 12, 7)
    P.SUB.pack_into(pool.buf, pool.layout.sub_off(9), P.SUB_READY, KIND_SEND, 1, 0, 6, 100, 1,
                    0, 0, 0, 0, 13, -2)
    subs = dump.read_pool(pool)["subs"]
    assert subs["count"] == 2
    s3, s9 = subs["active"]
    assert (s3["slot"], s3["letter"], s3["src"], s3["dst"], s3["opcount"], s3["nbytes"], s3["nsteps"]) == \
        (3, "P", 0, 1, 5, 1 << 20, 8)
    assert (s3["posted"], s3["transmitted"], s3["received"], s3["done"], s3["args"], s3["tag"]) == \
        (4, 3, 3, 3, 12, 7)
    assert (s9["letter"], s9["tag"]) == ("R", -2)
    text = dump.format_text(dump.read_pool(pool))
    assert SUB_LINE in text
    assert "== active subs: 2 of 64 slots ==" in text


def test_loop_in_posted_chain_is_flagged_without_hanging(pool):
    set_free_head(pool, 0, -1)
    post(pool, [0, 1, 2])
    link(pool, [2], tail_next=1)  # 0 -> 1 -> 2 -> 1 -> ...
    t0 = time.monotonic()
    state = dump.read_pool(pool)
    assert time.monotonic() - t0 < 5
    chain = state["posted_chain"]
    assert chain["length"] == 3
    assert "loop: record 2 links back to record 1" in chain["problem"]
    assert any("posted chain: loop" in p for p in state["problems"])
    assert "!! loop: record 2 links back to record 1" in dump.format_text(state)


def test_loop_in_free_list_and_cycle_among_unlisted(pool):
    # Rank 1's shared list 16 -> 17 -> 18 -> 16; records 19-31 are then in no list.
    link(pool, [18], tail_next=16)
    # Rank 0's list is taken; its records 0-15 form a private chain whose tail loops to 5.
    set_free_head(pool, 0, -1)
    link(pool, [15], tail_next=5)
    state = dump.read_pool(pool)
    fl = state["ranks"][1]["free_list"]
    assert fl["length"] == 3 and "loop: record 18 links back to record 16" in fl["problem"]
    assert state["ranks"][1]["not_in_shared_list"]["count"] == 13
    nl0 = state["ranks"][0]["not_in_shared_list"]
    assert nl0["count"] == 16 and nl0["chains"][0] == {"head": 0, "length": 16}
    assert any("free list of local rank 1: loop" in p for p in state["problems"])


def test_out_of_range_indices_are_flagged(pool):
    pool.i32[P.NEXT_OPS_OFF // 4] = 999
    pool.i32[P.NEXT_OPS_END_OFF // 4] = -7
    link(pool, [20], tail_next=12345)  # rank 1's free list breaks after record 20
    set_free_head(pool, 0, -2)
    state = dump.read_pool(pool)
    chain = state["posted_chain"]
    assert chain["length"] == 0 and "head is record 999, out of range [0, 32)" in chain["problem"]
    assert "tail -7 out of range" in chain["tail_problem"]
    fl1 = state["ranks"][1]["free_list"]
    assert fl1["length"] == 5 and "record 20 links to 12345, out of range" in fl1["problem"]
    assert "head is record -2" in state["ranks"][0]["free_list"]["problem"]
    assert len(state["problems"]) >= 4
    text = dump.format_text(state)
    assert "!! head is record 999, out of range [0, 32)" in text
    assert "== problems: " in text


def test_record_in_wrong_lists_and_bad_fields(pool):
    set_free_head(pool, 0, -1)
    post(pool, [0, 1])
    rec(pool, 1)
    off = pool.layout.record_off(1)
    pool.buf[off + 8:off + 12] = (1).to_bytes(4, "little")  # owner
    pool.buf[off + 4] = 99  # kind
    # Rank 1's free list: 16 -> 0 (a record of rank 0, also posted) -> end.
    link(pool, [16], tail_next=0)
    link(pool, [0, 1])
    state = dump.read_pool(pool)
    r1 = state["posted_chain"]["records"][1]
    assert "owner 1 but record is in the region of local rank 0" in r1["corrupt"]
    assert "unknown kind 99" in r1["corrupt"] and r1["kind"] == "unknown(99)"
    fl = state["ranks"][1]["free_list"]
    assert 0 in fl["foreign"] and 0 in fl["also_posted"]
    text = dump.format_text(state)
    assert "!! records of other ranks" in text and "!! also in the posted chain" in text


def test_bad_sub_state_and_counters(pool):
    P.SUB.pack_into(pool.buf, pool.layout.sub_off(63), 9, KIND_RECV, 0, 1, 1, 10, 2, 1, 5, 0, 0, 1, 0)
    state = dump.read_pool(pool)
    s = state["subs"]["active"][0]
    assert s["slot"] == 63 and s["letter"] == "?" and s["kind"] == "recv"
    assert "unknown state 9" in s["corrupt"] and "counters out of order" in s["corrupt"]
    assert any(p.startswith("sub slot 63") for p in state["problems"])


def test_garbage_never_raises(pool):
    rng = random.Random(1234)
    start, end = P.NEXT_OPS_OFF, pool.layout.total_bytes
    for trial in range(20):
        n = rng.choice([64, 4096, end - start])
        off = rng.randrange(start, end - n + 1)
        pool.buf[off:off + n] = rng.randbytes(n)
        if trial % 5 == 4:  # the header too, behind the view's back
            pool.buf[0:64] = rng.randbytes(64)
        state = dump.read_pool(pool)
        json.dumps(state)
        text = dump.format_text(state)
        assert "== problems: " in text
        assert state["layout"]["nrecords"] == 32


def test_info_blob(pool):
    pool.write_info({"pid": 4242, "socket": "/tmp/x/job-c0.sock", "cpus": [2, 3],
                     "affinity_reason": "spare cores of the node",
                     "ranks": {0: {"rank": 0, "pid": 10, "host": "h"}},
                     "params": {"SHMPROXY_DUMP_SIGNAL": {"value": 10, "origin": "environment"},
                                "SHMPROXY_STEPS": {"value": 8, "origin": "default"}}})
    state = dump.read_pool(pool)
    assert state["info"]["cpus"] == [2, 3]
    assert state["info"]["params"]["SHMPROXY_DUMP_SIGNAL"]["value"] == 10
    assert dump_tool.dump_signal_of(state) == signal.SIGUSR1
    text = dump.format_text(state)
    assert "affinity: [2, 3] (spare cores of the node)" in text
    assert "SHMPROXY_DUMP_SIGNAL=10 [environment]" in text
    assert "local rank 0: rank 0 pid 10 host h" in text
    # A broken blob is reported, not raised.
    off = pool.layout.info_off
    pool.buf[off + 8:off + 12] = b"{{{{"
    assert "not valid JSON" in dump.read_pool(pool)["info"]["error"]


def test_mutex_holder_is_decoded(pool):
    assert dump.read_pool(pool)["mutex"]["state"] == "unlocked"
    pool.mutex.lock(5.0)
    try:
        m = dump.read_pool(pool)["mutex"]
    finally:
        pool.mutex.unlock()
    assert m["locked"] and m["holder_tid"] == threading.get_native_id() and m["holder_pid"] == os.getpid()
    assert f"held by thread {m['holder_tid']} of pid {os.getpid()}" in m["state"]


def test_read_only_mapping_reads_the_same(pool):
    typical(pool)
    seg = Segment.open_fd_readonly(f"/proc/self/fd/{_fd_of(pool)}")
    try:
        view = P.PoolView(seg.mm)
        try:
            ro = dump.read_pool(view)
        finally:
            view.release()
    finally:
        seg.close()
    rw = dump.read_pool(pool)
    for key in ("posted_chain", "subs", "error"):
        assert _strip_ages(ro[key]) == _strip_ages(rw[key])
    assert [r["not_in_shared_list"] for r in ro["ranks"]] == [r["not_in_shared_list"] for r in rw["ranks"]]


def _fd_of(view: P.PoolView) -> int:
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/dev/shm/shmproxy-{TAG}"):
                return int(fd)
        except OSError:
            pass
    raise AssertionError("pool fd not found")


def _strip_ages(x):
    if isinstance(x, dict):
        return {k: _strip_ages(v) for k, v in x.items() if k != "posted_age_ms"}
    if isinstance(x, list):
        return [_strip_ages(v) for v in x]
    return x


def test_format_text_sections_and_json_round_trip(pool):
    typical(pool)
    P.SUB.pack_into(pool.buf, pool.layout.sub_off(3), P.SUB_PROGRESS, KIND_SEND, 0, 1, 5, 1 << 20, 8,
                    4, 3, 3, 3, 12, 7)
    state = dump.read_pool(pool)
    text = dump.format_text(state)
    for needle in ("== progress process ==", "== first error ==\nnone", "== local ranks ==",
                   "== posted chain: 4 records (head 0, tail 16) ==",
                   "#0 send owner 0 peer 1 tag 7 4096 B (1024 x float32) opCount 2",
                   "== shared free lists ==", "local rank 1: 14 records (head 17)",
                   "== records not in a shared list (held privately by the rank, or leaked) ==",
                   "local rank 0: 13 records (3-15); 1 chain(s): 13 from #3",
                   "local rank 1: 1 records (20); 1 chain(s): 1 from #20",
                   SUB_LINE, "== problems: 0 =="):
        assert needle in text, needle
    assert "in process" not in text
    assert dump.format_text(json.loads(json.dumps(state))) == text


def test_format_text_renders_in_process(pool):
    state = dump.read_pool(pool)
    state["in_process"] = {
        "passes": 77, "stopping": False, "failed": False,
        "active_args": [{"id": 12, "conn": [0, 1], "opcount": 5, "state": "P", "transport": "shm",
                         "subs": [{"slot": 3, "nbytes": 1 << 20, "nsteps": 8, "posted": 4, "transmitted": 3,
                                   "received": 3, "done": 3}]}],
        "unmatched_sends": ["send rank 0 peer 1 tag 9 64 B opCount 3"],
        "unmatched_recvs": [],
        "connections": {"0->1": {"transport": "shm", "kind": "host", "state": "connected", "messages": 3}},
        "service": [{"rank": 0, "pid": 11, "state": "CONNECTED"}],
        "registered_buffers": {"0:1": 4096},
        "copy_threads": 2, "profile_events": 0, "extra_key": "shown too",
    }
    text = dump.format_text(json.loads(json.dumps(state)))
    for needle in ("== in process (the progress loop's own view) ==", "passes 77",
                   "args 12 [P] 0->1 opCount 5 via shm, 1 subs",
                   "sub 3 1048576 B steps 3/8 posted 4 transmitted 3 received 3 done 3",
                   "unmatched sends: 1", "  send rank 0 peer 1 tag 9 64 B opCount 3", "unmatched receives: 0",
                   "connections: 0->1 shm (host, connected, 3 msgs)", "service connections: rank 0 pid 11 CONNECTED",
                   "registered buffers: 1 (0:1: 4096 B)", "extra_key: shown too"):
        assert needle in text, needle


def test_format_text_of_a_damaged_dict_never_raises():
    for bad in ({}, {"ranks": [{"local_rank": 0}], "error": "boom"}, {"posted_chain": [1, 2]},
                {"subs": {"active": [{"slot": 1}], "count": "x"}}, {"in_process": {"active_args": [None]}}):
        text = dump.format_text(bad)  # type: ignore[arg-type]
        assert text.endswith("\n")
