"""Shared tensors for the tests: small, made here from a seed, with values
that float32 holds exactly (so kruskal, which stores float32, and pyttb
and TensorLy, which work in float64, decompose the same numbers)."""

from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "data"


def random_sparse(shape, nnz, seed, repeats=0):
    """Coordinates and values of a random sparse tensor; `repeats` of the
    coordinates appear a second time (with their own value)."""
    rng = np.random.default_rng(seed)
    coords = {tuple(int(rng.integers(d)) for d in shape) for _ in range(nnz)}
    subs = np.array(sorted(coords), dtype=np.int64)
    if repeats:
        subs = np.concatenate([subs, subs[rng.choice(len(subs), repeats, replace=False)]])
    # Quarters from 0.25 to 10: exact in float32.
    vals = rng.integers(1, 41, size=len(subs)).astype(np.float64) / 4
    return subs, vals, tuple(shape)


def read_tns(path):
    """A FROSTT text file (1-based, optional .gz) as subs, vals, shape."""
    data = np.loadtxt(path, comments="#", ndmin=2)
    subs = data[:, :-1].astype(np.int64) - 1
    vals = data[:, -1]
    return subs, vals, tuple(int(s) + 1 for s in subs.max(axis=0))


def small_tensors():
    """(name, subs, vals, shape): generated ones and the repository's
    small real ones."""
    out = [
        ("random-3mode", *random_sparse((30, 25, 20), 600, seed=3)),
        ("random-4mode", *random_sparse((12, 10, 9, 8), 500, seed=4)),
        ("repeated-coordinates", *random_sparse((20, 18, 15), 400, seed=5, repeats=80)),
    ]
    # The repository's real tensors (the second with repeated coordinates:
    # 3,010 of its nonzeros are split over several lines). A missing file
    # fails, as data/README.md says of every test.
    for name in ("splatt-small.tns", "splatt-med-repeats.tns.gz"):
        out.append((name, *read_tns(DATA / name)))
    return out


@pytest.fixture(params=small_tensors(), ids=lambda t: t[0])
def small(request):
    return request.param[1:]
