"""Ranks on GPUs of their own: rank r on GPU r % ngpus of a host with several, through the same code
as ranks sharing one GPU (tests/test_gpu.py). The progress process then maps each rank's memory in
its own device's context, copies between devices (peer copies), waits on events of one device from
another's stream, and runs a reduction whose inputs live on several GPUs.

Skipped, saying why, where fewer than 2 GPUs are visible (CI, the one-GPU lent hosts).
tools/gpu_tests.sh runs this file with the rest of the GPU suite. The bodies are those of
tests/test_gpu.py, placed by SPTEST_GPU_SPREAD=1 (tests/bodies_gpu.py, gpu_of_rank); with 3 ranks on
2 GPUs two ranks share one GPU and the third has its own, both paths in one communicator.
"""
from __future__ import annotations

import pytest

from tests.harness import free_port, run_ranks
from tests.test_gpu import BODY, MORE, REASON as ONE_GPU_REASON, VEC, _all_correct


def _gpus() -> int:
    if ONE_GPU_REASON:
        return 0
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


NGPU = _gpus()
REASON = ONE_GPU_REASON or (f"needs 2 or more GPUs for ranks on GPUs of their own; this host has {NGPU}"
                            if NGPU < 2 else "")
pytestmark = pytest.mark.skipif(bool(REASON), reason=f"multi-GPU tests: {REASON}")
SPREAD = {"SPTEST_GPU_SPREAD": "1"}


def _used_bytes_all() -> int:
    """Device memory in use, summed over every GPU of the host."""
    import cupy
    used = 0
    for d in range(NGPU):
        with cupy.cuda.Device(d):
            free, total = cupy.cuda.runtime.memGetInfo()
        used += total - free
    return used


@pytest.mark.parametrize("nranks", [2, 3])
def test_p2p_every_dtype_and_size_across_gpus(nranks):
    res = run_ranks(BODY + "p2p_every_dtype_and_size", nranks, timeout=240, env=SPREAD)
    _all_correct(res, 30)


def test_stream_order_across_gpus():
    res = run_ranks(BODY + "stream_order", 2, timeout=120, env=SPREAD)
    _all_correct(res)


@pytest.mark.parametrize("nranks", [2, 3])
def test_collectives_across_gpus(nranks):
    res = run_ranks(BODY + "collectives", nranks, timeout=400, env=SPREAD)
    _all_correct(res, 100)


def test_vector_collectives_across_gpus():
    res = run_ranks(VEC + "vector_collectives", 2, timeout=500, env=SPREAD)
    _all_correct(res, 2000)


def test_bfloat16_torch_tensors_across_gpus():
    pytest.importorskip("torch")
    res = run_ranks(MORE + "bfloat16_torch", 2, timeout=300, env=SPREAD)
    _all_correct(res, 60)


def test_torch_tensors_across_gpus():
    pytest.importorskip("torch")
    res = run_ranks(BODY + "torch_tensors", 2, timeout=180, env=SPREAD)
    assert all(r["ok"] for r in res.results), res.results


@pytest.mark.parametrize("graphs,completes", [("1", "1"), ("0", "1"), ("1", "0")])
@pytest.mark.parametrize("nranks", [2, 3])
def test_repeated_collectives_across_gpus(nranks, graphs, completes):
    """Graphs, planned reductions and GPU-published completions with each rank on its own GPU; the
    progress process says in its dump that it holds every GPU the ranks use."""
    res = run_ranks(MORE + "repeated_buffers", nranks, timeout=240,
                    env={**SPREAD, "SHMPROXY_CUDA_GRAPHS": graphs, "SHMPROXY_DEVICE_ONESHOT_BYTES": "0",
                         "SHMPROXY_DEVICE_TWOSHOT_BYTES": "0",   # the progress process's path, which this tests
                         "SHMPROXY_CUDA_DEVICE_COMPLETES": completes, "SHMPROXY_CUDA_DEVICE_COMPLETES_MIN": "0",
                         "SHMPROXY_DUMP_SIGNAL": "SIGUSR1"})
    for r in res.results:
        assert not r["bad"], r["bad"]
        assert r["cases"] == 94
    gpus = res.results[0]["gpus"]
    used = sorted({r % NGPU for r in range(nranks)})
    assert len(gpus) == 1 and gpus[0]["devices"] == used, gpus
    # rank 1's arrays on GPU 1, reduced by a kernel on GPU 0: mapped again in GPU 0's context
    assert gpus[0]["peer_mappings"] >= 1, gpus
    if graphs == "1":
        assert gpus[0]["graphs"] >= 5 and gpus[0]["planned_reductions"] >= 5, gpus


def test_device_alloc_on_each_ranks_gpu():
    res = run_ranks(MORE + "device_alloc", 2, timeout=180, env=SPREAD)
    _all_correct(res)


def test_kill9_across_gpus_survivors_raise_and_memory_returns_on_every_gpu():
    before = _used_bytes_all()
    res = run_ranks(BODY + "victim_dies_in_device_allreduce", 3, timeout=120, expect_fail={2}, env=SPREAD)
    for r in res.results[:2]:
        assert r["raised"] == "PeerDiedError", r
    after = _used_bytes_all()
    assert after - before < 64 << 20, (before, after)


ONESHOT = "tests.bodies_gpu_oneshot:"


def test_oneshot_allreduce_matches_numpy_bit_for_bit():
    """Each rank on a GPU of its own: a small device Allreduce is the ranks' own kernels
    (shmproxy.rank.devcoll), every element type and op of theirs, around the block slices and the
    size limit (one element past it goes to the progress process), in place or not, on two streams in
    turn."""
    res = run_ranks(ONESHOT + "oneshot_results", 2, timeout=300, env=SPREAD)
    for r in res.results:
        assert not r["bad"], r["bad"]
        assert r["path"] == "oneshot", r
        assert r["cases"] > 100 and r["launched"] > 0.8 * r["cases"], r


# small limits, so that the sizes around them are quick; a chunk of a few per block's part
TWOSHOT_ENV = {**SPREAD, "SHMPROXY_DEVICE_ONESHOT_BYTES": "64K", "SHMPROXY_DEVICE_TWOSHOT_WINDOW": "1M",
               "SHMPROXY_DEVICE_TWOSHOT_CHUNK": "1K"}


def test_twoshot_allreduce_matches_numpy_bit_for_bit():
    """Above DEVICE_ONESHOT_BYTES the ranks' kernels are two-shot (each reduces a share, written into
    its scratch by its peers): every element type and op, around the switch, a window and its packs,
    several windows, aligned and not, in place or not, parts of several chunks and of a partial one
    (the limits made small to reach them)."""
    res = run_ranks(ONESHOT + "twoshot_results", 2, timeout=400, env=TWOSHOT_ENV)
    for r in res.results:
        assert not r["bad"], r["bad"]
        assert r["path"] == "oneshot", r
        assert r["cases"] > 300 and r["launched"] > 1.3 * r["cases"], r   # several windows per large call


# ... and the copy engines from twice the one-shot limit: calls of each path in turn (the halves they
# share), windows of several chunks and a partial one
CE_ENV = {**TWOSHOT_ENV, "SHMPROXY_DEVICE_CE_BYTES": "128K", "SHMPROXY_DEVICE_CE_CHUNK": "48K"}


def test_copy_engine_allreduce_matches_numpy_bit_for_bit():
    """From DEVICE_CE_BYTES the two-shot Allreduce's exchanges are the copy engines' peer copies and
    flags stored by the streams, its reductions local kernels: every element type and op, several
    windows, aligned and not, in place or not, between calls of the kernels' paths."""
    res = run_ranks(ONESHOT + "twoshot_results", 2, timeout=400, env=CE_ENV)
    for r in res.results:
        assert not r["bad"], r["bad"]
        assert r["path"] == "oneshot", r
        assert r["ce_windows"] > r["cases"] // 2, r   # most cases' large calls, several windows each


def test_copy_engine_allreduce_survivor_raises_when_a_peer_dies():
    res = run_ranks(ONESHOT + "oneshot_peer_dies", 2, timeout=120, expect_fail={1}, args=(1 << 20,),
                    env={**CE_ENV, "SHMPROXY_TIMEOUT": "60"})
    r = res.results[0]
    assert r["path"] == "oneshot" and r["raised"] == "PeerDiedError" and r["ce"] >= 3, r
    assert r["s"] < 10, r


def test_copy_engine_reduce_scatter_and_allgather_match_numpy():
    res = run_ranks(ONESHOT + "shares_results", 2, timeout=400, env=CE_ENV)
    for r in res.results:
        assert not r["bad"], r["bad"]
        assert r["path"] == "oneshot" and r["ce_windows"] > r["cases"] // 2, r


def test_reduce_scatter_and_allgather_as_the_ranks_kernels():
    """Reduce_scatter_block and Allgather of device arrays, a GPU per rank, run as the ranks' own
    kernels: bit for bit, around a window and past several, aligned or not, IN_PLACE Allgather."""
    res = run_ranks(ONESHOT + "shares_results", 2, timeout=400, env=TWOSHOT_ENV)
    for r in res.results:
        assert not r["bad"], r["bad"]
        assert r["path"] == "oneshot", r
        assert r["launched"] >= 4 * r["cases"], r   # every call a kernel, the largest several


def test_fsdp2_on_gpus_of_their_own_matches_nccl():
    """FSDP2 (fully_shard) of a CUDA model, a GPU per rank: shmproxy's run (its shard collectives the
    ranks' own kernels) ends with NCCL's weights and losses."""
    pytest.importorskip("torch")
    env = {**SPREAD, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    res = run_ranks(ONESHOT + "fsdp2_against_nccl", 2, timeout=240, env=env)
    for r in res.results:
        assert r["path"] == "oneshot", r
        assert r["max_diff"] <= 1e-5, r
        assert all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(r["losses_nccl"], r["losses_shmproxy"])), r


def test_twoshot_allreduce_survivor_raises_when_a_peer_dies():
    res = run_ranks(ONESHOT + "oneshot_peer_dies", 2, timeout=120, expect_fail={1}, args=(1 << 20,),
                    env={**TWOSHOT_ENV, "SHMPROXY_TIMEOUT": "60"})
    r = res.results[0]
    assert r["path"] == "oneshot" and r["raised"] == "PeerDiedError", r
    assert r["s"] < 10, r


def test_oneshot_allreduce_with_ranks_sharing_a_gpu_stays_with_the_progress_process():
    """3 ranks on 2 GPUs: two share one, so the set-up declines on every rank alike; results right."""
    res = run_ranks(ONESHOT + "oneshot_results", 3, timeout=400, env=SPREAD)
    for r in res.results:
        assert not r["bad"], r["bad"]
        assert r["path"] == "progress" and r["launched"] == 0, r


def test_oneshot_allreduce_survivor_raises_when_a_peer_dies():
    res = run_ranks(ONESHOT + "oneshot_peer_dies", 2, timeout=120, expect_fail={1},
                    env={**SPREAD, "SHMPROXY_TIMEOUT": "60"})
    r = res.results[0]
    assert r["path"] == "oneshot" and r["raised"] == "PeerDiedError", r
    assert r["s"] < 10, r   # the failure watch's slice and the kernel's abort word, not TIMEOUT


def test_oneshot_allreduce_through_torch():
    pytest.importorskip("torch")
    env = {**SPREAD, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    res = run_ranks(ONESHOT + "oneshot_torch", 2, timeout=240, env=env)
    for r in res.results:
        assert not r["bad"], r["bad"]
        assert r["path"] == "oneshot", r
