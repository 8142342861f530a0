//! `kruskal mttkrp`: time the MTTKRP of each mode (median of K runs). The
//! flags become [`MttkrpOptions`] and [`kruskal::measure::mttkrp`] does the
//! work, as it does for `cargo xtask bench`; this module prints its
//! reports as tables (or JSON).

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use serde_json::json;

use super::common::{GpuArgs, InputArgs, MultiGpuArgs, parse_rank, parse_threads, set_threads};
use kruskal::console::{dims_text, thousands};
use kruskal::measure::{
    CpuMttkrpReport, GpuMttkrpReport, GroupMttkrpReport, MttkrpBackend, MttkrpOptions, MttkrpReport,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MttkrpBackendArg {
    Cpu,
    /// The first CUDA GPU.
    Gpu,
}

#[derive(Args, Debug)]
pub struct MttkrpArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Number of columns of the factor matrices.
    #[arg(long, short, default_value_t = 32, allow_negative_numbers = true, value_parser = parse_rank)]
    pub rank: usize,
    /// `all`, or one mode numbered from 1.
    #[arg(long, default_value = "all")]
    pub mode: String,
    /// Timed runs per mode (after one warm-up run); the median is reported.
    #[arg(long, default_value_t = 10, allow_negative_numbers = true)]
    pub repeat: usize,
    #[arg(long, value_enum, default_value_t = MttkrpBackendArg::Cpu)]
    pub backend: MttkrpBackendArg,
    /// MTTKRP engine, or `all` to time each one in turn. CPU: auto, sorted,
    /// fcoo, flycoo, hicoo. GPU: auto, coo, hicoo, fcoo, flycoo; on the GPU
    /// `auto` is the tuning model's choice of engine and launch parameter
    /// for this tensor and rank (fcoo with threadlen 8 when there is no
    /// trained model), and an engine's parameter not given below is the
    /// model's best for that engine.
    #[arg(long, default_value = "auto")]
    pub kernel: String,
    #[command(flatten)]
    pub gpu: GpuArgs,
    #[command(flatten)]
    pub multi: MultiGpuArgs,
    /// Also compare each mode with the f64 reference (slow on big tensors).
    #[arg(long)]
    pub verify: bool,
    /// Relabel each mode to the indices that occur first (as `kruskal cpd
    /// --compact`): for dimensions far larger than the indices used.
    #[arg(long)]
    pub compact: bool,
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = parse_threads)]
    pub threads: usize,
    #[arg(long)]
    pub json: bool,
}

impl MttkrpArgs {
    /// What the flags ask [`kruskal::measure::mttkrp`] for (`--gpus` is
    /// resolved to ordinals and the group's options checked here).
    fn options(&self) -> Result<MttkrpOptions> {
        let (gpus, group) = self.multi.group()?;
        Ok(MttkrpOptions {
            rank: self.rank,
            mode: self.mode.clone(),
            repeat: self.repeat,
            backend: match self.backend {
                MttkrpBackendArg::Cpu => MttkrpBackend::Cpu,
                MttkrpBackendArg::Gpu => MttkrpBackend::Gpu,
            },
            kernel: self.kernel.parse()?,
            gpu: self.gpu.options(),
            no_model: self.gpu.no_model,
            gpus,
            group,
            verify: self.verify,
        })
    }
}

pub fn run(args: MttkrpArgs) -> Result<()> {
    set_threads(args.threads)?;
    args.multi.check_used(false)?;
    // The GPUs asked for, and the memory for the tensor's shape, before
    // the tensor is read or generated.
    let options = args.options()?;
    if args.backend == MttkrpBackendArg::Gpu && args.multi.gpus.is_none() {
        super::preflight::check_gpu_present()?;
    }
    let (rank, on_gpus) = (
        args.rank,
        args.backend == MttkrpBackendArg::Gpu || options.gpus.is_some(),
    );
    args.gpu.check(!on_gpus)?;
    if !args.compact {
        // (`--compact` shrinks the dimensions first; checked after it.)
        super::preflight::check_memory_ahead(&args.input, |dims, nnz| {
            let mut need = kruskal_cpd::memory::mttkrp_need(dims, nnz, rank);
            if on_gpus {
                // On GPUs the host holds the factors (made, then uploaded).
                need.parts.truncate(1);
            }
            need
        })?;
    }
    let mut loaded = args.input.load()?;
    if args.compact {
        // MTTKRP writes no factors, so the map back is not needed.
        super::compact::compact_tensor(&mut loaded, args.json, false)?;
    }
    let reports = kruskal::measure::mttkrp(&options, &loaded)?;
    if !args.json {
        for (k, report) in reports.iter().enumerate() {
            if k > 0 {
                println!();
            }
            print_report(report, args.verify);
        }
    }
    finish(&reports, args.json, "MTTKRP")
}

/// ` 3.2e-8` after a row where the error was measured.
fn error_column(error: Option<f64>) -> String {
    error.map_or(String::new(), |e| format!("   {e:.2e}"))
}

/// The header's last column where errors were measured.
fn error_header(verify: bool) -> &'static str {
    if verify { "   rel. error" } else { "" }
}

/// A report as `kruskal mttkrp` prints it: the tensor, the engine and a
/// row per mode (and `all` over several).
fn print_report(report: &MttkrpReport, verify: bool) {
    match report {
        MttkrpReport::Cpu(r) => print_cpu(r, verify),
        MttkrpReport::Gpu(r) => print_gpu(r, verify),
        MttkrpReport::Group(r) => print_group(r, verify),
    }
}

fn print_cpu(r: &CpuMttkrpReport, verify: bool) {
    let t = &r.tensor;
    println!("tensor   {}", t.source);
    println!(
        "         {}, {} nonzeros; rank {}; cpu, {} threads; {} kernel ({:.1} bytes/nnz), prepared in {:.2} s",
        dims_text(&t.dims),
        thousands(t.nnz as u64),
        r.rank,
        r.threads,
        r.kernel,
        r.bytes_per_nnz,
        r.prepare_s
    );
    println!(
        "{:>6} {:>11} {:>11} {:>14} {:>16}{}",
        "mode",
        "median ms",
        "min ms",
        "Mnnz/s",
        "Mnnz/s per core",
        error_header(verify)
    );
    for m in &r.modes {
        println!(
            "{:>6} {:>11.3} {:>11.3} {:>14.1} {:>16.1}{}",
            m.mode,
            m.median_ms,
            m.min_ms,
            m.mnnz_per_s,
            m.mnnz_per_s_per_core,
            error_column(m.relative_error)
        );
    }
    if r.modes.len() > 1 {
        println!(
            "{:>6} {:>11.3} {:>11} {:>14.1} {:>16.1}",
            "all", r.total_median_ms, "", r.mnnz_per_s, r.mnnz_per_s_per_core
        );
    }
}

fn print_gpu(r: &GpuMttkrpReport, verify: bool) {
    let t = &r.tensor;
    println!("tensor   {}", t.source);
    println!(
        "         {}, {} nonzeros; rank {}; {} ({} SMs, copy bandwidth {:.2} TB/s, L2 gathers {:.2} TB/s); {} kernel{}; prepared and uploaded in {:.2} s",
        dims_text(&t.dims),
        thousands(t.nnz as u64),
        r.rank,
        r.gpu,
        r.sms,
        r.copy_bandwidth_bytes_per_s / 1e12,
        r.l2_gather_bandwidth_bytes_per_s / 1e12,
        r.kernel,
        if r.deterministic && r.kernel == "flycoo" {
            " (deterministic)"
        } else {
            ""
        },
        r.prepare_s
    );
    if !r.prepare_steps.is_empty() {
        let parts: Vec<String> = r
            .prepare_steps
            .iter()
            .map(|p| format!("{} {:.1} ms", p.step, p.s * 1e3))
            .collect();
        println!("         built on the GPU: {}", parts.join(", "));
    }
    println!("         kernel {}", r.choice_line);
    println!(
        "{:>6} {:>11} {:>11} {:>14} {:>10} {:>9} {:>9} {:>10} {:>8}{}",
        "mode",
        "median ms",
        "min ms",
        "Mnnz/s",
        "floor ms",
        "x floor",
        "rows/nnz",
        "L2 fl. ms",
        "x L2",
        error_header(verify)
    );
    for m in &r.modes {
        println!(
            "{:>6} {:>11.3} {:>11.3} {:>14.1} {:>10.3} {:>9.2} {:>9.3} {:>10.3} {:>8.2}{}",
            m.mode,
            m.median_ms,
            m.min_ms,
            m.mnnz_per_s,
            m.floor_ms,
            m.times_floor,
            m.gathers_per_nonzero,
            m.l2_floor_ms,
            m.times_l2_floor,
            error_column(m.relative_error)
        );
    }
    if r.modes.len() > 1 {
        println!(
            "{:>6} {:>11.3} {:>11} {:>14} {:>10.3} {:>9.2} {:>9} {:>10.3} {:>8.2}",
            "all",
            r.total_median_ms,
            "",
            "",
            r.floor_ms,
            r.times_floor,
            "",
            r.l2_floor_ms,
            r.times_l2_floor
        );
    }
}

fn print_group(r: &GroupMttkrpReport, verify: bool) {
    let t = &r.tensor;
    println!("tensor   {}", t.source);
    println!(
        "         {}, {} nonzeros; rank {}",
        dims_text(&t.dims),
        thousands(t.nnz as u64),
        r.rank
    );
    for (topic, text) in &r.notes {
        println!("{topic:<11}{text}");
    }
    println!(
        "         {} GPU(s), prepared in {:.2} s; ms per mode, median of {} (slowest GPU)",
        r.gpus.len(),
        r.prepare_s,
        r.repeat
    );
    println!(
        "{:>6} {:>11} {:>10} {:>10} {:>10} {:>11}  MTTKRP ms per GPU{}",
        "mode",
        "MTTKRP ms",
        "h2d ms",
        "kernel ms",
        "reduce ms",
        "exchange ms",
        error_header(verify)
    );
    for m in &r.modes {
        let per: Vec<String> = m.per_gpu_ms.iter().map(|x| format!("{x:.3}")).collect();
        println!(
            "{:>6} {:>11.3} {:>10.3} {:>10.3} {:>10.3} {:>11.3}  {}{}",
            m.mode,
            m.median_ms,
            m.h2d_ms,
            m.kernel_ms,
            m.reduce_ms,
            m.exchange_ms,
            per.join(" "),
            error_column(m.relative_error)
        );
    }
    if r.modes.len() > 1 {
        println!("{:>6} {:>11.3}", "all", r.total_median_ms);
    }
}

/// Prints the reports as JSON (one object, or `{"runs": [...]}`) with
/// `--json`, then fails if any relative error exceeds its report's
/// `tolerance` (1e-5 unless the report says otherwise: half-precision
/// gathers are checked against what their rounding allows).
fn finish(reports: &[MttkrpReport], as_json: bool, what: &str) -> Result<()> {
    if as_json {
        let value = match reports {
            [one] => serde_json::to_value(one)?,
            all => json!({ "runs": all }),
        };
        println!("{}", serde_json::to_string_pretty(&value)?);
    }
    if let Some((bad, tol)) = reports
        .iter()
        .flat_map(|r| r.relative_errors().map(|e| (e, r.tolerance())))
        .find(|&(e, tol)| e > tol)
    {
        bail!("{what} differs from the f64 reference: relative error {bad:.2e} > {tol:.0e}");
    }
    Ok(())
}

#[cfg(test)]
mod finish_tests {
    use super::*;

    /// A single report printed as JSON must still be checked (it once was
    /// moved out before the check and a bad error passed).
    /// A CPU report of one mode with this relative error.
    fn report(error: f64) -> MttkrpReport {
        MttkrpReport::Cpu(CpuMttkrpReport {
            tensor: kruskal::measure::TensorShape {
                source: "t".into(),
                dims: vec![2, 2, 2],
                nnz: 3,
            },
            backend: "cpu",
            kernel: "csf",
            bytes_per_nnz: 16.0,
            threads: 1,
            rank: 2,
            repeat: 1,
            prepare_s: 0.0,
            modes: vec![kruskal::measure::CpuModeRow {
                mode: 1,
                median_ms: 1.0,
                min_ms: 1.0,
                mnnz_per_s: 1.0,
                mnnz_per_s_per_core: 1.0,
                relative_error: Some(error),
            }],
            total_median_ms: 1.0,
            mnnz_per_s: 1.0,
            mnnz_per_s_per_core: 1.0,
        })
    }

    #[test]
    fn a_large_error_fails_with_and_without_json() {
        let bad = report(1e-3);
        let good = report(1e-8);
        for as_json in [false, true] {
            assert!(finish(std::slice::from_ref(&bad), as_json, "MTTKRP").is_err());
            assert!(finish(&[good.clone(), bad.clone()], as_json, "MTTKRP").is_err());
            assert!(finish(std::slice::from_ref(&good), as_json, "MTTKRP").is_ok());
        }
    }
}
