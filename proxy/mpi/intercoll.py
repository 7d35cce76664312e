"""The collectives of an intercommunicator (a mixin of intercomm.Intercomm; its header says how the
intercommunicator is laid out: one merged native communicator ``_c`` of both groups, the local group
at internal ranks ``_loff..``, the remote one at ``_roff..``).

MPI's intercommunicator semantics: data flows between the two groups, never within one. A rooted
call names its root by ``root``: MPI.ROOT on the root itself, MPI.PROC_NULL on the other members of
the root's group (they take no part in the data), and the root's rank in the remote group on every
member of the other group. Anything else raises ERR_ROOT before anything is posted.

Every data movement is one internal Alltoallv (``_move``) whose counts are zero except between the
ranks that send and receive, so each call is a single native collective posted at once: the
nonblocking forms are the same call without the Wait, and a PROC_NULL member takes part with zero
counts (it needs to know neither the root nor the sizes). Buffers move as bytes, so the two groups'
buffers need only agree in size, as MPI requires:

- Bcast/Gather/Scatter/Gatherv/Scatterv: the root sends to (receives from) each member of the other
  group its block (vector specs count ``remote_size`` blocks);
- Allgather/Allgatherv: every rank sends its sendbuf to each remote rank; block j of the recvbuf is
  remote rank j's;
- Alltoall/Alltoallv: block j of the sendbuf goes to remote rank j, block j of the recvbuf comes from it;
- Reduce, Iallreduce, Reduce_scatter(_block) and their I forms: the contributions a rank needs travel
  to it and it folds them in remote rank order (localred's fold, every op and type localred reduces,
  when the Wait or a Test sees the move complete): Reduce's root gets
  every remote sendbuf; Reduce_scatter's rank i gets block i of each remote sendbuf (blocks of the
  recvbuf's size for _block; for Reduce_scatter every rank's count is learnt first by a small
  internal Allgather, since a group needs the other group's counts to cut its vectors);
- Allreduce (blocking): each group reduces its own sendbufs on a native communicator of its members
  (a Split of the internal one, made on first use, collective over both groups like the call), and
  one internal Alltoallv takes each group's result from its leader to every member of the other;
- Barrier/Ibarrier: the internal one; the persistent forms (persistent.py) start these I forms;
- the object layer (bcast, gather, scatter, allgather, alltoall, allreduce, reduce, barrier): each
  object is pickled once and travels through ``_exchange`` (an internal Alltoall of byte counts, then
  one Alltoallv of the pickles); reductions fold in remote rank order;
- Scan and Exscan are not defined on an intercommunicator (MPI): ERR_COMM.

IN_PLACE is not defined on an intercommunicator: ERR_ARG. None where a buffer is not read (the root
group's sendbuf of Gather, a PROC_NULL member's buffers) is no buffer. A rank's own arguments (root,
buffer specs, block divisibility, recvcounts) are checked before anything is posted; sizes the two
groups disagree on are seen by the native Alltoallv, which raises on both sides ("counts disagree").
Derived datatypes and device buffers raise NotImplementedError here.
"""
from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from shmproxy.core import errors
from shmproxy.core.ops import IN_PLACE
from shmproxy.mpi import buffers, localred
from shmproxy.mpi.exceptions import (ERR_ARG, ERR_BUFFER, ERR_COMM, ERR_COUNT, ERR_ROOT, as_int, convert,
                                     error, is_integral, unsupported)
from shmproxy.mpi.ops import SUM, as_op
from shmproxy.mpi.request import Request
from shmproxy.mpi.status import PROC_NULL

ROOT = -4      # the root's own rank argument in an intercommunicator's rooted collectives


def _empty() -> np.ndarray:
    return np.empty(0, np.uint8)


def _raw(arr: np.ndarray) -> np.ndarray:
    """The bytes of a contiguous array, 1-D, as a view."""
    return arr.reshape(-1).view(np.uint8)


class InterCollectives:
    """Buffer and object collectives across the two groups of an intercommunicator."""

    __slots__ = ()
    _c: Any
    _iw: tuple[int, ...]
    _loff: int
    _lsize: int
    _roff: int
    _rsize: int
    _side: Any

    # ---- arguments
    def _root_of(self, root: Any, name: str) -> int:
        """ROOT, PROC_NULL, or the internal rank of the remote root."""
        root = as_int(root, f"{name}: root", ERR_ROOT)
        if root in (ROOT, PROC_NULL):
            return root
        if not 0 <= root < self._rsize:
            raise error(ERR_ROOT, f"{name} on an intercommunicator: root {root!r} is neither MPI.ROOT, "
                        f"MPI.PROC_NULL nor a rank of the remote group of {self._rsize}")
        return self._roff + root

    def _array(self, spec: Any, what: str, writable: bool, blocks: int = 1) -> np.ndarray:
        """A typed, contiguous, 1-D view of a buffer spec; None is no buffer (an empty one)."""
        if spec is None:
            return _empty()
        if spec is IN_PLACE:
            raise error(ERR_ARG, f"{what}: MPI.IN_PLACE is not defined on an intercommunicator")
        arr = buffers.parse(spec, what, writable, blocks=blocks)
        if type(arr) is not np.ndarray:
            unsupported(f"{what}: derived datatypes and device buffers on an intercommunicator")
        return arr.reshape(-1)

    def _bytes(self, spec: Any, what: str, writable: bool, blocks: int = 1) -> np.ndarray:
        return self._array(spec, what, writable, blocks).view(np.uint8)

    def _blocks(self, spec: Any, what: str, writable: bool) -> tuple[np.ndarray, int]:
        """The bytes of a buffer of one block per remote rank, and the block's size in bytes."""
        b = self._bytes(spec, what, writable, blocks=self._rsize)
        if b.size % self._rsize:
            raise error(ERR_COUNT, f"{what}: {b.size} bytes are not {self._rsize} equal blocks (one per rank "
                        "of the remote group)")
        return b, b.size // self._rsize

    def _vector(self, spec: Any, what: str, writable: bool) -> tuple[np.ndarray, list[int], list[int]]:
        """A vector spec of one block per remote rank: (its bytes, byte counts, byte displacements)."""
        if spec is IN_PLACE or spec is None:
            raise error(ERR_ARG, f"{what}: a vector buffer is needed on an intercommunicator (not "
                        f"{'MPI.IN_PLACE' if spec is IN_PLACE else 'None'})")
        v = buffers.parse_v(spec, what, writable, self._rsize)
        if type(v.array) is not np.ndarray:
            unsupported(f"{what}: derived datatypes on an intercommunicator")
        k = v.array.dtype.itemsize
        return _raw(v.array), [c * k for c in v.counts], [x * k for x in v.displs]

    def _remote(self) -> range:
        return range(self._roff, self._roff + self._rsize)

    # ---- the one mechanism
    def _move(self, sb: np.ndarray, sends: dict[int, tuple[int, int]], rb: np.ndarray,
              recvs: dict[int, tuple[int, int]]) -> Any:
        """Start one internal Alltoallv of bytes: ``sends``/``recvs`` map internal ranks to
        (count, displ) in bytes; every other pair moves nothing. The native request."""
        n = self._c.size
        sc, sd, rc, rd = [0] * n, [0] * n, [0] * n, [0] * n
        for p, (c, d) in sends.items():
            sc[p], sd[p] = c, d
        for p, (c, d) in recvs.items():
            rc[p], rd[p] = c, d
        return self._call(self._c.Ialltoallv, sb, sc, sd, rb, rc, rd)      # type: ignore[attr-defined]

    def _nothing(self) -> Request:
        """A PROC_NULL member's part: the internal collective with zero counts."""
        return Request(self._move(_empty(), {}, _empty(), {}))

    def _folding(self, req: Any, then: Any) -> Request:
        return Request(localred.Folding(self._c, req, then))

    # ---- barrier, broadcast
    def Barrier(self) -> None:
        self._call(self._c.Barrier)       # type: ignore[attr-defined]

    def Ibarrier(self) -> Request:
        return Request(self._call(self._c.Ibarrier))       # type: ignore[attr-defined]

    def Ibcast(self, buf: Any, root: int = 0) -> Request:
        """The root's buf to every rank of the other group."""
        src = self._root_of(root, "Bcast")
        if src == ROOT:
            b = self._bytes(buf, "Bcast buffer", False)
            return Request(self._move(b, {p: (b.size, 0) for p in self._remote()}, _empty(), {}))
        if src == PROC_NULL:
            return self._nothing()
        b = self._bytes(buf, "Bcast buffer", True)
        return Request(self._move(_empty(), {}, b, {src: (b.size, 0)}))

    def Bcast(self, buf: Any, root: int = 0) -> None:
        self.Ibcast(buf, root).Wait()

    # ---- rooted data movement
    def Igather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        """Block j of the root's recvbuf = remote rank j's sendbuf."""
        dst = self._root_of(root, "Gather")
        if dst == ROOT:
            rb, k = self._blocks(recvbuf, "Gather recvbuf", True)
            recvs = {p: (k, k * j) for j, p in enumerate(self._remote())}
            return Request(self._move(_empty(), {}, rb, recvs))
        if dst == PROC_NULL:
            return self._nothing()
        sb = self._bytes(sendbuf, "Gather sendbuf", False)
        return Request(self._move(sb, {dst: (sb.size, 0)}, _empty(), {}))

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        self.Igather(sendbuf, recvbuf, root).Wait()

    def Iscatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        """Remote rank j's recvbuf = block j of the root's sendbuf."""
        src = self._root_of(root, "Scatter")
        if src == ROOT:
            sb, k = self._blocks(sendbuf, "Scatter sendbuf", False)
            sends = {p: (k, k * j) for j, p in enumerate(self._remote())}
            return Request(self._move(sb, sends, _empty(), {}))
        if src == PROC_NULL:
            return self._nothing()
        rb = self._bytes(recvbuf, "Scatter recvbuf", True)
        return Request(self._move(_empty(), {}, rb, {src: (rb.size, 0)}))

    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        self.Iscatter(sendbuf, recvbuf, root).Wait()

    def Igatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        """Remote rank j's sendbuf to block j of the root's vector recvbuf."""
        dst = self._root_of(root, "Gatherv")
        if dst == ROOT:
            rb, counts, displs = self._vector(recvbuf, "Gatherv recvbuf", True)
            recvs = {p: (counts[j], displs[j]) for j, p in enumerate(self._remote())}
            return Request(self._move(_empty(), {}, rb, recvs))
        if dst == PROC_NULL:
            return self._nothing()
        sb = self._bytes(sendbuf, "Gatherv sendbuf", False)
        return Request(self._move(sb, {dst: (sb.size, 0)}, _empty(), {}))

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        self.Igatherv(sendbuf, recvbuf, root).Wait()

    def Iscatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        """Block j of the root's vector sendbuf to remote rank j's recvbuf."""
        src = self._root_of(root, "Scatterv")
        if src == ROOT:
            sb, counts, displs = self._vector(sendbuf, "Scatterv sendbuf", False)
            sends = {p: (counts[j], displs[j]) for j, p in enumerate(self._remote())}
            return Request(self._move(sb, sends, _empty(), {}))
        if src == PROC_NULL:
            return self._nothing()
        rb = self._bytes(recvbuf, "Scatterv recvbuf", True)
        return Request(self._move(_empty(), {}, rb, {src: (rb.size, 0)}))

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        self.Iscatterv(sendbuf, recvbuf, root).Wait()

    # ---- all-to-all data movement
    def Iallgather(self, sendbuf: Any, recvbuf: Any) -> Request:
        """Block j of recvbuf = the sendbuf of remote rank j."""
        sb = self._bytes(sendbuf, "Allgather sendbuf", False)
        rb, k = self._blocks(recvbuf, "Allgather recvbuf", True)    # k: the remote group's sendbuf size
        return Request(self._move(sb, {p: (sb.size, 0) for p in self._remote()}, rb,
                                  {p: (k, k * j) for j, p in enumerate(self._remote())}))

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        self.Iallgather(sendbuf, recvbuf).Wait()

    def Iallgatherv(self, sendbuf: Any, recvbuf: Any) -> Request:
        """Block j of the vector recvbuf = the sendbuf of remote rank j."""
        sb = self._bytes(sendbuf, "Allgatherv sendbuf", False)
        rb, counts, displs = self._vector(recvbuf, "Allgatherv recvbuf", True)
        return Request(self._move(sb, {p: (sb.size, 0) for p in self._remote()}, rb,
                                  {p: (counts[j], displs[j]) for j, p in enumerate(self._remote())}))

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        self.Iallgatherv(sendbuf, recvbuf).Wait()

    def Ialltoall(self, sendbuf: Any, recvbuf: Any) -> Request:
        """Block j of sendbuf to remote rank j; block j of recvbuf from it."""
        sb, ks = self._blocks(sendbuf, "Alltoall sendbuf", False)
        rb, kr = self._blocks(recvbuf, "Alltoall recvbuf", True)
        remote = self._remote()
        return Request(self._move(sb, {p: (ks, ks * j) for j, p in enumerate(remote)}, rb,
                                  {p: (kr, kr * j) for j, p in enumerate(remote)}))

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        self.Ialltoall(sendbuf, recvbuf).Wait()

    def Ialltoallv(self, sendbuf: Any, recvbuf: Any) -> Request:
        """Block j of the vector sendbuf to remote rank j; block j of the vector recvbuf from it."""
        sb, sc, sd = self._vector(sendbuf, "Alltoallv sendbuf", False)
        rb, rc, rd = self._vector(recvbuf, "Alltoallv recvbuf", True)
        remote = self._remote()
        return Request(self._move(sb, {p: (sc[j], sd[j]) for j, p in enumerate(remote)}, rb,
                                  {p: (rc[j], rd[j]) for j, p in enumerate(remote)}))

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        self.Ialltoallv(sendbuf, recvbuf).Wait()

    # ---- reductions: the contributions travel to whoever needs them, who folds them in rank order
    def _rows(self, like: np.ndarray) -> np.ndarray:
        return np.empty((self._rsize, like.size), like.dtype)

    def Ireduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM, root: int = 0) -> Request:
        """The root's recvbuf = op over the remote group's sendbufs."""
        dst = self._root_of(root, "Reduce")
        o = as_op(op, "Reduce")
        if dst == ROOT:
            rb = self._array(recvbuf, "Reduce recvbuf", True)
            rows = self._rows(rb)
            k = rb.nbytes
            req = self._move(_empty(), {}, _raw(rows), {p: (k, k * j) for j, p in enumerate(self._remote())})
            dt = buffers.datatype_named(recvbuf)
            return self._folding(req, lambda: localred._fold(o, rows, self._rsize, rb, dt))
        if dst == PROC_NULL:
            return self._nothing()
        sb = self._bytes(sendbuf, "Reduce sendbuf", False)
        return Request(self._move(sb, {dst: (sb.size, 0)}, _empty(), {}))

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM, root: int = 0) -> None:
        self.Ireduce(sendbuf, recvbuf, op, root).Wait()

    def _allreduce_args(self, name: str, sendbuf: Any, recvbuf: Any, op: Any) -> tuple:
        o = as_op(op, name)
        sb = self._array(sendbuf, f"{name} sendbuf", False)
        rb = self._array(recvbuf, f"{name} recvbuf", True)
        if sb.dtype != rb.dtype or sb.size != rb.size:
            raise error(ERR_BUFFER, f"{name} on an intercommunicator: sendbuf of {sb.size} {sb.dtype}, "
                        f"recvbuf of {rb.size} {rb.dtype}: they must agree")
        return sb, rb, o

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> Request:
        """Every member of one group gets op over the other group's sendbufs."""
        sb, rb, o = self._allreduce_args("Iallreduce", sendbuf, recvbuf, op)
        rows, k = self._rows(rb), rb.nbytes
        remote = self._remote()
        req = self._move(_raw(sb), {p: (k, 0) for p in remote}, _raw(rows),
                         {p: (k, k * j) for j, p in enumerate(remote)})
        dt = buffers.datatype_named(recvbuf)
        return self._folding(req, lambda: localred._fold(o, rows, self._rsize, rb, dt))

    def _side_comm(self) -> Any:
        if self._side is None:
            self._side = self._call(self._c.Split, 0 if self._loff == 0 else 1, self._c.rank)  # type: ignore
        return self._side

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        """As Iallreduce; a group reduces its own sendbufs first (on its side communicator), so that
        each rank receives one vector, not one per remote rank."""
        sb, rb, o = self._allreduce_args("Allreduce", sendbuf, recvbuf, op)
        side = self._side_comm()
        partial = np.empty_like(rb)
        native = self._native_op(o, sb, rb)      # type: ignore[attr-defined]
        if native is None:      # an op or type the engine lacks: this group's ranks fold it
            try:
                folding = localred.allreduce(side, sb, partial, o, buffers.datatype_named(recvbuf))
            except errors.ProxyError as exc:
                raise convert(exc) from None
            Request(folding).Wait()
        else:
            self._call(side.Allreduce, sb, partial, native)    # type: ignore[attr-defined]
        pb, rbb = _raw(partial), _raw(rb)
        sends = {p: (pb.size, 0) for p in self._remote()} if self._c.rank == self._loff else {}
        Request(self._move(pb, sends, rbb, {self._roff: (rbb.size, 0)})).Wait()

    def Ireduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> Request:
        """Local rank i's recvbuf = op over block i of the remote group's sendbufs: a rank cuts its
        sendbuf into remote_size equal blocks and sends block j to remote rank j."""
        o = as_op(op, "Reduce_scatter_block")
        sb = self._array(sendbuf, "Reduce_scatter_block sendbuf", False)
        rb = self._array(recvbuf, "Reduce_scatter_block recvbuf", True)
        if sb.size % self._rsize:
            raise error(ERR_COUNT, f"Reduce_scatter_block on an intercommunicator: sendbuf of {sb.size} "
                        f"elements is not {self._rsize} equal blocks (one per remote rank)")
        ks, kr = sb.nbytes // self._rsize, rb.nbytes
        rows, remote = self._rows(rb), self._remote()
        req = self._move(_raw(sb), {p: (ks, ks * j) for j, p in enumerate(remote)}, _raw(rows),
                         {p: (kr, kr * j) for j, p in enumerate(remote)})
        dt = buffers.datatype_named(recvbuf)
        return self._folding(req, lambda: localred._fold(o, rows, self._rsize, rb, dt))

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        self.Ireduce_scatter_block(sendbuf, recvbuf, op).Wait()

    def Ireduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = SUM) -> Request:
        """recvcounts: this group's blocks (one count per local rank; left out, each rank's recvbuf
        size, mpi4py's rule). Local rank i gets op over block i of the remote group's sendbufs. The
        counts every rank receives are exchanged first (an internal Allgather, blocking even here: the
        remote group cuts its sendbufs by them)."""
        o = as_op(op, "Reduce_scatter")
        sb = self._array(sendbuf, "Reduce_scatter sendbuf", False)
        rb = self._array(recvbuf, "Reduce_scatter recvbuf", True)
        if recvcounts is None:
            mine = rb.size
        else:
            try:
                counts = None if is_integral(recvcounts) else list(recvcounts)
            except TypeError:
                counts = None
            if counts is None or len(counts) != self._lsize:
                raise error(ERR_COUNT, f"Reduce_scatter: recvcounts must be a sequence of {self._lsize} "
                            f"counts (one per rank of the local group), got {recvcounts!r}")
            counts = [buffers.as_count(c, "recvcount", "Reduce_scatter") for c in counts]
            if sb.size != sum(counts):
                raise error(ERR_COUNT, f"Reduce_scatter: sendbuf has {sb.size} elements, the recvcounts add "
                            f"up to {sum(counts)}")
            mine = counts[self._c.rank - self._loff]
            if mine > rb.size:
                raise error(ERR_COUNT, f"Reduce_scatter: recvcount {mine} for a recvbuf of {rb.size} "
                            "elements")
        # every rank's (recvcount, sendbuf size): each rank checks every rank's sendbuf against the
        # counts of the group it sends to, so that all raise together or none does
        every = np.empty((self._c.size, 2), np.int64)
        self._call(self._c.Allgather, np.array([mine, sb.size], np.int64), every)   # type: ignore
        cut = self._lsize if self._loff == 0 else self._rsize    # internal [0, cut): the first group
        need = (int(every[cut:, 0].sum()), int(every[:cut, 0].sum()))   # what each group's senders cut
        short = [p for p in range(self._c.size) if every[p, 1] < need[0 if p < cut else 1]]
        if short:
            worlds = [self._iw[p] for p in short]
            raise error(ERR_COUNT, f"Reduce_scatter on an intercommunicator: the sendbufs of COMM_WORLD "
                        f"ranks {worlds} are shorter than the other group's recvcounts add up to")
        theirs = [int(c) for c in every[self._roff:self._roff + self._rsize, 0]]
        isz = sb.dtype.itemsize
        sends, at = {}, 0
        for j, p in enumerate(self._remote()):
            sends[p] = (theirs[j] * isz, at * isz)
            at += theirs[j]
        out = rb[:mine]
        rows, k = self._rows(out), out.nbytes
        req = self._move(_raw(sb), sends, _raw(rows), {p: (k, k * j) for j, p in enumerate(self._remote())})
        dt = buffers.datatype_named(recvbuf)
        return self._folding(req, lambda: localred._fold(o, rows, self._rsize, out, dt))

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = SUM) -> None:
        self.Ireduce_scatter(sendbuf, recvbuf, recvcounts, op).Wait()

    def _no_scan(self, name: str) -> Any:
        raise error(ERR_COMM, f"{name} is not defined on an intercommunicator (MPI defines it on "
                    "intracommunicators only)")

    def Scan(self, *a: Any, **k: Any) -> None:
        self._no_scan("Scan")

    def Iscan(self, *a: Any, **k: Any) -> Request:
        return self._no_scan("Iscan")

    def Exscan(self, *a: Any, **k: Any) -> None:
        self._no_scan("Exscan")

    def Iexscan(self, *a: Any, **k: Any) -> Request:
        return self._no_scan("Iexscan")

    def scan(self, *a: Any, **k: Any) -> Any:
        return self._no_scan("scan")

    def exscan(self, *a: Any, **k: Any) -> Any:
        return self._no_scan("exscan")

    # ---- the object layer
    def _exchange(self, payloads: list[bytes], dests: dict[int, int]) -> dict[int, Any]:
        """Collective over both groups: payloads[dests[p]] to internal rank p; what every rank sent
        this one, by internal rank (a pickle is never empty, so a zero count means nothing)."""
        n = self._c.size
        at, start = [], 0
        for data in payloads:
            at.append(start)
            start += len(data)
        sizes = np.zeros(n, np.int64)
        sends = {}
        for p, i in dests.items():
            sizes[p] = len(payloads[i])
            sends[p] = (len(payloads[i]), at[i])
        got = np.empty(n, np.int64)
        self._call(self._c.Alltoall, sizes, got)    # type: ignore[attr-defined]
        recvs, total = {}, 0
        for p in range(n):
            if got[p]:
                recvs[p] = (int(got[p]), total)
                total += int(got[p])
        sb = np.frombuffer(b"".join(payloads), np.uint8) if payloads else _empty()
        rb = np.empty(total, np.uint8)
        Request(self._move(sb, sends, rb, recvs)).Wait()
        return {p: rb[d:d + c] for p, (c, d) in recvs.items()}

    @staticmethod
    def _dumps(obj: Any) -> bytes:
        return pickle.dumps(obj, protocol=5)

    def _from_remote(self, got: dict[int, Any]) -> list:
        """The objects of every remote rank, in remote rank order."""
        missing = [p - self._roff for p in self._remote() if p not in got]
        if missing:
            raise error(ERR_ARG, f"no object came from remote ranks {missing}: the groups' calls disagree")
        return [pickle.loads(got[p]) for p in self._remote()]

    def barrier(self) -> None:
        self.Barrier()

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        """The root's object on every rank of the other group; None in the root's group."""
        src = self._root_of(root, "bcast")
        if src == ROOT:
            self._exchange([self._dumps(obj)], {p: 0 for p in self._remote()})
            return None
        if src == PROC_NULL:
            self._exchange([], {})
            return None
        got = self._exchange([], {})
        if src not in got:
            raise error(ERR_ROOT, f"bcast: remote rank {src - self._roff} is not the root the other group "
                        "named")
        return pickle.loads(got[src])

    def gather(self, sendobj: Any, root: int = 0) -> list | None:
        """The root gets the remote group's objects in rank order; everyone else None."""
        dst = self._root_of(root, "gather")
        if dst == ROOT:
            return self._from_remote(self._exchange([], {}))
        if dst == PROC_NULL:
            self._exchange([], {})
            return None
        self._exchange([self._dumps(sendobj)], {dst: 0})
        return None

    def scatter(self, sendobj: Any = None, root: int = 0) -> Any:
        """Item j of the root's sequence to remote rank j; None in the root's group."""
        src = self._root_of(root, "scatter")
        if src == ROOT:
            items = [None] * self._rsize if sendobj is None else list(sendobj)   # None: one None each
            if len(items) != self._rsize:
                raise error(ERR_ARG, f"scatter: the root needs a sequence of {self._rsize} objects (one per "
                            f"remote rank), got {len(items)}")
            self._exchange([self._dumps(x) for x in items], {p: j for j, p in enumerate(self._remote())})
            return None
        got = self._exchange([], {})
        if src == PROC_NULL:
            return None
        if src not in got:
            raise error(ERR_ROOT, f"scatter: remote rank {src - self._roff} is not the root the other group "
                        "named")
        return pickle.loads(got[src])

    def allgather(self, sendobj: Any) -> list:
        """The remote group's objects, in remote rank order."""
        got = self._exchange([self._dumps(sendobj)], {p: 0 for p in self._remote()})
        return self._from_remote(got)

    def alltoall(self, sendobj: Any) -> list:
        """Item j of this rank's sequence to remote rank j; item j of the result from it."""
        items = [None] * self._rsize if sendobj is None else list(sendobj)   # None: one None per rank
        if len(items) != self._rsize:
            raise error(ERR_ARG, f"alltoall: expected a sequence of {self._rsize} objects (one per remote "
                        f"rank), got {len(items)}")
        got = self._exchange([self._dumps(x) for x in items], {p: j for j, p in enumerate(self._remote())})
        return self._from_remote(got)

    @staticmethod
    def _fold_objects(o: Any, values: list) -> Any:
        acc = values[0]
        for v in values[1:]:
            acc = o(acc, v)
        return acc

    def allreduce(self, sendobj: Any, op: Any = SUM) -> Any:
        """op over the remote group's objects, in remote rank order."""
        o = as_op(op, "allreduce")
        return self._fold_objects(o, self.allgather(sendobj))

    def reduce(self, sendobj: Any, op: Any = SUM, root: int = 0) -> Any:
        """The root gets op over the remote group's objects, in remote rank order; the others None."""
        dst = self._root_of(root, "reduce")
        o = as_op(op, "reduce")
        values = self.gather(sendobj, dst if dst in (ROOT, PROC_NULL) else dst - self._roff)
        return None if values is None else self._fold_objects(o, values)
