"""The collectives' frames between nodes: the SEND and RECV entries of the schedules of a collective
across nodes (shmproxy.coll.hierarchy), met here by key, for the socket transport (net_socket.py).

A SEND is one frame from the entry's region; a RECV waits for the frame of its key (or takes it from
the stash, when the frame came first) and lands it in its region, or, a folding RECV (sched.recv's
``fold``), lands its first operand op the frame there. Their frames take the link's wire
(shm/_wire.c: C threads, each frame split over NET_COLL_SOCKETS sockets, folded as it is read, the
finished ones' tokens drained by the loop after news: ``drain``), or without one the link's last
Python-threaded socket (``on_frame``, COLL).

A SEND that passes on what the RECV before it landed (a ring's next step) is handed to that RECV's
wire when the RECV starts (``forward_of``), which sends it the moment the bytes are in, and the
RECVs after such SENDs are posted at once: the data moves from step to step at the wire's pace, and
the loop only counts. Such an entry carries ``chain`` (core.ops.FORWARDING, then FORWARDED when its
token came before its schedule reached it).

Threads: ``on_frame`` runs on a link's Python reader thread and touches only ``recvs`` and ``stash``,
under the transport's lock; everything else is the loop's.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np

from shmproxy.core import errors
from shmproxy.core.ops import FORWARDED, FORWARDING, NOT_STARTED, RECV, SEND, STARTED
from shmproxy.transports import net_wire as W
from shmproxy.transports.base import TransportContext, land_folded

MAX_KEY = 512   # bytes of a collective entry's key on the wire


class CollFrames:
    """One progress process's collective frames to and from the other nodes."""

    def __init__(self, ctx: TransportContext, lock: threading.Lock, ids: "itertools.count[int]", chunk: int):
        self.ctx = ctx
        self.lock = lock     # the transport's: its reader threads take ``recvs`` and ``stash`` under it
        self.ids = ids       # the transport's ids (tokens share the space with its messages' ids)
        self.chunk = chunk   # NET_CHUNK_SIZE: with the collectives' largest chunk, a frame's bound
        self.forward = bool(ctx.params.NET_COLL_FORWARD)   # a ring's steps handed to the wires (forward_of)
        self.links: dict[int, W.Link] = {}   # node -> link, published whole by the transport
        self.recvs: dict[bytes, tuple] = {}   # key -> (schedule, entry, view, scratch): RECV started (no wire)
        self.stash: dict[bytes, bytes] = {}   # key -> bytes: arrived before its RECV (no wire)
        self.tokens: dict[int, tuple] = {}    # wire token -> (schedule, entry) in flight

    def entry(self, link: W.Link, sch: Any, e: Any) -> list:
        """Loop: start SEND or RECV ``e`` on ``link``; the (schedule, entry) pairs done now."""
        if e.chain:   # handed to the wires already, when the receive before it started (forward_of)
            return [(sch, e)] if e.chain == FORWARDED else []
        key = repr(e.key).encode()
        if len(key) > MAX_KEY:
            raise errors.InternalError(f"collective entry key {e.key!r} is too long for the wire")
        wire = link.wire
        if wire is not None:   # the link's collective sockets, driven by C threads (shm/_wire.c)
            # (its token is registered after the call: only this thread's drain ever reads the tokens)
            tok = next(self.ids)
            if e.kind == SEND:
                done = wire.send(key, e.src, e.nbytes, tok)   # True: written now, by us (no token comes)
            else:
                then = self.forward_of(sch, e)
                try:
                    done = wire.recv(key, e.dst, e.nbytes, tok, *(e.fold or (-1, 0, 0)), *then)
                except ValueError as exc:
                    raise errors.InvalidUsage(f"collective chunk {e.key!r}: {exc} (the nodes called different "
                                              f"collectives)") from exc
            if done:
                return [(sch, e)]
            self.tokens[tok] = (sch, e)
            return []
        if e.kind == SEND:
            # without a wire, one socket for a collective's chunks (docs/decisions.md: each socket's
            # Python threads queue for the GIL)
            link.bulk(W.COLL, len(key), 0, [key, W.address_view(e.src, e.nbytes) if e.nbytes else b""],
                      lambda: self.ctx.post_event(lambda: self.ctx.entry_done(sch, e)), spread=False)
            return []
        # a folding receive lands in a scratch that the loop reduces from (the wire folds as it reads)
        scratch = np.empty(e.nbytes, np.uint8) if e.fold is not None else None
        view = (memoryview(scratch.data) if scratch is not None else
                W.address_view(e.dst, e.nbytes) if e.nbytes else memoryview(b""))
        with self.lock:
            data = self.stash.pop(key, None)
            if data is None:
                self.recvs[key] = (sch, e, view, scratch)
                return []
        if len(data) != e.nbytes:
            raise errors.InvalidUsage(f"collective chunk {e.key!r}: {len(data)} B arrived for a {e.nbytes} B "
                                      f"receive (the nodes called different collectives)")
        if scratch is not None:
            land_folded(e, np.frombuffer(data, np.uint8).ctypes.data if data else 0)
        elif data:
            view[:] = data
        return [(sch, e)]

    def on_frame(self, a: int, n: int, rd: W.Inbox) -> None:
        """A link's reader: a COLL frame (key of ``a`` bytes, ``n`` in all) on a Python-threaded socket."""
        if not 0 < a <= MAX_KEY or n < a or n - a > max(self.chunk, self.ctx.coll_chunk_max):
            raise W.ProtocolError(f"COLL frame with a {a} B key and {n} B")
        key = rd.payload(a)
        nbytes = n - a
        with self.lock:
            waiting = self.recvs.pop(key, None)
            if waiting is None:
                self.stash[key] = rd.payload(nbytes)
                return
        sch, e, view, scratch = waiting
        if nbytes != e.nbytes:
            raise W.ProtocolError(f"collective chunk {key!r}: {nbytes} B for a {e.nbytes} B receive "
                                  f"(the nodes called different collectives)")
        if nbytes and not rd.read_into(view):
            raise W.ProtocolError("connection closed inside a frame")
        if scratch is not None:   # a folding receive: the loop reduces what landed in its scratch
            def folded() -> None:
                land_folded(e, scratch.ctypes.data)
                self.ctx.entry_done(sch, e)
            rd.later(folded)
        else:
            rd.later(lambda: self.ctx.entry_done(sch, e))

    def forward_of(self, sch: Any, e: Any) -> tuple:
        """RECV ``e`` is starting on a wire. When the entries after it pass on what the one before
        landed (a ring's steps: SEND of exactly the bytes the RECV before it lands, then the next
        RECV, ...), hand them to the wires now: each SEND to the wire of the RECV before it, which
        sends it from the thread that landed the bytes, the moment they are in; each RECV posted
        ahead, so that the frame its peer forwards the same way lands in place (not in the stash).
        Returns ``then`` for ``e`` ((wire, key, token) of the SEND after it) or ().

        The schedule's barriers are whole (a SEND waits for every entry before it); what they protect
        here is memory, so an entry is handed over early only where nothing still in flight touches
        its bytes: no other kind of entry may still run, a SEND reads only what the RECV before it
        wrote, and a RECV writes (and folds from) memory that no SEND in flight reads and no other
        RECV in flight writes. The walk stops at the first entry that fails this (in a ring: the
        allgather's first receive, whose segment the reduce-scatter's first send still reads)."""
        ents, i = sch.entries, sch.next
        if not self.forward or not e.nbytes or i >= len(ents):
            return ()
        reads: list[tuple[int, int]] = []
        for x in ents[:i]:
            if x.status == STARTED and x is not e:
                if x.kind != SEND:
                    return ()
                reads.append((x.src, x.nbytes))
        writes = [(e.dst, e.nbytes)]
        prev: Any = e
        then: tuple = ()
        ahead: list[list[Any]] = []   # [RECV, its then, its wire, its key], posted after the walk
        while i + 1 < len(ents):
            s, r = ents[i], ents[i + 1]
            if (s.kind != SEND or s.status != NOT_STARTED or s.chain or s.src != prev.dst
                    or s.nbytes != prev.nbytes or _touches(s.src, s.nbytes, writes[:-1])):
                break
            s_wire, s_key = self._wire_key(s)
            if s_wire is None:
                break
            tok = next(self.ids)
            self.tokens[tok] = (sch, s)
            s.chain = FORWARDING
            if prev is e:
                then = (s_wire, s_key, tok)
            else:
                ahead[-1][1] = (s_wire, s_key, tok)
            reads.append((s.src, s.nbytes))
            if (r.kind != RECV or r.status != NOT_STARTED or r.chain or not r.nbytes
                    or _touches(r.dst, r.nbytes, reads + writes)
                    or (r.fold is not None and r.fold[2] != r.dst and _touches(r.fold[2], r.nbytes, writes))):
                break
            r_wire, r_key = self._wire_key(r)
            if r_wire is None:
                break
            ahead.append([r, (), r_wire, r_key])
            writes.append((r.dst, r.nbytes))
            prev, i = r, i + 2
        for r, r_then, r_wire, r_key in ahead:   # (each knows its forward before it is posted)
            tok = next(self.ids)
            self.tokens[tok] = (sch, r)
            r.chain = FORWARDING
            try:
                if r_wire.recv(r_key, r.dst, r.nbytes, tok, *(r.fold or (-1, 0, 0)), *r_then):
                    del self.tokens[tok]
                    r.chain = FORWARDED
            except ValueError as exc:
                raise errors.InvalidUsage(f"collective chunk {r.key!r}: {exc} (the nodes called different "
                                          f"collectives)") from exc
        return then

    def _wire_key(self, e: Any) -> tuple:
        """(the wire to e's peer node, e's key on it), or (None, b"") where there is none."""
        link = self.links.get(e.peer)
        key = repr(e.key).encode()
        if link is None or link.wire is None or len(key) > MAX_KEY:
            return None, b""
        return link.wire, key

    def drain(self) -> None:
        """Loop, after news: the collective frames the links' wires sent or landed (shm/_wire.c), and
        why a wire broke."""
        for link in list(self.links.values()):
            wire = link.wire
            if wire is None:
                continue
            tokens, lost = wire.poll()
            for tok in tokens:
                done = self.tokens.pop(tok, None)
                if done is None:   # the receive was cancelled by a failure
                    continue
                sch, e = done
                if e.status == NOT_STARTED:   # a forwarded send, sent before its schedule reached it
                    e.chain = FORWARDED
                    continue
                self.ctx.entry_done(sch, e)
            if lost is not None:
                link.broken(f"collective sockets: {lost}")

    def waiting(self) -> tuple[list, int]:
        """Loop, for the dump: the RECV entries that wait for a frame, and how many frames wait for theirs."""
        with self.lock:
            recvs = [e for _sch, e, _view, _scratch in self.recvs.values()]
            stashed = len(self.stash)
        return recvs + [e for _sch, e in list(self.tokens.values()) if e.kind != SEND], stashed


def _touches(addr: int, n: int, ranges: list[tuple[int, int]]) -> bool:
    """True when [addr, addr + n) overlaps one of ``ranges`` ((address, bytes) each)."""
    return any(a < addr + n and addr < a + m for a, m in ranges)
