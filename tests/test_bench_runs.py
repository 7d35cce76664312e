"""Tests of shmproxy-bench that run the real thing: the tool launched under mpiexec (skipped without
mpiexec or mpi4py) or torchrun (skipped without torch), checked through its JSON report and its output.
Each launched job gets its own SHMPROXY_JOB_ID, so it never meets another job's progress process, and
afterwards no process carrying that id may be left.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from shmproxy.tools import bench


REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT = 120


# ---------------------------------------------------------------- under mpiexec

needs_mpi = pytest.mark.skipif(shutil.which("mpiexec") is None or importlib.util.find_spec("mpi4py") is None,
                               reason="needs mpiexec and mpi4py")


def _launch(tmp_path: Path, *argv: str, nranks: int = 2) -> tuple[subprocess.CompletedProcess[str], str]:
    job = str(uuid.uuid4())
    env = dict(os.environ, SHMPROXY_JOB_ID=job)
    cmd = ["mpiexec", "-n", str(nranks), sys.executable, "-m", "shmproxy.tools.bench", *argv]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    return proc, job


def _processes_of_job(job: str) -> list[int]:
    """Processes (progress processes included: they inherit the environment) still carrying ``job``."""
    needle = f"SHMPROXY_JOB_ID={job}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue                                       # gone, or not ours to read
    return found


@pytest.mark.launcher
@pytest.mark.slow
@needs_mpi
def test_pingpong_against_mpi4py(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc, job = _launch(tmp_path, "pingpong", "-b", "8", "-e", "4096", "-f", "8", "-n", "20", "-w", "5",
                        "--peers", "mpi4py", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _processes_of_job(job) == []
    report = json.loads(out.read_text())
    assert bench.validate_report(report) == []
    assert report["ok"] is True and report["libraries"] == ["shmproxy", "shmproxy:alloc", "mpi4py"]
    assert [row["bytes"] for row in report["results"]] == [8, 64, 512, 4096]
    for row in report["results"]:
        assert row["iters"] == 20 and row["warmup"] == 5
        for lib in ("shmproxy", "shmproxy:alloc", "mpi4py"):
            r = row["results"][lib]
            assert r["time_us"] > 0 and r["p99_us"] >= r["time_us"] and r["busbw_GBps"] > 0
            assert r["check"] == "ok"
        assert set(row["ratio"]) == {"mpi4py"} and row["ratio"]["mpi4py"] > 0   # against plain arrays
    env = report["environment"]
    assert env["ranks"] == 2 and env["launcher"] == "mpich" and env["params"]["CHUNK_SIZE"]["value"] > 0
    assert "shmproxy.tools.bench" in env["command"] and report["config"]["shmproxy_buffers"] == "plain+alloc"
    lines = proc.stdout.splitlines()
    assert sum(1 for line in lines if line.rstrip().endswith(" ok")) == 4
    assert any(line.startswith("# shmproxy buffers: plain numpy arrays as the peers'") for line in lines)
    assert "# checks: all passed" in lines


@pytest.mark.launcher
@pytest.mark.slow
@needs_mpi
def test_failed_check_exits_non_zero(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc, job = _launch(tmp_path, "pingpong", "-b", "8", "-e", "64", "-n", "5", "-w", "1",
                        "--peers", "mpi4py", "--inject-error", "--json", str(out))
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert _processes_of_job(job) == []
    assert "FAIL:shmproxy" in proc.stdout and "1 FAILED" in proc.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is False
    first, *rest = report["results"]
    assert first["results"]["shmproxy"]["check"] == "FAIL" and first["results"]["mpi4py"]["check"] == "ok"
    assert all(r["check"] == "ok" for row in rest for r in row["results"].values())


@pytest.mark.launcher
@pytest.mark.slow
@needs_mpi
def test_allreduce_against_mpi4py(tmp_path: Path) -> None:
    out = tmp_path / "allreduce.json"
    proc, job = _launch(tmp_path, "allreduce", "-b", "8", "-e", "1M", "-f", "32", "-n", "10", "-w", "2",
                        "--rounds", "3", "--peers", "mpi4py", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _processes_of_job(job) == []
    report = json.loads(out.read_text())
    assert bench.validate_report(report) == []
    assert report["ok"] is True and report["libraries"] == ["shmproxy", "shmproxy:alloc", "mpi4py"]
    assert report["bus_factor"] == "2(n-1)/n" and report["config"]["redop"] == "sum"
    assert [row["bytes"] for row in report["results"]] == [8, 256, 8192, 262144, 1 << 20]
    assert report["config"]["rounds"] == 3
    for row in report["results"]:
        # -n 10 in 3 rounds: 4 iterations per round, 12 in all
        assert row["iters"] == 12 and row["warmup"] == 2 and row["count"] == row["bytes"] // 4
        for lib in ("shmproxy", "shmproxy:alloc", "mpi4py"):
            r = row["results"][lib]
            assert r["time_us"] > 0 and r["busbw_GBps"] > 0 and r["check"] == "ok"
            assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])      # 2(n-1)/n = 1 at 2 ranks
            assert r["steal_pct"] is None or 0 <= r["steal_pct"] <= 100
    lines = proc.stdout.splitlines()
    assert "# checks: all passed" in lines
    assert any(line.startswith("# rounds: each library's iterations ran as 3 interleaved slices") for line in lines)
    # The steal line sums what the report holds: it is there exactly when some measurement spanned a clock
    # tick of /proc/stat (10 ms; a fast run may span none), and never where the host reports no ticks.
    known = [row["results"][lib]["steal_pct"] for row in report["results"] for lib in row["results"]
             if row["results"][lib]["steal_pct"] is not None]
    assert any(line.startswith("# steal") for line in lines) == bool(known)
    assert bench.cpu_ticks() is not None or not known


@pytest.mark.launcher
@pytest.mark.slow
@needs_mpi
def test_overlap_against_mpi4py(tmp_path: Path) -> None:
    out = tmp_path / "overlap.json"
    proc, job = _launch(tmp_path, "overlap", "-b", "64K", "-e", "256K", "-f", "4", "-n", "5", "-w", "1",
                        "--peers", "mpi4py", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _processes_of_job(job) == []
    report = json.loads(out.read_text())
    assert bench.validate_report(report) == []
    assert report["ok"] is True and report["libraries"] == ["shmproxy", "shmproxy:alloc", "mpi4py"]
    assert [c["key"] for c in report["columns"]] == ["t_comm_us", "t_compute_us", "t_total_us", "work_slowdown",
                                                     "post_us", "wait_us", "overlap_pct"]
    assert [row["bytes"] for row in report["results"]] == [64 << 10, 256 << 10]
    for row in report["results"]:
        for lib in ("shmproxy", "mpi4py"):
            r = row["results"][lib]
            assert r["t_comm_us"] > 0 and r["t_compute_us"] > 0 and r["t_total_us"] > 0
            assert r["work_slowdown"] > 0
            # what was not hidden is the post and the wait after the work, no more, no less
            assert r["post_us"] > 0 and r["wait_us"] > 0
            assert r["post_us"] + r["wait_us"] == pytest.approx(r["t_total_us"] - r["t_compute_us"], abs=0.01)
            # the work ran for t_comm of wall time (OSU), at least; means over iterations and ranks
            assert r["t_compute_us"] >= 0.999 * r["t_comm_us"]
            assert 0.0 <= r["overlap_pct"] <= 100.0
            assert r["overlap_pct"] == pytest.approx(bench.overlap_percent(
                r["t_comm_us"], r["t_compute_us"], r["t_total_us"]))
            assert len(r["ranks"]["overlap_pct"]) == 2 and r["check"] == "ok"
    assert "overlap (OSU osu_iallreduce)" in proc.stdout


@pytest.mark.launcher
@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("argv", [
    ["allreduce"], ["allreduce", "--in-place", "--no-alloc"], ["reduce", "--op", "max", "--dtype", "int32"],
    ["bcast"], ["allgather", "--in-place"], ["reduce_scatter", "--op", "prod"],
    ["reduce_scatter", "--in-place"],
    ["alltoall", "--no-alloc"], ["barrier"],
])
def test_every_collective_at_three_ranks(tmp_path: Path, argv: list[str]) -> None:
    """Uneven blocks (3 ranks), every peer that can be opened; every check must pass."""
    out = tmp_path / "coll.json"
    proc, job = _launch(tmp_path, *argv, "-b", "8", "-e", "4K", "-f", "16", "-n", "3", "-w", "1",
                        "--peers", "mpi4py,gloo", "--json", str(out), nranks=3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _processes_of_job(job) == []
    report = json.loads(out.read_text())
    assert bench.validate_report(report) == [] and report["ok"] is True
    assert "mpi4py" in report["libraries"]
    if argv == ["reduce_scatter", "--in-place"] and importlib.util.find_spec("torch") is not None:
        assert "gloo" not in report["libraries"] and "in-place" in report["skipped"]["gloo"]
    for row in report["results"]:
        assert all(r["check"] == "ok" and r["time_us"] > 0 for r in row["results"].values())
    if argv == ["barrier"]:
        assert [row["bytes"] for row in report["results"]] == [0]
    else:
        assert all(row["bytes"] > 0 for row in report["results"])


@pytest.mark.launcher
@pytest.mark.slow
@needs_mpi
def test_nccl_on_host_buffers_is_skipped_saying_why(tmp_path: Path) -> None:
    """NCCL takes device buffers only: on host buffers the run goes on without it and says why, on
    every rank alike (no rank waits in a torch rendezvous the others never enter)."""
    out = tmp_path / "bench.json"
    proc, job = _launch(tmp_path, "allreduce", "-b", "8", "-e", "64", "-f", "8", "-n", "5", "-w", "1",
                        "--peers", "nccl,mpi4py", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _processes_of_job(job) == []
    assert "# nccl skipped: nccl takes device buffers only (run with --device cuda)" in proc.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["libraries"] == ["shmproxy", "shmproxy:alloc", "mpi4py"]
    assert "device buffers only" in report["skipped"]["nccl"]


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (torchrun)")
def test_allreduce_under_torchrun_against_gloo(tmp_path: Path) -> None:
    """The tool runs under torchrun like any rank program; gloo rendezvouses through torchrun's env."""
    import socket
    out = tmp_path / "bench.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = str(uuid.uuid4())
    env = dict(os.environ, SHMPROXY_JOB_ID=job)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "shmproxy.tools.bench", "allreduce", "-b", "8", "-e", "4096", "-f", "64", "-n", "10", "-w", "2",
           "--peers", "gloo", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _processes_of_job(job) == []
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["libraries"] == ["shmproxy", "shmproxy:alloc", "gloo"]
    assert all(row["results"]["gloo"]["check"] == "ok" for row in report["results"])
