//! What `kruskal mttkrp` runs: the MTTKRP of each mode timed on the CPU,
//! one GPU or a group of GPUs (median of `repeat` runs after a warm-up),
//! returned as typed reports ([`MttkrpReport`], which `Serialize` to what
//! `kruskal mttkrp --json` prints). It prints nothing: the tables are the
//! command's.

use std::time::Instant;

use kruskal_cpd::engine_choice::{
    ChoiceRule, ChoiceSource, EngineChoice, GpuCandidate, GpuRequest,
};
use kruskal_cpd::{CpdError, EngineRequest, OptionName, random_factors};
use kruskal_cpu::{CpuEngine, MttkrpEngine, mttkrp_reference, relative_error};
use kruskal_device::GpuOptions;
use kruskal_group::GroupOptions;
use ndarray::Array2;
use serde::Serialize;

use super::{LayoutStep, MeasureError, Result, TOLERANCE, median};
use crate::input::Loaded;

/// Where the MTTKRP runs (without [`MttkrpOptions::gpus`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MttkrpBackend {
    #[default]
    Cpu,
    /// The first CUDA GPU.
    Gpu,
}

/// What `kruskal mttkrp --kernel` asks for: one engine (or `auto`), or
/// every engine of the backend in turn (`all`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MttkrpKernel {
    One(EngineRequest),
    All,
}

impl Default for MttkrpKernel {
    fn default() -> Self {
        MttkrpKernel::One(EngineRequest::Auto)
    }
}

impl std::str::FromStr for MttkrpKernel {
    type Err = kruskal_cpd::CpdError;

    /// `all`, or what [`EngineRequest`] takes.
    fn from_str(text: &str) -> std::result::Result<Self, Self::Err> {
        match text {
            "all" => Ok(MttkrpKernel::All),
            _ => text.parse().map(MttkrpKernel::One),
        }
    }
}

impl std::fmt::Display for MttkrpKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MttkrpKernel::One(k) => k.fmt(f),
            MttkrpKernel::All => f.write_str("all"),
        }
    }
}

/// What [`mttkrp`] times: the options of `kruskal mttkrp` that shape a
/// measurement. `Default` gives the command's defaults.
#[derive(Clone, Debug)]
pub struct MttkrpOptions {
    /// Number of columns of the factor matrices (default 32).
    pub rank: usize,
    /// `all` (the default), or one mode numbered from 1; checked against
    /// the tensor.
    pub mode: String,
    /// Timed runs per mode after one warm-up run; the median is reported
    /// (default 10).
    pub repeat: usize,
    /// The CPU (default) or the first GPU; ignored with [`gpus`](Self::gpus).
    pub backend: MttkrpBackend,
    /// MTTKRP engine, or `all` to time each one in turn. CPU: auto,
    /// sorted, fcoo, flycoo, hicoo, csf. GPU: auto, coo, hicoo, fcoo, flycoo;
    /// on the GPU `auto` is the tuning model's choice of engine and launch
    /// parameter for this tensor and rank (fcoo with threadlen 8 when
    /// there is no trained model), and an engine's parameter not given in
    /// [`gpu`](Self::gpu) is the model's best for that engine. Several
    /// GPUs: auto or shard. Default `auto`.
    pub kernel: MttkrpKernel,
    /// Launch parameters of the GPU engines; a parameter given here wins
    /// over the tuning model's.
    pub gpu: GpuOptions,
    /// Ignore the tuning model: `auto` is the fixed default and every
    /// parameter not given is the fixed default.
    pub no_model: bool,
    /// Run the shard kernel on these GPUs of this host as one group (see
    /// [`kruskal_cpd::decompose::first_gpus`]); `None` (the default): one
    /// device, as [`backend`](Self::backend) says.
    pub gpus: Option<Vec<usize>>,
    /// Options of the group, with [`gpus`](Self::gpus).
    pub group: GroupOptions,
    /// Also compare each mode with the f64 reference (slow on big
    /// tensors); the relative errors are in the reports, and checking
    /// them is the caller's choice.
    pub verify: bool,
}

impl Default for MttkrpOptions {
    fn default() -> Self {
        MttkrpOptions {
            rank: 32,
            mode: "all".into(),
            repeat: 10,
            backend: MttkrpBackend::Cpu,
            kernel: MttkrpKernel::default(),
            gpu: GpuOptions::default(),
            no_model: false,
            gpus: None,
            group: GroupOptions::default(),
            verify: false,
        }
    }
}

/// What a run of `kruskal mttkrp` measured: one engine on the CPU, one on
/// a GPU, or the shard kernel on a group of GPUs. Serializes to the object
/// `kruskal mttkrp --json` prints.
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub enum MttkrpReport {
    Cpu(CpuMttkrpReport),
    Gpu(GpuMttkrpReport),
    Group(GroupMttkrpReport),
}

impl MttkrpReport {
    /// The engine's name (`shard` for a group).
    pub fn kernel(&self) -> &'static str {
        match self {
            MttkrpReport::Cpu(r) => r.kernel,
            MttkrpReport::Gpu(r) => r.kernel,
            MttkrpReport::Group(r) => r.kernel,
        }
    }

    /// The relative error this engine may show: [`TOLERANCE`], or what
    /// half-precision gathers allow.
    pub fn tolerance(&self) -> f64 {
        match self {
            MttkrpReport::Gpu(r) => r.tolerance,
            MttkrpReport::Cpu(_) | MttkrpReport::Group(_) => TOLERANCE,
        }
    }

    /// Every mode's relative error against the f64 reference, where it was
    /// measured (`verify`).
    pub fn relative_errors(&self) -> impl Iterator<Item = f64> + '_ {
        let errors: Vec<Option<f64>> = match self {
            MttkrpReport::Cpu(r) => r.modes.iter().map(|m| m.relative_error).collect(),
            MttkrpReport::Gpu(r) => r.modes.iter().map(|m| m.relative_error).collect(),
            MttkrpReport::Group(r) => r.modes.iter().map(|m| m.relative_error).collect(),
        };
        errors.into_iter().flatten()
    }
}

/// The tensor a report is about.
#[derive(Clone, Debug, Serialize)]
pub struct TensorShape {
    /// The file's path, or how the tensor was generated.
    pub source: String,
    pub dims: Vec<u32>,
    pub nnz: usize,
}

impl TensorShape {
    fn of(loaded: &Loaded) -> Self {
        TensorShape {
            source: loaded.source.clone(),
            dims: loaded.tensor.dims().to_vec(),
            nnz: loaded.tensor.nnz(),
        }
    }
}

/// One CPU engine timed.
#[derive(Clone, Debug, Serialize)]
pub struct CpuMttkrpReport {
    pub tensor: TensorShape,
    /// `cpu`.
    pub backend: &'static str,
    pub kernel: &'static str,
    /// Bytes of tensor data the engine holds per nonzero (all modes).
    pub bytes_per_nnz: f64,
    pub threads: usize,
    pub rank: usize,
    pub repeat: usize,
    pub prepare_s: f64,
    pub modes: Vec<CpuModeRow>,
    pub total_median_ms: f64,
    pub mnnz_per_s: f64,
    pub mnnz_per_s_per_core: f64,
}

/// One mode of a CPU engine (mode numbered from 1).
#[derive(Clone, Debug, Serialize)]
pub struct CpuModeRow {
    pub mode: usize,
    pub median_ms: f64,
    pub min_ms: f64,
    pub mnnz_per_s: f64,
    pub mnnz_per_s_per_core: f64,
    pub relative_error: Option<f64>,
}

/// One GPU engine timed, beside the DRAM and L2 gather floors.
#[derive(Clone, Debug, Serialize)]
pub struct GpuMttkrpReport {
    pub tensor: TensorShape,
    /// `gpu`.
    pub backend: &'static str,
    pub kernel: &'static str,
    pub choice: ChoiceReport,
    /// FLYCOO's split rows summed in a fixed order.
    pub deterministic: bool,
    /// The GPU's name.
    pub gpu: String,
    pub copy_bandwidth_bytes_per_s: f64,
    pub l2_gather_bandwidth_bytes_per_s: f64,
    pub rank: usize,
    pub repeat: usize,
    pub prepare_s: f64,
    /// The layout build's steps on the GPU.
    pub prepare_steps: Vec<LayoutStep>,
    pub modes: Vec<GpuModeRow>,
    /// The relative error the engine may show.
    pub tolerance: f64,
    pub total_median_ms: f64,
    pub floor_ms: f64,
    pub times_floor: f64,
    pub l2_floor_ms: f64,
    pub times_l2_floor: f64,
    /// The GPU's multiprocessors.
    #[serde(skip)]
    pub sms: usize,
    /// The choice in one line: `auto -> fcoo, threadlen 8, lane teams
    /// (tuning model, ...)`.
    #[serde(skip)]
    pub choice_line: String,
}

/// One mode of a GPU engine (mode numbered from 1).
#[derive(Clone, Debug, Serialize)]
pub struct GpuModeRow {
    pub mode: usize,
    pub median_ms: f64,
    pub min_ms: f64,
    pub mnnz_per_s: f64,
    pub floor_ms: f64,
    pub times_floor: f64,
    pub relative_error: Option<f64>,
    /// Factor rows gathered per nonzero.
    pub gathers_per_nonzero: f64,
    pub l2_floor_ms: f64,
    pub times_l2_floor: f64,
}

/// The engine and launch parameters a GPU run used, and where they came
/// from.
#[derive(Clone, Debug, Serialize)]
pub struct ChoiceReport {
    /// What `--kernel` asked for.
    pub requested: &'static str,
    pub kernel: &'static str,
    /// `fcoo, threadlen 8, lane teams`.
    pub description: String,
    pub kappa: usize,
    pub threadlen: usize,
    pub block_bits: u32,
    pub fiber: bool,
    pub factor_precision: &'static str,
    pub rounds: u32,
    pub prefetch: bool,
    pub min_blocks: u32,
    pub group_sums: bool,
    /// `flags`, `model` or `default`.
    pub source: &'static str,
    pub predicted_ms: Option<f64>,
    /// Why the default was used (also when the model kept it).
    pub reason: Option<String>,
    pub features_s: f64,
}

/// The shard kernel timed on a group of GPUs, with the row exchange that
/// follows each mode in CPD-ALS.
#[derive(Clone, Debug, Serialize)]
pub struct GroupMttkrpReport {
    pub tensor: TensorShape,
    /// `gpus`.
    pub backend: &'static str,
    /// `shard`.
    pub kernel: &'static str,
    /// The GPUs' ordinals.
    pub gpus: Vec<usize>,
    /// The first GPU's name.
    pub gpu: String,
    pub exchange: Option<&'static str>,
    pub exchange_note: Option<String>,
    /// Where each GPU's shards live, a line per GPU.
    pub placement: Vec<String>,
    pub rank: usize,
    pub repeat: usize,
    pub prepare_s: f64,
    pub modes: Vec<GroupModeRow>,
    pub total_median_ms: f64,
    /// What the group's preparation said, (topic, text) in order.
    #[serde(skip)]
    pub notes: Vec<(String, String)>,
}

/// One mode on a group (slowest GPU's times; mode numbered from 1).
#[derive(Clone, Debug, Serialize)]
pub struct GroupModeRow {
    pub mode: usize,
    pub median_ms: f64,
    pub h2d_ms: f64,
    pub kernel_ms: f64,
    pub exchange_ms: f64,
    /// The reduction of a partial mode's sums onto their owners after the
    /// MTTKRP (a split plan; 0 otherwise), slowest GPU.
    pub reduce_ms: f64,
    pub per_gpu_ms: Vec<f64>,
    pub relative_error: Option<f64>,
    /// `read` (only the rows each GPU reads), `all`, or `none` (a split
    /// plan's cut mode).
    pub exchange_rows: &'static str,
    pub exchange_bytes: u64,
    pub all_gather_bytes: u64,
    pub reduce_bytes: u64,
}

/// Times what `opts` asks for on a loaded tensor and returns one report
/// per engine (one for a group of GPUs): what `kruskal mttkrp --json`
/// prints. A report's [`MttkrpReport::tolerance`] is the relative error
/// its engine may show ([`TOLERANCE`], or more for half-precision
/// gathers).
///
/// ```
/// use kruskal::input::TensorSource;
/// use kruskal::measure::{MttkrpOptions, mttkrp};
///
/// let loaded = TensorSource::Like { name: "nell-2".into(), nnz: Some(2_000), seed: 1 }.load().unwrap();
/// let opts = MttkrpOptions { rank: 4, repeat: 2, kernel: "fcoo".parse().unwrap(), verify: true, ..Default::default() };
/// let reports = mttkrp(&opts, &loaded).unwrap();
/// assert_eq!(reports[0].kernel(), "fcoo");
/// assert!(reports[0].relative_errors().all(|e| e < 1e-5));
/// ```
pub fn mttkrp(opts: &MttkrpOptions, loaded: &Loaded) -> Result<Vec<MttkrpReport>> {
    for (option, n) in [
        (OptionName::Rank, opts.rank),
        (OptionName::Repeat, opts.repeat),
    ] {
        if n == 0 {
            return Err(CpdError::option(option, "must be at least 1").into());
        }
    }
    let t = &loaded.tensor;
    let modes: Vec<usize> = if opts.mode == "all" {
        (0..t.nmodes()).collect()
    } else {
        match opts.mode.parse::<usize>() {
            Ok(m) if (1..=t.nmodes()).contains(&m) => vec![m - 1],
            _ => {
                return Err(CpdError::option_value(
                    OptionName::Mode,
                    &opts.mode,
                    format!("is not 'all' or a mode from 1 to {}", t.nmodes()),
                )
                .into());
            }
        }
    };
    let mut need = kruskal_cpd::memory::mttkrp_need(t.dims(), t.nnz(), opts.rank);
    if opts.backend == MttkrpBackend::Gpu || opts.gpus.is_some() {
        // On GPUs the host holds the factors (made here, then uploaded).
        need.parts.truncate(1);
    }
    if let Some(refusal) = kruskal_cpd::memory::host_refusal(&need, t, true) {
        return Err(refusal.into());
    }
    if let Some(ordinals) = &opts.gpus {
        return Ok(vec![MttkrpReport::Group(run_group(
            opts, loaded, &modes, ordinals,
        )?)]);
    }
    if opts.backend == MttkrpBackend::Gpu {
        return run_gpu(opts, loaded, &modes);
    }
    let kernels: Vec<CpuEngine> = match opts.kernel {
        MttkrpKernel::All => CpuEngine::ENGINES.to_vec(),
        MttkrpKernel::One(k) => vec![k.cpu().ok_or_else(|| {
            MeasureError::Invalid(format!(
                "unknown CPU kernel '{k}' (auto, sorted, fcoo, flycoo, hicoo, csf)"
            ))
        })?],
    };
    let factors = random_factors(t.dims(), opts.rank, 1);
    let mut reports = Vec::new();
    for &kernel in &kernels {
        reports.push(MttkrpReport::Cpu(time_kernel(
            opts, loaded, kernel, &modes, &factors,
        )?));
    }
    Ok(reports)
}

/// What half-precision gathers may add to the error: bf16 keeps 8 bits of
/// mantissa (values rounded by up to 2^-9), f16 11 bits (2^-12).
fn tolerance(precision: kruskal_device::FactorPrecision) -> f64 {
    use kruskal_device::FactorPrecision;
    match precision {
        FactorPrecision::F32 => TOLERANCE,
        FactorPrecision::Bf16 => 1e-2,
        FactorPrecision::F16 => 2e-3,
    }
}

/// Builds one engine and times it: one warm-up sweep over `modes`, then
/// `repeat` sweeps (in mode order, as CPD-ALS calls them: FLYCOO's tensor
/// copy then arrives in each mode's order by its dynamic remap).
fn time_kernel(
    opts: &MttkrpOptions,
    loaded: &Loaded,
    kernel: CpuEngine,
    modes: &[usize],
    factors: &[Array2<f32>],
) -> Result<CpuMttkrpReport> {
    let t = &loaded.tensor;
    let threads = rayon::current_num_threads();
    let prep = Instant::now();
    let mut engine: Box<dyn MttkrpEngine> = kernel.build(t)?;
    let prep_s = prep.elapsed().as_secs_f64();
    let mut outs: Vec<Array2<f32>> = modes
        .iter()
        .map(|&m| Array2::<f32>::zeros((t.dims()[m] as usize, opts.rank)))
        .collect();
    let mut times = vec![Vec::with_capacity(opts.repeat); modes.len()];
    for sweep in 0..=opts.repeat {
        for (k, &mode) in modes.iter().enumerate() {
            let s = Instant::now();
            engine.mttkrp(mode, factors, &mut outs[k])?;
            if sweep > 0 {
                times[k].push(s.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    let mut rows = Vec::new();
    let mut total_ms = 0.0;
    for (k, &mode) in modes.iter().enumerate() {
        let min_ms = times[k].iter().copied().fold(f64::INFINITY, f64::min);
        let ms = median(&mut times[k]);
        total_ms += ms;
        let rate = t.nnz() as f64 / (ms * 1e-3) / 1e6;
        let error = if opts.verify {
            let views: Vec<_> = factors.iter().map(|f| f.view()).collect();
            let exact = mttkrp_reference(t, &views, mode)?;
            Some(relative_error(outs[k].view(), exact.view()))
        } else {
            None
        };
        rows.push(CpuModeRow {
            mode: mode + 1,
            median_ms: ms,
            min_ms,
            mnnz_per_s: rate,
            mnnz_per_s_per_core: rate / threads as f64,
            relative_error: error,
        });
    }
    let rate_all = t.nnz() as f64 * modes.len() as f64 / (total_ms * 1e-3) / 1e6;
    Ok(CpuMttkrpReport {
        tensor: TensorShape::of(loaded),
        backend: "cpu",
        kernel: engine.name(),
        bytes_per_nnz: engine.bytes() as f64 / t.nnz().max(1) as f64,
        threads,
        rank: opts.rank,
        repeat: opts.repeat,
        prepare_s: prep_s,
        modes: rows,
        total_median_ms: total_ms,
        mnnz_per_s: rate_all,
        mnnz_per_s_per_core: rate_all / threads as f64,
    })
}

/// `--backend gpu`: uploads the tensor and random factors, times every mode
/// of each chosen engine with CUDA events (median of `--repeat` after a
/// warm-up), compares it with the bandwidth floor, and with `--verify`
/// checks each mode against the f64 reference.
fn run_gpu(opts: &MttkrpOptions, loaded: &Loaded, modes: &[usize]) -> Result<Vec<MttkrpReport>> {
    use kruskal_device::{GpuEngine, floor_bytes};
    let t = &loaded.tensor;
    let kernels: Vec<GpuEngine> = match opts.kernel {
        MttkrpKernel::All => GpuEngine::ENGINES.to_vec(),
        MttkrpKernel::One(k) => vec![k.gpu().ok_or_else(|| {
            MeasureError::Invalid(format!(
                "unknown GPU kernel '{k}' (choose auto, coo, hicoo, fcoo or flycoo)"
            ))
        })?],
    };
    let gpu = kruskal_device::Gpu::open(0)?;
    let bandwidth = Bandwidths {
        copy: gpu.copy_bandwidth()?,
        l2_gather: gpu.l2_gather_bandwidth(opts.rank)?,
    };
    let factors = random_factors(t.dims(), opts.rank, 1);
    let exact: Vec<Option<Array2<f64>>> = if opts.verify {
        let views: Vec<_> = factors.iter().map(|f| f.view()).collect();
        modes
            .iter()
            .map(|&m| mttkrp_reference(t, &views, m).map(Some))
            .collect::<Result<_, _>>()?
    } else {
        vec![None; modes.len()]
    };
    let floor_ms: Vec<f64> = modes
        .iter()
        .map(|_| floor_bytes(t.dims(), t.nnz(), opts.rank) as f64 / bandwidth.copy * 1e3)
        .collect();
    let mut features = None;
    let mut reports = Vec::new();
    for &kernel in &kernels {
        let choice = GpuRequest {
            engine: kernel,
            given: &opts.gpu,
            no_model: opts.no_model,
            rank: opts.rank,
            rule: ChoiceRule::One,
        }
        .choose(t, gpu.properties().sms, &mut features);
        reports.push(MttkrpReport::Gpu(time_gpu_kernel(
            opts, loaded, &gpu, &choice, modes, &factors, &exact, &floor_ms, bandwidth,
        )?));
    }
    Ok(reports)
}

/// The measured bandwidths the floors divide by, bytes per second.
#[derive(Clone, Copy, Debug)]
struct Bandwidths {
    /// Device-to-device copy (read + write): the DRAM floor.
    copy: f64,
    /// Rows of `rank` floats gathered from L2: the L2 gather floor.
    l2_gather: f64,
}

/// One timed sweep of one mode on a group: the slowest GPU's times, each
/// GPU's MTTKRP milliseconds, and the exchange milliseconds.
type Sample = (kruskal_group::MttkrpTimes, Vec<f64>, f64);

/// `--gpus`: the shard kernel on every GPU of a group. Times `repeat`
/// sweeps (after a warm-up) per mode: the MTTKRP (slowest GPU, with its
/// copy and kernel time when streamed) and the exchange of the mode's rows
/// that follows it in CPD-ALS.
fn run_group(
    opts: &MttkrpOptions,
    loaded: &Loaded,
    modes: &[usize],
    ordinals: &[usize],
) -> Result<GroupMttkrpReport> {
    let t = &loaded.tensor;
    let prep = Instant::now();
    // Where the shards are built follows `--fcoo-build`, as for one GPU.
    let group_opts = GroupOptions {
        build: opts.gpu.fcoo_build,
        ..opts.group.clone()
    };
    let mut notes = Vec::new();
    let mut group = kruskal_cpd::decompose::gpu_group(
        ordinals,
        t,
        opts.rank,
        match opts.kernel {
            MttkrpKernel::One(k) => k,
            MttkrpKernel::All => return Err(kruskal_cpd::decompose::not_for_a_group("all").into()),
        },
        &group_opts,
        &mut |topic, text| notes.push((topic.to_string(), text.to_string())),
    )?;
    let factors = random_factors(t.dims(), opts.rank, 1);
    group.load_factors(&factors)?;
    let prep_s = prep.elapsed().as_secs_f64();
    let gpus = group.gpus().len();
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); modes.len()];
    for sweep in 0..=opts.repeat {
        for (k, &mode) in modes.iter().enumerate() {
            group.mttkrp(mode)?;
            let times = group.sync()?;
            let exchange_ms = group.exchange_rows(mode)?;
            if sweep > 0 {
                let slowest = times
                    .iter()
                    .copied()
                    .max_by(|a, b| a.total_ms.total_cmp(&b.total_ms))
                    .unwrap_or_default();
                let slowest = kruskal_group::MttkrpTimes {
                    reduce_ms: times.iter().map(|t| t.reduce_ms).fold(0.0, f64::max),
                    ..slowest
                };
                let per_gpu = times.iter().map(|t| t.total_ms).collect();
                samples[k].push((slowest, per_gpu, exchange_ms));
            }
        }
    }
    let views: Vec<_> = factors.iter().map(|f| f.view()).collect();
    let mut rows = Vec::new();
    let mut total_ms = 0.0;
    for (k, &mode) in modes.iter().enumerate() {
        let med = |f: &dyn Fn(&Sample) -> f64| {
            let mut v: Vec<f64> = samples[k].iter().map(f).collect();
            median(&mut v)
        };
        let ms = med(&|s| s.0.total_ms);
        let h2d = med(&|s| s.0.h2d_ms);
        let kernel = med(&|s| s.0.kernel_ms);
        let exchange = med(&|s| s.2);
        let reduce = med(&|s| s.0.reduce_ms);
        let per_gpu: Vec<f64> = (0..gpus).map(|g| med(&|s| s.1[g])).collect();
        total_ms += ms + reduce;
        let error = if opts.verify {
            group.mttkrp(mode)?;
            group.sync()?;
            let out = group.output(mode)?;
            let exact = mttkrp_reference(t, &views, mode)?;
            Some(relative_error(out.view(), exact.view()))
        } else {
            None
        };
        let volume = group.exchange_volume(mode);
        rows.push(GroupModeRow {
            mode: mode + 1,
            median_ms: ms,
            h2d_ms: h2d,
            kernel_ms: kernel,
            exchange_ms: exchange,
            reduce_ms: reduce,
            per_gpu_ms: per_gpu,
            relative_error: error,
            exchange_rows: volume.rows_name(),
            exchange_bytes: volume.bytes,
            all_gather_bytes: volume.all_gather_bytes,
            reduce_bytes: volume.reduce_bytes,
        });
    }
    Ok(GroupMttkrpReport {
        tensor: TensorShape::of(loaded),
        backend: "gpus",
        kernel: "shard",
        gpus: ordinals.to_vec(),
        gpu: group.gpus()[0].properties().name.clone(),
        exchange: group.exchange().map(|e| e.name()),
        exchange_note: group.exchange_note().map(String::from),
        placement: group.describe(),
        rank: opts.rank,
        repeat: opts.repeat,
        prepare_s: prep_s,
        modes: rows,
        total_median_ms: total_ms,
        notes,
    })
}

/// `fcoo, threadlen 8`: the engine and the parameter it uses.
fn describe(
    kernel: kruskal_device::GpuEngine,
    opts: &kruskal_device::GpuOptions,
    sms: usize,
    rank: usize,
) -> String {
    use kruskal_device::GpuEngine;
    let p = opts.resolve(sms);
    match kernel.resolve() {
        GpuEngine::Hicoo => format!("hicoo, block bits {}", p.block_bits),
        GpuEngine::Fcoo => format!(
            "fcoo, threadlen {}{}{}{}",
            p.threadlen,
            if p.fiber { ", fiber reuse" } else { "" },
            if !p.fiber
                && opts.teams.unwrap_or(kruskal_device::options::DEFAULT_TEAMS)
                && kruskal_device::engines::fcoo::teams_fit(rank)
            {
                let pipe = opts.pipeline();
                if pipe == kruskal_device::options::DEFAULT_PIPELINE {
                    ", lane teams".to_string()
                } else {
                    format!(
                        ", lane teams (rounds {}{}, min blocks {}{})",
                        pipe.rounds,
                        if pipe.prefetch { ", prefetch" } else { "" },
                        pipe.min_blocks,
                        if pipe.group_sums { ", group sums" } else { "" }
                    )
                }
            } else {
                String::new()
            },
            match opts.precision {
                kruskal_device::FactorPrecision::F32 => String::new(),
                other => format!(", {} gathers", other.name()),
            }
        ),
        GpuEngine::Flycoo => format!("flycoo, kappa {}", p.kappa),
        k => k.name().to_string(),
    }
}

/// The engine a one-GPU run builds: its choice's only candidate.
fn chosen(choice: &EngineChoice) -> Result<&GpuCandidate> {
    choice
        .candidates
        .first()
        .ok_or_else(|| MeasureError::Invalid("no GPU kernel to run".into()))
}

/// `flags`, `model` or `default`, and why the default was used (also when
/// the model kept it under its margin).
fn source_and_reason(choice: &EngineChoice) -> (&'static str, Option<String>) {
    match &choice.source {
        ChoiceSource::Flags => ("flags", None),
        ChoiceSource::Trial => ("trial", None),
        ChoiceSource::Model { kept } => ("model", kept.map(|k| k.to_string())),
        ChoiceSource::Default { why } => ("default", Some(why.text(&crate::console::flag))),
    }
}

/// One line for the text output: `auto -> fcoo, threadlen 8, lane teams
/// (fixed default: --no-model)`.
fn choice_line(choice: &EngineChoice, sms: usize, rank: usize) -> Result<String> {
    let c = chosen(choice)?;
    let what = describe(c.engine, &c.options, sms, rank);
    let how = match (source_and_reason(choice), c.predicted_ms) {
        (("model", why), Some(ms)) => format!(
            "tuning model, predicted {ms:.3} ms for all modes{}; features in {:.2} s",
            why.as_ref().map_or(String::new(), |w| format!("; {w}")),
            choice.features_s.unwrap_or(0.0)
        ),
        (("default", Some(r)), _) => format!("fixed default: {r}"),
        _ => "given by the flags".into(),
    };
    Ok(format!("{} -> {what} ({how})", choice.requested))
}

/// The choice as `--json` reports it.
fn choice_report(choice: &EngineChoice, sms: usize, rank: usize) -> Result<ChoiceReport> {
    let c = chosen(choice)?;
    let p = c.options.resolve(sms);
    let pipe = c.options.pipeline();
    let (source, reason) = source_and_reason(choice);
    Ok(ChoiceReport {
        requested: choice.requested.name(),
        kernel: c.engine.name(),
        description: describe(c.engine, &c.options, sms, rank),
        kappa: p.kappa,
        threadlen: p.threadlen,
        block_bits: p.block_bits,
        fiber: p.fiber,
        factor_precision: c.options.precision.name(),
        rounds: pipe.rounds,
        prefetch: pipe.prefetch,
        min_blocks: pipe.min_blocks,
        group_sums: pipe.group_sums,
        source,
        predicted_ms: c.predicted_ms,
        reason,
        features_s: choice.features_s.unwrap_or(0.0),
    })
}

/// Builds one GPU engine and times it.
#[allow(clippy::too_many_arguments)]
fn time_gpu_kernel(
    opts: &MttkrpOptions,
    loaded: &Loaded,
    gpu: &std::sync::Arc<kruskal_device::Gpu>,
    choice: &EngineChoice,
    modes: &[usize],
    factors: &[Array2<f32>],
    exact: &[Option<Array2<f64>>],
    floor_ms: &[f64],
    bandwidth: Bandwidths,
) -> Result<GpuMttkrpReport> {
    use kruskal_device::DeviceFactors;
    use kruskal_device::build_engine;
    let t = &loaded.tensor;
    let prep = Instant::now();
    let built = chosen(choice)?;
    let mut engine = build_engine(built.engine, gpu.clone(), t, &built.options)?;
    let dev_factors = DeviceFactors::upload(gpu, factors)?;
    gpu.stream()
        .synchronize()
        .map_err(|source| kruskal_device::DeviceError::Driver {
            what: "waiting for the upload".into(),
            error: source,
        })?;
    let prep_s = prep.elapsed().as_secs_f64();
    let p = gpu.properties();
    let l2_ms: Vec<f64> = modes
        .iter()
        .map(|&m| {
            kruskal_device::l2_floor_bytes(t.nnz(), engine.gathers_per_nonzero(m), opts.rank)
                / bandwidth.l2_gather
                * 1e3
        })
        .collect();
    let mut rows = Vec::new();
    let mut total_ms = 0.0;
    let sweeps = engine.time_sweeps(&dev_factors, modes, opts.repeat)?;
    for (k, &mode) in modes.iter().enumerate() {
        let mut times: Vec<f64> = sweeps[k].iter().copied().map(f64::from).collect();
        let min_ms = times.iter().copied().fold(f64::INFINITY, f64::min);
        let ms = median(&mut times);
        total_ms += ms;
        let rate = t.nnz() as f64 / (ms * 1e-3) / 1e6;
        let error = match &exact[k] {
            Some(exact) => {
                let mut out =
                    Array2::<f32>::from_elem((t.dims()[mode] as usize, opts.rank), f32::NAN);
                engine.mttkrp_host(mode, factors, &mut out)?;
                Some(relative_error(out.view(), exact.view()))
            }
            None => None,
        };
        rows.push(GpuModeRow {
            mode: mode + 1,
            median_ms: ms,
            min_ms,
            mnnz_per_s: rate,
            floor_ms: floor_ms[k],
            times_floor: ms / floor_ms[k],
            relative_error: error,
            gathers_per_nonzero: engine.gathers_per_nonzero(mode),
            l2_floor_ms: l2_ms[k],
            times_l2_floor: ms / l2_ms[k],
        });
    }
    let floor_total: f64 = floor_ms.iter().sum();
    let l2_total: f64 = l2_ms.iter().sum();
    Ok(GpuMttkrpReport {
        tensor: TensorShape::of(loaded),
        backend: "gpu",
        kernel: engine.name(),
        choice: choice_report(choice, p.sms, opts.rank)?,
        deterministic: opts.gpu.deterministic,
        gpu: p.name.clone(),
        copy_bandwidth_bytes_per_s: bandwidth.copy,
        l2_gather_bandwidth_bytes_per_s: bandwidth.l2_gather,
        rank: opts.rank,
        repeat: opts.repeat,
        prepare_s: prep_s,
        prepare_steps: engine
            .preparation()
            .iter()
            .map(|&(step, s)| LayoutStep { step, s })
            .collect(),
        modes: rows,
        tolerance: tolerance(if engine.name() == "fcoo" {
            built.options.precision
        } else {
            kruskal_device::FactorPrecision::F32
        }),
        total_median_ms: total_ms,
        floor_ms: floor_total,
        times_floor: total_ms / floor_total,
        l2_floor_ms: l2_total,
        times_l2_floor: total_ms / l2_total,
        sms: p.sms,
        choice_line: choice_line(choice, p.sms, opts.rank)?,
    })
}

#[cfg(test)]
mod choice_tests {
    use super::*;
    use crate::input::TensorSource;
    use kruskal_device::{FactorPrecision, GpuEngine};

    /// The choice for `--kernel kernel` with these launch options, on a
    /// small nips-shaped tensor.
    fn pick(kernel: &str, gpu: GpuOptions, no_model: bool) -> EngineChoice {
        pick_on("nips", 2_000, kernel, gpu, no_model)
    }

    fn pick_on(
        like: &str,
        nnz: usize,
        kernel: &str,
        gpu: GpuOptions,
        no_model: bool,
    ) -> EngineChoice {
        let source = TensorSource::Like {
            name: like.into(),
            nnz: Some(nnz),
            seed: 1,
        };
        let t = source.load().unwrap().tensor;
        GpuRequest {
            engine: kernel.parse().unwrap(),
            given: &gpu,
            no_model,
            rank: 32,
            rule: ChoiceRule::One,
        }
        .choose(&t, 132, &mut None)
    }

    /// Launch options with only `threadlen` given.
    fn threadlen(n: usize) -> GpuOptions {
        GpuOptions {
            threadlen: Some(n),
            ..GpuOptions::default()
        }
    }

    /// Source, engine and options of a one-engine choice.
    fn parts(c: &EngineChoice) -> (&'static str, GpuEngine, GpuOptions) {
        let k = chosen(c).unwrap();
        (source_and_reason(c).0, k.engine, k.options.clone())
    }

    #[test]
    fn flags_win_and_no_model_keeps_the_fixed_default() {
        let c = pick("fcoo", threadlen(16), false);
        let (source, engine, opts) = parts(&c);
        assert_eq!(
            (source, engine, opts.threadlen),
            ("flags", GpuEngine::Fcoo, Some(16))
        );
        assert_eq!(choice_report(&c, 132, 32).unwrap().source, "flags");
        assert!(
            choice_line(&c, 132, 32)
                .unwrap()
                .ends_with("(given by the flags)")
        );
        assert_eq!(parts(&pick("coo", GpuOptions::default(), false)).0, "flags");
        let c = pick("auto", GpuOptions::default(), true);
        assert_eq!((parts(&c).0, parts(&c).1), ("default", GpuEngine::Fcoo));
        assert_eq!(source_and_reason(&c).1.as_deref(), Some("--no-model"));
        let line = choice_line(&c, 132, 32).unwrap();
        assert!(
            line.starts_with("auto -> fcoo, threadlen 8, lane teams (fixed default"),
            "{line}"
        );
        let report = choice_report(&c, 132, 32).unwrap();
        assert_eq!(report.threadlen, 8);
        assert_eq!(report.reason.as_deref(), Some("--no-model"));
        assert_eq!(report.features_s, 0.0);
        // The kernel's options as the line names them; lane teams only at
        // the ranks they exist for.
        let fiber = GpuOptions {
            fiber: Some(true),
            ..threadlen(8)
        };
        let (_, k, o) = parts(&pick("fcoo", fiber, false));
        let bf16 = GpuOptions {
            precision: FactorPrecision::Bf16,
            ..threadlen(8)
        };
        let c2 = pick("fcoo", bf16, false);
        let (_, k2, o2) = parts(&c2);
        assert_eq!(describe(k, &o, 132, 32), "fcoo, threadlen 8, fiber reuse");
        assert_eq!(
            describe(k2, &o2, 132, 32),
            "fcoo, threadlen 8, lane teams, bf16 gathers"
        );
        assert_eq!(describe(k2, &o2, 132, 7), "fcoo, threadlen 8, bf16 gathers");
        assert_eq!(
            choice_report(&c2, 132, 32).unwrap().factor_precision,
            "bf16"
        );
        // With a trained model the source is `model`; untrained, the default.
        let flycoo = GpuOptions {
            kappa: Some(7),
            deterministic: true,
            ..GpuOptions::default()
        };
        let (_, _, o) = parts(&pick("flycoo", flycoo, false));
        assert_eq!((o.kappa, o.deterministic), (Some(7), true));
        let (source, engine, _) = parts(&pick("hicoo", GpuOptions::default(), false));
        assert!(["model", "default"].contains(&source));
        assert_eq!(engine, GpuEngine::Hicoo);
        // With the model, `auto` leaves the default only beyond the margin,
        // and says why when it keeps it (on a nell-2 shape the embedded
        // model ranks flycoo first, by a few percent).
        let c = pick_on("nell-2", 200_000, "auto", GpuOptions::default(), false);
        let (source, engine, opts) = parts(&c);
        if source == "model" {
            match source_and_reason(&c).1 {
                Some(why) => {
                    assert!(why.starts_with("default fcoo/threadlen=8 kept"), "{why}");
                    assert_eq!((engine, opts.threadlen), (GpuEngine::Fcoo, Some(8)));
                    let line = choice_line(&c, 132, 32).unwrap();
                    assert!(line.contains(why.as_str()), "{line}");
                }
                None => assert!(chosen(&c).unwrap().predicted_ms.is_some()),
            }
        }
    }
}
