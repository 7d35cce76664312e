"""Rank bodies of tests/test_mpi_partitioned.py: partitioned point-to-point (Psend_init, Precv_init)."""
from __future__ import annotations

import numpy as np

from shmproxy import MPI
from tests.mpi_checks import raises_class


def ring_out_of_order(parts: int, rounds: int) -> dict:
    """Each rank sends to the next one ``rounds`` times, marking partitions ready in a different order
    each round (last first, odd ones first, a range, a list), and checks each part's data and that a
    part is never seen to arrive before the sender could have sent it."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    dest, source = (rank + 1) % size, (rank - 1) % size
    k = 5
    sbuf = np.zeros(parts * k, np.float64)
    rbuf = np.full(parts * k, -1.0)
    sreq = comm.Psend_init([sbuf, MPI.DOUBLE], parts, dest, tag=7)
    rreq = comm.Precv_init(rbuf, parts, source, tag=7)
    # a plain message with the same tag, in flight across every round: no part may match it
    plain_in = np.zeros(3)
    plain = comm.Irecv(plain_in, source, tag=7)
    comm.Send(np.full(3, 42.0 + rank), dest, tag=7)
    orders = [list(range(parts))[::-1], [i for i in range(parts) if i % 2] + [i for i in range(parts) if not i % 2]]
    for rnd in range(rounds):
        sbuf[:] = np.repeat(np.arange(parts) + 100 * rnd + 1000 * rank, k)
        rreq.Start()
        assert not any(rreq.Parrived(i) for i in range(parts))
        comm.Barrier()
        sreq.Start()
        if rnd % 4 == 2 and parts > 1:
            sreq.Pready_range(parts // 2, parts - 1)
            sreq.Pready_range(0, parts // 2 - 1)
        elif rnd % 4 == 3:
            sreq.Pready_list(list(range(parts))[::-1])
        else:
            for i in orders[rnd % 2]:
                sreq.Pready(i)
        for i in range(parts):
            while not rreq.Parrived(i):
                pass
            want = i + 100 * rnd + 1000 * source
            assert (rbuf[i * k:(i + 1) * k] == want).all(), (rnd, i, rbuf)
        st = MPI.Status()
        rreq.Wait(st)
        assert (st.Get_source(), st.Get_tag(), st.Get_count(MPI.DOUBLE)) == (source, 7, parts * k), st
        sreq.Wait()
        comm.Barrier()
    plain.Wait()
    assert (plain_in == 42.0 + source).all(), plain_in
    sreq.Free()
    rreq.Free()
    return {}


def errors_before_anything_is_posted() -> dict:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    buf = np.zeros(10)
    raises_class(MPI.ERR_COUNT, lambda: comm.Psend_init(buf, 3, rank, 0))   # 10 is not 3 parts
    raises_class(MPI.ERR_ARG, lambda: comm.Psend_init(buf, 0, rank, 0))
    raises_class(MPI.ERR_RANK, lambda: comm.Precv_init(buf, 2, MPI.ANY_SOURCE, 0))
    raises_class(MPI.ERR_RANK, lambda: comm.Psend_init(buf, 2, MPI.PROC_NULL, 0))
    raises_class(MPI.ERR_TAG, lambda: comm.Psend_init(buf, 2, rank, -1))
    s = comm.Psend_init(buf, 2, rank, 3)
    r = comm.Precv_init(np.empty(10), 2, rank, 3)
    raises_class(MPI.ERR_REQUEST, lambda: s.Pready(0))      # not started
    r.Start()
    s.Start()
    s.Pready(1)
    raises_class(MPI.ERR_ARG, lambda: s.Pready(1))          # twice in one round
    raises_class(MPI.ERR_ARG, lambda: s.Pready(2))          # out of range
    assert not s.Test() and not r.Parrived(1)    # part 1 waits for part 0: parts go in order
    try:
        s.Wait()      # would wait forever for a part only this process can mark
    except MPI.Exception:
        pass
    else:
        raise AssertionError("Wait with a partition not ready returned")
    s.Start()     # the failed Wait ended the round
    s.Pready_range(0, 1)
    MPI.Request.Waitall([r, s])
    s.Free()
    r.Free()
    return {}
