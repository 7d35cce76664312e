"""Tests of the service client (proxy/control/client.py): fds both ways, asynchronous calls matched by
op id (out of order, late, from several threads, with timeouts), and the connect rendezvous with a
server that is not there yet. Helpers and fixtures are in tests/service_helpers.py; every test checks
that it leaves no fd open.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from shmproxy.core import errors
from shmproxy.control.protocol import MsgType, ProtocolError, encode_response, recv_request, send_frame
from shmproxy.control.service import ServiceServer
from shmproxy.control.client import ServiceClient
from tests import service_helpers
from tests.service_helpers import T, TOKEN, Handler, memfd_with

# The shared fixtures of tests/service_helpers.py, bound here so that pytest finds them
# (no_fd_leak is autouse: every test checks that it leaves no fd open).
no_fd_leak = service_helpers.no_fd_leak
sockdir = service_helpers.sockdir
handler = service_helpers.handler
server = service_helpers.server
clients = service_helpers.clients


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
