"""Jobs across hosts made of network namespaces (tests/harness_netns.py): real network stacks, so real
host identities, TCP over veth cables through a switch, a cable pulled mid-collective, strangers on a
progress process's port, and torchrun on every host. Skipped, saying why, where namespaces cannot be
made (not root)."""
from __future__ import annotations

import pytest

from tests import harness_netns
from tests.harness import run_ranks

BODY = "tests.bodies_multinode:"
_WHY = harness_netns.unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


@pytest.fixture(autouse=True)
def no_namespace_left():
    yield
    left = harness_netns.leftover()
    assert not left, f"network namespaces left behind: {left}"


def run_hosts(hosts: harness_netns.Hosts, body: str, nranks: int, **kw):
    return run_ranks(BODY + body, nranks, nodes=hosts.n, node_cmd=hosts.cmds(), bootstrap=hosts.bootstrap(), **kw)


def test_two_hosts_point_to_point_and_collectives():
    with harness_netns.Hosts(2) as hosts:
        run_hosts(hosts, "p2p_every_pair", 4, timeout=120)
        run_hosts(hosts, "collectives", 4, timeout=180, args=(300 << 10,),
                  env={"SHMPROXY_NET_CHUNK_SIZE": "64K"})


def test_three_hosts_split_and_objects():
    with harness_netns.Hosts(3) as hosts:
        run_hosts(hosts, "split_and_objects", 4, timeout=120)


def test_a_pulled_cable_fails_every_survivor_within_the_bound():
    with harness_netns.Hosts(2) as hosts:
        cut = ["ip", "-n", hosts.switch, "link", "set", "s1", "down"]
        res = run_hosts(hosts, "cut_link", 4, timeout=120, args=(cut, 20),
                        env={"SHMPROXY_NET_KEEPALIVE_S": "2", "SHMPROXY_TIMEOUT": "90"})
        cut_at = res.results[0]["cut"]
        for r, out in enumerate(res.results):
            assert out["ended"] - cut_at < 30, (r, out)
            assert "lost node" in out["error"] or "reported by node" in out["error"], (r, out)


def test_strangers_on_the_port_are_dropped_and_the_job_goes_on():
    with harness_netns.Hosts(2) as hosts:
        res = run_hosts(hosts, "stranger_on_the_port", 4, timeout=120)
        assert all(r["ok"] for r in res.results)


def test_torchrun_on_two_hosts():
    with harness_netns.Hosts(2) as hosts:
        res = harness_netns.launch_torchrun_hosts(hosts, BODY + "p2p_every_pair", 2, timeout=180)
        assert all(r["ok"] for r in res.results)
