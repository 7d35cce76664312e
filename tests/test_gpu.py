"""Device (cupy) buffers through shmproxy: ranks sharing one GPU, every operation against cupy
references, stream order, host/device mixing refused, a rank killed mid-collective.

Skipped, saying why, where cupy or a GPU is absent (CI). tools/gpu_tests.sh runs this file on a GPU
host. Rank bodies are in tests/bodies_gpu.py, tests/bodies_gpu_more.py and tests/bodies_gpu_vector.py.
"""
from __future__ import annotations

import json

import pytest

from tests.harness import run_ranks


def _gpu_reason() -> str:
    try:
        import cupy
    except ImportError as exc:
        return f"cupy is not installed ({exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:   # cupy raises its own CUDARuntimeError, or an ImportError of libcudart
        return f"no usable CUDA device ({type(exc).__name__}: {exc})"
    return "" if n else "no CUDA device"


REASON = _gpu_reason()
pytestmark = pytest.mark.skipif(bool(REASON), reason=f"GPU tests: {REASON}")
BODY = "tests.bodies_gpu:"
MORE = "tests.bodies_gpu_more:"
VEC = "tests.bodies_gpu_vector:"


def _all_correct(res, cases_over: int | None = None) -> None:
    """Every rank's body found nothing wrong (its first mismatches shown) and, where given, ran more
    than ``cases_over`` cases."""
    for r in res.results:
        assert not r["bad"], r["bad"][:20]
        if cases_over is not None:
            assert r["cases"] > cases_over, r["cases"]


def _used_bytes() -> int:
    import cupy
    free, total = cupy.cuda.runtime.memGetInfo()
    return total - free


@pytest.mark.parametrize("nranks", [2, 3])
def test_p2p_every_dtype_and_size(nranks):
    res = run_ranks(BODY + "p2p_every_dtype_and_size", nranks, timeout=180)
    _all_correct(res, 30)


def test_work_queued_on_a_non_default_stream_is_seen():
    res = run_ranks(BODY + "stream_order", 2, timeout=120)
    _all_correct(res)


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_collectives_against_cupy_references(nranks):
    res = run_ranks(BODY + "collectives", nranks, timeout=400)
    _all_correct(res, 100)


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_vector_collectives_device_matches_host(nranks):
    """Gather, Scatter, Gatherv, Scatterv, Allgatherv, Alltoallv, Reduce_scatter, Scan, Exscan and
    their I-forms (IN_PLACE too) on device arrays: bit for bit the host path's results and a numpy
    reference, for float32, float16 and int64, even, uneven (an empty rank) and zero counts."""
    res = run_ranks(VEC + "vector_collectives", nranks, timeout=500)
    _all_correct(res, 2000)


def test_vector_collectives_host_and_device_mixed_is_refused():
    res = run_ranks(VEC + "vector_mixed_is_refused", 3, timeout=180)
    for r in res.results:
        assert r["refused"] == 6, r
        assert r["cross"] == ["Gatherv: InvalidArgument", "Iscan: InvalidArgument"], r
        assert r["ok"], r


@pytest.mark.parametrize("nranks", [2, 3])
def test_vector_collectives_bfloat16_torch(nranks):
    pytest.importorskip("torch")
    res = run_ranks(VEC + "vector_bfloat16_torch", nranks, timeout=300)
    _all_correct(res, 100)


def test_host_and_device_mixed_in_one_call_is_refused():
    res = run_ranks(BODY + "mixed_is_refused", 2, timeout=120)
    assert res.results == [{"refused": 4, "ok": True}] * 2


def test_torch_cuda_tensors():
    pytest.importorskip("torch")
    res = run_ranks(BODY + "torch_tensors", 2, timeout=180)
    assert all(r["ok"] for r in res.results)


@pytest.mark.parametrize("nranks", [2, 3])
def test_bfloat16_torch_tensors(nranks):
    pytest.importorskip("torch")
    res = run_ranks(MORE + "bfloat16_torch", nranks, timeout=300)
    _all_correct(res, 60)


def test_stream_keyword_orders_after_that_stream():
    pytest.importorskip("torch")
    res = run_ranks(MORE + "stream_keyword", 2, timeout=180)
    _all_correct(res)


@pytest.mark.parametrize("nranks", [2, 3])
def test_small_blocking_collectives_take_the_fast_path(nranks):
    """Small blocking collectives on device arrays (Bcast runs between the ranks: rank/fastpath.py):
    results, stream order, host buffers on one rank and device buffers on the others."""
    res = run_ranks(MORE + "small_fast", nranks, timeout=300, env={"SHMPROXY_TIMEOUT": "60"})
    for r in res.results:
        assert r["fast"] > 0, "the fast path is off on a one-node communicator"
        assert not r["bad"], r["bad"]
        assert r["cases"] > 200
    assert [r["large_mix"] for r in res.results] == ["InvalidArgument"] * nranks
    # a small device Allreduce against a host one: the same path (works) or a mismatch on every rank
    expect = "InvalidUsage"   # SHMPROXY_FAST_DEVICE_REDUCTIONS is off by default
    assert [r["mixed_reduce"] for r in res.results] == [expect] * nranks


@pytest.mark.parametrize("graphs,completes", [("1", "1"), ("0", "1"), ("1", "0")])
@pytest.mark.parametrize("nranks", [2, 3])
def test_repeated_collectives_on_the_same_buffers(nranks, graphs, completes):
    """Repeated work runs as CUDA graphs from its second time (transports/cuda.py), or not at all; a
    message's requests are published by the GPU (CUDA_DEVICE_COMPLETES) or by the loop."""
    res = run_ranks(MORE + "repeated_buffers", nranks, timeout=180,
                    env={"SHMPROXY_CUDA_GRAPHS": graphs, "SHMPROXY_CUDA_DEVICE_COMPLETES": completes,
                         "SHMPROXY_CUDA_DEVICE_COMPLETES_MIN": "0",   # its small buffers too
                         "SHMPROXY_DUMP_SIGNAL": "SIGUSR1"})
    for r in res.results:
        assert not r["bad"], r["bad"]
        assert r["cases"] == 94
        assert r["remembered"] >= 3, "the rank remembered no checked device collective"
    gpus = res.results[0]["gpus"]
    assert len(gpus) == 1 and gpus[0]["devices"] == [0] and gpus[0]["peer_mappings"] == 0, gpus
    # repeated copies run as graphs that publish their requests (transports/cuda_publish.py)
    assert gpus[0]["gpu_publishes_completions"] == ([0] if graphs == completes == "1" else []), gpus
    if graphs == "1":   # the reductions (Allreduce x3 ops, IN_PLACE, Reduce per root) and the messages
        assert gpus[0]["graphs"] >= 5 and gpus[0]["planned_reductions"] >= 5, gpus
    else:
        assert gpus[0]["graphs"] == 0 and gpus[0]["planned_reductions"] >= 5, gpus


@pytest.mark.parametrize("armed", ["1", "0"])
@pytest.mark.parametrize("nranks", [2, 3])
def test_armed_routes_keep_mpi_order(nranks, armed):
    """Repeated device messages fired from C at fetch (proxy/engine/armed.py) deliver what MPI's
    matching would: host messages of the same tag, alternating buffers, receives posted ahead, a
    wildcard receive, a cancelled receive and probes around them; and they do fire, unless turned off."""
    res = run_ranks("tests.bodies_gpu_armed:armed_routes", nranks, timeout=180,
                    env={"SHMPROXY_CUDA_ARMED_ROUTES": armed, "SHMPROXY_DUMP_SIGNAL": "SIGUSR1"})
    for r in res.results:
        assert not r["bad"], r["bad"][:10]
    assert [r["cases"] for r in res.results] == [400, 600] + [0] * (nranks - 2)
    got = res.results[0]["armed"]
    if armed == "1":
        assert got["on"] and got["fired"] >= 100 and got["held_ops"] == [], got
    else:
        assert got == {"on": False}, got


def test_device_alloc_registered_once_freed_when_dropped():
    res = run_ranks(MORE + "device_alloc", 2, timeout=180)
    print("GPU_ALLOC " + json.dumps(res.results))
    _all_correct(res)


def test_nonblocking_collective_overlaps_device_compute():
    res = run_ranks(MORE + "overlap", 2, timeout=300)
    print("GPU_OVERLAP " + json.dumps(res.results))
    for r in res.results:
        assert not r["bad"], r["bad"]
        # most of the collectives' time runs under the rank's kernel (measured: all of it)
        assert r["hidden_fraction"] > 0.5, r


def test_kill9_mid_collective_survivors_raise_and_gpu_memory_returns():
    before = _used_bytes()
    res = run_ranks(BODY + "victim_dies_in_device_allreduce", 3, timeout=120, expect_fail={2})
    for r in res.results[:2]:
        assert r["raised"] == "PeerDiedError", r
    after = _used_bytes()
    # every process that held the job's device memory is gone, so is the memory (a CUDA context of
    # a few hundred MiB per process would show)
    assert after - before < 64 << 20, (before, after)


@pytest.mark.parametrize("nranks", [2, 3])
def test_a_stream_waits_on_the_gpu_for_a_request(nranks):
    res = run_ranks(BODY + "wait_on_stream", nranks, timeout=180)
    _all_correct(res)
    for r in res.results:
        # the last rank's input kernel spins ~100 ms: a host that waited for the Allreduce would show it
        assert r["host_s"] < 0.03, r


def test_a_remembered_call_sees_its_memory_freed_and_allocated_again():
    res = run_ranks(BODY + "remembered_call_after_realloc", 2, timeout=120)
    _all_correct(res)
    for r in res.results:
        assert r["same_address"] >= 1, r   # the case this is about happened


@pytest.mark.parametrize("host_waits", [True, False])
def test_a_waiting_stream_is_let_go_when_a_peer_dies(host_waits):
    res = run_ranks(BODY + "stream_let_go_when_peer_dies", 2, timeout=120, expect_fail={1},
                    args={"host_waits": host_waits})
    r = res.results[0]
    assert r["armed"] is True and r["raised"] == "PeerDiedError", r
    assert r["sync_s"] < 5.0, r


def test_mpi_layer_hands_device_arrays_to_the_native_layer():
    res = run_ranks(MORE + "mpi_layer_device_arrays", 2, timeout=180)
    _all_correct(res)


# The ranks' own kernels (shmproxy.rank.devcoll) on the GPU the ranks share, where the parameter
# allows it (a GPU under MPS); without MPS their waits take turns on the GPU, so the limits are small.
# The copy-engine Allreduce's protocol (chunks, windows, the halves shared with the kernels' calls)
# runs here on any one-GPU host; tests/test_gpu_multi.py runs it between GPUs, where it is meant to.
SHARED_KERNELS_ENV = {"SHMPROXY_DEVICE_KERNELS_SHARED_GPU": "1", "SHMPROXY_DEVICE_ONESHOT_BYTES": "64K",
                      "SHMPROXY_DEVICE_TWOSHOT_WINDOW": "1M", "SHMPROXY_DEVICE_TWOSHOT_CHUNK": "1K",
                      "SHMPROXY_DEVICE_CE_BYTES": "128K", "SHMPROXY_DEVICE_CE_CHUNK": "48K"}


def test_ranks_kernels_on_a_shared_gpu_when_allowed():
    res = run_ranks("tests.bodies_gpu_oneshot:twoshot_results", 2, timeout=600, env=SHARED_KERNELS_ENV)
    for r in res.results:
        assert not r["bad"], r["bad"]
        assert r["path"] == "oneshot", r
        assert r["ce_windows"] > r["cases"] // 2, r


def test_ranks_share_kernels_on_a_shared_gpu_when_allowed():
    """Reduce_scatter_block and Allgather by the copy engines from DEVICE_CE_BYTES, the kernels below."""
    res = run_ranks("tests.bodies_gpu_oneshot:shares_results", 2, timeout=600, env=SHARED_KERNELS_ENV)
    for r in res.results:
        assert not r["bad"], r["bad"]
        assert r["path"] == "oneshot" and r["ce_windows"] > r["cases"] // 2, r


def test_ranks_kernels_on_a_shared_gpu_survivor_raises_when_a_peer_dies():
    res = run_ranks("tests.bodies_gpu_oneshot:oneshot_peer_dies", 2, timeout=120, expect_fail={1},
                    args=(1 << 20,), env={**SHARED_KERNELS_ENV, "SHMPROXY_TIMEOUT": "60"})
    r = res.results[0]
    assert r["path"] == "oneshot" and r["raised"] == "PeerDiedError" and r["ce"] >= 3, r
    assert r["s"] < 10, r
