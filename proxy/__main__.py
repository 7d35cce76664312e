"""``python -m shmproxy script.py [args]`` (also ``-m module``, ``-c cmd``): run a program on every
rank, and abort the whole job (COMM_WORLD.Abort) when one rank raises an uncaught exception, as
``python -m mpi4py`` does. The how and why: shmproxy/_run.py."""
from __future__ import annotations

import sys

from shmproxy._run import run

if __name__ == "__main__":
    run(sys.argv[1:], "shmproxy")
