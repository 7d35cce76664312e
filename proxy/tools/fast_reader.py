"""The dump's view of the fast path (shm/_fast.h): what waits in the cells, who is in which small
collective, and the counters the ranks order their messages by. Read without any lock, as the rest
of the dump is: a snapshot that may catch a cell or a slot mid-update.

Problems it names: messages waiting in cells whose receiver has a receive posted in the progress
process (they should have been drained: a lost doorbell), and a small collective some ranks entered
while others have not (the fast path's counterpart of the progress process's unjoined collective).
"""
from __future__ import annotations

from shmproxy.shm import pool as P

_STATE = {P.CELL_EMPTY: "empty", P.CELL_FULL: "full", P.CELL_TAKING: "taken by the receiver",
          P.CELL_DRAINING: "drained by the progress process"}


def read_fast(view: P.PoolView, problems: list[str]) -> dict:
    lay = view.layout
    if not lay.fast_bytes:
        return {"on": False}
    q, n = view.q, lay.nlocal
    ranks = []
    for lr in range(n):
        ranks.append({"local_rank": lr, "rank": q[lay.frank_q(lr, P.FRANK_RANK)] - 1,
                      "recv_posted": q[lay.rank_q(lr, P.RANK_RECV_POSTED)],
                      "recv_done": q[lay.frank_q(lr, P.FRANK_RECV_DONE)],
                      "doorbell": q[lay.frank_q(lr, P.FRANK_DOORBELL)]})
    waiting = []
    for s in range(n):
        for d in range(n):
            base = lay.pair_off(s, d) // 8
            cells = []
            for k in range(P.FAST_CELLS):
                cell = P.CELL.unpack_from(view.buf, lay.cell_off(s, d, k))
                state, code, fseq, slow, tag, nbytes = cell[:6]
                if state != P.CELL_EMPTY:
                    cells.append({"fseq": fseq, "state": _STATE.get(state, state), "tag": tag,
                                  "nbytes": nbytes, "dtype_code": code, "slow_sends_before": slow})
            if not cells:
                continue
            cells.sort(key=lambda c: c["fseq"])
            src, dst = ranks[s]["rank"], ranks[d]["rank"]
            waiting.append({"from": src, "to": dst, "cells": cells,
                            "written": q[base + P.PAIR_F_WRITTEN], "taken": q[base + P.PAIR_F_TAKEN],
                            "drained": q[base + P.PAIR_F_DRAINED],
                            "slow_fetched": q[base + P.PAIR_FETCHED_SLOW], "unexpected": q[base + P.PAIR_UNEXP]})
            r = ranks[d]
            if r["recv_posted"] != r["recv_done"]:
                problems.append(f"fast path: {len(cells)} message(s) from rank {src} to rank {dst} wait in "
                                f"cells (tags {[c['tag'] for c in cells]}) while rank {dst} has a receive "
                                f"posted in the progress process: they should have been drained into it")
    return {"on": True, "bytes": lay.fast_bytes, "ranks": ranks, "cells": waiting,
            "collectives": _collectives(view, problems)}


def _collectives(view: P.PoolView, problems: list[str]) -> list[dict]:
    """Per rank: the newest small collective it entered, the last it finished, and how many it
    posted to the progress process."""
    lay, q = view.layout, view.q
    out = []
    for r in range(lay.nlocal):
        base = lay.crank_off(r)
        seqs = []
        for parity in range(2):
            seq, fp, _slow = P.CSLOT.unpack_from(view.buf, base + P.FAST_LINE + lay.cell_stride * parity)
            seqs.append((seq, fp))
        seq, fp = max(seqs)
        out.append({"rank": r, "entered": seq, "fingerprint": fp, "done": q[base // 8 + P.CRANK_DONE],
                    "slow_collectives": q[base // 8 + P.CRANK_SLOW_COLLS]})
    top = max((c["entered"] for c in out), default=0)
    if top:
        inside = [c["rank"] for c in out if c["entered"] == top]
        behind = [c["rank"] for c in out if c["entered"] < top]
        if behind and any(c["done"] < top for c in out if c["entered"] == top):
            fp = next(c["fingerprint"] for c in out if c["entered"] == top)
            problems.append(f"small collective #{top} ({describe(fp)}): ranks {inside} entered it, "
                            f"ranks {behind} have not")
    return out


def describe(fp: int) -> str:
    from shmproxy.rank.fastpath import describe as words   # the rank's wording of a fingerprint
    return words(fp)
