"""Armed routes (shmproxy.engine.armed) with the real Matcher and the real C fire, without a GPU: a
loop of this file's own in place of the engine's point-to-point half (a receive posts or matches, a
send arrives or matches, and an unmatched device half is armed, as engine/p2p.py does), and a ctypes
callback in place of cuGraphLaunch. What only the engine's Python can get wrong is checked here: a
half held out of matching goes back into it before whatever changes what its rank waits for, and
nothing is armed while it does; a pair fires across two batches; a fired route is armed again. The
GPU suite (tests/test_gpu.py, test_armed_routes_keep_mpi_order) runs the whole path."""
from __future__ import annotations

import types

import numpy as np

from shmproxy.core.ops import KIND_RECV, KIND_SEND, Op
from shmproxy.engine import armed as A
from shmproxy.engine.matching import Matcher
from shmproxy.shm import _native
from shmproxy.shm import pool as P
from shmproxy.transports import cuda_publish
from tests.test_native_device import _Launcher

MAX_OPS = 8
TAG = 9
NBYTES = 1 << 20


class _Repeat:
    """The transport's launch of a route: a cell, its ack word and token counter in host memory."""

    def __init__(self, launcher_cell: np.ndarray, runs: np.ndarray, launcher: _Launcher):
        self.cell, self.runs, self.launcher = launcher_cell, runs, launcher

    def words(self) -> tuple:
        c = self.cell
        ack = c.ctypes.data + 8 * (c.size - 2)
        return (0, ack, int(c[1]), c.ctypes.data, 0, 0xE1, 0x5E, self.runs.ctypes.data, self.launcher.addr)

    def current_device(self) -> int:
        return 0


class _Transport:
    def __init__(self, rep: _Repeat):
        self.rep = rep
        self.fired: list[tuple[Op, Op, int]] = []

    def proxy_repeat(self, ctx: object, t: object) -> _Repeat:
        return self.rep

    def proxy_fired(self, ctx: object, conn: object, t: object, rep: _Repeat, token: int, rc: int) -> None:
        self.fired.append((t.send, t.recv, token))
        rep.cell[1] = rep.cell[-2] = token   # launched and, by the next batch, done


class _Loop:
    """The engine's share around the component: matching, a record buffer, and the p2p half in brief."""

    def __init__(self) -> None:
        self.matcher = Matcher()
        self.probes: dict = {}
        self.slots = np.zeros(3 * MAX_OPS * P.SLOT_BYTES // 8, np.uint64)
        self.take_out = bytearray(P.RECORD_BYTES * 16)
        self.take_out_addr = _native.buffer_info(self.take_out, True)[0]
        self.armed = A.ArmedRoutes(True, self.matcher, None, types.SimpleNamespace(on=False), 0,
                                   (self.slots.ctypes.data, MAX_OPS), self.probes, {0: 0, 1: 1, 2: 2},
                                   types.SimpleNamespace(enabled=False), self.append)
        self.conn = self.connector()
        self.transport, self.launcher = self.conn.transport, self.conn.transport.rep.launcher
        self.matched: list[tuple[Op, Op]] = []   # pairs matched by the Python path
        self.appended: list[Op] = []             # ops in the order they went into matching

    @staticmethod
    def connector() -> types.SimpleNamespace:
        """A connector whose transport launches one graph of its own (a cell, a token counter)."""
        cell = np.zeros(cuda_publish.CELL_BYTES // 8, np.uint64)
        transport = _Transport(_Repeat(cell, np.zeros(1, np.uint64), _Launcher(cell)))
        return types.SimpleNamespace(transport=transport, nmsgs=0)

    def append(self, op: Op) -> None:
        m = self.matcher
        if op.kind == KIND_RECV:
            send = m.post(op.rank, op.peer, op.tag, op)
            if send is not None:
                self.matched.append((send, op))
            elif op.mem:
                self.armed.arm(op, True)
        else:
            recv = m.arrive(op.peer, op.rank, op.tag, op)
            if recv is not None:
                self.matched.append((op, recv))
            elif op.mem:
                self.armed.arm(op, False)
        self.appended.append(op)   # once in matching: the order ops went in

    def batch(self, *ops: Op) -> None:
        """A fetch of these ops' records, as ProgressEngine.fetch runs it."""
        for i, op in enumerate(ops):
            P.RECORD.pack_into(self.take_out, i * P.RECORD_BYTES, -1, op.kind, op.dtype, 0, op.flags,
                               op.owner, op.peer, op.tag, 0, op.req_seq, op.req_slot, op.buf_id, op.offset,
                               op.nbytes, 0, -1, op.mem, 0, 0, 0, 0, 0, 0)
        out: tuple[list, list, list] = ([], [], [])
        if self.armed.live:
            self.armed.fire(self.take_out_addr, 0, len(ops), out)
        if out[0] or out[1] or out[2]:
            self.armed.process(list(ops), out)
        else:
            for op in ops:
                self.append(op)


_seq = iter(range(1, 1 << 30))


def _op(kind: int, owner: int, peer: int, buf: int = 3, mem: int = 1, tag: int = TAG) -> Op:
    seq = next(_seq)
    slot = owner * MAX_OPS + seq % MAX_OPS
    fields = (-1, kind, 11, 0, 0, owner, peer, tag, 0, seq, slot, buf, 0, NBYTES, 0, -1, mem,
              0, 0, 0, 0, 0, 0)
    return Op(0, fields, owner, 0)


def _send(buf: int = 3, **kw) -> Op:
    return _op(KIND_SEND, 0, 1, buf, **kw)


def _recv(buf: int = 5, **kw) -> Op:
    return _op(KIND_RECV, 1, 0, buf, **kw)


def _ran_once() -> _Loop:
    """Rank 0's device send to rank 1 ran as a publishing graph once: its route is remembered."""
    loop = _Loop()
    s, r = _send(), _recv()
    loop.batch(r, s)
    assert loop.matched == [(s, r)]
    loop.armed.remember(types.SimpleNamespace(send=s, recv=r, nbytes=NBYTES), loop.conn)
    assert loop.armed.counts["pairs"] == 1 and loop.matcher.armed == {1}
    return loop


def test_a_pair_claims_a_half_then_fires_at_the_other_and_is_armed_again():
    loop = _ran_once()
    s, r = _send(), _recv()
    loop.batch(s)
    assert loop.armed.describe()["held_ops"] == [s.describe()] and len(loop.matched) == 1
    loop.batch(r)
    assert loop.transport.fired == [(s, r, 1)] and not loop.launcher.calls[1:]
    assert loop.armed.counts["fired"] == 1 and loop.armed.counts["pairs"] == 2   # armed again for the next time
    assert len(loop.matcher) == 0


def test_a_held_half_goes_into_matching_before_a_change_to_what_its_rank_waits_for():
    loop = _ran_once()
    s = _send()
    loop.batch(s)
    other = _op(KIND_SEND, 2, 1, mem=0)   # rank 2's host message to rank 1 reaches matching first, in Python
    loop.append(other)
    assert loop.appended[-2:] == [s, other] and loop.matcher.is_unexpected(1, 0, TAG, s)
    assert loop.armed.live == [] and loop.matcher.armed == set()   # nothing armed while it went in
    r = _recv()
    loop.batch(r)
    assert loop.matched[-1] == (s, r) and loop.transport.fired == []


def test_a_record_that_voids_a_pair_finds_the_held_half_in_matching_before_it():
    loop = _ran_once()
    s = _send()
    loop.batch(s)
    r2 = _recv(buf=7)   # another receive of the same message: C voids the pair at it
    loop.batch(r2)
    assert loop.appended[-2:] == [s, r2] and loop.matched[-1] == (s, r2) and loop.transport.fired == []
    assert loop.armed.counts["voided"] == 1


def test_a_claim_and_its_void_in_one_batch_leave_the_half_in_its_place():
    loop = _ran_once()
    s, r2 = _send(), _recv(buf=7)
    loop.batch(s, r2)
    assert loop.appended[-2:] == [s, r2] and loop.matched[-1] == (s, r2) and loop.transport.fired == []


def test_a_single_entry_fires_from_a_receive_in_matching():
    loop = _ran_once()
    loop.armed.disarm_all()   # the pair goes: the receive below goes into matching as a Python path would
    r = _recv()
    loop.append(r)
    assert loop.armed.counts["armed"] == 1 and loop.matcher.armed == {1}
    s = _send()
    loop.batch(s)
    assert loop.transport.fired == [(s, r, 1)] and len(loop.matcher) == 0


def test_a_claim_of_this_batch_disarmed_while_an_earlier_held_half_goes_in_is_kept():
    """Two routes to rank 1: X from rank 0, Y from rank 2. X holds rank 0's send from an earlier fetch.
    In this batch another send of rank 0 to rank 1 voids X (it might match first), so X's send goes
    into matching before the batch; that change to what waits for rank 1 disarms Y, whose send this
    batch claimed: Y's send then goes into matching in its place, after the batch's records before it."""
    loop = _ran_once()
    sy, ry = _op(KIND_SEND, 2, 1, buf=4, tag=TAG + 1), _op(KIND_RECV, 1, 2, buf=6, tag=TAG + 1)
    loop.batch(ry, sy)
    loop.armed.remember(types.SimpleNamespace(send=sy, recv=ry, nbytes=NBYTES), loop.connector())
    loop.armed.arm_pair(loop.armed.history[A.signature(_send())])   # X again (Y's receive voided it)
    assert loop.armed.counts["pairs"] == 3 and len(loop.armed.live) == 2
    sx = _send()
    loop.batch(sx)                                     # X claims it
    other, sy2 = _op(KIND_SEND, 0, 1, mem=0, tag=77), _op(KIND_SEND, 2, 1, buf=4, tag=TAG + 1)
    loop.batch(other, sy2)                             # other voids X; Y claims sy2
    assert loop.appended[-3:] == [sx, other, sy2] and loop.transport.fired == []
    assert loop.matcher.is_unexpected(1, 2, TAG + 1, sy2) and loop.armed.counts["claimed"] == 2
