"""The C helpers outside the pool protocol: Status, buffer_info, the reduce kernel (shm._reduce)
against numpy, the copy worker pool (shm._workers.Workers) and the streaming copy."""
from __future__ import annotations

import time

import numpy as np
import pytest

import shmproxy
from shmproxy.core import ops
from shmproxy.shm import _native


def test_status_is_built_in_c_and_reads_like_mpi_status():
    st = shmproxy.Status(3, -(2**63), 1 << 40)
    assert (st.source, st.tag, st.nbytes) == (3, -(2**63), 1 << 40)
    assert repr(st) == f"Status(source=3, tag={-(2**63)}, nbytes={1 << 40})"
    assert shmproxy.Status(source=1, tag=2, nbytes=3).tag == 2
    with pytest.raises(TypeError):
        shmproxy.Status(1, 2)


def test_buffer_info_rejects_what_cannot_be_received_into():
    a = np.zeros(10)
    addr, n = _native.buffer_info(a, True)
    assert n == 80 and addr == a.__array_interface__["data"][0]
    with pytest.raises((BufferError, ValueError)):
        _native.buffer_info(a[::2], True)
    ro = np.frombuffer(b"x" * 16, np.uint8)
    with pytest.raises((BufferError, ValueError)):
        _native.buffer_info(ro, True)


_KERNEL_CASES = [(op, dt) for op in ("SUM", "PROD", "MIN", "MAX", "AVG")
                 for dt in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                            "float16", "float32", "float64", "complex64", "complex128")]


def _kernel_inputs(dt: np.dtype, nsrc: int, count: int, rng) -> list[np.ndarray]:
    if dt.kind == "b":
        return [rng.integers(0, 2, count).astype(bool) for _ in range(nsrc)]
    if dt.kind in "iu":   # full range: sums and products overflow and must wrap like numpy's
        info = np.iinfo(dt)
        return [rng.integers(info.min, info.max, count, dtype=dt, endpoint=True) for _ in range(nsrc)]
    xs = [(rng.standard_normal(count) * 100).astype(dt) for _ in range(nsrc)]
    if dt.kind == "c":
        xs = [(x + 1j * rng.standard_normal(count)).astype(dt) for x in xs]
    else:
        xs[0][::97] = np.nan    # MIN/MAX must return the NaN, from either side
        xs[-1][5::89] = np.nan
    return xs


@pytest.mark.parametrize("op,dtype", _KERNEL_CASES)
@pytest.mark.parametrize("streaming", [False, True])
def test_reduce_kernel_matches_numpy(op, dtype, streaming):
    """shm._reduce gives numpy's results bit for bit (AVG: numpy's sum divided by n), for the pairs it
    takes; it takes every pair the collectives allow except float16 and complex PROD/MIN/MAX."""
    from shmproxy.coll import sched
    from shmproxy.shm import _reduce
    dt, code, rop = np.dtype(dtype), ops.DTYPE_CODE[np.dtype(dtype).char], int(sched.ReduceOp[op])
    allowed = not ((dt.kind == "b" and op not in ("MIN", "MAX")) or (op == "AVG" and dt.kind not in "fc"))
    takes = allowed and dt != np.float16 and not (dt.kind == "c" and op in ("MIN", "MAX", "PROD"))
    assert _reduce.supported(rop, code) is takes
    if not takes:
        with pytest.raises(ValueError, match="not supported"):
            _reduce.reduce(rop, code, 1, [0], [0], streaming)
        return
    rng = np.random.default_rng(7)
    count = 5000 + 3   # several kernel blocks and a ragged tail
    xs = _kernel_inputs(dt, 5, count, rng)
    want = xs[0].copy()
    with np.errstate(all="ignore"):
        for x in xs[1:]:
            sched.UFUNCS[rop](want, x, out=want)
        if op == "AVG":
            np.divide(want, len(xs), out=want, casting="unsafe")
    fill = np.array(7).astype(dt)
    outs = [np.full(count + 2, fill, dt) for _ in range(3)]
    dsts = [o[1:-1].ctypes.data for o in outs]
    _reduce.reduce(rop, code, count, [x.ctypes.data for x in xs], dsts, streaming)
    for o in outs:
        assert o[0] == fill and o[-1] == fill, "wrote outside the destination"
        if op == "AVG":
            np.testing.assert_allclose(o[1:-1], want, rtol=1e-6 if dt in (np.float32, np.complex64) else 1e-14)
        else:
            np.testing.assert_array_equal(o[1:-1], want)   # NaNs in the same places


def test_reduce_kernel_output_may_alias_an_input():
    from shmproxy.shm import _reduce
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(100_003).astype(np.float32) for _ in range(4)]
    want = xs[0] + xs[1] + xs[2] + xs[3]
    _reduce.reduce(1, ops.DTYPE_CODE["f"], xs[0].size, [x.ctypes.data for x in xs], [xs[2].ctypes.data,
                   xs[0].ctypes.data], True)   # in-place Allreduce: rank 0's and 2's buffers are also outputs
    np.testing.assert_array_equal(xs[0], want)
    np.testing.assert_array_equal(xs[2], want)


def test_worker_pool_runs_steps_in_order_and_returns_every_token_once():
    """shm._workers: a job's steps run in order on one thread (the REDUCE reads what the COPY wrote),
    with plain or (every other job) streaming stores, jobs spread over the threads, and each token
    comes back exactly once."""
    from shmproxy.shm import _workers
    rng = np.random.default_rng(11)
    pool = _workers.Workers(3, None)
    try:
        n, njobs = 70_001, 24
        xs = [rng.standard_normal(n).astype(np.float64) for _ in range(njobs)]
        scratch = [np.zeros(n) for _ in range(njobs)]
        outs = [np.zeros((2, n)) for _ in range(njobs)]
        code = ops.DTYPE_CODE["d"]
        for j in range(njobs):
            pool.run(("job", j), [
                (_workers.COPY, scratch[j].ctypes.data, xs[j].ctypes.data, xs[j].nbytes),
                (_workers.REDUCE, 1, code, n, [scratch[j].ctypes.data, xs[j].ctypes.data],
                 [outs[j][0].ctypes.data, outs[j][1].ctypes.data]),
            ], j % 2 == 1)
        a, b = np.arange(1000, dtype=np.uint8), np.zeros(1000, np.uint8)
        pool.copy("copy", b.ctypes.data, a.ctypes.data, a.nbytes)
        got: list = []
        deadline = time.monotonic() + 30
        while len(got) < njobs + 1 and time.monotonic() < deadline:
            pool.wait(1.0)
            got += pool.drain()
        assert sorted(got, key=str) == sorted([("job", j) for j in range(njobs)] + ["copy"], key=str)
        assert pool.pending == 0 and pool.drain() == []
        for j in range(njobs):
            np.testing.assert_array_equal(outs[j][0], xs[j] + xs[j])
            np.testing.assert_array_equal(outs[j][1], xs[j] + xs[j])
        np.testing.assert_array_equal(a, b)
    finally:
        pool.stop()


def test_worker_pool_rejects_bad_jobs_before_queueing_and_stops_cleanly():
    from shmproxy.shm import _workers
    pool = _workers.Workers(1, [0])
    x = np.ones(8, np.float16)
    bad = [
        [(_workers.REDUCE, 1, ops.DTYPE_CODE["e"], 8, [x.ctypes.data], [x.ctypes.data])],  # float16: numpy's
        [(_workers.REDUCE, 1, ops.DTYPE_CODE["f"], 8, [], [x.ctypes.data])],                 # no source
        [(_workers.COPY, x.ctypes.data, x.ctypes.data)],                                     # short tuple
        [(_workers.COPY, 0, x.ctypes.data, 8)],                                              # null address
        [(9, 1, 2, 3)],                                                                      # unknown kind
        [[_workers.COPY, x.ctypes.data, x.ctypes.data, 8]],                                  # not a tuple
    ]
    for steps in bad:
        with pytest.raises((ValueError, TypeError)):
            pool.run("bad", steps)
    with pytest.raises(TypeError, match="streaming"):
        pool.run("bad", [], False, "extra")
    assert pool.pending == 0
    t0 = time.monotonic()
    assert pool.wait(0.05) is False            # bounded: nothing in flight
    assert time.monotonic() - t0 < 5
    pool.done("py")                            # a Python worker's report joins the same list
    assert pool.wait(0.0) is True and pool.drain() == ["py"]
    pool.stop()
    pool.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        pool.copy("late", x.ctypes.data, x.ctypes.data, 2)
    with pytest.raises(ValueError, match="nthreads"):
        _workers.Workers(-1)


def test_worker_pool_wait_ends_on_news_in_the_watched_word():
    """The loop's wait on its workers also watches the pool's EVENTS word (the collective wire's
    tokens, shm/_wire.c): a word that differs from what the loop saw ends the poll, and the sleep,
    at once; an unchanged one leaves the wait to its bound."""
    from shmproxy.shm import _workers
    pool = _workers.Workers(1, [0])
    word = np.zeros(1, np.uint64)
    try:
        t0 = time.monotonic()
        assert pool.wait(0.2, 0.2, word.ctypes.data, 0) is False
        assert time.monotonic() - t0 >= 0.15, "an unchanged word does not end the wait"
        word[0] = 7
        t0 = time.monotonic()
        assert pool.wait(5.0, 5.0, word.ctypes.data, 0) is False
        assert time.monotonic() - t0 < 2.0, "news ends the wait at once"
        with pytest.raises(TypeError):
            pool.wait(0.1, 0.1, word.ctypes.data)
    finally:
        pool.stop()


def test_worker_pool_help_runs_queued_jobs_on_the_caller():
    """Caller-runs: help(k) takes up to k queued jobs off the queue and runs them on the calling thread
    (GIL released), in order, reporting through the same finished list; with no threads of its own
    the pool runs jobs only there, so what help() did is exact."""
    from shmproxy.shm import _workers
    pool = _workers.Workers(0, None)
    try:
        srcs = [np.arange(100_000, dtype=np.float32) * (j + 1) for j in range(3)]
        dsts = [np.zeros(100_000, np.float32) for _ in range(3)]
        for j in range(3):
            pool.run(("job", j), [(_workers.COPY, dsts[j].ctypes.data, srcs[j].ctypes.data, srcs[j].nbytes)], True)
        pool.copy("last", dsts[0][:10].ctypes.data, srcs[1][:10].ctypes.data, 40)
        assert pool.pending == 4 and pool.wait(0.0) is False    # queued; no thread will take them
        assert pool.help(2) == 2
        assert pool.drain() == [("job", 0), ("job", 1)] and pool.pending == 2
        np.testing.assert_array_equal(dsts[0], srcs[0])
        np.testing.assert_array_equal(dsts[1], srcs[1])
        assert not dsts[2].any()                                 # still queued: not run
        assert pool.help(10) == 2 and pool.help(1) == 0           # the queue ran dry
        assert pool.drain() == [("job", 2), "last"] and pool.pending == 0
        np.testing.assert_array_equal(dsts[2], srcs[2])
        np.testing.assert_array_equal(dsts[0][:10], srcs[1][:10])
    finally:
        pool.stop()
    assert pool.help(1) == 0                                     # stopped: nothing runs


def test_worker_pool_help_races_the_workers_and_every_job_runs_once():
    """The loop's help() and the workers take jobs off one queue: each job runs exactly once
    (a job run twice would come back twice; one lost never comes back)."""
    from shmproxy.shm import _workers
    pool = _workers.Workers(2, None)
    try:
        njobs, n = 600, 4096
        src = np.random.default_rng(5).integers(0, 255, n * njobs, dtype=np.uint8)
        dst = np.zeros_like(src)
        for j in range(njobs):
            pool.copy(j, dst[j * n:].ctypes.data, src[j * n:].ctypes.data, n)
        got: list = []
        helped = 0
        deadline = time.monotonic() + 60
        while len(got) < njobs and time.monotonic() < deadline:
            helped += pool.help(1)
            got += pool.drain()
        got += pool.drain()
        assert sorted(got) == list(range(njobs)), (len(got), len(set(got)))
        assert pool.pending == 0 and 0 <= helped <= njobs
        np.testing.assert_array_equal(dst, src)
    finally:
        pool.stop()


@pytest.mark.parametrize("n", [0, 5, 4095, 4096, 100_003, (1 << 20) + 7])
@pytest.mark.parametrize("src_off,dst_off", [(0, 0), (3, 8), (8, 5)])
def test_streaming_copy_is_exact_and_stays_in_bounds(n, src_off, dst_off):
    src = np.random.default_rng(n).integers(0, 255, n + 64, dtype=np.uint8)
    dst = np.zeros(n + 64, np.uint8)
    s = _native.buffer_info(src, False)[0] + src_off
    d = _native.buffer_info(dst, True)[0] + dst_off
    _native.memcopy_nt(d, s, n)
    assert np.array_equal(dst[dst_off:dst_off + n], src[src_off:src_off + n])
    assert not dst[:dst_off].any() and not dst[dst_off + n:].any()
