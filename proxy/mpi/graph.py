"""Graph and distributed-graph topologies (Intracomm.Create_graph, Create_dist_graph_adjacent,
Create_dist_graph): mpi4py's Graphcomm and Distgraphcomm.

A Graphcomm is given the whole graph on every rank (MPI_Graph_create's index/edges), so it is a
native communicator (Split: the first nnodes ranks) plus those two lists. A distributed graph is
given in pieces (each rank its own adjacency, or any edges at all); creating one makes one object
Allgather of the pieces over the new communicator, so that every rank knows the whole graph. The
queries take any adjacency (as MPI libraries do; mpi4py's tests give a rank's sources alone); the
first neighbour collective checks that both ends of every edge agree (a mistake raises ERR_TOPOLOGY
on every rank, before anything is posted, rather than a hang) and computes the same number of
Alltoallv rounds as every other rank (neighbor.py). ``reorder`` is accepted and ranks keep their
order (topology.py says why that is an optimal placement here).

Edges between the same pair of ranks are matched in order (the j-th edge s->d in s's destinations
meets the j-th s in d's sources), which is MPI's rule for multigraphs. For Create_dist_graph the
in- and out-edges of a rank are listed in the order the edges were given (by giving rank, then
position in its arguments).
"""
from __future__ import annotations

from typing import Any, Sequence

from shmproxy.core import errors
from shmproxy.core.ops import UNDEFINED
from shmproxy.mpi.exceptions import ERR_ARG, ERR_RANK, ERR_TOPOLOGY, as_int, convert, error
from shmproxy.mpi.neighbor import Edge, multiplicity, occurrence_edges
from shmproxy.mpi.comm import Comm
from shmproxy.mpi.topology import DIST_GRAPH, GRAPH, Topocomm, blank_of, int_list, made_in_new
from shmproxy.rank import objcoll


class _Weights:
    """MPI.UNWEIGHTED and MPI.WEIGHTS_EMPTY: markers for the weight arguments."""

    __slots__ = ("_name",)

    def __init__(self, name: str):
        self._name = name

    def __repr__(self) -> str:
        return f"MPI.{self._name}"


UNWEIGHTED = _Weights("UNWEIGHTED")
WEIGHTS_EMPTY = _Weights("WEIGHTS_EMPTY")


def _ranks(values: Sequence[Any], size: int, what: str) -> list[int]:
    out = []
    for v in values:
        v = as_int(v, what, ERR_RANK)
        if not 0 <= v < size:
            raise error(ERR_RANK, f"{what}: rank {v} is not in a communicator of {size}")
        out.append(v)
    return out


def _check_pairs(out_lists: Sequence[Sequence[int]], in_lists: Sequence[Sequence[int]], what: str) -> None:
    """Every ordered pair (s, d) must have as many edges in s's out-list as in d's in-list."""
    count: dict[tuple[int, int], int] = {}
    for s, outs in enumerate(out_lists):
        for d in outs:
            count[(s, d)] = count.get((s, d), 0) + 1
    for d, ins in enumerate(in_lists):
        for s in ins:
            count[(s, d)] = count.get((s, d), 0) - 1
    bad = sorted(p for p, n in count.items() if n)
    if bad:
        s, d = bad[0]
        raise error(ERR_TOPOLOGY, f"{what}: the edges do not agree at both ends: rank {s} lists {d} as a "
                    f"destination a different number of times than rank {d} lists {s} as a source "
                    f"({len(bad)} such pairs)")


class Graphcomm(Topocomm):
    """A communicator with a graph topology (Create_graph): every rank knows the whole graph; a
    rank's neighbours are both its sources and its destinations."""

    __slots__ = ("_index", "_gedges")
    _KIND = GRAPH

    def __init__(self, native: Any = None, world_ranks: tuple[int, ...] = (), name: str = "",
                 index: Sequence[int] = (), edges: Sequence[int] = ()):
        if isinstance(native, Comm) and made_in_new(self):
            return
        self._index, self._gedges = tuple(index), tuple(edges)
        super().__init__(native, world_ranks, name)     # (a second handle: _share replaces them)

    def _share(self, other: Any) -> None:
        self._index, self._gedges = other._index, other._gedges

    def Get_dims(self) -> tuple[int, int]:
        """(nnodes, nedges)."""
        self._c
        return len(self._index), len(self._gedges)

    @property
    def dims(self) -> tuple[int, int]:
        return self.Get_dims()

    @property
    def nnodes(self) -> int:
        return len(self._index)

    @property
    def nedges(self) -> int:
        return len(self._gedges)

    def Get_topo(self) -> tuple[list[int], list[int]]:
        """(index, edges) as MPI_Graph_get gives them (index without mpi4py's leading 0)."""
        self._c
        return list(self._index), list(self._gedges)

    @property
    def topo(self) -> tuple[list[int], list[int]]:
        return self.Get_topo()

    @property
    def index(self) -> list[int]:
        return list(self._index)

    @property
    def edges(self) -> list[int]:
        return list(self._gedges)

    def Get_neighbors(self, rank: int) -> list[int]:
        rank = as_int(rank, "Get_neighbors: rank", ERR_RANK)
        if not 0 <= rank < len(self._index):
            raise error(ERR_RANK, f"Get_neighbors: rank {rank} is not in a graph of {len(self._index)}")
        lo = self._index[rank - 1] if rank else 0
        return list(self._gedges[lo:self._index[rank]])

    def Get_neighbors_count(self, rank: int) -> int:
        return len(self.Get_neighbors(rank))

    @property
    def neighbors(self) -> list[int]:
        return self.Get_neighbors(self._c.rank)

    @property
    def nneighbors(self) -> int:
        return len(self.neighbors)

    def _edges(self, rank: int) -> tuple[list[Edge], list[Edge]]:
        n = self.Get_neighbors(rank)
        return occurrence_edges(n), occurrence_edges(n)

    def _rounds(self) -> int:
        # MPI allows neighbour collectives on a graph only when its adjacency is symmetric.
        lists = [self.Get_neighbors(r) for r in range(len(self._index))]
        _check_pairs(lists, lists, "neighbour collective on a Graphcomm (the adjacency must be symmetric)")
        return max((multiplicity(occurrence_edges(n)) for n in lists), default=1)

    def Dup(self, info: Any = None) -> "Graphcomm":
        native, members, hints = self._dup_native(info)
        dup = blank_of(self)    # as mpi4py: a handle of type(self), a subclass of the program's too
        Graphcomm.__init__(dup, native, members, "", self._index, self._gedges)
        dup._info = hints
        return dup


class Distgraphcomm(Topocomm):
    """A communicator with a distributed graph topology, with or without edge weights."""

    __slots__ = ("_all", "_weights")
    _KIND = DIST_GRAPH

    def __init__(self, native: Any = None, world_ranks: tuple[int, ...] = (), name: str = "",
                 adjacency: Sequence[tuple[list[int], list[int]]] = (),
                 weights: tuple[list[int], list[int]] | None = None):
        if isinstance(native, Comm) and made_in_new(self):
            return
        self._all = tuple((list(s), list(d)) for s, d in adjacency)   # per rank: (sources, destinations)
        self._weights = weights
        super().__init__(native, world_ranks, name)     # (a second handle: _share replaces them)

    def _share(self, other: Any) -> None:
        self._all, self._weights = other._all, other._weights

    def Get_dist_neighbors_count(self) -> tuple[int, int, bool]:
        """(indegree, outdegree, weighted)."""
        s, d = self._all[self._c.rank]
        return len(s), len(d), self._weights is not None

    def Get_dist_neighbors(self) -> tuple[list[int], list[int], tuple[list[int], list[int]] | None]:
        """(sources, destinations, (sourceweights, destweights) or None when unweighted)."""
        s, d = self._all[self._c.rank]
        w = None if self._weights is None else (list(self._weights[0]), list(self._weights[1]))
        return list(s), list(d), w

    def _edges(self, rank: int) -> tuple[list[Edge], list[Edge]]:
        s, d = self._all[rank]
        return occurrence_edges(d), occurrence_edges(s)

    def _rounds(self) -> int:
        # Queries take any adjacency (mpi4py's tests give sources alone); moving data needs both
        # ends of every edge, which every rank checks alike here, before anything is posted.
        _check_pairs([d for _s, d in self._all], [s for s, _d in self._all],
                     "neighbour collective on a Distgraphcomm")
        return super()._rounds()

    def Dup(self, info: Any = None) -> "Distgraphcomm":
        native, members, hints = self._dup_native(info)
        dup = blank_of(self)
        Distgraphcomm.__init__(dup, native, members, "", self._all, self._weights)
        dup._info = hints
        return dup


# ---------------------------------------------------------------------------------- constructors
def _graph_args(comm: Any, index: Any, edges: Any, what: str) -> tuple[list[int], list[int]]:
    """(index, edges) of MPI_Graph_create, checked against ``comm``. As mpi4py, ``index`` may also be
    the standard adjacency form with a leading 0 (n + 1 offsets, the last the number of edges)."""
    index = int_list(index, f"{what}: index")
    edges_in = int_list(edges, f"{what}: edges")
    if len(index) > 1 and index[0] == 0 and index[-1] == len(edges_in):
        index = index[1:]
    nnodes, size = len(index), comm._c.size
    if nnodes > size:
        raise error(ERR_TOPOLOGY, f"{what}: a graph of {nnodes} nodes on a communicator of {size}")
    if any(b < a for a, b in zip([0] + index, index)) or (index and index[-1] != len(edges_in)) or \
            (not index and edges_in):
        raise error(ERR_ARG, f"{what}: index {index} must be non-decreasing and end at the number "
                    f"of edges ({len(edges_in)})")
    return index, _ranks(edges_in, nnodes, what)


def create_graph(comm: Any, index: Any, edges: Any, reorder: bool = False) -> Any:
    """Intracomm.Create_graph: the first nnodes ranks form the graph, the others get COMM_NULL."""
    from shmproxy.mpi.comm import COMM_NULL
    index, edges = _graph_args(comm, index, edges, "Create_graph")
    rank = comm._c.rank
    native = comm._call(comm._c.Split, 0 if rank < len(index) else UNDEFINED, rank)
    if native is None:
        return COMM_NULL
    return Graphcomm(native, tuple(comm._wranks[r] for r in native.parent_ranks), "", index, edges)


def graph_map(comm: Any, index: Any, edges: Any) -> int:
    """Intracomm.Graph_map: this process's rank in the graph Create_graph(index, edges, reorder=True)
    would make, UNDEFINED for a process outside it (local: no communication)."""
    index, _edges = _graph_args(comm, index, edges, "Graph_map")
    rank = comm._c.rank
    return rank if rank < len(index) else UNDEFINED


def _weight_list(w: Any, n: int, what: str) -> list[int] | None:
    if w is None or w is UNWEIGHTED:
        return None
    w = [] if w is WEIGHTS_EMPTY else int_list(w, what)
    if len(w) != n:
        raise error(ERR_ARG, f"{what}: {len(w)} weights for {n} edges")
    return w


def _dup_and_gather(comm: Any, piece: Any) -> tuple[Any, list]:
    native = comm._call(comm._c.Dup)
    try:
        return native, objcoll.allgather(native, piece)
    except errors.ProxyError as exc:
        raise convert(exc) from None


def _refuse(native: Any, exc: BaseException) -> None:
    """A graph every rank found wrong (all ranks see the same pieces): close the new communicator
    on every rank, then raise."""
    try:
        native.close()
    except errors.ProxyError as close_exc:
        raise exc from close_exc
    raise exc


def create_dist_graph_adjacent(comm: Any, sources: Sequence[int], destinations: Sequence[int],
                               sourceweights: Any = None, destweights: Any = None, info: Any = None,
                               reorder: bool = False) -> Distgraphcomm:
    """Intracomm.Create_dist_graph_adjacent: each rank gives its own in- and out-neighbours."""
    size = comm._c.size
    srcs = _ranks(() if sources is None else int_list(sources, "Create_dist_graph_adjacent: sources"),
                  size, "Create_dist_graph_adjacent sources")
    dsts = _ranks(() if destinations is None else int_list(destinations, "Create_dist_graph_adjacent: "
                  "destinations"), size, "Create_dist_graph_adjacent destinations")
    sw = _weight_list(sourceweights, len(srcs), "Create_dist_graph_adjacent sourceweights")
    dw = _weight_list(destweights, len(dsts), "Create_dist_graph_adjacent destweights")
    if (sw is None) != (dw is None):
        raise error(ERR_ARG, "Create_dist_graph_adjacent: give both sourceweights and destweights, "
                    "or neither")
    native, pieces = _dup_and_gather(comm, (srcs, dsts))
    return Distgraphcomm(native, tuple(comm._wranks[r] for r in native.parent_ranks), "", pieces,
                         None if sw is None or dw is None else (sw, dw))


def create_dist_graph(comm: Any, sources: Sequence[int], degrees: Sequence[int], destinations: Sequence[int],
                      weights: Any = None, info: Any = None, reorder: bool = False) -> Distgraphcomm:
    """Intracomm.Create_dist_graph: each rank gives any edges (sources[i] -> the next degrees[i]
    destinations); every rank's in- and out-edges are collected from all of them."""
    size = comm._c.size
    srcs = _ranks(int_list(sources, "Create_dist_graph: sources"), size, "Create_dist_graph sources")
    degs = int_list(degrees, "Create_dist_graph: degrees")
    if len(degs) != len(srcs) or any(d < 0 for d in degs):
        raise error(ERR_ARG, f"Create_dist_graph: {len(degs)} degrees for {len(srcs)} sources (each >= 0)")
    dsts = _ranks(int_list(destinations, "Create_dist_graph: destinations"), size,
                  "Create_dist_graph destinations")
    if len(dsts) != sum(degs):
        raise error(ERR_ARG, f"Create_dist_graph: the degrees add up to {sum(degs)}, "
                    f"{len(dsts)} destinations")
    w = _weight_list(weights, len(dsts), "Create_dist_graph weights")
    mine, k = [], 0
    for s, n in zip(srcs, degs):
        for d in dsts[k:k + n]:
            mine.append((s, d, 0 if w is None else w[k]))
            k += 1
    native, pieces = _dup_and_gather(comm, (mine, w is not None))
    weighted = any(p[1] for p in pieces)
    if weighted and not all(p[1] or not p[0] for p in pieces):
        _refuse(native, error(ERR_ARG, "Create_dist_graph: some ranks give weights and others do not"))
    adjacency: list[tuple[list[int], list[int]]] = [([], []) for _ in range(size)]
    ws: list[tuple[list[int], list[int]]] = [([], []) for _ in range(size)]
    for edges, _w in pieces:
        for s, d, wt in edges:
            adjacency[s][1].append(d)
            ws[s][1].append(wt)
            adjacency[d][0].append(s)
            ws[d][0].append(wt)
    me = native.rank
    return Distgraphcomm(native, tuple(comm._wranks[r] for r in native.parent_ranks), "", adjacency,
                         ws[me] if weighted else None)
