"""Read an ops pool into a plain dict, from inside the progress process or from outside it.

``read_pool`` is what both dumps share: the progress process calls it on its own mapping (and adds an
``in_process`` key, ProgressEngine.dump_state), and ``shmproxy-dump`` calls it on a read-only mapping
of the pool opened through ``/proc/<pid>/fd/<n>`` when the process is stopped or wedged. Rendering
the dict as text is shmproxy.tools.dump's job, which re-exports ``read_pool``.

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

from shmproxy.tools.fast_reader import read_fast
from shmproxy.core import infoblob
from shmproxy.shm import pool as P

STATE_NAMES = {P.PROXY_STARTING: "STARTING", P.PROXY_RUNNING: "RUNNING", P.PROXY_STOPPING: "STOPPING",
               P.PROXY_EXITED: "EXITED"}
STAT_FIELDS = (("fetches", P.CTRL_N_FETCH), ("ops", P.CTRL_N_OPS), ("args", P.CTRL_N_ARGS),
               ("sleeps", P.CTRL_N_SLEEP), ("passes", P.CTRL_N_PASSES), ("active_subs", P.CTRL_ACTIVE_SUBS),
               ("buffered_sends", P.CTRL_N_BUFFERED), ("copy_jobs", P.CTRL_N_COPY_JOBS))
MAX_LISTED = 1024       # records / subs listed individually in one section; counts are always complete
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
    state["fast"] = _section(problems, "fast path", lambda: read_fast(view, problems))
    if isinstance(chain, dict):
        chain.pop("indices", None)  # internal: membership for the rank sections (records keep the order)
    state["layout"] = {"nlocal": layout.nlocal, "max_ops": layout.max_ops, "max_subs": layout.max_subs,
                       "nrecords": layout.nrecords, "total_bytes": layout.total_bytes,
                       "fast_bytes": layout.fast_bytes}
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
    info = infoblob.read(view)   # never a rewrite half done (its seqlock)
    if not isinstance(info, dict):
        problems.append("info blob is not a JSON object")
        return {"error": "info blob is not a JSON object"}
    if not info:
        return {"error": "info blob is empty (progress process still starting?)"}
    if "error" in info and len(info) == 1:
        problems.append(f"info blob: {info['error']}")
    problems.extend(pending_problems(info.get("pending")))
    return info


def pending_problems(pending: Any) -> list[str]:
    """What the progress process's list of old waits (engine/introspect.py) says is wrong: a receive
    and a message between the same ranks that do not match (another tag: a near-match), and a
    collective some local ranks entered and others have not."""
    if not isinstance(pending, dict):
        return []
    out = []
    recvs = [r for r in pending.get("recvs") or [] if isinstance(r, dict)]
    sends = [s for s in pending.get("sends") or [] if isinstance(s, dict)]
    for r in recvs:
        for s in sends:
            if s.get("to") == r.get("rank") and r.get("from") in (s.get("rank"), -1):
                out.append(f"near-match: rank {r.get('rank')} waits for tag {r.get('tag')} from rank "
                           f"{r.get('from')}, but rank {s.get('rank')}'s {s.get('bytes')} B message to it "
                           f"has tag {s.get('tag')} (both pending "
                           f"{min(r.get('age_s', 0), s.get('age_s', 0))} s)")
    for c in pending.get("colls") or []:
        if isinstance(c, dict) and c.get("missing"):
            out.append(f"collective #{c.get('seq')} {c.get('call')}: ranks {c.get('in')} entered it "
                       f"{c.get('age_s')} s ago, ranks {c.get('missing')} have not")
    return out


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
    try:  # ConnState may not exist in every build: fall back to the number
        from shmproxy.control.protocol import ConnState
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
