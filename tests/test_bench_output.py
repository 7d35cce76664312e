"""Tests of shmproxy-bench's output and command line, in-process: the table, the JSON report and its
schema, the plots (with and without matplotlib), the text progress bar, option parsing and the per-operation
defaults, usage errors. The measurement side is tested in tests/test_bench.py.
"""
from __future__ import annotations

import argparse
import builtins
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmproxy.tools import bench
from shmproxy.tools.bench import OPERATIONS
DEFAULT_PEERS = ("mpi4py", "gloo")   # shmproxy.MPI is a peer only when asked for


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
    assert dtype == np.uint8 and sizes[0] == 8 and sizes[-1] == 64 << 20 and args.peers == DEFAULT_PEERS
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
    assert dtype == np.float32 and sizes[0] == 8 and sizes[-1] == 64 << 20 and args.peers == DEFAULT_PEERS
    assert args.redop == "sum" and args.in_place is False and args.alloc is None   # both rows
    _op, sizes, dtype, args = _resolve("allreduce", "--op", "avg", "--dtype", "float64", "--in-place",
                                       "--no-alloc")
    assert args.redop == "avg" and args.in_place and not args.alloc and dtype == np.float64
    for name in ("allgather", "reduce_scatter"):
        assert _resolve(name, "--in-place")[3].in_place
    assert _resolve("reduce_scatter", "--op", "min", "--dtype", "int16")[3].redop == "min"
    _op, sizes, _dtype, args = _resolve("barrier", "-b", "1K", "-e", "1M")
    assert sizes == [0]                                     # no data: one row
    _op, sizes, _dtype, args = _resolve("overlap")
    assert sizes == [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20] and args.peers == DEFAULT_PEERS
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
