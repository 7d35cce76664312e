"""Rank bodies for tests/test_gpu.py: Gather, Scatter, Gatherv, Scatterv, Allgatherv, Alltoallv,
Reduce_scatter, Scan and Exscan (and their I-forms) on device arrays.

Every case runs twice, on host arrays (numpy) and on device arrays (cupy) of the same inputs, and both
results are compared bit for bit with one numpy reference (reductions: a left fold in rank order,
numpy's arithmetic, which the host path matches). A host failure too points at the reference, not
the device path. Counts are even, uneven with an empty rank, or all zero; displacements leave a gap
that must keep its sentinel. ``vector_cases_host`` runs the host half alone (no GPU needed).
"""
from __future__ import annotations

from typing import Any

import numpy as np

import shmproxy

DTYPES = ("float32", "float16", "int64")
SIZES = (1, 1000, 1 << 16)
SENTINEL = 9
_FOLD = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum, "AVG": np.add}


def _inp(r: int, n: int, dtype: str, salt: int) -> np.ndarray:
    return (((np.arange(n, dtype=np.int64) * 7 + r * 3 + salt) % 5) + 1).astype(dtype)


def _fold(xs: list[np.ndarray], op: str) -> np.ndarray:
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = _FOLD[op](acc, x)
    if op == "AVG":
        np.divide(acc, len(xs), out=acc, casting="unsafe")
    return acc


def _counts(size: int, n: int, pattern: str) -> list[int]:
    if pattern == "zero":
        return [0] * size
    if pattern == "even":
        return [n] * size
    return [0 if r == 1 else n + 3 * r for r in range(size)]


def _displs(cs: list[int]) -> list[int]:
    """Packed in rank order with a one-element gap before each block."""
    out, acc = [], 0
    for c in cs:
        out.append(acc + 1)
        acc += c + 1
    return out


def _cases(comm: Any, xp: Any, dtype: str, n: int, pattern: str, bad: list, label: str) -> int:
    """Every collective of this module (blocking, I-form, IN_PLACE) on ``xp`` arrays; returns the count."""
    me, size = comm.rank, comm.size
    dev = xp.__name__ != "numpy"
    cases = 0

    def arr(a: np.ndarray) -> Any:
        return xp.asarray(a) if dev else a.copy()

    def host(a: Any) -> np.ndarray:
        return xp.asnumpy(a) if dev else a

    def check(what: str, got: Any, ref: np.ndarray) -> None:
        nonlocal cases
        cases += 1
        g = host(got)
        if g.shape != ref.shape or g.tobytes() != ref.tobytes():
            bad.append(f"{label} {what} {dtype} n={n} {pattern}")

    def call(blocking: bool, name: str, *args: Any, **kw: Any) -> None:
        if blocking:
            getattr(comm, name)(*args, **kw)
        else:
            getattr(comm, "I" + name[0].lower() + name[1:])(*args, **kw).Wait()

    def packed(blocks: list[np.ndarray]) -> np.ndarray:   # the layout _displs describes
        gap = np.full(1, SENTINEL, dtype)
        return np.concatenate([gap] + [x for b in blocks for x in (b, gap)][:-1])

    rc = _counts(size, n, pattern)
    rd = _displs(rc)
    total = rd[-1] + rc[-1]
    root = (n + len(pattern)) % size
    xs = [_inp(r, rc[r], dtype, 0) for r in range(size)]
    for blocking in (True, False):
        form = "" if blocking else "I"
        # Gatherv (and IN_PLACE on the root)
        ref = np.full(total, SENTINEL, dtype)
        for r in range(size):
            ref[rd[r]:rd[r] + rc[r]] = xs[r]
        for in_place in (False, True):
            out = arr(np.full(total, SENTINEL, dtype)) if me == root else None
            send = arr(xs[me])
            if in_place and me == root:
                out[rd[me]:rd[me] + rc[me]] = send
                send = shmproxy.IN_PLACE
            call(blocking, "Gatherv", send, out, rc, rd, root)
            if me == root:
                check(f"{form}Gatherv{' in place' if in_place else ''}", out, ref)
        # Scatterv (and IN_PLACE on the root)
        full = packed([_inp(r, rc[r], dtype, 1) for r in range(size)])
        for in_place in (False, True):
            out = arr(np.zeros(rc[me], dtype))
            recv = shmproxy.IN_PLACE if in_place and me == root else out
            call(blocking, "Scatterv", arr(full) if me == root else None, recv, rc, rd, root)
            if recv is not shmproxy.IN_PLACE:
                check(f"{form}Scatterv{' in place' if in_place else ''}", out, _inp(me, rc[me], dtype, 1))
        # Allgatherv (and IN_PLACE)
        for in_place in (False, True):
            out = arr(np.full(total, SENTINEL, dtype))
            send = arr(xs[me])
            if in_place:
                out[rd[me]:rd[me] + rc[me]] = send
                send = shmproxy.IN_PLACE
            call(blocking, "Allgatherv", send, out, rc, rd)
            check(f"{form}Allgatherv{' in place' if in_place else ''}", out, ref)
        # Gather, Scatter: equal blocks of rc[0] (the pattern's first count)
        m = rc[0]
        gref = np.concatenate([_inp(r, m, dtype, 2) for r in range(size)])
        for in_place in (False, True):
            out = arr(np.zeros(m * size, dtype)) if me == root else None
            send = arr(_inp(me, m, dtype, 2))
            if in_place and me == root:
                out[me * m:(me + 1) * m] = send
                send = shmproxy.IN_PLACE
            call(blocking, "Gather", send, out, root)
            if me == root:
                check(f"{form}Gather{' in place' if in_place else ''}", out, gref)
            out = arr(np.zeros(m, dtype))
            recv = shmproxy.IN_PLACE if in_place and me == root else out
            call(blocking, "Scatter", arr(gref) if me == root else None, recv, root)
            if recv is not shmproxy.IN_PLACE:
                check(f"{form}Scatter{' in place' if in_place else ''}", out, gref[me * m:(me + 1) * m])
        # Alltoallv: rank r sends c(r, q) elements to rank q (some zero)

        def c(r: int, q: int) -> int:
            return 0 if pattern == "zero" else ((3 * r + 5 * q + 1) % 4) * max(1, n // 3)
        sc = [c(me, q) for q in range(size)]
        rcv = [c(r, me) for r in range(size)]
        sd, rdd = _displs(sc), _displs(rcv)
        sfull = [packed([_inp(r * size + q, c(r, q), dtype, 3) for q in range(size)]) for r in range(size)]
        aref = np.full(rdd[-1] + rcv[-1], SENTINEL, dtype)
        for r in range(size):
            aref[rdd[r]:rdd[r] + rcv[r]] = _inp(r * size + me, c(r, me), dtype, 3)
        out = arr(np.full(aref.size, SENTINEL, dtype))
        if blocking:
            comm.Alltoallv(arr(sfull[me]), sc, sd, out, rcv, rdd)
        else:
            comm.Ialltoallv(arr(sfull[me]), sc, sd, out, rcv, rdd).Wait()
        check(f"{form}Alltoallv", out, aref)
        # Reduce_scatter (counts, counts omitted, IN_PLACE), Scan, Exscan
        ops = ["SUM", "PROD", "MIN", "MAX"] + (["AVG"] if dtype[0] == "f" else [])
        tot = sum(rc)
        vecs = [_inp(r, tot, dtype, 4) for r in range(size)]
        off = sum(rc[:me])
        for op in ops:
            o = getattr(shmproxy, op)
            rsref = _fold([v[off:off + rc[me]] for v in vecs], op)
            out = arr(np.full(rc[me] + 1, SENTINEL, dtype))
            call(blocking, "Reduce_scatter", arr(vecs[me]), out[:rc[me]], rc, o)
            check(f"{form}Reduce_scatter {op}", out, np.concatenate([rsref, np.full(1, SENTINEL, dtype)]))
            inplace = arr(vecs[me])
            call(blocking, "Reduce_scatter", shmproxy.IN_PLACE, inplace, rc, o)
            check(f"{form}Reduce_scatter in place {op}", inplace[:rc[me]], rsref)
            if pattern == "even":   # recvcounts omitted: every rank's recvbuf's size
                out = arr(np.zeros(n, dtype))
                call(blocking, "Reduce_scatter", arr(vecs[me]), out, None, o)
                check(f"{form}Reduce_scatter no counts {op}", out, rsref)
            if op == "AVG":
                continue
            k = rc[0] if pattern != "zero" else 0
            sx = [_inp(r, k, dtype, 5) for r in range(size)]
            sref = _fold(sx[:me + 1], op)
            out = arr(np.zeros(k, dtype))
            call(blocking, "Scan", arr(sx[me]), out, o)
            check(f"{form}Scan {op}", out, sref)
            inplace = arr(sx[me])
            call(blocking, "Scan", shmproxy.IN_PLACE, inplace, o)
            check(f"{form}Scan in place {op}", inplace, sref)
            eref = _fold(sx[:me], op) if me else np.full(k, SENTINEL, dtype)
            out = arr(np.full(k, SENTINEL, dtype))
            call(blocking, "Exscan", arr(sx[me]), out, o)
            check(f"{form}Exscan {op}", out, eref)
            inplace = arr(sx[me])   # rank 0's too: its input, left as it is
            call(blocking, "Exscan", shmproxy.IN_PLACE, inplace, o)
            check(f"{form}Exscan in place {op}", inplace, eref if me else sx[0])
    return cases


def _run(xps: list[Any]) -> dict:
    bad: list = []
    cases = 0
    with shmproxy.init() as comm:
        for dtype in DTYPES:
            for n in SIZES:
                for pattern in ("even", "uneven") + (("zero",) if n == 1 else ()):
                    for xp in xps:
                        label = "host" if xp is np else "device"
                        cases += _cases(comm, xp, dtype, n, pattern, bad, label)
    return {"cases": cases, "bad": bad}


def vector_cases_host() -> dict:
    return _run([np])


def vector_collectives() -> dict:
    from tests.bodies_gpu import _cp
    return _run([np, _cp()])


def vector_mixed_is_refused() -> dict:
    """A host/device mix in one call: InvalidArgument before anything is posted. A host buffer on one
    rank where the others pass device memory: InvalidArgument on every rank. An argument the rank does
    not use (a non-root's Gatherv recvbuf) may be host memory. The communicator goes on."""
    from tests.bodies_gpu import _cp
    cp = _cp()
    refused, cross = 0, []
    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        d, h = cp.ones(4 * size, cp.float32), np.ones(4 * size, np.float32)
        c4 = [4] * size
        for call in (lambda: comm.Allgatherv(d[:4], h, c4), lambda: comm.Alltoallv(h, c4, None, d, c4, None),
                     lambda: comm.Reduce_scatter(d, h[:4], c4), lambda: comm.Scan(h[:4], d[:4]),
                     lambda: comm.Exscan(d[:4], h[:4]), lambda: comm.Iscan(d[:4], h[:4])):
            try:
                call()
            except shmproxy.InvalidArgument as exc:
                assert "host and device buffers mixed" in str(exc), exc
                refused += 1
        # rank 0 host, the others device: refused on every rank by the progress process
        for name, run in (("Gatherv", lambda s, r: comm.Gatherv(s[:4], r if me == 0 else None, c4, None, 0)),
                          ("Iscan", lambda s, r: comm.Iscan(s[:4], r[:4]).Wait())):
            xp = np if me == 0 else cp
            try:
                run(xp.ones(4 * size, np.float32), xp.zeros(4 * size, np.float32))
                cross.append(f"{name}: accepted")
            except shmproxy.InvalidArgument:
                cross.append(f"{name}: InvalidArgument")
        # a non-root's unused recvbuf may be anything
        out = cp.zeros(4 * size, cp.float32) if me == 0 else np.zeros(1, np.float32)
        comm.Gatherv(cp.full(4, me + 1, cp.float32), out, c4, None, 0)
        ok = me != 0 or bool((out == cp.repeat(cp.arange(1, size + 1, dtype=cp.float32), 4)).all())
        g = cp.zeros(4 * size, cp.float32)
        comm.Allgatherv(cp.full(4, me, cp.float32), g, c4)
        ok = ok and bool((g == cp.repeat(cp.arange(size, dtype=cp.float32), 4)).all())
    return {"refused": refused, "cross": cross, "ok": ok}


def vector_bfloat16_torch() -> dict:
    """bfloat16 torch CUDA tensors through the nine, bit for bit against torch (moves) and torch's own
    bfloat16 arithmetic step by step in rank order (reductions)."""
    import torch

    from tests.bodies_gpu import _cp
    from tests.bodies_gpu_more import _torch_bf16_ref
    _cp()
    bf = torch.bfloat16
    bad, cases = [], 0

    def inp(r: int, n: int, salt: int = 0) -> Any:
        return (((torch.arange(n, device="cuda") * 7 + r * 3 + salt) % 1000) * 0.37 + 1).to(bf)

    def same(what: str, a: Any, b: Any) -> None:
        nonlocal cases
        cases += 1
        if a.shape != b.shape or not bool((a.view(torch.int16) == b.view(torch.int16)).all()):
            bad.append(what)

    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        for n in (0, 1, 1000):
            rc = _counts(size, n, "uneven")
            rd = _displs(rc)
            total = rd[-1] + rc[-1]
            xs = [inp(r, rc[r]) for r in range(size)]
            for blocking in (True, False):
                tag = f"{'' if blocking else 'I'} n={n}"

                def call(name: str, *args: Any) -> None:
                    if blocking:
                        getattr(comm, name)(*args)
                    else:
                        getattr(comm, "I" + name[0].lower() + name[1:])(*args).Wait()
                ref = torch.zeros(total, dtype=bf, device="cuda")
                for r in range(size):
                    ref[rd[r]:rd[r] + rc[r]] = xs[r]
                out = torch.zeros(total, dtype=bf, device="cuda")
                call("Allgatherv", xs[me], out, rc, rd)
                same(f"Allgatherv{tag}", out, ref)
                g = torch.zeros(total, dtype=bf, device="cuda") if me == 0 else None
                call("Gatherv", xs[me], g, rc, rd, 0)
                if me == 0:
                    same(f"Gatherv{tag}", g, ref)
                s = torch.zeros(rc[me], dtype=bf, device="cuda")
                call("Scatterv", ref if me == size - 1 else None, s, rc, rd, size - 1)
                same(f"Scatterv{tag}", s, xs[me])
                sc = [rc[q] for q in range(size)]   # rank r sends rc[q] elements of its salt-r input to q
                a = torch.zeros(rc[me] * size, dtype=bf, device="cuda")
                call("Alltoallv", inp(me, sum(sc), 1), sc, None, a, [rc[me]] * size, None)
                off = sum(rc[:me])
                aref = torch.cat([inp(r, sum(sc), 1)[off:off + rc[me]] for r in range(size)])
                same(f"Alltoallv{tag}", a, aref)
                vecs = [inp(r, sum(rc), 2) for r in range(size)]
                for op in ("SUM", "PROD", "MIN", "MAX", "AVG"):
                    o = getattr(shmproxy, op)
                    rsref = _torch_bf16_ref(torch, [v[off:off + rc[me]] for v in vecs], op)
                    rs = torch.zeros(rc[me], dtype=bf, device="cuda")
                    call("Reduce_scatter", vecs[me], rs, rc, o)
                    same(f"Reduce_scatter {op}{tag}", rs, rsref)
                    rsi = vecs[me].clone()
                    call("Reduce_scatter", shmproxy.IN_PLACE, rsi, rc, o)
                    same(f"Reduce_scatter in place {op}{tag}", rsi[:rc[me]], rsref)
                    if op == "AVG":
                        continue
                    sx = [inp(r, n, 3) for r in range(size)]
                    sc_out = torch.zeros(n, dtype=bf, device="cuda")
                    call("Scan", sx[me], sc_out, o)
                    same(f"Scan {op}{tag}", sc_out, _torch_bf16_ref(torch, sx[:me + 1], op))
                    ex = sx[me].clone()
                    call("Exscan", shmproxy.IN_PLACE, ex, o)
                    exref = _torch_bf16_ref(torch, sx[:me], op) if me else sx[0]
                    same(f"Exscan in place {op}{tag}", ex, exref)
    return {"cases": cases, "bad": bad}
