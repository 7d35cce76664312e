"""The "shmproxy" torch.distributed backend (shmproxy.torch), under real torchrun, 2 ranks, CPU tensors.

Results are compared with gloo's in the same job (tests/bodies_torch.py). The killed-rank test runs
under the harness's torchrun-style environment instead of torchrun: torchrun stops the surviving
worker as soon as one dies, before the survivor could report what it raised.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.harness import free_port, run_ranks

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not installed (pip install torch==2.13.0)"),
              pytest.mark.slow]
B = "tests.bodies_torch"


def test_import_shmproxy_does_not_import_torch() -> None:
    code = ("import sys, shmproxy; assert 'torch' not in sys.modules;"
            " import shmproxy.torch, torch.distributed as d; assert 'SHMPROXY' in d.Backend._plugins")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.launcher
def test_every_op_and_dtype_equals_gloo() -> None:
    res = run_ranks(f"{B}:ops_vs_gloo", 2, timeout=280, launcher="torchrun")
    for r in res.results:
        assert r["diffs"] == [] and r["gloo_refused"] == [], r
        assert r["ran"] == 5 * 20 + 3, r   # 20 cases per dtype, AVG for the 3 floating ones


@pytest.mark.launcher
def test_async_ops_and_futures() -> None:
    res = run_ranks(f"{B}:async_futures", 2, timeout=200, launcher="torchrun")
    for r in res.results:
        assert r["wait"] is True and r["completed"] is True and r["exception"] == "None"
        assert r["value"] == 3.0 and r["chained"] == 6.0
        assert r["many"] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert [r["irecv"] for r in res.results] == [1.0, 0.0]
    assert res.results[0]["any_source"] == 1
    for r in res.results:
        assert r["registered torch.float32"] == 3.0 and r["registered torch.bfloat16"] == 3.0, r
        assert r["groups"] == 2.0, r


@pytest.mark.launcher
def test_ddp_same_weights_as_gloo() -> None:
    res = run_ranks(f"{B}:ddp_equal", 2, timeout=250, launcher="torchrun", args={"steps": 20})
    for r in res.results:
        assert r["max_diff"] == 0.0, r


@pytest.mark.launcher
def test_ddp_no_sync_and_comm_hook() -> None:
    res = run_ranks(f"{B}:ddp_equal", 2, timeout=250, launcher="torchrun",
                    args={"steps": 12, "no_sync_every": 3, "hook": True})
    for r in res.results:
        assert r["max_diff"] == 0.0, r


def test_killed_rank_makes_survivor_raise() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    res = run_ranks(f"{B}:killed_rank", 2, timeout=200, env=env, expect_fail={1})
    r = res.results[0]
    assert r["step"] >= 0, r
    assert "PeerDiedError: rank 1" in r["error"] and "died" in r["error"], r


@pytest.mark.launcher
def test_unsupported_ops_and_dtypes_are_clear_errors() -> None:
    res = run_ranks(f"{B}:unsupported", 2, timeout=200, launcher="torchrun")
    for r in res.results:
        assert "ReduceOp.BAND is not supported" in r["BAND"], r
        assert "ReduceOp.PREMUL_SUM is not supported" in r["PREMUL_SUM"], r
        assert "AVG needs a floating-point tensor" in r["AVG int"], r
        assert "float8_e4m3fn" in r["float8"] and "does not support" in r["float8"], r
        assert "not supported by this backend yet" in r["meta device"], r
        assert "cannot be mixed" in r["mixed devices"] and "meta" in r["mixed devices"], r
        assert "every block must match" in r["uneven all_gather"], r
        assert r["still usable"] == "2.0", r


@pytest.mark.launcher
def test_reused_tensors_move_to_registered_memory() -> None:
    res = run_ranks(f"{B}:adoption", 2, timeout=250, launcher="torchrun")
    for r in res.results:
        assert r["ddp_max_diff"] == 0.0, r
        n = r["ws"]
        assert r["reused"] == [float(sum(range(i, i + n))) for i in range(4)], r
        assert r["numpy_viewed_moved"] is False and r["numpy_view"] == float(n), r
        assert r["completed_unwaited"] is True, r
        if r["can_adopt"]:   # torch >= 2.13: a DDP bucket moved
            assert r["ddp_adopted"] >= 1, r
