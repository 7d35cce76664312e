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

LeakGuard is the resource check behind the autouse fixture of tests/conftest.py; it lives in
tests/harness_leaks.py and is importable from here, so that it can be tested (tests/test_harness.py)
and reused. The rank environment is in tests/harness_env.py, finding, waiting for and killing
processes in tests/harness_procs.py; every name of theirs that the harness ever exported is
importable from here as well.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Iterable, Mapping, Sequence

from tests.harness_env import (OWNER_VAR, REAL_LAUNCHERS, REPO, RUN_ID_VAR, SIMULATED_LAUNCHERS, _check_args,
                               _rankmain_cmd, apply_overrides, base_env, default_proxy_timeout, fault_timeout,
                               free_port, node_env, node_of, rank_env)
from tests.harness_leaks import (LeakGuard, file_holders, list_sockets, run_dirs, socket_holders,
                                 unlink_stale_sockets)
from tests.harness_procs import (KILL_WAIT, _exited, _Poller, kill_marked, kill_run, pids_with_env,
                                 read_environ, wait_gone)
from tests.rankmain import NOTIFY_VAR, OUTPUT_VAR


STDOUT_TAIL = 3000   # characters of each rank's stdout in a failure message
STDERR_TAIL = 8000   # characters of each rank's stderr in a failure message
READ_CAP = 4 << 20   # at most this many bytes of each output file are kept in RunResult


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
              launcher: str = "env", nodes: int = 1, node_cmd: Sequence[Sequence[str]] | None = None,
              bootstrap: str | None = None) -> RunResult:
    """Run ``target`` ("module:function") in ``nranks`` rank processes on this node; see the module doc.

    ``nodes`` > 1 splits the ranks into that many simulated nodes (consecutive blocks, sizes as even as
    they go): each block gets its own host identity (SHMPROXY_HOSTNAME) and local ranks, and they meet
    through SHMPROXY_BOOTSTRAP on loopback, so that each block has its own progress process and the
    blocks talk over the transport between nodes (launcher "env" only). ``node_cmd`` puts each node's
    ranks behind a command prefix of its own (``ip netns exec <host>``: tests/harness_netns.py), and
    then the node keeps its real host identity and ``bootstrap`` (rank 0's host:port) is where they meet.

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
    if not 1 <= nodes <= nranks or (nodes > 1 and launcher != "env"):
        raise ValueError(f"nodes={nodes}: between 1 and nranks, and more than 1 with launcher 'env' only")
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
        if nodes > 1:
            common["SHMPROXY_BOOTSTRAP"] = bootstrap or f"127.0.0.1:{free_port()}"
        for r in range(nranks):
            renv = dict(common)
            renv.update(rank_env(launcher, r, nranks, run_id))
            rcmd = cmd
            if nodes > 1:
                renv.update(node_env(r, nranks, nodes, run_id, simulated=node_cmd is None))
                if node_cmd is not None:
                    rcmd = [*node_cmd[node_of(r, nranks, nodes)], *cmd]
            apply_overrides(renv, env)  # env wins over the rank variables too
            with open(f"{prefix}.{r}.out", "wb") as out, open(f"{prefix}.{r}.err", "wb") as err:
                procs.append(subprocess.Popen(rcmd, cwd=REPO, env=renv, stdin=subprocess.DEVNULL,
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


__all__ = ["run_ranks", "launch_mpiexec", "launch_torchrun", "RunResult", "LeakGuard", "REPO",
           "default_proxy_timeout", "fault_timeout", "free_port", "kill_marked", "kill_run", "pids_with_env",
           "read_environ", "run_dirs", "wait_gone"]
# Names that moved to tests.harness_env, harness_procs and harness_leaks: still importable here.
__all__ += ["OWNER_VAR", "RUN_ID_VAR", "KILL_WAIT", "SIMULATED_LAUNCHERS", "REAL_LAUNCHERS", "apply_overrides",
            "base_env", "rank_env", "file_holders", "socket_holders", "list_sockets", "unlink_stale_sockets"]
