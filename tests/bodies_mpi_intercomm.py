"""Rank bodies of tests/test_mpi_intercomm.py: every collective and constructor of an
intercommunicator, written as an mpi4py program, each result checked against what MPI specifies,
computed here with numpy from COMM_WORLD ranks (never from the implementation's own answers).

The intercommunicator (``_make``): world rank 1 alone against every other rank, so the groups are of
unequal size from 3 ranks on, the smaller group is the second one internally (its leader has the
higher world rank), and each group's local order is the reverse of the world order, so a local rank
is never its world rank. A rank's contributions are functions of its world rank (``_val``).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from shmproxy import MPI


class _Inter:
    """The intercommunicator of a body and what MPI says about its ranks."""

    def __init__(self) -> None:
        world = MPI.COMM_WORLD
        self.world = world.rank
        self.color = 1 if world.rank == 1 else 0
        groups = [sorted((r for r in range(world.size) if r != 1), reverse=True), [1]]
        self.mine, self.other = groups[self.color], groups[1 - self.color]   # local/remote rank -> world
        self.local = world.Split(self.color, -world.rank)
        self.inter = self.local.Create_intercomm(0, world, self.other[0], tag=11)
        self.lrank = self.mine.index(self.world)
        assert self.inter.Get_rank() == self.lrank and self.inter.Get_size() == len(self.mine)
        assert self.inter.Get_remote_size() == len(self.other)

    def rooted(self) -> list[tuple[int, int, Any]]:
        """Every root of both groups: (root's color, root's world rank, this rank's root argument)."""
        out = []
        for rc, group in ((0, self.mine if self.color == 0 else self.other),
                          (1, self.mine if self.color == 1 else self.other)):
            for i, w in enumerate(group):
                if rc == self.color:
                    arg = MPI.ROOT if w == self.world else MPI.PROC_NULL
                else:
                    arg = i
                out.append((rc, w, arg))
        return out

    def free(self) -> None:
        self.inter.Free()
        self.local.Free()


def _val(w: int, n: int, dtype: str = "i", salt: int = 0) -> np.ndarray:
    """World rank w's contribution of n elements."""
    return (np.arange(n) + 100 * w + 7 * salt).astype(dtype)


def _raises(error_class: int, call: Callable[[], Any]) -> None:
    try:
        call()
    except MPI.Exception as exc:
        assert exc.Get_error_class() == error_class, (exc.Get_error_class(), error_class, exc)
        return
    raise AssertionError(f"expected an MPI.Exception of class {error_class}")


def rooted() -> dict:
    """Bcast, Gather(v), Scatter(v), Reduce and their I forms, from every root of both groups."""
    t = _Inter()
    inter, other = t.inter, t.other
    rsize = len(other)
    for rc, rw, arg in t.rooted():
        n = 2 + rc          # the root group's choice of sizes: the two groups differ
        for blocking in (True, False):
            def run(name: str, *args: Any) -> None:
                if blocking:
                    getattr(inter, name)(*args, root=arg)
                else:
                    getattr(inter, "I" + name.lower())(*args, root=arg).Wait()
            # Bcast: the root's buffer to every rank of the other group
            buf = _val(rw, n) if arg == MPI.ROOT else np.full(n, -1, "i")
            run("Bcast", buf)
            want = _val(rw, n) if arg not in (MPI.PROC_NULL,) else np.full(n, -1, "i")
            assert buf.tolist() == want.tolist(), ("Bcast", t.world, arg, buf)
            # Gather: the root gets each remote rank's n elements, in remote rank order
            if arg == MPI.ROOT:
                rb = np.full((rsize, n), -1, "d")
                run("Gather", None, rb)
                assert rb.tolist() == [_val(w, n, "d").tolist() for w in other], ("Gather", t.world, rb)
            elif arg == MPI.PROC_NULL:
                run("Gather", None, None)
            else:
                run("Gather", _val(t.world, n, "d"), None)
            # Scatter: block j of the root's sendbuf to remote rank j
            if arg == MPI.ROOT:
                run("Scatter", np.concatenate([_val(w, n) for w in other]), None)
            elif arg == MPI.PROC_NULL:
                run("Scatter", None, None)
            else:
                rb = np.full(n, -1, "i")
                run("Scatter", None, rb)
                assert rb.tolist() == _val(t.world, n).tolist(), ("Scatter", t.world, rb)
            # Gatherv: remote rank j sends j+1 elements, placed with a gap of j after each block
            counts = [j + 1 for j in range(rsize)]
            displs = [sum(counts[:j]) + j for j in range(rsize)]
            total = displs[-1] + counts[-1] + 1
            if arg == MPI.ROOT:
                rb = np.full(total, -1, "q")
                run("Gatherv", None, [rb, (counts, displs), MPI.INT64_T])
                want = np.full(total, -1, "q")
                for j, w in enumerate(other):
                    want[displs[j]:displs[j] + counts[j]] = _val(w, counts[j], "q")
                assert rb.tolist() == want.tolist(), ("Gatherv", t.world, rb)
            elif arg == MPI.PROC_NULL:
                run("Gatherv", None, None)
            else:
                run("Gatherv", _val(t.world, t.lrank + 1, "q"), None)
            # Scatterv: block j (j+1 elements at displs[j]) of the root's sendbuf to remote rank j
            if arg == MPI.ROOT:
                sb = np.full(total, -9, "q")
                for j, w in enumerate(other):
                    sb[displs[j]:displs[j] + counts[j]] = _val(w, counts[j], "q", salt=rw)
                run("Scatterv", [sb, (counts, displs), MPI.INT64_T], None)
            elif arg == MPI.PROC_NULL:
                run("Scatterv", None, None)
            else:
                rb = np.full(t.lrank + 1, -1, "q")
                run("Scatterv", None, rb)
                assert rb.tolist() == _val(t.world, t.lrank + 1, "q", salt=rw).tolist(), ("Scatterv", rb)
            # Reduce: SUM (the progress process's op), BXOR (folded by the ranks), a user op that keeps
            # its first operand (non-commutative: the result is remote rank 0's)
            first = MPI.Op.Create(lambda inb, inout, dt: inout.__setitem__(slice(None), inb), commute=False)
            for op, fold in ((MPI.SUM, np.add), (MPI.BXOR, np.bitwise_xor), (first, lambda a, b: a)):
                if arg == MPI.ROOT:
                    rb = np.full(n, -1, "i")
                    run("Reduce", None, rb, op)
                    want = _val(other[0], n)
                    for w in other[1:]:
                        want = fold(want, _val(w, n))
                    assert rb.tolist() == want.tolist(), ("Reduce", op, t.world, rb, want)
                elif arg == MPI.PROC_NULL:
                    run("Reduce", None, None, op)
                else:
                    run("Reduce", _val(t.world, n), None, op)
    # a root that is none of ROOT, PROC_NULL or a remote rank: ERR_ROOT on every rank, nothing posted
    for bad in (rsize, -3, -1):
        _raises(MPI.ERR_ROOT, lambda: inter.Bcast(np.zeros(1, "i"), root=bad))
        _raises(MPI.ERR_ROOT, lambda: inter.Igather(np.zeros(1, "i"), None, root=bad))
        _raises(MPI.ERR_ROOT, lambda: inter.Reduce(np.zeros(1, "i"), None, root=bad))
    inter.Barrier()      # still in step after the refused calls
    t.free()
    MPI.Finalize()
    return {"rank": t.world}


def allcoll() -> dict:
    """Allgather(v), Alltoall(v), Allreduce, Reduce_scatter(_block), their I forms, Ibarrier, and
    what MPI does not define on an intercommunicator."""
    t = _Inter()
    inter, other, mine = t.inter, t.other, t.mine
    rsize, lsize, me = len(other), len(mine), t.world
    ns, nr = 2 + t.color, 3 - t.color      # what this group sends per block, what it receives
    for blocking in (True, False):
        def run(name: str, *args: Any) -> None:
            if blocking:
                getattr(inter, name)(*args)
            else:
                getattr(inter, "I" + name.lower())(*args).Wait()
        # Allgather: block j = remote rank j's sendbuf (the groups send different sizes)
        rb = np.full((rsize, nr), -1, "i")
        run("Allgather", _val(me, ns), rb)
        assert rb.tolist() == [_val(w, nr).tolist() for w in other], ("Allgather", me, rb)
        # Allgatherv: remote rank j sends j+1 elements, each block followed by a gap
        counts = [j + 1 for j in range(rsize)]
        displs = [sum(counts[:j]) + j for j in range(rsize)]
        rb = np.full(displs[-1] + counts[-1] + 1, -1.0)
        run("Allgatherv", _val(me, t.lrank + 1, "d"), [rb, (counts, displs), MPI.DOUBLE])
        want = np.full(rb.size, -1.0)
        for j, w in enumerate(other):
            want[displs[j]:displs[j] + counts[j]] = _val(w, counts[j], "d")
        assert rb.tolist() == want.tolist(), ("Allgatherv", me, rb)
        # Alltoall: block j (ns elements, salted with remote rank j's world rank) to remote rank j
        sb = np.concatenate([_val(me, ns, salt=w) for w in other])
        rb = np.full(rsize * nr, -1, "i")
        run("Alltoall", sb, rb)
        assert rb.tolist() == np.concatenate([_val(w, nr, salt=me) for w in other]).tolist(), ("Alltoall", rb)
        # Alltoallv: local rank i sends remote rank j i+j+1 elements; blocks packed in reverse order
        sc = [t.lrank + j + 1 for j in range(rsize)]
        sd = [sum(sc[j + 1:]) for j in range(rsize)]
        sb = np.zeros(sum(sc), "q")
        for j, w in enumerate(other):
            sb[sd[j]:sd[j] + sc[j]] = _val(me, sc[j], "q", salt=w)
        rc = [j + t.lrank + 1 for j in range(rsize)]
        rd = [sum(rc[:j]) + 2 * j for j in range(rsize)]
        rb = np.full(rd[-1] + rc[-1], -1, "q")
        run("Alltoallv", [sb, (sc, sd), MPI.INT64_T], [rb, (rc, rd), MPI.INT64_T])
        want = np.full(rb.size, -1, "q")
        for j, w in enumerate(other):
            want[rd[j]:rd[j] + rc[j]] = _val(w, rc[j], "q", salt=me)
        assert rb.tolist() == want.tolist(), ("Alltoallv", me, rb, want)
        # Allreduce: op over the remote group's sendbufs
        for op, fold, dtype in ((MPI.SUM, np.add, "d"), (MPI.MAX, np.maximum, "i"),
                                (MPI.BAND, np.bitwise_and, "i")):
            rb = np.full(4, -1, dtype)
            run("Allreduce", _val(me, 4, dtype), rb, op)
            want = _val(other[0], 4, dtype)
            for w in other[1:]:
                want = fold(want, _val(w, 4, dtype))
            assert rb.tolist() == want.tolist(), ("Allreduce", op, me, rb, want)
        # Reduce_scatter_block: both groups' sendbufs have lsize*rsize*2 elements; a rank of a group of
        # n gets its block of count/n elements of the sum over the remote group
        count = lsize * rsize * 2
        k = count // lsize
        rb = np.full(k, -1, "i")
        run("Reduce_scatter_block", _val(me, count), rb, MPI.SUM)
        want = sum(_val(w, count) for w in other)[t.lrank * k:(t.lrank + 1) * k]
        assert rb.tolist() == want.tolist(), ("Reduce_scatter_block", me, rb, want)
        # Reduce_scatter: 7 elements on both sides, cut by each group's own recvcounts
        cuts = [7 // lsize + (i < 7 % lsize) for i in range(lsize)]
        start = sum(cuts[:t.lrank])
        want = sum(_val(w, 7, "d") for w in other)[start:start + cuts[t.lrank]]
        rb = np.full(cuts[t.lrank] + 1, -1.0)
        run("Reduce_scatter", _val(me, 7, "d"), rb, cuts, MPI.SUM)
        assert rb.tolist() == want.tolist() + [-1.0], ("Reduce_scatter", me, rb, want)
        rb = np.full(cuts[t.lrank], -1.0)      # mpi4py's rule: no counts, each rank's recvbuf size
        run("Reduce_scatter", _val(me, 7, "d"), rb, None, MPI.MAX)
        want = np.maximum.reduce([_val(w, 7, "d") for w in other])[start:start + cuts[t.lrank]]
        assert rb.tolist() == want.tolist(), ("Reduce_scatter", me, rb, want)
    # a folded reduction completed by Test alone (the fold runs when a Test sees the move complete)
    rb = np.full(4, -1, "i")
    req = inter.Iallreduce(_val(me, 4), rb, MPI.BXOR)
    deadline = time.monotonic() + 60
    while not req.Test():
        assert time.monotonic() < deadline, "Iallreduce did not complete under Test"
    want = _val(other[0], 4)
    for w in other[1:]:
        want = want ^ _val(w, 4)
    assert rb.tolist() == want.tolist(), ("Iallreduce by Test", me, rb, want)
    inter.Ibarrier().Wait()
    # refused before anything is posted, on every rank
    _raises(MPI.ERR_COMM, lambda: inter.Scan(np.zeros(1), np.zeros(1)))
    _raises(MPI.ERR_COMM, lambda: inter.Iexscan(np.zeros(1), np.zeros(1)))
    _raises(MPI.ERR_ARG, lambda: inter.Allreduce(MPI.IN_PLACE, np.zeros(1)))
    _raises(MPI.ERR_COUNT, lambda: inter.Alltoallv([np.zeros(4, "i"), [1] * (rsize + 1), MPI.INT],
                                                   np.zeros(4, "i")))
    _raises(MPI.ERR_COUNT, lambda: inter.Reduce_scatter(np.zeros(3), np.zeros(3), [1] * (lsize + 1)))
    # a sendbuf short of the other group's counts: seen after the count exchange, by every rank at once
    cuts = [7 // lsize + (i < 7 % lsize) for i in range(lsize)]
    _raises(MPI.ERR_COUNT, lambda: inter.Reduce_scatter(np.zeros(7 - t.color), np.zeros(cuts[t.lrank])))
    inter.Barrier()
    t.free()
    MPI.Finalize()
    return {"rank": me}


def p2p() -> dict:
    """Sendrecv and Sendrecv_replace with every remote rank: peers and the status's source are
    remote ranks (the lone rank of group 1 exchanges with each rank of group 0 in turn)."""
    t = _Inter()
    inter, other, me = t.inter, t.other, t.world
    for i, w in enumerate(other):
        got, st = np.full(5, -1, "i"), MPI.Status()
        inter.Sendrecv(_val(me, 5, salt=w), dest=i, sendtag=3, recvbuf=got, source=i, recvtag=3, status=st)
        assert got.tolist() == _val(w, 5, salt=me).tolist(), ("Sendrecv", me, w, got)
        assert (st.Get_source(), st.Get_tag()) == (i, 3), ("Sendrecv status", me, st.Get_source())
        buf, st = _val(me, 4, salt=w + 1), MPI.Status()
        source = MPI.ANY_SOURCE if len(other) == 1 else i
        inter.Sendrecv_replace(buf, dest=i, sendtag=4, source=source, recvtag=4, status=st)
        assert buf.tolist() == _val(w, 4, salt=me + 1).tolist(), ("Sendrecv_replace", me, w, buf)
        assert (st.Get_source(), st.Get_tag()) == (i, 4), ("Sendrecv_replace status", me, st.Get_source())
    t.free()
    MPI.Finalize()
    return {"rank": me}


def objects() -> dict:
    """The object layer: bcast, gather, scatter, allgather, alltoall, allreduce, reduce, barrier."""
    t = _Inter()
    inter, other, me = t.inter, t.other, t.world
    rsize = len(other)
    concat = MPI.Op.Create(lambda a, b: a + b, commute=False)
    for rc, rw, arg in t.rooted():
        msg = {"from": rw, "data": list(range(rw + 3)), "arr": np.arange(rw + 1.0)}
        got = inter.bcast(msg if arg == MPI.ROOT else None, root=arg)
        if rc == t.color:
            assert got is None
        else:
            assert got["from"] == rw and got["data"] == msg["data"]
            assert got["arr"].tolist() == msg["arr"].tolist()
        got = inter.gather(("g", me) if arg not in (MPI.ROOT, MPI.PROC_NULL) else None, root=arg)
        assert got == ([("g", w) for w in other] if arg == MPI.ROOT else None), ("gather", me, got)
        got = inter.scatter([("s", w, rw) for w in other] if arg == MPI.ROOT else None, root=arg)
        assert got == (None if rc == t.color else ("s", me, rw)), ("scatter", me, got)
        got = inter.reduce([me], op=concat, root=arg)
        assert got == ([w for w in other] if arg == MPI.ROOT else None), ("reduce", me, got)
        got = inter.reduce(me, op=MPI.MAX, root=arg)
        assert got == (max(other) if arg == MPI.ROOT else None), ("reduce", me, got)
    assert inter.allgather(("a", me)) == [("a", w) for w in other]
    assert inter.alltoall([(me, w) for w in other]) == [(w, me) for w in other]
    assert inter.allreduce(me) == sum(other)
    assert inter.allreduce([me], op=concat) == list(other)
    big = np.arange(100_000) + me        # a pickle of 800 kB
    assert all((a == np.arange(100_000) + w).all() for a, w in zip(inter.allgather(big), other))
    for bad in (rsize, -3, -1):
        _raises(MPI.ERR_ROOT, lambda: inter.reduce(None, op=MPI.NO_OP, root=bad))
        _raises(MPI.ERR_ROOT, lambda: inter.bcast(None, root=bad))
    _raises(MPI.ERR_ARG, lambda: inter.alltoall([0] * (rsize + 1)))
    _raises(MPI.ERR_COMM, lambda: inter.scan(me))
    inter.barrier()
    t.free()
    MPI.Finalize()
    return {"rank": me}


def communicators() -> dict:
    """Dup, Split, Split_type, Create, Create_from_groups, Compare, handles and constructors."""
    t = _Inter()
    inter, mine, other, me = t.inter, t.mine, t.other, t.world

    def check(c: Any, lmembers: list[int], rmembers: list[int]) -> None:
        """c is an intercommunicator of these groups (world ranks in rank order) and it works."""
        assert c.Is_inter() and c.Get_size() == len(lmembers) and c.Get_remote_size() == len(rmembers)
        assert c.Get_rank() == lmembers.index(me), (c.Get_rank(), lmembers, me)
        assert c.Get_group().members == tuple(lmembers) and c.Get_remote_group().members == tuple(rmembers)
        assert c.allgather(me) == rmembers
        rb = np.full(len(rmembers), -1, "i")
        c.Allgather(np.array([me], "i"), rb)
        assert rb.tolist() == rmembers

    dup = inter.Dup()
    check(dup, mine, other)
    assert MPI.Comm.Compare(dup, inter) == MPI.CONGRUENT and inter.Compare(inter) == MPI.IDENT
    assert MPI.Comm.Compare(inter, t.local) == MPI.UNEQUAL
    # Split: one color for all keeps the groups; reversed keys reverse each group's order
    same = inter.Split(0, 0)
    check(same, mine, other)
    rev = inter.Split(3, -t.lrank)
    check(rev, mine[::-1], other[::-1])
    assert MPI.Comm.Compare(rev, inter) == (MPI.SIMILAR if len(mine) + len(other) > 2 else MPI.CONGRUENT)
    # colors by world parity: a color the other group lacks gives COMM_NULL
    color = me % 2
    part = inter.Split(color, 0)
    lm, rm = [w for w in mine if w % 2 == color], [w for w in other if w % 2 == color]
    if rm:
        check(part, lm, rm)
        part.Free()
    else:
        assert part == MPI.COMM_NULL
    assert inter.Split(MPI.UNDEFINED, 0) == MPI.COMM_NULL
    shared = inter.Split_type(MPI.COMM_TYPE_SHARED)
    check(shared, mine, other)
    assert inter.Split_type(MPI.UNDEFINED) == MPI.COMM_NULL
    # Create: each group passes a subgroup of its own (here: its first rank only)
    sub = inter.Create(inter.Get_group().Incl([0]))
    if t.lrank == 0:
        check(sub, mine[:1], other[:1])
        sub.Free()
    else:
        assert sub == MPI.COMM_NULL
    _raises(MPI.ERR_COMM, lambda: inter.Create_group(inter.Get_group()))
    # Create_from_groups: the same groups, collective over their members only
    made = MPI.Intercomm.Create_from_groups(inter.Get_group(), 0, inter.Get_remote_group(), 0)
    check(made, mine, other)
    assert MPI.Comm.Compare(inter, made) == MPI.CONGRUENT
    _raises(MPI.ERR_RANK, lambda: MPI.Intercomm.Create_from_groups(inter.Get_group(), len(mine),
                                                                   inter.Get_remote_group(), 0))
    # handles: an int that gives back an intercommunicator equal to this one
    back = MPI.Comm.fromint(inter.toint())
    assert type(back) is MPI.Intercomm and back == inter and back.Get_remote_size() == len(other)
    assert back.allgather(me) == other
    second = MPI.Intercomm(inter)
    assert second == inter and second.Get_remote_group().members == tuple(other)
    for bad in (lambda: MPI.Intercomm(t.local), lambda: MPI.Intracomm(inter)):
        try:
            bad()
        except TypeError:
            continue
        raise AssertionError("a constructor took a communicator of the other kind")
    merged = rev.Merge(high=t.color == 1)
    assert merged.Get_group().members == tuple(sorted(range(MPI.COMM_WORLD.size), key=lambda w: (w == 1, w)))
    for c in (dup, same, rev, shared, made, merged):
        c.Free()
    t.free()
    MPI.Finalize()
    return {"rank": me}
