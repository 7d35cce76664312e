"""mpi4py's demo programs, run unchanged against shmproxy.MPI, give the output they give under mpi4py.

Which programs, and why the others are left out: tests/mpi4py_demo_runner.py (DEMOS, EXCLUDED). The
demo folder comes from mpi4py's source distribution (skipped, saying why, when it cannot be had); the
output to compare with is the program's under the real mpi4py and mpiexec, run here when both are
installed; without them the program must still run to its end on shmproxy.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_ranks
from tests.mpi4py_demo_runner import DEMOS, TIMED, normalised, reference
from tests.mpi4py_suite_runner import SourcesUnavailable, sources


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    try:
        return sources() / "demo"
    except SourcesUnavailable as exc:
        pytest.skip(f"mpi4py's demo sources are not available: {exc}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("script, args, nranks", DEMOS, ids=[d[0] for d in DEMOS])
def test_demo_runs_with_mpi4py_output(demo_dir: Path, script: str, args: tuple[str, ...], nranks: int):
    res = run_ranks("tests.mpi4py_demo_runner:run_demo", nranks, timeout=300, env={"SHMPROXY_TIMEOUT": "30"},
                    args=(str(demo_dir), script, list(args)))
    timed = script in TIMED
    got = normalised("".join(res.stdout), timed)
    want = reference(demo_dir, script, args, nranks)
    if want is not None:
        assert got == normalised(want, timed), f"{script}: output differs from mpi4py's"
