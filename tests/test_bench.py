"""Tests of shmproxy-bench (proxy/bench.py).

The pure parts (size sweep, iteration defaults, bus factors, patterns and checks, reduction over ranks,
the table, the JSON report) are tested in-process. Two tests run the real thing under mpiexec (skipped
without mpiexec or mpi4py): a small pingpong against mpi4py whose JSON must hold both libraries, and
the --inject-error test hook, which must turn into FAIL and a non-zero exit. Each launched job gets
its own SHMPROXY_JOB_ID, so it never meets another job's progress process, and afterwards no process
carrying that id may be left.
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
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy import bench
from proxy.bench import OPERATIONS, PEERS, SENTINEL

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


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_operation_contract(name: str) -> None:
    op = OPERATIONS[name]
    if op.measure is bench.measure_loop:                   # timed-loop operations call each library
        assert set(op.calls) >= {"shmproxy", *PEERS}
    assert set(op.default_peers) <= set(PEERS)
    derived = {"algbw_GBps", "busbw_GBps"} if "time_us" in op.fields else set()
    assert {c.key for c in op.columns} <= set(op.fields) | derived
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


@pytest.mark.parametrize("argv", [
    ["pingpong", "--peers", "openmpi"], ["pingpong", "-f", "1"], ["pingpong", "-b", "1M", "-e", "1K"],
    ["pingpong", "--dtype", "bool"], ["pingpong", "--dtype", "nonsense"], ["pingpong", "-n", "0"],
    ["allreduce"], ["idle", "--idle-seconds", "0"],
])
def test_bad_command_lines_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _resolve(*argv)
    assert exc.value.code == 2


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


def _launch(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], str]:
    job = str(uuid.uuid4())
    env = dict(os.environ, SHMPROXY_JOB_ID=job)
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "proxy.bench", *argv]
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
            pass                                           # gone, or not ours to read
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
    assert "proxy.bench" in env["command"]
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
