import json, glob, statistics as st, sys
nbytes = int(sys.argv[1])
loop = [x for f in glob.glob("/tmp/chain_loop_*.json") for x in json.load(open(f)) if x[8] == nbytes]
r0 = json.load(open(f"/tmp/chain_rank0_{nbytes}.json")); r1 = json.load(open(f"/tmp/chain_rank1_{nbytes}.json"))
# transfers alternate: 0->1 (rank0 Send, rank1 Recv), then 1->0; iteration i has transfers 2i, 2i+1
loop.sort(key=lambda x: x[4])
n = min(len(r0), len(loop) // 2)
cols = {k: [] for k in ["oneway", "post_last->fetch_last", "fetch->match", "match->start", "start->launched",
                        "launched->end of start", "launched->recv returned", "launched->loop saw done",
                        "recv returned->next post", "send returned->its next post"]}
for i in range(n // 5, n - 1):
    for k, (tr, rs, rr) in enumerate(((loop[2*i], r0[i], r1[i]), (loop[2*i+1], r1[i], r0[i+1] if i+1 < len(r0) else None))):
        sp, rp, sf, rf, tm, t0, t1, t2, nb, seen = tr[:10]
        if len(tr) > 10:
            unp, nops, me, ta, ts, l0, tq = tr[10:17]
            cols.setdefault("fetch call->unpacked (last batch)", []).append(unp - tq)
            cols.setdefault("unpacked->match entry", []).append(me - unp)
            cols.setdefault("match entry->Transfer", []).append(tm - me)
            cols.setdefault("start->addresses", []).append(ta - t0)
            cols.setdefault("addresses->ordered stream", []).append(ts - ta)
            if l0: cols.setdefault("ordered stream->fill+launch begin", []).append(l0 - ts)
            if l0: cols.setdefault("fill+launch", []).append(t1 - l0)
            cols.setdefault("ops in last batch", []).append(nops * 1000)
            cols.setdefault("post_last->fetch call (last batch)", []).append(tq - max(sp, rp))
        if rr is None: continue
        post_last, fetch_last = max(sp, rp), max(sf, rf)
        # receiver's return: rank1's Recv returns at rs/rr rows; k=0: rank1 Recv is rr[1] (t1); k=1: rank0 Recv returns r0[i][2]
        recv_ret = r1[i][1] if k == 0 else r0[i][2]
        send_ret = r0[i][1] if k == 0 else r1[i][2]
        nxt = loop[2*i+1] if k == 0 else loop[2*i+2] if 2*i+2 < len(loop) else None
        if nxt is None: continue
        cols["oneway"].append(max(nxt[0], nxt[1]) - post_last)
        cols["post_last->fetch_last"].append(fetch_last - post_last)
        cols["fetch->match"].append(tm - fetch_last)
        cols["match->start"].append(t0 - tm)
        cols["start->launched"].append(t1 - t0)
        cols["launched->end of start"].append(t2 - t1)
        cols["launched->recv returned"].append(recv_ret - t1)
        if seen: cols["launched->loop saw done"].append(seen - t1)
        cols["recv returned->next post"].append((nxt[0] if k == 0 else nxt[0]) - recv_ret)  # next send is by the receiver
        cols["send returned->its next post"].append((nxt[1]) - send_ret)  # next recv is by the sender
print(f"CHAIN {nbytes} B, {len(cols['oneway'])} transfers, medians (p10, p90) us:")
for k, v in cols.items():
    if v:
        v = sorted(v); m = len(v)
        print(f"  {k:32s} {st.median(v)/1e3:7.1f}  ({v[m//10]/1e3:.1f}, {v[9*m//10]/1e3:.1f})")
