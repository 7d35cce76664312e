"""shmproxy-dump: show the state of a job's progress processes (docs/architecture.md, "Observability").

    shmproxy-dump                        list the progress processes of this user on this node
    shmproxy-dump --outside [--json]     read each one's ops pool from outside (the default read)
    shmproxy-dump --pid PID [--json]     the same for the named processes only
    shmproxy-dump --signal [--timeout S] ask them to dump themselves (needs SHMPROXY_DUMP_SIGNAL)

The outside read needs nothing from the process: it opens the pool through the fd the process keeps
open (``/proc/<pid>/fd/<n>`` -> ``/dev/shm/shmproxy-... (deleted)``; the name is unlinked once every
rank mapped it), maps it read-only and decodes it without taking the mutex. It works on a process that
is stopped (SIGSTOP, a debugger) or wedged. ``--pid`` accepts any process that has a pool open, a rank
process included.

``--signal`` sends the progress process its SHMPROXY_DUMP_SIGNAL (read from the pool's info blob);
its loop then writes ``<socket path without .sock>-<pid>.dump.json``, which adds the loop's own view
(active args, unmatched sends and receives, connections, registered buffers) to the pool read. The
tool waits for that file at most --timeout seconds, then falls back to the outside read.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import sys
import time
from typing import Any

from shmproxy.tools import dump

SHM_PREFIX = "/dev/shm/shmproxy-"
DELETED = " (deleted)"
POLL_S = 0.05


class DumpError(Exception):
    """A failure to report in one clear line (no traceback)."""


class DumpSignalOff(DumpError):
    """--signal on a job started without SHMPROXY_DUMP_SIGNAL."""


# ------------------------------------------------------------------------------- finding processes
def is_progress_cmdline(cmdline: list[str] | None) -> bool:
    cmd = cmdline or []
    return "-mshmproxy.engine.progress" in cmd or any(a == "-m" and b == "shmproxy.engine.progress"
                                                      for a, b in zip(cmd, cmd[1:]))


def find_progress_processes() -> list[dict]:
    """Progress processes (``-m shmproxy.engine.progress``) of this user, oldest first."""
    import psutil
    me, uid = os.getpid(), os.getuid()
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "uids", "create_time"]):
        info = p.info
        if info["pid"] == me or not is_progress_cmdline(info.get("cmdline")):
            continue
        uids = info.get("uids")
        if uids is None or uids.real != uid:
            continue
        found.append({"pid": info["pid"], "cmdline": info["cmdline"], "create_time": info.get("create_time")})
    found.sort(key=lambda d: (d["create_time"] or 0, d["pid"]))
    return found


def describe_pid(pid: int) -> dict:
    """pid, cmdline and status of a named process; DumpError if it does not exist."""
    import psutil
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return {"pid": pid, "cmdline": p.cmdline(), "status": p.status()}
    except psutil.NoSuchProcess:
        raise DumpError(f"no process {pid}") from None
    except psutil.AccessDenied:
        return {"pid": pid, "cmdline": None, "status": "unknown (access denied)"}


def process_status(pid: int) -> str:
    import psutil
    try:
        return psutil.Process(pid).status()
    except psutil.Error as exc:
        return f"unknown ({type(exc).__name__})"


# ------------------------------------------------------------------------------- the outside read
def pool_paths(pid: int) -> list[tuple[str, str]]:
    """(path to open, what it points to) for every shmproxy pool the process has open or mapped."""
    out: list[tuple[str, str]] = []
    seen: set[tuple[int, int]] = set()

    def add(path: str, target: str) -> None:
        try:
            st = os.stat(path)
        except OSError:
            return  # closed meanwhile
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            out.append((path, target))

    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except FileNotFoundError:
        raise DumpError(f"no process {pid}") from None
    except PermissionError:
        raise DumpError(f"cannot list {fd_dir}: permission denied (run as the job's user)") from None
    for fd in sorted(fds, key=lambda s: int(s) if s.isdigit() else 0):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith(SHM_PREFIX):
            add(f"{fd_dir}/{fd}", target)
    if not out:
        # Fallback: mapped but its fd closed. map_files needs CAP_SYS_ADMIN; try, never insist.
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].strip().startswith(SHM_PREFIX):
                        add(f"/proc/{pid}/map_files/{parts[0]}", parts[5].strip())
        except OSError:
            pass
    return out


def read_pool_at(path: str) -> dict:
    """Map a pool read-only from ``path`` and read it. DumpError when it cannot be read."""
    from shmproxy.shm.pool import PoolView
    from shmproxy.shm.segment import Segment
    try:
        seg = Segment.open_fd_readonly(path)
    except (OSError, ValueError) as exc:
        raise DumpError(f"cannot map {path} read-only: {exc}") from None
    try:
        try:
            view = PoolView(seg.mm)
        except (ValueError, struct.error) as exc:
            raise DumpError(f"{path}: {exc}") from None
        try:
            return dump.read_pool(view)
        finally:
            view.release()
    finally:
        seg.close()


def outside_read(pid: int) -> list[dict]:
    """[{fd, target, state}] for every pool the process holds; DumpError if it holds none."""
    paths = pool_paths(pid)
    if not paths:
        raise DumpError(f"process {pid} has no shmproxy ops pool open (no /proc/{pid}/fd link to "
                        f"{SHM_PREFIX}*)")
    pools = []
    for path, target in paths:
        entry: dict[str, Any] = {"fd": path, "target": target}
        try:
            entry["state"] = read_pool_at(path)
        except DumpError as exc:
            entry["error"] = str(exc)
        pools.append(entry)
    return pools


# ------------------------------------------------------------------------------- the signal dump
def dump_signal_of(state: dict) -> int:
    params = (state.get("info") or {}).get("params") or {}
    entry = params.get("SHMPROXY_DUMP_SIGNAL")
    value = entry.get("value") if isinstance(entry, dict) else entry
    if value in (None, "", 0, "0"):
        return 0
    if isinstance(value, int):
        return value
    text = str(value).strip().upper()
    if text.isdigit():
        return int(text)
    return int(signal.Signals[text if text.startswith("SIG") else "SIG" + text])


def _file_sig(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def signal_dump(pid: int, timeout: float, pools: list[dict] | None = None) -> dict:
    """Make the progress process behind ``pid`` dump itself; returns {pid, dump_file, state, note}.

    ``pools`` is ``outside_read(pid)`` when the caller has it already. Raises DumpError (DumpSignalOff
    when the job runs without a dump signal); waits at most ``timeout`` seconds.
    """
    if pools is None:
        pools = outside_read(pid)
    usable = [p for p in pools if "state" in p]
    if not usable:
        raise DumpError(pools[0]["error"])
    pool_state = usable[0]["state"]
    info = pool_state.get("info") or {}
    if "socket" not in info:
        raise DumpError(f"pool of process {pid} has no readable info blob ({info.get('error', 'empty')}); "
                        f"use the outside read")
    try:
        signum = dump_signal_of(pool_state)
    except (KeyError, ValueError) as exc:
        raise DumpError(f"pool of process {pid}: bad SHMPROXY_DUMP_SIGNAL: {exc}") from None
    if not signum:
        raise DumpSignalOff("dump signal is off; start the job with SHMPROXY_DUMP_SIGNAL=SIGUSR1, "
                            "or use the outside read")
    target = int(info.get("pid") or (pool_state.get("control") or {}).get("proxy_pid") or 0)
    if target <= 0:
        raise DumpError(f"the pool of process {pid} names no progress process pid; use the outside read")
    note = None
    if target != pid:
        note = f"process {pid} is not the pool's progress process; signalled {target} instead"
    desc = describe_pid(target)
    if not is_progress_cmdline(desc.get("cmdline")):
        raise DumpError(f"process {target}, named as the pool's progress process, is not running "
                        f"`-m shmproxy.engine.progress` (exited, pid reused?); not signalling it")
    if desc["status"] in ("stopped", "tracing-stop"):
        raise DumpError(f"progress process {target} is {desc['status']}: it cannot dump until it is "
                        f"continued; use the outside read")
    path = str(info["socket"]).removesuffix(".sock") + f"-{target}.dump.json"
    before = _file_sig(path)
    try:
        os.kill(target, signum)
    except OSError as exc:
        raise DumpError(f"cannot send signal {signum} to {target}: {exc.strerror}") from None
    deadline = time.monotonic() + timeout
    last_err = "it did not write it"
    while time.monotonic() < deadline:
        sig = _file_sig(path)
        if sig is not None and sig != before:
            try:
                with open(path) as f:
                    state = json.load(f)
                return {"pid": target, "dump_file": path, "state": state, "note": note}
            except (OSError, ValueError) as exc:
                last_err = f"reading it failed: {exc}"
        time.sleep(POLL_S)
    raise DumpError(f"progress process {target} did not dump to {path} within {timeout:g} s ({last_err}); "
                    f"its loop may be wedged: the loop, not the signal handler, writes the dump")


# ------------------------------------------------------------------------------- output
def _summary(state: dict) -> str:
    ctl = state.get("control") or {}
    err = state.get("error")
    age = ctl.get("heartbeat_age_ms")
    subs = state.get("subs") or {}
    lay = state.get("layout") or {}
    error = "none"
    if isinstance(err, dict) and "class" in err:
        error = f"{err.get('class')}: {err.get('message')}"
    return (f"{ctl.get('state_name')}, heartbeat {'never' if age is None else f'{age:.0f} ms ago'}, "
            f"{lay.get('nlocal')} local ranks, {subs.get('count')} active subs, abort {ctl.get('abort')}, "
            f"error: {error}, {len(state.get('problems') or [])} problem(s)")


def _cmd(cmdline: list[str] | None) -> str:
    return " ".join(cmdline) if cmdline else "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="shmproxy-dump", description="Dump the state of shmproxy progress processes (ops pool, subs, "
        "lists, errors). With no option: list them.")
    ap.add_argument("--pid", type=int, action="append", default=[],
                    help="only this process (repeatable); any process with a pool open is accepted")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--outside", action="store_true",
                      help="read the pools read-only from outside (the default once --pid is given); "
                      "works on stopped or wedged processes")
    mode.add_argument("--signal", action="store_true",
                      help="send SHMPROXY_DUMP_SIGNAL and print the dump file the process writes")
    ap.add_argument("--json", action="store_true", help="JSON instead of text")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a --signal dump (10)")
    ns = ap.parse_args(argv)
    if ns.timeout <= 0:
        ap.error("--timeout must be > 0")

    def fail(msg: str) -> None:
        print(f"shmproxy-dump: {msg}", file=sys.stderr, flush=True)

    # Which processes.
    procs: list[dict] = []
    if ns.pid:
        for pid in dict.fromkeys(ns.pid):
            try:
                procs.append(describe_pid(pid))
            except DumpError as exc:
                fail(str(exc))
                return 1
    else:
        try:
            procs = find_progress_processes()
        except Exception as exc:  # psutil missing or /proc unreadable: say so plainly
            fail(f"cannot list processes: {type(exc).__name__}: {exc}")
            return 1
        if not procs:
            fail(f"no shmproxy progress process (`python -m shmproxy.engine.progress`) of uid {os.getuid()} found on "
                 f"this node; is the job running here?")
            return 1
        for p in procs:
            p["status"] = process_status(p["pid"])

    listing = not (ns.pid or ns.outside or ns.signal)
    rc = 0
    results = []
    for p in procs:
        pid = p["pid"]
        entry: dict[str, Any] = {"pid": pid, "cmdline": p.get("cmdline"), "status": p.get("status")}
        results.append(entry)
        try:
            pools = outside_read(pid)
        except DumpError as exc:
            rc = 1
            entry["error"] = str(exc)
            fail(str(exc))
            continue
        if ns.signal:
            try:
                got = signal_dump(pid, ns.timeout, pools)
                entry.update(got)
                if got.get("note"):
                    fail(got["note"])
                continue
            except DumpSignalOff as exc:
                rc = 1
                entry["error"] = str(exc)
                fail(str(exc))
                continue
            except DumpError as exc:
                rc = 1
                entry["error"] = str(exc)
                fail(str(exc))
                fail(f"showing the outside read of process {pid} instead")
                try:
                    pools = outside_read(pid)  # fresher than the one taken before the wait
                except DumpError:
                    pass
        entry["pools"] = pools
        for pool in pools:
            if "error" in pool:
                rc = 1
                fail(pool["error"])

    if ns.json:
        doc: dict[str, Any] = {"mode": "list" if listing else "signal" if ns.signal else "outside",
                               "processes": results}
        if listing:  # a listing carries summaries, not whole pools
            for e in results:
                for pool in e.get("pools", []):
                    if "state" in pool:
                        pool["summary"] = _summary(pool.pop("state"))
        json.dump(doc, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
        sys.stdout.flush()
        return rc

    text: list[str] = []
    for e in results:
        if listing:
            text.append(f"pid {e['pid']} ({e.get('status')})  {_cmd(e.get('cmdline'))}")
            for pool in e.get("pools", []):
                what = _summary(pool["state"]) if "state" in pool else f"unreadable: {pool.get('error')}"
                text.append(f"    {pool['target']}: {what}")
            continue
        if "state" in e:  # a dump written by the process itself
            text.append(f"##### progress process {e['pid']}: its own dump, {e['dump_file']}")
            text.append(dump.format_text(e["state"]))
            continue
        for pool in e.get("pools", []):
            text.append(f"##### process {e['pid']} ({e.get('status')}), outside read of {pool['fd']} -> "
                        f"{pool['target']}")
            text.append(dump.format_text(pool["state"]) if "state" in pool
                        else f"unreadable: {pool['error']}\n")
    if listing:
        text.append("(--outside or --pid PID: read their pools; --signal: have them dump themselves; "
                    "--json: JSON)")
    if text:
        sys.stdout.write("\n".join(text) + "\n")
        sys.stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
