#!/usr/bin/env python3
"""Time CP-APR per outer iteration: kruskal (GPU and/or CPU) against pyttb.

Reads a tensor file with `kruskal.read`, turns its values into counts
(`--counts K`: ceil(value * K), for generated tensors whose values are
uniform in [0, 1); 0 keeps the values), and runs `kruskal.cp_apr` on each
`--backend` and pyttb's `cp_apr(algorithm="mu")` from the same random start
(numpy, seed 7) with `stoptol=0`, so every outer iteration runs all its
inner iterations; `--gpus N` (repeatable) adds a run on a group of N GPUs
(`kruskal.cp_apr(..., gpus=N)`). `--pyttb-iters` sets pyttb's own
iteration count (default `--iters`), and pyttb's sparse tensor is built
before its clock starts (that time is printed apart). Prints per run the
seconds of each outer iteration (the first also builds the sorted copies,
and on a GPU uploads them), the mean of the others, and the final
log-likelihood with its relative difference from the first run's.

    target/release/kruskal gen /tmp/nell2-20m.ktns --like nell-2 --nnz 20M
    cd crates/kruskal-py && maturin develop --release && cd -
    python3 bench/cp_apr_vs_pyttb.py /tmp/nell2-20m.ktns --rank 32 --iters 5 \
        --backend gpu --backend cpu --pyttb
"""

import argparse
import contextlib
import io
import time

import numpy as np

import kruskal


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tensor")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--counts", type=float, default=5.0)
    p.add_argument("--backend", action="append", choices=["gpu", "cpu", "auto"])
    p.add_argument("--gpus", action="append", type=int, default=[],
                   help="also run on a group of N GPUs")
    p.add_argument("--pyttb", action="store_true", help="time pyttb too")
    p.add_argument("--pyttb-iters", type=int, default=0)
    a = p.parse_args()
    X = kruskal.read(a.tensor)
    subs, vals, shape = X.indices.astype(np.int64), X.values.astype(np.float64), X.shape
    if a.counts > 0:
        vals = np.ceil(vals * a.counts)
    X = kruskal.SparseTensor(subs, vals, shape)
    rng = np.random.default_rng(7)
    start = [rng.random((d, a.rank)) for d in shape]
    print(f"{a.tensor}: {len(vals):,} nonzeros, dims {shape}, rank {a.rank}, {a.iters} iterations")
    first = None
    runs = [(b, 1) for b in (a.backend or ([] if a.gpus else ["gpu"]))]
    runs += [("gpu", n) for n in a.gpus]
    for backend, gpus in runs:
        m = kruskal.cp_apr(X, a.rank, init=start, maxiters=a.iters, stoptol=0.0, backend=backend,
                           gpus=gpus)
        ends = [it["elapsed_s"] for it in m.iterations]
        per = np.diff([0.0] + ends)
        first = m.log_likelihood if first is None else first
        print(f"kruskal {m.info['describe']}: per iteration {np.round(per, 4).tolist()} s, "
              f"after the first {per[1:].mean() if len(per) > 1 else float('nan'):.4f} s, "
              f"log-likelihood {m.log_likelihood:.12e} "
              f"(rel. diff {abs(m.log_likelihood - first) / abs(first):.1e})")
    if a.pyttb:
        import pyttb

        t0 = time.perf_counter()
        x = pyttb.sptensor.from_aggregator(subs, vals.reshape(-1, 1), shape)
        init = pyttb.ktensor([f.copy() for f in start])
        print(f"pyttb {pyttb.__version__}: sparse tensor built in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        iters = a.pyttb_iters or a.iters
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            _, _, out = pyttb.cp_apr(x, a.rank, algorithm="mu", init=init, maxiters=iters,
                                     stoptol=0.0, printitn=0)
        s = time.perf_counter() - t0
        ll = float(out["obj"])
        same = ""
        if iters == a.iters:
            same = f" (rel. diff {abs(ll - first) / abs(first):.1e})"
        print(f"pyttb {pyttb.__version__}: {iters} iteration(s) in {s:.3f} s, "
              f"{s / iters:.4f} s per iteration, log-likelihood {ll:.12e}{same}")


if __name__ == "__main__":
    main()
