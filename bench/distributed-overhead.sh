#!/usr/bin/env bash
# One process with two GPUs (`--gpus 2`) against two processes with one GPU
# each (`--distributed`, over 127.0.0.1) on the same .ktns files: ms per
# iteration (mean of iterations 2-12, median of 3 runs), update and exchange
# time, setup time, and the largest fit difference. Prints a Markdown table.
#
#   bash bench/distributed-overhead.sh [KRUSKAL_BINARY] [SCRATCH_DIR]
#
# Needs 2 GPUs, NCCL, python3 and about 4 GB in SCRATCH_DIR (default /tmp).
set -euo pipefail
K=${1:-kruskal}
D=${2:-/tmp}
export KRUSKAL_JOB_TOKEN=${KRUSKAL_JOB_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
"$K" gen --like nell-1 --nnz 144M "$D/nell-1.ktns" > /dev/null
"$K" gen --like nell-2 --nnz 76.9M "$D/nell-2.ktns" > /dev/null
A="--rank 32 --iters 12 --tol 0 --json"
for name in nell-1 nell-2; do
  F=$D/$name.ktns
  for rep in 1 2 3; do
    "$K" cpd "$F" --gpus 2 --exchange nccl $A > "$D/$name-one-$rep.json"
    "$K" cpd "$F" $A --distributed --process-rank 1 --world-size 2 --local-gpu 1 \
      --rendezvous 127.0.0.1:29533 > /dev/null &
    "$K" cpd "$F" $A --distributed --process-rank 0 --world-size 2 --local-gpu 0 \
      --rendezvous 127.0.0.1:29533 > "$D/$name-two-$rep.json"
    wait
  done
done
python3 - "$D" <<'PY'
import json, statistics as st, sys
d = sys.argv[1]
def per_it(r):
    xs = [s["mttkrp_s"] + s["other_s"] for s in r["iterations"][1:]]
    return 1e3 * sum(xs) / len(xs)
def total(r, key):
    return sum(x[key] / max(x["calls"], 1) for x in r["kernel"]["breakdown"])
print("| tensor | one process ms/it | two processes ms/it | overhead | update + Gram, one / two (ms/it) "
      "| exchange, one / two (ms/it) | setup, one process (load + prepare) | setup, two processes (count, shards, group) |")
print("|---|---|---|---|---|---|---|---|")
for name, label in (("nell-1", "nell-1 144M"), ("nell-2", "nell-2 76.9M")):
    ones = [json.load(open(f"{d}/{name}-one-{k}.json")) for k in (1, 2, 3)]
    twos = [json.load(open(f"{d}/{name}-two-{k}.json")) for k in (1, 2, 3)]
    o = st.median(per_it(r) for r in ones)
    t = st.median(per_it(r) for r in twos)
    fit = max(abs(a["fit"] - b["fit"]) for x, y in zip(ones, twos)
              for a, b in zip(x["iterations"], y["iterations"]))
    s = twos[0]["setup_s"]
    print(f"| {label} | {o:.2f} | {t:.2f} | {100 * (t / o - 1):+.1f}% "
          f"| {st.median(total(r, 'update_ms') for r in ones):.2f} / {st.median(total(r, 'update_ms') for r in twos):.2f} "
          f"| {st.median(total(r, 'exchange_ms') for r in ones):.2f} / {st.median(total(r, 'exchange_ms') for r in twos):.2f} "
          f"| {st.median(r['tensor']['load_s'] + r['prepare_s'] for r in ones):.1f} s "
          f"| {s['count']:.1f}, {s['shards']:.1f}, {s['group']:.1f} s (largest fit difference {fit:.0e}) |")
PY
