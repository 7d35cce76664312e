"""The CUDA driver leaves a file per process in /dev/shm for its interprocess events (cuda.shm.<n>.<pid
in hex>.<n>); shmproxy removes those of its ranks (transports/cuda_driver.py). Which files that
removal takes needs no GPU: the driver's names are made here for processes that exist and that do not.
The removal on a GPU, at a rank's exit and after a rank's kill -9, is checked by every GPU test
(tests/harness_leaks.py counts a new cuda.shm file as a leak)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shmproxy.control import bootstrap
from shmproxy.core.process import alive
from shmproxy.transports import cuda_driver

pytestmark = pytest.mark.skipif(not os.path.isdir(cuda_driver.SHM_DIR), reason="no /dev/shm on this host")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _touch(name: str) -> str:
    path = os.path.join(cuda_driver.SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    return path


def test_only_that_processes_event_files_are_removed():
    dead, me = _dead_pid(), os.getpid()
    assert not alive(dead) and alive(me)
    ours = [_touch(f"cuda.shm.0.{dead:x}.1"), _touch(f"cuda.shm.7.{dead:x}.2")]
    others = [_touch(f"cuda.shm.0.{me:x}.1"),                 # another process's (this one's)
              _touch(f"cuda.shm.0.{dead:x}0.1"),              # a pid whose hex starts like it
              _touch(f"cuda.shm.0.{dead:x}"),                 # not the driver's shape
              _touch(f"shmproxy-cuda.shm.0.{dead:x}.1")]
    try:
        assert sorted(cuda_driver.event_files(dead)) == sorted(ours)
        assert sorted(cuda_driver.remove_event_files(dead)) == sorted(ours)
        assert not any(os.path.exists(p) for p in ours)
        assert all(os.path.exists(p) for p in others)
        assert cuda_driver.remove_event_files(dead) == []   # nothing left: no error either
    finally:
        for p in ours + others:
            if os.path.exists(p):
                os.unlink(p)


def test_a_zombie_is_not_alive():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)   # exited, not reaped: a zombie
        assert not alive(p.pid)
    finally:
        p.wait()


def test_a_killed_jobs_marks_and_files_are_swept(tmp_path):
    """A job killed whole leaves its ranks' event files and their marks in the run directory; the next
    job's sweep removes those of processes that are gone, and nothing else."""
    dead, me = _dead_pid(), os.getpid()
    rundir = str(tmp_path)
    cuda_driver.mark_event_files(rundir, dead)
    cuda_driver.mark_event_files(rundir, me)
    files = [_touch(f"cuda.shm.0.{dead:x}.1"), _touch(f"cuda.shm.0.{me:x}.1")]
    odd = [tmp_path / "x12.cuda-events", tmp_path / f"{dead}.cuda-events.bak"]
    for p in odd:
        p.write_bytes(b"")
    try:
        removed = bootstrap.sweep_stale_event_files(rundir)
        assert sorted(removed) == sorted([files[0], cuda_driver.mark_path(rundir, dead)])
        assert os.path.exists(files[1]) and os.path.exists(cuda_driver.mark_path(rundir, me))
        assert all(p.exists() for p in odd)
        assert bootstrap.sweep_stale_event_files(str(tmp_path / "missing")) == []
        # this process at its exit: its file and its mark
        assert sorted(cuda_driver.remove_event_files(me, rundir)) == sorted([files[1],
                                                                          cuda_driver.mark_path(rundir, me)])
    finally:
        for p in files:
            if os.path.exists(p):
                os.unlink(p)


def test_the_first_rank_sweeps_a_killed_jobs_event_files():
    """End to end: a mark and an event file of a dead rank in the run directory are gone once the
    next job has started (local rank 0 sweeps at init, beside the stale sockets and pools)."""
    from shmproxy.core import params
    from tests.harness import run_ranks
    rundir = bootstrap.run_dir(params.get())   # the ranks' own, made if missing
    dead = _dead_pid()
    cuda_driver.mark_event_files(rundir, dead)
    file = _touch(f"cuda.shm.0.{dead:x}.1")
    try:
        run_ranks("tests.bodies_p2p:self_send", 2, timeout=60)
        assert not os.path.exists(file) and not os.path.exists(cuda_driver.mark_path(rundir, dead))
    finally:
        for p in (file, cuda_driver.mark_path(rundir, dead)):
            if os.path.exists(p):
                os.unlink(p)
