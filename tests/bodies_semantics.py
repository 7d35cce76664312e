"""Rank bodies of tests/test_semantics.py: receive wildcards, what a closing receiver does to the
sends waiting for it, and a send posted before its receiver has joined.

Each function runs in every rank of a real job (tests/rankmain.py) and raises on any deviation.
"""
from __future__ import annotations

import importlib.util
import os
import time

import numpy as np

import shmproxy


def wildcards_in_mpi_order() -> dict:
    """Rank 0 posts receives with every mix of wildcards before anything is sent; ranks 1 and 2 send
    in a fixed order, one message at a time (a Barrier after each: collectives never match a
    receive, and a synchronous Ssend returns once matched), so the arrival order is known. Every
    receive must get the message MPI's rules give it: a message goes to the earliest posted receive
    that accepts it, and the Status names the real source and tag. (A standard Send would not do:
    it may return buffered, from a fast-path cell the progress process drains later, and MPI orders
    messages of one sender only, not two senders' across a Barrier.)"""
    A, S = shmproxy.ANY_SOURCE, shmproxy.ANY_TAG
    with shmproxy.init() as comm:
        r = comm.rank
        # (source, tag) of rank 0's receives, in posting order, and the messages in sending order
        posts = [(2, 7), (A, 5), (1, S), (A, S), (2, S), (A, 9)]
        sends = [(1, 5), (2, 5), (1, 7), (2, 7), (2, 9), (1, 9)]   # (sender, tag), message i has value i
        if r == 0:
            bufs = [np.full(1, -1, np.int64) for _ in posts]
            reqs = [comm.Irecv(b, s, t) for b, (s, t) in zip(bufs, posts)]
            for _ in sends:
                comm.Barrier()
            got = []
            for b, rq in zip(bufs, reqs):
                st = rq.Wait(timeout=30)
                got.append((int(b[0]), st.source, st.tag))
            # the reference: MPI's rule applied by hand to the arrival order
            pending = list(enumerate(posts))
            want: dict[int, tuple] = {}
            for i, (sender, tag) in enumerate(sends):
                k = next(k for k, (s, t) in pending if s in (A, sender) and t in (S, tag))
                pending = [(j, p) for j, p in pending if j != k]
                want[k] = (i, sender, tag)
            assert got == [want[k] for k in range(len(posts))], (got, want)
            return {"got": got}
        for i, (sender, tag) in enumerate(sends):
            if sender == r:
                comm.Ssend(np.array([i], np.int64), 0, tag=tag)
            comm.Barrier()
        return {}


def wildcard_arguments_are_for_receives() -> None:
    """ANY_TAG and ANY_SOURCE on a send are refused before anything is posted, by the C fast path's
    fallback and the full path alike, and the communicator goes on."""
    with shmproxy.init() as comm:
        peer = (comm.rank + 1) % comm.size
        x = comm.alloc(4, np.int32)
        for buf in (x, np.zeros(4, np.int32)):      # registered (C fast path) and staged (Python)
            for call in (lambda: comm.Isend(buf, peer, tag=shmproxy.ANY_TAG),
                         lambda: comm.Send(buf, peer, tag=shmproxy.ANY_TAG),
                         lambda: comm.Isend(buf, shmproxy.ANY_SOURCE, tag=0)):
                try:
                    call()
                except shmproxy.InvalidArgument as exc:
                    assert "ANY_" in str(exc), exc
                else:
                    raise AssertionError("a wildcard send was accepted")
        out = np.zeros(4, np.int32)
        rq = comm.Irecv(out, shmproxy.ANY_SOURCE, shmproxy.ANY_TAG)
        comm.Send(np.full(4, comm.rank, np.int32), peer, tag=-(2**63) + 1)
        st = rq.Wait(timeout=30)
        src = (comm.rank - 1) % comm.size
        assert (st.source, st.tag) == (src, -(2**63) + 1) and (out == src).all(), (st, out)


def sends_fail_when_their_receiver_closes() -> dict:
    """Ranks 0 and 1 post sends to rank 2 that it never receives; rank 2 closes after a Barrier. Both
    senders get InvalidUsage (the receiver closed first) within seconds, not a Timeout after
    SHMPROXY_TIMEOUT: whether their sends reached the progress process before or after the close.
    The sends are synchronous (Issend): a standard one this small would be buffered and complete."""
    with shmproxy.init() as comm:
        r = comm.rank
        if r == 2:
            comm.Barrier()
            return {}
        early = comm.Issend(np.full(5, 7, np.int32), 2, tag=0)   # waiting before the close
        comm.Barrier()
        t0 = time.monotonic()
        late = comm.Issend(np.full(5, 7, np.int32), 2, tag=1)    # before or after it
        took = []
        for rq in (early, late):
            try:
                rq.Wait(timeout=60)
            except shmproxy.InvalidUsage:
                took.append(time.monotonic() - t0)
            else:
                raise AssertionError("a send to a rank that closed without receiving it completed")
        assert max(took) < 5, took
        return {"took": took}


def send_before_the_receiver_joins(marker: str) -> None:
    """Rank 0 posts a send to rank 1 and only then lets rank 1 call init (a marker file): the progress
    process must keep the envelope for a rank it does not know yet, not refuse it."""
    if int(os.environ["RANK"]) == 1:
        deadline = time.monotonic() + 30
        while not os.path.exists(marker):
            assert time.monotonic() < deadline, "rank 0 never posted"
            time.sleep(0.005)    # waiting for another process's file, not synchronising with shmproxy
    with shmproxy.init() as comm:
        if comm.rank == 0:
            rq = comm.Isend(np.arange(100, dtype=np.float64), 1, tag=3)
            open(marker, "w").close()
            rq.Wait(timeout=30)
        else:
            out = np.zeros(100)
            st = comm.Recv(out, 0, tag=3)
            assert st.source == 0 and (out == np.arange(100)).all()


class _DeviceArray:
    """Looks like a cupy array to the rank's checks (the CUDA array interface), owns no memory."""

    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}


def memory_kinds_are_checked_end_to_end() -> None:
    """A device array that cannot be used (no cupy here, or no memory behind it) is refused at the rank,
    naming its kind, before anything is posted (point-to-point and collectives), and so is one mixed
    with a host array; a REGISTER of device memory without an IPC handle is refused by the progress
    process, naming the kind; an unknown kind is refused; the communicator goes on working after each."""
    from shmproxy.control.protocol import MsgType
    with shmproxy.init() as comm:
        dev, host = _DeviceArray(), np.zeros(4, np.float32)
        peer = (comm.rank + 1) % comm.size
        for call in (lambda: comm.Isend(dev, peer), lambda: comm.Irecv(dev, peer),
                     lambda: comm.Allreduce(dev, host), lambda: comm.Allreduce(host, dev),
                     lambda: comm.Bcast(dev, 0)):
            try:
                call()
            except shmproxy.InvalidArgument as exc:
                # without cupy: refused naming the array; mixed with a host array: refused as a mix
                assert (("cuda device memory" in str(exc) and "_DeviceArray" in str(exc))
                        or "host and device buffers mixed" in str(exc)), exc
            else:
                raise AssertionError("a device array was accepted")
        if importlib.util.find_spec("cupy") is None:   # device allocations need cupy: a clear refusal
            for call in (lambda: comm.alloc_device(4), lambda: comm.alloc(4, np.float32, device=0)):
                try:
                    call()
                except shmproxy.InvalidArgument as exc:
                    assert "needs cupy" in str(exc), exc
                else:
                    raise AssertionError("a device allocation without cupy was accepted")
        for kind, text in (("cuda", "cuda memory (device 0) by rank"), ("tape", "unknown memory kind 'tape'")):
            try:
                comm._control(MsgType.REGISTER, {"buf_id": 9999, "bytes": 16, "kind": kind, "device": 0})
            except shmproxy.InvalidArgument as exc:
                assert text in str(exc), exc
            else:
                raise AssertionError(f"REGISTER of {kind} memory was accepted")
        out = np.zeros(4, np.float32)
        comm.Allreduce(np.full(4, comm.rank + 1, np.float32), out)
        assert (out == comm.size * (comm.size + 1) / 2).all()


def timeout_in_a_with_block_ends_in_one_bound() -> dict:
    """Rank 1 waits for a message nobody sends: its Timeout leaves the with block, whose close must not
    wait for the same request a second time (one SHMPROXY_TIMEOUT in all, not two). Rank 0 stays (a
    receive from rank 1, which never sends) until rank 1's close fails it: the peer closed first."""
    t0 = time.monotonic()
    try:
        with shmproxy.init() as comm:
            if comm.rank == 1:
                comm.Recv(np.zeros(4, np.int32), 0, tag=41)
            else:
                try:   # waits longer than rank 1's bound (its own explicit deadline), to see its close
                    comm.Irecv(np.zeros(4, np.int32), 1, tag=99).Wait(timeout=60)
                except shmproxy.InvalidUsage as exc:
                    assert "closed" in str(exc), exc
                    return {"elapsed": time.monotonic() - t0, "timed_out": False}
    except shmproxy.Timeout:
        return {"elapsed": time.monotonic() - t0, "timed_out": True}
    return {"elapsed": time.monotonic() - t0, "timed_out": False}


def exit_with_an_unmatched_receive_is_prompt_and_says_so() -> dict:
    """Rank 1 leaves its with block with a receive nobody will match: close abandons it at once and
    names it on stderr (the progress process drops it), instead of waiting out SHMPROXY_TIMEOUT."""
    with shmproxy.init() as comm:
        comm.Barrier()
        t0 = time.monotonic()
        if comm.rank == 1:
            comm.Irecv(np.zeros(4, np.int32), 0, tag=41)
    return {"close_s": time.monotonic() - t0}


def exit_after_the_sender_closed_names_the_receive() -> dict:
    """The other order of the race above: rank 0 has closed (and the progress process failed rank 1's
    receives from it) before rank 1 leaves its with block. A second receive's Wait is what says so;
    the first, never tested, is then abandoned by close and named, not raised."""
    with shmproxy.init() as comm:
        comm.Barrier()
        if comm.rank == 1:
            comm.Irecv(np.zeros(4, np.int32), 0, tag=41)
            try:
                comm.Irecv(np.zeros(1, np.int32), 0, tag=42).Wait(timeout=30)
            except shmproxy.InvalidUsage as exc:
                assert "closed the communicator first" in str(exc), exc
            else:
                raise AssertionError("a receive from a closed rank completed")
            t0 = time.monotonic()
    return {"close_s": time.monotonic() - t0} if comm.rank == 1 else {}


def a_bad_op_names_what_was_passed() -> None:
    """op="sum" (mpi4py users write strings, or MPI.SUM objects) is refused naming what was passed."""
    with shmproxy.init() as comm:
        x, y = np.ones(4, np.float32), np.zeros(4, np.float32)
        for bad, text in (("sum", "got 'sum' (str)"), (None, "got None (NoneType)"), (99, "unknown reduction op 99")):
            try:
                comm.Allreduce(x, y, op=bad)
            except shmproxy.InvalidArgument as exc:
                assert text in str(exc), (bad, str(exc))
            else:
                raise AssertionError(f"op={bad!r} was accepted")
        comm.Allreduce(x, y, op=shmproxy.SUM)
        assert (y == comm.size).all()


def second_init_is_refused() -> dict:
    """shmproxy.init() again while the first communicator of the job is open: every rank is refused
    alike before anything is started (it used to take the live socket for a stale one), and the first
    communicator still works."""
    comm = shmproxy.init()
    try:
        shmproxy.init()
        second = "joined"
    except shmproxy.InvalidUsage as exc:
        second = str(exc)
    x = np.zeros(1)
    comm.Allreduce(np.ones(1), x)
    comm.Ibarrier().Wait()
    comm.close()
    return {"second": second, "sum": float(x[0])}
