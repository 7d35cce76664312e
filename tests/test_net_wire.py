"""The TCP transport's wire, in-process: the handshake check and the frame reader against junk.

Whatever bytes a peer sends, reading a frame either hands the loop a well-formed event or raises
ProtocolError (which drops the link); it never raises anything else and never writes outside a
landing. The multi-process side (strangers on a real port, a pulled cable) is in tests/test_netns.py."""
from __future__ import annotations

import socket
import struct
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from shmproxy.core import params as PM
from shmproxy.transports import net_socket as NS
from shmproxy.transports import net_wire as W

SECRET = bytes(range(16))


def fake_ctx(events: list) -> types.SimpleNamespace:
    """What _Net reads of the engine: node 1 of 2, ranks 0-1 on node 0 and 2-3 on node 1."""
    return types.SimpleNamespace(params=PM.Params(env={}), post_event=events.append, node=1, nnodes=2,
                                 secret=SECRET, comm_id=7, timeout=5.0, coll_chunk_max=1 << 20,
                                 rank_node=lambda r: r // 2 if 0 <= r < 4 else -1)


def feed(net: NS._Net, header: tuple, payload: bytes, frames: list | None = None) -> None:
    """Write one frame into a socketpair and let the reader side parse it; ``frames`` collects what the
    reader answers on the link."""
    a, b = socket.socketpair()
    try:
        a.sendall(payload)   # the reader has consumed the header already
        a.shutdown(socket.SHUT_WR)
        said = frames if frames is not None else []
        link = types.SimpleNamespace(peer=0, control=lambda *f, **k: said.append(f))
        inbox = W.Inbox(b, net.ctx.post_event)
        net.on_frame(link, 0, header, inbox)
        inbox.flush()
    finally:
        a.close()
        b.close()


def test_a_valid_hello_is_accepted_and_every_field_is_checked():
    good = W.make_hello(SECRET, 7, 0, 1, 2)
    assert W.check_hello(good, SECRET, 7, 2, 1) == (0, 1, 2)
    bad = {
        "magic": b"XXXXXXXX" + good[8:],
        "secret": good[:8] + bytes(16) + good[24:],
        "comm": W.make_hello(SECRET, 8, 0, 1, 2),
        "node": W.make_hello(SECRET, 7, 1, 0, 2),     # only lower nodes connect to us
        "index": W.make_hello(SECRET, 7, 0, 2, 2),
        "nsocks": W.make_hello(SECRET, 7, 0, 0, 0),
        "short": good[:-1],
    }
    for what, data in bad.items():
        with pytest.raises(W.ProtocolError):
            W.check_hello(data, SECRET, 7, 2, 1)
        assert what


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=64))
def test_junk_hellos_are_refused(data):
    with pytest.raises(W.ProtocolError):
        W.check_hello(data, SECRET, 7, 2, 1)


def test_frames_out_of_bounds_are_protocol_errors_and_good_ones_become_events():
    events: list = []
    net = NS._Net(fake_ctx(events))
    env = W.ENVELOPE.pack(0, 2, 0, 0)
    feed(net, (W.RTS, W.F_EAGER, W.ENVELOPE.size + 3, 5, 9, 3), env + b"abc")
    feed(net, (W.CTS, 0, 0, 5, -1, 0), b"")
    feed(net, (W.CLOSED, 0, 0, 1, 0, 0), b"")
    assert len(events) == 3
    for header, payload in [
        ((W.DATA, 0, 4, 99, 0, 0), b"abcd"),                       # no such landing
        ((W.RTS, W.F_EAGER, W.ENVELOPE.size + 3, 5, 9, 4), env + b"abc"),   # length disagrees
        ((W.RTS, 0, W.ENVELOPE.size, 5, 9, 3), W.ENVELOPE.pack(2, 0, 0, 0)),  # sender not on the peer node
        ((W.RTS, W.F_EAGER, W.ENVELOPE.size + (1 << 20), 5, 9, 1 << 20), env),  # eager above the limit
        ((W.COLL, 0, 10, 0, 0, 0), b"x" * 10),                     # key longer than the frame
        ((W.COLL, 0, 1000, 600, 0, 0), b"x" * 1000),               # key too long
        ((W.CLOSED, 0, 0, 3, 0, 0), b""),                          # rank 3 is ours, not node 0's
        ((W.ABORT, 0, W.MAX_CONTROL + 1, 0, 0, 0), b""),
        ((77, 0, 0, 0, 0, 0), b""),
    ]:
        with pytest.raises(W.ProtocolError):
            feed(net, header, payload)
    assert len(events) == 3


def test_data_lands_only_inside_its_landing():
    events: list = []
    net = NS._Net(fake_ctx(events))
    mem = np.zeros(64, np.uint8)
    transfer = types.SimpleNamespace(send=types.SimpleNamespace(sid=5))
    net.landings[1] = NS._Landing(transfer, memoryview(mem)[8:24], 16)
    frames: list = []
    with pytest.raises(W.ProtocolError):
        feed(net, (W.DATA, 0, 8, 1, 12, 0), b"x" * 8, frames)   # 12 + 8 > 16
    feed(net, (W.DATA, 0, 8, 1, 0, 0), b"y" * 8, frames)
    assert not frames   # half a message: nothing to say yet
    feed(net, (W.DATA, 0, 8, 1, 8, 0), b"z" * 8, frames)
    assert bytes(mem[8:24]) == b"y" * 8 + b"z" * 8 and not mem[:8].any() and not mem[24:].any()
    assert len(events) == 1 and 1 not in net.landings    # the landing completed
    assert frames == [(W.DONE, 5)]                      # and the sender's node is told: its send completes


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ftype=st.integers(0, 10), flags=st.integers(0, 3), a=st.integers(-2, 2 ** 40),
       b=st.integers(-2, 2 ** 20), c=st.integers(-2, 2 ** 20), payload=st.binary(max_size=256))
def test_random_frames_never_raise_anything_but_protocol_errors(ftype, flags, a, b, c, payload):
    events: list = []
    net = NS._Net(fake_ctx(events))
    try:
        feed(net, (ftype, flags, len(payload), a, b, c), payload)
    except W.ProtocolError:
        pass
    assert len(events) <= 1


def test_the_header_is_32_bytes():
    assert W.HEADER.size == 32 and W.HELLO.size == struct.calcsize("<8s16sIIII")


def test_an_inbox_posts_what_one_recv_brought_as_one_event_before_it_blocks_again():
    a, b = socket.socketpair()
    posted: list = []
    seen: list = []
    inbox = W.Inbox(b, posted.append)
    big = bytes(range(256)) * (W.INBOX_BYTES // 256 + 1)   # more than the buffer: its tail lands in place
    try:
        a.sendall(b"x" * 8 + b"y" * 8 + big)
        for _ in range(2):
            data = inbox.payload(8)
            inbox.later(lambda d=data: seen.append(d))
        assert not posted   # both came with the first recv: the reader did not block since
        out = bytearray(len(big))
        assert inbox.read_into(memoryview(out)) and out == big
        assert len(posted) == 1   # flushed before the recv that fetched the rest
        posted[0]()
        assert seen == [b"x" * 8, b"y" * 8]
        a.close()
        assert not inbox.read_into(memoryview(bytearray(4)))   # a clean EOF between frames
    finally:
        a.close()
        b.close()


def test_a_batch_whose_event_raises_posts_the_rest_again():
    posted: list = []
    seen: list = []

    def boom() -> None:
        raise RuntimeError("boom")

    inbox = W.Inbox(None, posted.append)   # type: ignore[arg-type]
    for fn in (lambda: seen.append(1), boom, lambda: seen.append(3)):
        inbox.later(fn)
    inbox.flush()
    with pytest.raises(RuntimeError):
        posted[0]()
    assert seen == [1] and len(posted) == 2
    posted[1]()
    assert seen == [1, 3]


def test_whole_frames_cross_a_socket_in_c_through_partial_writes_and_reads():
    """The bulk path of the link's threads (shm/_native_net.c): a frame of several parts goes out with
    one call however many partial writes the kernel makes of it (socket buffers far smaller than the
    frame), and lands byte-exact with one call however many partial reads; an EOF inside a payload is
    a short count, which Inbox.read_into turns into a ProtocolError."""
    import threading
    from shmproxy.shm import _native
    a, b = socket.socketpair()
    try:
        for s in (a, b):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
        head = W.HEADER.pack(W.COLL, 0, 3 << 20, 1, 2, 3)
        body = np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8)
        sender = threading.Thread(target=_native.sock_send_parts,
                                  args=(a.fileno(), [head, b"key", memoryview(body)]))
        sender.start()
        got_head = bytearray(W.HEADER.size + 3)
        assert _native.sock_recv_into(b.fileno(), _native.buffer_info(got_head, True)[0], len(got_head)) == \
            len(got_head)
        land = np.zeros(3 << 20, np.uint8)
        assert _native.sock_recv_into(b.fileno(), land.ctypes.data, land.nbytes) == land.nbytes
        sender.join(10)
        assert bytes(got_head) == head + b"key" and np.array_equal(land, body)
        # EOF inside a payload: the C call says how much came; the Inbox calls it a protocol error
        a.sendall(b"x" * (W.DIRECT_BYTES + 10))
        a.shutdown(socket.SHUT_WR)
        inbox = W.Inbox(b, lambda fn: None)
        with pytest.raises(W.ProtocolError, match="closed inside a frame"):
            inbox.read_into(memoryview(bytearray(W.DIRECT_BYTES * 4)))
        with pytest.raises(ValueError, match="at most"):
            _native.sock_send_parts(a.fileno(), [b"x"] * 17)
        with pytest.raises(OSError):
            _native.sock_send_parts(a.fileno(), [b"after shutdown"])
    finally:
        a.close()
        b.close()
