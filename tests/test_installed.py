"""The package as users install it: built into a wheel from its sdist, installed into a fresh
virtualenv outside the checkout, and run from there.

Every other test imports shmproxy from the checkout (pyproject's ``pythonpath``, the editable
install), where a subpackage missing from the wheel goes unnoticed: this one is what catches it.
Building once per session (module fixture):

- ``python -m build --sdist --wheel`` makes both from the checkout, the wheel as ``pip install
  <checkout>`` does (a wheel built from the sdist can hide a missing package: setuptools copies the
  sdist's stray .py files in as package data);
- the wheel must hold every package of the checkout (each folder with ``__init__.py`` under proxy/,
  shm/ and transports/, with every .py file in it), the four C extensions, ``py.typed`` and the
  console scripts;
- a virtualenv in a temporary folder gets the wheel with its ``mpi`` extra (MPICH's ``mpiexec``)
  and, when this interpreter has torch, the same torch version;
- there, every module of ``shmproxy`` imports (those needing cupy excepted when it is absent), and
  tests/installed_job.py runs as a real job through the native API and ``shmproxy.MPI`` under
  ``mpiexec`` and through the torch backend under ``torchrun``.

The job runs with the checkout off ``sys.path`` and its folder as working directory, so an import
that reached the checkout would fail (installed_job checks where ``shmproxy`` came from too).
"""
from __future__ import annotations

import configparser
import email.parser
import importlib.metadata
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import free_port
from tests.harness_env import OWNER_VAR, REPO

pytestmark = pytest.mark.slow

# checkout folder -> its import name; pyproject.toml maps the same ([tool.setuptools] package-dir)
ROOTS = {"proxy": "shmproxy", "shm": "shmproxy.shm", "transports": "shmproxy.transports"}
EXTENSIONS = ("_native", "_poster", "_reduce", "_workers", "_membuf", "_wire", "_arena")
SCRIPTS = ("shmproxy-dump", "shmproxy-bench", "shmproxy-params", "shmproxy-host-probe")
JOB = Path(__file__).with_name("installed_job.py")


def checkout_packages(repo: Path = REPO) -> dict[str, tuple[str, list[str]]]:
    """Import name of every package in the checkout -> (its folder there, the names of its .py files)."""
    found: dict[str, tuple[str, list[str]]] = {}
    for folder, name in ROOTS.items():
        for init in sorted((repo / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(repo)
            if "__pycache__" in rel.parts:
                continue
            pkg = ".".join([name, *rel.parts[1:]])
            found[pkg] = (rel.as_posix(), sorted(p.name for p in init.parent.glob("*.py")))
    return found


def missing_from_wheel(wheel: Path, repo: Path = REPO) -> list[str]:
    """What the checkout has that the wheel lacks: packages, their modules, extensions, py.typed."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    missing = []
    for pkg, (_, files) in checkout_packages(repo).items():
        base = pkg.replace(".", "/")
        missing += [f"{base}/{f}" for f in files if f"{base}/{f}" not in names]
    for ext in EXTENSIONS:
        if not any(n.startswith(f"shmproxy/shm/{ext}.") and n.endswith(".so") for n in names):
            missing.append(f"shmproxy/shm/{ext}.*.so")
    missing += [p for p in ("shmproxy/py.typed", "shmproxy/shm/py.typed", "shmproxy/transports/py.typed")
                if p not in names]
    return missing


def clean_copy(dst: Path, repo: Path = REPO) -> Path:
    """The checkout's files as a fresh clone has them (what git tracks, and what it would): a build in
    the checkout itself reads the editable install's stale *.egg-info, whose SOURCES.txt can slip a
    package that pyproject.toml forgets into the wheel as data."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    if listed.returncode != 0:
        pytest.skip(f"{repo} is not a git checkout: its build artefacts cannot be told from its sources")
    for rel in filter(None, listed.stdout.decode().split("\0")):
        src = repo / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


@dataclass
class Installed:
    wheel: Path
    sdist: Path
    venv: Path
    workdir: Path   # a folder outside the checkout, the job's working directory

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def env(self) -> dict[str, str]:
        """This environment without the checkout or our virtualenv on any path, the venv's bin first."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")}
        env["PATH"] = os.pathsep.join([str(self.venv / "bin")] + [
            p for p in os.environ.get("PATH", "").split(os.pathsep)
            if p and not p.startswith(sys.prefix)])
        env.update({"PYTHONUNBUFFERED": "1", "SHMPROXY_TIMEOUT": "60", "OMP_NUM_THREADS": "1",
                    OWNER_VAR: str(os.getpid())})  # the leak guard's mark: it reaps what a failure left
        return env

    def run(self, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run in a session of its own: on a timeout the whole group (launcher, ranks) is killed."""
        proc = subprocess.Popen(cmd, cwd=self.workdir, env=self.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                stdin=subprocess.DEVNULL)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"{' '.join(cmd)} did not end in {timeout} s:\n{out[-6000:]}", pytrace=False)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _check(res: subprocess.CompletedProcess, what: str) -> str:
    assert res.returncode == 0, f"{what} failed (exit {res.returncode}):\n{res.stdout[-8000:]}"
    return res.stdout


def _oks(out: str, api: str) -> list[tuple[int, int]]:
    """The (rank, size) of each rank's closing line (a launcher may interleave the ranks' lines)."""
    return sorted((int(r), int(n)) for r, n in re.findall(rf"{api} rank (\d+) of (\d+) ok", out))


def _torch_version() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return None
    return importlib.metadata.version("torch")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    if importlib.util.find_spec("build") is None:
        pytest.skip("the 'build' package is not installed (the test extra has it: pip install -e '.[test]')")
    root = tmp_path_factory.mktemp("installed")
    dist, workdir = root / "dist", root / "work"
    workdir.mkdir()
    build = subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(dist),
                            str(clean_copy(root / "src"))],
                           capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert build.returncode == 0, f"python -m build failed:\n{(build.stdout + build.stderr)[-8000:]}"
    wheel, = dist.glob("shmproxy-*.whl")
    sdist, = dist.glob("shmproxy-*.tar.gz")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300,
                   stdin=subprocess.DEVNULL)
    reqs = [f"{wheel}[mpi]"]
    torch = _torch_version()
    if torch is not None:
        reqs.append(f"torch=={torch}")
    inst = Installed(wheel, sdist, venv, workdir)
    _check(inst.run([str(inst.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                     "--progress-bar", "off", *reqs], timeout=1200), "pip install of the wheel")
    shutil.copy(JOB, workdir / JOB.name)
    return inst


def test_the_wheel_holds_every_package_extension_and_marker(installed: Installed):
    missing = missing_from_wheel(installed.wheel)
    assert not missing, f"{installed.wheel.name} lacks what the checkout has: {missing}"


def test_a_package_left_out_of_the_wheel_is_named(tmp_path: Path):
    """The check above can fail: a wheel without shmproxy.mpi (the gap this test was written for)."""
    pkgs = checkout_packages()
    assert "shmproxy.mpi" in pkgs and "shmproxy.tools.bench" in pkgs and "shmproxy.shm" in pkgs
    wheel = tmp_path / "shmproxy-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for pkg, (_, files) in pkgs.items():
            if pkg != "shmproxy.mpi":
                for f in files:
                    zf.writestr(pkg.replace(".", "/") + "/" + f, "")
    missing = missing_from_wheel(wheel)
    assert "shmproxy/mpi/comm.py" in missing and "shmproxy/mpi/__init__.py" in missing
    assert not any(m.startswith("shmproxy/rank/") for m in missing)


def test_the_build_fails_naming_a_package_the_list_forgets(tmp_path: Path):
    """tools/build_backend.py: pyproject.toml without shmproxy.mpi does not build at all."""
    src = clean_copy(tmp_path / "src")
    pyproject = src / "pyproject.toml"
    text = pyproject.read_text()
    assert '"shmproxy.mpi", ' in text
    pyproject.write_text(text.replace('"shmproxy.mpi", ', "", 1))
    res = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path / "dist"),
                          str(src)], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert res.returncode != 0, "the build passed with shmproxy.mpi left out of the package list"
    assert "not listed, though their folders hold an __init__.py: ['shmproxy.mpi']" in res.stdout + res.stderr


def test_a_wheel_built_from_the_sdist_is_whole(installed: Installed, tmp_path: Path):
    """pip install shmproxy-X.tar.gz: the sdist carries the build backend and every source."""
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                          "--disable-pip-version-check", "--wheel-dir", str(tmp_path), str(installed.sdist)],
                         capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"pip wheel of the sdist failed:\n{(res.stdout + res.stderr)[-8000:]}"
    wheel, = tmp_path.glob("shmproxy-*.whl")
    missing = missing_from_wheel(wheel)
    assert not missing, f"the wheel built from {installed.sdist.name} lacks: {missing}"


def test_the_sdist_carries_the_sources_and_the_wheel_its_metadata(installed: Installed):
    import tarfile
    with tarfile.open(installed.sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for folder, files in checkout_packages().values():
        lacking = [f for f in files if f"{folder}/{f}" not in names]
        assert not lacking, f"the sdist lacks {folder}/{lacking}"
    with zipfile.ZipFile(installed.wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        eps_name = next(n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt"))
        meta = email.parser.Parser().parsestr(zf.read(meta_name).decode())
        eps = configparser.ConfigParser()
        eps.read_string(zf.read(eps_name).decode())
    assert meta["Name"] == "shmproxy"
    assert set(SCRIPTS) <= set(eps["console_scripts"])


def test_every_module_imports_from_the_installed_package(installed: Installed):
    code = r"""
import importlib, importlib.util, pkgutil, sys, traceback
import shmproxy
assert "site-packages" in shmproxy.__file__, shmproxy.__file__
has_cupy = importlib.util.find_spec("cupy") is not None
bad, count = [], 0
for info in pkgutil.walk_packages(shmproxy.__path__, "shmproxy."):
    count += 1
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as exc:
        if exc.name == "cupy" and not has_cupy:
            continue
        bad.append(f"{info.name}: {exc!r}")
    except Exception as exc:
        bad.append(f"{info.name}: {traceback.format_exception_only(exc)[-1].strip()}")
from shmproxy import MPI
assert MPI.COMM_WORLD is not None
print(f"imported {count} modules")
if bad:
    sys.exit("\n".join(bad))
"""
    out = _check(installed.run([str(installed.python), "-c", code], timeout=300), "importing every module")
    assert int(out.split()[-2]) > 100, out


def test_the_console_scripts_run(installed: Installed):
    for script in SCRIPTS:
        _check(installed.run([str(installed.venv / "bin" / script), "--help"], timeout=120),
               f"{script} --help")


@pytest.mark.parametrize("api", ["native", "mpi"])
def test_a_job_under_mpiexec_runs_from_the_installed_package(installed: Installed, api: str):
    mpiexec = installed.venv / "bin" / "mpiexec"
    assert mpiexec.exists(), "the mpi extra did not install MPICH's mpiexec"
    out = _check(installed.run([str(mpiexec), "-n", "3", str(installed.python), JOB.name, api], timeout=300),
                 f"mpiexec -n 3 installed_job.py {api}")
    assert _oks(out, api) == [(r, 3) for r in range(3)], out


def test_a_torchrun_job_uses_the_installed_backend(installed: Installed):
    if _torch_version() is None:
        pytest.skip("torch is not installed here, so the virtualenv has none (pip install torch==2.13.0)")
    cmd = [str(installed.python), "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
           JOB.name, "torch"]
    out = _check(installed.run(cmd, timeout=300), "torchrun installed_job.py torch")
    assert _oks(out, "torch") == [(r, 2) for r in range(2)], out
