"""The launcher environment of the test harness (tests/harness.py): the variables every rank of a run
starts from (the run's markers SPTEST_RUN_ID and SPTEST_OWNER, SHMPROXY_JOB_ID, SHMPROXY_TIMEOUT, the
faulthandler deadline), what each simulated launcher sets for one rank, and the launcher variables a rank
must not inherit from the test process. Importable from tests.harness too.
"""
from __future__ import annotations

import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

from tests.rankmain import FAULT_TIMEOUT_VAR, RESULT_VAR


REPO = Path(__file__).resolve().parents[1]

RUN_ID_VAR = "SPTEST_RUN_ID"  # marks every process of one run (ranks, launchers' workers, progress)
OWNER_VAR = "SPTEST_OWNER"    # pid of the test process that started the run (LeakGuard ownership)


# Launcher variables a rank must not inherit from the test process (prefixes, then exact names).
_LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "SLURM_", "TORCHELASTIC_", "HYDRA_",
                      "PRTE_", "MPICH_", "I_MPI_", "SPTEST_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                   "SHMPROXY_JOB_ID", "SHMPROXY_TIMEOUT"}

SIMULATED_LAUNCHERS = ("env", "ompi", "pmi", "slurm")
REAL_LAUNCHERS = ("mpiexec", "torchrun")


# ---------------------------------------------------------------------------------------------
# Environment


def default_proxy_timeout(timeout: float) -> float:
    """SHMPROXY_TIMEOUT for a run with this deadline: the runtime's waits must fire first."""
    return round(min(timeout / 2, 60.0), 3)


def fault_timeout(timeout: float, startup: float = 0.0) -> float:
    """When a rank dumps its stacks: shortly before the harness's deadline (minus launcher startup)."""
    return round(max(timeout * 0.5, min(timeout * 0.8, timeout - 2.0) - startup), 3)


def base_env(timeout: float, run_id: str, prefix: str, env: Mapping[str, str | None] | None,
             startup: float = 0.0) -> dict[str, str]:
    """The environment every rank of a run starts from (without its rank variables)."""
    out = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)}
    pythonpath = out.get("PYTHONPATH", "")
    out.update({
        "PYTHONPATH": str(REPO) + (os.pathsep + pythonpath if pythonpath else ""),
        "PYTHONFAULTHANDLER": "1",
        "PYTHONUNBUFFERED": "1",  # what a rank printed before it hung is in its output
        "SHMPROXY_JOB_ID": uuid.uuid4().hex,
        "SHMPROXY_TIMEOUT": str(default_proxy_timeout(timeout)),
        RUN_ID_VAR: run_id,
        OWNER_VAR: str(os.getpid()),
        RESULT_VAR: prefix,
        FAULT_TIMEOUT_VAR: str(fault_timeout(timeout, startup)),
    })
    apply_overrides(out, env)
    return out


def apply_overrides(dst: dict[str, str], env: Mapping[str, str | None] | None) -> None:
    """Apply a test's ``env`` to an environment: a value sets (as str), None removes."""
    for k, v in (env or {}).items():
        if v is None:
            dst.pop(k, None)
        else:
            dst[k] = str(v)


def rank_env(style: str, rank: int, nranks: int, job: str) -> dict[str, str]:
    """The variables launcher ``style`` sets for ``rank`` of ``nranks`` on one node (``job``: hex id)."""
    r, n = str(rank), str(nranks)
    if style == "env":
        return {"RANK": r, "WORLD_SIZE": n, "LOCAL_RANK": r, "LOCAL_WORLD_SIZE": n}
    if style == "ompi":
        return {"OMPI_COMM_WORLD_RANK": r, "OMPI_COMM_WORLD_SIZE": n, "OMPI_COMM_WORLD_LOCAL_RANK": r,
                "OMPI_COMM_WORLD_LOCAL_SIZE": n, "OMPI_COMM_WORLD_NODE_RANK": r}
    if style == "pmi":
        return {"PMI_RANK": r, "PMI_SIZE": n, "MPI_LOCALRANKID": r, "MPI_LOCALNRANKS": n}
    if style == "slurm":
        return {"SLURM_PROCID": r, "SLURM_NTASKS": n, "SLURM_STEP_NUM_TASKS": n, "SLURM_LOCALID": r,
                "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_STEP_TASKS_PER_NODE": n,
                "SLURM_TASKS_PER_NODE": n, "SLURM_JOB_ID": str(int(job[:7], 16)), "SLURM_STEP_ID": "0"}
    raise ValueError(f"unknown launcher style {style!r}; one of {SIMULATED_LAUNCHERS + REAL_LAUNCHERS}")


def _rankmain_cmd(target: str, args: Sequence[Any] | Mapping[str, Any]) -> list[str]:
    if ":" not in target:
        raise ValueError(f"target must be 'module:function', got {target!r}")
    payload = dict(args) if isinstance(args, Mapping) else list(args)
    return ["-m", "tests.rankmain", target, json.dumps(payload)]


def _check_args(nranks: int, timeout: float, expect_fail: set[int] | None) -> set[int]:
    if not isinstance(nranks, int) or nranks < 1:
        raise ValueError(f"nranks must be an int >= 1, got {nranks!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout!r}")
    fails = set(expect_fail or ())
    bad = sorted(r for r in fails if not 0 <= r < nranks)
    if bad:
        raise ValueError(f"expect_fail ranks {bad} out of range for {nranks} ranks")
    return fails


def node_of(rank: int, nranks: int, nodes: int) -> int:
    """The simulated node of ``rank``: consecutive blocks of sizes as even as they go."""
    return rank * nodes // nranks


def node_env(rank: int, nranks: int, nodes: int, job: str, simulated: bool = True) -> dict[str, str]:
    """The variables that put ``rank`` on its node (run_ranks(nodes=...)): local rank and size within
    the node and, for a simulated node, a host identity of the node's own."""
    node = node_of(rank, nranks, nodes)
    members = [r for r in range(nranks) if node_of(r, nranks, nodes) == node]
    out = {"LOCAL_RANK": str(members.index(rank)), "LOCAL_WORLD_SIZE": str(len(members))}
    if simulated:
        out["SHMPROXY_HOSTNAME"] = f"simnode{node}-{job[:8]}"
    return out


def free_port() -> int:
    """A TCP port of loopback nobody listens on now, for rank 0 (or a launcher) to bind a moment later.

    It is drawn from below the kernel's ephemeral range (net.ipv4.ip_local_port_range): a port the
    kernel picked for bind(port 0) is one it also hands to outgoing connections, and one of those
    (any test's client socket) can take it between this call and rank 0's bind (EADDRINUSE, seen in
    CI). Below the range only another listener can collide, and that is checked here.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    low = max(low, 12000)
    for _ in range(200):
        port = 10000 + int.from_bytes(os.urandom(2), "little") % (low - 10000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port of loopback below the ephemeral range after 200 draws")
