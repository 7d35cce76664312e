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
"""
from __future__ import annotations

import functools
import operator
import os
import signal
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
        private = len(getattr(comm, "_free_records", []))
        summary = {
            "in_posted_chain": [x["in_posted_chain"] for x in ranks],
            "subs_active": st["subs"]["count"],
            "subs_listed": st["subs"]["active"][:4],
            "my_shared_free": mine["in_shared_free_lists"],
            "my_private_free": private,
            "my_unlisted": mine["not_in_shared_list"]["count"],
            "max_ops": max_ops,
            "pending_requests": len(getattr(comm, "_pending", {})),
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


def overlap_with_p2p(rounds: int) -> dict:
    """Iallreduce (large) and Ibcast in flight while ring exchanges with tags that a collective might
    use internally (0, -1, the 64-bit extremes) run; everything completes in one Waitall."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        right, left = (r + 1) % n, (r - 1) % n
        count = 1 << 20
        big = comm.alloc(count, np.float32)
        big[:] = _pat(count, r)
        big_out = np.zeros(count, np.float32)
        small = np.zeros(1000, np.int32)
        if r == n - 1:
            small[:] = np.arange(1000)
        tags = [0, 1, -1, 2**63 - 1, -(2**63) + 1, 12345]   # -(2**63) is ANY_TAG
        for rnd in range(rounds):
            coll = [comm.Iallreduce(big, big_out), comm.Ibcast(small, root=n - 1)]
            outs, p2p = [], []
            for t in tags:
                for nbytes in (8, 100_000, 1 << 20):
                    o = np.zeros(nbytes, np.uint8)
                    outs.append((o, t, nbytes))
                    p2p.append(comm.Irecv(o, left, tag=t))
                    payload = np.full(nbytes, (r * 31 + t + nbytes + rnd) % 251, np.uint8)
                    p2p.append(comm.Isend(payload, right, tag=t))
            # a second wave of collectives posted behind the point-to-point traffic
            out16 = np.zeros(16, np.int32)
            coll.append(comm.Iallreduce(np.full(16, r, np.int32), out16, op=shmproxy.MAX))
            shmproxy.Request.Waitall(p2p + coll)
            for o, t, nbytes in outs:
                if not np.all(o == (left * 31 + t + nbytes + rnd) % 251):
                    raise AssertionError(f"rank {r} round {rnd}: p2p tag {t} {nbytes} B from {left}: "
                                         "wrong data")
            want = sum(_pat(count, q) for q in range(n)) if n > 1 else _pat(count, 0)
            if not np.array_equal(big_out, want):
                raise AssertionError(f"rank {r} round {rnd}: Iallreduce overlapped with p2p: wrong result")
            if not np.array_equal(small, np.arange(1000)):
                raise AssertionError(f"rank {r} round {rnd}: Ibcast overlapped with p2p: wrong result")
            if not np.all(out16 == n - 1):
                raise AssertionError(f"rank {r} round {rnd}: Iallreduce after p2p: {out16.tolist()}")
            big_out[:] = 0
        return {"rounds": rounds}


def outstanding_then_blocking() -> dict:
    """Several nonblocking collectives outstanding, then blocking ones on the same communicator
    (MPI ordering: all complete in posting order), then Waitall in reverse order."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        outs = [np.zeros(1000, np.int64) for _ in range(5)]
        reqs = [comm.Iallreduce(np.full(1000, r + i, np.int64), outs[i]) for i in range(5)]
        b = np.full(10, r, np.int16)
        comm.Bcast(b, root=0)
        comm.Barrier()
        y = np.zeros(3, np.float64)
        comm.Allreduce(np.full(3, 1.0), y)
        for q in reversed(reqs):
            q.Wait()
        for i in range(5):
            assert np.all(outs[i] == n * (n - 1) // 2 + n * i), (i, outs[i][:3])
        assert np.all(b == 0) and np.all(y == n), (b, y)
        return {"ok": True}


def multi_comm() -> dict:
    """Dup and Split: collectives interleaved on two communicators (nonblocking, posted in opposite
    orders on even and odd ranks), sub-communicators of different colors at the same time, and one
    communicator progressing while another has an unmatched operation."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        out: dict[str, Any] = {}
        dup = comm.Dup()
        assert (dup.rank, dup.size) == (r, n), (dup.rank, dup.size)
        for it in range(20):
            a, b = np.zeros(5000, np.int32), np.zeros(5000, np.int32)
            sa, sb = np.full(5000, r + it, np.int32), np.full(5000, 100 * r, np.int32)
            if r % 2 == 0:
                ra = comm.Iallreduce(sa, a)
                rb = dup.Iallreduce(sb, b, op=shmproxy.MAX)
            else:
                rb = dup.Iallreduce(sb, b, op=shmproxy.MAX)
                ra = comm.Iallreduce(sa, a)
            if it % 2:
                rb.Wait()
                ra.Wait()
            else:
                ra.Wait()
                rb.Wait()
            assert np.all(a == n * (n - 1) // 2 + n * it), (it, a[:3])
            assert np.all(b == 100 * (n - 1)), (it, b[:3])
            # blocking, interleaved in the same order everywhere
            x = np.full(7, r, np.float64) if r == 0 else np.zeros(7)
            comm.Bcast(x, root=0)
            y = np.full(7, r, np.float64) if r == n - 1 else np.zeros(7)
            dup.Bcast(y, root=n - 1)
            assert np.all(x == 0) and np.all(y == n - 1), (x, y)
        out["dup_iterations"] = 20

        # Split by parity, key reversing the order: both colors run at the same time
        color = r % 2
        sub = comm.Split(color, key=-r)
        members = [q for q in range(n) if q % 2 == color]
        want_rank = sorted(members, key=lambda q: -q).index(r)
        assert (sub.rank, sub.size) == (want_rank, len(members)), (sub.rank, sub.size, want_rank, members)
        g = np.zeros(sub.size, np.int64)
        sub.Allgather(np.array([r], np.int64), g)
        assert g.tolist() == sorted(members, key=lambda q: -q), g
        for it in range(10):
            s = np.zeros(100_000, np.float64)
            rs = sub.Iallreduce(np.full(100_000, r + it, np.float64), s)
            t = np.zeros(100_000, np.float64)
            comm.Allreduce(np.full(100_000, 1.0), t)   # the parent, while the sub's op is in flight
            rs.Wait()
            assert np.all(s == sum(members) + it * len(members)), (it, s[:3])
            assert np.all(t == n), t[:3]
        out["split"] = {"color": color, "rank": sub.rank, "size": sub.size}

        # UNDEFINED: rank 0 gets no communicator; the others get one of n-1 ranks
        sub2 = comm.Split(shmproxy.UNDEFINED if r == 0 else 7, key=0)
        if r == 0:
            assert sub2 is None, sub2
        else:
            assert (sub2.rank, sub2.size) == (r - 1, n - 1), (sub2.rank, sub2.size)
            z = np.zeros(1, np.int64)
            sub2.Allreduce(np.array([r], np.int64), z)
            assert z[0] == n * (n - 1) // 2, z

        # Independent progress: comm has an op that cannot complete until dup's collective did.
        if n >= 2:
            if r == 0:
                got, pa = np.zeros(4, np.int64), np.zeros(3)
                rq = comm.Irecv(got, 1, tag=5)
                ia = comm.Iallreduce(np.ones(3), pa)    # posted by rank 0 only so far
                w = np.zeros(1 << 18, np.float32)
                dup.Allreduce(np.ones(1 << 18, np.float32), w)
                rq.Wait()
                ia.Wait()
                assert np.all(got == 42) and np.all(w == n) and np.all(pa == n), (got, w[:3], pa)
            else:
                w = np.zeros(1 << 18, np.float32)
                dup.Allreduce(np.ones(1 << 18, np.float32), w)
                if r == 1:
                    comm.Send(np.full(4, 42, np.int64), 0, tag=5)
                pa = np.zeros(3)
                comm.Allreduce(np.ones(3), pa)
                assert np.all(w == n) and np.all(pa == n), (w[:3], pa)
        # Dup of a sub-communicator, then close everything (children first)
        sd = sub.Dup()
        q = np.zeros(2, np.int32)
        sd.Allreduce(np.full(2, 1, np.int32), q)
        assert np.all(q == sub.size), q
        for c in (sd, sub, sub2, dup):
            if c is not None:
                c.close()
        comm.Barrier()
        return out


MISMATCH_KINDS = ("coll", "count", "dtype", "root", "op", "nonblocking", "dtype_bcast", "count_alltoall",
                  "last_rank")


def mismatch(kind: str) -> dict:
    """Rank 0 calls one collective, the others another at the same position of the sequence.
    Every rank must raise InvalidUsage naming both fingerprints; later calls must raise too."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        comm.Barrier()  # everybody is in, and the sequences are aligned
        odd = r == 0
        t0 = time.monotonic()
        err: BaseException | None = None
        try:
            if kind == "coll":
                if odd:
                    comm.Allreduce(np.ones(100, np.float32), np.zeros(100, np.float32))
                else:
                    comm.Bcast(np.zeros(100, np.float32), root=0)
            elif kind == "count":
                c = 1234 if odd else 4321
                comm.Allreduce(np.ones(c, np.float32), np.zeros(c, np.float32))
            elif kind == "dtype":
                dt = np.float32 if odd else np.int32   # same size: only the dtype differs
                comm.Allreduce(np.ones(100, dt), np.zeros(100, dt))
            elif kind == "root":
                comm.Bcast(np.zeros(100, np.float32), root=0 if odd else n - 1)
            elif kind == "op":
                comm.Allreduce(np.ones(100, np.float32), np.zeros(100, np.float32),
                               op=shmproxy.SUM if odd else shmproxy.MAX)
            elif kind == "dtype_bcast":   # data movement only, same bytes: the dtype still counts
                comm.Bcast(np.zeros(100, np.float32 if odd else np.int32), root=0)
            elif kind == "count_alltoall":
                c = 1234 if odd else 4321
                comm.Alltoall(np.zeros(c * n, np.int16), np.zeros(c * n, np.int16))
            elif kind == "last_rank":     # only the last rank disagrees (fingerprints 'Reduce' / 'Allreduce')
                if r == n - 1:
                    comm.Allreduce(np.ones(100, np.float64), np.zeros(100, np.float64))
                else:
                    comm.Reduce(np.ones(100, np.float64), np.zeros(100, np.float64), root=0)
            elif kind == "nonblocking":
                if odd:
                    req = comm.Iallreduce(np.ones(100, np.float32), np.zeros(100, np.float32))
                else:
                    req = comm.Ibcast(np.zeros(100, np.float32), root=0)
                req.Wait()
            else:
                raise ValueError(kind)
        except Exception as exc:
            err = exc
        elapsed = time.monotonic() - t0
        later = None
        try:
            comm.Allreduce(np.ones(4), np.zeros(4))
        except Exception as exc:
            later = type(exc).__name__
        return {"error": None if err is None else type(err).__name__,
                "is_invalid_usage": isinstance(err, shmproxy.InvalidUsage),
                "message": "" if err is None else str(err), "seconds": elapsed, "later": later}


def victim_dies_in_allreduce(victim: int, when: str, nbytes: int) -> dict:
    """The victim SIGKILLs itself right before posting an Iallreduce of ``nbytes``, right after, or
    a quarter of the time one such Allreduce takes after posting; the survivors are in the same Allreduce.
    The progress process moves every rank's bytes, so the collective may legitimately complete when
    the victim dies after posting: then the next collective (a Barrier) must raise. Either way every
    survivor gets PeerDiedError; the test checks which rank it names and how long it took."""
    with shmproxy.init() as comm:
        r = comm.rank
        count = nbytes // 4
        send = comm.alloc(count, np.float32)
        send[:] = 1.0
        recv = comm.alloc(count, np.float32)
        comm.Allreduce(np.ones(1), np.zeros(1))   # every rank is in before the kill
        t = time.perf_counter()
        comm.Allreduce(send, recv)                # warm, and how long one takes
        one = time.perf_counter() - t
        if r == victim:
            if when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            comm.Iallreduce(send, recv)
            if when == "during":
                time.sleep(one / 4)
            os.kill(os.getpid(), signal.SIGKILL)
        return _expect_peer_died(lambda: comm.Allreduce(send, recv), comm, one)


def _expect_peer_died(first, comm, one: float) -> dict:
    t0 = time.monotonic()
    phase = "Allreduce"
    try:
        first()
        phase = "Barrier after the Allreduce completed"
        comm.Barrier()
    except shmproxy.PeerDiedError as exc:
        return {"seconds": time.monotonic() - t0, "message": str(exc), "rank": exc.rank,
                "error": type(exc).__name__, "phase": phase, "one_allreduce_s": one}
    except Exception as exc:
        return {"seconds": time.monotonic() - t0, "message": str(exc), "rank": None,
                "error": type(exc).__name__, "phase": phase, "one_allreduce_s": one}
    return {"seconds": time.monotonic() - t0, "message": "", "rank": None, "error": None, "phase": phase,
            "one_allreduce_s": one}


def bad_arguments() -> dict:
    """Bad buffers and arguments raise InvalidArgument before anything is posted, on every rank alike;
    the communicator stays usable (a collective afterwards works)."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        f4 = np.zeros(10, np.float32)
        cases = {
            "Allreduce recv too small": lambda: comm.Allreduce(f4, np.zeros(9, np.float32)),
            "Allreduce dtypes differ": lambda: comm.Allreduce(f4, np.zeros(10, np.float64)),
            "Allreduce AVG on int": lambda: comm.Allreduce(np.ones(10, np.int32), np.zeros(10, np.int32),
                                                           op=shmproxy.AVG),
            "Allreduce SUM on bool": lambda: comm.Allreduce(np.ones(10, bool), np.zeros(10, bool)),
            "Iallreduce PROD on bool": lambda: comm.Iallreduce(np.ones(10, bool), np.zeros(10, bool),
                                                               op=shmproxy.PROD),
            "Allreduce AVG on bool": lambda: comm.Allreduce(np.ones(10, bool), np.zeros(10, bool),
                                                            op=shmproxy.AVG),
            "Reduce root out of range": lambda: comm.Reduce(f4, np.zeros(10, np.float32), root=n),
            "Bcast root negative": lambda: comm.Bcast(f4, root=-1),
            "Bcast not an array": lambda: comm.Bcast([1, 2, 3], root=0),
            "Allreduce read-only recv": lambda: comm.Allreduce(f4, np.frombuffer(b"\0" * 40, np.float32)),
            "Allgather recv wrong size": lambda: comm.Allgather(f4, np.zeros(10 * n + 1, np.float32)),
            "Reduce_scatter_block send wrong size": lambda: comm.Reduce_scatter_block(
                np.zeros(10 * n + 1, np.float32), np.zeros(10, np.float32)),
            "Alltoall sizes differ": lambda: comm.Alltoall(np.zeros(10 * n, np.float32),
                                                           np.zeros(10 * n + n, np.float32)),
            "Allreduce unsupported dtype": lambda: comm.Allreduce(np.array(["a"]), np.array(["b"])),
            "Allreduce bad op": lambda: comm.Allreduce(f4, np.zeros(10, np.float32), op="sum"),
            "Allreduce non-contiguous recv": lambda: comm.Allreduce(
                f4, np.zeros((10, 2), np.float32)[:, 0]),

        }
        wrong = {}
        for name, fn in cases.items():
            try:
                fn()
            except shmproxy.InvalidArgument:
                continue
            except Exception as exc:
                wrong[name] = f"{type(exc).__name__}: {exc}"
            else:
                wrong[name] = "no error"
            if comm.get_async_error() is not None:
                wrong[name + " (then)"] = f"communicator failed: {comm.get_async_error()}"
                break
        out = np.zeros(3, np.int64)
        comm.Allreduce(np.full(3, r, np.int64), out)
        assert np.all(out == n * (n - 1) // 2), out
        return {"wrong": wrong}


def empty_and_single() -> dict:
    """0-element buffers for every collective and dtype, on alloc and plain buffers."""
    with shmproxy.init() as comm:
        n = comm.size
        k = 0
        for dtype in DTYPES:
            op = shmproxy.MAX if dtype == "bool" else shmproxy.SUM
            for alloc in (False, True):
                def z(c):
                    return comm.alloc(c, dtype) if alloc else np.zeros(c, dtype)
                comm.Allreduce(z(0), z(0), op=op)
                comm.Allreduce(shmproxy.IN_PLACE, z(0), op=op)
                comm.Reduce(z(0), z(0), op=op, root=n - 1)
                comm.Bcast(z(0), root=0)
                comm.Allgather(z(0), z(0))
                comm.Reduce_scatter_block(z(0), z(0), op=op)
                comm.Alltoall(z(0), z(0))
                shmproxy.Request.Waitall([comm.Iallreduce(z(0), z(0), op=op), comm.Ibcast(z(0), root=0),
                                       comm.Iallgather(z(0), z(0)), comm.Ialltoall(z(0), z(0)),
                                       comm.Ireduce(z(0), z(0), op=op, root=0),
                                       comm.Ireduce_scatter_block(z(0), z(0), op=op), comm.Ibarrier()])
                k += 14
        return {"calls": k}


def proxy_dies_in_allreduce(nbytes: int) -> dict:
    """Rank 0 SIGKILLs the progress process a quarter of the way through a large Allreduce every rank is
    in; if that Allreduce completed first, the next collective must raise."""
    with shmproxy.init() as comm:
        count = nbytes // 4
        send = comm.alloc(count, np.float32)
        recv = comm.alloc(count, np.float32)
        comm.Allreduce(np.ones(1), np.zeros(1))
        t = time.perf_counter()
        comm.Allreduce(send, recv)
        one = time.perf_counter() - t
        req = comm.Iallreduce(send, recv)
        if comm.rank == 0:
            time.sleep(one / 4)
            os.kill(comm._proxy_pid, signal.SIGKILL)
        return _expect_peer_died(req.Wait, comm, one)


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


def nonblocking_is_nonblocking() -> dict:
    """Posting a nonblocking collective returns at once: rank 0's Iallreduce and Ibarrier stay
    incomplete (Test() is False, repeatedly) while the other ranks are held back by a point-to-point
    handshake that rank 0 only sends afterwards."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        out = np.zeros(100_000, np.float64)
        if r == 0:
            t0 = time.monotonic()
            ra = comm.Iallreduce(np.full(100_000, 1.0), out)
            rb = comm.Ibarrier()
            post_s = time.monotonic() - t0
            tests = []
            for _ in range(20):
                tests.append((ra.Test(), rb.Test()))
                time.sleep(0.005)
            for q in range(1, n):
                comm.Send(np.ones(1), q, tag=77)
            ra.Wait()
            rb.Wait()
            assert not any(a or b for a, b in tests), tests
            assert np.all(out == n), out[:3]
            return {"post_s": post_s}
        comm.Recv(np.zeros(1), 0, tag=77)
        comm.Allreduce(np.full(100_000, 1.0), out)
        comm.Barrier()
        assert np.all(out == n), out[:3]
        return {}


def many_outstanding_large(count: int) -> dict:
    """Six different large nonblocking collectives outstanding at once (every root, registered and
    plain buffers mixed), completed in reverse order."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        al = comm.alloc
        a_send = al(count, np.float32)
        a_send[:] = _pat(count, r)
        a_out = np.zeros(count, np.float32)
        b_buf = al(count, np.int64) if r % 2 else np.zeros(count, np.int64)
        if r == n - 1:
            b_buf[:] = np.arange(count)
        g_out = al(n * count, np.int16)
        rs_send = np.asarray(_pat(n * count, r, 1), np.float64)
        rs_out = al(count, np.float64)
        t_send = al(n * count, np.uint32)
        t_send[:] = np.arange(n * count, dtype=np.uint32) + r * 1_000_000
        t_out = np.zeros(n * count, np.uint32)
        red_out = np.zeros(count, np.float32) if r == 0 else None
        reqs = [comm.Iallreduce(a_send, a_out, op=shmproxy.SUM),
                comm.Ibcast(b_buf, root=n - 1),
                comm.Iallgather(np.full(count, r, np.int16), g_out),
                comm.Ireduce_scatter_block(rs_send, rs_out, op=shmproxy.MAX),
                comm.Ialltoall(t_send, t_out),
                comm.Ireduce(a_send, red_out, op=shmproxy.MIN, root=0)]
        for q in reversed(reqs):
            q.Wait()
        pats = [_pat(count, q) for q in range(n)]
        assert np.array_equal(a_out, functools.reduce(np.add, pats)), "Iallreduce"
        assert np.array_equal(b_buf, np.arange(count)), "Ibcast"
        gwant = np.repeat(np.arange(n, dtype=np.int16)[:, None], count, 1)
        assert np.array_equal(g_out.reshape(n, count), gwant), "Iallgather"
        blocks = [np.asarray(_pat(n * count, q, 1), np.float64)[r * count:(r + 1) * count] for q in range(n)]
        want = functools.reduce(np.maximum, blocks)
        assert np.array_equal(rs_out, want), "Ireduce_scatter_block"
        want = np.concatenate([np.arange(r * count, (r + 1) * count, dtype=np.uint32) + q * 1_000_000
                               for q in range(n)])
        assert np.array_equal(t_out, want), "Ialltoall"
        if r == 0:
            assert np.array_equal(red_out, functools.reduce(np.minimum, pats)), "Ireduce"
        return {"ok": True}


def many_comms(k: int) -> dict:
    """k Dups at once, each with its own progress process; nonblocking collectives posted on all of
    them in a rank-dependent order, then closed in a rank-independent order."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        dups = [comm.Dup() for _ in range(k)]
        pids = {d._proxy_pid for d in dups if hasattr(d, "_proxy_pid")}
        for it in range(5):
            order = list(range(k))
            if r % 2:
                order.reverse()
            outs = {}
            reqs = []
            for j in order:
                outs[j] = np.zeros(50_000, np.int64)
                reqs.append(dups[j].Iallreduce(np.full(50_000, r * (j + 1) + it, np.int64), outs[j]))
            for q in reqs:
                q.Wait()
            for j in range(k):
                want = (j + 1) * n * (n - 1) // 2 + n * it
                assert np.all(outs[j] == want), (it, j, outs[j][:3], want)
        for d in dups:
            d.close()
        x = np.zeros(1, np.int64)
        comm.Allreduce(np.ones(1, np.int64), x)
        assert x[0] == n
        return {"proxies": len(pids)}


def split_orders() -> dict:
    """Split orders ranks by (key, parent rank); nested splits; a sub-communicator of one rank."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        keys = [(q * 7) % 3 for q in range(n)]            # ties broken by parent rank
        sub = comm.Split(0, key=keys[r])
        want = sorted(range(n), key=lambda q: (keys[q], q))
        assert (sub.rank, sub.size) == (want.index(r), n), (sub.rank, sub.size, want)
        g = np.zeros(n, np.int32)
        sub.Allgather(np.array([r], np.int32), g)
        assert g.tolist() == want, (g, want)
        nested = sub.Split(sub.rank % 2, key=-sub.rank)   # a split of a split
        members = [q for q in want if want.index(q) % 2 == sub.rank % 2]
        nwant = sorted(members, key=lambda q: -want.index(q))
        h = np.zeros(len(members), np.int32)
        nested.Allgather(np.array([r], np.int32), h)
        assert h.tolist() == nwant, (h, nwant)
        solo = comm.Split(r, key=0)                      # every rank alone
        assert (solo.rank, solo.size) == (0, 1)
        y = np.zeros(3)
        solo.Allreduce(np.full(3, r + 0.5), y)
        assert np.all(y == r + 0.5)
        for c in (solo, nested, sub):
            c.close()
        return {"order": want}


def sub_mismatch(n_colors: int = 2) -> dict:
    """A mismatch on one sub-communicator: its members raise InvalidUsage; the sibling
    sub-communicator and the parent keep working (separate pools and progress processes)."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        color = r % n_colors
        sub = comm.Split(color)
        err = None
        if color == 0:
            try:
                if sub.rank == 0:
                    sub.Allreduce(np.ones(10), np.zeros(10))
                else:
                    sub.Bcast(np.zeros(10), root=0)
            except shmproxy.InvalidUsage as exc:
                err = str(exc)
        else:
            x = np.zeros(10)
            for _ in range(3):
                sub.Allreduce(np.ones(10), x)
            assert np.all(x == sub.size)
        y = np.zeros(4)
        comm.Allreduce(np.ones(4), y)
        assert np.all(y == n), y
        sub.close()
        return {"color": color, "error": err}


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


def barrier_synchronizes(delay: float) -> dict:
    """The last rank enters Barrier / Ibarrier ``delay`` s late: nobody may leave before it entered.
    Each rank returns how long it spent inside (the late rank about 0)."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        comm.Barrier()
        out = {}
        for name in ("Barrier", "Ibarrier", "Allreduce"):
            if r == n - 1:
                time.sleep(delay)
            t0 = time.monotonic()
            if name == "Barrier":
                comm.Barrier()
            elif name == "Ibarrier":
                comm.Ibarrier().Wait()
            else:
                comm.Allreduce(np.ones(1), np.zeros(1))
            out[name] = time.monotonic() - t0
        return out


def close_with_outstanding() -> dict:
    """Nonblocking collectives never waited on: leaving the with-block (close) completes them and
    leaves nothing behind (the conftest leak check)."""
    with shmproxy.init() as comm:
        n = comm.size
        keep = [np.zeros(100_000, np.float32) for _ in range(3)]
        comm.Iallreduce(np.ones(100_000, np.float32), keep[0])
        comm.Ibcast(keep[1], root=0)
        comm.Iallgather(np.ones(100_000 // n, np.float32), keep[2][: (100_000 // n) * n])
        comm.Ibarrier()
    return {"closed": True}


def wait_timeout_then_complete() -> dict:
    """Wait(timeout=) on a collective a peer has not posted raises Timeout naming it; the request
    stays pending and completes once the peer posts."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        out = np.zeros(10)
        if r == 0:
            req = comm.Iallreduce(np.ones(10), out)
            msg = None
            try:
                req.Wait(timeout=0.3)
            except shmproxy.Timeout as exc:
                msg = str(exc)
            for q in range(1, n):
                comm.Send(np.ones(1), q, tag=3)
            req.Wait()
            assert np.all(out == n), out
            return {"timeout_message": msg}
        comm.Recv(np.zeros(1), 0, tag=3)
        comm.Allreduce(np.ones(10), out)
        assert np.all(out == n), out
        return {}


def abort_during_allreduce() -> dict:
    """Rank 0 calls Abort while the others wait in a large Allreduce: they raise Aborted (the
    reason in the message) within the time returned."""
    with shmproxy.init() as comm:
        r = comm.rank
        comm.Barrier()
        if r == 0:
            time.sleep(0.2)
            comm.Abort("coll test over")
            return {}
        t0 = time.monotonic()
        try:
            comm.Allreduce(comm.alloc(1 << 22, np.float32), comm.alloc(1 << 22, np.float32))
        except shmproxy.ProxyError as exc:
            return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}
        return {"error": None, "seconds": time.monotonic() - t0}


def noncontiguous_consistent(coll: str) -> dict:
    """A non-contiguous buffer where the role decides whether it is read or written (Bcast's buf,
    Reduce's recvbuf on the root): whatever the library decides, every rank must decide the same,
    or the ranks' collective sequences drift apart. Then an Allreduce must still work."""
    with shmproxy.init() as comm:
        r, n = comm.rank, comm.size
        comm.Barrier()
        base = np.zeros((10, 2), np.float32)
        buf = base[:, 0]
        if coll == "Bcast":
            if r == 0:
                buf[:] = np.arange(10)
            call = lambda: comm.Bcast(buf, root=0)  # noqa: E731
            want = np.arange(10, dtype=np.float32)
        else:
            call = lambda: comm.Reduce(np.ones(10, np.float32), buf, root=0)  # noqa: E731
            want = np.full(10, n, np.float32) if r == 0 else None
        try:
            call()
            outcome = "ok"
        except shmproxy.InvalidArgument:
            outcome = "InvalidArgument"
        except shmproxy.ProxyError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        correct = None if outcome != "ok" or want is None else bool(np.array_equal(buf, want))
        after = None
        try:
            x = np.zeros(2)
            comm.Allreduce(np.ones(2), x)
        except shmproxy.ProxyError as exc:
            after = f"{type(exc).__name__}: {exc}"
        return {"outcome": outcome, "correct": correct, "after": after}
