"""Tests of shmproxy.engine.affinity: the pinning policy on fake CPU sets, and real pinning in child processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from shmproxy.engine import affinity
from shmproxy.engine.affinity import choose_proxy_cpus, format_cpu_list
from shmproxy.core.errors import InvalidArgument, SystemError_
from shmproxy.core.params import Params
from tests.harness import run_ranks

REPO = Path(__file__).resolve().parents[1]


def params(cpus: str = "", ncores: int = 0) -> Params:
    return Params(env={}, overrides={"PROXY_CPUS": cpus, "PROXY_NCORES": ncores})


def cpus(text: str) -> set[int]:
    return set(affinity.parse_cpu_list(text))


TWO_NODES = {0: cpus("0-7"), 1: cpus("8-15")}


@pytest.mark.parametrize("given,expected", [
    ([0], "0"), ([0, 1, 2, 3], "0-3"), ([3, 1, 2, 8, 10, 11], "1-3,8,10-11"), ([5, 7], "5,7"), ([], ""),
])
def test_format_cpu_list(given: list[int], expected: str) -> None:
    assert format_cpu_list(given) == expected
    if given:
        assert affinity.parse_cpu_list(expected) == sorted(given)


# ------------------------------------------------------------------------------------------------
# The policy, on fake topologies

POLICY_CASES = [
    # (id, PROXY_CPUS, PROXY_NCORES, rank affinities, allowed, numa, prefer_node, expected cpus)
    ("ranks pinned: spare = the rest",
     "", 0, ["0", "1", "2", "3"], "0-15", TWO_NODES, None, "4-15"),
    ("ranks pinned: one node preferred when it has enough",
     "", 8, ["0", "1", "2", "3"], "0-15", TWO_NODES, None, "8-15"),
    ("ranks pinned on node 0 with room there: stay near them",
     "", 2, ["0", "1"], "0-15", TWO_NODES, None, "6-7"),
    ("ranks unpinned: the lowest nlocal CPUs are theirs",
     "", 0, ["0-3", "0-3"], "0-3", {}, None, "2-3"),
    ("ranks unpinned, 'auto' is the same as ''",
     "auto", 0, ["0-3", "0-3"], "0-3", {}, None, "2-3"),
    ("ranks unpinned: highest-numbered spare, capped at 16",
     "", 0, ["0-31"] * 2, "0-31", {}, None, "16-31"),
    ("PROXY_NCORES takes that many",
     "", 2, ["0"], "0-7", {}, None, "6-7"),
    ("PROXY_NCORES above the spare count takes all spare",
     "", 10, ["0", "1"], "0-3", {}, None, "2-3"),
    ("PROXY_NCORES above 8 is honoured",
     "", 12, ["0"], "0-15", {}, None, "4-15"),
    ("no node has enough: split, best node first",
     "", 10, ["0-5"], "0-15", TWO_NODES, None, "6-15"),
    ("prefer_node wins over the ranks' node",
     "", 2, ["8"], "0-15", TWO_NODES, 0, "6-7"),
    ("prefer_node 1",
     "", 2, ["0"], "0-15", TWO_NODES, 1, "14-15"),
    ("a rank unpinned among pinned ones: count-based",
     "", 1, ["0", "0-3"], "0-3", {}, None, "3"),
    ("rank affinity outside allowed does not compete",
     "", 0, ["8-9"], "0-3", {}, None, "0-3"),
    ("allowed narrower than the ranks' masks: ranks count as unpinned",
     "", 0, ["0-63"], "4-7", {}, None, "5-7"),
    ("NUMA nodes outside allowed are ignored",
     "", 0, ["8"], "8-11", TWO_NODES, 0, "9-11"),
    ("explicit list",
     "4-5", 0, ["0"], "0-7", TWO_NODES, None, "4-5"),
    ("explicit list intersected with allowed; NCORES does not apply",
     "2-9", 1, ["0"], "0-5", {}, None, "2-5"),
    ("explicit list may overlap the ranks (the user said so)",
     "0", 0, ["0"], "0-3", {}, None, "0"),
]


@pytest.mark.parametrize("spec,ncores,ranks,allowed,numa,prefer,expected",
                         [c[1:] for c in POLICY_CASES], ids=[c[0] for c in POLICY_CASES])
def test_choose_proxy_cpus(spec: str, ncores: int, ranks: list[str], allowed: str, numa: dict,
                           prefer: int | None, expected: str) -> None:
    chosen, reason = choose_proxy_cpus(params(spec, ncores), [cpus(r) for r in ranks], cpus(allowed),
                                       numa=numa, prefer_node=prefer)
    assert chosen == sorted(cpus(expected))
    assert format_cpu_list(chosen) in reason and "\n" not in reason


def test_choose_reason_says_why() -> None:
    _, reason = choose_proxy_cpus(params("", 8), [{0}, {1}], cpus("0-15"), numa=TWO_NODES)
    assert reason == "CPUs 8-15 on NUMA node 1: 8 of 14 spare of 16 allowed, ranks pinned to 0-1"
    _, reason = choose_proxy_cpus(params("2-9"), [{0}], cpus("0-5"), numa={})
    assert reason == "CPUs 2-5 from SHMPROXY_PROXY_CPUS=2-9 (6-9 not allowed, dropped)"


def test_choose_none_disables_pinning() -> None:
    assert choose_proxy_cpus(params("none"), [{0}], {0, 1}) == (
        None, "pinning disabled by SHMPROXY_PROXY_CPUS=none")
    assert choose_proxy_cpus(params("NONE"), [], set())[0] is None  # nothing else is looked at


@pytest.mark.parametrize("ranks,allowed,message", [
    (["0", "1"], "0-1", "no spare cores: 2 cores, 2 local ranks; not pinned, shares the ranks' CPUs"),
    (["0-3"] * 4, "0-3", "no spare cores: 4 cores, 4 local ranks; not pinned, shares the ranks' CPUs"),
    (["0-1", "2-3"], "0-3", "no spare cores: 4 cores, 2 local ranks; not pinned, shares the ranks' CPUs"),
    (["0-7"] * 12, "0-7", "no spare cores: 8 cores, 12 local ranks; not pinned, shares the ranks' CPUs"),
])
def test_choose_no_spare(ranks: list[str], allowed: str, message: str) -> None:
    assert choose_proxy_cpus(params(), [cpus(r) for r in ranks], cpus(allowed), numa={}) == (None, message)


@pytest.mark.parametrize("spec,ranks,allowed,expected", [
    ("", ["0", "1"], "0-1", [0, 1]),              # --bind-to core: not rank 0's CPU alone
    ("", ["0-1", "2-3"], "0-7", [0, 1, 2, 3]),    # within the ranks' CPUs, not the whole cpuset
    ("", ["0", "9"], "0-3", [0]),                 # a rank pinned outside the allowed CPUs
    ("", ["8"], "0-3", [0, 1, 2, 3]),             # nothing usable: the allowed CPUs
    ("none", ["0", "1"], "0-1", None),            # opted out: left as inherited
])
def test_float_cpus(spec: str, ranks: list[str], allowed: str, expected: list[int] | None) -> None:
    assert affinity.float_cpus(params(spec), [cpus(r) for r in ranks], cpus(allowed)) == expected


def test_choose_errors() -> None:
    with pytest.raises(InvalidArgument, match="SHMPROXY_PROXY_CPUS=8-9 names no CPU"):
        choose_proxy_cpus(params("8-9"), [{0}], cpus("0-3"))
    with pytest.raises(InvalidArgument, match="at least one local rank"):
        choose_proxy_cpus(params(), [], cpus("0-3"))
    with pytest.raises(InvalidArgument, match="empty allowed"):
        choose_proxy_cpus(params(), [{0}], set())


def test_choose_with_real_defaults() -> None:
    """allowed and numa read from this machine: the result is within allowed and off the rank's CPU."""
    allowed = affinity.allowed_cpus()
    rank = {min(allowed)}
    chosen, reason = choose_proxy_cpus(params(), [rank])
    if len(allowed) == 1:
        assert chosen is None and reason.startswith("no spare cores")
    else:
        assert chosen and set(chosen) <= allowed - rank


# ------------------------------------------------------------------------------------------------
# The machine's view

def test_numa_nodes_are_online_cpus() -> None:
    nodes = affinity.numa_nodes()
    online = affinity.allowed_cpus() | affinity.current_affinity()
    for node, node_cpus in nodes.items():
        assert node >= 0 and node_cpus
    assert all(isinstance(c, int) for s in nodes.values() for c in s)
    if nodes:
        assert online <= set().union(*nodes.values())


def test_last_level_cache_is_the_outermost_data_or_unified_cache(tmp_path: Path) -> None:
    """From a sysfs-shaped tree: the highest level that is not an instruction cache, in K/M units;
    0 for a CPU with no cache directory or unreadable entries. The real machine's, if any, is sane."""
    def cache(cpu: int, index: int, level: str, kind: str, size: str) -> None:
        d = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
        d.mkdir(parents=True)
        (d / "level").write_text(level + "\n")
        (d / "type").write_text(kind + "\n")
        (d / "size").write_text(size + "\n")
    cache(0, 0, "1", "Data", "48K")
    cache(0, 1, "1", "Instruction", "32K")
    cache(0, 2, "2", "Unified", "2048K")
    cache(0, 3, "3", "Unified", "307200K")
    cache(1, 0, "1", "Data", "32K")
    cache(1, 1, "2", "Instruction", "1M")     # never an instruction cache, however outer
    cache(2, 0, "x", "Data", "32K")           # unreadable level
    assert affinity.last_level_cache_bytes(0, str(tmp_path)) == 300 << 20
    assert affinity.last_level_cache_bytes(1, str(tmp_path)) == 32 << 10
    assert affinity.last_level_cache_bytes(2, str(tmp_path)) == 0
    assert affinity.last_level_cache_bytes(7, str(tmp_path)) == 0
    real = affinity.last_level_cache_bytes(sorted(affinity.current_affinity())[0])
    assert real == 0 or 16 << 10 <= real <= 16 << 30


def test_allowed_cpus_covers_current_affinity_and_leaves_it_alone() -> None:
    before = affinity.current_affinity()
    assert before <= affinity.allowed_cpus()
    assert affinity.current_affinity() == before


def run_child(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs at least 2 CPUs")


@needs_two_cpus
def test_allowed_cpus_sees_past_an_inherited_pin() -> None:
    """A child of a pinned rank inherits the pin; allowed_cpus() still reports the whole cpuset."""
    out = run_child(
        "import json, os; from shmproxy.engine import affinity\n"
        "whole = affinity.allowed_cpus()\n"
        "os.sched_setaffinity(0, {min(whole)})\n"
        "print(json.dumps({'whole': sorted(whole), 'after': sorted(affinity.allowed_cpus()),"
        " 'mine': sorted(affinity.current_affinity())}))")
    assert out["after"] == out["whole"] and len(out["whole"]) >= 2
    assert out["mine"] == out["whole"][:1]


@needs_two_cpus
def test_pin_self_pins_every_thread() -> None:
    out = run_child(
        "import json, os, threading; from shmproxy.engine import affinity\n"
        "target = [max(os.sched_getaffinity(0))]\n"
        "started, stop = threading.Event(), threading.Event()\n"
        "t = threading.Thread(target=lambda: (started.set(), stop.wait()), daemon=True)\n"
        "t.start(); started.wait()\n"
        "affinity.pin_self(target)\n"
        "late = {}\n"
        "t2 = threading.Thread(target=lambda: late.update(c=sorted(affinity.current_affinity())))\n"
        "t2.start(); t2.join()\n"
        "def mask(tid):\n"
        "    try:\n"
        "        return sorted(os.sched_getaffinity(int(tid)))\n"
        "    except ProcessLookupError:\n"   # t2, joined, can linger in /proc/self/task for a moment
        "        return None\n"
        "tasks = {tid: mask(tid) for tid in os.listdir('/proc/self/task')}\n"
        "res = {'target': target, 'late': late['c'], 'tasks': {k: v for k, v in tasks.items() if v is not None}}\n"
        "stop.set(); t.join()\n"
        "print(json.dumps(res))")
    assert len(out["tasks"]) >= 2
    assert all(mask == out["target"] for mask in out["tasks"].values())
    assert out["late"] == out["target"]


@needs_two_cpus
def test_pin_thread_pins_only_the_caller() -> None:
    before = affinity.current_affinity()
    target = {max(before)}
    seen: dict[str, object] = {}

    def worker() -> None:
        try:
            affinity.pin_thread(target)
            seen["thread"] = affinity.current_affinity()
            seen["by_tid"] = affinity.current_affinity(threading.get_native_id())
        except BaseException as exc:  # reported below, never lost in the thread
            seen["error"] = exc

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert "error" not in seen, seen.get("error")
    assert seen["thread"] == target == seen["by_tid"]
    assert affinity.current_affinity() == before


def test_pin_errors() -> None:
    with pytest.raises(InvalidArgument):
        affinity.pin_thread([])
    with pytest.raises(InvalidArgument):
        affinity.pin_self([-1])
    with pytest.raises(SystemError_) as exc_info:
        affinity.pin_thread([max(affinity.allowed_cpus()) + 4096])
    assert exc_info.value.errno is not None and isinstance(exc_info.value.__cause__, OSError)


def test_current_affinity_of_a_missing_pid() -> None:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, timeout=60, check=True)
    with pytest.raises(SystemError_):
        affinity.current_affinity(int(proc.stdout))


def test_auto_policy_avoids_smt_siblings_of_rank_cpus():
    """Spare CPUs that share a physical core with a rank are left out while others remain."""
    p = params()
    sib = {i: {i % 16, i % 16 + 16} for i in range(32)}  # CPU i and i+16 are one core
    cpus, why = affinity.choose_proxy_cpus(p, [{i} for i in range(8)], set(range(32)), numa={}, siblings=sib)
    assert cpus is not None and not set(cpus) & set(range(16, 24)), cpus
    assert "SMT siblings" in why
    # When every spare CPU is a sibling of a rank CPU, they are still used (better than nothing).
    sib4 = {0: {0, 2}, 2: {0, 2}, 1: {1, 3}, 3: {1, 3}}
    cpus, _ = affinity.choose_proxy_cpus(p, [{0}, {1}], {0, 1, 2, 3}, numa={}, siblings=sib4)
    assert cpus == [2, 3]


@needs_two_cpus
def test_progress_process_floats_over_the_cpus_of_bound_ranks() -> None:
    run_ranks("tests.bodies_p2p:progress_floats_over_bound_ranks_cpus", 2, timeout=90)
