"""Tests of the service (proxy/control/service.py), its client (proxy/control/client.py) and the wire protocol.

A ServiceServer runs in the test process with a small handler; clients run in the test process and,
for process-exit detection, in a real subprocess. Every test checks that it leaves no fd open.
Synchronisation is by events and bounded waits, never by sleeping.

This file tests the server side: the state machine a connection goes through, the server's lifetime
(stop, the socket path), and a client's death (clean, unclean, killed) and the callbacks it fires. The
wire protocol and malformed or stray clients are tested in tests/test_service_protocol.py, the client
in tests/test_service_client.py, with the helpers and fixtures of tests/service_helpers.py.
"""
from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from shmproxy.core import errors
from shmproxy.control.protocol import MAX_FDS, ConnState, MsgType, close_fds
from shmproxy.control.service import ConnInfo, ServiceServer
from shmproxy.control.client import ServiceClient
from tests import service_helpers
from tests.service_helpers import REPO, T, TOKEN, Handler, assert_dropped, memfd_with, raw_socket, state_of

# The shared fixtures of tests/service_helpers.py, bound here so that pytest finds them
# (no_fd_leak is autouse: every test checks that it leaves no fd open).
no_fd_leak = service_helpers.no_fd_leak
sockdir = service_helpers.sockdir
handler = service_helpers.handler
server = service_helpers.server
clients = service_helpers.clients


# ---------------------------------------------------------------- the state machine

def test_happy_path(server: ServiceServer, handler: Handler, clients: Callable[..., ServiceClient]) -> None:
    c = clients(server.path)
    resp, fds = c.call(MsgType.INIT, {"token": TOKEN, "rank": 3, "local_rank": 1, "extra": "x"})
    assert fds == [] and resp["rank"] == 3
    assert resp["echo"] == {"rank": 3, "local_rank": 1, "extra": "x"}     # the token never reaches it
    (info,) = server.connections()
    assert (info.pid, info.uid, info.rank, info.local_rank, info.state) == \
        (os.getpid(), os.getuid(), 3, 1, ConnState.INITIALIZED)
    for msg, after in [(MsgType.SHARED_INIT, ConnState.SHARED_INITIALIZED),
                       (MsgType.SETUP, ConnState.SETUP_DONE), (MsgType.CONNECT, ConnState.CONNECTED),
                       (MsgType.CONNECT, ConnState.CONNECTED),
                       (MsgType.ABORT, ConnState.CONNECTED), (MsgType.STOP, ConnState.CONNECTED)]:
        resp, _ = c.call(msg, {"peer": 1})
        assert resp["echo"] == {"peer": 1}
        assert state_of(server) == [after]
    c.call(MsgType.CLOSE, {})
    assert state_of(server) == [ConnState.CLOSED]
    c.call(MsgType.CLOSE, {})                   # a second CLOSE is harmless
    with pytest.raises(errors.InvalidUsage, match="REGISTER is not allowed in state CLOSED"):
        c.call(MsgType.REGISTER, {"name": "a", "size": 1})
    c.close()
    c.close()                                   # idempotent
    handler.wait_event(("disconnect", os.getpid(), 3, True))
    with pytest.raises(errors.Closed):
        c.call(MsgType.STOP, {})


def test_wrong_state_is_invalid_usage_and_client_stays_usable(
        server: ServiceServer, handler: Handler, clients: Callable[..., ServiceClient]) -> None:
    c = clients(server.path)
    with pytest.raises(errors.InvalidUsage, match="SETUP is not allowed in state UNINITIALIZED"):
        c.call(MsgType.SETUP, {})
    c.call(MsgType.INIT, {"token": TOKEN, "rank": 0, "local_rank": 0})
    with pytest.raises(errors.InvalidUsage, match="INIT is not allowed"):
        c.call(MsgType.INIT, {"token": TOKEN, "rank": 0, "local_rank": 0})
    fd = memfd_with(b"data")
    try:        # refused before the handler: the server must close the fd it received
        with pytest.raises(errors.InvalidUsage, match="REGISTER is not allowed in state INITIALIZED"):
            c.call(MsgType.REGISTER, {"name": "a", "size": 4}, [fd])
    finally:
        os.close(fd)
    with pytest.raises(errors.InvalidUsage):
        c.call(MsgType.CONNECT, {})
    c.call(MsgType.SHARED_INIT, {})
    c.call(MsgType.SETUP, {})
    assert state_of(server) == [ConnState.SETUP_DONE]
    assert handler.requests == [MsgType.INIT, MsgType.SHARED_INIT, MsgType.SETUP]


def test_handler_errors_become_error_responses(
        server: ServiceServer, clients: Callable[..., ServiceClient]) -> None:
    c = clients(server.path, rank=0)
    with pytest.raises(errors.InvalidUsage, match="the handler says no"):
        c.call(MsgType.STOP, {"raise": "usage"})
    with pytest.raises(errors.InternalError, match="boom"):
        c.call(MsgType.STOP, {"raise": "bug"})
    op = c.call_async(MsgType.STOP, {"big": 1000}, resp_size=100)
    with pytest.raises(errors.TruncationError, match="at most 100"):
        c.wait(op, T)
    assert c.call(MsgType.STOP, {"big": 10})[0]["blob"] == "x" * 10     # still served
    op = c.call_async(MsgType.STOP, {"raise": "usage"}, resp_size=0)
    with pytest.raises(errors.InvalidUsage):    # an error response fits whatever resp_size says
        c.wait(op, T)
    with pytest.raises(errors.InvalidArgument):
        c.call_async(MsgType.STOP, {}, fds=list(range(MAX_FDS + 1)))
    with pytest.raises(errors.InvalidArgument, match="not pending"):
        c.wait(12345, T)


@pytest.mark.parametrize("payload, match", [
    ({"token": "wrong", "rank": 0, "local_rank": 0}, "token"),
    ({"rank": 0, "local_rank": 0}, "token"),
    ({"token": TOKEN, "rank": "0", "local_rank": 0}, "integer"),
    ({"token": TOKEN, "rank": 0, "local_rank": -1}, "integer"),
])
def test_bad_init_is_rejected_and_dropped(server: ServiceServer, handler: Handler,
                                          clients: Callable[..., ServiceClient],
                                          payload: dict[str, Any], match: str) -> None:
    bad = clients(server.path)
    with pytest.raises(errors.InvalidArgument, match=match):
        bad.call(MsgType.INIT, payload)
    with pytest.raises(errors.PeerDiedError) as info:
        bad.call(MsgType.INIT, {"token": TOKEN, "rank": 0, "local_rank": 0})
    assert info.value.rank == -1 and info.value.pid == os.getpid()
    assert handler.requests == [] and handler.events == []     # the handler never heard of it
    clients(server.path, rank=0)                                 # others are served


def test_wrong_uid_is_dropped_at_accept(sockdir: Path, handler: Handler,
                                        clients: Callable[..., ServiceClient]) -> None:
    srv = ServiceServer(str(sockdir / "other.sock"), handler, TOKEN, uid=os.getuid() + 1)
    srv.start()
    try:
        c = clients(srv.path)
        with pytest.raises(errors.PeerDiedError):
            c.call(MsgType.INIT, {"token": TOKEN, "rank": 0, "local_rank": 0})
    finally:
        srv.stop(T)


# ---------------------------------------------------------------- lifetime and death


def test_stop_from_inside_the_handler(server: ServiceServer, handler: Handler,
                                      clients: Callable[..., ServiceClient]) -> None:
    handler.server = server
    c = clients(server.path, rank=0)
    assert c.call(MsgType.STOP, {"stop_server": True})[0]["echo"] == {"stop_server": True}
    for t in [t for t in threading.enumerate() if t.name == "shmproxy-service"]:
        t.join(T)
        assert not t.is_alive()
    assert not os.path.exists(server.path)
    with pytest.raises(errors.PeerDiedError):
        c.call(MsgType.STOP, {})


def test_stop_is_idempotent_and_unlinks(sockdir: Path, handler: Handler,
                                        clients: Callable[..., ServiceClient]) -> None:
    srv = ServiceServer(str(sockdir / "stop.sock"), handler, TOKEN)
    srv.start()
    assert oct(os.stat(srv.path).st_mode & 0o777) == oct(0o600)
    c = clients(srv.path, rank=0)
    srv.stop(T)
    srv.stop(T)
    assert not os.path.exists(srv.path)
    assert srv.connections() == [] and srv.error is None
    assert not [t for t in threading.enumerate() if t.name == "shmproxy-service"]
    with pytest.raises(errors.PeerDiedError) as info:
        c.call(MsgType.STOP, {})
    assert info.value.rank == -1
    assert handler.events == []                 # no callbacks during stop
    with pytest.raises(errors.InvalidUsage):
        srv.start()


def test_existing_path_is_not_clobbered(sockdir: Path, handler: Handler) -> None:
    path = sockdir / "taken.sock"
    path.write_text("not ours")
    srv = ServiceServer(str(path), handler, TOKEN)
    with pytest.raises(errors.SystemError_, match="taken.sock"):
        srv.start()
    srv.stop(T)
    assert path.read_text() == "not ours"


CHILD = r"""
import sys
from shmproxy.control.protocol import MsgType
from shmproxy.control.client import ServiceClient
client = ServiceClient.connect(sys.argv[1], 5.0)
client.call(MsgType.INIT, {"token": sys.argv[2], "rank": 7, "local_rank": 0})
print("ready", flush=True)
sys.stdin.read()
"""


def test_killed_process_is_reported(server: ServiceServer, handler: Handler) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with subprocess.Popen([sys.executable, "-c", CHILD, server.path, TOKEN], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, cwd=REPO, env=env) as proc:
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], T)
            assert ready and proc.stdout.readline() == b"ready\n"
            assert state_of(server, proc.pid) == [ConnState.INITIALIZED]
            proc.kill()
            handler.wait_event(("exit", proc.pid, 7))
            handler.wait_event(("disconnect", proc.pid, 7, False))
            assert handler.events.count(("exit", proc.pid, 7)) == 1
            assert state_of(server, proc.pid) == []
        finally:
            proc.kill()


def test_unclean_disconnect_of_a_living_process(server: ServiceServer, handler: Handler,
                                                clients: Callable[..., ServiceClient]) -> None:
    c = clients(server.path, rank=2)
    c.close()                                   # no CLOSE first
    handler.wait_event(("disconnect", os.getpid(), 2, False))
    assert not [e for e in handler.events if e[0] == "exit"]


def test_no_fd_leak_over_a_full_cycle(sockdir: Path, handler: Handler) -> None:
    before = len(os.listdir("/proc/self/fd"))
    srv = ServiceServer(str(sockdir / "cycle.sock"), handler, TOKEN)
    srv.start()
    fd = memfd_with(b"abcd")
    try:
        for rank in range(3):
            c = ServiceClient.connect(srv.path, T)
            c.call(MsgType.INIT, {"token": TOKEN, "rank": rank, "local_rank": rank})
            c.call(MsgType.SHARED_INIT, {})
            c.call(MsgType.REGISTER, {"name": "b", "size": 4}, [fd])
            _, got = c.call(MsgType.QUERYFD, {"text": "q"})
            close_fds(got)
            c.call_async(MsgType.QUERYFD, {"text": "never collected"})   # its fd dies with close()
            c.call(MsgType.CLOSE, {})
            c.close()
            handler.wait_event(("disconnect", os.getpid(), rank, True))
    finally:
        os.close(fd)
        srv.stop(T)
        handler.close_all()
    assert len(os.listdir("/proc/self/fd")) == before


# ---------------------------------------------------------------- a failing callback is never swallowed

class RaisingHandler(Handler):
    """Records the rank's exit, then fails on it, as a progress process with a bug in rank_died would."""

    def on_process_exit(self, conn: ConnInfo) -> None:
        super().on_process_exit(conn)
        raise RuntimeError(f"on_process_exit blew up for rank {conn.rank}")


def start_child(path: str) -> subprocess.Popen[bytes]:
    """A rank in a real process (its death is seen through the pidfd), initialized as rank 7."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, path, TOKEN], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, cwd=REPO, env=env)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], T)
    assert ready and proc.stdout.readline() == b"ready\n"
    return proc


@pytest.fixture
def service_log(caplog: pytest.LogCaptureFixture,
                monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """caplog for shmproxy.SERVICE, whether or not shmproxy.core.log.configure() stopped propagation."""
    monkeypatch.setattr(logging.getLogger("shmproxy"), "propagate", True)
    caplog.set_level(logging.INFO, logger="shmproxy.SERVICE")
    return caplog


def test_process_exit_error_reaches_on_handler_error(sockdir: Path, service_log: pytest.LogCaptureFixture,
                                                     clients: Callable[..., ServiceClient]) -> None:
    """A rank's death whose handling fails must fail the communicator, not become a logged line."""
    handler = RaisingHandler()
    got: list[BaseException] = []
    cond = threading.Condition()

    def on_handler_error(exc: BaseException) -> None:
        with cond:
            got.append(exc)
            cond.notify_all()

    srv = ServiceServer(str(sockdir / "fail.sock"), handler, TOKEN, on_handler_error=on_handler_error)
    srv.start()
    try:
        with start_child(srv.path) as proc:
            try:
                proc.kill()
                with cond:
                    assert cond.wait_for(lambda: got, T), "the handler's error never reached on_handler_error"
            finally:
                proc.kill()
        assert len(got) == 1 and isinstance(got[0], RuntimeError) and "rank 7" in str(got[0])
        assert handler.events.count(("exit", proc.pid, 7)) == 1
        failed = [r for r in service_log.records if "handler.on_process_exit failed" in r.getMessage()]
        assert failed and failed[0].exc_info is not None      # still logged, with its traceback
        # the callback took the error: the service goes on serving the other ranks
        assert srv.error is None
        assert clients(srv.path, rank=1).call(MsgType.SHARED_INIT, {"x": 1})[0]["echo"] == {"x": 1}
    finally:
        srv.stop(T)
        handler.close_all()


def test_process_exit_error_without_a_callback_ends_the_loop(sockdir: Path) -> None:
    """With no on_handler_error the error is not swallowed either: it ends the loop, kept in .error."""
    handler = RaisingHandler()
    srv = ServiceServer(str(sockdir / "fail.sock"), handler, TOKEN)
    srv.start()
    try:
        watcher = raw_socket(srv.path)          # an uninitialized client: closed when the loop ends
        try:
            with start_child(srv.path) as proc:
                try:
                    proc.kill()
                    assert_dropped(watcher)
                finally:
                    proc.kill()
        finally:
            watcher.close()
        assert isinstance(srv.error, RuntimeError) and "rank 7" in str(srv.error)
    finally:
        srv.stop(T)
        handler.close_all()
    assert not [t for t in threading.enumerate() if t.name == "shmproxy-service"]
