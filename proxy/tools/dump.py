"""Render an ops pool's state as a report (docs/architecture.md, "Observability"); the reading is
shmproxy.tools.pool_reader.

``read_pool`` (re-exported here, the name the progress process, shmproxy-dump and the tests use)
turns a pool into a JSON-ready dict; ``format_text`` renders that dict, freshly read or loaded back
from a dump file alike, as a readable multi-section report. The dict may come from a damaged pool or
a damaged file, so the renderer trusts none of its shape and never raises.
"""
from __future__ import annotations

from typing import Any

from shmproxy.tools.pool_reader import (MAX_LISTED, PRIVATE_NOTE, STAT_FIELDS, STATE_NAMES, _ranges,
                                        read_pool)

__all__ = ["MAX_LISTED", "PRIVATE_NOTE", "STAT_FIELDS", "STATE_NAMES", "TEXT_LISTED", "format_sub",
           "format_text", "read_pool"]

TEXT_LISTED = 64        # of the records / subs the reader lists, those shown in the text report


# ---------------------------------------------------------------------------------------- text
def _g(d: Any, key: str, default: Any = None) -> Any:
    return d.get(key, default) if isinstance(d, dict) else default


def _corrupt(d: Any) -> str:
    """The 'corrupt' note of a section that could not be read, or ''."""
    return str(d["corrupt"]) if isinstance(d, dict) and "corrupt" in d else ""


def format_sub(s: dict) -> str:
    """One sub, NCCL dumpProxyState style (steps = done/nsteps)."""
    line = (f"args {s.get('args')} sub {s.get('slot')} [{s.get('letter', '?')}] "
            f"{s.get('src')}->{s.get('dst')} opCount {s.get('opcount')} {s.get('nbytes')} B "
            f"steps {s.get('done')}/{s.get('nsteps')} "
            f"posted {s.get('posted')} transmitted {s.get('transmitted')} received {s.get('received')} "
            f"done {s.get('done')}")
    if s.get("tag") is not None:
        line += f" tag {s['tag']}"
    if s.get("corrupt"):
        line += f"  !! {s['corrupt']}"
    return line


def _format_record(r: dict) -> str:
    if "kind" not in r:
        return f"#{r.get('index')} !! {r.get('corrupt')}"
    age = r.get("posted_age_ms")
    line = (f"#{r['index']} {r['kind']} owner {r['owner']} peer {r['peer']} tag {r['tag']} {r['nbytes']} B "
            f"({r['count']} x {r['dtype']}) opCount {r['opcount']} req {r['req_seq']}@{r['req_slot']}"
            + (f" posted {age:.1f} ms ago" if isinstance(age, (int, float)) else ""))
    if r.get("corrupt"):
        line += f"  !! {r['corrupt']}"
    return line


def _format_params(params: Any) -> list[str]:
    if not isinstance(params, dict):
        return []
    changed, default = [], 0
    for name, v in sorted(params.items()):
        value, origin = (v.get("value"), v.get("origin")) if isinstance(v, dict) else (v, "?")
        if origin == "default":
            default += 1
        else:
            changed.append(f"  {name}={value} [{origin}]")
    return ["params:" + ("" if changed else " all at their defaults")] + changed + (
        [f"  ({default} more at their defaults; --json lists all)"] if changed and default else [])


def format_text(state: dict) -> str:
    """A readable multi-section report of ``read_pool``'s dict (and of its ``in_process`` key).

    Never raises: a dict it cannot fully render (a damaged dump file) gives the sections it could,
    and a note saying where it stopped.
    """
    out: list[str] = []
    try:
        _format_into(state if isinstance(state, dict) else {}, out)
    except Exception as exc:
        out.append(f"!! report incomplete, stopped at {type(exc).__name__}: {exc} (--json shows everything)")
    return "\n".join(out) + "\n"


def _format_into(state: dict, out: list[str]) -> None:
    add = out.append

    def sec(key: str, kind: type = dict) -> Any:  # a section of the expected type, or a corrupt note
        v = _g(state, key, kind())
        return v if isinstance(v, kind) else {"corrupt": f"{key}: unexpected {type(v).__name__}"}

    lay, hdr = sec("layout"), sec("header")
    add(f"== shmproxy ops pool: {_g(lay, 'nlocal')} local ranks, {_g(lay, 'max_ops')} records each, "
        f"{_g(lay, 'max_subs')} sub slots, {_g(lay, 'total_bytes')} bytes ==")
    if _corrupt(hdr):
        add(f"header: {_corrupt(hdr)}")
    if state.get("snapshot"):
        add(f"({state['snapshot']})")

    ctl = sec("control")
    add("")
    add("== progress process ==")
    if _corrupt(ctl):
        add(_corrupt(ctl))
    else:
        age = ctl.get("heartbeat_age_ms")
        hb = "never" if age is None else f"{age:.0f} ms ago"
        add(f"pid {ctl.get('proxy_pid')}  state {ctl.get('state_name')}  heartbeat {hb}  "
            f"sleeping {'yes' if ctl.get('sleeping') else 'no'}  stop {ctl.get('stop')}  "
            f"abort {ctl.get('abort')}")
        stats = ctl.get("stats") or {}
        add("  ".join(f"{k.replace('_', ' ')} {v}" for k, v in stats.items()))
    mtx = _g(state, "mutex")
    if isinstance(mtx, dict):
        add(f"pool mutex: {_corrupt(mtx) or mtx.get('state')}"
            + ("  (waiters)" if mtx.get("waiters") else ""))

    err = _g(state, "error")
    add("")
    add("== first error ==")
    if err is None:
        add("none")
    elif not isinstance(err, dict) or _corrupt(err):
        add(_corrupt(err) or f"unreadable: {err!r}")
    else:
        who = []
        if err.get("rank") is not None:
            who.append(f"rank {err['rank']}")
        if err.get("pid"):
            who.append(f"pid {err['pid']}")
        add(f"{err.get('class')} (code {err.get('code')})" + (f" [{', '.join(who)}]" if who else "")
            + f": {err.get('message')}")

    info = sec("info")
    add("")
    add("== job ==")
    if _corrupt(info) or "error" in info:
        add(f"info: {_corrupt(info) or info.get('error')}")
    if isinstance(info, dict) and "error" not in info and not _corrupt(info):
        add(f"job {info.get('job_key')}  comm {info.get('comm_id')}  size {info.get('size')}  "
            f"nlocal {info.get('nlocal')}  pid {info.get('pid')}")
        add(f"socket {info.get('socket')}  pool {info.get('pool')}")
        cpus = info.get("cpus")
        add(f"affinity: {cpus if cpus else 'unpinned'} ({info.get('affinity_reason')}); "
            f"copy threads {info.get('copy_threads')}")
        ranks_info = info.get("ranks") or {}
        if isinstance(ranks_info, dict):
            for lr, ri in sorted(ranks_info.items(), key=lambda kv: str(kv[0])):
                if isinstance(ri, dict):
                    add(f"local rank {lr}: rank {ri.get('rank')} pid {ri.get('pid')} host {ri.get('host')}")
        out.extend(_format_params(info.get("params")))
        out.extend(_format_pending(info.get("pending")))
        out.extend(_format_nodes(info.get("nodes")))

    ranks = sec("ranks", list)
    chain = sec("posted_chain")
    add("")
    add("== local ranks ==")
    if _corrupt(ranks):
        add(_corrupt(ranks))
        ranks = []
    for r in ranks:
        nl = r.get("not_in_shared_list", {})
        add(f"local rank {r.get('local_rank')}: pid {r.get('pid')}  conn {r.get('conn_state_name')}  "
            f"waiting {r.get('waiting')}  posted {r.get('posted')}  completed {r.get('completed')}  | "
            f"records {r['records'][0]}-{r['records'][1]}: {r.get('in_posted_chain')} posted, "
            f"{r.get('in_shared_free_lists')} in the shared free list, "
            f"{nl.get('count')} not in a shared list"
            + (f", chain {r['pending_chain'][0]}..{r['pending_chain'][1]} handed off, not yet spliced"
               if r.get("pending_chain") else ""))

    add("")
    if _corrupt(chain):
        add("== posted chain ==")
        add(_corrupt(chain))
    else:
        add(f"== posted chain: {chain.get('length')} records (head {chain.get('head')}, "
            f"tail {chain.get('tail')}) ==")
        for p in (chain.get("problem"), chain.get("tail_problem")):
            if p:
                add(f"!! {p}")
        recs = chain.get("records") or []
        for rec in recs[:TEXT_LISTED]:
            add("  " + _format_record(rec))
        if chain.get("length", 0) > min(len(recs), TEXT_LISTED):
            more = chain["length"] - min(len(recs), TEXT_LISTED)
            add(f"  ... {more} more (--json lists up to {MAX_LISTED})")

    add("")
    add("== shared free lists ==")
    for r in ranks:
        fl = r.get("free_list", {})
        line = f"local rank {r.get('local_rank')}: {fl.get('length')} records (head {fl.get('head')})"
        if fl.get("problem"):
            line += f"  !! {fl['problem']}"
        add(line)
        for key, what in (("foreign", "records of other ranks"), ("also_posted", "also in the posted chain"),
                          ("in_two_lists", "also in another free list")):
            if fl.get(key):
                add(f"  !! {what}: {_ranges(fl[key])}")

    add("")
    add(f"== records {PRIVATE_NOTE} ==")
    for r in ranks:
        nl = r.get("not_in_shared_list", {})
        if not nl.get("count"):
            add(f"local rank {r.get('local_rank')}: none")
            continue
        chains = nl.get("chains") or []
        shape = ", ".join(f"{c['length']} from #{c['head']}" + (" (cycle)" if c.get("cycle") else "")
                          for c in chains[:6])
        add(f"local rank {r.get('local_rank')}: {nl['count']} records ({nl.get('indices')}); "
            f"{len(chains)} chain(s): {shape}{' ...' if len(chains) > 6 else ''}")

    subs = sec("subs")
    add("")
    if _corrupt(subs):
        add("== active subs ==")
        add(_corrupt(subs))
    else:
        add(f"== active subs: {subs.get('count')} of {subs.get('max_subs')} slots ==")
        act = subs.get("active") or []
        for s in act[:TEXT_LISTED * 4]:
            add(format_sub(s))
        if subs.get("count", 0) > min(len(act), TEXT_LISTED * 4):
            add(f"... {subs['count'] - min(len(act), TEXT_LISTED * 4)} more")

    ip = state.get("in_process")
    if isinstance(ip, dict):
        out.extend(_format_in_process(ip))

    probs = state.get("problems") or []
    add("")
    add(f"== problems: {len(probs)} ==")
    for p in probs:
        add(f"- {p}")


def _format_in_process(ip: dict) -> list[str]:
    out = ["", "== in process (the progress loop's own view) =="]
    add = out.append
    add(f"passes {ip.get('passes')}  stopping {ip.get('stopping')}  failed {ip.get('failed')}  "
        f"copy threads {ip.get('copy_threads')}  profile events {ip.get('profile_events')}")
    args = ip.get("active_args") or []
    add(f"active args: {len(args)}")
    for a in args:
        conn = a.get("conn") or ["?", "?"]
        subs = a.get("subs") or []
        add(f"  args {a.get('id')} [{a.get('state')}] {conn[0]}->{conn[1]} opCount {a.get('opcount')} "
            f"via {a.get('transport')}, {len(subs)} subs")
        for s in subs:
            add(f"    sub {s.get('slot')} {s.get('nbytes')} B steps {s.get('done')}/{s.get('nsteps')} "
                f"posted {s.get('posted')} transmitted {s.get('transmitted')} received {s.get('received')} "
                f"done {s.get('done')}")
    for key, what in (("unmatched_sends", "unmatched sends"), ("unmatched_recvs", "unmatched receives")):
        items = ip.get(key) or []
        add(f"{what}: {len(items)}")
        for d in items[:TEXT_LISTED]:
            add(f"  {d}")
        if len(items) > TEXT_LISTED:
            add(f"  ... {len(items) - TEXT_LISTED} more")
    conns = ip.get("connections") or {}
    add("connections: " + (", ".join(f"{k} {_conn_text(v)}" for k, v in conns.items()) if conns else "none"))
    svc = ip.get("service") or []
    svc_text = ", ".join(f"rank {c.get('rank')} pid {c.get('pid')} {c.get('state')}" for c in svc)
    add(f"service connections: {svc_text or 'none'}")
    bufs = ip.get("registered_buffers") or {}
    add(f"registered buffers: {len(bufs)}" + (
        " (" + ", ".join(f"{k}: {v} B" for k, v in list(bufs.items())[:TEXT_LISTED]) + ")" if bufs else ""))
    known = {"passes", "stopping", "failed", "copy_threads", "profile_events", "active_args",
             "unmatched_sends", "unmatched_recvs", "connections", "service", "registered_buffers"}
    for k, v in ip.items():
        if k not in known:
            add(f"{k}: {v}")
    return out


def _conn_text(c: object) -> str:
    """A connector as the in-process dump describes it (transports.base.Connector.describe)."""
    if not isinstance(c, dict):
        return str(c)
    return f"{c.get('transport')} ({c.get('kind')}, {c.get('state')}, {c.get('messages')} msgs)"


def _format_nodes(nodes: object) -> list[str]:
    """The node section of a communicator across nodes: its links and what waits on which node."""
    if not isinstance(nodes, dict):
        return []
    out = ["", f"== nodes: this is node {nodes.get('node')} of {nodes.get('nnodes')} =="]
    listening = nodes.get("listening") or []
    if listening:
        out.append(f"listening on {listening[0]} port {listening[1] if len(listening) > 1 else '?'}; "
                   f"connections dropped at the handshake: {nodes.get('dropped_connections', 0)}")
    ranks_of = nodes.get("ranks_of") or []
    for link in nodes.get("links") or []:
        if not isinstance(link, dict):
            continue
        peer = link.get("node")
        ranks = ranks_of[peer] if isinstance(peer, int) and 0 <= peer < len(ranks_of) else "?"
        out.append(f"link to node {peer} (ranks {ranks}): {link.get('state')}, {link.get('sockets')}/"
                   f"{link.get('of')} sockets, {link.get('bytes_out')} B out, {link.get('bytes_in')} B in, "
                   f"{link.get('queued')} frames queued")
    waits = nodes.get("waiting") or []
    if waits:
        by_node: dict = {}
        for w in waits:
            if isinstance(w, dict):
                by_node.setdefault(w.get("node"), []).append(str(w.get("what")))
        for node, whats in sorted(by_node.items(), key=lambda kv: str(kv[0])):
            out.append(f"waiting on node {node}: {len(whats)}")
            out.extend(f"  {w}" for w in whats[:16])
    else:
        out.append("nothing waits on another node")
    return out


def _format_pending(pending: object) -> list[str]:
    """What has waited more than a second, as the progress process last wrote it (every heartbeat)."""
    if not isinstance(pending, dict):
        return ["", "== waiting: nothing has waited more than a second =="]
    out = ["", "== waiting more than a second (the progress process's view, refreshed every heartbeat) =="]
    for r in pending.get("recvs") or []:
        if isinstance(r, dict):
            src = "any rank" if r.get("from") == -1 else f"rank {r.get('from')}"
            out.append(f"rank {r.get('rank')} waits for {r.get('bytes')} B from {src}, tag {r.get('tag')} "
                       f"({r.get('age_s')} s)")
    for s in pending.get("sends") or []:
        if isinstance(s, dict):
            out.append(f"rank {s.get('rank')}'s {s.get('bytes')} B message to rank {s.get('to')}, tag {s.get('tag')}, "
                       f"is not received ({s.get('age_s')} s)")
    for c in pending.get("colls") or []:
        if isinstance(c, dict):
            out.append(f"collective #{c.get('seq')} {c.get('call')}: in {c.get('in')}, missing {c.get('missing')} "
                       f"({c.get('age_s')} s)")
    return out
