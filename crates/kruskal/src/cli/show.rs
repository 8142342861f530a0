//! How `kruskal cpd` shows a decomposition as it runs: the tensor, the
//! library's warnings, its choices and a line per iteration (the events of
//! [`kruskal_cpd::decompose`] and [`kruskal_cpd::decompose_distributed`]),
//! with a progress bar on a terminal.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::atomic::AtomicBool;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use kruskal::console::{dims_text, flag, spinner, thousands, warn};
use kruskal::input::Loaded;
use kruskal_cpd::distributed::{Abort, Job};
use kruskal_cpd::{
    CpdOptions, DecomposeOptions, Decomposition, DistributedDecomposition, Event, IterationStats,
    StartSummary,
};
use kruskal_formats::SparseTensor;

/// Builds the backend and runs every start ([`kruskal_cpd::decompose`]),
/// printing the tensor, what it chose and a line per iteration unless
/// `quiet` (and a progress bar on a terminal). Stops after the
/// current iteration once `stop` is set.
pub(super) fn decompose(
    opts: &DecomposeOptions,
    loaded: Loaded,
    quiet: bool,
    stop: &AtomicBool,
) -> Result<Decomposition> {
    let tensor = &loaded.tensor;
    let cpd = &opts.cpd;
    print_warnings(tensor, cpd.rank, cpd.max_iters);
    if !quiet {
        println!("tensor     {}", loaded.source);
        println!(
            "           {} modes, {}, {} nonzeros (loaded in {:.2} s)",
            tensor.nmodes(),
            dims_text(tensor.dims()),
            thousands(tensor.nnz() as u64),
            loaded.load_s
        );
    }
    let mut printer = Printer::new(quiet, cpd);
    // The tensor goes with the call: freed once the backend is built, so
    // the model does not come back beside it.
    let done = kruskal_cpd::decompose_owned(loaded.tensor, opts, &mut |e| printer.event(e), stop);
    printer.finish();
    let done = done?;
    if !quiet {
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

/// This process's part of a decomposition spread over several processes
/// ([`kruskal_cpd::decompose_distributed`]), printing the communicator,
/// the tensor, the plan, the GPU group and a line per iteration unless
/// `quiet`, as [`decompose`] does. `on_abort` receives the
/// communicator's abort as soon as it exists.
pub(super) fn decompose_distributed(
    opts: &DecomposeOptions,
    job: &Job<'_>,
    path: &Path,
    on_abort: &mut dyn FnMut(Abort),
    quiet: bool,
    stop: &AtomicBool,
) -> Result<DistributedDecomposition> {
    let mut printer = Printer::new(quiet, &opts.cpd);
    let done = kruskal_cpd::decompose_distributed(
        job,
        path,
        opts,
        on_abort,
        &mut |e| printer.event(e),
        stop,
    );
    printer.finish();
    let done = done?;
    if !quiet {
        print_starts(done.starts, &done.summaries);
    }
    Ok(done)
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
            Event::Choice { choice, sms } => {
                if !self.quiet {
                    for line in choice.notes(sms, &flag) {
                        println!("{:<11}{line}", "kernels");
                    }
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
