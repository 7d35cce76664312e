"""shm transport: host memory of two ranks on the same node.

The progress process has mapped every local rank's registered buffers (memfds passed over the
service socket), so a message is one copy, source buffer to destination buffer, chunk by chunk:
no intermediate FIFO, no second copy. Steps follow DESIGN.md section 5: a step is posted when its
chunk is handed to the copy engine (inline for small chunks, a worker thread for large ones),
transmitted when the copy finished, received at the same moment (the bytes are in the receiver's
buffer), done when retired; at most STEPS steps of a sub are in flight (posted < done + STEPS).

Collectives within the node are the shm transport's too: every rank's buffers are mapped here, so a
collective's sub runs chunk schedules (proxy/coll/sched.py) with the same counters: a step is posted when
its schedule starts, transmitted/received when it completed, done when retired in order.
"""
from __future__ import annotations

from typing import Any

from shmproxy.transports.base import PeerInfo, Transport


class ShmTransport(Transport):
    name = "shm"

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        return me.host == peer.host

    def proxy_progress(self, engine: Any, args: Any) -> bool:
        steps = engine.steps
        copy = engine.copy.copy
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
            all_done &= _settle(engine, s, before)
        return all_done

    def proxy_progress_coll(self, engine: Any, args: Any) -> bool:
        steps = engine.steps
        start = engine.start_entry
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
                if not engine.start_schedule(sch):
                    sch.advance(start)
            while inflight and inflight[0].complete:
                inflight.popleft()
                s.done += 1
            s.transmitted = s.received = s.done + sum(1 for sch in inflight if sch.complete)
            all_done &= _settle(engine, s, before)
        return all_done


def _settle(engine: Any, s: Any, before: tuple[int, int]) -> bool:
    """After a sub was advanced: note progress, publish its counters, retire it when done."""
    if (s.posted, s.done) != before:   # waiting on workers is idle: the loop then blocks on
        engine.progressed = True         # their queue, with the GIL released (copyengine.py)
    engine.argspool.mirror(s)
    if s.done < s.nsteps:
        return False
    engine.sub_finished(s)
    return True
