#!/usr/bin/env python3
"""pyttb's CP-APR on a .ktns count tensor, timed per outer iteration: the
CPU baseline for `kruskal cp-apr`.

It reads kruskal's binary tensor format with the reader of
benches/torch_mttkrp.py (repeated coordinates summed as kruskal sums them,
so both tools get the same nonzeros), builds a pyttb sparse tensor, draws
uniform [0, 1) factors (numpy, --seed) and runs
`pyttb.cp_apr(X, rank, algorithm="mu", maxiters=--iters, stoptol=0)`, so
every outer iteration runs. pyttb's own clock (`output["times"]`, the
cumulative seconds after each outer iteration) gives the seconds of each;
the last line is JSON with the median over the iterations after the
first, the same summary `kruskal cp-apr` prints.

    python3 benches/pyttb_cp_apr.py /tmp/counts.ktns --rank 32 --iters 3

pyttb imports matplotlib for plotting only; on a machine without it
(--no-matplotlib) an empty stand-in module is registered first, which is
enough for cp_apr.
"""

import argparse
import json
import os
import statistics
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_mttkrp import read_ktns  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tensor", help="a .ktns file of counts")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--iters", type=int, default=3, help="outer iterations")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-matplotlib", action="store_true",
                   help="register an empty matplotlib before importing pyttb")
    a = p.parse_args()
    if a.iters < 1 or a.rank < 1:
        sys.exit("pyttb_cp_apr: --iters and --rank must be at least 1")
    if a.no_matplotlib:
        plt = types.ModuleType("matplotlib.pyplot")
        mpl = types.ModuleType("matplotlib")
        mpl.pyplot = plt
        sys.modules.setdefault("matplotlib", mpl)
        sys.modules.setdefault("matplotlib.pyplot", plt)
    import pyttb as ttb

    t0 = time.time()
    x = read_ktns(a.tensor)
    subs = np.stack([i.astype(np.int64) for i in x.indices], axis=1)
    vals = x.values.astype(np.float64).reshape(-1, 1)
    if not np.all(np.isfinite(vals)) or np.any(vals < 0):
        sys.exit(f"pyttb_cp_apr: {a.tensor}: values must be finite and non-negative")
    tensor = ttb.sptensor(subs, vals, tuple(int(d) for d in x.dims))
    load_s = time.time() - t0
    rng = np.random.default_rng(a.seed)
    init = ttb.ktensor([rng.random((int(d), a.rank)) for d in x.dims])
    _, _, out = ttb.cp_apr(tensor, a.rank, algorithm="mu", maxiters=a.iters,
                           stoptol=0.0, init=init, printitn=1)
    cumulative = [float(t) for t in out["times"]]
    each = [b - a_ for a_, b in zip([0.0] + cumulative[:-1], cumulative)]
    after_first = each[1:] or each
    print(json.dumps({
        "tool": "pyttb cp_apr mu",
        "tensor": a.tensor,
        "nnz": int(x.nnz),
        "rank": a.rank,
        "threads": os.cpu_count(),
        "load_s": load_s,
        "iteration_s": each,
        "median_s_after_first": statistics.median(after_first),
    }))


if __name__ == "__main__":
    main()
