#!/usr/bin/env bash
# The CPD-ALS figures of docs/performance.md on generated tensors, on one
# GPU and on the host's CPU backend: per tensor and rank, ms per iteration
# (mean of iterations 2..), MTTKRP share, dense update, fit, and the CPU
# backend's ms per iteration. Prints a Markdown table; the JSON reports stay
# in SCRATCH_DIR.
#
#   bash bench/cpd-one-gpu.sh [KRUSKAL_BINARY] [SCRATCH_DIR] [RANKS] [CPU_RANKS]
#
# Generated tensors have exactly the nonzero count asked for, at distinct
# coordinates (kruskal gen), so their fits are those of real CPD runs.
set -euo pipefail
K=${1:-kruskal}
D=${2:-/tmp}
RANKS=${3:-"16 32 64"}
CPU_RANKS=${4:-"32"}
tensors="nell-2:76.9M nell-1:100M delicious-4d:100M vast-5d:26M"
for t in $tensors; do
  name=${t%%:*}; nnz=${t##*:}
  [ -f "$D/$name-$nnz.ktns" ] || "$K" gen --like "$name" --nnz "$nnz" "$D/$name-$nnz.ktns" > /dev/null
  for r in $RANKS; do
    "$K" cpd "$D/$name-$nnz.ktns" --rank "$r" --iters 4 --tol 0 --backend gpu --json \
      > "$D/cpd-gpu-$name-$r.json"
  done
  for r in $CPU_RANKS; do
    "$K" cpd "$D/$name-$nnz.ktns" --rank "$r" --iters 2 --tol 0 --backend cpu --json \
      > "$D/cpd-cpu-$name-$r.json"
  done
done
python3 - "$D" "$tensors" "$RANKS" <<'PY'
import json, os, sys
d, tensors, ranks = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
def per_it(r):
    """MTTKRP, dense update and whole iteration, ms, mean of iterations 2.."""
    its = r["iterations"][1:] or r["iterations"]
    mean = lambda f: 1e3 * sum(f(x) for x in its) / len(its)
    return mean(lambda x: x["mttkrp_s"]), mean(lambda x: x["update_s"]), \
        mean(lambda x: x["mttkrp_s"] + x["other_s"])
print("| tensor | rank | GPU ms/iteration | GPU MTTKRP ms (share) | GPU dense update ms | fit | CPU ms/iteration | CPU MTTKRP share | GPU speedup |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for t in tensors:
    name, nnz = t.split(":")
    for r in ranks:
        g = json.load(open(f"{d}/cpd-gpu-{name}-{r}.json"))
        m, u, total = per_it(g)
        cpu = f"{d}/cpd-cpu-{name}-{r}.json"
        if os.path.exists(cpu):
            c = json.load(open(cpu))
            cm, _, ct = per_it(c)
            cpu_cols = f"{ct:.0f} | {100 * cm / ct:.0f}% | {ct / total:.1f}x"
        else:
            cpu_cols = "not measured | | "
        print(f"| {name} {nnz} | {r} | {total:.1f} | {m:.1f} ({100 * m / total:.0f}%) | {u:.1f} | "
              f"{g['fit']:.6f} | {cpu_cols} |")
PY
