"""LeakGuard and the resource listings behind it: the service sockets' run directories, which process
holds a segment or a socket, and the check of tests/conftest.py that nothing of a test outlives it.
Importable from tests.harness too (tests/test_harness.py tests it there).
"""
from __future__ import annotations

import os
import socket
import sys
from typing import Callable, Iterable, Mapping, Sequence

import psutil

from tests.harness_env import OWNER_VAR
from tests.harness_procs import KILL_WAIT, read_environ, wait_gone


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


def list_files(dirs: Iterable[str], suffix: str) -> set[str]:
    """The files named ``*<suffix>`` in ``dirs`` (missing directories are skipped)."""
    out: set[str] = set()
    for d in dirs:
        try:
            out.update(os.path.join(d, n) for n in os.listdir(d) if n.endswith(suffix))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            pass
    return out


def list_sockets(dirs: Iterable[str]) -> set[str]:
    """The ``*.sock`` files in ``dirs`` (missing directories are skipped)."""
    return list_files(dirs, ".sock")


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

    Looked at: POSIX shm segments ``<shm_dir>/shmproxy-*``, and ``<shm_dir>/cuda.shm.*``, the files
    in which the CUDA driver keeps a process's interprocess events and never removes them (shmproxy
    makes none: transports/cuda_order.py); processes whose command line contains
    ``shmproxy.engine.progress`` or whose environment has SHMPROXY_JOB_ID (the harness's ranks and everything
    they start); service sockets ``*.sock`` and dump files ``*.dump.json`` in the run directories. Only
    what belongs to this test process counts: a process that descends from it, or that carries
    SPTEST_OWNER=<its pid> (set by the harness, inherited by the progress process even once it is
    orphaned); a segment or socket that no live foreign process holds. So two test sessions on one
    machine do not fail each other.

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
        self._dumps: set[str] = set()

    # -- listing
    def _list_segments(self) -> set[str]:
        try:
            return {n for n in os.listdir(self.shm_dir) if n.startswith(("shmproxy-", "cuda.shm."))}
        except FileNotFoundError:
            return set()

    def _list_sockets(self) -> set[str]:
        return list_sockets(self.dirs)

    def _list_dumps(self) -> set[str]:
        """Dump files a progress process wrote into a run directory (tools/dump --signal): output a
        person asked for, which a test that asks for one must remove."""
        return list_files(self.dirs, ".dump.json")

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
        self._dumps = self._list_dumps()

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
        for path in sorted(self._list_dumps() - self._dumps):
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            leaks.append(f"dump file {path} left in the run directory, removed")
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
