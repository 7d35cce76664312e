"""Tests of shmproxy.control.bootstrap: launcher detection, job keys, host identity, run dir, socket paths."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shmproxy.control import bootstrap
from shmproxy.control.bootstrap import LaunchInfo, detect, job_key, run_dir, service_path
from shmproxy.core.errors import InvalidArgument, InvalidUsage
from shmproxy.core.params import Params

REPO = Path(__file__).resolve().parents[1]

OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "PMIX_NAMESPACE": "prterun-node1-4242@1"}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
TORCH = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
         "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "abc"}
SLURM = {"SLURM_PROCID": "9", "SLURM_NTASKS": "11", "SLURM_STEP_NUM_TASKS": "11", "SLURM_LOCALID": "1",
         "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_JOB_ID": "777",
         "SLURM_STEP_ID": "0"}

LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "SLURM_", "TORCHELASTIC_", "SHMPROXY_", "HYDRA_")
LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def params(**overrides: object) -> Params:
    return Params(env={}, overrides=overrides)


def info_tuple(i: LaunchInfo) -> tuple:
    return (i.rank, i.size, i.local_rank, i.local_size, i.launcher, i.master_addr, i.master_port)


@pytest.fixture
def boot_log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """caplog for shmproxy.BOOTSTRAP, whether or not shmproxy.core.log.configure() stopped propagation."""
    monkeypatch.setattr(logging.getLogger("shmproxy"), "propagate", True)
    caplog.set_level(logging.INFO, logger="shmproxy.BOOTSTRAP")
    return caplog


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "shmproxy.BOOTSTRAP" and r.levelno == logging.WARNING]


# ------------------------------------------------------------------------------------------------
# detect(): each launcher, precedence, fallbacks

DETECT_CASES = [
    ("no launcher", {}, (0, 1, 0, 1, "singleton", None, None)),
    ("open mpi", OMPI, (3, 8, 1, 2, "openmpi", None, None)),
    ("mpich hydra", {**MPICH, "PMI_FD": "9"}, (2, 4, 0, 2, "mpich", None, None)),
    ("torchrun", TORCH, (5, 8, 1, 4, "torchrun", "node0", 29500)),
    ("srun, step list indexed by node", SLURM, (9, 11, 1, 3, "slurm", None, None)),
    ("srun, SLURM_NTASKS_PER_NODE only",
     {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2",
      "SLURM_STEP_ID": "3"}, (1, 4, 1, 2, "slurm", None, None)),
    ("srun, allocation-wide SLURM_TASKS_PER_NODE skipped for the step's",
     {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
      "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_TASKS_PER_NODE": "2",
      "SLURM_STEP_ID": "1"}, (1, 2, 1, 2, "slurm", None, None)),
    ("srun, equal counts need no SLURM_NODEID",
     {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "2(x2)",
      "SLURM_STEPID": "0"}, (3, 4, 1, 2, "slurm", None, None)),
    ("sbatch script: SLURM_PROCID without a step is not a launcher",
     {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "1(x4)",
      "SLURM_JOB_ID": "5"}, (0, 1, 0, 1, "singleton", None, None)),
    ("extern/batch step ids are not srun tasks",
     {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "4294967292"},
     (0, 1, 0, 1, "singleton", None, None)),
    ("srun --mpi=pmi2: PMI rank, local pair taken from Slurm",
     {"PMI_RANK": "9", "PMI_SIZE": "11", "PMI_FD": "5", **SLURM}, (9, 11, 1, 3, "mpich", None, None)),
    ("RANK/WORLD_SIZE only: all ranks assumed on this host",
     {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"},
     (2, 3, 2, 3, "torchrun", "10.0.0.1", 1234)),
    ("mpirun -npernode 1 torchrun: torchrun is innermost",
     {**TORCH, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, (5, 8, 1, 4, "torchrun", "node0", 29500)),
    ("srun torchrun: torchrun beats Slurm",
     {**SLURM, **TORCH}, (5, 8, 1, 4, "torchrun", "node0", 29500)),
    ("mpirun inside an allocation: Open MPI beats Slurm",
     {**SLURM, **OMPI}, (3, 8, 1, 2, "openmpi", None, None)),
    ("hydra inside an allocation: MPICH beats Slurm",
     {**SLURM, **MPICH}, (2, 4, 0, 2, "mpich", None, None)),
    ("Open MPI beats PMI_*", {**MPICH, **OMPI}, (3, 8, 1, 2, "openmpi", None, None)),
    ("whitespace around integers is fine",
     {"RANK": " 1 ", "WORLD_SIZE": "2\n", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
     (1, 2, 1, 2, "torchrun", None, None)),
]


@pytest.mark.parametrize("env,expected", [c[1:] for c in DETECT_CASES], ids=[c[0] for c in DETECT_CASES])
def test_detect(env: dict[str, str], expected: tuple) -> None:
    assert info_tuple(detect(env)) == expected


def test_detect_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith(LAUNCHER_PREFIXES) or k in LAUNCHER_NAMES:
            monkeypatch.delenv(k)
    for k, v in OMPI.items():
        monkeypatch.setenv(k, v)
    assert info_tuple(detect()) == (3, 8, 1, 2, "openmpi", None, None)


EXPLICIT_CASES = [
    ("explicit beats every launcher", {**OMPI, **TORCH}, dict(rank=1, size=2, local_rank=0, local_size=1),
     (1, 2, 0, 1, "explicit", "node0", 29500)),
    ("explicit without local pair, no env: all on this host", {}, dict(rank=1, size=3),
     (1, 3, 1, 3, "explicit", None, None)),
    ("explicit takes the local pair of an agreeing launcher", OMPI, dict(rank=3, size=8),
     (3, 8, 1, 2, "explicit", None, None)),
    ("explicit ignores the local pair of a disagreeing launcher", OMPI, dict(rank=0, size=8),
     (0, 8, 0, 8, "explicit", None, None)),
    ("local pair alone overrides only the local fields", TORCH, dict(local_rank=0, local_size=8),
     (5, 8, 0, 8, "torchrun", "node0", 29500)),
    ("explicit beats a malformed launcher", {"RANK": "x", "WORLD_SIZE": "2"}, dict(rank=0, size=1),
     (0, 1, 0, 1, "explicit", None, None)),
]


@pytest.mark.parametrize("env,kwargs,expected", [c[1:] for c in EXPLICIT_CASES],
                         ids=[c[0] for c in EXPLICIT_CASES])
def test_detect_explicit(env: dict[str, str], kwargs: dict, expected: tuple) -> None:
    assert info_tuple(detect(env, **kwargs)) == expected


def test_disagreeing_launchers_warn(boot_log: pytest.LogCaptureFixture) -> None:
    info = detect({**SLURM, **TORCH})
    assert info.launcher == "torchrun"
    [msg] = warnings_of(boot_log)
    assert "disagree" in msg and "torchrun says rank 5 of 8" in msg and "slurm says rank 9 of 11" in msg
    assert "using torchrun" in msg and "SLURM_PROCID=9" in msg


def test_agreeing_launchers_do_not_warn(boot_log: pytest.LogCaptureFixture) -> None:
    detect({**SLURM, "PMI_RANK": "9", "PMI_SIZE": "11"})
    detect({**OMPI, "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert warnings_of(boot_log) == []


def test_missing_local_info_warns_only_for_several_ranks(boot_log: pytest.LogCaptureFixture) -> None:
    detect({"RANK": "0", "WORLD_SIZE": "1"})
    assert warnings_of(boot_log) == []
    detect({"RANK": "0", "WORLD_SIZE": "2"})
    [msg] = warnings_of(boot_log)
    assert "assuming all 2 ranks run on this host" in msg


def test_malformed_lower_launcher_only_warns(boot_log: pytest.LogCaptureFixture) -> None:
    info = detect({**OMPI, "SLURM_PROCID": "zero", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"})
    assert info.launcher == "openmpi"
    [msg] = warnings_of(boot_log)
    assert "ignoring slurm's variables" in msg and "SLURM_PROCID='zero'" in msg


ERROR_CASES = [
    ("non-integer rank", {**OMPI, "OMPI_COMM_WORLD_RANK": "three"}, {}, "OMPI_COMM_WORLD_RANK='three'"),
    ("empty variable", {"RANK": "", "WORLD_SIZE": "2"}, {}, "RANK=''"),
    ("rank >= size", {**MPICH, "PMI_RANK": "4"}, {}, "PMI_RANK=4"),
    ("negative rank", {**MPICH, "PMI_RANK": "-1"}, {}, "PMI_RANK=-1"),
    ("size 0", {"RANK": "0", "WORLD_SIZE": "0"}, {}, "WORLD_SIZE=0"),
    ("local rank >= local size", {**TORCH, "LOCAL_RANK": "4"}, {}, "LOCAL_RANK=4"),
    ("local size > size", {**TORCH, "LOCAL_WORLD_SIZE": "9"}, {}, "LOCAL_WORLD_SIZE=9"),
    ("rank without size", {"RANK": "0"}, {}, "WORLD_SIZE"),
    ("size without rank", {"OMPI_COMM_WORLD_SIZE": "2"}, {}, "OMPI_COMM_WORLD_RANK"),
    ("local rank without local size", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, {},
     "LOCAL_WORLD_SIZE"),
    ("local size without local rank", {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "2"}, {},
     "MPI_LOCALRANKID"),
    ("malformed tasks per node", {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "4(x2"}, {},
     "SLURM_STEP_TASKS_PER_NODE='4(x2'"),
    ("SLURM_NODEID out of range", {**SLURM, "SLURM_NODEID": "3"}, {}, "SLURM_NODEID=3"),
    ("SLURM_LOCALID without a usable tasks-per-node",
     {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"}, {},
     "SLURM_LOCALID"),
    ("bad MASTER_PORT", {**TORCH, "MASTER_PORT": "http"}, {}, "MASTER_PORT='http'"),
    ("MASTER_PORT out of range", {**TORCH, "MASTER_PORT": "70000"}, {}, "MASTER_PORT='70000'"),
    ("explicit rank out of range", {}, dict(rank=2, size=2), "rank=2"),
    ("explicit local size > size", {}, dict(rank=0, size=2, local_rank=0, local_size=3), "local_size=3"),
    ("explicit rank without size", {}, dict(rank=0), "rank= and size="),
    ("explicit local rank without local size", {}, dict(local_rank=0), "local_rank= and local_size="),
    ("explicit bool", {}, dict(rank=True, size=2), "rank= must be an int"),
    ("explicit str", {}, dict(rank="0", size=2), "rank= must be an int"),
]


@pytest.mark.parametrize("env,kwargs,needle", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_detect_errors(env: dict[str, str], kwargs: dict, needle: str) -> None:
    with pytest.raises(InvalidArgument) as exc_info:
        detect(env, **kwargs)
    assert needle in str(exc_info.value)


def test_detect_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        detect({}, world_size=2)  # type: ignore[call-arg]


@pytest.mark.parametrize("text,expected", [
    ("4", [4]), ("4(x2),3", [4, 4, 3]), ("1(x3)", [1, 1, 1]), (" 2 , 2 ", [2, 2]), ("2(x1),1(x2)", [2, 1, 1]),
])
def test_parse_tasks_per_node(text: str, expected: list[int]) -> None:
    assert bootstrap.parse_tasks_per_node(text) == expected


@pytest.mark.parametrize("text", ["", "x", "4(x)", "4(2)", "0", "4(x0)", "4,,3", "-1"])
def test_parse_tasks_per_node_rejects(text: str) -> None:
    with pytest.raises(InvalidArgument, match="SLURM_TASKS_PER_NODE"):
        bootstrap.parse_tasks_per_node(text)


# ------------------------------------------------------------------------------------------------
# job_key()

HEX16 = re.compile(r"[0-9a-f]{16}")


def key_of(env: dict[str, str], **p: object) -> str:
    return job_key(detect(env), params(**p), env)


def ranks_of(base: dict[str, str], rank_var: str, local_var: str, n: int) -> list[dict[str, str]]:
    return [{**base, rank_var: str(r), local_var: str(r % 2)} for r in range(n)]


@pytest.mark.parametrize("base,rank_var,local_var", [
    (TORCH, "RANK", "LOCAL_RANK"),
    (OMPI, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
    (SLURM, "SLURM_PROCID", "SLURM_LOCALID"),
], ids=["torchrun", "openmpi", "slurm"])
def test_job_key_equal_across_ranks(base: dict[str, str], rank_var: str, local_var: str) -> None:
    env = dict(base)
    if base is SLURM:  # two local ranks per node for this check
        env.update(SLURM_STEP_TASKS_PER_NODE="2(x4)", SLURM_NODEID="0", SLURM_STEP_NUM_TASKS="8",
                   SLURM_NTASKS="8")
    keys = {key_of(e) for e in ranks_of(env, rank_var, local_var, 2)}
    assert len(keys) == 1 and HEX16.fullmatch(keys.pop())


@pytest.mark.parametrize("env,change", [
    (TORCH, {"MASTER_PORT": "29501"}),
    (TORCH, {"MASTER_ADDR": "node1"}),
    (TORCH, {"TORCHELASTIC_RUN_ID": "other"}),
    (TORCH, {"TORCHELASTIC_RESTART_COUNT": "1"}),
    (OMPI, {"PMIX_NAMESPACE": "prterun-node1-4243@1"}),
    ({**OMPI, "PMIX_NAMESPACE": ""}, {"OMPI_MCA_ess_base_jobid": "123"}),
    (SLURM, {"SLURM_JOB_ID": "778"}),
    (SLURM, {"SLURM_STEP_ID": "1"}),
], ids=["master_port", "master_addr", "run_id", "restart", "pmix_ns", "ess_jobid", "slurm_job", "slurm_step"])
def test_job_key_differs_between_jobs(env: dict[str, str], change: dict[str, str]) -> None:
    assert key_of(env) != key_of({**env, **change})


def test_job_key_from_job_id_wins_and_is_launcher_independent() -> None:
    a = key_of(TORCH, JOB_ID="run-42")
    # both jobs span nodes (the host identity is mixed in), as does neither of the last two
    assert a == key_of(OMPI, JOB_ID="run-42")
    assert key_of({}, JOB_ID="run-42") == key_of({**MPICH, "MPI_LOCALNRANKS": "4"}, JOB_ID="run-42")
    assert a != key_of(TORCH, JOB_ID="run-43")
    assert a != key_of(TORCH)


def test_job_key_across_nodes_differs_per_host() -> None:
    """Two "nodes" of one job on one machine (network namespaces) must not share a socket path."""
    a = key_of(TORCH, JOB_ID="run-42", HOSTNAME="node-a")
    assert a != key_of(TORCH, JOB_ID="run-42", HOSTNAME="node-b")
    one = {**TORCH, "LOCAL_WORLD_SIZE": "8"}
    assert key_of(one, JOB_ID="run-42", HOSTNAME="node-a") == key_of(one, JOB_ID="run-42", HOSTNAME="node-b")


def test_job_key_mixes_in_the_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    a = key_of(TORCH, JOB_ID="x")
    monkeypatch.setattr(bootstrap.os, "getuid", lambda: 4242)
    assert key_of(TORCH, JOB_ID="x") != a


def test_job_key_singleton_is_per_process() -> None:
    mine = key_of({})
    assert mine == key_of({}) and HEX16.fullmatch(mine)
    code = ("from shmproxy.control import bootstrap; from shmproxy.core import params; "
            "print(bootstrap.job_key(bootstrap.detect({}), params.Params(env={}), {}))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           check=True, cwd=REPO).stdout.strip()
    assert HEX16.fullmatch(other) and other != mine


def test_job_key_falls_back_to_the_launcher_process() -> None:
    """Open MPI without a job id variable: the local daemon (our parent here) names the job."""
    env = {k: v for k, v in OMPI.items() if k != "PMIX_NAMESPACE"}
    assert key_of(env) == key_of(env)
    assert key_of(env) != key_of({**env, "PMIX_NAMESPACE": "ns"})


def test_job_key_mpich_ignores_a_stale_pmi_fd() -> None:
    """PMI_FD naming no socket of an ancestor falls back to the parent process, deterministically."""
    r, w = os.pipe()
    try:
        a = key_of({**MPICH, "PMI_FD": str(r)})
        assert a == key_of({**MPICH}) == key_of({**MPICH, "PMI_FD": "notanfd"})
    finally:
        os.close(r)
        os.close(w)


def test_job_key_explicit_needs_job_id() -> None:
    with pytest.raises(InvalidUsage, match="SHMPROXY_JOB_ID"):
        job_key(detect({}, rank=0, size=2), params(), {})
    assert HEX16.fullmatch(job_key(detect({}, rank=0, size=2), params(JOB_ID="j"), {}))
    assert HEX16.fullmatch(job_key(detect({}, rank=0, size=1), params(), {}))


# ------------------------------------------------------------------------------------------------
# host_identity()

def test_host_identity_is_stable() -> None:
    a = bootstrap.host_identity()
    assert a == bootstrap.host_identity()
    assert f"netns={os.stat('/proc/self/ns/net').st_ino}" in a
    assert bootstrap.host_identity(None) == a.rsplit("/shm=", 1)[0]


def test_host_identity_differs_across_network_namespaces() -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare(1) is not installed")
    code = "from shmproxy.control.bootstrap import host_identity; print(host_identity())"
    proc = subprocess.run([unshare, "--net", sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    if proc.returncode != 0 and "unshare" in proc.stderr:
        pytest.skip(f"cannot create a network namespace here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    other, mine = proc.stdout.strip(), bootstrap.host_identity()
    assert other != mine
    assert re.sub(r"netns=\d+", "", other) == re.sub(r"netns=\d+", "", mine)


# ------------------------------------------------------------------------------------------------
# run_dir()

def mode_of(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_run_dir_created_private(tmp_path: Path) -> None:
    path = run_dir(params(RUN_DIR=str(tmp_path / "a" / "b")), {})
    assert path == str(tmp_path / "a" / "b" / f"shmproxy-{os.getuid()}")
    assert mode_of(path) == 0o700
    assert run_dir(params(RUN_DIR=str(tmp_path / "a" / "b")), {}) == path  # idempotent


def test_run_dir_fixes_a_loose_mode(tmp_path: Path) -> None:
    target = tmp_path / f"shmproxy-{os.getuid()}"
    target.mkdir()
    os.chmod(target, 0o777)
    assert run_dir(params(RUN_DIR=str(tmp_path)), {}) == str(target)
    assert mode_of(target) == 0o700


def test_run_dir_refuses_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    (tmp_path / f"shmproxy-{os.getuid()}").symlink_to(real)
    with pytest.raises(InvalidUsage, match="symbolic link"):
        run_dir(params(RUN_DIR=str(tmp_path)), {})


def test_run_dir_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / f"shmproxy-{os.getuid()}").write_text("")
    with pytest.raises(InvalidUsage, match="not a directory"):
        run_dir(params(RUN_DIR=str(tmp_path)), {})


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to chown a directory to another user")
def test_run_dir_refuses_a_foreign_owner(tmp_path: Path) -> None:
    target = tmp_path / f"shmproxy-{os.getuid()}"
    target.mkdir(mode=0o700)
    os.chown(target, 12345, 12345)
    with pytest.raises(InvalidUsage, match="owned by uid 12345"):
        run_dir(params(RUN_DIR=str(tmp_path)), {})


def test_run_dir_must_be_absolute() -> None:
    with pytest.raises(InvalidArgument, match="absolute"):
        run_dir(params(RUN_DIR="relative/dir"), {})


def test_run_dir_uses_xdg_runtime_dir_when_it_exists(tmp_path: Path) -> None:
    assert run_dir(params(), {"XDG_RUNTIME_DIR": str(tmp_path)}) == str(tmp_path / f"shmproxy-{os.getuid()}")
    missing = str(tmp_path / "missing")
    default = f"/tmp/shmproxy-{os.getuid()}"
    existed = os.path.lexists(default)
    try:
        assert run_dir(params(), {"XDG_RUNTIME_DIR": missing}) == default
        assert run_dir(params(), {"XDG_RUNTIME_DIR": "relative"}) == default
        assert not os.path.exists(missing)
    finally:
        if not existed and os.path.isdir(default) and not os.listdir(default):
            os.rmdir(default)


# ------------------------------------------------------------------------------------------------
# service_path(), the multi-node seam

KEY = "0123456789abcdef"


def test_service_path_format() -> None:
    rundir = "/run/user/1000/shmproxy-1000"
    assert service_path(rundir, KEY, 3) == f"{rundir}/{KEY}-c3.sock"


def test_service_path_length_limit() -> None:
    tail = len(f"/{KEY}-c7.sock")
    ok = "/" + "d" * (bootstrap.SUN_PATH_MAX - tail - 1)
    assert len(service_path(ok, KEY, 7)) == bootstrap.SUN_PATH_MAX
    with pytest.raises(InvalidArgument, match="SHMPROXY_RUN_DIR") as exc_info:
        service_path(ok + "d", KEY, 7)
    assert "108 bytes" in str(exc_info.value)


def test_service_path_counts_bytes_not_characters() -> None:
    tail = len(f"/{KEY}-c0.sock")
    with pytest.raises(InvalidArgument, match="SHMPROXY_RUN_DIR"):
        service_path("/" + "é" * (bootstrap.SUN_PATH_MAX - tail - 1), KEY, 0)  # 2 bytes each


@pytest.mark.parametrize("key,comm_id", [("../../etc/passwd", 0), (KEY.upper(), 0), (KEY[:-1], 0),
                                         (KEY, -1), (KEY, True), (KEY, "0")])
def test_service_path_rejects_bad_input(key: str, comm_id: object) -> None:
    with pytest.raises(InvalidArgument):
        service_path("/tmp", key, comm_id)  # type: ignore[arg-type]


def test_spans_nodes() -> None:
    assert not bootstrap.spans_nodes(detect(TORCH, local_rank=1, local_size=8))
    assert bootstrap.spans_nodes(detect(TORCH))


# ------------------------------------------------------------------------------------------------
# Under a real launcher

# Each rank writes its row to a file of its own: lines printed by two ranks at once can reach
# mpiexec's merged stdout interleaved.
RANK_SCRIPT = """
import dataclasses, json, os
from shmproxy.control import bootstrap
from shmproxy.core import params
info = bootstrap.detect()
row = json.dumps({"info": dataclasses.asdict(info), "ppid": os.getppid(),
                  "key": bootstrap.job_key(info, params.Params()),
                  "host": bootstrap.host_identity()})
with open(os.path.join(os.environ["ROWS_DIR"], f"{os.getpid()}.json"), "w") as f:
    f.write(row)
"""


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_NAMES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_mpiexec(mpiexec: str, argv: list[str], env: dict[str, str], cwd: Path) -> list[dict]:
    rows_dir = Path(tempfile.mkdtemp(prefix="rows-", dir=cwd))
    proc = subprocess.run([mpiexec, "-n", "2", *argv], capture_output=True, text=True, timeout=60,
                          env={**env, "ROWS_DIR": str(rows_dir)}, cwd=cwd)
    assert proc.returncode == 0, f"mpiexec failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    rows = [json.loads(f.read_text()) for f in sorted(rows_dir.iterdir())]
    assert len(rows) == 2, proc.stdout + proc.stderr
    return sorted(rows, key=lambda row: row["info"]["rank"])


@pytest.mark.launcher
def test_under_mpiexec(tmp_path: Path) -> None:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    env = clean_env()
    direct = run_mpiexec(mpiexec, [sys.executable, "-c", RANK_SCRIPT], env, tmp_path)
    # Each rank behind its own shell: the ranks' parents differ, the PMI_FD peer (the proxy) does not.
    wrapped = run_mpiexec(mpiexec, ["sh", "-c", '"$PY" -c "$SCRIPT"; exit $?'],
                          {**env, "PY": sys.executable, "SCRIPT": RANK_SCRIPT}, tmp_path)
    for rows in (direct, wrapped):
        assert [r["info"]["rank"] for r in rows] == [0, 1]
        assert {(r["info"]["size"], r["info"]["local_size"], r["info"]["launcher"]) for r in rows} == {
            (2, 2, "mpich")}
        assert [r["info"]["local_rank"] for r in rows] == [0, 1]
        assert rows[0]["key"] == rows[1]["key"] and HEX16.fullmatch(rows[0]["key"])
        assert rows[0]["host"] == rows[1]["host"]
    assert wrapped[0]["ppid"] != wrapped[1]["ppid"]
    assert direct[0]["key"] != wrapped[0]["key"]  # two jobs, two keys


def test_sweep_removes_only_old_service_sockets_nobody_listens_on(tmp_path: Path) -> None:
    """What a kill -9 of every process of a job leaves (its socket file) is removed by the next start,
    once it is old and refuses connections; a live server's socket, a fresh one, and anything that is
    not a service socket stay."""
    import socket
    import time

    def sock(name: str, listen: bool, age_s: float) -> tuple[str, socket.socket]:
        path = str(tmp_path / name)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        if listen:
            s.listen(1)
        t = time.time() - age_s
        os.utime(path, (t, t))
        return path, s

    dead, d = sock("0123456789abcdef-c0.sock", False, 600)
    live, l_ = sock("fedcba9876543210-c1.sock", True, 600)
    fresh, f = sock("00112233445566ff-c0.sock", False, 1)
    other, o = sock("not-ours.sock", False, 600)
    plain = tmp_path / "aaaaaaaaaaaaaaaa-c0.sock"   # our name, but a regular file
    dump = tmp_path / "0123456789abcdef-c0-123.dump.json"
    plain.write_text("x")
    dump.write_text("{}")
    old = time.time() - 600
    os.utime(plain, (old, old))
    os.utime(dump, (old, old))
    try:
        assert bootstrap.sweep_stale_sockets(str(tmp_path)) == [dead]
        assert not os.path.exists(dead)
        assert all(os.path.exists(p) for p in (live, fresh, other, plain, dump))
        assert bootstrap.sweep_stale_sockets(str(tmp_path / "missing")) == []
    finally:
        for s in (d, l_, f, o):
            s.close()


def test_sweep_removes_only_old_pools_whose_progress_process_is_gone(tmp_path: Path) -> None:
    """A job killed outright as its progress process created the ops pool leaves the pool's name; the next
    start removes it once it is old and the progress process its header names is gone (or its pid now
    belongs to another program). A pool of a live progress process, a fresh one, and anything that is
    not a pool stay."""
    import struct
    import subprocess
    import sys
    import time

    from shmproxy.shm import pool as P

    def fake_pool(name: str, pid: int, age_s: float, magic: int = P.MAGIC) -> str:
        path = str(tmp_path / name)
        head = bytearray(4096)
        struct.pack_into("<Q", head, 0, magic)
        struct.pack_into("<Q", head, P.CTRL_OFF + 8 * P.CTRL_PROXY_PID, pid)
        with open(path, "wb") as f:
            f.write(head)
        t = time.time() - age_s
        os.utime(path, (t, t))
        return path

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()   # a pid that no process has now
    progress = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)",
                                 "-m", "shmproxy.engine.progress"], stdout=subprocess.PIPE, text=True)
    assert progress.stdout is not None and progress.stdout.readline() == "up\n"   # its cmdline is its own now
    try:
        dead = fake_pool("shmproxy-0123abcd-c0-89abcdef", gone.pid, 600)
        reused = fake_pool("shmproxy-0123abcd-c1-89abcdef", os.getpid(), 600)   # not a progress process
        live = fake_pool("shmproxy-0123abcd-c2-89abcdef", progress.pid, 600)
        fresh = fake_pool("shmproxy-0123abcd-c3-89abcdef", gone.pid, 1)
        other = fake_pool("shmproxy-buf-0123", gone.pid, 600)
        foreign = fake_pool("shmproxy-0123abcd-c4-89abcdef", gone.pid, 600, magic=7)
        assert sorted(bootstrap.sweep_stale_pools(str(tmp_path))) == sorted([dead, reused])
        assert all(os.path.exists(p) for p in (live, fresh, other, foreign))
        assert bootstrap.sweep_stale_pools(str(tmp_path / "missing")) == []
    finally:
        progress.kill()
        progress.communicate()
