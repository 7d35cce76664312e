"""The error vocabulary of shmproxy, in one place.

Errors cross process boundaries as a small integer code (in the pool's asyncResult, in a request's
completion slot, in a service response), so every class has a stable ``code``; ``from_code`` turns a
code and its message back into the right exception on the other side.

    ProxyError                      base of everything we raise
    |-- InvalidArgument (ValueError)  bad input, caught before anything is posted; comm stays usable
    |-- InvalidUsage                  a correct call at the wrong time (mismatched collectives, ...)
    |-- SystemError_ (OSError cause)  the OS said no (errno kept, __cause__ set)
    |-- RemoteError                   a peer broke the protocol or failed
    |   `-- PeerDiedError              a rank or the progress process died (names rank and pid)
    |-- Timeout (TimeoutError)        a bounded wait expired; says what was pending and on whom
    |-- Closed                        the communicator was closed by this process
    |-- Aborted                       the communicator was aborted (by comm.Abort() or a failure)
    `-- InternalError                 a bug in shmproxy: please report it
"""
from __future__ import annotations

import builtins


class ProxyError(Exception):
    """Base of every error shmproxy raises."""

    code = 1


class InvalidArgument(ProxyError, ValueError):
    """A bad argument, detected before anything was posted; the communicator is still usable."""

    code = 2


class InvalidUsage(ProxyError):
    """A call that is valid alone but not here (e.g. ranks disagree on a collective)."""

    code = 3


class SystemError_(ProxyError):
    """The operating system refused something; ``errno`` and ``__cause__`` say what."""

    code = 4

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class RemoteError(ProxyError):
    """A peer process failed or broke the protocol."""

    code = 5


class PeerDiedError(RemoteError):
    """A rank or the progress process died. ``rank`` is -1 for the progress process."""

    code = 6

    def __init__(self, message: str, rank: int | None = None, pid: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.pid = pid


class Timeout(ProxyError, builtins.TimeoutError):
    """A bounded wait expired. The message says what was pending and on whom."""

    code = 7


class Closed(ProxyError):
    """The communicator was closed; no further calls are possible."""

    code = 8


class Aborted(ProxyError):
    """The communicator was aborted, by comm.Abort() or after a fatal error."""

    code = 9


class InternalError(ProxyError):
    """A bug in shmproxy. Please report it with the dump (``shmproxy-dump``)."""

    code = 10


class TruncationError(InvalidArgument):
    """A message was larger than the receive buffer; nothing was written to the buffer."""

    code = 11


class PeerClosed(InvalidUsage):
    """A point-to-point request's peer closed the communicator before a message matched it (its
    code is InvalidUsage's: the progress process reports it so)."""


_BY_CODE: dict[int, type[ProxyError]] = {
    cls.code: cls
    for cls in (ProxyError, InvalidArgument, InvalidUsage, SystemError_, RemoteError, PeerDiedError,
                Timeout, Closed, Aborted, InternalError, TruncationError)
}


def from_code(code: int, message: str, rank: int | None = None, pid: int | None = None) -> ProxyError:
    """Rebuild the exception that ``code`` stands for (codes travel through shared memory)."""
    cls = _BY_CODE.get(code, InternalError)
    if cls is PeerDiedError:
        return PeerDiedError(message, rank=rank, pid=pid)
    return cls(message)


def while_joining(failure: ProxyError) -> ProxyError:
    """The failure a rank still joining the communicator meets, whichever way it learns it: the
    service refusing its join (control/handler.py) or the pool's record once the service is gone
    (rank/lifecycle.py). Same class, who and pid as ``failure``."""
    return from_code(failure.code, f"the communicator failed while this rank joined: {failure}",
                     rank=getattr(failure, "rank", None), pid=getattr(failure, "pid", None))


def from_oserror(what: str, exc: OSError) -> SystemError_:
    """Wrap an OSError, keeping errno and the cause."""
    err = SystemError_(f"{what}: {exc.strerror or exc}", errno=exc.errno)
    err.__cause__ = exc
    return err
