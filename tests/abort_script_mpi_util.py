"""A program for ``python -m shmproxy`` (tests/test_mpi_util.py): rank 1 raises while the other
ranks wait in a Barrier; the runner must abort the whole job, not leave them waiting."""
import time

from shmproxy import MPI

comm = MPI.COMM_WORLD
comm.Barrier()
if comm.Get_rank() == 1:
    time.sleep(0.5)
    raise RuntimeError("rank 1 fails on purpose")
comm.Barrier()          # never completes: rank 1 is gone
time.sleep(600)
