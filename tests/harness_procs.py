"""Processes for the test harness (tests/harness.py): finding them by the environment they started with,
waiting (bounded, on pidfds, never blind sleeps) until they are gone, and killing every process of a run.
Importable from tests.harness too.
"""
from __future__ import annotations

import os
import select
import signal
import time
from typing import Any, Iterable

import psutil

from tests.harness_env import RUN_ID_VAR


KILL_WAIT = 10.0     # bound on reaping processes after SIGKILL


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
