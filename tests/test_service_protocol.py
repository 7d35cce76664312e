"""Tests of the service's wire protocol (proxy/control/protocol.py): the transition table, frames with
fds, and what the server (proxy/control/service.py) does with malformed frames and stray clients (too
many fds, stalled, not reading, lying about their rank): it drops that client only. Helpers and
fixtures are in tests/service_helpers.py; every test checks that it leaves no fd open.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Callable

import pytest

from shmproxy.core import errors
from shmproxy.control.protocol import (MAX_FDS, MAX_PAYLOAD, PROTOCOL_VERSION, ConnState, MsgType, Request,
                                       close_fds, encode_request, next_state, recv_request, recv_response,
                                       send_frame)
from shmproxy.control.service import ServiceServer
from shmproxy.control.client import ServiceClient
from tests import service_helpers
from tests.service_helpers import (FRAME_TIMEOUT, T, TOKEN, Handler, assert_dropped, memfd_with, raw_socket,
                                   req_header)

# The shared fixtures of tests/service_helpers.py, bound here so that pytest finds them
# (no_fd_leak is autouse: every test checks that it leaves no fd open).
no_fd_leak = service_helpers.no_fd_leak
sockdir = service_helpers.sockdir
handler = service_helpers.handler
server = service_helpers.server
clients = service_helpers.clients


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
