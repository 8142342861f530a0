"""Two decompositions of one tensor from Python on one GPU (docs/performance.md,
"Third round"): the second upload copies from the page lock the first one left
with the tensor. Prints each run's preparation and iteration seconds.
Usage: python bench/py-twice.py FILE [RANK] [ITERS]"""
import sys

import kruskal

path = sys.argv[1]
rank = int(sys.argv[2]) if len(sys.argv) > 2 else 32
iters = int(sys.argv[3]) if len(sys.argv) > 3 else 10
X = kruskal.read(path)
fits = []
for run in (1, 2):
    m = kruskal.cp_als(X, rank, iters=iters, tol=0, backend="gpu", kernel="fcoo", seed=1,
                       progress=False)
    fits.append(m.fits[-1])
    print(f"run {run}: backend {m.backend}, preparation {m.info['prepare_s']:.4f} s, "
          f"{iters} iterations {m.info['cpd_s']:.4f} s, fit {m.fits[-1]:.6f}")
    print("  parts", {k: round(v, 4) for k, v in m.info["prepare"].items()},
          "layout steps (ms)", [(s, round(1e3 * t, 1)) for s, t in m.info["layout_steps"]])
print("same fit" if fits[0] == fits[1] else f"fits differ: {fits}")
