"""MPI.Message: what a matched probe took (Comm.Mprobe/Improbe, mprobe/improbe for objects)."""
from __future__ import annotations

from typing import Any

from shmproxy.core import errors
from shmproxy.core.ops import ANY_SOURCE, ANY_TAG
from shmproxy.mpi.exceptions import ERR_REQUEST, convert, error
from shmproxy.mpi.handles import HandleNumber, Numbers
from shmproxy.mpi.request import ObjRequest, Request
from shmproxy.mpi.status import Status


class Message(HandleNumber):
    """A message a matched probe took (Comm.Mprobe/Improbe, or mprobe/improbe for objects): only its
    Recv/Irecv (recv/irecv) receives it. MESSAGE_NO_PROC is the message of a probe of PROC_NULL."""

    __slots__ = ("_m", "_obj", "_comm", "_no_proc", "_h", "__weakref__")

    def __init__(self, message: "Message | None" = None):
        """``Message()`` is MESSAGE_NULL's handle, ``Message(msg)`` a second object of ``msg``'s handle
        (as mpi4py's); matched probes make the others (``_of``)."""
        self._h: Message | None = None      # the message whose handle this object is a copy of
        self._m = self._obj = self._comm = None
        self._no_proc = False
        if message is None:
            return
        if not isinstance(message, Message):
            raise TypeError(f"MPI.Message() takes an MPI.Message, not {type(message).__name__}")
        self._m, self._obj, self._comm = message._m, message._obj, message._comm
        self._no_proc, self._h = message._no_proc, message._hid()

    @classmethod
    def _of(cls, native: Any = None, obj: Any = None, comm: Any = None, no_proc: bool = False) -> "Message":
        """The message of a matched probe: the native one (buffers), or the object one (``obj``)."""
        msg = cls()
        msg._m, msg._obj, msg._comm, msg._no_proc = native, obj, comm, no_proc
        return msg

    def _hid(self) -> "Message":
        return self if self._h is None else self._h

    def __bool__(self) -> bool:
        return self._m is not None or self._obj is not None or self._no_proc

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return (not self and not other) or (bool(self) and self._hid() is other._hid())

    # as mpi4py's handles: not hashable, since a receive turns a handle into MESSAGE_NULL in place
    __hash__ = None  # type: ignore[assignment]

    # handles, as mpi4py gives them: a number naming the message while some object of it lives (0 names
    # MESSAGE_NULL)
    @property
    def handle(self) -> int:
        return _NUMBERS.number(self._hid() if self else None)

    @classmethod
    def fromhandle(cls, handle: Any) -> "Message":
        h = _NUMBERS.lookup(handle)
        return cls() if h is None else cls(h)

    def __reduce__(self) -> Any:
        for name in ("MESSAGE_NULL", "MESSAGE_NO_PROC"):
            if self._hid() is globals().get(name) and (self._no_proc or not self):
                return name if self._h is None else (type(self), (globals()[name],))
        raise ValueError("a matched message cannot be pickled: it names a message of this process")

    @classmethod
    def Probe(cls, comm: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Any = None) -> "Message":
        """mpi4py's form of Comm.Mprobe."""
        return comm.Mprobe(source, tag, status)

    @classmethod
    def Iprobe(cls, comm: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG,
               status: Any = None) -> "Message | None":
        """mpi4py's form of Comm.Improbe."""
        return comm.Improbe(source, tag, status)

    @classmethod
    def probe(cls, comm: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Any = None) -> "Message":
        """mpi4py's form of Comm.mprobe (an object message)."""
        return comm.mprobe(source, tag, status)

    @classmethod
    def iprobe(cls, comm: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG,
               status: Any = None) -> "Message | None":
        return comm.improbe(source, tag, status)

    def _take(self) -> tuple[Any, Any]:
        if not self:
            raise error(ERR_REQUEST, "receive of MPI.MESSAGE_NULL (the message was received already)")
        m, obj = self._m, self._obj
        self._m = self._obj = None
        if self is not globals().get("MESSAGE_NO_PROC"):   # the constant itself stays what it is
            self._no_proc = False
        return m, obj

    def Irecv(self, buf: Any) -> Request:
        from shmproxy.mpi.buffers import parse, wire
        no_proc = self._no_proc
        # parsed before the message is taken: a bad buffer leaves the message to receive; wire() as
        # every receive does (a long double or pair type travels as its bytes)
        b = None if (no_proc and self._m is None) else wire(parse(buf, "receive buffer", True))
        m, _obj = self._take()
        if m is None and no_proc:
            return Request(None, True)
        try:
            return Request(m.Irecv(b))
        except errors.ProxyError as exc:
            raise convert(exc) from None

    def Recv(self, buf: Any, status: Status | None = None) -> None:
        self.Irecv(buf).Wait(status)

    def recv(self, status: Status | None = None) -> Any:
        """The object of an object-layer matched probe (Comm.mprobe)."""
        if self._no_proc and self._obj is None:
            self._take()
            if status is not None:
                status._fill_null()
            return None
        value, st = self._receive()
        if status is not None:
            status._fill(st)
        return value

    def _receive(self) -> tuple[Any, Any]:
        """(object, the native status of its receive) of an object-layer matched probe."""
        from shmproxy.rank import objects
        _m, inc = self._take()
        if inc is None:
            raise error(ERR_REQUEST, "recv of a buffer message (from Comm.Mprobe): use Recv")
        if isinstance(inc, Held):
            value, st = inc.value, inc.status
        else:
            try:
                value, st = objects._finish_recv(self._comm, inc,
                                                 f"recv from rank {inc.source} tag {inc.tag}")
            except errors.ProxyError as exc:
                raise convert(exc) from None
        return value, st

    def irecv(self) -> Request:
        if self._no_proc and self._obj is None:
            return ObjRequest(_Done(self.recv(), None))
        return ObjRequest(_Done(*self._receive()))

    def free(self) -> None:
        """Drop a message that needs no receive (MESSAGE_NULL, or a probe of PROC_NULL's): it becomes
        MESSAGE_NULL. A message a matched probe took must be received; freeing it is an error."""
        if self._m is not None or self._obj is not None:
            raise error(ERR_REQUEST, "free of a matched message that was not received (Recv/recv it)")
        if self._no_proc and self is not globals().get("MESSAGE_NO_PROC"):
            self._no_proc = False

    def __repr__(self) -> str:
        return "<MPI.Message>" if self else "<MPI.MESSAGE_NULL>"


class Held:
    """An object a matched probe took whole (one a rank sent itself: it never crossed the runtime),
    with the status of its receive; the Message's recv() hands it over."""

    __slots__ = ("value", "status")

    def __init__(self, value: Any, status: Any):
        self.value, self.status = value, status


class _Done:
    """An object request that is complete already (Message.irecv of an object in hand)."""

    __slots__ = ("_value", "status")

    def __init__(self, value: Any, status: Any):
        self._value, self.status = value, status

    def wait(self) -> Any:
        return self._value

    def test(self) -> tuple[bool, Any]:
        return True, self._value


_NUMBERS = Numbers("message", ERR_REQUEST)
MESSAGE_NULL = Message()
MESSAGE_NO_PROC = Message._of(no_proc=True)
