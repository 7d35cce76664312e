"""Rank bodies of tests/test_mpi_buffers.py: MPI.buffer objects (Alloc_mem's, slices, DLPack/CAI-free
host memory) as message buffers between ranks, and packed messages (Pack/Unpack, external32) sent as
MPI.PACKED bytes and unpacked on the other side."""
from __future__ import annotations

import numpy as np

from shmproxy import MPI


def buffers() -> dict:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    peer = (rank + 1) % size
    src = (rank - 1) % size
    mem = MPI.Alloc_mem(64)
    assert type(mem) is MPI.buffer and mem.nbytes == 64 and not mem.readonly
    out = np.frombuffer(mem, np.int32)
    out[:] = np.arange(16, dtype=np.int32) * (rank + 1)
    got = MPI.Alloc_mem(64)
    got[:] = 0
    # an MPI.buffer with a count and datatype, and a slice of one as a plain byte buffer
    comm.Sendrecv([mem, 16, MPI.INT], peer, 1, [got, 16, MPI.INT], src, 1)
    assert (np.frombuffer(got, np.int32) == np.arange(16) * (src + 1)).all()
    comm.Sendrecv(mem[8:24], peer, 2, got[0:16], src, 2)
    assert bytes(got[0:16]) == (np.arange(16, dtype=np.int32) * (src + 1)).tobytes()[8:24]
    # read-only memory cannot receive, and cannot be attached for buffered sends
    ro = MPI.buffer(b"abcd")
    for call in (lambda: comm.Recv([ro, MPI.BYTE], src, 3), lambda: MPI.Attach_buffer(ro)):
        try:
            call()
        except BufferError:
            pass
        else:
            raise AssertionError("a read-only MPI.buffer was accepted for writing")
    MPI.Free_mem(mem)
    MPI.Free_mem(got)
    assert mem.address == 0 and mem.nbytes == 0 and got.nbytes == 0
    comm.Barrier()
    return {"rank": rank}


def packed() -> dict:
    """Rank 0 packs an int vector (every other element) and doubles, in native and external32 form,
    and sends the bytes as MPI.PACKED; rank 1 unpacks them with other types of the same signature."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    every2 = MPI.INT.Create_vector(4, 1, 2).Commit()
    ints = np.arange(8, dtype=np.int32) * 3
    dbl = np.linspace(0.5, 2.5, 5)
    n1, n2 = every2.Pack_size(1, comm), MPI.DOUBLE.Pack_size(5, comm)
    e1, e2 = MPI.INT.Pack_external_size("external32", 4), MPI.DOUBLE.Pack_external_size("external32", 5)
    assert (n1, n2, e1, e2) == (16, 40, 16, 40)
    if rank == 0:
        buf = bytearray(n1 + n2)
        pos = every2.Pack(ints[:7], buf, 0, comm)
        pos = MPI.DOUBLE.Pack(dbl, buf, pos, comm)
        assert pos == n1 + n2
        ext = MPI.Alloc_mem(e1 + e2)
        pos = MPI.INT.Pack_external("external32", ints[::2].copy(), ext, 0)
        pos = MPI.DOUBLE.Pack_external("external32", dbl, ext, pos)
        assert bytes(ext[:4]) == (0).to_bytes(4, "big") and bytes(ext[4:8]) == (6).to_bytes(4, "big")
        comm.Send([buf, MPI.PACKED], 1, 5)
        comm.Send([ext, MPI.PACKED], 1, 6)
        MPI.Free_mem(ext)
    elif rank == 1:
        buf = bytearray(n1 + n2)
        comm.Recv([buf, MPI.PACKED], 0, 5)
        got_i, got_d = np.zeros(4, np.int32), np.zeros(5)
        pos = MPI.INT.Unpack(buf, 0, got_i, comm)
        pos = MPI.DOUBLE.Unpack(buf, pos, got_d, comm)
        assert pos == n1 + n2 and (got_i == ints[::2]).all() and (got_d == dbl).all()
        ext = bytearray(e1 + e2)
        comm.Recv([ext, MPI.PACKED], 0, 6)
        spread = np.full(8, -1, np.int32)           # unpacked through the vector: every other element
        pos = every2.Unpack_external("external32", ext, 0, spread[:7])
        pos = MPI.DOUBLE.Unpack_external("external32", ext, pos, got_d)
        assert pos == e1 + e2 and (spread[::2] == ints[::2]).all() and (spread[1::2] == -1).all()
        assert (got_d == dbl).all()
    every2.Free()
    comm.Barrier()
    return {"rank": rank}


def matched_long_double() -> dict:
    """A matched probe's receive of long doubles (they travel as their bytes, as in Recv), and a bad
    receive buffer refused before the message is taken (it stays receivable)."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    x = np.arange(5, dtype=np.longdouble) / 3
    if rank == 0:
        comm.Send([x, MPI.LONG_DOUBLE], 1, 7)
    elif rank == 1:
        m = comm.Mprobe(0, 7)
        try:
            m.Recv(b"read-only")
        except BufferError:
            pass
        else:
            raise AssertionError("a read-only receive buffer was taken")
        assert m, "the refused receive consumed the message"
        got = np.zeros(5, np.longdouble)
        m.Recv(got)
        assert (got == x).all() and not m
    comm.Barrier()
    return {"rank": rank}


def spec_errors() -> dict:
    """mpi4py's errors for bad message specs, raised before anything is posted (the next message
    between the two ranks is the right one): an unknown type code is KeyError (and ValueError), a
    list/dict/class as the buffer TypeError, a type of negative extent commits but no message takes
    it; None with a datatype and no counts is an empty vector spec."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    other = 1 - rank
    buf = MPI.Alloc_mem(8)
    empty = [None, 0, "B"]
    neg = MPI.INT.Create_resized(0, -4).Commit()
    for spec, exc in (([buf, 0, "\0"], KeyError), ([buf, 0, "\0"], ValueError),
                      ([[1, 2], 2, 0, "i"], TypeError), ([{1: 2}, 1, 0, "i"], TypeError), (object, TypeError),
                      ([buf, None, neg], ValueError)):
        try:
            comm.Sendrecv(spec, other, 3, empty, other, 3)
        except exc as e:
            assert isinstance(e, MPI.Exception), type(e).__mro__
        else:
            raise AssertionError(f"{spec!r}: no {exc.__name__}")
    try:
        MPI.Datatype.fromcode("\0")
    except ValueError:
        pass
    neg.Free()
    MPI.COMM_SELF.Alltoallv([None, "B"], [None, "B"])
    got = np.zeros(2, "i")
    comm.Sendrecv(np.array([rank, 7], "i"), other, 4, got, other, 4)
    assert got.tolist() == [other, 7]
    MPI.Free_mem(buf)
    return {"rank": rank}


class _CAI:
    """A host array exporting the CUDA array interface (as mpi4py's tests' fake GPU arrays)."""

    def __init__(self, arr: np.ndarray, readonly: bool = False):
        self.arr = arr
        self.__cuda_array_interface__ = {"version": 0, "data": (arr.__array_interface__["data"][0], readonly),
                                         "typestr": arr.dtype.str, "shape": arr.shape, "strides": None}


def cai_forms() -> dict:
    """CUDA-array-interface objects over host memory as messages, with mpi4py's checks of the
    interface: a byte order not this machine's, a mask, a bad data pair or strides are refused
    (BufferError, ValueError, TypeError, KeyError) before anything is posted; a 'descr' that is not
    the typestr's is a RuntimeWarning, and a |V typestr over fields of one type moves those."""
    import warnings
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    other = 1 - rank
    good = _CAI(np.arange(6, dtype="d") + rank)
    bad = []
    swapped = _CAI(np.zeros(6, "d"))
    swapped.__cuda_array_interface__["typestr"] = ">f8" if np.little_endian else "<f8"
    bad.append((swapped, BufferError))
    masked = _CAI(np.zeros(6, "d"))
    masked.__cuda_array_interface__["mask"] = True
    bad.append((masked, BufferError))
    short = _CAI(np.zeros(6, "d"))
    short.__cuda_array_interface__["data"] = (short.__cuda_array_interface__["data"][0],)
    bad.append((short, ValueError))
    strided = _CAI(np.zeros(6, "d"))
    strided.__cuda_array_interface__["strides"] = (16,)
    bad.append((strided, BufferError))
    nodata = _CAI(np.zeros(6, "d"))
    del nodata.__cuda_array_interface__["data"]
    bad.append((nodata, KeyError))
    notdict = _CAI(np.zeros(6, "d"))
    notdict.__cuda_array_interface__ = None      # type: ignore[assignment]
    bad.append((notdict, TypeError))
    readonly = _CAI(np.zeros(6, "d"), readonly=True)
    bad.append((readonly, BufferError))
    for obj, exc in bad:
        try:
            comm.Sendrecv(good, other, 8, obj, other, 8)
        except exc:
            pass
        else:
            raise AssertionError(f"{obj.__cuda_array_interface__!r}: no {exc.__name__}")
    packed = _CAI(np.zeros(6, "d"))
    cai = packed.__cuda_array_interface__
    cai.update(typestr="|V24", shape=(2,), descr=[("", "<f8")] * 3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        comm.Sendrecv(good, other, 9, packed, other, 9)
    assert any(issubclass(w.category, RuntimeWarning) for w in seen)
    assert (packed.arr == np.arange(6) + other).all()
    return {"rank": rank}
