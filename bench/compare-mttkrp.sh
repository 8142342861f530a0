#!/bin/bash
# The same kruskal mttkrp runs by two binaries (OLD, default
# gpu-run/kruskal-old, and NEW, default gpu-run/kruskal), e.g. before and
# after a change that should not alter the output:
# output compared with numbers masked.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} KRUSKAL_CACHE_DIR=/tmp/kc
T="--like nell-2 --nnz 2000000 --repeat 3"
mask() { sed -E 's/[0-9]+\.[0-9]+(e-?[0-9]+)?/N/g; s/ +/ /g'; }
while IFS= read -r args; do
  ${OLD:-gpu-run/kruskal-old} mttkrp $T $args > /tmp/old.txt 2>&1; a=$?
  ${NEW:-gpu-run/kruskal} mttkrp $T $args > /tmp/new.txt 2>&1; b=$?
  if diff <(mask < /tmp/old.txt) <(mask < /tmp/new.txt) > /tmp/d.txt; then
    echo "same rc=$a/$b $(wc -l < /tmp/new.txt) lines: $args"
  else
    echo "DIFF rc=$a/$b: $args"; head -20 /tmp/d.txt
  fi
done <<'LIST'
--backend gpu --kernel auto --verify
--backend gpu --kernel all
--backend gpu --kernel fcoo --threadlen 16 --json
--backend gpu --kernel flycoo --deterministic --verify --json
--backend gpu --kernel fcoo --factor-precision bf16 --verify
--gpus 2 --verify
--gpus 2 --exchange p2p --json
--gpus 2 --kernel all
LIST
echo "== new, gpu auto"; ${NEW:-gpu-run/kruskal} mttkrp $T --backend gpu --verify | head -12
echo "== new, gpus 2"; ${NEW:-gpu-run/kruskal} mttkrp $T --gpus 2 --verify | head -16
