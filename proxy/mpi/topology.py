"""Cartesian topologies in pure Python: a Cartcomm is a native communicator (from Split) plus its
dims and periods; coordinates, ranks, shifts and sub-grids are arithmetic on them, in row-major
order as MPI defines. ``reorder`` is accepted and ignored (every rank keeps its rank: one node).

Topocomm is the base of every topology (Cartcomm here, Graphcomm and Distgraphcomm in graph.py): the
neighbourhood queries (degrees, inedges, outedges) and the neighbour collectives (neighbor.py), which
each topology feeds with its edges. A Cartesian rank's neighbours are, per dimension, the negative
then the positive neighbour (PROC_NULL past a non-periodic border), both as sources and destinations.
"""
from __future__ import annotations

from typing import Any, Sequence

from shmproxy.core.ops import UNDEFINED
from shmproxy.mpi.comm import Intracomm
from shmproxy.mpi.exceptions import ERR_ARG, ERR_DIMS, ERR_RANK, ERR_TOPOLOGY, as_int, error, is_integral
from shmproxy.mpi.neighbor import Edge, NeighborCollectives, Plan, make_plan, multiplicity
from shmproxy.mpi.status import PROC_NULL

CART, GRAPH, DIST_GRAPH = 1, 2, 3


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out


def Compute_dims(nnodes: int, dims: int | Sequence[int]) -> list[int]:
    """A balanced grid of ``nnodes`` processes: ``dims`` is a number of dimensions or a list whose
    nonzero entries are kept; the free (zero) ones get factors as equal as possible, in
    non-increasing order (MPI_Dims_create)."""
    nnodes = as_int(nnodes, "Compute_dims: nnodes", ERR_DIMS)
    if is_integral(dims):
        out = [0] * as_int(dims, "Compute_dims: dims", ERR_DIMS)
    else:
        out = [as_int(d, "Compute_dims: dims", ERR_DIMS) for d in dims]  # type: ignore[union-attr]
    if nnodes < 0 or any(d < 0 for d in out):
        raise error(ERR_DIMS, f"Compute_dims({nnodes}, {dims}): negative value")
    fixed = 1
    for d in out:
        if d:
            fixed *= d
    free = [i for i, d in enumerate(out) if d == 0]
    if fixed == 0 or nnodes % fixed:
        raise error(ERR_DIMS, f"Compute_dims: {nnodes} processes do not divide into the fixed dims {out}")
    rest = nnodes // fixed
    if not free:
        if rest != 1:
            raise error(ERR_DIMS, f"Compute_dims: dims {out} hold {fixed} processes, not {nnodes}")
        return out
    sizes = [1] * len(free)
    for p in sorted(_prime_factors(rest), reverse=True):
        k = min(range(len(sizes)), key=lambda i: sizes[i])
        sizes[k] *= p
    for i, s in zip(free, sorted(sizes, reverse=True)):
        out[i] = s
    return out


class Topocomm(NeighborCollectives, Intracomm):
    """An intracommunicator with a topology: neighbourhood queries and neighbour collectives."""

    __slots__ = ("_nplan",)

    def _edges(self, rank: int) -> tuple[list[Edge], list[Edge]]:
        """(sends, recvs) of ``rank``: one Edge per block of its send and receive buffers."""
        raise NotImplementedError

    def _rounds(self) -> int:
        """The largest number of edges between one ordered pair of ranks, anywhere in the topology."""
        return max((multiplicity(self._edges(r)[0]) for r in range(self._c.size)), default=1)

    def _neighbour_plan(self) -> Plan:
        plan = getattr(self, "_nplan", None)
        if plan is None:
            sends, recvs = self._edges(self._c.rank)
            plan = self._nplan = make_plan(sends, recvs, self._rounds())
        return plan

    def _inout(self) -> tuple[list[int], list[int]]:
        sends, recvs = self._edges(self._c.rank)
        return [e.peer for e in recvs], [e.peer for e in sends]

    @property
    def degrees(self) -> tuple[int, int]:
        """(indegree, outdegree)."""
        i, o = self._inout()
        return len(i), len(o)

    @property
    def indegree(self) -> int:
        return self.degrees[0]

    @property
    def outdegree(self) -> int:
        return self.degrees[1]

    @property
    def inedges(self) -> list[int]:
        """The sources of the receive blocks, in order."""
        return self._inout()[0]

    @property
    def outedges(self) -> list[int]:
        """The destinations of the send blocks, in order."""
        return self._inout()[1]

    @property
    def inoutedges(self) -> tuple[list[int], list[int]]:
        return self._inout()


class Cartcomm(Topocomm):
    """A communicator with a Cartesian grid (Create_cart)."""

    __slots__ = ("_dims", "_periods")

    def __init__(self, native: Any = None, world_ranks: tuple[int, ...] = (), name: str = "",
                 dims: Sequence[int] = (), periods: Sequence[bool] = ()):
        super().__init__(native, world_ranks, name)
        self._dims, self._periods = tuple(dims), tuple(bool(p) for p in periods)

    def Get_topology(self) -> int:
        return CART

    def Get_dim(self) -> int:
        return len(self._dims)

    @property
    def ndim(self) -> int:
        return len(self._dims)

    @property
    def dims(self) -> list[int]:
        return list(self._dims)

    @property
    def periods(self) -> list[bool]:
        return list(self._periods)

    @property
    def coords(self) -> list[int]:
        return self.Get_coords(self._c.rank)

    def Get_topo(self) -> tuple[list[int], list[bool], list[int]]:
        return list(self._dims), list(self._periods), self.Get_coords(self._c.rank)

    @property
    def topo(self) -> tuple[list[int], list[bool], list[int]]:
        return self.Get_topo()

    def _edges(self, rank: int) -> tuple[list[Edge], list[Edge]]:
        # A block sent in the positive direction of a dim lands in the negative-direction block of
        # the receiver: the receiver's key is the sender's slot.
        me = self.Get_coords(rank)
        sends, recvs = [], []
        for d in range(len(self._dims)):
            neg, pos = self._neighbour(me, d, -1), self._neighbour(me, d, 1)
            sends += [Edge(2 * d, neg, 2 * d), Edge(2 * d + 1, pos, 2 * d + 1)]
            recvs += [Edge(2 * d, neg, 2 * d + 1), Edge(2 * d + 1, pos, 2 * d)]
        return sends, recvs

    def Get_coords(self, rank: int) -> list[int]:
        rank = as_int(rank, "Get_coords: rank", ERR_RANK)
        if not 0 <= rank < self._c.size:
            raise error(ERR_RANK, f"Get_coords: rank {rank} is not in a grid of {self._c.size}")
        coords = []
        for d in reversed(self._dims):
            coords.append(rank % d)
            rank //= d
        return coords[::-1]

    def Get_cart_rank(self, coords: Sequence[int]) -> int:
        if len(coords) != len(self._dims):
            raise error(ERR_ARG, f"Get_cart_rank: {len(coords)} coordinates for {len(self._dims)} dims")
        rank = 0
        for c, d, p in zip(coords, self._dims, self._periods):
            c = as_int(c, "Get_cart_rank: coordinate")
            if not 0 <= c < d:
                if not p:
                    raise error(ERR_ARG, f"Get_cart_rank: coordinate {c} outside the non-periodic dim of {d}")
                c %= d
            rank = rank * d + c
        return rank

    def Shift(self, direction: int, disp: int) -> tuple[int, int]:
        """(source, dest) of a shift by ``disp`` along ``direction``; PROC_NULL past a non-periodic edge."""
        direction, disp = as_int(direction, "Shift: direction"), as_int(disp, "Shift: disp")
        if not 0 <= direction < len(self._dims):
            raise error(ERR_ARG, f"Shift: direction {direction} of a {len(self._dims)}-d grid")
        me = self.Get_coords(self._c.rank)
        return self._neighbour(me, direction, -disp), self._neighbour(me, direction, disp)

    def _neighbour(self, me: list[int], direction: int, disp: int) -> int:
        c = list(me)
        c[direction] += disp
        d = self._dims[direction]
        if not 0 <= c[direction] < d:
            if not self._periods[direction]:
                return PROC_NULL
            c[direction] %= d
        return self.Get_cart_rank(c)

    def Sub(self, remain_dims: Sequence[bool]) -> "Cartcomm":
        """Collective: the sub-grid through this rank that keeps the dims where ``remain_dims`` is true."""
        if len(remain_dims) != len(self._dims):
            raise error(ERR_ARG, f"Sub: {len(remain_dims)} flags for {len(self._dims)} dims")
        keep = [bool(k) for k in remain_dims]
        me = self.Get_coords(self._c.rank)
        color = key = 0
        for c, d, k in zip(me, self._dims, keep):
            if k:
                key = key * d + c
            else:
                color = color * d + c
        native = self._call(self._c.Split, color, key)
        dims = [d for d, k in zip(self._dims, keep) if k]
        periods = [p for p, k in zip(self._periods, keep) if k]
        return Cartcomm(native, tuple(self._wranks[r] for r in native.parent_ranks), "", dims, periods)

    def Dup(self, info: Any = None) -> "Cartcomm":
        native = self._call(self._c.Dup)
        members = tuple(self._wranks[r] for r in native.parent_ranks)
        return Cartcomm(native, members, "", self._dims, self._periods)


def create_cart(comm: Any, dims: Sequence[int], periods: Sequence[bool] | None, reorder: bool) -> Any:
    """Intracomm.Create_cart: the first prod(dims) ranks form the grid (Split), the others get COMM_NULL."""
    from shmproxy.mpi.comm import COMM_NULL
    dims = [as_int(d, "Create_cart: dims", ERR_DIMS) for d in dims]
    if any(d <= 0 for d in dims):
        raise error(ERR_DIMS, f"Create_cart: every dim must be positive, got {dims}")
    periods = [False] * len(dims) if periods is None else [bool(p) for p in periods]
    if len(periods) != len(dims):
        raise error(ERR_TOPOLOGY, f"Create_cart: {len(periods)} periods for {len(dims)} dims")
    n = 1
    for d in dims:
        n *= d
    size, rank = comm._c.size, comm._c.rank
    if n > size:
        raise error(ERR_TOPOLOGY, f"Create_cart: a grid of {n} processes on a communicator of {size}")
    native = comm._call(comm._c.Split, 0 if rank < n else UNDEFINED, rank)
    if native is None:
        return COMM_NULL
    return Cartcomm(native, tuple(comm._wranks[r] for r in native.parent_ranks), "", dims, periods)
