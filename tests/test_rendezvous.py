"""The rendezvous across nodes and the choice of interface, in-process: the served allgather with
threads as ranks (and a stranger among them), the layout it yields, NCCL's interface syntax."""
from __future__ import annotations

import json
import socket
import threading

import pytest

from shmproxy.control import netif, rendezvous
from shmproxy.control.launcher import LaunchInfo
from shmproxy.core import params as PM
from shmproxy.core.errors import InvalidArgument, InvalidUsage, Timeout


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gather(n: int, blobs, port: int, timeout: float = 10.0, stranger: bytes | None = None) -> list:
    p = PM.Params(env={"SHMPROXY_BOOTSTRAP": f"127.0.0.1:{port}"})
    out: list = [None] * n

    def rank(r: int) -> None:
        info = LaunchInfo(rank=r, size=n, local_rank=0, local_size=1, launcher="explicit")
        try:
            out[r] = rendezvous.allgather(info, p, blobs[r], timeout)
        except Exception as exc:  # noqa: BLE001  (reported to the test)
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    threads[0].start()
    if stranger is not None:   # knocks before the others come
        for _ in range(100):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(stranger)
                break
            except ConnectionRefusedError:
                threading.Event().wait(0.02)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_the_served_allgather_gives_every_rank_every_blob_in_rank_order():
    blobs = [f"blob of rank {r}".encode() * (r + 1) for r in range(4)]
    assert _gather(4, blobs, _port()) == [blobs] * 4


@pytest.mark.parametrize("stranger", [b"GET / HTTP/1.0\r\n\r\n", b"SHMPXBS1" + b"\xff" * 16, b""])
def test_a_stranger_at_the_rendezvous_is_dropped(stranger):
    blobs = [b"a", b"b", b"c"]
    assert _gather(3, blobs, _port(), stranger=stranger) == [blobs] * 3


def test_a_missing_rank_is_a_timeout_naming_the_address():
    port = _port()
    p = PM.Params(env={"SHMPROXY_BOOTSTRAP": f"127.0.0.1:{port}"})
    info = LaunchInfo(rank=0, size=2, local_rank=0, local_size=1, launcher="explicit")
    with pytest.raises(Timeout, match=f"127.0.0.1:{port}"):
        rendezvous.allgather(info, p, b"x", 1.0)


def test_the_layout_groups_ranks_by_host_and_checks_the_launchers_local_ranks(monkeypatch):
    hosts = ["h0", "h1", "h0", "h1"]
    entries = [json.dumps({"host": h, "lr": r // 2, "net": f"{r}0",
                           **({"secret": "00" * 16} if r == 0 else {})}).encode()
               for r, h in enumerate(hosts)]
    monkeypatch.setattr(rendezvous, "allgather", lambda *a, **k: entries)
    p = PM.Params(env={})
    info = LaunchInfo(rank=1, size=4, local_rank=0, local_size=2, launcher="explicit")
    lay = rendezvous.node_layout(info, p, "h1", b"", 1.0)
    assert lay["rank_node"] == [0, 1, 0, 1] and lay["node"] == 1 and lay["hosts"] == ["h0", "h1"]
    assert lay["infos"] == ["00", "10"]
    bad = LaunchInfo(rank=1, size=4, local_rank=1, local_size=2, launcher="explicit")
    with pytest.raises(InvalidUsage, match="local rank 1 of 2"):
        rendezvous.node_layout(bad, p, "h1", b"", 1.0)


def test_no_rendezvous_names_what_to_set(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_mpi4py(name, *a, **k):
        if name == "mpi4py":
            raise ImportError("hidden")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_mpi4py)
    info = LaunchInfo(rank=0, size=4, local_rank=0, local_size=2, launcher="openmpi")
    with pytest.raises(InvalidUsage, match="SHMPROXY_BOOTSTRAP=host:port.*torchrun.*mpi4py"):
        rendezvous.method(info, PM.Params(env={}))


@pytest.mark.parametrize("spec,name,ok", [
    ("eth", "eth0", True), ("eth", "ib0", False), ("eth,ib", "ib0", True), ("^docker,lo", "lo", False),
    ("^docker,lo", "eth1", True), ("=eth0", "eth0", True), ("=eth0", "eth01", False), ("^=lo", "lo0", True),
])
def test_ifname_syntax_is_nccls(spec, name, ok):
    assert netif.matches(spec, name) is ok


def test_choose_ip_follows_the_spec_and_the_route():
    assert netif.choose_ip("=lo", None) == "127.0.0.1"
    assert netif.choose_ip("", "127.0.0.1") == "127.0.0.1"
    with pytest.raises(InvalidUsage, match="no interface matches"):
        netif.choose_ip("=nosuchif0", None)
    with pytest.raises(InvalidArgument):
        PM.Params(env={"SHMPROXY_SOCKET_IFNAME": "eth 0"})
    with pytest.raises(InvalidArgument):
        PM.Params(env={"SHMPROXY_BOOTSTRAP": "nohostport"})
