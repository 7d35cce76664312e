"""tools/host_probe: bandwidth, interference and per-CPU speed, and that it leaves no process behind
and the caller's affinity as it was."""
from __future__ import annotations

import os

import pytest


def test_host_probe_measures_and_cleans_up():
    """tools/host_probe: bandwidth is a positive rate; interference times the work against every other
    CPU and leaves no streamer process behind (the leak guard checks)."""
    from shmproxy.tools import hostprobe
    assert hostprobe.bandwidth(1, "add", reps=1) > 0
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("interference needs two CPUs")
    res = hostprobe.interference(cpus[0], cpus[1:2])
    assert len(res) == 1 and res[0][1] == cpus[1] and res[0][0] > 0
    assert sorted(os.sched_getaffinity(0)) == cpus     # the caller is not left pinned to cpus[0]


def test_host_probe_speed_times_every_cpu(capsys):
    """host_probe speed times the work on every CPU the caller may use, once per round, prints one line
    per round with the slowest/fastest ratio, and leaves the caller's affinity as it was."""
    from shmproxy.tools import hostprobe
    cpus = sorted(os.sched_getaffinity(0))
    res = hostprobe.speed(cpus, rounds=2)
    assert len(res) == 2
    for times, steal in res:
        assert sorted(times) == cpus and all(t > 0 for t in times.values())
        assert steal is None or 0 <= steal <= 100
    assert sorted(os.sched_getaffinity(0)) == cpus
    assert hostprobe.main(["speed", "--rounds", "1"]) == 0
    line, = capsys.readouterr().out.splitlines()
    assert line.startswith("round 1: ms per CPU ") and "slowest/fastest" in line
    assert [int(c.split(":")[0]) for c in line.split("|")[0].split()[5:]] == cpus
    assert sorted(os.sched_getaffinity(0)) == cpus
