"""shm._native.unpack_ops (shm/_native_ops.c), the progress loop's unpacking of taken records: every op
it makes equals what Op(index, fields, rank, t_fetch) makes from the same record, every field at the
edges of its type; and a class it cannot fill is refused at bind time."""
from __future__ import annotations

import random

import numpy as np
import pytest

from shmproxy.core.ops import Op
from shmproxy.shm import _native
from shmproxy.shm import pool as P

_EDGES = {"B": (0, 255), "i": (-(1 << 31), (1 << 31) - 1), "I": (0, (1 << 32) - 1),
          "q": (-(1 << 63), (1 << 63) - 1), "Q": (0, (1 << 64) - 1)}
_CODES = "iBBBBiiqQQIiQQQiiQQQQQQ"   # shm/pool.py RECORD, field by field
assert P.RECORD.format.lstrip("<") == _CODES


class _Info:
    def __init__(self, rank: int):
        self.rank = rank


def _record(rng: random.Random, edge: int | None) -> tuple:
    out = []
    for code in _CODES:
        lo, hi = _EDGES[code]
        out.append((lo, hi)[edge] if edge is not None else rng.randint(lo, hi))
    return tuple(out)


def test_every_field_as_the_python_constructor_makes_it():
    _native.bind_op(Op)
    rng = random.Random(23)
    records = [_record(rng, 0), _record(rng, 1)] + [_record(rng, None) for _ in range(30)]
    records[2] = records[2][:5] + (3,) + records[2][6:]   # owner 3: a rank the engine knows
    buf = bytearray(P.RECORD_BYTES * len(records))
    for k, fields in enumerate(records):
        P.RECORD.pack_into(buf, k * P.RECORD_BYTES, *fields)
    idx = np.array([rng.randint(0, 1 << 20) for _ in records], np.int32)
    ranks = {3: _Info(41), 0: _Info(7)}
    ops = _native.unpack_ops(_native.buffer_info(buf, True)[0], len(records), idx.ctypes.data, ranks, 987654321)
    assert len(ops) == len(records)
    for k, op in enumerate(ops):
        fields = P.RECORD.unpack_from(buf, k * P.RECORD_BYTES)
        info = ranks.get(fields[5])
        ref = Op(int(idx[k]), fields, info.rank if info else -1, 987654321)
        assert type(op) is Op
        for name in Op.__slots__:
            assert getattr(op, name) == getattr(ref, name), (k, name)
    assert ops[2].rank == 41 and ops[0].rank == -1   # owner -2**31: no such rank
    assert _native.unpack_ops(0, 0, 0, ranks, 1) == []


def test_a_class_without_those_slots_is_refused_and_the_bound_one_stays():
    class NotAnOp:
        __slots__ = ("kind", "dtype")

    _native.bind_op(Op)
    with pytest.raises((TypeError, AttributeError)):
        _native.bind_op(NotAnOp)
    buf = bytearray(P.RECORD_BYTES)
    P.RECORD.pack_into(buf, 0, *_record(random.Random(1), None))
    idx = np.zeros(1, np.int32)
    op, = _native.unpack_ops(_native.buffer_info(buf, True)[0], 1, idx.ctypes.data, {}, 5)
    ref = Op(0, P.RECORD.unpack_from(buf), -1, 5)
    assert type(op) is Op and all(getattr(op, name) == getattr(ref, name) for name in Op.__slots__)
