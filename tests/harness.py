"""Multi-rank test harness: run a test body in N real rank processes, with hard limits.

    from tests.harness import run_ranks

    def pingpong(n):            # a module-level function: each rank imports the module and calls it
        with shmproxy.init() as comm:
            ...
            return comm.rank    # optional: JSON-encodable; arrives in RunResult.results[rank]

    def test_pingpong():
        res = run_ranks("tests.bodies_p2p:pingpong", 2, timeout=60, args=(1000,))
        assert res.results == [0, 1]

What it guarantees (docs/architecture.md, "Testing"; modelled on torch's MultiProcessTestCase):

- Every rank is a fresh interpreter, ``python -m tests.rankmain module:function [json-args]`` in the
  repository root, never a fork of the test process (no inherited locks, threads or mappings).
- One deadline for the whole job. The first rank that exits non-zero (unless listed in
  ``expect_fail``), or the deadline, ends the run: every rank's process group is SIGKILLed (ranks
  start in a new session, so their own children, the progress process above all, die with them),
  and so is every process that carries this run's SPTEST_RUN_ID in its environment (whatever left
  the group, e.g. torchrun's workers, which run in sessions of their own); the harness waits until
  each is gone, and unlinks the service sockets of the run that nobody holds any more (a SIGKILLed
  service cannot). Then AssertionError with every rank's exit code, stdout and stderr (tracebacks,
  and faulthandler stacks of hung ranks: rankmain arms ``faulthandler.dump_traceback_later`` to
  fire shortly before the deadline). Under a real launcher, rankmain reports each rank's start and
  exit code to the harness over a datagram socket, so the first failure ends the run at once there
  too (Hydra does not stop the other ranks of a job that is no MPI job).
- After a run that passed, nothing is killed: a progress process that outlives its ranks is a bug
  that the leak check of tests/conftest.py (LeakGuard below) must get to see.
- Output goes to files, never pipes, so a chatty rank cannot deadlock against the parent.
- Each run gets a fresh SHMPROXY_JOB_ID (a uuid), so concurrent runs never share a job key, socket
  or segment, and SHMPROXY_TIMEOUT below the harness's deadline (min(timeout/2, 60)), so the
  runtime's own bounded waits fire, with their messages, before the harness's kill.

Launchers (``launcher=``): "env" (default) sets torchrun-style RANK/WORLD_SIZE/LOCAL_RANK/
LOCAL_WORLD_SIZE itself; "ompi", "pmi" and "slurm" set the variables those launchers set (Open MPI,
MPICH/Hydra, srun) without needing them; "mpiexec" and "torchrun" run the real launchers
(``launch_mpiexec``, ``launch_torchrun``; the test is skipped, saying why, when the launcher is not
installed). Launcher variables inherited from the test process (pytest itself run under a launcher)
are removed first, so the ranks see exactly one launcher.

``env`` entries override the harness's (including SHMPROXY_TIMEOUT and SHMPROXY_JOB_ID); a value of
None removes the variable. Harness variables use the SPTEST_ prefix: every SHMPROXY_* variable is
validated by shmproxy.core.params and an unknown one is an error.

LeakGuard is the resource check behind the autouse fixture of tests/conftest.py; it lives here so
that it can be tested (tests/test_harness.py) and reused.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import psutil

from tests.rankmain import FAULT_TIMEOUT_VAR, NOTIFY_VAR, OUTPUT_VAR, RESULT_VAR

REPO = Path(__file__).resolve().parents[1]

RUN_ID_VAR = "SPTEST_RUN_ID"  # marks every process of one run (ranks, launchers' workers, progress)
OWNER_VAR = "SPTEST_OWNER"    # pid of the test process that started the run (LeakGuard ownership)

STDOUT_TAIL = 3000   # characters of each rank's stdout in a failure message
STDERR_TAIL = 8000   # characters of each rank's stderr in a failure message
READ_CAP = 4 << 20   # at most this many bytes of each output file are kept in RunResult
KILL_WAIT = 10.0     # bound on reaping processes after SIGKILL

# Launcher variables a rank must not inherit from the test process (prefixes, then exact names).
_LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "SLURM_", "TORCHELASTIC_", "HYDRA_",
                      "PRTE_", "MPICH_", "I_MPI_", "SPTEST_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                   "SHMPROXY_JOB_ID", "SHMPROXY_TIMEOUT"}

SIMULATED_LAUNCHERS = ("env", "ompi", "pmi", "slurm")
REAL_LAUNCHERS = ("mpiexec", "torchrun")


@dataclasses.dataclass
class RunResult:
    """What a run left behind, indexed by rank.

    returncodes: each rank's exit status (negative: killed by that signal). Under a real launcher,
    the status rankmain reported (0, 1, or the body's sys.exit code), None if the rank never got
    that far (killed, or did not start).
    stdout/stderr: each rank's output (under a launcher, from the moment rankmain took over).
    results: each rank's return value decoded from JSON, None if it returned None (or failed).
    pids: each rank's pid (None under a launcher if the rank never started).
    launcher_returncode / launcher_output: the real launcher's exit status and output (None / "").
    """
    target: str
    nranks: int
    launcher: str
    returncodes: list[int | None]
    stdout: list[str]
    stderr: list[str]
    results: list[Any]
    pids: list[int | None]
    duration: float
    launcher_returncode: int | None = None
    launcher_output: str = ""

    def describe(self, killed: Iterable[int] = ()) -> str:
        """Every rank's exit code, pid, stdout tail and stderr tail, as failure messages show them."""
        killed = set(killed)
        parts = []
        if self.launcher in REAL_LAUNCHERS:
            parts.append(f"=== {self.launcher}: exit code {_code_text(self.launcher_returncode)}\n"
                         f"{_tail(self.launcher_output, STDERR_TAIL)}")
        for r in range(self.nranks):
            how = " (killed by the harness)" if r in killed else ""
            parts.append(f"=== rank {r}: exit code {_code_text(self.returncodes[r])}{how}, pid {self.pids[r]}\n"
                         f"--- rank {r} stdout:\n{_tail(self.stdout[r], STDOUT_TAIL)}\n"
                         f"--- rank {r} stderr:\n{_tail(self.stderr[r], STDERR_TAIL)}")
        return "\n".join(parts)


def _code_text(code: int | None) -> str:
    if code is None:
        return "unknown (the rank did not finish)"
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


def _tail(text: str, n: int) -> str:
    if not text:
        return "(empty)"
    text = text.rstrip("\n")
    return text if len(text) <= n else f"[... {len(text) - n} characters cut ...]\n{text[-n:]}"


def _read(path: str | os.PathLike) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - READ_CAP))
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


# ---------------------------------------------------------------------------------------------
# Environment


def default_proxy_timeout(timeout: float) -> float:
    """SHMPROXY_TIMEOUT for a run with this deadline: the runtime's waits must fire first."""
    return round(min(timeout / 2, 60.0), 3)


def fault_timeout(timeout: float, startup: float = 0.0) -> float:
    """When a rank dumps its stacks: shortly before the harness's deadline (minus launcher startup)."""
    return round(max(timeout * 0.5, min(timeout * 0.8, timeout - 2.0) - startup), 3)


def base_env(timeout: float, run_id: str, prefix: str, env: Mapping[str, str | None] | None,
             startup: float = 0.0) -> dict[str, str]:
    """The environment every rank of a run starts from (without its rank variables)."""
    out = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)}
    pythonpath = out.get("PYTHONPATH", "")
    out.update({
        "PYTHONPATH": str(REPO) + (os.pathsep + pythonpath if pythonpath else ""),
        "PYTHONFAULTHANDLER": "1",
        "PYTHONUNBUFFERED": "1",  # what a rank printed before it hung is in its output
        "SHMPROXY_JOB_ID": uuid.uuid4().hex,
        "SHMPROXY_TIMEOUT": str(default_proxy_timeout(timeout)),
        RUN_ID_VAR: run_id,
        OWNER_VAR: str(os.getpid()),
        RESULT_VAR: prefix,
        FAULT_TIMEOUT_VAR: str(fault_timeout(timeout, startup)),
    })
    apply_overrides(out, env)
    return out


def apply_overrides(dst: dict[str, str], env: Mapping[str, str | None] | None) -> None:
    """Apply a test's ``env`` to an environment: a value sets (as str), None removes."""
    for k, v in (env or {}).items():
        if v is None:
            dst.pop(k, None)
        else:
            dst[k] = str(v)


def rank_env(style: str, rank: int, nranks: int, job: str) -> dict[str, str]:
    """The variables launcher ``style`` sets for ``rank`` of ``nranks`` on one node (``job``: hex id)."""
    r, n = str(rank), str(nranks)
    if style == "env":
        return {"RANK": r, "WORLD_SIZE": n, "LOCAL_RANK": r, "LOCAL_WORLD_SIZE": n}
    if style == "ompi":
        return {"OMPI_COMM_WORLD_RANK": r, "OMPI_COMM_WORLD_SIZE": n, "OMPI_COMM_WORLD_LOCAL_RANK": r,
                "OMPI_COMM_WORLD_LOCAL_SIZE": n, "OMPI_COMM_WORLD_NODE_RANK": r}
    if style == "pmi":
        return {"PMI_RANK": r, "PMI_SIZE": n, "MPI_LOCALRANKID": r, "MPI_LOCALNRANKS": n}
    if style == "slurm":
        return {"SLURM_PROCID": r, "SLURM_NTASKS": n, "SLURM_STEP_NUM_TASKS": n, "SLURM_LOCALID": r,
                "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_STEP_TASKS_PER_NODE": n,
                "SLURM_TASKS_PER_NODE": n, "SLURM_JOB_ID": str(int(job[:7], 16)), "SLURM_STEP_ID": "0"}
    raise ValueError(f"unknown launcher style {style!r}; one of {SIMULATED_LAUNCHERS + REAL_LAUNCHERS}")


def _rankmain_cmd(target: str, args: Sequence[Any] | Mapping[str, Any]) -> list[str]:
    if ":" not in target:
        raise ValueError(f"target must be 'module:function', got {target!r}")
    payload = dict(args) if isinstance(args, Mapping) else list(args)
    return ["-m", "tests.rankmain", target, json.dumps(payload)]


def _check_args(nranks: int, timeout: float, expect_fail: set[int] | None) -> set[int]:
    if not isinstance(nranks, int) or nranks < 1:
        raise ValueError(f"nranks must be an int >= 1, got {nranks!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout!r}")
    fails = set(expect_fail or ())
    bad = sorted(r for r in fails if not 0 <= r < nranks)
    if bad:
        raise ValueError(f"expect_fail ranks {bad} out of range for {nranks} ranks")
    return fails


# ---------------------------------------------------------------------------------------------
# Processes


def read_environ(pid: int) -> dict[str, str] | None:
    """The environment a process started with (/proc/PID/environ), None if unreadable or gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return None
    out = {}
    for item in data.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
    return out


def pids_with_env(name: str, value: str) -> list[int]:
    """Pids (other than ours) of live processes whose initial environment has ``name=value``."""
    needle = f"\0{name}={value}\0".encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                data = b"\0" + f.read() + b"\0"
        except OSError:
            continue
        if needle in data:
            found.append(int(entry))
    return found


def _exited(pid: int) -> bool:
    """True when ``pid`` is gone or a zombie."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _Poller:
    """Blocks until a watched process exits or a watched fd is readable, or a timeout; never sleeps blind.

    A process is watched through its pidfd, which becomes readable when the process exits (whoever
    its parent is) and never reaps it: a child of ours stays for its Popen to reap, or that Popen
    would report exit code 0. Where pidfds are missing (Linux < 5.3), ``wait`` returns after slices
    of 50 ms reporting those processes as maybe-exited; callers re-check the state either way.
    """

    SLICE = 0.05

    def __init__(self) -> None:
        self._poll = select.poll()
        self._keys: dict[int, Any] = {}    # fd -> key
        self._pidfds: dict[Any, int] = {}  # key -> pidfd we own
        self._blind: set[Any] = set()      # keys watched without a pidfd

    def add_pid(self, pid: int, key: Any) -> None:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # gone already, or no pidfd here: the caller re-checks
            self._blind.add(key)
            return
        self._pidfds[key] = fd
        self.add_fd(fd, key)

    def add_fd(self, fd: int, key: Any) -> None:
        self._keys[fd] = key
        self._poll.register(fd, select.POLLIN)

    def remove(self, key: Any) -> None:
        self._blind.discard(key)
        for fd, k in list(self._keys.items()):
            if k == key:
                self._poll.unregister(fd)
                del self._keys[fd]
        if key in self._pidfds:
            os.close(self._pidfds.pop(key))

    def wait(self, timeout: float) -> set[Any]:
        """The keys that are (or, without a pidfd, may be) ready, after at most ``timeout`` seconds."""
        timeout = max(timeout, 0.0)
        if self._blind:
            timeout = min(timeout, self.SLICE)
        ready = {self._keys[fd] for fd, _ in self._poll.poll(timeout * 1000)}
        return ready | self._blind

    def close(self) -> None:
        for key in list(self._pidfds):
            self.remove(key)


def wait_gone(procs: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait (bounded) until the processes exit; return the ones still alive. A zombie counts as gone.

    Never reaps (see _Poller)."""
    deadline = time.monotonic() + timeout
    alive = {i: p for i, p in enumerate(procs) if _alive(p)}
    poller = _Poller()
    try:
        for i, p in alive.items():
            poller.add_pid(p.pid, i)
        while alive:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for i in poller.wait(left):
                if i in alive and not _alive(alive[i]):
                    del alive[i]
                    poller.remove(i)
        return list(alive.values())
    finally:
        poller.close()


def kill_run(run_id: str, pgids: Iterable[int] = ()) -> list[int]:
    """SIGKILL every process of a run and wait (bounded) until each is gone; return their pids.

    A process belongs to the run when its environment carries SPTEST_RUN_ID=``run_id`` or it is in
    one of the process groups ``pgids`` (the ranks' and launchers' sessions: a process that is
    already dying can no longer show its environment). Our own children are not reaped here: their
    Popen does that.
    """
    pgids = set(pgids)
    victims: list[psutil.Process] = []
    me = os.getpid()
    for pid in set(pids_with_env(RUN_ID_VAR, run_id)) | {pid for pid in _all_pids() if _pgid(pid) in pgids}:
        if pid == me:
            continue
        try:
            victims.append(psutil.Process(pid))
        except psutil.Error:
            pass
    for pgid in pgids:
        _killpg(pgid)
    for p in victims:
        try:
            p.kill()  # psutil checks that the pid is still the process it was
        except psutil.Error:
            pass
    left = wait_gone(victims, KILL_WAIT)
    return sorted(p.pid for p in victims if p not in left)


def kill_marked(run_id: str) -> list[int]:
    """kill_run() for the processes found by their SPTEST_RUN_ID marker alone."""
    return kill_run(run_id)


def _all_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the rank started a session: its pgid is its pid
    except (ProcessLookupError, PermissionError):
        pass


def _wait_for(procs: Sequence[subprocess.Popen], deadline: float, expect_fail: set[int]) -> str | None:
    """Wait for every process; the reason to stop early (first unexpected failure, deadline) or None."""
    poller = _Poller()
    running = set(range(len(procs)))
    try:
        for i, p in enumerate(procs):
            poller.add_pid(p.pid, i)
        while True:
            for i in sorted(running):
                rc = procs[i].poll()
                if rc is None:
                    continue
                running.discard(i)
                poller.remove(i)
                if rc != 0 and i not in expect_fail:
                    return f"rank {i} failed with exit code {_code_text(rc)}"
            if not running:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return f"the deadline was reached; still running: ranks {sorted(running)}"
            poller.wait(left)
    finally:
        poller.close()


# ---------------------------------------------------------------------------------------------
# run_ranks


def run_ranks(target: str, nranks: int, timeout: float = 60, env: Mapping[str, str | None] | None = None,
              args: Sequence[Any] | Mapping[str, Any] = (), expect_fail: set[int] | None = None,
              launcher: str = "env") -> RunResult:
    """Run ``target`` ("module:function") in ``nranks`` rank processes on this node; see the module doc.

    ``args`` are passed to the function (a list positionally, a dict by keyword) through JSON.
    Ranks in ``expect_fail`` must exit non-zero (strict, like xfail_strict): their failure does not
    end the run, and their success is an error. Returns a RunResult when every rank did what was
    expected; raises AssertionError (with every rank's exit code, stdout and stderr) otherwise.
    """
    __tracebackhide__ = True  # pytest shows the caller's line and the message, not this code
    if launcher == "mpiexec":
        return launch_mpiexec(target, nranks, timeout, env, args=args, expect_fail=expect_fail)
    if launcher == "torchrun":
        return launch_torchrun(target, nranks, timeout, env, args=args, expect_fail=expect_fail)
    if launcher not in SIMULATED_LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}; one of {SIMULATED_LAUNCHERS + REAL_LAUNCHERS}")
    fails = _check_args(nranks, timeout, expect_fail)
    cmd = [sys.executable, *_rankmain_cmd(target, args)]
    run_id = uuid.uuid4().hex
    tmp = tempfile.mkdtemp(prefix="sptest-")
    prefix = os.path.join(tmp, "rank")
    common = base_env(timeout, run_id, prefix, env)
    sockets_before = list_sockets(run_dirs(common))
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    deadline = t0 + timeout
    reason: str | None = "spawning the ranks failed"
    killed: set[int] = set()
    try:
        for r in range(nranks):
            renv = dict(common)
            renv.update(rank_env(launcher, r, nranks, run_id))
            apply_overrides(renv, env)  # env wins over the rank variables too
            with open(f"{prefix}.{r}.out", "wb") as out, open(f"{prefix}.{r}.err", "wb") as err:
                procs.append(subprocess.Popen(cmd, cwd=REPO, env=renv, stdin=subprocess.DEVNULL,
                                              stdout=out, stderr=err, start_new_session=True))
        reason = _wait_for(procs, deadline, fails)
    finally:
        if reason is not None:
            killed = {r for r, p in enumerate(procs) if p.poll() is None}
            kill_run(run_id, [p.pid for p in procs])
            unlink_stale_sockets(list_sockets(run_dirs(common)) - sockets_before)
        for p in procs:
            try:
                p.wait(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                pass
        try:
            res = RunResult(
                target=target, nranks=nranks, launcher=launcher,
                returncodes=[p.returncode for p in procs] + [None] * (nranks - len(procs)),
                stdout=[_read(f"{prefix}.{r}.out") for r in range(nranks)],
                stderr=[_read(f"{prefix}.{r}.err") for r in range(nranks)],
                results=[_load_result(f"{prefix}.{r}") for r in range(nranks)],
                pids=[p.pid for p in procs] + [None] * (nranks - len(procs)),
                duration=time.monotonic() - t0)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if reason is None:
        reason = _unmet_expectations(res, fails)
    if reason is not None:
        raise AssertionError(f"{_header(res, timeout)}: {reason}; after {res.duration:.2f}s"
                             f"{f'; killed ranks {sorted(killed)}' if killed else ''}\n{res.describe(killed)}")
    return res


def _header(res: RunResult, timeout: float) -> str:
    return f"run_ranks({res.target!r}, nranks={res.nranks}, launcher={res.launcher!r}, timeout={timeout})"


def _unmet_expectations(res: RunResult, fails: set[int]) -> str | None:
    bad = [f"rank {r} exited with {_code_text(res.returncodes[r])}" for r in range(res.nranks)
           if r not in fails and res.returncodes[r] != 0]
    ok = [r for r in sorted(fails) if res.returncodes[r] == 0]
    if ok:
        bad.append(f"ranks {ok} were expected to fail (expect_fail) but exited with 0")
    return "; ".join(bad) or None


def _load_result(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _load_int(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# Real launchers


@functools.lru_cache(maxsize=None)
def mpiexec_flavour(path: str) -> str:
    """'hydra' (MPICH), 'openmpi' or 'unknown', from ``mpiexec --version``."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = out.stdout + out.stderr
    if "HYDRA" in text or "Hydra" in text:
        return "hydra"
    if "Open MPI" in text or "OpenRTE" in text or "prte" in text.lower():
        return "openmpi"
    return "unknown"


def _skip(reason: str) -> None:
    import pytest  # only the test process needs pytest; the ranks import this module too
    pytest.skip(reason)


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_mpiexec(target: str, nranks: int, timeout: float = 60, env: Mapping[str, str | None] | None = None,
                   args: Sequence[Any] | Mapping[str, Any] = (), expect_fail: set[int] | None = None) -> RunResult:
    """Run ``target`` under the ``mpiexec`` on PATH (MPICH Hydra from the ``mpich`` wheel, or Open MPI).

    Skips the test when there is no mpiexec. Hydra kills every rank when one fails; with
    ``expect_fail`` it runs with -disable-auto-cleanup so the other ranks carry on.
    """
    __tracebackhide__ = True  # pytest shows the caller's line and the message, not this code
    exe = shutil.which("mpiexec")
    if exe is None:
        _skip("mpiexec is not on PATH (pip install 'shmproxy[mpi]' installs MPICH's)")
    assert exe is not None
    flavour = mpiexec_flavour(exe)
    fails = _check_args(nranks, timeout, expect_fail)
    extra_env: dict[str, str] = {}
    if flavour == "hydra":
        opts = ["-n", str(nranks)] + (["-disable-auto-cleanup"] if fails else [])
    elif flavour == "openmpi":
        if fails:
            raise ValueError("expect_fail is not supported under Open MPI's mpiexec (it aborts the job)")
        opts = ["-n", str(nranks), "--oversubscribe"]
        extra_env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    else:
        _skip(f"{exe} is neither MPICH Hydra nor Open MPI (`mpiexec --version` did not say)")
        raise AssertionError("unreachable")
    return _run_launcher("mpiexec", [exe, *opts, sys.executable], target, nranks, timeout, env, args,
                         fails, extra_env, startup=1.0)


def launch_torchrun(target: str, nranks: int, timeout: float = 60, env: Mapping[str, str | None] | None = None,
                    args: Sequence[Any] | Mapping[str, Any] = (), expect_fail: set[int] | None = None) -> RunResult:
    """Run ``target`` under ``python -m torch.distributed.run`` (torchrun) with ``nranks`` workers.

    Skips the test when torch is not installed. torchrun stops every worker when one fails, so
    ``expect_fail`` is not supported (ValueError).
    """
    __tracebackhide__ = True  # pytest shows the caller's line and the message, not this code
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        _skip("torch is not installed (pip install torch==2.13.0 for torchrun tests)")
    fails = _check_args(nranks, timeout, expect_fail)
    if fails:
        raise ValueError("expect_fail is not supported under torchrun: it stops every worker when one fails")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nranks),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0"]
    # torch's import takes seconds on a small machine: the ranks' stack dumps are moved earlier.
    return _run_launcher("torchrun", cmd, target, nranks, timeout, env, args, fails, {"OMP_NUM_THREADS": "1"},
                         startup=min(10.0, timeout / 4))


class _RankWatch:
    """Follows the ranks that a launcher starts, as they start and end, without polling files.

    rankmain sends ``start <rank> <pid>`` and ``exit <rank> <code>`` datagrams to a socket of ours
    (SPTEST_NOTIFY); each started rank's pidfd says when it is gone, reported or not (SIGKILL). So
    the first failure ends the run at once, whether or not the launcher itself stops the job
    (Hydra does not when the ranks are no MPI processes).
    """

    def __init__(self, path: str):
        if len(os.fsencode(path)) > 100:  # sun_path is 108 bytes: fall back to the abstract namespace
            path = "@sptest-" + uuid.uuid4().hex  # '@' stands for the leading NUL (rankmain maps it)
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + path[1:] if path.startswith("@") else path)
        self.sock.setblocking(False)
        self.codes: dict[int, int] = {}  # rank -> exit code it reported
        self.pids: dict[int, int] = {}   # rank -> pid it reported
        self._poller = _Poller()
        self._poller.add_fd(self.sock.fileno(), "notify")

    def close(self) -> None:
        self._poller.close()
        self.sock.close()

    def _drain(self) -> None:
        while True:
            try:
                data = self.sock.recv(256)
            except (BlockingIOError, InterruptedError):
                return
            parts = data.decode("ascii", "replace").split()
            if len(parts) != 3 or not parts[1].isdigit() or not parts[2].lstrip("-").isdigit():
                continue
            kind, rank, value = parts[0], int(parts[1]), int(parts[2])
            if kind == "start" and rank not in self.pids:
                self.pids[rank] = value
                self._poller.add_pid(value, rank)
            elif kind == "exit":
                self.codes[rank] = value

    def wait(self, proc: subprocess.Popen, deadline: float, fails: set[int], name: str) -> str | None:
        """Wait for the launcher to end; the reason to stop early, or None when it ended by itself."""
        self._poller.add_pid(proc.pid, "launcher")
        gone: set[int] = set()  # ranks whose process ended
        try:
            while True:
                ready = self._poller.wait(deadline - time.monotonic())
                self._drain()  # before looking at the pidfds: a rank reports before it exits
                for key in ready:
                    if isinstance(key, int) and _exited(self.pids[key]):  # a rank (not the launcher)
                        gone.add(key)
                        self._poller.remove(key)
                for rank, code in sorted(self.codes.items()):
                    if code != 0 and rank not in fails:
                        return f"rank {rank} failed with exit code {code}"
                silent = sorted(gone - set(self.codes) - fails)
                if silent:
                    return (f"rank {silent[0]} (pid {self.pids[silent[0]]}) died without reporting an exit"
                            " code (killed by a signal?)")
                if proc.poll() is not None:
                    self._drain()
                    if proc.returncode != 0 and not fails:
                        return f"{name} failed with exit code {_code_text(proc.returncode)}"
                    return None
                if time.monotonic() >= deadline:
                    return f"the deadline was reached; {name} still running"
        finally:
            self._poller.remove("launcher")


def _run_launcher(name: str, cmd: list[str], target: str, nranks: int, timeout: float,
                  env: Mapping[str, str | None] | None, args: Sequence[Any] | Mapping[str, Any],
                  fails: set[int], extra_env: Mapping[str, str], startup: float) -> RunResult:
    __tracebackhide__ = True  # pytest shows the caller's line and the message, not this code
    run_id = uuid.uuid4().hex
    tmp = tempfile.mkdtemp(prefix="sptest-")
    prefix = os.path.join(tmp, "rank")
    lenv = dict(extra_env)
    lenv.update(base_env(timeout, run_id, prefix, env, startup=startup))
    lenv[OUTPUT_VAR] = prefix
    watch = _RankWatch(os.path.join(tmp, "notify"))
    lenv[NOTIFY_VAR] = watch.path
    full = [*cmd, *_rankmain_cmd(target, args)]
    sockets_before = list_sockets(run_dirs(lenv))
    t0 = time.monotonic()
    reason: str | None = f"starting {name} failed"
    proc: subprocess.Popen | None = None
    killed = False
    try:
        with open(f"{prefix}.launcher", "wb") as out:
            proc = subprocess.Popen(full, cwd=REPO, env=lenv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        reason = watch.wait(proc, t0 + timeout, fails, name)
    finally:
        if reason is not None:
            killed = proc is not None and proc.poll() is None
            kill_run(run_id, [proc.pid] if proc is not None else [])
            unlink_stale_sockets(list_sockets(run_dirs(lenv)) - sockets_before)
        if proc is not None:
            try:
                proc.wait(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                pass
        try:
            res = RunResult(
                target=target, nranks=nranks, launcher=name,
                returncodes=[_load_int(f"{prefix}.{r}.exit") for r in range(nranks)],
                stdout=[_read(f"{prefix}.{r}.out") for r in range(nranks)],
                stderr=[_read(f"{prefix}.{r}.err") for r in range(nranks)],
                results=[_load_result(f"{prefix}.{r}") for r in range(nranks)],
                pids=[_load_int(f"{prefix}.{r}.pid") for r in range(nranks)],
                duration=time.monotonic() - t0,
                launcher_returncode=proc.returncode if proc is not None else None,
                launcher_output=_read(f"{prefix}.launcher"))
        finally:
            watch.close()
            shutil.rmtree(tmp, ignore_errors=True)
    if reason is None:
        reason = _unmet_expectations(res, fails)
    if reason is not None:
        raise AssertionError(f"{_header(res, timeout)}: {reason}; after {res.duration:.2f}s"
                             f"{f'; killed {name} and every rank' if killed else ''}\n{res.describe()}")
    return res


# ---------------------------------------------------------------------------------------------
# LeakGuard: nothing of ours may outlive a test (docs/architecture.md, "Testing")


def run_dirs(env: Mapping[str, str] | None = None) -> list[str]:
    """Where service sockets can live: <base>/shmproxy-<uid> for /tmp, $XDG_RUNTIME_DIR, $SHMPROXY_RUN_DIR."""
    env = os.environ if env is None else env
    uid = os.getuid()
    bases = ["/tmp", env.get("XDG_RUNTIME_DIR", ""), env.get("SHMPROXY_RUN_DIR", "")]
    out = []
    for b in bases:
        if b and os.path.isabs(b):
            d = os.path.join(b, f"shmproxy-{uid}")
            if d not in out:
                out.append(d)
    return out


def _fd_holders(match: Callable[[str], bool]) -> set[int]:
    """Pids with an open fd whose link text satisfies ``match`` (scans /proc/*/fd)."""
    holders = set()
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        fd_dir = f"/proc/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if match(os.readlink(f"{fd_dir}/{fd}")):
                    holders.add(int(entry))
                    break
            except OSError:
                pass
    return holders


def file_holders(path: str) -> set[int]:
    """Pids (other than ours) that map ``path`` or hold an fd on it. Scans /proc: for suspected leaks only."""
    holders = set()
    me = os.getpid()
    suffix = " " + path
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/maps", encoding="utf-8", errors="replace") as f:
                if any(line.rstrip("\n").endswith(suffix) for line in f):
                    holders.add(int(entry))
        except OSError:
            continue
    return holders | _fd_holders(lambda link: link == path)


def socket_holders(path: str) -> set[int]:
    """Pids (other than ours) holding a Unix socket bound to ``path``; empty when the file is stale.

    Looks in /proc/net/unix first (no side effect); a socket bound in another network namespace is
    not listed there, so then it connects and asks SO_PEERCRED who listens.
    """
    inodes = set()
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if len(fields) >= 8 and fields[7] == path:
                    inodes.add(fields[6])
    except OSError:
        pass
    if inodes:
        names = {f"socket:[{i}]" for i in inodes}
        return _fd_holders(lambda link: link in names)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(path)
        creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        pid = int.from_bytes(creds[:4], sys.byteorder, signed=True)
        return {pid} if pid > 0 and pid != os.getpid() else set()
    except OSError:
        return set()
    finally:
        s.close()


def list_sockets(dirs: Iterable[str]) -> set[str]:
    """The ``*.sock`` files in ``dirs`` (missing directories are skipped)."""
    out: set[str] = set()
    for d in dirs:
        try:
            out.update(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".sock"))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            pass
    return out


def unlink_stale_sockets(paths: Iterable[str]) -> list[str]:
    """Unlink the sockets in ``paths`` that no live process holds (a SIGKILLed service leaves its file)."""
    done = []
    for path in paths:
        if any(psutil.pid_exists(pid) for pid in socket_holders(path)):
            continue
        try:
            os.unlink(path)
            done.append(path)
        except FileNotFoundError:
            pass
    return done


class LeakGuard:
    """Records what exists before a test and, after it, finds what the test left behind and removes it.

    Looked at: POSIX shm segments ``<shm_dir>/shmproxy-*``; processes whose command line contains
    ``shmproxy.engine.progress`` or whose environment has SHMPROXY_JOB_ID (the harness's ranks and everything
    they start); service sockets ``*.sock`` in the run directories. Only what belongs to this test
    process counts: a process that descends from it, or that carries SPTEST_OWNER=<its pid> (set by
    the harness, inherited by the progress process even once it is orphaned); a segment or socket
    that no live foreign process holds. So two test sessions on one machine do not fail each other.

    ``check()`` gives live processes ``grace`` seconds to exit (polled, bounded), then SIGKILLs the
    survivors and unlinks leftover segments and sockets, so that one failing test does not cascade,
    and returns one line per leak (empty: clean).
    """

    def __init__(self, shm_dir: str = "/dev/shm", dirs: Sequence[str] | None = None, grace: float = 5.0,
                 owner: int | None = None):
        self.shm_dir = shm_dir
        self.dirs = list(dirs) if dirs is not None else run_dirs()
        self.grace = grace
        self.owner = os.getpid() if owner is None else owner
        self._procs: dict[int, float] = {}
        self._segments: set[str] = set()
        self._sockets: set[str] = set()

    # -- listing
    def _list_segments(self) -> set[str]:
        try:
            return {n for n in os.listdir(self.shm_dir) if n.startswith("shmproxy-")}
        except FileNotFoundError:
            return set()

    def _list_sockets(self) -> set[str]:
        return list_sockets(self.dirs)

    @staticmethod
    def _list_procs() -> dict[int, float]:
        out = {}
        for p in psutil.process_iter(["create_time"]):
            ct = p.info.get("create_time")
            if ct is not None:
                out[p.pid] = ct
        return out

    def snapshot(self) -> None:
        self._procs = self._list_procs()
        self._segments = self._list_segments()
        self._sockets = self._list_sockets()

    # -- ownership
    def _descendants(self) -> set[int]:
        try:
            return {c.pid for c in psutil.Process(self.owner).children(recursive=True)}
        except psutil.Error:
            return set()

    def _owned(self, pid: int, descendants: set[int]) -> bool:
        if pid == self.owner or pid in descendants:
            return True
        environ = read_environ(pid)
        return environ is not None and environ.get(OWNER_VAR) == str(self.owner)

    def _new_procs(self) -> list[psutil.Process]:
        """New processes of ours that look like shmproxy's (progress process, ranks)."""
        found = []
        descendants: set[int] | None = None
        for p in psutil.process_iter(["create_time", "cmdline"]):
            if p.pid == self.owner or self._procs.get(p.pid) == p.info.get("create_time"):
                continue
            cmdline = " ".join(p.info.get("cmdline") or ())
            environ = read_environ(p.pid) or {}
            if "shmproxy.engine.progress" not in cmdline and "SHMPROXY_JOB_ID" not in environ:
                continue
            if descendants is None:
                descendants = self._descendants()
            if self._owned(p.pid, descendants):
                found.append(p)
        return found

    # -- the check
    def check(self) -> list[str]:
        leaks: list[str] = []
        new = self._new_procs()
        cmdlines = {}
        for p in new:
            try:
                cmdlines[p.pid] = " ".join(p.cmdline())
            except psutil.Error:
                cmdlines[p.pid] = "?"
        survivors = wait_gone(new, self.grace)
        for p in survivors:
            try:
                p.kill()
            except psutil.Error:
                pass
            leaks.append(f"process {p.pid} still running {self.grace:g}s after the test, killed: {cmdlines[p.pid]}")
        wait_gone(survivors, KILL_WAIT)

        segments = {os.path.join(self.shm_dir, n) for n in self._list_segments() - self._segments}
        leaks += self._remove_unheld("shm segment", segments, file_holders)
        leaks += self._remove_unheld("socket", self._list_sockets() - self._sockets, socket_holders)
        return leaks

    def _remove_unheld(self, what: str, paths: Iterable[str], holders_of: Callable[[str], set[int]]) -> list[str]:
        """Unlink the new ``paths`` unless a live process of another session holds them; one line each."""
        leaks: list[str] = []
        paths = sorted(paths)
        descendants = self._descendants() if paths else set()
        for path in paths:
            holders = {h for h in holders_of(path) if psutil.pid_exists(h)}
            if holders and not any(self._owned(h, descendants) for h in holders):
                continue  # another session's, in use
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            leaks.append(f"{what} {path} left behind, unlinked"
                         + (f" (held by pids {sorted(holders)})" if holders else ""))
        return leaks


__all__ = ["run_ranks", "launch_mpiexec", "launch_torchrun", "RunResult", "LeakGuard", "REPO",
           "default_proxy_timeout", "fault_timeout", "free_port", "kill_marked", "kill_run", "pids_with_env",
           "read_environ", "run_dirs", "wait_gone"]
