"""The PyTorch baseline's .ktns reader (benches/torch_mttkrp.py) against
kruskal's own: both versions of the format, repeated coordinates summed
where the file does not claim them distinct, so the baseline and kruskal
get the same nonzeros."""

import importlib.util
import struct
import zlib

import numpy as np
import pytest

import kruskal
from conftest import REPO, random_sparse

SCRIPT = REPO / "benches" / "torch_mttkrp.py"


def load_script():
    spec = importlib.util.spec_from_file_location("torch_mttkrp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def align8(x):
    return (x + 7) // 8 * 8


def ktns_bytes(dims, subs, vals, version, flags):
    """A .ktns file as crates/kruskal-formats/src/binary.rs lays it out."""
    nmodes, nnz = len(dims), len(vals)
    stride = align8(4 * nnz)

    def padded(array):
        raw = array.tobytes()
        return raw + b"\0" * (stride - len(raw))

    payload = b"".join(padded(subs[:, m].astype("<u4")) for m in range(nmodes))
    payload += padded(np.asarray(vals, dtype="<f4"))
    fixed = b"KRUSKAL\0" + struct.pack("<IIQII", version, nmodes, nnz,
                                       zlib.crc32(payload), flags)
    head = fixed + struct.pack(f"<{nmodes}I", *dims)
    head += b"\0" * (align8(len(head)) - len(head))
    head += struct.pack("<I", zlib.crc32(head)) + b"\0" * 4
    return head + payload


def by_coordinate(indices, values):
    """Nonzeros as a dict from coordinate to value."""
    return {tuple(int(i) for i in row): float(v) for row, v in zip(indices, values)}


CASES = [
    # (version, flags, repeats): version 1 never claims distinct coordinates.
    (1, 0, 40),
    (1, 0, 0),
    (2, 0, 40),
    (2, 1, 0),
]


@pytest.mark.parametrize("version,flags,repeats", CASES)
def test_the_baseline_reads_what_kruskal_reads(tmp_path, version, flags, repeats):
    subs, vals, dims = random_sparse((15, 12, 9), 300, seed=version + repeats, repeats=repeats)
    if not flags:
        # Out of order, as a file of another writer may be.
        order = np.random.default_rng(7).permutation(len(vals))
        subs, vals = subs[order], vals[order]
    path = tmp_path / "t.ktns"
    path.write_bytes(ktns_bytes(dims, subs, vals, version, flags))

    ours = kruskal.read(path)
    theirs = load_script().read_ktns(str(path))
    assert theirs.dims == list(ours.shape)
    assert theirs.nnz == ours.nnz == len(vals) - repeats
    got = by_coordinate(np.stack(theirs.indices, axis=1), theirs.values)
    want = by_coordinate(ours.indices, ours.values)
    assert got == want
    assert float(np.linalg.norm(theirs.values.astype(np.float64))) == pytest.approx(
        ours.norm(), rel=1e-12)


def test_unknown_flags_are_refused_by_both(tmp_path):
    subs, vals, dims = random_sparse((5, 4, 3), 10, seed=1)
    path = tmp_path / "t.ktns"
    path.write_bytes(ktns_bytes(dims, subs, vals, 2, 6))
    with pytest.raises(ValueError, match="unknown flags"):
        load_script().read_ktns(str(path))
    with pytest.raises((OSError, ValueError), match="unknown flags"):
        kruskal.read(path)
