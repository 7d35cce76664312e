"""Read an ops pool into a plain dict, and render that dict as a report (DESIGN.md section 11).

``read_pool`` is what both dumps share: the progress process calls it on its own mapping (and adds an
``in_process`` key, ProgressEngine.dump_state), and ``shmproxy-dump`` calls it on a read-only mapping
of the pool opened through ``/proc/<pid>/fd/<n>`` when the process is stopped or wedged.

Rules of the reader:
- It never takes the pool mutex (its holder may be the wedged party) and writes nothing. What it
  returns is therefore a snapshot taken *while others may be writing*: a list caught mid-splice can
  look inconsistent for an instant. Problems found are reported as such, never trusted further.
- It never raises on a corrupt pool. Every index read from shared memory (list heads, links, sub
  fields) is bounds-checked before use; a section that fails anyway is reported as
  ``{"corrupt": "..."}`` and the other sections are still read.
- The result is JSON-serialisable as is (ints, strings, bools, None, lists, dicts with str keys), so
  ``format_text`` renders a freshly read dict and one loaded back from a dump file alike.
"""
from __future__ import annotations

import os
import struct
import time
from typing import Any, Callable

from shmproxy.shm import pool as P

STATE_NAMES = {P.PROXY_STARTING: "STARTING", P.PROXY_RUNNING: "RUNNING", P.PROXY_STOPPING: "STOPPING",
               P.PROXY_EXITED: "EXITED"}
STAT_FIELDS = (("fetches", P.CTRL_N_FETCH), ("ops", P.CTRL_N_OPS), ("args", P.CTRL_N_ARGS),
               ("sleeps", P.CTRL_N_SLEEP), ("passes", P.CTRL_N_PASSES), ("active_subs", P.CTRL_ACTIVE_SUBS))
MAX_LISTED = 1024       # records / subs listed individually in one section; counts are always complete
TEXT_LISTED = 64        # of those, shown in the text report
PRIVATE_NOTE = "not in a shared list (held privately by the rank, or leaked)"

# glibc's pthread_mutex_t (x86-64 and AArch64): int __lock, unsigned __count, int __owner,
# unsigned __nusers, int __kind. For a robust mutex __lock is the owner's TID plus futex flag bits.
_MUTEX_HEAD = struct.Struct("<iIiIi")
_FUTEX_WAITERS, _FUTEX_OWNER_DIED, _FUTEX_TID_MASK = 0x80000000, 0x40000000, 0x3FFFFFFF
_MUTEX_INCONSISTENT, _MUTEX_NOTRECOVERABLE = 0x7FFFFFFF, 0x7FFFFFFE
_MUTEX_KIND_ROBUST = 16


# ---------------------------------------------------------------------------------------- reading
def read_pool(view: P.PoolView) -> dict:
    """Everything in the pool a person debugging a hang needs, as a JSON-ready dict. Never raises."""
    state: dict[str, Any] = {"snapshot": "read without the pool mutex; lists may be caught mid-update",
                             "wall_time": time.time(), "reader_pid": os.getpid()}
    problems: list[str] = []
    state["problems"] = problems
    layout = view.layout

    state["header"] = _section(problems, "header", lambda: _read_header(view))
    state["control"] = _section(problems, "control", lambda: _read_control(view))
    state["error"] = _section(problems, "error", lambda: _read_error(view))
    state["mutex"] = _section(problems, "mutex", lambda: _read_mutex(view, problems))
    state["info"] = _section(problems, "info", lambda: _read_info(view, problems))
    chain = _section(problems, "posted chain", lambda: _read_chain(view, problems))
    state["posted_chain"] = chain
    state["ranks"] = _section(problems, "ranks", lambda: _read_ranks(view, chain, problems))
    state["subs"] = _section(problems, "subs", lambda: _read_subs(view, problems))
    if isinstance(chain, dict):
        chain.pop("indices", None)  # internal: membership for the rank sections (records keep the order)
    state["layout"] = {"nlocal": layout.nlocal, "max_ops": layout.max_ops, "max_subs": layout.max_subs,
                       "nrecords": layout.nrecords, "total_bytes": layout.total_bytes}
    return state


def _section(problems: list[str], name: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # a corrupt pool must never take the dump down with it
        msg = f"{name}: could not be read: {type(exc).__name__}: {exc}"
        problems.append(msg)
        return {"corrupt": msg}


def _read_header(view: P.PoolView) -> dict:
    magic, version, hdr, nlocal, max_ops, max_subs, _reserved, total = P.HEADER_FMT.unpack_from(view.buf, 0)
    return {"magic": f"{magic:#x}", "version": version, "header_bytes": hdr, "nlocal": nlocal,
            "max_ops": max_ops, "max_subs": max_subs, "total_bytes": total, "mapped_bytes": len(view.buf)}


def _read_control(view: P.PoolView) -> dict:
    hb = view.ctrl(P.CTRL_HEARTBEAT)
    now = time.monotonic_ns()
    st = view.ctrl(P.CTRL_STATE)
    return {
        "stop": view.ctrl(P.CTRL_STOP),
        "abort": view.ctrl(P.CTRL_ABORT),
        "proxy_pid": view.ctrl(P.CTRL_PROXY_PID),
        "heartbeat_ns": hb,
        # CLOCK_MONOTONIC is system-wide, so the age is meaningful from another process.
        "heartbeat_age_ms": None if hb == 0 else round((now - hb) / 1e6, 3),
        "state": st,
        "state_name": STATE_NAMES.get(st, f"unknown({st})"),
        "sleeping": view.ctrl(P.CTRL_SLEEPING),
        "stats": {name: view.ctrl(field) for name, field in STAT_FIELDS},
    }


def _read_error(view: P.PoolView) -> dict | None:
    if not view.ctrl(P.CTRL_ERR_SEQ):
        return None
    code = view.ctrl(P.CTRL_ERR_CODE)
    rank = view.ctrl(P.CTRL_ERR_RANK)
    try:
        from shmproxy.core.errors import _BY_CODE
        cls = _BY_CODE.get(code)
        cls_name = cls.__name__ if cls is not None else f"unknown error code {code}"
    except Exception:  # pragma: no cover - shmproxy.core.errors always imports
        cls_name = f"code {code}"
    return {"code": code, "class": cls_name, "rank": None if rank == P.NO_RANK else rank,
            "pid": view.ctrl(P.CTRL_ERR_PID) or None, "message": view.error_message()}


def _tgid_of(tid: int) -> int | None:
    """The process a thread id belongs to, or None when no such thread exists now."""
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _read_mutex(view: P.PoolView, problems: list[str]) -> dict:
    """Who holds the pool mutex, decoded from glibc's robust mutex words (best effort)."""
    lock, _count, owner, nusers, kind = _MUTEX_HEAD.unpack_from(view.buf, P.MUTEX_OFF)
    word = lock & 0xFFFFFFFF
    out: dict[str, Any] = {"decoding": "glibc robust pthread_mutex_t", "lock_word": f"{word:#x}",
                           "kind": kind, "locked": word != 0, "holder_tid": None, "holder_pid": None,
                           "waiters": bool(word & _FUTEX_WAITERS),
                           "owner_died": bool(word & _FUTEX_OWNER_DIED), "state": "unlocked"}
    if not kind & _MUTEX_KIND_ROBUST:
        out["state"] = "unknown layout (not a glibc robust mutex?)"
        return out
    if owner == _MUTEX_NOTRECOVERABLE:
        out["state"] = "not recoverable (an owner died and it was unlocked without being made consistent)"
        problems.append("pool mutex is not recoverable")
        return out
    if owner == _MUTEX_INCONSISTENT:
        out["state"] = "inconsistent (an owner died holding it; the next locker repairs it)"
    tid = word & _FUTEX_TID_MASK
    if tid:
        out["holder_tid"] = tid
        pid = _tgid_of(tid)
        out["holder_pid"] = pid
        if pid is None:
            out["state"] = f"held by thread {tid}, which no longer exists (died holding it)"
            problems.append(f"pool mutex held by thread {tid}, which no longer exists")
        else:
            out["state"] = f"held by thread {tid} of pid {pid}"
    elif word & _FUTEX_OWNER_DIED:
        out["state"] = "owner died holding it; not yet repaired"
    return out


def _read_info(view: P.PoolView, problems: list[str]) -> dict:
    info = view.read_info()
    if not isinstance(info, dict):
        problems.append("info blob is not a JSON object")
        return {"error": "info blob is not a JSON object"}
    if not info:
        return {"error": "info blob is empty (progress process still starting?)"}
    if "error" in info and len(info) == 1:
        problems.append(f"info blob: {info['error']}")
    return info


def _walk(view: P.PoolView, head: int, limit: int) -> tuple[list[int], str | None]:
    """PoolView.walk plus a reason when it stopped early: loop, bad link, or too long."""
    nrec = view.layout.nrecords
    out, bad = view.walk(head, limit)
    if not bad:
        return out, None
    if not out:
        return out, f"head is record {head}, out of range [0, {nrec})"
    last = out[-1]
    nxt = view.record_next(last)  # re-read: the pool may have moved on meanwhile
    if not 0 <= nxt < nrec and nxt != -1:
        return out, f"record {last} links to {nxt}, out of range [0, {nrec})"
    if nxt in set(out):
        return out, f"loop: record {last} links back to record {nxt} (after {len(out)} records)"
    if nxt == -1:
        return out, f"stopped at record {last}: the list changed while being read"
    return out, f"longer than {limit} records, truncated"


def _decode_record(view: P.PoolView, idx: int, now_ns: int) -> dict:
    from shmproxy.core.ops import CODE_DTYPE, KIND_NAMES
    (nxt, kind, dtype, redop, flags, owner, peer, tag, opcount, req_seq, req_slot, buf_id, offset, nbytes,
     count, _buf2, _res, _off2, _nb2, coll_seq, t_post, _x1, _x2) = view.read_record(idx)
    dt = CODE_DTYPE.get(dtype)
    rec = {"index": idx, "next": nxt, "kind": KIND_NAMES.get(kind, f"unknown({kind})"), "owner": owner,
           "peer": peer, "tag": tag, "nbytes": nbytes, "count": count, "opcount": opcount,
           "dtype": dt.name if dt is not None else f"unknown({dtype})", "req_seq": req_seq,
           "req_slot": req_slot, "buf_id": buf_id, "offset": offset,
           "posted_age_ms": round((now_ns - t_post) / 1e6, 3) if 0 < t_post <= now_ns else None}
    region = idx // view.layout.max_ops
    bad = []
    if owner != region:
        bad.append(f"owner {owner} but record is in the region of local rank {region}")
    if kind not in KIND_NAMES:
        bad.append(f"unknown kind {kind}")
    if req_slot // view.layout.max_ops != region:
        bad.append(f"completion slot {req_slot} outside the rank's range")
    if bad:
        rec["corrupt"] = "; ".join(bad)
    return rec


def _read_chain(view: P.PoolView, problems: list[str]) -> dict:
    layout, nrec = view.layout, view.layout.nrecords
    head = view.i32[P.NEXT_OPS_OFF // 4]
    tail = view.i32[P.NEXT_OPS_END_OFF // 4]
    indices, problem = _walk(view, head, nrec)
    now = time.monotonic_ns()
    records = []
    for idx in indices[:MAX_LISTED]:
        try:
            rec = _decode_record(view, idx, now)
        except Exception as exc:
            rec = {"index": idx, "corrupt": f"{type(exc).__name__}: {exc}"}
        if "corrupt" in rec:
            problems.append(f"posted chain: record {idx}: {rec['corrupt']}")
        records.append(rec)
    if problem:
        problems.append(f"posted chain: {problem}")
    tail_note = None
    if not 0 <= tail < nrec and tail != -1:
        tail_note = f"tail {tail} out of range [0, {nrec})"
    elif head == -1 and tail != -1:
        tail_note = f"chain empty but tail is {tail}"
    elif head != -1 and not problem and indices and tail != indices[-1]:
        tail_note = f"tail {tail} is not the last record ({indices[-1]})"
    if tail_note:
        problems.append(f"posted chain: {tail_note} (or a post in progress: read without the lock)")
    return {"head": head, "tail": tail, "length": len(indices), "problem": problem, "tail_problem": tail_note,
            "indices": indices, "records": records, "listed": len(records),
            "per_rank": _count_by_region(indices, layout.max_ops, layout.nlocal)}


def _count_by_region(indices: list[int], max_ops: int, nlocal: int) -> list[int]:
    counts = [0] * nlocal
    for i in indices:
        r = i // max_ops
        if 0 <= r < nlocal:
            counts[r] += 1
    return counts


def _conn_state_name(value: int) -> str:
    try:
        from shmproxy.control.protocol import ConnState  # may not exist in every build: fall back to the number
        return ConnState(value).name
    except Exception:
        return str(value)


def _ranges(indices: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8'"""
    out = []
    s = sorted(indices)
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(out)


def _chains_among(view: P.PoolView, members: list[int]) -> list[dict]:
    """Group records by their links inside ``members``: a private free list shows as one long chain,
    a leaked record as a singleton. Returns [{head, length}] longest first (cycles reported too)."""
    mset = set(members)
    succ: dict[int, int] = {}
    indeg: dict[int, int] = dict.fromkeys(members, 0)
    for m in members:
        n = view.record_next(m)
        if n in mset and n != m:
            succ[m] = n
            indeg[n] += 1
    seen: set[int] = set()
    chains = []
    for h in [m for m in members if indeg[m] == 0] + members:  # heads first, then leftover cycles
        if h in seen:
            continue
        length, cyc = 0, indeg[h] != 0
        i: int | None = h
        while i is not None and i not in seen:
            seen.add(i)
            length += 1
            i = succ.get(i)
        chains.append({"head": h, "length": length, **({"cycle": True} if cyc else {})})
    chains.sort(key=lambda c: -c["length"])
    return chains


def _read_ranks(view: P.PoolView, chain: Any, problems: list[str]) -> list[dict]:
    layout, q = view.layout, view.q
    nrec, max_ops = layout.nrecords, layout.max_ops
    in_chain = set(chain.get("indices", [])) if isinstance(chain, dict) else set()
    listed_where: dict[int, int] = {}          # record -> the local rank whose free list holds it
    ranks = []
    free_lists = []
    for r in range(layout.nlocal):
        head = view.i32[P.FREE_OPS_OFF // 4 + r]
        idxs, problem = _walk(view, head, nrec)
        foreign = [i for i in idxs if i // max_ops != r]
        both = [i for i in idxs if i in in_chain]
        dup = [i for i in idxs if i in listed_where]
        for i in idxs:
            listed_where.setdefault(i, r)
        fl: dict[str, Any] = {"head": head, "length": len(idxs), "problem": problem}
        if problem:
            problems.append(f"free list of local rank {r}: {problem}")
        if foreign:
            fl["foreign"] = foreign[:MAX_LISTED]
            problems.append(f"free list of local rank {r} holds {len(foreign)} record(s) of other ranks: "
                            f"{_ranges(foreign[:MAX_LISTED])}")
        if both:
            fl["also_posted"] = both[:MAX_LISTED]
            problems.append(f"free list of local rank {r} holds {len(both)} record(s) that are also in the "
                            f"posted chain: {_ranges(both[:MAX_LISTED])}")
        if dup:
            fl["in_two_lists"] = dup[:MAX_LISTED]
            problems.append(f"free list of local rank {r} shares {len(dup)} record(s) with another free list")
        free_lists.append(fl)
    for r in range(layout.nlocal):
        region = range(r * max_ops, (r + 1) * max_ops)
        unlisted = [i for i in region if i not in in_chain and i not in listed_where]
        nposted = sum(1 for i in region if i in in_chain)
        nfree = sum(1 for i in region if i in listed_where)
        conn = q[layout.rank_q(r, P.RANK_CONN_STATE)]
        pend = q[layout.rank_q(r, P.RANK_PENDING)]   # a chain handed off, not yet spliced (_pool_lock.h)
        waiting = q[layout.rank_q(r, P.RANK_WAITING)]
        ranks.append({
            "local_rank": r,
            "pid": q[layout.rank_q(r, P.RANK_PID)],
            "waiting": int(bool(waiting)),
            "waiting_cpu": P.waiting_cpu(waiting) if waiting else None,
            "wake_word": q[layout.rank_q(r, P.RANK_WAKE)] & 0xFFFFFFFF,
            "posted": q[layout.rank_q(r, P.RANK_POSTED)],
            "completed": q[layout.rank_q(r, P.RANK_COMPLETED)],
            "conn_state": conn,
            "conn_state_name": _conn_state_name(conn),
            "records": [region.start, region.stop - 1],
            "in_posted_chain": nposted,
            "pending_chain": [(pend >> 32) - 1, (pend & 0xFFFFFFFF) - 1] if pend else None,
            "free_list": free_lists[r],
            "in_shared_free_lists": nfree,
            "not_in_shared_list": {
                "count": len(unlisted), "note": PRIVATE_NOTE, "indices": _ranges(unlisted),
                "chains": _chains_among(view, unlisted)[:16],
            },
        })
    return ranks


def _read_subs(view: P.PoolView, problems: list[str]) -> dict:
    from shmproxy.core.ops import KIND_NAMES
    layout = view.layout
    active: list[dict] = []
    nactive = 0
    for slot in range(layout.max_subs):
        (st, kind, src, dst, opcount, nbytes, nsteps, posted, transmitted, received, done, args_id,
         tag) = view.read_sub(slot)
        if st == P.SUB_FREE:
            continue
        nactive += 1
        if len(active) >= MAX_LISTED:
            continue
        sub = {"slot": slot, "state": st, "letter": P.SUB_STATE_LETTER.get(st, "?"),
               "kind": KIND_NAMES.get(kind, f"unknown({kind})"), "src": src, "dst": dst,
               "opcount": opcount, "nbytes": nbytes, "nsteps": nsteps, "posted": posted,
               "transmitted": transmitted, "received": received, "done": done, "args": args_id, "tag": tag}
        bad = []
        if st not in P.SUB_STATE_LETTER:
            bad.append(f"unknown state {st}")
        if not done <= received <= transmitted <= posted <= nsteps:
            bad.append("counters out of order (expected done <= received <= transmitted <= posted <= nsteps)")
        if bad:
            sub["corrupt"] = "; ".join(bad)
            problems.append(f"sub slot {slot}: {sub['corrupt']} (or caught mid-update)")
        active.append(sub)
    return {"active": active, "count": nactive, "listed": len(active), "max_subs": layout.max_subs}


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
    add("connections: " + (", ".join(f"{k} {v}" for k, v in conns.items()) if conns else "none"))
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
