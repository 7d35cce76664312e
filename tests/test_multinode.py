"""Jobs across nodes, on simulated nodes of this machine (tests/harness.py run_ranks(nodes=...)): each
block of ranks has a host identity of its own, so its own progress process, and the blocks meet
through SHMPROXY_BOOTSTRAP and talk over the socket transport on loopback. What needs separate
network stacks (a cut link, a stranger on the port) is in tests/test_netns.py."""
from __future__ import annotations

import pytest

from tests.harness import run_ranks

BODY = "tests.bodies_multinode:"
SMALL_CHUNKS = {"SHMPROXY_NET_CHUNK_SIZE": "64K", "SHMPROXY_NET_EAGER_BYTES": "4K"}


@pytest.mark.parametrize("socks", ["1", "3"])
@pytest.mark.parametrize("nranks,nodes", [(2, 2), (4, 2), (5, 3)], ids=["1+1", "2+2", "1+2+2"])
def test_point_to_point_between_nodes(nranks, nodes, socks):
    """Every pair, every size class; one socket per link and three, whose bulk frames take turns and
    may overtake each other while control frames keep their order on socket 0."""
    run_ranks(BODY + "p2p_every_pair", nranks, nodes=nodes, timeout=120, env={"SHMPROXY_SOCKET_NTHREADS": socks})


@pytest.mark.parametrize("ring", ["tree", "ring", "ring-py"])
@pytest.mark.parametrize("nranks,nodes", [(4, 2), (5, 3), (6, 2), (4, 4), (8, 8)],
                         ids=["2+2", "1+2+2", "3+3", "4x1", "8x1"])
def test_every_collective_between_nodes(nranks, nodes, ring):
    """Allreduce between nodes goes around a ring from NET_RING_MIN_BYTES (its reduce-scatter folding
    each segment as it lands), up a tree below: both, at 2-8 nodes of 1-3 ranks, with counts around
    the 64 KiB chunk of float64, float32 and int16 (8192, 16384 and 32768 elements fill one exactly).
    The collectives' frames take the link's C-driven sockets (shm/_wire.c: three, each frame split
    in parts of 4 KiB and more), or, without them ("ring-py", "tree"), the last of the Python-threaded
    sockets (three, one), whose first carries the control frames."""
    env = {**SMALL_CHUNKS, "SHMPROXY_NET_RING_MIN_BYTES": "1G" if ring == "tree" else "1K",
           "SHMPROXY_SOCKET_NTHREADS": "1" if ring == "tree" else "3",
           "SHMPROXY_NET_COLL_SOCKETS": "3" if ring == "ring" else "0", "SHMPROXY_NET_COLL_PART_BYTES": "4K",
           "SHMPROXY_NET_LOCAL_WORKERS": "1" if ring == "ring" else "0"}
    counts = (8191, 8192, 8193, 16384, 32769)
    run_ranks(BODY + "collectives", nranks, nodes=nodes, timeout=240, args=(300 << 10, counts), env=env)


def test_collectives_between_nodes_run_on_the_loop_not_on_woken_workers():
    """The stall of issue 40: chunks of a collective between nodes handed one by one to copy workers
    spread over the progress process's CPUs waited on their wake-ups (docs/decisions.md). Between
    nodes the loop runs the chunks itself: with NET_LOCAL_WORKERS=0 no worker job, while a large
    message within the node still goes to the workers (the counter moves); with 1, a node's local
    reductions and copies (two ranks per node) go to the workers and its frames stay on the loop."""
    env = {"SHMPROXY_NET_CHUNK_SIZE": "256K", "SHMPROXY_COPY_THREADS": "2"}
    res = run_ranks(BODY + "collectives_across_nodes_stay_on_the_loop", 4, nodes=2, timeout=120,
                    args=(4 << 20,), env={**env, "SHMPROXY_NET_LOCAL_WORKERS": "0"})
    for r, out in enumerate(res.results):
        assert out["across"] == 0, (r, out)
    assert any(out["within"] > 0 for out in res.results), res.results
    res = run_ranks(BODY + "collectives_across_nodes_stay_on_the_loop", 4, nodes=2, timeout=120,
                    args=(4 << 20,), env={**env, "SHMPROXY_NET_LOCAL_WORKERS": "1"})
    assert all(out["across"] > 0 for out in res.results), res.results


def test_loop_sleeps_in_c_while_a_collective_between_nodes_waits_on_the_network():
    """With only a collective between nodes in flight, the loop waits for the link's news in C, the
    GIL released (NET_LOOP_WAIT), instead of passing through Python, where the link's reader and
    writer threads queued for the GIL behind it on every chunk (docs/decisions.md, "Collectives across
    nodes run on the loop"). Forced on here: on this small machine the automatic choice is off (a
    spin would take the CPU the threads need). A pass every 1 ms wait at most, where a Python loop
    spinning on sched_yield makes tens of thousands a second."""
    for mode in ("1", "2"):   # spinning in C; asleep on the pool's condvar
        res = run_ranks(BODY + "loop_passes_while_a_collective_waits", 2, nodes=2, timeout=120, args=(1.5,),
                        env={"SHMPROXY_NET_LOOP_WAIT": mode})
        out = res.results[0]
        assert out["seconds"] >= 1.0, (mode, out)   # the heartbeat moved across the wait
        assert out["passes"] < 3000 * out["seconds"], (mode, out)


def test_bench_times_the_raw_sockets_between_the_nodes_in_the_same_run(tmp_path):
    """The link's own limit beside shmproxy's ping-pong (issue 40): one stream, and as many as the
    transport moves a message or a collective's chunk on (SOCKET_NTHREADS x NSOCKS_PERTHREAD or
    NET_COLL_SOCKETS, whichever is more); collectives skip them saying why."""
    import json
    res = run_ranks(BODY + "bench_with_raw_sockets", 2, nodes=2, timeout=120, args=(str(tmp_path),),
                    env={"SHMPROXY_SOCKET_IFNAME": "lo", "SHMPROXY_SOCKET_NTHREADS": "2",
                         "SHMPROXY_NET_COLL_SOCKETS": "3"})
    assert res.results == [0, 0]
    ping = json.loads((tmp_path / "pingpong.json").read_text())
    assert ping["ok"] is True, ping["libraries"]
    assert ping["libraries"] == ["shmproxy", "shmproxy:alloc", "tcp", "tcp-streams"], ping["libraries"]
    for row in ping["results"]:
        for lib in ("tcp", "tcp-streams"):
            assert row["results"][lib]["check"] == "ok" and row["results"][lib]["time_us"] > 0, row
    assert "3 streams over 127.0.0.1" in json.dumps(ping), "tcp-streams uses the collective sockets' count"
    coll = json.loads((tmp_path / "allreduce.json").read_text())
    assert coll["libraries"] == ["shmproxy", "shmproxy:alloc"] and "ping-pong only" in coll["skipped"]["tcp"], \
        coll["skipped"]


def test_split_dup_and_objects_between_nodes():
    run_ranks(BODY + "split_and_objects", 4, nodes=2, timeout=120)


def test_collective_mismatch_between_nodes_names_both_calls():
    res = run_ranks(BODY + "mismatch", 4, nodes=2, timeout=60)
    for r in res.results:
        assert "Allreduce" in r["error"] and "Bcast" in r["error"], r


@pytest.mark.parametrize("what", ["rank", "proxy"])
def test_a_killed_rank_or_progress_process_fails_every_node(what):
    """Rank 3 (node 1) kills itself or its node's progress process mid-collective: every survivor on
    both nodes raises within the bound."""
    res = run_ranks(BODY + "kill_during_collective", 4, nodes=2, timeout=90, args=(3, what),
                    expect_fail={3} if what == "rank" else None, env={"SHMPROXY_TIMEOUT": "60"})
    for r, out in enumerate(res.results):
        if out is None:
            continue
        assert out["seconds"] < 30, out
        assert "PeerDiedError" in out["error"] or "died" in out["error"] or "lost node" in out["error"], (r, out)


def test_outside_dump_shows_links_and_which_node_a_hung_collective_waits_for():
    res = run_ranks(BODY + "hung_collective_dump", 4, nodes=2, timeout=90)
    text = res.results[0]["dump"]
    assert "== nodes: this is node 0 of 2 ==" in text, text
    assert "link to node 1 (ranks [2, 3]): up" in text, text
    assert "waiting on node 1" in text and "collective #" in text, text


def test_abort_on_one_node_fails_every_node():
    res = run_ranks(BODY + "abort_on_one_node", 4, nodes=2, timeout=60, args=(3,))
    for r in (0, 1, 2):
        assert "gave up" in res.results[r]["error"], res.results[r]


def test_ipv6_rendezvous_and_links():
    import socket
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    run_ranks(BODY + "p2p_every_pair", 2, nodes=2, timeout=60, bootstrap=f"[::1]:{port}")


def test_rendezvous_through_mpi4py_under_mpiexec():
    res = run_ranks(BODY + "rendezvous_through_mpi4py", 3, launcher="mpiexec", timeout=90)
    assert all(r["blobs"] == ["rank0", "rank1", "rank2"] for r in res.results)


def test_a_job_across_nodes_without_a_rendezvous_says_which_to_set():
    res = run_ranks("tests.bodies_multinode:init_only", 2, nodes=2, timeout=60, expect_fail={0, 1},
                    env={"SHMPROXY_BOOTSTRAP": None, "SPTEST_HIDE_MPI4PY": "1"})
    for err in res.stderr:
        assert "SHMPROXY_BOOTSTRAP" in err and "torchrun" in err, err
