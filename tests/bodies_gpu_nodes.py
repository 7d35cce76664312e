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
    """bfloat16 torch tensors between nodes: moved bit for bit; reduced in float32 and rounded once
    (shmproxy.rank.devstage), so every rank holds torch's float32 result rounded to bfloat16."""
    import torch
    _cp()
    bad, cases = [], 0
    bf = torch.bfloat16

    def same(a: Any, b: Any) -> bool:
        return bool((a.view(torch.int16) == b.view(torch.int16)).all())

    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        for n in (1, 1000, 1 << 18):
            # up to 997 distinct values, so that sums and products need rounding in 8 bits of mantissa
            xs = [((torch.arange(n, device="cuda") * 7 + r * 3) % 997 * 0.37 + 1).to(bf) for r in range(size)]
            g = torch.zeros(n * size, dtype=bf, device="cuda")
            comm.Allgather(xs[me], g)
            b = xs[me].clone()
            comm.Bcast(b, 0)
            cases += 2
            if not same(g, torch.cat(xs)):
                bad.append(f"Allgather bfloat16 n={n}")
            if not same(b, xs[0]):
                bad.append(f"Bcast bfloat16 n={n}")
            wide = [x.float() for x in xs]
            for op in ("SUM", "PROD", "MIN", "MAX", "AVG"):
                acc = wide[0].clone()
                for w in wide[1:]:
                    acc = {"SUM": acc + w, "AVG": acc + w, "PROD": acc * w,
                           "MIN": torch.minimum(acc, w), "MAX": torch.maximum(acc, w)}[op]
                ref = (acc / size if op == "AVG" else acc).to(bf)
                out = torch.zeros(n, dtype=bf, device="cuda")
                comm.Allreduce(xs[me], out, getattr(shmproxy, op))
                inplace = xs[me].clone()
                comm.Allreduce(shmproxy.IN_PLACE, inplace, getattr(shmproxy, op))
                rout = torch.zeros(n, dtype=bf, device="cuda") if me == 0 else None
                comm.Reduce(xs[me], rout, getattr(shmproxy, op), root=0)
                cases += 3
                for what, got in (("Allreduce", out), ("Allreduce in place", inplace)) + (
                        (("Reduce", rout),) if me == 0 else ()):
                    if not same(got, ref):
                        bad.append(f"{what} {op} bfloat16 n={n}")
            rs = torch.zeros(n, dtype=bf, device="cuda")
            full = torch.cat(xs)
            comm.Reduce_scatter_block(full, rs)
            cases += 1
            if not same(rs, (xs[me].float() * size).to(bf)):
                bad.append(f"Reduce_scatter_block bfloat16 n={n}")
    return {"cases": cases, "bad": bad}


def buffers_given_back() -> dict:
    """The pinned host buffers: reused call after call (no new registration per call), and gone
    with the communicator: the GPU's memory and the host's locked pages back where they were."""
    cp = _cp()
    with shmproxy.init() as comm:
        x = cp.ones(1 << 20, cp.float32)
        out = cp.zeros_like(x)
        comm.Allreduce(x, out)
        stage: Any = comm._posting.devstage
        first = len(stage.pinned.pinned)
        for _ in range(20):
            comm.Allreduce(x, out)
        again = len(stage.pinned.pinned)
        ok = bool((out == comm.size).all())
    return {"cases": 1, "bad": [] if ok and again == first else [f"pinned {first} then {again}, ok {ok}"],
            "pinned_after_close": len(stage.pinned.pinned)}


def torch_backend_large() -> dict:
    """The torch backend between nodes on CUDA tensors large enough, and a stream busy enough, that
    ``wait()`` would make the stream wait within a node (shmproxy.torch.cuda): across nodes the host
    waits (the staging synchronises the stream at the next post, under the group's lock: a stream
    waiting for the completion thread would deadlock it), and the copies back run on the staging's
    own stream."""
    import torch
    import torch.distributed as dist
    import shmproxy.torch  # noqa: F401  (registers the backend)
    _cp()
    dist.init_process_group("shmproxy")
    me, ws = dist.get_rank(), dist.get_world_size()
    bad, cases = [], 0
    for n in (1 << 20, 1 << 22):
        x = torch.full((n,), float(me + 1), device="cuda")
        torch.cuda._sleep(50_000_000)   # a busy stream: wait() takes the stream path
        dist.all_reduce(x, async_op=True).wait()
        y = x * 2
        dist.all_reduce(x)
        z = x + 0
        torch.cuda.synchronize()
        cases += 2
        s = float(sum(range(1, ws + 1)))
        if float(y.min()) != 2 * s or float(y.max()) != 2 * s:
            bad.append(f"n={n}: after wait {float(y.min())}..{float(y.max())}, not {2 * s}")
        if float(z.min()) != s * ws or float(z.max()) != s * ws:
            bad.append(f"n={n}: second all_reduce {float(z.min())}, not {s * ws}")
    dist.destroy_process_group()
    return {"cases": cases, "bad": bad}
