import json, glob, sys, numpy as np
d = sys.argv[1]
ranks = [np.load(f) for f in sorted(glob.glob(f"{d}/rank*.npz"))]
prof = json.load(open(glob.glob(f"{d}/prof*.json")[0]))["traceEvents"]
gc = [json.load(open(f)) for f in glob.glob(f"{d}/gc*.json")][:1] or [[]]; gc = gc[0]
ar = [e for e in prof if e["name"].startswith("Allreduce")]
ar.sort(key=lambda e: int(e["name"].split("#")[1]))
it = len(ranks[0]["to"])
def arr(evs):
    first = np.array([e["ts"] * 1e3 for e in evs]); done = first + np.array([e["dur"] * 1e3 for e in evs])
    last = np.array([e["args"]["last_post_ns"] for e in evs], float); fetch = np.array([e["args"]["fetch_ns"] for e in evs], float)
    return first, last, fetch, done
ov = arr(ar[-it:]); cm = arr(ar[-2 * it:-it])
def q(x): x = np.sort(x); return " ".join(f"{x[int(p*(len(x)-1))]/1e3:7.1f}" for p in (0.1, 0.5, 0.9, 0.99)) + f"  mean {x.mean()/1e3:6.1f}"
print("target us", [round(float(r["target"]) * 1e6, 1) for r in ranks])
for name, (first, last, fetch, done) in (("comm", cm), ("overlap", ov)):
    print(f"== {name}  (p10 p50 p90 p99)")
    print(" post skew first->last ", q(last - first))
    print(" last post -> fetch    ", q(fetch - last))
    print(" fetch -> done         ", q(done - fetch))
    print(" last post -> done     ", q(done - last))
to = np.stack([r["to"] for r in ranks])  # rank, iter, 4
first, last, fetch, done = ov
late = done[None, :] - to[:, :, 2]
print("late (done - work end), all ranks:", q(late.ravel()), " frac late", (late > 0).mean().round(3))
ovh = (to[:, :, 3] - to[:, :, 0]) - (to[:, :, 2] - to[:, :, 1])
print("t_total - t_comp:", q(ovh.ravel()), " post:", q((to[:, :, 1] - to[:, :, 0]).ravel()), " wait:", q((to[:, :, 3] - to[:, :, 2]).ravel()))
tc = np.stack([r["tc"] for r in ranks]); tcomm = (tc[:, :, 1] - tc[:, :, 0]).mean()
print("t_comm mean", tcomm / 1e3, " overlap %", 100 * (1 - ovh.mean() / tcomm))
wait = to[:, :, 3] - to[:, :, 2]
lateit = (late.max(axis=0) > 0)
print("wait when late (mean over late iters)", (wait[:, lateit]).mean() / 1e3, "n late iters", lateit.sum(), " wait when not late", wait[:, ~lateit].mean() / 1e3)
print("contribution of late iters to overhead", (wait[:, lateit].sum() / wait.sum()).round(3))
print("gc", len(gc), gc[:5])
# late iterations: which component
fl = (fetch - last)[lateit]; ex = (done - fetch)[lateit]
print("late iters: fetch delay", q(fl), "\n            exec      ", q(ex))
print("late iters: work end - last post per rank (i.e. work duration from post)", q((to[:, lateit, 2] - last[None, lateit]).ravel()))
