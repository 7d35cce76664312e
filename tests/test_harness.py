"""Tests of the multi-rank harness (tests/harness.py, tests/rankmain.py) and of the leak guard.

The rank bodies are in tests/bodies_harness.py (``tests.bodies_harness:body_ok``): they do not need
shmproxy.init(), so the harness is tested by itself.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.harness import (LeakGuard, RunResult, default_proxy_timeout, launch_mpiexec, launch_torchrun,
                           kill_marked, run_ranks)
from tests.bodies_harness import STANDIN

HERE = "tests.bodies_harness"


# ------------------------------------------------------------------------------------------------
# Helpers


def _dead(pid: int, created: float | None = None) -> bool:
    """True if ``pid`` is gone (or a zombie, or a different process than the one created at ``created``)."""
    try:
        p = psutil.Process(pid)
        if created is not None and abs(p.create_time() - created) > 0.5:
            return True
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ------------------------------------------------------------------------------------------------
# run_ranks: success


def test_all_ranks_succeed_and_results_arrive() -> None:
    res = run_ranks(f"{HERE}:body_ok", 3, timeout=60, args=(1, "two"))
    assert isinstance(res, RunResult)
    assert res.returncodes == [0, 0, 0]
    assert [r["rank"] for r in res.results] == [0, 1, 2]
    assert [r["pid"] for r in res.results] == res.pids
    assert all(r["args"] == [1, "two"] for r in res.results)
    assert all(r["cwd"] == str(Path(__file__).resolve().parents[1]) for r in res.results)
    # one fresh job id per run, the same on every rank; SHMPROXY_TIMEOUT below the deadline
    assert len({r["job"] for r in res.results}) == 1 and res.results[0]["job"]
    assert float(res.results[0]["timeout"]) == default_proxy_timeout(60) < 60
    again = run_ranks(f"{HERE}:body_ok", 1, timeout=60)
    assert again.results[0]["job"] != res.results[0]["job"]


def test_none_result_and_output_capture() -> None:
    res = run_ranks(f"{HERE}:body_none", 2, timeout=60)
    assert res.results == [None, None]
    for r in range(2):
        assert res.stdout[r] == f"stdout of rank {r}\n"
        assert res.stderr[r] == f"stderr of rank {r}\n"


def test_kwargs_and_env_overrides() -> None:
    res = run_ranks(f"{HERE}:body_kwargs", 1, timeout=60, args={"a": 5, "b": "y"})
    assert res.results == [[5, "y"]]
    res = run_ranks(f"{HERE}:body_ok", 2, timeout=60, env={"SHMPROXY_TIMEOUT": "7", "MY_VAR": "v"})
    assert [r["timeout"] for r in res.results] == ["7", "7"]
    assert [r["my_var"] for r in res.results] == ["v", "v"]


def test_big_output_does_not_deadlock() -> None:
    res = run_ranks(f"{HERE}:body_big_output", 2, timeout=60, args=(4 << 20,))
    assert res.results == [4 << 20] * 2
    assert all(len(out) == 4 << 20 for out in res.stdout)


def test_harness_env_passes_params_validation() -> None:
    res = run_ranks(f"{HERE}:body_params", 2, timeout=40)
    assert res.results[0] == res.results[1]
    assert res.results[0][0] == default_proxy_timeout(40)


@pytest.mark.parametrize("launcher,name", [("env", "torchrun"), ("ompi", "openmpi"), ("pmi", "mpich"),
                                           ("slurm", "slurm")])
def test_simulated_launchers_are_detected(launcher: str, name: str) -> None:
    res = run_ranks(f"{HERE}:body_detect", 2, timeout=60, launcher=launcher)
    assert [r[:4] for r in res.results] == [[0, 2, 0, 2], [1, 2, 1, 2]]
    assert [r[4] for r in res.results] == [name, name]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="module:function"):
        run_ranks("tests.test_harness.body_ok", 1)
    with pytest.raises(ValueError, match="nranks"):
        run_ranks(f"{HERE}:body_ok", 0)
    with pytest.raises(ValueError, match="out of range"):
        run_ranks(f"{HERE}:body_ok", 2, expect_fail={2})
    with pytest.raises(ValueError, match="launcher"):
        run_ranks(f"{HERE}:body_ok", 1, launcher="srun")


# ------------------------------------------------------------------------------------------------
# run_ranks: failures


def test_failing_rank_kills_the_others_promptly() -> None:
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(f"{HERE}:body_raise_on", 3, timeout=60, args=(1,))
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert elapsed < 20, f"took {elapsed:.1f}s: the hanging ranks were not killed promptly"
    assert "rank 1 failed with exit code 1" in msg
    assert "RuntimeError: boom from rank 1" in msg and "Traceback" in msg
    for r in (0, 2):
        assert f"=== rank {r}: exit code -9 (SIGKILL) (killed by the harness)" in msg


def test_unknown_target_reports_the_import_error() -> None:
    with pytest.raises(AssertionError, match="(?s)AttributeError.*no_such_body"):
        run_ranks(f"{HERE}:no_such_body", 1, timeout=60)
    with pytest.raises(AssertionError, match="ModuleNotFoundError"):
        run_ranks("tests.no_such_module:f", 1, timeout=60)


def test_deadline_kills_everything_and_shows_the_stacks() -> None:
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(f"{HERE}:body_hang", 2, timeout=4)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert 4 <= elapsed < 15
    assert "the deadline was reached; still running: ranks [0, 1]" in msg
    for r in (0, 1):
        assert f"=== rank {r}: exit code -9 (SIGKILL) (killed by the harness)" in msg
    # faulthandler.dump_traceback_later fired in each rank before the kill
    assert msg.count("in _hang") == 2, msg
    assert msg.count("in body_hang") == 2, msg


def test_expect_fail() -> None:
    res = run_ranks(f"{HERE}:body_exit", 3, timeout=60, args=({"1": 3},), expect_fail={1})
    assert res.returncodes == [0, 3, 0]
    assert res.results == ["done", None, "done"]
    # strict: an expected failure that does not happen is an error
    with pytest.raises(AssertionError, match=r"ranks \[1\] were expected to fail"):
        run_ranks(f"{HERE}:body_exit", 2, timeout=60, args=({},), expect_fail={1})
    # an unexpected failure still is one
    with pytest.raises(AssertionError, match="rank 0 failed with exit code 4"):
        run_ranks(f"{HERE}:body_exit", 2, timeout=60, args=({"0": 4, "1": 3},), expect_fail={1})


@pytest.mark.parametrize("new_session", [False, True], ids=["same-group", "own-session"])
def test_children_of_ranks_are_killed(tmp_path: Path, new_session: bool) -> None:
    """A rank's child (the progress process) dies with the job: by process group, or by run marker
    when it left the group (setsid), as torchrun's workers do."""
    with pytest.raises(AssertionError, match="rank failed while its child runs"):
        run_ranks(f"{HERE}:body_spawn_child", 2, timeout=60, args=(str(tmp_path), new_session, 1))
    pids = [int((tmp_path / f"child.{r}").read_text()) for r in range(2)
            if (tmp_path / f"child.{r}").exists()]
    assert pids, "no child was started"
    assert all(_dead(pid) for pid in pids), [psutil.Process(p).cmdline() for p in pids if not _dead(p)]


def test_works_without_pidfd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels before 5.3 have no pidfd: the harness then waits in bounded slices."""
    monkeypatch.delattr(os, "pidfd_open")
    assert run_ranks(f"{HERE}:body_ok", 2, timeout=60).returncodes == [0, 0]
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="rank 0 failed with exit code 1"):
        run_ranks(f"{HERE}:body_raise_on", 2, timeout=60, args=(0,))
    assert time.monotonic() - t0 < 20


# ------------------------------------------------------------------------------------------------
# Real launchers


@pytest.mark.launcher
def test_mpiexec_two_ranks() -> None:
    res = launch_mpiexec(f"{HERE}:body_ok", 2, timeout=90, args=("m",))
    assert [r["rank"] for r in res.results] == [0, 1]
    assert res.returncodes == [0, 0] and res.launcher_returncode == 0
    assert [r["pid"] for r in res.results] == res.pids
    assert len({r["job"] for r in res.results}) == 1


@pytest.mark.launcher
def test_mpiexec_failure_and_expect_fail() -> None:
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(f"{HERE}:body_raise_on", 2, timeout=90, args=(0,), launcher="mpiexec")
    assert time.monotonic() - t0 < 45
    assert "RuntimeError: boom from rank 0" in str(info.value)
    res = run_ranks(f"{HERE}:body_exit", 2, timeout=90, args=({"1": 3},), expect_fail={1}, launcher="mpiexec")
    assert res.returncodes == [0, 3] and res.results == ["done", None]


@pytest.mark.launcher
@pytest.mark.slow
def test_torchrun_two_ranks() -> None:
    res = launch_torchrun(f"{HERE}:body_ok", 2, timeout=120)
    assert [r["rank"] for r in res.results] == [0, 1]
    assert res.returncodes == [0, 0] and res.launcher_returncode == 0


@pytest.mark.launcher
def test_launcher_deadline_kills_the_launcher_and_its_ranks() -> None:
    with pytest.raises(AssertionError) as info:
        launch_mpiexec(f"{HERE}:body_hang", 2, timeout=8)
    msg = str(info.value)
    assert "deadline" in msg
    pids = [int(p) for p in re.findall(r"=== rank \d: exit code [^\n]*, pid (\d+)", msg)]
    assert len(pids) == 2
    assert all(_dead(p) for p in pids), [psutil.Process(p).as_dict(["status", "ppid", "cmdline"])
                                         for p in pids if not _dead(p)]


# ------------------------------------------------------------------------------------------------
# LeakGuard (the autouse fixture's logic); each test cleans up after itself


def test_leakguard_clean_when_nothing_is_left(tmp_path: Path) -> None:
    guard = LeakGuard(dirs=[str(tmp_path)])
    guard.snapshot()
    assert guard.check() == []


def test_leakguard_segment_is_reported_and_unlinked(tmp_path: Path) -> None:
    guard = LeakGuard(dirs=[str(tmp_path)])
    guard.snapshot()
    path = Path("/dev/shm") / f"shmproxy-sptest-{uuid.uuid4().hex[:8]}"
    path.write_bytes(b"\0" * 64)
    try:
        leaks = guard.check()
    finally:
        path.unlink(missing_ok=True)
    assert leaks == [f"shm segment {path} left behind, unlinked"]


def test_leakguard_socket_is_reported_and_unlinked(tmp_path: Path) -> None:
    guard = LeakGuard(dirs=[str(tmp_path)])
    guard.snapshot()
    path = tmp_path / "0123456789abcdef-c0.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))  # closed without unlink: what a SIGKILLed service leaves
    (tmp_path / "not-a-socket.txt").write_text("ignored")
    leaks = guard.check()
    assert leaks == [f"socket {path} left behind, unlinked"]
    assert not path.exists()


def _until_execed(pid: int) -> None:
    """Until ``pid`` runs the stand-in: between fork and exec it still shows pytest's command line,
    which the guard rightly does not take for ours (a loaded machine once checked in that window)."""
    deadline = time.monotonic() + 10
    while "shmproxy.engine.progress" not in " ".join(psutil.Process(pid).cmdline()):
        assert time.monotonic() < deadline, "the stand-in never started"
        time.sleep(0.01)


def test_leakguard_process_is_killed_and_reported(tmp_path: Path) -> None:
    guard = LeakGuard(dirs=[str(tmp_path)], grace=0.5)
    guard.snapshot()
    child = subprocess.Popen(STANDIN, stdin=subprocess.DEVNULL)
    try:
        _until_execed(child.pid)
        leaks = guard.check()
        assert len(leaks) == 1 and f"process {child.pid} still running" in leaks[0], leaks
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()


def test_leakguard_grace_lets_exiting_processes_go(tmp_path: Path) -> None:
    guard = LeakGuard(dirs=[str(tmp_path)], grace=10)
    guard.snapshot()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "shmproxy.engine.progress-standin"],
                             stdin=subprocess.PIPE)
    try:
        assert child.stdin is not None
        child.stdin.close()  # the child exits on EOF, while check() waits
        t0 = time.monotonic()
        assert guard.check() == []
        assert time.monotonic() - t0 < 10
    finally:
        child.kill()
        child.wait()


def _orphan(env: dict[str, str]) -> int:
    """Start a STANDIN whose parent exits at once (so it is reparented, no longer our descendant)."""
    code = ("import subprocess, sys, json; p = subprocess.Popen(json.loads(sys.argv[1]), "
            "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, "
            "start_new_session=True); print(p.pid)")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(STANDIN)], env=env, check=True,
                         capture_output=True, text=True, timeout=60)
    return int(out.stdout)


def test_leakguard_orphans_are_ours_by_marker_only(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPTEST_")}
    base["SPTEST_RUN_ID"] = marker  # for the cleanup below
    guard = LeakGuard(dirs=[str(tmp_path)], grace=0.5)
    guard.snapshot()
    try:
        foreign = _orphan(base)  # another session's: no SPTEST_OWNER of ours
        ours = _orphan({**base, "SPTEST_OWNER": str(os.getpid())})
        leaks = guard.check()
        assert len(leaks) == 1 and f"process {ours} still running" in leaks[0], leaks
        assert not _dead(foreign)
    finally:
        kill_marked(marker)
    assert _dead(foreign) and _dead(ours)


def test_leak_guard_removes_and_reports_dumps(tmp_path):
    """A dump file that appears in a run directory during a test is a leak: reported, one line each,
    and removed; one there before the test is not."""
    old = tmp_path / "k-c0-1.dump.json"
    old.write_bytes(b"")
    guard = LeakGuard(shm_dir=str(tmp_path / "shm"), dirs=[str(tmp_path)])
    guard.snapshot()
    new = [tmp_path / "k-c0-7.dump.json", tmp_path / "k-c1-7.dump.json"]
    for p in new:
        p.write_bytes(b"")
    leaks = guard.check()
    assert sorted(leaks) == sorted(f"dump file {p} left in the run directory, removed" for p in new), leaks
    assert not any(p.exists() for p in new) and old.exists()
