"""Summary of ovdiag.py's per-rank files (docs/bench/h200x2-32core/session6/diag/ovdiag.py) without
the progress profile: per-iteration post, Wait and t_total - t_compute over all ranks, the fraction of
iterations where some rank waited more than 2 us (the collective outlasted the work), and OSU's overlap.
    python3 ovsum.py DIR [DIR...]"""
import glob
import sys

import numpy as np


def q(x):
    x = np.sort(x.ravel()) / 1e3
    return " ".join(f"{x[int(p * (len(x) - 1))]:6.2f}" for p in (0.1, 0.5, 0.9, 0.99)) + f"  mean {x.mean():6.2f}"


for d in sys.argv[1:]:
    ranks = [np.load(f) for f in sorted(glob.glob(f"{d}/rank*.npz"))]
    if not ranks:
        print(d, "no rank files")
        continue
    to = np.stack([r["to"] for r in ranks])       # rank, iteration, (t0 post t1 work t2 wait t3)
    tc = np.stack([r["tc"] for r in ranks])
    t_comm = (tc[:, :, 1] - tc[:, :, 0]).mean()
    post, wait = to[:, :, 1] - to[:, :, 0], to[:, :, 3] - to[:, :, 2]
    ovh = (to[:, :, 3] - to[:, :, 0]) - (to[:, :, 2] - to[:, :, 1])
    late = (wait > 2000).any(axis=0).mean()
    print(f"{d}: {len(ranks)} ranks, t_comm {t_comm / 1e3:.1f} us, overlap {100 * (1 - ovh.mean() / t_comm):.1f} %,"
          f" late iterations {100 * late:.1f} %")
    print("   (p10 p50 p90 p99, us)  post", q(post), "| wait", q(wait), "| t_total-t_comp", q(ovh))
