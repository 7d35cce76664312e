"""A rank of the job that tests/test_installed.py runs from the installed wheel, outside the checkout.

It imports nothing from the checkout (the test runs it from a temporary folder with a fresh
virtualenv's python), checks that ``shmproxy`` is the installed one, then drives one API, named by
its argument, with results checked against what each rank can compute alone:

    native  shmproxy.init(): Allreduce, a ring of Send/Recv, Bcast, the object layer's allgather
    mpi     shmproxy.MPI: COMM_WORLD's allreduce, Allreduce, Allgatherv with vector specs, Split
    torch   the torch.distributed backend "shmproxy": all_reduce, broadcast, all_gather, barrier

Each rank prints one line, ``<api> rank R of N ok``; any mismatch raises, so the rank exits non-zero.
"""
from __future__ import annotations

import sys

import numpy as np


def _installed_only(module) -> None:
    path = module.__file__ or ""
    if "site-packages" not in path:
        raise AssertionError(f"shmproxy was imported from {path}, not from the installed wheel")


def native() -> tuple[int, int]:
    import shmproxy
    _installed_only(shmproxy)
    with shmproxy.init(timeout=60) as comm:
        rank, size = comm.rank, comm.size
        x = np.full(1000, rank + 1, dtype=np.float64)
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=shmproxy.SUM)
        assert np.all(out == size * (size + 1) / 2), out[:4]
        right, left = (rank + 1) % size, (rank - 1) % size
        got = np.empty(3, dtype=np.int64)
        with comm.group():
            reqs = [comm.Irecv(got, left, tag=5), comm.Isend(np.array([rank, 7, rank * 3]), right, tag=5)]
        shmproxy.Request.Waitall(reqs)
        assert got.tolist() == [left, 7, left * 3], got
        b = np.arange(64, dtype=np.int32) if rank == 0 else np.zeros(64, dtype=np.int32)
        comm.Bcast(b, root=0)
        assert b.tolist() == list(range(64)), b
        assert comm.allgather({"r": rank}) == [{"r": r} for r in range(size)]
    return rank, size


def mpi() -> tuple[int, int]:
    import shmproxy
    from shmproxy import MPI
    _installed_only(shmproxy)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    assert world.allreduce(rank, op=MPI.SUM) == size * (size - 1) // 2
    x = np.full(16, rank, dtype=np.int32)
    out = np.empty_like(x)
    world.Allreduce(x, out, op=MPI.MAX)
    assert np.all(out == size - 1), out
    counts = [r + 1 for r in range(size)]
    displs = [sum(counts[:r]) for r in range(size)]
    recv = np.full(sum(counts), -1, dtype=np.float64)
    world.Allgatherv(np.full(rank + 1, float(rank)), [recv, counts, displs, MPI.DOUBLE])
    assert recv.tolist() == [float(r) for r in range(size) for _ in range(r + 1)], recv
    half = world.Split(rank % 2, key=-rank)
    assert half.Get_size() == len(range(rank % 2, size, 2))
    assert half.allgather(rank) == sorted(range(rank % 2, size, 2), reverse=True)
    half.Free()
    return rank, size


def torch_backend() -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    import shmproxy.torch  # noqa: F401  (registers the backend)
    _installed_only(shmproxy.torch)
    dist.init_process_group("shmproxy")
    try:
        rank, size = dist.get_rank(), dist.get_world_size()
        t = torch.full((257,), float(rank + 1))
        dist.all_reduce(t)
        assert torch.all(t == size * (size + 1) / 2), t[:4]
        b = torch.arange(10) if rank == 0 else torch.zeros(10, dtype=torch.int64)
        dist.broadcast(b, src=0)
        assert b.tolist() == list(range(10)), b
        parts = [torch.empty(2, dtype=torch.int32) for _ in range(size)]
        dist.all_gather(parts, torch.tensor([rank, -rank], dtype=torch.int32))
        assert [p.tolist() for p in parts] == [[r, -r] for r in range(size)], parts
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return rank, size


def main() -> None:
    api = sys.argv[1]
    rank, size = {"native": native, "mpi": mpi, "torch": torch_backend}[api]()
    print(f"{api} rank {rank} of {size} ok", flush=True)


if __name__ == "__main__":
    main()
