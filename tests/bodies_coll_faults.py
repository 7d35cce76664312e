"""Rank bodies for tests/test_coll.py: what goes wrong in a collective. Mismatched calls across ranks,
bad arguments, empty buffers, non-contiguous buffers, and a rank or the progress process killed (or
Abort called) in the middle of one.

Shared inputs and helpers live in tests/bodies_coll.py.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np

import shmproxy
from tests.bodies_coll import DTYPES


MISMATCH_KINDS = ("coll", "count", "dtype", "root", "op", "nonblocking", "dtype_bcast", "count_alltoall",
                  "last_rank")


def mismatch(kind: str) -> dict:
    """Rank 0 calls one collective, the others another at the same position of the sequence.
    Every rank must raise InvalidUsage naming both fingerprints; later calls must raise too."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        comm.Barrier()  # everybody is in, and the sequences are aligned
        odd = r == 0
        t0 = time.monotonic()
        err: BaseException | None = None
        try:
            if kind == "coll":
                if odd:
                    comm.Allreduce(np.ones(100, np.float32), np.zeros(100, np.float32))
                else:
                    comm.Bcast(np.zeros(100, np.float32), root=0)
            elif kind == "count":
                c = 1234 if odd else 4321
                comm.Allreduce(np.ones(c, np.float32), np.zeros(c, np.float32))
            elif kind == "dtype":
                dt = np.float32 if odd else np.int32   # same size: only the dtype differs
                comm.Allreduce(np.ones(100, dt), np.zeros(100, dt))
            elif kind == "root":
                comm.Bcast(np.zeros(100, np.float32), root=0 if odd else n - 1)
            elif kind == "op":
                comm.Allreduce(np.ones(100, np.float32), np.zeros(100, np.float32),
                               op=shmproxy.SUM if odd else shmproxy.MAX)
            elif kind == "dtype_bcast":   # data movement only, same bytes: the dtype still counts
                comm.Bcast(np.zeros(100, np.float32 if odd else np.int32), root=0)
            elif kind == "count_alltoall":
                c = 1234 if odd else 4321
                comm.Alltoall(np.zeros(c * n, np.int16), np.zeros(c * n, np.int16))
            elif kind == "last_rank":     # only the last rank disagrees (fingerprints 'Reduce' / 'Allreduce')
                if r == n - 1:
                    comm.Allreduce(np.ones(100, np.float64), np.zeros(100, np.float64))
                else:
                    comm.Reduce(np.ones(100, np.float64), np.zeros(100, np.float64), root=0)
            elif kind == "nonblocking":
                if odd:
                    req = comm.Iallreduce(np.ones(100, np.float32), np.zeros(100, np.float32))
                else:
                    req = comm.Ibcast(np.zeros(100, np.float32), root=0)
                req.Wait()
            else:
                raise ValueError(kind)
        except Exception as exc:
            err = exc
        elapsed = time.monotonic() - t0
        later = None
        try:
            comm.Allreduce(np.ones(4), np.zeros(4))
        except Exception as exc:
            later = type(exc).__name__
        return {"error": None if err is None else type(err).__name__,
                "is_invalid_usage": isinstance(err, shmproxy.InvalidUsage),
                "message": "" if err is None else str(err), "seconds": elapsed, "later": later}


def sub_mismatch(n_colors: int = 2) -> dict:
    """A mismatch on one sub-communicator: its members raise InvalidUsage; the sibling
    sub-communicator and the parent keep working (separate pools and progress processes)."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        color = r % n_colors
        sub = comm.Split(color)
        err = None
        if color == 0:
            try:
                if sub.rank == 0:
                    sub.Allreduce(np.ones(10), np.zeros(10))
                else:
                    sub.Bcast(np.zeros(10), root=0)
            except shmproxy.InvalidUsage as exc:
                err = str(exc)
        else:
            x = np.zeros(10)
            for _ in range(3):
                sub.Allreduce(np.ones(10), x)
            assert np.all(x == sub.size)
        y = np.zeros(4)
        comm.Allreduce(np.ones(4), y)
        assert np.all(y == n), y
        sub.close()
        return {"color": color, "error": err}


def bad_arguments() -> dict:
    """Bad buffers and arguments raise InvalidArgument before anything is posted, on every rank alike;
    the communicator stays usable (a collective afterwards works)."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        f4 = np.zeros(10, np.float32)
        cases = {
            "Allreduce recv too small": lambda: comm.Allreduce(f4, np.zeros(9, np.float32)),
            "Allreduce dtypes differ": lambda: comm.Allreduce(f4, np.zeros(10, np.float64)),
            "Allreduce AVG on int": lambda: comm.Allreduce(np.ones(10, np.int32), np.zeros(10, np.int32),
                                                           op=shmproxy.AVG),
            "Allreduce SUM on bool": lambda: comm.Allreduce(np.ones(10, bool), np.zeros(10, bool)),
            "Iallreduce PROD on bool": lambda: comm.Iallreduce(np.ones(10, bool), np.zeros(10, bool),
                                                               op=shmproxy.PROD),
            "Allreduce AVG on bool": lambda: comm.Allreduce(np.ones(10, bool), np.zeros(10, bool),
                                                            op=shmproxy.AVG),
            "Reduce root out of range": lambda: comm.Reduce(f4, np.zeros(10, np.float32), root=n),
            "Bcast root negative": lambda: comm.Bcast(f4, root=-1),
            "Bcast not an array": lambda: comm.Bcast([1, 2, 3], root=0),
            "Allreduce read-only recv": lambda: comm.Allreduce(f4, np.frombuffer(b"\0" * 40, np.float32)),
            "Allgather recv wrong size": lambda: comm.Allgather(f4, np.zeros(10 * n + 1, np.float32)),
            "Reduce_scatter_block send wrong size": lambda: comm.Reduce_scatter_block(
                np.zeros(10 * n + 1, np.float32), np.zeros(10, np.float32)),
            "Alltoall sizes differ": lambda: comm.Alltoall(np.zeros(10 * n, np.float32),
                                                           np.zeros(10 * n + n, np.float32)),
            "Allreduce unsupported dtype": lambda: comm.Allreduce(np.array(["a"]), np.array(["b"])),
            "Allreduce bad op": lambda: comm.Allreduce(f4, np.zeros(10, np.float32), op="sum"),
            "Allreduce non-contiguous recv": lambda: comm.Allreduce(
                f4, np.zeros((10, 2), np.float32)[:, 0]),

        }
        wrong = {}
        for name, fn in cases.items():
            try:
                fn()
            except shmproxy.InvalidArgument:
                continue
            except Exception as exc:
                wrong[name] = f"{type(exc).__name__}: {exc}"
            else:
                wrong[name] = "no error"
            if comm.get_async_error() is not None:
                wrong[name + " (then)"] = f"communicator failed: {comm.get_async_error()}"
                break
        out = np.zeros(3, np.int64)
        comm.Allreduce(np.full(3, r, np.int64), out)
        assert np.all(out == n * (n - 1) // 2), out
        return {"wrong": wrong}


def empty_and_single() -> dict:
    """0-element buffers for every collective and dtype, on alloc and plain buffers."""
    with shmproxy.init() as comm:
        n = comm.size
        k = 0
        for dtype in DTYPES:
            op = shmproxy.MAX if dtype == "bool" else shmproxy.SUM
            for alloc in (False, True):
                def z(c):
                    return comm.alloc(c, dtype) if alloc else np.zeros(c, dtype)
                comm.Allreduce(z(0), z(0), op=op)
                comm.Allreduce(shmproxy.IN_PLACE, z(0), op=op)
                comm.Reduce(z(0), z(0), op=op, root=n - 1)
                comm.Bcast(z(0), root=0)
                comm.Allgather(z(0), z(0))
                comm.Reduce_scatter_block(z(0), z(0), op=op)
                comm.Alltoall(z(0), z(0))
                shmproxy.Request.Waitall([comm.Iallreduce(z(0), z(0), op=op), comm.Ibcast(z(0), root=0),
                                          comm.Iallgather(z(0), z(0)), comm.Ialltoall(z(0), z(0)),
                                          comm.Ireduce(z(0), z(0), op=op, root=0),
                                          comm.Ireduce_scatter_block(z(0), z(0), op=op), comm.Ibarrier()])
                k += 14
        return {"calls": k}


def noncontiguous_consistent(coll: str) -> dict:
    """A non-contiguous buffer where the role decides whether it is read or written (Bcast's buf,
    Reduce's recvbuf on the root): whatever the library decides, every rank must decide the same,
    or the ranks' collective sequences drift apart. Then an Allreduce must still work."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        comm.Barrier()
        base = np.zeros((10, 2), np.float32)
        buf = base[:, 0]
        if coll == "Bcast":
            if r == 0:
                buf[:] = np.arange(10)
            call = lambda: comm.Bcast(buf, root=0)  # noqa: E731
            want = np.arange(10, dtype=np.float32)
        else:
            call = lambda: comm.Reduce(np.ones(10, np.float32), buf, root=0)  # noqa: E731
            want = np.full(10, n, np.float32) if r == 0 else None
        try:
            call()
            outcome = "ok"
        except shmproxy.InvalidArgument:
            outcome = "InvalidArgument"
        except shmproxy.ProxyError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        correct = None if outcome != "ok" or want is None else bool(np.array_equal(buf, want))
        after = None
        try:
            x = np.zeros(2)
            comm.Allreduce(np.ones(2), x)
        except shmproxy.ProxyError as exc:
            after = f"{type(exc).__name__}: {exc}"
        return {"outcome": outcome, "correct": correct, "after": after}


def victim_dies_in_allreduce(victim: int, when: str, nbytes: int) -> dict:
    """The victim SIGKILLs itself right before posting an Iallreduce of ``nbytes``, right after, or
    a quarter of the time one such Allreduce takes after posting; the survivors are in the same Allreduce.
    The progress process moves every rank's bytes, so the collective may legitimately complete when
    the victim dies after posting: then the next collective (a Barrier) must raise. Either way every
    survivor gets PeerDiedError; the test checks which rank it names and how long it took."""
    with shmproxy.init() as comm:
        r = comm.rank
        count = nbytes // 4
        send = comm.alloc(count, np.float32)
        send[:] = 1.0
        recv = comm.alloc(count, np.float32)
        comm.Allreduce(np.ones(1), np.zeros(1))   # every rank is in before the kill
        t = time.perf_counter()
        comm.Allreduce(send, recv)                # warm, and how long one takes
        one = time.perf_counter() - t
        if r == victim:
            if when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            comm.Iallreduce(send, recv)
            if when == "during":
                time.sleep(one / 4)
            os.kill(os.getpid(), signal.SIGKILL)
        return _expect_peer_died(lambda: comm.Allreduce(send, recv), comm, one)


def _expect_peer_died(first, comm, one: float) -> dict:
    t0 = time.monotonic()
    phase = "Allreduce"
    try:
        first()
        phase = "Barrier after the Allreduce completed"
        # through the progress process: a blocking Barrier runs between the ranks (rank/fastpath.py),
        # which notices the death only at its next look at the pidfd
        comm.Ibarrier().Wait()
    except shmproxy.PeerDiedError as exc:
        return {"seconds": time.monotonic() - t0, "message": str(exc), "rank": exc.rank,
                "error": type(exc).__name__, "phase": phase, "one_allreduce_s": one}
    except Exception as exc:
        return {"seconds": time.monotonic() - t0, "message": str(exc), "rank": None,
                "error": type(exc).__name__, "phase": phase, "one_allreduce_s": one}
    return {"seconds": time.monotonic() - t0, "message": "", "rank": None, "error": None, "phase": phase,
            "one_allreduce_s": one}


def proxy_dies_in_allreduce(nbytes: int) -> dict:
    """Rank 0 SIGKILLs the progress process a quarter of the way through a large Allreduce every rank is
    in; if that Allreduce completed first, the next collective must raise."""
    with shmproxy.init() as comm:
        count = nbytes // 4
        send = comm.alloc(count, np.float32)
        recv = comm.alloc(count, np.float32)
        comm.Allreduce(np.ones(1), np.zeros(1))
        t = time.perf_counter()
        comm.Allreduce(send, recv)
        one = time.perf_counter() - t
        req = comm.Iallreduce(send, recv)
        if comm.rank == 0:
            time.sleep(one / 4)
            os.kill(comm._proxy.pid, signal.SIGKILL)
        return _expect_peer_died(req.Wait, comm, one)


def abort_during_allreduce() -> dict:
    """Rank 0 calls Abort while the others wait in a large Allreduce: they raise Aborted (the
    reason in the message) within the time returned."""
    with shmproxy.init() as comm:
        r = comm.rank
        comm.Barrier()
        if r == 0:
            time.sleep(0.2)
            comm.Abort("coll test over")
            return {}
        t0 = time.monotonic()
        try:
            comm.Allreduce(comm.alloc(1 << 22, np.float32), comm.alloc(1 << 22, np.float32))
        except shmproxy.ProxyError as exc:
            return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}
        return {"error": None, "seconds": time.monotonic() - t0}
