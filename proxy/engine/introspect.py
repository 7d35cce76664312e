"""What the progress process shows of itself: the pool's info blob and the signal dump.

The info blob (shm/pool.py) is the part of the pool that the outside dump (shmproxy-dump, nothing
prepared, no cooperation from this process) reads besides the counters and records: who this is, its
parameters and ranks, and, refreshed every heartbeat while anything has waited longer than
``PENDING_AGE_S``, what waits: posted receives and unexpected messages the matcher holds (who waits
for what from whom), collectives that some local ranks have entered and others not, and on a
communicator across nodes its links and what waits on which node. The dump tool turns those into
problems (near-matches, collectives not joined). The blob is rewritten only when that summary
changed, so a busy job does not pay for a JSON dump every heartbeat, nor an idle job across nodes for
a rewrite. The loop is its only writer (a rank's join posts the rewrite as an event: a join handled
after the loop ended must not write beside the dump), and it publishes through shmproxy.core.infoblob's
seqlock, so that the outside reader never takes a rewrite half done.

``Introspector`` is a component of the engine: it owns what it last published, and reads the engine
(typed, never written): describing a process is reading all of it, so the engine is what it needs.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING

from shmproxy.core import infoblob, log
from shmproxy.core.memory import MemKind
from shmproxy.shm import pool as P

if TYPE_CHECKING:  # pragma: no cover
    from shmproxy.engine.progress import ProgressEngine

_log = log.get("PROXY")
PENDING_AGE_S = 1.0   # ops pending at least this long are listed in the info blob
PENDING_SHOWN = 64    # at most this many of each kind


class Introspector:
    def __init__(self, engine: "ProgressEngine"):
        self.engine = engine
        self.info_written = b""               # the blob as last published
        self.nodes_shown: dict | None = None  # describe_nodes() as last published
        self.pending: dict | None = None      # describe_pending() as last published

    def write_info(self) -> None:
        """Loop thread only (the blob's one writer): publish the blob, if its content changed."""
        e = self.engine
        self.nodes_shown = self.describe_nodes()
        data = infoblob.encode({
            "pid": os.getpid(), "job_key": e.job_key, "comm_id": e.comm_id, "nlocal": e.nlocal,
            "size": e.size, "socket": e.path, "pool": e.seg.name, "cpus": e.cpus,
            "affinity_reason": e.affinity_reason, "copy_threads": e.st.copy.nworkers,
            "params": {p.env_name(): {"value": p.value, "origin": p.origin} for p in e.params.items()},
            "ranks": {r.local_rank: {"rank": r.rank, "pid": r.pid, "host": r.host}
                      for r in list(e.st.ranks.values())},
            "nodes": self.nodes_shown,
            "pending": self.pending,
        })
        if data != self.info_written:
            infoblob.publish(e.view, data)
            self.info_written = data

    def post_write_info(self) -> None:
        """Any thread: have the loop rewrite the info blob (it has one writer)."""
        self.engine.events.post(self.write_info)

    def refresh(self) -> None:
        """Heartbeat: rewrite the info blob if what waits (or, across nodes, the links) changed."""
        pending = self.describe_pending(time.monotonic_ns())
        nodes = self.describe_nodes()
        if pending != self.pending or nodes != self.nodes_shown:
            self.pending = pending
            self.write_info()

    def describe_pending(self, now: int) -> dict | None:
        """Matcher entries and partly arrived collectives older than PENDING_AGE_S (None: nothing)."""
        e = self.engine
        old = now - int(PENDING_AGE_S * 1e9)
        recvs: list[dict] = []
        sends: list[dict] = []
        colls: list[dict] = []
        m = e.p2p.matcher
        for d in m.dests():
            for src, tag, op in m.posted(d):
                if op.t_fetch <= old and len(recvs) < PENDING_SHOWN:
                    recvs.append({"rank": d, "from": src, "tag": tag, "bytes": op.nbytes,
                                  "age_s": round((now - op.t_fetch) / 1e9, 1)})
            for src, tag, op in m.unexpected(d):
                if op.t_fetch <= old and len(sends) < PENDING_SHOWN:
                    sends.append({"rank": src, "to": d, "tag": tag, "bytes": op.nbytes,
                                  "age_s": round((now - op.t_fetch) / 1e9, 1)})
        for seq, ops in list(e.coll.colls.items()):
            arrived = [op for op in ops if op is not None]
            if arrived and min(op.t_fetch for op in arrived) <= old and len(colls) < PENDING_SHOWN:
                op0 = arrived[0]
                colls.append({"seq": seq, "call": e.coll.describe_fingerprint(e.coll.fingerprint(op0)),
                              "in": sorted(op.rank for op in arrived),
                              "missing": sorted(r.rank for lr, r in list(e.st.ranks.items())
                                                if ops[lr] is None),
                              "age_s": round((now - min(op.t_fetch for op in arrived)) / 1e9, 1)})
        if not (recvs or sends or colls):
            return None
        return {"recvs": recvs, "sends": sends, "colls": colls}

    def describe_nodes(self) -> dict | None:
        """This node among the communicator's (None on one node), with the transport's links and what
        waits on another node: looked at every heartbeat, and the info blob rewritten when it changed,
        so that the outside dump shows it with no preparation."""
        e = self.engine
        if e.nodes.nnodes < 2:
            return None
        out: dict = {"node": e.nodes.node, "nnodes": e.nodes.nnodes, "ranks_of": e.nodes.map.ranks_of}
        if e.nodes.net is not None and e.nodes.net.proxy_describe is not None:
            out.update(e.nodes.net.proxy_describe(e.ctx))
        return out

    def dump_state(self) -> dict:
        """Everything a person debugging a hang needs, from inside the process."""
        from shmproxy.tools import dump
        e = self.engine
        state = dump.read_pool(e.view)
        state["in_process"] = {
            "passes": e.st.passes,
            "stopping": e.st.stopping,
            "failed": e.failures.failed,
            "armed_hooks": e.st.hooks.describe(),   # work deferred to the next passes (engine/hooks.py)
            "active_args": [
                {"id": a.id, "conn": list(a.conn), "opcount": a.opcount,
                 "state": P.SUB_STATE_LETTER.get(a.state, "?"), "transport": a.transport.name,
                 "subs": [{"slot": s.slot, "nbytes": s.nbytes, "nsteps": s.nsteps, "posted": s.posted,
                           "transmitted": s.transmitted, "received": s.received, "done": s.done}
                          for s in a.subs]}
                for a in e.st.active],
            "unmatched_sends": [op.describe() for d in e.p2p.matcher.dests() for _s, _t, op in
                                e.p2p.matcher.unexpected(d)],
            "unmatched_recvs": [op.describe() for d in e.p2p.matcher.dests() for _s, _t, op in
                                e.p2p.matcher.posted(d)],
            "connections": {f"{s}->{d}": c.describe() for (s, d, _kind), c in e.connections.conns.items()},
            "nodes": self.describe_nodes(),
            "fast_path": e.fastpath.describe(), "armed_routes": e.armed.describe(),
            "service": [{"rank": c.rank, "pid": c.pid, "state": c.state.name}
                        for c in e.server.connections()],
            "registered_buffers": {f"{lr}:{bid}": b.size for (lr, bid), b in list(e.st.buffers.items())},
            "copy_threads": e.st.copy.nworkers,
            "gpus": [d for d in (t.proxy_describe(e.ctx) for t in e.st.transports
                                 if MemKind.CUDA in t.kinds and t.proxy_describe is not None) if d],
            "profile_events": len(e.st.profiler.events),
        }
        return state

    def dump_path(self) -> str:
        return self.engine.path.removesuffix(".sock") + f"-{os.getpid()}.dump.json"

    def write_dump(self) -> None:
        path = self.dump_path()
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.dump_state(), f, indent=1, default=str)
        os.replace(tmp, path)
        _log.warning("state dumped to %s", path)
        print(f"shmproxy: progress process {os.getpid()} dumped its state to {path}", file=sys.stderr,
              flush=True)
