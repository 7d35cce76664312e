"""Armed routes: a repeated device message launched from C at the fetch of its second half (a mixin
of ProgressEngine).

A ping-pong or a training loop sends between the same two device buffers again and again, and each
message's Python (fetch, match, route, launch: tens of microseconds on the slower hosts) sits between
the second half's post and the copy. When a message ran as a publishing graph (the GPU stores both
completions: transports/cuda_publish.py), the engine remembers its two halves. Later, when one half
of the same message waits in matching (a posted receive, or a send that found none), the engine
*arms* an entry in a small table: the other half's record, field for field, and the graph's launch
(the transport's ``proxy_repeat``). The loop's fetch hands the taken records to C before it unpacks
them (shm/_native_armed.c, ``fire_armed``): a record equal to an armed entry launches the graph there
and then, and Python does the match's bookkeeping while the copy runs (``armed_fired``, the
transport's ``proxy_fired``).

Why the launch is the one MPI's matching would have made:

- The armed half is the next to match: a receive at the head of its (source, tag) queue with no
  wildcard receive pending for its rank, or a message at the head of its unexpected queue
  (Matcher.next_recv_is, next_unexpected_is), and it names its peer and tag exactly.
- Nothing changes that while the entry is armed: any change to what waits for the receiving rank
  (Matcher.on_armed) disarms it, as does a send of the pair held behind a fast-path cell; C voids it
  at any other point-to-point record of either rank taken before the firing one in the same batch,
  and when a fast-path cell to the receiver is waiting (a cell written before the send must match
  first).
- The launch is the one Python would make: the same buffers (the record's buffer, offset, size,
  memory and dtype are compared), no stream word to wait for (a record with one does not match), the
  graph not retired (every retirement disarms all: ``disarm_all``) and not relaunched since the
  arming (C compares the cell's token), its last run acked, and its device current on the loop.

A voided entry costs nothing but the Python path the message would have taken anyway.
"""
from __future__ import annotations

from typing import Any

import struct

from shmproxy.core.ops import FLAG_MPROBED, FLAG_STREAM_WORD, FLAG_TYPED, Op
from shmproxy.engine.args import Transfer
from shmproxy.shm import _native
from shmproxy.shm import pool as P

ARMED_MAX = 8          # entries armed at once (a ping-pong needs one; pairs of ranks, one each)
HISTORY_MAX = 1024     # remembered messages (halves' signatures), cleared when full
MASK64 = (1 << 64) - 1
_NO_ARM = FLAG_STREAM_WORD | FLAG_TYPED | FLAG_MPROBED
(A_STATE, A_FIELDS, A_ARMED_SLOT, A_DEVICE, A_POS, ARM_WORDS) = _native.ARMED_LAYOUT
A_OTHER = A_FIELDS + 10
A_ARMED_SEQ, A_ARMED_SOURCE, A_ARMED_TAG, A_FIRE_SOURCE, A_FIRE_TAG, A_MSG_BYTES = range(A_ARMED_SLOT + 1,
                                                                                         A_ARMED_SLOT + 7)
A_CELLS = A_DEVICE + 8
A_TOKEN, A_PUBLISHED, A_RC, A_T_FIRE = range(A_POS + 1, A_POS + 5)
ARM_FREE, ARM_ARMED, ARM_FIRED, ARM_VOID = range(4)
assert A_MSG_BYTES + 1 == A_DEVICE and A_CELLS + 1 == A_POS and A_T_FIRE + 1 == ARM_WORDS
_ROW = struct.Struct(f"<{A_CELLS}Q")   # an entry's words after its state, up to A_CELLS (arm)
assert P.FRANK_CELLS_TAKEN == P.FRANK_CELLS_WRITTEN + 1 and P.FRANK_CELLS_DRAINED == P.FRANK_CELLS_WRITTEN + 2


def signature(op: Op) -> tuple:
    """What a half's record must hold to be the same message's half again: the fields C compares,
    in the entry's order (kind, owner, peer, tag, dtype, flags, buffer, offset, bytes, memory)."""
    return (op.kind, op.owner, op.peer, op.tag, op.dtype, op.flags & ~FLAG_STREAM_WORD, op.buf_id, op.offset,
            op.nbytes, op.mem)


class ArmedRoutes:
    """State: the entries (``arm_buf``, shared with C, and what Python keeps of each), the halves of
    published messages (``arm_history``), and counts for the dump."""

    # Until init_armed (engines built without a pool, in tests, have none): off, and read only.
    arm_on = False
    arm_history: dict = {}
    arm_live: list = []

    def init_armed(self, on: bool) -> None:
        self.arm_on = on
        self.arm_buf = bytearray(8 * ARMED_MAX * ARM_WORDS)
        self.arm_words = memoryview(self.arm_buf).cast("Q")   # entry k's word w: [k * ARM_WORDS + w]
        self.arm_addr = _native.buffer_info(self.arm_buf, True)[0]
        self.arm_held: list[tuple | None] = [None] * ARMED_MAX   # (op, is_recv, dst, conn, repeat, nbytes)
        self.arm_live: list[int] = []   # entries not free
        self.arm_ops: dict[Op, int] = {}
        self.arm_history: dict[tuple, tuple] = {}
        self.arm_launch = (0, 0)   # (cuGraphLaunch, the current device's getter) of the last arming
        self.arm_counts = {"armed": 0, "fired": 0, "voided": 0, "disarmed": 0}
        self.matcher.on_armed = self.disarm_dest

    # ------------------------------------------------------------------ remembering and arming
    def remember(self, t: Transfer, conn: Any) -> None:
        """``t`` just started as a publishing graph: its halves may come back (p2p.match)."""
        send, recv = t.send, t.recv
        if send.owner < 0 or (send.flags | recv.flags) & (FLAG_TYPED | FLAG_MPROBED):
            return
        rep = conn.transport.proxy_repeat(self.ctx, t)
        if rep is None:
            return
        hist = self.arm_history
        if len(hist) >= HISTORY_MAX:
            hist.clear()
        hist[signature(recv)] = (signature(send), conn, rep, t.nbytes)
        hist[signature(send)] = (signature(recv), conn, rep, t.nbytes)

    def arm(self, op: Op, is_recv: bool) -> None:
        """``op`` (device memory) went into matching unmatched: arm its message's other half, where
        the same message ran before as a publishing graph and nothing may match before it."""
        got = self.arm_history.get(signature(op))
        if got is None or op.flags & _NO_ARM or op in self.arm_ops or len(self.arm_live) >= ARMED_MAX:
            return
        fire_sig, conn, rep, n = got
        m = self.matcher
        if is_recv:
            dst, sender, receiver = op.rank, fire_sig[1], op.owner
            if not m.next_recv_is(dst, op.peer, op.tag, op):
                return
        else:
            dst, sender, receiver = op.peer, op.owner, fire_sig[1]
            if not m.next_unexpected_is(dst, op.rank, op.tag, op):
                return
        cells = 0
        if self.fast:
            if (sender, receiver) in self.fast_held or self.fast_early or self.fast_retry:
                return
            cells = self.seg.addr + 8 * self.f_cells[receiver][0]
        words = rep.words()
        if words is None:
            return
        k = self.arm_held.index(None)
        tag = op.tag & MASK64
        launch = words[-1]
        _ROW.pack_into(self.arm_buf, 8 * (k * ARM_WORDS + 1), *[v & MASK64 for v in fire_sig], op.owner, op.req_slot,
                       op.req_seq, op.peer & MASK64, tag, op.rank, tag, n, *words[:-1], cells)
        self.arm_words[k * ARM_WORDS + A_STATE] = ARM_ARMED   # last: the entry is whole
        self.arm_held[k] = (op, is_recv, dst, conn, rep, n)
        self.arm_live.append(k)
        self.arm_ops[op] = k
        m.armed.add(dst)
        self.arm_launch = (launch, rep.current_device)
        self.arm_counts["armed"] += 1

    # ------------------------------------------------------------------ disarming
    def _free(self, k: int) -> None:
        held = self.arm_held[k]
        self.arm_held[k] = None
        self.arm_words[k * ARM_WORDS + A_STATE] = ARM_FREE
        self.arm_live.remove(k)
        self.arm_ops.pop(held[0], None)
        dst = held[2]
        if not any(self.arm_held[j][2] == dst for j in self.arm_live):
            self.matcher.armed.discard(dst)

    def disarm_dest(self, dst: int) -> None:
        """What waits for rank ``dst`` is about to change: its armed entries go (not one C fired and
        the loop has yet to see, which this fetch's ``armed_fired`` completes)."""
        for k in [k for k in self.arm_live if self.arm_held[k][2] == dst]:
            if self.arm_words[k * ARM_WORDS + A_STATE] != ARM_FIRED:
                self._free(k)
                self.arm_counts["disarmed"] += 1
        self.matcher.armed.discard(dst)

    def disarm_all(self) -> None:
        """Before a launch an entry holds is destroyed (the transport's graphs retire), or at exit."""
        if self.arm_on:
            for k in [k for k in self.arm_live if self.arm_words[k * ARM_WORDS + A_STATE] != ARM_FIRED]:
                self._free(k)

    # ------------------------------------------------------------------ firing (the loop's fetch)
    def fire_armed(self, n: int) -> dict[int, int]:
        """Right after ``n`` records were taken and before they are unpacked: C launches what they fire.
        Returns {record position: entry} of the fired ones; frees the entries C voided."""
        launch, current_device = self.arm_launch
        slots, _nbytes, per_rank = self.completion_slots()
        fired = _native.fire_armed(self.arm_addr, ARMED_MAX, self.take_out_addr, n, slots, per_rank,
                                   current_device(), launch)
        w = self.arm_words
        for k in [k for k in self.arm_live if w[k * ARM_WORDS + A_STATE] == ARM_VOID]:
            self._free(k)
            self.arm_counts["voided"] += 1
        return {w[k * ARM_WORDS + A_POS]: k for k in fired}

    def armed_fired(self, op: Op, k: int) -> None:
        """``op`` fired entry ``k``: the match Python would have made, with the copy already running."""
        at = k * ARM_WORDS
        w = self.arm_words
        token, published, rc, t_fire = w[at + A_TOKEN], bool(w[at + A_PUBLISHED]), w[at + A_RC], w[at + A_T_FIRE]
        armed, is_recv, dst, conn, rep, n = self.arm_held[k]
        self._free(k)
        if is_recv:
            send, recv = op, armed
            self.matcher.pop_next(dst, recv.peer, recv.tag, recv, True)
            if self.fast and send.pair_seq:   # the pair's order, as send_local keeps it
                d = self.local_of.get(dst)
                if d is not None:
                    self.fast_sent(send, d)
        else:
            send, recv = armed, op
            self.matcher.pop_next(dst, send.rank, send.tag, send, False)
        t = Transfer(send, recv, n, t_fire)
        t.published = published
        if self.profiler.enabled:
            t.t_started = t_fire
        conn.nmsgs += 1
        self.arm_counts["fired"] += 1
        conn.transport.proxy_fired(self.ctx, conn, t, rep, token, rc)

    def armed_describe(self) -> dict[str, Any]:
        """For the signal dump: entries armed now, and how many were armed and fired so far."""
        if not self.arm_on:
            return {"on": False}
        return {"on": True, "armed_now": len(self.arm_live), **self.arm_counts}
