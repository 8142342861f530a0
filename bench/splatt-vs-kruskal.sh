#!/usr/bin/env bash
# SPLATT against kruskal's CPU MTTKRP on the same FROSTT .tns files: all-mode
# MTTKRP, f32, rank RANK, THREADS threads, the two tools run back to back in
# ROUNDS rounds. Prints every round and, per tensor, the medians, the
# smallest and largest per-round ratio, and SPLATT's time over kruskal's.
#
#   bash bench/splatt-vs-kruskal.sh KRUSKAL_BINARY KIT_DIR TENSOR.tns [TENSOR.tns ...]
#
# KIT_DIR is the SPLATT/BLCO build kit (copied into a git-ignored folder of
# the repository, e.g. .gpu/kit). SPLATT is run by the kit's run.sh (SKIP_BLCO=1),
# which times each variant's MTTKRP of every mode (`splatt bench -a csf`,
# wall clock, mean of iterations 2..SPLATT_ITERS); the best of the variants
# counts. kruskal is `kruskal mttkrp --backend cpu --kernel K --json`
# (one warm-up sweep, then the median of each mode over REPEAT sweeps,
# summed over modes); each kernel of KERNELS is one column.
#
# If $KIT_BUILD/bin/splatt_f32_i64 is missing, SPLATT alone is built from
# the kit's sources with its splatt.mk (gcc and make; no CUDA, no cmake), as
# the kit's build.sh builds it.
#
# Environment (all optional):
#   THREADS=$(nproc)  RANK=32  ROUNDS=5  REPEAT=5  SPLATT_ITERS=5
#   KERNELS='auto csf sorted'          kruskal's columns
#   SPLATT_VARIANTS='two:none all:none'  CSF copies:tiling, as run.sh takes them
#   KIT_BUILD=/tmp/kit-build  KIT_WORK=/tmp/kit-run  OUT_DIR=bench-out/splatt
set -euo pipefail
K=${1:?the kruskal binary}
KIT=${2:?the kit folder (with run.sh and splatt.mk)}
shift 2
[ $# -gt 0 ] || { echo "usage: $0 KRUSKAL_BINARY KIT_DIR TENSOR.tns..." >&2; exit 2; }
THREADS=${THREADS:-$(nproc)}
RANK=${RANK:-32}
ROUNDS=${ROUNDS:-5}
REPEAT=${REPEAT:-5}
SPLATT_ITERS=${SPLATT_ITERS:-5}
KERNELS=${KERNELS:-auto csf sorted}
SPLATT_VARIANTS=${SPLATT_VARIANTS:-two:none all:none}
export KIT_BUILD=${KIT_BUILD:-/tmp/kit-build}
KIT_WORK=${KIT_WORK:-/tmp/kit-run}
OUT_DIR=${OUT_DIR:-bench-out/splatt}
mkdir -p "$OUT_DIR"

if [ ! -x "$KIT_BUILD/bin/splatt_f32_i64" ]; then
  echo "building SPLATT (f32, 64-bit indices) from $KIT into $KIT_BUILD" >&2
  mkdir -p "$KIT_BUILD/bin" "$KIT_BUILD/stub"
  gcc -O2 -c "$KIT/stub/blas_lapack_stub.c" -o "$KIT_BUILD/stub/blas_lapack_stub.o"
  ar rcs "$KIT_BUILD/stub/libkitblasstub.a" "$KIT_BUILD/stub/blas_lapack_stub.o"
  make -f "$KIT/splatt.mk" -j"$(nproc)" CC=gcc SRC="$KIT/src/splatt" \
    BUILD="$KIT_BUILD/splatt-f32-i64" IDX=64 VAL=32 \
    STUB="$KIT_BUILD/stub/libkitblasstub.a" > "$OUT_DIR/splatt-build.log" 2>&1
  cp "$KIT_BUILD/splatt-f32-i64/splatt" "$KIT_BUILD/bin/splatt_f32_i64"
fi

echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "date:    $(date -u +%Y-%m-%dT%H:%MZ)"
echo "threads $THREADS, rank $RANK, $ROUNDS rounds; SPLATT $SPLATT_VARIANTS (mean of iterations 2..$SPLATT_ITERS); kruskal median of $REPEAT sweeps"
for T in "$@"; do
  name=$(basename "$T" .tns)
  rows="$OUT_DIR/$name.rounds"
  : > "$rows"
  for round in $(seq 1 "$ROUNDS"); do
    # SPLATT first, then every kruskal kernel, back to back.
    work="$KIT_WORK/$name"
    SKIP_BLCO=1 THREADS="$THREADS" SPLATT_ITERS="$SPLATT_ITERS" \
      SPLATT_VARIANTS="$SPLATT_VARIANTS" KIT_WORK="$work" RUN_BUDGET=3000 \
      bash "$KIT/run.sh" "$T" "$RANK" > "$OUT_DIR/$name-$round-splatt.log" 2>&1 || true
    splatt=$(grep -h "allmodes_ms_mean" "$work/summary.txt" 2>/dev/null \
      | sed 's/.*allmodes_ms_mean=\([0-9.]*\).*/\1/' | sort -g | head -n1)
    [ -n "$splatt" ] || { echo "SPLATT gave no time on $T; see $OUT_DIR/$name-$round-splatt.log" >&2; exit 1; }
    line="$round $splatt"
    for kern in $KERNELS; do
      "$K" mttkrp "$T" --backend cpu --kernel "$kern" --rank "$RANK" --threads "$THREADS" \
        --repeat "$REPEAT" --json > "$OUT_DIR/$name-$round-$kern.json"
      ms=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['total_median_ms'])" \
        "$OUT_DIR/$name-$round-$kern.json")
      line="$line $ms"
    done
    echo "$line" >> "$rows"
  done
  python3 - "$name" "$rows" "$KERNELS" <<'PY'
import statistics, sys
name, rows, kernels = sys.argv[1], sys.argv[2], sys.argv[3].split()
data = [list(map(float, l.split()[1:])) for l in open(rows) if l.strip()]
splatt = [r[0] for r in data]
print(f"\n{name}: all-mode MTTKRP, ms per round (SPLATT best variant, then kruskal kernels)")
print("| round | SPLATT | " + " | ".join(f"kruskal {k}" for k in kernels) + " |")
print("| --- | --- | " + " | ".join("---" for _ in kernels) + " |")
for i, r in enumerate(data, 1):
    print(f"| {i} | " + " | ".join(f"{x:.1f}" for x in r) + " |")
med = [statistics.median(c) for c in zip(*data)]
print("| median | " + " | ".join(f"{x:.1f}" for x in med) + " |")
for j, k in enumerate(kernels, 1):
    ratios = [r[0] / r[j] for r in data]
    print(f"SPLATT / kruskal {k}: {med[0] / med[j]:.2f}x (ratio of medians; per round "
          f"{min(ratios):.2f}x to {max(ratios):.2f}x)")
PY
done
