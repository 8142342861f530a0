//! CP-APR: the Poisson CP decomposition of a count tensor by alternating
//! Poisson regression with multiplicative updates (Chi and Kolda, "On
//! tensors, sparsity, and nonnegative factorizations", SIAM J. Matrix
//! Anal. Appl. 2012), step by step as pyttb's `cp_apr(algorithm="mu")`
//! and the Tensor Toolbox's `cp_apr` do it, so that from the same initial
//! factors both give the same log-likelihoods.
//!
//! The model `M = sum_r lambda_r a_r^(1) o ... o a_r^(N)` maximizes
//! `sum_nz x log(m) - sum_all m` (the Poisson log-likelihood without its
//! `log(x!)` term). Factor columns are kept at unit 1-norm between mode
//! updates, so `sum_all m = sum_r lambda_r`.
//!
//! Each outer iteration, for each mode n:
//! 1. from the second iteration on, entries of `A_n` below `kappa_tol`
//!    whose `Phi_n` (from the previous iteration) is positive are raised by
//!    `kappa` (the inadmissible-zero fix: a zero entry never moves under a
//!    multiplicative update);
//! 2. lambda is folded into `A_n`;
//! 3. `Pi` (one row per nonzero: the product of the other modes' factor
//!    rows at its indices) is formed once;
//! 4. up to `max_inner_iters` times: `Phi_n = sum_nz (x / max(<a_i, pi>,
//!    eps_div_zero)) pi` row by row; stop when the KKT violation
//!    `max |min(A_n, 1 - Phi_n)|` is below `tol`, else `A_n *= Phi_n`;
//! 5. the columns of `A_n` are scaled to unit 1-norm into lambda.
//!
//! The run stops after an outer iteration whose every mode met `tol` on
//! its first inner iteration (the KKT test), or after `max_iters`, or past
//! the time limit. The log-likelihood is computed after every outer
//! iteration. At the end the columns are normalized once more and sorted
//! by lambda, largest first.
//!
//! Everything is computed in f64 (the tensor's f32 values are exact for
//! counts up to 2^24). Each mode has a copy of the nonzeros sorted by its
//! index (rows as in CSR); `Phi_n` is computed in parallel over rows, one
//! task writing each row and summing its nonzeros in a fixed order, so the
//! result does not depend on the thread count. Memory: per mode, the
//! sorted copy (`nnz * (8 + 4 (N-1))` bytes and a row pointer), plus `Pi`
//! (`nnz * R * 8` bytes) and `Phi` (`dims[n] * R * 8` bytes per mode).
//!
//! The driver (`run_steps`) is written over the steps (`AprSteps`):
//! [`cp_apr`] runs it with the CPU's, [`crate::apr_gpu`] with one GPU's
//! or a group's (each GPU a range of every mode's rows).

use std::ops::ControlFlow;
use std::time::Instant;

use kruskal_formats::SparseTensor;
use ndarray::Array2;
use rayon::prelude::*;
use serde::Serialize;

use crate::error::{CpdError, OptionName, Result};

/// Default outer iteration limit (pyttb's `maxiters`).
pub const DEFAULT_MAX_ITERS: usize = 1000;
/// Default inner iteration limit per mode (pyttb's `maxinneriters`).
pub const DEFAULT_MAX_INNER_ITERS: usize = 10;
/// Default tolerance on the KKT violation (pyttb's `stoptol`).
pub const DEFAULT_TOL: f64 = 1e-4;
/// Default offset of the inadmissible-zero fix (pyttb's `kappa`).
pub const DEFAULT_KAPPA: f64 = 0.01;
/// Default threshold below which an entry counts as zero (`kappatol`).
pub const DEFAULT_KAPPA_TOL: f64 = 1e-10;
/// Default floor of the model's value in `Phi` (pyttb's `epsDivZero`).
pub const DEFAULT_EPS_DIV_ZERO: f64 = 1e-10;

/// Nonzeros per task in the passes over all nonzeros (`Pi`, the
/// log-likelihood): the chunking is fixed, so sums are made in the same
/// order on any thread count.
const NNZ_CHUNK: usize = 1 << 12;

/// Where the factors start.
#[derive(Clone, Debug)]
pub enum AprInit {
    /// Uniform in [0, 1) from `seed`: the factors `kruskal cpd --seed`
    /// draws ([`crate::random_factors`]), widened to f64.
    Random { seed: u64 },
    /// Given non-negative factors, one `dims[m] x rank` matrix per mode,
    /// and optional non-negative weights (ones when absent).
    Given {
        factors: Vec<Array2<f64>>,
        weights: Option<Vec<f64>>,
    },
}

/// Options of a CP-APR run; the defaults are pyttb's.
#[derive(Clone, Debug)]
pub struct AprOptions {
    pub rank: usize,
    pub max_iters: usize,
    pub max_inner_iters: usize,
    pub tol: f64,
    pub kappa: f64,
    pub kappa_tol: f64,
    pub eps_div_zero: f64,
    /// Stop after the outer iteration that ends past this many seconds.
    pub time_limit_s: Option<f64>,
    pub init: AprInit,
}

impl AprOptions {
    /// Rank `rank`, pyttb's defaults, random init with seed 1.
    pub fn new(rank: usize) -> Self {
        AprOptions {
            rank,
            max_iters: DEFAULT_MAX_ITERS,
            max_inner_iters: DEFAULT_MAX_INNER_ITERS,
            tol: DEFAULT_TOL,
            kappa: DEFAULT_KAPPA,
            kappa_tol: DEFAULT_KAPPA_TOL,
            eps_div_zero: DEFAULT_EPS_DIV_ZERO,
            time_limit_s: None,
            init: AprInit::Random { seed: 1 },
        }
    }

    fn check(&self) -> Result<()> {
        let bad = |what: &str, v: f64| {
            Err(CpdError::Option(format!(
                "{what} {v} must be finite and >= 0"
            )))
        };
        if self.rank == 0 {
            return Err(CpdError::option(OptionName::Rank, "must be at least 1"));
        }
        if self.max_inner_iters == 0 {
            return Err(CpdError::Option(
                "the inner iteration limit must be at least 1".into(),
            ));
        }
        for (what, v) in [
            ("tol", self.tol),
            ("kappa", self.kappa),
            ("kappa_tol", self.kappa_tol),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(what, v);
            }
        }
        if !(self.eps_div_zero.is_finite() && self.eps_div_zero > 0.0) {
            return Err(CpdError::Option(format!(
                "eps_div_zero {} must be finite and > 0",
                self.eps_div_zero
            )));
        }
        if let Some(t) = self.time_limit_s {
            if t.is_nan() || t < 0.0 {
                return bad("time limit", t);
            }
        }
        Ok(())
    }
}

/// One outer iteration (the fields of `kruskal cp-apr --json`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AprIteration {
    /// 1-based.
    pub iteration: usize,
    /// `sum_nz x log(m) - sum_all m` after the iteration.
    pub log_likelihood: f64,
    /// The largest KKT violation of the modes' last inner iterations.
    pub kkt_violation: f64,
    /// Inner iterations run, all modes together.
    pub inner_iters: usize,
    /// Modes whose inadmissible zeros were raised by kappa.
    pub kappa_fixes: usize,
    /// Seconds since the run started.
    pub elapsed_s: f64,
}

/// The result of a CP-APR run.
#[derive(Clone, Debug)]
pub struct AprModel {
    /// Component weights, largest first.
    pub lambda: Vec<f64>,
    /// One `dims[m] x rank` matrix per mode, columns of unit 1-norm (a
    /// column that vanished stays zero, with weight 0).
    pub factors: Vec<Array2<f64>>,
    /// Every outer iteration run.
    pub iterations: Vec<AprIteration>,
    /// The KKT test was met before the iteration limit.
    pub converged: bool,
    /// The time limit ended the run.
    pub timed_out: bool,
    /// The caller stopped the run.
    pub interrupted: bool,
    /// The final model's log-likelihood.
    pub log_likelihood: f64,
}

/// Each mode's copy of the nonzeros, sorted by that mode's index.
pub(crate) struct ModeRows {
    /// Nonzeros of row `i` are `row_ptr[i]..row_ptr[i + 1]`.
    pub(crate) row_ptr: Vec<usize>,
    pub(crate) values: Vec<f64>,
    /// The other modes, ascending.
    other_modes: Vec<usize>,
    /// `other[k][j]`: the index in mode `other_modes[k]` of sorted nonzero j.
    pub(crate) other: Vec<Vec<u32>>,
}

impl ModeRows {
    pub(crate) fn new(tensor: &SparseTensor, mode: usize) -> Self {
        let idx = tensor.mode_indices(mode);
        // A counting sort: stable, so a row's nonzeros keep the tensor's
        // order (the order pyttb sums them in).
        let row_ptr = row_pointer(tensor, mode);
        let mut next = row_ptr.clone();
        let mut perm = vec![0usize; idx.len()];
        for (k, &i) in idx.iter().enumerate() {
            perm[next[i as usize]] = k;
            next[i as usize] += 1;
        }
        let other_modes: Vec<usize> = (0..tensor.nmodes()).filter(|&m| m != mode).collect();
        let other = other_modes
            .iter()
            .map(|&m| {
                let src = tensor.mode_indices(m);
                perm.par_iter().map(|&p| src[p]).collect()
            })
            .collect();
        let values = perm
            .par_iter()
            .map(|&p| f64::from(tensor.values()[p]))
            .collect();
        ModeRows {
            row_ptr,
            values,
            other_modes,
            other,
        }
    }
}

/// Where each row of mode `mode` starts in the copy sorted by that mode:
/// `dims[mode] + 1` entries, from 0 to nnz.
pub(crate) fn row_pointer(tensor: &SparseTensor, mode: usize) -> Vec<usize> {
    let mut row_ptr = Vec::with_capacity(tensor.dims()[mode] as usize + 1);
    row_ptr.push(0usize);
    let mut at = 0usize;
    for n in tensor.mode_counts(mode) {
        at += n as usize;
        row_ptr.push(at);
    }
    row_ptr
}

/// Checks the tensor holds counts: finite and non-negative values.
fn check_counts(tensor: &SparseTensor) -> Result<()> {
    if let Some(k) = tensor
        .values()
        .par_iter()
        .position_first(|v| !(v.is_finite() && *v >= 0.0))
    {
        let at: Vec<String> = tensor
            .indices()
            .iter()
            .map(|m| (m[k] + 1).to_string())
            .collect();
        return Err(CpdError::Invalid(format!(
            "CP-APR needs non-negative counts; the value at ({}) is {}",
            at.join(", "),
            tensor.values()[k]
        )));
    }
    Ok(())
}

/// Nonzero values that are not whole numbers (pyttb accepts them; the
/// Poisson model is meant for counts).
pub fn non_integer_values(tensor: &SparseTensor) -> usize {
    tensor
        .values()
        .par_iter()
        .filter(|v| v.fract() != 0.0)
        .count()
}

/// The initial factors and weights, checked against the tensor.
fn initial(tensor: &SparseTensor, opts: &AprOptions) -> Result<(Vec<Array2<f64>>, Vec<f64>)> {
    let dims = tensor.dims();
    let rank = opts.rank;
    match &opts.init {
        AprInit::Random { seed } => {
            let factors = crate::random_factors(dims, rank, *seed)
                .into_iter()
                .map(|f| f.mapv(f64::from))
                .collect();
            Ok((factors, vec![1.0; rank]))
        }
        AprInit::Given { factors, weights } => {
            if factors.len() != dims.len() {
                return Err(CpdError::Shape(format!(
                    "{} factor matrices for a {}-mode tensor",
                    factors.len(),
                    dims.len()
                )));
            }
            for (m, (f, &d)) in factors.iter().zip(dims).enumerate() {
                if f.nrows() != d as usize || f.ncols() != rank {
                    return Err(CpdError::Shape(format!(
                        "initial factor {} is {} x {}, expected {d} x {rank}",
                        m + 1,
                        f.nrows(),
                        f.ncols()
                    )));
                }
                if f.iter().any(|x| !(x.is_finite() && *x >= 0.0)) {
                    return Err(CpdError::Invalid(format!(
                        "initial factor {} has a negative or non-finite entry (CP-APR needs non-negative factors)",
                        m + 1
                    )));
                }
            }
            let weights = match weights {
                None => vec![1.0; rank],
                Some(w) if w.len() != rank => {
                    return Err(CpdError::Shape(format!(
                        "{} initial weights for rank {rank}",
                        w.len()
                    )));
                }
                Some(w) if w.iter().any(|x| !(x.is_finite() && *x >= 0.0)) => {
                    return Err(CpdError::Invalid(
                        "the initial weights must be finite and non-negative".into(),
                    ));
                }
                Some(w) => w.clone(),
            };
            let factors = factors
                .iter()
                .map(|f| f.as_standard_layout().into_owned())
                .collect();
            Ok((factors, weights))
        }
    }
}

/// Scales each column of `a` to unit 1-norm, multiplying `lambda[r]` by
/// the norm (a zero column stays zero and its weight becomes 0), as
/// pyttb's `ktensor.normalize(normtype=1, mode=n)`.
pub(crate) fn normalize_mode(a: &mut Array2<f64>, lambda: &mut [f64]) {
    for (r, l) in lambda.iter_mut().enumerate() {
        let mut col = a.column_mut(r);
        let norm: f64 = col.iter().map(|x| x.abs()).sum();
        if norm > 0.0 {
            let inv = 1.0 / norm;
            col.mapv_inplace(|x| inv * x);
        }
        *l *= norm;
    }
}

/// `Pi`: row j (in `rows`' order) is the product of the other modes'
/// factor rows at nonzero j's indices, multiplied in ascending mode order.
fn compute_pi(rows: &ModeRows, factors: &[Array2<f64>], rank: usize, pi: &mut Vec<f64>) {
    let nnz = rows.values.len();
    pi.clear();
    pi.resize(nnz * rank, 1.0);
    let others: Vec<(&[u32], &[f64])> = rows
        .other
        .iter()
        .zip(&rows.other_modes)
        .map(|(idx, &m)| {
            // Factors are kept in standard layout (row-major).
            (idx.as_slice(), factors[m].as_slice().unwrap_or(&[]))
        })
        .collect();
    pi.par_chunks_mut(rank * NNZ_CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            for (j, row) in chunk.chunks_mut(rank).enumerate() {
                let k = c * NNZ_CHUNK + j;
                for (idx, f) in &others {
                    let i = idx[k] as usize;
                    for (p, &x) in row.iter_mut().zip(&f[i * rank..(i + 1) * rank]) {
                        *p *= x;
                    }
                }
            }
        });
}

/// `Phi_n` into `phi` (`dims[n] x rank`, row-major) for the current
/// `a = A_n`, and the KKT violation `max |min(a, 1 - phi)|`.
///
/// Row i: `sum_j (x_j / max(<a_i, pi_j>, eps)) pi_j` over its nonzeros j,
/// summed in their stored order; an empty row is zero.
fn compute_phi(
    rows: &ModeRows,
    pi: &[f64],
    a: &[f64],
    rank: usize,
    eps: f64,
    phi: &mut [f64],
) -> f64 {
    phi.par_chunks_mut(rank)
        .zip(a.par_chunks(rank))
        .enumerate()
        .with_min_len(64)
        .map(|(i, (out, a_i))| {
            out.fill(0.0);
            for j in rows.row_ptr[i]..rows.row_ptr[i + 1] {
                let p = &pi[j * rank..(j + 1) * rank];
                let v: f64 = a_i.iter().zip(p).map(|(x, y)| x * y).sum();
                let w = rows.values[j] / v.max(eps);
                for (o, &y) in out.iter_mut().zip(p) {
                    *o += w * y;
                }
            }
            a_i.iter()
                .zip(out.iter())
                .map(|(&x, &f)| x.min(1.0 - f).abs())
                .fold(0.0, f64::max)
        })
        .reduce(|| 0.0, f64::max)
}

/// `Phi_n` and the KKT violation of every mode n for `factors` as they
/// are (no lambda, no kappa fix), by the CPU's steps: each mode's sorted
/// copy, its `Pi`, then `Phi` (the run's own arithmetic and order, the
/// output filled with NaN first so a row left unwritten shows). For
/// `kruskal check`, which compares them with a naive f64 computation.
///
/// Shapes: `factors[m]` is `dims[m] x rank` for every mode, rank >= 1.
/// Cost: per mode one sort of the nonzeros and `nnz * R * N` products.
#[doc(hidden)]
pub fn phi_cpu(
    tensor: &SparseTensor,
    factors: &[Array2<f64>],
    eps_div_zero: f64,
) -> Result<Vec<(Array2<f64>, f64)>> {
    let rank = check_factor_shapes(tensor, factors)?;
    let factors: Vec<Array2<f64>> = factors
        .iter()
        .map(|f| f.as_standard_layout().into_owned())
        .collect();
    let mut pi = Vec::new();
    (0..tensor.nmodes())
        .map(|n| {
            let rows = ModeRows::new(tensor, n);
            compute_pi(&rows, &factors, rank, &mut pi);
            let a = factors[n].as_slice().unwrap_or(&[]);
            let mut phi = vec![f64::NAN; a.len()];
            let kkt = compute_phi(&rows, &pi, a, rank, eps_div_zero, &mut phi);
            let phi = Array2::from_shape_vec(factors[n].dim(), phi)
                .map_err(|e| CpdError::Shape(e.to_string()))?;
            Ok((phi, kkt))
        })
        .collect()
}

/// The rank of `factors` after checking they fit `tensor`: one
/// `dims[m] x rank` matrix per mode, rank >= 1.
pub(crate) fn check_factor_shapes(tensor: &SparseTensor, factors: &[Array2<f64>]) -> Result<usize> {
    let dims = tensor.dims();
    let rank = factors.first().map_or(0, |f| f.ncols());
    if factors.len() != dims.len() || rank == 0 {
        return Err(CpdError::Shape(format!(
            "{} factor matrices of rank {rank} for a {}-mode tensor",
            factors.len(),
            dims.len()
        )));
    }
    for (m, (f, &d)) in factors.iter().zip(dims).enumerate() {
        if f.dim() != (d as usize, rank) {
            return Err(CpdError::Shape(format!(
                "factor {} is {} x {}, expected {d} x {rank}",
                m + 1,
                f.nrows(),
                f.ncols()
            )));
        }
    }
    Ok(rank)
}

/// The Poisson log-likelihood `sum_nz x log(m) - sum_all m` of the model
/// `(lambda, factors)` (any column scaling), as pyttb's
/// `tt_loglikelihood`; terms with `x = 0` count as 0.
pub fn log_likelihood(tensor: &SparseTensor, lambda: &[f64], factors: &[Array2<f64>]) -> f64 {
    let rank = lambda.len();
    let idx = tensor.indices();
    let values = tensor.values();
    let sums: Vec<f64> = (0..tensor.nnz().div_ceil(NNZ_CHUNK))
        .into_par_iter()
        .map(|c| {
            let mut row = vec![0f64; rank];
            let mut sum = 0.0;
            for k in c * NNZ_CHUNK..((c + 1) * NNZ_CHUNK).min(tensor.nnz()) {
                let x = f64::from(values[k]);
                if x == 0.0 {
                    continue;
                }
                row.copy_from_slice(lambda);
                for (f, ix) in factors.iter().zip(idx) {
                    let i = ix[k] as usize;
                    for (p, &y) in row.iter_mut().zip(f.row(i)) {
                        *p *= y;
                    }
                }
                sum += x * row.iter().sum::<f64>().ln();
            }
            sum
        })
        .collect();
    // The whole model's sum: lambda_r times the product of column sums.
    let total: f64 = (0..rank)
        .map(|r| {
            factors
                .iter()
                .fold(lambda[r], |acc, f| acc * f.column(r).sum())
        })
        .sum();
    sums.iter().sum::<f64>() - total
}

/// Runs CP-APR on `tensor` (counts: finite, non-negative values) on the
/// CPU. `on_iteration` hears every outer iteration; `Break` stops the run
/// (the model so far is returned, `interrupted` set). One GPU:
/// [`crate::apr_gpu::cp_apr_gpu`]; either: [`crate::apr_gpu::cp_apr_on`].
///
/// Cost per outer iteration: for each mode, one pass over the nonzeros
/// for `Pi` (`nnz * R * (N-1)` products) and one per inner iteration for
/// `Phi` (`2 nnz R`), plus one pass for the log-likelihood.
pub fn cp_apr(
    tensor: &SparseTensor,
    opts: &AprOptions,
    on_iteration: &mut dyn FnMut(&AprIteration) -> ControlFlow<()>,
) -> Result<AprModel> {
    check_run(tensor, opts)?;
    // Refused with the numbers before anything sized by a dimension or the
    // nonzeros is made (a 3-line file may name index 3e9).
    let need = crate::memory::apr_need(tensor.dims(), tensor.nnz(), opts.rank);
    if let Some(refusal) = crate::memory::host_refusal(&need, tensor, false) {
        return Err(CpdError::memory(format!("CP-APR: {refusal}")));
    }
    run_steps(
        tensor,
        opts,
        |factors| Ok(CpuSteps::new(tensor, factors, opts.rank)),
        on_iteration,
    )
}

/// The checks every backend makes first: the options, and that the
/// tensor holds counts.
pub(crate) fn check_run(tensor: &SparseTensor, opts: &AprOptions) -> Result<()> {
    opts.check()?;
    check_counts(tensor)
}

/// The steps of an outer iteration, where they run: on the CPU
/// ([`CpuSteps`]), on one GPU or on a group of GPUs (`apr_gpu`). Each acts on mode `n`'s
/// factor `A_n`, its `Phi_n` and the `Pi` last formed.
pub(crate) trait AprSteps {
    /// With `kappa = Some((kappa_tol, kappa))`, the inadmissible-zero fix
    /// of `A_n` from the `Phi_n` of the previous outer iteration (whether
    /// an entry was raised comes back); then lambda folded into `A_n`.
    fn kappa_fold(&mut self, n: usize, kappa: Option<(f64, f64)>, lambda: &[f64]) -> Result<bool>;
    /// `Pi` of mode `n` from the current factors.
    fn form_pi(&mut self, n: usize) -> Result<()>;
    /// Mode `n`'s inner loop, up to `max_inner` times: `Phi_n` and the
    /// KKT violation `max |min(A_n, 1 - Phi_n)|`; the loop ends once that
    /// is below `tol`, else `A_n *= Phi_n`.
    fn inner(&mut self, n: usize, max_inner: usize, tol: f64, eps_div_zero: f64) -> Result<Inner>;
    /// `A_n`'s columns scaled to unit 1-norm, the norms into `lambda`
    /// ([`normalize_mode`]).
    fn normalize(&mut self, n: usize, lambda: &mut [f64]) -> Result<()>;
    /// The log-likelihood of `(lambda, factors)` ([`log_likelihood`]).
    fn log_likelihood(&mut self, lambda: &[f64]) -> Result<f64>;
    /// The factors, on the host.
    fn factors(&mut self) -> Result<Vec<Array2<f64>>>;
}

/// What a mode's inner loop did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Inner {
    /// `Phi` computations (inner iterations).
    pub iters: usize,
    /// The KKT violation of the last of them.
    pub kkt: f64,
    /// Whether any update was done (the violation of the first at least
    /// `tol`).
    pub updated: bool,
}

impl Inner {
    /// The loop whose iteration i saw the KKT violation `max_p
    /// parts[p][i]` (each part's share; the largest by the bits, as the
    /// device compares them, which for non-negative doubles is the
    /// largest value): where it ended, as the CPU's loop decides it.
    /// Values past the end are not read.
    pub(crate) fn from_violations(parts: &[Vec<f64>], max_inner: usize, tol: f64) -> Inner {
        let mut out = Inner::default();
        for i in 0..max_inner {
            out.iters += 1;
            let bits = parts.iter().map(|p| p[i].to_bits()).max().unwrap_or(0);
            out.kkt = f64::from_bits(bits);
            if out.kkt < tol {
                break;
            }
            out.updated = true;
        }
        out
    }
}

/// The steps on the CPU: the factors, each mode's sorted copy, `Phi` and
/// `Pi` in host memory.
struct CpuSteps<'t> {
    tensor: &'t SparseTensor,
    rank: usize,
    factors: Vec<Array2<f64>>,
    layouts: Vec<ModeRows>,
    phi: Vec<Vec<f64>>,
    pi: Vec<f64>,
}

impl<'t> CpuSteps<'t> {
    fn new(tensor: &'t SparseTensor, factors: Vec<Array2<f64>>, rank: usize) -> Self {
        let layouts = (0..tensor.nmodes())
            .map(|m| ModeRows::new(tensor, m))
            .collect();
        let phi = factors.iter().map(|a| vec![0.0; a.len()]).collect();
        CpuSteps {
            tensor,
            rank,
            factors,
            layouts,
            phi,
            pi: Vec::new(),
        }
    }

    fn factor(&mut self, n: usize) -> Result<&mut [f64]> {
        self.factors[n]
            .as_slice_mut()
            .ok_or_else(|| CpdError::Backend("factor not in standard layout".into()))
    }

    /// `Phi_n` and the KKT violation.
    fn phi(&mut self, n: usize, eps_div_zero: f64) -> Result<f64> {
        let a = self.factors[n]
            .as_slice()
            .ok_or_else(|| CpdError::Backend("factor not in standard layout".into()))?;
        Ok(compute_phi(
            &self.layouts[n],
            &self.pi,
            a,
            self.rank,
            eps_div_zero,
            &mut self.phi[n],
        ))
    }

    /// `A_n *= Phi_n`.
    fn update(&mut self, n: usize) -> Result<()> {
        let phi = std::mem::take(&mut self.phi[n]);
        self.factor(n)?
            .par_iter_mut()
            .zip(phi.par_iter())
            .with_min_len(1 << 12)
            .for_each(|(x, &f)| *x *= f);
        self.phi[n] = phi;
        Ok(())
    }
}

impl AprSteps for CpuSteps<'_> {
    fn kappa_fold(&mut self, n: usize, kappa: Option<(f64, f64)>, lambda: &[f64]) -> Result<bool> {
        let rank = self.rank;
        let phi = std::mem::take(&mut self.phi[n]);
        let a = self.factor(n)?;
        let mut fixed = false;
        if let Some((kappa_tol, kappa)) = kappa {
            for (x, &f) in a.iter_mut().zip(&phi) {
                if f > 0.0 && *x < kappa_tol {
                    *x += kappa;
                    fixed = true;
                }
            }
        }
        for row in a.chunks_mut(rank) {
            for (x, l) in row.iter_mut().zip(lambda) {
                *x *= l;
            }
        }
        self.phi[n] = phi;
        Ok(fixed)
    }

    fn form_pi(&mut self, n: usize) -> Result<()> {
        compute_pi(&self.layouts[n], &self.factors, self.rank, &mut self.pi);
        Ok(())
    }

    fn inner(&mut self, n: usize, max_inner: usize, tol: f64, eps_div_zero: f64) -> Result<Inner> {
        let mut out = Inner::default();
        for _ in 0..max_inner {
            out.iters += 1;
            out.kkt = self.phi(n, eps_div_zero)?;
            if out.kkt < tol {
                break;
            }
            out.updated = true;
            self.update(n)?;
        }
        Ok(out)
    }

    fn normalize(&mut self, n: usize, lambda: &mut [f64]) -> Result<()> {
        normalize_mode(&mut self.factors[n], lambda);
        Ok(())
    }

    fn log_likelihood(&mut self, lambda: &[f64]) -> Result<f64> {
        Ok(log_likelihood(self.tensor, lambda, &self.factors))
    }

    fn factors(&mut self) -> Result<Vec<Array2<f64>>> {
        Ok(std::mem::take(&mut self.factors))
    }
}

/// The run itself, the same on every backend: the initial factors
/// (normalized on the host) handed to `make`, which returns the steps;
/// the outer and inner iterations and their stopping rules; the factors
/// back on the host, normalized and sorted.
pub(crate) fn run_steps<S: AprSteps>(
    tensor: &SparseTensor,
    opts: &AprOptions,
    make: impl FnOnce(Vec<Array2<f64>>) -> Result<S>,
    on_iteration: &mut dyn FnMut(&AprIteration) -> ControlFlow<()>,
) -> Result<AprModel> {
    let (mut factors, mut lambda) = initial(tensor, opts)?;
    let rank = opts.rank;
    let nmodes = tensor.nmodes();
    let start = Instant::now();
    // The start, normalized with the 1-norm (weights times column norms).
    for a in factors.iter_mut() {
        normalize_mode(a, &mut lambda);
    }
    let mut steps = make(factors)?;
    let mut kkt_modes = vec![0.0f64; nmodes];
    let mut iterations = Vec::new();
    let (mut converged, mut timed_out, mut interrupted) = (false, false, false);

    for iteration in 0..opts.max_iters {
        let mut all_met = true;
        let mut inner_iters = 0;
        let mut kappa_fixes = 0;
        for (n, kkt) in kkt_modes.iter_mut().enumerate() {
            let kappa = (iteration > 0).then_some((opts.kappa_tol, opts.kappa));
            let fixed = steps.kappa_fold(n, kappa, &lambda)?;
            kappa_fixes += usize::from(fixed);
            lambda.fill(1.0);
            steps.form_pi(n)?;
            let inner = steps.inner(n, opts.max_inner_iters, opts.tol, opts.eps_div_zero)?;
            inner_iters += inner.iters;
            if inner.iters > 0 {
                *kkt = inner.kkt;
            }
            all_met &= !inner.updated;
            steps.normalize(n, &mut lambda)?;
        }
        let stats = AprIteration {
            iteration: iteration + 1,
            log_likelihood: steps.log_likelihood(&lambda)?,
            kkt_violation: kkt_modes.iter().copied().fold(0.0, f64::max),
            inner_iters,
            kappa_fixes,
            elapsed_s: start.elapsed().as_secs_f64(),
        };
        let stop = on_iteration(&stats);
        let elapsed = stats.elapsed_s;
        iterations.push(stats);
        if all_met {
            converged = true;
            break;
        }
        if opts.time_limit_s.is_some_and(|t| elapsed > t) {
            timed_out = true;
            break;
        }
        if stop.is_break() {
            interrupted = true;
            break;
        }
    }

    // The final normalization, then the components by weight, largest
    // first.
    let mut factors = steps.factors()?;
    drop(steps);
    for a in factors.iter_mut() {
        normalize_mode(a, &mut lambda);
    }
    let mut order: Vec<usize> = (0..rank).collect();
    order.sort_by(|&p, &q| lambda[q].total_cmp(&lambda[p]));
    let lambda: Vec<f64> = order.iter().map(|&r| lambda[r]).collect();
    let factors: Vec<Array2<f64>> = factors
        .iter()
        .map(|a| a.select(ndarray::Axis(1), &order))
        .collect();
    let log_likelihood = match iterations.last() {
        Some(s) => s.log_likelihood,
        None => log_likelihood(tensor, &lambda, &factors),
    };
    Ok(AprModel {
        lambda,
        factors,
        iterations,
        converged,
        timed_out,
        interrupted,
        log_likelihood,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal_formats::generate::{PlantedSpec, planted};

    /// A planted tensor with its values rounded up to counts.
    fn counts(dims: Vec<u32>, rank: usize, nnz: usize, seed: u64) -> SparseTensor {
        let p = planted(&PlantedSpec {
            dims,
            rank,
            nnz,
            noise: 0.0,
            seed,
        })
        .unwrap();
        let (dims, idx, values) = p.tensor.into_parts();
        let values = values.iter().map(|v| (v * 20.0).ceil()).collect();
        SparseTensor::new(dims, idx, values).unwrap()
    }

    #[test]
    fn the_inner_loop_ends_where_the_violations_say() {
        // Two parts; iteration 2's largest share (0.004) is below 0.01.
        let parts = vec![vec![0.5, 0.02, 0.004, 0.0], vec![0.3, 0.05, 0.001, 0.0]];
        let out = Inner::from_violations(&parts, 4, 0.01);
        assert_eq!(
            out,
            Inner {
                iters: 3,
                kkt: 0.004,
                updated: true
            }
        );
        // Never below: every iteration, the last one's violation.
        let out = Inner::from_violations(&parts, 2, 0.01);
        assert_eq!((out.iters, out.kkt, out.updated), (2, 0.05, true));
        // Below at once: no update.
        let out = Inner::from_violations(&[vec![0.001, 7.0]], 2, 0.01);
        assert_eq!((out.iters, out.kkt, out.updated), (1, 0.001, false));
    }

    fn given(tensor: &SparseTensor, rank: usize, seed: u64) -> AprInit {
        AprInit::Given {
            factors: crate::random_factors(tensor.dims(), rank, seed)
                .into_iter()
                .map(|f| f.mapv(|x| f64::from(x) + 0.05))
                .collect(),
            weights: None,
        }
    }

    #[test]
    fn apr_phi_matches_a_naive_f64_reference() {
        let t = counts(vec![13, 9, 7, 5], 3, 300, 3);
        let rank = 4;
        let AprInit::Given { factors, .. } = given(&t, rank, 9) else {
            unreachable!()
        };
        for n in 0..t.nmodes() {
            let rows = ModeRows::new(&t, n);
            let mut pi = Vec::new();
            compute_pi(&rows, &factors, rank, &mut pi);
            let a = factors[n].as_slice().unwrap();
            let mut phi = vec![f64::NAN; a.len()];
            let kkt = compute_phi(&rows, &pi, a, rank, 1e-10, &mut phi);
            // Naive: straight from the coordinates, in the tensor's order.
            let mut want = vec![0f64; a.len()];
            for k in 0..t.nnz() {
                let krp: Vec<f64> = (0..rank)
                    .map(|r| {
                        (0..t.nmodes())
                            .filter(|&m| m != n)
                            .map(|m| factors[m][[t.indices()[m][k] as usize, r]])
                            .product()
                    })
                    .collect();
                let i = t.indices()[n][k] as usize;
                let m: f64 = (0..rank).map(|r| factors[n][[i, r]] * krp[r]).sum();
                for r in 0..rank {
                    want[i * rank + r] += f64::from(t.values()[k]) / m * krp[r];
                }
            }
            let mut want_kkt = 0f64;
            for (j, (&got, &w)) in phi.iter().zip(&want).enumerate() {
                assert!(
                    (got - w).abs() <= 1e-12 * w.abs().max(1.0),
                    "mode {n} entry {j}: {got} vs {w}"
                );
                want_kkt = want_kkt.max(a[j].min(1.0 - w).abs());
            }
            assert!((kkt - want_kkt).abs() <= 1e-12 * want_kkt.max(1.0));
        }
    }

    #[test]
    fn apr_log_likelihood_matches_the_dense_sum() {
        let t = counts(vec![6, 5, 4], 2, 60, 4);
        let rank = 3;
        let AprInit::Given { factors, .. } = given(&t, rank, 2) else {
            unreachable!()
        };
        let lambda = vec![2.0, 0.5, 1.5];
        let model = |i: usize, j: usize, k: usize| -> f64 {
            (0..rank)
                .map(|r| lambda[r] * factors[0][[i, r]] * factors[1][[j, r]] * factors[2][[k, r]])
                .sum()
        };
        let mut want = 0.0;
        for i in 0..6 {
            for j in 0..5 {
                for k in 0..4 {
                    want -= model(i, j, k);
                }
            }
        }
        for k in 0..t.nnz() {
            let ix: Vec<usize> = (0..3).map(|m| t.indices()[m][k] as usize).collect();
            want += f64::from(t.values()[k]) * model(ix[0], ix[1], ix[2]).ln();
        }
        let got = log_likelihood(&t, &lambda, &factors);
        assert!((got - want).abs() <= 1e-12 * want.abs(), "{got} vs {want}");
    }

    #[test]
    fn apr_log_likelihood_never_falls_and_the_kkt_test_stops_the_run() {
        let t = counts(vec![12, 10, 8], 2, 300, 6);
        let mut opts = AprOptions::new(2);
        opts.init = given(&t, 2, 5);
        opts.max_iters = 1000;
        opts.tol = 1e-2;
        let mut heard = 0;
        let m = cp_apr(&t, &opts, &mut |_| {
            heard += 1;
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(heard, m.iterations.len());
        assert!(
            m.converged,
            "not converged in {} iterations",
            m.iterations.len()
        );
        assert!(m.iterations.len() > 2);
        let last = m.iterations.last().unwrap();
        // Converged: every mode met the tolerance on its first inner
        // iteration.
        assert!(last.kkt_violation < opts.tol);
        assert_eq!(last.inner_iters, t.nmodes());
        for w in m.iterations.windows(2) {
            let (a, b) = (w[0].log_likelihood, w[1].log_likelihood);
            assert!(
                b >= a - 1e-12 * a.abs(),
                "iteration {}: {a} -> {b}",
                w[1].iteration
            );
        }
        assert_eq!(m.log_likelihood, last.log_likelihood);
        // The result: 1-norm columns, weights sorted, its log-likelihood
        // the last iteration's.
        assert!(m.lambda.windows(2).all(|w| w[0] >= w[1]));
        for f in &m.factors {
            for c in f.columns() {
                assert!((c.sum() - 1.0).abs() < 1e-12);
            }
        }
        let again = log_likelihood(&t, &m.lambda, &m.factors);
        assert!((again - m.log_likelihood).abs() <= 1e-12 * again.abs());
        // The model's total equals the data's at a stationary point.
        let total: f64 = t.values().iter().map(|&v| f64::from(v)).sum();
        assert!((m.lambda.iter().sum::<f64>() - total).abs() < 1e-3 * total);
    }

    #[test]
    fn apr_kappa_raises_inadmissible_zeros() {
        let t = counts(vec![12, 10, 8], 2, 400, 8);
        let AprInit::Given { mut factors, .. } = given(&t, 2, 1) else {
            unreachable!()
        };
        // A zero entry where the data wants mass: only kappa can move it.
        let row = t.indices()[0][0] as usize;
        factors[0][[row, 0]] = 0.0;
        let mut opts = AprOptions::new(2);
        opts.init = AprInit::Given {
            factors,
            weights: None,
        };
        opts.max_iters = 3;
        opts.tol = 0.0;
        let m = cp_apr(&t, &opts, &mut |_| ControlFlow::Continue(())).unwrap();
        assert_eq!(m.iterations[0].kappa_fixes, 0);
        assert!(m.iterations[1].kappa_fixes >= 1);
        opts.kappa = 0.0;
        let m0 = cp_apr(&t, &opts, &mut |_| ControlFlow::Continue(())).unwrap();
        assert!(m.log_likelihood != m0.log_likelihood);
    }

    #[test]
    fn apr_same_result_on_any_thread_count() {
        let t = counts(vec![40, 30, 20], 3, 20_000, 2);
        let mut opts = AprOptions::new(3);
        opts.max_iters = 4;
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| cp_apr(&t, &opts, &mut |_| ControlFlow::Continue(())).unwrap())
        };
        let (a, b) = (run(1), run(3));
        assert_eq!(a.iterations.len(), b.iterations.len());
        for (x, y) in a.iterations.iter().zip(&b.iterations) {
            assert_eq!(x.log_likelihood.to_bits(), y.log_likelihood.to_bits());
        }
        assert_eq!(a.factors, b.factors);
    }

    #[test]
    fn a_shape_beyond_memory_is_refused_before_allocating() {
        // Three nonzeros, one index of 3e9: at rank 10 the f64 factors
        // alone take 240 GB.
        if crate::memory::available_bytes().is_none() {
            return; // no MemAvailable to compare with (not Linux)
        }
        let t = SparseTensor::new(
            vec![3_000_000_000, 2, 2],
            vec![vec![0, 1, 2_999_999_999], vec![0, 1, 1], vec![1, 0, 1]],
            vec![1.0, 2.0, 3.0],
        )
        .unwrap();
        let e = cp_apr(&t, &AprOptions::new(10), &mut |_| ControlFlow::Continue(())).unwrap_err();
        assert!(matches!(e, CpdError::Memory { .. }), "{e}");
        let text = e.to_string();
        assert!(
            text.starts_with("CP-APR: the run needs") && text.contains("MemAvailable"),
            "{text}"
        );
    }

    #[test]
    fn apr_refuses_what_is_not_counts() {
        let t =
            SparseTensor::new(vec![2, 2], vec![vec![0, 1], vec![1, 0]], vec![3.0, -1.0]).unwrap();
        let e = cp_apr(&t, &AprOptions::new(1), &mut |_| ControlFlow::Continue(()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("non-negative counts") && e.contains("(2, 1)") && e.contains("-1"),
            "{e}"
        );
        let t =
            SparseTensor::new(vec![2, 2], vec![vec![0, 1], vec![1, 0]], vec![3.0, 0.5]).unwrap();
        assert_eq!(non_integer_values(&t), 1);
        // Negative or misshapen initial factors, bad options.
        let mut opts = AprOptions::new(1);
        opts.init = AprInit::Given {
            factors: vec![
                Array2::from_elem((2, 1), 1.0),
                Array2::from_elem((2, 1), -1.0),
            ],
            weights: None,
        };
        let e = cp_apr(&t, &opts, &mut |_| ControlFlow::Continue(())).unwrap_err();
        assert!(e.to_string().contains("initial factor 2"), "{e}");
        opts.init = AprInit::Given {
            factors: vec![
                Array2::from_elem((2, 1), 1.0),
                Array2::from_elem((3, 1), 1.0),
            ],
            weights: None,
        };
        let e = cp_apr(&t, &opts, &mut |_| ControlFlow::Continue(())).unwrap_err();
        assert!(matches!(e, CpdError::Shape(_)), "{e}");
        for bad in [
            AprOptions {
                rank: 0,
                ..AprOptions::new(1)
            },
            AprOptions {
                kappa: -1.0,
                ..AprOptions::new(1)
            },
            AprOptions {
                eps_div_zero: 0.0,
                ..AprOptions::new(1)
            },
            AprOptions {
                max_inner_iters: 0,
                ..AprOptions::new(1)
            },
        ] {
            assert!(matches!(
                cp_apr(&t, &bad, &mut |_| ControlFlow::Continue(())),
                Err(CpdError::Option(_) | CpdError::InvalidOption { .. })
            ));
        }
    }
}
