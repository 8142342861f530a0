"""CP decomposition (CPD-ALS) of large sparse tensors on GPUs and CPUs.

The Python face of kruskal: the same decomposition as ``kruskal cpd``
(one library call makes the same choices of backend, kernels and GPUs),
with numpy arrays in and out; and ``cp_apr``, the Poisson CP of count
tensors (as ``kruskal cp-apr`` and pyttb's ``cp_apr``).

Examples
--------
>>> import numpy as np, kruskal
>>> X = kruskal.SparseTensor(np.array([[0, 0, 0], [1, 2, 3]]), np.array([1.0, 2.0]), (2, 3, 4))
>>> m = kruskal.cp_als(X, rank=1, iters=10, progress=False)
>>> m.factors[0].shape
(2, 1)
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _kruskal
from ._kruskal import GpuError, SparseTensor, read

__all__ = [
    "GpuError",
    "KruskalModel",
    "SparseTensor",
    "cp_als",
    "cp_apr",
    "devices",
    "mttkrp",
    "read",
]
__version__: str = _kruskal.__version__

#: Defaults shared with ``kruskal cpd`` (``--iters``, ``--tol``).
DEFAULT_ITERS = 50
DEFAULT_TOL = 1e-5


class KruskalModel:
    """A CP model ``sum_r weights[r] * a_r(1) o ... o a_r(N)`` and its run.

    Attributes
    ----------
    weights : numpy.ndarray
        float64, shape (rank,), largest first.
    factors : list of numpy.ndarray
        One (dims[n], rank) matrix per mode with unit 2-norm columns, in
        the dtype ``cp_als`` was asked for (float32 by default).
    fit : float
        ``1 - ||X - model|| / ||X||`` after the last iteration (NaN for
        ``cp_apr``, which does not compute it).
    fits : numpy.ndarray
        The fit after every iteration of the kept start (the last 10,000
        of a longer run).
    log_likelihood : float
        ``cp_apr`` only: the Poisson log-likelihood of the model (NaN for
        ``cp_als``).
    log_likelihoods : numpy.ndarray
        ``cp_apr`` only: the log-likelihood after every outer iteration.
    iterations : list of dict
        Per iteration: ``iteration``, ``fit``, ``delta``, ``mttkrp_s``,
        ``other_s``, ``mttkrp_modes_s``, ``update_s``, ``fit_s`` (the
        fields of ``kruskal cpd --json``); the last 10,000 of a longer
        run, whose count is ``info["iterations_run"]``.
    converged : bool
        The fit changed less than ``tol`` before the iteration limit.
    interrupted : bool
        The run was stopped (the callback returned False) before it ended.
    backend : str
        ``"cpu"``, ``"gpu"`` or ``"gpus"``.
    info : dict
        How the run went: ``describe`` (the backend in words), ``fallback``
        (why ``backend="auto"`` did not use the GPU, or None),
        ``prepare_s`` and its parts ``prepare`` (``open_s``, ``choose_s``,
        ``build_s``, as ``kruskal cpd --json`` gives them), ``layout_steps``
        (the GPU layout build's (step, seconds), empty on the CPU),
        ``cpd_s``, ``starts`` (seed, fit, iterations of each start),
        ``pseudo_inverse_solves``, ``notes`` (the choices ``kruskal cpd``
        prints, as (topic, text) pairs), ``iterations_run``.
    """

    def __init__(self, weights: np.ndarray, factors: List[np.ndarray], iterations: List[dict],
                 converged: bool = False, interrupted: bool = False, backend: str = "cpu",
                 info: Optional[dict] = None) -> None:
        self.weights = weights
        self.factors = factors
        self.iterations = iterations
        self.converged = converged
        self.interrupted = interrupted
        self.backend = backend
        self.info = info or {}

    @property
    def rank(self) -> int:
        """The number of components."""
        return len(self.weights)

    @property
    def fits(self) -> np.ndarray:
        """The fit after every iteration (float64; NaN for ``cp_apr``)."""
        return np.array([it.get("fit", np.nan) for it in self.iterations], dtype=np.float64)

    @property
    def fit(self) -> float:
        """The fit after the last iteration (0.0 when none ran; NaN for
        ``cp_apr``)."""
        return float(self.iterations[-1].get("fit", np.nan)) if self.iterations else 0.0

    @property
    def log_likelihoods(self) -> np.ndarray:
        """``cp_apr``: the log-likelihood after every outer iteration."""
        return np.array([it.get("log_likelihood", np.nan) for it in self.iterations],
                        dtype=np.float64)

    @property
    def log_likelihood(self) -> float:
        """``cp_apr``: the final model's log-likelihood (NaN for ``cp_als``)."""
        return float(self.info.get("log_likelihood", np.nan))

    def full(self) -> np.ndarray:
        """The model as a dense numpy array (float64): for small tensors only."""
        shape = tuple(f.shape[0] for f in self.factors)
        out = np.zeros(shape)
        letters = "abcdefghijklmnopqrstuvwxy"[: len(shape)]
        spec = ",".join(f"{c}z" for c in letters) + ",z->" + letters
        out += np.einsum(spec, *[f.astype(np.float64) for f in self.factors], self.weights)
        return out

    def to_pyttb(self) -> Any:
        """The model as a ``pyttb.ktensor`` (needs pyttb).

        The factors are converted to float64, pyttb's dtype.
        """
        import pyttb

        return pyttb.ktensor([np.asarray(f, dtype=np.float64) for f in self.factors],
                             np.asarray(self.weights, dtype=np.float64))

    def to_tensorly(self) -> Any:
        """The model as a ``tensorly.cp_tensor.CPTensor`` (needs TensorLy)."""
        from tensorly.cp_tensor import CPTensor

        return CPTensor((np.asarray(self.weights), [np.asarray(f) for f in self.factors]))

    def __repr__(self) -> str:
        shape = ", ".join(str(f.shape[0]) for f in self.factors)
        state = "converged" if self.converged else "interrupted" if self.interrupted else "limit"
        if "log_likelihood" in self.info:
            return (f"kruskal.KruskalModel(shape=({shape}), rank={self.rank}, "
                    f"log_likelihood={self.log_likelihood:.6e}, "
                    f"iterations={len(self.iterations)} ({state}), backend={self.backend!r})")
        return (f"kruskal.KruskalModel(shape=({shape}), rank={self.rank}, fit={self.fit:.6f}, "
                f"iterations={len(self.iterations)} ({state}), backend={self.backend!r})")


def _as_tensor(X: Any) -> SparseTensor:
    """``X`` as a SparseTensor: itself, or converted from pyttb, pydata
    sparse or scipy.sparse."""
    if isinstance(X, SparseTensor):
        return X
    kind = type(X).__module__.split(".")[0]
    if kind == "pyttb":
        return SparseTensor.from_pyttb(X)
    if kind == "sparse":
        return SparseTensor.from_sparse(X)
    if kind == "scipy":
        return SparseTensor.from_scipy(X)
    raise TypeError(
        f"expected a kruskal.SparseTensor, pyttb.sptensor, sparse.COO or scipy.sparse matrix, "
        f"not {type(X).__name__}")


def _factors_f32(factors: Sequence[Any], what: str) -> List[np.ndarray]:
    """Factor matrices as float32 2-D arrays (no copy when they already are)."""
    if isinstance(factors, np.ndarray) or not isinstance(factors, (list, tuple)):
        raise ValueError(f"{what} must be a list of arrays, one per mode")
    out = []
    for n, f in enumerate(factors):
        a = np.asarray(f)
        if a.dtype.kind not in "fiu":
            raise ValueError(f"{what}[{n}] must hold real numbers, not {a.dtype}")
        if a.ndim != 2:
            raise ValueError(f"{what}[{n}] must be 2-D (rows x rank), not {a.ndim}-D")
        out.append(a.astype(np.float32, copy=False))
    return out


def _check_init(given: List[np.ndarray], shape: Sequence[int], rank: int) -> None:
    """The checks ``kruskal cpd --init`` makes of its files, in Python's
    words: one (shape[n], rank) matrix per mode, finite, and none but the
    first all zeros. Made before anything is prepared."""
    if len(given) != len(shape):
        raise ValueError(f"init holds {len(given)} matrices for a {len(shape)}-mode tensor "
                         f"(one per mode)")
    if given[0].shape[1] != rank:
        raise ValueError(f"init has rank {given[0].shape[1]} (the columns of init[0]), "
                         f"rank is {rank}")
    rows = tuple(int(f.shape[0]) for f in given)
    for n, (f, d) in enumerate(zip(given, shape)):
        if f.shape != (d, rank):
            hint = ""
            if f.shape[1] == rank and all(r >= s for r, s in zip(rows, shape)):
                # A text file has the dimensions of its largest indices;
                # read with the factors' own, it has their shape.
                hint = (f"; a file read with kruskal.read(path, dims={rows}) has the factors' "
                        f"shape")
            raise ValueError(f"init[{n}] is {f.shape[0]} x {f.shape[1]}, expected {d} x {rank} "
                             f"(shape[{n}] is {d}){hint}")
        if not np.isfinite(f).all():
            raise ValueError(f"init[{n}] holds a value that is not finite")
        if n > 0 and not f.any():
            raise ValueError(f"init[{n}] is all zeros, from which ALS cannot move (the first "
                             f"mode's factor is computed from the others)")


class _Progress:
    """A progress bar (tqdm, terminal or Jupyter) or a status line on stderr."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.bar = None
        try:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="cp_als", unit="it", leave=False)
        except ImportError:
            pass

    def update(self, start: int, iteration: int, fit: float, seconds: float) -> None:
        text = f"start {start + 1}, fit {fit:.6f}, {seconds:.3f} s/iteration"
        if self.bar is not None:
            if iteration == 1:
                self.bar.reset(total=self.total)
            self.bar.update(1)
            self.bar.set_postfix_str(text, refresh=False)
        else:
            sys.stderr.write(f"\rcp_als {iteration}/{self.total}: {text}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\n")


def _nonneg_modes(nonneg: Any, nmodes: int) -> Tuple[bool, Optional[List[int]]]:
    """``nonneg`` of ``cp_als`` as (every mode, the listed modes)."""
    if isinstance(nonneg, (bool, np.bool_)):
        return bool(nonneg), None
    try:
        listed = list(nonneg)
    except TypeError:
        raise ValueError(
            f"nonneg must be True, False or a list of modes, not {nonneg!r}") from None
    if not listed:
        raise ValueError("nonneg lists no mode (use False for none)")
    for m in listed:
        if isinstance(m, (bool, np.bool_)) or not isinstance(m, (int, np.integer)):
            raise ValueError(f"nonneg lists modes as integers, not {m!r}")
        if not 0 <= m < nmodes:
            raise ValueError(
                f"nonneg names mode {m}; the tensor's modes are 0 to {nmodes - 1}")
    return False, sorted({int(m) for m in listed})


def cp_als(
    X: Any,
    rank: int = 10,
    *,
    backend: str = "auto",
    gpus: Union[int, str] = 1,
    iters: int = DEFAULT_ITERS,
    tol: float = DEFAULT_TOL,
    init: Union[str, Sequence[np.ndarray]] = "random",
    seed: int = 1,
    starts: int = 1,
    kernel: str = "auto",
    nonneg: Union[bool, Sequence[int]] = False,
    l1: Optional[float] = None,
    l2: Optional[float] = None,
    progress: bool = True,
    callback: Optional[Callable[[int, float], Optional[bool]]] = None,
    dtype: Any = np.float32,
) -> KruskalModel:
    """CP decomposition by alternating least squares, as ``kruskal cpd``.

    Follows pyttb's ``cp_als`` step by step (normalization, fit, stopping
    rule): from the same initial factors both give the same fits.

    Parameters
    ----------
    X : SparseTensor, pyttb.sptensor, sparse.COO or scipy.sparse matrix
        The tensor (converted to a SparseTensor when it is not one).
    rank : int, default 10
        Number of components (``--rank``).
    backend : {"auto", "cpu", "gpu"}, default "auto"
        ``auto`` runs on the GPU when one is usable and the run fits in
        its memory, else on the CPU (``info["fallback"]`` says why).
    gpus : int or "all", default 1
        GPUs of this machine to run on; from 2 on, the tensor is sharded
        over them (``--gpus``). ``"all"``: as many of the machine's GPUs as
        pay for this tensor (a small one stays on one GPU;
        ``info["notes"]`` says why), as ``kruskal cpd --gpus all``.
    iters : int, default 50
        Iteration limit (``--iters``).
    tol : float, default 1e-5
        Stop when the fit changes by less than this (``--tol``).
    init : "random" or list of array_like, default "random"
        ``"random"``: uniform in [0, 1) from ``seed`` (the factors
        ``kruskal cpd --seed`` draws). Otherwise one (dims[n], rank) matrix
        per mode (used as float32; ``--init``).
    seed : int, default 1
        Seed of the random initial factors (``--seed``).
    starts : int, default 1
        Run from this many random starts (seeds ``seed``, ``seed + 1``,
        ...) and keep the best fit (``--starts``).
    kernel : str, default "auto"
        MTTKRP engine (``--kernel``). CPU: auto (csf from three modes,
        sorted on two), sorted, fcoo, flycoo, hicoo, csf. GPU: auto (times
        three candidates on the first iteration, fcoo threadlen 8 and the
        tuning model's two fastest other configurations, and keeps the
        fastest per mode), coo, fcoo, flycoo, hicoo.
    nonneg : bool or list of int, default False
        Keep every factor non-negative (``True``), or only those of the
        listed modes (numbered from 0) (``--nonneg``). Any of ``nonneg``,
        ``l1``, ``l2`` makes the run constrained CP by AO-ADMM (each factor
        found by ADMM steps instead of ALS's exact solve), on one GPU or
        the CPU, where an unconstrained run would go (a GPU runs the inner
        loop with each row stopping on its own; the
        ``"method"`` note of ``info["notes"]`` says which ran);
        ``gpus >= 2`` refuses it.
    l1 : float, optional
        Weight of the penalty ``l1 * ||A||_1`` on every factor (``--l1``).
    l2 : float, optional
        Weight of the penalty ``l2 * ||A||_F^2`` on every factor (``--l2``).
    progress : bool, default True
        Show a progress bar (tqdm when installed, in a terminal or in
        Jupyter; else a status line on stderr).
    callback : callable, optional
        ``callback(iteration, fit)`` after every iteration; returning False
        stops the run (the model so far is returned, ``interrupted`` set).
    dtype : numpy dtype, default numpy.float32
        dtype of the returned factors: float32 (as computed) or float64.

    Returns
    -------
    KruskalModel

    Raises
    ------
    ValueError
        Bad arguments (rank 0, unknown backend or kernel, factors of the
        wrong shape) or data.
    GpuError
        ``backend="gpu"``, ``gpus >= 2`` or ``gpus="all"`` and the GPU
        cannot be used or fails.
    KeyboardInterrupt
        Ctrl-C: heard after the current iteration; the run stops and its
        memory (GPU included) is released.
    """
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, not {rank!r}")
    if not isinstance(iters, (int, np.integer)) or iters < 0:
        raise ValueError(f"iters must be an integer >= 0, not {iters!r}")
    if not isinstance(starts, (int, np.integer)) or starts < 1:
        raise ValueError(f"starts must be an integer >= 1, not {starts!r}")
    pick_gpus = isinstance(gpus, str) and gpus == "all"
    if not pick_gpus and (
        not isinstance(gpus, (int, np.integer)) or isinstance(gpus, bool) or gpus < 1
    ):
        raise ValueError(f"gpus must be an integer >= 1 or 'all', not {gpus!r}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, not {seed!r}")
    out_dtype = np.dtype(dtype)
    if out_dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be float32 or float64, not {out_dtype}")
    tensor = _as_tensor(X)
    if isinstance(init, str):
        if init != "random":
            raise ValueError(f"init must be 'random' or a list of factor matrices, not {init!r}")
        given = None
    else:
        given = _factors_f32(init, "init")
        _check_init(given, tensor.shape, int(rank))
    nonneg_all, nonneg_modes = _nonneg_modes(nonneg, len(tensor.shape))
    for name, weight in (("l1", l1), ("l2", l2)):
        if weight is not None and (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float, np.integer, np.floating))
            or not np.isfinite(weight) or weight < 0
        ):
            raise ValueError(f"{name} must be a finite number >= 0, not {weight!r}")
    # The bar appears with the first iteration: an argument the run refuses
    # leaves none behind.
    bars: List[_Progress] = []

    def hear(start: int, iteration: int, fit: float, seconds: float) -> bool:
        if progress:
            if not bars:
                bars.append(_Progress(int(iters)))
            bars[0].update(start, iteration, fit, seconds)
        if callback is not None:
            return callback(iteration, fit) is not False
        return True

    try:
        out = _kruskal.cp_als(
            tensor, int(rank), backend=backend, gpus=0 if pick_gpus else int(gpus),
            pick_gpus=pick_gpus, iters=int(iters),
            tol=float(tol), init=given, seed=int(seed), starts=int(starts), kernel=kernel,
            callback=hear if (progress or callback is not None) else None,
            nonneg_all=nonneg_all, nonneg_modes=nonneg_modes,
            l1=None if l1 is None else float(l1), l2=None if l2 is None else float(l2))
    finally:
        for bar in bars:
            bar.close()
    factors = [f if out_dtype == f.dtype else f.astype(out_dtype) for f in out["factors"]]
    info = {k: out[k] for k in ("describe", "fallback", "prepare_s", "prepare", "layout_steps",
                                "cpd_s", "pseudo_inverse_solves", "notes", "iterations_run")}
    info["starts"] = [dict(zip(("seed", "fit", "iterations"), s)) for s in out["starts"]]
    return KruskalModel(out["weights"], factors, out["iterations"], out["converged"],
                        out["interrupted"], out["backend"], info)


def cp_apr(
    X: Any,
    rank: int = 10,
    algorithm: str = "mu",
    stoptol: float = 1e-4,
    stoptime: float = 1e6,
    maxiters: int = 1000,
    init: Any = "random",
    maxinneriters: int = 10,
    epsDivZero: float = 1e-10,
    kappa: float = 0.01,
    kappatol: float = 1e-10,
    *,
    seed: int = 1,
    callback: Optional[Callable[[int, float, float], Optional[bool]]] = None,
    backend: str = "auto",
    gpus: Union[int, str] = 1,
) -> KruskalModel:
    """Poisson CP of a count tensor by CP-APR, as ``kruskal cp-apr``.

    Follows pyttb's ``cp_apr(algorithm="mu")`` step by step (the
    multiplicative updates of Chi and Kolda, the kappa fix of inadmissible
    zeros, the KKT stopping test, the final normalization and sort): from
    the same initial factors both give the same log-likelihoods. Runs in
    float64 on one GPU, on several (``gpus``) or on the CPU's cores
    (``backend``).

    The arguments from ``algorithm`` to ``kappatol`` are pyttb's, with its
    names and defaults.

    Parameters
    ----------
    X : SparseTensor, pyttb.sptensor, sparse.COO or scipy.sparse matrix
        Counts: non-negative values (others are refused).
    rank : int, default 10
        Number of components.
    algorithm : {"mu"}
        Only the multiplicative updates ("mu").
    stoptol : float, default 1e-4
        Stop when every mode's KKT violation is below this.
    stoptime : float, default 1e6
        Stop after the outer iteration that ends past this many seconds.
    maxiters : int, default 1000
        Outer iteration limit.
    init : "random", pyttb.ktensor or list of array_like
        ``"random"``: uniform in [0, 1) from ``seed`` (the factors
        ``kruskal cpd --seed`` draws; pyttb draws its own from numpy).
        A ``pyttb.ktensor`` (its factors and weights) or one non-negative
        (dims[n], rank) matrix per mode, used as float64.
    maxinneriters : int, default 10
        Multiplicative updates per mode and outer iteration at most.
    epsDivZero : float, default 1e-10
        Floor of the model's value where it divides a count.
    kappa : float, default 0.01
        Offset added to entries stuck at zero that the data wants to grow.
    kappatol : float, default 1e-10
        Entries below this count as zero for the kappa fix.
    seed : int, default 1
        Seed of the random initial factors.
    callback : callable, optional
        ``callback(iteration, log_likelihood, kkt_violation)`` after every
        outer iteration; returning False stops the run.
    backend : {"auto", "cpu", "gpu"}, default "auto"
        ``"auto"``: the first GPU when one is usable, takes the rank (1 to
        256) and has the memory, else the CPU (``info["fallback"]`` says
        why); ``"gpu"`` raises ``GpuError`` when the GPU cannot run it.
        Both give the same model up to rounding.
    gpus : int or "all", default 1
        From 2: the first ``gpus`` GPUs, each owning a range of every
        mode's rows (``kruskal cp-apr --gpus``); the same model up to
        rounding. ``"all"``: a GPU per million nonzeros, up to every GPU
        (``info["gpus_note"]`` says when fewer). Raises ``GpuError`` when a
        GPU cannot run it; not with ``backend="cpu"``.

    Returns
    -------
    KruskalModel
        float64 factors with columns of unit 1-norm, weights largest first
        (``to_pyttb()`` gives the ``pyttb.ktensor``); ``log_likelihood``,
        ``log_likelihoods``, and per outer iteration in ``iterations``:
        ``iteration``, ``log_likelihood``, ``kkt_violation``,
        ``inner_iters``, ``kappa_fixes``, ``elapsed_s``. ``backend`` is
        where it ran (``"gpu"`` or ``"cpu"``). ``info`` holds
        ``log_likelihood``, ``timed_out``, ``non_integer_values`` (values
        that are not whole numbers: accepted, as pyttb does), ``describe``,
        ``fallback`` (why ``backend="auto"`` did not use the GPU, or None),
        ``gpus`` (how many ran it, 0 on the CPU), ``gpus_note``.

    Raises
    ------
    ValueError
        Bad arguments, negative or non-finite values, negative initial
        factors or factors of the wrong shape.
    GpuError
        ``backend="gpu"`` and the GPU cannot be used or fails.
    """
    if algorithm != "mu":
        raise ValueError(f"algorithm must be 'mu' (the only one kruskal has), not {algorithm!r}")
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, not {rank!r}")
    for name, value in (("maxiters", maxiters), ("maxinneriters", maxinneriters)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, not {value!r}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, not {seed!r}")
    pick_gpus = isinstance(gpus, str) and gpus == "all"
    if not pick_gpus and (
        not isinstance(gpus, (int, np.integer)) or isinstance(gpus, bool) or gpus < 1
    ):
        raise ValueError(f"gpus must be an integer >= 1 or 'all', not {gpus!r}")
    tensor = _as_tensor(X)
    weights = None
    if isinstance(init, str):
        if init != "random":
            raise ValueError(f"init must be 'random', a pyttb.ktensor or a list of factor "
                             f"matrices, not {init!r}")
        given = None
    else:
        if hasattr(init, "factor_matrices") and hasattr(init, "weights"):
            weights = [float(w) for w in np.asarray(init.weights, dtype=np.float64)]
            init = list(init.factor_matrices)
        if isinstance(init, np.ndarray) or not isinstance(init, (list, tuple)):
            raise ValueError("init must be a list of arrays, one per mode")
        given = []
        for n, f in enumerate(init):
            a = np.asarray(f)
            if a.dtype.kind not in "fiu" or a.ndim != 2:
                raise ValueError(f"init[{n}] must be a 2-D array of real numbers")
            given.append(np.ascontiguousarray(a, dtype=np.float64))
    stop = float(stoptime)
    out = _kruskal.cp_apr(
        tensor, int(rank), iters=int(maxiters), inner_iters=int(maxinneriters),
        tol=float(stoptol), kappa=float(kappa), kappa_tol=float(kappatol),
        eps_div_zero=float(epsDivZero), time_limit=stop if np.isfinite(stop) else None,
        init=given, weights=weights, seed=int(seed),
        callback=(lambda i, ll, kkt: callback(i, ll, kkt) is not False)
        if callback is not None else None, backend=str(backend),
        gpus=0 if pick_gpus else int(gpus), pick_gpus=pick_gpus)
    info = {k: out[k] for k in ("log_likelihood", "timed_out", "non_integer_values", "fallback",
                                "gpus", "gpus_note")}
    if out["device"] is None:
        where = out["backend"]
    elif out["gpus"] > 1:
        where = f"{out['gpus']} GPUs ({out['device']})"
    else:
        where = f"gpu ({out['device']})"
    info["describe"] = f"{where} (CP-APR, multiplicative updates)"
    return KruskalModel(out["weights"], list(out["factors"]), out["iterations"],
                        out["converged"], out["interrupted"], out["backend"], info)


def mttkrp(X: Any, factors: Sequence[np.ndarray], mode: int, *, backend: str = "auto",
           kernel: str = "auto") -> np.ndarray:
    """One MTTKRP: ``X_(mode) (khatri-rao of the other factors)``.

    For users writing their own solvers. The product skips ``factors[mode]``
    (it must still have the right shape).

    Parameters
    ----------
    X : SparseTensor, pyttb.sptensor, sparse.COO or scipy.sparse matrix
        The tensor.
    factors : list of array_like
        One (dims[n], rank) matrix per mode (used as float32).
    mode : int
        The output mode, 0-based.
    backend : {"auto", "cpu", "gpu"}, default "auto"
        ``auto``: the GPU when one is usable, else the CPU.
    kernel : str, default "auto"
        The engine, as for ``cp_als``.

    Returns
    -------
    numpy.ndarray
        float32, shape (dims[mode], rank).

    Raises
    ------
    ValueError
        Shapes that do not fit the tensor, a mode out of range.
    GpuError
        ``backend="gpu"`` and the GPU cannot be used or fails.
    """
    if not isinstance(mode, (int, np.integer)) or isinstance(mode, bool) or mode < 0:
        raise ValueError(f"mode must be an integer >= 0, not {mode!r}")
    return _kruskal.mttkrp(_as_tensor(X), _factors_f32(factors, "factors"), int(mode),
                           backend=backend, kernel=kernel)


class Devices(list):
    """The usable CUDA GPUs (a list of dicts: ordinal, name, arch, sms,
    total_bytes, free_bytes); ``reason`` says why it is empty."""

    reason: Optional[str]


def devices() -> Devices:
    """The CUDA GPUs kruskal can use, or why none can be.

    Returns
    -------
    Devices
        A list with one dict per GPU (``ordinal``, ``name``, ``arch``,
        ``sms``, ``total_bytes``, ``free_bytes``); when empty, its
        ``reason`` attribute says why (no driver, no GPU).
    """
    found, reason = _kruskal.devices()
    out = Devices(found)
    out.reason = reason
    return out
