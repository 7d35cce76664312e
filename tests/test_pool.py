"""The ops pool in shared memory: its layout and record formats, the posted chain the progress process
takes, completion slots, segments, and the native lock protocol (robust mutex, bounded waits, futex),
and the args pool that mirrors transfer counters into it. Single process (forks where a test needs
another process)."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from shmproxy.core import errors, ops, params as params_mod
from shmproxy.engine.args import ArgsPool, Transfer
from shmproxy.shm import _native, _poster, pool as P, sync
from shmproxy.shm.segment import MemfdBuffer, Segment
from tests.unit_helpers import _taker


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
    a.close()
    b.close()
    a.close()  # idempotent


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
    t.start()
    t.join(5)
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
        t.start()
        t.join(5)
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
