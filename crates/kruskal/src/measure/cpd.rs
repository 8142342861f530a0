//! What `kruskal cpd` runs on a loaded tensor, for tools that measure it
//! (`cargo xtask bench`): the backend and every start of CPD-ALS
//! ([`kruskal_cpd::decompose`]) and the typed report `kruskal cpd --json`
//! prints ([`CpdReport`]). Showing the run as it goes is the command's.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::atomic::AtomicBool;

use kruskal_cpd::{
    Chosen, DecomposeOptions, Decomposition, IterationStats, KernelPlan, ModeBreakdown,
    PrepareTimes, StartSummary,
};
use serde::Serialize;

use super::Result;
use crate::input::Loaded;

/// What [`cpd`] runs: the decomposition's options.
#[derive(Clone, Debug)]
pub struct CpdRunOptions {
    /// Backend, kernel, starts, rank and limits. The default is
    /// `kruskal cpd`'s: rank 10, one start from seed 1, backend and kernel
    /// `auto`, and the modes to relabel (`--compact`) named when the
    /// host's memory is too small for a tensor with sparse modes.
    pub decompose: DecomposeOptions,
}

/// The rank of `kruskal cpd` without `--rank`.
const DEFAULT_RANK: usize = 10;

impl Default for CpdRunOptions {
    fn default() -> Self {
        CpdRunOptions {
            decompose: DecomposeOptions {
                can_compact: true,
                ..DecomposeOptions::new(DEFAULT_RANK)
            },
        }
    }
}

/// Runs the decomposition `opts` asks for on a loaded tensor, printing
/// nothing, and returns the report `kruskal cpd --json` prints (the
/// tensor, backend, kernels, times, fit, every iteration and start,
/// lambda).
///
/// ```
/// use kruskal::input::TensorSource;
/// use kruskal::measure::{CpdRunOptions, cpd};
///
/// let loaded = TensorSource::Like { name: "nell-2".into(), nnz: Some(2_000), seed: 1 }.load().unwrap();
/// let mut opts = CpdRunOptions::default();
/// opts.decompose.cpd.rank = 3;
/// opts.decompose.cpd.max_iters = 2;
/// opts.decompose.backend = kruskal::cpd::BackendChoice::Cpu;
/// let report = cpd(&opts, &loaded).unwrap();
/// assert_eq!(report.iterations.len(), 2);
/// ```
pub fn cpd(opts: &CpdRunOptions, loaded: &Loaded) -> Result<CpdReport> {
    static NEVER: AtomicBool = AtomicBool::new(false);
    let done = kruskal_cpd::decompose(
        &loaded.tensor,
        &opts.decompose,
        &mut |_| ControlFlow::Continue(()),
        &NEVER,
    )?;
    Ok(cpd_report(TensorReport::of(loaded), &done, None, None))
}

/// The tensor a report is about.
#[derive(Clone, Debug, Serialize)]
pub struct TensorReport {
    /// The file's path, or how the tensor was generated.
    pub source: String,
    pub dims: Vec<u32>,
    pub nnz: usize,
    /// Lines of the file summed into others (repeated coordinates).
    pub duplicates_merged: usize,
    pub load_s: f64,
    /// Seconds of the load spent on repeated coordinates.
    pub coalesce_s: f64,
}

impl TensorReport {
    /// What a report says of `loaded`'s tensor, taken before the tensor
    /// is handed on (and freed) by [`kruskal_cpd::decompose_owned`].
    pub fn of(loaded: &Loaded) -> Self {
        TensorReport {
            source: loaded.source.clone(),
            dims: loaded.tensor.dims().to_vec(),
            nnz: loaded.tensor.nnz(),
            duplicates_merged: loaded.merged,
            load_s: loaded.load_s,
            coalesce_s: loaded.coalesce_s,
        }
    }
}

/// The MTTKRP engine a CPD ran with: a CPU engine's name, the one-GPU
/// plan (the engine chosen per mode and the first iteration's trial), or
/// the group's shard kernel.
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub enum KernelReport {
    Cpu(&'static str),
    Gpu(KernelPlan),
    Group(GroupKernelReport),
}

/// The several-GPU group a CPD ran on.
#[derive(Clone, Debug, Serialize)]
pub struct GroupKernelReport {
    /// Always `shard`.
    pub name: &'static str,
    /// The GPUs' ordinals.
    pub gpus: Vec<usize>,
    /// `nccl` or `p2p`; `None` on one GPU.
    pub exchange: Option<&'static str>,
    /// Why the exchange is what it is, when it was not asked for.
    pub exchange_note: Option<String>,
    /// The plan taken (rows by owner, or split by a mode) and why.
    pub plan: Option<String>,
    /// Where each GPU's shards live, a line per GPU.
    pub placement: Vec<String>,
    /// Per mode, where the time went.
    pub breakdown: Vec<ModeBreakdown>,
}

/// One step of the GPU layout build and its seconds.
#[derive(Clone, Debug, Serialize)]
pub struct LayoutStep {
    pub step: &'static str,
    pub s: f64,
}

/// What `kruskal cpd --json` reports of a decomposition (the command adds
/// what only it knows: `compact`, `method`, `constraints`, `admm_inner`,
/// `wall`).
#[derive(Clone, Debug, Serialize)]
pub struct CpdReport {
    pub tensor: TensorReport,
    /// `cpu`, `gpu` or `gpus`.
    pub backend: &'static str,
    /// The (first) GPU's name; `None` on the CPU.
    pub device: Option<String>,
    /// Why the GPU was not used, when `auto` fell back to the CPU.
    pub gpu_not_used: Option<String>,
    pub kernel: KernelReport,
    /// Worker threads of the CPU's pool.
    pub threads: usize,
    pub rank: usize,
    pub prepare_s: f64,
    pub prepare: PrepareTimes,
    /// The one-GPU layout build's steps (empty on the CPU and a group).
    pub layout_steps: Vec<LayoutStep>,
    pub cpd_s: f64,
    pub fit: f64,
    pub converged: bool,
    pub interrupted: bool,
    pub pseudo_inverse_solves: usize,
    /// The last iterations of the kept start (at most
    /// [`kruskal_cpd::HISTORY`]).
    pub iterations: Vec<IterationStats>,
    /// Iterations the kept start ran.
    pub iterations_run: usize,
    /// Every start, in the order run.
    pub starts: Vec<StartSummary>,
    pub lambda: Vec<f64>,
    /// Against planted factors (`kruskal cpd --demo`).
    pub factor_match_score: Option<f64>,
    /// The folder the model was written to.
    pub out: Option<String>,
}

/// The report of a decomposition of `tensor` ([`TensorReport::of`]): with
/// the factor match score against planted factors (`fms`, `kruskal cpd
/// --demo`) and the folder the model was written to (`out`), when there
/// are.
pub fn cpd_report(
    tensor: TensorReport,
    done: &Decomposition,
    fms: Option<f64>,
    out: Option<&Path>,
) -> CpdReport {
    let model = &done.model;
    let (kernel, device) = match &done.backend {
        Chosen::Cpu(b) => (KernelReport::Cpu(b.kernel_name()), None),
        Chosen::Gpu(b) => (
            KernelReport::Gpu(b.plan()),
            Some(b.gpu().properties().name.clone()),
        ),
        Chosen::Group(b) => {
            let group = b.group();
            (
                KernelReport::Group(GroupKernelReport {
                    name: "shard",
                    gpus: group
                        .gpus()
                        .iter()
                        .map(|g| g.properties().ordinal)
                        .collect(),
                    exchange: group.exchange().map(|e| e.name()),
                    exchange_note: group.exchange_note().map(String::from),
                    plan: group.plan_note().map(String::from),
                    placement: group.describe(),
                    breakdown: b.breakdown().to_vec(),
                }),
                Some(group.gpus()[0].properties().name.clone()),
            )
        }
    };
    let layout_steps = match &done.backend {
        Chosen::Gpu(b) => b
            .layout_steps()
            .iter()
            .map(|&(step, s)| LayoutStep { step, s })
            .collect(),
        _ => Vec::new(),
    };
    CpdReport {
        tensor,
        backend: done.backend.name(),
        device,
        gpu_not_used: done.fallback.clone(),
        kernel,
        threads: rayon::current_num_threads(),
        rank: model.rank(),
        prepare_s: done.prep_s,
        prepare: done.prepare,
        layout_steps,
        cpd_s: done.cpd_s,
        fit: model.fit(),
        converged: model.converged,
        interrupted: model.interrupted,
        pseudo_inverse_solves: model.pseudo_inverse_solves,
        iterations: model.iterations.clone(),
        iterations_run: model.totals.count,
        starts: done.summaries.clone(),
        lambda: model.lambda.clone(),
        factor_match_score: fms,
        out: out.map(|p| p.display().to_string()),
    }
}
