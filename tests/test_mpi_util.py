"""shmproxy.util (pkl5, dtlib, sync, pool), shmproxy.futures and ``python -m shmproxy`` in real rank
processes (bodies in tests/bodies_mpi_util.py), and under MPICH's mpiexec where a launcher is what
is being tested (``python -m shmproxy.futures``, ``python -m shmproxy``)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from tests.harness import REPO, run_ranks


def test_pkl5_point_to_point_and_collectives():
    res = run_ranks("tests.bodies_mpi_util:pkl5_roundtrip", 3, timeout=120)
    assert [r["ok"] for r in res.results] == [True] * 3


def test_pkl5_duplicate_is_freed_with_its_comm_never_by_the_garbage_collector():
    res = run_ranks("tests.bodies_mpi_util:pkl5_duplicate_lives_and_dies_with_its_comm", 4, timeout=120)
    assert res.results == [True] * 4


def test_dtlib_round_trips():
    res = run_ranks("tests.bodies_mpi_util:dtlib_roundtrip", 1, timeout=60)
    assert len(res.results[0]) == 6


@pytest.mark.slow
def test_sync_counter_mutex_condition_semaphore_sequential():
    res = run_ranks("tests.bodies_mpi_util:sync_objects", 3, timeout=180)
    assert sorted(r["rank"] for r in res.results) == [0, 1, 2]


def test_comm_executor_runs_tasks_on_the_other_ranks():
    res = run_ranks("tests.bodies_mpi_util:comm_executor", 3, timeout=120)
    assert res.results[1]["pids"] == 2
    assert [r["after"] for r in res.results] == [3, 3, 3]


def test_thread_pool():
    res = run_ranks("tests.bodies_mpi_util:pool_threads", 1, timeout=60)
    assert res.results[0] == [[x * x for x in range(10)], [0, 1, 4, 9, 16], [4, 27], [0, 1, 4, 9]]


def _mpiexec(args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    exe = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(exe):
        pytest.skip("mpiexec is not installed (pip install 'shmproxy[mpi]')")
    env = dict(os.environ, SHMPROXY_JOB_ID=uuid.uuid4().hex, SHMPROXY_TIMEOUT="120")
    t0 = time.monotonic()
    out = subprocess.run([exe, "-n", "3", sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return out, time.monotonic() - t0


@pytest.mark.launcher
def test_futures_main_runs_a_script_with_a_pool_of_ranks():
    out, _ = _mpiexec(["-m", "shmproxy.futures", "tests/futures_script_mpi_util.py", "x", "y"], 120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FUTURES-OK 2 x y" in out.stdout


@pytest.mark.launcher
def test_shmproxy_main_aborts_every_rank_when_one_raises():
    out, took = _mpiexec(["-m", "shmproxy", "tests/abort_script_mpi_util.py"], 90)
    assert out.returncode != 0
    assert "rank 1 fails on purpose" in out.stderr
    assert took < 30, f"the job took {took:.1f} s to end after rank 1 raised"
