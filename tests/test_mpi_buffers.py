"""MPI.buffer (shmproxy.mpi.membuf, shm/_membuf.c), mpi4py's buffer object: its constructors, the
buffer protocol it exports, indexing and slicing (checked against numpy by hypothesis), mpi4py's
errors; as a message buffer between real ranks (tests/bodies_mpi_buffers.py)."""
from __future__ import annotations

import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmproxy import MPI
from tests.harness import run_ranks

BODY = "tests.bodies_mpi_buffers:"


def test_empty_allocate_and_views():
    b = MPI.buffer()
    assert (b.address, b.nbytes, b.readonly, b.obj) == (0, 0, False, None)
    assert (b.format, b.itemsize, len(b)) == ("B", 1, 0)
    m = memoryview(b)
    assert (m.format, m.shape, m.strides, m.readonly, m.tobytes()) == ("B", (0,), (1,), False, b"")
    for n in (0, 1, 7):
        a = MPI.buffer.allocate(n, True)
        assert a.nbytes == n and a.address != 0 and memoryview(a.obj).nbytes == n
        assert bytes(a) == bytes(n)
    with pytest.raises(TypeError):
        MPI.buffer.allocate(None)
    with pytest.raises(ValueError):
        MPI.buffer.allocate(-1)
    for bad in (None, 0, 0.0, [], ()):
        with pytest.raises(TypeError):
            MPI.buffer(bad)


def test_constructors_share_the_objects_memory():
    ba = bytearray(b"xyz")
    b = MPI.buffer.frombuffer(ba)
    b[0] = ord("a")
    assert ba == bytearray(b"ayz") and b.obj is ba and not b.readonly
    ro = b.toreadonly()
    assert ro.readonly and ro.address == b.address and ro.obj is ba
    with pytest.raises(TypeError):
        ro[0] = 1
    with pytest.raises(BufferError):
        MPI.buffer.frombuffer(b"abc")          # read-only memory, asked for writable
    assert MPI.buffer(b"abc").readonly
    arr = array.array("B", [1, 2, 3])
    addr, n = arr.buffer_info()
    fa = MPI.buffer.fromaddress(addr, n)
    fa[1:] = array.array("B", [7, 8])
    assert arr.tolist() == [1, 7, 8] and fa.obj is None
    with pytest.raises(ValueError):
        MPI.buffer.fromaddress(addr, -1)
    with pytest.raises(ValueError):
        MPI.buffer.fromaddress(0, 1)
    b.release()
    assert (b.address, b.nbytes, b.readonly) == (0, 0, False)


def test_index_and_slice_errors_are_mpi4pys():
    b = MPI.buffer.allocate(4, True)
    for call, exc in ((lambda: b[4], IndexError), (lambda: b[::2], IndexError), (lambda: b[None], TypeError),
                      (lambda: b.__setitem__(slice(0, 1), b[1:3]), ValueError),
                      (lambda: b.__delitem__(0), NotImplementedError)):
        with pytest.raises(exc):
            call()
    assert b.cast("i")[0] == 0 and b.tobytes() == bytes(4)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=40), start=st.integers(-50, 50), stop=st.integers(-50, 50),
       fill=st.integers(0, 255))
def test_slices_read_and_write_as_numpy_does(data, start, stop, fill):
    b = MPI.buffer.allocate(len(data))
    b[:] = data
    ref = np.frombuffer(bytearray(data), np.uint8).copy()
    assert b[start:stop].tobytes() == ref[start:stop].tobytes()
    b[start:stop] = fill
    ref[start:stop] = fill
    assert b.tobytes() == ref.tobytes()
    part = ref[start:stop][::-1].copy()
    b[start:stop] = part.tobytes()
    ref[start:stop] = part
    assert b.tobytes() == ref.tobytes()
    if len(data):
        i = start % len(data)
        assert b[i] == ref[i] and b[i - len(data)] == ref[i]


def test_alloc_mem_is_a_buffer_and_free_mem_empties_it():
    m = MPI.Alloc_mem(16, MPI.INFO_NULL)
    assert type(m) is MPI.buffer and len(m) == 16
    MPI.Free_mem(m)
    assert m.address == 0 and m.nbytes == 0


def test_buffers_as_messages_between_ranks():
    run_ranks(BODY + "buffers", 3, timeout=120)


def test_matched_receive_of_long_doubles():
    run_ranks(BODY + "matched_long_double", 2, timeout=120)


def test_bad_specs_raise_mpi4pys_errors_before_posting():
    run_ranks(BODY + "spec_errors", 2, timeout=120)


def test_cuda_array_interface_objects_checked_as_mpi4py_checks_them():
    run_ranks(BODY + "cai_forms", 2, timeout=120)


def test_pkl5_out_of_band_buffers_are_mpi_buffers():
    """mpi4py.util.pkl5's dumps_oob gives MPI.buffer objects over the array's own memory."""
    from shmproxy.util import pkl5
    a = np.arange(1 << 20, dtype="i")     # above pkl5's THRESHOLD: out of band
    data, bufs = pkl5.pickle.dumps_oob(a)
    assert len(bufs) == 1 and type(bufs[0]) is MPI.buffer and bufs[0].address == a.ctypes.data
    assert (pkl5.pickle.loads_oob(data, bufs) == a).all()
