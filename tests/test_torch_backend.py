"""The "shmproxy" torch.distributed backend (shmproxy.torch), under real torchrun, 2 ranks, CPU tensors.

Results are compared with gloo's in the same job (tests/bodies_torch.py). The killed-rank test runs
under the harness's torchrun-style environment instead of torchrun: torchrun stops the surviving
worker as soon as one dies, before the survivor could report what it raised.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import free_port, run_ranks

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not installed (pip install torch==2.13.0)"),
              pytest.mark.slow]
B = "tests.bodies_torch"
REPO = Path(__file__).resolve().parent.parent


def test_import_shmproxy_does_not_import_torch() -> None:
    code = ("import sys, shmproxy; assert 'torch' not in sys.modules;"
            " import shmproxy.torch, torch.distributed as d; assert 'SHMPROXY' in d.Backend._plugins")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.launcher
@pytest.mark.parametrize("direct", ["1", "0"], ids=["blocking-direct", "all-posted"])
def test_every_op_and_dtype_equals_gloo(direct: str) -> None:
    """Every case is a blocking call: with TORCH_BLOCKING_DIRECT the small ones run directly, without
    it every one is posted and waited for; both paths give gloo's bits."""
    res = run_ranks(f"{B}:ops_vs_gloo", 2, timeout=280, launcher="torchrun",
                    env={"SHMPROXY_TORCH_BLOCKING_DIRECT": direct})
    for r in res.results:
        assert r["diffs"] == [] and r["gloo_refused"] == [], r
        assert r["ran"] == 5 * 20 + 3, r   # 20 cases per dtype, AVG for the 3 floating ones


def test_every_op_and_dtype_equals_gloo_between_two_nodes() -> None:
    """The same, each rank a simulated node of its own: the backend over the transport between nodes."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    res = run_ranks(f"{B}:ops_vs_gloo", 2, timeout=280, nodes=2, env=env)
    for r in res.results:
        assert r["diffs"] == [] and r["gloo_refused"] == [], r
        assert r["ran"] == 5 * 20 + 3, r


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
def test_small_blocking_calls_complete_on_the_calling_thread() -> None:
    """Issue 43: a blocking small call's Work is completed by the thread that waits for it (no pass of
    the completion thread, which each call used to wake and wait for), also with two threads calling
    on two groups at once; a Future still completes with nobody waiting."""
    res = run_ranks(f"{B}:small_calls_on_their_own_thread", 2, timeout=200, launcher="torchrun")
    for r in res.results:
        assert r["passes"] == 0, r
        assert r["a_ok"] and r["b_ok"], r
        assert r["future"] == 2.0, r


@pytest.mark.launcher
def test_blocking_small_calls_run_directly() -> None:
    """Issue 43: torch's blocking calls of small contiguous CPU tensors run the communicator's blocking
    collective on the calling thread (a completed Work, its Future holding the outputs), strided ones
    through a copy; async calls, large and bfloat16 tensors are posted; reduce, broadcast and barrier
    equal gloo's."""
    res = run_ranks(f"{B}:blocking_direct", 2, timeout=200, launcher="torchrun")
    for r in res.results:
        assert r["blocking"] == "Completed" and r["async"] == "Work", r
        assert r["value"] == 3.0 and r["future"] == 3.0 and r["completed"], r
        assert r["kinds"] == {"large": ["Work", 2.0], "strided": ["Completed", 2.0], "bfloat16": ["Work", 2.0]}, r
        assert r["same"], r


@pytest.mark.launcher
def test_small_send_and_recv_take_the_fast_path_in_mpi_order() -> None:
    """Issue 43: small CPU sends complete at once through the ranks' fast path (a completed Work),
    receives are deferred to their wait; order, Futures, polling, any source, strided, bfloat16, a
    deferred receive across a barrier and a large message all come out right."""
    res = run_ranks(f"{B}:p2p_small", 2, timeout=200, launcher="torchrun")
    r0, r1 = res.results
    assert r0["bad"] == [] and r1["bad"] == [], (r0, r1)
    assert r1["isend"] == "Completed", r1
    assert r0["any_source"] == 1, r0


@pytest.mark.launcher
def test_a_receive_waits_without_the_groups_lock() -> None:
    """A thread receiving on a group while another thread of the rank sends on it (what the peer waits
    for before it sends back): no hang."""
    res = run_ranks(f"{B}:p2p_two_threads", 2, timeout=200, launcher="torchrun")
    for r in res.results:
        assert r["bad"] == [], r


@pytest.mark.launcher
def test_ranks_disagreeing_on_async_op_fail_every_rank() -> None:
    """A blocking small all_reduce on one rank against an async one on the other cannot match (the
    first runs between the ranks, the second through the progress process): every rank raises,
    saying why, well inside the test's bound."""
    res = run_ranks(f"{B}:async_op_mismatch", 2, timeout=120, launcher="torchrun")
    r0, r1 = (r["error"] for r in res.results)
    assert r0.startswith("InvalidUsage") and "async_op" in r0 and "nonblocking" in r0, r0
    assert "mismatch" in r1, r1


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


@pytest.mark.launcher
def test_fsdp2_fully_shard_same_losses_and_weights_as_gloo() -> None:
    """Issue 43: FSDP2 (fully_shard on a DeviceMesh made from the group) trains over shmproxy, with
    gloo's losses and weights bit for bit; the mesh finds the group by its name, which a Python
    process group could not give before."""
    res = run_ranks(f"{B}:fsdp2_equal", 2, timeout=250, launcher="torchrun")
    for r in res.results:
        assert r["losses_shmproxy"] == r["losses_gloo"], r
        assert r["max_diff"] == 0.0 and r["params"] == 6, r


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
@pytest.mark.parametrize("how", ["auto", "share"])
def test_reused_tensors_move_to_registered_memory(how: str) -> None:
    """auto is the swap on a torch that has it (CI's), share on older ones; share is every torch's."""
    res = run_ranks(f"{B}:adoption", 2, timeout=250, launcher="torchrun", env={"SHMPROXY_TORCH_ADOPT": how})
    swap = hasattr(importlib.import_module("torch").UntypedStorage, "_swap_data_ptr_")
    for r in res.results:
        assert r["how"] == ("swap" if how == "auto" and swap else "share"), r
        assert r["ddp_max_diff"] == 0.0, r
        assert r["ddp_adopted"] >= 1, r
        n = r["ws"]
        assert r["reused"] == [float(sum(range(i, i + n))) for i in range(4)], r
        top = float(sum(range(3, 3 + n)))
        assert r["registered"] is True and r["registered with a view left"] is True, r
        assert r["view"] == [top] * 4, r
        assert r["shared"] is (r["how"] == "share"), r
        if r["how"] == "share":   # the swap's memory is comm.alloc's, which deregisters as its array dies
            assert r["registered after its death"] is False, r
        assert r["numpy_viewed_moved"] is False and r["numpy_view"] == float(n), r
        assert r["completed_unwaited"] is True, r


def _torch_bench() -> Any:
    spec = importlib.util.spec_from_file_location("torch_bench", REPO / "tools" / "torch_bench.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_hidden_share_is_the_in_flight_union_before_compute_ends() -> None:
    in_flight = _torch_bench().in_flight
    # [t_call, t_start, t_posted, t_done, bytes]: two overlapping buckets (1-4), a gap, one more (6-9);
    # backward compute ends at 7.
    events = [[0.9, 1.0, 1.1, 3.0, 8.0], [1.9, 2.0, 2.1, 4.0, 8.0], [5.9, 6.0, 6.1, 9.0, 8.0]]
    total, before = in_flight(events, 7.0)
    assert total == pytest.approx(6.0) and before == pytest.approx(4.0)
    assert in_flight(events, 0.5) == (pytest.approx(6.0), 0.0)
    assert in_flight([], 1.0) == (0.0, 0.0)


@pytest.mark.launcher
def test_torch_bench_reports_overlap_of_both_backends(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), str(REPO / "tools" / "torch_bench.py"), "--sizes", "256K", "--iters", "3",
           "--pingpong", "8", "--overlap-size", "1M", "--params", "1M", "--layers", "6", "--bucket-cap-mb", "0.5",
           "--steps", "3", "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    for name in ("gloo", "shmproxy"):
        o, d = rep["overlap"][name], rep["ddp"][name]
        assert 0.0 <= o["overlap"] <= 1.0 and o["matmuls"] >= 1, o
        assert 0.0 <= d["hidden"] <= 1.0 and 0.0 <= d["hidden_step_based"] <= 1.0, d
        assert d["buckets"] >= 3 and d["exposed_s"] <= d["in_flight_s"], d
        assert d["compute_s"] <= d["backward_s"], d
    assert "hidden" in proc.stdout and "overlap 1M" in proc.stdout, proc.stdout
    assert all(rep["pingpong"]["8"][name] > 0 for name in ("gloo", "shmproxy")), rep["pingpong"]


@pytest.mark.launcher
def test_large_staged_tensors_equal_gloo() -> None:
    res = run_ranks(f"{B}:staged_large", 2, timeout=250, launcher="torchrun")
    for r in res.results:
        assert r["diffs"] == [] and r["ddp_max_diff"] == 0.0, r
        assert r["lent"] >= 6 and r["ddp_lent"] >= 6, r   # the group staged them, not the communicator
