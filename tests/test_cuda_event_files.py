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
