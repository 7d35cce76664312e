"""Process topologies (MPI 4.0 chapter 8) in pure Python: Topocomm, the base of every topology, and
Cartesian grids (Cartcomm, Create_cart, Cart_map, Compute_dims); graphs are in graph.py.

A topology communicator is a native communicator (from Split or Dup) plus what describes its
topology; coordinates, ranks, shifts and sub-grids are arithmetic on that, in row-major order as MPI
defines. A grid or graph of fewer processes than the communicator has takes its first ranks; the
others get COMM_NULL (MPI's rule). ``reorder`` is accepted and every rank keeps its rank: the
processes of a job are interchangeable to shmproxy's transports (one progress process per node, one
cost per pair within it), so the identity is an optimal placement, and Cart_map/Graph_map return
that same placement (a process's rank, or UNDEFINED past the topology's size), which is what
Create_cart/Create_graph with reorder give.

Topocomm holds the neighbourhood queries (degrees, inedges, outedges) and the neighbour collectives
(neighbor.py), which each topology feeds with its edges. A Cartesian rank's neighbours are, per
dimension, the negative then the positive neighbour (PROC_NULL past a non-periodic border), both as
sources and destinations. ``MPI.Cartcomm(comm)`` and the like are second handles of a communicator
of that topology (its description is shared); any other communicator is a TypeError, as in mpi4py.
"""
from __future__ import annotations

from typing import Any, Sequence

from shmproxy.core.ops import UNDEFINED
from shmproxy.mpi.comm import Comm, Intracomm, cached_native
from shmproxy.mpi.exceptions import (ERR_ARG, ERR_DIMS, ERR_RANK, ERR_TOPOLOGY, as_int, error, is_integral,
                                     type_error)
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


def int_list(values: Any, what: str, error_class: int = ERR_ARG) -> list[int]:
    """A sequence of integers (mpi4py's ``getarray``), each read through ``__index__``; anything
    else (a single integer included) an MPI.Exception that is also a TypeError."""
    if isinstance(values, (str, bytes)) or is_integral(values):
        raise type_error(error_class, f"{what}: expected a sequence of integers, got {type(values).__name__}")
    try:
        items = list(values)
    except TypeError:
        raise type_error(error_class, f"{what}: expected a sequence of integers, got "
                         f"{type(values).__name__}") from None
    return [as_int(v, what, error_class) for v in items]


def sized_list(values: Any, n: int, what: str, error_class: int = ERR_ARG) -> list[int]:
    """``int_list`` of exactly ``n`` items (mpi4py's ``chkarray``: another length is a ValueError)."""
    out = int_list(values, what, error_class)
    if len(out) != n:
        raise error(error_class, f"{what}: expected {n} items, got {len(out)}")
    return out


def Compute_dims(nnodes: int, dims: int | Sequence[int]) -> list[int]:
    """A balanced grid of ``nnodes`` processes: ``dims`` is a number of dimensions or a list whose
    nonzero entries are kept; the free (zero) ones get factors as equal as possible, in
    non-increasing order (MPI_Dims_create)."""
    nnodes = as_int(nnodes, "Compute_dims: nnodes", ERR_DIMS)
    if is_integral(dims):
        out = [0] * as_int(dims, "Compute_dims: dims", ERR_DIMS)
    else:
        out = int_list(dims, "Compute_dims: dims", ERR_DIMS)
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


def _layer_class(cls: type) -> type:
    """The first class of this layer that ``cls`` (maybe a subclass of the program's) derives from."""
    return next(c for c in cls.__mro__ if c.__module__.startswith("shmproxy"))


def blank_of(comm: Comm) -> Any:
    """An unset handle of ``comm``'s class, made by its __new__ without arguments (mpi4py's New)."""
    cls: Any = type(comm)
    return cls.__new__(cls)


def made_in_new(comm: Comm) -> bool:
    """True when Topocomm.__new__ already made this handle (a subclass of the program's)."""
    return not type(comm).__module__.startswith("shmproxy") and cached_native(comm) is not None


class Topocomm(NeighborCollectives, Intracomm):
    """An intracommunicator with a topology: neighbourhood queries and neighbour collectives."""

    __slots__ = ("_nplan",)
    _KIND = 0        # CART, GRAPH or DIST_GRAPH in the subclasses

    def __new__(cls, *a: Any, **_k: Any) -> "Topocomm":
        # MPI.Topocomm(cart) is a handle of cart's own class (its queries need its topology)
        if cls is Topocomm and a and isinstance(a[0], Topocomm):
            return object.__new__(type(a[0]))
        obj = object.__new__(cls)
        if a and isinstance(a[0], Comm) and not cls.__module__.startswith("shmproxy"):
            # a subclass of the program's whose __new__ passes the communicator it made (mpi4py's
            # test_subclass: Create_cart then super().__new__(cls, cart)): the handle is made here, as
            # in mpi4py; the __init__ Python calls next, with the original argument, leaves it be
            layer: Any = _layer_class(cls)
            layer.__init__(obj, a[0])
        return obj

    def __init__(self, native: Any = None, world_ranks: tuple[int, ...] = (), name: str = ""):
        if isinstance(native, Comm):   # a second handle: only of a communicator of this topology
            if made_in_new(self):
                return
            if native and not isinstance(native, _layer_class(type(self)) if self._KIND else Topocomm):
                want = {CART: "a Cartesian", GRAPH: "a general graph", DIST_GRAPH: "a distributed graph"}
                raise TypeError(f"MPI.{type(self).__name__}(): expecting {want.get(self._KIND, 'a topology')}"
                                f" communicator, got {type(native).__name__}")
            other = native
            super().__init__(native)
            if other:
                self._share(other)
            return
        super().__init__(native, world_ranks, name)

    def _share(self, other: Any) -> None:
        """Take ``other``'s topology (a second handle of it)."""
        raise NotImplementedError

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

    def Get_topology(self) -> int:
        self._c      # a null handle raises
        return self._KIND

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

    def _dup_native(self, info: Any) -> tuple[Any, tuple[int, ...], dict]:
        """A native Dup of this communicator, the world ranks of its members and the hints it keeps."""
        native = self._call(self._c.Dup)
        hints = dict(info.items()) if info else dict(self._info)
        return native, tuple(self._wranks[r] for r in native.parent_ranks), hints


class Cartcomm(Topocomm):
    """A communicator with a Cartesian grid (Create_cart)."""

    __slots__ = ("_dims", "_periods")
    _KIND = CART

    def __init__(self, native: Any = None, world_ranks: tuple[int, ...] = (), name: str = "",
                 dims: Sequence[int] = (), periods: Sequence[bool] = ()):
        if isinstance(native, Comm) and made_in_new(self):
            return
        self._dims, self._periods = tuple(dims), tuple(bool(p) for p in periods)
        super().__init__(native, world_ranks, name)     # (a second handle: _share replaces them)

    def _share(self, other: Any) -> None:
        self._dims, self._periods = other._dims, other._periods

    def Get_dim(self) -> int:
        self._c
        return len(self._dims)

    @property
    def dim(self) -> int:
        return self.Get_dim()

    @property
    def ndim(self) -> int:
        return self.Get_dim()

    @property
    def dims(self) -> list[int]:
        return self.Get_topo()[0]

    @property
    def periods(self) -> list[bool]:
        return self.Get_topo()[1]

    @property
    def coords(self) -> list[int]:
        return self.Get_topo()[2]

    def Get_topo(self) -> tuple[list[int], list[bool], list[int]]:
        """(dims, periods, this rank's coordinates)."""
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
        """The rank at ``coords``; a coordinate outside a periodic dimension wraps around, outside a
        non-periodic one is an error (MPI_Cart_rank)."""
        coords = sized_list(coords, len(self._dims), "Get_cart_rank: coords")
        rank = 0
        for c, d, p in zip(coords, self._dims, self._periods):
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
            raise error(ERR_DIMS, f"Shift: direction {direction} of a {len(self._dims)}-d grid")
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
        """Collective: the sub-grid through this rank that keeps the dims where ``remain_dims`` is true
        (a 0-dimensional grid of this rank alone when none is kept)."""
        keep = [bool(k) for k in sized_list(remain_dims, len(self._dims), "Sub: remain_dims")]
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
        native, members, hints = self._dup_native(info)
        dup = blank_of(self)    # as mpi4py: a handle of type(self), a subclass of the program's too
        Cartcomm.__init__(dup, native, members, "", self._dims, self._periods)
        dup._info = hints
        return dup


def _cart_args(comm: Any, dims: Any, periods: Any, what: str) -> tuple[list[int], list[bool], int]:
    """(dims, periods, number of processes) of a grid, checked against ``comm`` (mpi4py's reading:
    periods None is all False, a bool is that for every dim, a sequence one per dim)."""
    dims = int_list(dims, f"{what}: dims", ERR_DIMS)
    if any(d <= 0 for d in dims):
        raise error(ERR_DIMS, f"{what}: every dim must be positive, got {dims}")
    if periods is None or isinstance(periods, bool):
        periods = [bool(periods)] * len(dims)
    else:
        periods = [bool(p) for p in sized_list(periods, len(dims), f"{what}: periods", ERR_TOPOLOGY)]
    n = 1
    for d in dims:
        n *= d
    size = comm._c.size
    if n > size:
        raise error(ERR_TOPOLOGY, f"{what}: a grid of {n} processes on a communicator of {size}")
    return dims, periods, n


def create_cart(comm: Any, dims: Sequence[int], periods: Any, reorder: bool) -> Any:
    """Intracomm.Create_cart: the first prod(dims) ranks form the grid (Split), the others get COMM_NULL."""
    from shmproxy.mpi.comm import COMM_NULL
    dims, periods, n = _cart_args(comm, dims, periods, "Create_cart")
    rank = comm._c.rank
    native = comm._call(comm._c.Split, 0 if rank < n else UNDEFINED, rank)
    if native is None:
        return COMM_NULL
    return Cartcomm(native, tuple(comm._wranks[r] for r in native.parent_ranks), "", dims, periods)


def cart_map(comm: Any, dims: Sequence[int], periods: Any = None) -> int:
    """Intracomm.Cart_map: this process's rank in the grid Create_cart(dims, periods, reorder=True)
    would make, UNDEFINED for a process outside it (local: no communication)."""
    _dims, _periods, n = _cart_args(comm, dims, periods, "Cart_map")
    rank = comm._c.rank
    return rank if rank < n else UNDEFINED
