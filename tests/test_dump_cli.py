"""The dump tool end to end: shmproxy.tools.dump_cli (shmproxy-dump, tools/dump) run against a live process.

The outside read (the pool reached through /proc/PID/fd of a process that has unlinked its name, running
or stopped), the signal dump (the process writes its own dump file on SHMPROXY_DUMP_SIGNAL, and the
fallback when it is stopped), the listing, the errors, and a real progress process. The stand-in process
builds its pool the way tests/test_dump.py does in-process.
"""
from __future__ import annotations

import glob
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shmproxy.tools import dump, dump_cli as dump_tool

from tests.dump_helpers import ROOT, SUB_LINE, TAG


def test_cmdline_matching():
    assert dump_tool.is_progress_cmdline(["python", "-m", "shmproxy.engine.progress", "--path", "x"])
    assert dump_tool.is_progress_cmdline(["python3", "-mshmproxy.engine.progress"])
    assert not dump_tool.is_progress_cmdline(["python", "-m", "proxy.progressive"])
    assert not dump_tool.is_progress_cmdline(["shmproxy.engine.progress"])
    assert not dump_tool.is_progress_cmdline(None)


# ------------------------------------------------------------------------------------ end to end
# A stand-in progress process: holds a pool whose name it has unlinked, blocks on stdin. Started as
# `python -c CHILD -m shmproxy.engine.progress SOCK SIGNUM` so that its cmdline looks like a progress process.
CHILD = r"""
import json, os, select, signal, sys, time
from shmproxy.tools import dump
from shmproxy.core.ops import pack, DTYPE_CODE, KIND_SEND
from shmproxy.shm import pool as P
from shmproxy.shm.segment import Segment

sock, signum, tag = sys.argv[3], int(sys.argv[4]), sys.argv[5]
layout = P.Layout(2, 16, 64)
seg = Segment.create(tag, layout.total_bytes)
view = P.PoolView.initialize(seg.mm, seg.addr, layout)
try:
    view.set_ctrl(P.CTRL_PROXY_PID, os.getpid())
    view.set_ctrl(P.CTRL_STATE, P.PROXY_RUNNING)
    view.set_ctrl(P.CTRL_HEARTBEAT, time.monotonic_ns())
    view.write_info({"pid": os.getpid(), "socket": sock, "pool": seg.name, "cpus": None,
                     "affinity_reason": "test", "ranks": {},
                     "params": {"SHMPROXY_DUMP_SIGNAL": {"value": signum, "origin": "environment"}}})
    view.i32[P.FREE_OPS_OFF // 4] = -1
    for i in (0, 1, 2):
        pack(view.buf, layout, i, KIND_SEND, DTYPE_CODE["f"], 0, 1, 7, 2, i, i, 1, 0, 64, 16,
             time.monotonic_ns())
        view.i32[layout.record_off(i) // 4] = i + 1 if i < 2 else -1
    view.i32[P.NEXT_OPS_OFF // 4], view.i32[P.NEXT_OPS_END_OFF // 4] = 0, 2
    P.SUB.pack_into(view.buf, layout.sub_off(3), P.SUB_PROGRESS, KIND_SEND, 0, 1, 5, 1 << 20, 8,
                    4, 3, 3, 3, 12, 7)
    flag = []
    if signum:
        signal.signal(signum, lambda s, f: flag.append(s))
    print("ready", seg.name, flush=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r, _, _ = select.select([sys.stdin], [], [], 0.05)
        if r and not sys.stdin.readline():
            break
        if flag:
            flag.clear()
            state = dump.read_pool(view)
            state["in_process"] = {"passes": 5,
                                   "unmatched_sends": ["send rank 0 peer 1 tag 7 64 B opCount 2"]}
            path = sock.removesuffix(".sock") + f"-{os.getpid()}.dump.json"
            with open(path + ".tmp", "w") as f:
                json.dump(state, f)
            os.replace(path + ".tmp", path)
finally:
    view.release()
    seg.close()
"""


class Child:
    def __init__(self, tmp_path: Path, signum: int = 0):
        self.sock = str(tmp_path / "job-c0.sock")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, "-m", "shmproxy.engine.progress", self.sock, str(signum), TAG + "e2e"],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        self.stderr = ""
        if not line.startswith("ready"):
            self.proc.kill()
            _, err = self.proc.communicate(timeout=30)
            pytest.fail(f"child did not start: {line!r} {err!r}")
        self.name = line.split()[1]

    def close(self) -> None:
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        try:
            _, self.stderr = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.stderr = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, self.stderr
        assert glob.glob(f"/dev/shm/shmproxy-{TAG}e2e*") == []


@pytest.fixture
def child(tmp_path):
    c = Child(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def signal_child(tmp_path):
    c = Child(tmp_path, int(signal.SIGUSR1))
    try:
        yield c
    finally:
        c.close()


def run_tool(*args: str, exe: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = (exe or [sys.executable, "-m", "shmproxy.tools.dump_cli"]) + list(args)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_outside_read_json_of_an_unlinked_pool(child):
    assert not os.path.exists("/dev/shm" + child.name)  # the name is gone: only the fd reaches it
    res = run_tool("--pid", str(child.pid), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["mode"] == "outside"
    (proc,) = doc["processes"]
    assert proc["pid"] == child.pid
    (pool,) = proc["pools"]
    assert pool["target"] == f"/dev/shm{child.name} (deleted)"
    assert pool["fd"].startswith(f"/proc/{child.pid}/fd/")
    state = pool["state"]
    assert state["control"]["proxy_pid"] == child.pid and state["control"]["state_name"] == "RUNNING"
    assert [r["index"] for r in state["posted_chain"]["records"]] == [0, 1, 2]
    assert state["ranks"][0]["not_in_shared_list"]["indices"] == "3-15"
    assert state["subs"]["active"][0]["letter"] == "P"
    assert state["info"]["socket"] == child.sock


def test_outside_read_text_of_a_stopped_process(child):
    os.kill(child.pid, signal.SIGSTOP)
    try:
        res = run_tool("--pid", str(child.pid))
    finally:
        os.kill(child.pid, signal.SIGCONT)
    assert res.returncode == 0, res.stderr
    assert f"##### process {child.pid} (stopped), outside read of /proc/{child.pid}/fd/" in res.stdout
    assert "== posted chain: 3 records (head 0, tail 2) ==" in res.stdout
    assert SUB_LINE in res.stdout


def test_tools_dump_executable_and_listing(child):
    exe = ROOT / "tools" / "dump"
    assert os.access(exe, os.X_OK)
    res = run_tool("--pid", str(child.pid), "--json", exe=[str(exe)])
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["processes"][0]["pid"] == child.pid
    # No option: a listing that finds the stand-in by its `-m shmproxy.engine.progress` cmdline.
    res = run_tool()
    assert res.returncode == 0, res.stderr
    assert f"pid {child.pid} (" in res.stdout and "RUNNING" in res.stdout
    res = run_tool("--json")
    doc = json.loads(res.stdout)
    assert doc["mode"] == "list"
    mine = [p for p in doc["processes"] if p["pid"] == child.pid]
    assert mine and "RUNNING" in mine[0]["pools"][0]["summary"]


def test_signal_dump(signal_child, tmp_path):
    res = run_tool("--pid", str(signal_child.pid), "--signal", "--json", "--timeout", "20")
    assert res.returncode == 0, res.stderr
    (proc,) = json.loads(res.stdout)["processes"]
    path = str(tmp_path / f"job-c0-{signal_child.pid}.dump.json")
    assert proc["dump_file"] == path and os.path.exists(path)
    assert proc["state"]["in_process"]["passes"] == 5
    assert proc["state"]["posted_chain"]["length"] == 3
    # A second dump replaces the first (the tool waits for a *new* file, not the old one).
    res = run_tool("--pid", str(signal_child.pid), "--signal", "--timeout", "20")
    assert res.returncode == 0, res.stderr
    assert f"its own dump, {path}" in res.stdout
    assert "== in process (the progress loop's own view) ==" in res.stdout
    assert "unmatched sends: 1" in res.stdout


def test_signal_dump_of_a_stopped_process_falls_back(signal_child):
    os.kill(signal_child.pid, signal.SIGSTOP)
    try:
        res = run_tool("--pid", str(signal_child.pid), "--signal", "--json", "--timeout", "2")
    finally:
        os.kill(signal_child.pid, signal.SIGCONT)
    assert res.returncode == 1
    assert "is stopped" in res.stderr and "outside read" in res.stderr
    (proc,) = json.loads(res.stdout)["processes"]
    assert proc["pools"][0]["state"]["posted_chain"]["length"] == 3


def test_signal_off_is_a_clear_error(child):
    res = run_tool("--pid", str(child.pid), "--signal")
    assert res.returncode == 1
    assert "dump signal is off; start the job with SHMPROXY_DUMP_SIGNAL=SIGUSR1, or use the outside read" \
        in res.stderr


def test_errors_no_process_and_no_pool():
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE) as p:
        try:
            res = run_tool("--pid", str(p.pid))
        finally:
            p.stdin.close()
            p.wait(timeout=30)
    assert res.returncode == 1
    assert f"process {p.pid} has no shmproxy ops pool open" in res.stderr
    res = run_tool("--pid", str(p.pid))  # reaped by now
    assert res.returncode == 1 and f"no process {p.pid}" in res.stderr


def test_real_progress_process(tmp_path):
    """`python -m shmproxy.engine.progress` itself: outside read, then --signal makes its loop write the dump."""
    sock = tmp_path / "j-c0.sock"
    env = dict(os.environ, SHMPROXY_DUMP_SIGNAL="SIGUSR1", SHMPROXY_TIMEOUT="60")
    cmd = [sys.executable, "-m", "shmproxy.engine.progress", "--path", str(sock), "--nlocal", "1", "--size", "1",
           "--job-key", f"{os.getpid():08x}feed", "--comm-id", "0", "--parent", str(os.getpid())]
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            # RUNNING is stored after the signal handlers are installed: only then may we signal it.
            deadline = time.monotonic() + 30
            state: dict = {}
            while time.monotonic() < deadline and proc.poll() is None:
                paths = dump_tool.pool_paths(proc.pid)
                if paths:
                    try:
                        state = dump_tool.read_pool_at(paths[0][0])
                    except dump_tool.DumpError:
                        state = {}   # the pool is made empty, then sized and filled: not readable yet
                    if state.get("control", {}).get("state_name") == "RUNNING":
                        break
                time.sleep(0.05)
            assert state.get("control", {}).get("state_name") == "RUNNING", proc.poll()
            res = run_tool("--pid", str(proc.pid), "--json")
            assert res.returncode == 0, res.stderr
            outside = json.loads(res.stdout)["processes"][0]["pools"][0]["state"]
            assert outside["control"]["proxy_pid"] == proc.pid
            assert outside["ranks"][0]["free_list"]["length"] == outside["layout"]["max_ops"]
            res = run_tool("--pid", str(proc.pid), "--signal", "--json", "--timeout", "20")
            assert res.returncode == 0, res.stderr
            got = json.loads(res.stdout)["processes"][0]
            assert got["dump_file"] == str(tmp_path / f"j-c0-{proc.pid}.dump.json")
            assert got["state"]["in_process"]["active_args"] == []
            assert "== in process" in dump.format_text(got["state"])
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=30)
    assert f"dumped its state to {tmp_path}" in err
    assert proc.returncode == 0, err
    assert glob.glob(f"/dev/shm/shmproxy-{os.getpid():08x}-*") == []  # the pool is named by job_key[:8]
