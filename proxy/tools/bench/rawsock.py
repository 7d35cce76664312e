"""The link's own limit, in the same run: plain TCP sockets between ranks 0 and 1, no library between.

Peers ``tcp`` (one stream) and ``tcp-streams`` (as many streams as shmproxy moves one message or
one collective's chunk on between two nodes: SOCKET_NTHREADS x NSOCKS_PERTHREAD or NET_COLL_SOCKETS,
whichever is more, each carrying an equal share of a message, as the transport's frames do) time
the ping-pong over the interface shmproxy's transport listens on (SOCKET_IFNAME, else the first that
is not loopback or a container bridge: shmproxy.control.netif).
Across nodes that is the wire shmproxy uses, so shmproxy's ping-pong can be read against what the
sockets themselves move. Ping-pong only: a collective has no raw-socket counterpart to time.

Rank 1 listens and tells rank 0 its address through shmproxy; rank 0 connects the streams. Each
stream has a thread of its own that moves its share (``sendall`` / ``recv_into``, GIL released in
the kernel), so the streams run in parallel as the transport's do; with one stream the calling
thread moves the bytes itself.
"""
from __future__ import annotations

import queue
import socket
import threading
from typing import Any

import numpy as np

from shmproxy.control import netif
from shmproxy.tools.bench.libraries import Library
from shmproxy.tools.bench.operation import Ctx
from shmproxy.tools.bench.traffic import TAG_SETUP

CONNECT_TIMEOUT_S = 30.0
OPS = ("pingpong",)   # what these peers time


def unsupported(name: str, op: str) -> str:
    """Why raw-socket peer ``name`` does not run ``op`` ('' when it does)."""
    return "" if op in OPS else f"{name}: raw sockets time the ping-pong only (the link's limit)"


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"the peer closed the stream after {got} of {n} bytes")
        got += k


class _Stream:
    """One socket and, for a multi-stream peer, the thread that moves its share of each message."""

    def __init__(self, sock: socket.socket, threaded: bool):
        self.sock = sock
        self.jobs: queue.SimpleQueue | None = queue.SimpleQueue() if threaded else None
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        if threaded:
            self.thread = threading.Thread(target=self._run, name="bench-tcp-stream", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        assert self.jobs is not None
        while True:
            job = self.jobs.get()
            if job is None:
                return
            kind, view = job
            try:
                self.move(kind, view)
                self.done.put(None)
            except OSError as exc:
                self.done.put(exc)

    def move(self, kind: str, view: memoryview) -> None:
        if kind == "send":
            self.sock.sendall(view)
        else:
            _recv_exact(self.sock, view)

    def stop(self) -> None:
        if self.jobs is not None and self.thread is not None:
            self.jobs.put(None)
            self.thread.join(5.0)
        self.sock.close()


class TcpLib(Library):
    """Ranks 0 and 1 over ``nstreams`` TCP sockets; send/recv split a message evenly over them."""

    def __init__(self, name: str, socks: list[socket.socket], where: str):
        super().__init__()
        self.name = self.kind = name
        self.version = f"{len(socks)} stream{'s' if len(socks) > 1 else ''} over {where}"
        self.streams = [_Stream(s, threaded=len(socks) > 1) for s in socks]
        self.send = lambda buf, peer, tag: self._move("send", buf)
        self.recv = lambda buf, peer, tag: self._move("recv", buf)
        self.isend = self.irecv = self._no_nonblocking

    @staticmethod
    def _no_nonblocking(buf: Any, peer: int, tag: int) -> Any:
        raise NotImplementedError("raw sockets time the ping-pong only")

    def _move(self, kind: str, buf: Any) -> None:
        view = memoryview(buf).cast("B")
        n, k = len(view), len(self.streams)
        if k == 1:
            self.streams[0].move(kind, view)
            return
        bounds = [n * i // k for i in range(k + 1)]
        for s, lo, hi in zip(self.streams, bounds, bounds[1:]):
            assert s.jobs is not None
            s.jobs.put((kind, view[lo:hi]))
        errors = [s.done.get() for s in self.streams]
        for exc in errors:
            if exc is not None:
                raise exc

    def close(self) -> None:
        for s in self.streams:
            s.stop()


def open_tcp(ctx: Ctx, name: str) -> tuple[Library | None, str]:
    """The raw-socket peer ``name`` ('tcp': one stream; 'tcp-streams': as many as shmproxy's link)."""
    comm = ctx.comm
    params = comm.params
    nstreams = 1 if name == "tcp" else max(params.SOCKET_NTHREADS * params.NSOCKS_PERTHREAD,
                                           params.NET_COLL_SOCKETS)
    if ctx.rank > 1:
        return TcpLib(name, [], "-"), ""   # ranks past 1 take no part in the ping-pong
    addr_buf = np.zeros(64, np.uint8)
    try:
        ip = netif.choose_ip(params.SOCKET_IFNAME, None)
    except Exception as exc:   # whatever the interface probe raised: the peer is skipped, saying why
        ip, why = "", f"no interface to listen on ({exc})"
    else:
        why = ""
    if ctx.rank == 1:
        listener = None
        if ip:
            fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
            listener = socket.socket(fam, socket.SOCK_STREAM)
            listener.bind((ip, 0))
            listener.listen(nstreams)
            listener.settimeout(CONNECT_TIMEOUT_S)
            mine = f"{ip} {listener.getsockname()[1]}".encode()
            addr_buf[:len(mine)] = np.frombuffer(mine, np.uint8)
        comm.Send(addr_buf, 0, TAG_SETUP)
        if listener is None:
            return None, why
        try:
            socks = [listener.accept()[0] for _ in range(nstreams)]
        except OSError as exc:
            return None, f"rank 0 did not connect its streams ({exc})"
        finally:
            listener.close()
    else:
        comm.Recv(addr_buf, 1, TAG_SETUP)
        text = bytes(addr_buf).rstrip(b"\0").decode()
        if not text:
            return None, "rank 1 has no interface to listen on"
        host, port = text.rsplit(" ", 1)
        try:
            socks = [socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
                     for _ in range(nstreams)]
        except OSError as exc:
            return None, f"cannot connect to rank 1 at {host} port {port} ({exc})"
        ip = host
    for s in socks:
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return TcpLib(name, socks, ip), ""
