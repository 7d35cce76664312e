"""Run mpi4py's own unit tests against shmproxy.MPI (tests/test_mpi4py_suite.py drives this).

mpi4py's tests are not copied into this repository: ``sources()`` downloads the source distribution
of the mpi4py version installed here from the package index (``pip download --no-binary``), once per
cache directory, and extracts its test/ and demo/ folders.

``run_modules`` is a rank body (tests/harness.py run_ranks). It puts a module named ``mpi4py`` whose
``MPI`` is shmproxy.MPI into sys.modules before mpi4py's tests import it, so the tests run unchanged
on shmproxy. Every rank runs the same tests in the same order, as mpi4py's own runner does under
mpiexec. After each test the ranks exchange their outcomes over a communicator of their own (made
before any test ran), so that every test is recorded once with its worst outcome over the ranks,
and rank 0 appends that record to a JSON-lines file at once: a job that ends early (a test that
hangs past the runtime's timeout, or one whose ranks left it at different points) keeps what it
recorded, and the driver (``run_suite``) starts a fresh job after the test it was in.

Outcomes: ``pass``, ``skip`` (mpi4py's own skip decorators), ``fail`` (an assertion on values or on
behaviour did not hold: the ones to read), ``unsupported`` (NotImplementedError: a feature
shmproxy.MPI names as missing), ``error`` (any other exception), ``hang`` (the job ended inside it).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import traceback
import types
import unittest
from pathlib import Path
from typing import Any

CACHE = Path("/tmp") / f"shmproxy-mpi4py-suite-{os.getuid()}"
STOP_EXIT = 75      # a rank's exit status when it ends its job after a test that did not pass
WORST = ("pass", "skip", "unsupported", "error", "fail", "hang")   # later is worse
# mpi4py's own switch for the tests that need dynamic processes (mpitestutil.disable_mpi_spawn: its
# users set it for MPI libraries without Spawn): test_util_pool's process pool at one rank. shmproxy
# provides no Spawn (tests/mpi4py_suite_report.py OUT_OF_SCOPE, test_spawn).
SUITE_ENV = {"MPI4PY_TEST_SPAWN": "0"}


class SourcesUnavailable(Exception):
    """mpi4py's source distribution could not be had (no index, no mpi4py installed)."""


def mpi4py_version() -> str:
    try:
        return importlib.metadata.version("mpi4py")
    except importlib.metadata.PackageNotFoundError:
        raise SourcesUnavailable("mpi4py is not installed (pip install -e '.[mpi]')") from None


def sources(version: str | None = None, cache: Path = CACHE) -> Path:
    """The extracted mpi4py-<version>/ folder (with test/ and demo/), downloaded on first use."""
    version = version or mpi4py_version()
    root = cache / f"mpi4py-{version}"
    if (root / "test" / "mpiunittest.py").exists():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"mpi4py-{version}.tar.gz"
    if not tarball.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"mpi4py=={version}", "-d", str(cache), "--disable-pip-version-check", "--quiet"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise SourcesUnavailable("pip download of mpi4py's sources took over 600 s") from None
        if out.returncode != 0 or not tarball.exists():
            tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
            raise SourcesUnavailable(f"the package index gave no mpi4py=={version} sdist: {' | '.join(tail)}")
    prefix = f"mpi4py-{version}/"
    with tarfile.open(tarball) as tf:
        members = [m for m in tf.getmembers()
                   if m.name.startswith((prefix + "test/", prefix + "demo/")) and (m.isfile() or m.isdir())]
        tf.extractall(cache, members=members, filter="data")
    return root


def install_shim() -> Any:
    """Make ``import mpi4py`` / ``from mpi4py import MPI`` give shmproxy.MPI in this process."""
    from shmproxy import MPI
    pkg = types.ModuleType("mpi4py")
    pkg.__path__ = []          # a package with no submodules of its own: only those mapped below import
    pkg.__version__ = mpi4py_version()
    pkg.MPI = MPI              # type: ignore[attr-defined]
    sys.modules["mpi4py"] = pkg
    sys.modules["mpi4py.MPI"] = MPI
    # mpi4py's pure-Python layers under the names a program's import change gives them (mpi4py.util ->
    # shmproxy.util, mpi4py.futures -> shmproxy.futures, mpi4py.rc -> shmproxy.rc): the same module
    # objects, imported on demand
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
    return MPI


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``mpi4py.util...``, ``mpi4py.futures...`` and ``mpi4py.rc`` (the runtime configuration) import as
    shmproxy's modules of the same names."""

    LAYERS = ("mpi4py.util", "mpi4py.futures", "mpi4py.rc")

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name in self.LAYERS or name.startswith(tuple(f"{layer}." for layer in self.LAYERS)):
            real = "shmproxy" + name[len("mpi4py"):]
            if importlib.util.find_spec(real) is not None:
                return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec: Any) -> Any:
        # the real module, already initialised: importlib keeps its own __name__ and __spec__
        return importlib.import_module("shmproxy" + spec.name[len("mpi4py"):])

    def exec_module(self, module: Any) -> None:
        return None


class _Result(unittest.TestResult):
    """One test's outcome and reason (a subtest's failure counts for its test)."""

    def __init__(self) -> None:
        super().__init__()
        self.outcome, self.reason = "pass", ""

    def _set(self, outcome: str, reason: str) -> None:
        if WORST.index(outcome) > WORST.index(self.outcome):
            self.outcome, self.reason = outcome, reason[-600:]

    def _exc(self, err: Any) -> None:
        etype, value, tb = err
        if issubclass(etype, NotImplementedError):
            self._set("unsupported", f"NotImplementedError: {value}")
        elif issubclass(etype, AssertionError):
            where = traceback.extract_tb(tb)[-1]
            self._set("fail", f"{etype.__name__}: {value} (at {Path(where.filename).name}:{where.lineno})")
        else:
            where = traceback.extract_tb(tb)[-1]
            self._set("error", f"{etype.__name__}: {value} (at {Path(where.filename).name}:{where.lineno})")

    def addError(self, test: Any, err: Any) -> None:
        self._exc(err)

    def addFailure(self, test: Any, err: Any) -> None:
        self._exc(err)

    def addSubTest(self, test: Any, subtest: Any, err: Any) -> None:
        if err is not None:
            self._exc(err)

    def addSkip(self, test: Any, reason: str) -> None:
        self._set("skip", reason)

    def addUnexpectedSuccess(self, test: Any) -> None:
        self._set("fail", "unexpected success")


def _tests(suite: Any) -> list[unittest.TestCase]:
    out: list[unittest.TestCase] = []
    for t in suite:
        out.extend(_tests(t) if isinstance(t, unittest.TestSuite) else [t])
    return out


def run_modules(testdir: str, modules: list[str], outfile: str, skip_through: str = "") -> int:
    """Rank body: run ``modules`` of mpi4py's test folder; rank 0 appends one JSON line per test to
    ``outfile``. Tests up to and including ``skip_through`` (an id) are not run again."""
    sys.path.insert(0, testdir)
    MPI = install_shim()
    world = MPI.COMM_WORLD
    ctrl = world.Dup()          # the outcome exchange: no test's leftovers can reach it
    rank = world.Get_rank()
    skipping = bool(skip_through)
    ran = 0
    fixtures = _ClassFixtures()
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - recorded: the module's tests cannot run at all
            if rank == 0:
                with open(outfile, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"id": f"{name}.(import)", "outcome": "error", "ranks": [],
                                        "reason": f"import failed: {type(exc).__name__}: {exc}"}) + "\n")
            continue
        for test in _tests(unittest.defaultTestLoader.loadTestsFromModule(mod)):
            tid = test.id()
            if skipping:
                skipping = tid != skip_through
                continue
            if rank == 0:
                with open(outfile, "a", encoding="utf-8") as f:    # in case the job ends inside it
                    f.write(json.dumps({"id": tid, "started": True}) + "\n")
            res = _Result()
            fixtures.enter(type(test), res)
            if res.outcome == "pass":
                test.run(res)
            everyone = ctrl.allgather((tid, res.outcome, res.reason))
            if any(t != tid for t, _o, _r in everyone):
                raise RuntimeError(f"ranks ran different tests: {[t for t, _o, _r in everyone]}")
            worst = max(everyone, key=lambda e: WORST.index(e[1]))
            if rank == 0:
                with open(outfile, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"id": tid, "outcome": worst[1], "reason": worst[2],
                                        "ranks": [o for _t, o, _r in everyone]}) + "\n")
            ran += 1
            if worst[1] not in ("pass", "skip"):
                # A test that failed may leave messages or requests behind that the next test would
                # match: end this job (the driver starts a fresh one after this test). The exit
                # status tells the harness to tear the job down, progress process included.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(STOP_EXIT)
        fixtures.leave()
    ctrl.Free()
    MPI.Finalize()
    return ran


class _ClassFixtures:
    """setUpClass / tearDownClass around each test class's tests, as unittest's suites call them (a
    test run alone with ``test.run`` skips them). A class whose setUpClass raises fails each of its
    tests with that exception; one that raised unittest.SkipTest skips them. A class a skip decorator
    marked is not set up at all (unittest.suite's _handleClassSetUp): its setUpClass may need what
    the decorator found missing."""

    def __init__(self) -> None:
        self.current: type | None = None
        self.failure: tuple[str, Any] | None = None

    def enter(self, cls: type, res: "_Result") -> None:
        if cls is not self.current:
            self.leave()
            self.current, self.failure = cls, self._set_up(cls)
        if self.failure is not None:
            kind, detail = self.failure
            if kind == "skip":
                res.addSkip(None, detail)
            else:
                res.addError(None, detail)

    @staticmethod
    def _set_up(cls: type) -> tuple[str, Any] | None:
        if getattr(cls, "__unittest_skip__", False):
            return ("skip", getattr(cls, "__unittest_skip_why__", ""))
        try:
            cls.setUpClass()  # type: ignore[attr-defined]
        except unittest.SkipTest as exc:
            return ("skip", str(exc))
        except Exception:  # noqa: BLE001 - recorded as each test's outcome
            return ("error", sys.exc_info())
        return None

    def leave(self) -> None:
        if self.current is not None and self.failure is None:
            self.current.tearDownClass()  # type: ignore[attr-defined]
        self.current = None


def read_records(outfile: str) -> tuple[dict[str, dict], str | None]:
    """(finished records by id, the id of a test that started and never finished)."""
    done: dict[str, dict] = {}
    started: str | None = None
    if not os.path.exists(outfile):
        return done, None
    with open(outfile, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("started"):
                started = rec["id"]
            else:
                done[rec["id"]] = rec
                started = None
    return done, started


def run_suite(root: Path, modules: list[str], nranks: int, workdir: Path, timeout: float = 600,
              proxy_timeout: float = 20, max_restarts: int = 400) -> dict[str, dict]:
    """Every test of ``modules`` at ``nranks`` ranks, restarting after a test that ended a job."""
    from tests.harness import run_ranks
    workdir.mkdir(parents=True, exist_ok=True)
    outfile = str(workdir / f"records-{nranks}.jsonl")
    if os.path.exists(outfile):
        os.unlink(outfile)
    skip_through = ""
    for _attempt in range(max_restarts + 1):
        failure = ""
        try:
            run_ranks("tests.mpi4py_suite_runner:run_modules", nranks, timeout=timeout,
                      env={"SHMPROXY_TIMEOUT": str(proxy_timeout), **SUITE_ENV},
                      args=(str(root / "test"), modules, outfile, skip_through))
            return read_records(outfile)[0]
        except AssertionError as exc:
            failure = str(exc)
        done, started = read_records(outfile)
        if started is None:
            if f"exit code {STOP_EXIT}" in failure and done:
                skip_through = list(done)[-1]      # the deliberate stop after a test that did not pass
                continue
            # died outside any test (import, setup): nothing to skip past
            raise AssertionError(f"the mpi4py suite job ended outside a test:\n{failure[-6000:]}")
        with open(outfile, "a", encoding="utf-8") as f:
            f.write(json.dumps({"id": started, "outcome": "hang", "ranks": [],
                                "reason": "the job ended in this test: " + _job_reason(failure)}) + "\n")
        skip_through = started
    return read_records(outfile)[0]


def _job_reason(failure: str) -> str:
    """The first line of the harness's message and the last exception line of any rank."""
    lines = failure.splitlines()
    head = lines[0][-300:] if lines else ""
    last = [ln for ln in lines if "Error" in ln or "Timeout" in ln or "Exception" in ln]
    return head + (" | " + last[-1].strip()[:300] if last else "")
