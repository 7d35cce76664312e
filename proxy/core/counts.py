"""The counts table of the v-collectives, and who moves what to whom.

A rank posts Gatherv, Scatterv, Allgatherv, Alltoallv or Reduce_scatter with a table of 4 x size
int64 (send counts, send displacements, receive counts, receive displacements, in elements) at
offset 0 of a registered buffer whose id the op record carries in its tag word
(shmproxy.rank.collpost). The progress process copies the table out of shared memory once
(``read``: bounds-checked), then works from the copy.

``sends`` and ``recvs`` say, from one rank's own arguments, which blocks it sends to and receives
from each rank; they serve both the one-node builders (every rank's view is known) and the
across-nodes ones (only the local ranks' views are). ``claims`` turns those views into what must
agree between two ranks (what r sends q is what q expects from r; Reduce_scatter's recvcounts are
the same everywhere), and ``check`` names the first two ranks that disagree.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shmproxy.core import errors
from shmproxy.core.ops import COLL_NAMES, Coll

SCOUNTS, SDISPLS, RCOUNTS, RDISPLS = range(4)
MOVES = frozenset((Coll.GATHER, Coll.SCATTER, Coll.GATHERV, Coll.SCATTERV, Coll.ALLGATHERV, Coll.ALLTOALLV))


def empty(size: int) -> np.ndarray:
    return np.zeros((4, size), np.int64)


def nbytes(size: int) -> int:
    return 32 * size


def write(mm: Any, table: np.ndarray) -> None:
    """The rank: the table at offset 0 of a staging buffer's mapping."""
    np.frombuffer(mm, np.int64, count=table.size)[:] = table.reshape(-1)


def read(buf: Any, size: int, what: str) -> np.ndarray:
    """The progress process: a copy of the table at offset 0 of registered buffer ``buf``."""
    if buf is None or buf.size < nbytes(size):
        raise errors.InvalidArgument(f"{what}: the counts table is not in a registered buffer of "
                                     f"{nbytes(size)} B")
    table = np.frombuffer(buf.mm, np.int64, count=4 * size).reshape(4, size).copy()
    if (table < 0).any():
        raise errors.InvalidArgument(f"{what}: negative count or displacement in the counts table")
    return table


class View:
    """One rank's arguments of a v-collective: its rank, count (the record's), IN_PLACE flag and table."""

    __slots__ = ("rank", "count", "in_place", "table")

    def __init__(self, rank: int, count: int, in_place: bool, table: np.ndarray | None):
        self.rank, self.count, self.in_place, self.table = rank, count, in_place, table

    def counts(self) -> np.ndarray:
        """The table, which only the collectives that carry counts have (core.ops.COLL_WITH_COUNTS)."""
        if self.table is None:
            raise errors.InternalError(f"rank {self.rank}: a collective without counts asked for its table")
        return self.table


def sends(coll: int, v: View, root: int, size: int) -> tuple[bool, list[tuple[int, int, int]]]:
    """(from_recvbuf, [(dest, element offset, count)]) of what rank ``v.rank`` sends; from_recvbuf: an
    in-place Allgatherv sends its block out of its receive buffer."""
    r, n = v.rank, v.count
    if coll in (Coll.GATHER, Coll.GATHERV):
        return False, [] if (r == root and v.in_place) else [(root, 0, n)]
    if coll in (Coll.SCATTER, Coll.SCATTERV):
        if r != root:
            return False, []
        if coll == Coll.SCATTER:
            blocks = [(q, q * n, n) for q in range(size)]
        else:
            t = v.counts()
            blocks = [(q, int(t[SDISPLS][q]), int(t[SCOUNTS][q])) for q in range(size)]
        return False, [b for b in blocks if not (v.in_place and b[0] == r)]
    if coll == Coll.ALLGATHERV:
        if v.in_place:
            t = v.counts()
            return True, [(q, int(t[RDISPLS][r]), int(t[RCOUNTS][r])) for q in range(size) if q != r]
        return False, [(q, 0, n) for q in range(size)]
    if coll == Coll.ALLTOALLV:
        t = v.counts()
        return False, [(q, int(t[SDISPLS][q]), int(t[SCOUNTS][q])) for q in range(size)]
    raise errors.InternalError(f"{COLL_NAMES.get(coll, coll)} moves no blocks")


def recvs(coll: int, v: View, root: int, size: int) -> list[tuple[int, int, int]]:
    """[(source, element offset, count)] of what rank ``v.rank`` receives into its receive buffer."""
    q, n = v.rank, v.count
    if coll in (Coll.GATHER, Coll.GATHERV):
        if q != root:
            return []
        if coll == Coll.GATHER:
            blocks = [(r, r * n, n) for r in range(size)]
        else:
            t = v.counts()
            blocks = [(r, int(t[RDISPLS][r]), int(t[RCOUNTS][r])) for r in range(size)]
        return [b for b in blocks if not (v.in_place and b[0] == q)]
    if coll in (Coll.SCATTER, Coll.SCATTERV):
        return [] if (q == root and v.in_place) else [(root, 0, n)]
    if coll in (Coll.ALLGATHERV, Coll.ALLTOALLV):
        t = v.counts()
        return [(r, int(t[RDISPLS][r]), int(t[RCOUNTS][r])) for r in range(size)
                if not (v.in_place and r == q)]
    raise errors.InternalError(f"{COLL_NAMES.get(coll, coll)} moves no blocks")


def claims(coll: int, views: list[View], root: int, size: int) -> list[tuple]:
    """What these ranks say must agree with other ranks: (key, rank, count) triples."""
    out: list[tuple] = []
    if coll == Coll.REDUCE_SCATTER:
        for v in views:
            out += [(("c", q), v.rank, int(v.table[RCOUNTS][q])) for q in range(size)]  # type: ignore[index]
        return out
    if coll not in MOVES:
        return out
    for v in views:
        out += [(("m", v.rank, q), v.rank, n) for q, _off, n in sends(coll, v, root, size)[1]]
        out += [(("m", r, v.rank), v.rank, n) for r, _off, n in recvs(coll, v, root, size)]
    return out


def check(coll: int, seq: int, items: list[tuple], seen: dict | None = None) -> str | None:
    """The first disagreement among claims (``seen``: earlier claims of the same collective, kept
    across calls), as a message naming both ranks; None when all agree."""
    seen = {} if seen is None else seen
    name = COLL_NAMES.get(coll, str(coll))
    for key, rank, value in items:
        key = tuple(key)
        first = seen.setdefault(key, (rank, value))
        if first[1] != value:
            other, was = first
            if key[0] == "m":
                src, dst = key[1], key[2]
                sent, expected = (was, value) if other == src else (value, was)
                return (f"collective #{seq} {name}: counts disagree: rank {src} sends {sent} elements to "
                        f"rank {dst}, which expects {expected} from it")
            return (f"collective #{seq} {name}: counts disagree: rank {other} says recvcounts[{key[1]}] is "
                    f"{was}, rank {rank} says {value}")
    return None
