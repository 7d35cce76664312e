"""shm._native.fire_armed (shm/_native_armed.c) without a GPU: armed entries laid out as
proxy/engine/armed.py writes them, taken records as the loop copies them, and a ctypes callback in
place of cuGraphLaunch. A record equal to an entry fires it (slots, cell, launch, out words); every
reason not to fire voids it instead, and launches nothing. The GPU suite (tests/test_gpu.py,
test_armed_routes_keep_mpi_order) runs the whole path against the driver."""
from __future__ import annotations

import numpy as np
import pytest

from shmproxy.core.ops import FLAG_STREAM_WORD, KIND_CANCEL, KIND_COLL, KIND_PROBE, KIND_RECV, KIND_SEND
from shmproxy.engine import armed as A
from shmproxy.shm import _native
from shmproxy.shm import pool as P
from shmproxy.transports import cuda_publish
from tests.test_native_device import _Launcher

MAX_OPS = 8
SLOT_WORDS = P.SLOT_BYTES // 8
EXE, STREAM, DELTA, DEVICE = 0xE1, 0x5E, 0x1000, 0
TAG = 77
NBYTES = 1 << 26


class _Rig:
    """Slots, a cell with its ack word, the counters of the receiver's cells, a token word, and a table
    of ARMED_MAX entries."""

    def __init__(self, rc: int = 0):
        self.slots = np.zeros(2 * MAX_OPS * SLOT_WORDS, np.uint64)
        self.cell = np.zeros(cuda_publish.CELL_BYTES // 8, np.uint64)
        self.cells = np.zeros(3, np.uint64)     # written, taken, drained
        self.runs = np.zeros(1, np.uint64)
        self.table = np.zeros((A.ARMED_MAX, A.ARM_WORDS), np.uint64)
        self.launcher = _Launcher(self.cell, rc)
        self.records = bytearray(P.RECORD_BYTES * 8)
        self.first = self.n = 0   # the records fire() scans: [first, n)
        self.ack = self.cell.ctypes.data + 8 * (self.cell.size - 2)   # cuda_publish's _ACK word

    def arm(self, k: int = 0, token: int = 5, held: int = A.HELD_RECV, state: int = A.ARM_ARMED) -> None:
        """Entry k: rank 0's send (slot 4) to rank 1 and rank 1's receive (slot MAX_OPS + 2, seq 31); with
        ``held`` that half waits (ARM_ARMED), or neither (ARM_PAIR, held 0)."""
        self.runs[0] = token
        self.cell[1] = token                     # the graph's last launch
        self.cell[-2] = token                    # ... acked
        # kind, owner, peer, tag, dtype, flags, buffer, offset, bytes, memory
        send = [KIND_SEND, 0, 1, TAG, 11, 0, 3, 64, NBYTES, 1]
        recv = [KIND_RECV, 1, 0, TAG, 11, 0, 5, 128, NBYTES, 1]
        slot, seq = {A.HELD_RECV: (MAX_OPS + 2, 31), A.HELD_SEND: (4, 17)}.get(held, (0, 0))
        row = send + recv + [held, slot, seq, 2**64 - 1, NBYTES,
                             DEVICE, self.ack, token, self.cell.ctypes.data, DELTA, EXE, STREAM,
                             self.runs.ctypes.data, self.cells.ctypes.data]
        self.table[k, 1:1 + len(row)] = row
        self.table[k, A.A_STATE] = state

    def record(self, kind: int = KIND_SEND, owner: int = 0, peer: int = 1, tag: int = TAG, flags: int = 0,
               buf: int = 3, slot: int = 4, seq: int = 17) -> None:
        """A taken record; by default the entry's send (rank 0's, slot 4, seq 17)."""
        offset = 64 if kind == KIND_SEND else 128
        P.RECORD.pack_into(self.records, self.n * P.RECORD_BYTES, -1, kind, 11, 0, flags, owner, peer, tag, 0,
                           seq, slot, buf, offset, NBYTES, NBYTES // 4, -1, 1, 0, 0, 0, 0, 0, 0)
        self.n += 1

    def recv_record(self, **kw) -> None:
        """The entry's receive (rank 1's, slot MAX_OPS + 2, seq 31)."""
        self.record(**{"kind": KIND_RECV, "owner": 1, "peer": 0, "buf": 5, "slot": MAX_OPS + 2, "seq": 31,
                       **kw})

    def fire(self, device: int = DEVICE) -> tuple[list, list]:
        records = _native.buffer_info(self.records, True)[0]
        return _native.fire_armed(self.table.ctypes.data, A.ARMED_MAX, records, self.first, self.n,
                                  self.slots.ctypes.data, MAX_OPS, device, self.launcher.addr)


def _cell_pairs(rig: _Rig, recv_slot: int, recv_seq: int, send_slot: int, send_seq: int) -> list:
    base = rig.slots.ctypes.data
    return [base + 8 * (recv_slot * SLOT_WORDS + P.SLOT_DONE_SEQ) + DELTA, recv_seq,
            base + 8 * (send_slot * SLOT_WORDS + P.SLOT_DONE_SEQ) + DELTA, send_seq]


def test_the_expected_send_fires_an_armed_receive():
    rig = _Rig()
    rig.arm(k=2)
    rig.record(kind=KIND_COLL, owner=1)   # a collective touches no entry
    rig.record()
    assert rig.fire() == ([2], [])
    e = rig.table[2]
    assert e[A.A_STATE] == A.ARM_FIRED and e[A.A_POS] == 1 and e[A.A_TOKEN] == 6 and e[A.A_PUBLISHED] == 1
    assert e[A.A_RC] == 0 and e[A.A_T_FIRE] > 0 and rig.runs[0] == 6
    (exe, stream, seen), = rig.launcher.calls
    assert (exe, stream) == (EXE, STREAM)
    # the cell as the launch saw it: two pairs (the receive's slot first), the new token
    assert seen[:6] == [2, 6] + _cell_pairs(rig, MAX_OPS + 2, 31, 4, 17)
    for slot, source in ((MAX_OPS + 2, 0), (4, 1)):   # each request's source is its peer
        s = rig.slots[slot * SLOT_WORDS:(slot + 1) * SLOT_WORDS]
        assert s[P.SLOT_NBYTES] == NBYTES and s[P.SLOT_STATUS] == source << 32 and s[P.SLOT_TAG] == TAG
        assert s[P.SLOT_DONE_SEQ] == 0


def test_the_expected_receive_fires_an_armed_send():
    rig = _Rig()
    rig.arm(held=A.HELD_SEND)
    rig.record(kind=KIND_RECV, owner=1, peer=0, buf=9)   # the receiver's other receive: it voids the entry
    assert rig.fire() == ([], []) and rig.table[0, A.A_STATE] == A.ARM_VOID
    rig = _Rig()
    rig.arm(held=A.HELD_SEND)
    rig.recv_record()
    assert rig.fire() == ([0], [])
    assert rig.launcher.calls[0][2][:6] == [2, 6] + _cell_pairs(rig, MAX_OPS + 2, 31, 4, 17)


@pytest.mark.parametrize("first", ["send", "receive"])
def test_a_pair_claims_its_first_half_and_fires_at_the_second_in_this_batch_or_a_later_one(first):
    for same_batch in (True, False):
        rig = _Rig()
        rig.arm(held=0, state=A.ARM_PAIR)
        halves = [rig.record, rig.recv_record] if first == "send" else [rig.recv_record, rig.record]
        halves[0]()
        rig.record(owner=2, peer=3)   # another pair's op in between
        if same_batch:
            halves[1]()
            assert rig.fire() == ([0], [0])
            assert rig.table[0, A.A_HELD_POS] == 0 and rig.table[0, A.A_POS] == 2
        else:
            assert rig.fire() == ([], [0])
            e = rig.table[0]
            assert e[A.A_STATE] == A.ARM_HALF and e[A.A_HELD_POS] == 0 and not rig.launcher.calls
            assert e[A.A_HELD] == (A.HELD_SEND if first == "send" else A.HELD_RECV)
            assert (e[A.A_HELD_SLOT], e[A.A_HELD_SEQ]) == ((4, 17) if first == "send" else (MAX_OPS + 2, 31))
            rig.first = rig.n   # a second take, after the first's records
            halves[1]()
            assert rig.fire() == ([0], [])
            assert rig.table[0, A.A_POS] == 2   # places count from the first take's records
        assert rig.launcher.calls[0][2][:6] == [2, 6] + _cell_pairs(rig, MAX_OPS + 2, 31, 4, 17)


@pytest.mark.parametrize("why", ["the receiver's receive first", "the receiver's probe first",
                                 "the sender's send to the receiver first", "the sender's cancel first",
                                 "stream word", "another buffer", "last run not acked", "relaunched since",
                                 "cell waiting", "other device"])
def test_what_voids_an_entry_launches_nothing(why):
    rig = _Rig()
    rig.arm()
    rig.record(kind=KIND_COLL, owner=0)
    rig.record(kind=KIND_SEND, owner=1, peer=0)   # the receiver's send: it changes nothing the halves match
    rig.record(kind=KIND_SEND, owner=0, peer=2)   # the sender's send to another rank: neither
    if why == "the receiver's receive first":
        rig.record(kind=KIND_RECV, owner=1, peer=2)
    elif why == "the receiver's probe first":
        rig.record(kind=KIND_PROBE, owner=1, peer=0)
    elif why == "the sender's send to the receiver first":
        rig.record(tag=TAG + 1)
    elif why == "the sender's cancel first":
        rig.record(kind=KIND_CANCEL, owner=0, peer=3)
    rig.record(flags=FLAG_STREAM_WORD if why == "stream word" else 0, buf=4 if why == "another buffer" else 3)
    if why == "last run not acked":
        rig.cell[-2] = 4
    elif why == "relaunched since":
        rig.cell[1] = 9
    elif why == "cell waiting":
        rig.cells[0] = 1
    assert rig.fire(device=1 if why == "other device" else DEVICE) == ([], [])
    assert rig.table[0, A.A_STATE] == A.ARM_VOID and not rig.launcher.calls and rig.runs[0] == 5


def test_a_pair_is_not_claimed_while_a_cell_waits_and_a_claimed_half_can_be_voided():
    rig = _Rig()
    rig.arm(held=0, state=A.ARM_PAIR)
    rig.cells[0] = 1
    rig.record()
    assert rig.fire() == ([], []) and rig.table[0, A.A_STATE] == A.ARM_VOID
    rig = _Rig()
    rig.arm(held=0, state=A.ARM_PAIR)
    rig.record()
    rig.record(kind=KIND_RECV, owner=1, peer=0, buf=9)   # the receiver's other receive, after the claim
    assert rig.fire() == ([], [0]) and rig.table[0, A.A_STATE] == A.ARM_VOID


def test_another_pairs_ops_leave_an_entry_armed_and_one_record_fires_one_entry():
    rig = _Rig()
    rig.arm(k=0)
    rig.arm(k=1)   # the same expected record twice: the first entry takes it
    rig.record(owner=5, peer=6)
    rig.record(kind=KIND_RECV, owner=6, peer=1)
    assert rig.fire() == ([], []) and list(rig.table[:2, A.A_STATE]) == [A.ARM_ARMED, A.ARM_ARMED]
    rig.first = rig.n
    rig.record()
    assert rig.fire() == ([0], [])
    assert rig.table[1, A.A_STATE] == A.ARM_VOID   # the sender's send to the receiver, not its to fire


def test_a_slot_outside_its_owners_region_publishes_nothing_and_a_driver_error_is_kept():
    rig = _Rig(rc=700)
    rig.arm()
    rig.record(slot=MAX_OPS + 1)   # rank 0's op naming a slot of rank 1's region
    assert rig.fire() == ([0], [])
    assert rig.table[0, A.A_PUBLISHED] == 0 and rig.table[0, A.A_RC] == 700
    assert not rig.slots.any() and rig.launcher.calls[0][2][:2] == [0, 6]


def test_bad_arguments_are_refused():
    rig = _Rig()
    with pytest.raises(ValueError):
        _native.fire_armed(0, 1, 1, 0, 0, 1, MAX_OPS, 0, 1)
    with pytest.raises(ValueError):
        _native.fire_armed(1, 1, 1, 0, 0, 1, 0, 0, 1)
    assert rig.fire() == ([], [])   # no records


def test_the_engine_writes_entries_as_c_reads_them():
    """armed.py's word names against the C layout, and its row packing."""
    assert _native.ARMED_LAYOUT == (A.A_STATE, A.A_SEND, A.A_RECV, A.A_HELD, A.A_DEVICE, A.A_POS, A.ARM_WORDS)
    assert A._ROW.size == 8 * (A.A_CELLS - A.A_STATE)
