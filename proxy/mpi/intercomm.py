"""Intercommunicators (Intracomm.Create_intercomm, mpi4py's Intercomm) over one merged native
communicator.

Create_intercomm: the two leaders swap their groups (world ranks), their local communicator's id and
a per-communicator count over ``peer_comm`` with ``tag``; each leader broadcasts what it got over its
local communicator. Every member of both groups then joins one native communicator of both groups,
whose id both sides derive from the same two (id, count) pairs. Its rank order is fixed: the group
whose leader has the lower COMM_WORLD rank first, then the other; a rank of the remote group r is
internal rank ``roff + r``. Everything the intercommunicator does goes through that communicator:

- point-to-point: the peer (a remote rank) is mapped to its internal rank, and the source in a
  receive's status back to a remote rank (only the remote group ever sends to us on it);
- Barrier: the internal Barrier;
- Bcast (root MPI.ROOT on the root, MPI.PROC_NULL on the rest of its group, the root's remote rank
  in the other group), Allgather: one internal Alltoallv whose counts are zero except between the
  sending and receiving ranks (a PROC_NULL member takes part with zero counts, so it needs to know
  neither the root nor the size). They move bytes, so the two groups' buffers need only agree in
  size, as MPI requires;
- Allreduce: each group reduces its own contributions on a native communicator of its members (a
  Split of the internal one, made on first use: collective over both groups, like the call), then
  one internal Alltoallv takes each group's result from its leader to every member of the other.
- Merge(high): an Allgather of the flags over the internal communicator, then a Split of it with keys
  that put the group that passed high=False first (on a tie, the internal order).
Collectives beyond these raise NotImplementedError naming themselves.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from shmproxy.core import errors
from shmproxy.core.ops import ANY_SOURCE, ANY_TAG, IN_PLACE
from shmproxy.mpi import buffers, localred
from shmproxy.mpi.comm import Comm, Intracomm
from shmproxy.mpi.exceptions import (ERR_ARG, ERR_BUFFER, ERR_COUNT, ERR_RANK, ERR_ROOT, ERR_TAG, as_int,
                                     convert, error, unsupported)
from shmproxy.mpi.ops import SUM
from shmproxy.mpi.p2p import PointToPoint
from shmproxy.mpi.group import Group
from shmproxy.mpi.request import Request
from shmproxy.mpi.status import PROC_NULL, Status

ROOT = -4      # the root's own rank argument in an intercommunicator's rooted collectives


class _Shifted:
    """A native receive request whose status reports the source as a remote rank."""

    __slots__ = ("_r", "_off")

    def __init__(self, native: Any, off: int):
        self._r, self._off = native, off

    def Wait(self) -> Any:
        return self._r.Wait()

    def Test(self) -> Any:
        return self._r.Test()

    def Cancel(self) -> Any:
        return self._r.Cancel()

    def describe(self) -> str:
        return self._r.describe()

    @property
    def _comm(self) -> Any:     # for Waitany/Waitsome, which sleep on a request's communicator
        return self._r._comm

    @property
    def status(self) -> Any:
        st = self._r.status
        if st is None:
            return None
        s = Status()
        s._fill(st)
        if s.source >= 0:
            s.source -= self._off
        return s


class Intercomm(Comm):
    """Two disjoint groups; ranks name processes of the remote group (mpi4py's MPI.Intercomm)."""

    __slots__ = ("_iw", "_loff", "_lsize", "_roff", "_rsize", "_side")

    def _setup(self, iw: tuple[int, ...], loff: int, lsize: int, roff: int, rsize: int) -> None:
        self._iw, self._loff, self._lsize, self._roff, self._rsize = iw, loff, lsize, roff, rsize
        self._side = None

    # ---- queries
    def Get_rank(self) -> int:
        return self._c.rank - self._loff

    def Get_size(self) -> int:
        return self._lsize

    @property
    def rank(self) -> int:
        return self.Get_rank()

    @property
    def size(self) -> int:
        return self._lsize

    def Get_remote_size(self) -> int:
        return self._rsize

    @property
    def remote_size(self) -> int:
        return self._rsize

    def Get_group(self) -> Group:
        return Group(self._iw[self._loff:self._loff + self._lsize], self._iw[self._c.rank])

    def Get_remote_group(self) -> Group:
        return Group(self._iw[self._roff:self._roff + self._rsize], self._iw[self._c.rank])

    @property
    def remote_group(self) -> Group:
        return self.Get_remote_group()

    @property
    def is_inter(self) -> bool:
        return True

    @property
    def is_intra(self) -> bool:
        return False

    def Is_inter(self) -> bool:
        return True

    def Is_intra(self) -> bool:
        return False

    # ---- point-to-point: remote ranks <-> internal ranks
    def _peer(self, peer: Any, what: str, wildcard: bool = False) -> int:
        peer = as_int(peer, what, ERR_RANK)
        if peer == PROC_NULL or (wildcard and peer == ANY_SOURCE):
            return peer
        if not 0 <= peer < self._rsize:
            raise error(ERR_RANK, f"{what} {peer} out of range: the remote group has {self._rsize} ranks")
        return peer + self._roff

    def _shift(self, status: Status | None) -> None:
        if status is not None and status.source >= 0:
            status.source -= self._roff

    # the general paths: the fast ones pass peers to the native call unmapped (p2p.py)
    Send = Rsend = PointToPoint._send
    Isend = Irsend = PointToPoint._isend

    def Recv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG,
             status: Status | None = None) -> None:
        self._recv(buf, source, tag, status)
        self._shift(status)

    def recv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG,
             status: Status | None = None) -> Any:
        obj = super().recv(buf, source, tag, status)
        self._shift(status)
        return obj

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = ANY_SOURCE, recvtag: int = ANY_TAG, status: Status | None = None) -> None:
        super().Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)
        self._shift(status)

    def Probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None) -> bool:
        out = super().Probe(source, tag, status)
        self._shift(status)
        return out

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None) -> bool:
        out = super().Iprobe(source, tag, status)
        if out:
            self._shift(status)
        return out

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        req = self._irecv(buf, source, tag)
        if req._r is not None:
            req._r = _Shifted(req._r, self._roff)
        return req

    # ---- collectives on the internal communicator
    def Barrier(self) -> None:
        self._call(self._c.Barrier)

    def barrier(self) -> None:
        self.Barrier()

    def _bytes(self, spec: Any, what: str, writable: bool, blocks: int = 1) -> np.ndarray:
        if spec is None:
            return np.empty(0, np.uint8)
        arr = buffers.parse(spec, what, writable, blocks=blocks)
        if not isinstance(arr, np.ndarray):
            raise error(ERR_BUFFER, f"{what}: an intercommunicator collective needs a buffer, not {arr!r}")
        return arr.view(np.uint8)

    def _move(self, sb: np.ndarray, sends: dict[int, tuple[int, int]], rb: np.ndarray,
              recvs: dict[int, tuple[int, int]]) -> Any:
        """One internal Alltoallv of bytes: ``sends``/``recvs`` map internal ranks to (count, displ)."""
        n = self._c.size
        sc, sd, rc, rd = [0] * n, [0] * n, [0] * n, [0] * n
        for p, (c, d) in sends.items():
            sc[p], sd[p] = c, d
        for p, (c, d) in recvs.items():
            rc[p], rd[p] = c, d
        return self._call(self._c.Ialltoallv, sb, sc, sd, rb, rc, rd)

    def _remote(self) -> range:
        return range(self._roff, self._roff + self._rsize)

    def Ibcast(self, buf: Any, root: int = 0) -> Request:
        root = as_int(root, "root", ERR_ROOT)
        if root == ROOT:
            b = self._bytes(buf, "Bcast buffer", False)
            return Request(self._move(b, {p: (b.size, 0) for p in self._remote()}, b[:0], {}))
        if root == PROC_NULL:
            empty = np.empty(0, np.uint8)
            return Request(self._move(empty, {}, empty, {}))
        if not 0 <= root < self._rsize:
            raise error(ERR_ROOT, f"Bcast on an intercommunicator: root {root!r} is neither MPI.ROOT, "
                        f"MPI.PROC_NULL nor a rank of the remote group of {self._rsize}")
        b = self._bytes(buf, "Bcast buffer", True)
        return Request(self._move(b[:0], {}, b, {self._roff + root: (b.size, 0)}))

    def Bcast(self, buf: Any, root: int = 0) -> None:
        self.Ibcast(buf, root).Wait()

    def Iallgather(self, sendbuf: Any, recvbuf: Any) -> Request:
        """Block j of recvbuf = the sendbuf of remote rank j."""
        sb = self._bytes(sendbuf, "Allgather sendbuf", False)
        rb = self._bytes(recvbuf, "Allgather recvbuf", True, blocks=self._rsize)
        if rb.size != sb.size * self._rsize:
            raise error(ERR_COUNT, f"Allgather on an intercommunicator: recvbuf of {rb.size} bytes for "
                        f"{self._rsize} remote blocks of {sb.size}")
        k = sb.size
        return Request(self._move(sb, {p: (k, 0) for p in self._remote()}, rb,
                                  {p: (k, k * j) for j, p in enumerate(self._remote())}))

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        self.Iallgather(sendbuf, recvbuf).Wait()

    def _side_comm(self) -> Any:
        if self._side is None:
            self._side = self._call(self._c.Split, 0 if self._loff == 0 else 1, self._c.rank)
        return self._side

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        """Every member of one group gets op over the other group's sendbufs."""
        if sendbuf is IN_PLACE:
            raise error(ERR_ARG, "Allreduce on an intercommunicator: IN_PLACE is not defined")
        sb, rb, o = self._reduce_args("Allreduce", sendbuf, recvbuf, op)
        side = self._side_comm()
        partial = np.empty_like(rb)
        native = self._native_op(o, sb, rb)
        if native is None:      # an op or type the engine lacks: this group's ranks reduce it
            try:
                folding = localred.allreduce(side, sb.reshape(-1), partial.reshape(-1), o, None)
            except errors.ProxyError as exc:
                raise convert(exc) from None
            Request(folding).Wait()
        else:
            self._call(side.Allreduce, sb, partial, native)
        pb, rbb = partial.view(np.uint8), rb.view(np.uint8)
        sends = {p: (pb.size, 0) for p in self._remote()} if self._c.rank == self._loff else {}
        Request(self._move(pb, sends, rbb, {self._roff: (rbb.size, 0)})).Wait()

    def Merge(self, high: bool = False) -> Intracomm:
        """Collective over both groups: one intracommunicator of all, the group that passed
        high=False first (both the same: this intercommunicator's internal order)."""
        flags = np.zeros(self._c.size, np.int64)
        self._call(self._c.Allgather, np.array([1 if high else 0], np.int64), flags)
        mine, theirs = int(flags[self._c.rank]), int(flags[self._roff])
        first = mine < theirs or (mine == theirs and self._loff == 0)
        key = (0 if first else self._c.size) + self._c.rank - self._loff
        native = self._call(self._c.Split, 0, key)
        return Intracomm(native, tuple(self._iw[r] for r in native.parent_ranks))

    def Free(self) -> None:
        side = self._side
        if side is not None:
            self._side = None
            self._call(side.close)
        super().Free()

    def Dup(self, info: Any = None) -> Any:
        unsupported("Intercomm.Dup", "create another intercommunicator with Create_intercomm")

    def __repr__(self) -> str:
        return f"<MPI.Intercomm rank {self.Get_rank()}/{self._lsize}, remote {self._rsize}>"


def _not_inter(name: str) -> Any:
    def call(self: Any, *_a: Any, **_k: Any) -> Any:
        unsupported(f"Intercomm.{name}", "intercommunicators have Barrier, Bcast, Allgather and Allreduce")
    call.__name__ = name
    return call


for _name in ("Reduce", "Ireduce", "Iallreduce", "Gather", "Igather", "Scatter", "Iscatter", "Gatherv",
              "Igatherv", "Scatterv", "Iscatterv", "Allgatherv", "Iallgatherv", "Alltoall", "Ialltoall",
              "Alltoallv", "Ialltoallv", "Reduce_scatter", "Ireduce_scatter", "Reduce_scatter_block",
              "Ireduce_scatter_block", "Scan", "Iscan", "Exscan", "Iexscan", "Ibarrier", "bcast", "gather",
              "allgather", "allreduce", "reduce", "scatter", "alltoall", "Split", "Split_type", "Create",
              "Create_group"):
    setattr(Intercomm, _name, _not_inter(_name))


def create_intercomm(comm: Any, local_leader: int, peer_comm: Any, remote_leader: int,
                     tag: int = 0) -> Intercomm:
    """Intracomm.Create_intercomm: collective over this communicator and the remote group's."""
    from shmproxy.control import bootstrap
    from shmproxy.rank.comm import Comm as NativeComm
    c = comm._c
    local_leader = comm._peer(local_leader, "local_leader")
    tag = as_int(tag, "Create_intercomm: tag", ERR_TAG)     # in the new id: True and 1 must agree
    counters = c.__dict__.setdefault("_mpi_intercomm_count", [0])
    counters[0] += 1
    mine = (tuple(comm._wranks), int(c._comm_id), counters[0], local_leader)
    theirs = None
    if c.rank == local_leader:
        if peer_comm is None or not peer_comm:
            raise error(ERR_ARG, "Create_intercomm: the local leader needs a peer communicator")
        theirs = peer_comm.sendrecv(mine, dest=remote_leader, sendtag=tag, source=remote_leader, recvtag=tag)
    theirs = comm.bcast(theirs, root=local_leader)
    if set(mine[0]) & set(theirs[0]):
        both = sorted(set(mine[0]) & set(theirs[0]))
        raise error(ERR_ARG, f"Create_intercomm: the groups overlap ({both})")
    me_first = mine[0][mine[3]] < theirs[0][theirs[3]]     # the lower leader's group first
    a, b = (mine, theirs) if me_first else (theirs, mine)
    iw = a[0] + b[0]
    text = f"inter/{a[1]}/{a[2]}/{b[1]}/{b[2]}/{tag}"
    digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
    comm_id = int.from_bytes(digest, "little") & 0x7FFFFFFF or 1
    loff = 0 if me_first else len(a[0])
    roff = len(a[0]) if me_first else 0
    me = loff + c.rank
    info = bootstrap.LaunchInfo(rank=me, size=len(iw), local_rank=me, local_size=len(iw), launcher="split")
    try:
        native = NativeComm._create(info, c.params, comm_id, key=c._job_key)
    except errors.ProxyError as exc:
        raise convert(exc) from None
    native.parent_ranks = []
    inter = Intercomm(native, tuple(comm._wranks))
    inter._setup(tuple(iw), loff, len(mine[0]), roff, len(theirs[0]))
    return inter
