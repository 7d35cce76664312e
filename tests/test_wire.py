"""The collective sockets of a link (shm/_wire.c), in-process over socketpairs: frames split over the
sockets land byte-exact whether their receive was posted first or last, folding receives reduce as
numpy does in the schedule's operand order, and every broken protocol or connection is a reason the
loop gets once (never a hang, never a write outside a receive). Jobs across nodes that use the wire
are in tests/test_multinode.py."""
from __future__ import annotations

import socket
import struct
import sys
import time

import numpy as np
import pytest

from shmproxy.core.ops import DTYPE_CODE, ReduceOp
from shmproxy.shm import _wire
from shmproxy.transports import net_wire as W

BOUND_S = 10.0


def wires(nsocks: int, part_min: int = 4096, max_total: int = 1 << 24,
          direct: int = 0) -> tuple[_wire.Wire, _wire.Wire, list]:
    """Two wires joined by ``nsocks`` socketpairs (no pool: the tests poll); ``direct``: their
    direct_max (frames up to it written by the sender, landed by recv())."""
    a = _wire.Wire(1, nsocks, 0, part_min, max_total, direct)
    b = _wire.Wire(0, nsocks, 0, part_min, max_total, direct)
    for i in range(nsocks):
        x, y = socket.socketpair()
        for s in (x, y):   # small buffers: every part crosses in many partial transfers
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
        a.attach(i, x.detach())
        b.attach(i, y.detach())
    return a, b, []


def collect(w: _wire.Wire, want: int) -> list[int]:
    """Tokens until ``want`` came (bounded); the link must not break meanwhile."""
    got: list[int] = []
    deadline = time.monotonic() + BOUND_S
    while len(got) < want:
        tokens, lost = w.poll()
        assert lost is None, lost
        got += tokens
        assert time.monotonic() < deadline, f"{len(got)} of {want} tokens in {BOUND_S} s"
    return got


def post_late_and_check(b: _wire.Wire, late: set, srcs: list, dsts: list, tok0: int) -> None:
    """Frame i (key k<i>, bytes srcs[i]) was sent to ``b``, whose receive into dsts[i] (token tok0 + i)
    is posted already unless i is in ``late``: post those now, take every receive's token (or its
    done-now), and check that each destination holds its frame and nothing past it."""
    done_now = set()
    for i in sorted(late):
        if b.recv(b"k%d" % i, dsts[i].ctypes.data, srcs[i].nbytes, tok0 + i):
            done_now.add(tok0 + i)
    got = set(collect(b, len(srcs) - len(done_now))) | done_now
    assert got == {tok0 + i for i in range(len(srcs))}
    for s, d in zip(srcs, dsts):
        assert np.array_equal(d[:s.nbytes], s) and not d[s.nbytes:].any()


def lost_reason(w: _wire.Wire) -> str:
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        _tokens, lost = w.poll()
        if lost is not None:
            return lost
    raise AssertionError("the wire never said it was lost")


@pytest.mark.parametrize("nsocks", [1, 3])
def test_frames_land_byte_exact_whether_posted_first_or_last(nsocks):
    a, b, _ = wires(nsocks)
    rng = np.random.default_rng(1)
    sizes = [0, 1, 4095, 4096, 4097, 100_000, 1 << 20, (1 << 20) + 3] * 3
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dsts = [np.zeros(n + 64, np.uint8) for n in sizes]   # 64 B of guard after each
    early = set(range(0, len(sizes), 2))
    try:
        for i, d in enumerate(dsts):
            if i not in early:
                assert not b.recv(b"k%d" % i, d.ctypes.data, sizes[i], 100 + i)
        for i, s in enumerate(srcs):
            a.send(b"k%d" % i, s.ctypes.data, s.nbytes, 200 + i)
        assert sorted(collect(a, len(srcs))) == [200 + i for i in range(len(srcs))]
        post_late_and_check(b, early, srcs, dsts, 100)
        assert b.describe()["frames_early"] == 0 and b.describe()["receives_posted"] == 0
        assert a.describe()["bytes_out"] == b.describe()["bytes_in"]
    finally:
        a.close(BOUND_S)
        b.close(BOUND_S)
    assert a.poll() == ([], None) and b.poll() == ([], None), "a clean close is no loss"


@pytest.mark.parametrize("dtype,op", [(np.float32, ReduceOp.SUM), (np.float64, ReduceOp.PROD),
                                      (np.int32, ReduceOp.MAX), (np.uint8, ReduceOp.SUM)])
def test_a_folding_receive_lands_first_operand_op_frame_as_numpy_does(dtype, op):
    """Posted first (the reader folds as it reads) and last (the copier folds what the stash held),
    with a count that does not fill the reader's 64 KiB pieces evenly."""
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MAX: np.maximum}[op]
    a, b, _ = wires(2)
    rng = np.random.default_rng(2)
    n = 300_007
    x = (rng.random(n) * 100).astype(dtype)
    y = (rng.random(n) * 100).astype(dtype)
    code = DTYPE_CODE[np.dtype(dtype).char]
    try:
        for when in ("posted first", "posted last"):
            out = np.zeros(n + 8, dtype)
            key = when.encode()
            if when == "posted first":
                assert not b.recv(key, out.ctypes.data, x.nbytes, 1, int(op), code, x.ctypes.data)
            a.send(key, y.ctypes.data, y.nbytes, 2)
            collect(a, 1)
            if when == "posted last":
                deadline = time.monotonic() + BOUND_S
                while b.describe()["frames_early"] == 0:   # (parts still arriving are landed either way)
                    assert time.monotonic() < deadline
                assert not b.recv(key, out.ctypes.data, x.nbytes, 1, int(op), code, x.ctypes.data)
            assert collect(b, 1) == [1]
            assert np.array_equal(out[:n], ufunc(x, y)), when
            assert not out[n:].any()
    finally:
        a.close(BOUND_S)
        b.close(BOUND_S)


@pytest.mark.parametrize("when", ["posted first", "posted last"])
@pytest.mark.parametrize("fold", [False, True])
def test_a_receive_forwards_what_it_landed_on_another_wire(when, fold):
    """Three nodes in a line, a -> (b | c) -> d: b's receive names c's wire as ``then``, so what lands
    in b (folded, when it folds) goes on to d the moment it is all in, from the thread that landed it
    (the reader, or the copier for a frame that came first), and both b's and c's tokens come."""
    a, b, _ = wires(3)
    c, d, _ = wires(2)
    n = 300_001
    rng = np.random.default_rng(3)
    x, y = rng.random(n).astype(np.float32), rng.random(n).astype(np.float32)
    mid, out = np.zeros(n, np.float32), np.zeros(n + 16, np.float32)
    fold_args = (int(ReduceOp.SUM), DTYPE_CODE["f"], x.ctypes.data) if fold else (-1, 0, 0)
    refs = sys.getrefcount(c)
    try:
        assert not d.recv(b"k2", out.ctypes.data, x.nbytes, 40)
        if when == "posted last":
            a.send(b"k1", y.ctypes.data, y.nbytes, 10)
            collect(a, 1)
            deadline = time.monotonic() + BOUND_S
            while b.describe()["frames_early"] == 0:
                assert time.monotonic() < deadline
        assert not b.recv(b"k1", mid.ctypes.data, x.nbytes, 20, *fold_args, c, b"k2", 30)
        if when == "posted first":
            a.send(b"k1", y.ctypes.data, y.nbytes, 10)
            collect(a, 1)
        assert collect(b, 1) == [20]
        assert collect(c, 1) == [30]
        assert collect(d, 1) == [40]
        want = x + y if fold else y
        assert np.array_equal(mid, want) and np.array_equal(out[:n], want) and not out[n:].any()
        assert b.describe()["forwarded"] == 1 and c.describe()["bytes_out"] == d.describe()["bytes_in"]
        b.poll()
        assert sys.getrefcount(c) == refs, "the chain's reference on the other wire is released"
    finally:
        for w in (a, b, c, d):
            w.close(BOUND_S)


def test_a_receive_forwards_back_on_its_own_wire_and_an_unfired_chain_lets_go():
    """Two nodes: the ring's next step goes back to the node it came from (then = the same wire).
    A chain whose receive is cancelled, or whose wire is closed, never fires and holds no reference."""
    a, b, _ = wires(2)
    src, mid, back = np.arange(1000, dtype=np.uint8), np.zeros(1000, np.uint8), np.zeros(1000, np.uint8)
    other = _wire.Wire(9, 1, 0, 4096, 1 << 20)
    refs = sys.getrefcount(other)
    try:
        assert not a.recv(b"back", back.ctypes.data, 1000, 1)
        assert not b.recv(b"go", mid.ctypes.data, 1000, 2, -1, 0, 0, b, b"back", 3)
        a.send(b"go", src.ctypes.data, 1000, 4)
        assert sorted(collect(a, 2)) == [1, 4]
        assert sorted(collect(b, 2)) == [2, 3]
        assert np.array_equal(back, src)
        assert not b.recv(b"never", mid.ctypes.data, 1000, 5, -1, 0, 0, other, b"x", 6)
        assert sys.getrefcount(other) == refs + 1
        assert b.cancel() == 1
        assert sys.getrefcount(other) == refs
        with pytest.raises(TypeError):
            b.recv(b"k", mid.ctypes.data, 1000, 7, -1, 0, 0, object(), b"x", 8)
        with pytest.raises(ValueError):
            b.recv(b"k", mid.ctypes.data, 2 << 20, 7, -1, 0, 0, other, b"x", 8)   # past other's frame limit
        assert sys.getrefcount(other) == refs
    finally:
        for w in (a, b, other):
            w.close(BOUND_S)


@pytest.mark.parametrize("nsocks", [1, 2])
def test_small_frames_go_out_and_land_without_the_wires_threads_and_never_interleave(nsocks):
    """Frames up to direct_max are written by send() itself when their socket is idle (done at once:
    no token), the rest of one that does not fit in the socket's buffer by its writer, after it and
    before anything queued behind; one that came whole before its receive is landed by recv(). Small
    and large frames (queued, written by the writer threads) mixed on the same sockets land
    byte-exact, so a direct write never cuts into a part the writer is writing."""
    direct = 48 << 10   # above the test sockets' 32 KiB buffers: some direct writes end part-way
    a, b, _ = wires(nsocks, part_min=64 << 10, direct=direct)
    rng = np.random.default_rng(4)
    sizes = [int(x) for x in rng.choice([1, 8, 4096, 40_000, direct, 300_000, 1 << 20], 120)]
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dsts = [np.zeros(n + 32, np.uint8) for n in sizes]
    late = set(range(0, len(sizes), 3))
    try:
        for i in range(len(sizes)):
            if i not in late:
                assert not b.recv(b"k%d" % i, dsts[i].ctypes.data, sizes[i], 1000 + i)
        queued, sent = [], []
        for i, x in enumerate(srcs):
            if i % 4 == 0:   # now and then the sockets go idle (a direct write's chance), else they are busy
                sent += collect(a, len(queued) - len(sent))
            if not a.send(b"k%d" % i, x.ctypes.data, x.nbytes, i):
                queued.append(i)
        assert all(sizes[i] <= direct for i in set(range(len(sizes))) - set(queued))
        assert sorted(sent + collect(a, len(queued) - len(sent))) == queued
        post_late_and_check(b, late, srcs, dsts, 1000)
        da, db = a.describe(), b.describe()
        assert da["written_direct"] > 0 and da["bytes_out"] == db["bytes_in"] and db["frames_early"] == 0
    finally:
        a.close(BOUND_S)
        b.close(BOUND_S)


def test_a_small_frame_that_came_first_is_landed_by_recv_itself():
    a, b, _ = wires(1, direct=16 << 10)
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, np.uint8)
    try:
        assert a.send(b"k", src.ctypes.data, src.nbytes, 1), "an idle socket takes a small frame at once"
        deadline = time.monotonic() + BOUND_S
        while b.describe()["bytes_early"] < src.nbytes:   # read whole, not just begun
            assert time.monotonic() < deadline
        assert b.recv(b"k", dst.ctypes.data, dst.nbytes, 2), "all there: landed by recv(), done now"
        assert np.array_equal(dst, src) and b.describe()["landed_by_recv"] == 1
        assert a.poll() == ([], None) and b.poll() == ([], None), "no token for what was done at once"
    finally:
        a.close(BOUND_S)
        b.close(BOUND_S)


def test_a_frame_of_another_size_than_its_receive_is_refused():
    a, b, _ = wires(1)
    src, dst = np.ones(1000, np.uint8), np.zeros(2000, np.uint8)
    try:
        a.send(b"k", src.ctypes.data, 1000, 1)
        collect(a, 1)
        deadline = time.monotonic() + BOUND_S
        while b.describe()["frames_early"] == 0:
            assert time.monotonic() < deadline
        with pytest.raises(ValueError, match="1000 B arrived for a 2000 B receive"):
            b.recv(b"k", dst.ctypes.data, 2000, 2)
        # posted first, then a frame of another size: the link is lost, the buffer untouched
        assert not b.recv(b"j", dst.ctypes.data, 2000, 3)
        a.send(b"j", src.ctypes.data, 1000, 4)
        assert "different collectives" in lost_reason(b)
        assert not dst.any()
    finally:
        a.close(1.0)
        b.close(1.0)


@pytest.mark.parametrize("junk", ["type", "key", "bounds", "eof-inside"])
def test_a_peer_that_breaks_the_protocol_loses_the_link_once(junk):
    x, y = socket.socketpair()
    b = _wire.Wire(0, 1, 0, 4096, 1 << 20)
    b.attach(0, y.detach())
    dst = np.zeros(4096, np.uint8)
    try:
        assert not b.recv(b"k", dst.ctypes.data, 4096, 1)
        head = {"type": W.HEADER.pack(W.RTS, 0, 0, 0, 0, 0),
                "key": W.HEADER.pack(W.COLL, 0, 10, 0, 0, 10),
                "bounds": W.HEADER.pack(W.COLL, 0, 1 + 4096, 1, 4096, 4096),
                "eof-inside": W.HEADER.pack(W.COLL, 0, 1 + 4096, 1, 0, 4096) + b"k" + b"x" * 100}[junk]
        x.sendall(head)
        x.shutdown(socket.SHUT_WR)
        reason = lost_reason(b)
        assert ("protocol error" in reason) or ("closed inside" in reason), reason
        assert b.poll() == ([], None), "told once"
        assert not dst[100:].any()
    finally:
        x.close()
        b.close(1.0)


def test_an_eof_without_goodbye_is_a_loss_and_close_is_bounded_when_the_peer_never_closes():
    x, y = socket.socketpair()
    b = _wire.Wire(0, 1, 0, 4096, 1 << 20)
    b.attach(0, y.detach())
    try:
        x.shutdown(socket.SHUT_WR)
        assert "without a goodbye" in lost_reason(b)
    finally:
        b.close(1.0)
        x.close()
    # a peer that never says goodbye nor closes: our close waits its bound, no more
    x, y = socket.socketpair()
    b = _wire.Wire(0, 1, 0, 4096, 1 << 20)
    b.attach(0, y.detach())
    t = time.monotonic()
    b.close(0.5)
    took = time.monotonic() - t
    x.close()
    assert took < 3.0, f"close took {took:.2f} s with a 0.5 s bound"


def test_cancelled_receives_take_no_more_bytes():
    a, b, _ = wires(2)
    dst = np.zeros(1 << 20, np.uint8)
    src = np.ones(1 << 20, np.uint8)
    try:
        assert not b.recv(b"k", dst.ctypes.data, dst.nbytes, 1)
        assert b.cancel() == 1
        a.send(b"k", src.ctypes.data, src.nbytes, 2)
        collect(a, 1)
        deadline = time.monotonic() + BOUND_S
        while b.describe()["frames_early"] == 0:
            assert time.monotonic() < deadline
        assert b.poll() == ([], None) and not dst.any()
    finally:
        a.close(BOUND_S)
        b.close(BOUND_S)


def test_bad_arguments_are_refused_before_anything_moves():
    w = _wire.Wire(0, 1, 0, 4096, 1 << 20)
    try:
        with pytest.raises(ValueError):
            w.send(b"", 1, 1, 1)
        with pytest.raises(ValueError):
            w.send(b"k" * (_wire.MAX_KEY + 1), 1, 1, 1)
        with pytest.raises(ValueError):
            w.send(b"k", 0, 8, 1)
        with pytest.raises(ValueError):
            w.send(b"k", 1, (1 << 20) + 1, 1)
        with pytest.raises(ValueError):
            w.recv(b"k", 1, 6, 1, int(ReduceOp.SUM), DTYPE_CODE["f"], 8)   # not whole float32s
        with pytest.raises(ValueError):
            w.attach(1, 0)
        assert w.describe()["queued"] == 0
    finally:
        w.close(1.0)
    with pytest.raises(ValueError):
        _wire.Wire(0, 0, 0, 4096, 1 << 20)
    assert struct.calcsize("<HHIqqq") == W.HEADER.size == 32
