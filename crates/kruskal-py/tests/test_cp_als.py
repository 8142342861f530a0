"""kruskal.cp_als against pyttb and TensorLy, and its options."""

import contextlib
import io
import os
import signal
import threading
import time

import numpy as np
import pytest

import kruskal

pyttb = pytest.importorskip("pyttb")


def pyttb_tensor(subs, vals, shape):
    """The tensor as pyttb sees it: values rounded to float32 (what kruskal
    stores), repeated coordinates summed by pyttb itself."""
    vals32 = np.asarray(vals, dtype=np.float32).astype(np.float64).reshape(-1, 1)
    return pyttb.sptensor.from_aggregator(np.asarray(subs), vals32, shape)


def pyttb_fits(x, factors, iters):
    """pyttb's fit after each of `iters` iterations (pyttb returns only the
    final fit, so iteration k comes from a run of k iterations)."""
    fits = []
    for k in range(1, iters + 1):
        init = pyttb.ktensor([f.astype(np.float64) for f in factors])
        with contextlib.redirect_stdout(io.StringIO()):
            _, _, out = pyttb.cp_als(x, factors[0].shape[1], stoptol=0.0, maxiters=k,
                                     init=init, printitn=0)
        fits.append(float(out["fit"]))
    return np.array(fits)


def initial(shape, rank, seed=11):
    rng = np.random.default_rng(seed)
    return [rng.random((d, rank)).astype(np.float32) for d in shape]


def test_same_fits_as_pyttb_every_iteration(small):
    subs, vals, shape = small
    # A rank below the smallest dimension: at a rank that fits the tensor
    # exactly, the fit is 1 - sqrt(a difference of nearly equal norms), and
    # the square root magnifies kruskal's float32 rounding of the factors
    # (1e-7) to 3e-4 against pyttb's float64.
    rank, iters = min(4, min(shape)), 12
    factors = initial(shape, rank)
    X = kruskal.SparseTensor(subs, vals, shape)
    theirs = pyttb_fits(pyttb_tensor(subs, vals, shape), factors, iters)
    fits = {}
    # The default (auto: csf from three modes, sorted on two) and the
    # engines themselves.
    for kernel in ("auto", "sorted", "csf"):
        m = kruskal.cp_als(X, rank, init=factors, iters=iters, tol=0, backend="cpu",
                           kernel=kernel, progress=False)
        assert len(m.fits) == iters
        np.testing.assert_allclose(m.fits, theirs, rtol=0, atol=1e-6, err_msg=kernel)
        # Relative too: the fits of the sparsest tensors are small.
        np.testing.assert_allclose(m.fits, theirs, rtol=1e-5, err_msg=kernel)
        fits[kernel] = np.array(m.fits)
    # The engines agree with each other far closer than with pyttb's float64.
    np.testing.assert_allclose(fits["csf"], fits["sorted"], rtol=0, atol=1e-7)


def test_repeated_coordinates_are_summed_as_pyttb_does():
    subs = np.array([[0, 1, 2], [1, 0, 0], [0, 1, 2], [0, 1, 2]])
    vals = np.array([1.0, 2.0, 0.5, 0.25])
    X = kruskal.SparseTensor(subs, vals, (2, 2, 3))
    assert X.nnz == 2
    np.testing.assert_array_equal(X.indices, [[0, 1, 2], [1, 0, 0]])
    np.testing.assert_array_equal(X.values, [1.75, 2.0])
    theirs = pyttb_tensor(subs, vals, (2, 2, 3))
    assert X.norm() == pytest.approx(theirs.norm(), rel=1e-7)


@pytest.mark.parametrize("value", [3.4e38, 1e30, 1e-23, 1e-40])
def test_values_at_the_ends_of_float32_give_a_finite_model(value):
    # Run at a power-of-two scale and scaled back: never NaN weights
    # reported as a perfect fit.
    X = kruskal.SparseTensor(np.array([[0, 0, 0], [1, 1, 1]]), np.array([value, value]),
                             (2, 2, 2))
    m = kruskal.cp_als(X, 2, iters=30, tol=0, backend="cpu", progress=False)
    assert np.all(np.isfinite(m.weights))
    assert all(np.all(np.isfinite(f)) for f in m.factors)
    assert m.fit > 0.999  # (some starts are slow: 0.9997 after 30 iterations)
    np.testing.assert_allclose(m.weights, float(np.float32(value)), rtol=1e-3)


def test_same_fits_as_tensorly_on_a_dense_tensor_stored_sparse():
    tl = pytest.importorskip("tensorly")
    from tensorly.decomposition import parafac

    rng = np.random.default_rng(8)
    shape, rank, iters = (8, 7, 6), 3, 15
    dense = (rng.integers(1, 41, size=shape) / 4).astype(np.float64)
    subs = np.argwhere(dense != 0)
    X = kruskal.SparseTensor(subs, dense[tuple(subs.T)], shape)
    assert X.nnz == dense.size
    factors = initial(shape, rank, seed=9)
    m = kruskal.cp_als(X, rank, init=factors, iters=iters, tol=0, backend="cpu",
                       progress=False)
    init = tl.cp_tensor.CPTensor((np.ones(rank), [f.astype(np.float64) for f in factors]))
    _, errors = parafac(tl.tensor(dense), rank, n_iter_max=iters, init=init, tol=0,
                        return_errors=True)
    theirs = 1 - np.array([float(e) for e in errors])
    n = min(len(theirs), iters)
    assert n >= iters - 1
    np.testing.assert_allclose(m.fits[:n], theirs[:n], rtol=0, atol=1e-4)


def test_same_seed_same_model_and_the_model_reconstructs():
    subs, vals, shape = [
        np.array([[i, j, k] for i in range(4) for j in range(3) for k in range(5)]),
        None, (4, 3, 5)]
    rng = np.random.default_rng(1)
    a, b, c = rng.random(4), rng.random(3), rng.random(5)
    dense = np.einsum("i,j,k->ijk", a, b, c)
    X = kruskal.SparseTensor(subs, dense[tuple(subs.T)], shape)
    m1 = kruskal.cp_als(X, 1, iters=100, tol=1e-10, progress=False)
    m2 = kruskal.cp_als(X, 1, iters=100, tol=1e-10, progress=False)
    np.testing.assert_array_equal(m1.fits, m2.fits)
    assert m1.fit > 0.999
    np.testing.assert_allclose(m1.full(), dense, atol=1e-4)


def test_callback_hears_every_iteration_and_stops_the_run():
    subs, vals, shape = kruskal_tensor_parts()
    X = kruskal.SparseTensor(subs, vals, shape)
    heard = []

    def stop_at_three(iteration, fit):
        heard.append((iteration, fit))
        return iteration < 3

    m = kruskal.cp_als(X, 3, iters=20, tol=0, callback=stop_at_three, progress=False)
    assert [i for i, _ in heard] == [1, 2, 3]
    assert m.interrupted and not m.converged
    np.testing.assert_array_equal(m.fits, [f for _, f in heard])


def test_an_exception_in_the_callback_propagates():
    subs, vals, shape = kruskal_tensor_parts()
    X = kruskal.SparseTensor(subs, vals, shape)

    def fail(iteration, fit):
        raise RuntimeError("from the callback")

    with pytest.raises(RuntimeError, match="from the callback"):
        kruskal.cp_als(X, 3, iters=5, callback=fail, progress=False)


@pytest.mark.skipif(os.name != "posix", reason="sends SIGINT to this process")
def test_ctrl_c_raises_keyboard_interrupt_after_the_current_iteration():
    subs, vals, shape = random_parts((300, 300, 300), 150_000, seed=2)
    X = kruskal.SparseTensor(subs, vals, shape)
    iteration_s = []
    kruskal.cp_als(X, 16, iters=6, tol=0, progress=False,
                   callback=lambda i, f: iteration_s.append(time.perf_counter()) or True)
    # The shortest of five iterations: one slowed by a busy machine would
    # set the timer late enough for the run below to end before it.
    one = min(b - a for a, b in zip(iteration_s, iteration_s[1:]))
    timer = threading.Timer(5 * one, lambda: os.kill(os.getpid(), signal.SIGINT))
    start = time.perf_counter()
    timer.start()
    # No Python callback at all: the signal is heard on the way between
    # iterations, with the GIL briefly taken back. The run is far longer
    # than the timer (the assertion below bounds the time if it were not
    # heard).
    with pytest.raises(KeyboardInterrupt):
        kruskal.cp_als(X, 16, iters=100_000, tol=0, progress=False)
    elapsed = time.perf_counter() - start
    timer.join()
    # Stopped within about one iteration of the signal, not at the limit.
    assert elapsed < 5 * one + 3 * one + 2.0
    assert threading.active_count() == 1


def test_starts_keep_the_best_fit():
    subs, vals, shape = kruskal_tensor_parts()
    X = kruskal.SparseTensor(subs, vals, shape)
    m = kruskal.cp_als(X, 3, iters=8, starts=3, seed=5, progress=False)
    starts = m.info["starts"]
    assert [s["seed"] for s in starts] == [5, 6, 7]
    assert m.fit == max(s["fit"] for s in starts)
    # The preparation's parts, as `kruskal cpd --json` gives them: disjoint
    # spans of it (`auto` may have spent some of it trying the GPU); on the
    # CPU no GPU layout was built.
    parts = m.info["prepare"]
    assert sorted(parts) == ["build_s", "choose_s", "open_s"]
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) <= m.info["prepare_s"] + 1e-9
    if m.backend == "cpu":
        assert m.info["layout_steps"] == []


def test_progress_bar_runs_with_and_without_tqdm(capsys):
    subs, vals, shape = kruskal_tensor_parts()
    X = kruskal.SparseTensor(subs, vals, shape)
    m = kruskal.cp_als(X, 2, iters=3, tol=0, progress=True)
    assert len(m.fits) == 3


def random_parts(shape, nnz, seed):
    rng = np.random.default_rng(seed)
    subs = np.stack([rng.integers(d, size=nnz) for d in shape], axis=1)
    vals = rng.integers(1, 41, size=nnz) / 4
    return subs, vals, shape


def kruskal_tensor_parts():
    return random_parts((25, 20, 15), 800, seed=7)


def gpu_reason():
    found = kruskal.devices()
    return None if found else f"no usable GPU: {found.reason}"


@pytest.mark.skipif(gpu_reason() is not None, reason=str(gpu_reason()))
def test_gpu_gives_the_cpu_fits():
    subs, vals, shape = random_parts((200, 150, 100), 20_000, seed=4)
    X = kruskal.SparseTensor(subs, vals, shape)
    factors = initial(shape, 8)
    cpu = kruskal.cp_als(X, 8, init=factors, iters=10, tol=0, backend="cpu", progress=False)
    gpu = kruskal.cp_als(X, 8, init=factors, iters=10, tol=0, backend="gpu", progress=False)
    assert gpu.backend == "gpu"
    np.testing.assert_allclose(gpu.fits, cpu.fits, atol=1e-4)
    if len(kruskal.devices()) >= 2:
        two = kruskal.cp_als(X, 8, init=factors, iters=10, tol=0, gpus=2, progress=False)
        assert two.backend == "gpus"
        np.testing.assert_allclose(two.fits, cpu.fits, atol=1e-4)
    # A tensor this small stays on one GPU under gpus="all", and says why.
    every = kruskal.cp_als(X, 8, init=factors, iters=10, tol=0, gpus="all", progress=False)
    assert every.backend == "gpu"
    assert any(topic == "gpus" and "1 of" in text
               for topic, text in every.info["notes"]), every.info["notes"]
    np.testing.assert_allclose(every.fits, cpu.fits, atol=1e-4)


@pytest.mark.skipif(gpu_reason() is not None, reason=str(gpu_reason()))
def test_gpu_decomposes_one_large_tensor_twice_alike():
    # Over 4M words of COO, so the upload page-locks the arrays; they stay
    # locked with the tensor and the second run copies from that lock.
    subs, vals, shape = random_parts((3000, 2000, 1000), 1_200_000, seed=5)
    X = kruskal.SparseTensor(subs, vals, shape)
    factors = initial(shape, 8)
    runs = [kruskal.cp_als(X, 8, init=factors, iters=5, tol=0, backend="gpu", kernel="fcoo",
                           progress=False) for _ in range(2)]
    assert [r.backend for r in runs] == ["gpu", "gpu"]
    steps = [dict(r.info["layout_steps"]) for r in runs]
    assert all("upload" in s and "sort" in s for s in steps), steps
    np.testing.assert_array_equal(runs[0].fits, runs[1].fits)
    cpu = kruskal.cp_als(X, 8, init=factors, iters=5, tol=0, backend="cpu", progress=False)
    np.testing.assert_allclose(runs[0].fits, cpu.fits, atol=1e-4)
