"""Rank bodies of tests/test_mpi_attributes.py: attribute caching on communicators and datatypes as
MPI and mpi4py define it (shmproxy/mpi/attributes.py): keyvals of each kind, copy callbacks on every
Dup (NotImplemented: not copied, True: the same value), delete callbacks on Delete_attr, on a Set_attr
over an old value, on Free and, for COMM_SELF, on Finalize; callback errors printed and raised as
ERR_OTHER; the predefined keys."""
from __future__ import annotations

import contextlib
import io
from typing import Any

from shmproxy import MPI
from tests.mpi_checks import raises_class


def comm_attributes() -> dict:
    world = MPI.COMM_WORLD
    log: list[tuple[str, Any]] = []

    def copy_fn(obj: Any, key: int, value: Any) -> Any:
        assert isinstance(obj, MPI.Comm) and obj and key == k_copy
        return value + ["copied"]

    def delete_fn(obj: Any, key: int, value: Any) -> None:
        assert isinstance(obj, MPI.Comm) and obj      # still usable while its attributes go
        log.append(("deleted", value))

    k_copy = MPI.Comm.Create_keyval(copy_fn, delete_fn)
    k_same = MPI.Comm.Create_keyval(True)
    k_none = MPI.Comm.Create_keyval()
    k_skip = MPI.Comm.Create_keyval(lambda o, k, v: NotImplemented)
    k_int = MPI.Comm.Create_keyval(lambda o, k, v: v + 1, nopython=True)
    assert len({k_copy, k_same, k_none, k_skip, k_int, MPI.KEYVAL_INVALID, MPI.TAG_UB}) == 7
    comm = world.Dup()
    assert comm.Get_attr(k_copy) is None
    shared = ["same"]
    comm.Set_attr(k_copy, [world.rank])
    comm.Set_attr(k_same, shared)
    comm.Set_attr(k_none, "not copied")
    comm.Set_attr(k_skip, "not copied either")
    comm.Set_attr(k_int, 41)
    assert comm.Get_attr(k_same) is shared and comm.Get_attr(k_int) == 41
    dup = comm.Dup()
    assert dup.Get_attr(k_copy) == [world.rank, "copied"]
    assert dup.Get_attr(k_same) is shared
    assert dup.Get_attr(k_none) is None and dup.Get_attr(k_skip) is None
    assert dup.Get_attr(k_int) == 42
    # every duplication copies: Idup, Dup_with_info, and a Cartcomm's own Dup
    assert comm.Idup()[0].Get_attr(k_int) == 42
    assert comm.Dup_with_info(MPI.INFO_NULL).Get_attr(k_same) is shared
    cart = comm.Create_cart([world.size])
    cart.Set_attr(k_int, 7)
    assert cart.Dup().Get_attr(k_int) == 8
    # a second handle of one communicator sees its attributes
    assert MPI.Comm(comm).Get_attr(k_same) is shared

    # delete callbacks: on overwrite, on Delete_attr, on Free (latest first)
    comm.Set_attr(k_copy, ["second"])
    assert log == [("deleted", [world.rank])]
    comm.Delete_attr(k_copy)
    assert log[-1] == ("deleted", ["second"]) and comm.Get_attr(k_copy) is None
    comm.Delete_attr(k_copy)          # nothing set: nothing to do
    dup.Set_attr(k_copy, ["a"])       # replaces the copied value
    dup.Set_attr(k_none, "b")
    log.clear()
    dup.Free()
    assert log == [("deleted", ["a"])], log
    assert dup == MPI.COMM_NULL

    # a freed keyval refuses new calls, but the value set with it keeps its delete callback
    comm.Set_attr(k_copy, ["kept"])
    assert MPI.Comm.Free_keyval(k_copy) == MPI.KEYVAL_INVALID
    raises_class(MPI.ERR_KEYVAL, comm.Get_attr, k_copy)
    raises_class(MPI.ERR_KEYVAL, comm.Set_attr, k_copy, 1)
    raises_class(MPI.ERR_KEYVAL, MPI.Comm.Free_keyval, k_copy)
    log.clear()
    comm.Free()
    assert log == [("deleted", ["kept"])], log

    # the predefined keys, and keys of another kind
    assert world.Get_attr(MPI.TAG_UB) >= 32767 and world.Get_attr(MPI.WTIME_IS_GLOBAL) is False
    assert world.Get_attr(MPI.LASTUSEDCODE) >= MPI.ERR_LASTCODE
    raises_class(MPI.ERR_KEYVAL, world.Set_attr, MPI.TAG_UB, 5)
    raises_class(MPI.ERR_KEYVAL, world.Delete_attr, MPI.TAG_UB)
    raises_class(MPI.ERR_KEYVAL, MPI.Comm.Free_keyval, MPI.TAG_UB)
    raises_class(MPI.ERR_KEYVAL, world.Get_attr, MPI.KEYVAL_INVALID)
    raises_class(MPI.ERR_COMM, MPI.COMM_NULL.Get_attr, k_same)
    k_type = MPI.Datatype.Create_keyval()
    raises_class(MPI.ERR_KEYVAL, world.Get_attr, k_type)
    raises_class(MPI.ERR_KEYVAL, MPI.Comm.Free_keyval, k_type)
    MPI.Datatype.Free_keyval(k_type)

    # a delete callback that raises: the value goes, the error is ERR_OTHER, the traceback printed
    def bad_delete(obj: Any, key: int, value: Any) -> None:
        raise ValueError("delete went wrong")

    k_bad = MPI.Comm.Create_keyval(None, bad_delete)
    world.Set_attr(k_bad, "v")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        raises_class(MPI.ERR_OTHER, world.Delete_attr, k_bad)
    assert "ValueError: delete went wrong" in err.getvalue() and world.Get_attr(k_bad) is None
    for k in (k_same, k_none, k_skip, k_int, k_bad):
        MPI.Comm.Free_keyval(k)
    return {"rank": world.rank}


def datatype_attributes() -> dict:
    log: list[Any] = []
    k = MPI.Datatype.Create_keyval(copy_fn=lambda o, key, v: MPI.Datatype.Dup(v),
                                   delete_fn=lambda o, key, v: (log.append(v.Get_size()), v.Free()))
    t = MPI.INT.Dup()
    inner = MPI.DOUBLE.Dup()
    t.Set_attr(k, inner)
    t2 = t.Dup()
    inner2 = t2.Get_attr(k)
    assert inner2 != inner and inner2.Get_size() == 8
    t2.Free()                                    # runs the delete callback, which frees inner2
    assert t2 == MPI.DATATYPE_NULL and inner2 == MPI.DATATYPE_NULL and log == [8]
    t.Delete_attr(k)
    assert inner == MPI.DATATYPE_NULL and t.Get_attr(k) is None
    # a predefined type holds attributes too; a vector type's Dup copies them
    k_same = MPI.Datatype.Create_keyval(True)
    MPI.INT.Set_attr(k_same, "on INT")
    assert MPI.Datatype(MPI.INT).Get_attr(k_same) == "on INT" and t.Dup().Get_attr(k_same) is None
    vec = MPI.INT.Create_vector(2, 1, 2).Commit()
    vec.Set_attr(k_same, "on vec")
    assert vec.Dup().Get_attr(k_same) == "on vec"
    MPI.INT.Delete_attr(k_same)
    raises_class(MPI.ERR_TYPE, MPI.DATATYPE_NULL.Get_attr, k_same)
    raises_class(MPI.ERR_KEYVAL, MPI.INT.Get_attr, MPI.KEYVAL_INVALID)

    # a copy callback that raises: Dup fails with ERR_OTHER and the half-made duplicate is freed,
    # running the delete callbacks of what it had copied
    deleted: list[Any] = []

    def bad_copy(obj: Any, key: int, v: Any) -> Any:
        raise KeyError("copy went wrong")

    k_first = MPI.Datatype.Create_keyval(True, lambda o, key, v: deleted.append(v))
    k_bad = MPI.Datatype.Create_keyval(bad_copy)
    t.Set_attr(k_first, "first")
    t.Set_attr(k_bad, "second")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        raises_class(MPI.ERR_OTHER, t.Dup)
    assert "KeyError" in err.getvalue() and deleted == ["first"], (err.getvalue(), deleted)
    t.Delete_attr(k_bad)
    t.Free()
    assert deleted == ["first", "first"]
    for key in (k, k_same, k_first, k_bad):
        MPI.Datatype.Free_keyval(key)
    return {"size": MPI.COMM_WORLD.size}


def self_attributes_at_finalize() -> dict:
    """COMM_SELF's delete callbacks run at Finalize, latest first, while MPI is still usable."""
    order: list[str] = []

    def hook(obj: Any, key: int, value: str) -> None:
        assert obj and MPI.COMM_WORLD.Get_size() >= 1
        order.append(value)

    k = MPI.Comm.Create_keyval(delete_fn=hook)
    k2 = MPI.Comm.Create_keyval(delete_fn=hook)
    MPI.COMM_SELF.Set_attr(k, "first")
    MPI.COMM_SELF.Set_attr(k2, "second")
    MPI.COMM_WORLD.Barrier()
    MPI.Finalize()
    assert order == ["second", "first"], order
    return {"order": order}
