"""Helpers and fixtures shared by the service tests (tests/test_service.py, test_service_protocol.py,
test_service_client.py): a recording Handler, a ServiceServer on a private socket directory, clients
closed at teardown, raw sockets, and the autouse check that a test leaves no fd open. The test modules
bind the fixtures by name, so that pytest finds them there and nowhere else.
"""
from __future__ import annotations

import mmap
import os
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from shmproxy.core import errors
from shmproxy.control.protocol import (MAX_PAYLOAD, PROTOCOL_VERSION, REQUEST_HEADER, REQUEST_MAGIC,
                                       ConnState, MsgType, close_fds)
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
