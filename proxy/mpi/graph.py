"""Graph and distributed-graph topologies (Intracomm.Create_graph, Create_dist_graph_adjacent,
Create_dist_graph): mpi4py's Graphcomm and Distgraphcomm.

A Graphcomm is given the whole graph on every rank (MPI_Graph_create's index/edges), so it is a
native communicator (Split: the first nnodes ranks) plus those two lists. A distributed graph is
given in pieces (each rank its own adjacency, or any edges at all); creating one makes one object
Allgather of the pieces over the new communicator, so that every rank knows the whole graph: it
then checks that both ends of every edge agree (a mistake raises ERR_TOPOLOGY on every rank rather
than a hang in the first neighbour collective) and computes the same number of Alltoallv rounds
as every other rank (neighbor.py). ``reorder`` is accepted and ignored: ranks keep their order.

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
from shmproxy.mpi.topology import DIST_GRAPH, GRAPH, Topocomm
from shmproxy.rank import objects


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

    def __init__(self, native: Any = None, world_ranks: tuple[int, ...] = (), name: str = "",
                 index: Sequence[int] = (), edges: Sequence[int] = ()):
        super().__init__(native, world_ranks, name)
        self._index, self._gedges = tuple(index), tuple(edges)

    def Get_topology(self) -> int:
        return GRAPH

    def Get_dims(self) -> tuple[int, int]:
        """(nnodes, nedges)."""
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
        """(index, edges) as given to Create_graph."""
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
        native = self._call(self._c.Dup)
        return Graphcomm(native, tuple(self._wranks[r] for r in native.parent_ranks), "", self._index,
                         self._gedges)


class Distgraphcomm(Topocomm):
    """A communicator with a distributed graph topology, with or without edge weights."""

    __slots__ = ("_all", "_weights")

    def __init__(self, native: Any = None, world_ranks: tuple[int, ...] = (), name: str = "",
                 adjacency: Sequence[tuple[list[int], list[int]]] = (),
                 weights: tuple[list[int], list[int]] | None = None):
        super().__init__(native, world_ranks, name)
        self._all = tuple((list(s), list(d)) for s, d in adjacency)   # per rank: (sources, destinations)
        self._weights = weights

    def Get_topology(self) -> int:
        return DIST_GRAPH

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

    def Dup(self, info: Any = None) -> "Distgraphcomm":
        native = self._call(self._c.Dup)
        return Distgraphcomm(native, tuple(self._wranks[r] for r in native.parent_ranks), "", self._all,
                             self._weights)


# ---------------------------------------------------------------------------------- constructors
def create_graph(comm: Any, index: Sequence[int], edges: Sequence[int], reorder: bool = False) -> Any:
    """Intracomm.Create_graph: the first len(index) ranks form the graph, the others get COMM_NULL."""
    from shmproxy.mpi.comm import COMM_NULL
    index = [as_int(i, "Create_graph: index") for i in index]
    size, rank = comm._c.size, comm._c.rank
    nnodes = len(index)
    if nnodes > size:
        raise error(ERR_TOPOLOGY, f"Create_graph: a graph of {nnodes} nodes on a communicator of {size}")
    if any(b < a for a, b in zip([0] + index, index)) or (index and index[-1] != len(edges)):
        raise error(ERR_ARG, f"Create_graph: index {index} must be non-decreasing and end at the number "
                    f"of edges ({len(edges)})")
    edges = _ranks(edges, nnodes, "Create_graph")
    native = comm._call(comm._c.Split, 0 if rank < nnodes else UNDEFINED, rank)
    if native is None:
        return COMM_NULL
    return Graphcomm(native, tuple(comm._wranks[r] for r in native.parent_ranks), "", index, edges)


def _weight_list(w: Any, n: int, what: str) -> list[int] | None:
    if w is None or w is UNWEIGHTED:
        return None
    if w is WEIGHTS_EMPTY:
        w = []
    w = [as_int(x, what) for x in w]
    if len(w) != n:
        raise error(ERR_ARG, f"{what}: {len(w)} weights for {n} edges")
    return w


def _dup_and_gather(comm: Any, piece: Any) -> tuple[Any, list]:
    native = comm._call(comm._c.Dup)
    try:
        return native, objects.allgather(native, piece)
    except errors.ProxyError as exc:
        raise convert(exc) from None


def create_dist_graph_adjacent(comm: Any, sources: Sequence[int], destinations: Sequence[int],
                               sourceweights: Any = None, destweights: Any = None, info: Any = None,
                               reorder: bool = False) -> Distgraphcomm:
    """Intracomm.Create_dist_graph_adjacent: each rank gives its own in- and out-neighbours."""
    size = comm._c.size
    srcs = _ranks(sources, size, "Create_dist_graph_adjacent sources")
    dsts = _ranks(destinations, size, "Create_dist_graph_adjacent destinations")
    sw = _weight_list(sourceweights, len(srcs), "Create_dist_graph_adjacent sourceweights")
    dw = _weight_list(destweights, len(dsts), "Create_dist_graph_adjacent destweights")
    if (sw is None) != (dw is None):
        raise error(ERR_ARG, "Create_dist_graph_adjacent: give both sourceweights and destweights, "
                    "or neither")
    native, pieces = _dup_and_gather(comm, (srcs, dsts))
    _check_pairs([p[1] for p in pieces], [p[0] for p in pieces], "Create_dist_graph_adjacent")
    return Distgraphcomm(native, tuple(comm._wranks[r] for r in native.parent_ranks), "", pieces,
                         None if sw is None else (sw, dw))


def create_dist_graph(comm: Any, sources: Sequence[int], degrees: Sequence[int], destinations: Sequence[int],
                      weights: Any = None, info: Any = None, reorder: bool = False) -> Distgraphcomm:
    """Intracomm.Create_dist_graph: each rank gives any edges (sources[i] -> the next degrees[i]
    destinations); every rank's in- and out-edges are collected from all of them."""
    size = comm._c.size
    srcs = _ranks(sources, size, "Create_dist_graph sources")
    degs = [as_int(d, "Create_dist_graph: degrees") for d in degrees]
    if len(degs) != len(srcs) or any(d < 0 for d in degs):
        raise error(ERR_ARG, f"Create_dist_graph: {len(degs)} degrees for {len(srcs)} sources (each >= 0)")
    dsts = _ranks(destinations, size, "Create_dist_graph destinations")
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
        raise error(ERR_ARG, "Create_dist_graph: some ranks give weights and others do not")
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
