"""Tests of shmproxy-bench (the package proxy/tools/bench/).

The pure parts (size sweep, iteration defaults, bus factors, patterns and checks, reduction over ranks,
the table, the JSON report; for the collectives the nccl-tests size convention, the expected results
and their checks, the overlap formula and the work calibration) are tested in-process. The rest runs
the real thing under mpiexec (skipped without mpiexec or mpi4py): a small pingpong against mpi4py
whose JSON must hold both libraries, the --inject-error test hook, which must turn into FAIL and a
non-zero exit, an allreduce sweep and an overlap run against mpi4py, and one small run of every
collective against every peer that can be opened. Each launched job gets its own SHMPROXY_JOB_ID, so
it never meets another job's progress process, and afterwards no process carrying that id may be left.
"""
from __future__ import annotations

import argparse
import builtins
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmproxy.tools import bench
from shmproxy.tools.bench import OPERATIONS, PEERS, SENTINEL

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT = 120


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
        assert set(op.calls) >= {"shmproxy", *PEERS}       # one builder per library
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
    per_rank = np.array([[100.0, 100.0, 150.0, 1.0, 1.0],
                         [110.0, 90.0, 180.0, 1.5, 1.0]])
    r = bench.reduce_result(op, per_rank, 4096, 2, checked=True)
    assert (r["t_comm_us"], r["t_compute_us"], r["t_total_us"]) == (105.0, 95.0, 165.0)
    assert r["work_slowdown"] == pytest.approx(1.25)
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


# ---------------------------------------------------------------- table

def _row(op: bench.Operation, libs: list[str], check: str = "ok") -> dict[str, Any]:
    results = {}
    for i, lib in enumerate(libs):
        per_rank = np.array([[float(10 * (i + 1) + k) for k in range(len(op.fields))] + [1.0]] * 2)
        results[lib] = bench.reduce_result(op, per_rank, 4096, 2, checked=True)
    results[libs[-1]]["check"] = check
    return {"bytes": 4096, "count": 1024, "dtype": "float32", "iters": 20, "warmup": 2,
            "results": results, "ratio": bench.ratios(op, results)}


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_table_columns_line_up(name: str) -> None:
    op = OPERATIONS[name]
    libs = ["shmproxy", "mpi4py", "gloo"]
    header = bench.format_header(op, libs)
    row = bench.format_row(op, _row(op, libs), libs)
    assert len(header) == 3 and all(line.startswith("#") for line in header)
    assert row.endswith("  ok")
    width = len(header[1]) - len("  check")
    assert len(header[2]) == width and len(row) - len("  ok") == width
    for lib in libs:
        assert lib in header[0]
    assert ("vs mpi4py" in header[1]) == (op.ratio_key is not None)
    # each header title ends where its values end
    for title in ("size", "count", "type", op.columns[0].title):
        end = header[1].index(title) + len(title)
        assert row[end - 1] != " " and (end == len(row) or row[end] == " ")


def test_table_row_values_and_failures() -> None:
    op = OPERATIONS["pingpong"]
    libs = ["shmproxy", "mpi4py"]
    row = _row(op, libs, check="FAIL")
    line = bench.format_row(op, row, libs)
    assert line.endswith("FAIL:mpi4py")
    assert line.split()[:5] == ["4096", "1024", "float32", "10.00", "11.00"]
    assert "2.00" in line.split()                          # mpi4py 20 us / shmproxy 10 us
    row["results"]["mpi4py"]["time_us"] = math.nan
    row["ratio"] = bench.ratios(op, row["results"])
    assert bench.format_row(op, row, libs).split()[-2] == "-"


@pytest.mark.parametrize("value,text", [(None, "-"), (math.nan, "-"), (3, "3"), ("uint8", "uint8"),
                                        (1.234, "1.23"), (1234.56, "1234.6"), (123456.7, "123457")])
def test_format_value(value: Any, text: str) -> None:
    assert bench.format_value(value) == text


def test_check_word() -> None:
    assert bench.check_word({"a": {"check": "ok"}, "b": {"check": "ok"}}) == "ok"
    assert bench.check_word({"a": {"check": "skipped"}}) == "-"
    mixed = {"a": {"check": "FAIL"}, "b": {"check": "ok"}, "c": {"check": "FAIL"}}
    assert bench.check_word(mixed) == "FAIL:a,c"


# ---------------------------------------------------------------- report

ENV = {k: "x" for k in bench.ENV_KEYS}


def _report(name: str = "pingpong", check: str = "ok") -> dict[str, Any]:
    op = OPERATIONS[name]
    libs = ["shmproxy", "mpi4py"]
    return bench.build_report(op, [_row(op, libs, check)], libs, {"gloo": "torch missing"},
                              {"sizes": [4096]}, ENV)


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_report_follows_the_schema(name: str) -> None:
    report = _report(name)
    assert bench.validate_report(report) == []
    assert report["ok"] is True and report["schema"] == bench.SCHEMA
    text = bench.dumps_report(report)
    back = json.loads(text)                                # strict JSON: NaN became null
    assert bench.validate_report(back) == []
    assert back["skipped"] == {"gloo": "torch missing"}


def test_report_with_a_failure_is_not_ok() -> None:
    assert _report(check="FAIL")["ok"] is False


def test_dumps_report_writes_nan_as_null() -> None:
    report = _report()
    report["results"][0]["results"]["mpi4py"]["time_us"] = math.nan
    report["results"][0]["results"]["mpi4py"]["n"] = np.int64(3)
    back = json.loads(bench.dumps_report(report))
    assert back["results"][0]["results"]["mpi4py"]["time_us"] is None
    assert back["results"][0]["results"]["mpi4py"]["n"] == 3


@pytest.mark.parametrize("breakage,needle", [
    (lambda r: r.pop("environment"), "environment"),
    (lambda r: r["environment"].pop("params"), "environment lacks params"),
    (lambda r: r["results"][0]["results"].pop("mpi4py"), "lacks mpi4py"),
    (lambda r: r["results"][0]["results"]["shmproxy"].pop("p99_us"), "lacks p99_us"),
    (lambda r: r["results"][0]["results"]["shmproxy"].update(check="maybe"), "check"),
    (lambda r: r["results"][0].update(bytes="8"), "bytes"),
    (lambda r: r.update(schema="other/1"), "schema"),
])
def test_validate_report_finds_problems(breakage: Any, needle: str) -> None:
    report = _report()
    breakage(report)
    problems = bench.validate_report(report)
    assert problems and any(needle in p for p in problems), problems


def test_plot_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    out = tmp_path / "p.png"
    assert "matplotlib is not installed" in bench.plot_report(_report(), str(out))
    assert not out.exists()
    assert "nothing to plot" in bench.plot_report(_report("idle"), str(out))


def test_plot_with_matplotlib(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    assert str(out) in bench.plot_report(_report(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- command line

def _resolve(*argv: str) -> tuple[bench.Operation, list[int], np.dtype, argparse.Namespace]:
    parser = bench.make_parser()
    args = parser.parse_args(list(argv))
    op, sizes, dtype = bench.resolve(args, parser)
    return op, sizes, dtype, args


def test_per_operation_defaults() -> None:
    op, sizes, dtype, args = _resolve("pingpong")
    assert dtype == np.uint8 and sizes[0] == 8 and sizes[-1] == 64 << 20 and args.peers == PEERS
    _op, _sizes, dtype, _args = _resolve("sendrecv")
    assert dtype == np.float32
    _op, sizes, _dtype, args = _resolve("post")
    assert sizes == [8]
    _op, _sizes, _dtype, args = _resolve("idle")
    assert args.peers == () and args.idle_seconds == 10.0
    _op, sizes, dtype, args = _resolve("sendrecv", "-b", "1K", "-e", "4K", "-f", "2", "--dtype", "float64",
                                       "--peers", "gloo", "--no-alloc", "--no-check")
    assert sizes == [1024, 2048, 4096] and dtype == np.float64 and args.peers == ("gloo",)
    assert args.alloc is False and args.check is False
    assert _resolve("pingpong", "--peers", "none")[3].peers == ()
    assert _resolve("pingpong", "-b", "128K")[1][0] == 128 << 10   # a larger -b alone still sweeps


def test_collective_defaults_and_options() -> None:
    op, sizes, dtype, args = _resolve("allreduce")
    assert dtype == np.float32 and sizes[0] == 8 and sizes[-1] == 64 << 20 and args.peers == PEERS
    assert args.redop == "sum" and args.in_place is False and args.alloc is True
    _op, sizes, dtype, args = _resolve("allreduce", "--op", "avg", "--dtype", "float64", "--in-place",
                                       "--no-alloc")
    assert args.redop == "avg" and args.in_place and not args.alloc and dtype == np.float64
    for name in ("allgather", "reduce_scatter"):
        assert _resolve(name, "--in-place")[3].in_place
    assert _resolve("reduce_scatter", "--op", "min", "--dtype", "int16")[3].redop == "min"
    _op, sizes, _dtype, args = _resolve("barrier", "-b", "1K", "-e", "1M")
    assert sizes == [0]                                     # no data: one row
    _op, sizes, _dtype, args = _resolve("overlap")
    assert sizes == [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20] and args.peers == PEERS
    assert _resolve("pingpong")[3].redop == "sum"           # unused, but always set


@pytest.mark.parametrize("argv", [
    ["pingpong", "--peers", "openmpi"], ["pingpong", "-f", "1"], ["pingpong", "-b", "1M", "-e", "1K"],
    ["pingpong", "--dtype", "bool"], ["pingpong", "--dtype", "nonsense"], ["pingpong", "-n", "0"],
    ["allgemeinreduce"], ["idle", "--idle-seconds", "0"],
    ["allreduce", "--op", "xor"], ["allreduce", "--op", "avg", "--dtype", "int32"],
    ["bcast", "--op", "max"], ["pingpong", "--op", "sum"], ["bcast", "--in-place"],
    ["alltoall", "--in-place"],
    ["overlap", "--in-place"], ["pingpong", "--rounds", "0"], ["post", "--rounds", "2"],
    ["overlap", "--rounds", "3"],
])
def test_bad_command_lines_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _resolve(*argv)
    assert exc.value.code == 2


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


def test_steal_note() -> None:
    rows = [{"results": {"shmproxy": {"steal_pct": 0.5}, "mpi4py": {"steal_pct": 30.0}}},
            {"results": {"shmproxy": {"steal_pct": 12.25}, "mpi4py": {"steal_pct": None}}}]
    note = bench.steal_note(rows, ["shmproxy", "mpi4py"])
    assert note.startswith("# steal") and "shmproxy 0.5-12.2 %" in note and "mpi4py 30.0-30.0 %" in note
    none = [{"results": {"shmproxy": {"steal_pct": None}}}]
    assert bench.steal_note(none, ["shmproxy"]) == ""


def test_inject_error_is_hidden(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.make_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--inject-error" not in out and "--no-alloc" in out and "pingpong" in out


def test_one_rank_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    for var in ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                "SLURM_PROCID", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    assert bench.main(["pingpong"]) == 2
    assert "at least 2 ranks" in capsys.readouterr().err


# ---------------------------------------------------------------- under mpiexec

needs_mpi = pytest.mark.skipif(shutil.which("mpiexec") is None or importlib.util.find_spec("mpi4py") is None,
                               reason="needs mpiexec and mpi4py")


def _launch(tmp_path: Path, *argv: str, nranks: int = 2) -> tuple[subprocess.CompletedProcess[str], str]:
    job = str(uuid.uuid4())
    env = dict(os.environ, SHMPROXY_JOB_ID=job)
    cmd = ["mpiexec", "-n", str(nranks), sys.executable, "-m", "shmproxy.tools.bench", *argv]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    return proc, job


def _processes_of_job(job: str) -> list[int]:
    """Processes (progress processes included: they inherit the environment) still carrying ``job``."""
    needle = f"SHMPROXY_JOB_ID={job}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue                                       # gone, or not ours to read
    return found


@pytest.mark.launcher
@pytest.mark.slow
@needs_mpi
def test_pingpong_against_mpi4py(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc, job = _launch(tmp_path, "pingpong", "-b", "8", "-e", "4096", "-f", "8", "-n", "20", "-w", "5",
                        "--peers", "mpi4py", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _processes_of_job(job) == []
    report = json.loads(out.read_text())
    assert bench.validate_report(report) == []
    assert report["ok"] is True and report["libraries"] == ["shmproxy", "mpi4py"]
    assert [row["bytes"] for row in report["results"]] == [8, 64, 512, 4096]
    for row in report["results"]:
        assert row["iters"] == 20 and row["warmup"] == 5
        for lib in ("shmproxy", "mpi4py"):
            r = row["results"][lib]
            assert r["time_us"] > 0 and r["p99_us"] >= r["time_us"] and r["busbw_GBps"] > 0
            assert r["check"] == "ok"
        assert row["ratio"]["mpi4py"] > 0
    env = report["environment"]
    assert env["ranks"] == 2 and env["launcher"] == "mpich" and env["params"]["CHUNK_SIZE"]["value"] > 0
    assert "shmproxy.tools.bench" in env["command"]
    lines = proc.stdout.splitlines()
    assert sum(1 for line in lines if line.rstrip().endswith(" ok")) == 4
    assert "# checks: all passed" in lines


@pytest.mark.launcher
@pytest.mark.slow
@needs_mpi
def test_failed_check_exits_non_zero(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc, job = _launch(tmp_path, "pingpong", "-b", "8", "-e", "64", "-n", "5", "-w", "1",
                        "--peers", "mpi4py", "--inject-error", "--json", str(out))
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert _processes_of_job(job) == []
    assert "FAIL:shmproxy" in proc.stdout and "1 FAILED" in proc.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is False
    first, *rest = report["results"]
    assert first["results"]["shmproxy"]["check"] == "FAIL" and first["results"]["mpi4py"]["check"] == "ok"
    assert all(r["check"] == "ok" for row in rest for r in row["results"].values())


@pytest.mark.launcher
@pytest.mark.slow
@needs_mpi
def test_allreduce_against_mpi4py(tmp_path: Path) -> None:
    out = tmp_path / "allreduce.json"
    proc, job = _launch(tmp_path, "allreduce", "-b", "8", "-e", "1M", "-f", "32", "-n", "10", "-w", "2",
                        "--rounds", "3", "--peers", "mpi4py", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _processes_of_job(job) == []
    report = json.loads(out.read_text())
    assert bench.validate_report(report) == []
    assert report["ok"] is True and report["libraries"] == ["shmproxy", "mpi4py"]
    assert report["bus_factor"] == "2(n-1)/n" and report["config"]["redop"] == "sum"
    assert [row["bytes"] for row in report["results"]] == [8, 256, 8192, 262144, 1 << 20]
    assert report["config"]["rounds"] == 3
    for row in report["results"]:
        # -n 10 in 3 rounds: 4 iterations per round, 12 in all
        assert row["iters"] == 12 and row["warmup"] == 2 and row["count"] == row["bytes"] // 4
        for lib in ("shmproxy", "mpi4py"):
            r = row["results"][lib]
            assert r["time_us"] > 0 and r["busbw_GBps"] > 0 and r["check"] == "ok"
            assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])      # 2(n-1)/n = 1 at 2 ranks
            assert r["steal_pct"] is None or 0 <= r["steal_pct"] <= 100
    lines = proc.stdout.splitlines()
    assert "# checks: all passed" in lines
    assert any(line.startswith("# rounds: each library's iterations ran as 3 interleaved slices") for line in lines)
    assert any(line.startswith("# steal") for line in lines) == (bench.cpu_ticks() is not None)


@pytest.mark.launcher
@pytest.mark.slow
@needs_mpi
def test_overlap_against_mpi4py(tmp_path: Path) -> None:
    out = tmp_path / "overlap.json"
    proc, job = _launch(tmp_path, "overlap", "-b", "64K", "-e", "256K", "-f", "4", "-n", "5", "-w", "1",
                        "--peers", "mpi4py", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _processes_of_job(job) == []
    report = json.loads(out.read_text())
    assert bench.validate_report(report) == []
    assert report["ok"] is True and report["libraries"] == ["shmproxy", "mpi4py"]
    assert [c["key"] for c in report["columns"]] == ["t_comm_us", "t_compute_us", "t_total_us", "work_slowdown",
                                                     "overlap_pct"]
    assert [row["bytes"] for row in report["results"]] == [64 << 10, 256 << 10]
    for row in report["results"]:
        for lib in ("shmproxy", "mpi4py"):
            r = row["results"][lib]
            assert r["t_comm_us"] > 0 and r["t_compute_us"] > 0 and r["t_total_us"] > 0
            assert r["work_slowdown"] > 0
            # the work ran for t_comm of wall time (OSU), at least; means over iterations and ranks
            assert r["t_compute_us"] >= 0.999 * r["t_comm_us"]
            assert 0.0 <= r["overlap_pct"] <= 100.0
            assert r["overlap_pct"] == pytest.approx(bench.overlap_percent(
                r["t_comm_us"], r["t_compute_us"], r["t_total_us"]))
            assert len(r["ranks"]["overlap_pct"]) == 2 and r["check"] == "ok"
    assert "overlap (OSU osu_iallreduce)" in proc.stdout


@pytest.mark.launcher
@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("argv", [
    ["allreduce"], ["allreduce", "--in-place", "--no-alloc"], ["reduce", "--op", "max", "--dtype", "int32"],
    ["bcast"], ["allgather", "--in-place"], ["reduce_scatter", "--op", "prod"],
    ["reduce_scatter", "--in-place"],
    ["alltoall", "--no-alloc"], ["barrier"],
])
def test_every_collective_at_three_ranks(tmp_path: Path, argv: list[str]) -> None:
    """Uneven blocks (3 ranks), every peer that can be opened; every check must pass."""
    out = tmp_path / "coll.json"
    proc, job = _launch(tmp_path, *argv, "-b", "8", "-e", "4K", "-f", "16", "-n", "3", "-w", "1",
                        "--peers", "mpi4py,gloo", "--json", str(out), nranks=3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _processes_of_job(job) == []
    report = json.loads(out.read_text())
    assert bench.validate_report(report) == [] and report["ok"] is True
    assert "mpi4py" in report["libraries"]
    if argv == ["reduce_scatter", "--in-place"] and importlib.util.find_spec("torch") is not None:
        assert "gloo" not in report["libraries"] and "in-place" in report["skipped"]["gloo"]
    for row in report["results"]:
        assert all(r["check"] == "ok" and r["time_us"] > 0 for r in row["results"].values())
    if argv == ["barrier"]:
        assert [row["bytes"] for row in report["results"]] == [0]
    else:
        assert all(row["bytes"] > 0 for row in report["results"])


def test_progress_bar_text_fallback_counts_sizes(monkeypatch):
    import io
    import builtins
    real_import = builtins.__import__

    def no_tqdm(name, *a, **k):
        if name == "tqdm":
            raise ImportError("no tqdm here")
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    out = io.StringIO()
    bar = bench.Progress(3, "allreduce", enabled=True, stream=out)
    for what in ("8 B", "64 B", "512 B"):
        bar.step(what)
    bar.close()
    text = out.getvalue()
    assert "0/3 sizes done, now 8 B" in text and "2/3 sizes done, now 512 B" in text
    assert text.endswith("3/3 sizes done" + " " * 30 + "\n")
    quiet = io.StringIO()
    off = bench.Progress(3, "x", enabled=False, stream=quiet)
    off.step("8 B")
    off.close()
    assert quiet.getvalue() == ""


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (torchrun)")
def test_allreduce_under_torchrun_against_gloo(tmp_path: Path) -> None:
    """The tool runs under torchrun like any rank program; gloo rendezvouses through torchrun's env."""
    import socket
    out = tmp_path / "bench.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = str(uuid.uuid4())
    env = dict(os.environ, SHMPROXY_JOB_ID=job)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "shmproxy.tools.bench", "allreduce", "-b", "8", "-e", "4096", "-f", "64", "-n", "10", "-w", "2",
           "--peers", "gloo", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _processes_of_job(job) == []
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["libraries"] == ["shmproxy", "gloo"]
    assert all(row["results"]["gloo"]["check"] == "ok" for row in report["results"])
