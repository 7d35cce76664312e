"""The transports registry: selection per peer pair, the contract check, the TRANSPORTS parameter."""
from __future__ import annotations

import pytest

import shmproxy
from shmproxy.core import errors
from shmproxy import transports
from shmproxy.transports.base import PeerInfo, Transport, check_transport


def test_registry_selects_shm_on_one_host_and_names_both_peers_otherwise():
    a = PeerInfo(0, 0, "hostA", 100)
    b = PeerInfo(1, 1, "hostA", 101)
    c = PeerInfo(2, 0, "hostB", 200)
    assert transports.select(a, b).name == "shm"
    with pytest.raises(errors.InvalidUsage, match=r"rank 0 \(host hostA.*rank 2 \(host hostB"):
        transports.select(a, c)


def test_contract_check_rejects_incomplete_transports():
    class NoProgress(Transport):
        name = "broken"

        def can_connect(self, me, peer):
            return True

    class Named(Transport):
        def can_connect(self, me, peer):
            return True

        def proxy_progress(self, engine, args):
            return True

    with pytest.raises(TypeError):
        check_transport(NoProgress())  # abstract method missing: cannot even be instantiated
    with pytest.raises(TypeError, match="no name"):
        check_transport(Named())


def test_transports_parameter_restricts_the_registry_and_names_unknown_ones() -> None:
    from shmproxy import transports
    from shmproxy.core.params import Params
    assert transports.allowed(Params(env={}).TRANSPORTS) == transports.REGISTRY
    assert [t.name for t in transports.allowed(Params(env={"SHMPROXY_TRANSPORTS": " SHM "}).TRANSPORTS)] == ["shm"]
    with pytest.raises(shmproxy.InvalidArgument, match="nosuch.*registered: shm"):
        transports.allowed(Params(env={"SHMPROXY_TRANSPORTS": "shm,nosuch"}).TRANSPORTS)
    with pytest.raises(shmproxy.InvalidArgument):
        Params(env={"SHMPROXY_TRANSPORTS": "a b"})
