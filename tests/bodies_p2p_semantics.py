"""Rank bodies of tests/test_p2p_semantics.py: MPI's point-to-point modes (standard sends buffered by
the progress process below SEND_BUFFER_BYTES, with flow control; synchronous sends), probes, matched
probes, cancel, the object layer's wildcards and nonblocking calls, and what close does with sends
nobody received.

An Iprobe is a round trip to the progress process that follows every op the rank posted before it
(one rank's records are handled in posting order), so after it the engine has seen those sends: the
bodies use it to check what completed without sleeping.
"""
from __future__ import annotations

import os
import time

import numpy as np

import shmproxy
from shmproxy.core.ops import FLAG_PROBE_BLOCK, FLAG_PROBE_MATCHED
from shmproxy.rank import objects
from shmproxy.shm import pool as P
from shmproxy import MPI

A, T = shmproxy.ANY_SOURCE, shmproxy.ANY_TAG


def send_then_recv_exchange() -> None:
    """Both ranks Send, then Recv: a small message is buffered, so neither waits for the other; a large
    one is exchanged with Isend (its send completes once the receive took it)."""
    with shmproxy.init() as comm:
        peer = 1 - comm.rank
        for n in (1, 4, 32 // 8 * 2, 1024, 8192):       # int64 elements; up to 64 KiB
            out = np.full(n, comm.rank + 10 * n, np.int64)
            got = np.zeros(n, np.int64)
            comm.Send(out, peer, tag=n)
            st = comm.Recv(got, peer, tag=n)
            assert (got == peer + 10 * n).all() and st.nbytes == out.nbytes, (n, got[:4], st)
        big = np.full(1 << 18, comm.rank, np.float64)   # 2 MiB: not buffered
        got = np.zeros_like(big)
        rq = comm.Isend(big, peer, tag=99)
        comm.Recv(got, peer, tag=99)
        rq.Wait(timeout=30)
        assert (got == peer).all()
        comm.Barrier()


def buffered_bytes_are_bounded(nmsg: int, nbytes: int, per_peer: int) -> dict:
    """Rank 0 posts ``nmsg`` sends of ``nbytes`` to rank 1, which receives nothing until a Barrier:
    only those within SEND_BUFFER_PER_PEER (``per_peer``) complete before it; the rest wait for their
    receives (flow control), and every message arrives, in order."""
    with shmproxy.init() as comm:
        n = nbytes // 8
        if comm.rank == 0:
            reqs = [comm.Isend(np.full(n, i, np.int64), 1, tag=5) for i in range(nmsg)]
            fit = per_peer // nbytes
            # buffered after a grace of about their copy's time (SEND_BUFFER_GRACE_US_PER_KIB), not at once
            shmproxy.Request.Waitall(reqs[:fit], timeout=30)
            assert comm.Iprobe(1, 5) is None     # the round trip: every send above reached the engine
            done = [rq.Test() for rq in reqs]
            comm.Barrier()
            shmproxy.Request.Waitall(reqs, timeout=30)
            assert done == [True] * fit + [False] * (nmsg - fit), done
            return {"done_early": sum(done)}
        comm.Barrier()
        for i in range(nmsg):
            got = np.zeros(n, np.int64)
            comm.Recv(got, 0, tag=5)
            assert (got == i).all(), (i, got[:3])
        return {}


def buffered_and_unbuffered_do_not_overtake() -> None:
    """On one (source, tag): a buffered small send, a large one, a synchronous small one, a buffered
    small one: received in sending order (the buffered copy keeps its send's place in matching)."""
    with shmproxy.init() as comm:
        sizes = [16, 300_000, 16, 24, 8]
        if comm.rank == 0:
            reqs = []
            for i, nb in enumerate(sizes):
                buf = np.full(nb, i + 1, np.uint8)
                reqs.append(comm.Issend(buf, 1, tag=3) if i == 2 else comm.Isend(buf, 1, tag=3))
            shmproxy.Request.Waitall([reqs[0], reqs[3], reqs[4]], timeout=30)   # buffered: no receive needed
            comm.Iprobe(1, 3)
            early = [rq.Test() for rq in reqs]
            assert early == [True, False, False, True, True], early
            comm.Barrier()
            shmproxy.Request.Waitall(reqs, timeout=30)
        else:
            comm.Barrier()
            for i, nb in enumerate(sizes):
                got = np.zeros(300_000, np.uint8)
                st = comm.Recv(got, A, T)
                assert (st.source, st.tag, st.nbytes) == (0, 3, nb) and (got[:nb] == i + 1).all(), (i, st)


def ssend_waits_for_its_receive() -> None:
    """A synchronous send of 8 bytes is not complete before the receive is posted; a standard one
    of the same size is (buffered)."""
    with shmproxy.init() as comm:
        if comm.rank == 0:
            sync = comm.Issend(np.arange(1, dtype=np.int64), 1, tag=1)
            std = comm.Isend(np.arange(1, dtype=np.int64), 1, tag=2)
            std.Wait(timeout=30)   # buffered: complete without its receive
            comm.Iprobe(1, 0)
            assert not sync.Test()
            comm.Barrier()
            comm.Barrier()      # rank 1 posted its receive in between
            sync.Wait(timeout=30)
            comm.Ssend(np.ones(3), 1, tag=4)
        else:
            comm.Barrier()
            got = np.zeros(1, np.int64)
            comm.Recv(got, 0, tag=1)
            comm.Barrier()
            comm.Recv(got, 0, tag=2)
            comm.Recv(np.zeros(3), 0, tag=4)


def probes() -> None:
    """Probe/Iprobe leave the message; Mprobe/Improbe take it, and only the Message's Recv receives it;
    blocking probes that wait for a message posted later; a large (unbuffered) message through Mprobe."""
    with shmproxy.init() as comm:
        if comm.rank == 0:
            for tag in (1, 2, 3):
                comm.Send(np.full(tag, tag, np.int32), 1, tag=tag)
            comm.Barrier()
            comm.Barrier()
            comm.Send(np.full(9, 9, np.int32), 1, tag=9)
            big = np.arange(1 << 17, dtype=np.float64)
            comm.Send(big, 1, tag=10)
            return
        comm.Barrier()
        assert comm.Iprobe(0, 5) is None
        st = comm.Probe(A, T)
        assert (st.source, st.tag, st.nbytes) == (0, 1, 4), st
        st = comm.Iprobe(0, 2)
        assert (st.source, st.tag, st.nbytes) == (0, 2, 8), st
        msg = comm.Mprobe(0, T)
        assert (msg.status.tag, msg.status.nbytes) == (1, 4)
        got = np.zeros(3, np.int32)
        st = comm.Recv(got, A, T)               # tag 1 is held by msg: the next one is tag 2
        assert st.tag == 2 and list(got[:2]) == [2, 2], (st, got)
        got1 = np.zeros(1, np.int32)
        st = msg.Recv(got1)
        assert st.tag == 1 and got1[0] == 1
        m3 = comm.Improbe(0, 3)
        assert m3 is not None and comm.Improbe(0, 3) is None and comm.Iprobe(A, T) is None
        m3.Recv(got)
        assert list(got) == [3, 3, 3]
        waiting = comm._posting.probe(0, 9, FLAG_PROBE_BLOCK)      # Probe, posted before the message exists
        mwaiting = comm._posting.probe(0, 10, FLAG_PROBE_BLOCK | FLAG_PROBE_MATCHED)   # Mprobe likewise
        comm.Barrier()
        st = waiting.Wait(timeout=30)
        assert (st.tag, st.nbytes) == (9, 36), st
        st10 = mwaiting.Wait(timeout=30)
        assert (st10.tag, st10.nbytes) == (10, 8 << 17), st10
        comm.Recv(np.zeros(9, np.int32), 0, 9)
        big = np.zeros(1 << 17)
        shmproxy.Message(comm, mwaiting._seq, st10).Recv(big)
        assert (big == np.arange(1 << 17)).all()


def cancel() -> None:
    """A posted receive cancelled completes as cancelled and takes nothing; a later message goes to a
    new receive. A completed receive cannot be cancelled. An unmatched large send can be."""
    with shmproxy.init() as comm:
        if comm.rank == 1:
            buf = np.full(4, -1, np.int32)
            rq = comm.Irecv(buf, 0, tag=7)
            assert rq.Cancel() is True
            st = rq.Wait(timeout=10)
            assert st.cancelled and (buf == -1).all(), st
            assert rq.Cancel() is False
            comm.Barrier()
            st = comm.Recv(buf, 0, tag=7)
            assert not st.cancelled and (buf == 7).all()
            assert comm.Iprobe(0, 8) is None      # rank 0 cancelled its large send
            comm.Barrier()
        else:
            comm.Barrier()
            comm.Send(np.full(4, 7, np.int32), 1, tag=7)
            rq = comm.Isend(np.zeros(1 << 18), 1, tag=8)
            assert rq.Cancel() is True and rq.Wait(timeout=10).cancelled
            comm.Barrier()


def object_wildcards_and_nonblocking() -> None:
    """The object layer: recv() with its defaults (ANY_SOURCE, ANY_TAG), recv_status, isend/irecv,
    sendrecv, probe/iprobe; and a wildcard recv does not take the object collectives' traffic."""
    with shmproxy.init() as comm:
        r, size = comm.rank, comm.size
        if r != 0:
            comm.send({"from": r, "big": np.full(100_000, r)}, 0, tag=r)
        else:
            seen = set()
            for _ in range(size - 1):
                obj, st = objects.recv_status(comm)
                assert obj["from"] == st.source == st.tag and (obj["big"] == st.source).all(), (obj, st)
                seen.add(st.source)
            assert seen == set(range(1, size))
        comm.barrier()
        right, left = (r + 1) % size, (r - 1) % size
        assert comm.sendrecv(("x", r), right, 11, left, 11) == ("x", left)
        rq = comm.irecv(left, 12)
        done, _ = rq.test()
        sq = comm.isend([r] * 3, right, 12)
        assert rq.wait() == [left] * 3 and rq.status.source == left
        sq.wait()
        comm.barrier()
        if r == 0:
            st = comm.probe()
            assert st.source == 1 and st.tag == 13, st
            assert comm.iprobe(1, 14) is None
            assert comm.recv(1) == "p"
        elif r == 1:
            comm.send("p", 0, 13)
        # a wildcard recv posted while rank 1 is already in a collective does not take its message
        if r == 0:
            rq = comm.irecv()
            assert comm.allgather(r) == list(range(size))
            comm.send("to self", 0, 15)
            assert rq.wait() == "to self"
        else:
            assert comm.allgather(r) == list(range(size))
        comm.barrier()


def close_with_unmatched_sends(marker: str) -> dict:
    """Rank 1 closes with a small send (buffered: complete) and a large one that rank 0, alive, never
    receives: close abandons the large one at once, saying so, instead of waiting for the timeout.
    Rank 0 (whose own close waits for every local rank) stays open until rank 1 closed (a marker
    file), then still receives the buffered message of the rank that left."""
    comm = shmproxy.init()
    comm.Barrier()
    if comm.rank == 1:
        small = comm.Isend(np.zeros(4, np.int32), 0, tag=41)
        comm.Isend(np.zeros(1 << 18), 0, tag=42)
        # The small one completes once the progress process buffered it, a grace period after it took
        # it; a close before that cancels it like any send no receive took (rank/lifecycle.py).
        small.Wait()
        t0 = time.monotonic()
        comm.close()
        took = time.monotonic() - t0
        open(marker, "w").close()
        return {"close_s": took}
    deadline = time.monotonic() + 30
    while not os.path.exists(marker):
        assert time.monotonic() < deadline, "rank 1 never closed"
        time.sleep(0.005)    # waiting for another process's file, not synchronising with shmproxy
    got = np.full(4, -1, np.int32)
    st = comm.Recv(got, 1, tag=41)   # the buffered message is still there after its sender closed
    assert st.nbytes == 16 and (got == 0).all()
    try:
        comm.Recv(np.zeros(1 << 18), 1, tag=42)
    except shmproxy.InvalidUsage:
        pass                          # abandoned with its sender: the receive fails at once
    else:
        raise AssertionError("received a send its sender abandoned")
    comm.close()
    return {}


def mpi_point_to_point() -> None:
    """shmproxy.MPI: the standard-mode exchange (both ranks Send, then Recv), Ssend, Probe/Iprobe/
    Mprobe/Improbe with Status, Message.Recv, Request.Cancel and Is_cancelled, the object layer's
    recv() with its defaults, isend/irecv, sendrecv, probe/iprobe and mprobe."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    other = 1 - rank
    st = MPI.Status()
    got = np.zeros(4, "i")
    comm.Send([np.full(4, rank, "i"), MPI.INT], dest=other, tag=1)
    comm.Recv([got, MPI.INT], source=other, tag=1, status=st)
    assert got.tolist() == [other] * 4 and st.Get_count(MPI.INT) == 4
    if rank == 0:
        comm.Ssend(np.arange(3, dtype="d"), 1, tag=2)
        comm.Send(np.arange(6, dtype="d"), 1, tag=3)
        comm.Send(np.arange(2, dtype="d"), 1, tag=4)
    else:
        assert comm.Probe(0, 2, st) and (st.source, st.tag, st.Get_count(MPI.DOUBLE)) == (0, 2, 3)
        comm.Recv(np.zeros(3), 0, 2)
        comm.Probe(MPI.ANY_SOURCE, 3)
        assert comm.Iprobe(0, 3, st) and st.Get_count(MPI.DOUBLE) == 6
        assert not comm.Iprobe(0, 99)
        msg = comm.Mprobe(0, MPI.ANY_TAG, st)
        assert st.tag == 3 and msg
        buf = np.zeros(st.Get_count(MPI.DOUBLE))
        msg.Recv([buf, MPI.DOUBLE], st)
        assert buf.tolist() == list(range(6)) and not msg
        while (m := comm.Improbe(0, 4, st)) is None:
            pass
        out = np.zeros(2)
        m.Irecv(out).Wait()
        assert out.tolist() == [0, 1]
        r = comm.Irecv(np.zeros(1), 0, 77)
        r.Cancel()
        r.Wait(st)
        assert st.Is_cancelled()
    comm.Barrier()
    # objects
    if rank == 0:
        comm.send("a", 1, tag=5)
        comm.isend(["b"], 1, tag=6).wait()
        comm.send({"c": 3}, 1, tag=7)
        comm.send(4, 1, tag=8)
    else:
        assert comm.recv(status=st) == "a" and (st.source, st.tag) == (0, 5)
        assert comm.irecv(source=0, tag=6).wait() == ["b"]
        assert comm.probe(0, 7, st) and st.tag == 7
        msg = comm.mprobe(0, MPI.ANY_TAG, st)
        assert st.tag == 7 and msg.recv() == {"c": 3}
        while not comm.iprobe(0, 8):
            pass
        assert comm.recv(None, 0) == 4
    assert comm.sendrecv(rank, other, 9, source=other, recvtag=9) == other
    comm.Barrier()


def buffering_waits_out_its_grace(grace: bool) -> dict:
    """A 64 KiB standard send that finds no receive: with a grace (SEND_BUFFER_GRACE_US_PER_KIB large)
    it is not copied nor complete until a receive posted later takes it, with one copy; without one
    (0) it is buffered and complete before any receive. Returns the progress process's count of
    buffered sends (the dump's buffered_sends)."""
    with shmproxy.init() as comm:
        data = np.arange(8192, dtype=np.int64)
        if comm.rank == 0:
            req = comm.Isend(data, 1, tag=4)
            if grace:
                assert comm.Iprobe(1, 4) is None   # the round trip: the send reached the engine
                assert not req.Test()              # waiting out its grace, unbuffered
                comm.Barrier()                     # rank 1 posts its receive after this
                req.Wait(timeout=30)
            else:
                req.Wait(timeout=30)               # buffered: complete without its receive
                comm.Barrier()
            comm.Barrier()
            return {"buffered": int(comm._q[P.CTRL_OFF // 8 + P.CTRL_N_BUFFERED])}
        comm.Barrier()
        got = np.zeros(8192, np.int64)
        comm.Recv(got, 0, tag=4)
        assert (got == data).all()
        comm.Barrier()
        return {}
