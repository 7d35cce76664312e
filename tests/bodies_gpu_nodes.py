"""Rank bodies for tests/test_gpu_nodes.py: device buffers between simulated nodes, what the bodies of
tests/bodies_gpu.py do not reach (those run there too): sizes around the switches between nodes
(the eager limit, the chunk, the ring), a receive from any source, bfloat16, and the pinned host
buffers given back."""
from __future__ import annotations

from typing import Any

import numpy as np

import shmproxy
from tests.bodies_gpu import _cp

# float32 element counts around 64 KiB (the eager limit between nodes), a 1 MiB chunk and beyond
COUNTS = [16383, 16384, 16385, (1 << 18) + 1, (1 << 20) + 3, 3 << 20]


def switches() -> dict:
    """Allreduce, Bcast, Allgather, Reduce_scatter_block and Send/Recv at every size of COUNTS,
    against numpy; a receive from ANY_SOURCE; nonblocking forms waited on out of order."""
    cp = _cp()
    bad, cases = [], 0
    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        for n in COUNTS:
            xs = [((np.arange(n, dtype=np.int64) * 7 + r * 3) % 11).astype(np.float32) for r in range(size)]
            ref = np.sum(xs, axis=0, dtype=np.float32)
            out = cp.zeros(n, cp.float32)
            comm.Allreduce(cp.asarray(xs[me]), out)
            b = cp.asarray(xs[me])
            comm.Bcast(b, size - 1)
            g = cp.zeros(n * size, cp.float32)
            comm.Allgather(cp.asarray(xs[me]), g)
            full = cp.asarray(np.concatenate(xs))
            rs = cp.zeros(n, cp.float32)
            r1 = comm.Ireduce_scatter_block(full, rs)
            inplace = cp.asarray(xs[me])
            r2 = comm.Iallreduce(shmproxy.IN_PLACE, inplace)
            r2.Wait()
            r1.Wait()
            cases += 5
            for what, got, want in (("Allreduce", out, ref), ("Bcast", b, xs[size - 1]),
                                    ("Allgather", g, np.concatenate(xs)),
                                    ("Reduce_scatter_block", rs, np.full(n, 0, np.float32) + xs[me] * size),
                                    ("Iallreduce in place", inplace, ref)):
                if not np.array_equal(cp.asnumpy(got), want):
                    bad.append(f"{what} n={n}")
            # a ring of messages, the receive from any source
            right, left = (me + 1) % size, (me - 1) % size
            rbuf = cp.zeros(n, cp.float32)
            rr = comm.Irecv(rbuf, shmproxy.ANY_SOURCE, tag=5)
            comm.Send(cp.asarray(xs[me]), right, tag=5)
            st = rr.Wait()
            cases += 1
            if st.source != left or st.nbytes != 4 * n or not np.array_equal(cp.asnumpy(rbuf), xs[left]):
                bad.append(f"ring from ANY_SOURCE n={n}: source {st.source} nbytes {st.nbytes}")
        # a short message into a longer buffer: only its bytes land, the rest keeps its values
        if size >= 2 and me < 2:
            long = cp.full(100, -1.0, cp.float32)
            if me == 0:
                comm.Send(cp.arange(10, dtype=cp.float32), 1, tag=9)
            else:
                st = comm.Recv(long, 0, tag=9)
                cases += 1
                got = cp.asnumpy(long)
                if st.nbytes != 40 or not (np.array_equal(got[:10], np.arange(10)) and (got[10:] == -1).all()):
                    bad.append(f"short message: nbytes {st.nbytes}, {got[:12]}")
    return {"cases": cases, "bad": bad}


def bfloat16_across() -> dict:
    """bfloat16 torch tensors between nodes: moved bit for bit; a reduction refused before posting,
    and the communicator goes on."""
    import torch
    _cp()
    bad, cases = [], 0
    bf = torch.bfloat16
    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        xs = [((torch.arange(1000, device="cuda") * 7 + r * 3) % 997 * 0.37 + 1).to(bf) for r in range(size)]
        g = torch.zeros(1000 * size, dtype=bf, device="cuda")
        comm.Allgather(xs[me], g)
        b = xs[me].clone()
        comm.Bcast(b, 0)
        cases += 2
        if not bool((g.view(torch.int16) == torch.cat(xs).view(torch.int16)).all()):
            bad.append("Allgather bfloat16")
        if not bool((b.view(torch.int16) == xs[0].view(torch.int16)).all()):
            bad.append("Bcast bfloat16")
        try:
            comm.Allreduce(xs[me], torch.zeros(1000, dtype=bf, device="cuda"))
            bad.append("a bfloat16 Allreduce across nodes was accepted")
        except shmproxy.InvalidArgument as exc:
            cases += 1
            if "bfloat16" not in str(exc):
                bad.append(f"refusal does not say why: {exc}")
        out = torch.zeros(1000, device="cuda")
        comm.Allreduce(xs[me].float(), out)
        cases += 1
        if not bool((out == sum(x.float() for x in xs)).all()):
            bad.append("float32 Allreduce after the refusal")
    return {"cases": cases, "bad": bad}


def buffers_given_back() -> dict:
    """The pinned host buffers: reused call after call (no new registration per call), and gone
    with the communicator: the GPU's memory and the host's locked pages back where they were."""
    cp = _cp()
    with shmproxy.init() as comm:
        x = cp.ones(1 << 20, cp.float32)
        out = cp.zeros_like(x)
        comm.Allreduce(x, out)
        stage: Any = comm._devstage
        first = len(stage.pinned.pinned)
        for _ in range(20):
            comm.Allreduce(x, out)
        again = len(stage.pinned.pinned)
        ok = bool((out == comm.size).all())
    return {"cases": 1, "bad": [] if ok and again == first else [f"pinned {first} then {again}, ok {ok}"],
            "pinned_after_close": len(stage.pinned.pinned)}
