"""Which address a node's progress process listens on for the other nodes.

``SOCKET_IFNAME`` follows NCCL_SOCKET_IFNAME: a comma-separated list of interface-name prefixes
(``eth,ib``), ``^`` in front excludes them instead (``^docker,lo``), ``=`` in front makes the names
exact (``=eth0``). Without it, the interface is the one the kernel routes to the rendezvous address
through (a UDP socket "connected" there sends nothing and tells which source address it would
use): the address the other nodes can reach us at, on a machine with several networks. With no
rendezvous address, the first interface that is neither loopback nor a container bridge; loopback
only when nothing else exists (every node on one machine). IPv4 is preferred over IPv6, and IPv6
link-local addresses are never chosen (they need a scope that the other nodes cannot know).
"""
from __future__ import annotations

import ipaddress
import socket

import psutil

from shmproxy.core import log
from shmproxy.core.errors import InvalidArgument, InvalidUsage

_log = log.get("BOOTSTRAP")
_DEFAULT_EXCLUDED = ("lo", "docker", "virbr", "br-", "veth")   # loopback and container bridges


def parse_spec(spec: str) -> tuple[bool, bool, list[str]]:
    """(exclude, exact, names) of a SOCKET_IFNAME value."""
    t = spec.strip()
    exclude = t.startswith("^")
    t = t.lstrip("^")
    exact = t.startswith("=")
    t = t.lstrip("=")
    names = [n.strip() for n in t.split(",") if n.strip()]
    return exclude, exact, names


def matches(spec: str, ifname: str) -> bool:
    exclude, exact, names = parse_spec(spec)
    hit = any(ifname == n if exact else ifname.startswith(n) for n in names)
    return hit != exclude


def _usable(addr: str, family: int) -> bool:
    if family == socket.AF_INET6:
        ip = ipaddress.ip_address(addr.split("%")[0])
        return not ip.is_link_local
    return family == socket.AF_INET


def interface_addresses() -> list[tuple[str, int, str]]:
    """(interface, family, address) of every interface that is up, IPv4 first."""
    stats = psutil.net_if_stats()
    out = []
    for name, addrs in psutil.net_if_addrs().items():
        if name in stats and not stats[name].isup:
            continue
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and _usable(a.address, a.family):
                out.append((name, int(a.family), a.address.split("%")[0]))
    out.sort(key=lambda x: (x[1] != socket.AF_INET,))
    return out


def route_source(host: str, port: int = 9) -> str | None:
    """The source address the kernel would use to reach ``host``, or None."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError as exc:
        _log.info("cannot resolve %s: %s", host, exc)
        return None
    for family, _t, _p, _c, sockaddr in infos:
        s = socket.socket(family, socket.SOCK_DGRAM)
        try:
            s.connect(sockaddr)
            return s.getsockname()[0]
        except OSError:
            continue
        finally:
            s.close()
    return None


def choose_ip(spec: str, target: str | None) -> str:
    """The address to listen on (see the module header). Raises InvalidUsage when nothing fits."""
    addrs = interface_addresses()
    if spec:
        exclude, _exact, names = parse_spec(spec)
        if not names:
            raise InvalidArgument(f"SHMPROXY_SOCKET_IFNAME={spec!r} names no interface")
        for name, _fam, addr in addrs:
            if matches(spec, name):
                _log.info("listening for other nodes on %s (%s; SOCKET_IFNAME=%s)", addr, name, spec)
                return addr
        raise InvalidUsage(f"no interface matches SHMPROXY_SOCKET_IFNAME={spec!r}; interfaces: "
                           f"{', '.join(sorted({n for n, _f, _a in addrs})) or 'none'}")
    if target:
        src = route_source(target)
        if src is not None:
            name = next((n for n, _f, a in addrs if a == src), "?")
            _log.info("listening for other nodes on %s (%s: the route to %s)", src, name, target)
            return src
    for name, _fam, addr in addrs:
        if not name.startswith(_DEFAULT_EXCLUDED):
            _log.info("listening for other nodes on %s (%s)", addr, name)
            return addr
    for name, _fam, addr in addrs:
        if name.startswith("lo"):
            _log.info("no network interface but loopback: listening on %s", addr)
            return addr
    raise InvalidUsage("no network interface to reach the other nodes through; set SHMPROXY_SOCKET_IFNAME")
