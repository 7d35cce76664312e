"""Rank bodies for tests/test_coll.py: nonblocking collectives in flight together, with point-to-point
traffic and blocking calls, on several communicators at once (Dup, Split), and their completion
(Test, Wait with a timeout, close with some outstanding).

Shared inputs and helpers live in tests/bodies_coll.py.
"""
from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np

import shmproxy
from tests.bodies_coll import _pat


def overlap_with_p2p(rounds: int) -> dict:
    """Iallreduce (large) and Ibcast in flight while ring exchanges with tags that a collective might
    use internally (0, -1, the 64-bit extremes) run; everything completes in one Waitall."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        right, left = (r + 1) % n, (r - 1) % n
        count = 1 << 20
        big = comm.alloc(count, np.float32)
        big[:] = _pat(count, r)
        big_out = np.zeros(count, np.float32)
        small = np.zeros(1000, np.int32)
        if r == n - 1:
            small[:] = np.arange(1000)
        tags = [0, 1, -1, 2**63 - 1, -(2**63) + 1, 12345]   # -(2**63) is ANY_TAG
        for rnd in range(rounds):
            coll = [comm.Iallreduce(big, big_out), comm.Ibcast(small, root=n - 1)]
            outs, p2p = [], []
            for t in tags:
                for nbytes in (8, 100_000, 1 << 20):
                    o = np.zeros(nbytes, np.uint8)
                    outs.append((o, t, nbytes))
                    p2p.append(comm.Irecv(o, left, tag=t))
                    payload = np.full(nbytes, (r * 31 + t + nbytes + rnd) % 251, np.uint8)
                    p2p.append(comm.Isend(payload, right, tag=t))
            # a second wave of collectives posted behind the point-to-point traffic
            out16 = np.zeros(16, np.int32)
            coll.append(comm.Iallreduce(np.full(16, r, np.int32), out16, op=shmproxy.MAX))
            shmproxy.Request.Waitall(p2p + coll)
            for o, t, nbytes in outs:
                if not np.all(o == (left * 31 + t + nbytes + rnd) % 251):
                    raise AssertionError(f"rank {r} round {rnd}: p2p tag {t} {nbytes} B from {left}: "
                                         "wrong data")
            want = sum(_pat(count, q) for q in range(n)) if n > 1 else _pat(count, 0)
            if not np.array_equal(big_out, want):
                raise AssertionError(f"rank {r} round {rnd}: Iallreduce overlapped with p2p: wrong result")
            if not np.array_equal(small, np.arange(1000)):
                raise AssertionError(f"rank {r} round {rnd}: Ibcast overlapped with p2p: wrong result")
            if not np.all(out16 == n - 1):
                raise AssertionError(f"rank {r} round {rnd}: Iallreduce after p2p: {out16.tolist()}")
            big_out[:] = 0
        return {"rounds": rounds}


def outstanding_then_blocking() -> dict:
    """Several nonblocking collectives outstanding, then blocking ones on the same communicator
    (MPI ordering: all complete in posting order), then Waitall in reverse order."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        outs = [np.zeros(1000, np.int64) for _ in range(5)]
        reqs = [comm.Iallreduce(np.full(1000, r + i, np.int64), outs[i]) for i in range(5)]
        b = np.full(10, r, np.int16)
        comm.Bcast(b, root=0)
        comm.Barrier()
        y = np.zeros(3, np.float64)
        comm.Allreduce(np.full(3, 1.0), y)
        for q in reversed(reqs):
            q.Wait()
        for i in range(5):
            assert np.all(outs[i] == n * (n - 1) // 2 + n * i), (i, outs[i][:3])
        assert np.all(b == 0) and np.all(y == n), (b, y)
        return {"ok": True}


def multi_comm() -> dict:
    """Dup and Split: collectives interleaved on two communicators (nonblocking, posted in opposite
    orders on even and odd ranks), sub-communicators of different colors at the same time, and one
    communicator progressing while another has an unmatched operation."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        out: dict[str, Any] = {}
        dup = comm.Dup()
        assert (dup.rank, dup.size) == (r, n), (dup.rank, dup.size)
        for it in range(20):
            a, b = np.zeros(5000, np.int32), np.zeros(5000, np.int32)
            sa, sb = np.full(5000, r + it, np.int32), np.full(5000, 100 * r, np.int32)
            if r % 2 == 0:
                ra = comm.Iallreduce(sa, a)
                rb = dup.Iallreduce(sb, b, op=shmproxy.MAX)
            else:
                rb = dup.Iallreduce(sb, b, op=shmproxy.MAX)
                ra = comm.Iallreduce(sa, a)
            if it % 2:
                rb.Wait()
                ra.Wait()
            else:
                ra.Wait()
                rb.Wait()
            assert np.all(a == n * (n - 1) // 2 + n * it), (it, a[:3])
            assert np.all(b == 100 * (n - 1)), (it, b[:3])
            # blocking, interleaved in the same order everywhere
            x = np.full(7, r, np.float64) if r == 0 else np.zeros(7)
            comm.Bcast(x, root=0)
            y = np.full(7, r, np.float64) if r == n - 1 else np.zeros(7)
            dup.Bcast(y, root=n - 1)
            assert np.all(x == 0) and np.all(y == n - 1), (x, y)
        out["dup_iterations"] = 20

        # Split by parity, key reversing the order: both colors run at the same time
        color = r % 2
        sub = comm.Split(color, key=-r)
        members = [q for q in range(n) if q % 2 == color]
        want_rank = sorted(members, key=lambda q: -q).index(r)
        assert (sub.rank, sub.size) == (want_rank, len(members)), (sub.rank, sub.size, want_rank, members)
        g = np.zeros(sub.size, np.int64)
        sub.Allgather(np.array([r], np.int64), g)
        assert g.tolist() == sorted(members, key=lambda q: -q), g
        for it in range(10):
            s = np.zeros(100_000, np.float64)
            rs = sub.Iallreduce(np.full(100_000, r + it, np.float64), s)
            t = np.zeros(100_000, np.float64)
            comm.Allreduce(np.full(100_000, 1.0), t)   # the parent, while the sub's op is in flight
            rs.Wait()
            assert np.all(s == sum(members) + it * len(members)), (it, s[:3])
            assert np.all(t == n), t[:3]
        out["split"] = {"color": color, "rank": sub.rank, "size": sub.size}

        # UNDEFINED: rank 0 gets no communicator; the others get one of n-1 ranks
        sub2 = comm.Split(shmproxy.UNDEFINED if r == 0 else 7, key=0)
        if r == 0:
            assert sub2 is None, sub2
        else:
            assert (sub2.rank, sub2.size) == (r - 1, n - 1), (sub2.rank, sub2.size)
            z = np.zeros(1, np.int64)
            sub2.Allreduce(np.array([r], np.int64), z)
            assert z[0] == n * (n - 1) // 2, z

        # Independent progress: comm has an op that cannot complete until dup's collective did.
        if n >= 2:
            if r == 0:
                got, pa = np.zeros(4, np.int64), np.zeros(3)
                rq = comm.Irecv(got, 1, tag=5)
                ia = comm.Iallreduce(np.ones(3), pa)    # posted by rank 0 only so far
                w = np.zeros(1 << 18, np.float32)
                dup.Allreduce(np.ones(1 << 18, np.float32), w)
                rq.Wait()
                ia.Wait()
                assert np.all(got == 42) and np.all(w == n) and np.all(pa == n), (got, w[:3], pa)
            else:
                w = np.zeros(1 << 18, np.float32)
                dup.Allreduce(np.ones(1 << 18, np.float32), w)
                if r == 1:
                    comm.Send(np.full(4, 42, np.int64), 0, tag=5)
                pa = np.zeros(3)
                # nonblocking like rank 0's: a blocking collective does not match a nonblocking one
                # (MPI's rule; a small blocking one runs between the ranks, rank/fastpath.py)
                comm.Iallreduce(np.ones(3), pa).Wait()
                assert np.all(w == n) and np.all(pa == n), (w[:3], pa)
        # Dup of a sub-communicator, then close everything (children first)
        sd = sub.Dup()
        q = np.zeros(2, np.int32)
        sd.Allreduce(np.full(2, 1, np.int32), q)
        assert np.all(q == sub.size), q
        for c in (sd, sub, sub2, dup):
            if c is not None:
                c.close()
        comm.Barrier()
        return out


def nonblocking_is_nonblocking() -> dict:
    """Posting a nonblocking collective returns at once: rank 0's Iallreduce and Ibarrier stay
    incomplete (Test() is False, repeatedly) while the other ranks are held back by a point-to-point
    handshake that rank 0 only sends afterwards."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        out = np.zeros(100_000, np.float64)
        if r == 0:
            t0 = time.monotonic()
            ra = comm.Iallreduce(np.full(100_000, 1.0), out)
            rb = comm.Ibarrier()
            post_s = time.monotonic() - t0
            tests = []
            for _ in range(20):
                tests.append((ra.Test(), rb.Test()))
                time.sleep(0.005)
            for q in range(1, n):
                comm.Send(np.ones(1), q, tag=77)
            ra.Wait()
            rb.Wait()
            assert not any(a or b for a, b in tests), tests
            assert np.all(out == n), out[:3]
            return {"post_s": post_s}
        comm.Recv(np.zeros(1), 0, tag=77)
        # nonblocking as rank 0's: a blocking collective does not match a nonblocking one (MPI's rule;
        # an 800 KB blocking Allreduce runs between the ranks, shmproxy.rank.fastpath.bind_arena)
        comm.Iallreduce(np.full(100_000, 1.0), out).Wait()
        comm.Ibarrier().Wait()
        assert np.all(out == n), out[:3]
        return {}


def many_outstanding_large(count: int) -> dict:
    """Six different large nonblocking collectives outstanding at once (every root, registered and
    plain buffers mixed), completed in reverse order."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        al = comm.alloc
        a_send = al(count, np.float32)
        a_send[:] = _pat(count, r)
        a_out = np.zeros(count, np.float32)
        b_buf = al(count, np.int64) if r % 2 else np.zeros(count, np.int64)
        if r == n - 1:
            b_buf[:] = np.arange(count)
        g_out = al(n * count, np.int16)
        rs_send = np.asarray(_pat(n * count, r, 1), np.float64)
        rs_out = al(count, np.float64)
        t_send = al(n * count, np.uint32)
        t_send[:] = np.arange(n * count, dtype=np.uint32) + r * 1_000_000
        t_out = np.zeros(n * count, np.uint32)
        red_out = np.zeros(count, np.float32) if r == 0 else None
        reqs = [comm.Iallreduce(a_send, a_out, op=shmproxy.SUM),
                comm.Ibcast(b_buf, root=n - 1),
                comm.Iallgather(np.full(count, r, np.int16), g_out),
                comm.Ireduce_scatter_block(rs_send, rs_out, op=shmproxy.MAX),
                comm.Ialltoall(t_send, t_out),
                comm.Ireduce(a_send, red_out, op=shmproxy.MIN, root=0)]
        for q in reversed(reqs):
            q.Wait()
        pats = [_pat(count, q) for q in range(n)]
        assert np.array_equal(a_out, functools.reduce(np.add, pats)), "Iallreduce"
        assert np.array_equal(b_buf, np.arange(count)), "Ibcast"
        gwant = np.repeat(np.arange(n, dtype=np.int16)[:, None], count, 1)
        assert np.array_equal(g_out.reshape(n, count), gwant), "Iallgather"
        blocks = [np.asarray(_pat(n * count, q, 1), np.float64)[r * count:(r + 1) * count] for q in range(n)]
        want = functools.reduce(np.maximum, blocks)
        assert np.array_equal(rs_out, want), "Ireduce_scatter_block"
        want = np.concatenate([np.arange(r * count, (r + 1) * count, dtype=np.uint32) + q * 1_000_000
                               for q in range(n)])
        assert np.array_equal(t_out, want), "Ialltoall"
        if r == 0:
            assert np.array_equal(red_out, functools.reduce(np.minimum, pats)), "Ireduce"
        return {"ok": True}


def many_comms(k: int) -> dict:
    """k Dups at once, each with its own progress process; nonblocking collectives posted on all of
    them in a rank-dependent order, then closed in a rank-independent order."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        dups = [comm.Dup() for _ in range(k)]
        pids = {d._proxy.pid for d in dups if hasattr(d, "_proxy")}
        for it in range(5):
            order = list(range(k))
            if r % 2:
                order.reverse()
            outs = {}
            reqs = []
            for j in order:
                outs[j] = np.zeros(50_000, np.int64)
                reqs.append(dups[j].Iallreduce(np.full(50_000, r * (j + 1) + it, np.int64), outs[j]))
            for q in reqs:
                q.Wait()
            for j in range(k):
                want = (j + 1) * n * (n - 1) // 2 + n * it
                assert np.all(outs[j] == want), (it, j, outs[j][:3], want)
        for d in dups:
            d.close()
        x = np.zeros(1, np.int64)
        comm.Allreduce(np.ones(1, np.int64), x)
        assert x[0] == n
        return {"proxies": len(pids)}


def split_orders() -> dict:
    """Split orders ranks by (key, parent rank); nested splits; a sub-communicator of one rank."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        keys = [(q * 7) % 3 for q in range(n)]            # ties broken by parent rank
        sub = comm.Split(0, key=keys[r])
        want = sorted(range(n), key=lambda q: (keys[q], q))
        assert (sub.rank, sub.size) == (want.index(r), n), (sub.rank, sub.size, want)
        g = np.zeros(n, np.int32)
        sub.Allgather(np.array([r], np.int32), g)
        assert g.tolist() == want, (g, want)
        nested = sub.Split(sub.rank % 2, key=-sub.rank)   # a split of a split
        members = [q for q in want if want.index(q) % 2 == sub.rank % 2]
        nwant = sorted(members, key=lambda q: -want.index(q))
        h = np.zeros(len(members), np.int32)
        nested.Allgather(np.array([r], np.int32), h)
        assert h.tolist() == nwant, (h, nwant)
        solo = comm.Split(r, key=0)                      # every rank alone
        assert (solo.rank, solo.size) == (0, 1)
        y = np.zeros(3)
        solo.Allreduce(np.full(3, r + 0.5), y)
        assert np.all(y == r + 0.5)
        for c in (solo, nested, sub):
            c.close()
        return {"order": want}


def barrier_synchronizes(delay: float) -> dict:
    """The last rank enters Barrier / Ibarrier ``delay`` s late: nobody may leave before it entered.
    Each rank returns how long it spent inside (the late rank about 0)."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        comm.Barrier()
        out = {}
        for name in ("Barrier", "Ibarrier", "Allreduce"):
            if r == n - 1:
                time.sleep(delay)
            t0 = time.monotonic()
            if name == "Barrier":
                comm.Barrier()
            elif name == "Ibarrier":
                comm.Ibarrier().Wait()
            else:
                comm.Allreduce(np.ones(1), np.zeros(1))
            out[name] = time.monotonic() - t0
        return out


def close_with_outstanding() -> dict:
    """Nonblocking collectives never waited on: leaving the with-block (close) completes them and
    leaves nothing behind (the conftest leak check)."""
    with shmproxy.init() as comm:
        n = comm.size
        keep = [np.zeros(100_000, np.float32) for _ in range(3)]
        comm.Iallreduce(np.ones(100_000, np.float32), keep[0])
        comm.Ibcast(keep[1], root=0)
        comm.Iallgather(np.ones(100_000 // n, np.float32), keep[2][: (100_000 // n) * n])
        comm.Ibarrier()
    return {"closed": True}


def wait_timeout_then_complete() -> dict:
    """Wait(timeout=) on a collective a peer has not posted raises Timeout naming it; the request
    stays pending and completes once the peer posts."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        out = np.zeros(10)
        if r == 0:
            req = comm.Iallreduce(np.ones(10), out)
            msg = None
            try:
                req.Wait(timeout=0.3)
            except shmproxy.Timeout as exc:
                msg = str(exc)
            for q in range(1, n):
                comm.Send(np.ones(1), q, tag=3)
            req.Wait()
            assert np.all(out == n), out
            return {"timeout_message": msg}
        comm.Recv(np.zeros(1), 0, tag=3)
        comm.Iallreduce(np.ones(10), out).Wait()   # matches rank 0's Iallreduce (a blocking one would not)
        assert np.all(out == n), out
        return {}
