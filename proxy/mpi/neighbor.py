"""Neighbour collectives (MPI 3 / mpi4py's Topocomm.Neighbor_*), run by the progress process.

Each topology (Cartesian, graph, distributed graph) describes its neighbourhood as two lists of
edges: what this rank sends (one block per out-edge, in the order of its send buffer) and what it
receives (one block per in-edge, in the order of its receive buffer), each edge naming the peer and
a ``key`` that pairs it with the edge at the other end. A neighbour collective is then a native
Alltoallv over the whole communicator: the count towards a peer is that edge's block and zero for
every non-neighbour, the displacements point straight into the caller's buffers (no copies in the
rank), and the progress process moves the bytes.

One Alltoallv carries at most one block per ordered pair of ranks, so a topology in which some rank
lists the same peer twice (a multigraph, or a periodic Cartesian dimension of size 1 or 2, where the
negative and positive neighbour are the same rank, possibly this rank itself) needs more: the edges
of each pair are sorted by key and the j-th goes in round j; the collective is R Alltoallv calls,
R being the largest multiplicity of any pair anywhere in the topology (every rank computes the same
R from the whole topology, which every rank knows, so that every rank makes the same calls). All
rounds are posted at the call; rounds after the first receive into arrays of their own, whose
blocks the rank copies into place once every round is done (see _Rounds). Keys give MPI's
matching: for graphs, the j-th edge s->d in s's list meets the j-th edge from s in d's list; for
Cartesian grids, the block s sends in the positive direction of a dimension lands in d's block of
the negative direction, and vice versa (which is what makes size-1 and size-2 periodic dims right).

PROC_NULL edges (non-periodic Cartesian borders) move nothing and leave their receive block as it was.
Sending and receiving datatypes must be the same (the native Alltoallv has one element type), except
in Neighbor_alltoallw, whose per-edge datatypes travel as bytes (wcoll.py) through the same rounds.
The object forms (neighbor_allgather, neighbor_alltoall) pickle, exchange sizes with one
Neighbor_alltoall of int64s, then the bytes with one Neighbor_alltoallv.
"""
from __future__ import annotations

import pickle
from typing import Any, NamedTuple, Sequence

import numpy as np

from shmproxy.core import errors
from shmproxy.mpi import buffers, wcoll
from shmproxy.mpi.datatypes import Datatype
from shmproxy.mpi.exceptions import ERR_ARG, ERR_BUFFER, ERR_COUNT, convert, error, is_integral
from shmproxy.mpi.request import Request
from shmproxy.mpi.status import PROC_NULL


class Edge(NamedTuple):
    """One block of a neighbour collective: ``slot`` in this rank's buffer, the ``peer``, and the
    ``key`` that orders the edges of one pair of ranks alike at both ends."""
    slot: int
    peer: int
    key: int


class Plan(NamedTuple):
    """The rounds of a neighbourhood: ``sends[j]`` / ``recvs[j]`` map a peer to a slot in round j."""
    indegree: int
    outdegree: int
    sends: tuple[dict[int, int], ...]
    recvs: tuple[dict[int, int], ...]


def occurrence_edges(peers: Sequence[int]) -> list[Edge]:
    """Graph edges: the key of an edge is how many earlier edges in the list have the same peer."""
    seen: dict[int, int] = {}
    out = []
    for slot, p in enumerate(peers):
        p = int(p)
        k = seen.get(p, 0)
        seen[p] = k + 1
        out.append(Edge(slot, p, k))
    return out


def multiplicity(edges: Sequence[Edge]) -> int:
    count: dict[int, int] = {}
    for e in edges:
        if e.peer != PROC_NULL:
            count[e.peer] = count.get(e.peer, 0) + 1
    return max(count.values(), default=0)


def make_plan(sends: Sequence[Edge], recvs: Sequence[Edge], rounds: int) -> Plan:
    """Assign every edge a round: per peer, sorted by key, the j-th edge in round j."""
    def split(edges: Sequence[Edge]) -> tuple[dict[int, int], ...]:
        per_peer: dict[int, list[Edge]] = {}
        for e in edges:
            if e.peer != PROC_NULL:
                per_peer.setdefault(e.peer, []).append(e)
        out: list[dict[int, int]] = [{} for _ in range(max(rounds, 1))]
        for peer, lst in per_peer.items():
            for j, e in enumerate(sorted(lst, key=lambda e: e.key)):
                out[j][peer] = e.slot
        return tuple(out)
    return Plan(len(recvs), len(sends), split(sends), split(recvs))


class _Rounds:
    """The Alltoallv rounds of one neighbour collective seen as one native request. Every round is
    posted at the call, so that collectives stay in call order on every rank; round 0 receives
    into the caller's buffer, later rounds into arrays of their own whose blocks are placed when
    all rounds are done (two native operations in flight on one receive buffer could undo each
    other's blocks: the native layer may stage a buffer it cannot map and copy it back whole)."""

    __slots__ = ("_reqs", "_places", "_rb", "_placed")

    def __init__(self, reqs: list[Any], places: list[tuple[np.ndarray, int, int, int]], rb: np.ndarray):
        self._reqs, self._places, self._rb, self._placed = reqs, places, rb, False

    def _place(self) -> None:
        if not self._placed:
            self._placed = True
            for tmp, at, displ, count in self._places:
                self._rb[displ:displ + count] = tmp[at:at + count]

    def Wait(self) -> None:
        for r in self._reqs:
            r.Wait()
        self._place()

    def Test(self) -> bool:
        if not all(r.Test() for r in self._reqs):
            return False
        self._place()
        return True

    @property
    def status(self) -> Any:
        return self._reqs[-1].status

    @property
    def _comm(self) -> Any:     # for Waitany/Waitsome, which sleep on a request's communicator
        return self._reqs[-1]._comm

    def Cancel(self) -> None:
        raise errors.InvalidArgument("a neighbour collective cannot be cancelled")

    def describe(self) -> str:
        return f"neighbour collective of {len(self._reqs)} Alltoallv rounds"


def _blocks(spec: Any, what: str, writable: bool, n: int) -> tuple[np.ndarray, list[int], list[int]]:
    """(array, counts, displs) of ``n`` blocks: a vector spec, or a buffer of ``n`` equal blocks (a
    count in the spec is per block)."""
    if isinstance(spec, (list, tuple)) and len(spec) >= 2 and \
            not isinstance(spec[1], (Datatype, str)) and not is_integral(spec[1]):
        v = buffers.parse_v(spec, what, writable, n)
        return v.array, list(v.counts), list(v.displs)
    arr = buffers.parse(spec, what, writable, blocks=max(n, 1))
    if not isinstance(arr, np.ndarray):
        raise error(ERR_BUFFER, f"{what}: neighbour collectives need a buffer (not {arr!r})")
    if n == 0:
        return arr, [], []
    if arr.size % n:
        raise error(ERR_COUNT, f"{what}: {arr.size} elements are not {n} equal blocks: pass "
                    f"[buf, (counts, displs), datatype]")
    k = arr.size // n
    return arr, [k] * n, [k * i for i in range(n)]


class NeighborCollectives:
    """Mixin of Topocomm: subclasses define ``_neighbour_plan()`` (a cached Plan)."""

    __slots__ = ()
    _c: Any

    def _neighbour_plan(self) -> Plan:
        raise NotImplementedError

    def _post_rounds(self, name: str, sb: np.ndarray, scounts: list[int], sdispls: list[int],
                     rb: np.ndarray, rcounts: list[int], rdispls: list[int]) -> Any:
        """Post every round's Alltoallv; one native request, or a _Rounds of several."""
        plan = self._neighbour_plan()
        c = self._c
        size = c.size
        if sb.dtype != rb.dtype:
            raise error(ERR_ARG, f"{name}: the send buffer is {sb.dtype} and the receive buffer {rb.dtype}: "
                        "neighbour collectives need one datatype")
        sb, rb = sb.reshape(-1), rb.reshape(-1)     # (views: a plain array may come as it is, n-d)
        if buffers.wire(sb) is not sb:     # a type with no native code (long double, pairs): its bytes
            k = sb.dtype.itemsize
            sb, rb = buffers.wire(sb), buffers.wire(rb)
            scounts, sdispls = [c * k for c in scounts], [x * k for x in sdispls]
            rcounts, rdispls = [c * k for c in rcounts], [x * k for x in rdispls]
        reqs: list[Any] = []
        places: list[tuple[np.ndarray, int, int, int]] = []
        try:
            for j, (sends, recvs) in enumerate(zip(plan.sends, plan.recvs)):
                sc, sd, rc, rd = [0] * size, [0] * size, [0] * size, [0] * size
                for peer, slot in sends.items():
                    sc[peer], sd[peer] = scounts[slot], sdispls[slot]
                target = rb
                if j:
                    target = np.empty(sum(rcounts[slot] for slot in recvs.values()), rb.dtype)
                at = 0
                for peer, slot in recvs.items():
                    rc[peer] = rcounts[slot]
                    if j:
                        rd[peer] = at
                        places.append((target, at, rdispls[slot], rcounts[slot]))
                        at += rcounts[slot]
                    else:
                        rd[peer] = rdispls[slot]
                reqs.append(c.Ialltoallv(sb, sc, sd, target, rc, rd))
        except errors.ProxyError as exc:
            raise convert(exc) from None
        return reqs[0] if len(reqs) == 1 else _Rounds(reqs, places, rb)

    def _allgather_args(self, name: str, sendbuf: Any, recvbuf: Any) -> tuple:
        plan = self._neighbour_plan()
        sb = buffers.parse(sendbuf, f"{name} sendbuf", False)
        if not isinstance(sb, np.ndarray):
            raise error(ERR_BUFFER, f"{name}: sendbuf must be a buffer (IN_PLACE is not defined here)")
        rb, rc, rd = _blocks(recvbuf, f"{name} recvbuf", True, plan.indegree)
        if any(c != sb.size for c in rc):
            raise error(ERR_COUNT, f"{name}: each receive block has {rc[0]} elements, the sendbuf {sb.size}")
        return sb, [sb.size] * plan.outdegree, [0] * plan.outdegree, rb, rc, rd

    def _allgatherv_args(self, name: str, sendbuf: Any, recvbuf: Any) -> tuple:
        plan = self._neighbour_plan()
        sb = buffers.parse(sendbuf, f"{name} sendbuf", False)
        if not isinstance(sb, np.ndarray):
            raise error(ERR_BUFFER, f"{name}: sendbuf must be a buffer (IN_PLACE is not defined here)")
        rb, rc, rd = _blocks(recvbuf, f"{name} recvbuf", True, plan.indegree)
        return sb, [sb.size] * plan.outdegree, [0] * plan.outdegree, rb, rc, rd

    def _alltoall_args(self, name: str, sendbuf: Any, recvbuf: Any) -> tuple:
        plan = self._neighbour_plan()
        sb, sc, sd = _blocks(sendbuf, f"{name} sendbuf", False, plan.outdegree)
        rb, rc, rd = _blocks(recvbuf, f"{name} recvbuf", True, plan.indegree)
        if sc and rc and sc[0] != rc[0]:
            raise error(ERR_COUNT, f"{name}: send blocks of {sc[0]} elements, receive blocks of {rc[0]}")
        return sb, sc, sd, rb, rc, rd

    def _alltoallv_args(self, name: str, sendbuf: Any, recvbuf: Any) -> tuple:
        plan = self._neighbour_plan()
        sb, sc, sd = _blocks(sendbuf, f"{name} sendbuf", False, plan.outdegree)
        rb, rc, rd = _blocks(recvbuf, f"{name} recvbuf", True, plan.indegree)
        return sb, sc, sd, rb, rc, rd

    # ---- blocking
    def Neighbor_allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        """Block i of recvbuf = the sendbuf of in-neighbour i."""
        Request(self._post_rounds("Neighbor_allgather",
                                  *self._allgather_args("Neighbor_allgather", sendbuf, recvbuf))).Wait()

    def Neighbor_allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        Request(self._post_rounds("Neighbor_allgatherv",
                                  *self._allgatherv_args("Neighbor_allgatherv", sendbuf, recvbuf))).Wait()

    def Neighbor_alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        """Block j of sendbuf to out-neighbour j; block i of recvbuf from in-neighbour i."""
        Request(self._post_rounds("Neighbor_alltoall",
                                  *self._alltoall_args("Neighbor_alltoall", sendbuf, recvbuf))).Wait()

    def Neighbor_alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        Request(self._post_rounds("Neighbor_alltoallv",
                                  *self._alltoallv_args("Neighbor_alltoallv", sendbuf, recvbuf))).Wait()

    # ---- nonblocking
    def Ineighbor_allgather(self, sendbuf: Any, recvbuf: Any) -> Request:
        return Request(self._post_rounds("Ineighbor_allgather",
                                         *self._allgather_args("Ineighbor_allgather", sendbuf, recvbuf)))

    def Ineighbor_allgatherv(self, sendbuf: Any, recvbuf: Any) -> Request:
        return Request(self._post_rounds("Ineighbor_allgatherv",
                                         *self._allgatherv_args("Ineighbor_allgatherv", sendbuf, recvbuf)))

    def Ineighbor_alltoall(self, sendbuf: Any, recvbuf: Any) -> Request:
        return Request(self._post_rounds("Ineighbor_alltoall",
                                         *self._alltoall_args("Ineighbor_alltoall", sendbuf, recvbuf)))

    def Ineighbor_alltoallv(self, sendbuf: Any, recvbuf: Any) -> Request:
        return Request(self._post_rounds("Ineighbor_alltoallv",
                                         *self._alltoallv_args("Ineighbor_alltoallv", sendbuf, recvbuf)))

    # ---- per-edge datatypes: a byte Neighbor_alltoallv (wcoll.py)
    def _alltoallw(self, name: str, sendbuf: Any, recvbuf: Any) -> Any:
        plan = self._neighbour_plan()
        p = wcoll.prepare(sendbuf, recvbuf, name, plan.outdegree, plan.indegree, in_place=False)
        req = self._post_rounds(name, p.sbuf, p.scounts, p.sdispls, p.rbuf, p.rcounts, p.rdispls)
        live = sorted({slot for r in plan.recvs for slot in r.values()})   # not the PROC_NULL edges
        return wcoll.wrap(req, p, live)

    def Neighbor_alltoallw(self, sendbuf: Any, recvbuf: Any) -> None:
        """Block j of sendbuf (sendcounts[j] x sendtypes[j] at byte sdispls[j]) to out-neighbour j;
        block i of recvbuf from in-neighbour i."""
        Request(self._alltoallw("Neighbor_alltoallw", sendbuf, recvbuf)).Wait()

    def Ineighbor_alltoallw(self, sendbuf: Any, recvbuf: Any) -> Request:
        return Request(self._alltoallw("Ineighbor_alltoallw", sendbuf, recvbuf))

    # ---- objects
    def neighbor_allgather(self, sendobj: Any) -> list:
        """The objects of the in-neighbours, in in-edge order (None from a PROC_NULL neighbour)."""
        plan = self._neighbour_plan()
        return self._exchange_objects([pickle.dumps(sendobj, 5)] * plan.outdegree, plan)

    def neighbor_alltoall(self, sendobj: Sequence[Any]) -> list:
        """Item j of ``sendobj`` to out-neighbour j; the list of what the in-neighbours sent."""
        plan = self._neighbour_plan()
        items = list(sendobj)
        if len(items) != plan.outdegree:
            raise error(ERR_ARG, f"neighbor_alltoall: {len(items)} objects for {plan.outdegree} "
                        "out-neighbours")
        return self._exchange_objects([pickle.dumps(o, 5) for o in items], plan)

    def _exchange_objects(self, blobs: list[bytes], plan: Plan) -> list:
        sizes = np.array([len(b) for b in blobs], np.int64)
        got = np.full(plan.indegree, -1, np.int64)     # -1 stays where a PROC_NULL edge sent nothing
        self.Neighbor_alltoall(sizes, got)
        send = np.frombuffer(b"".join(blobs), np.uint8) if blobs else np.empty(0, np.uint8)
        sdispls = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist() if blobs else []
        counts = [max(int(n), 0) for n in got]
        rdispls = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist() if counts else []
        recv = np.empty(sum(counts), np.uint8)
        self.Neighbor_alltoallv([send, (sizes.tolist(), sdispls), "B"], [recv, (counts, rdispls), "B"])
        return [None if n < 0 else pickle.loads(recv[d:d + n].tobytes()) for n, d in zip(got, rdispls)]
