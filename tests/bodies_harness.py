"""Rank bodies of the harness tests (tests/test_harness.py): each rank imports this module
(``tests.bodies_harness:body_ok``) and calls the function. They do not need shmproxy.init(), so the
harness is tested by itself. Kept apart from the tests so that a rank does not import pytest: on the
loaded 2-vCPU VM that import alone could outlast the 2 s after which the deadline test's ranks dump
their stacks, and the dump then showed the import instead of the hang.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from tests.rankmain import rank_from_env

# A stand-in for the progress process: its command line says shmproxy.engine.progress (LeakGuard looks for it).
STANDIN = [sys.executable, "-c", "import signal; signal.pause()", "shmproxy.engine.progress-standin"]


def _rank() -> int:
    return int(rank_from_env())


def _hang() -> None:
    """Block forever (until killed): what a rank stuck in a wait looks like."""
    threading.Event().wait()


def body_ok(*extra: object) -> dict:
    return {"rank": _rank(), "pid": os.getpid(), "args": list(extra),
            "job": os.environ.get("SHMPROXY_JOB_ID"), "timeout": os.environ.get("SHMPROXY_TIMEOUT"),
            "cwd": os.getcwd(), "my_var": os.environ.get("MY_VAR")}


def body_none() -> None:
    print(f"stdout of rank {_rank()}")
    print(f"stderr of rank {_rank()}", file=sys.stderr)


def body_kwargs(a: int, b: str = "x") -> list:
    return [a, b]


def body_raise_on(bad_rank: int) -> None:
    if _rank() == bad_rank:
        raise RuntimeError(f"boom from rank {bad_rank}")
    _hang()


def body_exit(codes: dict) -> str:
    code = codes.get(str(_rank()), 0)
    if code:
        sys.exit(code)
    return "done"


def body_hang() -> None:
    _hang()


def body_spawn_child(pid_dir: str, new_session: bool, fail_rank: int) -> None:
    """Start a child (a progress process stand-in), record its pid, then fail or hang."""
    child = subprocess.Popen(STANDIN, start_new_session=new_session, stdin=subprocess.DEVNULL)
    path = Path(pid_dir) / f"child.{_rank()}"
    tmp = path.with_name(path.name + ".tmp")  # per rank: with_suffix would give both "child.tmp"
    tmp.write_text(str(child.pid))
    os.replace(tmp, path)
    if _rank() == fail_rank:
        raise RuntimeError("rank failed while its child runs")
    _hang()


def body_big_output(nbytes: int) -> int:
    sys.stdout.write("x" * nbytes)
    sys.stdout.flush()
    return nbytes


def body_params() -> list:
    """Every variable the harness sets must pass shmproxy.core.params' validation (unknown SHMPROXY_* fail)."""
    from shmproxy.core import params
    p = params.Params()
    return [p.TIMEOUT, p.JOB_ID]


def body_detect() -> list:
    from shmproxy.control import bootstrap
    i = bootstrap.detect()
    return [i.rank, i.size, i.local_rank, i.local_size, i.launcher]
