"""``mpiexec -n N python -m shmproxy.futures script.py [args]``: rank 0 runs the script as
``__main__``; ranks 1..N-1 run the tasks of its MPIPoolExecutors (the static world of
``python -m mpi4py.futures``: no Spawn). When the script ends, the workers are stopped and every rank
exits; an uncaught exception aborts the job (shmproxy/_run.py)."""
from __future__ import annotations

import sys

from shmproxy._run import abort, load_main_for_workers, run
from shmproxy.futures import _core


def main() -> None:
    try:
        is_root = _core.world_pool_start(lambda: load_main_for_workers(sys.argv[1:]))
    except BaseException:  # noqa: BLE001 - a worker's failure must not leave rank 0 waiting
        abort(1)
    if not is_root:
        return
    run(sys.argv[1:], "shmproxy.futures")
    try:
        _core.world_pool_stop()
    except BaseException:  # noqa: BLE001
        abort(1)


if __name__ == "__main__":
    main()
