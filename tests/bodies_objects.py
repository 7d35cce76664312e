"""Rank bodies for the object-layer tests (proxy/rank/objects.py): each function runs in every rank of a
real job (tests/rankmain.py), calls shmproxy.init() itself, checks values and raises on any mismatch.
Return values travel back to the test as JSON, so the test can check what was exercised."""
from __future__ import annotations

import math
import threading

import numpy as np

import shmproxy
from shmproxy.core import errors
from shmproxy.rank import objcoll, objects

BIG = 1 << 20  # float64 elements: 8 MiB


class Point:
    """A user class (module-level, so that it pickles by reference)."""

    def __init__(self, x: int, y: str):
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)


def same(a, b, path: str = "obj") -> None:
    """Deep equality that understands numpy arrays (dtype, shape, order, values) and NaN."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), (path, type(a), type(b))
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, a.shape, b.dtype, b.shape)
        assert a.flags.f_contiguous == b.flags.f_contiguous or a.ndim < 2, path
        assert np.array_equal(a, b), (path, a[:8], b[:8])
        return
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), (path, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, (path, a, b)


def make_objects(seed: int) -> list:
    """Objects whose content depends on ``seed`` (the sending rank), so a mix-up is visible."""
    rng = np.random.default_rng(seed)
    big = rng.standard_normal(BIG)
    return [
        None,
        seed,
        -(2**100) - seed,
        float("nan"),
        3.25 * seed,
        f"rank {seed}: héllo ✓",
        b"\x00bytes" * (seed + 1),
        bytearray(b"ba") * (seed + 2),
        [seed, [seed + 1, [seed + 2, None]], ()],
        {"a": {"b": (seed, "x")}, 7: [1.5, True], None: frozenset({seed, 99})},
        {seed, seed + 1, "s"},
        Point(seed, "p" * seed),
        "x" * 5000,                                              # main pickle not inline
        {"grad": big, "step": seed, "meta": {"n": BIG}},          # 8 MiB out-of-band
        [np.zeros(0, t) for t in ("float64", "int8", "complex128", "bool")],  # 0-length arrays
        np.zeros((0, 5), np.float32),
        np.asfortranarray(rng.integers(0, 1000, (300, 70))),     # F-order, out-of-band
        np.arange(40000, dtype=np.int32)[::3],                   # not contiguous: in-band
        rng.integers(0, 255, 10, dtype=np.uint8),                # small: in-band
        {"mix": [rng.standard_normal(20000).astype(np.float32),   # out-of-band
                 "s", np.arange(3000, dtype=np.uint16),            # in-band
                 np.arange(40000, dtype=np.uint16) + seed,          # out-of-band (3 of them)
                 (rng.standard_normal((100, 100)) * 1j).astype(np.complex64)]},
    ]


def _comm():
    return shmproxy.init()


def p2p_objects() -> dict:
    """Every object of make_objects around a ring (to itself at size 1), one tag per object."""
    with _comm() as comm:
        r, n = comm.rank, comm.size
        right, left = (r + 1) % n, (r - 1) % n
        mine, theirs = make_objects(r), make_objects(left)
        # what travels out-of-band: the 8 MiB array, the F-order one, 3 of "mix" (the test needs them)
        assert [len(objects._dumps(o, "check").bufs) for o in mine] == [0] * 13 + [1, 0, 0, 1, 0, 0, 3]
        # Buffered sends: every rank sends everything first, then receives (no ordering needed).
        for i, obj in enumerate(mine):
            objects.send(comm, obj, right, tag=i)
        checked = 0
        for i, expect in enumerate(theirs):
            got = objects.recv(comm, left, tag=i)
            same(got, expect, f"object {i} from rank {left}")
            checked += 1
        # The 8 MiB array arrived out-of-band, into its own receive buffer: no pickle copy.
        objects.send(comm, mine[13], right, tag=-5)
        got = objects.recv(comm, left, tag=-5)["grad"]
        assert got.flags.writeable and isinstance(got.base, np.ndarray) and got.base.dtype == np.uint8, \
            (got.flags, type(got.base))
        assert got.base.nbytes == got.nbytes == 8 * BIG
        assert np.array_equal(got, theirs[13]["grad"])
        return {"checked": checked}


def many_buffers(nbufs: int) -> dict:
    """An object with ``nbufs`` buffers that qualify for out-of-band (more than the header holds
    lengths for, more than OOB_MAX_BUFFERS, and more than a rank's request slots with
    max_ops_per_rank=64), then every buffer out-of-band, even the empty ones (OOB_MIN_BYTES = 0)."""
    with shmproxy.init(max_ops_per_rank=64) as comm:
        r, n = comm.rank, comm.size
        objects.HDR_WORDS = 128   # every rank: the lengths of > 122 buffers travel in a message of their own
        right, left = (r + 1) % n, (r - 1) % n

        def build(seed: int) -> dict:
            return {f"a{i}": np.full(objects.OOB_MIN_BYTES // 8 + i, seed * 100000 + i, np.int64)
                    for i in range(nbufs)}

        mine = build(r)
        oob = len(objects._dumps(mine, "check").bufs)
        # the test really sends that many buffers out-of-band (the largest OOB_MAX_BUFFERS of them)
        assert oob == min(nbufs, objects.OOB_MAX_BUFFERS), oob
        if r % 2 == 0:
            objects.send(comm, mine, right, tag=3)
            got = objects.recv(comm, left, tag=3)
        else:
            got = objects.recv(comm, left, tag=3)
            objects.send(comm, mine, right, tag=3)
        same(got, build(left))

        objects.OOB_MIN_BYTES = 0

        def build_small(seed: int) -> dict:
            return {"empty": [np.zeros(0, np.float64), np.zeros((3, 0), np.int16)],
                    "one": np.ones(1, np.int8) * seed,
                    "nested": [np.arange(i, dtype=np.float32) + seed for i in range(20)]}

        small = build_small(r)
        oob_small = len(objects._dumps(small, "check").bufs)
        assert oob_small == 23, oob_small
        objects.send(comm, small, right, tag=4)
        got = objects.recv(comm, left, tag=4)
        same(got, build_small(left))
        return {"oob": oob, "oob_small": oob_small}


def tags_and_order() -> dict:
    """Tags select among objects, in any receive order; one pair and tag never overtake each other.
    Objects with out-of-band buffers interleave their messages on the same tags."""
    with _comm() as comm:
        assert comm.size >= 2
        k = 30
        if comm.rank == 0:
            for i in range(k):
                obj = {"i": i, "a": np.full(9000 + i, i, np.float64)}   # 72 KiB: out-of-band
                objects.send(comm, obj, 1, tag=[7, -3, 2**62][i % 3])
            objects.send(comm, "last", 1, tag=objects.OBJ_TAG_BASE)  # the lowest user tag
        elif comm.rank == 1:
            last = objects.recv(comm, 0, tag=objects.OBJ_TAG_BASE)  # sent last, received first
            assert last == "last", last
            got = {t: [] for t in (7, -3, 2**62)}
            for t in (2**62, 7, -3):
                for _ in range(k // 3):
                    obj = objects.recv(comm, 0, tag=t)
                    assert np.all(obj["a"] == obj["i"]) and obj["a"].size == 9000 + obj["i"], obj["i"]
                    got[t].append(obj["i"])
            for j, t in enumerate((7, -3, 2**62)):
                assert got[t] == list(range(j, k, 3)), (t, got[t])
        return {"rank": comm.rank}


def bad_args() -> dict:
    """Reserved tags and bad peers raise InvalidArgument before anything is sent."""
    with _comm() as comm:
        raised = 0
        for call in (lambda: objects.send(comm, 1, comm.rank, tag=objects.OBJ_TAG_BASE - 1),
                     lambda: objects.recv(comm, comm.rank, tag=objects.OBJ_COLL_TAG),
                     lambda: objects.send(comm, 1, comm.size),
                     lambda: objects.recv(comm, -2),       # -1 is ANY_SOURCE
                     lambda: objects.send(comm, 1, 0, tag=1.5),
                     lambda: objcoll.bcast(comm, 1, root=comm.size),
                     lambda: objcoll.gather(comm, 1, root=-1),
                     lambda: objcoll.allreduce(comm, 1, "AVG"),
                     lambda: objcoll.allreduce(comm, 1, 42)):
            try:
                call()
            except errors.InvalidArgument:
                raised += 1
        assert raised == 9, raised
        # and the communicator works
        assert objcoll.allreduce(comm, comm.rank, "SUM") == comm.size * (comm.size - 1) // 2
        return {"raised": raised}


def collectives() -> dict:
    """bcast from every root, gather to every root, allgather, allreduce with every op and a lambda,
    barrier; every rank checks every value."""
    import enum

    class Op(enum.IntEnum):  # any enum whose member names are the op names
        SUM = 0
        PROD = 1
        MIN = 2
        MAX = 3

    with _comm() as comm:
        r, n = comm.rank, comm.size
        for root in range(n):
            obj = {"root": root, "arr": np.arange(BIG // 4, dtype=np.float64) * root, "s": "x" * root} \
                if r == root else None
            got = objcoll.bcast(comm, obj, root=root)
            assert got["root"] == root and got["s"] == "x" * root, got
            assert np.array_equal(got["arr"], np.arange(BIG // 4, dtype=np.float64) * root)
            if r == root:
                assert got is not obj and got["arr"] is not obj["arr"]  # a copy at the root too
                got["arr"][0] = -1.0
                assert obj["arr"][0] == 0.0
        for root in range(n):
            got = objcoll.gather(comm, (r, [r] * r, np.full(20000, r, np.int32)), root=root)
            if r == root:
                assert isinstance(got, list) and len(got) == n, got
                for i, item in enumerate(got):
                    assert item[0] == i and item[1] == [i] * i, item
                    assert np.all(item[2] == i) and item[2].size == 20000
            else:
                assert got is None, got
        got = objcoll.allgather(comm, {"r": r, "a": np.full(30000, r, np.int16)})
        assert [g["r"] for g in got] == list(range(n)), got
        assert all(np.all(g["a"] == i) for i, g in enumerate(got))

        vals = [3 + 2 * i for i in range(n)]   # 3, 5, 7
        mine = vals[r]
        expect = {"SUM": sum(vals), "PROD": math.prod(vals), "MIN": min(vals), "MAX": max(vals)}
        for name, want in expect.items():
            assert objcoll.allreduce(comm, mine, name) == want, name
            assert objcoll.allreduce(comm, mine, Op[name]) == want, name
            assert objcoll.allreduce(comm, mine, getattr(shmproxy, name)) == want, name   # shmproxy.SUM, ...
            assert objcoll.allreduce(comm, mine, name.lower()) == want, name
        # numpy arrays go through np.add / np.multiply / np.minimum / np.maximum
        arr = np.array([r, n - r, 5, -r], np.float64)
        stack = np.array([[i, n - i, 5, -i] for i in range(n)], np.float64)
        for name, f in (("SUM", np.sum), ("PROD", np.prod), ("MIN", np.min), ("MAX", np.max)):
            got = objcoll.allreduce(comm, arr, Op[name])
            assert isinstance(got, np.ndarray) and np.array_equal(got, f(stack, axis=0)), (name, got)
        # lists concatenate in rank order; a lambda sees rank order too
        assert objcoll.allreduce(comm, [r], "SUM") == list(range(n))
        assert objcoll.allreduce(comm, str(r), lambda a, b: a + "," + b) == ",".join(map(str, range(n)))
        assert objcoll.allreduce(comm, (r, r), lambda a, b: max(a, b, key=lambda t: t[0])) == (n - 1, n - 1)
        # the reducer's result may hold out-of-band buffers; every rank gets the identical result
        got = objcoll.allreduce(comm, {"v": np.full(10000, r + 1.0)}, lambda a, b: {"v": a["v"] * b["v"]})
        assert np.all(got["v"] == math.factorial(n)), got["v"][:4]
        objcoll.barrier(comm)
        return {"rank": r, "ok": True}


def barrier_orders() -> dict:
    """No rank leaves the barrier before every rank entered it: rank 0 enters late and records (in
    shared state: a file it writes before entering) what the others saw."""
    import os
    import time
    with _comm() as comm:
        path = objcoll.bcast(comm, f"/tmp/sptest-barrier-{os.getpid()}" if comm.rank == 0 else None)
        for rnd in range(3):
            if comm.rank == 0:
                time.sleep(0.3)
                with open(path, "w") as f:
                    f.write(str(rnd))
            objcoll.barrier(comm)
            with open(path) as f:
                seen = f.read()
            assert seen == str(rnd), (rnd, seen)   # rank 0 wrote it before entering
            objcoll.barrier(comm)                  # nobody rewrites it before all have read
        if comm.rank == 0:
            os.unlink(path)
        return {"rounds": 3}


def unpicklable() -> dict:
    """An object that cannot be pickled raises InvalidArgument on its rank before anything is sent;
    in a collective every other rank raises RemoteError naming it; the comm stays usable."""
    with _comm() as comm:
        r, n = comm.rank, comm.size
        right, left = (r + 1) % n, (r - 1) % n
        seen = []
        for bad in (threading.Lock(), lambda x: x, {"ok": 1, "bad": [threading.Lock()]}):
            try:
                objects.send(comm, bad, right, tag=11)
            except errors.InvalidArgument as exc:
                assert "cannot pickle" in str(exc), str(exc)
                seen.append("send")
            else:
                raise AssertionError("send of an unpicklable object did not raise")
        # nothing of those was sent: the next object on tag 11 is the good one
        objects.send(comm, {"good": r}, right, tag=11)
        assert objects.recv(comm, left, tag=11) == {"good": left}

        victim = n - 1
        for root in range(n):
            # bcast: the root cannot pickle
            try:
                objcoll.bcast(comm, threading.Lock() if r == root else None, root=root)
            except errors.InvalidArgument:
                assert r == root
                seen.append("bcast-root")
            except errors.RemoteError as exc:
                assert r != root and f"rank {root}" in str(exc) and "lock" in str(exc), str(exc)
                seen.append("bcast-peer")
            else:
                raise AssertionError(f"bcast from {root} did not raise at rank {r}")
            # gather: one rank cannot pickle; only it and the root raise
            try:
                got = objcoll.gather(comm, threading.Lock() if r == victim else r, root=root)
            except errors.InvalidArgument:
                assert r == victim
                seen.append("gather-victim")
            except errors.RemoteError as exc:
                assert r == root and f"rank {victim}" in str(exc), str(exc)
                seen.append("gather-root")
            else:
                assert r not in (root, victim) and got is None, (r, root, got)
        for fn in (lambda o: objcoll.allgather(comm, o), lambda o: objcoll.allreduce(comm, o, "SUM")):
            try:
                fn(threading.Lock() if r == victim else r)
            except errors.InvalidArgument:
                assert r == victim
                seen.append("all-victim")
            except errors.RemoteError as exc:
                assert r != victim and f"rank {victim}" in str(exc), str(exc)
                seen.append("all-peer")
            else:
                raise AssertionError(f"rank {r}: a collective with an unpicklable contribution did not raise")
        # a reducer that fails on rank 0 fails everywhere
        try:
            objcoll.allreduce(comm, r, lambda a, b: a + "x")
        except TypeError:
            assert r == 0 and n > 1
            seen.append("reduce-root")
        except errors.RemoteError as exc:
            assert r != 0 and "TypeError" in str(exc), str(exc)
            seen.append("reduce-peer")
        else:
            assert n == 1, "a failing reducer did not raise"
        # still usable, and in step
        assert objcoll.allgather(comm, r) == list(range(n))
        assert objcoll.bcast(comm, "fine" if r == n - 1 else None, root=n - 1) == "fine"
        objcoll.barrier(comm)
        return {"seen": seen}


def misuse() -> dict:
    """Ranks in different collectives get an InvalidUsage naming both, not silently wrong data; recv
    of a message sent with Send (not an object) is an InvalidUsage too, not garbage."""
    out = {}
    with _comm() as comm:
        assert comm.size == 2
        try:
            if comm.rank == 0:
                objcoll.bcast(comm, "x", root=0)   # buffered: returns; rank 1 consumes the message
            else:
                objcoll.gather(comm, "y", root=1)
        except errors.InvalidUsage as exc:
            assert "bcast" in str(exc) and "gather" in str(exc), str(exc)
            out["mismatch"] = True
        if comm.rank == 0:
            comm.Send(np.arange(4, dtype=np.int64), 1, tag=9)
        else:
            try:
                objects.recv(comm, 0, tag=9)
            except errors.InvalidUsage as exc:
                assert "not an object message" in str(exc), str(exc)
                out["raw"] = True
        # A buffered send that fails after send() posted it (rank 1 receives it with a float64 Recv:
        # the dtypes disagree) is raised at the end of rank 0's next object call: the barrier, which
        # both ranks complete, so they stay in step (or the send itself, if the failure came first).
        if comm.rank == 0:
            try:
                objects.send(comm, 5, 1, tag=2)
            except errors.InvalidUsage as exc:
                assert "send" in str(exc) and "float64" in str(exc), str(exc)
                out["deferred"] = True
        else:
            try:
                comm.Recv(np.zeros(objects.HDR_WORDS, np.float64), 0, tag=2)
            except errors.InvalidUsage:
                out["dtype"] = True
        try:
            objcoll.barrier(comm)
        except errors.InvalidUsage as exc:
            assert comm.rank == 0 and "send" in str(exc) and "float64" in str(exc), str(exc)
            assert "deferred" not in out
            out["deferred"] = True
        # still in step afterwards
        assert objcoll.allgather(comm, comm.rank * 10) == [0, 10]
        return out


def size_one_and_closed() -> dict:
    """At size 1 every operation works without peers; after close every one raises Closed."""
    with _comm() as comm:
        assert comm.size == 1
        obj = {"a": np.arange(100000.0), "b": [1, 2]}
        got = objcoll.bcast(comm, obj)
        same(got, obj)
        assert got["a"] is not obj["a"]
        same(objcoll.gather(comm, obj), [obj])
        same(objcoll.allgather(comm, obj), [obj])
        assert objcoll.allreduce(comm, 5, "PROD") == 5
        assert objcoll.allreduce(comm, [1], lambda a, b: 1 / 0) == [1]  # one value: never called
        objcoll.barrier(comm)
        objects.send(comm, obj, 0, tag=1)
        objects.send(comm, "second", 0, tag=1)
        objects.send(comm, "other tag", 0, tag=2)
        assert objects.recv(comm, 0, tag=2) == "other tag"
        got = objects.recv(comm, 0, tag=1)
        same(got, obj)
        assert got["a"] is not obj["a"]
        assert objects.recv(comm, 0, tag=1) == "second"
        # pickling errors do not depend on the size: every operation refuses a lock, even alone
        lock = threading.Lock()
        refused = 0
        for call in (lambda: objects.send(comm, lock, 0), lambda: objcoll.bcast(comm, lock),
                     lambda: objcoll.gather(comm, lock), lambda: objcoll.allgather(comm, lock),
                     lambda: objcoll.allreduce(comm, lock, "SUM")):
            try:
                call()
            except errors.InvalidArgument as exc:
                assert "cannot pickle" in str(exc), str(exc)
                refused += 1
        assert refused == 5, refused
        assert objcoll.allgather(comm, "still fine") == ["still fine"]
    closed = 0
    for call in (lambda: objects.send(comm, 1, 0), lambda: objects.recv(comm, 0),
                 lambda: objcoll.bcast(comm, 1), lambda: objcoll.gather(comm, 1),
                 lambda: objcoll.allgather(comm, 1), lambda: objcoll.allreduce(comm, 1, "SUM"),
                 lambda: objcoll.barrier(comm)):
        try:
            call()
        except errors.Closed:
            closed += 1
    assert closed == 7, closed
    return {"closed": closed}
