"""Rank bodies for tests/test_arena.py: numpy arrays born in registered memory (shmproxy.rank.arena,
shm/_arena.c)."""
from __future__ import annotations

import contextvars
import os
import threading

import numpy as np

import shmproxy
from shmproxy.rank import arena

MIB = 1 << 20


def _staged(comm: shmproxy.Comm) -> int:
    """Bytes of staging buffers this rank has made so far (cached or out)."""
    return sum(b.size for b in comm._staging.owned.values())


def operations() -> dict:
    """Arrays made after init, of every size class around the arena's smallest, through
    point-to-point and collectives: in the arena, never staged, results exact; arrays made before
    init (numpy's) staged and exact as before; views and offsets of arena arrays too."""
    before = np.arange(3 * MIB // 8, dtype=np.float64)
    bad: list[str] = []
    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        right, left = (me + 1) % size, (me - 1) % size
        minimum = comm.params.NUMPY_ARENA_MIN_BYTES
        for nbytes in (minimum - 8, minimum, minimum + 8, 3 * minimum + 8, 5 * MIB + 24):
            n = nbytes // 8
            a = np.arange(n, dtype=np.float64) * (me + 1)
            if arena.owns(a.ctypes.data) != (nbytes >= minimum):
                bad.append(f"{nbytes} B: in the arena {arena.owns(a.ctypes.data)}")
            staged = _staged(comm)
            out = np.empty(n)
            comm.Allreduce(a, out)
            if not (out == np.arange(n) * sum(r + 1 for r in range(size))).all():
                bad.append(f"Allreduce {nbytes} B")
            got = np.empty(n)
            req = comm.Irecv(got, left, tag=1)
            comm.Send(a, right, tag=1)
            req.Wait()
            if not (got == np.arange(n) * (left + 1)).all():
                bad.append(f"Send/Recv {nbytes} B")
            view = a[8:]   # an offset into an arena block
            vout = np.empty_like(view)
            comm.Allreduce(view, vout)
            if not (vout == np.arange(8, n) * sum(r + 1 for r in range(size))).all():
                bad.append(f"Allreduce of a view {nbytes} B")
            if nbytes >= minimum and _staged(comm) != staged:
                bad.append(f"{nbytes} B: staged {_staged(comm) - staged} B")
        out = np.empty_like(before)
        comm.Allreduce(before, out)
        if arena.owns(before.ctypes.data) or not (out == before * size).all():
            bad.append("an array made before init")
        if not _staged(comm):
            bad.append("the array made before init was not staged")
    return {"bad": bad, "stats": arena.stats()}


def lifetime() -> dict:
    """An arena array is zero-copy on a communicator made after it (Dup: its own progress process,
    which maps the arena too), outlives both, stays intact and frees after close; after close numpy
    allocates as its own again."""
    bad: list[str] = []
    with shmproxy.init() as comm:
        kept = np.full(MIB, comm.rank + 1.0)
        if not arena.owns(kept.ctypes.data):
            bad.append("made after init: not in the arena")
        dup = comm.Dup()
        staged = _staged(dup)
        out = np.empty(MIB)
        dup.Allreduce(kept, out)
        if not (out == sum(r + 1.0 for r in range(comm.size))).all() or _staged(dup) != staged:
            bad.append("an array made before Dup, on the Dup: wrong or staged")
        dup.close()
    live = arena.stats()["live_blocks"]
    after = np.ones(MIB)
    if arena.owns(after.ctypes.data):
        bad.append("made after close: still in the arena")
    if not (kept == kept[0]).all() or kept[0] != comm.rank + 1.0:
        bad.append("an arena array changed at close")
    del kept, out
    if arena.stats()["live_blocks"] != live - 2:
        bad.append(f"freed after close: live blocks {arena.stats()['live_blocks']}, was {live}")
    return {"bad": bad}


def turned_off() -> dict:
    """With NUMPY_ARENA=0 (the test sets it) arrays stay numpy's, staged and exact."""
    bad: list[str] = []
    with shmproxy.init() as comm:
        off = np.ones(MIB)
        if arena.owns(off.ctypes.data) or arena.stats():
            bad.append("NUMPY_ARENA=0: an arena was made")
        out = np.empty(MIB)
        comm.Allreduce(off, out)
        if not (out == comm.size).all() or not _staged(comm):
            bad.append("NUMPY_ARENA=0: wrong, or not staged")
    return {"bad": bad}


def allocator() -> dict:
    """The allocator alone: calloc zeroes a reused block (kept or punched), realloc keeps the data,
    blocks are reused by class, threads allocating at once get distinct blocks, libc's arrays free
    through it."""
    bad: list[str] = []
    with shmproxy.init():   # NUMPY_ARENA_KEEP_BYTES = 2 MiB (the test sets it)
        base = arena.stats()
        for keep_round in range(2):
            for _ in range(3):   # a dirty block freed, then calloc'd: zero (kept: punched at the take)
                d = np.full(MIB // 8 * (1 + keep_round * 3), 7.0)
                del d
                z = np.zeros(MIB // 8 * (1 + keep_round * 3))
                if z.any():
                    bad.append(f"np.zeros after a freed block: {np.count_nonzero(z)} non-zero")
                del z
        s = arena.stats()
        if s["top"] - base["top"] > 8 * MIB:
            bad.append(f"blocks not reused: the arena grew by {s['top'] - base['top']} B")
        if s["resident_free"] > 2 * MIB:
            bad.append(f"kept {s['resident_free']} B of free blocks, allowed {2 * MIB}")
        r = np.arange(20000.0)   # 160 KB: the arena's
        r.resize(300000, refcheck=False)   # grows past its class: moves, keeps the data
        if not (r[:20000] == np.arange(20000.0)).all() or not arena.owns(r.ctypes.data):
            bad.append("realloc lost the data or left the arena")
        small = np.ones(100)   # libc's, freed through the handler
        del small
        errors: list[str] = []

        def churn(i: int) -> None:   # arena arrays made, written, checked and freed at once by 4 threads
            for k in range(200):
                x = np.full(MIB // 8 + 64 * k, float(i * 1000 + k))
                if not arena.owns(x.ctypes.data) or not (x == i * 1000 + k).all():
                    errors.append(f"thread {i} array {k}")
                del x
        # a thread starts with numpy's default handler: each runs in a copy of this context, which has ours
        threads = [threading.Thread(target=contextvars.copy_context().run, args=(churn, i)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bad += errors[:3]
        held = [np.empty(MIB // 8 + i) for i in range(64)]
        addrs = {h.ctypes.data for h in held}
        if len(addrs) != 64 or not all(arena.owns(a) for a in addrs):
            bad.append("64 live arrays: overlapping or outside the arena")
        del held
    return {"bad": bad}


def fork_child() -> dict:
    """After fork, the child's writes to an arena array stay in the child, and it sees the parent's
    values of the fork; the parent's arrays are intact and still zero-copy."""
    bad: list[str] = []
    with shmproxy.init() as comm:
        a = np.full(MIB, 5.0)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child: no shmproxy calls
            ok = bool((a == 5.0).all())
            a[:] = -1.0
            b = np.full(MIB, 3.0)   # the child's own allocations work too
            ok = ok and bool((b == 3.0).all()) and bool((a == -1.0).all())
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
        os.close(w)
        child_ok = os.read(r, 1) == b"1"
        os.close(r)
        os.waitpid(pid, 0)
        if not child_ok:
            bad.append("the child saw wrong values")
        if not (a == 5.0).all():
            bad.append(f"the child's writes reached the parent: {a[:3]}")
        staged = _staged(comm)
        out = np.empty(MIB)
        comm.Allreduce(a, out)
        if not (out == 5.0 * comm.size).all() or _staged(comm) != staged:
            bad.append("the parent's array after the fork: wrong or staged")
    return {"bad": bad}


def _fold(xs: list, op: str, order: list[int]) -> np.ndarray:
    """The reduction in the ranks' order (a Reduce's root first), as every path of shmproxy does it."""
    acc = xs[order[0]].copy()
    for r in order[1:]:
        x = xs[r]
        acc = {"SUM": acc + x, "PROD": acc * x, "MAX": np.maximum(acc, x), "MIN": np.minimum(acc, x),
               "AVG": acc + x}[op]
    if op == "AVG":
        acc = acc / acc.dtype.type(len(xs))
    return acc.astype(xs[0].dtype)


def middle() -> dict:
    """The middle collectives (shm/_poster_coll.c): Allreduce, Reduce and Bcast above the fast path's
    cells, bit for bit against the fold in rank order, around the shares' cache lines and the limits,
    in place, arrays outside the arena (made before init: through the scratch block), strided inputs
    (the Python fallback's way in), every rank's arena mapped, nothing staged or posted."""
    before = np.arange(300001, dtype=np.float32)
    out_before = np.empty(300001, np.float32)   # outputs outside the arena: copied out of the scratch
    inplace_before = np.arange(300001, dtype=np.float32)
    bad: list[str] = []
    cases = 0
    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        fast, mid = comm._fast_bytes, comm._mapped_bytes
        if not mid or mid <= fast:
            return {"bad": [f"the middle collectives are off: cells {fast}, middle {mid}"], "cases": 0}
        rng = np.random.default_rng(7)
        for dtype in ("float32", "float64", "int32", "uint8"):
            isz = np.dtype(dtype).itemsize
            for nbytes in (fast + isz, fast + 64 * size + isz, 3 * fast + 5 * isz, mid):
                n = nbytes // isz
                if dtype == "uint8":
                    xs = [rng.integers(0, 3, n).astype(dtype) for _ in range(size)]
                else:
                    xs = [(rng.integers(-50, 50, n) / 8).astype(dtype) for _ in range(size)]
                ops = ["SUM", "MAX", "PROD"] + (["AVG"] if dtype.startswith("float") else [])
                for op in ops:
                    o = getattr(shmproxy, op)
                    out = np.empty(n, dtype)
                    comm.Allreduce(xs[me], out, o)
                    ip = xs[me].copy()
                    comm.Allreduce(shmproxy.IN_PLACE, ip, o)
                    want = _fold(xs, op, list(range(size)))
                    root = n % size
                    rout = np.empty(n, dtype) if me == root else None
                    comm.Reduce(xs[me], rout, o, root=root)
                    cases += 3
                    for what, got, w in (("Allreduce", out, want), ("Allreduce in place", ip, want)):
                        if not np.array_equal(got, w):
                            bad.append(f"{what} {op} {dtype} {nbytes} B")
                    if me == root and not np.array_equal(rout, _fold(xs, op, [root] + [r for r in range(size)
                                                                                       if r != root])):
                        bad.append(f"Reduce {op} {dtype} {nbytes} B root {root}")
                for root in range(size):
                    b = xs[me].copy()
                    comm.Bcast(b, root)
                    cases += 1
                    if not np.array_equal(b, xs[root]):
                        bad.append(f"Bcast {dtype} {nbytes} B root {root}")
        # outside the arena: made before init (through the scratch block), and a strided input
        out = np.empty_like(before)
        comm.Allreduce(before, out)
        comm.Allreduce(before, out_before)
        comm.Allreduce(shmproxy.IN_PLACE, inplace_before)
        cases += 2
        if not np.array_equal(out_before, before * size) or not np.array_equal(inplace_before, before * size):
            bad.append("Allreduce into an array made before init (in place too)")
        strided = np.arange(2 * 300001, dtype=np.float32)[::2] + me
        sout = np.empty(300001, np.float32)
        comm.Allreduce(strided, sout)
        cases += 2
        if not np.array_equal(out, before * size):
            bad.append("Allreduce of an array made before init")
        if not np.array_equal(sout, np.arange(0, 600002, 2, dtype=np.float32) * size + sum(range(size))):
            bad.append("Allreduce of a strided input")
        maps = sum(1 for line in open("/proc/self/maps") if "shmproxy-arena" in line)
        if maps != size:
            bad.append(f"{maps} arenas mapped, {size} ranks")
    return {"bad": bad, "cases": cases}


def middle_declined() -> dict:
    """Rank 1 has no arena (NUMPY_ARENA=0 for it alone): every rank declines the middle collectives
    alike after the handshake and posts them, with the same results, over many calls."""
    if os.environ.get("RANK") == "1":
        os.environ["SHMPROXY_NUMPY_ARENA"] = "0"
    bad: list[str] = []
    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        n = (comm._fast_bytes + 4096) // 4
        for i in range(20):
            a = np.full(n, float(me + i), np.float32)
            out = np.empty_like(a)
            comm.Allreduce(a, out)
            b = a.copy()
            comm.Bcast(b, i % size)
            r = np.empty_like(a) if me == 0 else None
            comm.Reduce(a, r, shmproxy.MAX, root=0)
            if not (out == sum(r + i for r in range(size))).all() or not (b == i % size + i).all():
                bad.append(f"call {i}: Allreduce or Bcast wrong")
            if me == 0 and not (r == size - 1 + i).all():
                bad.append(f"call {i}: Reduce wrong")
    return {"bad": bad}


def middle_declined_by_a_device_rank() -> dict:
    """A rank whose buffers are device arrays takes no middle collective: it declines the host ranks'
    handshake (fastpath._decline_middle; here rank 1 plays it on host arrays, the GPU suite runs it on
    device ones) and every rank posts the call: same results, for Allreduce, Bcast and Reduce."""
    from shmproxy.core.ops import DTYPE_CODE, Coll
    bad: list[str] = []
    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        n = (comm._fast_bytes + 8192) // 4
        code = DTYPE_CODE[np.dtype(np.float32).char]
        for i in range(5):
            a = np.full(n, float(me + i), np.float32)
            out, b = np.empty_like(a), a.copy()
            r = np.empty_like(a) if me == 0 else None
            if me == 1:
                comm._pp.coll_decline(int(Coll.ALLREDUCE), a.nbytes, code, n, int(shmproxy.SUM), 0)
                comm.Iallreduce(a, out).Wait()
                comm._pp.coll_decline(int(Coll.BCAST), a.nbytes, code, n, 0, 0)
                comm.Ibcast(b, 0).Wait()
                comm._pp.coll_decline(int(Coll.REDUCE), a.nbytes, code, n, int(shmproxy.MAX), 0)
                comm.Ireduce(a, r, shmproxy.MAX, 0).Wait()
            else:
                comm.Allreduce(a, out)
                comm.Bcast(b, 0)
                comm.Reduce(a, r, shmproxy.MAX, root=0)
            if not (out == sum(x + i for x in range(size))).all() or not (b == i).all():
                bad.append(f"call {i}: Allreduce or Bcast wrong")
            if me == 0 and not (r == size - 1 + i).all():
                bad.append(f"call {i}: Reduce wrong")
    return {"bad": bad}


def arena_unmappable() -> dict:
    """Rank 0 runs under an address-space limit (RLIMIT_AS) that its progress process inherits: room
    for one 8 GiB arena there, not for both, and not for rank 0 to map rank 1's. The rank that
    registers second fails to (a warning; its arrays are staged), the middle
    collectives are declined by every rank alike, and every result is still right."""
    import resource
    if os.environ.get("RANK") == "0":
        vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:"))
        limit = (vm << 10) + (12 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    bad: list[str] = []
    with shmproxy.init() as comm:
        me, size = comm.rank, comm.size
        held = comm._arena_held
        for n in (1 << 10, 1 << 15, 1 << 18):
            a = np.full(n, float(me + 1))
            out = np.empty_like(a)
            comm.Allreduce(a, out)
            b = a.copy()
            comm.Bcast(b, 1)
            if not (out == sum(range(1, size + 1))).all() or not (b == 2.0).all():
                bad.append(f"{8 * n} B: wrong")
    return {"bad": bad, "held": held}
