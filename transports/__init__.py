"""Transports, in the order they are tried: the first that moves the memory kind and whose
``can_connect`` says yes carries a connection (the contract: shmproxy.transports.base): shm (host
memory on one node), cuda (device memory on one node, transports/cuda.py: it imports nothing of CUDA
until device memory is registered), then socket (host memory between nodes, over TCP). An RDMA
transport registers here when it lands. Every host-memory transport runs the conformance suite
(tests/test_conformance.py) by being registered; the cuda transport's suite is tests/test_gpu*.py."""
from __future__ import annotations

from shmproxy.core.errors import InvalidArgument, InvalidUsage
from shmproxy.transports.base import Connector, MemKind, PeerInfo, Transport, TransportContext, check_transport
from shmproxy.transports.cuda import CudaTransport
from shmproxy.transports.net_socket import SocketTransport
from shmproxy.transports.shm import ShmTransport

REGISTRY: tuple[Transport, ...] = tuple(check_transport(t) for t in (ShmTransport(), CudaTransport(),
                                                                     SocketTransport()))


def allowed(names: str, registry: tuple[Transport, ...] = REGISTRY) -> tuple[Transport, ...]:
    """The registry restricted to ``names`` (the TRANSPORTS parameter: comma-separated, '' = all), in
    registry order; an unknown name is an InvalidArgument listing the registered ones."""
    if not names:
        return registry
    wanted = names.split(",")
    known = {t.name for t in registry}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise InvalidArgument(f"SHMPROXY_TRANSPORTS names {', '.join(unknown)}, which is not a registered "
                              f"transport (registered: {', '.join(t.name for t in registry)})")
    return tuple(t for t in registry if t.name in wanted)


def select(me: PeerInfo, peer: PeerInfo, kind: MemKind = MemKind.HOST,
           registry: tuple[Transport, ...] = REGISTRY) -> Transport:
    """The first transport that can carry ``kind`` memory between the two ranks; raises naming both
    (and the memory kind) when none can."""
    for t in registry:
        if kind in t.kinds and t.can_connect(me, peer, kind):
            return t
    raise InvalidUsage(
        f"no transport can connect rank {me.rank} (host {me.host}, pid {me.pid}) with rank {peer.rank} "
        f"(host {peer.host}, pid {peer.pid}) for {kind.name.lower()} memory; tried: "
        f"{', '.join(t.name for t in registry) or 'none (SHMPROXY_TRANSPORTS)'}")


__all__ = ["REGISTRY", "allowed", "select", "Connector", "MemKind", "PeerInfo", "Transport", "TransportContext"]
