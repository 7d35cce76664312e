"""Armed routes: a repeated device message launched from C at the fetch of its second half (a
component of ProgressEngine: ``engine.armed``).

A ping-pong or a training loop sends between the same two device buffers again and again, and each
message's Python (fetch, match, route, launch: tens of microseconds on the slower hosts) sits between
the second half's post and the copy. When a message ran as a publishing graph (the GPU stores both
completions: transports/cuda_publish.py), the engine remembers it as a *route*: both halves' records
and the graph's launch (the transport's ``proxy_repeat``). It then arms an entry of a small table
that C reads (shm/_native_armed.c, ``fire_armed``, called by the loop's fetch right after it took
the posted chain and before it unpacks it):

- a *pair* entry while neither half has come, from the moment the route ran (``arm_pair``). C
  claims the first half that comes (the loop keeps that op out of matching, ``held``) and fires the
  graph when the second comes, in the same batch or a later one;
- a *single* entry when one half went into matching unmatched (``arm``: a receive, or a send that
  found none); C fires it at the other half.

Python then does the match's bookkeeping while the copy runs (``armed_fired``, the transport's
``proxy_fired``). Why the launch is the one MPI's matching would have made:

- The halves are the next to match each other. A pair is armed only while nothing waits for the
  receiver that either half could meet (Matcher.route_clear: no receive of that source and tag, no
  wildcard receive, no such unexpected message) and no probe of the receiver waits; a single entry
  only while its half heads its queue with no wildcard receive pending (Matcher.next_recv_is,
  next_unexpected_is). Both name their peer and tag exactly.
- Nothing changes that while the entry is armed: any change to what waits for the receiver
  (Matcher.on_armed), a probe of the receiver, or a send of the pair held behind a fast-path cell
  disarms it; C voids it at any receive, probe or cancel of the receiver and any send or cancel of
  the sender to the receiver before the firing record, and when a fast-path cell waits for the
  receiver (a cell written before the send matches first; a receive takes the cells to its rank
  first). A claimed half whose entry goes is put into matching in its place: before the change that
  disarmed it, or before the batch whose record voided it (``_release``).
- The launch is the one Python would make: the same buffers (both records' buffer, offset, size,
  memory, dtype and flags are compared), no stream word to wait for (a record with one does not
  match), the graph not retired (every retirement disarms all: ``disarm_all``) nor relaunched since
  the arming (C compares the cell's token), its last run acked, its device current on the loop.
"""
from __future__ import annotations

import struct
from typing import Any, Callable

from shmproxy.core.ops import FLAG_MPROBED, FLAG_STREAM_WORD, FLAG_TYPED, KIND_SEND, Op
from shmproxy.engine.args import Transfer
from shmproxy.engine.matching import Matcher
from shmproxy.shm import _native
from shmproxy.shm import pool as P

ARMED_MAX = 8          # entries at once (a ping-pong needs two: one per direction)
HISTORY_MAX = 1024     # remembered halves (signatures), cleared when full
MASK64 = (1 << 64) - 1
_NO_ARM = FLAG_STREAM_WORD | FLAG_TYPED | FLAG_MPROBED
(A_STATE, A_SEND, A_RECV, A_HELD, A_DEVICE, A_POS, ARM_WORDS) = _native.ARMED_LAYOUT
A_HELD_SLOT, A_HELD_SEQ, A_HELD_POS, A_MSG_BYTES = range(A_HELD + 1, A_HELD + 5)
A_CELLS = A_DEVICE + 8
A_TOKEN, A_PUBLISHED, A_RC, A_T_FIRE = range(A_POS + 1, A_POS + 5)
ARM_FREE, ARM_ARMED, ARM_PAIR, ARM_HALF, ARM_FIRED, ARM_VOID = range(6)
HELD_SEND, HELD_RECV = 1, 2
assert A_MSG_BYTES + 1 == A_DEVICE and A_CELLS + 1 == A_POS and A_T_FIRE + 1 == ARM_WORDS
assert P.FRANK_CELLS_TAKEN == P.FRANK_CELLS_WRITTEN + 1 and P.FRANK_CELLS_DRAINED == P.FRANK_CELLS_WRITTEN + 2
_ROW = struct.Struct(f"<{A_CELLS}Q")   # an entry's words after its state, up to A_CELLS (_arm_entry)
IN_MATCHING, HELD = "matching", "held"   # where an entry's half is (None: a pair, neither came yet)


def _no_device() -> int:
    return -1   # no route armed yet: fire finds no entry to launch


def signature(op: Op) -> tuple:
    """What a half's record must hold to be the same message's half again: the fields C compares,
    in the entry's order (kind, owner, peer, tag, dtype, flags, buffer, offset, bytes, memory)."""
    return (op.kind, op.owner, op.peer, op.tag, op.dtype, op.flags & ~FLAG_STREAM_WORD, op.buf_id, op.offset,
            op.nbytes, op.mem)


class Route:
    """A message that ran as a publishing graph: its halves, connector and launch (the transport's)."""

    __slots__ = ("send", "recv", "conn", "repeat", "nbytes", "dst", "src", "tag", "entry")

    def __init__(self, send: Op, recv: Op, conn: Any, repeat: Any, nbytes: int):
        self.send, self.recv = signature(send), signature(recv)
        self.conn, self.repeat, self.nbytes = conn, repeat, nbytes
        self.dst, self.src, self.tag = recv.rank, send.rank, send.tag
        self.entry = -1   # its armed entry, if any


class ArmedRoutes:
    """The engine's armed routes. State: the entries (``buf``, shared with C, and per entry [route,
    half op, where it is, its place in the batch being processed]), the routes by either half's
    signature (``history``), and counts. What it needs of the engine comes to its constructor: the
    matcher (whose changes disarm), the transports' context, the fast path (whose cells a firing
    must not overtake), the pool's address and the requests' slots (which C writes), the engine's
    probes and ranks (read, never rebound by the engine), and ``append``, which puts an op into
    matching as the loop's fetch would."""

    def __init__(self, on: bool, matcher: Matcher, ctx: Any, fastpath: Any, seg_addr: int,
                 slots: tuple[int, int], probes: dict[int, list[Op]], local_of: dict[int, int], profiler: Any,
                 append: Callable[[Op], None]):
        self.on = on
        self.matcher, self.ctx, self.fastpath, self.seg_addr = matcher, ctx, fastpath, seg_addr
        self.slots = slots                   # (address of the pool's slot 0, slots per rank): fire's
        self.probes, self.local_of, self.profiler, self.append = probes, local_of, profiler, append
        self.buf = bytearray(8 * ARMED_MAX * ARM_WORDS)
        self.words = memoryview(self.buf).cast("Q")   # entry k's word w: [k * ARM_WORDS + w]
        self.addr = _native.buffer_info(self.buf, True)[0]
        self.held: list[list | None] = [None] * ARMED_MAX
        self.live: list[int] = []   # entries not free
        self.history: dict[tuple, Route] = {}
        self.skip: dict[int, int] = {}   # claimed records of the batch being processed: place -> entry
        self.quiet = 0   # > 0 while a held half goes into matching (_release): nothing is armed
        self.launch: tuple[int, Callable[[], int]] = (0, _no_device)   # (cuGraphLaunch, the current
        #                                                                device's getter) of the last arming
        self.counts = {"armed": 0, "pairs": 0, "claimed": 0, "fired": 0, "voided": 0, "disarmed": 0}
        if on:
            matcher.on_armed = self.disarm_dest

    # ------------------------------------------------------------------ remembering and arming
    def remember(self, t: Transfer, conn: Any) -> None:
        """``t`` just started as a publishing graph: its halves may come back (p2p.match)."""
        send, recv = t.send, t.recv
        if send.owner < 0 or (send.flags | recv.flags) & (FLAG_TYPED | FLAG_MPROBED):
            return
        rep = conn.transport.proxy_repeat(self.ctx, t)
        if rep is None:
            return
        hist = self.history
        if len(hist) >= HISTORY_MAX:
            self.disarm_all()
            hist.clear()
        old = hist.get(signature(recv))
        if old is not None and old.entry >= 0:
            if self.words[old.entry * ARM_WORDS + A_STATE] == ARM_FIRED:
                return   # fired in this batch, not yet seen: keep it as it is
            self._disarm(old.entry)
        route = hist[signature(recv)] = hist[signature(send)] = Route(send, recv, conn, rep, t.nbytes)
        self.arm_pair(route)

    def arm_pair(self, route: Route) -> None:
        """Arm ``route`` before either half came, where nothing waiting for its receiver could meet one."""
        if (route.entry < 0 and route.dst not in self.probes
                and self.matcher.route_clear(route.dst, route.src, route.tag)):
            self._arm_entry(route, ARM_PAIR, 0, None)

    def arm(self, op: Op, is_recv: bool) -> None:
        """``op`` (device memory) went into matching unmatched: arm its route's other half, where the
        route ran before and nothing may match before it."""
        route = self.history.get(signature(op))
        if route is None or op.flags & _NO_ARM or route.entry >= 0:
            return
        m = self.matcher
        ok = (m.next_recv_is(route.dst, op.peer, op.tag, op) if is_recv
              else m.next_unexpected_is(route.dst, op.rank, op.tag, op))
        if ok:
            self._arm_entry(route, ARM_ARMED, HELD_RECV if is_recv else HELD_SEND, op)

    def _arm_entry(self, route: Route, state: int, held: int, op: Op | None) -> None:
        if len(self.live) >= ARMED_MAX or self.quiet:
            return
        sender, receiver = route.send[1], route.recv[1]
        cells = 0
        if self.fastpath.on:
            fp = self.fastpath
            if (sender, receiver) in fp.held or fp.early or fp.retry:
                return
            cells = self.seg_addr + 8 * fp.f_cells[receiver][0]
        words = route.repeat.words()
        if words is None:
            return
        k = self.held.index(None)
        slot, seq = (op.req_slot, op.req_seq) if op is not None else (0, 0)
        _ROW.pack_into(self.buf, 8 * (k * ARM_WORDS + 1), *[v & MASK64 for v in route.send],
                       *[v & MASK64 for v in route.recv], held, slot, seq, MASK64, route.nbytes, *words[:-1],
                       cells)
        self.words[k * ARM_WORDS + A_STATE] = state   # last: the entry is whole
        self.held[k] = [route, op, IN_MATCHING if op is not None else None, -1]
        self.live.append(k)
        route.entry = k
        self.matcher.armed.add(route.dst)
        self.launch = (words[-1], route.repeat.current_device)
        self.counts["pairs" if state == ARM_PAIR else "armed"] += 1

    # ------------------------------------------------------------------ disarming
    def _entry(self, k: int) -> list:
        """Live entry ``k``'s [route, half op, where it is, its place in the batch]."""
        held = self.held[k]
        assert held is not None, f"entry {k} is not live"
        return held

    def _free(self, k: int) -> list:
        held = self._entry(k)
        self.held[k] = None
        self.words[k * ARM_WORDS + A_STATE] = ARM_FREE
        self.live.remove(k)
        route = held[0]
        route.entry = -1
        if not any(self._entry(j)[0].dst == route.dst for j in self.live):
            self.matcher.armed.discard(route.dst)
        return held

    def _disarm(self, k: int) -> None:
        """Free entry ``k`` (not a fired one) and put the half it held out of matching back in its place."""
        self.counts["disarmed"] += 1
        self._release(self._free(k))

    def _release(self, held: list) -> None:
        _route, op, where, pos = held
        if where != HELD:
            return
        if pos >= 0 and self.skip.pop(pos, None) is not None:
            return   # its place in this batch is still ahead: the loop appends it there
        # It was posted before anything the loop has yet to process. Often from inside a change to
        # matching (Matcher.on_armed), which goes on after this: nothing may be armed meanwhile, or
        # it would miss that change.
        self.quiet += 1
        try:
            self.append(op)
        finally:
            self.quiet -= 1

    def disarm_dest(self, dst: int) -> None:
        """What waits for rank ``dst`` is about to change: its entries go (not one C fired and the
        loop has yet to see, which this fetch's ``armed_fired`` completes)."""
        w = self.words
        for k in [k for k in self.live if self._entry(k)[0].dst == dst]:
            if self.held[k] is not None and w[k * ARM_WORDS + A_STATE] != ARM_FIRED:
                self._disarm(k)

    def disarm_all(self) -> None:
        """Before a launch an entry holds is destroyed (the transport's graphs retire)."""
        if self.on:
            w = self.words
            for k in [k for k in self.live if w[k * ARM_WORDS + A_STATE] != ARM_FIRED]:
                if self.held[k] is not None:
                    self._disarm(k)

    # ------------------------------------------------------------------ the loop's fetch
    def fire(self, records: int, start: int, n: int, out: tuple[list, list, list]) -> None:
        """Right after records ``start`` to ``n`` were taken into ``records`` (the fetch's take buffer,
        engine/fetching.py) and before they are unpacked: C claims and
        launches what they fire. Adds to ``out`` (ops to append before the batch: halves held since an
        earlier fetch whose entry was voided; entries fired; entries claimed) and frees the voided."""
        launch, current_device = self.launch
        slots, per_rank = self.slots
        fired, claimed = _native.fire_armed(self.addr, ARMED_MAX, records, start, n, slots,
                                            per_rank, current_device(), launch)
        first, all_fired, all_claimed = out
        all_fired += fired
        all_claimed += claimed
        w = self.words
        for k in [k for k in self.live if w[k * ARM_WORDS + A_STATE] == ARM_VOID]:
            held = self._free(k)
            self.counts["voided"] += 1
            if held[2] == HELD:   # claimed in an earlier fetch (one claimed in this one goes in its place)
                first.append(held[1])

    def claims_waiting(self, out: tuple[list, list, list]) -> bool:
        """Whether this fetch claimed a half whose other half has not come (the loop may take it now)."""
        w = self.words
        return any(w[k * ARM_WORDS + A_STATE] == ARM_HALF for k in out[2])

    def process(self, ops: list[Op], out: tuple[list, list, list]) -> None:
        """The fetched ops, with fire_armed's outcome: held halves released first, fired records
        completed, claimed ones held by their entries, the others appended."""
        first, fired_k, claimed_k = out
        w = self.words
        fired = {w[k * ARM_WORDS + A_POS]: k for k in fired_k}
        skip = {}
        for k in claimed_k:
            if w[k * ARM_WORDS + A_STATE] != ARM_FREE:   # not voided by a later record of this fetch
                skip[w[k * ARM_WORDS + A_HELD_POS]] = k
                self.counts["claimed"] += 1
        for pos, k in skip.items():
            held = self.held[k]
            held[1], held[2], held[3] = ops[pos], HELD, pos
        self.skip = skip   # first: a hook run by what follows may disarm a claim of this batch
        try:
            for op in first:
                self.append(op)
            for i, op in enumerate(ops):
                k = fired.get(i)
                if k is not None:
                    self.fired(op, k)
                elif i in skip:
                    k = skip.pop(i)
                    if self.held[k] is not None:
                        self.held[k][3] = -1   # held from now on
                else:
                    self.append(op)
        finally:
            self.skip = {}

    def fired(self, op: Op, k: int) -> None:
        """``op`` fired entry ``k``: the match Python would have made, with the copy already running."""
        at = k * ARM_WORDS
        w = self.words
        token, published = w[at + A_TOKEN], bool(w[at + A_PUBLISHED])
        rc, t_fire = w[at + A_RC], w[at + A_T_FIRE]
        route, held, where, _pos = self._free(k)
        send, recv = (op, held) if op.kind == KIND_SEND else (held, op)
        if where == IN_MATCHING:
            self.matcher.pop_next(route.dst, route.src, route.tag, held, held is recv)
        if self.fastpath.on:
            if not (where == IN_MATCHING and held is send) and send.pair_seq:   # as send_local would
                d = self.local_of.get(route.dst)
                if d is not None:
                    self.fastpath.sent(send, d)
            if self.fastpath.early:
                self.fastpath.drain_to(recv.owner)
        t = Transfer(send, recv, route.nbytes, t_fire)
        t.published = published
        if self.profiler.enabled:
            t.t_started = t_fire
        conn = route.conn
        conn.nmsgs += 1
        self.counts["fired"] += 1
        conn.transport.proxy_fired(self.ctx, conn, t, route.repeat, token, rc)
        self.arm_pair(route)   # the same message again, next time

    def describe(self) -> dict[str, Any]:
        """For the signal dump: entries now (and the ops they hold out of matching), and counts."""
        if not self.on:
            return {"on": False}
        held = [h[1].describe() for h in self.held if h is not None and h[2] == HELD]
        return {"on": True, "entries_now": len(self.live), "held_ops": held, **self.counts}
