//! The CPD-ALS driver, generic over the [`Backend`].
//!
//! For each iteration and each mode n:
//! 1. `M = MTTKRP(X, n)`
//! 2. `V = hadamard(G_w for w != n)`, `G_w = A_w^T A_w`
//! 3. `A_n = M V^{-1}` (Cholesky in f64; `V^+` when V is singular)
//! 4. normalize the columns into lambda: 2-norms on the first iteration,
//!    `max(1, max |a|)` afterwards (the convention of the Tensor Toolbox and
//!    pyttb's `cp_als`), then `G_n = A_n^T A_n`.
//!
//! The fit is `1 - sqrt(|X|^2 + |model|^2 - 2 <X, model>) / |X|` with
//! `|model|^2 = lambda^T (hadamard of all G) lambda` and `<X, model>` from
//! the last mode's MTTKRP. The run stops when the fit changes by less than
//! `tol` (from the second iteration on) or after `max_iters`.

use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::time::Instant;

use ndarray::Array2;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::admm::AdmmOptions;
use crate::backend::Backend;
use crate::dense::{SolveKind, hadamard_except, solve_matrix};
use crate::error::{CpdError, OptionName, Result};
use crate::model::{HISTORY, IterationStats, IterationTotals, KruskalModel};

/// Default iteration limit.
pub const DEFAULT_MAX_ITERS: usize = 50;
/// Default tolerance on the change of the fit.
pub const DEFAULT_TOL: f64 = 1e-5;

/// Where the factors start.
#[derive(Clone, Debug)]
pub enum Init {
    /// Uniform in [0, 1), from a seeded generator (the same seed gives the
    /// same factors on every machine).
    Random { seed: u64 },
    /// Given factors, one `dims[m] x rank` matrix per mode.
    Given(Vec<Array2<f32>>),
}

/// Options of a CPD-ALS run.
#[derive(Clone, Debug)]
pub struct CpdOptions {
    pub rank: usize,
    pub max_iters: usize,
    pub tol: f64,
    pub init: Init,
    /// Constraints and regularization: `Some` runs AO-ADMM
    /// ([`crate::admm`]) instead of ALS.
    pub constraints: Option<AdmmOptions>,
}

impl CpdOptions {
    /// Rank `rank`, [`DEFAULT_MAX_ITERS`], [`DEFAULT_TOL`], random init with
    /// seed 1.
    pub fn new(rank: usize) -> Self {
        CpdOptions {
            rank,
            max_iters: DEFAULT_MAX_ITERS,
            tol: DEFAULT_TOL,
            init: Init::Random { seed: 1 },
            constraints: None,
        }
    }

    /// Refuses a rank of 0, a tolerance that is negative or not finite,
    /// and constraint weights that are (the modes the constraints name
    /// are checked against the tensor's where it is known).
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(CpdError::option(OptionName::Rank, "must be at least 1"));
        }
        if !(self.tol.is_finite() && self.tol >= 0.0) {
            return Err(CpdError::option_value(
                OptionName::Tol,
                self.tol,
                "must be finite and >= 0",
            ));
        }
        if let Some(c) = &self.constraints {
            c.check_weights()?;
        }
        Ok(())
    }
}

/// Random numbers drawn from one stream when initializing factors: fixed
/// so the factors do not depend on the thread count.
pub(crate) const RANDOM_BLOCK: usize = 1 << 16;

/// Seeded uniform random factors in [0, 1), `dims[m] x rank` each. Drawn in
/// parallel, in fixed blocks with one ChaCha stream per (mode, block): the
/// same seed gives the same factors on any machine and thread count.
pub fn random_factors(dims: &[u32], rank: usize, seed: u64) -> Vec<Array2<f32>> {
    dims.iter()
        .enumerate()
        .map(|(mode, &dim)| random_factor(mode, dim, rank, seed))
        .collect()
}

/// Mode `mode`'s matrix of [`random_factors`] (`dim x rank`), drawn alone:
/// every mode's numbers come from streams of their own.
pub fn random_factor(mode: usize, dim: u32, rank: usize, seed: u64) -> Array2<f32> {
    let mut data = vec![0f32; dim as usize * rank];
    data.par_chunks_mut(RANDOM_BLOCK)
        .enumerate()
        .for_each(|(block, chunk)| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            rng.set_stream(((mode as u64) << 40) | block as u64);
            chunk.iter_mut().for_each(|x| *x = rng.random::<f32>());
        });
    Array2::from_shape_vec((dim as usize, rank), data).expect("dim * rank entries")
}

/// Checks one `dims[m] x rank` matrix per mode, all of one rank >= 1.
pub(crate) fn check_factor_shapes(dims: &[u32], factors: &[Array2<f32>]) -> Result<usize> {
    if factors.len() != dims.len() {
        return Err(CpdError::Shape(format!(
            "{} factor matrices for a {}-mode tensor",
            factors.len(),
            dims.len()
        )));
    }
    let rank = factors[0].ncols();
    for (m, (f, &d)) in factors.iter().zip(dims).enumerate() {
        if f.nrows() != d as usize || f.ncols() != rank {
            return Err(CpdError::Shape(format!(
                "factor of mode {} is {} x {}, expected {d} x {rank}",
                m + 1,
                f.nrows(),
                f.ncols()
            )));
        }
        if !all_finite(f) {
            return Err(CpdError::Invalid(format!(
                "the initial factor of mode {} holds a value that is not finite",
                m + 1
            )));
        }
        // The first mode's factor is computed first, from the others; a
        // zero factor of another mode makes every MTTKRP zero, and ALS
        // would "converge" at once to a fit of 0.
        if m > 0 && f.iter().all(|&x| x == 0.0) {
            return Err(CpdError::Invalid(format!(
                "the initial factor of mode {} is all zeros, from which ALS cannot move",
                m + 1
            )));
        }
    }
    if rank == 0 {
        return Err(CpdError::Shape("factors have no columns".into()));
    }
    Ok(rank)
}

/// Whether every entry of `f` is finite (in parallel where `f` is
/// contiguous).
fn all_finite(f: &Array2<f32>) -> bool {
    match f.as_slice() {
        // Blocks folded without a branch per entry, so the test vectorizes.
        Some(data) => data
            .par_chunks(RANDOM_BLOCK)
            .all(|block| block.iter().fold(true, |ok, x| ok & x.is_finite())),
        None => f.iter().all(|x| x.is_finite()),
    }
}

/// Runs CPD-ALS without progress reports. See [`cpd_als_with`].
pub fn cpd_als(backend: &mut dyn Backend, opts: &CpdOptions) -> Result<KruskalModel> {
    cpd_als_with(backend, opts, &mut |_| ControlFlow::Continue(()))
}

/// Runs CPD-ALS, calling `on_iteration` after every iteration; returning
/// `ControlFlow::Break` stops the run after that iteration (the model so far
/// is returned with `interrupted` set).
///
/// With `opts.constraints` set, the run is constrained CP by AO-ADMM
/// instead ([`crate::admm::cpd_admm_with`]).
pub fn cpd_als_with(
    backend: &mut dyn Backend,
    opts: &CpdOptions,
    on_iteration: &mut dyn FnMut(&IterationStats) -> ControlFlow<()>,
) -> Result<KruskalModel> {
    if let Some(constraints) = &opts.constraints {
        return crate::admm::cpd_admm_with(backend, opts, constraints, on_iteration);
    }
    drive(backend, opts, &mut AlsUpdate, on_iteration)
}

/// What one mode's update hands back to [`drive`].
pub(crate) struct ModeUpdate {
    /// The weights the new factor's columns were divided by.
    pub lambda: Vec<f64>,
    /// The Gram of the new (normalized) factor.
    pub gram: Array2<f64>,
    /// Inner iterations the update ran (0 for a direct solve).
    pub inner_iters: usize,
    /// The R x R system was singular and solved by its pseudo-inverse.
    pub pseudo_inverse: bool,
}

/// The factor update of one alternating method: ALS's exact solve or
/// AO-ADMM's constrained one. [`drive`] runs everything else.
pub(crate) trait Update {
    /// Whether the update keeps its own copy of the initial factors
    /// (`begin`); without it, seeded factors are drawn where the backend
    /// holds them ([`Backend::load_random`]) and never pass the host.
    fn keeps_initial(&self) -> bool {
        false
    }
    /// Whether mode `mode`'s columns keep their signs in the final
    /// arrangement (a non-negative mode's entries are >= 0 and stay so).
    fn keeps_sign(&self, _mode: usize) -> bool {
        false
    }
    /// Called once with the initial factors, before they are loaded, when
    /// `keeps_initial` or the factors are given.
    fn begin(&mut self, _initial: &[Array2<f32>]) {}
    /// Updates factor `mode` from the backend's MTTKRP of that mode (the
    /// last `mttkrp(mode)`) and the Grams of every mode; `iter` counts from 0.
    fn update(
        &mut self,
        backend: &mut dyn Backend,
        mode: usize,
        iter: usize,
        grams: &[Array2<f64>],
    ) -> Result<ModeUpdate>;
}

/// The weights of a new factor's columns: 2-norms on the first iteration,
/// `max(1, max |a|)` afterwards (the Tensor Toolbox's and pyttb's
/// convention), and the divisors that normalize them (a zero column stays
/// zero, with weight 0, rather than NaN).
pub(crate) fn column_weights(iter: usize, two: Vec<f64>, max_abs: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let lambda: Vec<f64> = if iter == 0 {
        two
    } else {
        max_abs.iter().map(|&x| x.max(1.0)).collect()
    };
    let divisors = lambda
        .iter()
        .map(|&l| if l > 0.0 { l } else { 1.0 })
        .collect();
    (lambda, divisors)
}

/// ALS's update: `A_n = M V^{-1}`, then normalization.
struct AlsUpdate;

impl Update for AlsUpdate {
    fn update(
        &mut self,
        backend: &mut dyn Backend,
        mode: usize,
        iter: usize,
        grams: &[Array2<f64>],
    ) -> Result<ModeUpdate> {
        let v = hadamard_except(grams, Some(mode));
        let (w, kind) = solve_matrix(&v);
        let norms = backend.solve_update(mode, &w)?;
        let (lambda, divisors) = column_weights(iter, norms.two, &norms.max_abs);
        let gram = backend.scale_and_gram(mode, &divisors)?;
        Ok(ModeUpdate {
            lambda,
            gram,
            inner_iters: 0,
            pseudo_inverse: kind == SolveKind::PseudoInverse,
        })
    }
}

/// The alternating driver both methods share: initial factors, per
/// iteration and mode the MTTKRP and `update`, the fit, the stopping
/// rules, and the final arrangement of the model.
pub(crate) fn drive(
    backend: &mut dyn Backend,
    opts: &CpdOptions,
    update: &mut dyn Update,
    on_iteration: &mut dyn FnMut(&IterationStats) -> ControlFlow<()>,
) -> Result<KruskalModel> {
    opts.validate()?;
    let setup = Instant::now();
    let dims = backend.dims().to_vec();
    let nmodes = dims.len();
    let rank = opts.rank;
    match &opts.init {
        Init::Random { seed } if !update.keeps_initial() => backend.load_random(rank, *seed)?,
        init => {
            let initial = match init {
                Init::Random { seed } => random_factors(&dims, rank, *seed),
                Init::Given(factors) => {
                    let given_rank = check_factor_shapes(&dims, factors)?;
                    if given_rank != rank {
                        return Err(CpdError::Shape(format!(
                            "initial factors have rank {given_rank}, the run asks for rank {rank}"
                        )));
                    }
                    factors.clone()
                }
            };
            update.begin(&initial);
            backend.load_factors(initial)?;
        }
    }
    let mut grams = (0..nmodes)
        .map(|m| backend.gram(m))
        .collect::<Result<Vec<_>>>()?;

    let norm_x_sq = backend.tensor_norm_sq();
    let norm_x = norm_x_sq.sqrt();
    let mut lambda = vec![1f64; rank];
    let mut fit_old = 0f64;
    let mut iterations = VecDeque::new();
    let mut totals = IterationTotals::default();
    let mut converged = false;
    let mut interrupted = false;
    let mut pseudo_inverse_solves = 0;
    totals.setup_s = setup.elapsed().as_secs_f64();

    for iter in 0..opts.max_iters {
        let mut mttkrp_modes_s = vec![0f64; nmodes];
        let mut update_s = 0f64;
        let mut inner_iters = 0;
        let start = Instant::now();
        for mode in 0..nmodes {
            let t = Instant::now();
            backend.mttkrp(mode)?;
            backend.sync()?;
            mttkrp_modes_s[mode] = t.elapsed().as_secs_f64();

            let t = Instant::now();
            let done = update.update(backend, mode, iter, &grams)?;
            if done.pseudo_inverse {
                pseudo_inverse_solves += 1;
            }
            inner_iters += done.inner_iters;
            lambda = done.lambda;
            grams[mode] = done.gram;
            let mut updated_s = t.elapsed().as_secs_f64();
            if let Some(waited) = backend.take_waited_mttkrp_s() {
                // The update waited for the MTTKRP: move that part back.
                let moved = (waited - mttkrp_modes_s[mode]).clamp(0.0, updated_s);
                mttkrp_modes_s[mode] += moved;
                updated_s -= moved;
            }
            update_s += updated_s;
        }
        let fit_start = Instant::now();
        let last = nmodes - 1;
        let inner: f64 = backend
            .inner_products(last)?
            .iter()
            .zip(&lambda)
            .map(|(ip, l)| ip * l)
            .sum();
        let all = hadamard_except(&grams, None);
        let model_sq: f64 = (0..rank)
            .map(|a| {
                (0..rank)
                    .map(|b| lambda[a] * all[[a, b]] * lambda[b])
                    .sum::<f64>()
            })
            .sum();
        // `max` would turn a NaN into 0, a perfect fit: NaN stays NaN.
        let residual_sq = norm_x_sq + model_sq - 2.0 * inner;
        let residual = if residual_sq.is_nan() {
            f64::NAN
        } else {
            residual_sq.max(0.0).sqrt()
        };
        let fit = if norm_x > 0.0 {
            1.0 - residual / norm_x
        } else {
            0.0
        };
        let delta = fit - fit_old;
        fit_old = fit;
        let fit_s = fit_start.elapsed().as_secs_f64();
        let total = start.elapsed().as_secs_f64();
        let mttkrp_s: f64 = mttkrp_modes_s.iter().sum();
        let stats = IterationStats {
            iteration: iter + 1,
            fit,
            delta,
            mttkrp_s,
            other_s: (total - mttkrp_s).max(0.0),
            mttkrp_modes_s,
            update_s,
            fit_s,
            inner_iters,
        };
        let flow = on_iteration(&stats);
        totals.add(&stats);
        if iterations.len() == HISTORY {
            iterations.pop_front();
        }
        iterations.push_back(stats);
        if !fit.is_finite() || !lambda.iter().all(|l| l.is_finite()) {
            return Err(CpdError::Backend(format!(
                "the fit became {fit} at iteration {}: the factors diverged",
                iter + 1
            )));
        }
        if iter > 0 && delta.abs() < opts.tol {
            converged = true;
            break;
        }
        if flow.is_break() {
            interrupted = true;
            break;
        }
    }

    let finish = Instant::now();
    // A non-negative mode's columns keep their signs (they are >= 0). The
    // update says which: a constrained run's options may come to
    // `cpd_admm` apart from `opts`.
    let keep_sign: Vec<bool> = (0..nmodes).map(|m| update.keeps_sign(m)).collect();
    let (lambda, factors) = backend.take_arranged(lambda, &keep_sign)?;
    // A model that is not finite is an error, never a result.
    if let Some(r) = lambda.iter().position(|l| !l.is_finite()) {
        return Err(CpdError::Backend(format!(
            "weight {} of the model is {}: the factors diverged",
            r + 1,
            lambda[r]
        )));
    }
    for (m, f) in factors.iter().enumerate() {
        if !all_finite(f) {
            return Err(CpdError::Backend(format!(
                "the mode-{} factor holds a value that is not finite: the factors diverged",
                m + 1
            )));
        }
    }
    totals.finish_s = finish.elapsed().as_secs_f64();
    Ok(KruskalModel {
        lambda,
        factors,
        iterations: iterations.into(),
        totals,
        converged,
        pseudo_inverse_solves,
        interrupted,
    })
}

/// Per-column statistics of a factor: sum of squares, and the entry of
/// largest magnitude (with its sign). One parallel pass over the rows.
pub(crate) fn column_stats(data: &[f32], rank: usize) -> (Vec<f64>, Vec<f32>) {
    data.par_chunks(RANDOM_BLOCK.max(rank) / rank * rank)
        .map(|block| {
            let mut sumsq = vec![0f64; rank];
            let mut big = vec![0f32; rank];
            // Zipped, without an index, so the loop over a row vectorizes.
            for row in block.chunks_exact(rank) {
                for ((s, b), &x) in sumsq.iter_mut().zip(big.iter_mut()).zip(row) {
                    *s += f64::from(x) * f64::from(x);
                    if x.abs() > b.abs() {
                        *b = x;
                    }
                }
            }
            (sumsq, big)
        })
        // Partials combined in block order: the result must not depend on
        // how rayon split the work.
        .collect::<Vec<_>>()
        .into_iter()
        .fold(
            (vec![0f64; rank], vec![0f32; rank]),
            |(mut s, mut b), (s2, b2)| {
                s.iter_mut().zip(&s2).for_each(|(x, y)| *x += y);
                b.iter_mut()
                    .zip(&b2)
                    .for_each(|(x, &y)| *x = if y.abs() > x.abs() { y } else { *x });
                (s, b)
            },
        )
}

/// Normalizes every column to unit 2-norm (the norms go into lambda), sorts
/// the components by weight (largest first) and fixes signs: in every mode
/// but the last, the entry of largest magnitude of each column is made
/// positive; the last mode takes the product of the flipped signs.
///
/// Cost: two parallel passes over every factor.
pub fn arrange(lambda: Vec<f64>, factors: Vec<Array2<f32>>) -> (Vec<f64>, Vec<Array2<f32>>) {
    let keep = vec![false; factors.len()];
    arrange_keeping_signs(lambda, factors, &keep)
}

/// How a model's columns are arranged ([`arrange`]): what each column of
/// each mode is multiplied by, the order of the components, and the new
/// weights. Planned from each mode's column statistics alone, so a
/// backend that holds the factors elsewhere (a GPU) computes those and
/// applies the arrangement while the factors come to the host.
#[derive(Clone, Debug, PartialEq)]
pub struct Arrangement {
    /// The weights, in the new order.
    pub lambda: Vec<f64>,
    /// `scale[m][r]`: what column r of mode m (old numbering) is
    /// multiplied by.
    pub scale: Vec<Vec<f32>>,
    /// `order[k]`: the old component that becomes component k.
    pub order: Vec<usize>,
}

impl Arrangement {
    /// The arrangement of factors whose mode m has column sums of squares
    /// `stats[m].0` and entries of largest magnitude `stats[m].1` (the
    /// first such entry in row order), with weights `lambda`. The modes
    /// marked in `keep_sign` are never flipped.
    pub fn plan(mut lambda: Vec<f64>, stats: &[(Vec<f64>, Vec<f32>)], keep_sign: &[bool]) -> Self {
        let rank = lambda.len();
        let nmodes = stats.len();
        // The mode that takes the product of the flips.
        let absorber = (0..nmodes).rev().find(|&m| !keep_sign[m]);
        let mut scale = vec![vec![1f32; rank]; nmodes];
        let mut sign = vec![1f32; rank];
        for (m, (sumsq, big)) in stats.iter().enumerate() {
            for r in 0..rank {
                let norm = sumsq[r].sqrt();
                lambda[r] *= norm;
                let mut s = if norm > 0.0 { (1.0 / norm) as f32 } else { 1.0 };
                if !keep_sign[m] && absorber.is_some_and(|a| m < a) && big[r] < 0.0 {
                    s = -s;
                    sign[r] = -sign[r];
                }
                scale[m][r] = s;
            }
        }
        if let Some(a) = absorber {
            scale[a].iter_mut().zip(&sign).for_each(|(s, &g)| *s *= g);
        }
        let mut order: Vec<usize> = (0..rank).collect();
        order.sort_by(|&a, &b| lambda[b].total_cmp(&lambda[a]));
        let lambda = order.iter().map(|&r| lambda[r]).collect();
        Arrangement {
            lambda,
            scale,
            order,
        }
    }

    /// Mode `mode`'s scales in the new order: `dst[k] = src[order[k]] *
    /// scales[k]` arranges a row.
    pub fn scales(&self, mode: usize) -> Vec<f32> {
        self.order.iter().map(|&r| self.scale[mode][r]).collect()
    }

    /// Writes the arranged rows of `src` (whole rows of mode `mode`, old
    /// numbering) into `dst`; `scales` is [`Self::scales`] of the mode.
    pub fn rows(&self, scales: &[f32], src: &[f32], dst: &mut [f32]) {
        let rank = self.order.len();
        for (row, out) in src.chunks_exact(rank).zip(dst.chunks_exact_mut(rank)) {
            for ((d, &r), &s) in out.iter_mut().zip(&self.order).zip(scales) {
                *d = row[r] * s;
            }
        }
    }
}

/// [`arrange`], where the modes marked in `keep_sign` (the non-negative
/// ones of a constrained run) are never flipped: the signs are fixed among
/// the other modes, and the last of those takes the product of the flips.
/// With one unmarked mode or none, nothing is flipped.
pub(crate) fn arrange_keeping_signs(
    lambda: Vec<f64>,
    factors: Vec<Array2<f32>>,
    keep_sign: &[bool],
) -> (Vec<f64>, Vec<Array2<f32>>) {
    let rank = lambda.len();
    let mut factors: Vec<Array2<f32>> = factors
        .into_iter()
        .map(|f| {
            // A factor in standard layout is kept as it is: `into_owned` of
            // the view `as_standard_layout` gives would copy it.
            if f.is_standard_layout() {
                f
            } else {
                f.as_standard_layout().into_owned()
            }
        })
        .collect();
    let stats: Vec<(Vec<f64>, Vec<f32>)> = factors
        .iter()
        .map(|f| column_stats(f.as_slice().expect("standard layout"), rank))
        .collect();
    let plan = Arrangement::plan(lambda, &stats, keep_sign);
    for (m, f) in factors.iter_mut().enumerate() {
        let scales = plan.scales(m);
        let data = f.as_slice_mut().expect("standard layout");
        data.par_chunks_mut(RANDOM_BLOCK.max(rank) / rank * rank)
            .for_each(|block| {
                // Each row through a copy of itself: no block-sized buffer.
                let mut old = vec![0f32; rank];
                for row in block.chunks_exact_mut(rank) {
                    old.copy_from_slice(row);
                    plan.rows(&scales, &old, row);
                }
            });
    }
    (plan.lambda, factors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;
    use crate::score::factor_match_score;
    use kruskal_formats::SparseTensor;
    use kruskal_formats::generate::{PlantedSpec, PowerLawSpec, planted, power_law};

    fn planted_tensor(nmodes: usize, rank: usize, seed: u64) -> kruskal_formats::generate::Planted {
        let dims: Vec<u32> = (0..nmodes).map(|m| 40 + 13 * m as u32).collect();
        planted(&PlantedSpec {
            dims,
            rank,
            nnz: 4_000 * rank,
            noise: 0.0,
            seed,
        })
        .unwrap()
    }

    fn run(t: &SparseTensor, opts: &CpdOptions) -> KruskalModel {
        cpd_als(&mut CpuBackend::new(t), opts).unwrap()
    }

    #[test]
    fn a_mode_drawn_alone_is_that_mode_of_all_drawn_together() {
        let dims = [70_001, 3, 1, 5_000];
        let all = random_factors(&dims, 7, 42);
        for (mode, &d) in dims.iter().enumerate() {
            assert_eq!(random_factor(mode, d, 7, 42), all[mode], "mode {mode}");
        }
        // Another seed, other numbers.
        assert_ne!(random_factor(0, dims[0], 7, 43), all[0]);
    }

    #[test]
    fn recovers_planted_factors_in_three_to_five_modes() {
        for (nmodes, rank) in [(3, 4), (4, 3), (5, 2)] {
            let p = planted_tensor(nmodes, rank, 11);
            let mut opts = CpdOptions::new(rank);
            opts.max_iters = 200;
            opts.tol = 1e-9;
            let model = run(&p.tensor, &opts);
            let fms = factor_match_score(&model.lambda, &model.factors, &p.lambda, &p.factors);
            assert!(model.fit() > 0.999, "{nmodes} modes: fit {}", model.fit());
            assert!(fms > 0.99, "{nmodes} modes: factor match {fms}");
        }
    }

    #[test]
    fn fit_never_decreases_on_a_planted_tensor() {
        // Noise keeps the fit below 1 so every iteration has work to do.
        let p = planted(&PlantedSpec {
            dims: vec![40, 53, 66],
            rank: 5,
            nnz: 20_000,
            noise: 0.1,
            seed: 3,
        })
        .unwrap();
        let mut opts = CpdOptions::new(5);
        opts.max_iters = 40;
        opts.tol = 0.0;
        let model = run(&p.tensor, &opts);
        assert_eq!(model.iterations.len(), 40);
        let (first, last) = (model.iterations[0].fit, model.fit());
        assert!(last > first + 0.05, "fit only went from {first} to {last}");
        for w in model.iterations.windows(2) {
            assert!(
                w[1].fit >= w[0].fit - 1e-6,
                "fit fell from {} to {} at iteration {}",
                w[0].fit,
                w[1].fit,
                w[1].iteration
            );
        }
    }

    #[test]
    fn same_seed_gives_identical_results() {
        let t = power_law(&PowerLawSpec::new(vec![50, 40, 30, 20], 5_000)).unwrap();
        let mut opts = CpdOptions::new(4);
        opts.max_iters = 8;
        opts.init = Init::Random { seed: 42 };
        let a = run(&t, &opts);
        let b = run(&t, &opts);
        assert_eq!(a.lambda, b.lambda);
        assert_eq!(a.factors, b.factors);
        let fits = |m: &KruskalModel| m.iterations.iter().map(|s| s.fit).collect::<Vec<_>>();
        assert_eq!(fits(&a), fits(&b));
        opts.init = Init::Random { seed: 43 };
        assert_ne!(run(&t, &opts).factors, a.factors);
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        // Many 4096-row blocks per factor and many 65536-value chunks, so
        // every reduction has partials to combine.
        let t = power_law(&PowerLawSpec::new(vec![40_000, 30_000, 20_000], 300_000)).unwrap();
        let mut opts = CpdOptions::new(7);
        opts.max_iters = 6;
        let run_on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| run(&t, &opts))
        };
        let (a, b) = (run_on(1), run_on(3));
        assert_eq!(a.lambda, b.lambda);
        assert_eq!(a.factors, b.factors);
        let fits = |m: &KruskalModel| m.iterations.iter().map(|s| s.fit).collect::<Vec<_>>();
        assert_eq!(fits(&a), fits(&b));
    }

    #[test]
    fn given_initial_factors_are_used() {
        let t = power_law(&PowerLawSpec::new(vec![30, 20, 10], 2_000)).unwrap();
        let init = random_factors(t.dims(), 3, 9);
        let mut given = CpdOptions::new(3);
        given.max_iters = 5;
        given.init = Init::Given(init);
        let mut seeded = given.clone();
        seeded.init = Init::Random { seed: 9 };
        assert_eq!(run(&t, &given).factors, run(&t, &seeded).factors);
        given.init = Init::Given(random_factors(t.dims(), 2, 9));
        let err = cpd_als(&mut CpuBackend::new(&t), &given).unwrap_err();
        assert!(err.to_string().contains("rank 2"), "{err}");
    }

    #[test]
    fn initial_factors_that_are_not_finite_or_all_zero_are_refused() {
        let t = power_law(&PowerLawSpec::new(vec![30, 20, 10], 2_000)).unwrap();
        let mut opts = CpdOptions::new(3);
        let refused = |factors: Vec<Array2<f32>>, opts: &mut CpdOptions| {
            opts.init = Init::Given(factors);
            let err = cpd_als(&mut CpuBackend::new(&t), opts).unwrap_err();
            assert!(matches!(err, CpdError::Invalid(_)), "{err}");
            err.to_string()
        };
        let mut nan = random_factors(t.dims(), 3, 1);
        nan[1][[4, 2]] = f32::NAN;
        let err = refused(nan, &mut opts);
        assert!(
            err.contains("mode 2 holds a value that is not finite"),
            "{err}"
        );
        let mut zero = random_factors(t.dims(), 3, 1);
        zero[2].fill(0.0);
        let err = refused(zero, &mut opts);
        assert!(err.contains("mode 3 is all zeros"), "{err}");
        // The first mode's factor may be zero: it is computed first.
        let mut first = random_factors(t.dims(), 3, 1);
        first[0].fill(0.0);
        opts.init = Init::Given(first);
        opts.max_iters = 3;
        assert!(cpd_als(&mut CpuBackend::new(&t), &opts).unwrap().fit() > 0.0);
    }

    #[test]
    fn rank_above_a_dimension_uses_the_pseudo_inverse() {
        // Mode 3 has 2 indices: its Gram has rank <= 2 < 4, so every other
        // mode's V = hadamard(...) may be singular; the run must stay finite.
        let t = power_law(&PowerLawSpec::new(vec![30, 25, 2], 600)).unwrap();
        let mut opts = CpdOptions::new(4);
        opts.max_iters = 10;
        let model = run(&t, &opts);
        assert!(model.fit().is_finite() && model.fit() > 0.0);
        assert!(model.lambda.iter().all(|l| l.is_finite()));
        let t = power_law(&PowerLawSpec::new(vec![3, 2, 2], 10)).unwrap();
        let mut opts = CpdOptions::new(8);
        opts.max_iters = 5;
        let model = run(&t, &opts);
        assert!(model.pseudo_inverse_solves > 0);
        assert!(model.fit().is_finite());
    }

    #[test]
    fn stopping_rules() {
        let p = planted_tensor(3, 2, 5);
        let mut opts = CpdOptions::new(2);
        opts.max_iters = 3;
        opts.tol = 0.0;
        let model = run(&p.tensor, &opts);
        assert_eq!(model.iterations.len(), 3);
        assert!(!model.converged);
        opts.max_iters = 500;
        opts.tol = 1e-4;
        let model = run(&p.tensor, &opts);
        assert!(model.converged && model.iterations.len() < 500);
        let mut stop_after_two = |s: &IterationStats| {
            if s.iteration == 2 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        };
        opts.tol = 0.0;
        let model =
            cpd_als_with(&mut CpuBackend::new(&p.tensor), &opts, &mut stop_after_two).unwrap();
        assert!(model.interrupted && model.iterations.len() == 2);
        opts.rank = 0;
        assert!(cpd_als(&mut CpuBackend::new(&p.tensor), &opts).is_err());
    }

    #[test]
    fn a_model_that_is_not_finite_is_an_error_not_a_perfect_fit() {
        // Values at the top of f32 overflow the f32 MTTKRP when run as
        // they are (`decompose` scales them; the driver alone must not
        // turn the NaNs into a fit of 1).
        let t = SparseTensor::new(
            vec![2, 2, 2],
            vec![vec![0, 1], vec![0, 1], vec![0, 1]],
            vec![3.4e38, 3.4e38],
        )
        .unwrap();
        let mut opts = CpdOptions::new(2);
        opts.max_iters = 5;
        let err = cpd_als(&mut CpuBackend::new(&t), &opts).unwrap_err();
        assert!(
            matches!(err, CpdError::Backend(_)) && err.to_string().contains("diverged"),
            "{err}"
        );
    }

    #[test]
    fn the_history_keeps_the_last_iterations_and_every_total() {
        let t =
            SparseTensor::new(vec![2, 2], vec![vec![0, 1], vec![0, 1]], vec![1.0, 2.0]).unwrap();
        let mut opts = CpdOptions::new(1);
        opts.max_iters = HISTORY + 7;
        opts.tol = 0.0;
        let mut heard = 0;
        let model = cpd_als_with(&mut CpuBackend::new(&t), &opts, &mut |_| {
            heard += 1;
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(heard, HISTORY + 7);
        assert_eq!(model.totals.count, HISTORY + 7);
        assert_eq!(model.iterations.len(), HISTORY);
        assert_eq!(model.iterations[0].iteration, 8);
        assert_eq!(model.iterations.last().unwrap().iteration, HISTORY + 7);
        let kept: f64 = model.iterations.iter().map(|s| s.mttkrp_s).sum();
        assert!(model.totals.mttkrp_s >= kept && model.totals.first_mttkrp_s > 0.0);
    }

    #[test]
    fn arrange_normalizes_sorts_and_fixes_signs() {
        let f = vec![
            ndarray::arr2(&[[-2.0f32, 1.0], [0.0, 1.0]]),
            ndarray::arr2(&[[3.0f32, 0.0], [4.0, 2.0]]),
        ];
        let (lambda, factors) = arrange(vec![1.0, 10.0], f);
        // Component 2 (weight 10 * sqrt(2) * 2) comes first.
        assert!((lambda[0] - 10.0 * 2f64.sqrt() * 2.0).abs() < 1e-9);
        assert!((lambda[1] - 2.0 * 5.0).abs() < 1e-9);
        // Mode 1's largest entry is made positive; mode 2 takes the sign.
        assert_eq!(factors[0][[0, 1]], 1.0);
        assert!((factors[1][[1, 1]] + 0.8).abs() < 1e-6);
    }

    #[test]
    fn non_negative_modes_keep_their_signs() {
        let f = || {
            vec![
                ndarray::arr2(&[[1.0f32], [2.0]]),
                ndarray::arr2(&[[-3.0f32], [1.0]]),
                ndarray::arr2(&[[0.5f32], [0.5]]),
            ]
        };
        // Plain: mode 2 is flipped and the last mode takes the sign.
        let (_, plain) = arrange(vec![1.0], f());
        assert!(plain[1][[0, 0]] > 0.0 && plain[2][[0, 0]] < 0.0);
        // Modes 1 and 3 non-negative: mode 2 is the only free mode, so
        // nothing is flipped.
        let (_, kept) = arrange_keeping_signs(vec![1.0], f(), &[true, false, true]);
        assert!(kept[0].iter().chain(kept[2].iter()).all(|&x| x >= 0.0));
        assert!(kept[1][[0, 0]] < 0.0);
        // Mode 3 non-negative: mode 1 flips if needed and mode 2 takes it.
        let mut g = f();
        g[0] = ndarray::arr2(&[[-2.0f32], [1.0]]);
        let (_, two) = arrange_keeping_signs(vec![1.0], g, &[false, false, true]);
        assert!(two[0][[0, 0]] > 0.0 && two[1][[0, 0]] > 0.0);
        assert!(two[2].iter().all(|&x| x >= 0.0));
    }

    #[test]
    fn the_device_draw_mirrors_the_host_draw() {
        // `kruskal_device::random` is what the GPU's uniform_fill computes;
        // here it must give random_factors bit for bit: short modes, a
        // mode of two blocks (the second one short), seeds at the ends.
        use kruskal_device::random::{chacha_key, mode_stream, uniform_host};
        let dims = [5u32, 3000, 17, 1];
        for (rank, seed) in [(33, 0u64), (1, 7), (16, u64::MAX)] {
            let host = random_factors(&dims, rank, seed);
            for (m, f) in host.iter().enumerate() {
                let mirror = uniform_host(&chacha_key(seed), mode_stream(m), RANDOM_BLOCK, f.len());
                let same = f
                    .as_slice()
                    .unwrap()
                    .iter()
                    .zip(&mirror)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same && mirror.len() == f.len(),
                    "rank {rank} seed {seed} mode {m}"
                );
            }
        }
    }

    #[test]
    fn a_planned_arrangement_applied_to_rows_is_arrange() {
        // What a GPU does (statistics, plan, rows arranged as copied) gives
        // what arrange does in place, ties of magnitude included (the
        // first entry in row order decides the sign).
        let mut f = random_factors(&[300, 40, 9], 6, 3);
        for x in f.iter_mut().flat_map(|f| f.iter_mut()) {
            *x -= 0.5;
        }
        f[1][[2, 4]] = -2.0;
        f[1][[7, 4]] = 2.0;
        f[0].column_mut(5).fill(0.0);
        let lambda: Vec<f64> = (0..6).map(|r| 1.0 + 0.37 * r as f64).collect();
        for keep in [[false; 3], [false, false, true], [true, false, false]] {
            let (want_lambda, want) = arrange_keeping_signs(lambda.clone(), f.clone(), &keep);
            let stats: Vec<_> = f
                .iter()
                .map(|m| column_stats(m.as_slice().unwrap(), 6))
                .collect();
            let plan = Arrangement::plan(lambda.clone(), &stats, &keep);
            assert_eq!(plan.lambda, want_lambda);
            for (m, src) in f.iter().enumerate() {
                let mut dst = vec![0f32; src.len()];
                plan.rows(&plan.scales(m), src.as_slice().unwrap(), &mut dst);
                assert_eq!(dst, want[m].as_slice().unwrap(), "mode {m} keep {keep:?}");
            }
            // The tie in mode 2's column 5: -2 comes first, so a free mode
            // 2 (before the absorbing mode) is flipped.
            let k = plan.order.iter().position(|&r| r == 4).unwrap();
            assert_eq!(want[1][[2, k]] > 0.0, !keep[1] && !keep[2], "keep {keep:?}");
        }
    }
}
