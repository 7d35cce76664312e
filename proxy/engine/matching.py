"""Point-to-point message matching with MPI wildcards, for the ranks one progress process serves.

A send reaches the matcher as an *arrival* (its envelope: destination, source, tag); a receive as a
*post* (destination, source or ANY_SOURCE, tag or ANY_TAG). The matcher pairs them; the items it is
handed (the engine's Op) are opaque to it and compared by identity only.

MPI's ordering rules, and how this structure gives each of them:

1. An arriving message matches the EARLIEST POSTED pending receive of its destination that accepts
   it (source equal or ANY_SOURCE, tag equal or ANY_TAG; ANY_TAG never takes the runtime's reserved
   tags, core.ops.RESERVED_TAG_LO/HI). Receives with no wildcard wait in a FIFO
   per (source, tag), so the earliest specific one that can accept is that queue's head; receives
   with a wildcard wait in one list per destination in posting order, so the earliest wildcard one
   that can accept is the first acceptor in that list. Every post takes a number from one increasing
   sequence, so the earlier of those two candidates is the one with the smaller number.
2. A new receive matches the EARLIEST ARRIVED unexpected message it accepts. Unexpected messages
   wait in a FIFO per (destination, source, tag), numbered from the same sequence on arrival. A
   specific receive can only accept one queue, so it takes that head; a wildcard receive takes, among
   the heads of the queues it accepts, the one with the smallest number. A head is the earliest of
   its queue, so no non-head message can be earlier than the winning head.
3. Non-overtaking (two messages from one source to one destination that a receive both accepts are
   matched in the order they were sent; receives are satisfied in the order they were posted)
   follows from 1 and 2 because arrivals and posts are fed in that order.

Invariant: no pending receive accepts any pending unexpected message (each item is matched on entry
if it can be, and removals keep this true), so matching only ever looks at the newcomer.

Cost: with no wildcard receive pending for a destination, arrive and post are a few dict lookups and
deque operations, no scan. The wildcard list is walked only while it holds receives, and only up to
the specific candidate's sequence number; a wildcard post or a probe looks at the heads of the
destination's unexpected queues, never deeper. take, cancel and drop search (they are rare).
`scanned` counts every entry those walks examine, so tests can check the common path does none.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Iterator

from shmproxy.core import errors
from shmproxy.core.ops import ANY_SOURCE, ANY_TAG, RESERVED_TAG_HI, RESERVED_TAG_LO

Entry = tuple[int, Any]   # (sequence number, item)
_deque = collections.deque


class _Dest:
    """What is pending for one destination rank."""

    __slots__ = ("recvs", "wild", "unexp")

    def __init__(self) -> None:
        self.recvs: dict[tuple[int, int], collections.deque[Entry]] = {}   # specific posted receives
        self.wild: list[tuple[int, int, int, Any]] = []                    # (seq, src, tag, item)
        self.unexp: dict[tuple[int, int], collections.deque[Entry]] = {}   # unexpected, by (src, tag)

    def empty(self) -> bool:
        return not (self.recvs or self.wild or self.unexp)


def _not_armed(dst: int) -> None:
    raise errors.InternalError(f"destination {dst} is marked armed, but no armed routes are set up")


def _accepts(want_src: int, want_tag: int, src: int, tag: int) -> bool:
    # ANY_TAG leaves the runtime's reserved tags alone (core/ops.py)
    return ((want_src == src or want_src == ANY_SOURCE)
            and (want_tag == tag or (want_tag == ANY_TAG and not RESERVED_TAG_LO <= tag < RESERVED_TAG_HI)))


class Matcher:
    """Posted receives and unexpected messages of some destination ranks, matched by MPI's rules."""

    __slots__ = ("_dests", "_seq", "scanned", "gauge", "armed", "on_armed")

    def __init__(self) -> None:
        self._dests: dict[int, _Dest] = {}
        self._seq = 0
        self.scanned = 0   # entries examined by walks (wildcard list, queue heads, searches); for tests
        # gauge(dst, src, delta): told of every unexpected message from src to dst queued (+1) or
        # removed (-n) (the fast path publishes the counts: engine/fastpath.py)
        self.gauge: Callable[[int, int, int], None] | None = None
        # Destinations with an armed route (engine/armed.py): any change to what waits for one of them
        # calls on_armed(dst) first, which disarms it (an armed half must stay the next to match).
        self.armed: set[int] = set()
        self.on_armed: Callable[[int], None] = _not_armed   # set with the first armed route

    # ------------------------------------------------------------------ matching
    # arrive and post run for every message: locals instead of repeated attribute loads, and the
    # specific case first (no wildcard pending: dict lookups and deque operations only).
    def arrive(self, dst: int, src: int, tag: int, item: Any) -> Any | None:
        """A send's envelope: return the receive it matches (removed), else queue it as unexpected."""
        if src < 0 or tag == ANY_TAG:
            raise errors.InvalidArgument(
                f"a message's envelope cannot hold a wildcard (source {src}, tag {tag})")
        if self.armed and dst in self.armed:
            self.on_armed(dst)
        d = self._dests.get(dst)
        if d is None:
            d = self._dests[dst] = _Dest()   # kept once made: a destination's _Dest outlives its queues
        key = (src, tag)
        recvs, wild = d.recvs, d.wild
        q = recvs.get(key)
        if wild:
            best = q[0][0] if q else None
            for i, (seq, wsrc, wtag, witem) in enumerate(wild):
                if best is not None and seq > best:
                    break   # later than the specific candidate: it cannot win
                self.scanned += 1
                if _accepts(wsrc, wtag, src, tag):
                    del wild[i]
                    return witem
        if q:
            recv = q.popleft()[1]
            if not q:
                del recvs[key]
            return recv
        self._seq = seq = self._seq + 1
        unexp = d.unexp
        u = unexp.get(key)
        if u is None:
            unexp[key] = _deque(((seq, item),))
        else:
            u.append((seq, item))
        if self.gauge is not None:
            self.gauge(dst, src, 1)
        return None

    def post(self, dst: int, src: int, tag: int, item: Any) -> Any | None:
        """A new receive: return the unexpected message it matches (removed), else queue it as posted."""
        if src < ANY_SOURCE:
            raise errors.InvalidArgument(f"a receive's source must be a rank or ANY_SOURCE, not {src}")
        if self.armed and dst in self.armed:
            self.on_armed(dst)
        d = self._dests.get(dst)
        if d is None:
            d = self._dests[dst] = _Dest()   # kept once made: a destination's _Dest outlives its queues
        specific = src != ANY_SOURCE and tag != ANY_TAG
        key = (src, tag)
        unexp = d.unexp
        if unexp:
            found = key if specific else self._earliest(d, src, tag)
            q = unexp.get(found) if found is not None else None
            if q and found is not None:
                send = q.popleft()[1]
                if not q:
                    del unexp[found]
                if self.gauge is not None:
                    self.gauge(dst, found[0], -1)
                return send
        self._seq = seq = self._seq + 1
        if specific:
            recvs = d.recvs
            q = recvs.get(key)
            if q is None:
                recvs[key] = _deque(((seq, item),))
            else:
                q.append((seq, item))
        else:
            d.wild.append((seq, src, tag, item))
        return None

    def probe(self, dst: int, src: int, tag: int) -> Any | None:
        """The unexpected message a receive (src, tag) would match now, left in place (MPI_Iprobe)."""
        d = self._dests.get(dst)
        if d is None or not d.unexp:
            return None
        key = self._earliest(d, src, tag)
        return None if key is None else d.unexp[key][0][1]

    def _earliest(self, d: _Dest, src: int, tag: int) -> tuple[int, int] | None:
        """Key of the unexpected queue whose head a receive (src, tag) matches (rule 2)."""
        if src != ANY_SOURCE and tag != ANY_TAG:
            return (src, tag) if (src, tag) in d.unexp else None
        best_key, best_seq = None, 0
        for key, q in d.unexp.items():
            self.scanned += 1
            if _accepts(src, tag, key[0], key[1]) and (best_key is None or q[0][0] < best_seq):
                best_key, best_seq = key, q[0][0]
        return best_key

    def is_unexpected(self, dst: int, src: int, tag: int, item: Any) -> bool:
        """``item`` waits in the unexpected queue of (dst, src, tag)."""
        d = self._dests.get(dst)
        q = d.unexp.get((src, tag)) if d is not None else None
        return q is not None and any(e[1] is item for e in q)

    def replace_unexpected(self, dst: int, src: int, tag: int, old: Any, new: Any) -> bool:
        """Put ``new`` in the place of the unexpected message ``old`` (a send the engine buffered),
        keeping its place in matching order."""
        if self.armed and dst in self.armed:
            self.on_armed(dst)
        d = self._dests.get(dst)
        q = d.unexp.get((src, tag)) if d is not None else None
        if not q:
            return False
        for i in range(len(q) - 1, -1, -1):   # most often the newest
            if q[i][1] is old:
                q[i] = (q[i][0], new)
                return True
        return False

    # ------------------------------------------------------------------ armed routes (engine/armed.py)
    def route_clear(self, dst: int, src: int, tag: int) -> bool:
        """Whether nothing waits for ``dst`` that a message (src, tag) or a receive (src, tag) would
        meet: no such receive, no wildcard receive, no such unexpected message."""
        d = self._dests.get(dst)
        return d is None or not (d.wild or (src, tag) in d.recvs or (src, tag) in d.unexp)

    def next_recv_is(self, dst: int, src: int, tag: int, item: Any) -> bool:
        """Whether the posted specific receive ``item`` is the one a message (src, tag) to ``dst``
        would match now: the head of its queue, with no wildcard receive pending for ``dst``."""
        d = self._dests.get(dst)
        q = d.recvs.get((src, tag)) if d is not None and not d.wild else None
        return q is not None and bool(q) and q[0][1] is item

    def next_unexpected_is(self, dst: int, src: int, tag: int, item: Any) -> bool:
        """Whether the unexpected message ``item`` is the one a receive (src, tag) at ``dst`` would
        match now: the head of its queue."""
        d = self._dests.get(dst)
        q = d.unexp.get((src, tag)) if d is not None else None
        return q is not None and bool(q) and q[0][1] is item

    def pop_next(self, dst: int, src: int, tag: int, item: Any, posted: bool) -> None:
        """Remove ``item``, found by next_recv_is (``posted``) or next_unexpected_is when its route was
        armed and has not been disarmed since: its queue's head still."""
        d = self._dests[dst]
        queues = d.recvs if posted else d.unexp
        q = queues[(src, tag)]
        if q[0][1] is not item:
            raise errors.InternalError(f"an armed route's {'receive' if posted else 'message'} to rank {dst} "
                                       f"is no longer the next to match")
        q.popleft()
        if not q:
            del queues[(src, tag)]
        if not posted and self.gauge is not None:
            self.gauge(dst, src, -1)

    # ------------------------------------------------------------------ removal
    def take(self, dst: int, item: Any) -> bool:
        """Remove the unexpected message `item` (after a matched probe); False if it is not queued."""
        if self.armed and dst in self.armed:
            self.on_armed(dst)
        d = self._dests.get(dst)
        if d is None:
            return False
        for key, q in d.unexp.items():
            if self._remove_from(q, item):
                if not q:
                    del d.unexp[key]
                if self.gauge is not None:
                    self.gauge(dst, key[0], -1)
                return True
        return False

    def cancel(self, dst: int, item: Any) -> bool:
        """Remove the posted receive `item`; False if it is not pending (already matched, say)."""
        if self.armed and dst in self.armed:
            self.on_armed(dst)
        d = self._dests.get(dst)
        if d is None:
            return False
        for i, w in enumerate(d.wild):
            self.scanned += 1
            if w[3] is item:
                del d.wild[i]
                return True
        for key, q in d.recvs.items():
            if self._remove_from(q, item):
                if not q:
                    del d.recvs[key]
                return True
        return False

    def drop(self, pred: Callable[[int, int, int, Any], bool], posted: bool = True,
             unexpected: bool = True) -> list[Any]:
        """Remove every pending item (posted receives and/or unexpected messages) for which
        pred(dst, src, tag, item) is true; return them in the order they were posted or arrived."""
        out: list[Entry] = []
        for dst in list(self.armed):
            self.on_armed(dst)
        for dst, d in list(self._dests.items()):
            if posted:
                keep = []
                for w in d.wild:
                    if pred(dst, w[1], w[2], w[3]):
                        out.append((w[0], w[3]))
                    else:
                        keep.append(w)
                d.wild = keep
                self._drop_queues(dst, d.recvs, pred, out)
            if unexpected:
                self._drop_queues(dst, d.unexp, pred, out, self.gauge)
        out.sort(key=lambda e: e[0])
        return [item for _, item in out]

    @staticmethod
    def _drop_queues(dst: int, queues: dict[tuple[int, int], collections.deque[Entry]],
                     pred: Callable[[int, int, int, Any], bool], out: list[Entry],
                     gauge: Callable[[int, int, int], None] | None = None) -> int:
        """Move the entries of `queues` that pred picks to `out` (telling ``gauge``); return how many."""
        before = len(out)
        for (src, tag), q in list(queues.items()):
            keep: collections.deque[Entry] = collections.deque()
            n = len(out)
            for e in q:
                (out if pred(dst, src, tag, e[1]) else keep).append(e)
            if gauge is not None and len(out) > n:
                gauge(dst, src, n - len(out))
            if keep:
                queues[(src, tag)] = keep
            else:
                del queues[(src, tag)]
        return len(out) - before

    def _remove_from(self, q: collections.deque[Entry], item: Any) -> bool:
        for i, e in enumerate(q):
            self.scanned += 1
            if e[1] is item:
                del q[i]
                return True
        return False

    # ------------------------------------------------------------------ bookkeeping and views
    @property
    def nposted(self) -> int:
        """Posted receives pending, all destinations (counted when asked: not on the matching path)."""
        return sum(self.counts(dst)[0] for dst in self._dests)

    @property
    def nunexpected(self) -> int:
        return sum(self.counts(dst)[1] for dst in self._dests)

    def __len__(self) -> int:
        return self.nposted + self.nunexpected

    def dests(self) -> list[int]:
        """The destinations with anything pending, in increasing order."""
        return sorted(dst for dst, d in self._dests.items() if not d.empty())

    def posted(self, dst: int) -> Iterator[tuple[int, int, Any]]:
        """dst's pending receives as (src, tag, item), in posting order."""
        d = self._dests.get(dst)
        if d is None:
            return iter(())
        entries = [(seq, src, tag, item) for (src, tag), q in d.recvs.items() for seq, item in q]
        return ((src, tag, item) for _, src, tag, item in sorted(entries + d.wild, key=lambda e: e[0]))

    def unexpected(self, dst: int) -> Iterator[tuple[int, int, Any]]:
        """dst's unexpected messages as (src, tag, item), in arrival order."""
        d = self._dests.get(dst)
        if d is None:
            return iter(())
        entries = sorted(((seq, src, tag, item) for (src, tag), q in d.unexp.items() for seq, item in q),
                         key=lambda e: e[0])
        return ((src, tag, item) for _, src, tag, item in entries)

    def counts(self, dst: int) -> tuple[int, int]:
        """(posted receives, unexpected messages) pending for dst."""
        d = self._dests.get(dst)
        if d is None:
            return 0, 0
        return (sum(map(len, d.recvs.values())) + len(d.wild), sum(map(len, d.unexp.values())))
