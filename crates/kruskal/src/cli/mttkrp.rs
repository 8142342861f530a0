//! `kruskal mttkrp`: time the MTTKRP of each mode (median of K runs). The
//! flags become [`MttkrpOptions`] and [`kruskal::measure::mttkrp`] does the
//! work, as it does for `cargo xtask bench`.

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use serde_json::json;

use super::common::{GpuArgs, InputArgs, MultiGpuArgs, parse_rank, parse_threads, set_threads};
use kruskal::measure::{MttkrpBackend, MttkrpOptions, TOLERANCE};

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
            quiet: self.json,
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
    finish(&reports, args.json, "MTTKRP")
}

/// Prints the reports as JSON (one object, or `{"runs": [...]}`) with
/// `--json`, then fails if any relative error exceeds its report's
/// `tolerance` (1e-5 unless the report says otherwise: half-precision
/// gathers are checked against what their rounding allows).
fn finish(reports: &[serde_json::Value], as_json: bool, what: &str) -> Result<()> {
    if as_json {
        let value = match reports {
            [one] => one.clone(),
            all => json!({ "runs": all }),
        };
        println!("{}", serde_json::to_string_pretty(&value)?);
    }
    if let Some((bad, tol)) = reports_errors(reports)
        .into_iter()
        .find(|&(e, tol)| e > tol)
    {
        bail!("{what} differs from the f64 reference: relative error {bad:.2e} > {tol:.0e}");
    }
    Ok(())
}

/// Every relative error recorded in the reports (printed JSON included),
/// with its report's tolerance.
fn reports_errors(reports: &[serde_json::Value]) -> Vec<(f64, f64)> {
    reports
        .iter()
        .flat_map(|r| {
            let tol = r["tolerance"].as_f64().unwrap_or(TOLERANCE);
            r["modes"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter_map(move |m| m["relative_error"].as_f64().map(|e| (e, tol)))
        })
        .collect()
}

#[cfg(test)]
mod finish_tests {
    use super::*;

    /// A single report printed as JSON must still be checked (it once was
    /// moved out before the check and a bad error passed).
    #[test]
    fn a_large_error_fails_with_and_without_json() {
        let bad = json!({"modes": [{"mode": 1, "relative_error": 1e-3}]});
        let good = json!({"modes": [{"mode": 1, "relative_error": 1e-8}]});
        for as_json in [false, true] {
            assert!(finish(std::slice::from_ref(&bad), as_json, "MTTKRP").is_err());
            assert!(finish(&[good.clone(), bad.clone()], as_json, "MTTKRP").is_err());
            assert!(finish(std::slice::from_ref(&good), as_json, "MTTKRP").is_ok());
        }
    }
}
