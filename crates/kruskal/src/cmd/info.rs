//! `kruskal info`: what a tensor file holds (shape, nonzeros, per-mode
//! statistics). Run it to check a file before a long decomposition.

use anyhow::{Result, bail};
use clap::Args;
use serde_json::json;

use super::common::{InputArgs, dims_text, thousands};

#[derive(Args, Debug)]
pub struct InfoArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Also sum duplicate coordinates and report how many there were.
    #[arg(long)]
    pub duplicates: bool,
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: InfoArgs) -> Result<()> {
    if args.input.file.is_none() && args.input.like.is_none() {
        bail!("give a tensor FILE (or --like NAME)");
    }
    let loaded = args.input.load()?;
    let mut t = loaded.tensor;
    let duplicates = if args.duplicates {
        Some(t.coalesce())
    } else {
        None
    };
    let s = t.stats();
    let bytes = t.nnz() * (4 * t.nmodes() + 4);
    if args.json {
        let modes: Vec<_> = s
            .modes
            .iter()
            .enumerate()
            .map(|(m, ms)| {
                json!({
                    "mode": m + 1, "dim": ms.dim, "nonempty_slices": ms.nonempty_slices,
                    "empty_slices": ms.empty_slices, "degree_min": ms.degree_min,
                    "degree_mean": ms.degree_mean, "degree_max": ms.degree_max,
                    "hottest_index": ms.hottest_index + 1,
                    "hottest_share": ms.degree_max as f64 / s.nnz.max(1) as f64,
                })
            })
            .collect();
        let value = json!({
            "source": loaded.source, "nmodes": t.nmodes(), "dims": t.dims(), "nnz": s.nnz,
            "density": s.density, "norm": s.norm, "coo_bytes": bytes,
            "duplicates_merged": duplicates, "load_s": loaded.load_s, "modes": modes,
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    println!("tensor    {}", loaded.source);
    println!("modes     {}", t.nmodes());
    println!("dims      {}", dims_text(t.dims()));
    println!("nnz       {}", thousands(s.nnz));
    println!("density   {:.3e}", s.density);
    println!("norm      {:.6e}", s.norm);
    println!(
        "memory    {:.1} MiB as COO ({} bytes per nonzero)",
        bytes as f64 / (1 << 20) as f64,
        4 * t.nmodes() + 4
    );
    if let Some(d) = duplicates {
        println!("merged    {} duplicate nonzeros", thousands(d as u64));
    }
    println!("loaded in {:.2} s", loaded.load_s);
    println!();
    println!(
        "{:>5} {:>12} {:>12} {:>10} {:>8} {:>10} {:>12} {:>8} {:>12}",
        "mode", "dim", "nonempty", "empty", "min", "mean", "max", "max %", "hottest"
    );
    for (m, ms) in s.modes.iter().enumerate() {
        println!(
            "{:>5} {:>12} {:>12} {:>10} {:>8} {:>10.1} {:>12} {:>8.2} {:>12}",
            m + 1,
            thousands(u64::from(ms.dim)),
            thousands(ms.nonempty_slices),
            thousands(ms.empty_slices),
            ms.degree_min,
            ms.degree_mean,
            thousands(ms.degree_max),
            100.0 * ms.degree_max as f64 / s.nnz.max(1) as f64,
            ms.hottest_index + 1
        );
    }
    Ok(())
}
