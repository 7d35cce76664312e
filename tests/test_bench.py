"""Tests of shmproxy-bench (the package proxy/tools/bench/).

The pure parts (size sweep, iteration defaults, bus factors, patterns and checks, reduction over ranks,
the table, the JSON report; for the collectives the nccl-tests size convention, the expected results
and their checks, the overlap formula and the work calibration) are tested in-process. The rest runs
the real thing under mpiexec (skipped without mpiexec or mpi4py): a small pingpong against mpi4py
whose JSON must hold both libraries, the --inject-error test hook, which must turn into FAIL and a
non-zero exit, an allreduce sweep and an overlap run against mpi4py, and one small run of every
collective against every peer that can be opened. Each launched job gets its own SHMPROXY_JOB_ID, so
it never meets another job's progress process, and afterwards no process carrying that id may be left.

This file holds the in-process tests of the measurement side (sizes, operations, inputs, results and
checks, overlap and work, CPU steal); tests/test_bench_output.py tests the table, the report, the plots, the
progress bar and the command line, tests/test_bench_runs.py the runs under mpiexec and torchrun.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import numpy as np
import pytest

from shmproxy.tools import bench
from shmproxy.tools.bench import OPERATIONS, PEERS, SENTINEL
from shmproxy.tools.bench.device import DEVICE_OPS
from shmproxy.tools.bench import rawsock
from shmproxy.tools.bench.libraries import RAW_PEERS


# ---------------------------------------------------------------- sizes and iterations

@pytest.mark.parametrize("lo,hi,factor,expected", [
    (8, 4096, 8, [8, 64, 512, 4096]),
    (8, 64 << 20, 8, [8, 64, 512, 4096, 32768, 262144, 2097152, 16777216, 64 << 20]),
    (8, 8, 2, [8]),
    (1, 10, 3, [1, 3, 9, 10]),
    (100, 150, 2, [100, 150]),
])
def test_size_sweep(lo: int, hi: int, factor: int, expected: list[int]) -> None:
    assert bench.size_sweep(lo, hi, factor) == expected


def test_size_sweep_always_ends_at_the_maximum() -> None:
    for factor in (2, 3, 4, 8, 16):
        sizes = bench.size_sweep(8, 64 << 20, factor)
        assert sizes[-1] == 64 << 20
        assert sizes == sorted(set(sizes))
        assert all(b <= a * factor for a, b in zip(sizes, sizes[1:]))


@pytest.mark.parametrize("lo,hi,factor,needle", [
    (0, 8, 2, "at least 1 byte"), (16, 8, 2, "below the minimum"), (8, 64, 1, "at least 2"),
])
def test_size_sweep_rejects(lo: int, hi: int, factor: int, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        bench.size_sweep(lo, hi, factor)


@pytest.mark.parametrize("text,expected", [("8", 8), ("4K", 4096), ("64M", 64 << 20), ("1G", 1 << 30),
                                           ("2MiB", 2 << 20)])
def test_parse_size(text: str, expected: int) -> None:
    assert bench.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "x", "4Q", "-8"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="bad size"):
        bench.parse_size(text)


def test_element_count() -> None:
    assert bench.element_count(8, 4) == 2
    assert bench.element_count(10, 4) == 2        # never more bytes than asked
    assert bench.element_count(2, 4) == 1         # but at least one element


def test_default_iterations_adapt_to_size() -> None:
    sizes = bench.size_sweep(1, 1 << 30, 2)
    iters = [bench.default_iters(s) for s in sizes]
    assert iters == sorted(iters, reverse=True)
    assert iters[0] == 1000 and iters[-1] == 10
    # A sweep to 64 MiB moves a bounded amount of data per library: well under 2 GiB one way.
    assert sum(s * bench.default_iters(s) for s in bench.size_sweep(8, 64 << 20, 4)) < 2 << 30
    for n in (1, 10, 20, 1000):
        assert 2 <= bench.default_warmup(n) <= 100


# ---------------------------------------------------------------- the operation table

def test_bus_factors() -> None:
    for n in (2, 3, 4, 8, 64):
        assert OPERATIONS["pingpong"].bus_factor(n) == 1.0
        assert OPERATIONS["sendrecv"].bus_factor(n) == 1.0
    assert OPERATIONS["pingpong"].time_divisor == 2.0      # one way = half a round trip
    assert OPERATIONS["sendrecv"].time_divisor == 1.0


# nccl-tests PERFORMANCE.md: allreduce 2(n-1)/n; reduce, broadcast 1; allgather, reduce_scatter,
# alltoall (n-1)/n.
@pytest.mark.parametrize("name,factor", [
    ("allreduce", lambda n: 2 * (n - 1) / n), ("reduce", lambda n: 1.0), ("bcast", lambda n: 1.0),
    ("allgather", lambda n: (n - 1) / n), ("reduce_scatter", lambda n: (n - 1) / n),
    ("alltoall", lambda n: (n - 1) / n),
])
def test_collective_bus_factors(name: str, factor: Any) -> None:
    op = OPERATIONS[name]
    for n in (1, 2, 3, 4, 8, 16, 64):
        assert op.bus_factor(n) == pytest.approx(factor(n))
    assert op.time_divisor == 1.0
    assert OPERATIONS["allreduce"].bus_factor(2) == 1.0 and OPERATIONS["allreduce"].bus_factor(8) == 1.75
    assert OPERATIONS["allgather"].bus_factor(2) == 0.5 and OPERATIONS["alltoall"].bus_factor(16) == 0.9375


def test_busbw_is_algbw_of_the_nccl_size_times_the_factor() -> None:
    op = OPERATIONS["allgather"]
    per_rank = np.array([[100.0, 120.0, 1.0]] * 4)       # 100 us on every rank
    _s, _r, count, nbytes = bench.row_size(op, 1 << 20, 4, False, 4)
    r = bench.reduce_result(op, per_rank, nbytes, 4, checked=True)
    assert r["algbw_GBps"] == pytest.approx((1 << 20) / 100e-6 / 1e9)   # the whole gathered buffer
    assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 3 / 4)
    barrier = OPERATIONS["barrier"]
    r = bench.reduce_result(barrier, np.array([[5.0, 9.0, 1.0]] * 2), 0, 2, checked=True)
    assert r["time_us"] == 5.0 and "algbw_GBps" not in r and "busbw_GBps" not in r


# (operation, requested bytes, ranks, in place) -> (send elements, receive elements, count, size bytes)
# for float32: size = max(send, receive) bytes of one rank, count = the call's count (nccl-tests).
@pytest.mark.parametrize("name,nbytes,n,in_place,expected", [
    ("allreduce", 1 << 20, 4, False, (262144, 262144, 262144, 1 << 20)),
    ("allreduce", 1 << 20, 4, True, (262144, 262144, 262144, 1 << 20)),
    ("reduce", 4096, 3, False, (1024, 1024, 1024, 4096)),
    ("bcast", 6, 2, False, (1, 1, 1, 4)),                   # at least one element
    ("allgather", 1 << 20, 4, False, (65536, 262144, 65536, 1 << 20)),
    ("allgather", 1 << 20, 3, False, (87381, 262143, 87381, 1048572)),   # what is really moved
    ("allgather", 8, 4, False, (1, 4, 1, 16)),              # one element per block at least
    ("reduce_scatter", 1 << 20, 4, False, (262144, 65536, 65536, 1 << 20)),
    ("reduce_scatter", 1 << 20, 4, True, (262144, 262144, 65536, 1 << 20)),  # input in the recvbuf
    ("alltoall", 1 << 20, 4, False, (262144, 262144, 65536, 1 << 20)),
    ("alltoall", 1 << 20, 16, False, (262144, 262144, 16384, 1 << 20)),
    ("barrier", 0, 4, False, (1, 1, 0, 0)),
    ("overlap", 65536, 2, False, (16384, 16384, 16384, 65536)),
    ("pingpong", 100, 2, False, (25, 25, 25, 100)),
])
def test_size_convention(name: str, nbytes: int, n: int, in_place: bool,
                         expected: tuple[int, int, int, int]) -> None:
    assert bench.row_size(OPERATIONS[name], nbytes, n, in_place, 4) == expected


def test_block_count() -> None:
    assert bench.block_count(100, 4) == 25 and bench.block_count(3, 4) == 1 and bench.block_count(10, 3) == 3


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_operation_contract(name: str) -> None:
    op = OPERATIONS[name]
    if op.measure in (bench.measure_loop, bench.measure_coll, bench.measure_overlap):
        # one builder per library; nccl only where device buffers can go (it takes no host buffers), the
        # raw sockets only for what they time (the sweep skips them elsewhere, saying why)
        need = {"shmproxy", *PEERS} - (set() if name in DEVICE_OPS else {"nccl"})
        need -= set() if name in rawsock.OPS else set(RAW_PEERS)
        assert set(op.calls) >= need
    assert set(op.default_peers) <= set(PEERS)
    derived = {"algbw_GBps", "busbw_GBps"} if "time_us" in op.fields and op.sized else set()
    assert {c.key for c in op.columns} <= set(op.fields) | derived | set(op.derived)
    if op.in_place_ok or op.native_in_place:
        assert op.verify is not None
    assert op.verify is None or op.receives is not None
    assert op.ratio_key is None or op.ratio_key in op.fields
    for size in (2, 3, 5):
        for rank in range(size):
            src = op.source(rank, size)
            assert src is None or (0 <= src < size and src != rank)


@pytest.mark.parametrize("rank,size,expected", [(0, 2, 1), (1, 2, 0), (2, 3, None)])
def test_pingpong_sources(rank: int, size: int, expected: int | None) -> None:
    assert OPERATIONS["pingpong"].source(rank, size) == expected


def test_sendrecv_is_a_ring() -> None:
    op = OPERATIONS["sendrecv"]
    for n in (2, 3, 7):
        assert {op.source(r, n) for r in range(n)} == set(range(n))
        assert all(op.source(r, n) == (r - 1) % n for r in range(n))


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "uint32", "int64", "float16", "float32",
                                   "float64", "complex64"])
def test_pattern_is_exact_and_never_the_sentinel(dtype: str) -> None:
    a = bench.pattern(3, 1000, dtype)
    assert a.dtype == np.dtype(dtype) and a.shape == (1000,)
    assert np.array_equal(a, (np.arange(1000) * 7 + 3 * 13 + 1) % 101)
    assert not (a == SENTINEL).any()
    assert not np.array_equal(a, bench.pattern(4, 1000, dtype))
    assert not a.flags.writeable                           # cached: nobody may change it


def test_check_received() -> None:
    op = OPERATIONS["pingpong"]
    got = bench.pattern(1, 64, np.uint8).copy()
    assert op.check_received(0, 2, got)
    got[17] = SENTINEL
    assert not op.check_received(0, 2, got)
    assert op.check_received(2, 3, got)                    # an idle rank checks nothing
    post = OPERATIONS["post"]
    rows = np.tile(bench.pattern(0, 8, np.uint8), (4, 1))
    assert post.check_received(1, 2, rows)
    rows[3, 0] = SENTINEL
    assert not post.check_received(1, 2, rows)


# ---------------------------------------------------------------- collectives: inputs, results, checks

_REF_UFUNC = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add}


def _reference(name: str, n: int, count: int, dtype: str, redop: str, in_place: bool) -> list[np.ndarray]:
    """Every rank's receive buffer after a correct call, computed naively from full-size inputs (an
    independent reference: no periods, reduction in the dtype itself, rank order)."""
    op = OPERATIONS[name]
    n_send, n_recv, c = op.shape(count, n, in_place)
    ins = [np.array(op.fill(r, n_send, np.dtype(dtype), redop)) for r in range(n)]

    def reduced() -> np.ndarray:
        acc = ins[0].copy()
        for x in ins[1:]:
            acc = _REF_UFUNC[redop](acc, x, dtype=acc.dtype)
        return acc / n if redop == "avg" else acc
    outs = []
    for q in range(n):
        recv = np.full(n_recv, SENTINEL, dtype)
        if name in ("allreduce", "overlap") or (name == "reduce" and q == 0):
            recv[:] = reduced()
        elif name == "bcast" and q != 0:
            recv[:] = ins[0]
        elif name == "allgather":
            recv[:] = np.concatenate(ins)
        elif name == "reduce_scatter":
            recv[:c] = reduced()[q * c:(q + 1) * c]
        elif name == "alltoall":
            recv[:] = np.concatenate([ins[r][q * c:(q + 1) * c] for r in range(n)])
        outs.append(recv)
    return outs


COLLECTIVES = ["allreduce", "reduce", "bcast", "allgather", "reduce_scatter", "alltoall", "overlap"]


@pytest.mark.parametrize("name", COLLECTIVES)
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("count", [1, 7, 101, 250, 1000])
def test_verify_accepts_the_right_result_and_catches_one_wrong_element(name: str, n: int, count: int) -> None:
    op = OPERATIONS[name]
    for dtype, redop in (("float32", "sum"), ("int8", "sum"), ("int32", "max"), ("float64", "avg"),
                         ("float16", "prod"), ("uint8", "min")):
        if not op.reduces and redop != "sum":
            continue
        for in_place in ([False, True] if op.in_place_ok else [False]):
            spec = bench.CheckSpec(redop, in_place, op.shape(count, n, in_place)[2])
            outs = _reference(name, n, count, dtype, redop if op.reduces else "sum", in_place)
            for q, recv in enumerate(outs):
                assert op.verify(q, n, recv, spec), (name, dtype, redop, in_place, q)
                if not op.takes_data(q, n):
                    continue
                bad = recv.copy()
                spread = name in ("allgather", "alltoall")        # the whole buffer is data
                k = (5 * q + 2) % bad.size if spread else (7 * q + 3) % spec.count
                bad[k] = SENTINEL
                assert not op.verify(q, n, bad, spec), (name, dtype, redop, in_place, q, k)


def test_verify_of_the_ranks_that_receive_nothing() -> None:
    never = np.full(8, SENTINEL, np.float32)
    assert OPERATIONS["reduce"].verify(1, 3, never, bench.CheckSpec("sum", False, 8))
    assert OPERATIONS["bcast"].verify(0, 3, never, bench.CheckSpec("sum", False, 8))
    assert not OPERATIONS["reduce"].takes_data(1, 3) and OPERATIONS["reduce"].takes_data(0, 3)
    assert not OPERATIONS["bcast"].takes_data(0, 3) and OPERATIONS["bcast"].takes_data(2, 3)
    assert not any(OPERATIONS["barrier"].takes_data(r, 4) for r in range(4))


def test_reduce_scatter_in_place_result_is_in_the_first_block() -> None:
    op, n, c = OPERATIONS["reduce_scatter"], 3, 10
    spec = bench.CheckSpec("sum", True, c)
    recv = _reference("reduce_scatter", n, n * c, "int32", "sum", True)[1]
    assert op.verify(1, n, recv, spec)
    moved = np.full_like(recv, SENTINEL)
    moved[c:2 * c] = recv[:c]                               # nccl's place (block rank), not MPI's
    assert not op.verify(1, n, moved, spec)


def test_reduction_period_matches_a_direct_reduction() -> None:
    for dtype in ("int8", "uint8", "int16", "int64", "float16", "float32", "complex64"):
        for redop in ("sum", "prod", "min", "max"):
            for n in (2, 3, 16):
                direct = np.array(bench.reduction_input(0, 303, dtype, redop))
                for r in range(1, n):
                    direct = bench._UFUNCS[redop](direct, bench.reduction_input(r, 303, dtype, redop),
                                                  dtype=direct.dtype)
                assert bench.matches_periodic(direct, bench.reduction_period(n, dtype, redop),
                                              rtol=bench.tolerance(dtype, n)), (dtype, redop, n)


def test_integer_sums_wrap_like_the_libraries() -> None:
    per = bench.reduction_period(16, "int8", "sum")
    wide = sum(bench.input_period(r) for r in range(16))
    assert np.array_equal(per, wide.astype(np.int8)) and per.dtype == np.int8
    assert (wide > 127).any()                               # the test means something


def test_prod_inputs_are_powers_of_two_and_stay_finite() -> None:
    for r in range(16):
        assert set(np.unique(bench.input_period(r, "prod")).tolist()) <= {1, 2}
    p16 = bench.reduction_period(16, "float16", "prod")
    assert np.isfinite(p16).all() and len(set(p16.tolist())) > 3   # varied, not all zero or one value
    assert len(set(bench.reduction_period(2, "float32", "prod").tolist())) == 3


def test_avg_and_tolerance() -> None:
    assert np.allclose(bench.reduction_period(4, "float64", "avg"),
                       sum(bench.input_period(r) for r in range(4)) / 4)
    assert bench.tolerance("int32", 8) == 0.0
    assert bench.tolerance("float32", 8) == pytest.approx(32 * np.finfo(np.float32).eps)
    per = bench.reduction_period(3, "float32", "avg")
    got = bench.tiled(per, 0, 500, "float32") * np.float32(1 + 2e-7)     # reduction-order rounding
    assert bench.matches_periodic(got, per, 0, bench.tolerance("float32", 3))
    assert not bench.matches_periodic(got * np.float32(1.001), per, 0, bench.tolerance("float32", 3))


def test_matches_periodic_start_tail_and_chunks() -> None:
    per = bench.input_period(5)
    for start in (0, 1, 100, 101, 12345):
        for count in (0, 1, 100, 101, 102, 1000, bench._CHECK_CHUNK + 77):
            got = bench.tiled(per, start, count, "float32")
            assert bench.matches_periodic(got, per, start)
            if count:
                assert not bench.matches_periodic(got, per, start + 1) or count == 0
                got[count - 1] = SENTINEL                   # the very last element (tail or chunk)
                assert not bench.matches_periodic(got, per, start)
    assert np.array_equal(bench.tiled(per, 3, 5, "int64"), per[3:8])
    assert np.array_equal(bench.pattern(5, 300, "int64"), bench.tiled(per, 0, 300, "int64"))


def test_fill_is_the_pattern_except_for_prod() -> None:
    ar, bc = OPERATIONS["allreduce"], OPERATIONS["bcast"]
    assert np.array_equal(ar.fill(2, 50, np.dtype("float32"), "sum"), bench.pattern(2, 50, "float32"))
    assert np.array_equal(bc.fill(2, 50, np.dtype("float32"), "prod"), bench.pattern(2, 50, "float32"))
    assert set(ar.fill(2, 50, np.dtype("float32"), "prod").tolist()) <= {1.0, 2.0}


# ---------------------------------------------------------------- overlap: formula and the work

@pytest.mark.parametrize("t_comm,t_compute,t_total,expected", [
    (100.0, 100.0, 100.0, 100.0),       # communication fully hidden
    (100.0, 100.0, 200.0, 0.0),         # nothing hidden: comm + compute
    (100.0, 100.0, 150.0, 50.0),
    (100.0, 120.0, 145.0, 75.0),
    (100.0, 100.0, 260.0, 0.0),         # worse than sequential: clipped at 0
    (100.0, 100.0, 90.0, 100.0),        # noise below the compute alone: clipped at 100
    (50.0, 10.0, 40.0, 40.0),
])
def test_overlap_percent(t_comm: float, t_compute: float, t_total: float, expected: float) -> None:
    assert bench.overlap_percent(t_comm, t_compute, t_total) == pytest.approx(expected)


def test_overlap_percent_without_figures() -> None:
    assert math.isnan(bench.overlap_percent(0.0, 10.0, 10.0))
    assert math.isnan(bench.overlap_percent(math.nan, 10.0, 10.0))
    assert math.isnan(bench.overlap_percent(10.0, math.nan, 10.0))


def test_overlap_is_derived_from_the_means_over_ranks() -> None:
    # OSU's calculate_and_print_stats: every figure summed over the ranks and divided by their number
    op = OPERATIONS["overlap"]
    per_rank = np.array([[100.0, 100.0, 150.0, 1.0, 10.0, 40.0, 1.0],
                         [110.0, 90.0, 180.0, 1.5, 20.0, 70.0, 1.0]])
    r = bench.reduce_result(op, per_rank, 4096, 2, checked=True)
    assert (r["t_comm_us"], r["t_compute_us"], r["t_total_us"]) == (105.0, 95.0, 165.0)
    assert r["work_slowdown"] == pytest.approx(1.25)
    assert (r["post_us"], r["wait_us"]) == (15.0, 55.0)
    assert r["overlap_pct"] == pytest.approx(100 * (1 - 70 / 105))
    assert r["ranks"]["overlap_pct"] == [pytest.approx(50.0), pytest.approx(100 * (1 - 90 / 110))]
    assert "busbw_GBps" not in r and r["check"] == "ok"


def test_work_for_runs_for_a_time_not_an_amount() -> None:
    chunk = bench.calibrate(bench.WORK_CHUNK_S)
    t0 = time.perf_counter()
    n = bench.work_for(5e-3, chunk)
    took = time.perf_counter() - t0
    assert took >= 5e-3 and n > 1
    assert bench.work_for(0.0, chunk) == 1                  # at least one chunk, as OSU


def test_rescale_units() -> None:
    assert bench.rescale_units(1000, 2e-3, 1e-3) == 500
    assert bench.rescale_units(1000, 1e-3, 3e-3) == 3000
    assert bench.rescale_units(1, 1.0, 1e-9) == 1           # never zero
    assert bench.rescale_units(100, 0.0, 1e-3) == 200       # no measurement: grow


def test_spin_is_pure_python_work() -> None:
    assert bench.spin(0) == 1 and bench.spin(10) == bench.spin(10)
    import dis
    loads = ("LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD")
    names = {i.argval for i in dis.get_instructions(bench.spin) if i.opname in loads}
    assert names == {"range"}                               # integer arithmetic only: nothing frees the GIL


def _busy(units: int) -> None:
    """1 us of wall time per unit (the calibration then must find units = target in us)."""
    end = time.perf_counter() + units * 1e-6
    while time.perf_counter() < end:
        pass


@pytest.mark.parametrize("target_s", [200e-6, 3e-3])
def test_calibrate_finds_the_work_for_a_target(target_s: float) -> None:
    units = bench.calibrate(target_s, work=_busy)
    assert units == pytest.approx(target_s * 1e6, rel=0.25)


def test_calibrate_the_real_work() -> None:
    units = bench.calibrate(2e-3)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        bench.spin(units)
        runs.append(time.perf_counter() - t0)
    assert 0.5e-3 < min(runs) < 4e-3                        # loose: this runs on busy CI machines


def test_summarize_and_bandwidth() -> None:
    med, p99 = bench.summarize([2e-6] * 99 + [1e-3], divisor=2.0)
    assert med == pytest.approx(1.0)
    assert 1.0 < p99 <= 500.0
    assert all(math.isnan(v) for v in bench.summarize([]))
    assert bench.gbps(1 << 30, 1e6) == pytest.approx(1.073741824)
    assert math.isnan(bench.gbps(8, math.nan)) and math.isnan(bench.gbps(8, 0.0))


def test_reduce_result_takes_the_slowest_rank_that_took_part() -> None:
    op = OPERATIONS["pingpong"]
    per_rank = np.array([[10.0, 20.0, 1.0], [12.0, 15.0, 1.0], [math.nan, math.nan, 1.0]])
    r = bench.reduce_result(op, per_rank, 1200, 3, checked=True)
    assert r["time_us"] == 12.0 and r["p99_us"] == 20.0
    assert r["algbw_GBps"] == pytest.approx(1200 / 12.0 / 1e3)
    assert r["busbw_GBps"] == r["algbw_GBps"]
    assert r["check"] == "ok"
    assert r["ranks"]["time_us"] == [10.0, 12.0, None]
    per_rank[1, 2] = 0.0
    assert bench.reduce_result(op, per_rank, 1200, 3, checked=True)["check"] == "FAIL"
    assert bench.reduce_result(op, per_rank, 1200, 3, checked=False)["check"] == "skipped"


def test_ratios_are_peer_over_shmproxy() -> None:
    op = OPERATIONS["pingpong"]
    res = {"shmproxy": {"time_us": 5.0}, "mpi4py": {"time_us": 10.0}, "gloo": {"time_us": math.nan}}
    assert bench.ratios(op, res) == {"mpi4py": 2.0, "gloo": None}
    assert bench.ratios(OPERATIONS["idle"], res) == {}


def test_steal_meter_sums_its_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter([(10, 100), (15, 200), (15, 300), (35, 500)])
    monkeypatch.setattr(bench.stats, "cpu_ticks", lambda: next(ticks))     # where StealMeter looks it up
    meter = bench.StealMeter()
    for _ in range(2):
        with meter:
            pass
    assert (meter.steal, meter.total) == (25, 300) and meter.pct == pytest.approx(100 * 25 / 300)
    monkeypatch.setattr(bench.stats, "cpu_ticks", lambda: None)
    with meter:
        pass
    assert meter.pct is None                      # one span unknown: the whole figure is


def test_cpu_ticks_on_this_host() -> None:
    ticks = bench.cpu_ticks()
    if not os.path.exists("/proc/stat"):
        assert ticks is None
        return
    assert ticks is not None and 0 <= ticks[0] <= ticks[1] and ticks[1] > 0
