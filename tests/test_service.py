"""Tests of the service (proxy/control/service.py), its client (proxy/control/client.py) and the wire protocol.

A ServiceServer runs in the test process with a small handler; clients run in the test process and,
for process-exit detection, in a real subprocess. Every test checks that it leaves no fd open.
Synchronisation is by events and bounded waits, never by sleeping.
"""
from __future__ import annotations

import logging
import mmap
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from shmproxy.core import errors
from shmproxy.control.protocol import (MAX_FDS, MAX_PAYLOAD, PROTOCOL_VERSION, REQUEST_HEADER, REQUEST_MAGIC,
                            ConnState, MsgType, ProtocolError, Request, close_fds, encode_request,
                            encode_response, next_state, recv_request, recv_response, send_frame)
from shmproxy.control.service import ConnInfo, ServiceServer
from shmproxy.control.client import ServiceClient

TOKEN = "job-token-for-tests"
T = 5.0                 # bound for anything that should take milliseconds
FRAME_TIMEOUT = 0.5
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- helpers and fixtures

def open_fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:
            pass                # the descriptor listdir itself used
    return out


@pytest.fixture(autouse=True)
def no_fd_leak() -> Iterator[None]:
    before = open_fds()
    yield
    after = open_fds()
    assert after == before, f"fds leaked: {set(after.items()) - set(before.items())}"


def memfd_with(data: bytes) -> int:
    fd = os.memfd_create("test", os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


class Handler:
    """Echoes, keeps registered memfds, hands out new ones; records every callback."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.events: list[tuple[Any, ...]] = []
        self.requests: list[MsgType] = []
        self.owned: list[int] = []          # every fd the handler owns, closed at teardown
        self.server: ServiceServer | None = None

    def handle(self, conn: ConnInfo, msg: MsgType, payload: dict[str, Any],
               fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        self.requests.append(msg)
        self.owned.extend(fds)
        if msg is MsgType.REGISTER:
            if len(fds) != 1:
                raise errors.InvalidArgument(f"REGISTER needs one fd, got {len(fds)}")
            with mmap.mmap(fds[0], payload["size"], prot=mmap.PROT_READ) as m:
                data = bytes(m)
            conn.data.setdefault("regs", {})[payload["name"]] = fds[0]
            return {"data": data.decode()}, []
        if msg is MsgType.GETFD:
            return {}, [conn.data["regs"][payload["name"]]]
        if msg is MsgType.QUERYFD:
            fd = memfd_with(payload["text"].encode())
            self.owned.append(fd)
            return {"size": len(payload["text"])}, [fd]
        if msg is MsgType.DEREGISTER:
            fd = conn.data["regs"].pop(payload["name"])
            self.owned.remove(fd)
            os.close(fd)
            return {}, []
        if payload.get("stop_server"):
            assert self.server is not None
            self.server.stop(T)                 # as a progress process's STOP handler might
        if payload.get("raise") == "usage":
            raise errors.InvalidUsage("the handler says no")
        if payload.get("raise") == "bug":
            raise RuntimeError("boom")
        if "big" in payload:
            return {"blob": "x" * payload["big"]}, []
        return {"echo": payload, "rank": conn.rank, "state": conn.state.name}, []

    def on_disconnect(self, conn: ConnInfo, clean: bool) -> None:
        self._record(("disconnect", conn.pid, conn.rank, clean))

    def on_process_exit(self, conn: ConnInfo) -> None:
        self._record(("exit", conn.pid, conn.rank))

    def _record(self, event: tuple[Any, ...]) -> None:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def wait_event(self, event: tuple[Any, ...], timeout: float = T) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: event in self.events, timeout), (event, self.events)

    def close_all(self) -> None:
        close_fds(self.owned)
        self.owned.clear()


@pytest.fixture
def sockdir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    d.chmod(0o700)
    return d


@pytest.fixture
def handler() -> Iterator[Handler]:
    h = Handler()
    yield h
    h.close_all()


@pytest.fixture
def server(sockdir: Path, handler: Handler) -> Iterator[ServiceServer]:
    srv = ServiceServer(str(sockdir / "svc.sock"), handler, TOKEN, frame_timeout=FRAME_TIMEOUT)
    srv.start()
    yield srv
    srv.stop(T)


@pytest.fixture
def clients() -> Iterator[Callable[..., ServiceClient]]:
    made: list[ServiceClient] = []

    def make(path: str, rank: int | None = None) -> ServiceClient:
        client = ServiceClient.connect(path, T)
        made.append(client)
        if rank is not None:
            client.call(MsgType.INIT, {"token": TOKEN, "rank": rank, "local_rank": rank})
        return client

    yield make
    for client in made:
        client.close()


def raw_socket(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(T)
    sock.connect(path)
    return sock


def assert_dropped(sock: socket.socket) -> None:
    """The server closed this connection (EOF, or a reset when it left our bytes unread)."""
    try:
        assert sock.recv(4096) == b""
    except ConnectionResetError:
        pass


def req_header(mtype: int = MsgType.INIT, req_size: int = 2, magic: bytes = REQUEST_MAGIC,
               version: int = PROTOCOL_VERSION, resp_size: int = MAX_PAYLOAD) -> bytes:
    return REQUEST_HEADER.pack(magic, version, mtype, 0, req_size, resp_size, 0, 1)


def state_of(server: ServiceServer, pid: int = os.getpid()) -> list[ConnState]:
    return [c.state for c in server.connections() if c.pid == pid]


# ---------------------------------------------------------------- protocol

def test_transition_table() -> None:
    S = ConnState
    assert next_state(S.UNINITIALIZED, MsgType.INIT) is S.INITIALIZED
    assert next_state(S.CONNECTED, MsgType.CONNECT) is S.CONNECTED
    assert next_state(S.SETUP_DONE, MsgType.REGISTER) is S.SETUP_DONE
    assert next_state(S.CLOSED, MsgType.CLOSE) is S.CLOSED
    for state, msg in [(S.INITIALIZED, MsgType.INIT), (S.UNINITIALIZED, MsgType.CLOSE),
                       (S.INITIALIZED, MsgType.REGISTER), (S.CLOSED, MsgType.GETFD),
                       (S.SHARED_INITIALIZED, MsgType.CONNECT), (S.UNINITIALIZED, MsgType.STOP)]:
        with pytest.raises(errors.InvalidUsage, match=msg.name):
            next_state(state, msg)


def test_frame_round_trip_with_fds() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    fd = memfd_with(b"abc")
    try:
        send_frame(a, encode_request(MsgType.REGISTER, 3, 42, {"x": [1, 2]}, resp_size=100), [fd], T)
        req = recv_request(b, T)
        assert isinstance(req, Request)
        assert (req.type, req.rank, req.op_id, req.resp_size, req.payload) == \
            (MsgType.REGISTER, 3, 42, 100, {"x": [1, 2]})
        assert len(req.fds) == 1 and os.pread(req.fds[0], 3, 0) == b"abc"
        close_fds(req.fds)
        with pytest.raises(errors.InvalidArgument):
            encode_request(MsgType.SETUP, 0, 1, {"blob": "x" * MAX_PAYLOAD})
        with pytest.raises(errors.InvalidArgument):
            encode_request(MsgType.SETUP, 0, 1, {"obj": object()})
        with pytest.raises(errors.Timeout):
            recv_request(b, 0.01)
    finally:
        os.close(fd)
        a.close()
        b.close()


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


# ---------------------------------------------------------------- malformed and stray clients

MALFORMED = {
    "garbage": b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n" + b"\x00" * 32,
    "bad magic": req_header(magic=b"NOPE") + b"{}",
    "bad version": req_header(version=PROTOCOL_VERSION + 1) + b"{}",
    "oversize payload": req_header(req_size=MAX_PAYLOAD + 1),
    "oversize response size": req_header(resp_size=MAX_PAYLOAD + 1) + b"{}",
    "unknown type": req_header(mtype=99) + b"{}",
    "bad json": req_header(req_size=8) + b"not json",
    "non-object json": req_header(req_size=5) + b"[1,2]",
    "empty payload": req_header(req_size=0),
    "truncated then EOF": req_header(req_size=100) + b"{",
}


@pytest.mark.parametrize("blob", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_frame_drops_only_that_client(server: ServiceServer,
                                                clients: Callable[..., ServiceClient], blob: bytes) -> None:
    good = clients(server.path, rank=0)
    with raw_socket(server.path) as raw:
        raw.sendall(blob)
        raw.shutdown(socket.SHUT_WR)
        assert_dropped(raw)
    assert good.call(MsgType.STOP, {"n": 1})[0]["echo"] == {"n": 1}
    clients(server.path, rank=1)


def test_too_many_fds_drops_client_and_closes_them(server: ServiceServer,
                                                   clients: Callable[..., ServiceClient]) -> None:
    fds = [memfd_with(b"x") for _ in range(MAX_FDS + 1)]
    try:
        with raw_socket(server.path) as raw:
            socket.send_fds(raw, [encode_request(MsgType.INIT, 0, 1, {})], fds)
            assert_dropped(raw)
    finally:
        close_fds(fds)
    clients(server.path, rank=0)
    # the fd-leak fixture checks that the server closed the fds it received


def test_stalled_client_is_dropped_and_does_not_wedge(server: ServiceServer,
                                                      clients: Callable[..., ServiceClient]) -> None:
    good = clients(server.path, rank=0)
    with raw_socket(server.path) as raw:
        raw.sendall(req_header(req_size=100) + b'{"half": ')
        t0 = time.monotonic()
        for i in range(20):                     # served while the stray client holds half a frame
            assert good.call(MsgType.STOP, {"i": i})[0]["echo"] == {"i": i}
        assert_dropped(raw)
        assert FRAME_TIMEOUT * 0.9 <= time.monotonic() - t0 < T


def test_client_that_does_not_read_its_responses_is_dropped(
        server: ServiceServer, handler: Handler, clients: Callable[..., ServiceClient]) -> None:
    good = clients(server.path, rank=0)
    with raw_socket(server.path) as raw:
        raw.setblocking(False)
        send_frame(raw, encode_request(MsgType.INIT, 1, 1, {"token": TOKEN, "rank": 1, "local_rank": 1}),
                   [], T)
        assert recv_response(raw, T).result == 0
        for op in range(2, 40):                 # ~2 MiB of responses that are never read
            send_frame(raw, encode_request(MsgType.STOP, 1, op, {"big": 60000}), [], T)
        assert good.call(MsgType.STOP, {})[0]["echo"] == {}
        handler.wait_event(("disconnect", os.getpid(), 1, False))
    assert good.call(MsgType.STOP, {})[0]["echo"] == {}


def test_header_rank_must_match_the_connection(server: ServiceServer) -> None:
    with raw_socket(server.path) as raw:
        raw.setblocking(False)
        send_frame(raw, encode_request(MsgType.INIT, 4, 1, {"token": TOKEN, "rank": 4, "local_rank": 0}),
                   [], T)
        assert recv_response(raw, T).result == 0
        send_frame(raw, encode_request(MsgType.SHARED_INIT, 5, 2, {}), [], T)
        resp = recv_response(raw, T)
        assert (resp.op_id, resp.result) == (2, errors.InvalidArgument.code)
        assert "rank 5" in resp.payload["message"]
        send_frame(raw, encode_request(MsgType.SHARED_INIT, 4, 3, {}), [], T)
        assert recv_response(raw, T).result == 0


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


# ---------------------------------------------------------------- fds and async calls

def test_fd_passing_both_ways(server: ServiceServer, clients: Callable[..., ServiceClient]) -> None:
    c = clients(server.path, rank=0)
    c.call(MsgType.SHARED_INIT, {})
    fd = memfd_with(b"hello from the rank")
    try:
        resp, _ = c.call(MsgType.REGISTER, {"name": "buf", "size": 19}, [fd])
        assert resp["data"] == "hello from the rank"
        _, (back,) = c.call(MsgType.GETFD, {"name": "buf"})
        try:
            assert os.fstat(back).st_ino == os.fstat(fd).st_ino
            assert os.get_inheritable(back) is False
        finally:
            os.close(back)
    finally:
        os.close(fd)
    resp, (new,) = c.call(MsgType.QUERYFD, {"text": "made by the proxy"})
    try:
        assert os.pread(new, resp["size"], 0) == b"made by the proxy"
    finally:
        os.close(new)
    c.call(MsgType.DEREGISTER, {"name": "buf"})


def test_async_calls_are_matched_by_op_id(server: ServiceServer,
                                          clients: Callable[..., ServiceClient]) -> None:
    c = clients(server.path, rank=0)
    ops = {c.call_async(MsgType.STOP, {"i": i}): i for i in range(5)}
    assert len(ops) == 5
    for op in sorted(ops, reverse=True):        # waited for in the reverse order
        assert c.wait(op, T)[0]["echo"] == {"i": ops[op]}


def test_client_is_safe_from_several_threads(server: ServiceServer,
                                            clients: Callable[..., ServiceClient]) -> None:
    c = clients(server.path, rank=0)
    failures: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(50):
                assert c.call(MsgType.STOP, {"n": n, "i": i}, timeout=T)[0]["echo"] == {"n": n, "i": i}
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * T)
    assert failures == [] and not any(t.is_alive() for t in threads)


def _fake_service() -> tuple[ServiceClient, socket.socket]:
    a, b = socket.socketpair()
    b.setblocking(False)
    return ServiceClient(a, T, name="fake"), b


def test_responses_out_of_order_are_matched() -> None:
    client, srv = _fake_service()
    fd = memfd_with(b"fd for op 2")
    try:
        ops = [client.call_async(MsgType.SETUP, {"i": i}) for i in range(3)]
        reqs = [recv_request(srv, T) for _ in ops]
        assert [r.op_id for r in reqs] == ops and all(r.rank == -1 for r in reqs)
        for r in reversed(reqs):                # answered out of order
            data = encode_response(r.op_id, 0, {"i": r.payload["i"]})
            send_frame(srv, data, [fd] if r.op_id == ops[2] else [], T)
        resp, fds = client.wait(ops[0], T)
        assert resp == {"i": 0} and fds == []
        assert client.wait(ops[1], T) == ({"i": 1}, [])
        resp, (got,) = client.wait(ops[2], T)
        assert resp == {"i": 2} and os.pread(got, 11, 0) == b"fd for op 2"
        os.close(got)
    finally:
        os.close(fd)
        client.close()
        srv.close()


def test_wait_timeout_then_late_response_and_unknown_op() -> None:
    client, srv = _fake_service()
    try:
        op = client.call_async(MsgType.CONNECT, {})
        req = recv_request(srv, T)
        with pytest.raises(errors.Timeout, match=f"CONNECT \\(op_id {op}\\)"):
            client.wait(op, 0.05)
        send_frame(srv, encode_response(op, errors.InvalidUsage.code, {"message": "late"}), [], T)
        with pytest.raises(errors.InvalidUsage, match="late"):
            client.wait(op, T)                  # still expected after the timeout
        op2 = client.call_async(MsgType.CONNECT, {})
        send_frame(srv, encode_response(req.op_id + 100, 0, {}), [], T)
        with pytest.raises(ProtocolError, match="not pending"):
            client.wait(op2, T)
        with pytest.raises(ProtocolError):      # the client stays broken
            client.call_async(MsgType.STOP, {})
    finally:
        client.close()
        srv.close()


# ---------------------------------------------------------------- rendezvous, lifetime, death

def test_connect_rendezvous_with_a_server_that_starts_later(sockdir: Path, handler: Handler) -> None:
    srv = ServiceServer(str(sockdir / "late.sock"), handler, TOKEN)
    attempts = 0
    retrying = threading.Event()

    def should_abort() -> bool:             # called before every attempt
        nonlocal attempts
        attempts += 1
        if attempts == 3:
            retrying.set()
        return False

    def start_later() -> None:
        if retrying.wait(T):
            srv.start()

    starter = threading.Thread(target=start_later)
    starter.start()
    try:
        client = ServiceClient.connect(srv.path, T, should_abort)
        try:
            assert attempts >= 3
            assert client.call(MsgType.INIT, {"token": TOKEN, "rank": 0, "local_rank": 0})[0]["rank"] == 0
        finally:
            client.close()
    finally:
        starter.join(T)
        srv.stop(T)


def test_connect_timeout_and_abort(sockdir: Path) -> None:
    path = str(sockdir / "nobody.sock")
    t0 = time.monotonic()
    with pytest.raises(errors.Timeout, match="nobody.sock"):
        ServiceClient.connect(path, 0.2)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    with pytest.raises(errors.Aborted, match="nobody.sock"):
        ServiceClient.connect(path, T, should_abort=lambda: True)
    # a socket file that nobody listens on (ECONNREFUSED) is retried the same way
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unbound:
        unbound.bind(path)
        with pytest.raises(errors.Timeout):
            ServiceClient.connect(path, 0.1)


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
