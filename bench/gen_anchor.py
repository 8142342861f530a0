# Copied on 2026-11-24 from the project's shared bench folder (shared/bench/gen_anchor.py),
# unchanged below this note, so the anchor tensors can be made on a machine without it.
# The anchor tensors (same law as anchors/2026-11-22-h100.md): per mode index = perm[r],
# r bounded Zipf(1.1) over 1..dim, numpy default_rng(7), 20M nonzeros WITH duplicates,
# values U[0,1) f32. Written straight to kruskal's .ktns v1 layout.
# usage: gen_anchor.py t3|t4 OUT.ktns [NNZ] [--dedup]
import sys, zlib, struct
import numpy as np
shapes = {"t3": [12092, 9184, 28818], "t4": [6066, 5699, 244268, 1176]}
name, out = sys.argv[1], sys.argv[2]
nnz = int(sys.argv[3]) if len(sys.argv) > 3 and not sys.argv[3].startswith("--") else 20_000_000
dims = shapes[name]
rng = np.random.default_rng(7)
cols = []
for d in dims:
    perm = rng.permutation(d)
    w = np.arange(1, d + 1, dtype=np.float64) ** -1.1
    cdf = np.cumsum(w) / w.sum()
    r = np.minimum(np.searchsorted(cdf, rng.random(nnz), side="right"), d - 1)
    cols.append(perm[r].astype(np.uint32))
vals = rng.random(nnz, dtype=np.float32)
if "--dedup" in sys.argv:
    key = np.stack(cols, axis=1)
    _, first = np.unique(key, axis=0, return_index=True)
    first.sort()
    cols = [c[first] for c in cols]; vals = vals[first]; nnz = len(vals)
M = len(dims)
stride = (4 * nnz + 7) // 8 * 8
pad = b"\0" * (stride - 4 * nnz)
crc = 0
for a in cols + [vals]:
    crc = zlib.crc32(a.astype("<u4" if a.dtype == np.uint32 else "<f4").tobytes(), crc)
    crc = zlib.crc32(pad, crc)
hdr = b"KRUSKAL\0" + struct.pack("<IIQII", 1, M, nnz, crc, 0) + struct.pack(f"<{M}I", *dims)
hdr += b"\0" * ((len(hdr) + 7) // 8 * 8 - len(hdr))
hdr += struct.pack("<II", zlib.crc32(hdr), 0)
with open(out, "wb") as f:
    f.write(hdr)
    for a in cols + [vals]:
        f.write(a.tobytes()); f.write(pad)
print(out, dims, nnz, "hottest share", [float(np.bincount(c).max() / nnz) for c in cols])
