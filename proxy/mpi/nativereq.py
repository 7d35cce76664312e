"""Native-like requests: objects with the native Request's Wait/Test/Cancel/status/describe, for
operations that are not one native request (p2p.py's buffered and combined sends, typedcoll.py's
nonblocking collectives into derived datatypes)."""
from __future__ import annotations

from typing import Any, Callable

from shmproxy.core.ops import ANY_TAG
from shmproxy.mpi.status import PROC_NULL


class Done:
    """A native-like request that is complete (a buffered send started by a persistent request)."""

    status = None
    _comm = None

    def Wait(self) -> None:
        return None

    def Test(self) -> bool:
        return True

    def Cancel(self) -> None:
        return None

    def describe(self) -> str:
        return "buffered send"


class NullRecv:
    """The status of a receive from PROC_NULL, in the native status's fields."""
    source, tag, nbytes, cancelled = PROC_NULL, ANY_TAG, 0, False


class Both:
    """A receive and a send (either may be absent) seen as one native request (Isendrecv): complete
    when both are; the status is the receive's."""

    __slots__ = ("_recv", "_send", "_comm")

    def __init__(self, recv: Any, send: Any):
        self._recv, self._send = recv, send
        self._comm = (recv or send)._comm

    def Wait(self) -> Any:
        if self._recv is not None:
            self._recv.Wait()
        if self._send is not None:
            self._send.Wait()
        return self.status

    def Test(self) -> bool:
        return all(r.Test() for r in (self._recv, self._send) if r is not None)

    def Cancel(self) -> None:
        for r in (self._recv, self._send):
            if r is not None:
                r.Cancel()

    @property
    def status(self) -> Any:
        return self._recv.status if self._recv is not None else NullRecv()

    def describe(self) -> str:
        return " and ".join(r.describe() for r in (self._recv, self._send) if r is not None)


class Then:
    """A native request and what must follow its completion in this rank (unpacking a derived
    datatype's output, typedcoll.py): ``after`` runs once, in the Wait or Test that sees the
    native request complete, before either returns."""

    __slots__ = ("_native", "_after", "_comm")
    _after: Callable[[], None] | None     # None once it ran

    def __init__(self, native: Any, after: Callable[[], None]):
        self._native, self._after = native, after
        self._comm = native._comm

    def _finish(self) -> None:
        after, self._after = self._after, None
        if after is not None:
            after()

    def Wait(self) -> Any:
        self._native.Wait()
        self._finish()
        return self.status

    def Test(self) -> bool:
        if not self._native.Test():
            return False
        self._finish()
        return True

    def Cancel(self) -> None:
        self._native.Cancel()

    @property
    def status(self) -> Any:
        return self._native.status

    def describe(self) -> str:
        return self._native.describe() + " (then unpacked into a derived datatype)"
