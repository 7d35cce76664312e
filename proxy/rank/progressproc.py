"""A rank's handle on its communicator's progress process.

Local rank 0 starts the process (its child: this handle keeps the ``Popen``, waits for it at teardown
and kills it past the bound); every rank learns its pid at INIT and opens a pidfd on it, which reads as
ready once the process exited (the rank's waits poll it beside their futex sleeps), and receives the
fault report's memfd, where the process's fatal-signal handler writes the error and its threads'
stacks. The lifecycle (rank/lifecycle.py) asks it whether the process is dead and how it died, and
releases it last.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess

from shmproxy.core import errors, log

_log = log.get("RANK")


class ProgressProcess:
    """The progress process as one rank sees it: ``pid`` and ``pidfd`` once adopted (-1 before), the
    child ``proc`` on the rank that started it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None   # on local rank 0, which started it
        self.pid = -1
        self.pidfd = -1
        self.fault_fd = -1                          # its fault report (the service's memfd)

    def start(self, cmd: list[str], env: dict[str, str], cwd: str) -> None:
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, close_fds=True)
        _log.info("started progress process pid %d", self.proc.pid)

    def child_exited(self) -> bool:
        """Local rank 0, while it connects: whether the child it started is gone already."""
        return self.proc is not None and self.proc.poll() is not None

    def adopt(self, pid: int, fault_fd: int) -> None:
        """Watch the process the service names (its pidfd), and keep its fault report's fd."""
        self.fault_fd, self.pid = fault_fd, pid
        try:
            self.pidfd = os.pidfd_open(pid)
        except ProcessLookupError as exc:
            raise errors.PeerDiedError("the progress process exited during init", rank=-1, pid=pid) from exc

    def dead(self, wait_s: float = 0.0) -> bool:
        """Whether it exited, waiting up to ``wait_s`` for it; False before it was adopted."""
        return self.pidfd >= 0 and bool(select.select([self.pidfd], [], [], wait_s)[0])

    def doomed(self, failed: bool) -> bool:
        """At teardown: it exited, or is exiting from a SIGKILL. Its exit completes only once every
        thread has run, and its idle-priority keep-awake guards may wait a scheduler tick for a CPU; a
        survivor that judged by the pidfd alone could leave the socket file behind. A ``failed``
        communicator also gives the pidfd a short bounded wait."""
        if self.pidfd < 0:
            return False
        if self.dead(0.2 if failed else 0.0):
            return True
        try:
            with open(f"/proc/{self.pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except (OSError, ValueError):
            return False
        sigkill = 1 << (signal.SIGKILL - 1)
        return fields.get("State", "").strip()[:1] in ("Z", "X") or bool(
            int(fields.get("ShdPnd", "0"), 16) & sigkill or int(fields.get("SigPnd", "0"), 16) & sigkill)

    def death(self) -> str:
        """What is known of how it died: its exit status (its parent, local rank 0, can reap it) and
        the fatal error its fault report begins with (any rank can read it)."""
        out = ""
        if self.proc is not None:
            try:
                rc = self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                rc = None
            if rc is not None and rc < 0:
                out += f", killed by {signal.Signals(-rc).name}"
            elif rc is not None:
                out += f", exit status {rc}"
        if self.fault_fd < 0:
            return out
        try:
            report = os.pread(self.fault_fd, 4096, 0).decode("utf-8", "replace")
        except OSError:
            return out
        first = report.split("\n", 1)[0].strip()
        return out + (f": {first} (its stacks, from its fault handler: {report[len(first):].strip()[:800]})"
                      if first else "")

    def release(self, wait_s: float | None) -> bool:
        """Close the fds; on the rank that started it, wait up to ``wait_s`` (None: not at all) for the
        child to exit, then kill it. Whether it was this rank's child (then the job's socket file is
        this rank's to remove if the process did not). Idempotent."""
        for name in ("pidfd", "fault_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
        proc, self.proc = self.proc, None
        if proc is None:
            return False
        if wait_s is not None:
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                _log.warning("progress process %d did not exit within %.0f s; killing it", proc.pid, wait_s)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        return True
