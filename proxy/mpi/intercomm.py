"""Intercommunicators (Intracomm.Create_intercomm, Intercomm.Create_from_groups, mpi4py's Intercomm)
over one merged native communicator.

Create_intercomm: the two leaders swap their groups (world ranks), their local communicator's id and
a per-communicator count over ``peer_comm`` with ``tag``; each leader broadcasts what it got over its
local communicator. Every member of both groups then joins one native communicator of both groups,
whose id both sides derive from the same two (id, count) pairs. Its rank order is fixed: the group
whose leader has the lower COMM_WORLD rank first, then the other; a rank of the remote group r is
internal rank ``roff + r``. Everything the intercommunicator does goes through that communicator:

- point-to-point: the peer (a remote rank) is mapped to its internal rank, and the source in a
  receive's status back to a remote rank (only the remote group ever sends to us on it);
- collectives (Barrier, Bcast, Gather(v), Scatter(v), Allgather(v), Alltoall(v), Reduce, Allreduce,
  Reduce_scatter(_block), their I forms, and the object layer's): intercoll.py, whose header says
  what each does; in short, one internal Alltoallv whose counts are zero except between the ranks
  of one group that send and those of the other that receive;
- Create_from_groups(local_group, local_leader, remote_group, remote_leader, stringtag): collective
  over the members of both groups only; they join one native communicator of both (the group of the
  lower leader first) whose id they derive from the two groups and ``stringtag``, as
  Intracomm.Create_from_group does from one;
- Dup: the internal communicator's Dup, the same layout;
- Split(color, key): an internal Allgather of every rank's (color, key), then one internal Split
  whose keys keep the first group first and each group in (key, rank) order: an intercommunicator
  of the ranks of each group that passed the same color, COMM_NULL where a color is UNDEFINED or
  the other group has no rank of it (MPI's rule). Split_type(COMM_TYPE_SHARED) is Split(0, key) on
  one node; Create(group) is a Split by membership (each group passes its own subgroup);
- Merge(high): an Allgather of the flags over the internal communicator, then a Split of it with keys
  that put the group that passed high=False first (on a tie, the internal order);
- Compare: IDENT (one communicator), CONGRUENT (same local and remote groups in the same order),
  SIMILAR (same members), UNEQUAL.

Create_group (MPI defines it on intracommunicators) raises ERR_COMM; the topologies and the
neighbour collectives are not defined on intercommunicators either.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from shmproxy.core import errors
from shmproxy.core.ops import ANY_SOURCE, ANY_TAG, UNDEFINED
from shmproxy.mpi.comm import COMM_NULL, Comm, Intracomm, _member_comm
from shmproxy.mpi.exceptions import (ERR_ARG, ERR_COMM, ERR_GROUP, ERR_RANK, ERR_TAG, as_int, convert, error,
                                     unsupported)
from shmproxy.mpi.group import CONGRUENT, SIMILAR, UNEQUAL, Group
from shmproxy.mpi.intercoll import ROOT, InterCollectives
from shmproxy.mpi.p2p import PointToPoint
from shmproxy.mpi.request import Request
from shmproxy.mpi.status import PROC_NULL, Status

__all__ = ["ROOT", "Intercomm", "create_intercomm", "compare"]


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


class Intercomm(InterCollectives, Comm):
    """Two disjoint groups; ranks name processes of the remote group (mpi4py's MPI.Intercomm)."""

    __slots__ = ("_iw", "_loff", "_lsize", "_roff", "_rsize", "_side")
    _iw: tuple[int, ...]
    _side: Any          # this group's own communicator, made on first use (intercoll.py)

    def __init__(self, native: Any = None, world_ranks: tuple[int, ...] = (), name: str = ""):
        """``MPI.Intercomm(inter)``: a second handle of ``inter`` (an intracommunicator: TypeError)."""
        if isinstance(native, Comm) and not isinstance(native, Intercomm):
            raise TypeError(f"MPI.Intercomm() takes an intercommunicator, not {type(native).__name__}")
        super().__init__(native, world_ranks, name)
        if isinstance(native, Intercomm) and native:
            self._setup(native._iw, native._loff, native._lsize, native._roff, native._rsize)
            self._side = native._side

    def __getattr__(self, name: str) -> Any:
        # only reached for a slot never set: the layout of a null intercommunicator (MPI.Intercomm())
        if name in Intercomm.__slots__:
            raise error(ERR_COMM, "invalid communicator (a null intercommunicator)")
        return super().__getattr__(name)

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
        self._c   # a null handle raises ERR_COMM
        return True

    def Is_intra(self) -> bool:
        self._c
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

    def Sendrecv_replace(self, buf: Any, dest: int, sendtag: int = 0, source: int = ANY_SOURCE,
                         recvtag: int = ANY_TAG, status: Status | None = None) -> None:
        super().Sendrecv_replace(buf, dest, sendtag, source, recvtag, status)
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
        side = self._side if self else None
        if side is not None:
            self._side = None
            self._call(side.close)
        super().Free()

    # ---- new intercommunicators
    def _like(self, native: Any, iw: tuple[int, ...], loff: int, lsize: int, roff: int,
              rsize: int) -> "Intercomm":
        inter = Intercomm(native, iw[loff:loff + lsize])
        inter._setup(iw, loff, lsize, roff, rsize)
        return inter

    def Dup(self, info: Any = None) -> "Intercomm":
        """Collective over both groups: the same groups in the same order, a new context; it keeps
        this one's hints, or ``info``'s."""
        try:
            native = self._c.Dup()
        except errors.ProxyError as exc:
            raise convert(exc) from None
        dup = self._like(native, self._iw, self._loff, self._lsize, self._roff, self._rsize)
        dup._info = dict(info.items()) if info else dict(self._info)
        return dup

    def Split(self, color: int = 0, key: int = 0) -> Any:
        """Collective over both groups: each group splits by color, ordered by (key, rank), and the
        parts of one color in the two groups form an intercommunicator; COMM_NULL for UNDEFINED or a
        color the other group lacks."""
        color, key = as_int(color, "Split: color"), as_int(key, "Split: key")
        if color < 0 and color != UNDEFINED:
            raise error(ERR_ARG, f"Split: color must be >= 0 or MPI.UNDEFINED, got {color}")
        c = self._c
        n = c.size
        table = np.zeros((n, 2), np.int64)
        self._call(c.Allgather, np.array([color, key], np.int64), table)
        cut = self._lsize if self._loff == 0 else self._rsize   # internal [0, cut): the first group

        def part(lo: int, hi: int) -> list[int]:
            return sorted((r for r in range(lo, hi) if table[r, 0] == color), key=lambda r: (table[r, 1], r))
        a, b = part(0, cut), part(cut, n)
        if color == UNDEFINED or not a or not b:
            self._call(c.Split, UNDEFINED, 0)
            return COMM_NULL
        order = a + b
        native = self._call(c.Split, color, order.index(c.rank))
        iw = tuple(self._iw[r] for r in native.parent_ranks)
        mine, theirs = (a, b) if self._loff == 0 else (b, a)
        loff, roff = (0, len(a)) if self._loff == 0 else (len(a), 0)
        return self._like(native, iw, loff, len(mine), roff, len(theirs))

    def Split_type(self, split_type: int, key: int = 0, info: Any = None) -> Any:
        """COMM_TYPE_SHARED: the ranks of this node in each group, which on one node is everyone."""
        from shmproxy.mpi.env import COMM_TYPE_SHARED
        split_type = as_int(split_type, "Split_type: split_type")
        if split_type not in (UNDEFINED, COMM_TYPE_SHARED):
            unsupported(f"Intercomm.Split_type({split_type})", "only COMM_TYPE_SHARED exists")
        return self.Split(UNDEFINED if split_type == UNDEFINED else 0, key)

    def Create(self, group: Group) -> Any:
        """Collective over both groups, each passing a subgroup of its own: the intercommunicator of
        the two subgroups (in group order) on their members, COMM_NULL elsewhere."""
        self._check_group(group, "Create")
        key = group._index.get(self._iw[self._c.rank])
        return self.Split(UNDEFINED if key is None else 0, key or 0)

    def Create_group(self, group: Group, tag: int = 0) -> Any:
        raise error(ERR_COMM, "Create_group is defined on intracommunicators only (MPI); use Create")

    @classmethod
    def Create_from_groups(cls, local_group: Group, local_leader: int, remote_group: Group,
                           remote_leader: int, stringtag: str = "org.mpi4py", info: Any = None,
                           errhandler: Any = None) -> "Intercomm":
        """MPI 4's intercommunicator from two groups, collective over their members only."""
        from shmproxy.mpi.env import _native_world
        for what, g in (("local_group", local_group), ("remote_group", remote_group)):
            if not isinstance(g, Group):
                raise error(ERR_GROUP, f"Create_from_groups: {what} must be an MPI.Group, got "
                            f"{type(g).__name__}")
        if not isinstance(stringtag, str):
            raise TypeError(f"Create_from_groups: stringtag is a str, not {type(stringtag).__name__}")
        mine, theirs = tuple(local_group.members), tuple(remote_group.members)
        ll = as_int(local_leader, "Create_from_groups: local_leader", ERR_RANK)
        rl = as_int(remote_leader, "Create_from_groups: remote_leader", ERR_RANK)
        if not 0 <= ll < len(mine):
            raise error(ERR_RANK, f"Create_from_groups: local_leader {ll} is not a rank of the local group "
                        f"of {len(mine)}")
        if not 0 <= rl < len(theirs):
            raise error(ERR_RANK, f"Create_from_groups: remote_leader {rl} is not a rank of the remote group "
                        f"of {len(theirs)}")
        if set(mine) & set(theirs):
            both = sorted(set(mine) & set(theirs))
            raise error(ERR_GROUP, f"Create_from_groups: the groups overlap ({both})")
        world = _native_world()
        if world.rank not in local_group._index:
            raise error(ERR_GROUP, f"Create_from_groups: rank {world.rank} of COMM_WORLD is not in the "
                        "local group")
        me_first = mine[ll] < theirs[rl]
        iw = mine + theirs if me_first else theirs + mine
        try:
            native = _member_comm(world, list(iw), f"inter_from_groups/{stringtag}")
        except errors.ProxyError as exc:
            raise convert(exc) from None
        loff, roff = (0, len(mine)) if me_first else (len(theirs), 0)
        inter = cls(native, mine)
        inter._setup(iw, loff, len(mine), roff, len(theirs))
        inter._info = dict(info.items()) if info else {}
        return inter

    def __repr__(self) -> str:
        if not self:
            return "<MPI.Intercomm COMM_NULL>"
        return f"<MPI.Intercomm rank {self.Get_rank()}/{self._lsize}, remote {self._rsize}>"


def compare(a: Comm, b: Comm) -> int:
    """Comm.Compare where either is an intercommunicator (not the same one): CONGRUENT where both are
    intercommunicators of the same local and remote groups in the same order, SIMILAR where the
    members agree, else UNEQUAL."""
    if not (isinstance(a, Intercomm) and isinstance(b, Intercomm)):
        return UNEQUAL
    la, lb = a.Get_group().members, b.Get_group().members
    ra, rb = a.Get_remote_group().members, b.Get_remote_group().members
    if la == lb and ra == rb:
        return CONGRUENT
    return SIMILAR if set(la) == set(lb) and set(ra) == set(rb) else UNEQUAL


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
