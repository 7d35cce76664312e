"""shm transport: host memory of two ranks on the same node.

The progress process has mapped every local rank's registered buffers (memfds passed over the
service socket), so a message is one copy, source buffer to destination buffer, chunk by chunk: no
intermediate FIFO, no second copy. Both sides of a connection live in this one process, so setup
has nothing to exchange: the connect-info blobs are empty and the connector holds no state.

Policy (``proxy_start``): a message of at most ``ctx.eager`` bytes is copied at once, in the loop (an
args would be created, progressed and retired in this same pass; skipping it halves the Python work
of a small message). A larger one becomes subs of the connection's args for its opCount, split
over the copy workers from ``ctx.parallel_threshold`` bytes on (whole chunks per worker).

A derived datatype on either side (the op's ``tmap``: shmproxy.shm.typed) is one gather/scatter
over the block lists, in the loop whatever its size.

Steps: a step is posted when its chunk is handed to the copy engine (inline for small chunks, a
worker for large ones), transmitted when the copy finished, received at the same moment (the bytes
are in the receiver's buffer), done when retired; at most ``ctx.steps`` steps of a sub are in
flight (posted < done + steps).

Collectives within the node are the shm transport's too: every rank's buffers are mapped here, so a
collective's sub runs chunk schedules (shmproxy.coll.sched) with the same counters: a step is posted
when its schedule starts, transmitted/received when it completed, done when retired in order.
"""
from __future__ import annotations

from typing import Any

from shmproxy.core.errors import InternalError, InvalidArgument
from shmproxy.core.ops import RECV, SEND
from shmproxy.shm import typed
from shmproxy.transports.base import (Connector, MemKind, OneProcessSides, PeerInfo, Transport, TransportContext,
                                      land_folded)


class ShmTransport(OneProcessSides, Transport):   # the receiver's buffers are mapped here already
    name = "shm"
    kinds = frozenset({MemKind.HOST})

    def can_connect(self, me: PeerInfo, peer: PeerInfo, kind: MemKind) -> bool:
        return kind == MemKind.HOST and me.host == peer.host

    def proxy_start(self, ctx: TransportContext, conn: Connector, transfer: Any) -> bool:
        n = transfer.nbytes
        send, recv = transfer.send, transfer.recv
        bufs = ctx.buffers
        if send.tmap is not None or recv.tmap is not None:   # send: an Op or a Buffered, both have it
            typed.copy(bufs, send, recv, n)   # a derived datatype's gather/scatter: one call, inline
            return True
        sb, rb = bufs.get((send.owner, send.buf_id)), bufs.get((recv.owner, recv.buf_id))
        if (sb is None or rb is None or send.offset + n > sb.size or recv.offset + n > rb.size
                or n > send.nbytes or n > recv.nbytes or (send.mem | recv.mem) & 0xFF):
            _resolve(ctx, send, n)   # raises, naming what is wrong
            _resolve(ctx, recv, n)
            raise InvalidArgument(f"{send.describe()} -> {recv.describe()}: cannot be moved by shm")
        src, dst = sb.addr + send.offset, rb.addr + recv.offset
        if n <= ctx.eager:
            if n:
                ctx.memcopy(dst, src, n)
            return True
        args = ctx.args_for(conn, transfer.send.opcount)
        nworkers = ctx.nworkers
        parts = nworkers if nworkers > 1 and n >= ctx.parallel_threshold else 1
        chunk = ctx.chunk
        per = -(-n // parts)
        per = -(-per // chunk) * chunk  # whole chunks per part
        off = 0
        while off < n:
            m = min(per, n - off)
            ctx.add_sub(args, transfer, src + off, dst + off, m, chunk)
            off += m
        return False

    def proxy_progress(self, ctx: TransportContext, args: Any) -> bool:
        steps = ctx.steps
        copy = ctx.copy
        settle = ctx.settle
        all_done = True
        for s in args.subs:
            if s.done == s.nsteps:
                continue
            before = (s.posted, s.done)
            limit = min(s.nsteps, s.done + steps)
            while s.posted < limit:
                off = s.posted * s.chunk
                n = min(s.chunk, s.nbytes - off)
                s.posted += 1
                if copy(s, s.dst + off, s.src + off, n):
                    s.transmitted += 1
            # A direct copy lands in the destination as it is transmitted.
            s.received = s.transmitted
            s.done = s.received
            all_done &= settle(s, before)
        return all_done

    def proxy_progress_coll(self, ctx: TransportContext, args: Any) -> bool:  # type: ignore[override]
        steps = ctx.steps
        start = ctx.start_entry
        settle = ctx.settle
        all_done = True
        for s in args.subs:
            if s.done == s.nsteps:
                continue
            before = (s.posted, s.done)
            inflight = s.inflight
            for sch in inflight:
                if not sch.complete:
                    sch.advance(start)
            limit = min(s.nsteps, s.done + steps)
            while s.posted < limit:
                sch = s.make(s.k0 + s.posted)
                s.posted += 1
                inflight.append(sch)
                if not ctx.start_schedule(sch):
                    sch.advance(start)
            while inflight and inflight[0].complete:
                inflight.popleft()
                s.done += 1
            s.transmitted = s.received = s.done + sum(1 for sch in inflight if sch.complete)
            all_done &= settle(s, before)
        return all_done

    def proxy_coll_entry(self, ctx: TransportContext, conn: Connector, sch: Any,  # type: ignore[override]
                         e: Any) -> list:
        """A collective's SEND or RECV on the node's loopback connector: it waits in the connector's
        table until its partner of the same key is started, then the two become one copy (both
        (schedule, entry) pairs are returned, to be marked complete by the caller)."""
        waiting = conn.send_state
        if waiting is None:
            waiting = conn.send_state = {}
        other = waiting.pop(e.key, None)
        if other is None:
            waiting[e.key] = (sch, e)
            return []
        osch, oe = other
        snd, rcv = (e, oe) if e.kind == SEND else (oe, e)
        if snd.kind != SEND or rcv.kind != RECV or snd.nbytes != rcv.nbytes:
            raise InternalError(f"schedule rendezvous {e.key!r} pairs {snd!r} with {rcv!r}")
        if rcv.fold is not None:
            land_folded(rcv, snd.src)
        else:
            ctx.memcopy(rcv.dst, snd.src, snd.nbytes)
        return [(sch, e), (osch, oe)]

    def proxy_free(self, ctx: TransportContext) -> None:
        return None   # nothing of its own: the buffers are the engine's registry


def _resolve(ctx: TransportContext, op: Any, nbytes: int) -> int:
    """Address of an op's bytes in this process; bounds-checked against the registered size."""
    if op.mem & 0xFF != MemKind.HOST:
        raise InvalidArgument(f"{op.describe()}: not host memory (memory word {op.mem:#x})")
    buf = ctx.buffers.get((op.owner, op.buf_id))
    if buf is None or op.offset + nbytes > buf.size or nbytes > op.nbytes:
        raise InvalidArgument(
            f"{op.describe()}: buffer {op.buf_id} offset {op.offset} + {nbytes} B is outside "
            f"the registered buffer ({'unknown' if buf is None else buf.size} B)")
    return buf.addr + op.offset
