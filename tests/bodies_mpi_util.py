"""Rank bodies of tests/test_mpi_util.py: shmproxy.util (pkl5, dtlib, sync, pool) and shmproxy.futures
(MPICommExecutor) in real rank processes."""
from __future__ import annotations

import time
from typing import Any

import numpy as np


def _raises(kind: type, call: Any) -> None:
    try:
        call()
    except kind:
        return
    raise AssertionError(f"{call} must raise {kind.__name__}")


def pkl5_roundtrip() -> dict:
    """Point-to-point and collectives of pkl5 with objects whose buffers travel out of band."""
    from shmproxy import MPI
    from shmproxy.util import pkl5
    comm = pkl5.Intracomm(MPI.COMM_WORLD)
    rank, size = comm.Get_rank(), comm.Get_size()
    big = np.full(300_000, rank, dtype=np.int64)          # 2.4 MB: above the out-of-band threshold
    dest, source = (rank + 1) % size, (rank - 1) % size
    status = MPI.Status()
    got = comm.sendrecv({"a": big, "r": rank}, dest, 5, None, source, 5, status)
    assert got["r"] == source and np.all(got["a"] == source) and status.Get_source() == source
    assert status.Get_elements(MPI.BYTE) > big.nbytes
    req = comm.isend([big, "x"], dest, 6)
    msg = comm.mprobe(source, 6)
    assert isinstance(msg, pkl5.Message)
    obj = msg.irecv().wait()
    req.wait()
    assert obj[1] == "x" and np.all(obj[0] == source)
    pkl5._bigmpi.blocksize = 1 << 16                      # force the contiguous-datatype path
    try:
        obj = comm.bcast(big if rank == 0 else None, root=0)
        assert np.all(obj == 0)
    finally:
        pkl5._bigmpi.blocksize = (1 << 63) - 1
    gathered = comm.gather(big[:10], root=size - 1)
    if rank == size - 1:
        assert [int(g[0]) for g in gathered] == list(range(size))
    sc = comm.scatter([np.full(5, i) for i in range(size)] if rank == 0 else None, root=0)
    assert np.all(sc == rank)
    ag = comm.allgather(rank * 10)
    at = comm.alltoall([(rank, d) for d in range(size)])
    assert ag == [r * 10 for r in range(size)] and at == [(s, rank) for s in range(size)]
    _raises(RuntimeError, comm.irecv)
    dup = comm.Dup()
    assert isinstance(dup, pkl5.Intracomm)
    dup.Free()
    return {"rank": rank, "ok": True}


def pkl5_duplicate_lives_and_dies_with_its_comm() -> bool:
    """pkl5's collectives run on a duplicate of the communicator: Free of the communicator frees it
    (every rank at the same call); the garbage collector taking a communicator dropped without Free
    does not, since closing a communicator is collective and the GC runs at a different moment on
    each rank (rank 0 collects here while the others wait in a Barrier)."""
    import gc

    from shmproxy import MPI
    from shmproxy.util import pkl5
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    comm = pkl5.Intracomm(world.Split(rank % 2, rank))
    assert comm.bcast(["x", rank], root=0) == ["x", rank % 2]   # each group's root: world rank 0 or 1
    dup = comm.Get_attr(pkl5._dup_keyval[0])[0]
    assert dup
    comm.Free()
    assert not dup, "Free left pkl5's duplicate open"
    dropped = pkl5.Intracomm(world.Dup())
    assert dropped.allgather(rank) == list(range(world.Get_size()))
    dup = dropped.Get_attr(pkl5._dup_keyval[0])[0]
    del dropped
    if rank == 0:
        gc.collect()
    world.Barrier()
    assert dup, "the garbage collector closed pkl5's duplicate"
    dup.Barrier()
    dup.Free()
    return True


def dtlib_roundtrip() -> list:
    from shmproxy import MPI
    from shmproxy.util.dtlib import from_numpy_dtype, to_numpy_dtype
    out = []
    for spec in ("i4", "f8", "c16", np.dtype([("x", "i4"), ("y", "f8")], align=True),
                 np.dtype(("f4", (3,))), np.dtype(("i2", (2, 3)))):
        dt = np.dtype(spec)
        mt = from_numpy_dtype(dt)
        back = to_numpy_dtype(mt)
        if dt.fields:      # the same layout; the fields come back named f0, f1, ...
            assert back.isalignedstruct and back.itemsize == dt.itemsize, (dt, back)
            assert [back.fields[n][:2] for n in back.names] == [dt.fields[n][:2] for n in dt.names]
        else:
            assert back == dt, (dt, back)
        assert mt.Get_size() == dt.itemsize or dt.fields is not None
        mt.Free()
        out.append(str(dt))
    vec = MPI.INT.Create_vector(2, 1, 3)
    assert to_numpy_dtype(vec).itemsize == 4 * 4
    vec.Free()
    return out


def sync_objects() -> dict:
    """Counter, Mutex (mutual exclusion checked with a shared file), Condition, Semaphore, Sequential."""
    import os
    import tempfile
    from shmproxy import MPI
    from shmproxy.util import sync
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    counter = sync.Counter(comm=comm)
    mine = [counter.next() for _ in range(20)]
    everyone = comm.allgather(mine)
    flat = sorted(v for vals in everyone for v in vals)
    assert flat == list(range(20 * size)), flat
    comm.Barrier()
    counter.free()

    path = comm.bcast(tempfile.mktemp(prefix="shmproxy-mutex-") if rank == 0 else None)
    mutex = sync.Mutex(comm=comm)
    for _ in range(10):
        with mutex:
            assert mutex.locked()
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)     # fails if someone else is in
            time.sleep(0.001)
            os.close(fd)
            os.unlink(path)
        assert not mutex.locked()
    _raises(RuntimeError, mutex.release)
    comm.Barrier()
    mutex.free()

    rmutex = sync.Mutex(recursive=True, comm=comm)
    with rmutex:
        with rmutex:
            assert rmutex.count() == 2
        assert rmutex.count() == 1
    comm.Barrier()
    rmutex.free()

    # a condition: every rank but 0 waits for the shared counter to reach size - 1
    cv = sync.Condition(comm=comm)
    shared = sync.Counter(comm=comm)
    if rank != 0:
        with cv:
            shared.next()
            cv.notify_all()
            cv.wait_for(lambda: shared.next(0) >= size)
    else:
        with cv:
            cv.wait_for(lambda: shared.next(0) >= size - 1)
            shared.next()
            cv.notify_all()
    comm.Barrier()
    cv.free()
    shared.free()

    sem = sync.Semaphore(1, comm=comm)
    inside = sync.Counter(comm=comm)
    for _ in range(5):
        with sem:
            assert inside.next(1) == 0
            inside.next(-1)
    comm.Barrier()              # nobody holds it now: one more release is one too many
    if rank == 0:
        _raises(ValueError, sem.release)
    comm.Barrier()
    sem.free()
    inside.free()

    order = sync.Counter(comm=comm)
    with sync.Sequential(comm):
        seen = order.next()
    comm.Barrier()
    order.free()
    assert seen == rank, (seen, rank)
    return {"rank": rank, "first": mine[0]}


def _square(x: int) -> int:
    return x * x


def comm_executor() -> dict:
    """MPICommExecutor inside a program: root 1 of COMM_WORLD submits, the others run the tasks."""
    import os
    from shmproxy import MPI
    from shmproxy.futures import MPICommExecutor, as_completed
    comm = MPI.COMM_WORLD
    out: dict[str, Any] = {"rank": comm.Get_rank()}
    with MPICommExecutor(comm, root=1) as executor:
        if executor is not None:
            assert list(executor.map(_square, range(30), chunksize=4)) == [x * x for x in range(30)]
            futures = [executor.submit(os.getpid) for _ in range(12)]
            pids = {f.result() for f in as_completed(futures)}
            assert os.getpid() not in pids, pids
            out["pids"] = len(pids)
    comm.Barrier()              # every rank is back from the block: the program goes on
    out["after"] = comm.allreduce(1)
    return out


def pool_threads() -> list:
    """util.pool.ThreadPool (no worker ranks needed)."""
    from shmproxy.util.pool import ThreadPool
    with ThreadPool(2) as pool:
        res = pool.map(_square, range(10))
        asyn = pool.map_async(_square, range(5)).get(30)
        star = pool.starmap(pow, [(2, 2), (3, 3)])
        unordered = sorted(pool.imap_unordered(_square, range(4)))
        pool.close()
        pool.join()
    return [res, asyn, star, unordered]
