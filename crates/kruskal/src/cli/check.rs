//! `kruskal check`: every MTTKRP engine against the f64 reference on
//! generated power-law tensors and a folder of real ones, and CP-APR's
//! and AO-ADMM's steps against f64 references of their own (the cases are
//! in [`kruskal::harness`]); prints a table, fails if any case failed.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kruskal::harness::{CheckOptions, CheckReport, data_folder, run_check};
use serde_json::json;

use super::common::set_threads;
use kruskal::console::{dims_text, thousands};
use kruskal::input::parse_count;

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// Also check the GPU engines and the GPU's CP-APR and AO-ADMM steps
    /// (on GPU 0).
    #[arg(long)]
    pub gpu: bool,
    /// Fewer cases: 3 and 4 modes, ranks 1, 16 and 32, 20k nonzeros.
    #[arg(long)]
    pub quick: bool,
    /// A folder of real tensors (.tns, .tns.gz, .ktns) to check too
    /// (default: the folder KRUSKAL_TEST_DATA names, else none).
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// Nonzeros of each generated tensor (default 40k, 20k with --quick).
    #[arg(long, value_parser = parse_count)]
    pub nnz: Option<usize>,
    /// Worker threads of the CPU engines (default: one per core).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = super::common::parse_threads)]
    pub threads: usize,
    #[arg(long)]
    pub json: bool,
}

/// Failed cases listed in the table (all of them are in `--json`).
const LISTED_FAILURES: usize = 40;

pub fn run(args: CheckArgs) -> Result<()> {
    set_threads(args.threads)?;
    let mut opts = if args.quick {
        CheckOptions::quick()
    } else {
        CheckOptions::default()
    };
    opts.gpu = args.gpu;
    opts.data = data_folder(args.data.as_deref())?;
    if let Some(nnz) = args.nnz {
        opts.nnz = nnz;
    }
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("checking [{bar:30}] {pos}/{len} {elapsed} {wide_msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let report = run_check(&opts, &mut |p| {
        bar.set_length(p.total as u64);
        bar.set_position(p.done as u64);
        bar.set_message(p.message.to_string());
    });
    bar.finish_and_clear();
    let report = report?;
    if args.json {
        print_json(&report)?;
    } else {
        print_table(&report);
    }
    let failed = report.failures().count();
    if failed > 0 {
        bail!(
            "{failed} of {} cases failed (listed above)",
            report.cases.len()
        );
    }
    Ok(())
}

fn print_json(report: &CheckReport) -> Result<()> {
    let value = json!({
        "passed": report.passed(),
        "failed": report.failures().count(),
        "threads": report.threads,
        "gpu": report.gpu,
        "elapsed_s": report.elapsed_s,
        "tensors": report.tensors,
        "notes": report.notes,
        "summary": report.summary(),
        "failures": report.failures().collect::<Vec<_>>(),
        "cases": report.cases,
    });
    println!("{}", serde_json::to_string_pretty(&value)?);
    Ok(())
}

fn print_table(report: &CheckReport) {
    println!(
        "kruskal check: cpu ({} threads){}; {} cases in {:.1} s",
        report.threads,
        report
            .gpu
            .as_ref()
            .map_or(", no GPU (add --gpu)".to_string(), |g| format!(" and {g}")),
        report.cases.len(),
        report.elapsed_s
    );
    println!();
    let width = report
        .tensors
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(0);
    for t in &report.tensors {
        println!(
            "  {:<width$}  {}, {} nonzeros, hottest row {:.1}% of them",
            t.name,
            dims_text(&t.dims),
            thousands(t.nnz as u64),
            100.0 * t.hottest_row_share
        );
    }
    for note in &report.notes {
        println!("  note: {note}");
    }
    println!();
    let rows = report.summary();
    let width = rows
        .iter()
        .map(|r| r.engine.len())
        .max()
        .unwrap_or(6)
        .max(6);
    println!(
        "{:<width$}  {:<11}  {:>7}  {:>6}  {:>11}  result",
        "engine", "check", "tensors", "cases", "worst error"
    );
    for r in &rows {
        let worst = match (r.worst_error, r.nan) {
            (_, true) => "NaN".to_string(),
            (Some(e), false) => format!("{e:.2e}"),
            (None, false) => "-".to_string(),
        };
        let result = if r.failed == 0 {
            "ok".to_string()
        } else {
            format!("FAIL ({} of {})", r.failed, r.cases)
        };
        println!(
            "{:<width$}  {:<11}  {:>7}  {:>6}  {:>11}  {result}",
            r.engine,
            r.group.name(),
            r.tensors,
            r.cases,
            worst
        );
    }
    let failures: Vec<_> = report.failures().collect();
    if !failures.is_empty() {
        println!();
        println!("failed cases ({}):", failures.len());
        for c in failures.iter().take(LISTED_FAILURES) {
            let mut at = c.tensor.clone();
            if let Some(rank) = c.rank {
                at += &format!(", rank {rank}");
            }
            if let Some(mode) = c.mode {
                at += &format!(", mode {mode}");
            }
            println!(
                "  {} [{}] {at}: {}",
                c.engine,
                c.group.name(),
                c.failure.as_deref().unwrap_or_default()
            );
        }
        if failures.len() > LISTED_FAILURES {
            println!(
                "  ... and {} more (--json lists every case)",
                failures.len() - LISTED_FAILURES
            );
        }
    }
}
