#!/usr/bin/env python3
"""Compare `kruskal cpd` with pyttb's `cp_als`, iteration by iteration.

Both start from the same random factors (written as mode-<n>.npy and handed
to kruskal with --init), run K iterations without a stopping tolerance, and
the script prints the fit of every iteration from each and the largest
difference. It exits non-zero if any difference exceeds --max-diff.

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install pyttb numpy
    /tmp/venv/bin/python benches/compare_pyttb.py TENSOR.tns --rank 8 --iters 20 \
        --kruskal target/release/kruskal [--pattern] [--zero-based]

pyttb reports only the final fit, so iteration k's fit comes from a pyttb run
of k iterations (each run is deterministic from the same start). Lines that
repeat a coordinate are summed on both sides.
"""

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyttb as ttb


def read_tns(path, pattern, zero_based):
    # loadtxt reads .tns.gz as it is.
    data = np.loadtxt(path, comments="#", ndmin=2)
    if pattern:
        subs, vals = data, np.ones(len(data))
    else:
        subs, vals = data[:, :-1], data[:, -1]
    subs = subs.astype(np.int64) - (0 if zero_based else 1)
    shape = tuple(int(s) + 1 for s in subs.max(axis=0))
    # Lines that repeat a coordinate are one entry, their sum (the Tensor
    # Toolbox's rule, and kruskal's).
    return ttb.sptensor.from_aggregator(subs, vals.reshape(-1, 1), shape)


def pyttb_fits(x, factors, iters):
    fits = []
    for k in range(1, iters + 1):
        init = ttb.ktensor([f.astype(np.float64) for f in factors])
        with contextlib.redirect_stdout(io.StringIO()):
            _, _, out = ttb.cp_als(x, factors[0].shape[1], stoptol=0.0, maxiters=k,
                                   init=init, printitn=0)
        fits.append(float(out["fit"]))
    return fits


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tensor")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kruskal", default="target/release/kruskal")
    p.add_argument("--pattern", action="store_true")
    p.add_argument("--zero-based", action="store_true")
    p.add_argument("--max-diff", type=float, default=1e-4)
    a = p.parse_args()

    x = read_tns(a.tensor, a.pattern, a.zero_based)
    rng = np.random.default_rng(a.seed)
    factors = [rng.random((d, a.rank)).astype(np.float32) for d in x.shape]
    with tempfile.TemporaryDirectory() as tmp:
        for m, f in enumerate(factors):
            np.save(Path(tmp) / f"mode-{m + 1}.npy", f)
        cmd = [a.kruskal, "cpd", a.tensor, "--init", tmp, "--iters", str(a.iters),
               "--tol", "0", "--json"]
        cmd += ["--pattern"] if a.pattern else []
        cmd += ["--zero-based"] if a.zero_based else []
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    ours = [it["fit"] for it in json.loads(out)["iterations"]]
    theirs = pyttb_fits(x, factors, a.iters)

    print(f"{'iter':>4} {'kruskal fit':>14} {'pyttb fit':>14} {'difference':>11}")
    worst = 0.0
    for k, (f1, f2) in enumerate(zip(ours, theirs), 1):
        worst = max(worst, abs(f1 - f2))
        print(f"{k:>4} {f1:>14.9f} {f2:>14.9f} {f1 - f2:>11.2e}")
    print(f"largest difference {worst:.2e} over {len(ours)} iterations "
          f"({Path(a.tensor).name}, rank {a.rank})")
    return 0 if worst <= a.max_diff and len(ours) == a.iters else 1


if __name__ == "__main__":
    sys.exit(main())
