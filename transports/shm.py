"""shm transport: host memory of two ranks on the same node.

The progress process has mapped every local rank's registered buffers (memfds passed over the
service socket), so a message is one copy, source buffer to destination buffer, chunk by chunk:
no intermediate FIFO, no second copy. Steps follow DESIGN.md section 5: a step is posted when its
chunk is handed to the copy engine (inline for small chunks, a worker thread for large ones),
transmitted when the copy finished, received at the same moment (the bytes are in the receiver's
buffer), done when retired; at most STEPS steps of a sub are in flight (posted < done + STEPS).
"""
from __future__ import annotations

from typing import Any

from transports.base import PeerInfo, Transport


class ShmTransport(Transport):
    name = "shm"

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        return me.host == peer.host

    def proxy_progress(self, engine: Any, args: Any) -> bool:
        steps = engine.steps
        copy = engine.copy.copy
        mirror = engine.argspool.mirror
        all_done = True
        for s in args.subs:
            if s.done == s.nsteps:
                continue
            before = s.done
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
            if s.done != before or s.posted != s.done:
                engine.progressed = True
            mirror(s)
            if s.done < s.nsteps:
                all_done = False
            else:
                engine.sub_finished(s)
        return all_done
