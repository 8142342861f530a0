# Copied on 2026-11-26 from the project's shared bench folder (shared/bench/gen_anchor.py),
# unchanged below this note, so the anchor tensors can be made on a machine without it.
# The anchor tensors (same law as anchors/2026-11-22-h100.md): per mode index = perm[r],
# r bounded Zipf(1.1) over 1..dim, numpy default_rng(7), 20M nonzeros WITH duplicates,
# values U[0,1) f32. Written straight to kruskal's .ktns v1 layout.
# usage: gen_anchor.py t3|t4 OUT.ktns [NNZ] [--dedup | --distinct]
# --dedup keeps the first of each coordinate of the NNZ draws (fewer nonzeros);
# --distinct draws on (same law) until NNZ distinct coordinates exist and keeps the first NNZ.
import sys, zlib, struct
import numpy as np
shapes = {"t3": [12092, 9184, 28818], "t4": [6066, 5699, 244268, 1176]}
name, out = sys.argv[1], sys.argv[2]
nnz = int(sys.argv[3]) if len(sys.argv) > 3 and not sys.argv[3].startswith("--") else 20_000_000
dims = shapes[name]
rng = np.random.default_rng(7)
perms = [rng.permutation(d) for d in dims]
cdfs = []
for d in dims:
    w = np.arange(1, d + 1, dtype=np.float64) ** -1.1
    cdfs.append(np.cumsum(w) / w.sum())
def draw(n):
    return [perms[m][np.minimum(np.searchsorted(cdfs[m], rng.random(n), side="right"), dims[m] - 1)].astype(np.uint32)
            for m in range(len(dims))]
def keys(cols):
    k = np.zeros(len(cols[0]), dtype=np.int64)
    for c, d in zip(cols, dims):
        k = k * d + c.astype(np.int64)
    return k
cols = draw(nnz)
if "--distinct" in sys.argv:
    target = nnz
    while True:
        k = keys(cols)
        _, first = np.unique(k, return_index=True)
        if len(first) >= target:
            first.sort(); first = first[:target]
            cols = [c[first] for c in cols]
            break
        more = draw(max(target - len(first), 1) * 2)
        first.sort()
        cols = [np.concatenate([c[first], m]) for c, m in zip(cols, more)]
    nnz = target
vals = rng.random(nnz, dtype=np.float32)
if "--dedup" in sys.argv:
    _, first = np.unique(keys(cols), return_index=True)
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
