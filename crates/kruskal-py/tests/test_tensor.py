"""SparseTensor in and out, reading files, mttkrp, and bad input."""

import gzip

import numpy as np
import pytest

import kruskal

from conftest import DATA


def parts(seed=0, shape=(6, 5, 4), nnz=30):
    rng = np.random.default_rng(seed)
    flat = rng.choice(int(np.prod(shape)), nnz, replace=False)
    subs = np.stack(np.unravel_index(np.sort(flat), shape), axis=1).astype(np.int64)
    vals = rng.integers(1, 41, size=nnz) / 4
    return subs, vals, shape


def test_numpy_in_numpy_out():
    subs, vals, shape = parts()
    X = kruskal.SparseTensor(subs, vals, shape)
    assert X.shape == shape and X.ndim == 3 and X.nnz == len(vals)
    assert X.indices.dtype == np.int64 and X.values.dtype == np.float32
    np.testing.assert_array_equal(X.indices, subs)
    np.testing.assert_array_equal(X.values, vals.astype(np.float32))
    assert X.norm() == pytest.approx(np.linalg.norm(vals))
    assert "nnz=30" in repr(X)


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64, np.uint64])
def test_any_integer_dtype_and_layout(dtype):
    subs, vals, shape = parts(1)
    X = kruskal.SparseTensor(np.asfortranarray(subs.astype(dtype)), vals.astype(np.float32),
                             list(shape))
    np.testing.assert_array_equal(X.indices, subs)
    # A (nnz, 1) column of values, as pyttb keeps them.
    Y = kruskal.SparseTensor(subs.T.copy().T, vals.reshape(-1, 1), shape)
    np.testing.assert_array_equal(Y.values, X.values)


def test_pyttb_round_trip():
    ttb = pytest.importorskip("pyttb")
    subs, vals, shape = parts(2)
    x = ttb.sptensor(subs, vals.reshape(-1, 1), shape)
    X = kruskal.SparseTensor.from_pyttb(x)
    np.testing.assert_array_equal(X.indices, subs)
    assert X.norm() == pytest.approx(x.norm())
    m = kruskal.cp_als(x, 2, iters=5, progress=False)
    k = m.to_pyttb()
    assert isinstance(k, ttb.ktensor)
    np.testing.assert_allclose(k.weights, m.weights)
    np.testing.assert_allclose(k.full().data, m.full(), atol=1e-5)
    # The fit pyttb computes for the returned model is the one reported.
    fit = 1 - np.linalg.norm(x.full().data - k.full().data) / x.norm()
    assert fit == pytest.approx(m.fit, abs=1e-5)


def test_tensorly_model():
    tl = pytest.importorskip("tensorly")
    subs, vals, shape = parts(3)
    m = kruskal.cp_als(kruskal.SparseTensor(subs, vals, shape), 2, iters=5, progress=False,
                       dtype=np.float64)
    assert all(f.dtype == np.float64 for f in m.factors)
    cp = m.to_tensorly()
    np.testing.assert_allclose(tl.cp_to_tensor(cp), m.full(), atol=1e-6)


def test_pydata_sparse_and_scipy():
    subs, vals, shape = parts(4)
    sparse = pytest.importorskip("sparse")
    coo = sparse.COO(subs.T, vals, shape=shape)
    X = kruskal.SparseTensor.from_sparse(coo)
    np.testing.assert_array_equal(X.indices, subs)
    scipy_sparse = pytest.importorskip("scipy.sparse")
    rng = np.random.default_rng(5)
    mat = scipy_sparse.random(7, 9, density=0.3, format="csr", random_state=rng)
    M = kruskal.SparseTensor.from_scipy(mat)
    assert M.shape == (7, 9) and M.nnz == mat.nnz
    dense = np.zeros((7, 9), dtype=np.float32)
    dense[tuple(M.indices.T)] = M.values
    np.testing.assert_allclose(dense, mat.toarray(), rtol=1e-6)
    # cp_als takes them directly.
    assert kruskal.cp_als(mat, 2, iters=3, progress=False).factors[1].shape == (9, 2)


def test_read_a_text_file(tmp_path):
    subs, vals, shape = parts(6)
    lines = "".join(f"{' '.join(str(i + 1) for i in s)} {v}\n" for s, v in zip(subs, vals))
    plain = tmp_path / "t.tns"
    plain.write_text(lines)
    packed = tmp_path / "t.tns.gz"
    packed.write_bytes(gzip.compress(lines.encode()))
    for path in (plain, str(packed)):
        X = kruskal.read(path, dims=shape)
        np.testing.assert_array_equal(X.indices, subs)
        np.testing.assert_array_equal(X.values, vals.astype(np.float32))


def test_reading_a_pattern_file_without_pattern_warns():
    path = DATA / "kg-jf17k-4mode-novalues.tns.gz"
    with pytest.warns(UserWarning, match="pattern"):
        X = kruskal.read(path)
    assert X.ndim == 3
    X = kruskal.read(path, pattern=True)
    assert X.ndim == 4 and X.nnz == 34_544


def test_repeated_lines_of_a_file_are_summed():
    plain = kruskal.read(DATA / "splatt-med.tns.gz")
    repeats = kruskal.read(DATA / "splatt-med-repeats.tns.gz")
    assert repeats.shape == plain.shape and repeats.nnz == plain.nnz == 100_000
    np.testing.assert_array_equal(repeats.indices, plain.indices)
    np.testing.assert_allclose(repeats.values, plain.values)


def test_mttkrp_matches_numpy():
    subs, vals, shape = parts(7)
    X = kruskal.SparseTensor(subs, vals, shape)
    rng = np.random.default_rng(8)
    factors = [rng.random((d, 3)) for d in shape]
    dense = np.zeros(shape)
    dense[tuple(subs.T)] = vals
    expected = [
        np.einsum("ijk,jr,kr->ir", dense, factors[1], factors[2]),
        np.einsum("ijk,ir,kr->jr", dense, factors[0], factors[2]),
        np.einsum("ijk,ir,jr->kr", dense, factors[0], factors[1]),
    ]
    for mode in range(3):
        out = kruskal.mttkrp(X, factors, mode, backend="cpu")
        assert out.dtype == np.float32 and out.shape == (shape[mode], 3)
        np.testing.assert_allclose(out, expected[mode], rtol=1e-5)


@pytest.mark.parametrize("indices, values, shape, match", [
    (np.array([[0.0, 1.0]]), [1.0], (2, 2), "integers"),
    (np.array([[0, 1, 2]]), [1.0], (2, 2), r"shape \(nnz, 2\)"),
    (np.array([[0, -1]]), [1.0], (2, 2), r"indices\[0, 1\] is -1, outside range\(2\)"),
    (np.array([[0, 2]]), [1.0], (2, 2), r"indices\[0, 1\] is 2, outside range\(2\)"),
    (np.array([[0, 1]]), [np.nan], (2, 2), r"values\[0\] is nan: values must be finite"),
    (np.array([[0, 1]]), [1 + 2j], (2, 2), "real numbers"),
    (np.array([[0, 1]]), ["a"], (2, 2), "real numbers"),
    (np.array([[0, 1], [1, 1]]), [1.0], (2, 2), "2 index rows but 1 values"),
    (np.array([[0, 1]]), [1.0], (2, 0), r"shape\[1\] is 0"),
    (np.array([[0, 1]]), [1.0], "ab", "shape"),
])
def test_bad_tensors_raise_value_error(indices, values, shape, match):
    with pytest.raises(ValueError, match=match):
        kruskal.SparseTensor(indices, values, shape)


def test_bad_arguments_raise_value_error():
    X = kruskal.SparseTensor(*parts(9))
    for kwargs, match in [
        (dict(rank=0), "rank"),
        (dict(rank=2, backend="tpu"), "unknown backend"),
        (dict(rank=2, kernel="bogus"), "unknown kernel"),
        (dict(rank=2, tol=-1.0), "tol"),
        (dict(rank=2, starts=0), "starts"),
        (dict(rank=2, init=[np.ones((6, 2))]), "init holds 1 matrices for a 3-mode tensor"),
        (dict(rank=2, init=[np.ones((6, 2)), np.ones((5, 2)), np.ones((3, 2))]), r"init\[2\] is 3 x 2, expected 4 x 2"),
        (dict(rank=3, init=[np.ones((6, 2)), np.ones((5, 2)), np.ones((4, 2))]), "rank 2"),
        (dict(rank=2, init="nvecs"), "init"),
        (dict(rank=2, init=[np.ones((d, 2)) for d in (6, 5, 4)], starts=2), "starts"),
        (dict(rank=2, gpus=0), "gpus"),
        (dict(rank=2, gpus="some"), "gpus"),
        (dict(rank=2, gpus=True), "gpus"),
        (dict(rank=2, init=[np.full((d, 2), np.nan) for d in (6, 5, 4)]), "not finite"),
        (dict(rank=2, dtype=np.int32), "dtype"),
    ]:
        with pytest.raises(ValueError, match=match):
            kruskal.cp_als(X, progress=False, **kwargs)
    with pytest.raises(ValueError, match=r"mode=3 is out of range for a 3-mode tensor"):
        kruskal.mttkrp(X, [np.ones((d, 2)) for d in X.shape], 3)
    with pytest.raises(ValueError, match="expected 5 x 2"):
        kruskal.mttkrp(X, [np.ones((6, 2)), np.ones((4, 2)), np.ones((4, 2))], 0)
    with pytest.raises(TypeError, match="kruskal.SparseTensor"):
        kruskal.cp_als(np.ones((3, 3)), 2)


def test_refused_input_leaks_nothing():
    """Refused calls give back what they took: 40 refusals of a 48 MB
    input (a bad index in its last row) would hold about 2 GB if each kept
    what it had converted; the process may grow by far less."""
    resource = pytest.importorskip("resource")
    nnz = 2_000_000
    indices = np.arange(3 * nnz, dtype=np.int64).reshape(nnz, 3) % 1000
    indices[-1, 0] = -1
    values = np.ones(nnz)

    def peak_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    # The first refusal sets the peak that later ones must not raise.
    with pytest.raises(ValueError, match=r"is -1, outside range"):
        kruskal.SparseTensor(indices, values, (1000, 1000, 1000))
    before = peak_mb()
    for _ in range(40):
        with pytest.raises(ValueError, match=r"is -1, outside range"):
            kruskal.SparseTensor(indices, values, (1000, 1000, 1000))
    X = kruskal.SparseTensor(*parts(3))
    bad = [np.full((d, 2), np.nan) for d in X.shape]
    for _ in range(40):
        with pytest.raises(ValueError, match="not finite"):
            kruskal.cp_als(X, 2, init=bad, progress=False)
    assert peak_mb() - before < 300, (before, peak_mb())


def test_files_raise_os_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.tns"):
        kruskal.read(tmp_path / "missing.tns")
    bad = tmp_path / "bad.tns"
    bad.write_text("1 2 x\n")
    with pytest.raises((ValueError, OSError), match="bad.tns"):
        kruskal.read(bad)


def test_devices_say_why_none():
    found = kruskal.devices()
    assert isinstance(found, list)
    if not found:
        assert found.reason
    else:
        assert found.reason is None and {"name", "sms", "free_bytes"} <= set(found[0])


@pytest.mark.skipif(bool(kruskal.devices()), reason="checks the error without a GPU")
def test_gpu_backend_without_a_gpu_raises_gpu_error():
    X = kruskal.SparseTensor(*parts(10))
    with pytest.raises(kruskal.GpuError, match="CUDA"):
        kruskal.cp_als(X, 2, backend="gpu", progress=False)
    with pytest.raises(kruskal.GpuError, match="CUDA"):
        kruskal.mttkrp(X, [np.ones((d, 2)) for d in X.shape], 0, backend="gpu")
    with pytest.raises(kruskal.GpuError, match="CUDA"):
        kruskal.cp_als(X, 2, gpus="all", progress=False)
    # auto falls back to the CPU and says why.
    m = kruskal.cp_als(X, 2, iters=2, progress=False)
    assert m.backend == "cpu" and "CUDA" in m.info["fallback"]
