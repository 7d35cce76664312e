"""Hosts made of network namespaces, for tests of jobs across nodes (root only; CI runs as root).

    with Hosts(2) as hosts:                 # two "machines" on one switch
        run_ranks(target, 4, nodes=2, node_cmd=hosts.cmds(), bootstrap=hosts.bootstrap())

``Hosts(n)`` makes a switch namespace holding a bridge and ``n`` host namespaces, each with loopback
and one veth cable into the switch, addressed 10.<a>.<b>.<i+1>/24 (private addresses that exist only
inside the namespaces made here). A rank started with ``ip netns exec <host>`` sees its own network
stack, hence its own host identity (the namespace's inode is part of it) and its own ports, while the
file system, /dev/shm and the pid space stay shared, so the harness still finds, kills and checks
every process as usual. ``cut(i)`` takes host i's cable down at the switch, as a pulled cable would.
Everything is deleted on exit, also when the test failed, and ``leftover()`` lists namespaces of ours
still present (the test fixture asserts there are none).
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import uuid
from typing import Any, Mapping, Sequence

PREFIX = "sptest"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (the tests then skip, saying so), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    name = f"{PREFIX}probe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot create a network namespace: {getattr(exc, 'stderr', exc)}"
    _ip("netns", "del", name, check=False)
    return None


def leftover() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


class Hosts:
    def __init__(self, n: int):
        self.n = n
        tag = uuid.uuid4().hex[:6]
        self.switch = f"{PREFIX}{tag}sw"
        self.names = [f"{PREFIX}{tag}h{i}" for i in range(n)]
        self.net = f"10.{random.randint(64, 250)}.{random.randint(1, 250)}"

    def addr(self, i: int) -> str:
        return f"{self.net}.{i + 1}"

    def cmd(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def cmds(self) -> list[list[str]]:
        return [self.cmd(i) for i in range(self.n)]

    def bootstrap(self, port: int | None = None) -> str:
        return f"{self.addr(0)}:{port or random.randint(20000, 60000)}"

    def __enter__(self) -> "Hosts":
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"s{i}", "netns", self.switch)
                _ip("-n", self.switch, "link", "set", f"s{i}", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"s{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def cut(self, i: int) -> None:
        """Pull host i's cable (at the switch: the host's own interface stays up, as with a cable)."""
        _ip("-n", self.switch, "link", "set", f"s{i}", "down")

    def close(self) -> None:
        for ns in [*self.names, self.switch]:
            _ip("netns", "del", ns, check=False)

    def __exit__(self, *exc: Any) -> None:
        self.close()


def launch_torchrun_hosts(hosts: Hosts, target: str, per_host: int, timeout: float,
                          env: Mapping[str, str | None] | None = None, args: Sequence[Any] = ()) -> Any:
    """torchrun on every host (``--nnodes`` = hosts, ``--node-rank`` i, node 0's address as master),
    through the harness's launcher runner: one shell starts them all, so that the first failure, the
    deadline and the kill work as for one launcher."""
    from tests import harness
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        harness._skip("torch is not installed (pip install torch==2.13.0 for torchrun tests)")
    port = str(random.randint(20000, 60000))
    parts = []
    for i in range(hosts.n):
        cmd = [*hosts.cmd(i), sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts.n),
               "--node-rank", str(i), "--nproc-per-node", str(per_host), "--master-addr", hosts.addr(0),
               "--master-port", port, "--max-restarts", "0"]
        parts.append(" ".join(cmd) + ' "$@" & p' + str(i) + "=$!")
    waits = "; ".join(f"wait $p{i} || rc=1" for i in range(hosts.n))
    script = "; ".join(parts) + f"; rc=0; {waits}; exit $rc"
    return harness._run_launcher("torchrun", ["sh", "-c", script, "sh"], target, hosts.n * per_host, timeout, env,
                                 args, set(), {"OMP_NUM_THREADS": "1"}, startup=min(10.0, timeout / 4))
