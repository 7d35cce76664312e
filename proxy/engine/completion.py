"""Completing requests and waking ranks: Completion, a component of the engine (``engine.completion``).

A request is complete when its completion slot carries the op's sequence number (written last: it
publishes the other fields, shmproxy/shm/counters.py); the rank is then woken through its futex
word. Work a GPU does may be published by the GPU itself (``completion_items``): the loop writes
the fields when it queues the work, the GPU stores the sequence number behind it, and when the loop
later sees the work done it only counts the requests and wakes their ranks; it never writes those
slots again, since a rank may have taken its slot back for a later op by then. Ranks are woken only
after everything the pass completes is published: a woken rank may preempt the loop on its CPU at
once. Wake-ups of ranks asleep on a CPU whose keep-awake guard wakes
them are left to the guard and checked after RELAY_GRACE_NS (shm/_workers.c, "Relayed wake-ups").

The component owns where the completion slots and the ranks' words are (``rank_words``) and the
relayed wake-ups still to check; it takes the loop's state (the pool, the keep-awake guards, the
profiler, the poll hooks) and the failure path, and wakes every rank on a failure (Failures.on_abort).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Sequence, cast


from shmproxy.core import errors, log
from shmproxy.core.ops import KIND_PROBE, KIND_RECV, Op
from shmproxy.engine.args import CollWork, Sub, Transfer
from shmproxy.engine.failure import MASK64, Failures
from shmproxy.engine.p2p import BUFFERED_OWNER
from shmproxy.engine.state import LoopState
from shmproxy.shm import _native, pool as P

if TYPE_CHECKING:  # pragma: no cover
    from shmproxy.engine.p2p import Buffered

_log = log.get("PROXY")
RELAY_GRACE_NS = 200_000     # a rank left to a keep-awake guard to wake and still asleep after this: wake it
_SLOT_WORDS = P.SLOT_BYTES // 8


def _no_collectives(work: CollWork) -> None:
    raise errors.InternalError("a collective's work finished with no collective runner registered")


class Completion:
    def __init__(self, st: LoopState, failures: Failures):
        self.st, self.failures = st, failures
        layout = st.layout
        self.q, self.layout, self.seg_addr, self.nlocal = st.q, layout, st.seg_addr, layout.nlocal
        self.eager, self.crowded, self.fast = st.eager, st.crowded, st.fast
        # Per local rank: (u64 index of its COMPLETED counter, address of its futex word, u64 index of
        # its WAITING flag), and where the completion slots start: complete() runs for every op.
        self.rank_words = [(layout.rank_q(lr, P.RANK_COMPLETED), self.seg_addr + layout.wake_word_offset(lr),
                            layout.rank_q(lr, P.RANK_WAITING)) for lr in range(layout.nlocal)]
        self.slots_q = layout.slot_q(0)
        # per local rank, where the fast path counts its receives done (engine/fastpath.py): counted()
        self.f_recv_done = [layout.frank_q(lr, P.FRANK_RECV_DONE) for lr in range(layout.nlocal)] if self.fast else []
        # Wake-ups left to a guard (wake_ranks): (deadline ns, WAITING index, its value, futex address)
        self.relayed: list[tuple[int, int, int, int]] = []
        self.hook = st.hooks.register("relayed wake-ups to check", self.check_relayed)
        failures.on_abort.append(lambda: self.wake_ranks(tuple(range(self.nlocal))))
        # how a collective's work ends once its last sub is done: the collective runner's, which
        # registers it at construction (it takes this component, so this one cannot take it)
        self.coll_finished: Callable[[CollWork], None] = _no_collectives

    def sub_finished(self, s: Sub) -> None:
        t = s.transfer
        t.parts_left -= 1
        if t.parts_left == 0:
            t.finish(self)

    def finish_transfer(self, t: Transfer) -> None:
        if t.send.owner < 0:   # from another node (engine/nodes.py), or buffered: only the receive is ours
            self.complete(t.recv, 0, t.nbytes, source=t.send.rank, tag=t.send.tag)
            if t.send.owner == BUFFERED_OWNER:
                t.send.release(t.send)   # its bytes go back (engine/p2p.py, Buffered)
            if self.st.profiler.enabled:
                self._trace_msg(t)
            return
        # Both sides are published before either is woken: a woken rank may preempt this loop on
        # its CPU at once, and the other side would wait behind it (tens of microseconds).
        if t.published:
            self.counted(t.recv)
            self.counted(t.send)
        else:
            self.complete(t.recv, 0, t.nbytes, source=t.send.rank, tag=t.send.tag, wake=False)
            self.complete(t.send, 0, t.nbytes, source=t.recv.rank, tag=t.send.tag, wake=False)
        if t.send.owner != t.recv.owner:
            self.wake_ranks((t.recv.owner, t.send.owner))
        else:
            self.wake_rank(t.recv.owner)
        if t.nbytes > self.eager:
            self.complete_large()
        if self.st.profiler.enabled:
            self._trace_msg(t)

    def _trace_msg(self, t: Transfer) -> None:
        """A message's span, from the first post of its two halves to its delivery. ``via``: "ranks"
        (both ops were here), "buffered" (the send was copied here first: buffered by this process or
        a fast-path cell it drained, its sender long returned; the span still starts at its post), or
        "node" (another node's send: its envelope's arrival here stands for its post). ``started_ns``:
        when its transport had started it (for a GPU copy: launched); the span ends when the loop
        retired it (SHMPROXY_PROFILE traces line these up against the ranks' own times)."""
        s, r = t.send, t.recv
        via = "ranks" if s.owner >= 0 else "buffered" if s.owner == BUFFERED_OWNER else "node"
        self.st.profiler.span(f"msg {s.rank}->{r.rank}", min(s.t_post, r.t_post), time.monotonic_ns(),
                              bytes=t.nbytes, tag=s.tag, via=via, fetch_ns=max(s.t_fetch, r.t_fetch),
                              match_ns=t.t_match, last_post_ns=max(s.t_post, r.t_post), send_post_ns=s.t_post,
                              recv_post_ns=r.t_post, started_ns=t.t_started)

    def complete(self, op: "Op | Buffered", status: int, nbytes: int, source: int = -1, tag: int = 0,
                 peer_dtype: int = 0, wake: bool = True) -> None:
        """Publish a request's result in its completion slot, then wake its rank if it sleeps (unless
        ``wake`` is False: the caller wakes it once it has published everything it completes)."""
        q = self.q
        slot, owner = op.req_slot, op.owner
        if owner < 0:   # a stand-in for an op (another node's envelope: its node gets the verdict;
            # a buffered send: freed), which has reply() where an Op has none
            op.reply(status, nbytes, peer_dtype)  # type: ignore[union-attr]
            return
        op = cast(Op, op)   # a request of this node's ranks (a stand-in has no slot: above)
        if slot // self.layout.max_ops != owner:
            self.failures.fail(errors.InternalError.code, f"{op.describe()}: completion slot {slot} out of range")
            return
        base = self.slots_q + _SLOT_WORDS * slot
        q[base + P.SLOT_NBYTES] = nbytes
        q[base + P.SLOT_STATUS] = (status & 0xFFFF) | (peer_dtype << 16) | ((source & 0xFFFFFFFF) << 32)
        q[base + P.SLOT_TAG] = tag & MASK64
        q[base + P.SLOT_DONE_SEQ] = op.req_seq  # publishes the fields above (shm/counters.py)
        self.counted(op)
        if wake:
            self.wake_rank(owner)

    def counted(self, op: Op) -> None:
        """The loop's own record of a completed request of this node's rank."""
        q, owner = self.q, op.owner
        q[self.rank_words[owner][0]] += 1
        if self.fast and (op.kind == KIND_RECV or op.kind == KIND_PROBE):
            # The rank's fast Recv takes a cell only while this equals its receives posted
            # (engine/fastpath.py); one published by a GPU is counted late, which only makes a fast
            # Recv that looks in between go the slow way.
            q[self.f_recv_done[owner]] += 1

    def completion_items(self, t: Transfer) -> tuple | None:
        """For a transport whose device publishes ``t``'s completion itself: (op, source, tag) of both
        requests, the fields of a success that complete() would write. The transport's launch writes
        them and has the GPU store each done_seq behind its copy (shm/_native_device.c,
        ``publish_launch``); finish_transfer then only counts and wakes. None where ``t`` completes
        the usual way (its send from another node, or buffered)."""
        send, recv = t.send, t.recv
        if send.owner < 0:
            return None
        tag = send.tag & MASK64
        return ((recv, send.rank, tag), (send, recv.rank, tag))

    @staticmethod
    def coll_items(ops: list[Op]) -> list[tuple[Op, int, int]]:
        """completion_items for every rank's op of a collective a GPU graph completes (shmproxy.transports.cuda_coll):
        what complete_coll writes (status 0 with the op's peer as source, tag 0)."""
        return [(op, op.peer, 0) for op in ops]

    def completion_slots(self) -> tuple[int, int, int]:
        """Where the ranks' completion slots lie in this process: (address, bytes, slots per rank; rank
        r's are r * that and on)."""
        m = self.layout.max_ops
        return self.seg_addr + 8 * self.slots_q, self.nlocal * m * P.SLOT_BYTES, m

    def complete_coll(self, ops: list[Op], nbytes: int) -> None:
        """Complete every rank's op of a collective in one C call: all slots are published before any
        rank is woken, so ranks leave together (a Python loop of publish-and-wake let each rank leave
        a little later than the one before). Same protocol as complete() and wake_rank()."""
        layout = self.layout
        awake = self.st.awake
        relayed = awake.live_mask() if awake is not None else 0
        bad = _native.complete_coll(self.seg_addr, layout.slots_off, layout.rank_area_off, layout.max_ops,
                                    ops, nbytes, relayed)
        if bad >= 0:
            self.failures.fail(errors.InternalError.code, f"{ops[bad].describe()}: completion slot "
                               f"{ops[bad].req_slot} out of range")
        elif relayed:
            self._note_relayed([op.owner for op in ops], relayed)

    def refuse_coll(self, ops: list[Op], code: int) -> None:
        """Fail every rank's request of a collective with ``code`` (refused: nothing was moved)."""
        for op in ops:
            self.complete(op, code, 0)

    def complete_large(self) -> None:
        """After completing work the copy workers did: on a crowded node, sleep at once the next time
        the loop runs out of work instead of spinning. Its ranks slept on such requests and were just
        woken; a spinning loop holds a CPU, so the kernel queues both of them on the other one and
        they come back one after the other, tens of microseconds apart (docs/decisions.md). Their
        posts then wake the loop through the condvar."""
        if self.crowded:
            self.st.spin_skip = True
        if self.st.awake is not None:
            self.st.awake.touch()

    def wake_rank(self, local_rank: int) -> None:
        """Wake one rank whose completion is published: wake_ranks((local_rank,))."""
        self.wake_ranks((local_rank,))

    def wake_ranks(self, local_ranks: tuple[int, ...]) -> None:
        """Wake ranks whose completions are published, in one C call (_native.wake_owners, the same
        ordering complete_coll uses): every futex word bumped first, then the wake syscall for those
        that said they may sleep, those asleep on this CPU last (such a wakee preempts the loop at
        once), none asleep on a CPU whose keep-awake guard wakes them (shm/_workers.c, "Relayed
        wake-ups"); those are remembered, so that check_relayed wakes them should the guard not run.

        Lost wake-ups are impossible: the rank reads the word, stores WAITING (its CPU and that word),
        re-checks its slot and sleeps only while the word is unchanged (the futex compares it); we
        publish the slot, bump the word atomically (a full barrier), then read WAITING. Either the rank
        sees the new slot, or its futex_wait sees the bump, or we (or the guard) see WAITING set.
        """
        q, words, relayed, awake = self.q, self.rank_words, 0, self.st.awake
        if awake is not None and any(q[words[lr][2]] for lr in local_ranks):
            relayed = awake.live_mask()       # only where some rank may sleep (it costs a getcpu)
        _native.wake_owners(self.seg_addr, self.layout.rank_area_off, local_ranks, relayed)
        if relayed:
            self._note_relayed(local_ranks, relayed)

    def _note_relayed(self, local_ranks: Sequence[int], relayed: int) -> None:
        """Of ``local_ranks``, just woken with ``relayed`` (KeepAwake.live_mask), remember those asleep on
        a CPU whose keep-awake guard wakes them, so that check_relayed wakes them should the guard not
        run in time (a guard preempted just after it proved live)."""
        for lr in local_ranks:
            _completed, wake_addr, waiting = self.rank_words[lr]
            w = self.q[waiting]
            if not w:
                continue
            cpu = P.waiting_cpu(w)
            if 0 <= cpu < 64 and (relayed >> cpu) & 1:
                self.relayed.append((time.monotonic_ns() + RELAY_GRACE_NS, waiting, w, wake_addr))
                self.st.hooks.arm(self.hook)

    def check_relayed(self) -> bool:
        """The loop's poll hook: forget the relayed wake-ups whose rank woke; wake those still asleep
        after RELAY_GRACE_NS. True while some are left to check."""
        now, q, keep = time.monotonic_ns(), self.q, []
        for item in self.relayed:
            deadline, waiting, w, wake_addr = item
            if q[waiting] != w:
                continue
            if now >= deadline:
                _log.debug("a relayed wake-up was late; waking the rank directly")
                _native.futex_wake(wake_addr, 0x7FFFFFFF)
            else:
                keep.append(item)
        self.relayed = keep
        return bool(keep)
