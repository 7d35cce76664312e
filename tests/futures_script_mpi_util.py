"""A script for ``mpiexec -n 3 python -m shmproxy.futures`` (tests/test_mpi_util.py): rank 0 runs
it; the pool's tasks run on ranks 1 and 2."""
import os
import sys

from shmproxy.futures import MPIPoolExecutor, as_completed, wait
from shmproxy.util.pool import Pool


def where(x: int) -> tuple:
    return x * x, os.getpid()


def fail(x: int) -> int:
    raise ValueError(f"task {x} failed")


if __name__ == "__main__":
    with MPIPoolExecutor() as ex:
        results = list(ex.map(where, range(20), chunksize=3))
        assert [r[0] for r in results] == [x * x for x in range(20)]
        pids = {pid for _sq, pid in results}
        assert os.getpid() not in pids and len(pids) >= 1, pids
        futs = [ex.submit(pow, 2, k) for k in range(10)]
        done, _ = wait(futs)
        assert sorted(f.result() for f in as_completed(futs)) == [2 ** k for k in range(10)]
        try:
            ex.submit(fail, 7).result()
        except ValueError as exc:
            assert "task 7" in str(exc)
        else:
            raise AssertionError("the task's exception must come back")
    with Pool() as pool:
        assert pool.map(abs, [-1, -2, 3]) == [1, 2, 3]
        assert pool.apply_async(pow, (3, 2)).get(30) == 9
        assert pool.starmap(pow, [(2, 3), (3, 2)]) == [8, 9]
        pool.close()
        pool.join()
    print("FUTURES-OK", len(pids), " ".join(sys.argv[1:]), flush=True)
