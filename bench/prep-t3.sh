#!/bin/bash
# CPD of t3 end to end on one GPU (docs/performance.md, "End to end on t3"):
# load, preparation (opening the GPU, the tuning model, the layout built on
# the GPU or on the host) and 50 iterations, for fixed fcoo and auto, with
# the process's wall time. Usage, from the repository root on the GPU
# machine: bash bench/prep-t3.sh KRUSKAL_BINARY OUT_DIR
# (t3 is made by bench/gen_anchor.py, which needs numpy.)
set -u
K=${1:?the kruskal binary}
R=${2:?an output folder}
PY=${PY:-python3}
mkdir -p "$R" anchors
[ -f anchors/t3.ktns ] || "$PY" bench/gen_anchor.py t3 anchors/t3.ktns > "$R/gen.txt" 2>&1
# Version-2 .ktns, so loading does no search for repeated coordinates.
"$K" convert anchors/t3.ktns /tmp/t3c.ktns > /dev/null
# A short run first, so the kernel cache is warm.
"$K" cpd /tmp/t3c.ktns --backend gpu -r 32 --iters 2 --tol 0 > /dev/null 2>&1
for B in gpu host; do
  for KER in fcoo auto; do
    NM=""; [ "$KER" = fcoo ] && NM=--no-model
    "$K" cpd /tmp/t3c.ktns --backend gpu -r 32 --iters 50 --tol 0 --kernel $KER $NM --fcoo-build $B > "$R/cpd-$KER-$B.txt" 2>&1
    ( time "$K" cpd /tmp/t3c.ktns --backend gpu -r 32 --iters 50 --tol 0 --kernel $KER $NM --fcoo-build $B --json > "$R/cpd-$KER-$B.json" ) 2> "$R/time-$KER-$B.txt"
  done
done
"$K" mttkrp /tmp/t3c.ktns --backend gpu --kernel fcoo --no-model -r 32 --repeat 10 > "$R/mttkrp.txt" 2>&1
"$PY" bench/open_gpu.py > "$R/open.txt" 2>&1
grep -h "built on" "$R/mttkrp.txt"
for f in "$R"/cpd-*.json; do
  "$PY" -c "import json; d = json.load(open('$f')); print('$f', d['tensor']['load_s'], d['prepare'], d['cpd_s'])"
done
grep real "$R"/time-*.txt
cat "$R/open.txt"
