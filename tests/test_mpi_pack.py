"""Datatype.Pack/Unpack/Pack_size and external32 (shmproxy.mpi.pack) against numpy: the packed bytes
of predefined and derived types are numpy's gather of the same elements, external32 is numpy's
big-endian form (long double: IEEE binary128), and unpacking restores what was packed; between real
ranks as MPI.PACKED messages (tests/bodies_mpi_buffers.py)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmproxy import MPI
from tests.harness import run_ranks

BODY = "tests.bodies_mpi_buffers:"
TYPES = {"b": MPI.SIGNED_CHAR, "h": MPI.SHORT, "i": MPI.INT, "l": MPI.LONG, "q": MPI.LONG_LONG,
         "B": MPI.UNSIGNED_CHAR, "H": MPI.UNSIGNED_SHORT, "I": MPI.UNSIGNED, "Q": MPI.UNSIGNED_LONG_LONG,
         "f": MPI.FLOAT, "d": MPI.DOUBLE, "F": MPI.C_FLOAT_COMPLEX, "D": MPI.C_DOUBLE_COMPLEX,
         "?": MPI.C_BOOL}


@settings(max_examples=80, deadline=None)
@given(code=st.sampled_from(sorted(TYPES)), n=st.integers(0, 12), pos=st.integers(0, 9),
       stride=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_pack_and_external32_match_numpy(code, n, pos, stride, seed):
    rng = np.random.default_rng(seed)
    a = (rng.integers(0, 100, n * stride) % (2 if code == "?" else 100)).astype(code)
    d = TYPES[code]
    out = bytearray(pos + n * a.itemsize + 3)
    assert d.Pack(a[::stride].copy(), out, pos, MPI.COMM_SELF) == pos + n * a.itemsize
    assert bytes(out[pos:pos + n * a.itemsize]) == a[::stride].tobytes()
    vec = d.Create_vector(max(n, 1), 1, stride).Create_resized(0, stride * a.itemsize * max(n, 1)).Commit()
    if n:   # one instance of the strided type: the same elements
        out2 = bytearray(len(out))
        assert vec.Pack(a, out2, pos, MPI.COMM_SELF) == pos + n * a.itemsize
        assert out2 == out
        back = np.zeros_like(a)
        assert vec.Unpack(out2, pos, back, MPI.COMM_SELF) == pos + n * a.itemsize
        assert (back[::stride] == a[::stride]).all() and not back[np.arange(a.size) % stride != 0].any()
    vec.Free()
    ext = bytearray(pos + d.Pack_external_size("external32", n))
    assert d.Pack_external("external32", a[::stride].copy(), ext, pos) == len(ext)
    assert bytes(ext[pos:]) == a[::stride].astype(a.dtype.newbyteorder(">")).tobytes()
    back = np.zeros(n, a.dtype)
    assert d.Unpack_external("external32", ext, pos, back) == len(ext)
    assert (back == a[::stride]).all()


def test_long_double_external32_is_binary128():
    x = np.array([1 / 3, -2.5, 0.0, np.inf], np.longdouble)
    ext = bytearray(MPI.LONG_DOUBLE.Pack_external_size("external32", 4))
    MPI.LONG_DOUBLE.Pack_external("external32", x, ext, 0)
    assert bytes(ext[16:32]).hex() == "c0004" + "0" * 27          # -2.5 = -1.25 * 2**1
    assert bytes(ext[48:64]).hex() == "7fff" + "0" * 28            # +inf
    back = np.zeros(4, np.longdouble)
    MPI.LONG_DOUBLE.Unpack_external("external32", ext, 0, back)
    assert (back == x).all()


def test_pack_errors_come_before_anything_is_written():
    out = bytearray(6)
    with pytest.raises(MPI.Exception) as e:
        MPI.INT.Pack(np.arange(2, dtype="i"), out, 0, MPI.COMM_SELF)
    assert e.value.Get_error_class() == MPI.ERR_TRUNCATE and out == bytearray(6)
    with pytest.raises(BufferError):
        MPI.INT.Pack(np.arange(1, dtype="i"), b"12345678", 0, MPI.COMM_SELF)
    with pytest.raises(ValueError):
        MPI.INT.Pack_external("native", np.arange(1, dtype="i"), out, 0)
    with pytest.raises(MPI.Exception):
        MPI.INT.Unpack(bytearray(3), 0, np.zeros(1, "i"), MPI.COMM_SELF)
    mixed = MPI.Datatype.Create_struct([1, 1], [0, 4], [MPI.INT, MPI.FLOAT]).Commit()
    with pytest.raises(NotImplementedError):
        mixed.Pack_external_size("external32", 1)
    assert mixed.Pack_size(3, MPI.COMM_SELF) == 24
    mixed.Free()


def test_packed_messages_between_ranks():
    run_ranks(BODY + "packed", 2, timeout=120)
