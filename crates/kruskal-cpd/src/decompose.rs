//! One call from a tensor to a model: [`decompose`] chooses the backend
//! (`auto`: the GPU when one is usable and the run fits in its memory, else
//! the CPU, with the reason), the kernels (`auto`: the tuning model's
//! candidates, timed on the first iteration), the GPU group for several
//! GPUs, and runs every random start, keeping the best model.
//!
//! The `kruskal cpd` command and the Python package both call it, so the
//! two make the same choices. It prints nothing: what a user may want to
//! see (the kernels chosen, the GPU plan, each iteration) arrives as
//! [`Event`]s, and the caller decides how to show it.
//!
//! An option that cannot work is a [`CpdError::InvalidOption`], which
//! names it neutrally ([`OptionName`]); each front end spells it its own
//! way. [`DecomposeOptions::validate`] checks what can be checked before
//! any work, in one place.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kruskal_cpu::CpuEngine;
use kruskal_device::{DeviceError, Gpu, GpuOptions};
use kruskal_formats::SparseTensor;
use kruskal_group::{GpuGroup, GroupOptions};

use crate::backend::{Backend, CpuBackend};
use crate::engine_choice::{ChoiceRule, EngineChoice, EngineRequest, GpuRequest};
use crate::error::{CpdError, OptionName, Result};
use crate::gpu::{GpuBackend, KernelPlan};
use crate::model::{IterationStats, KruskalModel};
use crate::multi::GroupBackend;
use crate::scale::ValueScale;
use crate::{CpdOptions, Init, InnerStop, cpd_als_with};

/// Where the decomposition runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// The GPU when one is usable and the run fits in its memory, else the
    /// CPU ([`Decomposition::fallback`] says why).
    Auto,
    Cpu,
    /// The first CUDA GPU.
    Gpu,
}

impl std::str::FromStr for BackendChoice {
    type Err = CpdError;

    fn from_str(text: &str) -> Result<Self> {
        match text {
            "auto" => Ok(BackendChoice::Auto),
            "cpu" => Ok(BackendChoice::Cpu),
            "gpu" => Ok(BackendChoice::Gpu),
            // A value of no option names no front end's flag.
            other => Err(CpdError::Invalid(format!(
                "unknown backend '{other}' (auto, cpu or gpu)"
            ))),
        }
    }
}

/// What [`decompose`] does.
#[derive(Clone, Debug)]
pub struct DecomposeOptions {
    /// Rank, iteration limit, tolerance and the initial factors of the
    /// first start.
    pub cpd: CpdOptions,
    /// Random starts (seeds `seed`, `seed + 1`, ...); the best fit is kept.
    /// More than one needs random initial factors.
    pub starts: usize,
    /// Seed of the first start (also reported when the factors are given).
    pub seed: u64,
    pub backend: BackendChoice,
    /// MTTKRP engine. CPU: auto, sorted, fcoo, flycoo, hicoo, csf. GPU: auto,
    /// coo, fcoo, flycoo, hicoo; several GPUs: auto or shard.
    pub kernel: EngineRequest,
    /// Launch parameters of the GPU engines; a parameter given here wins
    /// over the tuning model's.
    pub gpu: GpuOptions,
    /// Ignore the tuning model (`--no-model`).
    pub no_model: bool,
    /// Run on these GPUs as one group (the shard kernel); `None`: one GPU
    /// or the CPU, as `backend` says.
    pub gpus: Option<Vec<usize>>,
    /// With `gpus`: use only as many of them as pay for this tensor (the
    /// first ones; one GPU runs the one-GPU backend), as
    /// [`crate::gpu_count::pick`] predicts (`--gpus all`).
    pub pick_gpus: bool,
    /// Options of the group, with `gpus`.
    pub group: GroupOptions,
    /// The caller can relabel sparse modes ([`OptionName::Compact`]): when
    /// the host's memory is too small for the run, the refusal lists the
    /// modes whose dimension dwarfs the indices that occur in them.
    pub can_compact: bool,
}

impl DecomposeOptions {
    /// Rank `rank` with the command line's defaults: one start, seed 1,
    /// backend and kernel `auto`.
    pub fn new(rank: usize) -> Self {
        DecomposeOptions {
            cpd: CpdOptions::new(rank),
            starts: 1,
            seed: 1,
            backend: BackendChoice::Auto,
            kernel: EngineRequest::Auto,
            gpu: GpuOptions::default(),
            no_model: false,
            gpus: None,
            pick_gpus: false,
            group: GroupOptions::default(),
            can_compact: false,
        }
    }

    /// Refuses options that cannot work, whatever the tensor and the
    /// machine: a rank or a number of starts of 0, a tolerance that is
    /// negative or not finite, several starts from given factors, an
    /// unknown kernel (a [`CpdError::Invalid`]: the value names no
    /// option), a group of GPUs on the CPU, and constraint weights that are negative or not finite. What
    /// depends on the tensor (its modes) or the machine (its GPUs) is
    /// checked where it is known.
    pub fn validate(&self) -> Result<()> {
        self.cpd.validate()?;
        check_starts(self.starts, &self.cpd.init)?;
        if self.kernel == EngineRequest::Shard && self.gpus.is_none() {
            return Err(CpdError::option_value(
                OptionName::Kernel,
                "shard",
                "runs on a group of GPUs only (give the GPUs)",
            ));
        }
        if self.gpus.as_ref().is_some_and(Vec::is_empty) {
            return Err(CpdError::option(OptionName::Gpus, "must be at least 1"));
        }
        if self.gpus.is_some() && self.backend == BackendChoice::Cpu {
            return Err(CpdError::option(
                OptionName::Gpus,
                "runs on GPUs; it cannot be combined with the CPU backend",
            ));
        }
        Ok(())
    }
}

/// Refuses 0 starts, and several from given initial factors (each start
/// after the first draws its own).
fn check_starts(starts: usize, init: &Init) -> Result<()> {
    if starts == 0 {
        return Err(CpdError::option(OptionName::Starts, "must be at least 1"));
    }
    if starts > 1 && matches!(init, Init::Given(_)) {
        return Err(CpdError::option(
            OptionName::Starts,
            "above 1 draws random initial factors; it cannot be combined with given ones",
        ));
    }
    Ok(())
}

/// What [`decompose`] tells its caller while it works.
#[derive(Debug)]
pub enum Event<'a> {
    /// A choice made while preparing, for the user: `topic` is a short
    /// word (`kernels`, `gpus`, `exchange`; empty for a continuation line).
    Note { topic: &'a str, text: &'a str },
    /// The GPU engines chosen, for the `kernels` notes
    /// ([`EngineChoice::notes`], which the front end spells), on a GPU of
    /// `sms` SMs.
    Choice {
        choice: &'a EngineChoice,
        sms: usize,
    },
    /// A step that may take a while begins (`Some`) or has ended (`None`).
    Step(Option<&'a str>),
    /// The backend is ready.
    Ready {
        backend: &'a str,
        /// Seconds to prepare it.
        prep_s: f64,
        /// The parts of `prep_s`.
        prepare: PrepareTimes,
        /// Why the GPU was not used, when `auto` fell back to the CPU.
        fallback: Option<&'a str>,
    },
    /// A start begins (`index` from 0; `starts` in all).
    Start {
        index: usize,
        starts: usize,
        seed: u64,
    },
    /// An iteration of the current start is done.
    Iteration(&'a IterationStats),
}

/// Seed, fit and iterations of one start.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StartSummary {
    pub seed: u64,
    pub fit: f64,
    pub iterations: usize,
}

/// Where the preparation of a backend went, in seconds (0 for a step a
/// backend does not take).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct PrepareTimes {
    /// Opening the GPU (the driver's context; `Gpu::open`).
    pub open_s: f64,
    /// The tensor's features (what they take beyond the GPU's opening,
    /// which they overlap) and the tuning model's choice of candidates.
    pub choose_s: f64,
    /// Building and uploading the engines' layouts (and, on the CPU, the
    /// kernel's layout).
    pub build_s: f64,
}

/// A finished decomposition and how it ran.
pub struct Decomposition {
    /// The best start's model.
    pub model: KruskalModel,
    pub backend: Chosen,
    /// Seconds to prepare the backend.
    pub prep_s: f64,
    /// The parts of `prep_s`.
    pub prepare: PrepareTimes,
    /// Why the GPU was not used, when `auto` fell back to the CPU.
    pub fallback: Option<String>,
    /// Seconds of all starts.
    pub cpd_s: f64,
    pub starts: usize,
    /// Every start, in the order run.
    pub summaries: Vec<StartSummary>,
}

/// Builds the backend and runs every start; keeps the best model.
///
/// `progress` hears every [`Event`]; returning `ControlFlow::Break` from
/// it, or setting `stop`, stops the run after the current iteration (the
/// model so far is returned, `interrupted` set, and no further start
/// runs). The backend is dropped (GPU memory and worker threads released)
/// when the returned [`Decomposition`] is.
pub fn decompose(
    tensor: &SparseTensor,
    opts: &DecomposeOptions,
    progress: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
    stop: &AtomicBool,
) -> Result<Decomposition> {
    let prepared = prepare(tensor, opts, progress)?;
    run_prepared(prepared, opts, progress, stop)
}

/// [`decompose`] of a tensor the caller gives up: once the backend is
/// built it holds everything the iterations read (its own formats, or the
/// shards on the GPUs), so the tensor is freed before the starts run. The
/// model then comes back without the tensor beside it in host memory: a
/// tensor of tens of gigabytes does not add its size to the peak at the
/// end of the run. (Freed on a thread of its own beside the first start,
/// the tensor's release slowed that start's setup on 4 GPUs: it is freed
/// here, in the time the teardown spent on it before.)
pub fn decompose_owned(
    tensor: SparseTensor,
    opts: &DecomposeOptions,
    progress: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
    stop: &AtomicBool,
) -> Result<Decomposition> {
    let prepared = prepare(&tensor, opts, progress)?;
    drop(tensor);
    run_prepared(prepared, opts, progress, stop)
}

/// A backend built for a tensor, ready for its starts.
struct Prepared {
    backend: Chosen,
    scale: ValueScale,
    prep_s: f64,
    prepare: PrepareTimes,
    fallback: Option<String>,
}

/// The backend of `tensor` (built from a scaled copy for values far from
/// 1), with the rows with data for AO-ADMM; tells `progress` it is ready.
/// Nothing it returns refers to `tensor`.
fn prepare(
    tensor: &SparseTensor,
    opts: &DecomposeOptions,
    progress: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
) -> Result<Prepared> {
    opts.validate()?;
    let rank = opts.cpd.rank;
    let prep = Instant::now();
    let prepare = std::cell::Cell::new(PrepareTimes::default());
    // Values far from 1 run scaled by a power of two (see `scale`): the
    // backends are built from a scaled copy, dropped once they are.
    let (scale, scaled) = scaled_copy(tensor, progress)?;
    let (mut backend, fallback) = make_backend(
        opts,
        scaled.as_ref().unwrap_or(tensor),
        rank,
        progress,
        &prepare,
    )?;
    drop(scaled);
    if opts.cpd.constraints.is_some() {
        // AO-ADMM's inner loop runs on the rows with data (DataRows).
        let start = Instant::now();
        let rows = crate::admm::DataRows::of(tensor);
        backend.as_dyn().set_data_rows(std::sync::Arc::new(rows))?;
        let mut t = prepare.get();
        t.build_s += start.elapsed().as_secs_f64();
        prepare.set(t);
    }
    let prepare = prepare.get();
    let prep_s = prep.elapsed().as_secs_f64();
    let _ = progress(Event::Ready {
        backend: &backend.describe(),
        prep_s,
        prepare,
        fallback: fallback.as_deref(),
    });
    Ok(Prepared {
        backend,
        scale,
        prep_s,
        prepare,
        fallback,
    })
}

/// Every start on a prepared backend; keeps the best model.
fn run_prepared(
    prepared: Prepared,
    opts: &DecomposeOptions,
    progress: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
    stop: &AtomicBool,
) -> Result<Decomposition> {
    let Prepared {
        mut backend,
        scale,
        prep_s,
        prepare,
        fallback,
    } = prepared;
    let runs = run_scaled(backend.as_dyn(), opts, scale, progress, stop)?;
    Ok(Decomposition {
        model: runs.model,
        backend,
        prep_s,
        prepare,
        fallback,
        cpd_s: runs.cpd_s,
        starts: runs.starts,
        summaries: runs.summaries,
    })
}

/// The scale `tensor`'s values run at ([`ValueScale`]) and, where it is
/// not 1, the scaled copy the backends are built from; tells `progress`.
/// The copy is refused (before it is made) when `MemAvailable` cannot
/// hold it.
fn scaled_copy(
    tensor: &SparseTensor,
    progress: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
) -> Result<(ValueScale, Option<SparseTensor>)> {
    let max_abs = tensor.max_abs();
    let scale = ValueScale::for_max_abs(max_abs);
    if scale.is_none() {
        return Ok((scale, None));
    }
    let bytes = kruskal_formats::memory::coo_bytes(tensor.nmodes(), tensor.nnz() as u64);
    let available = crate::memory::available_bytes().unwrap_or(u64::MAX);
    if bytes > available {
        return Err(CpdError::memory(format!(
            "the largest |value| is {max_abs:.3e}, so the run needs a copy of the tensor with its \
             values scaled by 2^{} ({}), and {} are available (MemAvailable); rescale the values \
             of the file into 2^-24 .. 2^40",
            scale.exponent(),
            crate::memory::bytes_text(bytes),
            crate::memory::bytes_text(available)
        )));
    }
    let _ = progress(Event::Note {
        topic: "values",
        text: &scale.describe(max_abs),
    });
    let mut copy = tensor.clone();
    copy.scale_values_pow2(scale.exponent())
        .map_err(|e| CpdError::Invalid(e.to_string()))?;
    Ok((scale, Some(copy)))
}

/// Every start `opts` asks for on `backend`, built from values scaled by
/// `scale`, whose weights are scaled back.
pub(crate) fn run_scaled(
    backend: &mut dyn Backend,
    opts: &DecomposeOptions,
    scale: ValueScale,
    progress: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
    stop: &AtomicBool,
) -> Result<Starts> {
    let mut runs = run_starts(backend, &opts.cpd, opts.seed, opts.starts, progress, stop)?;
    scale.restore(&mut runs.model);
    Ok(runs)
}

/// What [`run_starts`] found.
pub struct Starts {
    /// The best start's model.
    pub model: KruskalModel,
    /// Seconds of all starts.
    pub cpd_s: f64,
    pub starts: usize,
    /// Every start, in the order run.
    pub summaries: Vec<StartSummary>,
}

/// Runs `starts` starts on `backend` (the first from `opts.init`; with
/// more than one, seeds `seed`, `seed + 1`, ...) and keeps the model with
/// the best fit. Stops after the current iteration once `progress` breaks
/// or `stop` is set.
pub fn run_starts(
    backend: &mut dyn Backend,
    opts: &CpdOptions,
    seed: u64,
    starts: usize,
    progress: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
    stop: &AtomicBool,
) -> Result<Starts> {
    check_starts(starts, &opts.init)?;
    let start = Instant::now();
    // Only the best model is kept (the memory estimate counts one besides
    // the run's own), and nothing is sized by `starts` ahead.
    let mut best: Option<KruskalModel> = None;
    let mut summaries: Vec<StartSummary> = Vec::new();
    for k in 0..starts {
        let seed = seed + k as u64;
        // One start runs the caller's options as they are (given factors
        // are not copied here); several draw their own random factors.
        let drawn;
        let opts = if starts > 1 {
            drawn = CpdOptions {
                init: Init::Random { seed },
                ..opts.clone()
            };
            &drawn
        } else {
            opts
        };
        let _ = progress(Event::Start {
            index: k,
            starts,
            seed,
        });
        let mut report = |s: &IterationStats| {
            let flow = progress(Event::Iteration(s));
            if flow.is_break() || stop.load(Ordering::SeqCst) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        };
        let model = cpd_als_with(backend, opts, &mut report)?;
        let interrupted = model.interrupted;
        summaries.push(StartSummary {
            seed,
            fit: model.fit(),
            iterations: model.totals.count,
        });
        // The last of equal fits is kept (as `max_by` did).
        if best
            .as_ref()
            .is_none_or(|b| model.fit().total_cmp(&b.fit()).is_ge())
        {
            best = Some(model);
        }
        if interrupted {
            break;
        }
    }
    let cpd_s = start.elapsed().as_secs_f64();
    let Some(model) = best else {
        return Err(CpdError::option(OptionName::Starts, "must be at least 1"));
    };
    Ok(Starts {
        model,
        cpd_s,
        starts,
        summaries,
    })
}

/// The chosen backend.
pub enum Chosen {
    Cpu(CpuBackend),
    Gpu(Box<GpuBackend>),
    Group(Box<GroupBackend>),
}

impl Chosen {
    pub fn as_dyn(&mut self) -> &mut dyn Backend {
        match self {
            Chosen::Cpu(b) => b,
            Chosen::Gpu(b) => b.as_mut(),
            Chosen::Group(b) => b.as_mut(),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Chosen::Cpu(b) => b.describe(),
            Chosen::Gpu(b) => b.describe(),
            Chosen::Group(b) => b.describe(),
        }
    }

    /// `cpu`, `gpu` or `gpus`.
    pub fn name(&self) -> &'static str {
        match self {
            Chosen::Cpu(_) => "cpu",
            Chosen::Gpu(_) => "gpu",
            Chosen::Group(_) => "gpus",
        }
    }

    pub fn plan(&self) -> Option<KernelPlan> {
        match self {
            Chosen::Gpu(b) => Some(b.plan()),
            Chosen::Cpu(_) | Chosen::Group(_) => None,
        }
    }

    /// The inner loop a constrained run that asked for `asked` runs on
    /// this backend: each row on its own where the backend runs it
    /// itself (one GPU), else what was asked.
    pub fn admm_inner(&self, asked: InnerStop) -> InnerStop {
        let on_backend = match self {
            Chosen::Cpu(b) => b.runs_admm(),
            Chosen::Gpu(b) => b.runs_admm(),
            Chosen::Group(b) => b.runs_admm(),
        };
        if on_backend {
            InnerStop::RowBlocks
        } else {
            asked
        }
    }
}

/// The first `n` GPUs of this machine, for a group.
pub fn first_gpus(n: usize) -> Result<Vec<usize>> {
    // The driver starts where the group opens its GPUs, beside the plan.
    let count = Gpu::count_listed()?;
    if n == 0 {
        return Err(CpdError::option(OptionName::Gpus, "must be at least 1"));
    }
    if n > count {
        return Err(CpdError::option_value(
            OptionName::Gpus,
            n,
            format!("is more than this machine's {count} CUDA GPU(s)"),
        ));
    }
    Ok((0..n).collect())
}

/// The error of an engine for one GPU or the CPU asked of a group of GPUs
/// (`kernel` as it was asked for).
pub fn not_for_a_group(kernel: &str) -> CpdError {
    CpdError::option_value(
        OptionName::Kernel,
        kernel,
        "is for one GPU or the CPU; a group of GPUs runs the shard kernel on every GPU",
    )
}

/// Builds a group on `ordinals` for the shard kernel, telling `note` its
/// plan (placement and exchange). `kernel` is the run's kernel: only
/// `auto` and `shard` are accepted.
pub fn gpu_group(
    ordinals: &[usize],
    t: &SparseTensor,
    rank: usize,
    kernel: EngineRequest,
    opts: &GroupOptions,
    note: &mut dyn FnMut(&str, &str),
) -> Result<GpuGroup> {
    if !matches!(kernel, EngineRequest::Auto | EngineRequest::Shard) {
        return Err(not_for_a_group(kernel.name()));
    }
    let group = GpuGroup::new(ordinals, t, rank, opts, &mut |line| note("gpus", line))?;
    for line in group.describe() {
        note("", &line);
    }
    if let Some(plan) = group.plan_note() {
        note("plan", plan);
    }
    match (group.exchange(), group.exchange_note()) {
        (Some(e), None) => note("exchange", e.name()),
        (Some(_), Some(text)) => note("exchange", text),
        (None, _) => note("exchange", "none (one GPU)"),
    }
    if group.exchange().is_some() {
        let modes: Vec<String> = (0..t.nmodes())
            .map(|mode| {
                let v = group.exchange_volume(mode);
                let reduce = if v.reduce_bytes > 0 {
                    format!(
                        ", its partial sums reduced ({:.1} MB)",
                        v.reduce_bytes as f64 / 1e6
                    )
                } else {
                    String::new()
                };
                let sent = if v.local {
                    format!("mode {} stays on its GPUs (0 MB)", mode + 1)
                } else if v.read_only {
                    format!(
                        "mode {} rows read ({:.1} of {:.1} MB)",
                        mode + 1,
                        v.bytes as f64 / 1e6,
                        v.all_gather_bytes as f64 / 1e6
                    )
                } else {
                    format!(
                        "mode {} all rows ({:.1} MB)",
                        mode + 1,
                        v.bytes as f64 / 1e6
                    )
                };
                format!("{sent}{reduce}")
            })
            .collect();
        note("", &format!("per iteration: {}", modes.join(", ")));
    }
    Ok(group)
}

/// The group backend `gpus` asks for: the `shard` kernel on every GPU.
fn group_backend(
    opts: &DecomposeOptions,
    ordinals: &[usize],
    t: &SparseTensor,
    rank: usize,
    progress: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
) -> Result<Chosen> {
    // Where the shards are built follows where the one-GPU layout is
    // (`GpuOptions::fcoo_build`).
    let group_opts = GroupOptions {
        build: opts.gpu.fcoo_build,
        ..opts.group.clone()
    };
    let group = gpu_group(
        ordinals,
        t,
        rank,
        opts.kernel,
        &group_opts,
        &mut |topic, text| {
            let _ = progress(Event::Note { topic, text });
        },
    )?;
    Ok(Chosen::Group(Box::new(GroupBackend::new(group, t))))
}

/// Builds the backend `opts.backend` and `opts.kernel` ask for. With
/// `auto`, a GPU that cannot be used (none, no memory for the run, a rank
/// beyond the GPU kernels, a CPU-only kernel) gives the CPU backend and the
/// reason.
fn make_backend(
    opts: &DecomposeOptions,
    t: &SparseTensor,
    rank: usize,
    progress: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
    times: &std::cell::Cell<PrepareTimes>,
) -> Result<(Chosen, Option<String>)> {
    let record = |step: fn(&mut PrepareTimes) -> &mut f64, start: Instant| {
        let mut t = times.get();
        *step(&mut t) += start.elapsed().as_secs_f64();
        times.set(t);
    };
    let constrained = opts.cpd.constraints.is_some();
    if let Some(ordinals) = &opts.gpus {
        if !opts.pick_gpus {
            return Ok((group_backend(opts, ordinals, t, rank, progress)?, None));
        }
        let count = if ordinals.len() > 1 {
            let gpu = Gpu::open(ordinals[0])?;
            let need = crate::memory::gpu_need(t.dims(), t.nnz(), rank);
            let one_fits =
                need.total() <= gpu.free_bytes()? as u64 && opts.kernel != EngineRequest::Shard;
            drop(gpu);
            crate::gpu_count::pick(
                t,
                rank,
                ordinals.len(),
                one_fits,
                kruskal_group::split_possible(ordinals.len(), &opts.group),
            )
        } else {
            crate::gpu_count::GpuCount {
                gpus: 1,
                predicted_ms: Vec::new(),
                reason: "1 of 1: this machine has one GPU".into(),
            }
        };
        let _ = progress(Event::Note {
            topic: "gpus",
            text: &count.reason,
        });
        if count.gpus > 1 || opts.kernel == EngineRequest::Shard {
            let chosen = &ordinals[..count.gpus];
            return Ok((group_backend(opts, chosen, t, rank, progress)?, None));
        }
        let mut one = opts.clone();
        one.gpus = None;
        one.pick_gpus = false;
        one.backend = BackendChoice::Gpu;
        return make_backend(&one, t, rank, progress, times);
    }
    let name = opts.kernel.name();
    let cpu_kernel = opts.kernel.cpu();
    let gpu_kernel = opts.kernel.gpu();
    let cpu =
        |kernel: Option<CpuEngine>, why: Option<String>| -> Result<(Chosen, Option<String>)> {
            let Some(kernel) = kernel else {
                return Err(CpdError::option_value(
                    OptionName::Kernel,
                    name,
                    format!(
                        "runs on the GPU only{}",
                        why.map(|w| format!(", and the GPU cannot be used: {w}"))
                            .unwrap_or_default()
                    ),
                ));
            };
            let threads = rayon::current_num_threads();
            let mut need = crate::memory::cpu_need(t.dims(), t.nnz(), rank, threads, opts.starts);
            if constrained {
                need = need.and(crate::memory::admm_need(t.dims(), rank, threads));
            }
            if let Some(refusal) = crate::memory::host_refusal(&need, t, opts.can_compact) {
                return Err(refusal);
            }
            let start = Instant::now();
            let backend = CpuBackend::with_kernel(t, kernel)?;
            record(|t| &mut t.build_s, start);
            Ok((Chosen::Cpu(backend), why))
        };
    let mut gpu_run = || -> Result<GpuBackend> {
        let Some(kernel) = gpu_kernel else {
            return Err(CpdError::option_value(
                OptionName::Kernel,
                name,
                "runs on the CPU only (GPU kernels: auto, coo, fcoo, flycoo, hicoo)",
            ));
        };
        kruskal_device::dense::check_rank(rank)?;
        if constrained {
            kruskal_device::admm::check_rank(rank)?;
        }
        let request = GpuRequest {
            engine: kernel,
            given: &opts.gpu,
            no_model: opts.no_model,
            rank,
            rule: ChoiceRule::Trial,
        };
        // The tensor's features for the tuning model are computed while
        // the driver opens the GPU.
        let wants_features = request.wants_features();
        let (gpu, mut features) = std::thread::scope(|s| {
            let features = s.spawn(|| {
                wants_features.then(|| {
                    let start = Instant::now();
                    let f = kruskal_tune::TensorFeatures::compute(t);
                    (f, start.elapsed().as_secs_f64())
                })
            });
            let start = Instant::now();
            let gpu = Gpu::open(0);
            record(|t| &mut t.open_s, start);
            // What the features take beyond the opening is the choice's.
            let start = Instant::now();
            let features = features
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            record(|t| &mut t.choose_s, start);
            (gpu, features)
        });
        let gpu = gpu?;
        let mut need = crate::memory::gpu_need(t.dims(), t.nnz(), rank);
        if constrained {
            need = need.and(crate::memory::admm_gpu_need(t.dims(), rank));
        }
        let free = gpu.free_bytes()?;
        if need.total() > free as u64 {
            return Err(CpdError::Gpu(format!(
                "the run needs {need} on the GPU and {} are free there",
                crate::memory::bytes_text(free as u64)
            )));
        }
        let start = Instant::now();
        let sms = gpu.properties().sms;
        let choice = request.choose(t, sms, &mut features);
        let _ = progress(Event::Choice {
            choice: &choice,
            sms,
        });
        let candidates = choice.builds();
        record(|t| &mut t.choose_s, start);
        let _ = progress(Event::Step(Some("building the tensor's layout on the GPU")));
        let start = Instant::now();
        let backend = GpuBackend::new(gpu, t, &candidates);
        record(|t| &mut t.build_s, start);
        let _ = progress(Event::Step(None));
        backend
    };
    match opts.backend {
        BackendChoice::Cpu => cpu(cpu_kernel, None),
        BackendChoice::Gpu => Ok((Chosen::Gpu(Box::new(gpu_run()?)), None)),
        BackendChoice::Auto => match gpu_run() {
            Ok(b) => Ok((Chosen::Gpu(Box::new(b)), None)),
            Err(e) => cpu(cpu_kernel, Some(fallback_reason(&e))),
        },
    }
}

/// Why the GPU was not used, in a few words (the full list of library
/// names tried is for `--backend gpu`'s error).
pub(crate) fn fallback_reason(e: &CpdError) -> String {
    if let CpdError::Device(DeviceError::MissingLibrary { library, .. }) = e {
        return format!("no CUDA {library} library was found");
    }
    kruskal_device::error_line(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal_formats::generate::{PlantedSpec, planted};

    fn planted_tensor() -> SparseTensor {
        let spec = PlantedSpec {
            dims: vec![40, 30, 20],
            rank: 3,
            nnz: 4_000,
            noise: 0.0,
            seed: 3,
        };
        planted(&spec).unwrap().tensor
    }

    fn cpu_options(rank: usize) -> DecomposeOptions {
        let mut opts = DecomposeOptions::new(rank);
        opts.backend = BackendChoice::Cpu;
        opts.cpd.max_iters = 60;
        opts
    }

    /// Runs `decompose`, recording every event as a short string.
    fn run(
        t: &SparseTensor,
        opts: &DecomposeOptions,
        stop: &AtomicBool,
        mut flow: impl FnMut(&Event<'_>) -> ControlFlow<()>,
    ) -> (Result<Decomposition>, Vec<String>) {
        let mut seen = Vec::new();
        let done = decompose(
            t,
            opts,
            &mut |e| {
                seen.push(match &e {
                    Event::Note { topic, .. } => format!("note {topic}"),
                    Event::Choice { .. } => "note kernels".into(),
                    Event::Step(_) => "step".into(),
                    Event::Ready { .. } => "ready".into(),
                    Event::Start { index, seed, .. } => format!("start {index} seed {seed}"),
                    Event::Iteration(s) => format!("iteration {}", s.iteration),
                });
                flow(&e)
            },
            stop,
        );
        (done, seen)
    }

    #[test]
    fn a_tensor_given_up_decomposes_as_one_lent() {
        // decompose_owned frees the tensor once the backend is built; the
        // model, events and steps are those of decompose, values far from
        // one (a scaled copy) and AO-ADMM (rows with data) included.
        let stop = AtomicBool::new(false);
        let mut far = planted_tensor();
        far.scale_values_pow2(90).unwrap();
        let mut admm = cpu_options(3);
        admm.cpd.max_iters = 5;
        admm.cpd.constraints = Some(crate::AdmmOptions::nonneg());
        for (t, opts) in [
            (planted_tensor(), cpu_options(3)),
            (far, cpu_options(3)),
            (planted_tensor(), admm),
        ] {
            let (lent, lent_seen) = run(&t, &opts, &stop, |_| ControlFlow::Continue(()));
            let lent = lent.unwrap();
            let mut seen = Vec::new();
            let given = decompose_owned(
                t,
                &opts,
                &mut |e| {
                    if let Event::Iteration(s) = &e {
                        seen.push(format!("iteration {}", s.iteration));
                    }
                    ControlFlow::Continue(())
                },
                &stop,
            )
            .unwrap();
            let lent_iters: Vec<&String> = lent_seen
                .iter()
                .filter(|e| e.starts_with("iteration"))
                .collect();
            assert_eq!(seen.iter().collect::<Vec<_>>(), lent_iters);
            assert_eq!(given.model.lambda, lent.model.lambda);
            assert_eq!(given.model.factors, lent.model.factors);
            assert_eq!(given.model.fit(), lent.model.fit());
        }
    }

    #[test]
    fn recovers_a_planted_tensor_and_reports_each_step() {
        let t = planted_tensor();
        let stop = AtomicBool::new(false);
        let (done, seen) = run(&t, &cpu_options(3), &stop, |_| ControlFlow::Continue(()));
        let done = done.unwrap();
        assert!(done.model.fit() > 0.99, "fit {}", done.model.fit());
        assert_eq!(done.backend.name(), "cpu");
        assert!(done.fallback.is_none());
        let its = done.model.iterations.len();
        assert_eq!(seen[0], "ready");
        assert_eq!(seen[1], "start 0 seed 1");
        assert_eq!(seen.len(), 2 + its);
        assert_eq!(seen.last().unwrap(), &format!("iteration {its}"));
        assert_eq!(done.summaries.len(), 1);
        assert_eq!(done.summaries[0].fit, done.model.fit());
    }

    #[test]
    fn keeps_the_best_of_several_starts() {
        let t = planted_tensor();
        let mut opts = cpu_options(3);
        opts.starts = 3;
        opts.seed = 7;
        opts.cpd.max_iters = 5;
        let (done, _) = run(&t, &opts, &AtomicBool::new(false), |_| {
            ControlFlow::Continue(())
        });
        let done = done.unwrap();
        let seeds: Vec<u64> = done.summaries.iter().map(|s| s.seed).collect();
        assert_eq!(seeds, [7, 8, 9]);
        let best = done
            .summaries
            .iter()
            .map(|s| s.fit)
            .fold(f64::MIN, f64::max);
        assert_eq!(done.model.fit(), best);
    }

    #[test]
    fn the_callback_or_the_flag_stops_after_the_current_iteration() {
        let t = planted_tensor();
        let mut opts = cpu_options(3);
        opts.starts = 2;
        let stop = AtomicBool::new(false);
        let (done, seen) = run(&t, &opts, &stop, |e| match e {
            Event::Iteration(s) if s.iteration == 2 => ControlFlow::Break(()),
            _ => ControlFlow::Continue(()),
        });
        let done = done.unwrap();
        assert!(done.model.interrupted);
        assert_eq!(done.model.iterations.len(), 2);
        // The second start does not run.
        assert_eq!(done.summaries.len(), 1);
        assert!(!seen.iter().any(|e| e.starts_with("start 1")));

        stop.store(true, Ordering::SeqCst);
        let (done, _) = run(&t, &opts, &stop, |_| ControlFlow::Continue(()));
        let done = done.unwrap();
        assert!(done.model.interrupted);
        assert_eq!(done.model.iterations.len(), 1);
    }

    #[test]
    fn bad_options_are_refused_before_any_work() {
        let t = planted_tensor();
        let stop = AtomicBool::new(false);
        let refuse = |opts: &DecomposeOptions, option: OptionName, needle: &str| {
            let (done, seen) = run(&t, opts, &stop, |_| ControlFlow::Continue(()));
            match done {
                Err(e @ CpdError::InvalidOption { option: o, .. }) => {
                    assert_eq!(o, option, "{e}");
                    let text = e.to_string();
                    assert!(text.contains(needle), "{text}");
                    assert!(!text.contains("--"), "{text}");
                }
                Err(e) => panic!("{e}"),
                Ok(_) => panic!("accepted; expected '{needle}'"),
            }
            assert!(seen.is_empty(), "{seen:?}");
        };
        refuse(&cpu_options(0), OptionName::Rank, "rank must be at least 1");
        let mut opts = cpu_options(3);
        opts.cpd.tol = -1.0;
        refuse(&opts, OptionName::Tol, "tol -1 must be finite and >= 0");
        let mut opts = cpu_options(3);
        opts.kernel = EngineRequest::Coo;
        refuse(&opts, OptionName::Kernel, "kernel coo runs on the GPU only");
        opts.kernel = EngineRequest::Shard;
        refuse(
            &opts,
            OptionName::Kernel,
            "kernel shard runs on a group of GPUs only",
        );
        let mut opts = cpu_options(3);
        opts.starts = 0;
        refuse(&opts, OptionName::Starts, "starts must be at least 1");
        opts.starts = 2;
        opts.cpd.init = Init::Given(crate::random_factors(t.dims(), 3, 1));
        refuse(
            &opts,
            OptionName::Starts,
            "cannot be combined with given ones",
        );
        let mut opts = cpu_options(3);
        opts.gpus = Some(vec![0]);
        refuse(
            &opts,
            OptionName::Gpus,
            "cannot be combined with the CPU backend",
        );
        opts.gpus = Some(Vec::new());
        refuse(&opts, OptionName::Gpus, "gpus must be at least 1");
        let mut opts = cpu_options(3);
        opts.cpd.constraints = Some(crate::AdmmOptions {
            l1: -0.5,
            ..crate::AdmmOptions::default()
        });
        refuse(&opts, OptionName::L1, "l1 -0.5 must be finite and >= 0");
        // The whole text of each front end is the option spelled its way,
        // then the same reason.
        let e = cpu_options(0).validate().unwrap_err();
        let flag = |o: OptionName, _: Option<&str>| format!("--{o}");
        assert_eq!(e.message(&flag), "--rank must be at least 1");
    }

    /// The planted tensor with its values scaled so the largest is in
    /// `[1, 2)`, the scale a tensor far from 1 is run at.
    fn planted_at_one() -> SparseTensor {
        let mut t = planted_tensor();
        let to_one = ValueScale::for_max_abs(t.max_abs() * 2f64.powi(100)).exponent() + 100;
        t.scale_values_pow2(to_one).unwrap();
        assert!((1.0..2.0).contains(&t.max_abs()), "{}", t.max_abs());
        t
    }

    #[test]
    fn values_far_from_one_give_the_same_model_scaled() {
        let t = planted_at_one();
        let mut opts = cpu_options(3);
        opts.cpd.max_iters = 12;
        opts.cpd.tol = 0.0;
        let stop = AtomicBool::new(false);
        let go = |_: &Event<'_>| ControlFlow::Continue(());
        let (base, seen) = run(&t, &opts, &stop, go);
        let base = base.unwrap().model;
        assert!(!seen.iter().any(|e| e == "note values"), "{seen:?}");
        let fits = |m: &KruskalModel| m.iterations.iter().map(|s| s.fit).collect::<Vec<_>>();
        // Exact powers of two far outside the window (where f32 alone
        // overflows or underflows) give the same run to the bit, with the
        // weights times the power.
        for exponent in [-100, -60, 60, 126] {
            let mut scaled = t.clone();
            scaled.scale_values_pow2(exponent).unwrap();
            let mut back = scaled.clone();
            back.scale_values_pow2(-exponent).unwrap();
            assert_eq!(back, t, "2^{exponent} is exact on these values");
            let (done, seen) = run(&scaled, &opts, &stop, go);
            let done = done.unwrap().model;
            assert!(seen.iter().any(|e| e == "note values"), "{seen:?}");
            assert_eq!(fits(&done), fits(&base), "2^{exponent}");
            assert_eq!(done.factors, base.factors, "2^{exponent}");
            let want: Vec<f64> = base
                .lambda
                .iter()
                .map(|l| l * 2f64.powi(exponent))
                .collect();
            assert_eq!(done.lambda, want, "2^{exponent}");
        }
        // Inside the window the values run as they are. Above 1 the
        // normalization divides every column, and the run is the same to
        // the bit; below, the columns keep some of the values' scale, the
        // path differs by rounding, and the converged model agrees.
        opts.cpd.max_iters = 200;
        opts.cpd.tol = 1e-10;
        let (base, _) = run(&t, &opts, &stop, go);
        let base = base.unwrap().model;
        for exponent in [-24, -8, 8, 39] {
            let mut scaled = t.clone();
            scaled.scale_values_pow2(exponent).unwrap();
            let (done, seen) = run(&scaled, &opts, &stop, go);
            let done = done.unwrap().model;
            assert!(!seen.iter().any(|e| e == "note values"), "{seen:?}");
            if exponent > 0 {
                assert_eq!(fits(&done), fits(&base), "2^{exponent}");
            }
            assert!(
                (done.fit() - base.fit()).abs() < 1e-6,
                "2^{exponent}: {} {}",
                done.fit(),
                base.fit()
            );
            for (a, b) in done.lambda.iter().zip(&base.lambda) {
                let b = b * 2f64.powi(exponent);
                assert!((a - b).abs() <= 1e-4 * b.abs(), "2^{exponent}: {a} {b}");
            }
        }
    }

    #[test]
    fn auto_says_why_the_gpu_was_not_used() {
        if Gpu::count().is_ok_and(|n| n > 0) {
            return; // the fallback is for machines without a usable GPU
        }
        let t = planted_tensor();
        let mut opts = cpu_options(3);
        opts.backend = BackendChoice::Auto;
        opts.cpd.max_iters = 2;
        let (done, _) = run(&t, &opts, &AtomicBool::new(false), |_| {
            ControlFlow::Continue(())
        });
        let done = done.unwrap();
        assert_eq!(done.backend.name(), "cpu");
        assert!(done.fallback.unwrap().contains("CUDA"));
    }

    #[test]
    fn constrained_runs_go_where_unconstrained_ones_do() {
        let t = planted_tensor();
        let mut opts = cpu_options(3);
        opts.cpd.max_iters = 5;
        opts.cpd.constraints = Some(crate::AdmmOptions::nonneg());
        let go = |o: &DecomposeOptions| {
            run(
                &t,
                o,
                &AtomicBool::new(false),
                |_| ControlFlow::Continue(()),
            )
            .0
        };
        let done = go(&opts).unwrap();
        assert_eq!(done.backend.name(), "cpu");
        assert!(done.fallback.is_none());
        assert_eq!(
            done.backend.admm_inner(InnerStop::AllRows),
            InnerStop::AllRows
        );
        assert!(
            done.model
                .factors
                .iter()
                .all(|f| f.iter().all(|&x| x >= 0.0))
        );
        assert!(done.model.iterations.iter().all(|s| s.inner_iters > 0));
        // Auto: the GPU where one is usable, as for ALS, else the CPU with
        // the same reason ALS would give.
        opts.backend = BackendChoice::Auto;
        let done = go(&opts).unwrap();
        let gpu = Gpu::count().is_ok_and(|n| n > 0);
        assert_eq!(done.backend.name(), if gpu { "gpu" } else { "cpu" });
        if gpu {
            assert_eq!(
                done.backend.admm_inner(InnerStop::AllRows),
                InnerStop::RowBlocks
            );
        } else {
            assert!(done.fallback.unwrap().contains("CUDA"));
        }
        // A group of GPUs runs it too (each GPU the blocked inner loop on
        // its own rows); without two GPUs it is the GPUs' error, not the
        // constraints'.
        let mut o = opts.clone();
        o.gpus = Some(vec![0, 1]);
        if Gpu::count().is_ok_and(|n| n >= 2) {
            let done = go(&o).unwrap();
            assert_eq!(
                done.backend.admm_inner(InnerStop::AllRows),
                InnerStop::RowBlocks
            );
            assert!(
                done.model
                    .factors
                    .iter()
                    .all(|f| f.iter().all(|&x| x >= 0.0))
            );
        } else {
            let err = go(&o).err().unwrap();
            assert!(!matches!(err, CpdError::InvalidOption { .. }), "{err}");
        }
        // One GPU is asked for: without one it is the GPU's error, not the
        // constraints'.
        if !gpu {
            let mut o = opts.clone();
            o.backend = BackendChoice::Gpu;
            let err = go(&o).err().unwrap();
            assert!(!matches!(err, CpdError::InvalidOption { .. }), "{err}");
        }
    }

    #[test]
    fn the_reason_for_the_cpu_says_each_cause_once() {
        // The device's error is both the message and the source.
        let e = CpdError::from(DeviceError::NoDevice {
            ordinal: 0,
            count: 0,
        });
        assert_eq!(
            fallback_reason(&e),
            "no CUDA GPU 0 (the driver reports 0 device(s))"
        );
        let e = CpdError::from(DeviceError::MissingLibrary {
            library: "driver",
            tried: vec!["libcuda.so.1".into()],
        });
        assert_eq!(fallback_reason(&e), "no CUDA driver library was found");
    }
}
