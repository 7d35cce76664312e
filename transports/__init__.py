"""Transports, in the order they are tried: the first whose ``can_connect`` says yes carries a
connection. shm (host memory on one node) is the only one so far; p2p (CUDA IPC), net_socket and
net_ib register here in front of or after it as they land."""
from __future__ import annotations

from shmproxy.core.errors import InvalidArgument, InvalidUsage
from shmproxy.transports.base import PeerInfo, Transport, check_transport
from shmproxy.transports.shm import ShmTransport

REGISTRY: tuple[Transport, ...] = tuple(check_transport(t) for t in (ShmTransport(),))


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


def select(me: PeerInfo, peer: PeerInfo, registry: tuple[Transport, ...] = REGISTRY) -> Transport:
    """The first transport that can connect the two ranks; raises naming both when none can."""
    for t in registry:
        if t.can_connect(me, peer):
            return t
    raise InvalidUsage(
        f"no transport can connect rank {me.rank} (host {me.host}, pid {me.pid}) with rank {peer.rank} "
        f"(host {peer.host}, pid {peer.pid}); tried: {', '.join(t.name for t in registry)}")


__all__ = ["REGISTRY", "allowed", "select", "PeerInfo", "Transport"]
