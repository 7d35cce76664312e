"""MPI.Info: string key-value hints, with mpi4py's handle semantics.

An Info is a *handle* to an info object, as in MPI: ``Info(other)`` is a second handle to the same
object (equal, not identical), ``Dup`` makes a new object (not equal), ``Free`` turns the handle
into the null one (equal to INFO_NULL, false). shmproxy takes no hint from an info (calls that
accept one keep it, so that ``Get_info`` gives back what was set), so the object is a plain ordered
dict of strings. Pickling follows mpi4py: the predefined handles unpickle as themselves, a handle
equal to one of them as a handle to it, any other as a new object with the same items.
"""
from __future__ import annotations

import os
import socket
import sys
from typing import Any, Iterable, Iterator, Mapping

from shmproxy.mpi.exceptions import ERR_INFO, ERR_INFO_KEY, ERR_INFO_NOKEY, error_also
from shmproxy.mpi.handles import HandleNumber, Numbers

MAX_INFO_KEY = 255
MAX_INFO_VAL = 1024


class _Items:
    """The info object a handle refers to."""

    __slots__ = ("items", "__weakref__")    # weak: a handle number must not keep it alive

    def __init__(self, items: dict[str, str] | None = None):
        self.items: dict[str, str] = dict(items or {})


def _key(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"an info key must be a str, not {type(key).__name__}")
    if not 0 < len(key) <= MAX_INFO_KEY:
        raise ValueError(f"an info key must have 1 to {MAX_INFO_KEY} characters, not {len(key)}")
    return key


def _value(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"an info value must be a str, not {type(value).__name__}")
    return value


def _pairs(items: Any) -> list[tuple[str, str]]:
    """(key, value) pairs of an Info, a mapping or an iterable of pairs; TypeError for anything else."""
    if items is None:
        return []
    if isinstance(items, Info):
        return items.items()
    if isinstance(items, Mapping):
        return [(_key(k), _value(v)) for k, v in items.items()]
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise TypeError(f"info items must be an Info, a mapping or (key, value) pairs, not "
                        f"{type(items).__name__}")
    return [(_key(k), _value(v)) for k, v in items]


def _launched_size() -> int:
    """How many processes the launcher started (1 when there is none, or it cannot be read)."""
    from shmproxy.control.launcher import detect
    from shmproxy.core.errors import InvalidArgument
    try:
        return detect().size
    except InvalidArgument:
        return 1


class Info(HandleNumber):
    """A handle to an info object (``Info()`` is a null handle, as in mpi4py)."""

    __slots__ = ("_obj", "_name", "__weakref__")

    def __new__(cls, *_a: Any, **_k: Any) -> "Info":
        return object.__new__(cls)     # (mpi4py's subclasses call it with the info to wrap)

    def __init__(self, info: Info | None = None):
        if info is not None and not isinstance(info, Info):
            raise TypeError(f"MPI.Info() takes an MPI.Info, not {type(info).__name__}")
        self._obj: _Items | None = None if info is None else info._obj
        self._name = ""

    # handles, as mpi4py gives them: a number naming the info object while some handle of it lives
    # (0 names INFO_NULL); fromhandle gives another handle of it
    @property
    def handle(self) -> int:
        return _NUMBERS.number(self._obj)

    @classmethod
    def fromhandle(cls, handle: Any) -> Info:
        info = cls()
        info._obj = _NUMBERS.lookup(handle)
        return info

    # --- handle identity -----------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Info):
            return NotImplemented
        return self._obj is other._obj

    __hash__ = None  # type: ignore[assignment]  # a handle's object changes under Free

    def __bool__(self) -> bool:
        return self._obj is not None

    def __repr__(self) -> str:
        return f"<MPI.Info {self._name or (dict(self._obj.items) if self._obj else 'INFO_NULL')}>"

    def __reduce__(self) -> str | tuple[Any, ...]:
        if self._name:
            return self._name
        if self._obj is None:
            return (type(self), ())
        if self._obj is INFO_ENV._obj:
            return (type(self), (INFO_ENV,))
        # a subclass of the program's unpickles as itself (as mpi4py's)
        return (type(self).Create, (self.items(),))

    def _items(self, what: str) -> dict[str, str]:
        if self._obj is None:
            raise error_also(ERR_INFO, f"Info.{what} on MPI.INFO_NULL", KeyError)
        return self._obj.items

    # --- MPI's calls ---------------------------------------------------------------------
    @classmethod
    def Create(cls, items: Any = None) -> Info:
        pairs = _pairs(items)
        info = cls()
        info._obj = _Items(dict(pairs))
        return info

    @classmethod
    def Create_env(cls, args: Any = None) -> Info:
        """The environment the process was started with, as MPI_INFO_ENV describes it."""
        if args is None:
            argv = list(sys.argv)
        elif isinstance(args, str):
            argv = [args]
        else:
            argv = [str(a) for a in args]
        env = {"command": argv[0] if argv else sys.executable, "argv": " ".join(argv[1:]),
               "maxprocs": str(_launched_size()),
               "soft": "", "host": socket.gethostname(), "arch": os.uname().machine,
               "wdir": os.getcwd(), "file": "", "thread_level": "MPI_THREAD_SINGLE"}
        return cls.Create(env)

    def Free(self) -> None:
        if self._name:
            raise error_also(ERR_INFO, f"MPI.{self._name} is predefined and cannot be freed", ValueError)
        if self._obj is not None:
            self._obj.items.clear()
        self._obj = None

    def free(self) -> None:
        """mpi4py's safe free: a predefined constant stays itself; a second handle of one becomes
        null without touching it; any other info is freed."""
        if self._obj is None or self._name:
            return
        if self._obj is INFO_ENV._obj:
            self._obj = None
            return
        self.Free()

    def Dup(self) -> Info:
        return type(self).Create(self._items("Dup"))

    def Get(self, key: str) -> str | None:
        return self._items("Get").get(_key(key))

    def Set(self, key: str, value: str) -> None:
        self._items("Set")[_key(key)] = _value(value)

    def Delete(self, key: str) -> None:
        items = self._items("Delete")
        if _key(key) not in items:
            raise error_also(ERR_INFO_NOKEY, f"Info.Delete: no key {key!r}", KeyError)
        del items[key]

    def Get_nkeys(self) -> int:
        return len(self._items("Get_nkeys"))

    def Get_nthkey(self, n: int) -> str:
        keys = list(self._items("Get_nthkey"))
        if not 0 <= n < len(keys):
            raise error_also(ERR_INFO_KEY, f"Info.Get_nthkey({n}): the info has {len(keys)} keys", IndexError)
        return keys[n]

    # --- the mapping interface -------------------------------------------------------------
    def __len__(self) -> int:
        return self.Get_nkeys() if self._obj is not None else 0   # as mpi4py: len(INFO_NULL) is 0

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        return self._obj is not None and key in self._obj.items

    def __getitem__(self, key: str) -> str:
        items = self._items("__getitem__")
        return items[_key(key)]

    def __setitem__(self, key: str, value: str) -> None:
        self.Set(key, value)

    def __delitem__(self, key: str) -> None:
        self.Delete(key)

    def get(self, key: str, default: str | None = None) -> str | None:
        if self._obj is None:
            return default
        return self._obj.items.get(_key(key), default)

    def keys(self) -> list[str]:
        return list(self._obj.items) if self._obj is not None else []

    def values(self) -> list[str]:
        return list(self._obj.items.values()) if self._obj is not None else []

    def items(self) -> list[tuple[str, str]]:
        return list(self._obj.items.items()) if self._obj is not None else []

    def update(self, items: Any = (), **kwds: str) -> None:
        target = self._items("update")
        for k, v in _pairs(items) + _pairs(kwds):
            target[k] = v

    def pop(self, key: str, *default: str) -> str | None:
        if self._obj is None:
            if default:
                return default[0]
            raise KeyError(key)
        return self._obj.items.pop(_key(key), *default)

    def popitem(self) -> tuple[str, str]:
        return self._items("popitem").popitem()

    def copy(self) -> Info:
        return type(self).Create(self._obj.items) if self._obj is not None else type(self)()

    def clear(self) -> None:
        if self._obj is not None:
            self._obj.items.clear()


def _predefined(name: str, obj: _Items | None) -> Info:
    info = Info()
    info._obj, info._name = obj, name
    return info


_NUMBERS = Numbers("info object", ERR_INFO)
INFO_NULL = _predefined("INFO_NULL", None)
INFO_ENV = _predefined("INFO_ENV", Info.Create_env()._obj)
