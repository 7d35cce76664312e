"""Stream order through the completion slots' words (transports/cuda_order.py, the rank's half in
shmproxy.rank.device), the bookkeeping around the driver calls, without a GPU: a stand-in driver
records the calls that would queue a stream's store or wait, over slots in ordinary memory. The GPU
suite (tests/test_gpu.py: work queued on a stream before the call, nonblocking collectives under a
long kernel, kill -9 mid-collective) runs the real calls."""
from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

from shmproxy.core.errors import Closed, InvalidArgument
from shmproxy.core.memory import MemKind, mem_word
from shmproxy.core.ops import FLAG_STREAM_WORD
from shmproxy.rank import device as rank_device
from shmproxy.shm import pool as P
from shmproxy.transports.cuda_order import StreamOrder

MAX_OPS = 8
DELTA = 0x10000   # a device's address of the slots minus ours, as the stand-in reports it


class _Driver:
    """Records write_value and wait_value as (call, stream, device address, value); pins nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, int]] = []
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def write_value(self, stream: int, word: int, value: int) -> None:
        self.calls.append(("write", stream, word, value))

    def wait_value(self, stream: int, word: int, value: int, at_least: bool = False) -> None:
        self.calls.append(("wait_geq" if at_least else "wait", stream, word, value))

    def host_register(self, addr: int, nbytes: int) -> None:
        self.registered.append((addr, nbytes))

    def host_unregister(self, addr: int) -> None:
        self.unregistered.append(addr)

    def host_device_pointer(self, addr: int) -> int:
        return addr + DELTA


class _Mapped:
    def __init__(self) -> None:
        self.made = 0

    def __call__(self) -> "_Mapped":
        self.made += 1
        return self

    @staticmethod
    def delta(device: int) -> int:
        return DELTA


def _slots(nlocal: int = 2) -> np.ndarray:
    return np.zeros(nlocal * MAX_OPS * P.SLOT_BYTES // 8, np.uint64)


def _word(slots: np.ndarray, slot: int) -> int:
    return slots.ctypes.data + P.SLOT_BYTES * slot + 8 * P.SLOT_STREAM_SEQ


def _op(owner: int, slot: int, seq: int, flags: int = FLAG_STREAM_WORD, kind: MemKind = MemKind.CUDA):
    return types.SimpleNamespace(owner=owner, req_slot=slot, req_seq=seq, flags=flags, mem=mem_word(kind, 0),
                                 describe=lambda: f"op of local rank {owner} in slot {slot}")


def _order(slots: np.ndarray) -> tuple[StreamOrder, _Driver, _Mapped]:
    drv, mapped = _Driver(), _Mapped()
    return StreamOrder(drv, (slots.ctypes.data, slots.nbytes, MAX_OPS), mapped), drv, mapped


STREAM = types.SimpleNamespace(ptr=0x5E)


def test_a_wait_is_queued_only_for_a_flagged_device_op_whose_word_lacks_its_value():
    slots = _slots()
    order, drv, mapped = _order(slots)
    order.wait_for_rank(_op(1, MAX_OPS + 2, 7, flags=0), STREAM, 0)             # idle stream at post
    order.wait_for_rank(_op(1, MAX_OPS + 2, 7, kind=MemKind.HOST), STREAM, 0)   # host memory: ready
    ctypes.c_uint32.from_address(_word(slots, 3)).value = 9
    order.wait_for_rank(_op(0, 3, 9), STREAM, 0)                                # the store landed
    assert drv.calls == [] and mapped.made == 0   # nothing pinned for a job that needs no wait
    seq = (5 << 32) | 11                          # only the low 32 bits travel
    order.wait_for_rank(_op(1, MAX_OPS + 2, seq), STREAM, 0)
    assert drv.calls == [("wait", STREAM.ptr, _word(slots, MAX_OPS + 2) + DELTA, 11)]
    assert order.waited_on() == [1]


def test_a_slot_outside_its_ranks_region_is_refused_before_any_call():
    slots = _slots()
    order, drv, _ = _order(slots)
    for owner, slot in ((0, MAX_OPS), (1, 2 * MAX_OPS), (1, -1)):
        with pytest.raises(InvalidArgument, match="not its rank's"):
            order.wait_for_rank(_op(owner, slot, 3), STREAM, 0)
    assert drv.calls == []


def test_release_stores_what_a_stream_still_waits_for_and_nothing_else():
    slots = _slots()
    order, drv, _ = _order(slots)
    order.wait_for_rank(_op(0, 1, 4), STREAM, 0)
    order.wait_for_rank(_op(1, MAX_OPS, 6), STREAM, 0)
    ctypes.c_uint32.from_address(_word(slots, 1)).value = 4   # rank 0's store came; rank 1's never will
    assert order.waited_on() == [1]
    before = slots.copy()
    order.release()
    assert ctypes.c_uint32.from_address(_word(slots, MAX_OPS)).value == 6
    changed = np.flatnonzero(slots != before)
    assert list(changed) == [(P.SLOT_BYTES * MAX_OPS + 8 * P.SLOT_STREAM_SEQ) // 8]   # that word alone
    assert order.waited_on() == []


def test_the_ranks_store_waits_for_an_older_store_of_its_slot_still_queued_on_another_stream():
    slots = _slots()
    drv = _Driver()
    lr = 1
    words = rank_device._Words(slots.ctypes.data, lr * MAX_OPS, MAX_OPS, drv)
    slot = lr * MAX_OPS + 3
    addr = _word(slots, slot) + DELTA
    words.store(slot, 21, 0, 0xA)
    words.store(slot, 22, 0, 0xA)            # same stream: in order by itself
    assert drv.calls == [("write", 0xA, addr, 21), ("write", 0xA, addr, 22)]
    drv.calls.clear()
    words.store(slot, 23, 0, 0xB)            # another stream, and 22 has not landed: wait for it first
    assert drv.calls == [("wait", 0xB, addr, 22), ("write", 0xB, addr, 23)]
    drv.calls.clear()
    ctypes.c_uint32.from_address(_word(slots, slot)).value = 23
    words.store(slot, 24, 0, 0xA)            # back on the first stream, the last store landed: no wait
    assert drv.calls == [("write", 0xA, addr, 24)]
    ctypes.c_uint32.from_address(_word(slots, slot)).value = 24
    words.close(None)                        # nothing queued: no device to wait for, then unpinned
    first = slots.ctypes.data + P.SLOT_BYTES * lr * MAX_OPS
    start, end = first & ~4095, (first + P.SLOT_BYTES * MAX_OPS + 4095) & ~4095
    assert drv.registered == [(start, end - start)] and drv.unregistered == [start]


def test_a_streams_wait_for_a_completion_and_its_release_when_the_communicator_fails():
    """Request.wait_on_stream's bookkeeping (rank/device.py, _Words): the wait is for the slot's done_seq
    to reach the request's seq (low 32 bits, wrap-around order); a communicator that fails completes,
    failed, each awaited request whose completion did not come, and leaves the others alone."""
    slots = _slots()
    drv = _Driver()
    lr = 1
    words = rank_device._Words(slots.ctypes.data, lr * MAX_OPS, MAX_OPS, drv)

    def q(slot: int, field: int) -> int:
        return slot * P.SLOT_BYTES // 8 + field

    a, b, c = lr * MAX_OPS + 2, lr * MAX_OPS + 5, lr * MAX_OPS + 6
    words.wait_done(a, (1 << 32) + 7, 0, 0xA)
    assert drv.calls == [("wait_geq", 0xA, slots.ctypes.data + 8 * q(a, P.SLOT_DONE_SEQ) + DELTA, 7)]
    words.wait_done(b, 9, 0, 0xB)
    words.wait_done(c, 11, 0, 0xB)
    slots[q(a, P.SLOT_DONE_SEQ)] = (1 << 32) + 7    # a completed
    slots[q(c, P.SLOT_DONE_SEQ)] = 12               # c's slot went on to a later request
    words.release(Closed.code)
    assert slots[q(b, P.SLOT_DONE_SEQ)] == 9 and slots[q(b, P.SLOT_STATUS)] == Closed.code
    assert slots[q(a, P.SLOT_STATUS)] == 0 and slots[q(a, P.SLOT_DONE_SEQ)] == (1 << 32) + 7
    assert slots[q(c, P.SLOT_STATUS)] == 0 and slots[q(c, P.SLOT_DONE_SEQ)] == 12
    assert words.awaited == {}
