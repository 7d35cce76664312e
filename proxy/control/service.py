"""The service: the control plane of a progress process, served on a Unix domain socket.

Ranks connect to it to init, register buffers (memfds passed with SCM_RIGHTS), set up and connect
transports, close, abort and stop (docs/architecture.md, "Joining a communicator"; the wire format
is in proxy/control/protocol.py).

Threading. The service is one daemon thread ("shmproxy-service") of the progress process, so the data
loop never waits on a socket. It runs a ``selectors`` loop over the listening socket, a wake pipe (how
:meth:`ServiceServer.stop` interrupts it), every client socket and, once a connection is initialized, a
pidfd of the peer process (``os.pidfd_open``): a rank killed with SIGKILL is seen at once, not at the
next heartbeat. Every select is bounded, so the stop flag and the frame deadlines are always checked.
The handler (the progress process) is called on this thread only, one request at a time: it must
answer quickly and never block.

Why the loop cannot be wedged. Client sockets are non-blocking and read incrementally
(``protocol.RequestReader``); a client that has sent half a frame costs a buffer, never a blocked
thread. Responses go out through a per-connection queue flushed when the socket is writable; while a
client has unsent responses its further requests are not read (backpressure instead of unbounded
buffering). To bound the resources a stray client can hold, a connection in the middle of a frame, or
with responses it does not read, must finish within ``frame_timeout`` seconds or it is dropped. A
malformed frame drops that client only (logged as a WARN); other clients do not notice.

Requests. What one request does (the state machine, the job token and rank checks, the handler's
call and the check of its answer) is proxy/control/service_requests.py: this module moves bytes, fds
and connections, that one decides what a request gets. The peer's pid and uid come from SO_PEERCRED;
a uid other than the expected one is dropped at accept; a client whose INIT is rejected gets its
answer and is dropped. The socket file is created 0600 inside a 0700 directory that the caller
provides; :meth:`ServiceServer.stop` unlinks it (only if it is still ours).

Callbacks. ``on_disconnect`` and ``on_process_exit`` are called only for connections that reached
INITIALIZED, and not during :meth:`ServiceServer.stop` (the handler is being torn down then). After
an unclean disconnect the pidfd stays watched, so ``on_process_exit`` still tells the handler
whether the rank died; after a clean one (a CLOSE first) it is closed at once. A failing callback is
never swallowed: ``on_process_exit`` is how a rank's death becomes an error on every survivor, and a
death only logged is a hang until TIMEOUT. Its exception (or on_disconnect's) is logged and handed
to ``on_handler_error`` (the owner fails the communicator with it); without one it ends the loop
like any bug of the loop (``ServiceServer.error``). ``handle``'s own errors stay per request.
"""
from __future__ import annotations

import dataclasses
import enum
import fcntl
import itertools
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from shmproxy.core import errors
from shmproxy.core import log as plog
from shmproxy.control.protocol import (ConnState, MsgType, ProtocolError, Request, RequestReader, close_fds,
                                       encode_payload, error_payload, pack_response, send_some)
from shmproxy.control.service_requests import ConnInfo, Rejected, ServiceHandler, serve

__all__ = ["ConnInfo", "ServiceHandler", "ServiceServer"]

log = plog.get("SERVICE")

_PEERCRED = struct.Struct("3i")       # struct ucred: pid, uid, gid
_ACCEPTS_PER_WAKE = 64
_FRAMES_PER_WAKE = 16                 # per client and wake-up, so one busy client cannot starve others


class _HandlerFailed(BaseException):
    """A callback's error (its ``__cause__``) on its way to the loop's top level; not an Exception, so
    that serving INIT (whose pidfd may find the rank dead) cannot turn it into one error response."""


class _Kind(enum.Enum):
    LISTENER = 1
    WAKE = 2
    CLIENT = 3
    PIDFD = 4


@dataclass(eq=False)
class _Pending:
    """A response (or its unsent tail) waiting in a connection's output queue."""

    data: memoryview
    fds: list[int]              # sent with the first byte, then cleared
    owned: bool = False         # fds are our dups (closed once sent) rather than the handler's


@dataclass(eq=False)
class _Conn:
    info: ConnInfo
    sock: socket.socket | None
    reader: RequestReader = field(default_factory=RequestReader)
    outq: deque[_Pending] = field(default_factory=deque)
    events: int = selectors.EVENT_READ
    pidfd: int | None = None
    deadline: float | None = None   # set while a frame is half read or responses are unsent


class ServiceServer:
    """The service thread of one progress process. See the module header for the threading model."""

    def __init__(self, path: str, handler: ServiceHandler, token: str, uid: int | None = None, *,
                 frame_timeout: float = 5.0, on_handler_error: Callable[[BaseException], None] | None = None):
        # on_handler_error runs on the service thread (it must not block); see the module header.
        if not token:
            raise errors.InvalidArgument("the service needs a non-empty job token")
        if frame_timeout <= 0:
            raise errors.InvalidArgument(f"frame_timeout must be > 0, got {frame_timeout}")
        self.path = path
        self._handler = handler
        self._on_handler_error = on_handler_error
        self._token = token.encode()
        self._uid = os.getuid() if uid is None else uid
        self._frame_timeout = frame_timeout
        self._poll_interval = min(0.25, frame_timeout / 4)
        self._lock = threading.Lock()        # guards _conns, the wake fd and the start/stop flags
        self._conns: dict[int, _Conn] = {}
        self._pidfds: dict[int, _Conn] = {}  # watched pidfds, including those of dropped connections
        self._ids = itertools.count(1)
        self._sel: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._started = self._stop_called = False
        self._stopping = threading.Event()
        self._error: BaseException | None = None

    # ---------------------------------------------------------------- public API

    def start(self) -> None:
        """Bind the socket (mode 0600), listen and start the service thread.

        Raises SystemError_ if the socket cannot be bound (e.g. the path exists: a stale socket is not
        removed, since it may belong to a live process), InvalidUsage if called twice.
        """
        with self._lock:
            if self._started or self._stop_called:
                raise errors.InvalidUsage("ServiceServer.start() called twice or after stop()")
            self._started = True
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # On Linux the file gets the socket inode's mode at bind: 0600 from the first instant.
            os.fchmod(listener.fileno(), 0o600)
            listener.bind(self.path)
            st = os.stat(self.path)
            self._inode = (st.st_dev, st.st_ino)
            listener.listen(128)
            listener.setblocking(False)
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._sel = selectors.DefaultSelector()
            self._sel.register(listener, selectors.EVENT_READ, (_Kind.LISTENER, None))
            self._sel.register(self._wake_r, selectors.EVENT_READ, (_Kind.WAKE, None))
        except OSError as exc:
            listener.close()
            self._teardown()
            self._unlink()
            raise errors.from_oserror(f"cannot serve on {self.path}", exc) from exc
        self._listener = listener
        self._thread = threading.Thread(target=self._run, name="shmproxy-service", daemon=True)
        self._thread.start()
        log.info("service listening on %s", self.path)

    def stop(self, timeout: float) -> None:
        """Stop the thread (joined within ``timeout``), close every connection and pidfd, unlink the path.

        Idempotent; no handler callback is made. May be called from the handler itself (it then does
        not join: the loop ends when the handler returns). If the thread does not end in time (a
        handler is stuck) a WARN is logged and the thread releases its resources when it gets out.
        """
        with self._lock:
            if self._stop_called:
                return
            self._stop_called = True
        self._stopping.set()
        self._wake()
        thread = self._thread
        if thread is None:
            self._teardown()
        elif thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("service thread did not stop within %.1f s (a handler call is stuck?)", timeout)
        self._unlink()
        log.info("service on %s stopped", self.path)

    def connections(self) -> list[ConnInfo]:
        """A snapshot (copies) of the open connections, for the dump."""
        with self._lock:
            conns = list(self._conns.values())
        return [dataclasses.replace(c.info, data=dict(c.info.data)) for c in conns]

    @property
    def error(self) -> BaseException | None:
        """The exception that ended the service loop (a bug, or a callback's error nobody took), or None."""
        return self._error

    # ---------------------------------------------------------------- the loop

    def _run(self) -> None:
        assert self._sel is not None
        try:
            while not self._stopping.is_set():
                for key, mask in self._sel.select(self._poll_interval):
                    if self._stopping.is_set():
                        break           # stop() was called, maybe by a handler in this very batch
                    kind, conn = key.data
                    if kind is _Kind.CLIENT:
                        self._on_client(conn, mask)
                    elif kind is _Kind.PIDFD:
                        self._on_pidfd(conn)
                    elif kind is _Kind.LISTENER:
                        self._accept()
                    else:
                        self._drain_wake()
                self._expire(time.monotonic())
        except BaseException as exc:  # a bug in the loop itself: keep it for the progress process
            self._error = exc.__cause__ if isinstance(exc, _HandlerFailed) and exc.__cause__ else exc
            log.critical("service loop failed; no more control requests will be served", exc_info=True)
        finally:
            self._teardown()

    def _accept(self) -> None:
        assert self._listener is not None and self._sel is not None
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:      # EMFILE and friends: the client sees a refused/dropped socket
                log.warning("accept on %s failed: %s", self.path, exc)
                return
            try:
                pid, uid, gid = _PEERCRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
                sock.setblocking(False)
            except OSError as exc:
                log.warning("dropping a connection whose credentials cannot be read: %s", exc)
                sock.close()
                continue
            if uid != self._uid:
                log.warning("dropping a connection from pid %d uid %d: only uid %d may connect", pid, uid,
                            self._uid)
                sock.close()
                continue
            conn = _Conn(ConnInfo(id=next(self._ids), fd=sock.fileno(), pid=pid, uid=uid, gid=gid), sock)
            self._sel.register(sock, conn.events, (_Kind.CLIENT, conn))
            with self._lock:
                self._conns[conn.info.id] = conn
            log.info("accepted connection %d from pid %d", conn.info.id, pid)

    def _on_client(self, conn: _Conn, mask: int) -> None:
        if conn.sock is None:
            return                      # dropped earlier in this batch of events
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(conn)
            if mask & selectors.EVENT_READ:
                self._read_requests(conn)
        except EOFError:
            clean = conn.info.state is ConnState.CLOSED
            self._drop(conn, clean, "closed by the peer" + ("" if clean else " without CLOSE"), warn=False)
        except ProtocolError as exc:
            self._drop(conn, False, f"protocol error: {exc}")
        except OSError as exc:
            self._drop(conn, False, f"socket error: {exc}", warn=conn.info.state is not ConnState.CLOSED)
        except Exception:
            log.exception("bug while serving %s; dropping it", conn.info.describe())
            self._drop(conn, False, "internal error")

    def _read_requests(self, conn: _Conn) -> None:
        for _ in range(_FRAMES_PER_WAKE):
            if conn.outq or conn.sock is None:
                break                   # answer (or drop) before reading more
            req = conn.reader.read(conn.sock)
            if req is None:
                break
            self._dispatch(conn, req)
        self._update(conn)

    def _dispatch(self, conn: _Conn, req: Request) -> None:
        info = conn.info
        drop = False
        fds: list[int] = []
        try:
            data, fds = serve(self._handler, self._token, info, req)
            if req.type is MsgType.INIT:
                self._watch_pid(conn)
        except errors.ProxyError as exc:
            drop = isinstance(exc, Rejected)
            log.log(logging.WARNING if drop else plog.TRACE, "%s from %s failed: %s", req.type.name,
                    info.describe(), exc)
            data = pack_response(req.op_id, exc.code, encode_payload(error_payload(exc)))
        except Exception as exc:
            log.exception("handler failed on %s from %s", req.type.name, info.describe())
            err = errors.InternalError(f"the progress process failed serving {req.type.name}: {exc!r}")
            data = pack_response(req.op_id, err.code, encode_payload(error_payload(err)))
        conn.outq.append(_Pending(memoryview(data), fds))
        if drop:
            self._flush_once_and_drop(conn)
        else:
            self._flush(conn)

    # ---------------------------------------------------------------- output

    def _flush(self, conn: _Conn) -> None:
        """Send queued responses until done or EAGAIN. OSError: the caller drops the connection."""
        assert conn.sock is not None
        while conn.outq:
            pending = conn.outq[0]
            n = send_some(conn.sock, pending.data, pending.fds)
            if n == 0:
                if pending.fds and not pending.owned:
                    # The handler only lent these fds for now; keep our own references until sent.
                    pending.fds = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0) for fd in pending.fds]
                    pending.owned = True
                break
            if pending.owned:
                close_fds(pending.fds)  # the kernel holds its own references once sendmsg returned
            pending.fds = []
            pending.data = pending.data[n:]
            if not pending.data:
                conn.outq.popleft()
        self._update(conn)

    def _flush_once_and_drop(self, conn: _Conn) -> None:
        """Best effort: the rejection fits the socket buffer of any client that behaves."""
        try:
            assert conn.sock is not None
            send_some(conn.sock, conn.outq[0].data)
        except OSError:
            pass
        self._drop(conn, False, "INIT rejected")

    def _update(self, conn: _Conn) -> None:
        """Set the selector interest and the frame deadline after reading or writing."""
        if conn.sock is None:
            return
        assert self._sel is not None
        events = selectors.EVENT_WRITE if conn.outq else selectors.EVENT_READ
        if events != conn.events:
            self._sel.modify(conn.sock, events, (_Kind.CLIENT, conn))
            conn.events = events
        if conn.outq or conn.reader.in_progress:
            if conn.deadline is None:   # set once per frame: dribbling bytes does not extend it
                conn.deadline = time.monotonic() + self._frame_timeout
        else:
            conn.deadline = None

    def _expire(self, now: float) -> None:
        with self._lock:
            late = [c for c in self._conns.values() if c.deadline is not None and now > c.deadline]
        for conn in late:
            what = "read its responses" if conn.outq else "complete its frame"
            self._drop(conn, False, f"did not {what} within {self._frame_timeout} s")

    # ---------------------------------------------------------------- lifetime of connections

    def _drop(self, conn: _Conn, clean: bool, why: str, warn: bool = True) -> None:
        if conn.sock is None:
            return
        assert self._sel is not None
        self._sel.unregister(conn.sock)
        conn.sock.close()
        conn.sock = None
        self._release_io(conn)
        with self._lock:
            self._conns.pop(conn.info.id, None)
        (log.warning if warn else log.info)("dropped %s: %s", conn.info.describe(), why)
        if conn.info.state is ConnState.UNINITIALIZED:
            return                      # the handler never saw this connection
        if clean:
            self._unwatch_pid(conn)     # it left properly; its later exit is not our business
        self._notify("on_disconnect", conn, clean)

    @staticmethod
    def _release_io(conn: _Conn) -> None:
        conn.reader.close()
        for pending in conn.outq:
            if pending.owned:
                close_fds(pending.fds)
        conn.outq.clear()

    def _watch_pid(self, conn: _Conn) -> None:
        assert self._sel is not None
        try:
            pidfd = os.pidfd_open(conn.info.pid)
        except ProcessLookupError:
            self._notify("on_process_exit", conn)   # gone already
            return
        except OSError as exc:
            log.warning("cannot watch pid %d (%s): its death will show only as a dropped socket",
                        conn.info.pid, exc)
            return
        conn.pidfd = pidfd
        self._pidfds[pidfd] = conn
        self._sel.register(pidfd, selectors.EVENT_READ, (_Kind.PIDFD, conn))

    def _unwatch_pid(self, conn: _Conn) -> None:
        if conn.pidfd is None:
            return
        if self._sel is not None:
            self._sel.unregister(conn.pidfd)
        self._pidfds.pop(conn.pidfd, None)
        os.close(conn.pidfd)
        conn.pidfd = None

    def _on_pidfd(self, conn: _Conn) -> None:
        if conn.pidfd is None:
            return
        self._unwatch_pid(conn)
        log.info("peer process of %s exited", conn.info.describe())
        self._notify("on_process_exit", conn)

    def _notify(self, what: str, conn: _Conn, *args: Any) -> None:
        try:
            getattr(self._handler, what)(conn.info, *args)
        except Exception as exc:
            log.exception("handler.%s failed for %s", what, conn.info.describe())
            if self._on_handler_error is not None:
                try:
                    self._on_handler_error(exc)
                    return
                except Exception:
                    log.exception("on_handler_error failed too on handler.%s's error", what)
            raise _HandlerFailed(f"handler.{what} failed for {conn.info.describe()}: {exc!r}") from exc

    # ---------------------------------------------------------------- wake-up and teardown

    def _wake(self) -> None:
        with self._lock:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except BlockingIOError:
                    pass                # already full: a wake-up is pending anyway

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _teardown(self) -> None:
        """Close everything (on the service thread when it exits, or in stop() if it never ran)."""
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
        for conn in conns:
            if conn.sock is not None:
                conn.sock.close()
                conn.sock = None
            self._release_io(conn)
        for pidfd, conn in list(self._pidfds.items()):
            os.close(pidfd)
            conn.pidfd = None
        self._pidfds.clear()
        if self._sel is not None:
            self._sel.close()
            self._sel = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    def _unlink(self) -> None:
        """Remove the socket file if it is still the one we bound (never a successor's)."""
        if self._inode is None:
            return
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove the service socket %s: %s", self.path, exc)
        self._inode = None
