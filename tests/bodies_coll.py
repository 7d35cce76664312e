"""Rank bodies for tests/test_coll.py: buffer collectives end to end.

Each function runs in every rank (started by tests/rankmain.py), calls shmproxy.init() itself and
returns JSON-able results. Inputs are deterministic functions of (case seed, rank, salt), so every
rank can compute every other rank's contribution and check its own output against a numpy reference
computed locally; references use the buffer's own dtype arithmetic, so integer overflow wraps the
same way it does in numpy (SUM and PROD are exact modulo 2**bits in any order). Floating inputs are
small integers, so SUM, PROD, MIN and MAX are exact in any order and only AVG needs a tolerance.

Data mismatches are collected and returned (every rank finishes its sequence, the test reports all
of them with the case that produced them); an exception from the library ends the rank at once with
the case in the message.

This module holds the shared inputs and helpers, the property cases and the data-checking bodies;
tests/bodies_coll_nonblocking.py and tests/bodies_coll_faults.py hold the rest.
"""
from __future__ import annotations

import functools
import operator
import time
from typing import Any

import numpy as np

import shmproxy


DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]


OPS = ["SUM", "PROD", "MIN", "MAX", "AVG"]


REDUCING = ("Allreduce", "Reduce", "Reduce_scatter_block")


COLLS = ("Allreduce", "Reduce", "Bcast", "Allgather", "Reduce_scatter_block", "Alltoall", "Barrier")


_UFUNC = {"SUM": np.add, "AVG": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum}


def valid_ops(dtype: str) -> list[str]:
    """The ops the spec defines for ``dtype`` (complex MIN/MAX left out: the spec does not say)."""
    kind = np.dtype(dtype).kind
    if kind == "b":
        return ["MIN", "MAX"]
    if kind in "iu":
        return ["SUM", "PROD", "MIN", "MAX"]
    if kind == "f":
        return list(OPS)
    return ["SUM", "PROD", "AVG"]


def invalid_ops(dtype: str) -> list[str]:
    """Ops the spec says raise InvalidArgument for ``dtype``."""
    kind = np.dtype(dtype).kind
    if kind == "b":
        return ["SUM", "PROD", "AVG"]
    if kind in "iu":
        return ["AVG"]
    return []


def op_obj(name: str, via: str = "const") -> Any:
    return getattr(shmproxy.ReduceOp, name) if via == "enum" else getattr(shmproxy, name)


# ------------------------------------------------------------------------------- inputs, references
def make_input(seed: int, rank: int, count: int, dtype: str, op: str | None, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s deterministic input of ``count`` elements (flat)."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, rank, salt])
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, count).astype(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, count, dtype=dt, endpoint=True)
    if op is None:          # data movement only: any bits that compare equal to themselves
        lo, hi = -30000, 30000
    elif op == "PROD":      # |product| <= 2**size: exact in float16 for size <= 10
        lo, hi = -2, 2
    elif op in ("MIN", "MAX"):
        lo, hi = -1000, 1000
    else:                   # SUM, AVG: |sum| <= 3 * size
        lo, hi = -3, 3
    if dt.kind == "f":
        v = rng.integers(lo, hi, count, endpoint=True).astype(np.float64)
        if op is None:
            v = v / 8.0     # fractional values too
        return v.astype(dt)
    re = rng.integers(lo, hi, count, endpoint=True)
    im = rng.integers(lo, hi, count, endpoint=True)
    return (re + 1j * im).astype(dt)


def sentinel(count: int, dtype: str, salt: int) -> np.ndarray:
    """What receive buffers hold before the call: values unlikely to be the answer."""
    return make_input(0xDEAD, 977, count, dtype, None, salt)


def reference(xs: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    """op over the ranks' inputs in rank order, in the dtype's own arithmetic."""
    dt = np.dtype(dtype)
    if op == "AVG":
        wide = np.complex128 if dt.kind == "c" else np.float64
        acc = functools.reduce(operator.add, [x.astype(wide) for x in xs])
        return acc / len(xs)
    acc = xs[0].copy()
    for x in xs[1:]:
        _UFUNC[op](acc, x, out=acc)
    return acc


def compare(got: np.ndarray, want: np.ndarray, op: str | None, dtype: str) -> str | None:
    """None if equal (exact, or close for AVG), else a short description of the first differences."""
    got = np.asarray(got).reshape(-1)
    want = np.asarray(want).reshape(-1)
    if got.shape != want.shape:
        return f"shape {got.shape} != expected {want.shape}"
    dt = np.dtype(dtype)
    if op == "AVG":
        tol = {"float16": 1e-2, "complex64": 1e-5, "float32": 1e-5}.get(dt.name, 1e-12)
        ok = np.isclose(got.astype(want.dtype), want, rtol=tol, atol=tol)
    else:
        ok = got == want
    if np.all(ok):
        return None
    bad = np.flatnonzero(~ok)
    i = bad[:5]
    return (f"{bad.size} of {got.size} elements differ; first at {i.tolist()}: got {got[i].tolist()} "
            f"expected {want[i].tolist()}")


def _nelem(shape: list[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def _buf(comm, shape: tuple, dtype: str, alloc: bool, values: np.ndarray | None) -> np.ndarray:
    b = comm.alloc(shape, dtype) if alloc else np.empty(shape, dtype)
    if values is not None:
        b.reshape(-1)[...] = values.reshape(-1)
    return b


def _pad_pattern(count: int, dtype: str) -> np.ndarray:
    return make_input(0xBEEF, 0, count, dtype, None)


# ------------------------------------------------------------------------------- property cases
class _Case:
    """One collective of a property case list: set up buffers, call, check."""

    def __init__(self, comm, c: dict):
        self.comm, self.c = comm, c
        self.r, self.n = comm.rank, comm.size
        self.root = c["root"] % self.n
        self.coll, self.dtype = c["coll"], c["dtype"]
        self.op = c["op"] if self.coll in REDUCING else None
        self.alloc = c["alloc"]
        self.pad = c.get("pad", 0)
        self.shape = tuple(c["shape"])
        self.cnt = _nelem(c["shape"])
        self.checks: list = []      # (label, got array, expected) checked after completion
        self.send_copy = None       # (send buffer, its input): the send buffer must stay unchanged
        self.guards: list = []      # padded buffers: the padding around them must stay unchanged

    def describe(self) -> str:
        return f"case {self.c['i']} {self.c}"

    def buf(self, shape: tuple, dtype: str, alloc: bool, values: np.ndarray | None) -> np.ndarray:
        """With pad: a view at element offset ``pad`` of a larger array (a registered buffer used at
        an offset, or a plain array not at the start of its block); the padding is checked later."""
        if not self.pad:
            return _buf(self.comm, shape, dtype, alloc, values)
        count, pad = _nelem(list(shape)), self.pad
        whole = _buf(self.comm, (count + 2 * pad,), dtype, alloc, _pad_pattern(count + 2 * pad, dtype))
        b = whole[pad:pad + count].reshape(shape)
        if values is not None:
            b.reshape(-1)[...] = values.reshape(-1)
        self.guards.append((whole, count))
        return b

    def inp(self, rank: int, count: int) -> np.ndarray:
        return make_input(self.c["seed"], rank, count, self.dtype, self.op)

    def args(self) -> tuple[str, tuple, dict]:
        """(method name, positional args, keyword args) for this rank."""
        c, r, n = self.c, self.r, self.n
        dt, shape, cnt, alloc = self.dtype, self.shape, self.cnt, self.alloc
        kw: dict = {}
        if self.op is not None:
            kw["op"] = op_obj(self.op, c["opvia"])
        if self.coll == "Barrier":
            return "Barrier", (), {}
        if self.coll == "Allreduce":
            x = self.inp(r, cnt)
            if c["inplace"]:
                recv = self.buf(shape, dt, alloc, x)
                send = shmproxy.IN_PLACE
            else:
                send = self.buf(shape, dt, alloc, x)
                recv = self.buf(shape, dt, alloc, sentinel(cnt, dt, 1))
                self.send_copy = (send, x)
            if not c["invalid"]:
                want = reference([self.inp(q, cnt) for q in range(n)], self.op, dt)
                self.checks.append(("recvbuf", recv, want))
            return "Allreduce", (send, recv), kw
        if self.coll == "Reduce":
            kw["root"] = self.root
            x = self.inp(r, cnt)
            if r == self.root:
                if c["inplace"]:
                    recv = self.buf(shape, dt, alloc, x)
                    send = shmproxy.IN_PLACE
                else:
                    send = self.buf(shape, dt, alloc, x)
                    recv = self.buf(shape, dt, alloc, sentinel(cnt, dt, 2))
                    self.send_copy = (send, x)
                if not c["invalid"]:
                    want = reference([self.inp(q, cnt) for q in range(n)], self.op, dt)
                    self.checks.append(("root recvbuf", recv, want))
            else:
                send = self.buf(shape, dt, alloc, x)
                self.send_copy = (send, x)
                recv = None if c["none_recv"] else self.buf(shape, dt, alloc, sentinel(cnt, dt, 3))
            return "Reduce", (send, recv), kw
        if self.coll == "Bcast":
            want = self.inp(self.root, cnt)
            buf = self.buf(shape, dt, alloc, want if r == self.root else sentinel(cnt, dt, 4))
            self.checks.append(("buf", buf, want))
            return "Bcast", (buf,), {"root": self.root}
        if self.coll == "Allgather":
            x = self.inp(r, cnt)
            rshape = (n,) + shape if c["alt"] else (n * cnt,)
            recv = self.buf(rshape, dt, alloc, sentinel(n * cnt, dt, 5))
            if c["inplace"]:
                recv.reshape(n, cnt)[r] = x
                send = shmproxy.IN_PLACE
            else:
                send = self.buf(shape, dt, alloc, x)
                self.send_copy = (send, x)
            want = np.concatenate([self.inp(q, cnt) for q in range(n)])
            self.checks.append(("recvbuf", recv, want))
            return "Allgather", (send, recv), {}
        if self.coll == "Reduce_scatter_block":
            x = self.inp(r, n * cnt)
            sshape = (n,) + shape if c["alt"] else (n * cnt,)
            send = self.buf(sshape, dt, alloc, x)
            self.send_copy = (send, x)
            recv = self.buf(shape, dt, alloc, sentinel(cnt, dt, 6))
            if not c["invalid"]:
                blocks = [self.inp(q, n * cnt)[r * cnt:(r + 1) * cnt] for q in range(n)]
                self.checks.append(("recvbuf", recv, reference(blocks, self.op, dt)))
            return "Reduce_scatter_block", (send, recv), kw
        if self.coll == "Alltoall":
            x = self.inp(r, n * cnt)
            sshape = (n,) + shape if c["alt"] else (n * cnt,)
            rshape = (n,) + shape if c["alt2"] else (n * cnt,)
            send = self.buf(sshape, dt, alloc, x)
            self.send_copy = (send, x)
            recv = self.buf(rshape, dt, alloc, sentinel(n * cnt, dt, 7))
            want = np.concatenate([self.inp(q, n * cnt)[r * cnt:(r + 1) * cnt] for q in range(n)])
            self.checks.append(("recvbuf", recv, want))
            return "Alltoall", (send, recv), {}
        raise AssertionError(f"unknown collective {self.coll}")

    def verify(self) -> list[str]:
        out = []
        for label, got, want in self.checks:
            why = compare(got, want, self.op, self.dtype)
            if why:
                out.append(f"rank {self.r}: {self.describe()}: {label}: {why}")
        for whole, count in self.guards:
            want = _pad_pattern(count + 2 * self.pad, self.dtype)
            edges = np.r_[0:self.pad, self.pad + count:count + 2 * self.pad]
            if not np.array_equal(whole[edges], want[edges]):
                out.append(f"rank {self.r}: {self.describe()}: written outside the buffer (padding changed)")
        if self.send_copy is not None:
            send, x = self.send_copy
            if not np.array_equal(send.reshape(-1), x.reshape(-1)):
                out.append(f"rank {self.r}: {self.describe()}: the send buffer was modified")
        return out


def run_cases(cases: list[dict], max_outstanding: int = 4) -> dict:
    """Run every case in order on one communicator; return the data mismatches found.

    Nonblocking cases with wait == "later" stay outstanding (up to ``max_outstanding``) and are
    completed together with Request.Waitall before the next blocking case.
    """
    with shmproxy.init() as comm:
        failures: list[str] = []
        outstanding: list[tuple[_Case, Any]] = []
        counts = {"blocking": 0, "nonblocking": 0, "invalid": 0}

        def flush():
            if not outstanding:
                return
            try:
                shmproxy.Request.Waitall([req for _, req in outstanding])
            except Exception as exc:
                raise AssertionError(f"rank {comm.rank}: Waitall of cases "
                                     f"{[k.c['i'] for k, _ in outstanding]} raised "
                                     f"{type(exc).__name__}: {exc}") from exc
            for k, _ in outstanding:
                failures.extend(k.verify())
            outstanding.clear()

        for c in cases:
            case = _Case(comm, c)
            name, args, kw = case.args()
            if c["invalid"]:
                counts["invalid"] += 1
                fn = getattr(comm, ("I" + name[0].lower() + name[1:]) if c["nb"] else name)
                try:
                    fn(*args, **kw)
                except shmproxy.InvalidArgument as exc:
                    if not isinstance(exc, ValueError):
                        failures.append(f"rank {comm.rank}: {case.describe()}: "
                                        "InvalidArgument is no ValueError")
                    continue
                except Exception as exc:
                    raise AssertionError(f"rank {comm.rank}: {case.describe()}: expected InvalidArgument, "
                                         f"got {type(exc).__name__}: {exc}") from exc
                raise AssertionError(f"rank {comm.rank}: {case.describe()}: no InvalidArgument for op "
                                     f"{c['op']} on {c['dtype']}")
            try:
                if c["nb"]:
                    counts["nonblocking"] += 1
                    req = getattr(comm, "I" + name[0].lower() + name[1:])(*args, **kw)
                    if not isinstance(req, shmproxy.Request):
                        raise AssertionError(f"I{name} returned {type(req).__name__}, not a shmproxy.Request")
                    if c["wait"] == "later":
                        outstanding.append((case, req))
                        if len(outstanding) >= max_outstanding:
                            flush()
                        continue
                    if c["wait"] == "test":
                        deadline = time.monotonic() + 60
                        while not req.Test():
                            if time.monotonic() > deadline:
                                raise AssertionError("Test() did not turn True within 60 s")
                            time.sleep(0)
                        assert req.Test() is True  # stays True
                    else:
                        req.Wait()
                else:
                    flush()
                    counts["blocking"] += 1
                    getattr(comm, name)(*args, **kw)
            except AssertionError:
                raise
            except Exception as exc:
                raise AssertionError(f"rank {comm.rank}: {case.describe()}: "
                                     f"{type(exc).__name__}: {exc}") from exc
            failures.extend(case.verify())
        flush()
        comm.Barrier()
        pool = _pool_clean(comm)   # nothing posted, no active sub, every record back
        comm.Barrier()             # nobody closes while a peer still reads its pool
        if not pool["clean"]:
            failures.append(f"rank {comm.rank}: pool not clean after the cases: {pool}")
        return {"failures": failures, "counts": counts, "ncases": len(cases)}


# ------------------------------------------------------------------------------- deterministic
def _fill(comm, count: int, dtype, alloc: bool, values: np.ndarray) -> np.ndarray:
    b = comm.alloc(count, dtype) if alloc else np.empty(count, dtype)
    b[...] = values
    return b


def _pat(count: int, rank: int, salt: int = 0) -> np.ndarray:
    """Small-integer float32 pattern of rank ``rank`` (sums of a few ranks are exact)."""
    return ((np.arange(count, dtype=np.int64) * 7 + rank * 13 + salt) % 17 - 8).astype(np.float32)


def sizes_every_root(counts: list[int]) -> dict:
    """Every collective at each count (float32, SUM), every root, in place and not, alloc and plain.
    Counts are per block (Allgather's send, Reduce_scatter_block's recv, Alltoall's block)."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        done = []

        def check(what: str, got: np.ndarray, want: np.ndarray) -> None:
            if not np.array_equal(got.reshape(-1), want.reshape(-1)):
                bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
                raise AssertionError(f"rank {r}: {what}: {bad.size} of {want.size} elements wrong, first at "
                                     f"{bad[:5].tolist()}: got {got.reshape(-1)[bad[:5]].tolist()} expected "
                                     f"{want.reshape(-1)[bad[:5]].tolist()}")
            done.append(what)

        for count in counts:
            for alloc in (True, False):
                tag = f"count {count} alloc {alloc}"
                total = sum(_pat(count, q) for q in range(n)) if n > 1 else _pat(count, 0)
                # Allreduce, in place and not
                send = _fill(comm, count, np.float32, alloc, _pat(count, r))
                recv = _fill(comm, count, np.float32, alloc, np.full(count, 99, np.float32))
                comm.Allreduce(send, recv)
                check(f"Allreduce {tag}", recv, total)
                check(f"Allreduce {tag} send unchanged", send, _pat(count, r))
                buf = _fill(comm, count, np.float32, alloc, _pat(count, r))
                comm.Allreduce(shmproxy.IN_PLACE, buf, op=shmproxy.SUM)
                check(f"Allreduce IN_PLACE {tag}", buf, total)
                for root in range(n):
                    # Reduce, in place on the root and not; recvbuf None on the others
                    send = _fill(comm, count, np.float32, alloc, _pat(count, r, root))
                    recv = _fill(comm, count, np.float32, alloc, np.full(count, 99, np.float32)) \
                        if r == root else None
                    comm.Reduce(send, recv, op=shmproxy.SUM, root=root)
                    want = sum(_pat(count, q, root) for q in range(n)) if n > 1 else _pat(count, 0, root)
                    if r == root:
                        check(f"Reduce root {root} {tag}", recv, want)
                    if r == root:
                        buf = _fill(comm, count, np.float32, alloc, _pat(count, r, root))
                        comm.Reduce(shmproxy.IN_PLACE, buf, root=root)
                        check(f"Reduce IN_PLACE root {root} {tag}", buf, want)
                    else:
                        mine = _fill(comm, count, np.float32, alloc, _pat(count, r, root))
                        comm.Reduce(mine, None, root=root)
                    # Bcast
                    buf = _fill(comm, count, np.float32, alloc,
                                _pat(count, root, 5) if r == root else np.full(count, 99, np.float32))
                    comm.Bcast(buf, root=root)
                    check(f"Bcast root {root} {tag}", buf, _pat(count, root, 5))
                # Allgather, in place and not
                want = np.concatenate([_pat(count, q, 1) for q in range(n)])
                recv = _fill(comm, n * count, np.float32, alloc, np.full(n * count, 99, np.float32))
                comm.Allgather(_fill(comm, count, np.float32, alloc, _pat(count, r, 1)), recv)
                check(f"Allgather {tag}", recv, want)
                recv = _fill(comm, n * count, np.float32, alloc, np.full(n * count, 99, np.float32))
                recv[r * count:(r + 1) * count] = _pat(count, r, 1)
                comm.Allgather(shmproxy.IN_PLACE, recv)
                check(f"Allgather IN_PLACE {tag}", recv, want)
                # Reduce_scatter_block
                recv = _fill(comm, count, np.float32, alloc, np.full(count, 99, np.float32))
                send = _fill(comm, n * count, np.float32, alloc, _pat(n * count, r, 2))
                comm.Reduce_scatter_block(send, recv)
                want = sum(_pat(n * count, q, 2)[r * count:(r + 1) * count] for q in range(n))
                check(f"Reduce_scatter_block {tag}", recv, np.asarray(want, np.float32))
                # Alltoall
                recv = _fill(comm, n * count, np.float32, alloc, np.full(n * count, 99, np.float32))
                comm.Alltoall(_fill(comm, n * count, np.float32, alloc, _pat(n * count, r, 3)), recv)
                want = np.concatenate([_pat(n * count, q, 3)[r * count:(r + 1) * count] for q in range(n)])
                check(f"Alltoall {tag}", recv, want)
                comm.Barrier()
        return {"checked": len(done)}


def big_allreduce(nbytes: int, in_place: bool) -> dict:
    """One Allreduce of ``nbytes`` float32 between registered buffers; returns the time it took."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        count = nbytes // 4
        base = (np.arange(count, dtype=np.int64) % 251).astype(np.float32)
        send = comm.alloc(count, np.float32)
        np.add(base, np.float32(r), out=send)
        recv = send if in_place else comm.alloc(count, np.float32)
        comm.Barrier()
        t0 = time.perf_counter()
        if in_place:
            comm.Allreduce(shmproxy.IN_PLACE, recv)
        else:
            comm.Allreduce(send, recv)
        dt = time.perf_counter() - t0
        want = base * np.float32(n) + np.float32(n * (n - 1) // 2)
        if not np.array_equal(recv, want):
            bad = np.flatnonzero(recv != want)
            raise AssertionError(f"rank {r}: {bad.size} of {count} wrong, first at {bad[:5].tolist()}: "
                                 f"got {recv[bad[:5]].tolist()} expected {want[bad[:5]].tolist()}")
        return {"seconds": dt}


def _pool_clean(comm) -> dict:
    """What the pool says about leftovers; polled until clean (bounded) because the progress process
    frees subs and returns records a moment after the ranks see their completions."""
    from shmproxy.tools import dump
    deadline = time.monotonic() + 15
    while True:
        st = dump.read_pool(comm._view)
        ranks = st["ranks"]
        lr = comm.local_rank
        max_ops = st["layout"]["max_ops"]
        mine = ranks[lr]
        private = len(comm._waiter.free_records)
        summary = {
            "in_posted_chain": [x["in_posted_chain"] for x in ranks],
            "subs_active": st["subs"]["count"],
            "subs_listed": st["subs"]["active"][:4],
            "my_shared_free": mine["in_shared_free_lists"],
            "my_private_free": private,
            "my_unlisted": mine["not_in_shared_list"]["count"],
            "max_ops": max_ops,
            "pending_requests": len(comm._waiter.pending),
            "problems": st["problems"],
            "posted": [x["posted"] for x in ranks],
        }
        clean = (all(v == 0 for v in summary["in_posted_chain"]) and summary["subs_active"] == 0
                 and summary["my_shared_free"] + private == max_ops and summary["pending_requests"] == 0)
        if clean or time.monotonic() > deadline:
            summary["clean"] = clean
            return summary
        time.sleep(0.01)


def many_small_allreduces(k: int, window: int) -> dict:
    """k blocking Allreduces, then k Iallreduces in windows of ``window`` (Waitall), then the pool
    must hold no posted record, no active sub, and every record of ours must be back."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        send = np.zeros(8, np.int64)
        recv = np.zeros(8, np.int64)
        tri = n * (n - 1) // 2
        t0 = time.perf_counter()
        for i in range(k):
            send[:] = r + i
            send[0] = i
            comm.Allreduce(send, recv)
            if recv[0] != n * i or recv[1] != tri + n * i:
                raise AssertionError(f"rank {r}: Allreduce {i}: got {recv.tolist()}")
        t_block = time.perf_counter() - t0
        t0 = time.perf_counter()
        sends = [comm.alloc(4, np.int64) for _ in range(window)]
        recvs = [comm.alloc(4, np.int64) for _ in range(window)]
        for start in range(0, k, window):
            reqs = []
            for j in range(min(window, k - start)):
                sends[j][:] = start + j + r
                reqs.append(comm.Iallreduce(sends[j], recvs[j], op=shmproxy.MAX))
            shmproxy.Request.Waitall(reqs)
            for j in range(len(reqs)):
                if not np.all(recvs[j] == start + j + n - 1):
                    raise AssertionError(f"rank {r}: Iallreduce {start + j}: got {recvs[j].tolist()}")
        t_nb = time.perf_counter() - t0
        comm.Barrier()
        summary = _pool_clean(comm)
        summary.update({"blocking_us": t_block / k * 1e6, "nonblocking_us": t_nb / k * 1e6})
        comm.Barrier()  # nobody closes while a peer still reads its pool
        return summary


def alloc_free_churn(count: int, iters: int) -> dict:
    """Registered buffers allocated for one collective and dropped right after it (so they are
    deregistered while the progress process is idle between collectives): every collective, above
    the eager size, with pauses long enough for the progress process's housekeeping to run."""
    import gc
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        for i in range(iters):
            a = comm.alloc(count, np.float32)
            a[:] = r + i
            b = comm.alloc(count * n, np.float32)
            which = i % 5
            if which == 0:
                comm.Allreduce(a, b[:count])
                ok = np.all(b[:count] == n * (n - 1) / 2 + n * i)
            elif which == 1:
                comm.Reduce(a, b[:count] if r == 0 else None, root=0)
                ok = r != 0 or np.all(b[:count] == n * (n - 1) / 2 + n * i)
            elif which == 2:
                comm.Allgather(a, b)
                ok = all(np.all(b[q * count:(q + 1) * count] == q + i) for q in range(n))
            elif which == 3:
                comm.Reduce_scatter_block(b, a)
                ok = True
            else:
                comm.Bcast(a, root=n - 1)
                ok = np.all(a == n - 1 + i)
            if not ok:
                raise AssertionError(f"rank {r}: iteration {i} (kind {which}): wrong result")
            del a, b
            gc.collect()
            if i % 4 == 3:
                time.sleep(0.25)   # > HEARTBEAT_MS: the idle progress process closes retired buffers
        return {"iters": iters}


def huge_count(count: int) -> dict:
    """64-bit element counts: a Bcast of ``count`` int8 and an in-place MAX Allreduce of ``count``
    uint8 (count > 2**31), registered buffers."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        buf = comm.alloc(count, np.uint8)
        stride = 1 << 20
        marks = np.arange(0, count, stride)
        if r == 0:
            buf[marks] = (marks // stride) % 251
            buf[-1] = 77
        comm.Bcast(buf, root=0)
        assert np.array_equal(buf[marks], (marks // stride) % 251) and buf[-1] == 77, "Bcast"
        buf[marks] = (marks // stride + r) % 251
        buf[-1] = r
        t0 = time.perf_counter()
        comm.Allreduce(shmproxy.IN_PLACE, buf, op=shmproxy.MAX)
        dt = time.perf_counter() - t0
        want = np.max([(marks // stride + q) % 251 for q in range(n)], axis=0)
        assert np.array_equal(buf[marks], want) and buf[-1] == n - 1, "Allreduce"
        return {"allreduce_s": dt}
