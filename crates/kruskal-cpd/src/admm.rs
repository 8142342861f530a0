//! Constrained and regularized CP by AO-ADMM (Huang, Sidiropoulos and
//! Liavas, "A flexible and efficient algorithmic framework for constrained
//! matrix and tensor factorization", IEEE TSP 2016; as accelerated by Smith,
//! Beri and Karypis, "Constrained tensor factorization with accelerated
//! AO-ADMM", ICPP 2017): the alternating structure of CPD-ALS, each factor
//! found by ADMM instead of an exact solve.
//!
//! The objective, per run:
//!
//! `0.5 ||X - [[lambda; A_1, ..., A_N]]||_F^2 + sum_n r_n(A_n)`,
//! `r_n(A) = l1 ||A||_1 + l2 ||A||_F^2 (+ the indicator of A >= 0 on the
//! non-negative modes)`.
//!
//! For each outer iteration and each mode n (H = `A_n`, U its scaled dual,
//! both `I_n x R` in f64, kept for every mode and warm-started from the
//! previous outer iteration; on the host, or on the device where the
//! backend runs the inner loop itself, [`Backend::runs_admm`]). The first
//! outer iteration starts cold, from H = U = 0: the initial factors enter
//! through the other modes' Grams and MTTKRPs only. (A warm start from
//! random factors is off the solution's scale by the Gram's size, 1e8 on
//! a tensor with 1e5-row modes: the inner loop's 50 iterations did not
//! undo it, and a whole factor could come out 0.)
//! 1. `K = MTTKRP(X, n)` (the backend's; copied to the host for the host's
//!    loop), `G = hadamard(A_w^T A_w for w != n)`;
//! 2. `rho = sqrt(lambda_min lambda_max)` of G's eigenvalues ([`penalty`];
//!    the paper's `trace(G) / R` left most blocks at the inner limit), and
//!    `W = (G + rho I)^{-1}` by one Cholesky (`dense::solve_matrix`), on
//!    the host (R x R);
//! 3. every row whose K is all zero (a row no nonzero touches: most rows
//!    of a long sparse mode) gets H = U = 0, its exact solution, which the
//!    iteration keeps (see `zero_rows_without_data`); then up to
//!    `max_inner_iters` times: `Ht = (K + rho (H + U)) W`,
//!    `H_prev = H`, `H = prox(Ht - U)`, `U += H - Ht`; stop when the primal
//!    residual `||H - Ht||^2 / ||H||^2` and the dual residual
//!    `||H - H_prev||^2 / ||U||^2` are both at most `eps`, summed over the
//!    rows that stop together ([`InnerStop`]): all the mode's rows (the
//!    CPU's default), or each row on its own (the paper's blocked variant
//!    with blocks of [`BLOCK_ROWS`] = one row: most rows stop after a few
//!    iterations);
//! 4. the columns of H are normalized into lambda as ALS does (2-norms on
//!    the first iteration, `max(1, max |a|)` afterwards, from the f32
//!    rounding of H; U is divided by the same weights, so it stays H's
//!    dual), and the f32 rounding of H becomes the new factor.
//!
//! On one GPU (`GpuBackend`) the whole of step 3 is one kernel launch per
//! mode (`kruskal_device::admm`, `kernels/admm.cu`): always each row on
//! its own, a warp keeping several rows of K, H and U in registers across
//! their inner iterations and taking the next row as one stops; only W
//! goes up and the column statistics come back.
//! Step 4 divides H and U on the device and writes the factor there. On a
//! group of GPUs (`GroupBackend`, one process) each GPU runs the same
//! launch on the rows it owns (its H and U only), the statistics and
//! partial Grams are summed on the host, and the rows are exchanged after
//! step 4 as ALS's are (every row, though an empty row's is 0). The
//! CPU's [`InnerStop::RowBlocks`] runs the same blocks to the same rule,
//! which the GPU tests compare against.
//!
//! The proximal step `prox(v) = argmin_h r(h) + (rho / 2) (h - v)^2`, per
//! entry, for the objective above:
//! `prox(v) = S(v, l1 / rho) / (1 + 2 l2 / rho)`, with
//! `S(v, t) = sign(v) max(|v| - t, 0)` the soft threshold; on a
//! non-negative mode `prox(v) = max(v - l1 / rho, 0) / (1 + 2 l2 / rho)`.
//!
//! The normalization of step 4 keeps the run comparable with ALS (and
//! leaves a non-negative factor non-negative), but it also rescales the
//! penalty's argument: with `l1` or `l2` above 0 the run lowers the
//! objective mode by mode, not the objective of the final scaled model.
//!
//! The fit is ALS's: `1 - ||X - M|| / ||X||` from the Grams, lambda and the
//! last mode's MTTKRP. The rows are independent in step 3; on the CPU they
//! are updated in blocks in parallel and the residuals summed in block
//! order (or each row alone), so the result does not depend on the
//! thread count. With rows on their own, an iteration's `inner_iters`
//! counts the row that ran most.
//!
//! Memory beyond ALS's: H, U and K in f64, `3 * dims[n] * R * 8` bytes per
//! mode on the host (H and U kept for every mode); on one GPU, H and U of
//! every mode on the device, and an f32 copy of a mode's rows with data
//! for their Gram (`memory::admm_gpu_need`), and nothing sized by the rows
//! on the host.

use std::ops::ControlFlow;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use kruskal_device::admm::InnerParams;
use ndarray::Array2;
use rayon::prelude::*;

use crate::CpdOptions;
use crate::als::{ModeUpdate, Update, column_stats, column_weights, drive};
use crate::backend::Backend;
use crate::dense::{SolveKind, hadamard_except, solve_matrix};
use crate::error::{CpdError, OptionName, Result};
use crate::model::{IterationStats, KruskalModel};
use kruskal_formats::SparseTensor;
use std::sync::Arc;

/// Default limit of ADMM iterations per mode update (the paper's 50).
pub const DEFAULT_MAX_INNER_ITERS: usize = 50;
/// Default bound on the relative primal and dual residuals (the paper's
/// 1e-2).
pub const DEFAULT_EPS: f64 = 1e-2;

/// Rows handled by one task of the ADMM's row-wise passes.
pub(crate) const ROWS_PER_TASK: usize = 1024;

/// Rows of one block of the blocked inner loop ([`InnerStop::RowBlocks`]),
/// the GPU's too (`kruskal_device::admm::BLOCK_ROWS`): one, every row to
/// its own rule.
pub use kruskal_device::admm::BLOCK_ROWS;

// A task holds whole blocks, so the blocks do not depend on the tasks
// (whatever BLOCK_ROWS is; with one row, trivially).
#[allow(clippy::modulo_one)]
const _: () = assert!(ROWS_PER_TASK % BLOCK_ROWS == 0);

/// Per mode, the rows that hold a nonzero of the tensor, in increasing
/// order: the rows AO-ADMM's inner loop runs on where the backend has them
/// ([`Backend::set_data_rows`]). Every other row's MTTKRP is 0, and so is
/// its solution (see `zero_rows_without_data`): its H, U and factor row
/// stay 0 without a pass over them. On nell-1's third mode at 20M nonzeros
/// that is 2.6M rows of 25.5M.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataRows {
    dims: Vec<u32>,
    /// Per mode; `None` where every row holds a nonzero.
    modes: Vec<Option<Vec<u32>>>,
}

impl DataRows {
    /// The rows with a nonzero of each mode of `t` (a coordinate with the
    /// value 0 counts: its row's MTTKRP is 0 and the zero rule applies).
    /// One pass over each mode's indices, marking a bitmap in parallel.
    pub fn of(t: &SparseTensor) -> Self {
        let modes = (0..t.nmodes())
            .map(|m| rows_marked(t.mode_indices(m), t.dims()[m]))
            .collect();
        Self::from_modes(t.dims().to_vec(), modes)
    }

    /// From given lists (each strictly increasing and below its mode's
    /// length); errors otherwise.
    pub fn new(dims: Vec<u32>, modes: Vec<Vec<u32>>) -> Result<Self> {
        if modes.len() != dims.len() {
            return Err(CpdError::Backend(format!(
                "rows with data for {} modes of a {}-mode tensor",
                modes.len(),
                dims.len()
            )));
        }
        for (m, (list, &dim)) in modes.iter().zip(&dims).enumerate() {
            if list.windows(2).any(|w| w[0] >= w[1]) || list.last().is_some_and(|&r| r >= dim) {
                return Err(CpdError::Backend(format!(
                    "the rows with data of mode {} are not increasing rows below {dim}",
                    m + 1
                )));
            }
        }
        Ok(Self::from_modes(dims, modes))
    }

    fn from_modes(dims: Vec<u32>, modes: Vec<Vec<u32>>) -> Self {
        let modes = modes
            .into_iter()
            .zip(&dims)
            .map(|(list, &dim)| (list.len() < dim as usize).then_some(list))
            .collect();
        DataRows { dims, modes }
    }

    /// The rows of `mode` the loop runs on: `None` for every row.
    pub fn mode(&self, mode: usize) -> Option<&[u32]> {
        self.modes.get(mode).and_then(|l| l.as_deref())
    }

    /// Rows the loop runs on in `mode`.
    pub fn count(&self, mode: usize) -> usize {
        self.mode(mode)
            .map_or(self.dims[mode] as usize, <[u32]>::len)
    }

    /// Errors unless these are a tensor of `dims`' rows.
    pub fn check(&self, dims: &[u32]) -> Result<()> {
        if self.dims != dims {
            return Err(CpdError::Backend(format!(
                "rows with data of a {:?} tensor for a {dims:?} one",
                self.dims
            )));
        }
        Ok(())
    }
}

/// The distinct values of `indices` (each below `dim`), increasing: a
/// bitmap of `dim` bits marked in parallel (a word is read before it is
/// marked, so a hot row costs no contended writes), then read out.
fn rows_marked(indices: &[u32], dim: u32) -> Vec<u32> {
    use std::sync::atomic::{AtomicU64, Ordering};
    let words: Vec<AtomicU64> = (0..(dim as usize).div_ceil(64))
        .map(|_| AtomicU64::new(0))
        .collect();
    indices.par_chunks(1 << 16).for_each(|chunk| {
        for &i in chunk {
            let (word, bit) = (&words[i as usize / 64], 1u64 << (i % 64));
            if word.load(Ordering::Relaxed) & bit == 0 {
                word.fetch_or(bit, Ordering::Relaxed);
            }
        }
    });
    let words: Vec<u64> = words.into_iter().map(AtomicU64::into_inner).collect();
    words
        .par_chunks(1 << 12)
        .enumerate()
        .map(|(c, chunk)| {
            let mut out = Vec::new();
            for (w, &bits) in chunk.iter().enumerate() {
                let mut bits = bits;
                let base = ((c << 12) + w) as u32 * 64;
                while bits != 0 {
                    out.push(base + bits.trailing_zeros());
                    bits &= bits - 1;
                }
            }
            out
        })
        .collect::<Vec<_>>()
        .concat()
}

/// Which rows share the inner loop's stopping rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InnerStop {
    /// Every row of the mode runs until the whole factor's residuals meet
    /// `eps` (the default on the CPU).
    #[default]
    AllRows,
    /// Each block of [`BLOCK_ROWS`] rows (one: each row) runs until its
    /// own residuals meet `eps` (the paper's blocked variant); a one-GPU
    /// run always runs this.
    RowBlocks,
}

impl InnerStop {
    /// A few words for output: "all rows together", "each row on its own".
    pub fn describe(self) -> String {
        match self {
            InnerStop::AllRows => "all rows together".into(),
            InnerStop::RowBlocks => "each row on its own".into(),
        }
    }
}

/// Which modes' factors are kept non-negative.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NonNeg {
    None,
    All,
    /// These modes, numbered from 0.
    Modes(Vec<usize>),
}

impl NonNeg {
    /// Whether `mode` (from 0) is kept non-negative.
    pub fn holds(&self, mode: usize) -> bool {
        match self {
            NonNeg::None => false,
            NonNeg::All => true,
            NonNeg::Modes(m) => m.contains(&mode),
        }
    }
}

/// Constraints and regularization of an AO-ADMM run (see the module's
/// objective). `l1` and `l2` apply to every mode.
#[derive(Clone, Debug, PartialEq)]
pub struct AdmmOptions {
    pub nonneg: NonNeg,
    /// Weight of `||A_n||_1`.
    pub l1: f64,
    /// Weight of `||A_n||_F^2`.
    pub l2: f64,
    pub max_inner_iters: usize,
    pub eps: f64,
    /// Which rows stop together on the CPU (a GPU always runs each row on
    /// its own).
    pub inner: InnerStop,
}

impl Default for AdmmOptions {
    /// No constraint, no penalty, the paper's inner limit and tolerance.
    fn default() -> Self {
        AdmmOptions {
            nonneg: NonNeg::None,
            l1: 0.0,
            l2: 0.0,
            max_inner_iters: DEFAULT_MAX_INNER_ITERS,
            eps: DEFAULT_EPS,
            inner: InnerStop::AllRows,
        }
    }
}

impl AdmmOptions {
    /// Non-negative factors in every mode, no penalty.
    pub fn nonneg() -> Self {
        AdmmOptions {
            nonneg: NonNeg::All,
            ..Self::default()
        }
    }

    /// Refuses weights that are negative or not finite, an inner limit of
    /// 0, and modes beyond the tensor's.
    pub fn check(&self, nmodes: usize) -> Result<()> {
        self.check_weights()?;
        if let NonNeg::Modes(modes) = &self.nonneg {
            if let Some(&m) = modes.iter().find(|&&m| m >= nmodes) {
                // Modes counted from 1, as FROSTT files count them.
                return Err(CpdError::option(
                    OptionName::Nonneg,
                    format!("names mode {}, and the tensor has {nmodes} modes", m + 1),
                ));
            }
        }
        Ok(())
    }

    /// What [`AdmmOptions::check`] checks without the tensor: the weights
    /// and the inner limit.
    pub fn check_weights(&self) -> Result<()> {
        for (option, w) in [(OptionName::L1, self.l1), (OptionName::L2, self.l2)] {
            if !(w.is_finite() && w >= 0.0) {
                return Err(CpdError::option_value(option, w, "must be finite and >= 0"));
            }
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(CpdError::Option(format!(
                "eps {} must be finite and >= 0",
                self.eps
            )));
        }
        if self.max_inner_iters == 0 {
            return Err(CpdError::Option(
                "the inner iteration limit must be at least 1".into(),
            ));
        }
        Ok(())
    }

    /// One line for output: "non-negative (modes 1, 3), l1 0.1".
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        match &self.nonneg {
            NonNeg::None => {}
            NonNeg::All => parts.push("non-negative (all modes)".to_string()),
            NonNeg::Modes(m) => parts.push(format!(
                "non-negative (mode{} {})",
                if m.len() > 1 { "s" } else { "" },
                m.iter()
                    .map(|m| (m + 1).to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
        if self.l1 > 0.0 {
            parts.push(format!("l1 {}", self.l1));
        }
        if self.l2 > 0.0 {
            parts.push(format!("l2 {}", self.l2));
        }
        if parts.is_empty() {
            parts.push("unconstrained".into());
        }
        parts.join(", ")
    }
}

/// The ADMM penalty rho for `G` (the Hadamard product of the other modes'
/// Grams, before rho is added): `sqrt(lambda_min lambda_max)` of G's
/// eigenvalues, the penalty under which ADMM on a strongly convex
/// quadratic converges fastest (Ghadimi, Teixeira, Shames and Johansson,
/// "Optimal parameter selection for the alternating direction method of
/// multipliers", IEEE TAC 2015). The paper's `trace(G) / R` is the mean
/// eigenvalue; the Gram of non-negative factors has one large eigenvalue
/// and many small ones, and the error along an eigenvector of eigenvalue
/// `l` shrinks by `rho / (l + rho)` per inner iteration, so with the mean
/// most directions barely moved: blocks ran to the 50-iteration limit and
/// the fit per outer iteration was lower (see `docs/performance.md`).
///
/// `lambda_min` is taken as at least `1e-4 lambda_max`, so rho is at
/// least `lambda_max / 100`: a singular G (a mode of one row makes its
/// Gram rank one) would otherwise give a rho near 0, and `W = (G + rho
/// I)^{-1}` would multiply the last bits of K by `1 / rho` (a group of
/// GPUs, whose MTTKRP sums in another order, then ended with other
/// factors than one GPU). Where G is 0 (all-zero other factors) or its
/// eigenvalues cannot be found, the mean eigenvalue, or 1: any rho > 0
/// keeps the system solvable.
///
/// Cost: one symmetric eigenvalue decomposition of `R x R`.
pub fn penalty(g: &Array2<f64>) -> f64 {
    let rank = g.nrows();
    let trace: f64 = (0..rank).map(|r| g[[r, r]]).sum();
    let mean = if trace > 0.0 && trace.is_finite() {
        trace / rank as f64
    } else {
        return 1.0;
    };
    let gf = faer::Mat::<f64>::from_fn(rank, rank, |i, j| g[[i, j]]);
    match gf.self_adjoint_eigenvalues(faer::Side::Lower) {
        Ok(ev) => {
            let (low, high) = (ev[0], ev[rank - 1]);
            let rho = (low.max(1e-4 * high) * high).sqrt();
            if high > 0.0 && rho.is_finite() && rho > 0.0 {
                rho
            } else {
                mean
            }
        }
        Err(_) => mean,
    }
}

/// The proximal operator of one mode's penalty at a given rho.
#[derive(Clone, Copy, Debug)]
struct Prox {
    nonneg: bool,
    /// `l1 / rho`.
    threshold: f64,
    /// `1 / (1 + 2 l2 / rho)`.
    shrink: f64,
}

impl Prox {
    fn new(nonneg: bool, l1: f64, l2: f64, rho: f64) -> Self {
        Prox {
            nonneg,
            threshold: l1 / rho,
            shrink: 1.0 / (1.0 + 2.0 * l2 / rho),
        }
    }

    fn apply(self, v: f64) -> f64 {
        let t = if self.nonneg {
            (v - self.threshold).max(0.0)
        } else if v > self.threshold {
            v - self.threshold
        } else if v < -self.threshold {
            v + self.threshold
        } else {
            0.0
        };
        t * self.shrink
    }
}

impl From<&InnerParams> for Prox {
    fn from(p: &InnerParams) -> Self {
        Prox {
            nonneg: p.nonneg,
            threshold: p.threshold,
            shrink: p.shrink,
        }
    }
}

/// One mode's inner-loop parameters: the proximal step of `l1`, `l2` and
/// non-negativity at `rho`, `max_inner` iterations at most (u32's largest
/// beyond it) and the residuals' bound `eps`. What a run hands the loop,
/// on the host or on a GPU.
#[doc(hidden)]
pub fn inner_params(
    nonneg: bool,
    l1: f64,
    l2: f64,
    rho: f64,
    max_inner: usize,
    eps: f64,
) -> InnerParams {
    let prox = Prox::new(nonneg, l1, l2, rho);
    InnerParams {
        rho,
        nonneg: prox.nonneg,
        threshold: prox.threshold,
        shrink: prox.shrink,
        max_inner: u32::try_from(max_inner).unwrap_or(u32::MAX),
        eps,
    }
}

/// The proximal step of `params` applied to each entry of `v`, as the
/// host's inner loop applies it. For `kruskal check`.
#[doc(hidden)]
pub fn prox_host(params: &InnerParams, v: &[f64]) -> Vec<f64> {
    let prox = Prox::from(params);
    v.iter().map(|&x| prox.apply(x)).collect()
}

/// The host's inner loop of one mode on `h` and `u` (row-major
/// `rows x rank`, in place) from the MTTKRP `k` (the same shape) and
/// `w = (G + rho I)^{-1}` (`rank x rank`, row-major), under the stopping
/// rule `stop`: what a run on the CPU does in step 3. Returns the
/// iterations run (with rows on their own, those of the row that ran
/// most). For `kruskal check`.
///
/// Cost per iteration: `rows * rank^2` multiply-adds.
#[doc(hidden)]
pub fn inner_loop_host(
    k: &[f64],
    h: &mut [f64],
    u: &mut [f64],
    w: &[f64],
    rank: usize,
    params: &InnerParams,
    stop: InnerStop,
) -> Result<usize> {
    if rank == 0
        || k.len() % rank != 0
        || h.len() != k.len()
        || u.len() != k.len()
        || w.len() != rank * rank
    {
        return Err(CpdError::Shape(format!(
            "the inner loop at rank {rank} takes K, H and U of the same rows x rank \
             and a rank x rank W, not {}, {}, {} and {} values",
            k.len(),
            h.len(),
            u.len(),
            w.len()
        )));
    }
    if params.max_inner == 0 {
        return Err(CpdError::Option(
            "the inner iteration limit must be at least 1".into(),
        ));
    }
    Ok(admm_rows(
        k,
        h,
        u,
        w,
        rank,
        params.rho,
        Prox::from(params),
        params.max_inner as usize,
        params.eps,
        stop,
    ))
}

/// Residual sums of one inner iteration.
#[derive(Clone, Copy, Default)]
struct Residuals {
    /// `||H - Ht||^2`.
    primal: f64,
    /// `||H - H_prev||^2`.
    dual: f64,
    h: f64,
    u: f64,
}

impl Residuals {
    /// The stopping rule: both relative residuals at most `eps`.
    fn converged(self, eps: f64) -> bool {
        self.primal <= eps * self.h && self.dual <= eps * self.u
    }

    fn add(self, o: Residuals) -> Residuals {
        Residuals {
            primal: self.primal + o.primal,
            dual: self.dual + o.dual,
            h: self.h + o.h,
            u: self.u + o.u,
        }
    }
}

/// One inner iteration on a set of rows (row-major `rows x rank` slices
/// of K, H and U): `Ht = (K + rho (H + U)) W`, `H = prox(Ht - U)`,
/// `U += H - Ht`, with the residual sums of these rows in row order.
/// `rhs` and `ht` are scratch of the same length.
///
/// Cost: `rows * rank^2` multiply-adds and a few passes over the rows.
#[allow(clippy::too_many_arguments)]
fn inner_step(
    k: &[f64],
    h: &mut [f64],
    u: &mut [f64],
    w: MatRef<'_, f64>,
    rho: f64,
    prox: Prox,
    rhs: &mut [f64],
    ht: &mut [f64],
) -> Residuals {
    let rank = w.nrows();
    let rows = k.len() / rank;
    for (r, (&k, (&h, &u))) in rhs.iter_mut().zip(k.iter().zip(h.iter().zip(u.iter()))) {
        *r = k + rho * (h + u);
    }
    matmul(
        MatMut::from_row_major_slice_mut(ht, rows, rank),
        Accum::Replace,
        MatRef::from_row_major_slice(rhs, rows, rank),
        w,
        1.0,
        Par::Seq,
    );
    let mut r = Residuals::default();
    for ((h, u), &ht) in h.iter_mut().zip(u.iter_mut()).zip(ht.iter()) {
        let new = prox.apply(ht - *u);
        *u += new - ht;
        r.primal += (new - ht) * (new - ht);
        r.dual += (new - *h) * (new - *h);
        r.h += new * new;
        r.u += *u * *u;
        *h = new;
    }
    r
}

/// Sets H and U to 0 on every row whose K is all zero (a row of the mode
/// that no nonzero touches, most rows of a long sparse mode): there the
/// row's problem `min 0.5 h G h^T - k h^T + r(h)` has the exact solution
/// `h = 0` (G is positive semidefinite and every penalty is at least 0,
/// and 0 at 0), with dual `u = 0`, a fixed point of the iteration, so the
/// rows stay there. Left to the iteration from a warm start, such rows
/// only shrink geometrically towards 0, and their residuals, relative to
/// their own shrinking norms, never meet `eps`: a block of them ran to
/// `max_inner` every time. A block whose rows are all such rows now stops
/// after one iteration (all its sums are 0).
fn zero_rows_without_data(k: &[f64], h: &mut [f64], u: &mut [f64], rank: usize) {
    let chunk = ROWS_PER_TASK * rank;
    h.par_chunks_mut(chunk)
        .zip(u.par_chunks_mut(chunk))
        .zip(k.par_chunks(chunk))
        .for_each(|((h, u), k)| {
            for ((h, u), k) in h
                .chunks_exact_mut(rank)
                .zip(u.chunks_exact_mut(rank))
                .zip(k.chunks_exact(rank))
            {
                if k.iter().all(|&x| x == 0.0) {
                    h.fill(0.0);
                    u.fill(0.0);
                }
            }
        });
}

/// One mode's ADMM for `min 0.5 ||K - H G||` terms plus `prox`'s penalty:
/// runs up to `max_inner` iterations on `h` and `u` (row-major
/// `rows x rank`), from `k` (the MTTKRP, the same shape) and `w =
/// (G + rho I)^{-1}`, under the stopping rule `stop` says. Returns the
/// iterations run (with rows on their own, those of the row that ran
/// most).
///
/// Cost per iteration: `rows * rank^2` multiply-adds and a few passes over
/// `rows * rank` values.
#[allow(clippy::too_many_arguments)]
fn admm_rows(
    k: &[f64],
    h: &mut [f64],
    u: &mut [f64],
    w: &[f64],
    rank: usize,
    rho: f64,
    prox: Prox,
    max_inner: usize,
    eps: f64,
    stop: InnerStop,
) -> usize {
    let w = MatRef::from_row_major_slice(w, rank, rank);
    let chunk = ROWS_PER_TASK * rank;
    zero_rows_without_data(k, h, u, rank);
    if stop == InnerStop::RowBlocks {
        // Each block of BLOCK_ROWS rows runs to its own rule: the blocks
        // are independent, so neither the thread count nor the tasks'
        // split changes any block's iterations.
        let block = BLOCK_ROWS * rank;
        return h
            .par_chunks_mut(chunk)
            .zip(u.par_chunks_mut(chunk))
            .zip(k.par_chunks(chunk))
            .map(|((h, u), k)| {
                let mut rhs = vec![0f64; block.min(k.len())];
                let mut ht = rhs.clone();
                let mut most = 0;
                for ((h, u), k) in h
                    .chunks_mut(block)
                    .zip(u.chunks_mut(block))
                    .zip(k.chunks(block))
                {
                    let (rhs, ht) = (&mut rhs[..k.len()], &mut ht[..k.len()]);
                    let mut it = 1;
                    while !inner_step(k, h, u, w, rho, prox, rhs, ht).converged(eps)
                        && it < max_inner
                    {
                        it += 1;
                    }
                    most = most.max(it);
                }
                most
            })
            .max()
            .unwrap_or(0);
    }
    for it in 1..=max_inner {
        let r = h
            .par_chunks_mut(chunk)
            .zip(u.par_chunks_mut(chunk))
            .zip(k.par_chunks(chunk))
            .map(|((h, u), k)| {
                let mut rhs = vec![0f64; k.len()];
                let mut ht = vec![0f64; k.len()];
                inner_step(k, h, u, w, rho, prox, &mut rhs, &mut ht)
            })
            // Partials summed in block order: the stopping decision must
            // not depend on how rayon split the work.
            .collect::<Vec<_>>()
            .into_iter()
            .fold(Residuals::default(), Residuals::add);
        if r.converged(eps) {
            return it;
        }
    }
    max_inner
}

/// The `dim x rank` f32 factor whose row `list[i]` is the rounding of row
/// i of `h` (`list.len() x rank`) and whose other rows are 0. Row chunks
/// in parallel, each finding its list entries by binary search.
fn scatter_rows(h: &[f64], list: &[u32], dim: usize, rank: usize) -> Vec<f32> {
    let mut full = vec![0f32; dim * rank];
    if rank == 0 {
        return full;
    }
    full.par_chunks_mut(ROWS_PER_TASK * rank)
        .enumerate()
        .for_each(|(c, chunk)| {
            let start = c * ROWS_PER_TASK;
            let end = start + chunk.len() / rank;
            let from = list.partition_point(|&r| (r as usize) < start);
            let to = list.partition_point(|&r| (r as usize) < end);
            for (i, &r) in list[from..to].iter().enumerate() {
                let dst = (r as usize - start) * rank;
                let src = (from + i) * rank;
                for (d, &x) in chunk[dst..dst + rank].iter_mut().zip(&h[src..src + rank]) {
                    *d = x as f32;
                }
            }
        });
    full
}

/// AO-ADMM's update of one mode; keeps H and U of every mode.
struct AdmmUpdate<'a> {
    opts: &'a AdmmOptions,
    /// The backend runs the inner loop and keeps H and U
    /// ([`Backend::runs_admm`]); `h` and `u` stay empty.
    on_backend: bool,
    /// Per mode, H and U (row-major, `dims[m] x rank`, or one row per row
    /// with data where the backend has [`DataRows`]).
    h: Vec<Vec<f64>>,
    u: Vec<Vec<f64>>,
    /// The backend's rows with data ([`Backend::data_rows`]).
    rows: Option<Arc<DataRows>>,
}

impl AdmmUpdate<'_> {
    /// The rows of `mode` the host's loop runs on (`None`: every row).
    fn list(&self, mode: usize) -> Option<&[u32]> {
        self.rows.as_deref().and_then(|r| r.mode(mode))
    }
}

impl Update for AdmmUpdate<'_> {
    /// The host's loop sizes its H and U by the initial factors; a backend
    /// that runs the inner loop sizes them itself. Both start at 0.
    fn keeps_initial(&self) -> bool {
        !self.on_backend
    }

    fn keeps_sign(&self, mode: usize) -> bool {
        self.opts.nonneg.holds(mode)
    }

    fn begin(&mut self, initial: &[Array2<f32>]) {
        if self.on_backend {
            return;
        }
        // A cold start (see the module's description).
        self.h = initial
            .iter()
            .enumerate()
            .map(|(m, f)| {
                let rows = self.list(m).map_or(f.nrows(), <[u32]>::len);
                vec![0f64; rows * f.ncols()]
            })
            .collect();
        self.u = self.h.clone();
    }

    fn update(
        &mut self,
        backend: &mut dyn Backend,
        mode: usize,
        iter: usize,
        grams: &[Array2<f64>],
    ) -> Result<ModeUpdate> {
        let rank = grams[mode].nrows();
        let mut g = hadamard_except(grams, Some(mode));
        let rho = penalty(&g);
        for r in 0..rank {
            g[[r, r]] += rho;
        }
        let (w, kind) = solve_matrix(&g);
        let params = inner_params(
            self.opts.nonneg.holds(mode),
            self.opts.l1,
            self.opts.l2,
            rho,
            self.opts.max_inner_iters,
            self.opts.eps,
        );
        let prox = Prox::from(&params);
        if self.on_backend {
            let stats = backend.admm_inner(mode, &w, &params)?;
            let two: Vec<f64> = stats.sumsq.into_iter().map(f64::sqrt).collect();
            let (lambda, divisors) = column_weights(iter, two, &stats.max_abs);
            let gram = backend.admm_scale(mode, &divisors)?;
            return Ok(ModeUpdate {
                lambda,
                gram,
                inner_iters: stats.iters,
                pseudo_inverse: kind == SolveKind::PseudoInverse,
            });
        }
        let k32 = backend.mttkrp_output(mode)?;
        let dim = k32.nrows();
        // Only the rows with data, where the backend has them.
        let k: Vec<f64> = match self.list(mode) {
            Some(list) => {
                let src = k32.as_slice().expect("standard layout");
                list.par_iter()
                    .flat_map_iter(|&r| {
                        src[r as usize * rank..(r as usize + 1) * rank]
                            .iter()
                            .map(|&x| f64::from(x))
                    })
                    .collect()
            }
            None => k32.iter().map(|&x| f64::from(x)).collect(),
        };
        drop(k32);
        let w = w.as_standard_layout().into_owned();
        let w = w.as_slice().expect("standard layout");
        let (h, u) = (&mut self.h[mode], &mut self.u[mode]);
        let inner_iters = admm_rows(
            &k,
            h,
            u,
            w,
            rank,
            rho,
            prox,
            self.opts.max_inner_iters,
            self.opts.eps,
            self.opts.inner,
        );
        // The weights are those of the f32 factor, as ALS's are.
        let (two, max_abs) = {
            let rounded: Vec<f32> = h.par_iter().map(|&x| x as f32).collect();
            let (sumsq, big) = column_stats(&rounded, rank);
            let two: Vec<f64> = sumsq.into_iter().map(f64::sqrt).collect();
            let max_abs: Vec<f64> = big.iter().map(|&b| f64::from(b.abs())).collect();
            (two, max_abs)
        };
        let (lambda, divisors) = column_weights(iter, two, &max_abs);
        let inv: Vec<f64> = divisors.iter().map(|d| 1.0 / d).collect();
        let chunk = ROWS_PER_TASK * rank;
        h.par_chunks_mut(chunk)
            .zip(u.par_chunks_mut(chunk))
            .for_each(|(h, u)| {
                for (row_h, row_u) in h.chunks_exact_mut(rank).zip(u.chunks_exact_mut(rank)) {
                    for ((x, y), s) in row_h.iter_mut().zip(row_u.iter_mut()).zip(&inv) {
                        *x *= s;
                        *y *= s;
                    }
                }
            });
        let factor: Vec<f32> = match self.rows.as_deref().and_then(|r| r.mode(mode)) {
            // The other rows are 0.
            Some(list) => scatter_rows(h, list, dim, rank),
            None => h.par_iter().map(|&x| x as f32).collect(),
        };
        let factor = Array2::from_shape_vec((dim, rank), factor)
            .map_err(|e| CpdError::Backend(e.to_string()))?;
        backend.set_factor(mode, factor)?;
        let gram = backend.gram(mode)?;
        Ok(ModeUpdate {
            lambda,
            gram,
            inner_iters,
            pseudo_inverse: kind == SolveKind::PseudoInverse,
        })
    }
}

/// Runs AO-ADMM without progress reports. See [`cpd_admm_with`].
pub fn cpd_admm(
    backend: &mut dyn Backend,
    opts: &CpdOptions,
    admm: &AdmmOptions,
) -> Result<KruskalModel> {
    cpd_admm_with(backend, opts, admm, &mut |_| ControlFlow::Continue(()))
}

/// Runs AO-ADMM with the rank, iteration limit, tolerance on the fit's
/// change and initial factors of `opts` (its `constraints` are ignored:
/// `admm` rules), calling `on_iteration` after every outer iteration as
/// [`crate::cpd_als_with`] does. The backend must provide
/// [`Backend::mttkrp_output`] and [`Backend::set_factor`] (the CPU backend
/// does).
pub fn cpd_admm_with(
    backend: &mut dyn Backend,
    opts: &CpdOptions,
    admm: &AdmmOptions,
    on_iteration: &mut dyn FnMut(&IterationStats) -> ControlFlow<()>,
) -> Result<KruskalModel> {
    admm.check(backend.dims().len())?;
    let mut update = AdmmUpdate {
        opts: admm,
        on_backend: backend.runs_admm(),
        h: Vec::new(),
        u: Vec::new(),
        rows: backend.data_rows(),
    };
    drive(backend, opts, &mut update, on_iteration)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;
    use crate::score::factor_match_score;
    use crate::{Init, cpd_als};
    use kruskal_formats::generate::{PlantedSpec, planted};

    fn noisy(seed: u64) -> kruskal_formats::generate::Planted {
        planted(&PlantedSpec {
            dims: vec![40, 53, 66],
            rank: 4,
            nnz: 16_000,
            noise: 0.05,
            seed,
        })
        .unwrap()
    }

    /// `noisy(seed)`'s tensor with every `every`-th value negated (mixed
    /// signs: ALS would give negative entries).
    fn signs_mixed(seed: u64, every: usize) -> kruskal_formats::SparseTensor {
        let t = noisy(seed).tensor;
        let vals: Vec<f32> = t
            .values()
            .iter()
            .enumerate()
            .map(|(i, &v)| if i % every == 0 { -v } else { v })
            .collect();
        kruskal_formats::SparseTensor::new(t.dims().to_vec(), t.indices().to_vec(), vals).unwrap()
    }

    fn options(rank: usize, iters: usize, tol: f64) -> CpdOptions {
        let mut o = CpdOptions::new(rank);
        o.max_iters = iters;
        o.tol = tol;
        o
    }

    #[test]
    fn prox_formulas() {
        let p = Prox::new(false, 1.0, 0.5, 2.0); // threshold 0.5, shrink 1/1.5
        assert!((p.apply(2.0) - 1.5 / 1.5).abs() < 1e-15);
        assert!((p.apply(-2.0) + 1.0).abs() < 1e-15);
        assert_eq!(p.apply(0.3), 0.0);
        let n = Prox::new(true, 1.0, 0.0, 2.0);
        assert_eq!(n.apply(-3.0), 0.0);
        assert!((n.apply(3.0) - 2.5).abs() < 1e-15);
        // The l2 prox minimizes l2 h^2 + rho/2 (h - v)^2: derivative zero.
        let (l2, rho, v) = (0.7, 1.3, 2.1);
        let h = Prox::new(false, 0.0, l2, rho).apply(v);
        assert!((2.0 * l2 * h + rho * (h - v)).abs() < 1e-12);
    }

    #[test]
    fn nonneg_factors_have_no_negative_entry() {
        // A tensor with negative values: unconstrained ALS gives negative
        // entries, the non-negative run must not.
        let p = noisy(7);
        let mut t = p.tensor.clone();
        let neg = t.values().iter().map(|&v| -v).collect::<Vec<_>>();
        let half = neg.len() / 2;
        let mut vals = t.values().to_vec();
        vals[..half].copy_from_slice(&neg[..half]);
        t = kruskal_formats::SparseTensor::new(t.dims().to_vec(), t.indices().to_vec(), vals)
            .unwrap();
        let opts = options(4, 20, 0.0);
        let als = cpd_als(&mut CpuBackend::new(&t), &opts).unwrap();
        assert!(als.factors.iter().any(|f| f.iter().any(|&x| x < 0.0)));
        let model = cpd_admm(&mut CpuBackend::new(&t), &opts, &AdmmOptions::nonneg()).unwrap();
        for (m, f) in model.factors.iter().enumerate() {
            assert!(f.iter().all(|&x| x >= 0.0), "mode {}", m + 1);
        }
        assert!(model.lambda.iter().all(|&l| l >= 0.0));
        assert!(model.fit() > 0.0, "fit {}", model.fit());
    }

    #[test]
    fn nonneg_on_chosen_modes_only() {
        let t = signs_mixed(8, 3);
        let admm = AdmmOptions {
            nonneg: NonNeg::Modes(vec![0, 2]),
            ..AdmmOptions::default()
        };
        let model = cpd_admm(&mut CpuBackend::new(&t), &options(4, 15, 0.0), &admm).unwrap();
        assert!(model.factors[0].iter().all(|&x| x >= 0.0));
        assert!(model.factors[2].iter().all(|&x| x >= 0.0));
        assert!(model.factors[1].iter().any(|&x| x < 0.0));
    }

    /// The final arrangement fixes signs in the free modes only, whatever
    /// `CpdOptions::constraints` says: `cpd_admm` takes the constraints
    /// apart from `opts` (here `None`), and a free mode whose column's
    /// largest entry is negative used to hand its flip to the last mode,
    /// non-negative or not.
    #[test]
    fn nonneg_modes_keep_their_signs_when_a_free_mode_is_flipped() {
        let admm = AdmmOptions {
            nonneg: NonNeg::Modes(vec![0, 2]),
            l1: 0.1,
            ..AdmmOptions::default()
        };
        let mut flipped = 0;
        for seed in 1..=10 {
            let t = signs_mixed(seed, 3);
            let opts = options(4, 8, 0.0);
            assert!(opts.constraints.is_none());
            let model = cpd_admm(&mut CpuBackend::new(&t), &opts, &admm).unwrap();
            for m in [0, 2] {
                assert!(
                    model.factors[m].iter().all(|&x| x >= 0.0),
                    "seed {seed}: mode {m} has a negative entry"
                );
            }
            // A free column whose largest entry came out negative: the
            // flip the arrangement must not move onto mode 2.
            let free = &model.factors[1];
            if (0..4).any(|r| {
                let col = free.column(r);
                let big = col
                    .iter()
                    .fold(0f32, |b, &x| if x.abs() > b.abs() { x } else { b });
                big < 0.0
            }) {
                flipped += 1;
            }
        }
        assert!(
            flipped > 0,
            "no run kept a free column led by a negative entry"
        );
    }

    #[test]
    fn recovers_a_planted_nonnegative_tensor_with_noise() {
        let p = noisy(3);
        // The planted factors are non-negative.
        assert!(p.factors.iter().all(|f| f.iter().all(|&x| x >= 0.0)));
        let model = cpd_admm(
            &mut CpuBackend::new(&p.tensor),
            &options(4, 200, 1e-8),
            &AdmmOptions::nonneg(),
        )
        .unwrap();
        let fms = factor_match_score(&model.lambda, &model.factors, &p.lambda, &p.factors);
        eprintln!("non-negative: factor match {fms}, fit {}", model.fit());
        assert!(fms >= 0.99, "factor match {fms}, fit {}", model.fit());
    }

    #[test]
    fn unconstrained_admm_reaches_the_fit_of_als_from_the_same_start() {
        let p = noisy(5);
        let opts = options(4, 300, 1e-10);
        let als = cpd_als(&mut CpuBackend::new(&p.tensor), &opts).unwrap();
        let admm = cpd_admm(
            &mut CpuBackend::new(&p.tensor),
            &opts,
            &AdmmOptions::default(),
        )
        .unwrap();
        let (a, b) = (als.fit(), admm.fit());
        eprintln!("fit: ALS {a}, unconstrained AO-ADMM {b}");
        // Both converge to the same stationary point from the same start
        // (measured: 3e-8 apart); 1e-6 leaves room for the f32 factors'
        // rounding (about 1e-7 relative) and the last iterations' steps.
        assert!((a - b).abs() < 1e-6, "ALS {a}, ADMM {b}");
    }

    #[test]
    fn l1_gives_more_exact_zeros() {
        let p = noisy(9);
        let opts = options(4, 30, 0.0);
        let zeros = |m: &KruskalModel| {
            m.factors
                .iter()
                .map(|f| f.iter().filter(|&&x| x == 0.0).count())
                .sum::<usize>()
        };
        let plain = cpd_admm(
            &mut CpuBackend::new(&p.tensor),
            &opts,
            &AdmmOptions::nonneg(),
        )
        .unwrap();
        let sparse = cpd_admm(
            &mut CpuBackend::new(&p.tensor),
            &opts,
            &AdmmOptions {
                l1: 5.0,
                ..AdmmOptions::nonneg()
            },
        )
        .unwrap();
        let (z0, z1) = (zeros(&plain), zeros(&sparse));
        eprintln!(
            "exact zeros: {z0} without l1, {z1} with l1 5 (fit {})",
            sparse.fit()
        );
        assert!(z1 > z0 + 10, "zeros without l1 {z0}, with l1 {z1}");
        assert!(sparse.fit() > 0.5, "fit with l1 {}", sparse.fit());
    }

    #[test]
    fn constraints_in_the_options_run_admm_and_bad_weights_are_refused() {
        let p = noisy(4);
        let mut opts = options(4, 5, 0.0);
        opts.init = Init::Random { seed: 3 };
        opts.constraints = Some(AdmmOptions::nonneg());
        let via_als = cpd_als(&mut CpuBackend::new(&p.tensor), &opts).unwrap();
        let direct = cpd_admm(
            &mut CpuBackend::new(&p.tensor),
            &opts,
            &AdmmOptions::nonneg(),
        )
        .unwrap();
        assert_eq!(via_als.factors, direct.factors);
        assert!(via_als.iterations.iter().all(|s| s.inner_iters >= 3));
        for bad in [
            AdmmOptions {
                l1: -1.0,
                ..AdmmOptions::default()
            },
            AdmmOptions {
                l2: f64::NAN,
                ..AdmmOptions::default()
            },
            AdmmOptions {
                nonneg: NonNeg::Modes(vec![3]),
                ..AdmmOptions::default()
            },
        ] {
            let err = cpd_admm(&mut CpuBackend::new(&p.tensor), &opts, &bad).unwrap_err();
            assert!(matches!(err, CpdError::InvalidOption { .. }), "{err}");
            assert!(!err.to_string().contains("--"), "{err}");
        }
    }

    fn blocked(admm: AdmmOptions) -> AdmmOptions {
        AdmmOptions {
            inner: InnerStop::RowBlocks,
            ..admm
        }
    }

    #[test]
    fn row_blocks_keep_nonneg_modes_nonnegative_and_converge() {
        let t = signs_mixed(11, 4);
        let admm = blocked(AdmmOptions {
            nonneg: NonNeg::Modes(vec![0, 1]),
            l1: 0.05,
            ..AdmmOptions::default()
        });
        let model = cpd_admm(&mut CpuBackend::new(&t), &options(4, 15, 0.0), &admm).unwrap();
        assert!(model.factors[0].iter().all(|&x| x >= 0.0));
        assert!(model.factors[1].iter().all(|&x| x >= 0.0));
        assert!(model.factors[2].iter().any(|&x| x < 0.0));
        assert!(model.iterations.iter().all(|s| s.inner_iters >= 1));

        // On the planted non-negative tensor the blocked run finds the
        // planted factors as the global rule does.
        let p = noisy(3);
        let model = cpd_admm(
            &mut CpuBackend::new(&p.tensor),
            &options(4, 200, 1e-8),
            &blocked(AdmmOptions::nonneg()),
        )
        .unwrap();
        let fms = factor_match_score(&model.lambda, &model.factors, &p.lambda, &p.factors);
        eprintln!(
            "blocked non-negative: factor match {fms}, fit {}",
            model.fit()
        );
        assert!(fms >= 0.99, "factor match {fms}, fit {}", model.fit());
        assert!(model.converged);
    }

    #[test]
    fn each_row_alone_is_the_global_rule_on_that_row_and_rows_stop_apart() {
        // The blocked loop on 40 rows equals the global loop run on each
        // row by itself, and reports the most iterations of any row.
        let (rank, rows) = (5, 40);
        let mut x = 99u64;
        let mut next = || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 11) as f64 / (1u64 << 53) as f64
        };
        // A mode's problem: G = B^T B, K = H* G for an H* with some
        // negative entries, W = (G + rho I)^{-1}, H and U from elsewhere.
        let b = Array2::from_shape_fn((8, rank), |_| next());
        let mut g = b.t().dot(&b);
        let rho = penalty(&g);
        let hstar = Array2::from_shape_fn((rows, rank), |_| 1.2 * next() - 0.2);
        let k: Vec<f64> = hstar.dot(&g).iter().copied().collect();
        let h0: Vec<f64> = (0..rows * rank).map(|_| next()).collect();
        let u0: Vec<f64> = (0..rows * rank).map(|_| 0.1 * next() - 0.05).collect();
        for r in 0..rank {
            g[[r, r]] += rho;
        }
        let w: Vec<f64> = solve_matrix(&g).0.iter().copied().collect();
        let p = inner_params(true, 0.01, 0.0, rho, 50, 1e-2);
        let (mut h, mut u) = (h0.clone(), u0.clone());
        let most = inner_loop_host(&k, &mut h, &mut u, &w, rank, &p, InnerStop::RowBlocks).unwrap();
        let mut counts = Vec::new();
        for r in 0..rows {
            let at = r * rank..(r + 1) * rank;
            let (mut hr, mut ur) = (h0[at.clone()].to_vec(), u0[at.clone()].to_vec());
            let it = inner_loop_host(
                &k[at.clone()],
                &mut hr,
                &mut ur,
                &w,
                rank,
                &p,
                InnerStop::AllRows,
            )
            .unwrap();
            assert_eq!(hr, h[at.clone()], "row {r}: H");
            assert_eq!(ur, u[at], "row {r}: U");
            counts.push(it);
        }
        assert_eq!(most, *counts.iter().max().unwrap());
        // The rows stop apart: not all after the same count.
        assert!(counts.iter().any(|&c| c != most), "{counts:?}");
        let opts = options(3, 6, 0.0);
        let run = |t: &kruskal_formats::SparseTensor, admm: &AdmmOptions| {
            cpd_admm(&mut CpuBackend::new(t), &opts, admm).unwrap()
        };
        // A whole run: the rows stopping apart give other factors than the
        // global rule, at a fit close to it.
        let p = noisy(6);
        let global = run(&p.tensor, &AdmmOptions::nonneg());
        let blocks = run(&p.tensor, &blocked(AdmmOptions::nonneg()));
        assert_ne!(global.factors, blocks.factors);
        for (g, b) in global.iterations.iter().zip(&blocks.iterations) {
            assert!((g.fit - b.fit).abs() < 0.05, "fits {} {}", g.fit, b.fit);
        }
    }

    #[test]
    fn the_penalty_is_the_geometric_mean_of_the_extreme_eigenvalues() {
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1e-300);
        // Eigenvalues 1, 4 and 100.
        let g = ndarray::arr2(&[[4.0, 0.0, 0.0], [0.0, 100.0, 0.0], [0.0, 0.0, 1.0]]);
        assert!(close(penalty(&g), 10.0), "{}", penalty(&g));
        // Rotated: eigenvalues 1 and 9 of [[5, 4], [4, 5]].
        let g = ndarray::arr2(&[[5.0, 4.0], [4.0, 5.0]]);
        assert!(close(penalty(&g), 3.0), "{}", penalty(&g));
        // Singular: eigenvalues 0 and 2, the smallest taken as 2e-4.
        let g = ndarray::arr2(&[[1.0, 1.0], [1.0, 1.0]]);
        assert!(close(penalty(&g), 0.02), "{}", penalty(&g));
        // Ill-conditioned: eigenvalues 1e-6 and 1, the smallest as 1e-4.
        let g = ndarray::arr2(&[[1.0, 0.0], [0.0, 1e-6]]);
        assert!(close(penalty(&g), 0.01), "{}", penalty(&g));
        // Zero or not finite: 1.
        assert_eq!(penalty(&Array2::zeros((3, 3))), 1.0);
        assert_eq!(penalty(&ndarray::arr2(&[[f64::NAN]])), 1.0);
    }

    /// A long mode whose rows mostly hold no nonzero, and random initial
    /// factors far off the solution's scale (the Gram of a 250,000-row
    /// factor): the run neither collapses to a zero model nor spends the
    /// inner limit on the empty rows, whose rows of H are exactly 0. (With
    /// a warm start from those factors its fit was 0 after the first
    /// outer iteration, and the all-empty blocks ran to the limit.)
    #[test]
    fn empty_rows_are_zero_and_cost_one_iteration() {
        let dims = [300u32, 200, 250_000];
        let (mut idx, mut vals) = (vec![Vec::new(); 3], Vec::new());
        let mut x = 12345u64;
        let mut next = |below: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % below) as u32
        };
        for _ in 0..6000 {
            idx[0].push(next(300));
            idx[1].push(next(200));
            // The long mode's nonzeros on 500 of its rows only.
            idx[2].push(next(500) * 499);
            vals.push(1.0 + next(7) as f32);
        }
        let t = kruskal_formats::SparseTensor::new(dims.to_vec(), idx, vals).unwrap();
        let used: std::collections::HashSet<u32> = t.indices()[2].iter().copied().collect();
        for inner in [InnerStop::AllRows, InnerStop::RowBlocks] {
            let model = cpd_admm(
                &mut CpuBackend::new(&t),
                &options(4, 8, 0.0),
                &AdmmOptions {
                    inner,
                    ..AdmmOptions::nonneg()
                },
            )
            .unwrap();
            // Random nonzeros fit poorly at any rank 4; ALS from the same
            // start is the yardstick.
            let als = cpd_als(&mut CpuBackend::new(&t), &options(4, 8, 0.0)).unwrap();
            assert!(
                model.fit() > 0.9 * als.fit() && als.fit() > 0.0,
                "{inner:?}: fit {}, ALS {}",
                model.fit(),
                als.fit()
            );
            assert!(model.lambda.iter().all(|&l| l > 0.0), "{inner:?}");
            let long = &model.factors[2];
            for (i, row) in long.rows().into_iter().enumerate() {
                if !used.contains(&(i as u32)) {
                    assert!(row.iter().all(|&x| x == 0.0), "{inner:?}: row {i}");
                }
            }
            assert!(long.iter().any(|&x| x > 0.0));
        }
        // Only empty rows: one iteration, H = U = 0.
        let (rank, rows) = (3, 100);
        let k = vec![0f64; rows * rank];
        let mut h: Vec<f64> = (0..rows * rank).map(|e| e as f64).collect();
        let mut u = h.clone();
        let w: Vec<f64> = (0..rank * rank)
            .map(|e| if e % (rank + 1) == 0 { 0.5 } else { 0.0 })
            .collect();
        for stop in [InnerStop::AllRows, InnerStop::RowBlocks] {
            let p = inner_params(true, 0.0, 0.0, 1.0, 50, 1e-2);
            let iters = inner_loop_host(&k, &mut h, &mut u, &w, rank, &p, stop).unwrap();
            assert_eq!(iters, 1, "{stop:?}");
            assert!(h.iter().chain(&u).all(|&x| x == 0.0), "{stop:?}");
        }
    }

    /// A tensor with empty rows in every mode (`mode 3`: nonzeros on 300
    /// of 40,000 rows), its rows with data, and the same tensor with the
    /// empty rows taken out (indices renumbered in order).
    fn sparse_rows() -> (
        kruskal_formats::SparseTensor,
        DataRows,
        kruskal_formats::SparseTensor,
    ) {
        let dims = vec![90u32, 70, 40_000];
        let (mut idx, mut vals) = (vec![Vec::new(); 3], Vec::new());
        let mut x = 777u64;
        let mut next = |below: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % below) as u32
        };
        for _ in 0..3000 {
            idx[0].push(next(30) * 3);
            idx[1].push(next(70));
            idx[2].push(next(300) * 131 + 5);
            vals.push(1.0 + next(5) as f32);
        }
        let t = kruskal_formats::SparseTensor::new(dims.clone(), idx, vals).unwrap();
        let rows = DataRows::of(&t);
        let renumbered: Vec<Vec<u32>> = (0..3)
            .map(|m| {
                let list = rows
                    .mode(m)
                    .map_or_else(|| (0..dims[m]).collect(), <[u32]>::to_vec);
                t.mode_indices(m)
                    .iter()
                    .map(|i| list.binary_search(i).unwrap() as u32)
                    .collect()
            })
            .collect();
        let small_dims = (0..3).map(|m| rows.count(m) as u32).collect();
        let small = kruskal_formats::SparseTensor::new(small_dims, renumbered, t.values().to_vec())
            .unwrap();
        (t, rows, small)
    }

    #[test]
    fn data_rows_are_each_modes_distinct_indices() {
        let (t, rows, _) = sparse_rows();
        for m in 0..3 {
            let mut want: Vec<u32> = t.mode_indices(m).to_vec();
            want.sort_unstable();
            want.dedup();
            if want.len() == t.dims()[m] as usize {
                assert_eq!(rows.mode(m), None, "mode {m}: every row");
            } else {
                assert_eq!(rows.mode(m), Some(&want[..]), "mode {m}");
            }
            assert_eq!(rows.count(m), want.len());
        }
        assert_eq!(rows.mode(0).map(<[u32]>::len), Some(30));
        assert_eq!(rows.count(2), 300);
        assert!(rows.check(t.dims()).is_ok());
        assert!(rows.check(&[90, 70, 39_999]).is_err());
        // Lists are checked.
        assert!(DataRows::new(vec![4, 4], vec![vec![0, 2], vec![1, 3]]).is_ok());
        for bad in [
            vec![vec![2, 2], vec![1]],
            vec![vec![0, 4], vec![1]],
            vec![vec![0]],
        ] {
            assert!(DataRows::new(vec![4, 4], bad.clone()).is_err(), "{bad:?}");
        }
    }

    /// With the rows with data, the host's loop runs on those rows only:
    /// the same model as the tensor without its empty rows (the row blocks
    /// are the same blocks), from initial factors whose empty rows are 0;
    /// the empty rows stay 0. All rows together: the same model as without
    /// the list.
    #[test]
    fn rows_with_data_are_the_tensor_without_its_empty_rows() {
        let (t, rows, small) = sparse_rows();
        let rank = 4;
        let start = crate::als::random_factors(small.dims(), rank, 11);
        let spread = |m: usize, f: &Array2<f32>| {
            let mut full = Array2::<f32>::zeros((t.dims()[m] as usize, rank));
            for (i, row) in f.rows().into_iter().enumerate() {
                let r = rows.mode(m).map_or(i, |l| l[i] as usize);
                full.row_mut(r).assign(&row);
            }
            full
        };
        let full_start: Vec<Array2<f32>> = start
            .iter()
            .enumerate()
            .map(|(m, f)| spread(m, f))
            .collect();
        let run = |t: &kruskal_formats::SparseTensor,
                   init: &[Array2<f32>],
                   list: Option<&DataRows>,
                   inner: InnerStop| {
            let mut backend = CpuBackend::new(t);
            if let Some(l) = list {
                backend.set_data_rows(Arc::new(l.clone())).unwrap();
            }
            let mut opts = options(rank, 6, 0.0);
            opts.init = crate::Init::Given(init.to_vec());
            cpd_admm(
                &mut backend,
                &opts,
                &AdmmOptions {
                    inner,
                    ..AdmmOptions::nonneg()
                },
            )
            .unwrap()
        };
        for inner in [InnerStop::AllRows, InnerStop::RowBlocks] {
            let listed = run(&t, &full_start, Some(&rows), inner);
            let compact = run(&small, &start, None, inner);
            assert!((listed.fit() - compact.fit()).abs() < 1e-9, "{inner:?}");
            for m in 0..3 {
                let want = spread(m, &compact.factors[m]);
                for (x, y) in listed.factors[m].iter().zip(want.iter()) {
                    assert!(
                        (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                        "{inner:?} mode {m}: {x} vs {y}"
                    );
                }
            }
            if inner == InnerStop::AllRows {
                let plain = run(&t, &full_start, None, inner);
                assert!((listed.fit() - plain.fit()).abs() < 1e-9);
                for (a, b) in listed.factors.iter().zip(&plain.factors) {
                    for (x, y) in a.iter().zip(b.iter()) {
                        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
                    }
                }
            }
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let p = planted(&PlantedSpec {
            dims: vec![5000, 3000, 40],
            rank: 3,
            nnz: 30_000,
            noise: 0.1,
            seed: 2,
        })
        .unwrap();
        let opts = options(3, 4, 0.0);
        for inner in [InnerStop::AllRows, InnerStop::RowBlocks] {
            let run_on = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    cpd_admm(
                        &mut CpuBackend::new(&p.tensor),
                        &opts,
                        &AdmmOptions {
                            l1: 0.01,
                            inner,
                            ..AdmmOptions::nonneg()
                        },
                    )
                    .unwrap()
                })
            };
            let (a, b) = (run_on(1), run_on(3));
            assert_eq!(a.factors, b.factors, "{inner:?}");
            assert_eq!(a.lambda, b.lambda, "{inner:?}");
            let iters = |m: &KruskalModel| {
                m.iterations
                    .iter()
                    .map(|s| s.inner_iters)
                    .collect::<Vec<_>>()
            };
            assert_eq!(iters(&a), iters(&b), "{inner:?}");
        }
    }
}
