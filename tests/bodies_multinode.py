"""Rank bodies for tests/test_multinode.py: jobs whose ranks span (simulated or namespaced) nodes."""
from __future__ import annotations

import os
import signal
import time

import numpy as np

import shmproxy
from shmproxy.core import errors

SIZES = [0, 8, 16 << 10, (16 << 10) + 8, (1 << 20) + 3, 5 << 20]


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def p2p_every_pair() -> dict:
    """Every ordered pair moves a message of every size, byte-exact, both directions at once; then
    non-overtaking on one tag with eager and rendezvous sizes interleaved, ANY_SOURCE, truncation."""
    with shmproxy.init() as comm:
        me, n = comm.rank, comm.size
        for nbytes in SIZES:
            reqs, bufs = [], {}
            for p in range(n):
                if p != me:
                    bufs[p] = np.zeros(nbytes + 16, np.uint8)
                    reqs.append(comm.Irecv(bufs[p][:nbytes], p, tag=nbytes % 1000))
            for p in range(n):
                if p != me:
                    reqs.append(comm.Isend(_pattern(nbytes, me * 1000 + p), p, tag=nbytes % 1000))
            shmproxy.Request.Waitall(reqs)
            for p, b in bufs.items():
                assert (b[:nbytes] == _pattern(nbytes, p * 1000 + me)).all(), (nbytes, p)
                assert not b[nbytes:].any(), "written past the message"
        # non-overtaking: rank 0 sends alternating small/large messages on one tag to the last rank
        last = n - 1
        sizes = [8, 3 << 20, 100, 1 << 20, 0, 70000]
        if me == 0:
            for i, s in enumerate(sizes):
                comm.Send(np.full(s, i, np.uint8), last, tag=9)
        elif me == last:
            time.sleep(0.2)   # let every envelope arrive first: unexpected messages keep their order
            for i, s in enumerate(sizes):
                b = np.zeros(s, np.uint8)
                st = comm.Recv(b, 0, tag=9)
                assert st.nbytes == s and (b == i).all(), (i, s, st)
        # ANY_SOURCE across nodes
        if me == 0:
            got = set()
            for _ in range(n - 1):
                b = np.zeros(1, np.int64)
                st = comm.Recv(b, shmproxy.ANY_SOURCE, tag=11)
                assert b[0] == st.source
                got.add(st.source)
            assert got == set(range(1, n))
        else:
            comm.Send(np.array([me], np.int64), 0, tag=11)
        # truncation: the receiver fails, nothing written; the sender completes
        if me == 0:
            comm.Send(np.arange(100, dtype=np.int64), last, tag=12)
            comm.Send(np.arange(1 << 18, dtype=np.int64), last, tag=13)
        elif me == last:
            for tag, count in ((12, 100), (13, 1 << 18)):
                b = np.zeros(count - 1, np.int64)
                try:
                    comm.Recv(b, 0, tag=tag)
                except shmproxy.TruncationError:
                    assert not b.any()
                else:
                    raise AssertionError("no truncation error")
        comm.Barrier()
        return {"ok": True}


def collectives(nbytes_big: int, counts: tuple = ()) -> dict:
    """Every collective, blocking and nonblocking, IN_PLACE where it exists, small and over several
    chunks (and at ``counts``: around a chunk or algorithm switch), against numpy."""
    with shmproxy.init() as comm:
        me, n = comm.rank, comm.size
        for count in (1, 7, *counts, nbytes_big // 8):
            x = np.arange(count, dtype=np.float64) + me
            y = np.zeros(count)
            comm.Allreduce(x, y)
            assert np.array_equal(y, sum(np.arange(count, dtype=np.float64) + r for r in range(n)))
            z = x.copy()
            comm.Iallreduce(shmproxy.IN_PLACE, z, op=shmproxy.MAX).Wait()
            assert np.array_equal(z, np.arange(count, dtype=np.float64) + n - 1)
            a = np.full(count, float(me + 1), np.float32)
            comm.Allreduce(shmproxy.IN_PLACE, a, op=shmproxy.AVG)
            assert np.allclose(a, (n + 1) / 2), a[:3]
            ints = np.full(count, me + 1, np.int32)
            p = np.zeros(count, np.int32)
            comm.Allreduce(ints, p, op=shmproxy.PROD)
            assert (p == np.prod(np.arange(1, n + 1))).all()
            for root in (0, n - 1):
                b = np.arange(count, dtype=np.int64) * (root + 1) if me == root else np.zeros(count, np.int64)
                comm.Ibcast(b, root=root).Wait()
                assert (b == np.arange(count) * (root + 1)).all()
                r = np.zeros(count) if me == root else None
                comm.Reduce(x, r, root=root)
                if me == root:
                    assert np.array_equal(r, sum(np.arange(count, dtype=np.float64) + q for q in range(n)))
            g = np.zeros(count * n, np.int16)
            comm.Allgather(np.full(count, me, np.int16), g)
            assert (g == np.repeat(np.arange(n), count)).all()
            g2 = np.zeros(count * n, np.int16)
            g2[me * count:(me + 1) * count] = me + 5
            comm.Iallgather(shmproxy.IN_PLACE, g2).Wait()
            assert (g2 == np.repeat(np.arange(n) + 5, count)).all()
            s = np.arange(count * n, dtype=np.int64) + 1000 * me
            t = np.zeros(count * n, np.int64)
            comm.Ialltoall(s, t).Wait()
            exp = np.concatenate([np.arange(me * count, (me + 1) * count) + 1000 * q for q in range(n)])
            assert (t == exp).all()
            rs = np.zeros(count)
            full = np.arange(count * n, dtype=np.float64)
            comm.Reduce_scatter_block(full, rs)
            assert np.array_equal(rs, n * full[me * count:(me + 1) * count])
            ip = full.copy()
            comm.Ireduce_scatter_block(shmproxy.IN_PLACE, ip).Wait()
            assert np.array_equal(ip[:count], n * full[me * count:(me + 1) * count])
            # non-integer values, whose sums depend on the order: every rank must hold the same bits
            rnd = np.random.default_rng(1000 + me).standard_normal(count).astype(np.float32)
            rnd[::97] = np.nan if count > 200 else rnd[::97]
            res = np.empty_like(rnd)
            comm.Allreduce(rnd, res)
            every = np.empty(count * n, np.float32)
            comm.Allgather(res, every)
            rows = every.reshape(n, count).view(np.uint32)
            assert (rows == rows[0]).all(), "ranks hold different bits of one Allreduce"
            want = sum(np.random.default_rng(1000 + q).standard_normal(count).astype(np.float64) for q in range(n))
            finite = ~np.isnan(res)
            assert np.allclose(res[finite], want[finite], rtol=1e-4, atol=1e-4)
        comm.Barrier()
        comm.Ibarrier().Wait()
        return {"ok": True}


def split_and_objects() -> dict:
    """Split across nodes (by parity: every child spans nodes when the layout alternates), by node
    (children within one node), UNDEFINED, Dup; collectives on each; the object layer."""
    with shmproxy.init() as comm:
        me, n = comm.rank, comm.size
        odd = comm.Split(me % 2, key=-me)
        assert odd.size == len(range(me % 2, n, 2)) and odd.rank == sorted(range(me % 2, n, 2), reverse=True).index(me)
        s = np.zeros(1)
        odd.Allreduce(np.array([float(me)]), s)
        assert s[0] == sum(range(me % 2, n, 2)), s
        node = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) and comm.node_layout["rank_node"][me]
        local = comm.Split(node)
        assert local.size == comm.local_size, (local.size, comm.local_size)
        t = np.zeros(1)
        local.Allreduce(np.array([1.0]), t)
        assert t[0] == comm.local_size
        none = comm.Split(shmproxy.UNDEFINED if me == 0 else 1)
        assert (none is None) == (me == 0)
        dup = comm.Dup()
        objs = dup.allgather({"rank": me, "data": list(range(me))})
        assert [o["rank"] for o in objs] == list(range(n))
        assert dup.bcast({"x": np.arange(3)} if me == n - 1 else None, root=n - 1)["x"].tolist() == [0, 1, 2]
        assert dup.allreduce(me) == sum(range(n))
        if me == 0:
            dup.send({"big": np.ones(1 << 19)}, n - 1, tag=4)
        elif me == n - 1:
            assert dup.recv(0, tag=4)["big"].sum() == 1 << 19
        for c in (odd, local, dup) + ((none,) if none is not None else ()):
            c.close()
        return {"ok": True}


def mismatch() -> dict:
    """The last node's ranks call Bcast where the others call Allreduce: every rank fails, naming
    both calls."""
    comm = shmproxy.init()
    try:
        if comm.node_layout["rank_node"][comm.rank] == max(comm.node_layout["rank_node"]):
            comm.Bcast(np.zeros(4), root=0)
        else:
            comm.Allreduce(np.zeros(4), np.zeros(4))
    except shmproxy.InvalidUsage as exc:
        assert "mismatch" in str(exc), str(exc)
        return {"error": str(exc)}
    finally:
        comm.close()
    raise AssertionError("no mismatch detected")


def kill_during_collective(victim: int, what: str) -> dict:
    """Rank ``victim`` SIGKILLs itself (what='rank') or its node's progress process (what='proxy') in
    the middle of a stream of Allreduces; every survivor must raise within the bound."""
    comm = shmproxy.init()
    me = comm.rank
    x = np.ones(1 << 18)
    y = np.zeros_like(x)
    t0 = time.monotonic()
    try:
        for i in range(1000000):
            if i == 20 and me == victim:
                if what == "proxy":
                    os.kill(comm._proxy.pid, signal.SIGKILL)
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
            comm.Allreduce(x, y)
    except errors.ProxyError as exc:
        took = time.monotonic() - t0
        comm.close()
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": took}
    raise AssertionError("the collectives went on")


def cut_link(cut_cmd: list, after: int) -> dict:
    """Rank 0 pulls a cable (``cut_cmd``) after ``after`` Allreduces; every rank must then raise."""
    import subprocess
    comm = shmproxy.init()
    x = np.ones(1 << 16)
    y = np.zeros_like(x)
    cut_at = None
    try:
        for i in range(10 ** 7):
            if i == after and comm.rank == 0:
                subprocess.run(cut_cmd, check=True, timeout=30)
                cut_at = time.time()
            comm.Allreduce(x, y)
    except errors.ProxyError as exc:
        comm.close()
        return {"error": f"{type(exc).__name__}: {exc}", "ended": time.time(), "cut": cut_at}
    raise AssertionError("the collectives went on")


def stranger_on_the_port() -> dict:
    """Rank 0 knocks on node 1's port as a stranger would (junk, a wrong secret, a truncated hello, a
    silent connection, a flood); node 1 drops each, logs it, and the job goes on."""
    import json
    import socket
    import struct
    with shmproxy.init() as comm:
        if comm.rank == 0:
            info = json.loads(bytes.fromhex(comm.node_layout["infos"][1]))
            addr = (info["ip"], info["port"])
            magic = b"SHMPXN01"
            payloads = [
                np.random.default_rng(1).integers(0, 256, 40, dtype=np.uint8).tobytes(),
                magic + b"\0" * 16 + struct.pack("<IIII", 0, 0, 0, 1),     # the wrong secret
                magic + b"\1" * 5,                                         # truncated
                b"",                                                       # says nothing
                np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes(),
            ]
            silent = []
            for p in payloads:
                s = socket.create_connection(addr, timeout=5)
                if p:
                    try:
                        s.sendall(p)
                    except OSError:
                        pass   # dropped while we were still sending: that is the point
                if p == b"":
                    silent.append(s)   # held open through the collectives below
                else:
                    s.close()
        comm.Barrier()
        for k in range(5):
            x = np.full(1000, float(comm.rank + k))
            y = np.zeros(1000)
            comm.Allreduce(x, y)
            assert (y == sum(r + k for r in range(comm.size))).all()
        b = np.zeros(100000, np.uint8)
        if comm.rank == 0:
            comm.Send(np.full(100000, 7, np.uint8), comm.size - 1, tag=1)
        elif comm.rank == comm.size - 1:
            comm.Recv(b, 0, tag=1)
            assert (b == 7).all()
        if comm.rank == 0:
            for s in silent:
                s.close()
        comm.Barrier()
        return {"ok": True}


def hung_collective_dump() -> dict:
    """Node 0's ranks enter an Allreduce that node 1's have not joined: the outside dump of node 0's
    progress process (shmproxy-dump, nothing prepared) must say it waits for node 1 and show the link.
    Then rank 0 lets node 1 in, and the collective completes."""
    import subprocess
    import sys
    with shmproxy.init() as comm:
        node = comm.node_layout["rank_node"][comm.rank]
        x, y = np.ones(8), np.zeros(8)
        text = ""
        if node == 0:
            req = comm.Iallreduce(x, y)
            if comm.rank == 0:
                deadline = time.monotonic() + 20
                while "waiting on node 1" not in text and time.monotonic() < deadline:
                    text = subprocess.run([sys.executable, "-m", "shmproxy.tools.dump_cli", "--pid",
                                           str(comm._proxy.pid), "--outside"], capture_output=True, text=True,
                                          timeout=60).stdout
                for r in range(comm.size):
                    if comm.node_layout["rank_node"][r] == 1:
                        comm.Send(np.zeros(1), r, tag=77)
            req.Wait()
        else:
            comm.Recv(np.zeros(1), 0, tag=77)
            comm.Allreduce(x, y)
        assert (y == comm.size).all()
        return {"dump": text}


def abort_on_one_node(victim: int) -> dict:
    """Rank ``victim`` calls Abort while the others wait in an Allreduce: every rank on every node
    raises, naming the abort."""
    comm = shmproxy.init()
    try:
        # Everybody has joined once the victim leaves the Barrier; the others may not have seen its end
        # yet when the abort comes, so the abort meets every rank inside a collective, this one or the next.
        comm.Barrier()
        if comm.rank == victim:
            comm.Abort("the victim gave up")
            return {"aborted": True}
        comm.Allreduce(np.ones(4), np.zeros(4))
    except errors.ProxyError as exc:
        comm.close()
        return {"error": f"{type(exc).__name__}: {exc}"}
    raise AssertionError("the Allreduce completed without the victim")


def rendezvous_through_mpi4py() -> dict:
    """Under a real mpiexec, the rendezvous's mpi4py path: one allgather of every rank's blob."""
    from shmproxy.control import bootstrap, rendezvous
    from shmproxy.core import params as PM
    info = bootstrap.detect()
    p = PM.Params(env={})
    assert rendezvous.method(info, p) == "mpi4py", rendezvous.method(info, p)
    blobs = rendezvous.allgather(info, p, f"rank{info.rank}".encode(), 30.0)
    return {"blobs": [b.decode() for b in blobs]}


def init_only() -> None:
    """shmproxy.init() with mpi4py made unimportable (SPTEST_HIDE_MPI4PY): a job across nodes with no
    rendezvous must fail at init, naming what to set."""
    import sys
    if os.environ.get("SPTEST_HIDE_MPI4PY"):
        sys.modules["mpi4py"] = None   # type: ignore[assignment]  # import mpi4py now raises ImportError
    shmproxy.init()


def collectives_across_nodes_stay_on_the_loop(nbytes: int) -> dict:
    """Collectives between nodes hand no job to the progress process's copy workers (their chunks
    wait on the network between local steps, and a worker woken per chunk on another CPU stalled
    them: docs/decisions.md), and their results are right; a message within the node, as large,
    does use the workers (so the counter the check reads moves at all)."""
    from shmproxy.shm import pool as P
    with shmproxy.init() as comm:
        me, n = comm.rank, comm.size
        jobs_q = P.CTRL_OFF // 8 + P.CTRL_N_COPY_JOBS
        count = nbytes // 8
        x = np.arange(count, dtype=np.float64) + me
        y = np.empty_like(x)
        before = int(comm._q[jobs_q])
        comm.Allreduce(x, y)
        assert np.array_equal(y, n * np.arange(count, dtype=np.float64) + n * (n - 1) / 2)
        b = x.copy() if me == 1 else np.empty_like(x)
        comm.Bcast(b, root=1)
        assert np.array_equal(b, np.arange(count, dtype=np.float64) + 1)
        g = np.empty(count * n)
        comm.Allgather(x, g)
        assert np.array_equal(g.reshape(n, count), np.arange(count) + np.arange(n)[:, None])
        comm.Barrier()
        across = int(comm._q[jobs_q]) - before
        # within the node: local rank 0 sends its node's local rank 1 a message of the same size
        layout = comm.node_layout["rank_node"]
        mates = [r for r in range(n) if layout[r] == layout[me]]
        before_p2p = int(comm._q[jobs_q])
        if me == mates[0]:
            comm.Send(x, mates[1], tag=5)
        elif me == mates[1]:
            got = np.empty_like(x)
            comm.Recv(got, mates[0], tag=5)
            assert np.array_equal(got, np.arange(count, dtype=np.float64) + mates[0])
        comm.Barrier()
        within = int(comm._q[jobs_q]) - before_p2p
        return {"across": across, "within": within}


def loop_passes_while_a_collective_waits(delay_s: float) -> dict:
    """Node 1's rank enters an Allreduce ``delay_s`` late; node 0's progress loop, with that
    collective in flight and nothing else, counts its Python passes meanwhile (CTRL_N_PASSES, as of
    its last heartbeat). The result is checked too."""
    from shmproxy.shm import pool as P
    with shmproxy.init() as comm:
        passes_q = P.CTRL_OFF // 8 + P.CTRL_N_PASSES
        beat_q = P.CTRL_OFF // 8 + P.CTRL_HEARTBEAT
        x = np.full(1 << 16, comm.rank + 1.0)
        y = np.empty_like(x)
        comm.Allreduce(x, y)   # links and buffers warm
        comm.Barrier()
        if comm.rank == 1:
            time.sleep(delay_s)   # the wait under test, not a synchronisation
        before, beat0 = int(comm._q[passes_q]), int(comm._q[beat_q])
        comm.Allreduce(x, y)
        after, beat1 = int(comm._q[passes_q]), int(comm._q[beat_q])
        assert np.all(y == comm.size * (comm.size + 1) / 2)
        return {"passes": after - before, "seconds": (beat1 - beat0) / 1e9}


def bench_with_raw_sockets(out_dir: str) -> int:
    """shmproxy-bench across the nodes with the raw-socket peers: the ping-pong (timed against one
    stream and against as many as shmproxy's link has), then an allreduce (which they skip)."""
    from shmproxy.tools.bench.cli import main
    rc = main(["pingpong", "-b", "8", "-e", "1M", "-f", "128", "-n", "20", "-w", "2", "--no-progress",
               "--peers", "tcp,tcp-streams", "--json", f"{out_dir}/pingpong.json"])
    rc |= main(["allreduce", "-b", "8", "-e", "64", "-f", "8", "-n", "5", "-w", "1", "--no-progress",
                "--peers", "tcp", "--json", f"{out_dir}/allreduce.json"])
    return rc
