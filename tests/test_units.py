"""Single-process unit tests: pool layout, params, the fetch policy, transports, args recycling,
the native sync primitives, and the op record round trip."""
from __future__ import annotations

import os
import pathlib
import threading
import time

import numpy as np
import pytest

import shmproxy
from shmproxy.core import errors, ops, params as params_mod
from shmproxy.coll import sched as sched_mod
from shmproxy.engine.args import ArgsPool, Transfer
from shmproxy.engine.progress import FetchMode, fetch_mode
from shmproxy.shm import _native, _poster, pool as P, sync
from shmproxy.shm.segment import MemfdBuffer, Segment
from shmproxy import transports
from shmproxy.transports.base import PeerInfo, Transport, check_transport


# ------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("nlocal,max_ops,max_subs", [(1, 16, 64), (2, 1024, 4096), (7, 33, 65), (64, 1024, 4096)])
def test_layout_regions_are_aligned_and_disjoint(nlocal, max_ops, max_subs):
    lay = P.Layout(nlocal, max_ops, max_subs)
    regions = [
        (0, P.CTRL_OFF), (P.CTRL_OFF, P.CTRL_OFF + 8 * P.CTRL_COUNT), (P.ERR_MSG_OFF, P.ERR_MSG_OFF + P.ERR_MSG_BYTES),
        (P.FREE_OPS_OFF, P.FREE_OPS_OFF + 4 * nlocal),
        (lay.rank_area_off, lay.rank_area_off + P.RANK_AREA_BYTES * nlocal),
        (lay.info_off, lay.info_off + P.INFO_BYTES),
        (lay.slots_off, lay.slots_off + P.SLOT_BYTES * nlocal * max_ops),
        (lay.subs_off, lay.subs_off + P.SUB_BYTES * max_subs),
        (lay.records_off, lay.records_off + P.RECORD_BYTES * nlocal * max_ops),
    ]
    for (a0, a1), (b0, b1) in zip(regions, regions[1:]):
        assert a1 <= b0, (a0, a1, b0, b1)
    assert regions[-1][1] <= lay.total_bytes and lay.total_bytes % 4096 == 0
    for off in (lay.rank_area_off, lay.info_off, lay.slots_off, lay.subs_off, lay.records_off):
        assert off % 64 == 0
    assert lay.wake_word_offset(nlocal - 1) % 8 == 0
    assert P.CTRL_OFF + 8 * P.CTRL_COUNT <= P.ERR_MSG_OFF


def test_record_and_sub_formats_are_fixed_size():
    assert P.RECORD.size == P.RECORD_BYTES == 128
    assert P.SUB.size <= P.SUB_BYTES
    assert P.HEADER_FMT.size <= P.MUTEX_OFF
    assert sync.MUTEX_SIZE <= 64 and sync.COND_SIZE <= 64


@pytest.fixture
def pool():
    lay = P.Layout(2, 8, 16)
    seg = Segment.create("unittest", lay.total_bytes)
    view = P.PoolView.initialize(seg.mm, seg.addr, lay)
    try:
        yield seg, view
    finally:
        view.release()
        seg.close()
        seg.unlink()


def test_pool_initialises_free_lists_and_rejects_foreign_headers(pool):
    seg, view = pool
    lay = view.layout
    for r in range(lay.nlocal):
        chain, bad = view.walk(view.i32[P.FREE_OPS_OFF // 4 + r], lay.nrecords)
        assert not bad and chain == list(range(r * lay.max_ops, (r + 1) * lay.max_ops))
    assert view.i32[P.NEXT_OPS_OFF // 4] == -1
    other = P.PoolView(seg.mm)
    assert other.layout == lay
    seg.mm[0:8] = b"notapool"
    with pytest.raises(ValueError, match="not a shmproxy ops pool"):
        P.PoolView(seg.mm)


def test_record_round_trip_through_op(pool):
    _seg, view = pool
    ops.pack(view.buf, view.layout, 3, ops.KIND_SEND, ops.DTYPE_CODE["d"], 0, 5, -7, 11, 12, 3, 4, 64,
             2**40, 2**37, 999)
    op = ops.Op(3, view.read_record(3), rank=9, t_fetch=1)
    assert (op.kind, op.peer, op.tag, op.opcount, op.req_seq, op.req_slot) == (ops.KIND_SEND, 5, -7, 11, 12, 3)
    assert (op.buf_id, op.offset, op.nbytes, op.count, op.t_post) == (4, 64, 2**40, 2**37, 999)
    assert "send rank 9 peer 5 tag -7" in op.describe()
    with pytest.raises(IndexError):
        view.read_record(view.layout.nrecords)


def _post_chain(view, chain):
    """Records (index, opcount) linked as the posted chain, taken off their owners' free lists first."""
    lay, i32 = view.layout, view.i32
    for r in range(lay.nlocal):
        used = {i for i, _ in chain if i // lay.max_ops == r}
        free = [i for i in range(r * lay.max_ops, (r + 1) * lay.max_ops) if i not in used]
        i32[P.FREE_OPS_OFF // 4 + r] = free[0] if free else -1
        for a, b in zip(free, free[1:] + [-1]):
            i32[lay.record_off(a) // 4] = b
    for k, (i, opcount) in enumerate(chain):
        ops.pack(view.buf, lay, i, ops.KIND_SEND, ops.DTYPE_CODE["b"], i // lay.max_ops, 1, i, opcount, i, i,
                 0, 0, 8, 8, 100 + i)
        i32[lay.record_off(i) // 4] = chain[k + 1][0] if k + 1 < len(chain) else -1
    i32[P.NEXT_OPS_OFF // 4], i32[P.NEXT_OPS_END_OFF // 4] = chain[0][0], chain[-1][0]


def _taker(seg, lay):
    """(take(batch) -> take_posted's result, the record copies, their indices)."""
    out, idx = bytearray(P.RECORD_BYTES * lay.nrecords), np.zeros(lay.nrecords, np.int32)

    def take(batch=16):
        return _native.take_posted(seg.addr, lay.records_off, lay.rank_area_off, lay.nrecords, lay.max_ops, batch,
                                   _native.buffer_info(out, True)[0], idx.ctypes.data)
    return take, out, idx


def test_take_posted_takes_whole_groups_and_frees_the_records(pool):
    seg, view = pool
    lay, i32 = view.layout, view.i32
    take, out, idx = _taker(seg, lay)
    _post_chain(view, [(0, 1), (8, 1), (1, 1), (9, 2), (2, 2)])   # groups (0,1) (1,1) (1,2) (0,2)
    free0 = i32[P.FREE_OPS_OFF // 4]
    assert take(2) == (3, 0, -1)                     # the third group (1, 2) waits for the next fetch
    assert idx[:3].tolist() == [0, 8, 1]
    got = [ops.Op(int(idx[k]), f, 0, 0) for k, f in enumerate(P.RECORD.iter_unpack(bytes(out[:3 * 128])))]
    assert [(o.index, o.owner, o.opcount, o.tag, o.t_post) for o in got] == [
        (0, 0, 1, 0, 100), (8, 1, 1, 8, 108), (1, 0, 1, 1, 101)]
    assert (i32[P.NEXT_OPS_OFF // 4], i32[P.NEXT_OPS_END_OFF // 4]) == (9, 2)
    chain0, bad = view.walk(i32[P.FREE_OPS_OFF // 4], lay.nrecords)
    assert not bad and chain0[:3] == [1, 0, free0]   # pushed on the owner's free list, last taken first
    assert take(16) == (2, 0, -1) and idx[:2].tolist() == [9, 2]
    assert (i32[P.NEXT_OPS_OFF // 4], i32[P.NEXT_OPS_END_OFF // 4]) == (-1, -1)
    assert take(16) == (0, 0, -1)
    for r in range(lay.nlocal):                      # every record is back on its owner's list
        chain, bad = view.walk(i32[P.FREE_OPS_OFF // 4 + r], lay.nrecords)
        assert not bad and sorted(chain) == list(range(r * lay.max_ops, (r + 1) * lay.max_ops))


def test_take_posted_stops_at_corruption(pool):
    seg, view = pool
    lay, i32 = view.layout, view.i32
    take, _out, _idx = _taker(seg, lay)
    _post_chain(view, [(0, 1), (1, 1)])
    i32[lay.record_off(1) // 4] = lay.nrecords + 5   # a link out of range
    assert take() == (2, 1, lay.nrecords + 5)
    assert i32[P.NEXT_OPS_OFF // 4] == lay.nrecords + 5  # the bad link stays visible to the dump
    _post_chain(view, [(2, 1), (3, 1)])
    view.buf[lay.record_off(3) + 8:lay.record_off(3) + 12] = (1).to_bytes(4, "little")  # owner 1 in 0's region
    assert take() == (1, 2, 3) and i32[P.NEXT_OPS_OFF // 4] == 3
    with pytest.raises(ValueError, match="bad arguments"):
        take(1025)


def test_complete_coll_publishes_every_slot_then_bumps_every_rank(pool):
    seg, view = pool
    lay, q = view.layout, view.q

    def op(slot, seq, peer):
        ops.pack(view.buf, lay, slot, ops.KIND_COLL, 0, slot // lay.max_ops, peer, 0, 1, seq, slot, 0, 0, 8, 2, 0)
        return ops.Op(slot, view.read_record(slot), slot // lay.max_ops, 0)

    words = [view.i32[lay.wake_word_offset(r) // 4] for r in range(lay.nlocal)]
    coll = [op(3, 41, 0), op(lay.max_ops + 5, 42, 1)]
    args = (seg.addr, lay.slots_off, lay.rank_area_off, lay.max_ops)
    assert _native.complete_coll(*args, coll, 4096) == -1
    for o in coll:
        base = lay.slot_q(o.req_slot)
        assert q[base + P.SLOT_DONE_SEQ] == o.req_seq and q[base + P.SLOT_NBYTES] == 4096
        assert q[base + P.SLOT_STATUS] == o.peer << 32 and q[base + P.SLOT_TAG] == 0
    for r in range(lay.nlocal):
        assert view.i32[lay.wake_word_offset(r) // 4] == words[r] + 1
        assert q[lay.rank_q(r, P.RANK_COMPLETED)] == 1
    bad = op(6, 43, 0)
    bad.owner = 1                                    # its slot lies in rank 0's region
    before = bytes(view.buf[lay.slots_off:lay.subs_off])
    assert _native.complete_coll(*args, [op(7, 44, 0), bad], 8) == 1
    assert bytes(view.buf[lay.slots_off:lay.subs_off]) == before   # checked before anything is written


def test_segment_create_reports_no_space(monkeypatch):
    def enospc(fd, off, size):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", enospc)
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(errors.SystemError_, match="/dev/shm") as ei:
        Segment.create("nospace", 1 << 20)
    assert "free" in str(ei.value) and ei.value.errno == 28
    assert set(os.listdir("/dev/shm")) == before  # unlinked on the failed init


def test_memfd_buffer_round_trip():
    a = MemfdBuffer.create(4096)
    b = MemfdBuffer.from_fd(os.dup(a.fd), 4096)
    a.mm[:5] = b"hello"
    assert bytes(b.mm[:5]) == b"hello"
    a.close(); b.close(); a.close()  # idempotent


# ------------------------------------------------------------------------------------ native sync
def test_robust_mutex_owner_death_is_repaired(pool):
    _seg, view = pool
    dead = []
    view.mutex.on_owner_dead = lambda: dead.append(True)
    pid = os.fork()
    if pid == 0:  # the child locks and dies holding the lock (no Python cleanup)
        _native.lock(view.mutex.addr, 5.0)
        os._exit(0)
    os.waitpid(pid, 0)
    view.mutex.lock(5.0)
    view.mutex.unlock()
    assert dead == [True]
    assert view.mutex.trylock()
    view.mutex.unlock()


def test_lock_and_condvar_waits_are_bounded(pool):
    _seg, view = pool
    view.mutex.lock(1.0)
    got = []
    t = threading.Thread(target=lambda: got.append(_native.lock(view.mutex.addr, 0.2)))
    t.start(); t.join(5)
    assert got == [_native.TIMEDOUT]
    t0 = time.monotonic()
    assert view.cond.wait(0.05) is False
    assert time.monotonic() - t0 < 2
    view.mutex.unlock()


@pytest.mark.parametrize("spin_ns", [0, 5_000, 100_000])
def test_contended_lock_excludes_across_processes(spin_ns):
    """Four processes increment one shared counter under the robust mutex, through the C lock that the
    posts use (trylock, the bounded spin of SHMPROXY_LOCK_SPIN_US, then the sleeping lock): no
    increment may be lost, whichever way each lock was won."""
    import mmap
    shared = mmap.mmap(-1, 4096)   # MAP_SHARED | MAP_ANONYMOUS: shared with the forked children
    base = np.frombuffer(shared, np.uint8).ctypes.data
    mutex, counter = base, np.frombuffer(shared, np.uint64, 1, 2048)
    _native.mutex_init(mutex)
    nproc, per = 4, 3000
    pids = []
    for _ in range(nproc):
        pid = os.fork()
        if pid == 0:
            try:
                _native.set_lock_spin(spin_ns)
                for _ in range(per):
                    assert _native.lock(mutex, 10.0) == _native.OK
                    v = int(counter[0])
                    os.sched_yield() if v % 64 == 0 else None   # let holders lose their core now and then
                    counter[0] = v + 1
                    _native.unlock(mutex)
            finally:
                os._exit(0 if int(counter[0]) > 0 else 1)
        pids.append(pid)
    for pid in pids:
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert int(counter[0]) == nproc * per


def test_lock_spin_is_bounded_and_validated(pool):
    """A spinning locker still times out on a wedged holder, and bad spin values are refused."""
    _seg, view = pool
    view.mutex.lock(1.0)
    got = []
    _native.set_lock_spin(100_000)
    try:
        t = threading.Thread(target=lambda: got.append(_native.lock(view.mutex.addr, 0.2)))
        t.start(); t.join(5)
    finally:
        _native.set_lock_spin(0)
        view.mutex.unlock()
    assert got == [_native.TIMEDOUT]
    for mod in (_native, _poster):
        with pytest.raises(ValueError):
            mod.set_lock_spin(-1)
    with pytest.raises(errors.InvalidArgument):
        params_mod.Params(env={"SHMPROXY_LOCK_SPIN_US": "1000"})


def test_futex_wait_times_out_and_wakes(pool):
    seg, view = pool
    addr = seg.addr + view.layout.wake_word_offset(0)
    assert sync.futex_wait(addr, 12345, 0.01) is True  # word differs: returns at once
    word = view.q[view.layout.rank_q(0, P.RANK_WAKE)] & 0xFFFFFFFF
    assert sync.futex_wait(addr, word, 0.05) is False
    threading.Timer(0.05, sync.futex_bump_and_wake, (addr,)).start()
    assert sync.futex_wait(addr, word, 10.0) is True


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
    lay = view.layout
    seen, slept = [], []
    pp, *_ = _make_poster(seg, view, on_splice_error=seen.append)

    def sleeper():
        view.mutex.lock(5.0)
        t0 = time.monotonic()
        rc = _native.sleep_unless_posted(seg.addr, 30.0)
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
        assert _native.sleep_unless_posted(seg.addr, 0.05) == _native.TIMEDOUT
        assert time.monotonic() - t0 >= 0.04
        pp.write(5, 5, ops.KIND_SEND, 3, 0, 0, 1, 7, 1, 0, 8, 8, -1, 0, 0, 0, 0)
        pp.enqueue(5)   # this thread holds the mutex: the post must not need it
        t0 = time.monotonic()
        assert _native.sleep_unless_posted(seg.addr, 30.0) == _native.OK and time.monotonic() - t0 < 5
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


def test_status_is_built_in_c_and_reads_like_mpi_status():
    st = shmproxy.Status(3, -(2**63), 1 << 40)
    assert (st.source, st.tag, st.nbytes) == (3, -(2**63), 1 << 40)
    assert repr(st) == f"Status(source=3, tag={-(2**63)}, nbytes={1 << 40})"
    assert shmproxy.Status(source=1, tag=2, nbytes=3).tag == 2
    with pytest.raises(TypeError):
        shmproxy.Status(1, 2)


def test_buffer_info_rejects_what_cannot_be_received_into():
    a = np.zeros(10)
    addr, n = _native.buffer_info(a, True)
    assert n == 80 and addr == a.__array_interface__["data"][0]
    with pytest.raises((BufferError, ValueError)):
        _native.buffer_info(a[::2], True)
    ro = np.frombuffer(b"x" * 16, np.uint8)
    with pytest.raises((BufferError, ValueError)):
        _native.buffer_info(ro, True)


# ------------------------------------------------------------------------------------ reduce kernel
_KERNEL_CASES = [(op, dt) for op in ("SUM", "PROD", "MIN", "MAX", "AVG")
                 for dt in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                            "float16", "float32", "float64", "complex64", "complex128")]


def _kernel_inputs(dt: np.dtype, nsrc: int, count: int, rng) -> list[np.ndarray]:
    if dt.kind == "b":
        return [rng.integers(0, 2, count).astype(bool) for _ in range(nsrc)]
    if dt.kind in "iu":   # full range: sums and products overflow and must wrap like numpy's
        info = np.iinfo(dt)
        return [rng.integers(info.min, info.max, count, dtype=dt, endpoint=True) for _ in range(nsrc)]
    xs = [(rng.standard_normal(count) * 100).astype(dt) for _ in range(nsrc)]
    if dt.kind == "c":
        xs = [(x + 1j * rng.standard_normal(count)).astype(dt) for x in xs]
    else:
        xs[0][::97] = np.nan    # MIN/MAX must return the NaN, from either side
        xs[-1][5::89] = np.nan
    return xs


@pytest.mark.parametrize("op,dtype", _KERNEL_CASES)
@pytest.mark.parametrize("streaming", [False, True])
def test_reduce_kernel_matches_numpy(op, dtype, streaming):
    """shm._reduce gives numpy's results bit for bit (AVG: numpy's sum divided by n), for the pairs it
    takes; it takes every pair the collectives allow except float16 and complex PROD/MIN/MAX."""
    from shmproxy.coll import sched
    from shmproxy.shm import _reduce
    dt, code, rop = np.dtype(dtype), ops.DTYPE_CODE[np.dtype(dtype).char], int(sched.ReduceOp[op])
    allowed = not ((dt.kind == "b" and op not in ("MIN", "MAX")) or (op == "AVG" and dt.kind not in "fc"))
    takes = allowed and dt != np.float16 and not (dt.kind == "c" and op in ("MIN", "MAX", "PROD"))
    assert _reduce.supported(rop, code) is takes
    if not takes:
        with pytest.raises(ValueError, match="not supported"):
            _reduce.reduce(rop, code, 1, [0], [0], streaming)
        return
    rng = np.random.default_rng(7)
    count = 5000 + 3   # several kernel blocks and a ragged tail
    xs = _kernel_inputs(dt, 5, count, rng)
    want = xs[0].copy()
    with np.errstate(all="ignore"):
        for x in xs[1:]:
            sched.UFUNCS[rop](want, x, out=want)
        if op == "AVG":
            np.divide(want, len(xs), out=want, casting="unsafe")
    fill = np.array(7).astype(dt)
    outs = [np.full(count + 2, fill, dt) for _ in range(3)]
    dsts = [o[1:-1].ctypes.data for o in outs]
    _reduce.reduce(rop, code, count, [x.ctypes.data for x in xs], dsts, streaming)
    for o in outs:
        assert o[0] == fill and o[-1] == fill, "wrote outside the destination"
        if op == "AVG":
            np.testing.assert_allclose(o[1:-1], want, rtol=1e-6 if dt in (np.float32, np.complex64) else 1e-14)
        else:
            np.testing.assert_array_equal(o[1:-1], want)   # NaNs in the same places


def test_reduce_kernel_output_may_alias_an_input():
    from shmproxy.shm import _reduce
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(100_003).astype(np.float32) for _ in range(4)]
    want = xs[0] + xs[1] + xs[2] + xs[3]
    _reduce.reduce(1, ops.DTYPE_CODE["f"], xs[0].size, [x.ctypes.data for x in xs], [xs[2].ctypes.data,
                   xs[0].ctypes.data], True)   # in-place Allreduce: rank 0's and 2's buffers are also outputs
    np.testing.assert_array_equal(xs[0], want)
    np.testing.assert_array_equal(xs[2], want)


def test_worker_pool_runs_steps_in_order_and_returns_every_token_once():
    """shm._workers: a job's steps run in order on one thread (the REDUCE reads what the COPY wrote),
    with plain or (every other job) streaming stores, jobs spread over the threads, and each token
    comes back exactly once."""
    from shmproxy.shm import _workers
    rng = np.random.default_rng(11)
    pool = _workers.Workers(3, None)
    try:
        n, njobs = 70_001, 24
        xs = [rng.standard_normal(n).astype(np.float64) for _ in range(njobs)]
        scratch = [np.zeros(n) for _ in range(njobs)]
        outs = [np.zeros((2, n)) for _ in range(njobs)]
        code = ops.DTYPE_CODE["d"]
        for j in range(njobs):
            pool.run(("job", j), [
                (_workers.COPY, scratch[j].ctypes.data, xs[j].ctypes.data, xs[j].nbytes),
                (_workers.REDUCE, 1, code, n, [scratch[j].ctypes.data, xs[j].ctypes.data],
                 [outs[j][0].ctypes.data, outs[j][1].ctypes.data]),
            ], j % 2 == 1)
        a, b = np.arange(1000, dtype=np.uint8), np.zeros(1000, np.uint8)
        pool.copy("copy", b.ctypes.data, a.ctypes.data, a.nbytes)
        got: list = []
        deadline = time.monotonic() + 30
        while len(got) < njobs + 1 and time.monotonic() < deadline:
            pool.wait(1.0)
            got += pool.drain()
        assert sorted(got, key=str) == sorted([("job", j) for j in range(njobs)] + ["copy"], key=str)
        assert pool.pending == 0 and pool.drain() == []
        for j in range(njobs):
            np.testing.assert_array_equal(outs[j][0], xs[j] + xs[j])
            np.testing.assert_array_equal(outs[j][1], xs[j] + xs[j])
        np.testing.assert_array_equal(a, b)
    finally:
        pool.stop()


def test_worker_pool_rejects_bad_jobs_before_queueing_and_stops_cleanly():
    from shmproxy.shm import _workers
    pool = _workers.Workers(1, [0])
    x = np.ones(8, np.float16)
    bad = [
        [(_workers.REDUCE, 1, ops.DTYPE_CODE["e"], 8, [x.ctypes.data], [x.ctypes.data])],  # float16: numpy's
        [(_workers.REDUCE, 1, ops.DTYPE_CODE["f"], 8, [], [x.ctypes.data])],                 # no source
        [(_workers.COPY, x.ctypes.data, x.ctypes.data)],                                     # short tuple
        [(_workers.COPY, 0, x.ctypes.data, 8)],                                              # null address
        [(9, 1, 2, 3)],                                                                      # unknown kind
        [[_workers.COPY, x.ctypes.data, x.ctypes.data, 8]],                                  # not a tuple
    ]
    for steps in bad:
        with pytest.raises((ValueError, TypeError)):
            pool.run("bad", steps)
    with pytest.raises(TypeError, match="streaming"):
        pool.run("bad", [], False, "extra")
    assert pool.pending == 0
    t0 = time.monotonic()
    assert pool.wait(0.05) is False            # bounded: nothing in flight
    assert time.monotonic() - t0 < 5
    pool.done("py")                            # a Python worker's report joins the same list
    assert pool.wait(0.0) is True and pool.drain() == ["py"]
    pool.stop()
    pool.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        pool.copy("late", x.ctypes.data, x.ctypes.data, 2)
    with pytest.raises(ValueError, match="nthreads"):
        _workers.Workers(-1)


def test_worker_pool_help_runs_queued_jobs_on_the_caller():
    """Caller-runs: help(k) takes up to k queued jobs off the queue and runs them on the calling thread
    (GIL released), in order, reporting through the same finished list; with no threads of its own
    the pool runs jobs only there, so what help() did is exact."""
    from shmproxy.shm import _workers
    pool = _workers.Workers(0, None)
    try:
        srcs = [np.arange(100_000, dtype=np.float32) * (j + 1) for j in range(3)]
        dsts = [np.zeros(100_000, np.float32) for _ in range(3)]
        for j in range(3):
            pool.run(("job", j), [(_workers.COPY, dsts[j].ctypes.data, srcs[j].ctypes.data, srcs[j].nbytes)], True)
        pool.copy("last", dsts[0][:10].ctypes.data, srcs[1][:10].ctypes.data, 40)
        assert pool.pending == 4 and pool.wait(0.0) is False    # queued; no thread will take them
        assert pool.help(2) == 2
        assert pool.drain() == [("job", 0), ("job", 1)] and pool.pending == 2
        np.testing.assert_array_equal(dsts[0], srcs[0])
        np.testing.assert_array_equal(dsts[1], srcs[1])
        assert not dsts[2].any()                                 # still queued: not run
        assert pool.help(10) == 2 and pool.help(1) == 0           # the queue ran dry
        assert pool.drain() == [("job", 2), "last"] and pool.pending == 0
        np.testing.assert_array_equal(dsts[2], srcs[2])
        np.testing.assert_array_equal(dsts[0][:10], srcs[1][:10])
    finally:
        pool.stop()
    assert pool.help(1) == 0                                     # stopped: nothing runs


def test_worker_pool_help_races_the_workers_and_every_job_runs_once():
    """The loop's help() and the workers take jobs off one queue: each job runs exactly once
    (a job run twice would come back twice; one lost never comes back)."""
    from shmproxy.shm import _workers
    pool = _workers.Workers(2, None)
    try:
        njobs, n = 600, 4096
        src = np.random.default_rng(5).integers(0, 255, n * njobs, dtype=np.uint8)
        dst = np.zeros_like(src)
        for j in range(njobs):
            pool.copy(j, dst[j * n:].ctypes.data, src[j * n:].ctypes.data, n)
        got: list = []
        helped = 0
        deadline = time.monotonic() + 60
        while len(got) < njobs and time.monotonic() < deadline:
            helped += pool.help(1)
            got += pool.drain()
        got += pool.drain()
        assert sorted(got) == list(range(njobs)), (len(got), len(set(got)))
        assert pool.pending == 0 and 0 <= helped <= njobs
        np.testing.assert_array_equal(dst, src)
    finally:
        pool.stop()


def _new_thread_state(before: set[int], cpu: int, policy: int | None = None) -> str:
    """The scheduler state (/proc stat: "R", "S", ...) of the one thread this process started since
    ``before`` (thread ids), or "starting" until it has pinned itself to ``cpu`` alone (and taken
    scheduling ``policy``, when given), as the C threads of shm._workers do as they start."""
    import psutil
    tids = [t.id for t in psutil.Process().threads() if t.id not in before]
    if len(tids) != 1 or os.sched_getaffinity(tids[0]) != {cpu} or \
            (policy is not None and os.sched_getscheduler(tids[0]) != policy):
        return "starting"
    return pathlib.Path(f"/proc/self/task/{tids[0]}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_spread_workers_are_pinned_one_per_cpu_and_a_job_leaves_the_one_on_the_callers_cpu_asleep():
    """Workers(spread=True), the crowded node's pool: worker i is pinned to cpus[i] alone, and a job
    queued from a CPU does not wake that CPU's worker (the progress loop runs jobs there itself; a
    worker woken beside it preempted it and left the other CPU idle). wait() wakes any worker, and
    polls first when asked."""
    import psutil
    from shmproxy.shm import _workers
    cpu = sorted(os.sched_getaffinity(0))[0]
    mine = os.sched_getaffinity(0)
    before = {t.id for t in psutil.Process().threads()}
    pool = _workers.Workers(1, [cpu], True)

    def worker_state() -> str:
        return _new_thread_state(before, cpu)

    a, b = np.arange(1 << 16, dtype=np.uint8), np.zeros(1 << 16, np.uint8)
    try:
        os.sched_setaffinity(0, {cpu})       # this thread only: the worker's CPU
        deadline = time.monotonic() + 10
        while worker_state() != "S" and time.monotonic() < deadline:
            time.sleep(0.002)                # started, pinned, asleep on its condvar
        assert worker_state() == "S"
        pool.copy("here", b.ctypes.data, a.ctypes.data, a.nbytes)
        t_end = time.monotonic() + 0.05
        while time.monotonic() < t_end:      # not woken: the job stays queued, the worker asleep
            assert pool.pending == 1 and worker_state() == "S" and not b.any()
            time.sleep(0.005)
        assert pool.wait(10.0, 0.001) is True          # wait() wakes it; poll first, then sleep
        assert pool.drain() == ["here"] and pool.pending == 0
        np.testing.assert_array_equal(a, b)
        with pytest.raises(TypeError):
            pool.wait()
    finally:
        os.sched_setaffinity(0, mine)
        pool.stop()
    with pytest.raises(ValueError, match="spread"):
        _workers.Workers(1, None, True)


def test_keep_awake_guards_are_idle_priority_one_per_cpu_and_sleep_after_their_window():
    """shm._workers.KeepAwake: a SCHED_IDLE guard pinned to each CPU given; touch() opens a window
    in which they spin, after which they sleep (an idle job costs no CPU); stop() is idempotent."""
    import psutil
    from shmproxy.shm import _workers
    cpus = sorted(os.sched_getaffinity(0))[:2]
    before = {t.id for t in psutil.Process().threads()}
    k = _workers.KeepAwake(cpus, 0.02)
    try:
        assert k.nthreads == len(cpus) and not k.spinning
        deadline = time.monotonic() + 10
        while True:   # the guards name, pin and demote themselves as they start
            guards = [t.id for t in psutil.Process().threads() if t.id not in before]
            names = [pathlib.Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in guards]
            masks = sorted(c for t in guards for c in os.sched_getaffinity(t))
            pols = [os.sched_getscheduler(t) for t in guards]
            if (masks == cpus and pols == [os.SCHED_IDLE] * len(cpus)) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert names == ["shmproxy-awake"] * len(cpus) and masks == cpus, (names, masks)
        assert pols == [os.SCHED_IDLE] * len(cpus), pols
        k.touch()
        assert k.spinning
        time.sleep(0.1)
        assert not k.spinning
        cpu0 = psutil.Process().cpu_times()
        time.sleep(0.3)
        cpu1 = psutil.Process().cpu_times()
        assert (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system) < 0.1   # asleep, not spinning
    finally:
        k.stop()
        k.stop()
    assert k.nthreads == 0
    k.touch()                                   # harmless once stopped
    with pytest.raises(ValueError, match="window"):
        _workers.KeepAwake(cpus, 0)
    with pytest.raises(ValueError, match="cpus"):
        _workers.KeepAwake([], 0.01)


def test_keep_awake_guard_hands_the_cpu_back_to_a_thread_that_yields():
    """A thread that sched_yield()s on a CPU where a guard was just woken gets the CPU back at once.
    A yield is no wake-up, so nothing preempts the idle-priority guard it handed the CPU to: on the
    VM's kernel (6.18, EEVDF) a freshly woken guard kept it for its whole window, which made 1 % of
    the 4 MiB round trips take 1.2-2 ms (the progress loop touches the guards, then yields). The
    guards yield between their pause bursts. Unfixed, every yield here took the window (20 ms)."""
    import psutil
    from shmproxy.shm import _workers
    cpu = sorted(os.sched_getaffinity(0))[0]
    before = {t.id for t in psutil.Process().threads()}
    k = _workers.KeepAwake([cpu], 0.02)
    mine = os.sched_getaffinity(0)

    def guard_state() -> str:
        return _new_thread_state(before, cpu, os.SCHED_IDLE)   # it pins and demotes itself as it starts

    gaps = []
    try:
        os.sched_setaffinity(0, {cpu})       # this thread only, beside the guard
        for _ in range(12):
            deadline = time.monotonic() + 10
            while guard_state() != "S" and time.monotonic() < deadline:
                time.sleep(0.002)            # until its window ran out and it sleeps on its condvar
            k.touch()                        # wakes it (idle priority: it does not preempt us)
            t0 = time.perf_counter_ns()
            os.sched_yield()
            gaps.append(time.perf_counter_ns() - t0)
    finally:
        os.sched_setaffinity(0, mine)
        k.stop()
    gaps.sort()
    assert gaps[len(gaps) // 2] < 2_000_000, f"median yield {gaps[len(gaps) // 2] / 1e3:.0f} us: {gaps}"


def _two_cpus() -> tuple[int, int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: the guard's and the waker's")
    return cpus[0], cpus[1]


def _sleeper_on(cpu: int, area: np.ndarray, results: list) -> threading.Thread:
    """A thread pinned to ``cpu`` that sleeps on a rank area's futex word as a rank does (comm.py,
    _sleep_slice: WAITING = (CPU + 1) | word << 32), for at most 10 s; appends how long it slept."""
    wake_addr = area.ctypes.data + 8 * P.RANK_WAKE

    def sleep() -> None:
        os.sched_setaffinity(0, {cpu})
        word = int(area.view(np.uint32)[2 * P.RANK_WAKE])
        area[P.RANK_WAITING] = P.waiting_value(_native.getcpu(), word)
        t0 = time.monotonic()
        _native.futex_wait(wake_addr, word, 10.0)
        area[P.RANK_WAITING] = 0
        results.append(time.monotonic() - t0)
    t = threading.Thread(target=sleep, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not area[P.RANK_WAITING] and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)   # into the futex
    return t


def test_wake_owners_bumps_every_word_and_wakes_sleepers_but_not_relayed_ones():
    """_native.wake_owners (the wake-ups of ProgressEngine.wake_ranks and of complete_coll): every
    owner's futex word moves by one; a rank that said it sleeps is woken, unless its CPU's bit is set
    in ``relayed`` (its guard's job); a negative rank is refused before anything is touched."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    per = P.RANK_AREA_BYTES // 8
    areas = np.zeros(3 * per, np.uint64)
    words = areas.view(np.uint32)[2 * P.RANK_WAKE::2 * per]

    slept: list = []
    sleeper = _sleeper_on(cpu, areas[per:2 * per], slept)
    _native.wake_owners(areas.ctypes.data, 0, (1,), 1 << cpu)      # relayed: bumped, left asleep
    assert list(words) == [0, 1, 0]
    time.sleep(0.2)                                                  # a wrong wake-up would land here
    assert sleeper.is_alive() and not slept
    _native.futex_wake(areas.ctypes.data + 8 * (per + P.RANK_WAKE), 1)   # as the guard would
    sleeper.join(10)
    assert slept and slept[0] < 5

    sleeper = _sleeper_on(cpu, areas[per:2 * per], slept)
    _native.wake_owners(areas.ctypes.data, 0, [0, 1, 2])
    sleeper.join(10)
    assert len(slept) == 2 and slept[1] < 5 and list(words) == [1, 2, 1]
    with pytest.raises(ValueError, match="negative"):
        _native.wake_owners(areas.ctypes.data, 0, (2, -1))
    assert list(words) == [1, 2, 1]


def test_keep_awake_guard_wakes_a_rank_asleep_on_its_cpu_so_the_waker_needs_no_ipi():
    """"Relayed wake-ups" (shm/_workers.c): a live guard wakes the ranks that sleep on its CPU once
    their futex word moved, so a waker on another CPU only bumps the word (live_mask tells it which
    CPUs those are; never its own). A wake-up sent from another vCPU cost the waker ~12 us and the
    wakee ~23 us on the VM. Broken, the sleeper here would sleep its whole 10 s."""
    from shmproxy.shm import _workers
    guard_cpu, my_cpu = _two_cpus()
    mine = os.sched_getaffinity(0)
    area = np.zeros(P.RANK_AREA_BYTES // 8, np.uint64)
    k = _workers.KeepAwake([guard_cpu], 1.0, None, area.ctypes.data, 1)
    slept: list = []
    try:
        os.sched_setaffinity(0, {my_cpu})
        sleeper = _sleeper_on(guard_cpu, area, slept)
        k.touch()
        deadline = time.monotonic() + 10
        while not k.live_mask() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert k.live_mask() == 1 << guard_cpu
        _native.fetch_add_u32(area.ctypes.data + 8 * P.RANK_WAKE, 1)   # a completion, no wake-up
        sleeper.join(10)
        assert slept and slept[0] < 5, slept
    finally:
        os.sched_setaffinity(0, mine)
        k.stop()
    assert k.live_mask() == 0      # stopped guards wake nobody: the waker does it again


def test_keep_awake_guard_wakes_the_spread_workers_pinned_to_its_cpu():
    """A job queued while a live guard runs on its worker's CPU wakes no worker from the queueing
    thread: the guard does, locally. Broken, the worker would never be woken (wait() leaves it to
    the guard too) and the job would not finish."""
    from shmproxy.shm import _workers
    guard_cpu, my_cpu = _two_cpus()
    mine = os.sched_getaffinity(0)
    pool = _workers.Workers(1, [guard_cpu], True)
    area = np.zeros(P.RANK_AREA_BYTES // 8, np.uint64)
    k = _workers.KeepAwake([guard_cpu], 1.0, pool, area.ctypes.data, 1)
    src = np.arange(1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    try:
        os.sched_setaffinity(0, {my_cpu})
        k.touch()
        deadline = time.monotonic() + 10
        while not k.live_mask() and time.monotonic() < deadline:
            time.sleep(0.001)
        for i in range(20):
            dst[:] = 0
            pool.copy(i, dst.ctypes.data, src.ctypes.data, src.nbytes)
            assert pool.wait(5.0), f"job {i} did not finish"
            assert pool.drain() == [i] and np.array_equal(dst, src)
        with pytest.raises(RuntimeError, match="already has guards"):
            _workers.KeepAwake([guard_cpu], 1.0, pool)
    finally:
        os.sched_setaffinity(0, mine)
        k.stop()
        pool.stop()
    with pytest.raises(TypeError, match="Workers pool"):
        _workers.KeepAwake([guard_cpu], 1.0, object())


def test_a_relayed_wake_up_the_guard_did_not_deliver_is_delivered_by_the_loop():
    """ProgressEngine.check_relayed: a rank left to a guard to wake and still asleep on the same word
    after RELAY_GRACE_NS is woken by the loop (a guard preempted just after it proved live); one that
    woke is forgotten."""
    import types
    from shmproxy.engine.progress import ProgressEngine
    cpu = sorted(os.sched_getaffinity(0))[0]
    area = np.zeros(P.RANK_AREA_BYTES // 8, np.uint64)
    slept: list = []
    sleeper = _sleeper_on(cpu, area, slept)
    wake_addr = area.ctypes.data + 8 * P.RANK_WAKE
    _native.fetch_add_u32(wake_addr, 1)        # completed; nobody woke it
    eng = types.SimpleNamespace(q=area, relayed=[])
    eng.relayed.append((time.monotonic_ns() + 10**9, P.RANK_WAITING, int(area[P.RANK_WAITING]), wake_addr))
    ProgressEngine.check_relayed(eng)          # within its grace: kept, not woken
    assert len(eng.relayed) == 1 and sleeper.is_alive()
    eng.relayed[0] = (0,) + eng.relayed[0][1:]
    ProgressEngine.check_relayed(eng)          # late: the loop wakes it itself
    sleeper.join(10)
    assert slept and slept[0] < 5 and eng.relayed == []
    eng.relayed.append((0, P.RANK_WAITING, 12345, wake_addr))
    ProgressEngine.check_relayed(eng)          # it woke (WAITING changed): forgotten
    assert eng.relayed == []


def test_the_loop_remembers_only_the_ranks_a_guard_is_to_wake():
    """ProgressEngine._note_relayed: after a wake-up left to keep-awake guards (bits of ``relayed``),
    the ranks asleep on such a CPU are remembered for check_relayed; one asleep elsewhere (woken
    directly) or awake is not."""
    import types
    from shmproxy.engine.progress import ProgressEngine
    per = P.RANK_AREA_BYTES // 8
    area = np.zeros(3 * per, np.uint64)
    words = [(0, area.ctypes.data + 8 * (r * per + P.RANK_WAKE), r * per + P.RANK_WAITING) for r in range(3)]
    area[P.RANK_WAITING] = P.waiting_value(5, 7)            # rank 0 asleep on CPU 5: a guard's
    area[per + P.RANK_WAITING] = P.waiting_value(6, 7)      # rank 1 asleep on CPU 6: woken directly
    eng = types.SimpleNamespace(q=area, relayed=[], rank_words=words)  # rank 2 awake
    ProgressEngine._note_relayed(eng, (0, 1, 2), 1 << 5)
    assert [(w, v, a) for _d, w, v, a in eng.relayed] == [(P.RANK_WAITING, P.waiting_value(5, 7), words[0][1])]
    ProgressEngine._note_relayed(eng, (1, 2), 1 << 5)
    assert len(eng.relayed) == 1


# ------------------------------------------------------------------------------------ params
def test_params_defaults_env_and_overrides():
    p = params_mod.Params(env={})
    assert p.PROGRESS_APPENDOP_FREQ == 8 and p.APPEND_BATCH_SIZE == 16 and p.STEPS == 8
    assert p.TIMEOUT == 600.0 and p.DUMP_SIGNAL == 0
    assert p.KEEP_AWAKE_US == -1.0   # automatic: on only when the ranks and the progress process share cores
    assert p.LOOP_COPIES == -1       # automatic likewise
    assert p.LOOP_POLL_US == -1.0    # automatic: polls only where the loop runs copy jobs itself
    assert p.COPY_STREAMING is True and p.STREAMING_MIN_BYTES == -1   # automatic: by the cache
    assert params_mod.Params(env={"SHMPROXY_STREAMING_MIN_BYTES": "auto"}).STREAMING_MIN_BYTES == -1
    assert params_mod.Params(env={"SHMPROXY_STREAMING_MIN_BYTES": "8M"}).STREAMING_MIN_BYTES == 8 << 20
    p = params_mod.Params(env={"SHMPROXY_CHUNK_SIZE": "1M", "SHMPROXY_DUMP_SIGNAL": "USR1"},
                          overrides={"steps": 4})
    assert p.CHUNK_SIZE == 1 << 20 and p.DUMP_SIGNAL == 10 and p.STEPS == 4
    origins = {x.name: x.origin for x in p.items()}
    assert origins["CHUNK_SIZE"] == "environment" and origins["STEPS"] == "override"
    assert params_mod.Params(env=p.to_env()).CHUNK_SIZE == 1 << 20
    assert "SHMPROXY_STEPS" in p.dump()
    # the eager limit is EAGER_BYTES capped at one chunk, for the loop and Wait's spin alike
    assert p.eager_limit == 512 << 10
    assert params_mod.Params(env={"SHMPROXY_CHUNK_SIZE": "64K"}).eager_limit == 64 << 10


@pytest.mark.parametrize("env", [{"SHMPROXY_STEPS": "eight"}, {"SHMPROXY_STEPS": "0"},
                                 {"SHMPROXY_DEBUG": "LOUD"}, {"SHMPROXY_PROXY_CPUS": "3-1"},
                                 {"SHMPROXY_NO_SUCH_THING": "1"}, {"SHMPROXY_DUMP_SIGNAL": "SIGNOPE"},
                                 {"SHMPROXY_DEBUG_SUBSYS": "INIT,BOGUS"}, {"SHMPROXY_APPEND_BATCH_SIZE": "1025"},
                                 {"SHMPROXY_LOOP_COPIES": "2"}, {"SHMPROXY_LOOP_POLL_US": "-2"},
                                 {"SHMPROXY_STREAMING_MIN_BYTES": "-2"}, {"SHMPROXY_STREAMING_MIN_BYTES": "big"},
                                 {"SHMPROXY_COLL_CHUNK_SIZE": "-3"}])
def test_bad_param_values_raise(env):
    with pytest.raises(errors.InvalidArgument, match="SHMPROXY_"):
        params_mod.Params(env=env)


def test_unknown_override_raises():
    with pytest.raises(errors.InvalidArgument):
        params_mod.Params(env={}, overrides={"stepz": 3})


def test_streaming_threshold_follows_the_params_and_the_cache(monkeypatch):
    """A collective streams once it writes more than the threshold: never with COPY_STREAMING=0, an
    explicit STREAMING_MIN_BYTES as given; automatically always where the progress process has cores
    of its own, and on a crowded node (the loop runs copy jobs) above half the last-level cache, at
    most 16 MiB (16 MiB when the cache is unknown)."""
    from shmproxy.engine import affinity, progress
    def threshold(env, llc, crowded=True):
        monkeypatch.setattr(affinity, "last_level_cache_bytes", lambda cpu: llc)
        return progress.streaming_threshold(params_mod.Params(env=env), [0, 1], crowded)
    assert threshold({}, 8 << 20) == 4 << 20
    assert threshold({}, 300 << 20) == 16 << 20 == progress.AUTO_STREAMING_MIN_BYTES
    assert threshold({}, 0) == 16 << 20
    assert threshold({}, 8 << 20, crowded=False) == 0
    assert threshold({"SHMPROXY_STREAMING_MIN_BYTES": "0"}, 300 << 20) == 0
    assert threshold({"SHMPROXY_STREAMING_MIN_BYTES": "1M"}, 8 << 20, crowded=False) == 1 << 20
    assert threshold({"SHMPROXY_COPY_STREAMING": "0", "SHMPROXY_STREAMING_MIN_BYTES": "0"}, 8 << 20) >= 1 << 62


def test_coll_chunk_limit_is_one_chunk_per_cpu_where_the_loop_runs_jobs():
    from shmproxy.engine import progress
    p = params_mod.Params(env={})
    assert progress.coll_chunk_limit(p, loop_copies=False) == p.CHUNK_SIZE == 512 << 10
    assert progress.coll_chunk_limit(p, loop_copies=True) == progress.AUTO_CROWDED_COLL_CHUNK == 4 << 20
    p = params_mod.Params(env={"SHMPROXY_COLL_CHUNK_SIZE": "64K"})
    assert progress.coll_chunk_limit(p, True) == progress.coll_chunk_limit(p, False) == 64 << 10


def test_written_bytes_counts_every_output_and_streaming_schedules_mark_theirs():
    C, wb = sched_mod.Coll, sched_mod.written_bytes
    assert wb(C.ALLREDUCE, 1000, 4, 3) == 12_000            # every rank's recvbuf
    assert wb(C.REDUCE, 1000, 4, 3) == 4_000                 # the root's alone
    assert wb(C.BCAST, 1000, 8, 4) == 24_000                 # all but the root
    assert wb(C.ALLGATHER, 10, 2, 3) == 180                  # count per rank's block, size blocks each
    assert wb(C.ALLTOALL, 10, 2, 3) == 180
    assert wb(C.REDUCE_SCATTER_BLOCK, 10, 4, 3) == 120       # count per rank's result
    assert wb(C.BARRIER, 0, 1, 5) == 0
    make = sched_mod.streaming_schedules(lambda k: sched_mod.Schedule([sched_mod.Entry(sched_mod.NOP)]))
    assert make(0).streaming is True
    assert sched_mod.Schedule([]).streaming is False


# ------------------------------------------------------------------------------------ fetch policy
def test_fetch_policy():
    # Nothing active: block (spin, then a bounded condvar sleep).
    assert fetch_mode(idle=True, nactive=0, passes=3, appendop_freq=8) == FetchMode.BLOCK
    assert fetch_mode(idle=False, nactive=0, passes=3, appendop_freq=8) == FetchMode.BLOCK
    # Work in hand: only trylock, and only when idle or every FREQ passes.
    assert fetch_mode(idle=True, nactive=2, passes=3, appendop_freq=8) == FetchMode.TRY
    assert fetch_mode(idle=False, nactive=2, passes=3, appendop_freq=8) == FetchMode.NONE
    assert fetch_mode(idle=False, nactive=2, passes=16, appendop_freq=8) == FetchMode.TRY
    modes = [fetch_mode(False, 1, p, 8) for p in range(1, 65)]
    assert modes.count(FetchMode.TRY) == 8



@pytest.mark.parametrize("crowded", [False, True])
def test_idle_spin_is_skipped_once_after_large_work_on_a_crowded_node(crowded):
    """After completing what the copy workers moved, a crowded node's loop sleeps at once (leaves
    the CPUs to the ranks it woke); otherwise, and the time after, it polls its spin window."""
    import types
    from shmproxy.engine.progress import ProgressEngine
    i32 = np.full(P.NEXT_OPS_OFF // 4 + 1, -1, np.int32)           # an empty posted chain
    from shmproxy.shm import _workers
    awake = _workers.KeepAwake(sorted(os.sched_getaffinity(0))[:1], 1.0) if crowded else None
    q = np.zeros(P.PENDING_MASK_OFF // 8 + 1, np.uint64)                # nothing handed off
    eng = types.SimpleNamespace(spin_ns=30_000_000, spin_skip=False, crowded=crowded, awake=awake,
                                view=types.SimpleNamespace(i32=i32), q=q, _should_exit=lambda: False)

    def spin() -> float:
        t0 = time.monotonic()
        ProgressEngine._spin_for_work(eng)
        return time.monotonic() - t0
    ProgressEngine.complete_large(eng)
    assert eng.spin_skip is crowded
    if awake is not None:           # and the keep-awake guards spin through the hand-off
        assert awake.spinning
        awake.stop()
    first, second = spin(), spin()
    assert (first < 0.015) is crowded and second >= 0.03 and not eng.spin_skip
    q[P.PENDING_MASK_OFF // 8] = 1 << 1           # a chain handed off ends the spin
    assert spin() < 0.015


# ------------------------------------------------------------------------------------ transports
def test_registry_selects_shm_on_one_host_and_names_both_peers_otherwise():
    a = PeerInfo(0, 0, "hostA", 100)
    b = PeerInfo(1, 1, "hostA", 101)
    c = PeerInfo(2, 0, "hostB", 200)
    assert transports.select(a, b).name == "shm"
    with pytest.raises(errors.InvalidUsage, match=r"rank 0 \(host hostA.*rank 2 \(host hostB"):
        transports.select(a, c)


def test_contract_check_rejects_incomplete_transports():
    class NoProgress(Transport):
        name = "broken"

        def can_connect(self, me, peer):
            return True

    class Named(Transport):
        def can_connect(self, me, peer):
            return True

        def proxy_progress(self, engine, args):
            return True

    with pytest.raises(TypeError):
        check_transport(NoProgress())  # abstract method missing: cannot even be instantiated
    with pytest.raises(TypeError, match="no name"):
        check_transport(Named())


# ------------------------------------------------------------------------------------ args pool
def test_args_pool_recycles_and_mirrors_counters(pool):
    _seg, view = pool

    class FakeOp:
        kind, rank, peer, tag = ops.KIND_SEND, 0, 1, 5

    ap = ArgsPool(view)
    seen_args = set()
    for round_ in range(5):
        a = ap.get_args((0, 1), round_, None)
        t = Transfer(FakeOp(), FakeOp(), 3000, 0)
        s = ap.add_sub(a, t, 1000, 2000, 3000, 1024)
        assert s.nsteps == 3 and t.parts_left == 1
        s.posted, s.transmitted, s.received, s.done = 3, 3, 3, 2
        ap.mirror(s)
        entry = view.read_sub(s.slot)
        assert entry[0] == P.SUB_READY and entry[7:11] == (3, 3, 3, 2)
        ap.release(a)
        assert view.read_sub(s.slot)[0] == P.SUB_FREE
        seen_args.add(id(a))
    assert len(seen_args) == 1 and ap.allocated_args == 64  # one block, recycled
    assert len(ap.free_slots) == view.layout.max_subs


@pytest.mark.parametrize("n", [0, 5, 4095, 4096, 100_003, (1 << 20) + 7])
@pytest.mark.parametrize("src_off,dst_off", [(0, 0), (3, 8), (8, 5)])
def test_streaming_copy_is_exact_and_stays_in_bounds(n, src_off, dst_off):
    src = np.random.default_rng(n).integers(0, 255, n + 64, dtype=np.uint8)
    dst = np.zeros(n + 64, np.uint8)
    s = _native.buffer_info(src, False)[0] + src_off
    d = _native.buffer_info(dst, True)[0] + dst_off
    _native.memcopy_nt(d, s, n)
    assert np.array_equal(dst[dst_off:dst_off + n], src[src_off:src_off + n])
    assert not dst[:dst_off].any() and not dst[dst_off + n:].any()


# ------------------------------------------------------------------------------------ host probe
def test_host_probe_measures_and_cleans_up():
    """tools/host_probe: bandwidth is a positive rate; interference times the work against every other
    CPU and leaves no streamer process behind (the leak guard checks)."""
    from shmproxy.tools import hostprobe
    assert hostprobe.bandwidth(1, "add", reps=1) > 0
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("interference needs two CPUs")
    res = hostprobe.interference(cpus[0], cpus[1:2])
    assert len(res) == 1 and res[0][1] == cpus[1] and res[0][0] > 0
    assert sorted(os.sched_getaffinity(0)) == cpus     # the caller is not left pinned to cpus[0]


def test_host_probe_speed_times_every_cpu(capsys):
    """host_probe speed times the work on every CPU the caller may use, once per round, prints one line
    per round with the slowest/fastest ratio, and leaves the caller's affinity as it was."""
    from shmproxy.tools import hostprobe
    cpus = sorted(os.sched_getaffinity(0))
    res = hostprobe.speed(cpus, rounds=2)
    assert len(res) == 2
    for times, steal in res:
        assert sorted(times) == cpus and all(t > 0 for t in times.values())
        assert steal is None or 0 <= steal <= 100
    assert sorted(os.sched_getaffinity(0)) == cpus
    assert hostprobe.main(["speed", "--rounds", "1"]) == 0
    line, = capsys.readouterr().out.splitlines()
    assert line.startswith("round 1: ms per CPU ") and "slowest/fastest" in line
    assert [int(c.split(":")[0]) for c in line.split("|")[0].split()[5:]] == cpus
    assert sorted(os.sched_getaffinity(0)) == cpus


def test_transports_parameter_restricts_the_registry_and_names_unknown_ones() -> None:
    from shmproxy import transports
    from shmproxy.core.params import Params
    assert transports.allowed(Params(env={}).TRANSPORTS) == transports.REGISTRY
    assert [t.name for t in transports.allowed(Params(env={"SHMPROXY_TRANSPORTS": " SHM "}).TRANSPORTS)] == ["shm"]
    with pytest.raises(shmproxy.InvalidArgument, match="nosuch.*registered: shm"):
        transports.allowed(Params(env={"SHMPROXY_TRANSPORTS": "shm,nosuch"}).TRANSPORTS)
    with pytest.raises(shmproxy.InvalidArgument):
        Params(env={"SHMPROXY_TRANSPORTS": "a b"})
