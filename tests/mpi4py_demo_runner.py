"""Run the programs of mpi4py's demo/ folder unchanged against shmproxy.MPI, and under mpi4py itself.

The demo folder comes with mpi4py's source distribution (tests/mpi4py_suite_runner.py ``sources()``).
``run_demo`` is a rank body (tests/harness.py run_ranks): it makes ``from mpi4py import MPI`` give
shmproxy.MPI (install_shim) and runs the script as ``__main__`` from its own folder, with its
arguments. ``reference`` runs the same script under the real mpi4py with MPICH's mpiexec (each rank's
output to a file of its own), when both are installed (the '.[mpi]' extra brings them), for the
output to compare with.

DEMOS are the programs that need neither one-sided windows, dynamic processes nor
MPI_THREAD_MULTIPLE; EXCLUDED says, for every other Python program there, why it is not run.
"""
from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# (script under demo/, its arguments, ranks); outputs compare as sorted lines (ranks interleave)
DEMOS: list[tuple[str, tuple[str, ...], int]] = [
    ("helloworld.py", (), 2),
    ("compute-pi/cpi-cco.py", (), 2),
    ("mandelbrot/mandelbrot.py", (), 2),
    ("reductions/test_reductions.py", ("-q",), 2),
    ("sequential/test_seq.py", (), 2),
    *[(f"mpi-ref-v1/ex-{n}.py", (), 2) for n in ("2.01", "2.08", "2.16", "2.29", "2.32", "2.34", "2.35",
                                                 "3.01", "3.02", "3.03", "3.04", "3.05", "3.06", "3.07",
                                                 "3.08", "3.09", "3.11", "3.12", "3.13")],
]

# demos whose output holds timings: those numbers are masked before comparing
TIMED = frozenset({"mandelbrot/mandelbrot.py"})

EXCLUDED: dict[str, str] = {
    "compute-pi/cpi-dpm.py": "dynamic processes (Spawn)",
    "compute-pi/cpi-rma.py": "one-sided windows",
    "mandelbrot/mandelbrot-master.py": "dynamic processes (Spawn)",
    "nxtval/nxtval-dynproc.py": "dynamic processes",
    "nxtval/nxtval-onesided.py": "one-sided windows",
    "nxtval/nxtval-scalable.py": "one-sided windows",
    "nxtval/nxtval-mpi3.py": "one-sided windows",
    "nxtval/nxtval-threads.py": "MPI_THREAD_MULTIPLE",
    "threads/sendrecv.py": "MPI_THREAD_MULTIPLE",
    "futures/": "mpi4py.futures spawns its workers (dynamic processes)",
    "cuda-aware-mpi/": "device arrays (CuPy, Numba) in device memory",
    "osu_*.py": "benchmarks: their output is timings, which no two runs share",
    "init-fini/": "mpi4py.rc (the package's settings module), which the shim does not provide",
    "test-run/": "tests of mpi4py's own `python -m mpi4py` launcher",
}


def run_demo(demo_dir: str, script: str, args: list[str]) -> None:
    """Rank body: ``script`` (relative to ``demo_dir``) as __main__, importing shmproxy.MPI as mpi4py."""
    from tests.mpi4py_suite_runner import install_shim
    install_shim()
    path = Path(demo_dir) / script
    os.chdir(path.parent)
    sys.path.insert(0, str(path.parent))
    sys.argv = [str(path), *args]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:      # unittest.main() and the like end with sys.exit
        if exc.code not in (None, 0):
            raise
    sys.stdout.flush()


def reference(demo_dir: Path, script: str, args: tuple[str, ...], nranks: int,
              timeout: float = 300) -> str | None:
    """The script's output under the real mpi4py (mpiexec -n nranks), or None where either is missing."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    if mpiexec is None:
        return None
    check = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; MPI.Get_library_version()"],
                           capture_output=True, timeout=120)
    if check.returncode != 0:
        return None
    path = demo_dir / script
    with tempfile.TemporaryDirectory(prefix="mpi4py-demo-") as tmp:
        # each rank's output in a file of its own (MPICH's mpiexec): merged, ranks' lines can interleave
        pattern = os.path.join(tmp, "out.%r")
        cmd = [mpiexec, "-n", str(nranks), "-outfile-pattern", pattern, sys.executable, str(path), *args]
        out = subprocess.run(cmd, cwd=path.parent, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise AssertionError(f"{script} failed under mpi4py itself ({out.returncode}):\n"
                                 f"{(out.stderr or out.stdout)[-3000:]}")
        return "".join(Path(tmp, f"out.{r}").read_text() for r in range(nranks)
                       if Path(tmp, f"out.{r}").exists())


def normalised(text: str, timed: bool = False) -> list[str]:
    """Output lines in an order that does not depend on how the ranks' output interleaved (decimal
    numbers masked where ``timed``)."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    if timed:
        lines = [re.sub(r"\d+\.\d+", "#", line) for line in lines]
    return sorted(lines)
