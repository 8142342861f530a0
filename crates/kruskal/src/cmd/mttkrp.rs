//! `kruskal mttkrp`: time the MTTKRP of each mode (median of K runs).

use std::time::Instant;

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use kruskal_cpd::random_factors;
use kruskal_cpu::{CpuMttkrp, mttkrp_reference, relative_error};
use ndarray::Array2;
use serde_json::json;

use super::common::{InputArgs, dims_text, set_threads, thousands};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    Cpu,
}

#[derive(Args, Debug)]
pub struct MttkrpArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Number of columns of the factor matrices.
    #[arg(long, short, default_value_t = 32)]
    pub rank: usize,
    /// `all`, or one mode numbered from 1.
    #[arg(long, default_value = "all")]
    pub mode: String,
    /// Timed runs per mode (after one warm-up run); the median is reported.
    #[arg(long, default_value_t = 10)]
    pub repeat: usize,
    #[arg(long, value_enum, default_value_t = BackendChoice::Cpu)]
    pub backend: BackendChoice,
    /// Also compare each mode with the f64 reference (slow on big tensors).
    #[arg(long)]
    pub verify: bool,
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    #[arg(long)]
    pub json: bool,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

pub fn run(args: MttkrpArgs) -> Result<()> {
    set_threads(args.threads)?;
    if args.rank == 0 || args.repeat == 0 {
        bail!("--rank and --repeat must be at least 1");
    }
    let loaded = args.input.load()?;
    let t = &loaded.tensor;
    let modes: Vec<usize> = if args.mode == "all" {
        (0..t.nmodes()).collect()
    } else {
        match args.mode.parse::<usize>() {
            Ok(m) if (1..=t.nmodes()).contains(&m) => vec![m - 1],
            _ => bail!(
                "--mode must be 'all' or a mode from 1 to {}, not '{}'",
                t.nmodes(),
                args.mode
            ),
        }
    };
    let threads = rayon::current_num_threads();
    let prep = Instant::now();
    let engine = CpuMttkrp::new(t);
    let prep_s = prep.elapsed().as_secs_f64();
    let factors = random_factors(t.dims(), args.rank, 1);

    if !args.json {
        println!("tensor   {}", loaded.source);
        println!(
            "         {}, {} nonzeros; rank {}; cpu, {threads} threads; prepared in {:.2} s",
            dims_text(t.dims()),
            thousands(t.nnz() as u64),
            args.rank,
            prep_s
        );
        println!(
            "{:>6} {:>11} {:>11} {:>14} {:>16}{}",
            "mode",
            "median ms",
            "min ms",
            "Mnnz/s",
            "Mnnz/s per core",
            if args.verify { "   rel. error" } else { "" }
        );
    }
    let mut rows = Vec::new();
    let mut total_ms = 0.0;
    for &mode in &modes {
        let mut out = Array2::<f32>::zeros((t.dims()[mode] as usize, args.rank));
        engine.mttkrp(mode, &factors, &mut out)?;
        let mut times: Vec<f64> = (0..args.repeat)
            .map(|_| {
                let s = Instant::now();
                engine
                    .mttkrp(mode, &factors, &mut out)
                    .map(|_| s.elapsed().as_secs_f64() * 1e3)
            })
            .collect::<Result<_, _>>()?;
        let min_ms = times.iter().copied().fold(f64::INFINITY, f64::min);
        let ms = median(&mut times);
        total_ms += ms;
        let rate = t.nnz() as f64 / (ms * 1e-3) / 1e6;
        let error = if args.verify {
            let views: Vec<_> = factors.iter().map(|f| f.view()).collect();
            let exact = mttkrp_reference(t, &views, mode)?;
            Some(relative_error(out.view(), exact.view()))
        } else {
            None
        };
        if !args.json {
            println!(
                "{:>6} {:>11.3} {:>11.3} {:>14.1} {:>16.1}{}",
                mode + 1,
                ms,
                min_ms,
                rate,
                rate / threads as f64,
                error.map_or(String::new(), |e| format!("   {e:.2e}"))
            );
        }
        rows.push(json!({
            "mode": mode + 1, "median_ms": ms, "min_ms": min_ms,
            "mnnz_per_s": rate, "mnnz_per_s_per_core": rate / threads as f64,
            "relative_error": error,
        }));
    }
    let rate_all = t.nnz() as f64 * modes.len() as f64 / (total_ms * 1e-3) / 1e6;
    if args.json {
        let value = json!({
            "tensor": { "source": loaded.source, "dims": t.dims(), "nnz": t.nnz() },
            "backend": "cpu", "threads": threads, "rank": args.rank,
            "repeat": args.repeat, "prepare_s": prep_s, "modes": rows,
            "total_median_ms": total_ms, "mnnz_per_s": rate_all,
            "mnnz_per_s_per_core": rate_all / threads as f64,
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else if modes.len() > 1 {
        println!(
            "{:>6} {:>11.3} {:>11} {:>14.1} {:>16.1}",
            "all",
            total_ms,
            "",
            rate_all,
            rate_all / threads as f64
        );
    }
    if let Some(bad) = rows
        .iter()
        .filter_map(|r| r["relative_error"].as_f64())
        .find(|&e| e > 1e-5)
    {
        bail!("MTTKRP differs from the f64 reference: relative error {bad:.2e} > 1e-5");
    }
    Ok(())
}
