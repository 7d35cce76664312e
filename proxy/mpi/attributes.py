"""Attribute caching: keyvals, and the attributes communicators, datatypes and windows hold.

MPI lets a program hang values on a communicator, a datatype or a window under keys it creates
(``Comm.Create_keyval(copy_fn, delete_fn)``), with callbacks that MPI runs when the object is
duplicated (copy) and when a value goes away (delete: Delete_attr, a Set_attr over an old value,
Free, and MPI.Finalize for COMM_SELF's). This module is that machinery for the three classes; each
class only says which object its attributes belong to (``owner``: what every handle of one MPI
object shares, e.g. a communicator's native communicator, a datatype's ``_h``) and passes itself as
the handle the callbacks get. Keyvals and attributes are local to the process, as in MPI: nothing
here communicates, so a Dup's copy callbacks run on each rank for that rank's values only.

The callbacks follow mpi4py (its attrimpl.pxi), since programs are written against it:

- ``copy_fn(obj, keyval, value)`` returns the duplicate's value; ``NotImplemented`` means "do not
  copy"; ``copy_fn=True`` copies the same value, ``None``/``False`` never copies.
- ``delete_fn(obj, keyval, value)``; ``None``, ``False`` and ``True`` mean no callback.
- ``nopython=True``: values are integers (C pointers in mpi4py), stored and given back as ints.
- A callback that raises has its traceback printed and its error class (ERR_OTHER unless it raised
  an MPI.Exception) raised as an MPI.Exception (callbacks.py): from Delete_attr, and from Dup, whose
  half-made duplicate is freed first. As in mpi4py, a delete callback that raises during Free or
  during a Set_attr over an old value is only printed: the object is freed, the new value set.
- A freed keyval keeps serving the attributes already set with it (their copy and delete callbacks
  still run); new calls with its number are ERR_KEYVAL.

The predefined keys (TAG_UB, WTIME_IS_GLOBAL, ...) are communicator attributes with fixed values:
Get_attr gives them, Set_attr and Delete_attr refuse them, Free_keyval refuses to free them.
"""
from __future__ import annotations

import functools
import itertools
import operator
import threading
import weakref
from typing import Any, Callable

from shmproxy.core.ops import ANY_SOURCE
from shmproxy.mpi import callbacks
from shmproxy.mpi.exceptions import ERR_KEYVAL, error, last_used_code

KEYVAL_INVALID = -1
# the predefined communicator attributes (mpi4py's MPI.TAG_UB, ...)
TAG_UB, WTIME_IS_GLOBAL, HOST, IO, APPNUM, UNIVERSE_SIZE, LASTUSEDCODE = range(7)
_TAG_UB_VALUE = 2**63 - 1     # tags are any int64 but ANY_TAG (the native layer's range)
_PROC_NULL = -2

# what the three kinds of objects are called in messages and in mpi4py (MPI.Comm.Create_keyval, ...)
COMM, DATATYPE, WIN = "Comm", "Datatype", "Win"

# user keyvals are numbered past the predefined keys, and from one counter for every kind, so that a
# keyval of one kind is never mistaken for one of another (Comm.Get_attr(datatype_keyval): ERR_KEYVAL)
_FIRST_USER_KEYVAL = 64


def _predefined_comm(key: int) -> Any:
    """The value of a predefined communicator attribute: where a message may go (any int64 tag),
    clocks that are not synchronised, no host rank, I/O from any rank, no launcher-provided
    APPNUM or universe size, and the highest error code in use."""
    if key == LASTUSEDCODE:
        return last_used_code()
    return {TAG_UB: _TAG_UB_VALUE, WTIME_IS_GLOBAL: False, HOST: _PROC_NULL, IO: ANY_SOURCE,
            APPNUM: None, UNIVERSE_SIZE: None}[key]


_PREDEFINED: dict[str, Callable[[int], Any] | None] = {COMM: _predefined_comm, DATATYPE: None, WIN: None}
_PREDEFINED_KEYS: dict[str, frozenset[int]] = {COMM: frozenset(range(7)), DATATYPE: frozenset(), WIN: frozenset()}


class Keyval:
    """One key created by Create_keyval: its callbacks, as mpi4py normalises them."""

    __slots__ = ("number", "kind", "copy_fn", "delete_fn", "nopython")

    def __init__(self, number: int, kind: str, copy_fn: Any, delete_fn: Any, nopython: bool):
        for what, fn, allowed in (("copy_fn", copy_fn, (None, True, False)),
                                  ("delete_fn", delete_fn, (None, True, False))):
            if not callable(fn) and not any(fn is a for a in allowed):
                raise TypeError(f"{kind}.Create_keyval: {what} must be callable, None, True or False, "
                                f"not {type(fn).__name__}")
        self.number, self.kind = number, kind
        self.copy_fn = None if copy_fn is False else copy_fn
        # a delete callback is a function or nothing: True means nothing, as in mpi4py
        self.delete_fn = delete_fn if callable(delete_fn) else None
        self.nopython = bool(nopython)


_lock = threading.RLock()     # keyvals and tables; never held while a callback of the program runs
_numbers = itertools.count(_FIRST_USER_KEYVAL)
_keyvals: dict[int, Keyval] = {}
# id(owner) -> {keyval number: (Keyval, value)}, in the order the values were set. Keyed by id and
# dropped by a weakref finalizer: owners need not be hashable (datatypes are not, as in mpi4py), and
# an object the program drops without Free takes its attributes with it (no callbacks then: a
# garbage collection is no MPI call to run them from).
_tables: dict[int, dict[int, tuple[Keyval, Any]]] = {}


# ------------------------------------------------------------------ keyvals
def create_keyval(kind: str, copy_fn: Any = None, delete_fn: Any = None, nopython: bool = False) -> int:
    with _lock:
        kv = Keyval(next(_numbers), kind, copy_fn, delete_fn, nopython)
        _keyvals[kv.number] = kv
    return kv.number


def free_keyval(kind: str, keyval: Any) -> int:
    """Free a keyval (attributes set with it stay, with their callbacks); MPI's KEYVAL_INVALID back."""
    number = _number(kind, keyval, "Free_keyval")
    if number in _PREDEFINED_KEYS[kind]:
        raise error(ERR_KEYVAL, f"{kind}.Free_keyval({number}): a predefined attribute key cannot be freed")
    with _lock:
        _user_keyval(kind, number, "Free_keyval")
        del _keyvals[number]
    return KEYVAL_INVALID


def _number(kind: str, keyval: Any, call: str) -> int:
    try:
        number = operator.index(keyval)
    except TypeError:
        raise TypeError(f"{kind}.{call}: a keyval is an int, not {type(keyval).__name__}") from None
    if number == KEYVAL_INVALID:
        raise error(ERR_KEYVAL, f"{kind}.{call}(MPI.KEYVAL_INVALID): not an attribute key")
    return number


def _user_keyval(kind: str, number: int, call: str) -> Keyval:
    kv = _keyvals.get(number)
    if kv is None or kv.kind != kind:
        raise error(ERR_KEYVAL, f"{kind}.{call}: {number} is not a live {kind} attribute key"
                    + (f" (it is a {kv.kind} key)" if kv is not None else ""))
    return kv


# ------------------------------------------------------------------ values
def _table(owner: Any, create: bool = False) -> dict[int, tuple[Keyval, Any]] | None:
    t = _tables.get(id(owner))
    if t is None and create:
        t = _tables[id(owner)] = {}
        try:
            weakref.finalize(owner, _tables.pop, id(owner), None)
        except TypeError:
            pass    # an owner that cannot be weakly referenced lives as long as the process
    return t


def _stored(kv: Keyval, value: Any, what: str) -> Any:
    if kv.nopython:     # mpi4py's nopython values are C pointers: integers only
        try:
            return operator.index(value)
        except TypeError:
            raise TypeError(f"{what}: keyval {kv.number} was created with nopython=True, so its values "
                            f"are integers, not {type(value).__name__}") from None
    return value


def get_attr(kind: str, owner: Any, keyval: Any) -> Any:
    """The value set under ``keyval``, or None when none is (mpi4py's Get_attr)."""
    number = _number(kind, keyval, "Get_attr")
    predefined = _PREDEFINED[kind]
    if number in _PREDEFINED_KEYS[kind] and predefined is not None:
        return predefined(number)
    with _lock:
        _user_keyval(kind, number, "Get_attr")
        t = _table(owner)
        entry = None if t is None else t.get(number)
    return None if entry is None else entry[1]


def set_attr(kind: str, owner: Any, handle: Any, keyval: Any, value: Any) -> None:
    number = _number(kind, keyval, "Set_attr")
    if number in _PREDEFINED_KEYS[kind]:
        raise error(ERR_KEYVAL, f"{kind}.Set_attr({number}): a predefined attribute cannot be set")
    with _lock:
        kv = _user_keyval(kind, number, "Set_attr")
        value = _stored(kv, value, f"{kind}.Set_attr")
        t = _table(owner, create=True)
        assert t is not None
        old = t.pop(number, None)
        t[number] = (kv, value)     # at the end: the order values were set is the order of deletion
    if old is not None:
        _delete(handle, old, f"{kind}.Set_attr", raise_=False)


def delete_attr(kind: str, owner: Any, handle: Any, keyval: Any) -> None:
    """Remove the value under ``keyval`` (if any) and run its delete callback; the value is gone
    even if the callback raises, whose error is then raised (as mpi4py)."""
    number = _number(kind, keyval, "Delete_attr")
    if number in _PREDEFINED_KEYS[kind]:
        raise error(ERR_KEYVAL, f"{kind}.Delete_attr({number}): a predefined attribute cannot be deleted")
    with _lock:
        _user_keyval(kind, number, "Delete_attr")
        t = _table(owner)
        entry = None if t is None else t.pop(number, None)
    if entry is not None:
        _delete(handle, entry, f"{kind}.Delete_attr", raise_=True)


def free_all(owner: Any, handle: Any, what: str) -> None:
    """The object is being freed: run every delete callback, latest value first (the order MPI
    prescribes for COMM_SELF at Finalize, used for every object here), while the object is still
    usable. Their errors are printed only, as mpi4py's: the object is freed anyway."""
    with _lock:
        t = _tables.pop(id(owner), None)
    for entry in reversed(list((t or {}).values())):
        _delete(handle, entry, what, raise_=False)


def copy_all(src_owner: Any, src_handle: Any, dst_owner: Any, what: str) -> None:
    """Run the copy callbacks of ``src``'s values for its duplicate ``dst`` (Dup). The first callback
    that raises ends the copy with its error; the caller then frees the duplicate, which runs the
    delete callbacks of the values copied so far."""
    with _lock:
        entries = list((_table(src_owner) or {}).values())
    for kv, value in entries:
        fn = kv.copy_fn
        if fn is None:
            continue
        if fn is not True:
            try:
                value = fn(src_handle, kv.number, value)
            except BaseException as exc:    # noqa: BLE001 - reported as MPI reports a callback's error
                callbacks.report(exc)
                raise callbacks.failed(f"{what}: copying attribute {kv.number}", exc) from exc
            if value is NotImplemented:
                continue
            value = _stored(kv, value, f"{what}: the copy callback of keyval {kv.number}")
        with _lock:
            t = _table(dst_owner, create=True)
            assert t is not None
            t[kv.number] = (kv, value)


def _delete(handle: Any, entry: tuple[Keyval, Any], what: str, raise_: bool) -> None:
    kv, value = entry
    if kv.delete_fn is None:
        return
    try:
        kv.delete_fn(handle, kv.number, value)
    except BaseException as exc:    # noqa: BLE001 - reported as MPI reports a callback's error
        callbacks.report(exc)
        if raise_:
            raise callbacks.failed(f"{what}: deleting attribute {kv.number}", exc) from exc


def _copying(dup: Callable[..., Any]) -> Callable[..., Any]:
    """``dup`` followed by the copy callbacks of the original's attributes into the duplicate; if
    one raises, the duplicate is freed (running the delete callbacks of what was copied) and the
    error raised, as MPI_Comm_dup and MPI_Type_dup fail."""
    @functools.wraps(dup)
    def Dup(self: Any, *args: Any, **kwargs: Any) -> Any:
        new = dup(self, *args, **kwargs)
        try:
            copy_all(self._attr_owner(), self, new._attr_owner(), f"{self._attr_kind}.Dup")
        except BaseException:
            new.Free()
            raise
        return new
    return Dup


class Cached:
    """The attribute calls of mpi4py's Comm, Datatype and Win, for a class that says what its kind
    is (``_attr_kind``) and which object its attributes belong to (``_attr_owner()``, which raises the
    class's error on a null handle)."""

    __slots__ = ()
    _attr_kind: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # MPI runs the copy callbacks on every duplication, and this package's classes duplicate in
        # several places (Comm, Intercomm, the topologies, Datatype, derived and F90 types each have a
        # Dup of their own, none calling another): each is wrapped here, once. A program's subclass
        # that overrides Dup ends in one of these, so it is not wrapped again.
        if cls.__module__.startswith("shmproxy."):
            for name in ("Dup", "Create_dup"):
                fn = cls.__dict__.get(name)
                if fn is not None:
                    setattr(cls, name, _copying(fn))

    def _attr_owner(self) -> Any:
        raise NotImplementedError

    @classmethod
    def Create_keyval(cls, copy_fn: Any = None, delete_fn: Any = None, nopython: bool = False) -> int:
        return create_keyval(cls._attr_kind, copy_fn, delete_fn, nopython)

    @classmethod
    def Free_keyval(cls, keyval: int) -> int:
        return free_keyval(cls._attr_kind, keyval)

    def Get_attr(self, keyval: int) -> Any:
        return get_attr(self._attr_kind, self._attr_owner(), keyval)

    def Set_attr(self, keyval: int, attrval: Any) -> None:
        set_attr(self._attr_kind, self._attr_owner(), self, keyval, attrval)

    def Delete_attr(self, keyval: int) -> None:
        delete_attr(self._attr_kind, self._attr_owner(), self, keyval)
