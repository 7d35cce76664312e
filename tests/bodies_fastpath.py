"""Rank bodies for tests/test_fastpath.py: the fast path (shm/_fast.h) against MPI's rules, mixed with
the progress process's path, and its failures."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np

import shmproxy
from shmproxy.core import params as params_mod
from shmproxy.core.ops import ANY_SOURCE, ANY_TAG

LARGE = 96 << 10      # above SEND_BUFFER_BYTES: a rendezvous through the progress process
REF = 64 << 10        # FAST_REF_MIN_BYTES: a blocking Send by reference, and buffered where it goes slow
MEDIUM = 4096         # with FAST_BYTES=1K (the test's "small" mode): buffered by the progress process
SMALL = 8


def _plan(seed: int, nmsg: int) -> list[tuple[int, int, str]]:
    """The sender's messages: (tag, elements of int64, how it is sent)."""
    rng = random.Random(seed)
    out = []
    for _ in range(nmsg):
        mode = rng.choice(["Send", "Send", "Send", "Isend", "Issend", "Send_medium", "Isend_large", "Send_or_isend",
                           "Send_ref"])
        n = {"Send_medium": MEDIUM // 8, "Isend_large": LARGE // 8, "Send_ref": REF // 8}.get(
            mode, rng.choice([0, 1, SMALL]))
        out.append((rng.choice([0, 1, 2]), n, mode))
    return out


def order_mixed(seed: int, nmsg: int) -> dict:
    """Rank 0 sends ``nmsg`` messages to rank 1 on three tags, each through the fast path or the progress
    process (small blocking Sends, Isend, Issend, send_or_isend, medium buffered and large rendezvous
    sends); rank 1 receives them with blocking Recv (specific tag, ANY_TAG, ANY_SOURCE), Irecv + Wait,
    two Irecvs posted together, Probe + Recv, in an order drawn from the same seed. Every message carries its
    number: each receive must get the earliest unreceived message it accepts (MPI's non-overtaking),
    checked against that model."""
    with shmproxy.init() as comm:
        plan = _plan(seed, nmsg)
        if comm.rank == 0:
            pending = []
            for i, (tag, n, mode) in enumerate(plan):
                data = np.full(max(n, 1), i, np.int64)[:n]
                if mode in ("Send", "Send_medium", "Send_ref"):   # Send_ref: from the arena, by reference
                    comm.Send(data, 1, tag)
                elif mode == "Issend":
                    pending.append(comm.Issend(data, 1, tag))
                elif mode == "Send_or_isend":   # the torch backend's send: a cell at once, else Isend
                    r = comm._send_or_isend(data, 1, tag)
                    if r is not None:
                        pending.append(r)
                else:
                    pending.append(comm.Isend(data, 1, tag))
            for r in pending:
                r.Wait()
            comm.Barrier()
            return {}
        rng = random.Random(seed + 1)
        left = list(range(nmsg))   # the model: messages not received yet, in sending order
        got = 0

        def want(tag: int) -> int:
            i = next(k for k in left if tag == ANY_TAG or plan[k][0] == tag)
            left.remove(i)
            return i

        def check(buf: np.ndarray, st, i: int) -> None:
            n = plan[i][1]
            assert st.nbytes == 8 * n and (n == 0 or np.all(buf[:n] == i)), (i, plan[i], st, buf[:4])

        while left:
            tag = rng.choice([ANY_TAG, plan[rng.choice(left)][0]])
            style = rng.choice(["Recv", "Recv", "Recv_any_source", "Irecv", "pair", "Probe"])
            buf = np.full(LARGE // 8, -1, np.int64)
            if style == "pair" and len(left) >= 2:
                i1 = want(tag)
                tag2 = plan[left[0]][0]
                i2 = want(tag2)
                buf2 = np.full(LARGE // 8, -1, np.int64)
                r1, r2 = comm.Irecv(buf, 0, tag), comm.Irecv(buf2, 0, tag2)
                check(buf2, r2.Wait(), i2)
                check(buf, r1.Wait(), i1)
                got += 2
                continue
            i = want(tag)
            if style == "Irecv":
                st = comm.Irecv(buf, 0, tag).Wait()
            elif style == "Probe":
                pst = comm.Probe(0, tag)
                assert pst.nbytes == 8 * plan[i][1], (i, pst)
                st = comm.Recv(buf, 0, pst.tag)
            else:
                st = comm.Recv(buf, ANY_SOURCE if style == "Recv_any_source" else 0, tag)
            check(buf, st, i)
            got += 1
        comm.Barrier()
        return {"received": got}


def two_senders_any_source(nmsg: int) -> dict:
    """Ranks 1 and 2 send small blocking messages to rank 0, which receives them from ANY_SOURCE with
    blocking Recv: every message arrives once, each sender's in its order."""
    with shmproxy.init() as comm:
        if comm.rank != 0:
            for i in range(nmsg):
                comm.Send(np.array([comm.rank, i], np.int64), 0, 7)
            comm.Barrier()
            return {}
        nxt = {1: 0, 2: 0}
        buf = np.zeros(2, np.int64)
        for _ in range(2 * nmsg):
            st = comm.Recv(buf, ANY_SOURCE, 7)
            src, i = int(buf[0]), int(buf[1])
            assert st.source == src and nxt[src] == i, (st, buf, nxt)
            nxt[src] += 1
        comm.Barrier()
        return {"fast_recv": True}


def probes_and_errors() -> dict:
    """A message written into a cell is seen by Iprobe (which drains it into the progress process) and
    by Mprobe; a receive too small for a cell's message fails with TruncationError, one of another
    dtype with InvalidUsage, and the messages after them still arrive."""
    with shmproxy.init() as comm:
        if comm.rank == 0:
            comm.Send(np.arange(4, dtype=np.int32), 1, 1)
            comm.Send(np.arange(3, dtype=np.int32), 1, 2)
            comm.Send(np.arange(16, dtype=np.int64), 1, 3)   # too big for the receive
            comm.Send(np.arange(2, dtype=np.float64), 1, 4)  # another dtype than the receive's
            comm.Send(np.full(2, 9, np.int16), 1, 5)
            comm.Barrier()
            return {}
        st = None
        while st is None:
            st = comm.Iprobe(0, 1)
        assert st.nbytes == 16 and st.tag == 1, st
        a = np.zeros(4, np.int32)
        comm.Recv(a, 0, 1)
        assert a.tolist() == [0, 1, 2, 3]
        msg = comm.Mprobe(0, 2)
        st = msg.status
        b = np.zeros(3, np.int32)
        msg.Recv(b)
        assert b.tolist() == [0, 1, 2] and st.nbytes == 12, (b, st)
        try:
            comm.Recv(np.zeros(2, np.int64), 0, 3)
            trunc = None
        except shmproxy.TruncationError as exc:
            trunc = str(exc)
        try:
            comm.Recv(np.zeros(2, np.int64), 0, 4)
            mism = None
        except shmproxy.InvalidUsage as exc:
            mism = str(exc)
        c = np.zeros(2, np.int16)
        comm.Recv(c, 0, 5)
        assert c.tolist() == [9, 9]
        comm.Barrier()
        return {"truncation": trunc, "mismatch": mism}


_OPS = [shmproxy.SUM, shmproxy.PROD, shmproxy.MIN, shmproxy.MAX]
_DT = [np.int32, np.int64, np.float32, np.float64, np.uint8]


def small_collectives(seed: int, steps: int) -> dict:
    """A random sequence of blocking Barrier/Allreduce/Bcast/Reduce, small (between the ranks) and
    large (through the progress process), IN_PLACE and strided inputs, with nonblocking collectives
    outstanding across them, every result against numpy. Reductions are of small integers, so every
    order gives the same bits."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        rng = random.Random(seed)
        outstanding = []
        for step in range(steps):
            kind = rng.choice(["Barrier", "Allreduce", "Allreduce", "Bcast", "Reduce", "Ibcast"])
            count = rng.choice([1, 3, 16, 64, 5000])
            dt = np.dtype(rng.choice(_DT))
            op = rng.choice(_OPS)
            root = rng.randrange(n)
            ip = rng.random() < 0.3
            strided = rng.random() < 0.2

            def x(q: int) -> np.ndarray:
                return ((np.arange(count) + 3 * q + step) % 5 + 1).astype(dt)

            if kind == "Barrier":
                comm.Barrier()
            elif kind == "Allreduce":
                want = x(0)
                for q in range(1, n):
                    want = {shmproxy.SUM: np.add, shmproxy.PROD: np.multiply, shmproxy.MIN: np.minimum,
                            shmproxy.MAX: np.maximum}[op](want, x(q))
                out = np.zeros(count, dt)
                if ip:
                    out[:] = x(r)
                    comm.Allreduce(shmproxy.IN_PLACE, out, op)
                else:
                    src = np.repeat(x(r), 2)[::2] if strided else x(r)
                    comm.Allreduce(src, out, op)
                assert np.array_equal(out, want.astype(dt)), (step, kind, count, dt, op, out[:4], want[:4])
            elif kind == "Bcast":
                buf = x(root) if r == root else np.zeros(count, dt)
                comm.Bcast(buf, root)
                assert np.array_equal(buf, x(root)), (step, kind, buf[:4])
            elif kind == "Reduce":
                out = np.zeros(count, dt) if r == root else None
                comm.Reduce(x(r), out, shmproxy.SUM, root)
                if r == root:
                    want = sum(x(q).astype(np.int64) for q in range(n)).astype(dt)
                    assert np.array_equal(out, want), (step, kind, out[:4], want[:4])
            else:   # a nonblocking one stays outstanding across the next blocking ones
                buf = x(root) if r == root else np.zeros(count, dt)
                outstanding.append((comm.Ibcast(buf, root), buf, x(root)))
            if outstanding and rng.random() < 0.3:
                req, buf, want = outstanding.pop(0)
                req.Wait()
                assert np.array_equal(buf, want), (step, "Ibcast")
        for req, buf, want in outstanding:
            req.Wait()
            assert np.array_equal(buf, want)
        return {"small": int(comm._pp.coll_n)}


def sleepers_woken(seed: int, steps: int) -> dict:
    """Small collectives (cells and the middle way) whose ranks sleep on the futex word at once
    (WAIT_SPIN_US=0), arriving at random times, so that some rank is always asleep when another
    arrives: each call must end as soon as the last rank arrives, never a sleep's slice later."""
    rng = random.Random(seed)
    with shmproxy.init() as comm:
        me, n = comm.rank, comm.size
        big = np.ones(16 << 10, np.float32)   # 64 KiB: the middle collectives, through the arena
        out = np.zeros_like(big)
        worst = 0.0
        for i in range(steps):
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.002 * ((me + i) % n))
            t0 = time.monotonic()
            kind = i % 5
            if kind == 0:
                comm.Barrier()
            elif kind == 1:
                x = np.array([me + i], np.int64)
                comm.Allreduce(x, y := np.zeros(1, np.int64))
                assert y[0] == sum(range(i, i + n)), (i, y)
            elif kind == 2:
                b = np.array([i if me == i % n else -1], np.int64)
                comm.Bcast(b, root=i % n)
                assert b[0] == i, (i, b)
            elif kind == 3:
                r = np.zeros(1, np.int64)
                comm.Reduce(np.array([1], np.int64), r, root=i % n)
                assert me != i % n or r[0] == n, (i, r)
            else:
                comm.Allreduce(big, out)
                assert out[7] == n, (i, out[7])
            worst = max(worst, time.monotonic() - t0)
        return {"worst": worst, "steps": steps}


def blocking_against_nonblocking() -> dict:
    """Rank 0 calls Iallreduce where the others call a small blocking Allreduce: every rank raises
    InvalidUsage (the two never match, as in MPI) within seconds, naming the collective."""
    with shmproxy.init() as comm:
        comm.Barrier()
        t0 = time.monotonic()
        try:
            if comm.rank == 0:
                comm.Iallreduce(np.ones(2), np.zeros(2)).Wait()
            else:
                comm.Allreduce(np.ones(2), np.zeros(2))
            return {"error": None}
        except shmproxy.ProxyError as exc:
            return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}


def small_collective_timeout() -> dict:
    """Rank 1 never enters the Barrier rank 0 waits in: rank 0 raises Timeout after SHMPROXY_TIMEOUT,
    and the communicator fails for rank 1 too (its next call raises)."""
    with shmproxy.init() as comm:
        if comm.rank == 0:
            t0 = time.monotonic()
            try:
                comm.Barrier()
                err = None
            except shmproxy.Timeout as exc:
                err = str(exc)
            return {"error": err, "seconds": time.monotonic() - t0}
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 30:
                comm.Iprobe(0, 9)   # each raises once the communicator failed
                time.sleep(0.01)
            return {"later": None}
        except shmproxy.ProxyError as exc:
            return {"later": type(exc).__name__, "seconds": time.monotonic() - t0}


def killed_while_waiting(where: str) -> dict:
    """One rank is SIGKILLed while the other waits for it: rank 1 in a blocking Recv (spinning on the
    pair's cell, then in the progress process), a small Allreduce (between the ranks) or a middle one
    (through the ranks' arenas, 1 MiB), with rank 0 killed; or rank 0 in a 256 KiB Send by reference
    and the Recv of its answer, with rank 1 killed (``send_ref``: the Send's cell is drained by the
    progress process once its doorbell rings, never received). The survivor raises PeerDiedError
    within the usual bound, never hangs on a cell."""
    victim = 1 if where == "send_ref" else 0
    with shmproxy.init() as comm:
        comm.Barrier()
        if comm.rank == victim:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            if where == "send_ref":
                comm.Send(np.ones(1 << 15), 1, 3)   # 256 KiB, from the arena
                comm.Recv(np.zeros(1), 1, 4)
            elif where == "recv":
                comm.Recv(np.zeros(1), 0, 3)
            elif where == "middle":
                comm.Allreduce(np.ones(1 << 17), np.zeros(1 << 17))
            else:
                comm.Allreduce(np.ones(1), np.zeros(1))
            return {"error": None, "sent": comm._pp.ref_sent}
        except shmproxy.PeerDiedError as exc:
            return {"error": "PeerDiedError", "message": str(exc), "seconds": time.monotonic() - t0,
                    "sent": comm._pp.ref_sent}


def dump_small_collective(marker: str) -> dict:
    """Rank 0 waits in a small Barrier that rank 1 has not entered: the outside dump names it. Rank 1
    enters once the dump was read (a reader process leaves ``marker`` behind)."""
    with shmproxy.init() as comm:
        if comm.rank == 0:
            reader = ("import subprocess, sys, time\n"
                      "end, text = time.monotonic() + 30, ''\n"
                      "while 'have not' not in text and time.monotonic() < end:\n"
                      f"    text = subprocess.run([sys.executable, '-m', 'shmproxy.tools.dump_cli', '--pid', "
                      f"'{comm._proxy.pid}', '--outside'], capture_output=True, text=True).stdout\n"
                      "print(text)\n"
                      f"open({marker!r}, 'w').close()\n")
            proc = subprocess.Popen([sys.executable, "-c", reader], stdout=subprocess.PIPE, text=True)
            comm.Barrier()
            return {"dump": proc.communicate(timeout=60)[0]}
        end = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < end:
            time.sleep(0.05)
        comm.Barrier()
        return {}


def off_matches_on(seed: int) -> dict:
    """The same random small collectives and messages give the same results whether the fast path is
    on or off (each run returns a digest the test compares)."""
    with shmproxy.init() as comm:
        rng = random.Random(seed)
        acc = np.zeros(4, np.float64)
        for _ in range(50):
            x = np.array([rng.random() for _ in range(4)]) + comm.rank
            out = np.zeros(4)
            comm.Allreduce(x, out)
            acc += out
            peer = (comm.rank + 1) % comm.size
            got = np.zeros(4)
            if comm.rank % 2 == 0:
                comm.Send(out, peer, 1)
                comm.Recv(got, (comm.rank - 1) % comm.size, 1)
            else:
                comm.Recv(got, (comm.rank - 1) % comm.size, 1)
                comm.Send(out, peer, 1)
            acc += got
        return {"digest": acc.tobytes().hex(), "fast": comm._fast_bytes}


def cell_behind_slow_send(rounds: int) -> dict:
    """Rank 0 posts an Irecv (tag 2) and tells rank 1 or 2 to go; that rank posts a slow Isend (tag 1)
    and then writes a small Send (tag 2) into a cell. The receive waits in the progress process, so the
    sender rings its doorbell, and the drain finds the cell blocked behind the slow send until that is
    taken in: then the cell must reach the waiting receive (the case of a dissemination barrier's Isend
    followed by a small Send)."""
    with shmproxy.init() as comm:
        r = comm.rank
        go = np.zeros(1, np.int64)
        if r != 0:
            for i in range(rounds):
                comm.Recv(go, 0, 3)
                req = comm.Isend(np.full(2048, i, np.int64), 0, 1)
                comm.Send(np.array([r, i], np.int64), 0, 2)
                req.Wait()
            comm.Barrier()
            return {}
        big, small = np.zeros(2048, np.int64), np.zeros(2, np.int64)
        for i in range(rounds):
            for src in (1, 2):
                req = comm.Irecv(small, src, 2)
                comm.Send(go, src, 3)
                req.Wait()
                assert small.tolist() == [src, i], (src, i, small)
                comm.Recv(big, src, 1)
                assert np.all(big == i), (src, i, big[:2])
        comm.Barrier()
        return {"rounds": rounds}


def nonblocking_then_small(iters: int, pin: bool = True) -> dict:
    """Each rank alternates an Iallreduce (the progress process's) with a small Barrier, all ranks on
    one CPU (pin) so that a rank may be preempted in the middle of its arrival check: a rank that finished
    the Barrier and posted its next Iallreduce while a slower one was between reading its slot and its
    count of posted collectives must not be taken for a rank that went the other way."""
    if pin:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    with shmproxy.init() as comm:
        x, y = np.ones(2), np.zeros(2)
        for _ in range(iters):
            comm.Iallreduce(x, y).Wait()
            comm.Barrier()
        return {"sum": float(y[0])}


def by_reference(rounds: int) -> dict:
    """Blocking Send/Recv of arena arrays between FAST_REF_MIN_BYTES and FAST_REF_MAX_BYTES (shm/_fast.h,
    "By reference"): a ping-pong whose receives wait in Recv, so they take the cells themselves (one
    copy from the sender's array); dtypes, sizes at and around the limits, views at offsets into their
    arrays; then an exchange where both ranks Send first (each Send's cell drained into the progress
    process once its doorbell rings: no deadlock); then Sends into an Irecv posted first (the progress
    process's own path). Every message checked; the counts of cells by reference sent and taken."""
    p = params_mod.get()
    lo, hi = p.FAST_REF_MIN_BYTES, p.FAST_REF_MAX_BYTES
    bad: list[str] = []
    with shmproxy.init() as comm:
        me, peer = comm.rank, 1 - comm.rank
        cases = [("float64", lo // 8, 0), ("int32", hi // 4, 0), ("uint8", lo + 1, 0), ("float32", 100_000, 3),
                 ("int64", (lo + hi) // 16, 1), ("uint8", hi + 1, 0), ("uint8", lo - 1, 0)]
        for k in range(rounds):
            for dtype, n, off in cases:
                tag = k % 5
                if me == 0:
                    big = np.empty(n + off + 7, dtype)
                    src = big[off:off + n]
                    src[...] = (np.arange(n) * 3 + k) % 251
                    comm.Send(src, peer, tag)
                    back = np.empty(n, dtype)
                    comm.Recv(back, peer, tag)
                    if not np.array_equal(back, src):
                        bad.append(f"pong {dtype} n={n} off={off} round {k}")
                else:
                    got = np.empty(n, dtype)
                    comm.Recv(got, peer, tag)
                    want = ((np.arange(n) * 3 + k) % 251).astype(dtype)
                    if not np.array_equal(got, want):
                        bad.append(f"ping {dtype} n={n} off={off} round {k}")
                    comm.Send(got, peer, tag)
        taken = comm._pp.ref_taken
        # both Send first: the cells of both pairs hold references at once
        mine = np.full(lo // 8 * 2, me + 1.0)
        theirs = np.empty_like(mine)
        comm.Send(mine, peer, 9)
        comm.Recv(theirs, peer, 9)
        if not np.all(theirs == peer + 1.0):
            bad.append("exchange")
        # an Irecv posted first (behind a barrier): the Send sees it waiting and goes the progress process's way
        got = np.empty(lo // 8 * 2)
        req = comm.Irecv(got, peer, 11) if me == 1 else None
        comm.Barrier()
        if me == 0:
            comm.Send(np.full(lo // 8 * 2, 7.0), 1, 11)
        else:
            assert req is not None
            req.Wait()
            if not np.all(got == 7.0):
                bad.append("posted first")
        comm.Barrier()
        return {"bad": bad, "sent": comm._pp.ref_sent, "taken": taken, "cases": rounds * len(cases)}
