"""The rank side of the service: a client of the progress process's control socket.

Protocol (proxy/control/protocol.py): every request carries an ``op_id``; the response names it again. A rank
may post several requests (``call_async``) before it waits for any; responses that arrive for op_ids
other than the one being waited for are kept in the expected-response table until their own ``wait``.
``call`` is the blocking helper: post, then wait. A response with a nonzero result is raised as the
``shmproxy.core.errors`` class its code names; a response for an op_id never posted, or a malformed frame, is a
ProtocolError and breaks the client (the stream can no longer be trusted).

Threading. Ranks use a client from one thread, but it is safe from several. Sends are serialised by one
lock (a frame is never interleaved with another). Receives follow the leader/follower pattern: one
waiter at a time reads the socket (outside the lock) and files every response it reads under its
op_id, then wakes the others; the rest wait on a condition variable, each with its own deadline. A
waiter is therefore never delayed by another's longer timeout. The socket is non-blocking; a timeout
in the middle of a frame keeps the partial frame for the next wait.

Rendezvous. ``connect`` retries on ENOENT (the socket file does not exist yet) and ECONNREFUSED (it
exists but nobody listens yet, or a stale file): the progress process is started by local rank 0 and
may still be importing when the other ranks get here, and the launcher gives us no channel through
which it could announce "ready" before its socket exists. Retrying the connect *is* the rendezvous.
The backoff is exponential from 1 ms to a 20 ms cap, so a fast start costs ~1 ms and a slow one a few
wake-ups per second; it is bounded by ``timeout`` and checks ``should_abort`` between attempts.

Failures. The server closing the connection (the progress process died, or dropped this client) is a
PeerDiedError with rank -1 (the progress process) and the server's pid; a send that cannot complete
within the client's timeout breaks the client too, since a partly sent frame desynchronises the stream.
"""
from __future__ import annotations

import itertools
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Sequence

from shmproxy.core import errors
from shmproxy.core import log as plog
from shmproxy.control.protocol import (MAX_FDS, MAX_PAYLOAD, MsgType, ProtocolError, Response, ResponseReader,
                                       close_fds, encode_request, send_frame)

log = plog.get("SERVICE")

_BACKOFF_START = 0.001
_BACKOFF_CAP = 0.020
_PEERCRED = struct.Struct("3i")


class ServiceClient:
    """A connection to the service of one progress process. Use :meth:`connect`."""

    def __init__(self, sock: socket.socket, timeout: float, name: str = "service") -> None:
        """Wrap a connected Unix stream socket (taken over: :meth:`close` closes it).

        ``timeout`` bounds every send and is the default timeout of :meth:`call`.
        """
        sock.setblocking(False)
        self._sock = sock
        self._timeout = timeout
        self.name = name
        try:
            self.server_pid: int | None = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
        except OSError:
            self.server_pid = None
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()      # guards everything below
        self._reader = ResponseReader()
        self._reading = False                   # one waiter (the leader) is reading the socket
        self._expected: dict[int, tuple[MsgType, int]] = {}   # op_id -> (type, resp_size)
        self._ready: dict[int, Response] = {}
        self._abandoned: set[int] = set()       # timed out in call(): discard their responses
        self._broken: errors.ProxyError | None = None
        self._closed = False
        self._ids = itertools.count(1)
        self._rank = -1                         # from the INIT payload; goes in every request header

    @classmethod
    def connect(cls, path: str, timeout: float,
                should_abort: Callable[[], bool] | None = None) -> "ServiceClient":
        """Connect to the service socket at ``path``, waiting for it to appear (see the module header).

        Raises Timeout (naming the path) if no server accepts within ``timeout`` seconds, Aborted if
        ``should_abort()`` becomes true, SystemError_ for any other OS error, RemoteError if the socket
        is served by another user.
        """
        deadline = time.monotonic() + timeout
        delay = _BACKOFF_START
        while True:
            if should_abort is not None and should_abort():
                raise errors.Aborted(f"aborted while waiting for the service socket {path}")
            remaining = deadline - time.monotonic()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(max(remaining, 0.001))
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError, BlockingIOError, TimeoutError):
                sock.close()            # not there yet, not listening yet, or its backlog is full
            except OSError as exc:
                sock.close()
                raise errors.from_oserror(f"cannot connect to the service socket {path}", exc) from exc
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.Timeout(
                    f"no progress process accepted a connection on {path} within {timeout} s "
                    f"(it is still starting, or it failed: see its log)")
            time.sleep(min(delay, remaining))   # backoff between attempts; there is nothing to wait on
            delay = min(delay * 2, _BACKOFF_CAP)
        uid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]
        if uid != os.getuid():
            sock.close()
            raise errors.RemoteError(f"the service socket {path} is served by uid {uid}, "
                                     f"not by uid {os.getuid()}")
        log.info("connected to the service at %s", path)
        return cls(sock, timeout, name=path)

    @property
    def closed(self) -> bool:
        return self._closed

    def call_async(self, msg: MsgType, payload: dict[str, Any], fds: Sequence[int] = (),
                   resp_size: int = MAX_PAYLOAD) -> int:
        """Send a request and return its op_id, to be passed to :meth:`wait`.

        ``fds`` are borrowed: they are sent, not closed. Raises InvalidArgument (bad type, payload or
        fds; nothing was sent), Closed, PeerDiedError (the server is gone), Timeout (the server did not
        read the request within the client's timeout; the client is then broken).
        """
        try:
            msg = MsgType(msg)
        except ValueError:
            raise errors.InvalidArgument(f"unknown message type {msg!r}") from None
        if len(fds) > MAX_FDS:
            raise errors.InvalidArgument(f"{len(fds)} file descriptors in one request, at most {MAX_FDS}")
        with self._send_lock:
            self._check_usable()
            op_id = next(self._ids)
            rank = self._rank
            if msg is MsgType.INIT:
                value = payload.get("rank") if isinstance(payload, dict) else None
                rank = value if isinstance(value, int) and not isinstance(value, bool) else -1
            data = encode_request(msg, rank, op_id, payload, resp_size)   # InvalidArgument: nothing sent
            with self._cond:
                self._expected[op_id] = (msg, resp_size)
            try:
                send_frame(self._sock, data, fds, self._timeout)
            except errors.Timeout:
                err = errors.Timeout(f"sending {msg.name} (op_id {op_id}) to the service at {self.name}: "
                                     f"it did not read the request within {self._timeout} s")
                self._fail(err)
                raise err from None
            except OSError as exc:
                self._fail(self._died(f"sending {msg.name} failed: {exc}"))
                raise self._broken_error() from exc
            if msg is MsgType.INIT:
                self._rank = rank
        return op_id

    def wait(self, op_id: int, timeout: float) -> tuple[dict[str, Any], list[int]]:
        """Wait for the response to ``op_id``; return its payload and the fds that came with it (now
        the caller's).

        Raises the error the service answered with (``errors.from_code``), Timeout naming the message
        type and op_id (the op stays expected: wait again to collect it), PeerDiedError(rank=-1) if
        the server is gone, ProtocolError if it sent garbage, Closed, InvalidArgument for an op_id that
        is not pending.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                resp = self._ready.pop(op_id, None)
                if resp is not None:
                    msg, _ = self._expected.pop(op_id)
                    break
                if self._closed:
                    raise errors.Closed(f"the service client for {self.name} is closed")
                if op_id not in self._expected:
                    raise errors.InvalidArgument(f"op_id {op_id} is not pending (never posted, or already "
                                                 f"waited for)")
                if self._broken is not None:
                    raise self._broken_error()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    msg, _ = self._expected[op_id]
                    raise errors.Timeout(f"no response to {msg.name} (op_id {op_id}) from the service at "
                                         f"{self.name} within {timeout} s")
                if self._reading:
                    self._cond.wait(remaining)
                else:
                    self._lead(remaining)
        return self._result(msg, op_id, resp)

    def call(self, msg: MsgType, payload: dict[str, Any], fds: Sequence[int] = (),
             timeout: float | None = None) -> tuple[dict[str, Any], list[int]]:
        """:meth:`call_async` then :meth:`wait`; ``timeout`` None means the client's timeout.

        On Timeout the request is abandoned: its response, if it comes later, is discarded.
        """
        op_id = self.call_async(msg, payload, fds)
        try:
            return self.wait(op_id, self._timeout if timeout is None else timeout)
        except errors.Timeout:
            self._abandon(op_id)
            raise

    def close(self) -> None:
        """Close the connection (no CLOSE message: send one first for a clean disconnect). Idempotent.

        Responses received but not collected are dropped and their fds closed.
        """
        with self._send_lock:
            with self._cond:
                if self._closed:
                    return
                self._closed = True
                ready, self._ready = list(self._ready.values()), {}
                self._expected.clear()
                reading = self._reading
                self._cond.notify_all()
            for resp in ready:
                close_fds(resp.fds)
            if reading:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)   # the leader wakes up and closes the socket
                except OSError:
                    pass
            else:
                self._close_socket()

    # ---------------------------------------------------------------- internals

    def _lead(self, timeout: float) -> None:
        """Read at most one response with the lock released; file it. Called and returns locked."""
        self._reading = True
        self._cond.release()
        try:
            outcome = self._read_one(timeout)
        finally:
            self._cond.acquire()
            self._reading = False
            self._cond.notify_all()
        if self._closed:
            if isinstance(outcome, Response):
                close_fds(outcome.fds)
            self._close_socket()
        elif isinstance(outcome, errors.ProxyError):
            self._fail(outcome)
        elif outcome is not None:
            self._file(outcome)

    def _read_one(self, timeout: float) -> Response | errors.ProxyError | None:
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        try:
            if not poller.poll(timeout * 1000.0):
                return None
            return self._reader.read(self._sock)
        except EOFError:
            return self._died("the service closed the connection")
        except ProtocolError as exc:
            return ProtocolError(f"the service at {self.name} sent a bad frame: {exc}")
        except OSError as exc:
            return self._died(f"the connection to the service failed: {exc}")

    def _file(self, resp: Response) -> None:
        """Keep a response under its op_id (called locked)."""
        op_id = resp.op_id
        if op_id in self._abandoned:
            self._abandoned.discard(op_id)
            close_fds(resp.fds)
            return
        expected = self._expected.get(op_id)
        if expected is None or op_id in self._ready:
            close_fds(resp.fds)
            self._fail(ProtocolError(f"the service at {self.name} answered op_id {op_id}, which is not "
                                     f"pending"))
        elif resp.result == 0 and resp.size > expected[1]:     # errors are small and always allowed
            close_fds(resp.fds)
            self._fail(ProtocolError(f"the service answered {expected[0].name} (op_id {op_id}) with "
                                     f"{resp.size} bytes, more than the {expected[1]} requested"))
        else:
            self._ready[op_id] = resp

    def _abandon(self, op_id: int) -> None:
        with self._cond:
            if self._expected.pop(op_id, None) is not None:
                resp = self._ready.pop(op_id, None)
                if resp is not None:
                    close_fds(resp.fds)
                else:
                    self._abandoned.add(op_id)

    @staticmethod
    def _result(msg: MsgType, op_id: int, resp: Response) -> tuple[dict[str, Any], list[int]]:
        if resp.result == 0:
            return resp.payload, resp.fds
        close_fds(resp.fds)
        p = resp.payload
        message = p.get("message") if isinstance(p.get("message"), str) else "(no message)"
        rank, pid = p.get("rank"), p.get("pid")
        raise errors.from_code(resp.result, f"{msg.name} (op_id {op_id}) failed: {message}",
                               rank=rank if isinstance(rank, int) else None,
                               pid=pid if isinstance(pid, int) else None)

    def _check_usable(self) -> None:
        with self._cond:
            if self._closed:
                raise errors.Closed(f"the service client for {self.name} is closed")
            if self._broken is not None:
                raise self._broken_error()

    def _died(self, what: str) -> errors.PeerDiedError:
        return errors.PeerDiedError(
            f"{what}: the progress process (pid {self.server_pid}) serving {self.name} died or dropped "
            f"this client (see its SERVICE log)", rank=-1, pid=self.server_pid)

    def _fail(self, exc: errors.ProxyError) -> None:
        """Break the client: every later call raises (a copy of) ``exc``. The first failure wins."""
        with self._cond:
            if self._broken is None:
                self._broken = exc
                log.warning("service client for %s broken: %s", self.name, exc)
            self._cond.notify_all()

    def _broken_error(self) -> errors.ProxyError:
        """A fresh exception for the failure that broke the client (each raise gets its own traceback)."""
        exc = self._broken
        assert exc is not None
        if isinstance(exc, errors.PeerDiedError):
            return errors.PeerDiedError(str(exc), rank=exc.rank, pid=exc.pid)
        return type(exc)(str(exc))

    def _close_socket(self) -> None:
        self._sock.close()
        self._reader.close()
