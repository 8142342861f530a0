//! The algorithm cases of `kruskal check`: the steps of CP-APR and AO-ADMM
//! that are not an MTTKRP, each implementation (the CPU's; with
//! [`CheckOptions::gpu`], the GPU's too) against an f64 reference written
//! here loop by loop from the definitions, sharing no code with the
//! implementations:
//!
//! - `cp-apr phi`: CP-APR's `Phi_n` of every mode (for each nonzero, its
//!   value over the model's value there, floored at eps, times the
//!   Khatri-Rao row of the other factors, summed into row `i_n`) and the
//!   KKT violation `max |min(A_n, 1 - Phi_n)|` the step returns, on small
//!   power-law count tensors of the check's mode counts up to
//!   [`APR_MAX_MODES`] ([`APR_NNZ`] nonzeros; the hottest rows span
//!   several of the GPU's pieces) at the check's ranks;
//! - `ao-admm prox`: the proximal step of non-negativity, L1 and L2
//!   ([`PROX_WEIGHTS`]) on signed values at each rank; the reference is
//!   the minimizer of `l1 |h| + l2 h^2 + rho/2 (h - v)^2` (`h >= 0` on a
//!   non-negative mode), solved case by case;
//! - `ao-admm inner`: the inner loop of one mode on a small problem (a
//!   random Gram G, `rho = trace(G) / R`, `W = (G + rho I)^{-1}`, `K = H*
//!   G` for a factor H* with some negative entries, every seventh row's K
//!   0, H and U warm near it)
//!   at each rank: [`FIXED_ITERS`] iterations (`eps` 0, so no row stops
//!   early), and the stopping rule at the runs' `eps` of 1e-2, for all
//!   rows together and for each row on its own (all the GPU runs). The
//!   iterations run must equal the reference's.
//!
//! Errors are relative Frobenius errors; the bounds ([`PHI_TOLERANCE`],
//! [`PROX_TOLERANCE`], [`INNER_TOLERANCE`]) say why they are what they
//! are. Every input is f64, or f32 widened exactly, so the bounds are f64
//! rounding, not the 1e-5 of the f32 MTTKRP engines.

use std::sync::Arc;

use kruskal_cpd::admm::{InnerStop, inner_loop_host, inner_params, prox_host};
use kruskal_device::Gpu;
use kruskal_device::admm::{AdmmKernels, BLOCK_ROWS, InnerParams};
use kruskal_formats::SparseTensor;
use ndarray::Array2;

use super::{
    CaseResult, CheckOptions, Group, Result, TensorInfo, guarded, hottest_row_share,
    power_law_tensor,
};

/// Nonzeros of each count tensor of the `cp-apr phi` cases: the naive
/// reference costs `nnz * R * N` per mode, and the hottest rows (10% to
/// 30% of the nonzeros) still hold more than one GPU piece (256).
pub const APR_NNZ: usize = 3_000;

/// The most modes of a `cp-apr phi` count tensor. The naive reference
/// costs `N^2` passes over the nonzeros for the N modes, and CP-APR's
/// kernels take the mode count as an argument (only the rank is compiled
/// in), so 3 and 4 modes reach the code that 5 and 6 would.
pub const APR_MAX_MODES: usize = 4;

/// CP-APR's default floor of the model's value (pyttb's `epsDivZero`).
/// The factors are at least 0.05, so the model's values stay far above it.
const EPS_DIV_ZERO: f64 = kruskal_cpd::apr::DEFAULT_EPS_DIV_ZERO;

/// Largest relative error of `Phi` (and of the KKT violation, relative to
/// `max(1, violation)`). Both sides compute in f64 from the same f64
/// factors and exact f32 counts; every term of a sum is positive, so
/// nothing cancels, and an entry's relative error is at most about
/// `(terms + R + 3) * 2^-53` whatever the order: 1e-13 for the hottest
/// row (about 900 nonzeros) at rank 100. A nonzero left out of a row, or
/// a wrong factor row, is many orders above.
pub const PHI_TOLERANCE: f64 = 1e-12;

/// Largest relative error of the proximal step: one subtraction, one
/// division or multiplication each side, in another algebraic form
/// (`(rho v - l1) / (rho + 2 l2)` against `(v - l1 / rho) / (1 + 2 l2 /
/// rho)`): a few units of rounding of each value.
pub const PROX_TOLERANCE: f64 = 1e-12;

/// Largest relative error of H and U together after an inner loop. Each
/// iteration is a product by W (R terms, signed) and the proximal step,
/// which does not expand; W's condition number is at most R + 1 (`rho =
/// trace(G) / R` bounds G's largest eigenvalue by `R rho`), so an
/// iteration adds at most about `R (R + 1) 2^-53` relative: over 20
/// iterations at rank 100, 2e-11 at the worst, 1e-14 in practice (errors
/// of random sign). A wrong step or one iteration more or less is above
/// 1e-4.
pub const INNER_TOLERANCE: f64 = 1e-10;

/// The weights of the `ao-admm prox` cases: `(non-negative, l1, l2)`.
pub const PROX_WEIGHTS: [(bool, f64, f64); 4] = [
    (true, 0.0, 0.0),
    (true, 0.5, 0.25),
    (false, 0.5, 0.0),
    (false, 0.3, 0.4),
];

/// The rho of the `ao-admm prox` cases.
const PROX_RHO: f64 = 1.7;

/// Rows of the values of an `ao-admm prox` case (of `rank` values each).
const PROX_ROWS: usize = 40;

/// The weights of the `ao-admm inner` cases: `(non-negative, l1, l2)`.
const INNER_WEIGHTS: [(bool, f64, f64); 2] = [(true, 0.1, 0.0), (false, 0.05, 0.1)];

/// Inner iterations of the fixed-length `ao-admm inner` cases.
pub const FIXED_ITERS: usize = 10;

/// Inner iterations at most of the cases that stop by the rule.
const RULE_MAX_ITERS: usize = 20;

/// A proximal step: non-negativity, the L1 and L2 weights, and rho.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProxWeights {
    pub nonneg: bool,
    pub l1: f64,
    pub l2: f64,
    pub rho: f64,
}

impl ProxWeights {
    fn describe(&self) -> String {
        format!(
            "{}, l1 {}, l2 {}",
            if self.nonneg { "non-negative" } else { "free" },
            self.l1,
            self.l2
        )
    }
}

/// One mode's inner loop to run: K (`rows x rank`, row-major, f32 as the
/// MTTKRP gives it), W (`rank x rank`, row-major), the proximal step, the
/// start of H and U and the stopping rule's limits.
#[derive(Clone, Debug)]
pub struct InnerProblem {
    pub rank: usize,
    pub k: Vec<f32>,
    pub w: Vec<f64>,
    pub prox: ProxWeights,
    pub h0: Vec<f64>,
    pub u0: Vec<f64>,
    pub max_inner: usize,
    pub eps: f64,
}

impl InnerProblem {
    /// The parameters a run would hand the loop (`kruskal_cpd`'s own
    /// derivation of the threshold and the shrink).
    pub fn params(&self) -> InnerParams {
        let p = &self.prox;
        inner_params(p.nonneg, p.l1, p.l2, p.rho, self.max_inner, self.eps)
    }

    fn rows(&self) -> usize {
        self.k.len() / self.rank.max(1)
    }
}

/// `Phi_n` and the KKT violation of every mode for a tensor, factors and
/// eps.
pub type PhiFn =
    Box<dyn Fn(&SparseTensor, &[Array2<f64>], f64) -> Result<Vec<(Array2<f64>, f64)>, String>>;
/// The proximal step of each value (`rows x rank`, row-major, at `rank`).
pub type ProxFn = Box<dyn Fn(&ProxWeights, &[f32], usize) -> Result<Vec<f64>, String>>;
/// The inner loop on H and U (starting as the problem's `h0` and `u0`)
/// under a stopping rule; the iterations run.
pub type InnerFn =
    Box<dyn Fn(&InnerProblem, InnerStop, &mut [f64], &mut [f64]) -> Result<usize, String>>;

/// What an implementation computes.
pub enum Step {
    Phi(PhiFn),
    Prox(ProxFn),
    /// The stopping rules it runs.
    Inner {
        stops: Vec<InnerStop>,
        run: InnerFn,
    },
}

/// An implementation to check, as the table names it.
pub struct StepSpec {
    /// E.g. `cp-apr phi (cpu)`.
    pub label: String,
    pub step: Step,
}

/// The CPU's implementations: `kruskal_cpd`'s CP-APR steps and AO-ADMM
/// host loop.
pub fn cpu_steps() -> Vec<StepSpec> {
    vec![
        StepSpec {
            label: "cp-apr phi (cpu)".into(),
            step: Step::Phi(Box::new(|t, factors, eps| {
                kruskal_cpd::apr::phi_cpu(t, factors, eps).map_err(|e| e.to_string())
            })),
        },
        StepSpec {
            label: "ao-admm prox (cpu)".into(),
            step: Step::Prox(Box::new(|p, v, _rank| {
                let params = inner_params(p.nonneg, p.l1, p.l2, p.rho, 1, 0.0);
                let v: Vec<f64> = v.iter().map(|&x| f64::from(x)).collect();
                Ok(prox_host(&params, &v))
            })),
        },
        StepSpec {
            label: "ao-admm inner (cpu)".into(),
            step: Step::Inner {
                stops: vec![InnerStop::AllRows, InnerStop::RowBlocks],
                run: Box::new(|p, stop, h, u| {
                    let k: Vec<f64> = p.k.iter().map(|&x| f64::from(x)).collect();
                    inner_loop_host(&k, h, u, &p.w, p.rank, &p.params(), stop)
                        .map_err(|e| e.to_string())
                }),
            },
        },
    ]
}

/// The GPU's implementations on `gpu`: `AprGpu`'s steps as a GPU run
/// drives them, and `kruskal_device::admm`'s inner loop.
pub fn gpu_steps(gpu: &Arc<Gpu>) -> Vec<StepSpec> {
    let (apr, prox, inner) = (gpu.clone(), gpu.clone(), gpu.clone());
    vec![
        StepSpec {
            label: "cp-apr phi (gpu)".into(),
            step: Step::Phi(Box::new(move |t, factors, eps| {
                kruskal_cpd::apr_gpu::phi_gpu(apr.clone(), t, factors, eps)
                    .map_err(|e| e.to_string())
            })),
        },
        StepSpec {
            label: "ao-admm prox (gpu)".into(),
            // The GPU has no proximal step of its own: it is inside the
            // inner loop's kernel. One iteration from H = U = 0 with W = I
            // gives Ht = K exactly (the other products are by 0 and 1), so
            // the new H is prox(K).
            step: Step::Prox(Box::new(move |p, v, rank| {
                let params = inner_params(p.nonneg, p.l1, p.l2, p.rho, 1, 0.0);
                let identity: Vec<f64> = (0..rank * rank)
                    .map(|e| if e / rank == e % rank { 1.0 } else { 0.0 })
                    .collect();
                let mut h = vec![0f64; v.len()];
                let mut u = vec![0f64; v.len()];
                AdmmKernels::new(prox.clone(), rank)
                    .and_then(|mut k| k.inner_loop_host(v, &identity, &mut h, &mut u, &params))
                    .map_err(|e| e.to_string())?;
                Ok(h)
            })),
        },
        StepSpec {
            label: "ao-admm inner (gpu)".into(),
            step: Step::Inner {
                stops: vec![InnerStop::RowBlocks],
                run: Box::new(move |p, _stop, h, u| {
                    AdmmKernels::new(inner.clone(), p.rank)
                        .and_then(|mut k| k.inner_loop_host(&p.k, &p.w, h, u, &p.params()))
                        .map(|stats| stats.iters)
                        .map_err(|e| e.to_string())
                }),
            },
        },
    ]
}

/// The count tensor of the `cp-apr phi` cases with `nmodes` modes: the
/// check's power-law tensor with [`APR_NNZ`] nonzeros, its values made
/// counts from 1 to 5.
pub fn count_tensor(nmodes: usize, seed: u64) -> Result<SparseTensor> {
    let t = power_law_tensor(nmodes, APR_NNZ, seed)?;
    let (dims, indices, values) = t.into_parts();
    let counts = values
        .iter()
        .map(|v| (v.abs() * 5.0).ceil().clamp(1.0, 5.0))
        .collect();
    Ok(SparseTensor::new(dims, indices, counts)?)
}

/// Positive factors, at least 0.05: CP-APR's factors are non-negative, and
/// away from 0 the model's values stay far above eps.
fn apr_factors(dims: &[u32], rank: usize, seed: u64) -> Vec<Array2<f64>> {
    kruskal_cpd::random_factors(dims, rank, seed)
        .into_iter()
        .map(|f| f.mapv(|x| f64::from(x) + 0.05))
        .collect()
}

/// `Phi_n` and the KKT violation, naively: for each nonzero in the
/// tensor's order, the Khatri-Rao row of the other modes' factors, the
/// model's value at the nonzero, and the weighted row added into row
/// `i_n`.
pub fn phi_reference(
    t: &SparseTensor,
    factors: &[Array2<f64>],
    mode: usize,
    eps: f64,
) -> (Array2<f64>, f64) {
    let a = &factors[mode];
    let rank = a.ncols();
    let idx = t.indices();
    let mut phi = Array2::<f64>::zeros(a.dim());
    let mut krp = vec![0f64; rank];
    for (k, &x) in t.values().iter().enumerate() {
        krp.fill(1.0);
        for (m, f) in factors.iter().enumerate() {
            if m != mode {
                for (p, &y) in krp.iter_mut().zip(f.row(idx[m][k] as usize)) {
                    *p *= y;
                }
            }
        }
        let i = idx[mode][k] as usize;
        let model: f64 = a.row(i).iter().zip(&krp).map(|(&y, &p)| y * p).sum();
        let weight = f64::from(x) / model.max(eps);
        for (out, &p) in phi.row_mut(i).iter_mut().zip(&krp) {
            *out += weight * p;
        }
    }
    let kkt = a
        .iter()
        .zip(phi.iter())
        .map(|(&x, &p)| x.min(1.0 - p).abs())
        .fold(0.0, f64::max);
    (phi, kkt)
}

/// The proximal step of one value: the minimizer of `l1 |h| + l2 h^2 +
/// rho/2 (h - v)^2`, over `h >= 0` on a non-negative mode. The function is
/// strictly convex; where `h > 0` its derivative `l1 + 2 l2 h + rho (h -
/// v)` vanishes at `(rho v - l1) / (rho + 2 l2)`, positive when `rho v >
/// l1`; where `h < 0`, at `(rho v + l1) / (rho + 2 l2)`, negative when
/// `rho v < -l1`; otherwise the minimum is at the kink, 0.
pub fn prox_reference(p: &ProxWeights, v: f64) -> f64 {
    let rv = p.rho * v;
    if rv > p.l1 {
        (rv - p.l1) / (p.rho + 2.0 * p.l2)
    } else if !p.nonneg && rv < -p.l1 {
        (rv + p.l1) / (p.rho + 2.0 * p.l2)
    } else {
        0.0
    }
}

/// The inner loop, naively: for each group of rows that stop together
/// (all of them, or each [`BLOCK_ROWS`] = one row), iterations of
/// `Ht = (K + rho (H + U)) W`, `H = prox(Ht - U)`, `U += H - Ht`, row by
/// row, until both `||H - Ht||^2 <= eps ||H||^2` and
/// `||H - H_prev||^2 <= eps ||U||^2` over the group, or `max_inner`; a
/// row whose K is all zero starts at H = U = 0 (its exact solution).
/// Returns H, U and the most iterations a group ran.
pub fn inner_reference(p: &InnerProblem, stop: InnerStop) -> (Vec<f64>, Vec<f64>, usize) {
    let (rank, rows, rho) = (p.rank, p.rows(), p.prox.rho);
    let group = match stop {
        InnerStop::AllRows => rows.max(1),
        InnerStop::RowBlocks => BLOCK_ROWS,
    };
    let (mut h, mut u) = (p.h0.clone(), p.u0.clone());
    for i in 0..rows {
        if p.k[i * rank..(i + 1) * rank].iter().all(|&x| x == 0.0) {
            h[i * rank..(i + 1) * rank].fill(0.0);
            u[i * rank..(i + 1) * rank].fill(0.0);
        }
    }
    let mut ht = vec![0f64; rank];
    let mut most = 0;
    for first in (0..rows).step_by(group) {
        let last = (first + group).min(rows);
        let mut iters = 0;
        loop {
            iters += 1;
            let (mut primal, mut dual, mut h_sq, mut u_sq) = (0f64, 0f64, 0f64, 0f64);
            for i in first..last {
                for (j, t) in ht.iter_mut().enumerate() {
                    *t = (0..rank)
                        .map(|c| {
                            let e = i * rank + c;
                            (f64::from(p.k[e]) + rho * (h[e] + u[e])) * p.w[c * rank + j]
                        })
                        .sum();
                }
                for (j, &t) in ht.iter().enumerate() {
                    let e = i * rank + j;
                    let fresh = prox_reference(&p.prox, t - u[e]);
                    u[e] += fresh - t;
                    primal += (fresh - t) * (fresh - t);
                    dual += (fresh - h[e]) * (fresh - h[e]);
                    h_sq += fresh * fresh;
                    u_sq += u[e] * u[e];
                    h[e] = fresh;
                }
            }
            if (primal <= p.eps * h_sq && dual <= p.eps * u_sq) || iters >= p.max_inner {
                break;
            }
        }
        most = most.max(iters);
    }
    (h, u, most)
}

/// Values in [-2, 2): signed, so the proximal steps cut on both sides.
fn signed_values(rows: usize, rank: usize, seed: u64) -> Vec<f32> {
    kruskal_cpd::random_factors(&[rows as u32], rank, seed)[0]
        .iter()
        .map(|&x| 4.0 * (x - 0.5))
        .collect()
}

/// The inner loop's problem of `rows` rows at `rank`, with the weights
/// `(non-negative, l1, l2)` and the stopping rule's limits: see the
/// module's description.
pub fn inner_problem(
    rows: usize,
    rank: usize,
    weights: (bool, f64, f64),
    max_inner: usize,
    eps: f64,
    seed: u64,
) -> InnerProblem {
    let draw = |rows: usize, seed: u64| {
        kruskal_cpd::random_factors(&[rows as u32], rank, seed)
            .remove(0)
            .mapv(f64::from)
    };
    let b = draw(2 * rank + 8, seed.wrapping_add(1));
    let mut g = b.t().dot(&b);
    let rho = g.diag().sum() / rank as f64;
    // K as an MTTKRP gives it near a solution: H* G for a factor H* with
    // some entries below 0 (which a non-negative mode's prox cuts), and
    // H and U warm, as an outer iteration after the first leaves them.
    let target = draw(rows, seed.wrapping_add(2)).mapv(|x| x - 0.2);
    let mut k = target.dot(&g);
    // Rows without data (K = 0), as most rows of a long sparse mode are.
    for (i, mut row) in k.rows_mut().into_iter().enumerate() {
        if i % 7 == 2 {
            row.fill(0.0);
        }
    }
    for r in 0..rank {
        g[[r, r]] += rho;
    }
    let (w, _) = kruskal_cpd::dense::solve_matrix(&g);
    let (nonneg, l1, l2) = weights;
    let noise = draw(rows, seed.wrapping_add(3));
    InnerProblem {
        rank,
        k: k.iter().map(|&x| x as f32).collect(),
        w: w.iter().copied().collect(),
        prox: ProxWeights {
            nonneg,
            l1,
            l2,
            rho,
        },
        h0: target
            .iter()
            .zip(&noise)
            .map(|(&x, &e)| x + 0.1 * (e - 0.5))
            .collect(),
        u0: noise.iter().map(|&e| 0.01 * (e - 0.5)).collect(),
        max_inner,
        eps,
    }
}

/// Compares f64 values with the reference: the relative Frobenius error
/// (absolute where the reference is 0), or why the case fails (a wrong
/// length, NaN, an error above `tolerance`).
pub fn compare_f64(got: &[f64], want: &[f64], tolerance: f64) -> (Option<f64>, Option<String>) {
    if got.len() != want.len() {
        return (
            None,
            Some(format!(
                "{} values, the reference has {}",
                got.len(),
                want.len()
            )),
        );
    }
    let nan = got.iter().filter(|x| x.is_nan()).count();
    if nan > 0 {
        return (None, Some(format!("{nan} NaN entries of {}", got.len())));
    }
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>()
        .sqrt();
    let norm = want.iter().map(|x| x * x).sum::<f64>().sqrt();
    let err = if norm > 0.0 { diff / norm } else { diff };
    if err <= tolerance {
        (Some(err), None)
    } else {
        (
            Some(err),
            Some(format!("relative error {err:.2e} > {tolerance:.0e}")),
        )
    }
}

fn case(spec: &StepSpec, tensor: &str, rank: usize, mode: Option<usize>) -> CaseResult {
    CaseResult {
        engine: spec.label.clone(),
        group: Group::Algorithm,
        tensor: tensor.to_string(),
        rank: Some(rank),
        mode: mode.map(|m| m + 1),
        relative_error: None,
        failure: None,
    }
}

/// Runs the algorithm cases of `specs` at the check's mode counts up to
/// [`APR_MAX_MODES`] (the count tensors of `cp-apr phi`) and ranks. Returns the count tensors
/// and the cases; an implementation that errors or panics is a failed
/// case, and the check goes on.
pub fn run_algorithms(
    opts: &CheckOptions,
    specs: &[StepSpec],
) -> Result<(Vec<TensorInfo>, Vec<CaseResult>)> {
    let mut tensors = Vec::new();
    let mut cases = Vec::new();
    let phis: Vec<(&StepSpec, &PhiFn)> = specs
        .iter()
        .filter_map(|s| match &s.step {
            Step::Phi(f) => Some((s, f)),
            _ => None,
        })
        .collect();
    let proxes: Vec<(&StepSpec, &ProxFn)> = specs
        .iter()
        .filter_map(|s| match &s.step {
            Step::Prox(f) => Some((s, f)),
            _ => None,
        })
        .collect();
    let inners: Vec<(&StepSpec, &[InnerStop], &InnerFn)> = specs
        .iter()
        .filter_map(|s| match &s.step {
            Step::Inner { stops, run } => Some((s, stops.as_slice(), run)),
            _ => None,
        })
        .collect();

    if !phis.is_empty() {
        for &n in opts.nmodes.iter().filter(|&&n| n <= APR_MAX_MODES) {
            let t = count_tensor(n, opts.seed)?;
            let name = format!("counts {n} modes");
            tensors.push(TensorInfo {
                name: name.clone(),
                dims: t.dims().to_vec(),
                nnz: t.nnz(),
                hottest_row_share: hottest_row_share(&t),
            });
            for &rank in &opts.ranks {
                let factors = apr_factors(t.dims(), rank, opts.seed.wrapping_add(rank as u64));
                let want: Vec<(Array2<f64>, f64)> = (0..n)
                    .map(|m| phi_reference(&t, &factors, m, EPS_DIV_ZERO))
                    .collect();
                for &(spec, run) in &phis {
                    match guarded(|| run(&t, &factors, EPS_DIV_ZERO)) {
                        Ok(got) if got.len() == n => {
                            for (m, ((phi, kkt), (want_phi, want_kkt))) in
                                got.iter().zip(&want).enumerate()
                            {
                                cases.push(phi_case(
                                    case(spec, &name, rank, Some(m)),
                                    phi,
                                    *kkt,
                                    want_phi,
                                    *want_kkt,
                                ));
                            }
                        }
                        Ok(got) => cases.push(CaseResult {
                            failure: Some(format!("{} modes of Phi for {n} modes", got.len())),
                            ..case(spec, &name, rank, None)
                        }),
                        Err(e) => cases.push(CaseResult {
                            failure: Some(e),
                            ..case(spec, &name, rank, None)
                        }),
                    }
                }
            }
        }
    }

    for &rank in &opts.ranks {
        let seed = opts.seed.wrapping_add(rank as u64);
        if !proxes.is_empty() {
            let v = signed_values(PROX_ROWS, rank, seed);
            for (nonneg, l1, l2) in PROX_WEIGHTS {
                let weights = ProxWeights {
                    nonneg,
                    l1,
                    l2,
                    rho: PROX_RHO,
                };
                let want: Vec<f64> = v
                    .iter()
                    .map(|&x| prox_reference(&weights, f64::from(x)))
                    .collect();
                let name = format!("prox: {}, rho {PROX_RHO}", weights.describe());
                for &(spec, run) in &proxes {
                    let mut c = case(spec, &name, rank, None);
                    match guarded(|| run(&weights, &v, rank)) {
                        Ok(got) => {
                            (c.relative_error, c.failure) = compare_f64(&got, &want, PROX_TOLERANCE)
                        }
                        Err(e) => c.failure = Some(e),
                    }
                    cases.push(c);
                }
            }
        }
        if inners.is_empty() {
            continue;
        }
        // Above 1,024 rows the CPU's all-rows loop sums its residuals over
        // several tasks; at the larger ranks 40 rows keep the naive
        // reference quick.
        let rows = if rank <= 8 { 1_100 } else { 40 };
        for weights in INNER_WEIGHTS {
            for (what, max_inner, eps) in [
                (format!("{FIXED_ITERS} iterations"), FIXED_ITERS, 0.0),
                (
                    format!("eps 1e-2, at most {RULE_MAX_ITERS} iterations"),
                    RULE_MAX_ITERS,
                    1e-2,
                ),
            ] {
                let p = inner_problem(rows, rank, weights, max_inner, eps, seed);
                for stop in [InnerStop::AllRows, InnerStop::RowBlocks] {
                    let name = format!(
                        "inner: {rows} rows, {}, {what}, {}",
                        p.prox.describe(),
                        stop.describe()
                    );
                    let runs: Vec<_> = inners
                        .iter()
                        .filter(|(_, stops, _)| stops.contains(&stop))
                        .collect();
                    if runs.is_empty() {
                        continue;
                    }
                    let (want_h, want_u, want_iters) = inner_reference(&p, stop);
                    for &&(spec, _, run) in &runs {
                        let mut c = case(spec, &name, rank, None);
                        let (mut h, mut u) = (p.h0.clone(), p.u0.clone());
                        match guarded(|| run(&p, stop, &mut h, &mut u)) {
                            Ok(iters) => {
                                h.extend_from_slice(&u);
                                let want: Vec<f64> =
                                    want_h.iter().chain(&want_u).copied().collect();
                                (c.relative_error, c.failure) =
                                    compare_f64(&h, &want, INNER_TOLERANCE);
                                if c.failure.is_none() && iters != want_iters {
                                    c.failure = Some(format!(
                                        "ran {iters} inner iterations, the reference {want_iters}"
                                    ));
                                }
                            }
                            Err(e) => c.failure = Some(e),
                        }
                        cases.push(c);
                    }
                }
            }
        }
    }
    Ok((tensors, cases))
}

/// A `cp-apr phi` case from its result: `Phi` and the KKT violation
/// against the reference's.
fn phi_case(
    mut c: CaseResult,
    phi: &Array2<f64>,
    kkt: f64,
    want_phi: &Array2<f64>,
    want_kkt: f64,
) -> CaseResult {
    if phi.dim() != want_phi.dim() {
        c.failure = Some(format!(
            "Phi is {:?}, the reference {:?}",
            phi.dim(),
            want_phi.dim()
        ));
        return c;
    }
    let got: Vec<f64> = phi.iter().copied().collect();
    let want: Vec<f64> = want_phi.iter().copied().collect();
    let (err, failure) = compare_f64(&got, &want, PHI_TOLERANCE);
    let kkt_err = (kkt - want_kkt).abs() / want_kkt.max(1.0);
    c.relative_error = err.map(|e| e.max(kkt_err));
    c.failure = failure.or_else(|| {
        (kkt_err.is_nan() || kkt_err > PHI_TOLERANCE).then(|| {
            format!("KKT violation {kkt:.6e}, the reference {want_kkt:.6e} (relative error {kkt_err:.2e})")
        })
    });
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::{CheckReport, SummaryRow};

    fn small() -> CheckOptions {
        CheckOptions {
            nmodes: vec![3, 4],
            ranks: vec![1, 7],
            nnz: 3_000,
            data: None,
            gpu: false,
            seed: 3,
        }
    }

    fn report(specs: &[StepSpec]) -> CheckReport {
        let (tensors, cases) = run_algorithms(&small(), specs).unwrap();
        CheckReport {
            threads: 1,
            gpu: None,
            tensors,
            notes: Vec::new(),
            cases,
            elapsed_s: 0.0,
        }
    }

    fn row<'a>(rows: &'a [SummaryRow], engine: &str) -> &'a SummaryRow {
        rows.iter()
            .find(|r| r.engine == engine && r.group == Group::Algorithm)
            .unwrap_or_else(|| panic!("no row {engine}: {rows:#?}"))
    }

    #[test]
    fn cpu_steps_pass_every_case() {
        let report = report(&cpu_steps());
        let failures: Vec<_> = report.failures().collect();
        assert!(failures.is_empty(), "{failures:#?}");
        let rows = report.summary();
        for r in &rows {
            eprintln!(
                "{} worst {:?} over {} cases",
                r.engine, r.worst_error, r.cases
            );
        }
        // Phi: every mode of 3 and 4 modes at 2 ranks; the prox: 4 weights
        // at 2 ranks; the inner loop: 2 weights, fixed and by the rule,
        // both stopping rules, at 2 ranks.
        assert_eq!(row(&rows, "cp-apr phi (cpu)").cases, 7 * 2);
        assert_eq!(row(&rows, "ao-admm prox (cpu)").cases, 4 * 2);
        assert_eq!(row(&rows, "ao-admm inner (cpu)").cases, 2 * 2 * 2 * 2);
        let names: Vec<&str> = report.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["counts 3 modes", "counts 4 modes"]);
        // The count tensors have the hot rows the GPU cuts into pieces.
        for t in &report.tensors {
            assert!(t.hottest_row_share * APR_NNZ as f64 > 256.0, "{t:?}");
        }
    }

    #[test]
    fn the_references_solve_their_definitions() {
        // Phi by hand: a 2 x 2 matrix with nonzeros (1, 1) = 3 and
        // (2, 2) = 5, rank 1, a = (1, 2), b = (3, 4): row i of Phi_1 is
        // x / (a_i b_j) * b_j = x / a_i.
        let t =
            SparseTensor::new(vec![2, 2], vec![vec![0, 1], vec![0, 1]], vec![3.0, 5.0]).unwrap();
        let factors = [
            Array2::from_shape_vec((2, 1), vec![1.0, 2.0]).unwrap(),
            Array2::from_shape_vec((2, 1), vec![3.0, 4.0]).unwrap(),
        ];
        let (phi, kkt) = phi_reference(&t, &factors, 0, 1e-10);
        assert_eq!(phi.iter().copied().collect::<Vec<_>>(), [3.0, 2.5]);
        // max |min(a, 1 - phi)| = max(2, 1.5).
        assert_eq!(kkt, 2.0);
        // The floor: a model value of 0 is divided as eps.
        let zero = [Array2::zeros((2, 1)), factors[1].clone()];
        let (phi, _) = phi_reference(&t, &zero, 0, 0.5);
        assert_eq!(phi.iter().copied().collect::<Vec<_>>(), [18.0, 40.0]);

        // The prox: nothing near its value does better, and a
        // non-negative mode's is never negative.
        for (nonneg, l1, l2) in PROX_WEIGHTS {
            let p = ProxWeights {
                nonneg,
                l1,
                l2,
                rho: PROX_RHO,
            };
            let objective =
                |h: f64, v: f64| l1 * h.abs() + l2 * h * h + 0.5 * p.rho * (h - v) * (h - v);
            for k in -40..=40 {
                let v = f64::from(k) / 20.0;
                let h = prox_reference(&p, v);
                assert!(!nonneg || h >= 0.0, "{p:?} at {v}: {h}");
                for d in [1e-6, 1e-3, 0.1] {
                    for near in [h - d, h + d] {
                        if nonneg && near < 0.0 {
                            continue;
                        }
                        assert!(
                            objective(h, v) <= objective(near, v) + 1e-15,
                            "{p:?} at {v}: {h} against {near}"
                        );
                    }
                }
            }
        }

        // The inner loop: a limit of one iteration stops every group after
        // one, and from H = U = 0 with W = I that iteration is the prox of
        // K (how the GPU's prox case is run).
        let mut p = inner_problem(40, 3, INNER_WEIGHTS[1], 1, 0.0, 1);
        p.w = (0..9).map(|e| if e % 4 == 0 { 1.0 } else { 0.0 }).collect();
        p.h0.fill(0.0);
        p.u0.fill(0.0);
        for stop in [InnerStop::AllRows, InnerStop::RowBlocks] {
            let (h, _, iters) = inner_reference(&p, stop);
            assert_eq!(iters, 1);
            let want: Vec<f64> =
                p.k.iter()
                    .map(|&x| prox_reference(&p.prox, f64::from(x)))
                    .collect();
            assert_eq!(h, want);
        }
    }

    /// Implementations that are wrong in ways the check must notice.
    fn broken_steps() -> Vec<StepSpec> {
        let shrinkless = |p: &ProxWeights, v: f64| {
            let t = p.l1 / p.rho;
            if v > t {
                v - t
            } else if !p.nonneg && v < -t {
                v + t
            } else {
                0.0
            }
        };
        vec![
            StepSpec {
                label: "phi off by 1e-9".into(),
                step: Step::Phi(Box::new(|t, f, eps| {
                    let mut out =
                        kruskal_cpd::apr::phi_cpu(t, f, eps).map_err(|e| e.to_string())?;
                    for (phi, _) in &mut out {
                        phi.mapv_inplace(|x| x * (1.0 + 1e-9));
                    }
                    Ok(out)
                })),
            },
            StepSpec {
                label: "kkt of 0".into(),
                step: Step::Phi(Box::new(|t, f, eps| {
                    let out = kruskal_cpd::apr::phi_cpu(t, f, eps).map_err(|e| e.to_string())?;
                    Ok(out.into_iter().map(|(phi, _)| (phi, 0.0)).collect())
                })),
            },
            StepSpec {
                label: "phi panics".into(),
                step: Step::Phi(Box::new(|_, _, _| todo!("this step"))),
            },
            StepSpec {
                label: "prox without l2".into(),
                step: Step::Prox(Box::new(move |p, v, _| {
                    Ok(v.iter().map(|&x| shrinkless(p, f64::from(x))).collect())
                })),
            },
            StepSpec {
                label: "inner one iteration short".into(),
                step: Step::Inner {
                    stops: vec![InnerStop::AllRows, InnerStop::RowBlocks],
                    run: Box::new(|p, stop, h, u| {
                        let k: Vec<f64> = p.k.iter().map(|&x| f64::from(x)).collect();
                        let mut params = p.params();
                        params.max_inner = params.max_inner.saturating_sub(1).max(1);
                        let ran = inner_loop_host(&k, h, u, &p.w, p.rank, &params, stop)
                            .map_err(|e| e.to_string())?;
                        // Claims the limit it was given when it hit its own.
                        Ok(if ran == params.max_inner as usize {
                            p.max_inner
                        } else {
                            ran
                        })
                    }),
                },
            },
            StepSpec {
                label: "inner errors".into(),
                step: Step::Inner {
                    stops: vec![InnerStop::RowBlocks],
                    run: Box::new(|_, _, _, _| Err("no GPU opens here".into())),
                },
            },
        ]
    }

    #[test]
    fn broken_steps_fail_and_the_check_goes_on() {
        let mut specs = broken_steps();
        specs.extend(cpu_steps());
        let report = report(&specs);
        assert!(!report.passed());
        let rows = report.summary();
        let failed = |engine: &str| {
            let r = row(&rows, engine);
            (r.failed, r.cases)
        };
        assert_eq!(failed("phi off by 1e-9"), (14, 14));
        assert_eq!(failed("kkt of 0"), (14, 14));
        assert!(report.failures().any(|c| {
            c.engine == "kkt of 0"
                && c.failure
                    .as_deref()
                    .is_some_and(|f| f.starts_with("KKT violation"))
        }));
        // One failed case per tensor and rank, with the panic's message.
        assert_eq!(failed("phi panics"), (4, 4));
        assert!(report.failures().any(|c| c.engine == "phi panics"
            && c.failure.as_deref() == Some("panicked: not yet implemented: this step")));
        // Only the weights with an l2 show the missing shrink.
        assert_eq!(failed("prox without l2"), (4, 8));
        assert!(
            report
                .failures()
                .filter(|c| c.engine == "prox without l2")
                .all(|c| !c.tensor.contains("l2 0,"))
        );
        // Every fixed-length case shows the missing iteration (a case
        // stopped by the rule shows it only where a row ran to the
        // limit).
        let short: Vec<_> = report
            .failures()
            .filter(|c| c.engine == "inner one iteration short")
            .collect();
        let fixed = short
            .iter()
            .filter(|c| c.tensor.contains(&format!("{FIXED_ITERS} iterations,")))
            .count();
        assert_eq!(fixed, 8, "{short:#?}");
        assert_eq!(failed("inner errors"), (8, 8));
        assert!(report.failures().any(
            |c| c.engine == "inner errors" && c.failure.as_deref() == Some("no GPU opens here")
        ));
        // The real implementations after them still ran and passed.
        for engine in [
            "cp-apr phi (cpu)",
            "ao-admm prox (cpu)",
            "ao-admm inner (cpu)",
        ] {
            assert_eq!(row(&rows, engine).failed, 0, "{engine}");
        }
    }

    #[test]
    fn implementations_that_refuse_their_inputs_fail_their_cases() {
        // The CPU's own checks: factors that do not fit, a W of the wrong
        // size.
        let t = count_tensor(3, 1).unwrap();
        let bad = apr_factors(&[5, 5, 5], 2, 1);
        assert!(kruskal_cpd::apr::phi_cpu(&t, &bad, EPS_DIV_ZERO).is_err());
        let p = inner_problem(40, 2, INNER_WEIGHTS[1], 3, 0.0, 1);
        let k: Vec<f64> = p.k.iter().map(|&x| f64::from(x)).collect();
        let (mut h, mut u) = (p.h0.clone(), p.u0.clone());
        assert!(
            inner_loop_host(
                &k,
                &mut h,
                &mut u,
                &p.w[..3],
                2,
                &p.params(),
                InnerStop::AllRows
            )
            .is_err()
        );
        // A wrong length is a failed case, not a panic.
        let (err, failure) = compare_f64(&[1.0], &[1.0, 2.0], 1e-12);
        assert_eq!(err, None);
        assert!(failure.unwrap().contains("1 values"));
        let (_, failure) = compare_f64(&[f64::NAN, 2.0], &[1.0, 2.0], 1e-12);
        assert!(failure.unwrap().contains("1 NaN"));
        assert_eq!(compare_f64(&[0.0], &[0.0], 1e-12), (Some(0.0), None));
    }
}
