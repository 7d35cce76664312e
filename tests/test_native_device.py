"""shm._native's helpers for GPU-published work (shm/_native_device.c), without a GPU: publish_launch
writes slots and a publish cell and calls the launch entry point it is given (here a ctypes callback
standing in for cuGraphLaunch, recording its arguments), and watch_words returns on each of its
conditions. The GPU suite (tests/test_gpu.py) runs both against the driver."""
from __future__ import annotations

import ctypes
import threading
import time
import types

import numpy as np
import pytest

from shmproxy.shm import _native
from shmproxy.shm import pool as P
from shmproxy.transports import cuda_publish

MAX_OPS = 8
SLOT_WORDS = P.SLOT_BYTES // 8
_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


class _Launcher:
    """A stand-in for cuGraphLaunch: records (exe, stream) and the cell's words as the call saw them."""

    def __init__(self, cell: np.ndarray, rc: int = 0):
        self.calls: list[tuple[int, int, list[int]]] = []
        self.rc = rc
        self.fn = _LAUNCH(lambda exe, stream: self._call(exe, stream, cell))
        self.addr = ctypes.cast(self.fn, ctypes.c_void_p).value

    def _call(self, exe: int, stream: int, cell: np.ndarray) -> int:
        self.calls.append((exe, stream, cell.tolist()))
        return self.rc


def _op(owner: int, slot: int, seq: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(owner=owner, req_slot=slot, req_seq=seq)


def _setup(rc: int = 0):
    slots = np.zeros(2 * MAX_OPS * SLOT_WORDS, np.uint64)
    cell = np.zeros(cuda_publish.CELL_BYTES // 8, np.uint64)
    return slots, cell, _Launcher(cell, rc)


def _call(slots, cell, launcher, items, nbytes=64, token=7, delta=0x1000, pairs=cuda_publish.CELL_PAIRS):
    return _native.publish_launch(slots.ctypes.data, MAX_OPS, items, nbytes, cell.ctypes.data, pairs, token,
                                  delta, launcher.addr, 0xE1, 0x5E)


def test_publish_launch_writes_every_field_but_done_seq_then_the_cell_then_launches():
    slots, cell, launcher = _setup()
    recv, send = _op(1, MAX_OPS + 3, 41), _op(0, 2, 17)
    tag = (1 << 64) - 5
    assert _call(slots, cell, launcher, ((recv, 0, tag), (send, 1, tag)), nbytes=1 << 26) == (0, True)
    for op, source in ((recv, 0), (send, 1)):
        s = slots[op.req_slot * SLOT_WORDS:(op.req_slot + 1) * SLOT_WORDS]
        assert s[P.SLOT_NBYTES] == 1 << 26 and s[P.SLOT_STATUS] == source << 32 and s[P.SLOT_TAG] == tag
        assert s[P.SLOT_DONE_SEQ] == 0   # the GPU's to store, after the copy
    base = slots.ctypes.data
    expect = [2, 7, base + 8 * ((MAX_OPS + 3) * SLOT_WORDS + P.SLOT_DONE_SEQ) + 0x1000, 41,
              base + 8 * (2 * SLOT_WORDS + P.SLOT_DONE_SEQ) + 0x1000, 17]
    assert len(launcher.calls) == 1
    exe, stream, seen = launcher.calls[0]
    assert (exe, stream) == (0xE1, 0x5E)
    assert seen[:6] == expect   # the cell was complete when the launch was called


@pytest.mark.parametrize("bad", ["slot of another rank", "not a local rank", "too many"])
def test_publish_launch_publishes_nothing_it_cannot_and_still_launches(bad):
    slots, cell, launcher = _setup()
    cell[:] = 99
    if bad == "slot of another rank":
        items = ((_op(0, 1, 5), 1, 0), (_op(1, 2, 6), 0, 0))   # rank 1's slot 2 is rank 0's
        got = _call(slots, cell, launcher, items)
    elif bad == "not a local rank":
        got = _call(slots, cell, launcher, ((_op(-1, 0, 5), 1, 0),))
    else:
        got = _call(slots, cell, launcher, [(_op(0, i, i + 1), 1, 0) for i in range(3)], pairs=2)
    assert got == (0, False)
    assert not slots.any()   # nothing written: the loop completes them, complete() names a bad slot
    assert launcher.calls[0][2][:2] == [0, 7]   # count 0 and the run's token


def test_publish_launch_returns_the_drivers_error_and_rejects_malformed_items():
    slots, cell, launcher = _setup(rc=700)
    assert _call(slots, cell, launcher, ()) == (700, False)   # none to publish: the loop completes them
    with pytest.raises(TypeError):
        _call(slots, cell, launcher, ((_op(0, 1, 2), 1),))
    with pytest.raises(AttributeError):
        _call(slots, cell, launcher, ((object(), 1, 0),))
    with pytest.raises(ValueError):
        _native.publish_launch(0, MAX_OPS, (), 0, cell.ctypes.data, 16, 1, 0, launcher.addr, 0, 0)


def _pool():
    """The header words watch_words reads, in a buffer laid out as the pool's."""
    buf = np.zeros(P.FREE_OPS_OFF // 8, np.uint64)
    buf.view(np.int32)[P.NEXT_OPS_OFF // 4] = -1
    return buf, np.zeros(1, np.uint64), np.zeros(4, np.uint64)


def test_watch_words_returns_on_each_condition():
    pool, abort, acks = _pool()
    words = ((acks.ctypes.data, 5), (acks.ctypes.data + 8, 9))
    events = P.CTRL_OFF // 8 + P.CTRL_EVENTS

    def watch(timeout_ns: int = 2_000_000_000) -> int:
        return _native.watch_words(pool.ctypes.data, 3, abort.ctypes.data, words, timeout_ns)

    pool[events] = 3
    t0 = time.monotonic()
    assert watch(20_000_000) == _native.WATCH_TIMEOUT and time.monotonic() - t0 >= 0.019
    acks[1] = 9
    assert watch() == _native.WATCH_WORD
    acks[1] = 10   # a later run's token: that run is done too (tokens only grow)
    assert watch() == _native.WATCH_WORD
    acks[1] = 0
    pool.view(np.int32)[P.NEXT_OPS_OFF // 4] = 4
    assert watch() == _native.WATCH_POSTED
    pool.view(np.int32)[P.NEXT_OPS_OFF // 4] = -1
    pool[P.PENDING_MASK_OFF // 8] = 2
    assert watch() == _native.WATCH_POSTED
    pool[P.PENDING_MASK_OFF // 8] = 0
    pool[events] = 4
    assert watch() == _native.WATCH_EVENTS
    pool[events] = 3
    abort[0] = 1
    assert watch() == _native.WATCH_ABORT


def test_watch_words_releases_the_gil_while_it_waits():
    """The service thread and the copy workers run Python while the loop waits."""
    pool, abort, acks = _pool()
    pool[P.CTRL_OFF // 8 + P.CTRL_EVENTS] = 1
    setter = threading.Timer(0.05, lambda: acks.__setitem__(0, 11))
    setter.start()
    t0 = time.monotonic()
    try:
        why = _native.watch_words(pool.ctypes.data, 1, abort.ctypes.data, ((acks.ctypes.data, 11),), 5_000_000_000)
    finally:
        setter.join()
    assert why == _native.WATCH_WORD and time.monotonic() - t0 < 2.0
