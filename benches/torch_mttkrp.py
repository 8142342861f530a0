#!/usr/bin/env python3
"""MTTKRP in PyTorch, as a user would write it: the GPU baseline for kruskal.

For output mode d: gather the factor rows of every other mode for every
nonzero, multiply them with the values, and sum into the output rows with
`index_add_` (CUDA atomics, f32 sums unless --f64-sums):

    prod = vals[:, None] * A[w0][idx[w0]]          # nnz x R
    prod *= A[w1][idx[w1]] ...                     # every mode but d
    out = zeros(dims[d], R).index_add_(0, idx[d], prod)

It reads kruskal's binary tensor format (.ktns; make one with `kruskal gen
OUT.ktns --like nell-2 --nnz 20M` or `kruskal convert X.tns X.ktns`), draws
random f32 factors, runs one warm-up per mode, then times each mode
--repeat times with CUDA events and reports the median (and the minimum),
per mode and summed over modes, as `kruskal mttkrp` does. With --verify it
also computes every mode in f64 (same gathers, f64 products and sums) and
prints the relative Frobenius error of the f32 result against it.

    python3 benches/torch_mttkrp.py /tmp/nell2.ktns --rank 32 --repeat 10 --verify
    python3 benches/torch_mttkrp.py /tmp/nell2.ktns --modes 2 --json

`--parse-only` reads and checks the file and prints its shape and norm as
JSON; it needs only numpy (no torch), which is how the reader is tested
against `kruskal info --json`.
"""

import argparse
import json
import struct
import sys
import zlib

import numpy as np

MAGIC = b"KRUSKAL\0"
VERSIONS = (1, 2)
FLAG_DISTINCT = 1
FIXED_HEADER = 32


def align8(x):
    return (x + 7) // 8 * 8


class Ktns:
    """A .ktns tensor: dims, one uint32 index array per mode (0-based),
    float32 values."""

    def __init__(self, dims, indices, values):
        self.dims = dims
        self.indices = indices
        self.values = values

    @property
    def nnz(self):
        return len(self.values)

    @property
    def nmodes(self):
        return len(self.dims)


def read_ktns(path, check_payload=True):
    """Reads kruskal's binary format, versions 1 and 2 (layout in
    crates/kruskal-formats/src/binary.rs): a 32-byte fixed header (magic,
    version, M modes, N nonzeros, payload CRC-32, flags), M u32 dimensions
    padded to 8 bytes, the header CRC-32, then M index arrays and the
    values, each 4 N bytes padded to a multiple of 8. Little-endian
    throughout. The flags are 0 in version 1; in version 2 bit 0 says that
    no coordinate repeats. Without that claim repeated coordinates are
    summed (as kruskal does, in f64), so both tools get the same nonzeros.
    Raises ValueError naming the file on anything unexpected."""
    with open(path, "rb") as f:
        fixed = f.read(FIXED_HEADER)
        if len(fixed) < 8 or fixed[:8] != MAGIC:
            raise ValueError(f"{path}: not a kruskal binary tensor (bad magic); "
                             "convert text with `kruskal convert X.tns X.ktns`")
        if len(fixed) < FIXED_HEADER:
            raise ValueError(f"{path}: truncated header")
        version, nmodes, nnz, payload_crc, flags = struct.unpack_from("<IIQII", fixed, 8)
        if version not in VERSIONS:
            raise ValueError(f"{path}: format version {version}, this reads "
                             f"{VERSIONS[0]} to {VERSIONS[-1]}")
        known = FLAG_DISTINCT if version >= 2 else 0
        if flags & ~known:
            raise ValueError(f"{path}: unknown flags {flags:#x} in a version {version} header")
        if nmodes == 0:
            raise ValueError(f"{path}: the header says 0 modes")
        crc_offset = align8(FIXED_HEADER + 4 * nmodes)
        payload = crc_offset + 8
        stride = align8(4 * nnz)
        total = payload + (nmodes + 1) * stride
        f.seek(0)
        header = f.read(payload)
        f.seek(0, 2)
        size = f.tell()
        if len(header) < payload or size != total:
            raise ValueError(f"{path}: expected {total} bytes, file has {size}")
        (stored,) = struct.unpack_from("<I", header, crc_offset)
        if zlib.crc32(header[:crc_offset]) != stored:
            raise ValueError(f"{path}: header checksum mismatch")
        dims = list(struct.unpack_from(f"<{nmodes}I", header, FIXED_HEADER))
        if check_payload:
            crc = 0
            f.seek(payload)
            while True:
                chunk = f.read(1 << 26)
                if not chunk:
                    break
                crc = zlib.crc32(chunk, crc)
            if crc != payload_crc:
                raise ValueError(f"{path}: payload checksum mismatch")
    indices = [
        np.fromfile(path, dtype="<u4", count=nnz, offset=payload + m * stride)
        for m in range(nmodes)
    ]
    values = np.fromfile(path, dtype="<f4", count=nnz, offset=payload + nmodes * stride)
    for m, (idx, dim) in enumerate(zip(indices, dims)):
        if nnz and int(idx.max()) >= dim:
            raise ValueError(f"{path}: mode {m + 1} has index {int(idx.max())} >= {dim}")
    values = values.astype(np.float32, copy=False)
    if not flags & FLAG_DISTINCT:
        indices, values = sum_repeats(indices, values)
    return Ktns(dims, indices, values)


def sum_repeats(indices, values):
    """The nonzeros with each repeated coordinate once, its value the f64
    sum of its copies (rounded to f32), in coordinate order (mode 1 most
    significant); unchanged when no coordinate repeats."""
    if len(values) < 2:
        return indices, values
    order = np.lexsort(indices[::-1])
    sorted_idx = [i[order] for i in indices]
    starts = np.ones(len(values), dtype=bool)
    starts[1:] = np.logical_or.reduce([i[1:] != i[:-1] for i in sorted_idx])
    if starts.all():
        return indices, values
    first = np.flatnonzero(starts)
    sums = np.add.reduceat(values[order].astype(np.float64), first)
    return [i[first] for i in sorted_idx], sums.astype(np.float32)


def parse_modes(text, nmodes):
    if text == "all":
        return list(range(nmodes))
    try:
        m = int(text)
    except ValueError:
        m = 0
    if not 1 <= m <= nmodes:
        raise SystemExit(f"--modes must be 'all' or a mode from 1 to {nmodes}, not '{text}'")
    return [m - 1]


def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def run_torch(t, args):
    try:
        import torch
    except ImportError:
        raise SystemExit("torch_mttkrp: PyTorch is not installed for this python3 "
                         "(--parse-only needs only numpy)")

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("PyTorch sees no CUDA GPU (use --device cpu to test the script)")
    dev = torch.device(args.device)
    modes = parse_modes(args.modes, t.nmodes)
    rank = args.rank
    idx = [torch.from_numpy(i.astype(np.int64)).to(dev) for i in t.indices]
    vals = torch.from_numpy(t.values).to(dev)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    factors = [torch.rand((d, rank), generator=gen, device=dev, dtype=torch.float32)
               for d in t.dims]
    sum_dtype = torch.float64 if args.f64_sums else torch.float32

    def mttkrp(mode, factors, vals, dtype):
        prod = None
        for w in range(t.nmodes):
            if w == mode:
                continue
            rows = factors[w][idx[w]]
            prod = rows * vals[:, None] if prod is None else prod.mul_(rows)
        out = torch.zeros((t.dims[mode], rank), device=dev, dtype=dtype)
        out.index_add_(0, idx[mode], prod.to(dtype))
        return out

    def timed(mode):
        if dev.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = mttkrp(mode, factors, vals, sum_dtype)
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end)
        import time

        s = time.perf_counter()
        out = mttkrp(mode, factors, vals, sum_dtype)
        return out, (time.perf_counter() - s) * 1e3

    for mode in modes:  # warm-up: allocator, kernel loads
        timed(mode)
    times = {m: [] for m in modes}
    outs = {}
    for _ in range(args.repeat):
        for mode in modes:
            outs[mode], ms = timed(mode)
            times[mode].append(ms)

    rows = []
    for mode in modes:
        ms = median(times[mode])
        row = {
            "mode": mode + 1,
            "median_ms": ms,
            "min_ms": min(times[mode]),
            "mnnz_per_s": t.nnz / (ms * 1e-3) / 1e6,
            "relative_error": None,
        }
        if args.verify:
            f64 = [f.double() for f in factors]
            exact = mttkrp(mode, f64, vals.double(), torch.float64)
            diff = torch.linalg.vector_norm(outs[mode].double() - exact)
            norm = torch.linalg.vector_norm(exact)
            row["relative_error"] = float(diff / norm) if norm > 0 else float(diff)
            del exact, f64
        rows.append(row)
    total = sum(r["median_ms"] for r in rows)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {
        "tensor": {"path": args.tensor, "dims": t.dims, "nnz": t.nnz},
        "backend": "torch", "device": name, "torch": torch.__version__,
        "sums": "f64" if args.f64_sums else "f32",
        "rank": rank, "repeat": args.repeat, "modes": rows,
        "total_median_ms": total,
        "mnnz_per_s": t.nnz * len(rows) / (total * 1e-3) / 1e6,
    }


def print_table(r):
    t = r["tensor"]
    print(f"tensor   {t['path']}")
    print(f"         {' x '.join(f'{d:,}' for d in t['dims'])}, {t['nnz']:,} nonzeros; "
          f"rank {r['rank']}; torch {r['torch']} on {r['device']}, {r['sums']} sums "
          f"(index_add_); median of {r['repeat']}")
    verify = any(m["relative_error"] is not None for m in r["modes"])
    print(f"{'mode':>6} {'median ms':>11} {'min ms':>11} {'Mnnz/s':>14}"
          + ("   rel. error" if verify else ""))
    for m in r["modes"]:
        err = f"   {m['relative_error']:.2e}" if m["relative_error"] is not None else ""
        print(f"{m['mode']:>6} {m['median_ms']:>11.3f} {m['min_ms']:>11.3f} "
              f"{m['mnnz_per_s']:>14.1f}{err}")
    if len(r["modes"]) > 1:
        print(f"{'all':>6} {r['total_median_ms']:>11.3f} {'':>11} {r['mnnz_per_s']:>14.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tensor", help="a kruskal binary tensor (.ktns)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--repeat", type=int, default=10, help="timed runs per mode (median)")
    p.add_argument("--modes", default="all", help="'all' or one mode numbered from 1")
    p.add_argument("--verify", action="store_true",
                   help="relative error of each mode against an f64 computation")
    p.add_argument("--f64-sums", action="store_true",
                   help="accumulate in f64 (index_add_ into an f64 output)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu to test the script")
    p.add_argument("--no-checksum", action="store_true",
                   help="skip the payload CRC check (the header is always checked)")
    p.add_argument("--parse-only", action="store_true",
                   help="read the file, print its shape and norm as JSON (numpy only)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.rank < 1 or args.repeat < 1:
        raise SystemExit("--rank and --repeat must be at least 1")
    try:
        t = read_ktns(args.tensor, check_payload=not args.no_checksum)
    except (OSError, ValueError) as e:
        raise SystemExit(f"torch_mttkrp: {e}")
    if args.parse_only:
        v = t.values.astype(np.float64)
        print(json.dumps({
            "dims": t.dims, "nnz": t.nnz, "norm": float(np.sqrt(np.dot(v, v))),
            "index_sums": [int(i.astype(np.int64).sum()) for i in t.indices],
        }))
        return 0
    report = run_torch(t, args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
