"""shm._poster, the C poster of the rank side: the hand-off of posted chains (with and without the
mutex, to a sleeping or awake progress process) and the records its fast paths write, which must be
the ones proxy/rank/comm.py writes, or a decline where Python must handle the call."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from shmproxy.core import ops
from shmproxy.coll import sched as sched_mod
from shmproxy.shm import _native, _poster, pool as P
from shmproxy.shm.segment import MemfdBuffer
from tests.unit_helpers import _taker


def _make_poster(seg, view, size=2, on_splice_error=None):
    """A Poster for local rank 0 of the unit pool, as proxy/rank/comm.py builds one (comm: a stand-in
    object the requests point back to)."""
    from shmproxy.rank import comm as comm_mod
    from shmproxy.rank.request import Request
    lay = view.layout
    q0 = seg.addr + P.CTRL_OFF
    slots, records, pending = list(range(lay.max_ops - 1, -1, -1)), list(range(lay.max_ops - 1, -1, -1)), {}
    pp = _poster.Poster(
        "the comm", Request, np.ndarray, seg.addr + lay.records_off, seg.addr + P.MUTEX_OFF,
        seg.addr + P.COND_OFF, seg.addr + P.NEXT_OPS_OFF, seg.addr + P.NEXT_OPS_END_OFF,
        seg.addr + P.PENDING_MASK_OFF, seg.addr + lay.rank_area_off, q0 + 8 * P.CTRL_SLEEPING,
        q0 + 8 * P.CTRL_ERR_SEQ, q0 + 8 * P.CTRL_ABORT, seg.addr + 8 * lay.rank_q(0, P.RANK_POSTED), 0, size,
        1.0, slots, records, pending, comm_mod._DTYPES, comm_mod._probes(), on_splice_error or (lambda rc: None))
    return pp, slots, records, pending


def _handed_off(view, r=0):
    """The records local rank ``r`` handed off and nobody spliced yet (shm/_pool_lock.h, "Hand-off")."""
    p = view.q[view.layout.rank_q(r, P.RANK_PENDING)]
    if not p:
        return []
    chain, bad = view.walk((p >> 32) - 1, view.layout.nrecords)
    assert not bad and chain[-1] == (p & 0xFFFFFFFF) - 1 and view.q[P.PENDING_MASK_OFF // 8] >> r & 1
    return chain


def test_poster_hands_off_alone_and_chains_in_a_group(pool):
    """With the progress process awake, a post leaves its chain in the rank's pending slot without the
    mutex; a later post goes behind it (order kept); the progress process's take splices them."""
    seg, view = pool
    lay = view.layout
    pp, *_ = _make_poster(seg, view)
    take, _out, idx = _taker(seg, lay)
    assert pp.write(0, 0, ops.KIND_SEND, 3, 0, 0, 1, 7, 1, 0, 8, 8, -1, 0, 0, 0, 0) == 1
    pp.enqueue(0)
    pp.group_depth = 1
    for i in (1, 2):
        pp.write(i, i, ops.KIND_SEND, 3, 0, 0, 1, 7, 1, 0, 8, 8, -1, 0, 0, 0, 0)
        pp.enqueue(i)
    assert _handed_off(view) == [0] and pp.chain_first == 1
    assert view.i32[P.NEXT_OPS_OFF // 4] == -1      # the posted chain is the progress process's to write
    pp.group_depth = 0
    pp.flush()
    assert _handed_off(view) == [0, 1, 2] and pp.chain_first == -1
    assert pp.seq == 3 and pp.opcount == 1   # the group's records share the opCount they were given
    assert view.q[lay.rank_q(0, P.RANK_POSTED)] == 2
    assert take() == (3, 0, -1) and list(idx[:3]) == [0, 1, 2]
    assert _handed_off(view) == [] and view.q[P.PENDING_MASK_OFF // 8] == 0
    assert (view.i32[P.NEXT_OPS_OFF // 4], view.i32[P.NEXT_OPS_END_OFF // 4]) == (-1, -1)


def test_post_hands_off_while_the_mutex_is_held(pool):
    """A post does not wait for the mutex while the progress process is awake: posting from the very
    thread that holds it returns at once; a dump shows the chain handed off; the holder's take splices
    it, so nothing is posted twice."""
    seg, view = pool
    lay = view.layout
    seen = []
    pp, *_ = _make_poster(seg, view, on_splice_error=seen.append)
    take, _out, idx = _taker(seg, lay)
    pp.write(4, 4, ops.KIND_SEND, 3, 0, 0, 1, 7, 1, 0, 8, 8, -1, 0, 0, 0, 0)
    view.mutex.lock(5.0)
    try:
        pp.enqueue(4)
        assert seen == [] and view.q[lay.rank_q(0, P.RANK_PENDING)] == (5 << 32) | 5   # (first + 1, last + 1)
        from shmproxy.tools import dump
        assert dump.read_pool(view)["ranks"][0]["pending_chain"] == [4, 4]   # what a dump shows
        assert "chain 4..4 handed off" in dump.format_text(dump.read_pool(view))
        assert take() == (1, 0, -1) and idx[0] == 4
        assert _handed_off(view) == [] and view.q[P.PENDING_MASK_OFF // 8] == 0
    finally:
        view.mutex.unlock()
    assert take() == (0, 0, -1)


def test_fetch_posted_locks_takes_and_unlocks_in_one_call(pool):
    """The progress process's fetch (_native.fetch_posted): with trylock it takes nothing while the
    mutex is held (BUSY); otherwise it splices what ranks handed off, takes it and leaves the mutex free."""
    seg, view = pool
    lay = view.layout
    pp, *_ = _make_poster(seg, view)
    out, idx = bytearray(P.RECORD_BYTES * lay.nrecords), np.zeros(lay.nrecords, np.int32)

    def fetch(blocking):
        return _native.fetch_posted(seg.addr, lay.records_off, lay.rank_area_off, lay.nrecords, lay.max_ops, 16,
                                    _native.buffer_info(out, True)[0], idx.ctypes.data, blocking, 1.0)
    for i in (6, 7):
        pp.write(i, i, ops.KIND_SEND, 3, 0, 0, 1, 7, 1, 0, 8, 8, -1, 0, 0, 0, 0)
        pp.enqueue(i)
    view.mutex.lock(5.0)
    try:
        assert fetch(False) == (0, 0, -1, _native.BUSY) and _handed_off(view) == [6, 7]
    finally:
        view.mutex.unlock()
    assert fetch(True) == (2, 0, -1, _native.OK) and list(idx[:2]) == [6, 7]
    assert _handed_off(view) == [] and view.mutex.trylock()   # taken, and the mutex was released
    view.mutex.unlock()
    assert fetch(False) == (0, 0, -1, _native.OK)


def test_post_to_a_sleeping_progress_process_splices_and_signals(pool):
    """The progress process sleeps (sleep_unless_posted: SLEEPING, then the mask): a post sees SLEEPING,
    locks once the sleeper is inside the condvar wait, splices its chain and signals, so the sleeper
    wakes long before its bound."""
    seg, view = pool
    seen, slept = [], []
    pp, *_ = _make_poster(seg, view, on_splice_error=seen.append)

    def sleeper():
        view.mutex.lock(5.0)
        t0 = time.monotonic()
        rc = _native.sleep_unless_posted(seg.addr, 30.0, 0)
        slept.append((rc, time.monotonic() - t0, view.i32[P.NEXT_OPS_OFF // 4]))
        view.mutex.unlock()

    t = threading.Thread(target=sleeper, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not view.q[P.CTRL_OFF // 8 + P.CTRL_SLEEPING]:
        assert t.is_alive() and time.monotonic() < deadline, "the sleeper did not go to sleep"
        time.sleep(0.001)
    pp.write(3, 3, ops.KIND_SEND, 3, 0, 0, 1, 7, 1, 0, 8, 8, -1, 0, 0, 0, 0)
    pp.enqueue(3)
    t.join(20)
    assert not t.is_alive() and seen == []
    rc, took, head = slept[0]
    assert rc == _native.OK and took < 10 and head == 3   # signalled, with the chain spliced by the poster
    assert _handed_off(view) == [] and view.q[P.CTRL_OFF // 8 + P.CTRL_SLEEPING] == 0


def test_sleep_unless_posted_does_not_sleep_past_a_handed_off_chain(pool):
    """The progress process's side of the protocol: with a chain handed off it does not sleep at all;
    with none it sleeps to its bound; SLEEPING is 0 again either way."""
    seg, view = pool
    pp, *_ = _make_poster(seg, view)
    view.mutex.lock(5.0)
    try:
        t0 = time.monotonic()
        assert _native.sleep_unless_posted(seg.addr, 0.05, 0) == _native.TIMEDOUT
        assert time.monotonic() - t0 >= 0.04
        pp.write(5, 5, ops.KIND_SEND, 3, 0, 0, 1, 7, 1, 0, 8, 8, -1, 0, 0, 0, 0)
        pp.enqueue(5)   # this thread holds the mutex: the post must not need it
        t0 = time.monotonic()
        assert _native.sleep_unless_posted(seg.addr, 30.0, 0) == _native.OK and time.monotonic() - t0 < 5
        assert view.q[P.CTRL_OFF // 8 + P.CTRL_SLEEPING] == 0 and _handed_off(view) == [5]
    finally:
        view.mutex.unlock()


def test_post_whose_wake_up_cannot_lock_stays_handed_off(pool):
    """The progress process says it may sleep but the mutex stays held: the post's wake-up gives up at
    its bound and the post still succeeds, its chain handed off for the sleeper's next look (its sleep
    is bounded), not lost and not reported as failed."""
    seg, view = pool
    lay = view.layout
    seen = []
    pp, *_ = _make_poster(seg, view, on_splice_error=seen.append)   # its timeout: 1 s
    take, _out, idx = _taker(seg, lay)
    view.q[P.CTRL_OFF // 8 + P.CTRL_SLEEPING] = 1
    view.mutex.lock(5.0)
    try:
        pp.write(2, 2, ops.KIND_SEND, 3, 0, 0, 1, 7, 1, 0, 8, 8, -1, 0, 0, 0, 0)
        t = threading.Thread(target=pp.enqueue, args=(2,), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive() and seen == []
        assert _handed_off(view) == [2] and view.i32[P.NEXT_OPS_OFF // 4] == -1
        assert take() == (1, 0, -1) and idx[0] == 2
    finally:
        view.mutex.unlock()
        view.q[P.CTRL_OFF // 8 + P.CTRL_SLEEPING] = 0


def test_poster_fast_post_writes_the_record_python_reads(pool):
    seg, view = pool
    lay = view.layout
    pp, slots, records, pending = _make_poster(seg, view)
    assert pp.fast, "numpy's array header is not what shm/_poster.c reads"
    buf = MemfdBuffer.create(4096, "unittest")
    try:
        pp.set_ranges([(buf.addr, buf.addr + 4096, 5)])
        arr = np.frombuffer(buf.mm, np.float32, count=6, offset=64).reshape(2, 3)
        idx = records[-1]   # the top of the stack
        req = pp.post(ops.KIND_RECV, arr, 1, -(2**63))
        assert req is not None and pending[req._slot] is req and req._keep is arr and req._comm == "the comm"
        assert records[-1] != idx and len(records) == lay.max_ops - 1
        rec = view.read_record(idx)
        assert rec[:8] == (-1, ops.KIND_RECV, ops.DTYPE_CODE["f"], 0, 0, 0, 1, -(2**63))
        assert rec[8:16] == (1, 1, req._slot, 5, 64, 24, 6, -1)
        assert rec[19] == 0 and rec[20] > 0   # coll_seq, t_post
        assert rec[16] == 0                   # the mem word: host memory (shmproxy.core.memory)
        assert _handed_off(view) == [idx]
        assert (req._seq, req._nbytes, req._tag, req._peer, req._done) == (1, 24, -(2**63), 1, False)
        del arr, req
    finally:
        pending.clear()
        buf.close()


def test_poster_isend_irecv_post_or_fall_back(pool):
    """isend/irecv (what a Comm installs as Isend/Irecv) post in C when they can, the tag given by
    position, by keyword or by default; other keywords and everything declined reach the Python
    fallbacks with the call unchanged."""
    seg, view = pool
    pp, slots, records, pending = _make_poster(seg, view)
    calls = []
    pp.send_fallback = lambda *a, **k: calls.append(("send", a, k)) or "python send"
    pp.recv_fallback = lambda *a, **k: calls.append(("recv", a, k)) or "python recv"
    buf = MemfdBuffer.create(4096, "unittest")
    try:
        pp.set_ranges([(buf.addr, buf.addr + 4096, 5)])
        arr = np.frombuffer(buf.mm, np.int64, count=8)
        req = pp.isend(arr, 1)
        assert req._kind == ops.KIND_SEND and req._tag == 0 and req._peer == 1 and not calls
        req = pp.irecv(arr, 0, 9)
        assert req._kind == ops.KIND_RECV and req._tag == 9 and not calls
        req = pp.isend(arr, 1, tag=3)   # the tag by keyword is still the fast path
        assert req._kind == ops.KIND_SEND and req._tag == 3 and not calls
        assert pp.irecv(arr, source=1) == "python recv"
        assert pp.isend(np.zeros(3), 1, 2) == "python send"   # not registered: declined
        assert pp.isend(np.zeros(3), 1, tag=4) == "python send"
        assert [c[0] for c in calls] == ["recv", "send", "send"]
        assert calls[0][2] == {"source": 1} and calls[1][1][1:] == (1, 2)
        assert calls[2][1][1:] == (1,) and calls[2][2] == {"tag": 4}
        assert pp.seq == 3 and len(pending) == 3
        del arr, req
    finally:
        pending.clear()
        calls.clear()
        buf.close()


def test_poster_never_touches_a_detached_pool(pool):
    seg, view = pool
    pp, slots, records, pending = _make_poster(seg, view)
    pp.group_depth = 1
    pp.write(0, 0, ops.KIND_SEND, 3, 0, 0, 1, 7, 1, 0, 8, 8, -1, 0, 0, 0, 0)
    pp.enqueue(0)
    pp.detach()
    assert pp.chain_first == -1 and pp.post(ops.KIND_SEND, np.zeros(2), 1, 0) is None
    for call in (lambda: pp.write(1, 1, ops.KIND_SEND, 3, 0, 0, 1, 7, 1, 0, 8, 8, -1, 0, 0, 0, 0),
                 lambda: pp.enqueue(1)):
        with pytest.raises(RuntimeError, match="no longer mapped"):
            call()
    pp.flush()   # nothing chained any more: a no-op


@pytest.mark.parametrize("case", ["unregistered", "strided", "readonly", "longdouble", "big-endian", "empty",
                                  "peer", "np-peer", "bool-peer", "big-tag", "no-slot", "aborted", "unusable"])
def test_poster_declines_what_python_must_handle(pool, case):
    seg, view = pool
    pp, slots, records, pending = _make_poster(seg, view)
    buf = MemfdBuffer.create(4096, "unittest")
    try:
        pp.set_ranges([(buf.addr, buf.addr + 4096, 5)])
        arr = np.frombuffer(buf.mm, np.float64, count=16)
        kind, peer, tag = ops.KIND_RECV, 1, 0
        if case == "unregistered":
            arr = np.zeros(16)
        elif case == "strided":
            arr = arr[::2]
        elif case == "readonly":
            arr.flags.writeable = False
        elif case == "longdouble":
            arr = np.frombuffer(buf.mm, np.longdouble, count=4)
        elif case == "big-endian":
            arr = np.frombuffer(buf.mm, ">f8", count=4)
        elif case == "empty":
            arr = arr[:0]
        elif case == "peer":
            peer = 2
        elif case == "np-peer":
            peer = np.int64(1)
        elif case == "bool-peer":
            peer = True
        elif case == "big-tag":
            tag = 2**63
        elif case == "no-slot":
            slots.clear()
        elif case == "aborted":
            view.q[P.CTRL_OFF // 8 + P.CTRL_ABORT] = 1
        elif case == "unusable":
            pp.usable = 0
        assert pp.post(kind, arr, peer, tag) is None
        assert pp.seq == 0 and not pending and view.i32[P.NEXT_OPS_OFF // 4] == -1
        assert _handed_off(view) == []
        assert len(records) == view.layout.max_ops and len(slots) == (0 if case == "no-slot" else view.layout.max_ops)
        del arr
    finally:
        buf.close()


def test_poster_iallreduce_writes_the_record_comm_coll_writes(pool):
    """The C Allreduce post (a Comm's Iallreduce) writes what Comm._coll writes through write():
    root 0 in peer, Coll.ALLREDUCE in x1, the send side in (bid, off, nbytes), nothing there in place."""
    from shmproxy.coll import sched
    seg, view = pool
    pp, slots, records, pending = _make_poster(seg, view)
    pp.in_place = ops.IN_PLACE
    buf = MemfdBuffer.create(4096, "unittest")
    try:
        pp.set_ranges([(buf.addr, buf.addr + 4096, 5)])
        s = np.frombuffer(buf.mm, np.float32, count=6, offset=128)
        r = np.frombuffer(buf.mm, np.float32, count=6, offset=1024).reshape(3, 2)
        for n, (send, op, flags, bid, off, nb) in enumerate([(s, sched.ReduceOp.MAX, 0, 5, 128, 24),
                                                             (ops.IN_PLACE, 1, ops.FLAG_IN_PLACE, 0, 0, 0)], 1):
            idx = records[-1]
            req = pp.iallreduce(send, r, op)
            assert req is not None and pending[req._slot] is req and req._keep == (send, r)
            assert (req._kind, req._tag, req._peer, req._nbytes) == (ops.KIND_COLL, sched.Coll.ALLREDUCE, 0, 24)
            rec = view.read_record(idx)
            assert rec[:8] == (-1, ops.KIND_COLL, ops.DTYPE_CODE["f"], int(op), flags, 0, 0, 0)
            assert rec[9:16] == (n, req._slot, bid, off, nb, 6, 5)
            assert rec[17:20] == (1024, 24, n) and rec[21] == sched.Coll.ALLREDUCE
            assert pp.coll_seq == n and pp.seq == n
        idx = records[-1]
        req = pp.iallreduce(s, r)   # op defaults to SUM
        assert req is not None and view.read_record(idx)[3] == sched.ReduceOp.SUM
        idx = records[-1]
        req = pp.iallreduce(s, r, op=sched.ReduceOp.MIN)   # and may be given by keyword
        assert req is not None and view.read_record(idx)[3] == sched.ReduceOp.MIN
        del s, r, req, send
    finally:
        pending.clear()
        buf.close()


def test_poster_ibarrier_writes_the_record_comm_coll_writes(pool):
    from shmproxy.coll import sched
    seg, view = pool
    pp, slots, records, pending = _make_poster(seg, view)
    calls = []
    pp.barrier_fallback = lambda *a, **k: calls.append((a, k)) or "python"
    idx = records[-1]
    req = pp.ibarrier()
    assert pending[req._slot] is req and pp.coll_seq == 1 and calls == []
    assert (req._kind, req._tag, req._peer, req._nbytes) == (ops.KIND_COLL, sched.Coll.BARRIER, 0, 0)
    fast = view.read_record(idx)
    idx2, slot2 = records.pop(), slots.pop()   # what Comm._coll writes for a Barrier, through write()
    pp.write(idx2, slot2, ops.KIND_COLL, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, pp.coll_seq, sched.Coll.BARRIER)
    slow = view.read_record(idx2)
    same = [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 14, 15, 17, 18, 19, 21]   # all but next, opCount, seq, slot, time
    assert [fast[i] for i in same] == [slow[i] for i in same]
    assert fast[10] == req._slot and fast[21] == sched.Coll.BARRIER
    assert pp.ibarrier(1) == "python" and calls == [((1,), {})]   # anything unusual: Comm.Ibarrier
    del records[:]
    assert pp.ibarrier() == "python" and pp.coll_seq == 1            # no free record: Python takes it
    pending.clear()


@pytest.mark.parametrize("case", ["bool-sum", "int-avg", "bool-op", "big-op", "zero-op", "count", "dtype",
                                  "unregistered-send", "readonly-recv", "plain-in-place", "keyword", "no-record"])
def test_poster_iallreduce_declines_what_comm_coll_must_check(pool, case):
    seg, view = pool
    pp, slots, records, pending = _make_poster(seg, view)
    calls = []
    pp.allreduce_fallback = lambda *a, **k: calls.append((a, k)) or "python"
    pp.in_place = ops.IN_PLACE
    buf = MemfdBuffer.create(4096, "unittest")
    try:
        pp.set_ranges([(buf.addr, buf.addr + 4096, 5)])
        dt = {"bool-sum": np.bool_, "int-avg": np.int32}.get(case, np.float64)
        s = np.frombuffer(buf.mm, dt, count=8)
        r = np.frombuffer(buf.mm, dt, count=8, offset=2048)
        args, kw = [s, r, {"int-avg": 5, "bool-op": True, "big-op": 6, "zero-op": 0}.get(case, 1)], {}
        if case == "count":
            args[0] = s[:7]
        elif case == "dtype":
            args[0] = np.frombuffer(buf.mm, np.int64, count=8)
        elif case == "unregistered-send":
            args[0] = np.zeros(8)
        elif case == "readonly-recv":
            r.flags.writeable = False
        elif case == "plain-in-place":
            pp.in_place = None
            args[0] = ops.IN_PLACE
        elif case == "keyword":   # op= alone is the fast path; any other keyword is not
            kw = {"recvbuf": args.pop(1)}
        elif case == "no-record":
            records.clear()
        assert pp.iallreduce(*args, **kw) == "python" and len(calls) == 1
        assert calls[0][1] == kw and calls[0][0][0] is args[0]
        assert pp.seq == 0 and pp.coll_seq == 0 and not pending and view.i32[P.NEXT_OPS_OFF // 4] == -1
        assert _handed_off(view) == []
        del s, r, args, kw
    finally:
        calls.clear()
        buf.close()


# The C posts of the other buffer collectives, against the fields Comm._coll gives write() for the
# same call (2 ranks, this rank 0): (method, args, kwargs) -> (code char, redop, flags, root, send
# (bid, off, nbytes), count, recv (bid2, off2, nbytes2)). s6/s12: float32 sendbufs of 6/12 elements at
# offset 128, r6/r12 recvbufs at 1024, all in registered buffer 5.
_SUM, _MAX, _PROD, _MIN = (int(getattr(sched_mod.ReduceOp, n)) for n in ("SUM", "MAX", "PROD", "MIN"))


_C_COLL_CASES = {
    "bcast": ("ibcast", ("s6", 1), {}, (0, 0, ops.FLAG_IN_PLACE, 1, (0, 0, 24), 6, (5, 128, 24))),
    "bcast-kw": ("ibcast", ("s6",), {"root": 1}, (0, 0, ops.FLAG_IN_PLACE, 1, (0, 0, 24), 6, (5, 128, 24))),
    "reduce-root": ("ireduce", ("s6", "r6", _MAX, 0), {}, (0, _MAX, 0, 0, (5, 128, 24), 6, (5, 1024, 24))),
    "reduce-kw": ("ireduce", ("s6", "r6"), {"root": 0, "op": _MIN}, (0, _MIN, 0, 0, (5, 128, 24), 6, (5, 1024, 24))),
    "reduce-nonroot": ("ireduce", ("s6", None, _SUM, 1), {},
                       (0, _SUM, ops.FLAG_NO_RECV, 1, (5, 128, 24), 6, (0, 0, 0))),
    "reduce-in-place": ("ireduce", ("IN_PLACE", "r6"), {},
                        (0, _SUM, ops.FLAG_IN_PLACE, 0, (0, 0, 0), 6, (5, 1024, 24))),
    "allgather": ("iallgather", ("s6", "r12"), {}, (0, 0, 0, 0, (5, 128, 24), 6, (5, 1024, 48))),
    "allgather-in-place": ("iallgather", ("IN_PLACE", "r12"), {},
                           (0, 0, ops.FLAG_IN_PLACE, 0, (0, 0, 0), 6, (5, 1024, 48))),
    "rsb": ("ireduce_scatter_block", ("s12", "r6", _PROD), {}, (0, _PROD, 0, 0, (5, 128, 48), 6, (5, 1024, 24))),
    "rsb-in-place": ("ireduce_scatter_block", ("IN_PLACE", "r12"), {},
                     (0, _SUM, ops.FLAG_IN_PLACE, 0, (0, 0, 0), 6, (5, 1024, 48))),
    "alltoall": ("ialltoall", ("s12", "r12"), {}, (0, 0, 0, 0, (5, 128, 48), 6, (5, 1024, 48))),
}


_COLL_OF = {"ibcast": "BCAST", "ireduce": "REDUCE", "iallgather": "ALLGATHER",
            "ireduce_scatter_block": "REDUCE_SCATTER_BLOCK", "ialltoall": "ALLTOALL"}


def _coll_arrays(buf) -> dict:
    f = np.float32
    return {"s6": np.frombuffer(buf.mm, f, count=6, offset=128), "s12": np.frombuffer(buf.mm, f, count=12, offset=128),
            "r6": np.frombuffer(buf.mm, f, count=6, offset=1024).reshape(2, 3),
            "r12": np.frombuffer(buf.mm, f, count=12, offset=1024), "IN_PLACE": ops.IN_PLACE, None: None}


def _coll_poster(seg, view):
    """A poster as a Comm sets it up for the collective posts (rank 0 of 2), each fallback recording
    its call into the returned list."""
    pp, slots, records, pending = _make_poster(seg, view)
    pp.in_place, pp.rank = ops.IN_PLACE, 0
    calls: list = []
    for c in _COLL_OF.values():
        pp.set_coll_fallback(int(getattr(sched_mod.Coll, c)), lambda *a, **k: calls.append((a, k)) or "python")
    return pp, slots, records, pending, calls


@pytest.mark.parametrize("case", sorted(_C_COLL_CASES))
def test_poster_collectives_write_the_record_comm_coll_writes(pool, case):
    method, names, kw, (_c, redop, flags, root, send, count, recv) = _C_COLL_CASES[case]
    seg, view = pool
    pp, slots, records, pending, calls = _coll_poster(seg, view)
    buf = MemfdBuffer.create(4096, "unittest")
    try:
        pp.set_ranges([(buf.addr, buf.addr + 4096, 5)])
        arrays = _coll_arrays(buf)
        args = [arrays[n] if isinstance(n, str) or n is None else n for n in names]
        idx = records[-1]
        req = getattr(pp, method)(*args, **kw)
        assert calls == [] and req is not None and pending[req._slot] is req
        coll = int(getattr(sched_mod.Coll, _COLL_OF[method]))
        nbytes = max(send[2], recv[2])
        assert (req._kind, req._tag, req._peer, req._nbytes) == (ops.KIND_COLL, coll, root, nbytes)
        rec = view.read_record(idx)
        assert rec[1:8] == (ops.KIND_COLL, ops.DTYPE_CODE["f"], redop, flags, 0, root, 0)
        assert rec[9:16] == (1, req._slot, *send, count, recv[0])
        assert rec[17:20] == (recv[1], recv[2], 1) and rec[21] == coll
        # ... which is what Comm._coll has write() put in a record for the same call:
        idx2, slot2 = records.pop(), slots.pop()
        pp.write(idx2, slot2, ops.KIND_COLL, ops.DTYPE_CODE["f"], redop, flags, root, 0, *send, count, *recv,
                 pp.coll_seq, coll)
        slow = view.read_record(idx2)
        same = [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 14, 15, 17, 18, 19, 21]   # all but next, opCount, seq, slot, time
        assert [rec[i] for i in same] == [slow[i] for i in same]
        del arrays, args, req
    finally:
        pending.clear()
        buf.close()


@pytest.mark.parametrize("case", ["bcast-root-range", "bcast-bool-root", "bcast-unregistered", "bcast-readonly",
                                  "bcast-extra-arg", "bcast-unknown-kw", "reduce-nonroot-recvbuf",
                                  "reduce-nonroot-in-place", "reduce-bool-sum", "reduce-count", "allgather-count",
                                  "allgather-in-place-odd", "allgather-dtype", "rsb-count", "rsb-int-avg",
                                  "alltoall-in-place", "alltoall-count", "no-slot"])
def test_poster_collectives_decline_what_comm_coll_must_check(pool, case):
    """What Comm._coll must validate, raise for or stage reaches it with the call unchanged."""
    seg, view = pool
    pp, slots, records, pending, calls = _coll_poster(seg, view)
    buf = MemfdBuffer.create(4096, "unittest")
    try:
        pp.set_ranges([(buf.addr, buf.addr + 4096, 5)])
        a = _coll_arrays(buf)
        s6, r6, r12 = a["s6"], a["r6"], a["r12"]
        kw: dict = {}
        method, args = {
            "bcast-root-range": ("ibcast", [s6, 2]), "bcast-bool-root": ("ibcast", [s6, True]),
            "bcast-unregistered": ("ibcast", [np.zeros(4, np.float32)]),
            "bcast-readonly": ("ibcast", [s6]), "bcast-extra-arg": ("ibcast", [s6, 0, 1]),
            "bcast-unknown-kw": ("ibcast", [s6]),
            "reduce-nonroot-recvbuf": ("ireduce", [s6, r6, _SUM, 1]),
            "reduce-nonroot-in-place": ("ireduce", [ops.IN_PLACE, r6, _SUM, 1]),
            "reduce-bool-sum": ("ireduce", [np.frombuffer(buf.mm, np.bool_, 6, 128),
                                            np.frombuffer(buf.mm, np.bool_, 6, 1024), _SUM, 0]),
            "reduce-count": ("ireduce", [s6, r12, _SUM, 0]), "allgather-count": ("iallgather", [s6, r6]),
            "allgather-in-place-odd": ("iallgather", [ops.IN_PLACE, r12[:5]]),
            "allgather-dtype": ("iallgather", [s6, np.frombuffer(buf.mm, np.float64, 12, 1024)]),
            "rsb-count": ("ireduce_scatter_block", [s6, r6]),
            "rsb-int-avg": ("ireduce_scatter_block", [np.frombuffer(buf.mm, np.int32, 12, 128),
                                                      np.frombuffer(buf.mm, np.int32, 6, 1024), 5]),
            "alltoall-in-place": ("ialltoall", [ops.IN_PLACE, r12]),
            "alltoall-count": ("ialltoall", [a["s12"], r12[:11]]), "no-slot": ("ibcast", [s6]),
        }[case]
        if case == "bcast-readonly":
            s6.flags.writeable = False
        elif case == "bcast-unknown-kw":
            kw = {"rooot": 1}
        elif case == "no-slot":
            slots.clear()
        assert getattr(pp, method)(*args, **kw) == "python" and len(calls) == 1
        got_args, got_kw = calls[0]
        assert got_kw == kw and len(got_args) == len(args) and all(x is y for x, y in zip(got_args, args))
        assert pp.seq == 0 and pp.coll_seq == 0 and not pending and view.i32[P.NEXT_OPS_OFF // 4] == -1
        assert _handed_off(view) == []
        del a, s6, r6, r12, args, got_args
    finally:
        calls.clear()
        buf.close()


def test_post_event_wakes_a_sleeping_loop_and_a_pending_event_keeps_it_awake(pool):
    """News for the loop from another thread of its process (_native.post_event): it bumps EVENTS
    and signals a sleeper, which wakes long before its bound; a loop that has not seen the latest
    EVENTS does not sleep at all; with nothing new it sleeps to its bound; SLEEPING is 0 after."""
    seg, view = pool
    events_q = P.CTRL_OFF // 8 + P.CTRL_EVENTS
    slept = []

    def sleeper(seen: int) -> None:
        view.mutex.lock(5.0)
        t0 = time.monotonic()
        rc = _native.sleep_unless_posted(seg.addr, 30.0, seen)
        slept.append((rc, time.monotonic() - t0))
        view.mutex.unlock()

    t = threading.Thread(target=sleeper, args=(int(view.q[events_q]),), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not view.q[P.CTRL_OFF // 8 + P.CTRL_SLEEPING]:
        assert t.is_alive() and time.monotonic() < deadline, "the sleeper did not go to sleep"
        time.sleep(0.001)
    assert _native.post_event(seg.addr, 5.0) == _native.OK
    t.join(20)
    assert not t.is_alive() and slept[0][0] == _native.OK and slept[0][1] < 10
    assert view.q[events_q] == 1 and view.q[P.CTRL_OFF // 8 + P.CTRL_SLEEPING] == 0

    view.mutex.lock(5.0)
    try:
        t0 = time.monotonic()    # seen 0, EVENTS 1: news not yet handled, no sleep
        assert _native.sleep_unless_posted(seg.addr, 30.0, 0) == _native.OK and time.monotonic() - t0 < 5
        t0 = time.monotonic()    # seen 1: nothing new, sleeps to the bound
        assert _native.sleep_unless_posted(seg.addr, 0.05, 1) == _native.TIMEDOUT
        assert time.monotonic() - t0 >= 0.04
    finally:
        view.mutex.unlock()
    assert _native.post_event(seg.addr, 5.0) == _native.OK and view.q[events_q] == 2   # nobody asleep: no lock


def test_post_event_waits_for_a_held_mutex_before_it_signals(pool):
    """post_event finds SLEEPING set and the pool mutex held (the loop between its check and its wait,
    or a rank splicing): it blocks, GIL released, until the holder lets go, then signals."""
    seg, view = pool
    view.q[P.CTRL_OFF // 8 + P.CTRL_SLEEPING] = 1
    held, release = threading.Event(), threading.Event()

    def holder():
        view.mutex.lock(5.0)
        held.set()
        release.wait(10)
        view.mutex.unlock()

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    assert held.wait(10)
    threading.Timer(0.05, release.set).start()   # other Python threads run while post_event blocks
    t0 = time.monotonic()
    assert _native.post_event(seg.addr, 5.0) == _native.OK
    assert 0.04 <= time.monotonic() - t0 < 5 and release.is_set()
    t.join(10)
    view.q[P.CTRL_OFF // 8 + P.CTRL_SLEEPING] = 0


def test_the_mem_word_is_written_by_the_python_path_and_is_host_unless_named(pool):
    """write() takes the record's memory word as an optional last argument (the Python path for a
    memory kind the C fast path does not take); left out, it is 0 (host), whatever the record held."""
    from shmproxy.core.memory import MemKind, mem_word
    seg, view = pool
    pp, *_ = _make_poster(seg, view)
    args = (3, 3, ops.KIND_SEND, 3, 0, 0, 1, 7, 1, 0, 8, 8, -1, 0, 0, 0, 0)
    pp.write(*args, mem_word(MemKind.CUDA, 5))
    assert view.read_record(3)[16] == mem_word(MemKind.CUDA, 5) == 1 | 5 << 8
    pp.write(*args)
    assert view.read_record(3)[16] == 0
