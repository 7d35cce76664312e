"""Native-like requests of the point-to-point layer (p2p.py): objects with the native Request's
Wait/Test/Cancel/status/describe, for operations that are not one native request."""
from __future__ import annotations

from typing import Any

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
