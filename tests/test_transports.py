"""The transports registry: selection per peer pair, the contract check, the TRANSPORTS parameter."""
from __future__ import annotations

import pytest

import shmproxy
from shmproxy.core import errors
from shmproxy import transports
from shmproxy.transports.base import MemKind, PeerInfo, Transport, check_transport


def test_registry_selects_shm_on_one_host_and_names_both_peers_and_the_kind_otherwise():
    a = PeerInfo(0, 0, "hostA", 100)
    b = PeerInfo(1, 1, "hostA", 101)
    c = PeerInfo(2, 0, "hostB", 200)
    assert transports.select(a, b).name == "shm"
    assert transports.select(a, a, MemKind.HOST).name == "shm"   # the loopback: self-sends, collectives
    with pytest.raises(errors.InvalidUsage, match=r"rank 0 \(host hostA.*rank 2 \(host hostB.*host memory"):
        transports.select(a, c)
    assert transports.select(a, b, MemKind.CUDA).name == "cuda"
    with pytest.raises(errors.InvalidUsage, match=r"rank 1 \(host hostA.*cuda memory; tried: shm"):
        transports.select(a, b, MemKind.CUDA, transports.allowed("shm"))
    with pytest.raises(errors.InvalidUsage, match=r"tried: none"):
        transports.select(a, b, MemKind.HOST, ())


class _Complete(Transport):
    """Every required method, doing nothing: the contract check's notion of complete."""

    name = "complete"

    def can_connect(self, me, peer, kind):
        return True

    def send_setup(self, ctx, conn):
        return b""

    def recv_setup(self, ctx, conn):
        return b""

    def send_connect(self, ctx, conn, recv_info):
        return None

    def recv_connect(self, ctx, conn, send_info):
        return None

    def proxy_start(self, ctx, conn, transfer):
        return True

    def proxy_progress(self, ctx, args):
        return True

    def proxy_free(self, ctx):
        return None


def test_contract_check_rejects_incomplete_transports():
    assert check_transport(_Complete()).proxy_progress_coll is None   # optional hooks are None, not no-ops

    class NoStart(_Complete):
        name = "nostart"
    NoStart.proxy_start = Transport.proxy_start   # type: ignore[method-assign]

    class Unnamed(_Complete):
        name = "?"

    class NoKinds(_Complete):
        name = "nokinds"
        kinds = frozenset()

    class BadHook(_Complete):
        name = "badhook"
        proxy_register = 3   # type: ignore[assignment]

    with pytest.raises(TypeError, match="does not implement proxy_start"):
        check_transport(NoStart())
    with pytest.raises(TypeError, match="no name"):
        check_transport(Unnamed())
    with pytest.raises(TypeError, match="kinds"):
        check_transport(NoKinds())
    with pytest.raises(TypeError, match="proxy_register must be a method or None"):
        check_transport(BadHook())
    with pytest.raises(TypeError, match="is not a"):
        check_transport(object())   # type: ignore[arg-type]

    class StartsOnly(_Complete):   # a collective it starts would never finish
        name = "startsonly"

        def proxy_start_coll(self, ctx, ops):
            return None
    with pytest.raises(TypeError, match="proxy_start_coll needs proxy_progress_coll"):
        check_transport(StartsOnly())

    class Abstract(Transport):
        name = "abstract"

        def can_connect(self, me, peer, kind):
            return True
    with pytest.raises(TypeError):
        Abstract()   # type: ignore[abstract]  # a required method missing: it cannot even be made


def test_every_registered_transport_passes_the_contract_check_and_moves_a_kind():
    assert transports.REGISTRY and len({t.name for t in transports.REGISTRY}) == len(transports.REGISTRY)
    for t in transports.REGISTRY:
        assert check_transport(t) is t and t.kinds <= set(MemKind)


def test_transports_parameter_restricts_the_registry_and_names_unknown_ones() -> None:
    from shmproxy import transports
    from shmproxy.core.params import Params
    assert transports.allowed(Params(env={}).TRANSPORTS) == transports.REGISTRY
    assert [t.name for t in transports.allowed(Params(env={"SHMPROXY_TRANSPORTS": " SHM "}).TRANSPORTS)] == ["shm"]
    with pytest.raises(shmproxy.InvalidArgument, match="nosuch.*registered: shm"):
        transports.allowed(Params(env={"SHMPROXY_TRANSPORTS": "shm,nosuch"}).TRANSPORTS)
    with pytest.raises(shmproxy.InvalidArgument):
        Params(env={"SHMPROXY_TRANSPORTS": "a b"})
