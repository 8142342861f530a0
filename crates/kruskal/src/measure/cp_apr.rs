//! What `kruskal cp-apr` runs on a loaded tensor, for tools that measure
//! it (`cargo xtask bench`): CP-APR on the CPU, one GPU
//! ([`kruskal_cpd::cp_apr_on`]) or several
//! ([`kruskal_cpd::cp_apr_on_gpus`]) and the typed report `kruskal cp-apr
//! --json` prints ([`CpAprReport`]). Showing the run as it goes is the
//! command's.

use std::ops::ControlFlow;
use std::path::Path;
use std::time::Instant;

use kruskal_cpd::apr::{self, AprInit, AprIteration, AprModel, AprOptions};
use kruskal_cpd::{AprRun, BackendChoice};
use serde::Serialize;

use super::Result;
use crate::input::Loaded;

/// What [`cp_apr`] runs.
#[derive(Clone, Debug)]
pub struct CpAprRunOptions {
    /// Rank, limits, tolerances and the initial factors. The default is
    /// `kruskal cp-apr`'s: rank 10, pyttb's defaults, random factors from
    /// seed 1.
    pub apr: AprOptions,
    /// The CPU, one GPU, or `auto` (the default): the GPU when one is
    /// usable, takes the rank and has the memory.
    pub backend: BackendChoice,
    /// A group of GPUs (ordinals; `backend` is then not used), and why a
    /// run asked for every GPU takes fewer ([`kruskal_cpd::apr_all_gpus`]).
    pub gpus: Option<(Vec<usize>, Option<String>)>,
}

/// The rank of `kruskal cp-apr` without `--rank`.
const DEFAULT_RANK: usize = 10;

impl Default for CpAprRunOptions {
    fn default() -> Self {
        CpAprRunOptions {
            apr: AprOptions::new(DEFAULT_RANK),
            backend: BackendChoice::Auto,
            gpus: None,
        }
    }
}

/// Runs CP-APR as `opts` asks on a loaded tensor, printing nothing, and
/// returns the report `kruskal cp-apr --json` prints (the tensor, where
/// it ran, the options, every outer iteration, the log-likelihood, the
/// times, lambda).
///
/// ```
/// use kruskal::input::TensorSource;
/// use kruskal::measure::{CpAprRunOptions, cp_apr};
///
/// let loaded = TensorSource::Like { name: "enron".into(), nnz: Some(2_000), seed: 1 }.load().unwrap();
/// let mut opts = CpAprRunOptions::default();
/// opts.apr.rank = 3;
/// opts.apr.max_iters = 2;
/// opts.backend = kruskal::cpd::BackendChoice::Cpu;
/// let report = cp_apr(&opts, &loaded).unwrap();
/// assert_eq!(report.backend, "cpu");
/// assert!(report.iterations.len() <= 2);
/// ```
pub fn cp_apr(opts: &CpAprRunOptions, loaded: &Loaded) -> Result<CpAprReport> {
    let start = Instant::now();
    let run = run_cp_apr(&loaded.tensor, opts, &mut |_| ControlFlow::Continue(()))?;
    let cp_apr_s = start.elapsed().as_secs_f64();
    Ok(cp_apr_report(loaded, &opts.apr, &run, cp_apr_s, None, None))
}

/// Runs CP-APR where `opts` says (a group of GPUs, or `opts.backend`),
/// telling `on_iteration` of every outer iteration.
pub fn run_cp_apr(
    tensor: &kruskal_formats::SparseTensor,
    opts: &CpAprRunOptions,
    on_iteration: &mut dyn FnMut(&AprIteration) -> ControlFlow<()>,
) -> Result<AprRun> {
    Ok(match &opts.gpus {
        Some((ordinals, note)) => {
            let mut run = kruskal_cpd::cp_apr_on_gpus(tensor, &opts.apr, ordinals, on_iteration)?;
            run.note = note.clone();
            run
        }
        None => kruskal_cpd::cp_apr_on(tensor, &opts.apr, opts.backend, on_iteration)?,
    })
}

/// The options a CP-APR run had, as its report gives them.
#[derive(Clone, Debug, Serialize)]
pub struct CpAprOptionsReport {
    pub iters: usize,
    pub inner_iters: usize,
    pub tol: f64,
    pub kappa: f64,
    pub kappa_tol: f64,
    pub eps_div_zero: f64,
    pub time_limit_s: Option<f64>,
    /// `random, seed S`, or the folder the initial factors came from.
    pub init: String,
}

/// What `kruskal cp-apr --json` reports of a run.
#[derive(Clone, Debug, Serialize)]
pub struct CpAprReport {
    /// Always `cp-apr`.
    pub command: &'static str,
    /// The file's path, or how the tensor was generated.
    pub source: String,
    pub dims: Vec<u32>,
    pub nnz: usize,
    pub load_s: f64,
    /// Worker threads of the CPU's pool.
    pub threads: usize,
    /// `cpu` or `gpu`.
    pub backend: &'static str,
    /// The GPU's name (the first one's on several); `None` on the CPU.
    pub device: Option<String>,
    /// GPUs the run used (0 on the CPU).
    pub gpus: usize,
    /// Why a run asked for every GPU used fewer.
    pub gpus_note: Option<String>,
    /// Why `auto` did not use the GPU.
    pub fallback: Option<String>,
    pub rank: usize,
    pub options: CpAprOptionsReport,
    /// Values that are not whole numbers (the Poisson model is meant for
    /// counts).
    pub non_integer_values: usize,
    /// Every outer iteration run.
    pub iterations: Vec<AprIteration>,
    pub log_likelihood: f64,
    /// Why the run stopped ([`stopped`]).
    pub stopped: &'static str,
    pub converged: bool,
    /// Seconds of the whole run.
    pub cp_apr_s: f64,
    /// [`seconds_per_iteration_after_first`].
    pub seconds_per_iteration_after_first: Option<f64>,
    pub lambda: Vec<f64>,
    /// The folder the model was written to.
    pub out: Option<String>,
}

/// The report of a CP-APR run on `loaded` with `opts` that took
/// `cp_apr_s` seconds: with the folder the initial factors came from
/// (`init`; without it the report names `opts.init`) and the folder the
/// model was written to (`out`), when there are.
pub fn cp_apr_report(
    loaded: &Loaded,
    opts: &AprOptions,
    run: &AprRun,
    cp_apr_s: f64,
    init: Option<&Path>,
    out: Option<&Path>,
) -> CpAprReport {
    let t = &loaded.tensor;
    let model = &run.model;
    let init = match (init, &opts.init) {
        (Some(dir), _) => dir.display().to_string(),
        (None, AprInit::Random { seed }) => format!("random, seed {seed}"),
        (None, AprInit::Given { .. }) => "given factors".to_string(),
    };
    CpAprReport {
        command: "cp-apr",
        source: loaded.source.clone(),
        dims: t.dims().to_vec(),
        nnz: t.nnz(),
        load_s: loaded.load_s,
        threads: rayon::current_num_threads(),
        backend: run.backend,
        device: run.device.clone(),
        gpus: run.gpus,
        gpus_note: run.note.clone(),
        fallback: run.fallback.clone(),
        rank: opts.rank,
        options: CpAprOptionsReport {
            iters: opts.max_iters,
            inner_iters: opts.max_inner_iters,
            tol: opts.tol,
            kappa: opts.kappa,
            kappa_tol: opts.kappa_tol,
            eps_div_zero: opts.eps_div_zero,
            time_limit_s: opts.time_limit_s,
            init,
        },
        non_integer_values: apr::non_integer_values(t),
        iterations: model.iterations.clone(),
        log_likelihood: model.log_likelihood,
        stopped: stopped(model),
        converged: model.converged,
        cp_apr_s,
        seconds_per_iteration_after_first: seconds_per_iteration_after_first(model),
        lambda: model.lambda.clone(),
        out: out.map(|p| p.display().to_string()),
    }
}

/// Why a run stopped: `converged`, `interrupted`, `time limit reached` or
/// `iteration limit reached`.
pub fn stopped(model: &AprModel) -> &'static str {
    if model.converged {
        "converged"
    } else if model.interrupted {
        "interrupted"
    } else if model.timed_out {
        "time limit reached"
    } else {
        "iteration limit reached"
    }
}

/// The steady seconds per outer iteration: the mean of the iterations
/// after the first (which also builds each mode's sorted copy of the
/// nonzeros and, on a GPU, uploads them); `None` with fewer than two.
pub fn seconds_per_iteration_after_first(model: &AprModel) -> Option<f64> {
    match model.iterations.as_slice() {
        [first, .., last] => {
            Some((last.elapsed_s - first.elapsed_s) / (model.iterations.len() - 1) as f64)
        }
        _ => None,
    }
}
