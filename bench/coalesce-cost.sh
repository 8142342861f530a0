#!/usr/bin/env bash
# What summing repeated coordinates costs at load: `kruskal info --json`
# reports the load time and the part spent on repeated coordinates
# (coalesce_s) for text and .ktns files of 20M and 100M nonzeros, in
# coordinate order (as kruskal and FROSTT write them) and shuffled (the
# sort path), and a version 1 .ktns (no flag: the order check). Prints a
# Markdown table.
#
#   bash bench/coalesce-cost.sh [KRUSKAL_BINARY] [SCRATCH_DIR]
#
# Needs python3, shuf, and about 12 GB in SCRATCH_DIR.
set -euo pipefail
K=${1:-kruskal}
D=${2:-/tmp}
# Copies .ktns file $1 to $2 with a version 1 header (flags 0) over the same
# payload: the reader must then look for repeats itself.
as_version_1() {
  python3 - "$1" "$2" <<'PY'
import sys, zlib
src, dst = sys.argv[1:]
b = bytearray(open(src, "rb").read())
m = int.from_bytes(b[12:16], "little")
d = (32 + 4 * m + 7) // 8 * 8
b[8:12] = (1).to_bytes(4, "little")
b[28:32] = (0).to_bytes(4, "little")
b[d:d + 4] = zlib.crc32(bytes(b[:d])).to_bytes(4, "little")
open(dst, "wb").write(b)
PY
}
for t in nell-2:20M nell-1:100M; do
  name=${t%%:*}; nnz=${t##*:}; base=$D/co-$name-$nnz
  "$K" gen --like "$name" --nnz "$nnz" "$base.tns" > /dev/null
  "$K" convert "$base.tns" "$base.ktns" > /dev/null
  as_version_1 "$base.ktns" "$base-v1.ktns"
  { grep -v '^#' "$base.tns" | shuf --random-source=<(yes); } > "$base-shuffled.tns"
  "$K" convert "$base-shuffled.tns" "$base-shuffled.ktns" > /dev/null
  as_version_1 "$base-shuffled.ktns" "$base-shuffled-v1.ktns"
  rm -f "$base-shuffled.ktns"
done
echo "| file | nonzeros | load s | of it on repeated coordinates, s | share |"
echo "| --- | --- | --- | --- | --- |"
for t in nell-2:20M nell-1:100M; do
  name=${t%%:*}; nnz=${t##*:}; base=$D/co-$name-$nnz
  for f in "$base.tns" "$base-shuffled.tns" "$base.ktns" "$base-v1.ktns" "$base-shuffled-v1.ktns"; do
    "$K" info "$f" --json 2>/dev/null | python3 -c '
import json, sys
r = json.load(sys.stdin); f = sys.argv[1].rsplit("/", 1)[-1]
print(f"| {f} | {r[\"nnz\"]:,} | {r[\"load_s\"]:.2f} | {r[\"coalesce_s\"]:.3f} | {100 * r[\"coalesce_s\"] / r[\"load_s\"]:.0f}% |")' "$f"
  done
done
