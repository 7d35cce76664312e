"""What the progress process shows of itself (a mixin of ProgressEngine): the pool's info blob and the
signal dump.

The info blob (shm/pool.py) is the part of the pool that the outside dump (shmproxy-dump, nothing
prepared, no cooperation from this process) reads besides the counters and records: who this is, its
parameters and ranks, and, refreshed every heartbeat while anything has waited longer than
``PENDING_AGE_S``, what waits: posted receives and unexpected messages the matcher holds (who waits
for what from whom), collectives that some local ranks have entered and others not, and on a
communicator across nodes its links and what waits on which node. The dump tool turns those into
problems (near-matches, collectives not joined). The blob is rewritten only when that summary
changed, so a busy job does not pay for a JSON dump every heartbeat, nor an idle job across nodes for
a rewrite. The loop is its only writer (a rank's join on the service thread posts the rewrite to the
loop), and it publishes through shmproxy.core.infoblob's seqlock, so that the outside reader never
takes a rewrite half done.
"""
from __future__ import annotations

import json
import os
import sys
import time

from shmproxy.core import infoblob, log
from shmproxy.shm import pool as P

_log = log.get("PROXY")
PENDING_AGE_S = 1.0   # ops pending at least this long are listed in the info blob
PENDING_SHOWN = 64    # at most this many of each kind


class Introspection:
    info_written: bytes = b""        # the blob as last published
    nodes_shown: dict | None = None  # describe_nodes() as last published

    def _write_info(self) -> None:
        """Loop thread only (the blob's one writer): publish the blob, if its content changed."""
        self.nodes_shown = self.describe_nodes()
        data = infoblob.encode({
            "pid": os.getpid(), "job_key": self.job_key, "comm_id": self.comm_id, "nlocal": self.nlocal,
            "size": self.size, "socket": self.path, "pool": self.seg.name, "cpus": self.cpus,
            "affinity_reason": self.affinity_reason, "copy_threads": self.copy.nworkers,
            "params": {p.env_name(): {"value": p.value, "origin": p.origin} for p in self.params.items()},
            # list(): a snapshot taken in one C call; the service thread adds ranks as they join
            "ranks": {r.local_rank: {"rank": r.rank, "pid": r.pid, "host": r.host}
                      for r in list(self.ranks.values())},
            "nodes": self.nodes_shown,
            "pending": self.pending,
        })
        if data != self.info_written:
            infoblob.publish(self.view, data)
            self.info_written = data

    def post_write_info(self) -> None:
        """Any thread: have the loop rewrite the info blob (it has one writer)."""
        self.post_event(self._write_info)

    def refresh_info(self) -> None:
        """Heartbeat: rewrite the info blob if what waits (or, across nodes, the links) changed."""
        pending = self.describe_pending(time.monotonic_ns())
        nodes = self.describe_nodes()
        if pending != self.pending or nodes != self.nodes_shown:
            self.pending = pending
            self._write_info()

    def describe_pending(self, now: int) -> dict | None:
        """Matcher entries and partly arrived collectives older than PENDING_AGE_S (None: nothing)."""
        old = now - int(PENDING_AGE_S * 1e9)
        recvs, sends, colls = [], [], []
        m = self.matcher
        for d in m.dests():
            for src, tag, op in m.posted(d):
                if op.t_fetch <= old and len(recvs) < PENDING_SHOWN:
                    recvs.append({"rank": d, "from": src, "tag": tag, "bytes": op.nbytes,
                                  "age_s": round((now - op.t_fetch) / 1e9, 1)})
            for src, tag, op in m.unexpected(d):
                if op.t_fetch <= old and len(sends) < PENDING_SHOWN:
                    sends.append({"rank": src, "to": d, "tag": tag, "bytes": op.nbytes,
                                  "age_s": round((now - op.t_fetch) / 1e9, 1)})
        for seq, ops in list(self.colls.items()):
            arrived = [op for op in ops if op is not None]
            if arrived and min(op.t_fetch for op in arrived) <= old and len(colls) < PENDING_SHOWN:
                op0 = arrived[0]
                colls.append({"seq": seq, "call": self.describe_fingerprint(self.fingerprint(op0)),
                              "in": sorted(op.rank for op in arrived),
                              "missing": sorted(r.rank for lr, r in list(self.ranks.items())
                                                if ops[lr] is None),
                              "age_s": round((now - min(op.t_fetch for op in arrived)) / 1e9, 1)})
        if not (recvs or sends or colls):
            return None
        return {"recvs": recvs, "sends": sends, "colls": colls}

    def describe_nodes(self) -> dict | None:
        """This node among the communicator's (None on one node), with the transport's links and what
        waits on another node: looked at every heartbeat, and the info blob rewritten when it changed,
        so that the outside dump shows it with no preparation."""
        if self.nodes.nnodes < 2:
            return None
        out: dict = {"node": self.node, "nnodes": self.nodes.nnodes, "ranks_of": self.nodes.ranks_of}
        if self.net is not None and self.net.proxy_describe is not None:
            out.update(self.net.proxy_describe(self.ctx))
        return out

    def dump_state(self) -> dict:
        """Everything a person debugging a hang needs, from inside the process."""
        from shmproxy.tools import dump
        state = dump.read_pool(self.view)
        state["in_process"] = {
            "passes": self.passes,
            "stopping": self.stopping,
            "failed": self.failed,
            "active_args": [
                {"id": a.id, "conn": list(a.conn), "opcount": a.opcount,
                 "state": P.SUB_STATE_LETTER.get(a.state, "?"), "transport": a.transport.name,
                 "subs": [{"slot": s.slot, "nbytes": s.nbytes, "nsteps": s.nsteps, "posted": s.posted,
                           "transmitted": s.transmitted, "received": s.received, "done": s.done}
                          for s in a.subs]}
                for a in self.active],
            "unmatched_sends": [op.describe() for d in self.matcher.dests() for _s, _t, op in
                                self.matcher.unexpected(d)],
            "unmatched_recvs": [op.describe() for d in self.matcher.dests() for _s, _t, op in
                                self.matcher.posted(d)],
            "connections": {f"{s}->{d}": c.describe() for (s, d, _kind), c in self.conns.items()},
            "nodes": self.describe_nodes(),
            "fast_path": self.fast_describe(), "armed_routes": self.armed_describe(),
            "service": [{"rank": c.rank, "pid": c.pid, "state": c.state.name}
                        for c in self.server.connections()],
            "registered_buffers": {f"{lr}:{bid}": b.size for (lr, bid), b in list(self.buffers.items())},
            "copy_threads": self.copy.nworkers,
            "gpus": [t.gpu.describe() for t in self.transports if getattr(t, "gpu", None) is not None],
            "profile_events": len(self.profiler.events),
        }
        return state

    def dump_path(self) -> str:
        return self.path.removesuffix(".sock") + f"-{os.getpid()}.dump.json"

    def write_dump(self) -> None:
        path = self.dump_path()
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.dump_state(), f, indent=1, default=str)
        os.replace(tmp, path)
        _log.warning("state dumped to %s", path)
        print(f"shmproxy: progress process {os.getpid()} dumped its state to {path}", file=sys.stderr,
              flush=True)
