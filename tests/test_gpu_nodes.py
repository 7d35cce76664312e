"""Device buffers between nodes: two (and three) simulated nodes on one host, each rank on a GPU of
its own where the host has enough (rank r on GPU r % ngpus), talking over loopback. Every operation
of the GPU suite's bodies (tests/bodies_gpu.py: point-to-point, every collective, stream order,
torch tensors, the vector collectives) runs between the nodes, through the rank's staging in pinned
host memory (shmproxy.rank.devstage); tests/bodies_gpu_nodes.py adds the sizes around the switches
between nodes, bfloat16 (reduced in float32) and the buffers' lifetime.

Skipped, saying why, where cupy or a GPU is absent (CI). tools/gpu_tests.sh runs this file with the
rest of the GPU suite.
"""
from __future__ import annotations

import pytest

from tests.harness import free_port, run_ranks
from tests.test_gpu import BODY, REASON, VEC, _all_correct

pytestmark = pytest.mark.skipif(bool(REASON), reason=f"GPU tests: {REASON}")
NODES = "tests.bodies_gpu_nodes:"
SPREAD = {"SPTEST_GPU_SPREAD": "rank"}


@pytest.mark.parametrize("nranks,nodes", [(2, 2), (3, 2), (3, 3)])
def test_p2p_between_nodes(nranks, nodes):
    res = run_ranks(BODY + "p2p_every_dtype_and_size", nranks, timeout=300, env=SPREAD, nodes=nodes)
    _all_correct(res, 30)


@pytest.mark.parametrize("nranks,nodes", [(2, 2), (3, 2)])
def test_collectives_between_nodes(nranks, nodes):
    res = run_ranks(BODY + "collectives", nranks, timeout=500, env=SPREAD, nodes=nodes)
    _all_correct(res, 100)


def test_vector_collectives_between_nodes():
    res = run_ranks(VEC + "vector_collectives", 2, timeout=500, env=SPREAD, nodes=2)
    _all_correct(res, 2000)


def test_stream_order_between_nodes():
    res = run_ranks(BODY + "stream_order", 2, timeout=120, env=SPREAD, nodes=2)
    _all_correct(res)


@pytest.mark.parametrize("nranks,nodes", [(2, 2), (4, 2)])
def test_sizes_around_the_switches_between_nodes(nranks, nodes):
    res = run_ranks(NODES + "switches", nranks, timeout=400, env=SPREAD, nodes=nodes)
    _all_correct(res, 30)


def test_torch_tensors_between_nodes():
    pytest.importorskip("torch")
    res = run_ranks(BODY + "torch_tensors", 2, timeout=180, env=SPREAD, nodes=2)
    assert all(r["ok"] for r in res.results), res.results


@pytest.mark.parametrize("nranks,nodes", [(2, 2), (3, 2)])
def test_bfloat16_between_nodes(nranks, nodes):
    pytest.importorskip("torch")
    res = run_ranks(NODES + "bfloat16_across", nranks, timeout=300, env=SPREAD, nodes=nodes)
    _all_correct(res, 40)


def test_pinned_buffers_are_reused_and_given_back():
    res = run_ranks(NODES + "buffers_given_back", 2, timeout=120, env=SPREAD, nodes=2)
    _all_correct(res)
    assert all(r["pinned_after_close"] == 0 for r in res.results), res.results


def test_torch_backend_large_tensors_between_nodes_with_a_busy_stream():
    pytest.importorskip("torch")
    env = {**SPREAD, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    res = run_ranks(NODES + "torch_backend_large", 2, timeout=180, env=env, nodes=2)
    _all_correct(res, 3)
