"""Usage: python3 abrep.py OUTDIR NAME. Summarise interleaved A/B bench JSONs: per size, shmproxy time and ratio vs mpi4py for each run."""
import json, sys, glob, re, statistics
outdir, name = sys.argv[1], sys.argv[2]
runs = {"A": [], "B": []}
for side in "AB":
    files = sorted(glob.glob(f"{outdir}/{name}-{side}-*.json"), key=lambda f: int(re.search(r'-(\d+)\.json$', f).group(1)))
    for f in files:
        runs[side].append(json.load(open(f)))
sizes = [r["bytes"] for r in runs["A"][0]["results"]]
print(f"{name}: {len(runs['A'])} A runs, {len(runs['B'])} B runs; time us (ratio vs mpi4py)")
for i, size in enumerate(sizes):
    line = f"{size:>10}"
    for side in "AB":
        cells = []
        for d in runs[side]:
            r = d["results"][i]
            t = r["results"]["shmproxy"]["time_us"]; ra = r.get("ratio", {}).get("mpi4py")
            cells.append(f"{t:7.1f}" + (f"({ra:.2f})" if ra else ""))
        med = statistics.median(d["results"][i]["results"]["shmproxy"]["time_us"] for d in runs[side])
        line += f" | {side}: " + " ".join(cells) + f" med {med:.1f}"
    print(line)
