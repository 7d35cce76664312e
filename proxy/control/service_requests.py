"""What one control request does, apart from the sockets it travels on (those are service.py's).

A request read whole from a client (protocol.RequestReader) goes through ``serve``: the connection's
state machine (``protocol.TRANSITIONS``), the trust checks, the handler, and the check of what the
handler answered, and comes out as the response's bytes and the fds to send with it. Nothing here
touches a socket, a selector or a thread: the service loop (shmproxy.control.service) owns those,
and decides what an error means for the connection (``Rejected``: answer, then drop).

Trust. The peer's pid and uid come from SO_PEERCRED, never from a payload (the loop reads them at
accept). INIT must present the job token (compared in constant time) and integer ``rank``/
``local_rank``; otherwise the client gets an InvalidArgument response and is dropped. The token is
removed from the INIT payload before the handler sees it. Every later request must name the rank its
connection joined as.

The handler sees only requests the state machine allows; a request in the wrong state gets an
InvalidUsage response and the client stays connected. The state advances only when the handler
succeeds. A ProxyError of the handler becomes an error response with its code and message; what it
returns is checked (fds open, payload encodable, within the size the caller accepts) before any of it
is sent.
"""
from __future__ import annotations

import fcntl
import hmac
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard

from shmproxy.core import errors
from shmproxy.core import log as plog
from shmproxy.control.protocol import (MAX_FDS, MAX_PAYLOAD, ConnState, MsgType, Request, close_fds,
                                       encode_payload, next_state, pack_response)

log = plog.get("SERVICE")


@dataclass(eq=False)
class ConnInfo:
    """One client connection, as the handler sees it.

    ``pid``/``uid``/``gid`` come from SO_PEERCRED. ``rank``/``local_rank`` come from the INIT payload
    (-1 before). ``data`` is the handler's own per-connection storage; the server never looks at it.
    """

    id: int                     # serial number of the connection (fds get reused, ids do not)
    fd: int                     # the socket's fd, for log lines; the handler must not touch it
    pid: int
    uid: int
    gid: int
    rank: int = -1
    local_rank: int = -1
    state: ConnState = ConnState.UNINITIALIZED
    data: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        return f"connection {self.id} (pid {self.pid}, rank {self.rank}, {self.state.name})"


class ServiceHandler(Protocol):
    """What the progress process implements. Every method runs on the service thread."""

    def handle(self, conn: ConnInfo, msg: MsgType, payload: dict[str, Any],
               fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        """Serve one request; return the response payload and fds to send with it.

        The received ``fds`` belong to the handler from the moment it is called, even when it raises.
        The returned fds are borrowed: the server sends them and does not close them. A ProxyError
        becomes an error response with its code and message; any other exception an InternalError
        response (logged with its traceback). Either way the server keeps running.
        """
        ...

    def on_disconnect(self, conn: ConnInfo, clean: bool) -> None:
        """The socket of an initialized connection is gone; ``clean`` means a CLOSE came first."""
        ...

    def on_process_exit(self, conn: ConnInfo) -> None:
        """The peer process of an initialized connection exited (called once per connection)."""
        ...


class Rejected(errors.InvalidArgument):
    """INIT failed authentication or validation: answer, then drop the client."""


def serve(handler: ServiceHandler, token: bytes, info: ConnInfo, req: Request) -> tuple[bytes, list[int]]:
    """Run one request through the state machine and the handler: the response and the fds to send
    with it (the handler's, borrowed). A ProxyError is for an error response; ``Rejected`` also
    drops the client."""
    try:
        after = next_state(info.state, req.type)
        payload = check_init(info, req, token) if req.type is MsgType.INIT else check_rank(info, req)
    except BaseException:
        close_fds(req.fds)          # the handler never saw them
        raise
    try:
        result, out_fds = handler.handle(info, req.type, payload, req.fds)
    except BaseException:
        if req.type is MsgType.INIT:
            info.rank = info.local_rank = -1
        raise
    body = check_result(req, result, out_fds)
    info.state = after
    if req.type is MsgType.INIT:
        log.info("%s initialized", info.describe())
    return pack_response(req.op_id, 0, body), list(out_fds)


def check_init(info: ConnInfo, req: Request, token: bytes) -> dict[str, Any]:
    p = req.payload
    given = p.get("token")
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), token):
        raise Rejected("INIT rejected: missing or wrong job token (a socket of another job?)")
    rank, local_rank = p.get("rank"), p.get("local_rank")
    if not (_is_int(rank) and _is_int(local_rank) and rank >= 0 and local_rank >= 0):
        raise Rejected(f"INIT needs integer 'rank' and 'local_rank' >= 0, got {rank!r} and "
                       f"{local_rank!r}")
    if req.rank != rank:
        raise Rejected(f"INIT header names rank {req.rank} but the payload rank {rank}")
    info.rank, info.local_rank = rank, local_rank
    return {k: v for k, v in p.items() if k != "token"}


def check_rank(info: ConnInfo, req: Request) -> dict[str, Any]:
    if req.rank != info.rank:
        raise errors.InvalidArgument(
            f"{req.type.name} header names rank {req.rank}; this connection is rank {info.rank}")
    return req.payload


def check_result(req: Request, result: Any, out_fds: Any) -> bytes:
    """The encoded response payload; InternalError if the handler returned something unusable."""
    name = req.type.name
    if not isinstance(out_fds, (list, tuple)) or len(out_fds) > MAX_FDS or \
            not all(_is_int(fd) and _fd_open(fd) for fd in out_fds):
        raise errors.InternalError(f"handler returned bad fds for {name}: {out_fds!r}")
    try:
        body = encode_payload(result, MAX_PAYLOAD)
    except errors.InvalidArgument as exc:
        raise errors.InternalError(f"handler's response to {name} cannot be sent: {exc}") from None
    if len(body) > req.resp_size:
        raise errors.TruncationError(
            f"the response to {name} is {len(body)} bytes; the caller accepts at most {req.resp_size}")
    return body


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _fd_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
        return True
    except OSError:
        return False
