//! The harness of `kruskal check`: does every MTTKRP engine give the right
//! answer on this machine? (SPLATT's `splatt check`, for new hardware.)
//! The command (`cli/check.rs`) parses its options, calls [`run_check`]
//! and prints the report.
//!
//! Each engine (every CPU engine; with [`CheckOptions::gpu`], every GPU
//! engine too) computes the MTTKRP of every mode of
//!
//! - random power-law tensors with 3 to 6 modes whose hottest rows hold 10%
//!   or more of the nonzeros, at ranks 1 to 100 (the mode counts and ranks
//!   the GPU kernels are compiled for, [`CHECK_MODES`] and [`CHECK_RANKS`],
//!   odd and uneven ranks included), and
//! - the tensor files of a data folder (`--data`, or `KRUSKAL_TEST_DATA`),
//!
//! and each result is compared with the f64 reference
//! ([`mttkrp_reference`]): relative Frobenius error below [`TOLERANCE`].
//! Outputs are filled with NaN before every run, so a row an engine leaves
//! unwritten shows as a failure rather than as stale numbers.
//!
//! Two properties of FLYCOO are checked besides accuracy, on a layout with
//! few partitions (kappa 7) so that the hot rows are split between them:
//! after modes `0..N` in order its tensor copy is back in its original
//! order (the dynamic remap is a round trip), and with split rows summed in
//! a fixed order two sweeps give bit-identical results (on the CPU the
//! second sweep runs on one thread, so the result is also independent of
//! the thread count).
//!
//! An engine that fails to build, errors or panics is a failed case with
//! its message, never the end of the check.
//!
//! Besides the MTTKRP, the steps of CP-APR and AO-ADMM that are not one
//! are checked against f64 references of their own ([`algorithms`]):
//! CP-APR's `Phi` and KKT violation (`cp-apr phi`), AO-ADMM's proximal
//! step (`ao-admm prox`) and inner loop (`ao-admm inner`), on the CPU
//! and, with [`CheckOptions::gpu`], on the GPU.
//!
//! ```
//! use kruskal::harness::{CheckOptions, run_check};
//!
//! let opts = CheckOptions { nmodes: vec![3], ranks: vec![4], nnz: 2_000, ..CheckOptions::quick() };
//! let report = run_check(&opts, &mut |_| {}).unwrap();
//! assert!(report.passed(), "{:?}", report.failures().next());
//! ```

pub mod algorithms;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use kruskal_cpu::{CpuEngine, FlycooMttkrp, MttkrpEngine, mttkrp_reference, relative_error};
use kruskal_device::catalog::{CHECK_MODES, CHECK_RANKS};
use kruskal_device::{FlycooGpu, Gpu, GpuEngine, GpuMttkrp, GpuOptions, build_engine};
use kruskal_formats::generate::{PowerLawSpec, power_law};
use kruskal_formats::{ReadOptions, SparseTensor, read_tensor_report};
use kruskal_partition::flycoo::build_flycoo;
use kruskal_partition::layout::LayoutOptions;
use ndarray::Array2;
use rayon::prelude::*;
use serde::Serialize;

/// Why the check could not run at all (an engine's failure is a failed
/// case in the report instead).
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// Options that do not fit (a rank of 0, a mode count the generator
    /// lacks, a data folder that is not one).
    #[error("{0}")]
    Invalid(String),
    /// A folder could not be listed.
    #[error("listing {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    /// The one-thread pool of the CPU engines could not start.
    #[error("could not start a one-thread pool: {0}")]
    Pool(rayon::ThreadPoolBuildError),
    /// The GPU could not be opened. Reads as the device's error; the
    /// command line finds its kind with [`CheckError::device_error`].
    #[error(transparent)]
    Device(#[from] kruskal_device::DeviceError),
    /// A tensor could not be generated.
    #[error(transparent)]
    Format(#[from] kruskal_formats::FormatError),
    /// The f64 reference MTTKRP failed.
    #[error(transparent)]
    Cpu(#[from] kruskal_cpu::CpuError),
}

/// `Result` with [`CheckError`].
pub type Result<T, E = CheckError> = std::result::Result<T, E>;

impl CheckError {
    /// The device's error this one is, if it is one.
    pub fn device_error(&self) -> Option<&kruskal_device::DeviceError> {
        match self {
            CheckError::Device(e) => Some(e),
            _ => None,
        }
    }
}

/// Largest relative Frobenius error an f32 engine may have.
pub const TOLERANCE: f64 = 1e-5;

/// Partitions of the FLYCOO layout used for the remap and determinism
/// checks: few, so that the hot rows are split between partitions.
pub const SPLIT_KAPPA: usize = 7;

/// The environment variable naming the default data folder.
pub const DATA_ENV: &str = "KRUSKAL_TEST_DATA";

/// What to check.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// Mode counts of the generated power-law tensors (and, up to
    /// [`algorithms::APR_MAX_MODES`], of the CP-APR cases' count tensors).
    pub nmodes: Vec<usize>,
    /// Ranks of every case.
    pub ranks: Vec<usize>,
    /// Nonzeros of each generated tensor.
    pub nnz: usize,
    /// A folder of tensor files (`.tns`, `.tns.gz`, `.ktns`) to check too
    /// (see [`data_folder`] for the command's default).
    pub data: Option<PathBuf>,
    /// Also check the GPU engines and the GPU's CP-APR and AO-ADMM steps
    /// (on GPU 0).
    pub gpu: bool,
    /// Seed of the tensors and factors.
    pub seed: u64,
}

impl Default for CheckOptions {
    /// The full check: every mode count of [`CHECK_MODES`] (3 to 6) and
    /// rank of [`CHECK_RANKS`] (1 to 100), 40,000 nonzeros per tensor, CPU
    /// only, no data folder.
    fn default() -> Self {
        CheckOptions {
            nmodes: CHECK_MODES.iter().map(|&n| n as usize).collect(),
            ranks: CHECK_RANKS.iter().map(|&r| r as usize).collect(),
            nnz: 40_000,
            data: None,
            gpu: false,
            seed: 1,
        }
    }
}

impl CheckOptions {
    /// A second's worth: 3 and 4 modes, ranks 1, 16 and 32, 20,000
    /// nonzeros per tensor.
    pub fn quick() -> Self {
        CheckOptions {
            nmodes: vec![3, 4],
            ranks: vec![1, 16, 32],
            nnz: 20_000,
            ..CheckOptions::default()
        }
    }
}

/// Which property a case checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Group {
    /// Accuracy on the generated power-law tensors.
    PowerLaw,
    /// Accuracy on the data folder's tensors.
    Files,
    /// FLYCOO's copy is back in its original order after modes 0..N.
    Remap,
    /// Two sweeps give bit-identical outputs.
    Determinism,
    /// CP-APR's and AO-ADMM's steps against f64 references
    /// ([`algorithms`]).
    Algorithm,
}

impl Group {
    pub fn name(self) -> &'static str {
        match self {
            Group::PowerLaw => "power-law",
            Group::Files => "files",
            Group::Remap => "remap",
            Group::Determinism => "determinism",
            Group::Algorithm => "algorithm",
        }
    }
}

/// One checked case: an engine on a tensor at a rank and mode (or, for
/// remap cases and build failures, without a mode).
#[derive(Clone, Debug, Serialize)]
pub struct CaseResult {
    pub engine: String,
    pub group: Group,
    pub tensor: String,
    pub rank: Option<usize>,
    /// Numbered from 1, as on the command line.
    pub mode: Option<usize>,
    /// Relative error against the f64 reference (`None` when there is no
    /// result, or it holds NaN).
    pub relative_error: Option<f64>,
    /// Why the case failed; `None` when it passed.
    pub failure: Option<String>,
}

impl CaseResult {
    pub fn passed(&self) -> bool {
        self.failure.is_none()
    }
}

/// A tensor the check ran on.
#[derive(Clone, Debug, Serialize)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u32>,
    pub nnz: usize,
    /// Largest share of the nonzeros in one row of any mode.
    pub hottest_row_share: f64,
}

/// One line of the summary: an engine's cases of one group.
#[derive(Clone, Debug, Serialize)]
pub struct SummaryRow {
    pub engine: String,
    pub group: Group,
    pub tensors: usize,
    pub cases: usize,
    pub failed: usize,
    pub worst_error: Option<f64>,
    /// Some case's output held NaN (so `worst_error` is not the worst).
    pub nan: bool,
}

/// Everything a check found.
#[derive(Clone, Debug, Serialize)]
pub struct CheckReport {
    pub threads: usize,
    /// The GPU's name when the GPU engines were checked.
    pub gpu: Option<String>,
    pub tensors: Vec<TensorInfo>,
    /// Things the reader should know (e.g. no data folder).
    pub notes: Vec<String>,
    pub cases: Vec<CaseResult>,
    pub elapsed_s: f64,
}

impl CheckReport {
    pub fn passed(&self) -> bool {
        self.cases.iter().all(CaseResult::passed)
    }

    pub fn failures(&self) -> impl Iterator<Item = &CaseResult> {
        self.cases.iter().filter(|c| !c.passed())
    }

    /// One row per (engine, group): engines in the order they ran, each
    /// one's groups in the order of [`Group`].
    pub fn summary(&self) -> Vec<SummaryRow> {
        let mut rows: Vec<(SummaryRow, BTreeSet<&str>)> = Vec::new();
        for c in &self.cases {
            let k = match rows
                .iter()
                .position(|(r, _)| r.engine == c.engine && r.group == c.group)
            {
                Some(k) => k,
                None => {
                    rows.push((
                        SummaryRow {
                            engine: c.engine.clone(),
                            group: c.group,
                            tensors: 0,
                            cases: 0,
                            failed: 0,
                            worst_error: None,
                            nan: false,
                        },
                        BTreeSet::new(),
                    ));
                    rows.len() - 1
                }
            };
            let (row, tensors) = &mut rows[k];
            tensors.insert(&c.tensor);
            row.cases += 1;
            row.failed += usize::from(!c.passed());
            if let Some(e) = c.relative_error {
                row.worst_error = Some(row.worst_error.map_or(e, |w: f64| w.max(e)));
            } else if c.failure.as_deref().is_some_and(|f| f.contains("NaN")) {
                row.nan = true;
            }
        }
        let mut engines: Vec<&str> = Vec::new();
        for c in &self.cases {
            if !engines.contains(&c.engine.as_str()) {
                engines.push(&c.engine);
            }
        }
        let mut rows: Vec<SummaryRow> = rows
            .into_iter()
            .map(|(mut r, t)| {
                r.tensors = t.len();
                r
            })
            .collect();
        rows.sort_by_key(|r| (engines.iter().position(|&e| e == r.engine), r.group));
        rows
    }
}

/// Progress of a running check, for a progress bar.
pub struct Progress<'a> {
    pub done: usize,
    pub total: usize,
    pub message: &'a str,
}

/// Compares an engine's output with the f64 reference: the relative error,
/// or why the case fails (NaN left in the output, a wrong shape, an error
/// of [`TOLERANCE`] or more).
pub fn compare(out: &Array2<f32>, exact: &Array2<f64>) -> (Option<f64>, Option<String>) {
    if out.dim() != exact.dim() {
        return (
            None,
            Some(format!(
                "output is {:?}, the reference {:?}",
                out.dim(),
                exact.dim()
            )),
        );
    }
    let nan = out.iter().filter(|x| x.is_nan()).count();
    if nan > 0 {
        let rows = out
            .rows()
            .into_iter()
            .filter(|r| r.iter().any(|x| x.is_nan()))
            .count();
        return (
            None,
            Some(format!(
                "{nan} NaN entries in {rows} of {} rows (left unwritten, or computed as NaN)",
                out.nrows()
            )),
        );
    }
    let err = relative_error(out.view(), exact.view());
    if err < TOLERANCE {
        (Some(err), None)
    } else {
        (
            Some(err),
            Some(format!("relative error {err:.2e} >= {TOLERANCE:.0e}")),
        )
    }
}

/// Compares two runs bit for bit.
pub fn compare_bits(first: &Array2<f32>, second: &Array2<f32>) -> Option<String> {
    if first.dim() != second.dim() {
        return Some(format!(
            "second run's output is {:?}, the first's {:?}",
            second.dim(),
            first.dim()
        ));
    }
    let mut differ = 0usize;
    let mut largest = 0f64;
    for (&a, &b) in first.iter().zip(second) {
        if a.to_bits() != b.to_bits() {
            differ += 1;
            largest = largest.max((f64::from(a) - f64::from(b)).abs());
        }
    }
    (differ > 0).then(|| {
        format!(
            "second run differs in {differ} of {} entries (largest difference {largest:.3e})",
            first.len()
        )
    })
}

/// An engine as the check drives it.
pub trait Checked {
    /// `out = MTTKRP(mode)`; `out` arrives poisoned with NaN.
    fn run(
        &mut self,
        mode: usize,
        factors: &[Array2<f32>],
        out: &mut Array2<f32>,
    ) -> Result<(), String>;

    /// The second run of a determinism check (the CPU runs it on one
    /// thread); the same as [`Checked::run`] unless overridden.
    fn rerun(
        &mut self,
        mode: usize,
        factors: &[Array2<f32>],
        out: &mut Array2<f32>,
    ) -> Result<(), String> {
        self.run(mode, factors, out)
    }

    /// For engines that keep the tensor in the order of the mode they will
    /// compute next (FLYCOO): that mode and the tensor copy's elements.
    fn layout(&mut self) -> Option<Result<(usize, Vec<u32>), String>> {
        None
    }
}

/// An engine to check: how to build it for a tensor, and what to check.
pub struct EngineSpec {
    /// As the table shows it, e.g. `cpu flycoo` or `gpu flycoo kappa=7`.
    pub label: String,
    /// Run two sweeps and compare them bit for bit (generated tensors only).
    pub determinism: bool,
    /// Builds the engine for a tensor; an error fails the tensor's cases.
    pub build: BuildFn,
}

/// How an [`EngineSpec`] builds its engine for a tensor.
pub type BuildFn = Box<dyn Fn(&SparseTensor) -> Result<Box<dyn Checked>, String>>;

/// An engine built for one tensor, and the layout it started in.
struct Built {
    engine: Box<dyn Checked>,
    original: Option<Vec<u32>>,
}

/// A CPU engine behind [`MttkrpEngine`].
struct CheckedCpuEngine(Box<dyn MttkrpEngine>);

impl Checked for CheckedCpuEngine {
    fn run(
        &mut self,
        mode: usize,
        factors: &[Array2<f32>],
        out: &mut Array2<f32>,
    ) -> Result<(), String> {
        self.0.mttkrp(mode, factors, out).map_err(|e| e.to_string())
    }
}

/// The CPU FLYCOO engine: its layout is visible, and its second
/// determinism run uses one thread.
struct CpuFlycoo {
    engine: FlycooMttkrp,
    one_thread: Arc<rayon::ThreadPool>,
}

impl Checked for CpuFlycoo {
    fn run(
        &mut self,
        mode: usize,
        factors: &[Array2<f32>],
        out: &mut Array2<f32>,
    ) -> Result<(), String> {
        self.engine
            .mttkrp(mode, factors, out)
            .map_err(|e| e.to_string())
    }

    fn rerun(
        &mut self,
        mode: usize,
        factors: &[Array2<f32>],
        out: &mut Array2<f32>,
    ) -> Result<(), String> {
        let engine = &mut self.engine;
        self.one_thread
            .install(|| engine.mttkrp(mode, factors, out))
            .map_err(|e| e.to_string())
    }

    fn layout(&mut self) -> Option<Result<(usize, Vec<u32>), String>> {
        Some(Ok((
            self.engine.current_mode(),
            self.engine.current_elements(),
        )))
    }
}

/// A GPU engine built by [`build_engine`].
struct CheckedGpuEngine(Box<dyn GpuMttkrp>);

impl Checked for CheckedGpuEngine {
    fn run(
        &mut self,
        mode: usize,
        factors: &[Array2<f32>],
        out: &mut Array2<f32>,
    ) -> Result<(), String> {
        self.0
            .mttkrp_host(mode, factors, out)
            .map_err(|e| e.to_string())
    }
}

/// The GPU FLYCOO engine itself, for its layout.
struct GpuFlycoo(FlycooGpu);

impl Checked for GpuFlycoo {
    fn run(
        &mut self,
        mode: usize,
        factors: &[Array2<f32>],
        out: &mut Array2<f32>,
    ) -> Result<(), String> {
        self.0
            .mttkrp_host(mode, factors, out)
            .map_err(|e| e.to_string())
    }

    fn layout(&mut self) -> Option<Result<(usize, Vec<u32>), String>> {
        Some(
            self.0
                .current_elements()
                .map(|e| (self.0.current_mode(), e))
                .map_err(|e| e.to_string()),
        )
    }
}

/// An error unless some mode of a FLYCOO layout has split rows (without
/// them the remap and determinism checks would prove little).
fn require_split_rows(
    summaries: &[kruskal_partition::flycoo::LayoutSummary],
) -> Result<(), String> {
    if summaries.iter().any(|s| s.shared_pieces > 0) {
        Ok(())
    } else {
        Err(format!(
            "no row is split between the {SPLIT_KAPPA} partitions of any mode; \
             this tensor cannot show what the check is for"
        ))
    }
}

/// Every CPU engine, and CPU FLYCOO with split rows.
pub fn cpu_engines() -> Result<Vec<EngineSpec>> {
    let one_thread = Arc::new(
        rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .map_err(CheckError::Pool)?,
    );
    let mut specs: Vec<EngineSpec> = Vec::new();
    for kernel in CpuEngine::ENGINES {
        let pool = one_thread.clone();
        specs.push(EngineSpec {
            label: format!("cpu {kernel}"),
            determinism: false,
            build: Box::new(move |t| {
                Ok(if kernel == CpuEngine::Flycoo {
                    Box::new(CpuFlycoo {
                        engine: FlycooMttkrp::new(t, None).map_err(|e| e.to_string())?,
                        one_thread: pool.clone(),
                    })
                } else {
                    Box::new(CheckedCpuEngine(
                        kernel.build(t).map_err(|e| e.to_string())?,
                    ))
                })
            }),
        });
    }
    specs.push(EngineSpec {
        label: format!("cpu flycoo kappa={SPLIT_KAPPA}"),
        determinism: true,
        build: Box::new(move |t| {
            let engine = FlycooMttkrp::new(t, Some(SPLIT_KAPPA)).map_err(|e| e.to_string())?;
            require_split_rows(engine.summaries())?;
            Ok(Box::new(CpuFlycoo {
                engine,
                one_thread: one_thread.clone(),
            }))
        }),
    });
    Ok(specs)
}

/// Every GPU engine of [`GpuEngine::ENGINES`] as [`build_engine`] makes it,
/// and GPU FLYCOO with split rows summed in a fixed order.
pub fn gpu_engines(gpu: &Arc<Gpu>) -> Vec<EngineSpec> {
    let mut specs: Vec<EngineSpec> = Vec::new();
    for kernel in GpuEngine::ENGINES {
        let gpu = gpu.clone();
        specs.push(EngineSpec {
            label: format!("gpu {kernel}"),
            determinism: false,
            build: Box::new(move |t| {
                let e = build_engine(kernel, gpu.clone(), t, &GpuOptions::default())
                    .map_err(|e| e.to_string())?;
                Ok(Box::new(CheckedGpuEngine(e)))
            }),
        });
    }
    // fcoo's other kernels: fiber reuse, and the plain mapping where lane
    // teams are the default (ranks 16, 32, 64, 128).
    for (label, fiber, teams) in [("fiber=on", true, false), ("teams=off", false, false)] {
        let gpu = gpu.clone();
        let opts = GpuOptions {
            fiber: Some(fiber),
            teams: Some(teams),
            ..GpuOptions::default()
        };
        specs.push(EngineSpec {
            label: format!("gpu fcoo {label}"),
            determinism: false,
            build: Box::new(move |t| {
                let e = build_engine(GpuEngine::Fcoo, gpu.clone(), t, &opts)
                    .map_err(|e| e.to_string())?;
                Ok(Box::new(CheckedGpuEngine(e)))
            }),
        });
    }
    let gpu = gpu.clone();
    specs.push(EngineSpec {
        label: format!("gpu flycoo kappa={SPLIT_KAPPA} deterministic"),
        determinism: true,
        // Built here rather than by build_engine: the check needs the
        // concrete engine for its layout.
        build: Box::new(move |t| {
            let (f, summaries) = build_flycoo(t, &LayoutOptions::new(SPLIT_KAPPA))
                .map_err(|e| format!("building FLYCOO: {e}"))?;
            require_split_rows(&summaries)?;
            let mut engine = FlycooGpu::new(gpu.clone(), &f).map_err(|e| e.to_string())?;
            engine.set_deterministic(true);
            Ok(Box::new(GpuFlycoo(engine)))
        }),
    });
    specs
}

/// The power-law tensor of the check with `nmodes` modes: every mode's
/// Zipf exponent is above 1, so the hottest row of each mode holds about
/// 10% to 30% of the nonzeros, as in FROSTT's tensors.
pub fn power_law_tensor(nmodes: usize, nnz: usize, seed: u64) -> Result<SparseTensor> {
    const DIMS: [u32; 6] = [3_000, 1_700, 900, 400, 150, 60];
    const EXPONENTS: [f64; 6] = [1.3, 1.1, 1.5, 1.2, 1.4, 1.1];
    if !(2..=DIMS.len()).contains(&nmodes) {
        return Err(CheckError::Invalid(format!(
            "the check's tensors have 2 to {} modes, not {nmodes}",
            DIMS.len()
        )));
    }
    let mut spec = PowerLawSpec::new(DIMS[..nmodes].to_vec(), nnz).with_seed(seed ^ nmodes as u64);
    spec.exponents = EXPONENTS[..nmodes].to_vec();
    Ok(power_law(&spec)?)
}

/// The data folder `kruskal check` uses: `data` (its `--data`), else the one
/// `KRUSKAL_TEST_DATA` names, else none. A folder named either way must
/// exist. ([`run_check`] itself reads no environment.)
pub fn data_folder(data: Option<&Path>) -> Result<Option<PathBuf>> {
    let (dir, from) = match (data, std::env::var_os(DATA_ENV)) {
        (Some(d), _) => (d.to_path_buf(), "--data"),
        (None, Some(d)) if !d.is_empty() => (PathBuf::from(d), DATA_ENV),
        _ => return Ok(None),
    };
    if !dir.is_dir() {
        return Err(CheckError::Invalid(format!(
            "{} (from {from}) is not a folder",
            dir.display()
        )));
    }
    Ok(Some(dir))
}

/// The tensor files of `dir`, by name.
fn tensor_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|error| CheckError::Io {
            path: dir.to_path_buf(),
            error,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p
                .file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned());
            p.is_file()
                && [".tns", ".tns.gz", ".ktns"]
                    .iter()
                    .any(|x| name.ends_with(x))
        })
        .collect();
    files.sort();
    Ok(files)
}

/// Reads a file of the data folder, which may be 0-based or have no value
/// column: the plain FROSTT reading first, then the others (a reading whose
/// value column looks like an index counts as failed, so such a file is
/// read as a pattern); the first error if none works. Returns the tensor
/// and how it was read.
fn read_any(path: &Path) -> Result<(SparseTensor, &'static str), String> {
    let mut first_error = None;
    for (how, pattern, zero_based) in [
        ("", false, false),
        ("pattern", true, false),
        ("0-based", false, true),
        ("pattern, 0-based", true, true),
    ] {
        let opts = ReadOptions {
            pattern,
            zero_based,
            ..ReadOptions::default()
        };
        match read_tensor_report(path, &opts) {
            Ok((t, report)) if report.warnings.is_empty() => return Ok((t, how)),
            Ok((_, report)) => {
                let warnings: Vec<String> = report
                    .warnings
                    .iter()
                    .map(|w| w.message(&crate::console::flag))
                    .collect();
                first_error.get_or_insert(warnings.join("; "));
            }
            Err(e) => {
                first_error.get_or_insert(e.message(&crate::console::flag));
            }
        }
    }
    Err(first_error.unwrap_or_default())
}

fn hottest_row_share(t: &SparseTensor) -> f64 {
    let stats = t.stats();
    stats
        .modes
        .iter()
        .map(|m| m.degree_max as f64 / t.nnz().max(1) as f64)
        .fold(0.0, f64::max)
}

/// Runs `f`, turning a panic into an error: an engine under development
/// that panics (an unfinished branch, a failed assertion) is a failed case,
/// and the check goes on with the next one.
fn guarded<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Err(format!("panicked: {message}"))
    })
}

/// Factors in [-0.5, 0.5): signed, as ALS's are, so that sums cancel.
fn check_factors(dims: &[u32], rank: usize, seed: u64) -> Vec<Array2<f32>> {
    let mut fs = kruskal_cpd::random_factors(dims, rank, seed);
    for f in &mut fs {
        f.mapv_inplace(|x| x - 0.5);
    }
    fs
}

/// One tensor to check and the group its accuracy cases belong to.
struct Subject {
    name: String,
    tensor: SparseTensor,
    group: Group,
}

/// Runs the check with the CPU engines and algorithm steps and, with
/// `opts.gpu`, the GPU's. Errors only when the check cannot run at all (no
/// GPU with `gpu`, a data folder that is not one); every engine failure
/// is a failed case in the report.
pub fn run_check(
    opts: &CheckOptions,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<CheckReport> {
    let mut engines = cpu_engines()?;
    let mut steps = algorithms::cpu_steps();
    let mut gpu_name = None;
    if opts.gpu {
        let gpu = Gpu::open(0)?;
        gpu_name = Some(gpu.properties().name.clone());
        engines.extend(gpu_engines(&gpu));
        steps.extend(algorithms::gpu_steps(&gpu));
    }
    let mut total = 0;
    let mut report = run_with_engines(opts, &engines, &mut |p| {
        total = p.total;
        progress(p)
    })?;
    let start = Instant::now();
    progress(Progress {
        done: total,
        total,
        message: "CP-APR and AO-ADMM steps",
    });
    let (tensors, cases) = algorithms::run_algorithms(opts, &steps)?;
    report.tensors.extend(tensors);
    report.cases.extend(cases);
    report.elapsed_s += start.elapsed().as_secs_f64();
    report.gpu = gpu_name;
    Ok(report)
}

/// [`run_check`] with a given list of engines (tests add broken ones).
pub fn run_with_engines(
    opts: &CheckOptions,
    engines: &[EngineSpec],
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<CheckReport> {
    let start = Instant::now();
    if opts.ranks.contains(&0) {
        return Err(CheckError::Invalid("ranks must be at least 1".into()));
    }
    let mut notes = Vec::new();
    let mut cases = Vec::new();
    let mut subjects = Vec::new();
    for &n in &opts.nmodes {
        subjects.push(Subject {
            name: format!("power-law {n} modes"),
            tensor: power_law_tensor(n, opts.nnz, opts.seed)?,
            group: Group::PowerLaw,
        });
    }
    match &opts.data {
        None => notes.push(format!(
            "real tensors skipped: give --data DIR (or set {DATA_ENV}=DIR) with .tns, \
             .tns.gz or .ktns files to check them too"
        )),
        Some(dir) => {
            if !dir.is_dir() {
                return Err(CheckError::Invalid(format!(
                    "{} is not a folder",
                    dir.display()
                )));
            }
            let files = tensor_files(dir)?;
            if files.is_empty() {
                notes.push(format!(
                    "{} holds no .tns, .tns.gz or .ktns files",
                    dir.display()
                ));
            }
            for path in files {
                let name = path.file_name().map_or_else(
                    || path.display().to_string(),
                    |n| n.to_string_lossy().into_owned(),
                );
                match read_any(&path) {
                    Ok((tensor, how)) => subjects.push(Subject {
                        name: if how.is_empty() {
                            name
                        } else {
                            format!("{name} ({how})")
                        },
                        tensor,
                        group: Group::Files,
                    }),
                    Err(e) => cases.push(CaseResult {
                        engine: "reader".into(),
                        group: Group::Files,
                        tensor: name,
                        rank: None,
                        mode: None,
                        relative_error: None,
                        failure: Some(e),
                    }),
                }
            }
        }
    }

    let runs_for = |s: &Subject| {
        engines
            .iter()
            .filter(|e| s.group == Group::PowerLaw || !e.determinism)
            .count()
    };
    let total: usize = subjects
        .iter()
        .map(|s| runs_for(s) * opts.ranks.len())
        .sum();
    let mut done = 0;
    let mut tensors = Vec::new();
    for s in &subjects {
        let t = &s.tensor;
        let n = t.nmodes();
        tensors.push(TensorInfo {
            name: s.name.clone(),
            dims: t.dims().to_vec(),
            nnz: t.nnz(),
            hottest_row_share: hottest_row_share(t),
        });
        let specs: Vec<&EngineSpec> = engines
            .iter()
            .filter(|e| s.group == Group::PowerLaw || !e.determinism)
            .collect();
        let case = |engine: &EngineSpec, group, rank, mode: Option<usize>| CaseResult {
            engine: engine.label.clone(),
            group,
            tensor: s.name.clone(),
            rank,
            mode: mode.map(|m| m + 1),
            relative_error: None,
            failure: None,
        };
        // Build every engine once per tensor; keep the layout it starts in.
        let mut built: Vec<Option<Built>> = Vec::new();
        for spec in &specs {
            progress(Progress {
                done,
                total,
                message: &format!("{}: building {}", s.name, spec.label),
            });
            let b = guarded(|| {
                let mut engine = (spec.build)(t)?;
                let original = engine.layout().transpose()?.map(|(_, elements)| elements);
                Ok(Built { engine, original })
            });
            match b {
                Ok(b) => built.push(Some(b)),
                Err(e) => {
                    cases.push(CaseResult {
                        failure: Some(format!("building the engine: {e}")),
                        ..case(spec, s.group, None, None)
                    });
                    built.push(None);
                }
            }
        }
        for &rank in &opts.ranks {
            let factors = check_factors(t.dims(), rank, opts.seed.wrapping_add(rank as u64));
            let views: Vec<_> = factors.iter().map(|f| f.view()).collect();
            let exact = (0..n)
                .into_par_iter()
                .map(|m| mttkrp_reference(t, &views, m))
                .collect::<Result<Vec<_>, _>>()?;
            let poisoned =
                |m: usize| Array2::<f32>::from_elem((t.dims()[m] as usize, rank), f32::NAN);
            for (spec, b) in specs.iter().zip(&mut built) {
                progress(Progress {
                    done,
                    total,
                    message: &format!("{}: rank {rank}, {}", s.name, spec.label),
                });
                done += 1;
                let Some(Built { engine, original }) = b else {
                    continue;
                };
                // One sweep in mode order, as CPD-ALS runs it.
                let mut outs = Vec::with_capacity(n);
                let mut sweep_ok = true;
                for (m, exact_m) in exact.iter().enumerate() {
                    let mut out = poisoned(m);
                    let mut c = case(spec, s.group, Some(rank), Some(m));
                    match guarded(|| engine.run(m, &factors, &mut out)) {
                        Ok(()) => (c.relative_error, c.failure) = compare(&out, exact_m),
                        Err(e) => {
                            c.failure = Some(e);
                            sweep_ok = false;
                        }
                    }
                    cases.push(c);
                    outs.push(out);
                }
                if let (Some(original), true) = (original.as_ref(), sweep_ok) {
                    let mut c = case(spec, Group::Remap, Some(rank), None);
                    c.failure =
                        match guarded(|| Ok(engine.layout())).unwrap_or_else(|e| Some(Err(e))) {
                            Some(Ok((0, elements))) if &elements == original => None,
                            Some(Ok((0, _))) => Some(format!(
                                "after modes 1..{n} the tensor copy is not in its original order"
                            )),
                            Some(Ok((at, _))) => Some(format!(
                                "after modes 1..{n} the tensor copy is laid out for mode {}, not 1",
                                at + 1
                            )),
                            Some(Err(e)) => Some(e),
                            None => Some("the engine no longer reports its layout".into()),
                        };
                    cases.push(c);
                }
                if spec.determinism && sweep_ok {
                    for (m, first) in outs.iter().enumerate() {
                        let mut out = poisoned(m);
                        let mut c = case(spec, Group::Determinism, Some(rank), Some(m));
                        match guarded(|| engine.rerun(m, &factors, &mut out)) {
                            Ok(()) => {
                                (c.relative_error, c.failure) = compare(&out, &exact[m]);
                                if c.failure.is_none() {
                                    c.failure = compare_bits(first, &out);
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
    progress(Progress {
        done,
        total,
        message: "done",
    });
    Ok(CheckReport {
        threads: rayon::current_num_threads(),
        gpu: None,
        tensors,
        notes,
        cases,
        elapsed_s: start.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn comparison_catches_unwritten_rows_and_wrong_values() {
        let exact = Array2::from_shape_fn((4, 3), |(i, j)| (i * 3 + j) as f64 + 1.0);
        let good = exact.mapv(|x| x as f32);
        let (err, failure) = compare(&good, &exact);
        assert_eq!(failure, None);
        assert!(err.unwrap() < 1e-7);
        // A row left as the poison.
        let mut unwritten = good.clone();
        unwritten.row_mut(2).fill(f32::NAN);
        let (err, failure) = compare(&unwritten, &exact);
        assert_eq!(err, None);
        assert!(failure.unwrap().contains("NaN entries in 1 of 4 rows"));
        // Off by a little more than the tolerance allows.
        let off = good.mapv(|x| x * (1.0 + 3e-5));
        let (err, failure) = compare(&off, &exact);
        assert!(err.unwrap() > TOLERANCE);
        assert!(failure.unwrap().contains("relative error"));
        let (_, failure) = compare(&Array2::zeros((3, 3)), &exact);
        assert!(failure.unwrap().contains("output is"));
        // Bitwise: the smallest change shows.
        let mut nudged = good.clone();
        nudged[[1, 1]] = f32::from_bits(good[[1, 1]].to_bits() + 1);
        assert_eq!(compare_bits(&good, &good.clone()), None);
        assert!(compare_bits(&good, &nudged).unwrap().contains("1 of 12"));
    }

    #[test]
    fn generated_tensors_have_hot_rows() {
        for n in CHECK_MODES.map(|n| n as usize) {
            let t = power_law_tensor(n, 20_000, 1).unwrap();
            assert_eq!(t.nmodes(), n);
            let share = hottest_row_share(&t);
            assert!(share >= 0.1, "{n} modes: hottest row {share}");
        }
        assert!(power_law_tensor(7, 100, 1).is_err());
    }

    #[test]
    fn cpu_engines_pass_on_small_cases() {
        let report = run_check(&small(), &mut |_| {}).unwrap();
        let failures: Vec<_> = report.failures().collect();
        assert!(failures.is_empty(), "{failures:#?}");
        let rows = report.summary();
        let has = |engine: &str, group| rows.iter().any(|r| r.engine == engine && r.group == group);
        for k in CpuEngine::ENGINES {
            assert!(has(&format!("cpu {k}"), Group::PowerLaw), "{rows:#?}");
        }
        assert!(has("cpu flycoo", Group::Remap));
        // The CPU's CP-APR and AO-ADMM steps (their cases are counted in
        // `algorithms`' tests).
        for step in [
            "cp-apr phi (cpu)",
            "ao-admm prox (cpu)",
            "ao-admm inner (cpu)",
        ] {
            assert!(has(step, Group::Algorithm), "{rows:#?}");
        }
        assert!(!rows.iter().any(|r| r.engine.ends_with("(gpu)")));
        let det = format!("cpu flycoo kappa={SPLIT_KAPPA}");
        assert!(has(&det, Group::Determinism) && has(&det, Group::Remap));
        // Every engine, rank and mode: 3 + 4 modes, 2 ranks, the CPU
        // engines and FLYCOO with split rows.
        let accuracy = report
            .cases
            .iter()
            .filter(|c| c.group == Group::PowerLaw)
            .count();
        assert_eq!(accuracy, 7 * 2 * (CpuEngine::ENGINES.len() + 1));
        assert!(report.notes.iter().any(|n| n.contains("--data")));
    }

    /// Engines that are wrong in the ways the check must notice.
    fn broken_engines() -> Vec<EngineSpec> {
        struct SkipsRow(Box<dyn MttkrpEngine>);
        impl Checked for SkipsRow {
            fn run(
                &mut self,
                mode: usize,
                f: &[Array2<f32>],
                out: &mut Array2<f32>,
            ) -> Result<(), String> {
                // Computes into a scratch matrix and copies all rows but
                // the first: row 0 keeps the poison.
                let mut scratch = Array2::zeros(out.dim());
                self.0
                    .mttkrp(mode, f, &mut scratch)
                    .map_err(|e| e.to_string())?;
                for i in 1..out.nrows() {
                    out.row_mut(i).assign(&scratch.row(i));
                }
                Ok(())
            }
        }
        struct Panics;
        impl Checked for Panics {
            fn run(
                &mut self,
                _: usize,
                _: &[Array2<f32>],
                _: &mut Array2<f32>,
            ) -> Result<(), String> {
                todo!("this engine")
            }
        }
        struct Noisy(Box<dyn MttkrpEngine>);
        impl Checked for Noisy {
            fn run(
                &mut self,
                mode: usize,
                f: &[Array2<f32>],
                out: &mut Array2<f32>,
            ) -> Result<(), String> {
                self.0.mttkrp(mode, f, out).map_err(|e| e.to_string())
            }
            // Accurate to 1e-6, but not the same bits as the first run.
            fn rerun(
                &mut self,
                mode: usize,
                f: &[Array2<f32>],
                out: &mut Array2<f32>,
            ) -> Result<(), String> {
                self.run(mode, f, out)?;
                out.mapv_inplace(|x| x * (1.0 + 1e-6));
                Ok(())
            }
        }
        vec![
            EngineSpec {
                label: "skips a row".into(),
                determinism: false,
                build: Box::new(|t| {
                    Ok(Box::new(SkipsRow(
                        CpuEngine::Sorted.build(t).map_err(|e| e.to_string())?,
                    )))
                }),
            },
            EngineSpec {
                label: "not deterministic".into(),
                determinism: true,
                build: Box::new(|t| {
                    Ok(Box::new(Noisy(
                        CpuEngine::Sorted.build(t).map_err(|e| e.to_string())?,
                    )))
                }),
            },
            EngineSpec {
                label: "panics".into(),
                determinism: false,
                build: Box::new(|_| Ok(Box::new(Panics))),
            },
            EngineSpec {
                label: "cannot build".into(),
                determinism: false,
                build: Box::new(|_| Err("the engine is not built yet".into())),
            },
        ]
    }

    #[test]
    fn broken_engines_fail_and_the_check_goes_on() {
        let mut engines = broken_engines();
        engines.extend(cpu_engines().unwrap());
        let report = run_with_engines(&small(), &engines, &mut |_| {}).unwrap();
        assert!(!report.passed());
        let rows = report.summary();
        let row = |engine: &str, group| {
            rows.iter()
                .find(|r| r.engine == engine && r.group == group)
                .unwrap_or_else(|| panic!("no row {engine} {group:?}: {rows:#?}"))
        };
        let skips = row("skips a row", Group::PowerLaw);
        assert_eq!((skips.failed, skips.cases), (14, 14));
        assert!(skips.nan);
        let noisy = row("not deterministic", Group::Determinism);
        assert_eq!(noisy.failed, noisy.cases);
        assert_eq!(row("not deterministic", Group::PowerLaw).failed, 0);
        // A build failure is one failed case per tensor, with its message.
        let cannot = row("cannot build", Group::PowerLaw);
        assert_eq!((cannot.failed, cannot.cases), (2, 2));
        assert!(
            report.failures().any(|c| c.failure.as_deref()
                == Some("building the engine: the engine is not built yet"))
        );
        let panics = row("panics", Group::PowerLaw);
        assert_eq!((panics.failed, panics.cases), (14, 14));
        assert!(
            report
                .failures()
                .any(|c| c.failure.as_deref() == Some("panicked: not yet implemented: this engine"))
        );
        // The real engines after them still ran and passed.
        assert_eq!(row("cpu hicoo", Group::PowerLaw).failed, 0);
        assert_eq!(row("cpu hicoo", Group::PowerLaw).cases, 14);
    }

    #[test]
    fn data_folder_tensors_are_read_whatever_their_flavour() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("plain.tns"), "1 1 1 2.0\n2 3 1 1.5\n").unwrap();
        std::fs::write(dir.path().join("zero.tns"), "0 0 1 2.0\n1 2 0 1.5\n").unwrap();
        // No value column: the last index column is refused as values.
        let facts: String = (0..1000u32)
            .map(|i| format!("{} {} {}\n", i % 13 + 1, i % 17 + 1, (i * 7919) % 997 + 2))
            .collect();
        std::fs::write(dir.path().join("facts.tns"), facts).unwrap();
        std::fs::write(dir.path().join("broken.tns"), "1 x 1 2.0\n").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not a tensor").unwrap();
        let opts = CheckOptions {
            nmodes: vec![],
            ranks: vec![2],
            data: Some(dir.path().to_path_buf()),
            ..small()
        };
        let report = run_check(&opts, &mut |_| {}).unwrap();
        let names: Vec<&str> = report.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            ["facts.tns (pattern)", "plain.tns", "zero.tns (0-based)"]
        );
        let failures: Vec<_> = report.failures().collect();
        assert_eq!(failures.len(), 1, "{failures:#?}");
        assert_eq!(
            (failures[0].engine.as_str(), failures[0].tensor.as_str()),
            ("reader", "broken.tns")
        );
        assert!(report.notes.is_empty());
        let missing = CheckOptions {
            data: Some(dir.path().join("nope")),
            ..opts
        };
        assert!(
            run_check(&missing, &mut |_| {})
                .unwrap_err()
                .to_string()
                .contains("not a folder")
        );
    }

    /// The repository's test tensors (`data/`, or the folder
    /// KRUSKAL_TEST_DATA names); missing, they fail the test.
    #[test]
    fn repository_data_tensors_pass() {
        let dir = std::env::var_os(DATA_ENV).map_or_else(
            || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data"),
            PathBuf::from,
        );
        assert!(
            dir.is_dir(),
            "{} not found: the repository's test tensors are missing",
            dir.display()
        );
        let opts = CheckOptions {
            nmodes: vec![],
            ranks: vec![7],
            data: Some(dir),
            ..small()
        };
        let report = run_check(&opts, &mut |_| {}).unwrap();
        let failures: Vec<_> = report.failures().collect();
        assert!(failures.is_empty(), "{failures:#?}");
        assert!(report.tensors.len() >= 10);
    }
}
