"""The rendezvous of a job across nodes: one allgather among all ranks, through what the launcher runs.

On one node the ranks meet at a socket path they all compute (bootstrap.py). Across nodes they must
learn, once, which node every rank runs on, where each node's progress process listens, and the
job's secret. That is one allgather of a small blob per rank, made through the first of:

1. ``SHMPROXY_BOOTSTRAP=host:port`` (NCCL_COMM_ID's convention): rank 0 serves the allgather at that
   address (a thread of its own, for the duration of the exchange), every rank is its client.
2. torchrun: the TCPStore torchrun already serves at MASTER_ADDR:MASTER_PORT, as a client through
   torch (never binding that port); keys live under ``shmproxy/<run id>/<restart>/``.
3. mpi4py, when it imports: ``COMM_WORLD.allgather``.

Otherwise the error names the first two. ``node_layout`` turns the blobs into the layout the
progress process gets with CONNECT: nodes in the order of their lowest rank, each rank's node, each
node's host identity and connect-info, and the secret rank 0 drew (``secrets.token_bytes``).

The served allgather's wire: a client sends ``MAGIC, rank u32, size u32, length u32`` and its blob;
once all ``size`` ranks are in, each gets ``count u32`` then ``length u32 + blob`` per rank. A
connection that says anything else is logged and dropped; the exchange goes on.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import threading
import time
from typing import Any

from shmproxy.control.launcher import LaunchInfo
from shmproxy.core import log
from shmproxy.core.errors import InvalidArgument, InvalidUsage, Timeout, from_oserror

_log = log.get("BOOTSTRAP")
MAGIC = b"SHMPXBS1"
_HELLO = struct.Struct("<8sIII")
_LEN = struct.Struct("<I")
MAX_BLOB = 64 << 10
HELLO_WAIT_S = 2.0


def split_hostport(text: str) -> tuple[str, int]:
    host, _sep, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def target_host(info: LaunchInfo, params: Any) -> str | None:
    """The rendezvous address, for choosing the interface that routes there (netif.choose_ip)."""
    if params.BOOTSTRAP:
        return split_hostport(params.BOOTSTRAP)[0]
    return info.master_addr


def method(info: LaunchInfo, params: Any) -> str:
    """'bootstrap', 'torchrun' or 'mpi4py': how this job's ranks meet (the module header's order)."""
    if params.BOOTSTRAP:
        return "bootstrap"
    if info.launcher == "torchrun" and info.master_addr and info.master_port:
        return "torchrun"
    try:
        import mpi4py  # noqa: F401   (only whether it exists: importing mpi4py.MPI initialises MPI)
    except ImportError:
        raise InvalidUsage(
            f"{info.local_size} of the {info.size} ranks run on this host ({info}): a job across nodes "
            f"needs a rendezvous: set SHMPROXY_BOOTSTRAP=host:port (an address of rank 0's node), launch "
            f"with torchrun, or install mpi4py") from None
    return "mpi4py"


def allgather(info: LaunchInfo, params: Any, blob: bytes, timeout: float, env: dict | None = None) -> list[bytes]:
    """Every rank's ``blob``, in rank order, through the job's rendezvous (the module header)."""
    if len(blob) > MAX_BLOB:
        raise InvalidArgument(f"rendezvous blob of {len(blob)} bytes (at most {MAX_BLOB})")
    how = method(info, params)
    _log.info("rendezvous of %d ranks through %s", info.size, how)
    if how == "bootstrap":
        host, port = split_hostport(params.BOOTSTRAP)
        server = _Server(host, port, info.size, timeout) if info.rank == 0 else None
        try:
            return _client(host, port, info.rank, info.size, blob, timeout)
        finally:
            if server is not None:
                server.close()
    if how == "torchrun":
        return _torch_store(info, blob, timeout, os.environ if env is None else env)
    from mpi4py import MPI
    return [bytes(b) for b in MPI.COMM_WORLD.allgather(blob)]


def node_layout(info: LaunchInfo, params: Any, host: str, net_info: bytes, timeout: float) -> dict:
    """The layout of the job's nodes (the module header), the same on every rank."""
    mine: dict[str, Any] = {"host": host, "lr": info.local_rank, "net": net_info.hex()}
    if info.rank == 0:
        mine["secret"] = secrets.token_bytes(16).hex()
    blobs = allgather(info, params, json.dumps(mine).encode(), timeout)
    try:
        entries = [json.loads(b) for b in blobs]
        hosts: list[str] = []
        rank_node = []
        for e in entries:
            if e["host"] not in hosts:
                hosts.append(e["host"])
            rank_node.append(hosts.index(e["host"]))
        secret = entries[0]["secret"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidUsage(f"the rendezvous returned malformed entries: {exc!r}") from exc
    node = rank_node[info.rank]
    here = [r for r, n in enumerate(rank_node) if n == node]
    if len(here) != info.local_size or here.index(info.rank) != info.local_rank:
        raise InvalidUsage(
            f"rank {info.rank}: the launcher says local rank {info.local_rank} of {info.local_size}, but ranks "
            f"{here} share this host ({host}); set SHMPROXY_HOSTNAME if the host identity is wrong")
    infos = []
    for n in range(len(hosts)):
        first = rank_node.index(n)
        infos.append(entries[first]["net"])
    if any(not i for i in infos):
        raise InvalidUsage("a node's progress process has no address for the others (no transport between "
                           "nodes is allowed there: SHMPROXY_TRANSPORTS)")
    return {"node": node, "rank_node": rank_node, "hosts": hosts, "infos": infos, "secret": secret}


# -------------------------------------------------------------------------------------------------
# SHMPROXY_BOOTSTRAP: rank 0 serves the allgather


class _Server:
    """Rank 0's allgather server, on a thread, for one exchange."""

    def __init__(self, host: str, port: int, size: int, timeout: float):
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(fam, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
            self.sock.listen(max(64, size))
        except OSError as exc:
            self.sock.close()
            raise from_oserror(f"rank 0 cannot serve the rendezvous at SHMPROXY_BOOTSTRAP={host}:{port} (it "
                               f"must be an address of rank 0's node)", exc) from exc
        self.size, self.deadline = size, time.monotonic() + timeout
        self.sock.settimeout(0.2)
        self.stop = False
        self.thread = threading.Thread(target=self._serve, name="shmproxy-rendezvous", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        clients: dict[int, tuple[socket.socket, bytes]] = {}
        try:
            while len(clients) < self.size and not self.stop and time.monotonic() < self.deadline:
                try:
                    conn, peer = self.sock.accept()
                except socket.timeout:
                    continue
                try:
                    # A rank sends its hello as it connects: a silent stranger delays the others by
                    # HELLO_WAIT_S at most.
                    rank, blob = _read_hello(conn, self.size, min(HELLO_WAIT_S, self.deadline - time.monotonic()))
                    if rank in clients:
                        raise ValueError(f"rank {rank} twice")
                    clients[rank] = (conn, blob)
                except (OSError, ValueError) as exc:
                    _log.warning("rendezvous: dropped a connection from %s: %s", peer, exc)
                    conn.close()
            if len(clients) == self.size:
                reply = _LEN.pack(self.size) + b"".join(_LEN.pack(len(clients[r][1])) + clients[r][1]
                                                        for r in range(self.size))
                for conn, _b in clients.values():
                    try:
                        conn.sendall(reply)
                    except OSError as exc:
                        _log.warning("rendezvous: a rank left before its answer: %s", exc)
        finally:
            for conn, _b in clients.values():
                conn.close()
            self.sock.close()

    def close(self) -> None:
        self.stop = True
        self.thread.join(5.0)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            raise ValueError("closed early")
        buf += part
    return bytes(buf)


def _read_hello(conn: socket.socket, size: int, timeout: float) -> tuple[int, bytes]:
    conn.settimeout(max(0.1, timeout))
    magic, rank, nranks, n = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
    if magic != MAGIC or nranks != size or not 0 <= rank < size or n > MAX_BLOB:
        raise ValueError(f"not a rank of this job (rank {rank}, size {nranks}, {n} B)")
    blob = _recv_exact(conn, n)
    conn.settimeout(None)
    return rank, blob


def _client(host: str, port: int, rank: int, size: int, blob: bytes, timeout: float) -> list[bytes]:
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            break
        except (ConnectionRefusedError, socket.timeout, OSError) as exc:
            if time.monotonic() >= deadline:
                raise Timeout(f"rank {rank}: no rendezvous at SHMPROXY_BOOTSTRAP={host}:{port} within "
                              f"{timeout} s ({exc})") from exc
            time.sleep(delay)   # bounded backoff while rank 0 starts serving
            delay = min(delay * 2, 0.5)
    try:
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        conn.sendall(_HELLO.pack(MAGIC, rank, size, len(blob)) + blob)
        count = _LEN.unpack(_recv_exact(conn, 4))[0]
        if count != size:
            raise ValueError(f"{count} entries for {size} ranks")
        out = []
        for _ in range(count):
            n = _LEN.unpack(_recv_exact(conn, 4))[0]
            if n > MAX_BLOB:
                raise ValueError(f"an entry of {n} bytes")
            out.append(_recv_exact(conn, n))
        return out
    except socket.timeout as exc:
        raise Timeout(f"rank {rank}: the rendezvous at {host}:{port} did not complete within {timeout} s "
                      f"(are all {size} ranks started?)") from exc
    except (OSError, ValueError) as exc:
        raise InvalidUsage(f"rank {rank}: the rendezvous at {host}:{port} failed: {exc}") from exc
    finally:
        conn.close()


# -------------------------------------------------------------------------------------------------
# torchrun's store


def _torch_store(info: LaunchInfo, blob: bytes, timeout: float, env: Any) -> list[bytes]:
    import datetime

    import torch.distributed as dist
    if info.master_addr is None:
        raise InvalidUsage(f"rank {info.rank}: torchrun's store needs MASTER_ADDR, which is not set")
    store = dist.TCPStore(info.master_addr, int(info.master_port or 0), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    prefix = f"shmproxy/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    keys = [f"{prefix}{r}" for r in range(info.size)]
    store.set(keys[info.rank], blob)  # type: ignore[arg-type]  # the store takes bytes too (its stub says str)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:   # torch reports its store's timeout so
        raise Timeout(f"rank {info.rank}: torchrun's store did not see all {info.size} ranks within {timeout} s: "
                      f"{exc}") from exc
    return [bytes(store.get(k)) for k in keys]
