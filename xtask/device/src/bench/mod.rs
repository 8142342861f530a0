//! `cargo xtask bench`: the evaluation matrix, measured by the library
//! itself, with a report anyone can regenerate.
//!
//! The matrix is a TOML file (`bench/*.toml`, see [`matrix`]). Every
//! measurement runs the code of `kruskal mttkrp`, `kruskal cpd`
//! (`kruskal::measure::{mttkrp, cpd}`; ALS, or AO-ADMM with constraint
//! flags) and `kruskal cp-apr` (`kruskal::measure::cp_apr`) in this
//! process, so the release `xtask` and `xtask-device` binaries can be
//! carried to a GPU machine without a Rust toolchain (`cargo xtask bundle`
//! copies them) and run there (`gpu-run/xtask bench ...`). Each tensor is
//! loaded or generated once and serves every entry that names it. The
//! PyTorch baseline (`benches/torch_mttkrp.py`) runs on the tensors of GPU
//! MTTKRP entries when `python3` can import torch and sees a GPU.
//!
//! Output in `--out DIR`: `results.json` (every measurement with the
//! machine, GPU, driver, commit and date; rewritten after each one, so an
//! interrupted run keeps what it measured), `report.md` and SVG plots
//! ([`report`], [`plot`]). `cargo xtask bench report` rebuilds the report
//! from one or more results files (a single-GPU and a multi-GPU machine,
//! say) and can replace the generated block of `docs/performance.md`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use serde::{Deserialize, Serialize};
use serde_json::Value;

mod flags;
pub mod matrix;
pub mod plot;
pub mod report;

use kruskal::input::{Loaded, TensorSource};
use kruskal::measure::{
    CpdReport, CpdRunOptions, KernelReport, MttkrpBackend, MttkrpOptions, median,
};
use matrix::{BenchTensor, Matrix, Reference};

/// `cargo xtask bench`: run a matrix, or (`bench report`) rebuild the
/// report from results files.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    report: Option<ReportCmd>,
    /// The evaluation matrix.
    #[arg(long, default_value = "bench/gpu.toml")]
    matrix: PathBuf,
    /// Where results.json, report.md and the plots go.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Measure only these tensors (names from the matrix).
    #[arg(long, value_name = "TENSOR")]
    only: Vec<String>,
    /// Look for FROSTT .ktns files here (default: the matrix's data_dir).
    #[arg(long, value_name = "DIR")]
    data: Option<PathBuf>,
    /// Skip the PyTorch baseline.
    #[arg(long)]
    no_torch: bool,
    /// The Python interpreter for the PyTorch baseline.
    #[arg(long, default_value = "python3")]
    python: String,
    /// The PyTorch baseline script.
    #[arg(long, default_value = "benches/torch_mttkrp.py")]
    torch_script: PathBuf,
    /// Where generated tensors are written for the PyTorch baseline
    /// (default: the system's temporary folder); removed afterwards.
    #[arg(long, value_name = "DIR")]
    scratch: Option<PathBuf>,
    /// Keep the measurements already in OUT/results.json and add to them
    /// (to run a long matrix in several calls, with --only).
    #[arg(long)]
    append: bool,
    /// Finish with success when a baseline comparison could not be made
    /// (PyTorch missing or failing): each is reported as skipped. Without
    /// it such a run fails at its end, so no comparison goes missing
    /// unnoticed (--no-torch leaves PyTorch out on purpose).
    #[arg(long)]
    keep_going: bool,
}

#[derive(Subcommand, Debug)]
enum ReportCmd {
    /// Rebuild report.md and the plots from results files.
    Report {
        /// results.json files of bench runs.
        #[arg(required = true)]
        results: Vec<PathBuf>,
        /// Where report.md and the plots go.
        #[arg(long)]
        out: PathBuf,
        /// Replace the block between `<!-- bench:begin -->` and
        /// `<!-- bench:end -->` in this file with the report.
        #[arg(long, requires = "image_dir")]
        doc: Option<PathBuf>,
        /// How --doc's file reaches OUT (for the plots' links), e.g.
        /// `bench` for docs/performance.md and --out docs/bench.
        #[arg(long)]
        image_dir: Option<String>,
    },
}

/// The machine a measurement ran on.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    pub host: String,
    pub cpu: String,
    pub cores: usize,
    pub memory_gib: f64,
    /// Name of GPU 0, if any.
    pub gpu: Option<String>,
    pub gpus: usize,
    /// NVIDIA kernel driver version (e.g. 580.95.05).
    pub driver: Option<String>,
    /// CUDA version the driver supports (e.g. 13.0).
    pub cuda: Option<String>,
}

/// One measured configuration.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Measurement {
    /// `mttkrp`, `torch`, `cpd` or `cp_apr`.
    pub kind: String,
    /// The matrix's tensor name.
    pub tensor: String,
    /// Where the tensor came from (file, or generated like NAME).
    pub source: String,
    pub dims: Vec<u32>,
    pub nnz: usize,
    /// `cpu`, `gpu`, `gpus` (a group) or `torch`.
    pub backend: String,
    /// What the matrix asked for (`auto`, `fcoo`, `pytorch`, `shard`),
    /// with the entry's tag.
    pub label: String,
    /// The engine that ran (what `auto` chose).
    pub engine: String,
    pub rank: usize,
    /// GPUs used (0 on the CPU).
    pub gpus: usize,
    pub exchange: Option<String>,
    /// MTTKRP: median ms per mode. CPD: MTTKRP ms per mode and
    /// iteration (median over the iterations after the first).
    pub mode_ms: Vec<f64>,
    /// MTTKRP: all modes, ms. CPD: ms per iteration. CP-APR: ms per
    /// outer iteration (median over the iterations after the first).
    pub total_ms: f64,
    /// The bandwidth floor of all modes (GPU MTTKRP), ms.
    pub floor_ms: Option<f64>,
    /// Largest relative error against the f64 reference (when verified).
    pub max_relative_error: Option<f64>,
    /// CPD: the final fit.
    pub fit: Option<f64>,
    /// CPD: `als` or `ao-admm` (absent from results written before
    /// AO-ADMM rows existed: those are ALS).
    #[serde(default)]
    pub method: Option<String>,
    /// CP-APR: the final log-likelihood.
    #[serde(default)]
    pub log_likelihood: Option<f64>,
    pub machine: Machine,
    pub commit: String,
    /// UTC, RFC 3339.
    pub date: String,
    /// The full `--json` report it came from.
    pub report: Value,
}

/// A configuration the run could not measure, and why.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Skipped {
    pub what: String,
    pub why: String,
    pub machine: String,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Results {
    pub measurements: Vec<Measurement>,
    #[serde(default)]
    pub skipped: Vec<Skipped>,
    /// The matrix's figures measured elsewhere, one of each (absent from
    /// files written before they existed).
    #[serde(default)]
    pub references: Vec<Reference>,
}

impl Results {
    pub fn load(path: &Path) -> Result<Results> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// Adds figures measured elsewhere, one per tool, tensor and rank: a
    /// later copy (the matrix of a later run) replaces an earlier one in
    /// its place.
    fn add_references(&mut self, refs: impl IntoIterator<Item = Reference>) {
        for r in refs {
            let same = |o: &Reference| o.tool == r.tool && o.tensor == r.tensor && o.rank == r.rank;
            match self.references.iter_mut().find(|o| same(o)) {
                Some(o) => *o = r,
                None => self.references.push(r),
            }
        }
    }

    /// Writes through a temporary file, so the file is always whole.
    fn save(&self, path: &Path) -> Result<()> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
        serde_json::to_writer_pretty(&mut tmp, self)?;
        tmp.persist(path)
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }
}

pub fn bench(cli: BenchArgs) -> Result<()> {
    if let Some(ReportCmd::Report {
        results,
        out,
        doc,
        image_dir,
    }) = &cli.report
    {
        let mut all = Results::default();
        for p in results {
            let r = Results::load(p)?;
            all.measurements.extend(r.measurements);
            all.skipped.extend(r.skipped);
            all.add_references(r.references);
        }
        std::fs::create_dir_all(out)?;
        let md = report::write(&all, out)?;
        if let (Some(doc), Some(dir)) = (doc, image_dir) {
            report::splice_into(doc, &report::with_image_dir(&md, dir))?;
            println!("updated {}", doc.display());
        }
        println!("wrote {}/report.md and its plots", out.display());
        return Ok(());
    }
    run_matrix(&cli)
}

/// What every measurement of this run shares.
struct Run {
    machine: Machine,
    commit: String,
    out: PathBuf,
    results: Results,
    /// Relative errors over 1e-5, to fail the run at its end.
    bad: Vec<String>,
    /// Baseline comparisons that could not be made, to fail the run at
    /// its end unless `--keep-going`.
    missed: Vec<String>,
}

impl Run {
    fn push(&mut self, m: Measurement) -> Result<()> {
        if let Some(e) = m
            .max_relative_error
            .filter(|&e| e > 1e-5 && m.kind != "torch")
        {
            self.bad.push(format!(
                "{} {} rank {}: relative error {e:.2e}",
                m.tensor, m.label, m.rank
            ));
        }
        println!("{}", summary_line(&m));
        self.results.measurements.push(m);
        self.results.save(&self.out.join("results.json"))
    }

    fn skip(&mut self, what: String, why: String) -> Result<()> {
        println!("skipped  {what}: {why}");
        self.results.skipped.push(Skipped {
            what,
            why,
            machine: self.machine.host.clone(),
        });
        self.results.save(&self.out.join("results.json"))
    }

    /// [`Run::skip`] for a baseline comparison that was asked for.
    fn miss(&mut self, what: String, why: String) -> Result<()> {
        self.missed.push(format!("{what}: {why}"));
        self.skip(what, why)
    }
}

fn summary_line(m: &Measurement) -> String {
    let what = match m.kind.as_str() {
        "cpd" => format!("{:.3} ms/iteration", m.total_ms),
        "cp_apr" => format!("{:.3} ms/outer iteration", m.total_ms),
        _ => format!("{:.3} ms all modes", m.total_ms),
    };
    format!(
        "measured {:<8} {:<16} {:<22} rank {:<3} gpus {} {:<5} {what}",
        m.kind,
        m.tensor,
        m.label,
        m.rank,
        m.gpus,
        m.exchange.as_deref().unwrap_or("")
    )
}

fn run_matrix(cli: &BenchArgs) -> Result<()> {
    let matrix = Matrix::load(&cli.matrix)?;
    for name in &cli.only {
        if matrix.tensor(name).is_none() {
            bail!(
                "--only {name}: {} defines no such tensor",
                cli.matrix.display()
            );
        }
    }
    // The tensors this run measures: those selected that an entry uses.
    let selected: Vec<&BenchTensor> = matrix
        .tensors
        .iter()
        .filter(|t| cli.only.is_empty() || cli.only.contains(&t.name))
        .filter(|t| {
            let uses = |list: &[String]| list.contains(&t.name);
            matrix.mttkrp.iter().any(|e| uses(&e.tensors))
                || matrix.cpd.iter().any(|e| uses(&e.tensors))
                || matrix.cp_apr.iter().any(|e| uses(&e.tensors))
        })
        .collect();
    // A tensor file that is not there stops the run before anything is
    // measured, rather than after an hour of the tensors before it.
    for spec in &selected {
        spec.check_file(Path::new("."))?;
    }
    std::fs::create_dir_all(&cli.out).with_context(|| format!("creating {}", cli.out.display()))?;
    let results_path = cli.out.join("results.json");
    let mut results = if cli.append && results_path.exists() {
        Results::load(&results_path)?
    } else {
        Results::default()
    };
    // The figures measured elsewhere on this run's tensors go with its
    // results, for the report.
    results.add_references(
        matrix
            .references
            .iter()
            .filter(|r| selected.iter().any(|t| t.name == r.tensor))
            .cloned(),
    );
    let machine = machine();
    println!(
        "machine  {} ({}, {} cores, {:.0} GiB){}",
        machine.host,
        machine.cpu,
        machine.cores,
        machine.memory_gib,
        match &machine.gpu {
            Some(g) => format!(
                "; {} x {g}, driver {}",
                machine.gpus,
                machine.driver.as_deref().unwrap_or("?")
            ),
            None => "; no GPU".into(),
        }
    );
    let mut cx = Run {
        commit: commit(),
        machine,
        out: cli.out.clone(),
        results,
        bad: Vec::new(),
        missed: Vec::new(),
    };
    let data_dir = cli
        .data
        .clone()
        .unwrap_or_else(|| PathBuf::from(&matrix.settings.data_dir));
    let mut torch = if cli.no_torch || !matrix.settings.torch {
        Torch::Disabled
    } else {
        Torch::Unknown
    };
    for spec in selected {
        let uses = |list: &[String]| list.contains(&spec.name);
        let mttkrp: Vec<_> = matrix.mttkrp.iter().filter(|e| uses(&e.tensors)).collect();
        let cpd: Vec<_> = matrix.cpd.iter().filter(|e| uses(&e.tensors)).collect();
        let cp_apr: Vec<_> = matrix.cp_apr.iter().filter(|e| uses(&e.tensors)).collect();
        let source = spec.source(&data_dir)?;
        let mut loaded = source
            .load()
            .with_context(|| format!("tensor '{}'", spec.name))?;
        if spec.counts && matches!(source, TensorSource::Like { .. }) {
            loaded.tensor = matrix::as_counts(loaded.tensor)
                .with_context(|| format!("tensor '{}' as counts", spec.name))?;
            loaded.source = format!("{}, values as counts", loaded.source);
        }
        println!(
            "tensor   {}: {} ({} nonzeros, ready in {:.1} s)",
            spec.name,
            loaded.source,
            loaded.tensor.nnz(),
            loaded.load_s
        );
        let mut torch_file = TorchFile::new(spec, &source, cli.scratch.as_deref());
        // PyTorch runs once per rank, whichever entries ask for it.
        let mut torch_ranks = Vec::new();
        for e in &mttkrp {
            if e.backend == "gpu" && cx.machine.gpus == 0 {
                cx.skip(
                    format!("{} GPU MTTKRP", spec.name),
                    "no CUDA GPU on this machine".into(),
                )?;
                continue;
            }
            for &rank in &e.ranks {
                for engine in &e.engines {
                    let mut opts = MttkrpOptions {
                        rank,
                        repeat: matrix.settings.repeat,
                        backend: match e.backend.as_str() {
                            "gpu" => MttkrpBackend::Gpu,
                            _ => MttkrpBackend::Cpu,
                        },
                        kernel: engine.parse()?,
                        verify: spec.verify,
                        ..MttkrpOptions::default()
                    };
                    flags::mttkrp(&e.flags, &mut opts)?;
                    let reports = kruskal::measure::mttkrp(&opts, &loaded)
                        .with_context(|| format!("{} mttkrp --kernel {engine}", spec.name))?;
                    for r in reports {
                        let r = serde_json::to_value(&r)?;
                        let m = cx.mttkrp_measurement(spec, &e.backend, engine, &e.tag, r)?;
                        cx.push(m)?;
                    }
                }
                if e.backend == "gpu" && !torch_ranks.contains(&rank) {
                    torch_ranks.push(rank);
                    torch_baseline(
                        &mut cx,
                        &mut torch,
                        &mut torch_file,
                        &loaded,
                        spec,
                        rank,
                        matrix.settings.repeat,
                        cli,
                    )?;
                }
            }
        }
        torch_file.remove();
        for e in &cpd {
            for &rank in &e.ranks {
                let mut runs: Vec<(usize, Option<&str>)> = Vec::new();
                if e.backend == "gpus" {
                    for &g in &e.gpus {
                        if g == 1 || e.exchange.is_empty() {
                            runs.push((g, None));
                        } else {
                            runs.extend(e.exchange.iter().map(|x| (g, Some(x.as_str()))));
                        }
                    }
                } else {
                    runs.push((usize::from(e.backend == "gpu"), None));
                }
                for (g, exchange) in runs {
                    let what = format!(
                        "{} cpd rank {rank} on {}",
                        spec.name,
                        match (e.backend.as_str(), exchange) {
                            ("cpu", _) => "the CPU".to_string(),
                            (_, Some(x)) => format!("{g} GPUs ({x})"),
                            _ => format!("{g} GPU"),
                        }
                    );
                    if e.backend != "cpu" && g > cx.machine.gpus {
                        let why = format!("needs {g} GPU(s); this machine has {}", cx.machine.gpus);
                        cx.skip(what, why)?;
                        continue;
                    }
                    let mut opts = CpdRunOptions::default();
                    let d = &mut opts.decompose;
                    d.cpd.rank = rank;
                    d.cpd.max_iters = e.iters;
                    d.cpd.tol = 0.0;
                    match e.backend.as_str() {
                        "gpus" => {
                            d.gpus = Some(
                                kruskal::cpd::decompose::first_gpus(g)
                                    .with_context(|| what.clone())?,
                            );
                            d.group.exchange = exchange.map(exchange_named);
                        }
                        "gpu" => d.backend = kruskal::cpd::BackendChoice::Gpu,
                        _ => d.backend = kruskal::cpd::BackendChoice::Cpu,
                    }
                    flags::cpd(&e.flags, &mut opts)?;
                    let method = match &opts.decompose.cpd.constraints {
                        Some(_) => "ao-admm",
                        None => "als",
                    };
                    let tag = e.tag.clone().or_else(|| flags::cpd_tag(&opts));
                    let constraints = opts
                        .decompose
                        .cpd
                        .constraints
                        .as_ref()
                        .map(|c| c.describe());
                    let r = kruskal::measure::cpd(&opts, &loaded).with_context(|| what.clone())?;
                    let mut m = cx.cpd_measurement(spec, &e.backend, &tag, g, exchange, r)?;
                    // What `kruskal cpd --json` adds to the report.
                    m.method = Some(method.into());
                    m.report["method"] = method.into();
                    m.report["constraints"] = constraints.into();
                    cx.push(m)?;
                }
            }
        }
        for e in &cp_apr {
            // One GPU or the CPU once; a group once per size.
            let sizes: Vec<Option<usize>> = if e.backend == "gpus" {
                e.gpus.iter().map(|&g| Some(g)).collect()
            } else {
                vec![None]
            };
            for &rank in &e.ranks {
                for &group in &sizes {
                    let what = format!(
                        "{} cp-apr rank {rank} on {}",
                        spec.name,
                        match (group, e.backend.as_str()) {
                            (Some(g), _) => format!("{g} GPU(s)"),
                            (None, "gpu") => "1 GPU".into(),
                            _ => "the CPU".into(),
                        }
                    );
                    let needs = group.unwrap_or(usize::from(e.backend == "gpu"));
                    if needs > cx.machine.gpus {
                        let why =
                            format!("needs {needs} GPU(s); this machine has {}", cx.machine.gpus);
                        cx.skip(what, why)?;
                        continue;
                    }
                    let mut opts = kruskal::measure::CpAprRunOptions {
                        apr: kruskal::cpd::AprOptions::new(rank),
                        backend: match e.backend.as_str() {
                            "cpu" => kruskal::cpd::BackendChoice::Cpu,
                            _ => kruskal::cpd::BackendChoice::Gpu,
                        },
                        gpus: group.map(|g| ((0..g).collect(), None)),
                    };
                    opts.apr.max_iters = e.iters;
                    flags::cp_apr(&e.flags, &mut opts.apr)?;
                    let report = kruskal::measure::cp_apr(&opts, &loaded)
                        .map_err(anyhow::Error::from)
                        .and_then(|r| cp_apr_report(&r))
                        .with_context(|| what.clone())?;
                    let m = cx
                        .cp_apr_measurement(spec, &e.backend, &e.tag, report)
                        .with_context(|| what.clone())?;
                    cx.push(m)?;
                }
            }
        }
    }
    let md = report::write(&cx.results, &cli.out)?;
    println!();
    print!("{}", report::terminal_summary(&cx.results));
    println!(
        "wrote report.md ({} lines), results.json and the plots into {}",
        md.lines().count(),
        cli.out.display()
    );
    verdict(&cx.bad, &cx.missed, cli.keep_going)
}

/// A run's end: an error when a measurement was wrong, or when a baseline
/// comparison asked for could not be made (unless `keep_going`).
fn verdict(bad: &[String], missed: &[String], keep_going: bool) -> Result<()> {
    if !bad.is_empty() {
        bail!(
            "{} measurement(s) differ from the f64 reference by more than 1e-5: {}",
            bad.len(),
            bad.join("; ")
        );
    }
    if !missed.is_empty() && !keep_going {
        bail!(
            "{} baseline comparison(s) could not be made (--keep-going accepts that, \
             --no-torch leaves PyTorch out): {}",
            missed.len(),
            missed.join("; ")
        );
    }
    Ok(())
}

/// The exchange a matrix names (`nccl` or `p2p`, checked when it is read).
fn exchange_named(name: &str) -> kruskal_group::Exchange {
    match name {
        "nccl" => kruskal_group::Exchange::Nccl,
        _ => kruskal_group::Exchange::P2p,
    }
}

fn label(requested: &str, tag: &Option<String>) -> String {
    match tag {
        Some(t) => format!("{requested} ({t})"),
        None => requested.to_string(),
    }
}

impl Run {
    fn base(&self, spec: &BenchTensor, report: &Value) -> Result<Measurement> {
        let t = &report["tensor"];
        Ok(Measurement {
            kind: String::new(),
            tensor: spec.name.clone(),
            source: t["source"]
                .as_str()
                .or(t["path"].as_str())
                .unwrap_or("")
                .to_string(),
            dims: serde_json::from_value(t["dims"].clone()).context("report without dims")?,
            nnz: t["nnz"].as_u64().context("report without nnz")? as usize,
            backend: String::new(),
            label: String::new(),
            engine: String::new(),
            rank: report["rank"].as_u64().context("report without rank")? as usize,
            gpus: 0,
            exchange: None,
            mode_ms: Vec::new(),
            total_ms: f64::NAN,
            floor_ms: None,
            max_relative_error: None,
            fit: None,
            method: None,
            log_likelihood: None,
            machine: self.machine.clone(),
            commit: self.commit.clone(),
            date: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
            report: Value::Null,
        })
    }

    fn mttkrp_measurement(
        &self,
        spec: &BenchTensor,
        backend: &str,
        requested: &str,
        tag: &Option<String>,
        report: Value,
    ) -> Result<Measurement> {
        let modes = report["modes"].as_array().context("report without modes")?;
        let mode_ms: Vec<f64> = modes
            .iter()
            .filter_map(|m| m["median_ms"].as_f64())
            .collect();
        let errors: Vec<f64> = modes
            .iter()
            .filter_map(|m| m["relative_error"].as_f64())
            .collect();
        let mut m = self.base(spec, &report)?;
        m.kind = "mttkrp".into();
        m.backend = backend.into();
        m.label = label(requested, tag);
        m.engine = report["kernel"].as_str().unwrap_or(requested).to_string();
        m.gpus = usize::from(backend == "gpu");
        m.total_ms = report["total_median_ms"].as_f64().context("no total")?;
        m.mode_ms = mode_ms;
        m.floor_ms = report["floor_ms"].as_f64();
        m.max_relative_error = errors.into_iter().reduce(f64::max);
        m.report = report;
        Ok(m)
    }

    fn cpd_measurement(
        &self,
        spec: &BenchTensor,
        backend: &str,
        tag: &Option<String>,
        gpus: usize,
        exchange: Option<&str>,
        report: CpdReport,
    ) -> Result<Measurement> {
        let its = &report.iterations;
        if its.len() < 2 {
            bail!(
                "the CPD stopped after {} iteration(s); nothing to time",
                its.len()
            );
        }
        let later = &its[1..];
        let mut per_it: Vec<f64> = later
            .iter()
            .map(|i| (i.mttkrp_s + i.other_s) * 1e3)
            .collect();
        let nmodes = report.tensor.dims.len();
        let mode_ms = (0..nmodes)
            .map(|k| {
                let mut v: Vec<f64> = later
                    .iter()
                    .filter_map(|i| i.mttkrp_modes_s.get(k).copied())
                    .map(|s| s * 1e3)
                    .collect();
                median(&mut v)
            })
            .collect();
        let value = serde_json::to_value(&report)?;
        let mut m = self.base(spec, &value)?;
        m.kind = "cpd".into();
        m.backend = backend.into();
        // CPU: the engine's name; GPU: the plan (the engine chosen per
        // mode); a group: the shard kernel.
        let (engine, group_exchange) = match &report.kernel {
            KernelReport::Cpu(name) => (name.to_string(), None),
            KernelReport::Gpu(plan) => (
                report::distinct(plan.per_mode.iter().map(String::as_str)).join(" / "),
                None,
            ),
            KernelReport::Group(g) => (g.name.to_string(), g.exchange.map(String::from)),
        };
        m.label = label(&engine, tag);
        m.engine = engine;
        m.gpus = gpus;
        m.exchange = exchange.map(String::from).or(group_exchange);
        m.mode_ms = mode_ms;
        m.total_ms = median(&mut per_it);
        // (A fit that is not finite is no fit: the report said null.)
        m.fit = report.fit.is_finite().then_some(report.fit);
        m.report = value;
        Ok(m)
    }
}

/// The report `kruskal cp-apr --json` prints, as JSON, with `dims` and
/// `nnz` also under `tensor`, as the other reports have them.
fn cp_apr_report(report: &kruskal::measure::CpAprReport) -> Result<Value> {
    let mut value = serde_json::to_value(report)?;
    value["tensor"] = serde_json::json!({
        "source": report.source,
        "dims": report.dims,
        "nnz": report.nnz,
    });
    Ok(value)
}

impl Run {
    /// A CP-APR run's row: ms per outer iteration, the median of the
    /// iterations after the first (which also sorts each mode's copy of
    /// the nonzeros and, on a GPU, uploads them), from the cumulative
    /// `elapsed_s` of each iteration; and the final log-likelihood. A
    /// value that is not finite is an error, not a row.
    fn cp_apr_measurement(
        &self,
        spec: &BenchTensor,
        backend: &str,
        tag: &Option<String>,
        report: Value,
    ) -> Result<Measurement> {
        let elapsed: Vec<f64> = report["iterations"]
            .as_array()
            .context("report without iterations")?
            .iter()
            .map(|i| i["elapsed_s"].as_f64().unwrap_or(f64::NAN))
            .collect();
        if elapsed.len() < 2 {
            bail!(
                "CP-APR stopped after {} outer iteration(s); nothing to time",
                elapsed.len()
            );
        }
        let mut per_it: Vec<f64> = elapsed.windows(2).map(|w| (w[1] - w[0]) * 1e3).collect();
        let ms_per_it = median(&mut per_it);
        if !ms_per_it.is_finite() || ms_per_it < 0.0 {
            bail!("CP-APR's time per outer iteration is {ms_per_it} ms");
        }
        let ll = report["log_likelihood"].as_f64().unwrap_or(f64::NAN);
        if !ll.is_finite() {
            bail!("CP-APR's final log-likelihood is not finite");
        }
        let mut m = self.base(spec, &report)?;
        m.kind = "cp_apr".into();
        m.backend = backend.into();
        m.label = label("cp-apr", tag);
        m.engine = "cp-apr mu".into();
        m.gpus = report["gpus"].as_u64().unwrap_or(0) as usize;
        m.total_ms = ms_per_it;
        m.log_likelihood = Some(ll);
        m.report = report;
        Ok(m)
    }
}

/// Whether the PyTorch baseline can run here.
enum Torch {
    Unknown,
    Ready,
    /// Turned off (`--no-torch` or the matrix's settings).
    Disabled,
    /// Asked for, but it cannot run here: why.
    Off(String),
}

/// The `.ktns` file the PyTorch script reads: the tensor's own file, or
/// the generated tensor written to the scratch folder (once, removed after
/// the tensor's entries).
struct TorchFile {
    path: PathBuf,
    written: bool,
    ours: bool,
}

impl TorchFile {
    fn new(spec: &BenchTensor, source: &TensorSource, scratch: Option<&Path>) -> TorchFile {
        if let TensorSource::File { path, .. } = source {
            return TorchFile {
                path: path.clone(),
                written: true,
                ours: false,
            };
        }
        let dir = scratch.map_or_else(std::env::temp_dir, Path::to_path_buf);
        TorchFile {
            path: dir.join(format!(
                "kruskal-bench-{}-{}.ktns",
                spec.name,
                std::process::id()
            )),
            written: false,
            ours: true,
        }
    }

    fn ensure(&mut self, t: &kruskal_formats::SparseTensor) -> Result<&Path> {
        if !self.written {
            kruskal_formats::binary::write_binary(&self.path, t)
                .with_context(|| format!("writing {} for PyTorch", self.path.display()))?;
            self.written = true;
        }
        Ok(&self.path)
    }

    fn remove(&mut self) {
        if self.ours && self.written {
            let _ = std::fs::remove_file(&self.path);
            self.written = false;
        }
    }
}

impl Drop for TorchFile {
    fn drop(&mut self) {
        self.remove();
    }
}

#[allow(clippy::too_many_arguments)]
fn torch_baseline(
    cx: &mut Run,
    torch: &mut Torch,
    file: &mut TorchFile,
    loaded: &Loaded,
    spec: &BenchTensor,
    rank: usize,
    repeat: usize,
    cli: &BenchArgs,
) -> Result<()> {
    let what = format!("{} PyTorch rank {rank}", spec.name);
    if let Torch::Unknown = torch {
        *torch = match torch_available(&cli.python) {
            Ok(()) => Torch::Ready,
            Err(why) => Torch::Off(why),
        };
    }
    match torch {
        Torch::Disabled => return cx.skip(what, "turned off".into()),
        Torch::Off(why) => return cx.miss(what, why.clone()),
        Torch::Unknown | Torch::Ready => {}
    }
    if !cli.torch_script.is_file() {
        return cx.miss(what, format!("{} not found", cli.torch_script.display()));
    }
    let path = file.ensure(&loaded.tensor)?.to_path_buf();
    let mut cmd = Command::new(&cli.python);
    cmd.arg(&cli.torch_script).arg(&path).args([
        "--rank",
        &rank.to_string(),
        "--repeat",
        &repeat.to_string(),
        "--json",
    ]);
    if spec.verify {
        cmd.arg("--verify");
    }
    let out = cmd
        .output()
        .with_context(|| format!("running {}", cli.python))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .trim()
            .lines()
            .last()
            .unwrap_or("no message")
            .to_string();
        return cx.miss(what, format!("the PyTorch script failed: {last}"));
    }
    let report: Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("{what}: the script's JSON"))?;
    let mut m = cx.mttkrp_measurement(spec, "torch", "pytorch", &None, report)?;
    m.kind = "torch".into();
    m.engine = "pytorch".into();
    m.gpus = 1;
    // The script names the scratch file; say where the tensor came from.
    m.source = loaded.source.clone();
    cx.push(m)
}

/// Ok when `python` imports torch and sees a CUDA GPU; else why not.
fn torch_available(python: &str) -> Result<(), String> {
    let probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)";
    match Command::new(python).args(["-c", probe]).output() {
        Err(e) => Err(format!("{python} cannot be run ({e})")),
        Ok(o) if o.status.code() == Some(3) => Err("PyTorch sees no CUDA GPU".into()),
        Ok(o) if !o.status.success() => Err(format!("{python} cannot import torch")),
        Ok(_) => Ok(()),
    }
}

/// The machine this runs on; GPU fields stay empty without a driver.
fn machine() -> Machine {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name")?.split(':').nth(1))
        .map_or("unknown CPU".to_string(), |s| s.trim().to_string());
    let mem_kib: f64 = read("/proc/meminfo")
        .lines()
        .find_map(|l| {
            l.strip_prefix("MemTotal:")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0.0);
    let driver = driver_version(&read("/proc/driver/nvidia/version"));
    let mut m = Machine {
        host: read("/proc/sys/kernel/hostname").trim().to_string(),
        cpu,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory_gib: mem_kib / (1 << 20) as f64,
        driver,
        ..Machine::default()
    };
    if let Ok(n) = kruskal_device::Gpu::count() {
        m.gpus = n;
        if n > 0 {
            if let Ok(g) = kruskal_device::Gpu::open(0) {
                let p = g.properties();
                m.gpu = Some(p.name.clone());
                m.cuda = Some(format!(
                    "{}.{}",
                    p.driver_version / 1000,
                    p.driver_version % 1000 / 10
                ));
            }
        }
    }
    m
}

/// The kernel driver's version from `/proc/driver/nvidia/version`
/// ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04
/// ..."): the first word after "Module" made of digits and dots.
fn driver_version(text: &str) -> Option<String> {
    text.split_whitespace()
        .skip_while(|w| *w != "Module")
        .find(|w| w.contains('.') && w.chars().all(|c| c.is_ascii_digit() || c == '.'))
        .map(String::from)
}

/// The commit the binary was built from (`build.rs`; `-dirty` when the
/// tracked files differed from it). The build-time record is the right
/// one: a copy of the tree on another machine may carry a stale `.git`.
fn commit() -> String {
    env!("KRUSKAL_BUILD_COMMIT").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missed_comparison_fails_the_run_unless_asked_to_keep_going() {
        let missed = vec!["t PyTorch rank 32: the PyTorch script failed: x".to_string()];
        let err = verdict(&[], &missed, false).unwrap_err().to_string();
        assert!(
            err.contains("1 baseline comparison(s)") && err.contains("--keep-going"),
            "{err}"
        );
        assert!(verdict(&[], &missed, true).is_ok());
        assert!(verdict(&[], &[], false).is_ok());
        // A wrong measurement fails the run whatever --keep-going says.
        assert!(verdict(&["t fcoo: 1e-3".to_string()], &[], true).is_err());
    }

    #[test]
    fn the_driver_version_is_found_in_both_module_banners() {
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U16-I3-B03-4-3)  Thu Oct 16 2025\nGCC version:  gcc version 13.3.0\n";
        let closed = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n";
        assert_eq!(driver_version(open).as_deref(), Some("580.159.04"));
        assert_eq!(driver_version(closed).as_deref(), Some("550.54.15"));
        assert_eq!(driver_version(""), None);
    }

    fn reference(tool: &str, tensor: &str, ms: f64) -> Reference {
        Reference {
            tool: tool.into(),
            tensor: tensor.into(),
            rank: 32,
            ms,
            date: "2026-11-22".into(),
            machine: "one H100".into(),
            source: "ANCHORS.md".into(),
        }
    }

    #[test]
    fn references_are_kept_once_and_old_results_still_load() {
        // A results file from before references existed.
        let old: Results = serde_json::from_str(r#"{"measurements": [], "skipped": []}"#).unwrap();
        assert!(old.references.is_empty());
        let mut r = Results::default();
        r.add_references([reference("BLCO", "t3", 3.91), reference("BLCO", "t4", 7.79)]);
        // An appending run with the same matrix, one figure corrected.
        r.add_references([
            reference("BLCO", "t3", 3.9),
            reference("MM-CSF", "t3", 10.14),
        ]);
        let got: Vec<_> = r
            .references
            .iter()
            .map(|x| (x.tool.as_str(), x.tensor.as_str(), x.ms))
            .collect();
        assert_eq!(
            got,
            [
                ("BLCO", "t3", 3.9),
                ("BLCO", "t4", 7.79),
                ("MM-CSF", "t3", 10.14)
            ]
        );
    }

    fn run_here() -> Run {
        Run {
            machine: Machine::default(),
            commit: "abc".into(),
            out: PathBuf::from("unused"),
            results: Results::default(),
            bad: Vec::new(),
            missed: Vec::new(),
        }
    }

    fn spec() -> BenchTensor {
        matrix::Matrix::parse(
            "[[tensor]]\nname = \"counts\"\nlike = \"enron\"\nnnz = \"2k\"\ncounts = true\n",
        )
        .unwrap()
        .tensors
        .remove(0)
    }

    /// What `cp_apr_report` makes of a run, with these iterations (the
    /// keys `cp_apr_measurement` reads).
    fn apr_report(elapsed_s: &[f64], log_likelihood: f64) -> Value {
        serde_json::json!({
            "tensor": { "source": "generated like enron", "dims": [6066, 5699, 244268, 1176], "nnz": 2000 },
            "backend": "cpu",
            "rank": 16,
            "iterations": elapsed_s.iter().enumerate().map(|(k, s)| serde_json::json!({
                "iteration": k + 1, "inner_iters": 10, "elapsed_s": s,
            })).collect::<Vec<_>>(),
            "log_likelihood": log_likelihood,
        })
    }

    #[test]
    fn a_cp_apr_row_is_the_median_outer_iteration_after_the_first() {
        let cx = run_here();
        // Iterations of 500 (the first: sorting), 10, 30 and 20 ms.
        let report = apr_report(&[0.5, 0.51, 0.54, 0.56], -42.5);
        let m = cx
            .cp_apr_measurement(&spec(), "cpu", &Some("mu".into()), report)
            .unwrap();
        assert_eq!(
            (m.kind.as_str(), m.label.as_str()),
            ("cp_apr", "cp-apr (mu)")
        );
        assert!((m.total_ms - 20.0).abs() < 1e-9, "{}", m.total_ms);
        assert_eq!(m.log_likelihood, Some(-42.5));
        assert_eq!((m.rank, m.nnz, m.gpus), (16, 2000, 0));
        assert_eq!(m.dims, [6066, 5699, 244268, 1176]);
        assert_eq!(m.fit, None);
        // The row goes into results.json and back.
        let back: Measurement = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back.log_likelihood, Some(-42.5));
    }

    #[test]
    fn a_cp_apr_value_that_is_not_finite_is_an_error_not_a_row() {
        let cx = run_here();
        // (json! writes a NaN or an infinity as null.)
        for ll in [f64::NAN, f64::NEG_INFINITY] {
            let e = cx
                .cp_apr_measurement(&spec(), "cpu", &None, apr_report(&[0.1, 0.2, 0.3], ll))
                .unwrap_err();
            assert!(
                e.to_string().contains("log-likelihood is not finite"),
                "{e}"
            );
        }
        let mut report = apr_report(&[0.1, 0.2, 0.3], -1.0);
        report["iterations"][1]["elapsed_s"] = Value::Null;
        report["iterations"][2]["elapsed_s"] = Value::Null;
        let e = cx
            .cp_apr_measurement(&spec(), "cpu", &None, report)
            .unwrap_err();
        assert!(e.to_string().contains("time per outer iteration"), "{e}");
        let e = cx
            .cp_apr_measurement(&spec(), "cpu", &None, apr_report(&[0.1], -1.0))
            .unwrap_err();
        assert!(e.to_string().contains("after 1 outer iteration"), "{e}");
    }

    #[test]
    fn old_results_without_method_or_log_likelihood_still_load() {
        let cx = run_here();
        let m = cx
            .cp_apr_measurement(&spec(), "cpu", &None, apr_report(&[0.1, 0.2, 0.3], -1.0))
            .unwrap();
        let mut v = serde_json::to_value(&m).unwrap();
        let o = v.as_object_mut().unwrap();
        o.remove("method");
        o.remove("log_likelihood");
        let old: Measurement = serde_json::from_value(v).unwrap();
        assert_eq!((old.method, old.log_likelihood), (None, None));
    }
}
