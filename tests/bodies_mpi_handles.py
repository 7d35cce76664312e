"""Rank bodies of tests/test_mpi_handles.py: mpi4py's error and handle model. Calls on null handles
raise MPI.Exception of the handle's error class, predefined handles refuse Free, error handlers are
kept per communicator and called by Call_errhandler, MPI.Exception behaves as mpi4py's, and error
classes/codes the program adds have their strings. Native errors still derive from both
MPI.Exception and the native class."""
from __future__ import annotations

import pickle
from typing import Any

import numpy as np

import shmproxy
from shmproxy import MPI
from tests.mpi_checks import raises_class


def null_handles() -> dict:
    comm = MPI.COMM_WORLD
    for method in ("Get_size", "Get_rank", "Is_inter", "Is_intra", "Get_group", "Get_topology",
                   "Get_errhandler"):
        raises_class(MPI.ERR_COMM, getattr(MPI.COMM_NULL, method))
    raises_class(MPI.ERR_COMM, MPI.Comm.Compare, comm, MPI.COMM_NULL)
    raises_class(MPI.ERR_COMM, MPI.COMM_NULL.Get_attr, MPI.TAG_UB)
    raises_class(MPI.ERR_COMM, MPI.Intercomm().Get_remote_size)
    raises_class(MPI.ERR_COMM, comm.Free)
    raises_class(MPI.ERR_COMM, MPI.COMM_SELF.Free)
    raises_class(MPI.ERR_KEYVAL, comm.Get_attr, MPI.KEYVAL_INVALID)
    raises_class(MPI.ERR_GROUP, MPI.GROUP_NULL.Get_size)
    raises_class(MPI.ERR_GROUP, MPI.Group.Compare, MPI.GROUP_EMPTY, MPI.GROUP_NULL)
    raises_class(MPI.ERR_TYPE, MPI.DATATYPE_NULL.Commit)
    raises_class(MPI.ERR_TYPE, MPI.DATATYPE_NULL.Free)
    MPI.DATATYPE_NULL.free()      # mpi4py's safe free: no error
    raises_class(MPI.ERR_TYPE, MPI.Status().Get_count, MPI.DATATYPE_NULL)
    raises_class(MPI.ERR_REQUEST, MPI.REQUEST_NULL.Free)
    raises_class(MPI.ERR_REQUEST, MPI.REQUEST_NULL.Cancel)
    MPI.REQUEST_NULL.free()
    for fn, args in ((MPI.INFO_NULL.Get_nkeys, ()), (MPI.INFO_NULL.Get, ("k",)), (MPI.INFO_NULL.Free, ())):
        raises_class(MPI.ERR_INFO, fn, *args)
    info = MPI.Info.Create()
    raises_class(MPI.ERR_INFO_NOKEY, info.Delete, "key")
    try:
        info.Delete("key")          # still a KeyError, as before
    except KeyError:
        pass
    raises_class(MPI.ERR_INFO_KEY, info.Get_nthkey, 0)
    info.Free()
    assert len(MPI.INFO_NULL) == 0
    return {"rank": comm.rank}


def errhandlers() -> dict:
    comm = MPI.COMM_WORLD.Dup()
    assert not MPI.ERRHANDLER_NULL and MPI.ERRORS_RETURN and MPI.ERRORS_ARE_FATAL
    eh = comm.Get_errhandler()
    assert eh == MPI.ERRORS_RETURN and eh is not MPI.ERRORS_RETURN
    comm.Set_errhandler(MPI.ERRORS_ARE_FATAL)
    got = comm.Get_errhandler()
    assert got == MPI.ERRORS_ARE_FATAL
    got.Free()
    assert got == MPI.ERRHANDLER_NULL and MPI.ERRORS_ARE_FATAL      # the constant stays itself
    raises_class(MPI.ERR_ARG, comm.Set_errhandler, MPI.ERRHANDLER_NULL)
    raises_class(MPI.ERR_ARG, MPI.ERRHANDLER_NULL.Free)
    seen: list[tuple[Any, int]] = []
    mine = MPI.Comm.Create_errhandler(lambda c, code: seen.append((c, code)))
    comm.Set_errhandler(mine)
    comm.Call_errhandler(MPI.ERR_OTHER)
    assert seen == [(comm, MPI.ERR_OTHER)], seen
    assert MPI.Errhandler.fromint(mine.toint()) == mine
    try:
        mine.__reduce__()
        raise AssertionError("a handler of the program's own pickled")
    except ValueError:
        pass
    comm.Set_errhandler(eh)
    comm.Call_errhandler(MPI.ERR_OTHER)       # ERRORS_RETURN: nothing happens
    mine.Free()
    eh.Free()
    assert pickle.loads(pickle.dumps(MPI.ERRORS_RETURN)) is MPI.ERRORS_RETURN
    copy = pickle.loads(pickle.dumps(MPI.Errhandler(MPI.ERRORS_RETURN)))
    assert copy == MPI.ERRORS_RETURN and copy is not MPI.ERRORS_RETURN
    comm.Free()
    return {"rank": MPI.COMM_WORLD.rank}


def exceptions() -> dict:
    e = MPI.Exception(MPI.ERR_ARG)
    assert repr(e) == f"MPI.Exception({MPI.ERR_ARG})" and str(e) == MPI.Get_error_string(MPI.ERR_ARG)
    assert e == MPI.ERR_ARG and int(e) == MPI.ERR_ARG and hash(e) == hash(MPI.ERR_ARG)
    assert MPI.Exception(MPI.SUCCESS) < e <= MPI.ERR_ARG and not MPI.Exception(MPI.SUCCESS)
    assert MPI.Exception(-5) == MPI.ERR_UNKNOWN
    cls = MPI.Add_error_class()
    assert cls == MPI.COMM_WORLD.Get_attr(MPI.LASTUSEDCODE) and MPI.Get_error_string(cls) == ""
    code = MPI.Add_error_code(cls)
    MPI.Add_error_string(code, "mine")
    assert MPI.Get_error_class(code) == cls and MPI.Get_error_string(code) == "mine"
    raises_class(MPI.ERR_ARG, MPI.Remove_error_class, cls)       # a code of it is left
    MPI.Remove_error_string(code)
    MPI.Remove_error_code(code)
    MPI.Remove_error_class(cls)
    # a native error is both kinds still: send to a rank that is not there
    comm = MPI.COMM_WORLD
    try:
        comm.Send(np.zeros(1), dest=comm.size)
    except MPI.Exception as exc:
        assert isinstance(exc, ValueError) and exc.Get_error_class() == MPI.ERR_RANK, exc
    try:
        raise MPI.Exception(MPI.ERR_OTHER)
    except shmproxy.Timeout:
        raise AssertionError("MPI.Exception(ierr) is no Timeout")
    except MPI.Exception:
        pass
    return {"rank": comm.rank}


def pickler() -> dict:
    """MPI.pickle.__init__(dumps, loads, protocol): the program's serializer for every object call."""
    import json
    import marshal
    comm = MPI.COMM_WORLD
    peer = (comm.rank + 1) % comm.size
    try:
        MPI.pickle.__init__(lambda o: json.dumps(o).encode(), lambda s: json.loads(bytes(s).decode()))
        got = comm.sendrecv({"r": comm.rank, "t": (1, 2)}, peer, 0, None, MPI.ANY_SOURCE, 0)
        assert got == {"r": (comm.rank - 1) % comm.size, "t": [1, 2]}, got     # json made the tuple a list
        assert comm.bcast([comm.rank], root=0) == [0]
        MPI.pickle.__init__(marshal.dumps, marshal.loads, 4)
        assert MPI.pickle.loads(MPI.pickle.dumps((1, 2.5))) == (1, 2.5)
        assert comm.allgather((comm.rank,)) == [(r,) for r in range(comm.size)]
        MPI.pickle.__init__(protocol=2)
        assert comm.sendrecv(np.arange(3), peer, 1, None, MPI.ANY_SOURCE, 1).tolist() == [0, 1, 2]
    finally:
        MPI.pickle.__init__()
    got = comm.sendrecv((comm.rank,), peer, 2, None, MPI.ANY_SOURCE, 2)
    assert got == ((comm.rank - 1) % comm.size,), got
    info = MPI.Get_hw_resource_info()
    assert isinstance(info, MPI.Info) and info.Get_nkeys() > 0
    return {"rank": comm.rank}


class MyStatus(MPI.Status):
    """A subclass of the program's: pickling keeps its class."""


def objmodel() -> dict:
    """mpi4py's safe free(): constants stay, second handles and created objects become null; null
    handles of other types refuse a constructor; a Status subclass pickles as itself."""
    import weakref
    created = [MPI.COMM_WORLD.Dup(), MPI.Op.Create(lambda a, b, t: None), MPI.COMM_WORLD.Get_group(),
               MPI.COMM_WORLD.Get_errhandler(), MPI.Info.Create(), MPI.Op(MPI.SUM), MPI.Comm(MPI.COMM_WORLD),
               MPI.Group(MPI.GROUP_EMPTY), MPI.Info(MPI.INFO_ENV),
               MPI.COMM_WORLD.Isend((None, 0, MPI.BYTE), MPI.PROC_NULL)]
    for obj in created:
        assert obj, obj
        for _ in range(2):
            obj.free()
            assert not obj, obj
    for const in (MPI.SUM, MPI.GROUP_EMPTY, MPI.INFO_ENV, MPI.ERRORS_RETURN, MPI.COMM_WORLD, MPI.COMM_SELF):
        const.free()
        assert const, const
    assert MPI.INFO_ENV.Get_nkeys() > 0 and MPI.COMM_WORLD.Get_size() >= 1
    for null in (MPI.COMM_NULL, MPI.REQUEST_NULL, MPI.INFO_NULL, MPI.GROUP_NULL, MPI.OP_NULL, MPI.SESSION_NULL,
                 MPI.WIN_NULL, MPI.ERRHANDLER_NULL):
        null.free()
        assert not null
    assert not MPI.Prequest(MPI.REQUEST_NULL) and not MPI.Grequest(MPI.REQUEST_NULL)
    weakref.ref(MPI.Status())
    weakref.ref(MPI.FILE_NULL)
    st = pickle.loads(pickle.dumps(MyStatus()))
    assert type(st) is MyStatus, type(st)
    ops = [MPI.Op.Create(lambda a, b, t: None) for _ in range(32)]    # mpi4py's table of 32 user ops
    try:
        MPI.Op.Create(lambda a, b, t: None)
        raise AssertionError("a 33rd user op was made")
    except RuntimeError:
        pass
    clone = MPI.Op.fromint(ops[0].toint())
    assert clone == ops[0] and MPI.Op.fromint(MPI.SUM.toint()) == MPI.SUM
    try:
        clone.__reduce__()
        raise AssertionError("an op from fromint pickled")
    except ValueError:
        pass
    for op in ops:
        op.Free()
    MPI.Op.Create(lambda a, b, t: None).Free()
    return {"rank": MPI.COMM_WORLD.rank}


class MyComm(MPI.Intracomm):
    def __new__(cls, comm: Any = None) -> "MyComm":
        return super().__new__(cls, comm)


class MyRequest(MPI.Request):
    def __new__(cls, request: Any = None) -> "MyRequest":
        return super().__new__(cls, request)


class MyInfo(MPI.Info):
    def __new__(cls, info: Any = None) -> "MyInfo":
        return MPI.Info.__new__(cls, info)


def subclasses() -> dict:
    """Subclasses of the program's, as mpi4py's test_subclass writes them: __new__ with the handle,
    Dup/Clone/Create/copy and pickling keep the subclass."""
    comm = MyComm(MPI.COMM_WORLD)
    dup = comm.Clone()
    assert type(dup) is MyComm and dup.Get_size() == MPI.COMM_WORLD.Get_size()
    dup.Free()
    assert type(MPI.COMM_WORLD.Dup()) is MPI.Intracomm
    req = MyRequest(MPI.REQUEST_NULL)
    assert type(req) is MyRequest and not req
    info = MyInfo.Create()
    info.Set("a", "1")
    for other in (info.Dup(), info.copy(), pickle.loads(pickle.dumps(info))):
        assert type(other) is MyInfo and other.Get("a") == "1", type(other)
    return {"rank": MPI.COMM_WORLD.rank}


class MyCartcomm(MPI.Cartcomm):
    def __new__(cls, comm: Any = None) -> "MyCartcomm":
        if comm is not None and comm != MPI.COMM_NULL:
            comm = comm.Create_cart([comm.size])
        return super().__new__(cls, comm)


def topo_subclass() -> dict:
    """mpi4py's test_subclass form: __new__ makes the grid and passes it on; Clone keeps the class."""
    cart = MyCartcomm(MPI.COMM_WORLD)
    assert type(cart) is MyCartcomm and cart.Get_topology() == MPI.CART and cart.dims == [MPI.COMM_WORLD.size]
    dup = cart.Clone()
    assert type(dup) is MyCartcomm and dup.dims == cart.dims
    dup.Free()
    cart.Free()
    return {"rank": MPI.COMM_WORLD.rank}
