"""The "shmproxy" torch.distributed backend on CUDA tensors, 2 ranks sharing one GPU: every op and
dtype against gloo, torch's stream order, CPU/CUDA mixing refused, DDP on a CUDA model against gloo,
a rank killed mid-allreduce.

Skipped, saying why, where torch, cupy or a GPU is absent (CI). tools/gpu_tests.sh runs this file on a
GPU host. Rank bodies are in tests/bodies_torch_cuda.py. NCCL is no reference here: it refuses two
ranks on one GPU.
"""
from __future__ import annotations

import importlib.util

import pytest

from tests.harness import free_port, run_ranks


def _reason() -> str:
    for mod in ("torch", "cupy"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    import torch
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return ""


REASON = _reason()
pytestmark = [pytest.mark.skipif(bool(REASON), reason=f"GPU tests: {REASON}"), pytest.mark.slow]
B = "tests.bodies_torch_cuda"


@pytest.mark.launcher
def test_every_op_and_dtype_on_cuda_equals_gloo() -> None:
    res = run_ranks(f"{B}:ops_vs_gloo", 2, timeout=300, launcher="torchrun")
    for r in res.results:
        print("GPU_TORCH gloo refused: " + "; ".join(r["gloo_refused"]))
        assert r["diffs"] == [], r
        assert r["ran"] >= 4 * 20 - len(r["gloo_refused"]), r


@pytest.mark.launcher
def test_stream_order_and_completion_on_the_device() -> None:
    res = run_ranks(f"{B}:stream_order", 2, timeout=200, launcher="torchrun")
    for r in res.results:
        assert r["bad"] == [], r
        assert r["pending_right_after_call"] is True, r


@pytest.mark.launcher
def test_wait_makes_the_stream_wait_not_the_host() -> None:
    res = run_ranks(f"{B}:wait_lets_the_host_go", 2, timeout=200, launcher="torchrun")
    for r in res.results:
        assert r["bad"] == [], r
        # the kernel ahead of every call runs for sleep_s: a host that waited for it would show it
        assert max(r["waited_s"]) < r["sleep_s"] / 4, r


@pytest.mark.launcher
def test_a_loop_of_blocking_all_reduce_and_synchronize_never_hangs() -> None:
    res = run_ranks(f"{B}:blocking_loop", 2, timeout=120, launcher="torchrun")
    for r in res.results:
        assert r["bad"] == [], r


@pytest.mark.launcher
def test_cpu_and_cuda_tensors_mixed_in_one_call_are_refused() -> None:
    res = run_ranks(f"{B}:mixed_is_refused", 2, timeout=200, launcher="torchrun")
    for r in res.results:
        for case in ("into tensor", "list", "alltoall"):
            assert "InvalidArgument" in r[case] and "cannot be mixed" in r[case], r
        assert r["still usable"] == "2.0", r


@pytest.mark.launcher
@pytest.mark.parametrize("hook", [False, True])
def test_ddp_on_a_cuda_model_same_weights_as_gloo(hook: bool) -> None:
    res = run_ranks(f"{B}:ddp_equal", 2, timeout=200, launcher="torchrun", args={"steps": 20, "hook": hook})
    for r in res.results:
        print(f"GPU_TORCH DDP hook={hook} max weight difference against gloo: {r['max_diff']}")
        assert r["max_diff"] <= 1e-6, r


def test_every_op_on_cuda_between_two_nodes_equals_gloo() -> None:
    """Each rank a simulated node of its own (both on GPU 0): the backend's CUDA tensors cross between
    nodes through the rank's pinned host memory (shmproxy.rank.devstage)."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    res = run_ranks(f"{B}:ops_vs_gloo", 2, timeout=300, nodes=2, env=env)
    for r in res.results:
        assert r["diffs"] == [], r
        assert r["ran"] >= 4 * 20 - len(r["gloo_refused"]), r


@pytest.mark.parametrize("hook", [False, True])
def test_ddp_on_a_cuda_model_between_two_nodes_same_weights_as_gloo(hook: bool) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    res = run_ranks(f"{B}:ddp_equal", 2, timeout=200, nodes=2, env=env, args={"steps": 20, "hook": hook})
    for r in res.results:
        assert r["max_diff"] <= 1e-6, r


@pytest.mark.parametrize("ddp", [False, True])
def test_killed_rank_mid_allreduce_makes_survivor_raise(ddp: bool) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    res = run_ranks(f"{B}:killed_rank", 2, timeout=200, env=env, expect_fail={1}, args={"ddp": ddp})
    r = res.results[0]
    assert r["step"] >= 0, r
    assert "PeerDiedError: rank 1" in r["error"] and "died" in r["error"], r
