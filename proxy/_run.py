"""Running a program the way ``python`` would (a script path, ``-m module``, ``-c command``), for
``python -m shmproxy`` and ``python -m shmproxy.futures``.

Why: an uncaught exception on one rank of an MPI job leaves the others blocked in their next
collective or receive until the runtime's timeout. As ``python -m mpi4py`` does, the runner prints
the traceback and aborts COMM_WORLD (MPI.Abort: every rank's pending and next calls fail at once,
and this process exits with status 1), so the whole job ends promptly. A program that never used
MPI (COMM_WORLD not initialised) just exits with status 1: the launcher ends the others.
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback
from typing import Callable, NoReturn, Sequence

USAGE = "usage: python -m {prog} [-m module | -c cmd | script.py] [args...]"


def parse(argv: Sequence[str], prog: str) -> tuple[Callable[[], object], list[str]]:
    """(the call that runs the program, its sys.argv) from the runner's arguments."""
    args = list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE.format(prog=prog), file=sys.stderr)
        raise SystemExit(0 if args else 2)
    if args[0] == "-m" and len(args) > 1:
        module = args[1]
        return (lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)), [module, *args[2:]]
    if args[0] == "-c" and len(args) > 1:
        code = args[1]

        def run_code() -> None:
            main = sys.modules["__main__"].__dict__
            exec(compile(code, "<string>", "exec"), main)   # noqa: S102 - what -c means
        return run_code, ["-c", *args[2:]]
    if args[0].startswith("-"):
        print(USAGE.format(prog=prog), file=sys.stderr)
        raise SystemExit(2)
    path = args[0]

    def run_script() -> None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        runpy.run_path(path, run_name="__main__")
    return run_script, args


def load_main_for_workers(argv: Sequence[str]) -> None:
    """On a worker rank: load the program's script or module as ``__mp_main__`` and make it
    ``__main__``, so that the functions its tasks pickle as ``__main__.f`` resolve (what
    multiprocessing's spawn does; the ``if __name__ == "__main__"`` block does not run)."""
    import types
    args = list(argv)
    if not args or args[0] == "-c":
        return
    if args[0] == "-m":
        if len(args) < 2:
            return
        sys.argv[:] = [args[1], *args[2:]]
        namespace = runpy.run_module(args[1], run_name="__mp_main__")
    else:
        sys.argv[:] = args
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        namespace = runpy.run_path(args[0], run_name="__mp_main__")
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def abort(code: int = 1) -> NoReturn:
    """Print the current exception and end the job: MPI.COMM_WORLD.Abort when MPI is in use."""
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("shmproxy.mpi")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(code)      # does not return (it ends this process too)
    os._exit(code)


def run(argv: Sequence[str], prog: str) -> None:
    """Run the program; abort the job on an uncaught exception (SystemExit passes through)."""
    target, sys.argv[:] = parse(argv, prog)
    try:
        target()
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - KeyboardInterrupt too: the other ranks must not hang
        abort(1)
