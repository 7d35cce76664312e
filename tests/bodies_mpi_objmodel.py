"""Rank bodies of tests/test_mpi_objmodel.py: handle objects as mpi4py's (test_objmodel, and
test_msgspec's TestMessageRMA): no hashing, weak references, constructors that take only their own
class, handle numbers that round-trip, safe free() of second handles, subclasses that pickle as
themselves; Win, File and Session as real classes whose only objects are their null handles."""
from __future__ import annotations

import copy
import ctypes
import pickle
import weakref
from typing import Any, Callable

import numpy as np

import shmproxy
from shmproxy import MPI


def _raises(exc: type, fn: Callable[..., Any], *args: Any) -> BaseException:
    try:
        fn(*args)
    except exc as e:
        return e
    raise AssertionError(f"{fn} {args} did not raise {exc.__name__}")


NULLS = ("DATATYPE_NULL", "INFO_NULL", "ERRHANDLER_NULL", "SESSION_NULL", "GROUP_NULL", "WIN_NULL", "OP_NULL",
         "FILE_NULL", "MESSAGE_NULL", "COMM_NULL")


def handle_model() -> dict:
    comm = MPI.COMM_WORLD
    nulls = [getattr(MPI, n) for n in NULLS]
    for obj in nulls + [MPI.INT, MPI.SUM, MPI.GROUP_EMPTY, MPI.INFO_ENV, MPI.MESSAGE_NO_PROC, comm]:
        _raises(TypeError, hash, obj)                     # mpi4py's handles do not hash
        assert weakref.ref(obj)() is obj, obj
        cls = MPI.Intracomm if obj is comm else type(obj)     # (COMM_WORLD's own class is private)
        for other in nulls + [MPI.Status(), 1234, "abc"]:
            if not isinstance(other, MPI.Comm if obj is comm else cls):    # Intracomm(COMM_NULL) is null
                _raises(TypeError, cls, other)            # a constructor takes its own class only
        assert cls(obj) == obj and not (cls(obj) != obj), obj
        # a subclass of the program's keeps its class through pickle and copy
        sub = type(f"My{cls.__name__}", (cls,), {"__module__": __name__})
        globals()[sub.__name__] = sub
        try:
            for copier in (lambda o: pickle.loads(pickle.dumps(o)), copy.copy, copy.deepcopy):
                dup = copier(sub(obj))
                assert type(dup) is sub and dup == obj, (obj, type(dup))
        finally:
            del globals()[sub.__name__]

    # handle numbers round-trip (0 is the null handle) and are read-only
    group = comm.Get_group()
    user_op = MPI.Op.Create(lambda a, b, t: None)
    vec = MPI.INT.Create_vector(2, 1, 2).Commit()
    for obj in nulls + [MPI.INT, MPI.DOUBLE, vec, MPI.INFO_ENV, MPI.GROUP_EMPTY, group, MPI.SUM, user_op,
                        MPI.MESSAGE_NO_PROC, MPI.ERRORS_RETURN, comm]:
        h = obj.handle
        assert (h == 0) == (not obj) and h >= 0, (obj, h)
        new = type(obj).fromhandle(h)
        assert new == obj and type(new) is type(obj) and new.handle == h, (obj, new)
        assert MPI._handleof(obj) == h
        for attempt in (lambda o: setattr(o, "handle", None), lambda o: delattr(o, "handle")):
            _raises(AttributeError, attempt, new)
    _raises(MPI.Exception, MPI.Datatype.fromhandle, 12345)

    # safe free(): a second handle or a Dup becomes null, the constant stays
    for const in (MPI.INT, MPI.DOUBLE):
        clone = MPI.Datatype(const)
        dup = const.Dup()
        for h in (clone, dup):
            assert h
            for _ in range(3):
                h.free()
                assert not h and h == MPI.DATATYPE_NULL, h
        const.free()
        assert const and const.Get_size() > 0
    vec.free()
    assert not vec
    for const in (MPI.COMM_SELF, comm):     # COMM_SELF's and COMM_WORLD's own classes are private
        clone = type(const)(const)
        assert clone and clone == const
        for _ in range(3):
            clone.free()
            assert not clone and clone == MPI.COMM_NULL, clone
        const.free()
        assert const and const.Get_size() >= 1
    # requests: unhashable, a second object only of a request, a subclass of the program's pickles as
    # itself (REQUEST_NULL as itself)
    _raises(TypeError, hash, MPI.REQUEST_NULL)
    assert pickle.loads(pickle.dumps(MPI.REQUEST_NULL)) is MPI.REQUEST_NULL
    sub = type("MyRequest", (MPI.Request,), {"__module__": __name__})
    globals()["MyRequest"] = sub
    try:
        for copier in (lambda o: pickle.loads(pickle.dumps(o)), copy.copy, copy.deepcopy):
            dup = copier(sub(MPI.REQUEST_NULL))
            assert type(dup) is sub and dup == MPI.REQUEST_NULL and dup is not MPI.REQUEST_NULL, dup
    finally:
        del globals()["MyRequest"]
    req = comm.Irecv(np.zeros(1), MPI.PROC_NULL)
    _raises(TypeError, hash, req)
    assert MPI.Request(req) == req
    for other in (MPI.Status(), MPI.INT, 1234, "abc"):
        _raises(TypeError, MPI.Request, other)
    req.Wait()

    # the C-level helpers: the memory at _addressof holds the handle (a status: its fields)
    for fn in (MPI._sizeof, MPI._addressof, MPI._handleof):
        _raises(TypeError, fn, None)
    for obj in (MPI.INT, vec, group, comm, MPI.SUM, MPI.COMM_NULL, MPI.INFO_ENV):
        addr = MPI._addressof(obj)
        assert MPI._sizeof(obj) == MPI._sizeof(type(obj)) == 8
        assert ctypes.c_uint64.from_address(addr).value == obj.handle and MPI._addressof(obj) == addr
    st = MPI.Status()
    st.source, st.tag = 5, 77
    fields = (ctypes.c_int64 * (MPI._sizeof(st) // 8)).from_address(MPI._addressof(st))
    assert (fields[0], fields[1]) == (5, 77) and MPI._handleof(st) == MPI._addressof(st)
    fields[1] = 78   # C code may fill a status through it, as mpi4py's tomemory
    assert st.tag == 78

    # BOTTOM, IN_PLACE, BUFFER_AUTOMATIC: ints with MPICH's values that export an empty buffer at that
    # address, one instance each, pickled by name; no arithmetic
    for name, value in (("BOTTOM", 0), ("IN_PLACE", -1), ("BUFFER_AUTOMATIC", -2)):
        c = getattr(MPI, name)
        assert c == value and hash(c) == hash(value) and repr(c) == name and type(c)() is c
        mv = memoryview(c)
        assert mv.nbytes == 0 and mv.obj is None and MPI.Get_address(c) == value
        assert pickle.loads(pickle.dumps(c)) is c and copy.copy(c) is c
        _raises(TypeError, lambda: c + 1)
    assert MPI.IN_PLACE is shmproxy.IN_PLACE

    # what the changes must not break: user ops in reductions, matched probes, derived types by handle
    rank, size = comm.Get_rank(), comm.Get_size()
    op = MPI.Op.Create(lambda a, b, t: np.maximum(np.frombuffer(a, "i"), np.frombuffer(b, "i"),
                                                  out=np.frombuffer(b, "i")), commute=True)
    out = np.zeros(1, "i")
    comm.Allreduce(np.array([rank * 7], "i"), out, op=op)
    assert out[0] == (size - 1) * 7, out
    op.Free()
    vec2 = MPI.Datatype.fromhandle(MPI.INT.Create_vector(3, 1, 2).Commit().handle)
    right, left = (rank + 1) % size, (rank - 1) % size
    send = np.arange(6, dtype="i") + 100 * rank
    recv = np.full(6, -1, "i")
    req = comm.Isend([send, 1, vec2], dest=right, tag=5)
    msg = comm.Mprobe(source=left, tag=5)
    assert type(msg) is MPI.Message and msg and msg.handle > 0
    msg.Recv([recv, 1, vec2])
    req.Wait()
    assert not msg and msg == MPI.MESSAGE_NULL
    expect = np.full(6, -1, "i")
    expect[::2] = (np.arange(6, dtype="i") + 100 * left)[::2]
    assert (recv == expect).all(), recv
    user_op.Free()
    ops = [MPI.Op.Create(lambda a, b, t: None) for _ in range(32)]   # the table of 32 still holds
    _raises(RuntimeError, MPI.Op.Create, lambda a, b, t: None)
    for o in ops:
        o.Free()
    return {"rank": rank}


def unprovided() -> dict:
    """Win, File, Session: real classes, null handles only, operations NotImplementedError."""
    for cls, null, ctor in ((MPI.Win, MPI.WIN_NULL, lambda: MPI.Win.Create(MPI.BOTTOM)),
                            (MPI.File, MPI.FILE_NULL, lambda: MPI.File.Open(MPI.COMM_SELF, "/dev/null")),
                            (MPI.Session, MPI.SESSION_NULL, MPI.Session.Init)):
        assert type(null) is cls and isinstance(null, cls) and not null
        assert cls() == null and cls(null) == null and pickle.loads(pickle.dumps(null)) is null
        assert cls.fromhandle(null.handle) == null and null.handle == 0
        e = _raises(NotImplementedError, ctor)
        assert isinstance(e, MPI.Exception) and e.Get_error_class() == MPI.ERR_UNSUPPORTED_OPERATION, e
        null.free()
        assert not null

        class Mine(cls):   # type: ignore[misc, valid-type]   # as mpi4py's test_subclass writes one
            def __new__(klass, h: Any = None) -> Any:
                return cls.__new__(klass, h)

        assert Mine(null) == null and isinstance(Mine(null), cls)
    for method, args in (("Fence", ()), ("Free", ()), ("Lock", (0,)), ("Get_group", ())):
        e = _raises(NotImplementedError, getattr(MPI.WIN_NULL, method), *args)
        assert "one-sided" in str(e), e
    _raises(NotImplementedError, MPI.FILE_NULL.Close)
    _raises(NotImplementedError, MPI.SESSION_NULL.Get_num_psets)
    # a window's data calls read their messages first, as mpi4py's: a malformed one is a ValueError
    _raises(ValueError, MPI.WIN_NULL.Put, [None, 0, 0, "B", None], 0, None)
    _raises(ValueError, MPI.WIN_NULL.Get, [None, 0, "B"], 0, {1: 2})
    _raises(ValueError, MPI.WIN_NULL.Put, [None, 0, "B"], 0, (0, 0, MPI.BYTE, None))
    for target in (None, 0, [0, 3, MPI.BYTE]):
        _raises(NotImplementedError, MPI.WIN_NULL.Put, b"abc", 0, target)
        _raises(NotImplementedError, MPI.WIN_NULL.Get, bytearray(3), 0, target)
    _raises(NotImplementedError, MPI.WIN_NULL.Get_accumulate, b"abc", bytearray(3), 0)
    return {"rank": MPI.COMM_WORLD.Get_rank()}


def comm_lock_table() -> dict:
    """mpi4py's per-communicator lock table: the bcast lock is made by the first bcast, every handle
    of one communicator shares the table, a Dup has its own (test_p2p_obj's testCommLock)."""
    import threading
    comm = MPI.COMM_WORLD.Dup()
    table = MPI._comm_lock_table(comm)
    assert isinstance(table, dict) and "bcast" not in table, table
    value = comm.bcast({"from": 0, "data": list(range(5))} if comm.Get_rank() == 0 else None, root=0)
    assert value == {"from": 0, "data": list(range(5))}, value
    assert isinstance(table["bcast"], type(threading.Lock())) and not table["bcast"].locked()
    assert MPI._comm_lock_table(MPI.Intracomm(comm)) is table
    assert MPI._comm_lock(comm, "bcast") is table["bcast"]
    other = comm.Dup()
    assert MPI._comm_lock_table(other) is not table and "bcast" not in MPI._comm_lock_table(other)
    other.Free()
    comm.Free()
    _raises(MPI.Exception, MPI._comm_lock_table, MPI.COMM_NULL)
    _raises(TypeError, MPI._comm_lock_table, None)
    return {"rank": MPI.COMM_WORLD.Get_rank()}


class _Retyped:
    """A CPU DLPack exporter of ``arr`` whose tensor claims another element type (bits, lanes, code),
    as mpi4py's test_msgspec makes them (testDtypeLanes, testDtypeCode)."""

    def __init__(self, arr: np.ndarray, bits: int, lanes: int, code: int | None = None) -> None:
        self.arr, self.bits, self.lanes, self.code = arr, bits, lanes, code

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)

    def __dlpack__(self, stream: Any = None, max_version: Any = None) -> Any:
        from shmproxy.mpi import foreign
        capsule = self.arr.__dlpack__(stream=stream)     # the legacy, unversioned capsule
        t = foreign._DLManaged.from_address(foreign._api.PyCapsule_GetPointer(capsule, b"dltensor")).dl_tensor
        t.dtype.bits, t.dtype.lanes = self.bits, self.lanes
        if self.code is not None:
            t.dtype.code = self.code
        return capsule


def dlpack_bytes() -> dict:
    """A DLPack element type with no buffer format (several lanes, an opaque code) is its bytes, as in
    mpi4py: it travels as bytes (a receive of another type is a type mismatch, erroneous in MPI)."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    for arr, bits, lanes, code in ((np.arange(4, dtype=np.uint32) + 10 * rank, 16, 2, None),
                                   (np.arange(4, dtype=np.uint16) + 10 * rank, 16, 1, 3)):
        sbuf = _Retyped(arr, bits, lanes, code)
        rbuf = bytearray(arr.nbytes)
        comm.Sendrecv(sbuf, right, 3, rbuf, left, 3)
        assert bytes(rbuf) == (np.arange(4, dtype=arr.dtype) + 10 * left).tobytes(), (bits, lanes, code)
    return {"rank": rank}
