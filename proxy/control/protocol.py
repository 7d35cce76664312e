"""Wire protocol of the service (control plane): message types, connection states, frames.

A rank talks to the progress process of its communicator over a Unix stream socket (docs/architecture.md,
"Joining a communicator"). Every message is one *frame*: a fixed binary header followed by a JSON object (the control
plane is not the hot path, so readable beats compact). File descriptors (memfds of registered buffers)
travel as SCM_RIGHTS ancillary data attached to the first byte of the frame, i.e. to the header.

    request   magic 'SPXQ' | version u16 | type u16 | rank i32 | req_size u32 | resp_size u32
              | reserved u32 (0) | op_id u64                                    32 bytes, little endian
    response  magic 'SPXR' | version u16 | reserved u16 (0) | op_id u64 | result i32 | resp_size u32
                                                                                24 bytes, little endian

``req_size``/``resp_size`` in a header is the size of the JSON payload that follows it, except that a
request's ``resp_size`` is the largest successful response payload its caller accepts (a larger one
is answered with a TruncationError instead). ``result`` is 0 or a ``shmproxy.core.errors`` code; an error
response's payload is ``{"message": str}`` (plus ``rank``/``pid`` for a PeerDiedError), a few KiB at
most whatever ``resp_size`` says. Payloads are capped at MAX_PAYLOAD bytes and a frame carries at
most MAX_FDS fds.

Where fds land. On a Unix stream socket the kernel attaches the fds to the segment they were sent
with and hands them to the first recvmsg() that reads any byte of it. Both readers below therefore
read *exactly* the bytes of the current frame (the header, then the payload), never ahead: every fd
that arrives while a frame is being read belongs to that frame. The reader is incremental (a
non-blocking socket may deliver a frame in pieces), so the service loop can interleave many clients
without ever blocking on one of them. Received fds are close-on-exec (MSG_CMSG_CLOEXEC); sends use
MSG_NOSIGNAL. Both call sendmsg/recvmsg directly, since ``socket.send_fds``/``recv_fds`` drop their
``flags`` argument (python/cpython#107898).

Validation. Anything malformed (bad magic or version, a nonzero reserved field, an unknown message type,
an oversize payload, a truncated frame, bad JSON, JSON that is not an object, more than MAX_FDS fds,
MSG_CTRUNC) raises :class:`ProtocolError` after closing every fd received for that frame. A peer that
sends one is not trusted with anything more: the caller drops the connection.

State machine. ``TRANSITIONS`` says, for every message type, the connection states it is accepted in and
the state a successful request leads to; :func:`next_state` applies it.
"""
from __future__ import annotations

import json
import os
import select
import socket
import struct
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Sequence

from shmproxy.core import errors

PROTOCOL_VERSION = 1
REQUEST_MAGIC = b"SPXQ"
RESPONSE_MAGIC = b"SPXR"
MAX_PAYLOAD = 64 << 10
TYPE_PART_BLOCKS = 1024   # blocks per TYPE_REGISTER part: 2 JSON ints of at most 20 digits each fit
TYPE_MAX_BLOCKS = 1 << 20  # blocks of one registered datatype (16 MiB of table in the progress process)
MAX_FDS = 8

REQUEST_HEADER = struct.Struct("<4sHHiIIIQ")   # magic version type rank req_size resp_size reserved op_id
RESPONSE_HEADER = struct.Struct("<4sHHQiI")    # magic version reserved op_id result resp_size
assert REQUEST_HEADER.size == 32 and RESPONSE_HEADER.size == 24


class MsgType(IntEnum):
    INIT = 1
    SHARED_INIT = 2
    SETUP = 3
    CONNECT = 4
    REGISTER = 5
    DEREGISTER = 6
    CLOSE = 7
    ABORT = 8
    STOP = 9
    GETFD = 10
    QUERYFD = 11
    TYPE_REGISTER = 12   # a derived datatype's block list (handler.py), in parts of at most TYPE_PART_BLOCKS


class ConnState(IntEnum):
    UNINITIALIZED = 0
    INITIALIZED = 1
    SHARED_INITIALIZED = 2
    SETUP_DONE = 3
    CONNECTED = 4
    CLOSED = 5


class ProtocolError(errors.RemoteError):
    """A peer sent something that is not a valid frame; the connection cannot be trusted any more."""


_S = ConnState
_OPEN_FROM_SHARED = frozenset({_S.SHARED_INITIALIZED, _S.SETUP_DONE, _S.CONNECTED})
_ANY_INITIALIZED = frozenset(s for s in _S if s >= _S.INITIALIZED)

# message type -> (states it is accepted in, state after success; None = unchanged)
TRANSITIONS: dict[MsgType, tuple[frozenset[ConnState], ConnState | None]] = {
    MsgType.INIT: (frozenset({_S.UNINITIALIZED}), _S.INITIALIZED),
    MsgType.SHARED_INIT: (frozenset({_S.INITIALIZED}), _S.SHARED_INITIALIZED),
    MsgType.SETUP: (frozenset({_S.SHARED_INITIALIZED}), _S.SETUP_DONE),
    MsgType.CONNECT: (frozenset({_S.SETUP_DONE, _S.CONNECTED}), _S.CONNECTED),
    MsgType.REGISTER: (_OPEN_FROM_SHARED, None),
    MsgType.DEREGISTER: (_OPEN_FROM_SHARED, None),
    MsgType.GETFD: (_OPEN_FROM_SHARED, None),
    MsgType.QUERYFD: (_OPEN_FROM_SHARED, None),
    MsgType.TYPE_REGISTER: (_OPEN_FROM_SHARED, None),
    MsgType.CLOSE: (_ANY_INITIALIZED, _S.CLOSED),      # CLOSE twice is harmless
    MsgType.ABORT: (_ANY_INITIALIZED, None),
    MsgType.STOP: (_ANY_INITIALIZED, None),
}
assert set(TRANSITIONS) == set(MsgType)


def next_state(state: ConnState, msg: MsgType) -> ConnState:
    """The state after a successful ``msg`` in ``state``; raises InvalidUsage if not allowed there."""
    allowed, after = TRANSITIONS[msg]
    if state not in allowed:
        names = ", ".join(s.name for s in sorted(allowed))
        raise errors.InvalidUsage(f"{msg.name} is not allowed in state {state.name} (allowed in: {names})")
    return state if after is None else after


@dataclass
class Request:
    type: MsgType
    rank: int
    op_id: int
    resp_size: int
    payload: dict[str, Any]
    fds: list[int] = field(default_factory=list)


@dataclass
class Response:
    op_id: int
    result: int
    payload: dict[str, Any]
    fds: list[int] = field(default_factory=list)
    size: int = 0               # bytes of the encoded payload, checked against the request's resp_size


def close_fds(fds: Sequence[int]) -> None:
    """Close every fd, ignoring ones already closed (used on error paths only)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def encode_payload(payload: dict[str, Any], limit: int = MAX_PAYLOAD) -> bytes:
    """JSON-encode a payload; InvalidArgument if it is not a JSON object or is larger than ``limit``."""
    if not isinstance(payload, dict):
        raise errors.InvalidArgument(f"a payload must be a dict, not {type(payload).__name__}")
    try:
        data = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise errors.InvalidArgument(f"payload is not JSON-serialisable: {exc}") from exc
    if len(data) > limit:
        raise errors.InvalidArgument(f"payload of {len(data)} bytes exceeds the limit of {limit} bytes")
    return data


def encode_request(msg: MsgType, rank: int, op_id: int, payload: dict[str, Any],
                   resp_size: int = MAX_PAYLOAD) -> bytes:
    if not 0 <= resp_size <= MAX_PAYLOAD:
        raise errors.InvalidArgument(f"resp_size {resp_size} is outside [0, {MAX_PAYLOAD}]")
    body = encode_payload(payload)
    return REQUEST_HEADER.pack(REQUEST_MAGIC, PROTOCOL_VERSION, int(msg), rank, len(body), resp_size, 0,
                               op_id) + body


def pack_response(op_id: int, result: int, body: bytes) -> bytes:
    """A response frame around an already encoded payload (see :func:`encode_payload`)."""
    return RESPONSE_HEADER.pack(RESPONSE_MAGIC, PROTOCOL_VERSION, 0, op_id, result, len(body)) + body


def encode_response(op_id: int, result: int, payload: dict[str, Any]) -> bytes:
    return pack_response(op_id, result, encode_payload(payload))


def error_payload(exc: errors.ProxyError) -> dict[str, Any]:
    out: dict[str, Any] = {"message": str(exc)[:4096]}
    for attr in ("rank", "pid"):
        value = getattr(exc, attr, None)
        if isinstance(value, int):
            out[attr] = value
    return out


class _FrameReader:
    """Incremental reader of one kind of frame from a non-blocking socket (see the module header)."""

    HEADER: struct.Struct

    def __init__(self) -> None:
        self._buf = bytearray()
        self._header: tuple[Any, ...] | None = None
        self._size = 0
        self._fds: list[int] = []

    @property
    def in_progress(self) -> bool:
        """True while part of a frame (or fds for it) has arrived but not all of it."""
        return bool(self._buf) or self._header is not None or bool(self._fds)

    def read(self, sock: socket.socket) -> Any:
        """Read what is available for the current frame; return it once complete, else None.

        Raises EOFError on a clean end of stream between frames, ProtocolError on anything malformed
        (fds received for the frame are closed first), OSError from the socket as it comes.
        """
        try:
            return self._read(sock)
        except ProtocolError:
            self.close()
            raise

    def _read(self, sock: socket.socket) -> Any:
        while True:
            need = (self.HEADER.size if self._header is None else self._size) - len(self._buf)
            if need > 0:
                try:
                    data, fds, flags = _recv_with_fds(sock, need)
                except BlockingIOError:
                    return None
                self._fds.extend(fds)
                if flags & socket.MSG_CTRUNC or len(self._fds) > MAX_FDS:
                    raise ProtocolError(f"more than {MAX_FDS} file descriptors in one frame")
                if not data:
                    if not self.in_progress:
                        raise EOFError("end of stream")
                    raise ProtocolError("connection closed in the middle of a frame (truncated frame)")
                self._buf += data
                if len(data) < need:
                    continue        # loop until the socket says EAGAIN or the part is complete
            if self._header is None:
                self._header = self.HEADER.unpack(self._buf)
                self._size = self._check_header(self._header)
                self._buf.clear()
                continue
            payload = decode_payload(bytes(self._buf))
            frame = self._build(self._header, payload, self._fds)
            self._buf.clear()
            self._header, self._size, self._fds = None, 0, []
            return frame

    def close(self) -> None:
        """Forget a partial frame, closing the fds received for it. Idempotent."""
        fds, self._fds = self._fds, []
        close_fds(fds)
        self._buf.clear()
        self._header = None

    def _check_header(self, header: tuple[Any, ...]) -> int:
        raise NotImplementedError

    def _build(self, header: tuple[Any, ...], payload: dict[str, Any], fds: list[int]) -> Any:
        raise NotImplementedError


def _check_common(kind: str, magic: bytes, expected: bytes, version: int, reserved: int, size: int) -> None:
    if magic != expected:
        raise ProtocolError(f"bad {kind} magic {magic!r} (expected {expected!r}): not a shmproxy peer")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"{kind} protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    if reserved != 0:
        raise ProtocolError(f"reserved {kind} header field is {reserved}, expected 0")
    if size > MAX_PAYLOAD:
        raise ProtocolError(f"{kind} payload of {size} bytes exceeds the limit of {MAX_PAYLOAD}")


class RequestReader(_FrameReader):
    """Reads :class:`Request` frames (the service side)."""

    HEADER = REQUEST_HEADER

    def _check_header(self, header: tuple[Any, ...]) -> int:
        magic, version, mtype, _rank, req_size, resp_size, reserved, _op_id = header
        _check_common("request", magic, REQUEST_MAGIC, version, reserved, req_size)
        try:
            MsgType(mtype)
        except ValueError:
            raise ProtocolError(f"unknown message type {mtype}") from None
        if resp_size > MAX_PAYLOAD:
            raise ProtocolError(f"requested response size {resp_size} exceeds the limit of {MAX_PAYLOAD}")
        return int(req_size)

    def _build(self, header: tuple[Any, ...], payload: dict[str, Any], fds: list[int]) -> Request:
        _magic, _version, mtype, rank, _req_size, resp_size, _reserved, op_id = header
        return Request(MsgType(mtype), rank, op_id, resp_size, payload, fds)


class ResponseReader(_FrameReader):
    """Reads :class:`Response` frames (the client side)."""

    HEADER = RESPONSE_HEADER

    def _check_header(self, header: tuple[Any, ...]) -> int:
        magic, version, reserved, _op_id, _result, resp_size = header
        _check_common("response", magic, RESPONSE_MAGIC, version, reserved, resp_size)
        return int(resp_size)

    def _build(self, header: tuple[Any, ...], payload: dict[str, Any], fds: list[int]) -> Response:
        _magic, _version, _reserved, op_id, result, resp_size = header
        return Response(op_id, result, payload, fds, resp_size)


_FD_SIZE = struct.calcsize("i")
_ANCBUF = socket.CMSG_SPACE(MAX_FDS * _FD_SIZE)


def _recv_with_fds(sock: socket.socket, size: int) -> tuple[bytes, list[int], int]:
    """recvmsg() of up to ``size`` bytes plus SCM_RIGHTS fds, received close-on-exec.

    Not ``socket.recv_fds``: it ignores its ``flags`` argument (python/cpython#107898, unfixed in 3.11),
    so the fds would arrive inheritable and leak into every child the process spawns.
    """
    data, ancdata, flags, _ = sock.recvmsg(size, _ANCBUF, socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, ctype, cdata in ancdata:
        if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
            usable = len(cdata) - len(cdata) % _FD_SIZE
            fds.extend(struct.unpack(f"{usable // _FD_SIZE}i", cdata[:usable]))
    return data, fds, flags


def decode_payload(data: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"payload is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ProtocolError(f"payload must be a JSON object, got {type(payload).__name__}")
    return payload


def _wait_io(sock: socket.socket, event: int, deadline: float, what: str) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise errors.Timeout(f"{what}: timed out")
    poller = select.poll()
    poller.register(sock, event)
    poller.poll(remaining * 1000.0)


def send_some(sock: socket.socket, data: memoryview, fds: Sequence[int] = ()) -> int:
    """One non-blocking send of ``data`` (with ``fds`` attached to its first byte); 0 on EAGAIN."""
    try:
        if fds:     # not socket.send_fds, which drops its flags argument (python/cpython#107898)
            rights = struct.pack(f"{len(fds)}i", *fds)
            return sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)], socket.MSG_NOSIGNAL)
        return sock.send(data, socket.MSG_NOSIGNAL)
    except BlockingIOError:
        return 0


def send_frame(sock: socket.socket, data: bytes, fds: Sequence[int], timeout: float) -> None:
    """Send a whole encoded frame over a non-blocking socket within ``timeout`` seconds.

    ``fds`` are borrowed: they are sent, not closed. Raises InvalidArgument for too many fds, Timeout
    (the peer does not read; a part of the frame may have been sent), OSError from the socket.
    """
    if len(fds) > MAX_FDS:
        raise errors.InvalidArgument(f"{len(fds)} file descriptors in one frame, at most {MAX_FDS}")
    deadline = time.monotonic() + timeout
    view = memoryview(data)
    pending_fds: Sequence[int] = fds
    while view:
        n = send_some(sock, view, pending_fds)
        if n == 0:
            _wait_io(sock, select.POLLOUT, deadline, "sending a frame")
            continue
        pending_fds = ()
        view = view[n:]


def _recv_frame(sock: socket.socket, reader: _FrameReader, own: bool, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    try:
        while True:
            frame = reader.read(sock)
            if frame is not None:
                return frame
            _wait_io(sock, select.POLLIN, deadline, "receiving a frame")
    except BaseException:
        if own:
            reader.close()      # a reader of our own dies with this call: no fd may outlive it
        raise


def recv_request(sock: socket.socket, timeout: float, reader: RequestReader | None = None) -> Request:
    """Receive one whole request from a non-blocking socket (EOFError, ProtocolError, Timeout).

    Pass a ``reader`` to resume a frame after a Timeout; without one, a partial frame is discarded.
    """
    return _recv_frame(sock, reader or RequestReader(), reader is None, timeout)


def recv_response(sock: socket.socket, timeout: float, reader: ResponseReader | None = None) -> Response:
    """Receive one whole response from a non-blocking socket (EOFError, ProtocolError, Timeout).

    Pass a ``reader`` to resume a frame after a Timeout; without one, a partial frame is discarded.
    """
    return _recv_frame(sock, reader or ResponseReader(), reader is None, timeout)
