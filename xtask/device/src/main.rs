//! The development tasks that need the GPU crates (`kruskal`,
//! `kruskal-device`, so cudarc), in a package of their own so that the
//! other tasks (`xtask`, one folder up) build without them. Users do not
//! run this binary by name: `cargo xtask kernels ...` and `cargo xtask bench
//! ...` forward their arguments to it (`cargo run --package xtask-device
//! --release -- TASK ARGS...`, or, in a bundle without cargo, the
//! `xtask-device` beside `xtask`); clap parses them here, so `cargo xtask
//! TASK --help` lists this side's options.
//!
//! - `kernels [--arch sm_80|sm_90]... [--ptxas PATH] [--jobs N] [--json]`:
//!   compile every kernel specialization with NVRTC for each architecture
//!   (default sm_80 and sm_90), assemble it with `ptxas -v` and print
//!   registers, spills and shared memory per function; fails on any compile
//!   error (see `kernels.rs` and `docs/kernels.md`).
//! - `bench [--matrix FILE] [--out DIR] ...`: run the evaluation matrix
//!   (`bench/*.toml`: tensors, engines, ranks, GPU counts) through the
//!   library, with the PyTorch baseline where torch is installed, and
//!   write `results.json`, `report.md` and SVG plots; `bench report` rebuilds
//!   the report from results files and updates `docs/performance.md` (see
//!   `bench/mod.rs`).

use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;

mod bench;
mod kernels;

/// Development tasks for kruskal that need the GPU crates (run by `cargo
/// xtask`).
#[derive(Parser, Debug)]
#[command(name = "xtask", bin_name = "cargo xtask")]
enum Task {
    /// Compile every kernel specialization (NVRTC + ptxas -v) and report
    /// registers, spills, shared memory.
    Kernels(kernels::KernelsArgs),
    /// Run the evaluation matrix (bench/*.toml) and write results.json,
    /// report.md and plots.
    #[command(args_conflicts_with_subcommands = true)]
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    let result: Result<()> = match Task::parse() {
        Task::Kernels(a) => kernels::kernels(a),
        Task::Bench(a) => bench::bench(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the error and its causes, outermost first.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod cli_tests {
    use clap::{CommandFactory, Parser};

    /// clap checks option definitions only when they are parsed; this
    /// checks every task's at once.
    #[test]
    fn command_line_definition_is_consistent() {
        super::Task::command().debug_assert();
    }

    /// The documented invocations of this package's tasks (the lines of
    /// `xtask/invocations.txt` that start with one), as `cargo xtask`
    /// forwards them; every task has at least one.
    #[test]
    fn documented_invocations_parse() {
        let cli = super::Task::command();
        let tasks: Vec<&str> = cli.get_subcommands().map(|s| s.get_name()).collect();
        let mut seen = Vec::new();
        for line in include_str!("../../invocations.txt").lines() {
            let Some(task) = line.split_whitespace().next() else {
                continue;
            };
            if !tasks.contains(&task) {
                continue;
            }
            seen.push(task);
            let argv = std::iter::once("xtask").chain(line.split_whitespace());
            if let Err(e) = super::Task::try_parse_from(argv) {
                panic!("`cargo xtask {line}`: {e}");
            }
        }
        for task in tasks {
            assert!(seen.contains(&task), "no documented `cargo xtask {task}`");
        }
    }
}
