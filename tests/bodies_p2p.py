"""Rank bodies for the point-to-point tests: each function runs in every rank of a real job
(tests/rankmain.py), calls shmproxy.init() itself, and raises on any mismatch. Return values travel back
to the test as JSON."""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import shmproxy

DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]


def _pattern(n: int, dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, n).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dt)
    if dt.kind == "f":
        return rng.standard_normal(n).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)


def ring_all_dtypes() -> dict:
    """Every dtype, sizes from 0 to > 1 chunk, both the staged and the alloc path, around a ring."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        right, left = (r + 1) % n, (r - 1) % n
        checked = 0
        for dtype in DTYPES:
            for count in (0, 1, 7, 4099, (1 << 20) // np.dtype(dtype).itemsize + 3):
                for use_alloc in (False, True):
                    send = _pattern(count, dtype, seed=r * 1000 + count)
                    if use_alloc:
                        s = comm.alloc(count, dtype)
                        s[...] = send
                        out = comm.alloc(count, dtype)
                    else:
                        s = send
                        out = np.zeros(count, dtype)
                    rq = comm.Irecv(out, left, tag=count)
                    sq = comm.Isend(s, right, tag=count)
                    st = rq.Wait()
                    sq.Wait()
                    expect = _pattern(count, dtype, seed=left * 1000 + count)
                    if not np.array_equal(out, expect):
                        raise AssertionError(f"{dtype} x {count} alloc={use_alloc}: wrong data from {left}")
                    assert st.source == left and st.tag == count and st.nbytes == expect.nbytes, st
                    checked += 1
        return {"checked": checked}


def tags_and_order() -> None:
    """Tags select among messages; one pair and tag never overtake each other."""
    with shmproxy.init() as comm:
        assert comm.size >= 2
        if comm.rank == 0:
            with comm.group():
                reqs = [comm.Isend(np.full(4, 100 + i, np.int32), 1, tag=i % 3) for i in range(30)]
            shmproxy.Request.Waitall(reqs)
        elif comm.rank == 1:
            got = {t: [] for t in range(3)}
            for t in (2, 0, 1):  # the reverse of the posting order of the first messages
                for _ in range(10):
                    buf = np.zeros(4, np.int32)
                    comm.Recv(buf, 0, tag=t)
                    got[t].append(int(buf[0]))
            for t in range(3):
                assert got[t] == [100 + i for i in range(30) if i % 3 == t], (t, got[t])


def self_send() -> None:
    """A rank may send to itself, as in MPI."""
    with shmproxy.init() as comm:
        out = np.zeros(1000, np.float64)
        rq = comm.Irecv(out, comm.rank, tag=5)
        comm.Send(np.arange(1000, dtype=np.float64), comm.rank, tag=5)
        rq.Wait()
        assert np.array_equal(out, np.arange(1000, dtype=np.float64))


def group_many() -> dict:
    """A group longer than the rank's record pool and request slots (64 each here): the partial
    group is posted when records run out, and nothing is lost or reordered."""
    with shmproxy.init(max_ops_per_rank=64) as comm:
        k = 300
        if comm.rank == 0:
            with comm.group():
                reqs = [comm.Isend(np.array([i, -i], np.int64), 1, tag=i % 5) for i in range(k)]
            shmproxy.Request.Waitall(reqs)
        elif comm.rank == 1:
            buf = np.zeros(2, np.int64)
            for i in range(k):
                comm.Recv(buf, 0, tag=i % 5)
                assert list(buf) == [i, -i], (i, buf)
        return {"k": k}


def group_semantics() -> None:
    """comm.group() nests (one splice, when the outermost ends), posts what it holds even when the
    block raises, hands back the comm, and refuses a closed communicator."""
    comm = shmproxy.init()
    with comm:
        peer = 1 - comm.rank
        send, recv = comm.alloc(4, np.int32), comm.alloc((3, 4), np.int32)
        send[:] = comm.rank
        pp = comm._pp
        with comm.group() as g:
            assert g is comm and pp.group_depth == 1
            rq = [comm.Irecv(recv[0], peer, tag=1)]
            with comm.group():
                rq.append(comm.Irecv(recv[1], peer, tag=2))
                assert pp.group_depth == 2
            assert pp.chain_first >= 0, "the inner group's end spliced the outer group's records"
            sq = [comm.Isend(send, peer, tag=1), comm.Isend(send, peer, tag=2)]
        assert pp.group_depth == 0 and pp.chain_first == -1
        shmproxy.Request.Waitall(rq + sq)
        try:
            with comm.group():
                rq = comm.Irecv(recv[2], peer, tag=3)
                sq = comm.Isend(send, peer, tag=3)
                raise KeyError("user error inside the group")
        except KeyError:
            pass
        else:
            raise AssertionError("the block's exception was swallowed")
        assert pp.group_depth == 0
        shmproxy.Request.Waitall([rq, sq], timeout=30)   # posted despite the exception
        assert np.all(recv == peer), recv
    try:
        with comm.group():
            pass
    except shmproxy.Closed:
        pass
    else:
        raise AssertionError("group() on a closed communicator did not raise Closed")


def test_and_waitall() -> None:
    """Test() polls without blocking; Waitall waits for all."""
    with shmproxy.init() as comm:
        if comm.rank == 0:
            buf = np.zeros(16, np.uint8)
            req = comm.Irecv(buf, 1, tag=1)
            assert req.Test() is False  # rank 1 sends only after our go
            comm.Send(np.ones(1, np.uint8), 1, tag=0)
            deadline = time.monotonic() + 30
            while not req.Test():
                assert time.monotonic() < deadline
            assert np.all(buf == 7)
        elif comm.rank == 1:
            comm.Recv(np.zeros(1, np.uint8), 0, tag=0)
            comm.Send(np.full(16, 7, np.uint8), 0, tag=1)


def wait_and_test_in_c() -> dict:
    """Requests on comm.alloc memory end in C (Request.Wait/Test in shm/_poster.c): the Status is
    right, every completion slot comes back (16 slots, 300 round trips), and what C does not own
    (errors, a Wait inside a group, bad arguments) still behaves."""
    with shmproxy.init(max_ops_per_rank=16) as comm:
        me, peer = comm.rank, 1 - comm.rank
        slots0 = len(comm._waiter.free_slots)
        send, recv = comm.alloc(3, np.int64), comm.alloc(3, np.int64)
        for i in range(300):
            send[:] = (me, i, -i)
            rq = comm.Irecv(recv, peer, tag=i)
            if me == 0:
                assert rq.Test() is False  # rank 1 sends message i only after it received ours
                sent = comm.Isend(send, peer, tag=i).Wait(timeout=30)
                st = rq.Wait(30) if i % 2 else rq.Wait()
            else:
                st = rq.Wait(30) if i % 2 else rq.Wait()
                sent = comm.Isend(send, peer, tag=i).Wait(timeout=30)
            assert (sent.source, sent.tag, sent.nbytes) == (peer, i, 24), sent
            assert (st.source, st.tag, st.nbytes) == (peer, i, 24), st
            assert rq.Wait() is st and rq.Test() is True and rq.status is st
            assert recv.tolist() == [peer, i, -i], recv
        w = comm._waiter
        assert len(w.free_slots) == slots0 and not w.pending, (len(w.free_slots), w.pending)
        for args, kwargs in (((1, 2), {}), ((), {"bogus": 1}), ((1,), {"timeout": 1})):
            try:
                rq.Wait(*args, **kwargs)
            except TypeError:
                pass
            else:
                raise AssertionError(f"Wait{args}{kwargs} accepted")
        # Test() polls a pending alloc request in C and reaps it there once complete.
        rq = comm.Irecv(recv, peer, tag=1000)
        comm.Send(send, peer, tag=1000)
        deadline = time.monotonic() + 30
        while not rq.Test():
            assert time.monotonic() < deadline
        assert (rq.status.source, rq.status.tag, rq.status.nbytes) == (peer, 1000, 24)
        # Inside a group the ops are not posted yet: Wait must refuse, not spin.
        with comm.group():
            rq = comm.Irecv(recv, peer, tag=2000)
            try:
                rq.Wait(timeout=5)
            except shmproxy.InvalidUsage as e:
                assert "group" in str(e), str(e)
            else:
                raise AssertionError("Wait inside comm.group() did not raise")
            sq = comm.Isend(send, peer, tag=2000)
        shmproxy.Request.Waitall([rq, sq])
        assert len(comm._waiter.free_slots) == slots0 and not comm._waiter.pending
        return {"status": repr(st)}


def bad_input() -> None:
    """Each bad call raises before anything is posted and leaves the communicator usable."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        ok = np.zeros(8, np.float32)
        cases = [
            (lambda: comm.Send(ok, n), shmproxy.InvalidArgument, "out of range"),
            (lambda: comm.Send(ok, -1), shmproxy.InvalidArgument, "out of range"),
            (lambda: comm.Recv(ok, n + 5), shmproxy.InvalidArgument, "out of range"),
            (lambda: comm.Recv(np.zeros((8, 8), np.float32)[:, ::2], 0), shmproxy.InvalidArgument, "contiguous"),
            (lambda: comm.Recv(np.frombuffer(b"x" * 32, np.float32), 0), shmproxy.InvalidArgument, "read-only"),
            (lambda: comm.Send(np.array(["a", "b"]), 0), shmproxy.InvalidArgument, "unsupported dtype"),
            (lambda: comm.Send(np.array([object()]), 0), shmproxy.InvalidArgument, "unsupported dtype"),
            (lambda: comm.Send([1, 2, 3], 0), shmproxy.InvalidArgument, "numpy array"),
            (lambda: comm.Send(ok, 0, tag=2**70), shmproxy.InvalidArgument, "64 bits"),
            (lambda: comm.Send(ok, "1"), shmproxy.InvalidArgument, "must be an int"),
            (lambda: comm.alloc(4, "U3"), shmproxy.InvalidArgument, "unsupported dtype"),
        ]
        for fn, exc, text in cases:
            try:
                fn()
            except exc as e:
                assert text in str(e), (text, str(e))
                assert isinstance(e, ValueError)
            else:
                raise AssertionError(f"no {exc.__name__} for case {text!r}")
        # Still usable: a ring exchange works.
        right, left = (r + 1) % n, (r - 1) % n
        out = np.zeros(8, np.float32)
        rq = comm.Irecv(out, left)
        comm.Send(np.full(8, r, np.float32), right)
        rq.Wait()
        assert np.all(out == left)
    try:
        comm.Send(ok, 0)
    except shmproxy.Closed:
        pass
    else:
        raise AssertionError("Send on a closed communicator did not raise Closed")
    comm.close()  # idempotent


def truncation() -> None:
    """A message larger than the receive buffer: error at the receiver, nothing written past it."""
    with shmproxy.init() as comm:
        if comm.rank == 0:
            comm.Send(np.arange(100, dtype=np.int32), 1, tag=3)
            comm.Send(np.arange(10, dtype=np.int32), 1, tag=4)
        elif comm.rank == 1:
            big = comm.alloc(20, np.int32)
            big[:] = -1
            small = big[:10]
            try:
                comm.Recv(small, 0, tag=3)
            except shmproxy.TruncationError as e:
                assert "400 B" in str(e) and "40 B" in str(e), str(e)
            else:
                raise AssertionError("no TruncationError")
            assert np.all(big == -1), big  # nothing written, not even inside the buffer
            comm.Recv(small, 0, tag=4)
            assert np.array_equal(small, np.arange(10)) and np.all(big[10:] == -1)


def dtype_mismatch() -> None:
    """A synchronous send hears of the mismatch with its receive; a standard one of this size may
    complete buffered before the match (MPI's standard mode), so only its receiver is told."""
    with shmproxy.init() as comm:
        if comm.rank == 0:
            try:
                comm.Ssend(np.zeros(2, np.float32), 1)
            except shmproxy.InvalidUsage:
                pass
            else:
                raise AssertionError("sender not told of the dtype mismatch")
            try:   # told if its receive was posted before it arrived, else complete (buffered)
                comm.Send(np.zeros(2, np.float32), 1, tag=1)
            except shmproxy.InvalidUsage as e:
                assert "int64" in str(e), str(e)
        elif comm.rank == 1:
            for tag in (0, 1):
                try:
                    comm.Recv(np.zeros(1, np.int64), 0, tag)
                except shmproxy.InvalidUsage as e:
                    assert "float32" in str(e), str(e)
                else:
                    raise AssertionError("receiver not told of the dtype mismatch")


def big_message(nbytes: int) -> dict:
    """One message of ``nbytes`` (64-bit counts), from registered memory to registered memory."""
    with shmproxy.init() as comm:
        t = 0.0
        if comm.rank == 0:
            buf = comm.alloc(nbytes, np.uint8)
            buf[::4096] = np.arange(len(buf[::4096])) % 251
            buf[-1] = 77
            comm.Send(buf, 1)
        elif comm.rank == 1:
            buf = comm.alloc(nbytes, np.uint8)
            t0 = time.perf_counter()
            st = comm.Recv(buf, 0)
            t = time.perf_counter() - t0
            assert st.nbytes == nbytes
            assert np.array_equal(buf[::4096], np.arange(len(buf[::4096])) % 251) and buf[-1] == 77
        return {"seconds": t}


def timeout_names_pending() -> None:
    with shmproxy.init() as comm:
        comm.Barrier()      # rank 1 has joined before rank 0 aborts
        if comm.rank == 0:
            try:
                comm.Irecv(np.zeros(1), 1, tag=9).Wait(timeout=0.5)
            except shmproxy.Timeout as e:
                assert isinstance(e, TimeoutError)
                assert "from rank 1 tag 9" in str(e), str(e)
            else:
                raise AssertionError("no Timeout")
            comm.Abort("test over")
        else:
            try:
                comm.Recv(np.zeros(1), 0, tag=1)
            except shmproxy.Aborted as e:
                assert "rank 0" in str(e) and "test over" in str(e), str(e)
            else:
                raise AssertionError("no Aborted")


def with_block_error_names_root_cause() -> dict:
    """An exception in rank 0's ``with`` block aborts the job; the survivor's error says what was
    raised, where and with what message, even if rank 0 never gets to print it (rank 1, if it was
    still joining when that happened, is told by init)."""
    try:
        comm = shmproxy.init()
    except shmproxy.Aborted as e:
        text = str(e)
        assert os.environ["RANK"] == "1" and "while this rank joined" in text, text
    else:
        if comm.rank == 0:
            try:
                with comm:
                    raise KeyError("the root cause")
            except KeyError:
                return {}
            raise AssertionError("the with block swallowed the KeyError")
        with comm:
            try:
                comm.Recv(np.zeros(1), 0, tag=1)
            except shmproxy.Aborted as e:
                text = str(e)
            else:
                raise AssertionError("no Aborted")
    assert "rank 0" in text and "KeyError raised in the with block at bodies_p2p.py:" in text, text
    assert "the root cause" in text, text
    return {"error": text}


def progress_floats_over_bound_ranks_cpus() -> dict:
    """Ranks bound like ``mpirun --bind-to core`` and covering every CPU: nothing is spare, so the
    progress process (started by local rank 0, inheriting its binding) must widen to all the ranks'
    CPUs instead of queueing its loop and copy workers on rank 0's CPUs: the loop floats over all of
    them, and the copy workers are spread one per CPU (the loop runs copy jobs beside them). The
    node is crowded, so there is also one idle-priority keep-awake guard on each of those CPUs."""
    allowed = sorted(os.sched_getaffinity(0))
    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mine = {c for i, c in enumerate(allowed) if i % n == r}
    os.sched_setaffinity(0, mine)
    with shmproxy.init() as comm:
        comm.Barrier()
        pid = comm._proxy.pid
        deadline = time.monotonic() + 20
        while True:   # the decision is applied by the loop's next housekeeping tick
            masks, guards, copiers = {}, {}, {}
            for t in map(int, os.listdir(f"/proc/{pid}/task")):
                with open(f"/proc/{pid}/task/{t}/comm") as f:
                    name = f.read().strip()
                kind = {"shmproxy-awake": guards, "shmproxy-copy": copiers}.get(name, masks)
                kind[t] = sorted(os.sched_getaffinity(t))
            done = (all(m == allowed for m in masks.values())
                    and sorted(c for m in guards.values() for c in m) == allowed
                    and sorted(c for m in copiers.values() for c in m) == allowed)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        policies = [os.sched_getscheduler(t) for t in guards]
        comm.Barrier()
    assert all(m == allowed for m in masks.values()), (allowed, masks)
    assert sorted(c for m in guards.values() for c in m) == allowed, (allowed, guards)   # one per CPU
    assert sorted(c for m in copiers.values() for c in m) == allowed, (allowed, copiers)  # one per CPU
    assert policies == [os.SCHED_IDLE] * len(guards), policies
    return {"threads": len(masks), "guards": len(guards), "copiers": len(copiers)}


# ---------------------------------------------------------------------------------- faults
def _ring(comm) -> None:
    r, n = comm.rank, comm.size
    rq = comm.Irecv(np.zeros(1), (r - 1) % n, tag=12345)
    comm.Send(np.zeros(1), (r + 1) % n, tag=12345)
    rq.Wait()


def _report(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text + "\n")


def victim_rank_dies(victim: int) -> dict:
    """The victim SIGKILLs itself while its peers wait for its messages; survivors must raise
    PeerDiedError naming it (the test measures how long that took)."""
    with shmproxy.init() as comm:
        comm.Barrier()      # every rank has joined (dies_holding_mutex covers a rank still joining)
        if comm.rank == victim:
            comm.Ssend(np.zeros(1), (victim + 1) % comm.size, tag=99)  # received: peers know we are in
            os.kill(os.getpid(), signal.SIGKILL)
        src = (comm.rank - 1) % comm.size
        if src == victim:
            comm.Recv(np.zeros(1), victim, tag=99)
        t0 = time.monotonic()
        try:
            comm.Recv(np.zeros(8), victim, tag=1)
        except shmproxy.PeerDiedError as e:
            assert e.rank == victim and f"rank {victim}" in str(e), str(e)
            return {"seconds": time.monotonic() - t0, "message": str(e)}
        raise AssertionError("Recv from a dead rank returned")


def proxy_dies() -> dict:
    """Rank 0 SIGKILLs the progress process while everybody waits: every rank must raise."""
    with shmproxy.init() as comm:
        t0 = time.monotonic()
        try:
            comm.Barrier()  # every rank is initialised before the kill
            if comm.rank == 0:
                os.kill(comm._proxy.pid, signal.SIGKILL)
                t0 = time.monotonic()
            comm.Recv(np.zeros(8), (comm.rank + 1) % comm.size, tag=1)
        except shmproxy.PeerDiedError as e:
            assert e.rank == -1 and "progress process" in str(e), str(e)
            return {"seconds": time.monotonic() - t0}
        raise AssertionError("Recv after the progress process died returned")


def proxy_and_local_rank0_die() -> dict:
    """Local rank 0, which started the progress process, SIGKILLs it and then itself: the survivors
    raise, and between them remove what neither dead process could (socket file, pool name)."""
    with shmproxy.init() as comm:
        comm.Barrier()
        if comm.rank == 0:
            os.kill(comm._proxy.pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.Recv(np.zeros(8), 0, tag=1)
        except shmproxy.PeerDiedError as e:
            return {"message": str(e)}
        raise AssertionError("Recv after local rank 0 and the progress process died returned")


def dies_holding_mutex(victim: int) -> dict:
    """The victim takes the pool mutex and SIGKILLs itself while holding it; the next locker
    repairs the mutex (EOWNERDEAD) and every survivor is told who died: a survivor still joining
    when it happened, by init itself."""
    t_start = time.monotonic()
    try:
        comm = shmproxy.init()
    except shmproxy.PeerDiedError as e:
        return {"seconds": time.monotonic() - t_start, "message": str(e), "at": "init"}
    with comm:
        if comm.rank == victim:
            # synchronous: its receiver is past its post before the mutex is taken (a buffered Send
            # would complete first, and the receiver's post would find the mutex of a dead rank)
            comm.Ssend(np.zeros(1), (victim + 1) % comm.size, tag=99)
            comm._view.mutex.lock(5.0)
            os.kill(os.getpid(), signal.SIGKILL)
        src = (comm.rank - 1) % comm.size
        if src == victim:
            comm.Recv(np.zeros(1), victim, tag=99)
        t0 = time.monotonic()
        try:
            # Posting needs the mutex the victim died holding.
            comm.Recv(np.zeros(8), victim, tag=1)
        except shmproxy.PeerDiedError as e:
            assert f"rank {victim}" in str(e) or "mutex" in str(e), str(e)
            return {"seconds": time.monotonic() - t0, "message": str(e)}
        raise AssertionError("Recv from a dead rank returned")


def joins_after_a_death(fifo: str) -> dict:
    """Ranks 0 and 1 join; rank 1 SIGKILLs itself; rank 0, told by its Recv, waits for the progress
    process to begin shutting down and writes to ``fifo``; only then does rank 2 join, and its init
    must raise the failure, naming rank 1, not find the service gone."""
    import select
    rank = int(os.environ["RANK"])
    if rank == 2:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            ready, _, _ = select.select([fd], [], [], 60)
            assert ready and os.read(fd, 1) == b"x", "rank 0 never said the communicator failed"
        finally:
            os.close(fd)
        t0 = time.monotonic()
        try:
            shmproxy.init()
        except shmproxy.PeerDiedError as e:
            return {"seconds": time.monotonic() - t0, "message": str(e)}
        raise AssertionError("init of a failed communicator returned")
    with shmproxy.init() as comm:
        if rank == 1:
            comm.Recv(np.zeros(1), 0, tag=4)     # rank 0 has joined
            os.kill(os.getpid(), signal.SIGKILL)
        comm.Send(np.zeros(1), 1, tag=4)
        try:
            comm.Recv(np.zeros(1), 1, tag=5)
            raise AssertionError("Recv from a dead rank returned")
        except shmproxy.PeerDiedError as e:
            message = str(e)
        # Rank 2 joins once the progress process is shutting down: without the linger its service
        # would be gone by then.
        from shmproxy.shm import pool as P
        deadline = time.monotonic() + 30
        while comm._view.ctrl(P.CTRL_STATE) == P.PROXY_RUNNING and time.monotonic() < deadline:
            time.sleep(0.001)
        assert comm._view.ctrl(P.CTRL_STATE) != P.PROXY_RUNNING
        with open(fifo, "wb") as f:   # blocks until rank 2 has it open for reading
            f.write(b"x")
        return {"message": message}


if __name__ == "__main__":  # pragma: no cover - manual runs
    globals()[sys.argv[1]]()


def dump_live() -> dict:
    """Rank 1 waits on a message nobody has sent yet; rank 0 dumps the real progress process from
    outside (read-only pool) and through DUMP_SIGNAL, then releases rank 1."""
    import json
    import subprocess
    with shmproxy.init() as comm:
        big = comm.alloc(3 << 20, np.uint8)
        out = {}
        if comm.rank == 1:
            comm.Recv(np.zeros(4), 0, tag=42)
            comm.Recv(big, 0, tag=43)
        elif comm.rank == 0:
            pid = comm._proxy.pid
            cmd = [sys.executable, "-m", "shmproxy.tools.dump_cli", "--pid", str(pid), "--json"]
            deadline = time.monotonic() + 30
            while True:  # until rank 1's receive has been fetched by the progress process
                doc = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                                                check=True).stdout)
                state = doc["processes"][0]["pools"][0]["state"]
                if state["ranks"][1]["posted"] >= 1 and not state["posted_chain"]["records"]:
                    break
                assert time.monotonic() < deadline, state
            out["outside_pid"] = state["control"]["proxy_pid"]
            sig = subprocess.run(cmd + ["--signal"], capture_output=True, text=True, timeout=60, check=True)
            signalled = json.loads(sig.stdout)["processes"][0]
            os.unlink(signalled["dump_file"])   # output a person asked for: the test's to remove
            inside = signalled["state"]
            out["unmatched"] = inside["in_process"]["unmatched_recvs"]
            text = subprocess.run([sys.executable, "-m", "shmproxy.tools.dump_cli", "--pid", str(pid)],
                                  capture_output=True, text=True, timeout=60, check=True).stdout
            out["text_has_ranks"] = "rank" in text
            comm.Send(np.ones(4), 1, tag=42)
            comm.Send(big, 1, tag=43)
        return out


def profile_trace(path: str) -> None:
    """With SHMPROXY_PROFILE=1 the progress process writes a Chrome trace at exit."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        for i in range(20):
            out = np.zeros(1 << 18, np.uint8)
            rq = comm.Irecv(out, (r - 1) % n, tag=i)
            comm.Send(np.full(1 << 18, i, np.uint8), (r + 1) % n, tag=i)
            rq.Wait()
        # Allreduce #1 writes 2 x 128 KiB, #2 2 x 1 MiB: one on each side of STREAMING_MIN_BYTES=1M
        for count in (1 << 15, 1 << 18):
            x = np.full(count, 1.5, np.float32)
            y = np.zeros_like(x)
            comm.Allreduce(x, y)
            assert (y == 1.5 * n).all()


def started_beside_another_proxy_package(decoy_root: str) -> dict:
    """Ranks whose working directory holds another `shmproxy` package (another checkout, a decoy): the
    progress process must run this rank's code, not the one `python -m` would find there first, and
    must still resolve relative paths in the rank's directory."""
    import psutil
    os.chdir(decoy_root)
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        out = np.zeros(1000)
        rq = comm.Irecv(out, (r - 1) % n, tag=5)
        comm.Send(np.full(1000, float(r)), (r + 1) % n, tag=5)
        rq.Wait()
        assert (out == (r - 1) % n).all()
        proxy_cwd = psutil.Process(comm._proxy.pid).cwd()
    return {"proxy_cwd": proxy_cwd}
