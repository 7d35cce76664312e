"""Entry point of one rank of a multi-process test: ``python -m tests.rankmain module:function [json-args]``.

Started by tests/harness.py, directly (one fresh interpreter per rank, never a fork) or under a real
launcher (mpiexec, torchrun). It

1. enables faulthandler, and arms ``faulthandler.dump_traceback_later(SPTEST_FAULT_TIMEOUT)`` so that a
   rank that hangs prints the stack of every thread to its stderr before the harness kills it;
2. under a launcher (SPTEST_OUTPUT set), sends its own stdout/stderr to per-rank files, so the harness
   reports each rank's output separately (the launcher would interleave them);
3. writes its pid to ``$SPTEST_RESULT.<rank>.pid`` and, under a launcher, sends ``start <rank> <pid>``
   to the harness's datagram socket $SPTEST_NOTIFY (``exit <rank> <code>`` at the end), so that the
   harness sees the first failure at once even when the launcher does not stop the job;
4. imports ``module`` and calls ``function(*args)`` (``function(**args)`` for a JSON object);
5. writes the return value, if not None, as JSON to ``$SPTEST_RESULT.<rank>`` and its exit code to
   ``$SPTEST_RESULT.<rank>.exit``; on an exception, prints the traceback to stderr and exits 1.

It prints nothing else. The rank number comes from whichever launcher variable is set (RANK, PMI_RANK,
OMPI_COMM_WORLD_RANK, SLURM_PROCID). The variables use the SPTEST_ prefix because every SHMPROXY_*
variable is validated by shmproxy.core.params and an unknown one is an error.
"""
from __future__ import annotations

import faulthandler
import importlib
import json
import os
import sys
import traceback
from typing import Any

RESULT_VAR = "SPTEST_RESULT"
FAULT_TIMEOUT_VAR = "SPTEST_FAULT_TIMEOUT"
OUTPUT_VAR = "SPTEST_OUTPUT"
NOTIFY_VAR = "SPTEST_NOTIFY"
RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def rank_from_env(env: dict[str, str] | None = None) -> str:
    """This process's rank as the launcher wrote it, or '0' when no launcher variable is set."""
    env = dict(os.environ) if env is None else env
    for name in RANK_VARS:
        value = env.get(name, "").strip()
        if value:
            return value
    return "0"


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _notify(message: str) -> None:
    """Tell the harness (a datagram socket at $SPTEST_NOTIFY; '@' = abstract) that we started or end."""
    path = os.environ.get(NOTIFY_VAR, "")
    if not path:
        return
    import socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(message.encode("ascii"), "\0" + path[1:] if path.startswith("@") else path)
    except OSError:
        pass  # the harness is gone or not listening: nothing to tell


def _redirect_output(prefix: str, rank: str) -> None:
    """Point fds 1 and 2 at per-rank files (children, e.g. the progress process, inherit them)."""
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(f"{prefix}.{rank}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or ":" not in argv[0]:
        print("usage: python -m tests.rankmain module:function [json-args]", file=sys.stderr)
        return 2
    rank = rank_from_env()
    output = os.environ.get(OUTPUT_VAR, "")
    if output:
        sys.stdout.flush()
        sys.stderr.flush()
        _redirect_output(output, rank)
    faulthandler.enable(all_threads=True)
    fault_timeout = os.environ.get(FAULT_TIMEOUT_VAR, "")
    if fault_timeout:
        faulthandler.dump_traceback_later(float(fault_timeout), exit=False)
    result_prefix = os.environ.get(RESULT_VAR, "")
    if result_prefix:
        _write_atomic(f"{result_prefix}.{rank}.pid", str(os.getpid()))
    _notify(f"start {rank} {os.getpid()}")

    code = 1
    try:
        module_name, _, func_name = argv[0].partition(":")
        args: Any = json.loads(argv[1]) if len(argv) == 2 else []
        func = getattr(importlib.import_module(module_name), func_name)
        value = func(**args) if isinstance(args, dict) else func(*args)
        if value is not None and result_prefix:
            _write_atomic(f"{result_prefix}.{rank}", json.dumps(value))
        code = 0
    except SystemExit as exc:  # a body that calls sys.exit(n) gets exit code n
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code != 0:
            traceback.print_exc()
    except BaseException:  # KeyboardInterrupt included: the parent must see why the rank stopped
        traceback.print_exc()
        code = 1
    finally:
        # The watchdog stays armed: a rank that hangs at exit (atexit handlers, non-daemon threads)
        # still prints its stack before the harness kills it.
        if result_prefix:
            try:
                _write_atomic(f"{result_prefix}.{rank}.exit", str(code))
            except OSError:
                traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        _notify(f"exit {rank} {code}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
