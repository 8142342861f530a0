//! What `kruskal cpd` runs on a loaded tensor: the backend and every start
//! of CPD-ALS ([`kruskal_cpd::decompose`]), shown as the command shows it,
//! and the `--json` report of the result.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::atomic::AtomicBool;

use indicatif::{ProgressBar, ProgressStyle};
use kruskal_cpd::decompose::Starts;
use kruskal_cpd::{
    Backend, Chosen, CpdOptions, DecomposeOptions, Decomposition, Event, IterationStats,
    StartSummary,
};
use kruskal_formats::SparseTensor;
use serde_json::json;

use super::Result;
use crate::console::{dims_text, flag, spinner, thousands, warn};
use crate::input::Loaded;

/// What [`cpd`] runs: the decomposition's options, and whether to print.
#[derive(Clone, Debug)]
pub struct CpdRunOptions {
    /// Backend, kernel, starts, rank and limits. The default is
    /// `kruskal cpd`'s: rank 10, one start from seed 1, backend and kernel
    /// `auto`, and the modes to relabel (`--compact`) named when the
    /// host's memory is too small for a tensor with sparse modes.
    pub decompose: DecomposeOptions,
    /// Print nothing on standard output (`kruskal cpd --json`); otherwise
    /// the tensor, the choices made and a line per iteration are printed.
    pub quiet: bool,
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
            quiet: false,
        }
    }
}

/// Runs the decomposition `opts` asks for on a loaded tensor and returns
/// the report `kruskal cpd --json` prints (the tensor, backend, kernels,
/// times, fit, every iteration and start, lambda).
///
/// ```
/// use kruskal::input::TensorSource;
/// use kruskal::measure::{CpdRunOptions, cpd};
///
/// let loaded = TensorSource::Like { name: "nell-2".into(), nnz: Some(2_000), seed: 1 }.load().unwrap();
/// let mut opts = CpdRunOptions { quiet: true, ..Default::default() };
/// opts.decompose.cpd.rank = 3;
/// opts.decompose.cpd.max_iters = 2;
/// opts.decompose.backend = kruskal::cpd::BackendChoice::Cpu;
/// let report = cpd(&opts, &loaded).unwrap();
/// assert_eq!(report["iterations"].as_array().unwrap().len(), 2);
/// ```
pub fn cpd(opts: &CpdRunOptions, loaded: &Loaded) -> Result<serde_json::Value> {
    static NEVER: AtomicBool = AtomicBool::new(false);
    let done = decompose(opts, loaded, &NEVER)?;
    cpd_report(loaded, &done, None, None)
}

/// Builds the backend and runs every start ([`kruskal_cpd::decompose`]),
/// printing the tensor, what it chose and a line per iteration unless
/// `opts.quiet` (and a progress bar on a terminal). Stops after the
/// current iteration once `stop` is set.
pub fn decompose(
    opts: &CpdRunOptions,
    loaded: &Loaded,
    stop: &AtomicBool,
) -> Result<Decomposition> {
    let tensor = &loaded.tensor;
    let cpd = &opts.decompose.cpd;
    print_warnings(tensor, cpd.rank, cpd.max_iters);
    if !opts.quiet {
        println!("tensor     {}", loaded.source);
        println!(
            "           {} modes, {}, {} nonzeros (loaded in {:.2} s)",
            tensor.nmodes(),
            dims_text(tensor.dims()),
            thousands(tensor.nnz() as u64),
            loaded.load_s
        );
    }
    let mut printer = Printer::new(opts.quiet, cpd);
    let done = kruskal_cpd::decompose(tensor, &opts.decompose, &mut |e| printer.event(e), stop);
    printer.finish();
    let done = done?;
    if !opts.quiet {
        print_starts(done.starts, &done.summaries);
    }
    Ok(done)
}

/// Prints each warning of [`kruskal_cpd::warnings`] on stderr, one line
/// each, options named by their flags and modes counted from 1.
fn print_warnings(t: &SparseTensor, rank: usize, iters: usize) {
    for w in kruskal_cpd::warnings(t, rank, iters) {
        warn(&w.text(&flag, 1));
    }
}

/// Runs `starts` starts on `backend` ([`kruskal_cpd::decompose::run_starts`],
/// seeds `seed`, `seed + 1`, ...) and keeps the best model, printing the
/// limits and a line per iteration unless `quiet`, as [`decompose`] does.
/// Stops after the current iteration once `stop` is set.
pub fn run_starts(
    backend: &mut dyn Backend,
    opts: &CpdOptions,
    seed: u64,
    starts: usize,
    quiet: bool,
    stop: &AtomicBool,
) -> Result<Starts> {
    let mut printer = Printer::new(quiet, opts);
    printer.limits();
    let runs = kruskal_cpd::decompose::run_starts(
        backend,
        opts,
        seed,
        starts,
        &mut |e| printer.event(e),
        stop,
    );
    printer.finish();
    let runs = runs?;
    if !quiet {
        print_starts(runs.starts, &runs.summaries);
    }
    Ok(runs)
}

/// Each start's seed, fit and iterations, when several were asked for.
fn print_starts(starts: usize, summaries: &[StartSummary]) {
    if starts > 1 {
        for s in summaries {
            println!(
                "start seed {}: fit {:.6} after {} iterations",
                s.seed, s.fit, s.iterations
            );
        }
    }
}

/// `: GPU opened 0.150 s, kernel model 0.020 s, layout built 0.050 s`,
/// the parts a backend took (none for a CPU backend's single part).
fn prepare_parts(p: &kruskal_cpd::PrepareTimes) -> String {
    let parts: Vec<String> = [
        ("GPU opened", p.open_s),
        ("kernel model", p.choose_s),
        ("layout built", p.build_s),
    ]
    .iter()
    .filter(|(_, s)| *s > 0.0)
    .map(|(what, s)| format!("{what} {s:.3} s"))
    .collect();
    if parts.len() < 2 {
        String::new()
    } else {
        format!(": {}", parts.join(", "))
    }
}

/// Shows `kruskal_cpd::decompose`'s events: its choices and a line per
/// iteration unless `quiet`, and a progress bar (fit and time per
/// iteration) on a terminal.
struct Printer {
    quiet: bool,
    rank: usize,
    max_iters: usize,
    tol: f64,
    spin: Option<ProgressBar>,
    bar: Option<ProgressBar>,
}

impl Printer {
    fn new(quiet: bool, opts: &CpdOptions) -> Self {
        Printer {
            quiet,
            rank: opts.rank,
            max_iters: opts.max_iters,
            tol: opts.tol,
            spin: None,
            bar: None,
        }
    }

    /// `rank 10, up to 50 iterations, tol 1e-5`.
    fn limits(&self) {
        if !self.quiet {
            println!(
                "rank {}, up to {} iterations, tol {:e}",
                self.rank, self.max_iters, self.tol
            );
        }
    }

    fn event(&mut self, event: Event<'_>) -> ControlFlow<()> {
        match event {
            Event::Note { topic, text } => {
                if !self.quiet {
                    println!("{topic:<11}{text}");
                }
            }
            Event::Step(Some(what)) => self.spin = Some(spinner(what)),
            Event::Step(None) => {
                if let Some(spin) = self.spin.take() {
                    spin.finish_and_clear();
                }
            }
            Event::Ready {
                backend,
                prep_s,
                prepare,
                fallback,
            } => {
                if !self.quiet {
                    if let Some(why) = fallback {
                        println!("note       GPU not used: {why}; running on the CPU");
                    }
                    println!(
                        "backend    {backend} (prepared in {prep_s:.3} s{})",
                        prepare_parts(&prepare)
                    );
                }
                self.limits();
            }
            Event::Start {
                index,
                starts,
                seed,
            } => {
                self.finish();
                if starts > 1 && !self.quiet {
                    println!("start {} of {starts} (seed {seed})", index + 1);
                }
                let bar = ProgressBar::new(self.max_iters as u64);
                bar.set_style(
                    ProgressStyle::with_template("iterating [{bar:30}] {pos}/{len} {msg}")
                        .expect("valid template")
                        .progress_chars("=> "),
                );
                self.bar = Some(bar);
            }
            Event::Iteration(s) => {
                if let Some(bar) = &self.bar {
                    let total = s.mttkrp_s + s.other_s;
                    bar.set_position(s.iteration as u64);
                    bar.set_message(format!("fit {:.6}, {:.3} s/iteration", s.fit, total));
                    if !self.quiet {
                        bar.suspend(|| println!("{}", iteration_line(s)));
                    }
                }
            }
        }
        ControlFlow::Continue(())
    }

    /// Clears the progress bar and spinner.
    fn finish(&mut self) {
        for bar in [self.bar.take(), self.spin.take()].into_iter().flatten() {
            bar.finish_and_clear();
        }
    }
}

/// `  its =   3 (0.512 s: mttkrp 0.410 [0.100 0.200 0.110], update 0.080,
/// fit 0.001)  fit = 0.123456  delta = +1.2e-3`
fn iteration_line(s: &IterationStats) -> String {
    let modes: Vec<String> = s.mttkrp_modes_s.iter().map(|t| format!("{t:.3}")).collect();
    format!(
        "  its = {:3} ({:.3}s: mttkrp {:.3} [{}], update {:.3}, fit {:.3})  fit = {:.6}  delta = {:+.4e}",
        s.iteration,
        s.mttkrp_s + s.other_s,
        s.mttkrp_s,
        modes.join(" "),
        s.update_s,
        s.fit_s,
        s.fit,
        s.delta
    )
}

/// The `--json` report of a decomposition of `loaded`: with the factor
/// match score against planted factors (`fms`, `kruskal cpd --demo`) and
/// the folder the model was written to (`out`), when there are.
pub fn cpd_report(
    loaded: &Loaded,
    done: &Decomposition,
    fms: Option<f64>,
    out: Option<&Path>,
) -> Result<serde_json::Value> {
    let model = &done.model;
    let t = &loaded.tensor;
    let (name, kernel, device) = match &done.backend {
        Chosen::Cpu(b) => ("cpu", json!(b.kernel_name()), None),
        Chosen::Gpu(b) => (
            "gpu",
            serde_json::to_value(b.plan())?,
            Some(b.gpu().properties().name.clone()),
        ),
        Chosen::Group(b) => (
            "gpus",
            json!({
                "name": "shard",
                "gpus": b.group().gpus().iter().map(|g| g.properties().ordinal).collect::<Vec<_>>(),
                "exchange": b.group().exchange().map(|e| e.name()),
                "exchange_note": b.group().exchange_note(),
                "placement": b.group().describe(),
                "breakdown": b.breakdown(),
            }),
            Some(b.group().gpus()[0].properties().name.clone()),
        ),
    };
    Ok(json!({
        "tensor": {
            "source": loaded.source,
            "dims": t.dims(),
            "nnz": t.nnz(),
            "duplicates_merged": loaded.merged,
            "load_s": loaded.load_s,
            "coalesce_s": loaded.coalesce_s,
        },
        "backend": name,
        "device": device,
        "gpu_not_used": done.fallback,
        "kernel": kernel,
        "threads": rayon::current_num_threads(),
        "rank": model.rank(),
        "prepare_s": done.prep_s,
        "prepare": done.prepare,
        "layout_steps": match &done.backend {
            Chosen::Gpu(b) => b
                .layout_steps()
                .iter()
                .map(|(step, s)| json!({"step": step, "s": s}))
                .collect::<Vec<_>>(),
            _ => Vec::new(),
        },
        "cpd_s": done.cpd_s,
        "fit": model.fit(),
        "converged": model.converged,
        "interrupted": model.interrupted,
        "pseudo_inverse_solves": model.pseudo_inverse_solves,
        "iterations": model.iterations,
        "iterations_run": model.totals.count,
        "starts": done.summaries,
        "lambda": model.lambda,
        "factor_match_score": fms,
        "out": out.map(|p| p.display().to_string()),
    }))
}
