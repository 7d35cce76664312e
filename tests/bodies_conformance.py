"""Rank bodies of the transport conformance suite (tests/test_conformance.py).

Each function runs in every rank of a real job (tests/rankmain.py), with SHMPROXY_TRANSPORTS naming the
one transport under test; it calls shmproxy.init() itself and raises on any deviation. Payloads are
seeded random bytes, so that a message delivered to the wrong receive, or out of order, is caught by
its contents and not only by its size. Receive buffers carry guard bytes past the message, which must
survive: a transport that writes past the end of a message fails here.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np

import shmproxy

GUARD = 64      # bytes after each receive buffer's message that nothing may write
SENTINEL = 0xA5


def _bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _large(comm: shmproxy.Comm) -> int:
    """A message of several chunks and above PARALLEL_THRESHOLD (split over copy workers): ~8 MiB,
    more if the parameters of the run ask for it; odd, so that the last chunk is a partial one."""
    p = comm.params
    return max(8 << 20, 4 * p.CHUNK_SIZE, 2 * p.PARALLEL_THRESHOLD, 2 * p.eager_limit) + 13


def _sizes(comm: shmproxy.Comm) -> list[int]:
    """Empty, tiny, page, on both sides of the eager limit, and large."""
    p = comm.params
    sizes = {0, 1, 8, 4096, _large(comm)}
    for e in {p.EAGER_BYTES, p.eager_limit}:
        sizes |= {max(e - 1, 0), e, e + 1}
    return sorted(sizes)


def _recv_buffer(comm: shmproxy.Comm, n: int, alloc: bool) -> tuple[np.ndarray, np.ndarray]:
    """(whole buffer, view of its first n bytes to receive into): the rest is guard bytes."""
    whole = comm.alloc(n + GUARD, np.uint8) if alloc else np.empty(n + GUARD, np.uint8)
    whole[:] = SENTINEL
    return whole, whole[:n]


def _send_buffer(comm: shmproxy.Comm, data: np.ndarray, alloc: bool) -> np.ndarray:
    if not alloc:
        return data.copy()
    buf = comm.alloc(data.size, data.dtype)
    buf[...] = data
    return buf


def _check(whole: np.ndarray, n: int, expect: np.ndarray, what: str) -> None:
    got = whole[:n]
    if not np.array_equal(got, expect):
        bad = np.flatnonzero(got != expect)
        raise AssertionError(f"{what}: {bad.size} of {n} bytes differ, first at offset {bad[0]}")
    if not np.all(whole[n:] == SENTINEL):
        raise AssertionError(f"{what}: bytes written past the end of the message")


# ------------------------------------------------------------------------------------ connect
def connect_every_pair() -> dict:
    """Every pair of ranks exchanges one message, first pair by pair with blocking calls (each pair's
    first message sets its connection up while the others wait), then all at once."""
    with shmproxy.init() as comm:
        me, n = comm.rank, comm.size
        pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
        for a, b in pairs:
            if me not in (a, b):
                continue
            peer = b if me == a else a
            out = np.zeros(4, np.int64)
            if me == a:
                comm.Send(np.array([a, b, me, 1], np.int64), peer, tag=1)
                st = comm.Recv(out, peer, tag=1)
            else:
                st = comm.Recv(out, peer, tag=1)
                comm.Send(np.array([a, b, me, 1], np.int64), peer, tag=1)
            assert out.tolist() == [a, b, peer, 1], (me, peer, out)
            assert (st.source, st.tag, st.nbytes) == (peer, 1, 32), st
        peers = [p for p in range(n) if p != me]
        outs = {p: np.zeros(3, np.int64) for p in peers}
        reqs = [comm.Irecv(outs[p], p, tag=2) for p in peers]
        reqs += [comm.Isend(np.array([me, p, 2], np.int64), p, tag=2) for p in peers]
        shmproxy.Request.Waitall(reqs)
        for p in peers:
            assert outs[p].tolist() == [p, me, 2], (me, p, outs[p])
        return {"peers": len(peers)}


# ------------------------------------------------------------------------------------ sizes
def eager_and_large() -> dict:
    """Every size of _sizes, each way between two ranks, for each combination of comm.alloc memory
    and plain (staged) numpy arrays on the sending and the receiving side; byte-exact."""
    with shmproxy.init() as comm:
        me, peer = comm.rank, 1 - comm.rank
        checked = []
        for n in _sizes(comm):
            for salloc in (True, False):
                for ralloc in (True, False):
                    tag = n * 4 + salloc * 2 + ralloc
                    data = _bytes(n, seed=tag * 2 + me)
                    whole, view = _recv_buffer(comm, n, ralloc)
                    rq = comm.Irecv(view, peer, tag=tag)
                    sq = comm.Isend(_send_buffer(comm, data, salloc), peer, tag=tag)
                    st = rq.Wait()
                    sq.Wait()
                    what = f"{n} B alloc send={salloc} alloc recv={ralloc}"
                    _check(whole, n, _bytes(n, seed=tag * 2 + peer), what)
                    assert (st.source, st.tag, st.nbytes) == (peer, tag, n), (what, st)
                    checked.append(n)
        return {"sizes": sorted(set(checked)), "messages": len(checked)}


# ------------------------------------------------------------------------------------ truncation
def truncation() -> dict:
    """A receive buffer smaller than the message: TruncationError, nothing written (not even inside
    the buffer), and the communicator goes on; a larger one: Status.nbytes says what arrived."""
    with shmproxy.init() as comm:
        sizes = [100, comm.params.eager_limit + 1, _large(comm)]
        cases = [(n, alloc) for n in sizes for alloc in (True, False)]
        if comm.rank == 0:
            for i, (n, alloc) in enumerate(cases):
                comm.Send(_send_buffer(comm, _bytes(n, seed=i), alloc), 1, tag=i)      # truncated
                comm.Send(_send_buffer(comm, _bytes(n, seed=i + 100), alloc), 1, tag=i)  # fits
                comm.Send(_send_buffer(comm, _bytes(n // 2, seed=i + 200), alloc), 1, tag=i)  # fits, short
            return {"cases": len(cases)}
        if comm.rank == 1:
            for i, (n, alloc) in enumerate(cases):
                what = f"{n} B alloc={alloc}"
                whole, view = _recv_buffer(comm, n, alloc)
                small = view[:n // 2]
                try:
                    comm.Recv(small, 0, tag=i)
                except shmproxy.TruncationError as e:
                    assert f"{n} B" in str(e) and f"{n // 2} B" in str(e), (what, str(e))
                else:
                    raise AssertionError(f"{what}: no TruncationError into {n // 2} B")
                assert np.all(whole == SENTINEL), f"{what}: a truncated message wrote to the buffer"
                st = comm.Recv(view, 0, tag=i)
                assert (st.source, st.tag, st.nbytes) == (0, i, n), (what, st)
                _check(whole, n, _bytes(n, seed=i + 100), what + " after the truncation")
                whole[:] = SENTINEL
                st = comm.Recv(view, 0, tag=i)
                assert (st.source, st.tag, st.nbytes) == (0, i, n // 2), (what, st)
                _check(whole, n // 2, _bytes(n // 2, seed=i + 200), what + " into a larger buffer")
            return {"cases": len(cases)}
        return None


# ------------------------------------------------------------------------------------ order
def _order_sizes(comm: shmproxy.Comm, k: int) -> list[int]:
    """Sizes that mix eager and transport messages on one tag, so that a small message posted after a
    large one has every chance to overtake it if the transport lets it."""
    cycle = [comm.params.eager_limit + 7, 5, 2 << 20, 0, 3000]
    return [cycle[i % len(cycle)] for i in range(k)]


def _post_recvs(comm: shmproxy.Comm, tags: list[int], sizes: list[int]) -> tuple[list, list]:
    cap = max(sizes)
    bufs = [np.zeros(cap, np.uint8) if i % 2 else comm.alloc(cap, np.uint8) for i in range(len(tags))]
    return bufs, [comm.Irecv(b, 0, tag=t) for b, t in zip(bufs, tags)]


def _post_sends(comm: shmproxy.Comm, tags: list[int], sizes: list[int]) -> list:
    return [comm.Isend(_send_buffer(comm, _bytes(n, seed=i), bool(i % 3)), 1, tag=t)
            for i, (t, n) in enumerate(zip(tags, sizes))]


def _check_order(tags: list[int], sizes: list[int], bufs: list, sts: list, recv_tags: list[int]) -> None:
    """The j-th receive posted on tag t must hold the j-th message sent on tag t."""
    sent = {t: [i for i, tt in enumerate(tags) if tt == t] for t in set(tags)}
    posted = {t: 0 for t in set(tags)}
    for b, st, t in zip(bufs, sts, recv_tags):
        i = sent[t][posted[t]]
        posted[t] += 1
        n = sizes[i]
        assert (st.source, st.tag, st.nbytes) == (0, t, n), (f"receive #{posted[t]} on tag {t}", st, n)
        if not np.array_equal(b[:n], _bytes(n, seed=i)):
            raise AssertionError(f"receive #{posted[t]} on tag {t} does not hold message {i} ({n} B)")


def tags_and_order(order: str) -> dict:
    """Many messages pending on one (source, tag), and on interleaved tags, each receive must get the
    matching send in posting order. ``order``: 'recvs_first' (every receive is posted before the first
    send), 'sends_first' (every send is posted, Isend, before the first receive), or 'interleaved'
    (three tags; the receives are posted tag by tag, in an order unlike the sends')."""
    k = 15
    with shmproxy.init() as comm:
        if order == "interleaved":
            tags = [i % 3 for i in range(k)]
            recv_tags = sorted(tags, key=lambda t: (2, 0, 1).index(t))
        else:
            tags = recv_tags = [7] * k
        sizes = _order_sizes(comm, k)
        if comm.rank == 0:
            if order == "recvs_first":
                comm.Recv(np.zeros(1, np.uint8), 1, tag=99)       # rank 1 has posted every receive
            reqs = _post_sends(comm, tags, sizes)
            if order != "recvs_first":
                comm.Send(np.zeros(1, np.uint8), 1, tag=99)       # every send is posted
            shmproxy.Request.Waitall(reqs)
        elif comm.rank == 1:
            if order != "recvs_first":
                comm.Recv(np.zeros(1, np.uint8), 0, tag=99)
            bufs, reqs = _post_recvs(comm, recv_tags, sizes)
            if order == "recvs_first":
                comm.Send(np.zeros(1, np.uint8), 0, tag=99)
            sts = shmproxy.Request.Waitall(reqs)
            _check_order(tags, sizes, bufs, sts, recv_tags)
        return {"messages": k}


# ------------------------------------------------------------------------------------ zero bytes, self
def zero_bytes() -> None:
    """Empty messages, from empty arrays of both kinds, into empty and non-empty buffers."""
    with shmproxy.init() as comm:
        peer = 1 - comm.rank
        for i, (salloc, ralloc, cap) in enumerate([(True, True, 0), (False, False, 0), (True, False, 16),
                                                   (False, True, 16)]):
            whole, view = _recv_buffer(comm, cap, ralloc)
            rq = comm.Irecv(view, peer, tag=i)
            empty = comm.alloc(0, np.uint8) if salloc else np.zeros(0, np.uint8)
            comm.Send(empty, peer, tag=i)
            st = rq.Wait()
            assert (st.source, st.tag, st.nbytes) == (peer, i, 0), (i, st)
            assert np.all(whole == SENTINEL), f"case {i}: an empty message wrote to the buffer"
        # an empty message keeps its place among others on the same tag
        rqs = [comm.Irecv(np.zeros(8, np.uint8), peer, tag=50) for _ in range(3)]
        for n in (4, 0, 8):
            comm.Isend(np.full(n, n, np.uint8), peer, tag=50).Wait()
        assert [r.Wait().nbytes for r in rqs] == [4, 0, 8]


def self_send() -> dict:
    """A rank sends to itself: Isend then Recv, and Irecv then Send, small and large, from both kinds
    of memory."""
    with shmproxy.init() as comm:
        me = comm.rank
        done = 0
        for n in (0, 1, comm.params.eager_limit + 1, _large(comm)):
            for alloc in (True, False):
                data = _bytes(n, seed=n + me)
                whole, view = _recv_buffer(comm, n, alloc)
                sq = comm.Isend(_send_buffer(comm, data, not alloc), me, tag=1)
                st = comm.Recv(view, me, tag=1)
                sq.Wait()
                _check(whole, n, data, f"Isend then Recv to self, {n} B")
                assert (st.source, st.tag, st.nbytes) == (me, 1, n), st
                whole, view = _recv_buffer(comm, n, not alloc)
                rq = comm.Irecv(view, me, tag=2)
                comm.Send(_send_buffer(comm, data, alloc), me, tag=2)
                st = rq.Wait()
                _check(whole, n, data, f"Irecv then Send to self, {n} B")
                assert (st.source, st.tag, st.nbytes) == (me, 2, n), st
                done += 2
        return {"messages": done}


# ------------------------------------------------------------------------------------ concurrency
def concurrent_large() -> dict:
    """Every rank exchanges a large message with every other at once (Isend/Irecv to all, Waitall),
    alternating comm.alloc and staged memory, two rounds."""
    with shmproxy.init() as comm:
        me, n = comm.rank, comm.size
        size = _large(comm)
        peers = [p for p in range(n) if p != me]
        for rnd in range(2):
            bufs, reqs = {}, []
            for p in peers:
                bufs[p] = _recv_buffer(comm, size, (p + rnd) % 2 == 0)
                reqs.append(comm.Irecv(bufs[p][1], p, tag=rnd))
            for p in peers:
                data = _bytes(size, seed=(rnd * n + me) * n + p)
                reqs.append(comm.Isend(_send_buffer(comm, data, (me + rnd) % 2 == 0), p, tag=rnd))
            sts = shmproxy.Request.Waitall(reqs)
            for p, st in zip(peers, sts):
                assert (st.source, st.tag, st.nbytes) == (p, rnd, size), st
                _check(bufs[p][0], size, _bytes(size, seed=(rnd * n + p) * n + me), f"round {rnd} from {p}")
        return {"bytes": size}


# ------------------------------------------------------------------------------------ dtype mismatch
def dtype_mismatch(large: bool, sender_told: bool = True) -> dict:
    """A send and a receive that match but disagree on the dtype (same byte count): InvalidUsage on
    both sides; on the receiver's only (``sender_told`` False) where the send was eager across nodes
    and had completed, buffered, before the receiver saw it (MPI's eager protocol). Where the sender is
    to be told the send is synchronous (Ssend): a standard one may complete buffered first."""
    with shmproxy.init() as comm:
        count = (_large(comm) // 4) if large else 2
        errors = {}
        if comm.rank == 0:
            try:
                (comm.Ssend if sender_told else comm.Send)(comm.alloc(count, np.float32), 1, tag=3)
            except shmproxy.InvalidUsage as e:
                if not sender_told:
                    raise AssertionError(f"an eager send across nodes failed: {e}") from e
                errors["send"] = str(e)
            else:
                if sender_told:
                    raise AssertionError("the sender was not told of the dtype mismatch")
                errors["send"] = "completed (eager)"
        elif comm.rank == 1:
            try:
                comm.Recv(np.zeros(count, np.int32), 0, tag=3)
            except shmproxy.InvalidUsage as e:
                assert "float32" in str(e), str(e)
                errors["recv"] = str(e)
            else:
                raise AssertionError("the receiver was not told of the dtype mismatch")
        return errors


# ------------------------------------------------------------------------------------ peer death
def peer_dies(when: str, victim: int) -> dict:
    """The survivor posts large receives from the victim; the victim SIGKILLs itself, ``when``='before'
    sending anything, or 'mid' after sending the first of them and posting (Isend) the second. The
    survivor's Wait must raise PeerDiedError naming the victim within a few seconds."""
    with shmproxy.init() as comm:
        size = _large(comm)
        survivor = 1 - victim
        # Everything either rank needs is allocated and posted before the Barrier: after it, the
        # victim may be gone, and every call of the survivor's that checks the communicator raises.
        if comm.rank == victim:
            bufs = [comm.alloc(size, np.uint8) for _ in range(2)]
            comm.Barrier()
            if when == "mid":
                comm.Send(bufs[0], survivor, tag=0)
                comm.Isend(bufs[1], survivor, tag=1)
            os.kill(os.getpid(), signal.SIGKILL)
            raise AssertionError("still alive after SIGKILL")
        bufs = [comm.alloc(size, np.uint8) for _ in range(3)]
        reqs = [comm.Irecv(b, victim, tag=i) for i, b in enumerate(bufs)]
        comm.Barrier()
        t0 = time.monotonic()
        arrived = 0
        for rq in reqs:
            try:
                rq.Wait()
                arrived += 1
            except shmproxy.PeerDiedError as e:
                elapsed = time.monotonic() - t0
                assert elapsed < 5, f"PeerDiedError took {elapsed:.2f}s"
                assert e.rank == victim and f"rank {victim}" in str(e), str(e)
                if when == "mid":
                    assert arrived >= 1, "the message sent before the death was lost"
                return {"seconds": elapsed, "arrived": arrived, "message": str(e)}
        raise AssertionError("every receive from the dead rank completed")
