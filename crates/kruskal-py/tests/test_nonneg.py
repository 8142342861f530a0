"""kruskal.cp_als with nonneg, l1 and l2 (constrained CP by AO-ADMM)
against TensorLy's non-negative HALS from the same start, and its
arguments."""

import numpy as np
import pytest

import kruskal
from conftest import DATA, random_sparse, read_tns


def dense_of(subs, vals, shape):
    dense = np.zeros(shape)
    np.add.at(dense, tuple(np.asarray(subs).T), np.asarray(vals, dtype=np.float32))
    return dense


def fit_of(dense, weights, factors):
    model = np.einsum("r," + ",".join(f"{c}r" for c in "ijkl"[: len(factors)])
                      + "->" + "ijkl"[: len(factors)], weights, *factors)
    return 1 - np.linalg.norm(dense - model) / np.linalg.norm(dense)


def tensors():
    """Small tensors whose dense form TensorLy can take: the repository's
    small real ones and generated ones."""
    return [
        ("splatt-small.tns", *read_tns(DATA / "splatt-small.tns")),
        ("splatt-small4.tns", *read_tns(DATA / "splatt-small4.tns")),
        ("random-3mode", *random_sparse((20, 15, 12), 400, seed=6)),
        ("random-4mode", *random_sparse((9, 8, 7, 6), 300, seed=7)),
    ]


@pytest.mark.parametrize("case", tensors(), ids=lambda t: t[0])
def test_nonneg_fit_matches_or_beats_tensorly_hals(case):
    tl = pytest.importorskip("tensorly")
    from tensorly.decomposition import non_negative_parafac_hals

    _, subs, vals, shape = case
    rank = 2 if min(shape) <= 3 else 4
    X = kruskal.SparseTensor(subs, vals, shape)
    rng = np.random.default_rng(3)
    init = [rng.random((d, rank)).astype(np.float32) for d in shape]
    m = kruskal.cp_als(X, rank, init=init, nonneg=True, iters=500, tol=1e-9,
                       backend="cpu", progress=False, dtype=np.float64)
    assert all((f >= 0).all() for f in m.factors)
    dense = dense_of(subs, vals, shape)
    ours = fit_of(dense, m.weights, m.factors)
    # The model's own fit is the one it reports.
    assert abs(ours - m.fit) < 1e-5, (ours, m.fit)
    start = tl.cp_tensor.CPTensor((np.ones(rank), [f.astype(np.float64) for f in init]))
    cp = non_negative_parafac_hals(tl.tensor(dense), rank, n_iter_max=500, init=start,
                                   tol=1e-9)
    theirs = fit_of(dense, np.asarray(cp.weights), [np.asarray(f) for f in cp.factors])
    print(f"{case[0]}: kruskal {ours:.6f}, TensorLy HALS {theirs:.6f}")
    assert ours >= theirs - 1e-3, (ours, theirs)


def test_listed_modes_only_are_non_negative_and_l1_zeroes_entries():
    subs, vals, shape = random_sparse((20, 15, 12), 400, seed=8)
    # Signed values, so that unconstrained factors go negative.
    vals = np.where(np.arange(len(vals)) % 3 == 0, -vals, vals)
    X = kruskal.SparseTensor(subs, vals, shape)
    init = [np.random.default_rng(1).random((d, 4)).astype(np.float32) for d in shape]
    free = kruskal.cp_als(X, 4, init=init, iters=30, backend="cpu", progress=False)
    assert any((f < 0).any() for f in free.factors)
    some = kruskal.cp_als(X, 4, init=init, nonneg=[0, 2], iters=30, backend="cpu",
                          progress=False)
    assert (some.factors[0] >= 0).all() and (some.factors[2] >= 0).all()
    assert (some.factors[1] < 0).any()
    plain = kruskal.cp_als(X, 4, init=init, nonneg=True, iters=30, backend="cpu",
                           progress=False)
    sparse = kruskal.cp_als(X, 4, init=init, nonneg=True, l1=5.0, iters=30, backend="cpu",
                            progress=False)
    zeros = lambda m: sum(int((f == 0).sum()) for f in m.factors)  # noqa: E731
    assert zeros(sparse) > zeros(plain)


@pytest.mark.parametrize("kwargs, words", [
    ({"nonneg": [3]}, "nonneg names mode 3; the tensor's modes are 0 to 2"),
    ({"nonneg": []}, "nonneg lists no mode"),
    ({"nonneg": "yes"}, "nonneg lists modes as integers"),
    ({"nonneg": 1.5}, "nonneg must be True, False or a list of modes"),
    ({"l1": -1.0}, "l1 must be a finite number >= 0"),
    ({"l2": float("nan")}, "l2 must be a finite number >= 0"),
])
def test_bad_constraints_are_refused_in_python_words(kwargs, words):
    X = kruskal.SparseTensor(*random_sparse((5, 4, 3), 20, seed=1))
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        kruskal.cp_als(X, 2, progress=False, **kwargs)


@pytest.mark.skipif(bool(kruskal.devices()), reason="checks the error without a GPU")
def test_constrained_runs_on_a_group_need_the_gpus():
    # A group of GPUs runs AO-ADMM (each GPU its own rows); without GPUs
    # the error is the GPUs', not a refusal of the constraints.
    X = kruskal.SparseTensor(*random_sparse((5, 4, 3), 20, seed=1))
    with pytest.raises(kruskal.GpuError, match="CUDA"):
        kruskal.cp_als(X, 2, nonneg=True, gpus=2, progress=False)


@pytest.mark.skipif(bool(kruskal.devices()), reason="checks the error without a GPU")
def test_constrained_runs_on_the_gpu_need_one():
    X = kruskal.SparseTensor(*random_sparse((5, 4, 3), 20, seed=1))
    with pytest.raises(kruskal.GpuError, match="CUDA"):
        kruskal.cp_als(X, 2, nonneg=True, backend="gpu", progress=False)


@pytest.mark.skipif(not kruskal.devices(), reason="needs a GPU")
def test_constrained_runs_on_the_gpu():
    X = kruskal.SparseTensor(*random_sparse((30, 20, 10), 600, seed=3))
    model = kruskal.cp_als(X, 3, nonneg=True, backend="gpu", iters=20, tol=0, progress=False)
    assert all((f >= 0).all() for f in model.factors)
    assert np.isfinite(model.fit)
