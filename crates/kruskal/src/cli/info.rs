//! `kruskal info`: what a tensor file holds (shape, nonzeros, per-mode
//! statistics). Run it to check a file before a long decomposition.

use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use serde_json::json;

use kruskal_partition::layout::unit_weights;
use kruskal_partition::{Balance, ShardOptions, ShardPlan, cyclic, lpt};
use kruskal_tune::{ModeFeatures, TensorFeatures};

use super::common::InputArgs;
use kruskal::console::{dims_text, thousands};

#[derive(Args, Debug)]
pub struct InfoArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Accepted for old scripts: lines that repeat a coordinate are always
    /// summed, and their count is always shown.
    #[arg(long, hide = true)]
    pub duplicates: bool,
    /// Report how evenly each mode's output rows spread over K partitions
    /// (FLYCOO thread blocks): greedy LPT with heavy rows split, against
    /// cyclic assignment and LPT on whole rows.
    #[arg(long, value_name = "K")]
    pub kappa: Option<usize>,
    /// Report the AMPED plan over M GPUs: nonzeros per GPU and per ISP.
    #[arg(long, value_name = "M")]
    pub gpus: Option<usize>,
    /// Show the CUDA GPUs (name, SMs, memory, L2, shared memory per block)
    /// or why none can be used.
    #[arg(long)]
    pub gpu: bool,
    /// Report the features the GPU tuning model reads, per mode: slices,
    /// fibers (distinct pairs of the mode's index and its fiber mode's, the
    /// other mode with the smallest dimension), their ratios, the largest
    /// and mean nonzeros per slice and per fiber, and the skew of the
    /// slice sizes (see `kruskal_tune::features`).
    #[arg(long)]
    pub features: bool,
    /// ISPs per GPU for --gpus (a few per SM; 528 = 4 x 132 SMs of an H100).
    #[arg(long, default_value_t = 528)]
    pub isps: usize,
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: InfoArgs) -> Result<()> {
    let no_tensor = args.input.file.is_none() && args.input.like.is_none();
    if args.gpu {
        print_gpus(args.json)?;
        if no_tensor {
            return Ok(());
        }
        println!();
    }
    if no_tensor {
        bail!("give a tensor FILE (or --like NAME), or --gpu");
    }
    let loaded = args.input.load()?;
    let t = loaded.tensor;
    let duplicates = loaded.merged;
    if args.kappa == Some(0) || args.gpus == Some(0) || args.isps == 0 {
        bail!("--kappa, --gpus and --isps must be at least 1");
    }
    if args.kappa.is_some() || args.gpus.is_some() {
        // Partitions and shard plans count the nonzeros of every index of
        // every mode.
        let counts = kruskal_cpd::memory::counts_need(t.dims(), rayon::current_num_threads());
        super::preflight::check_host_memory(&counts, &t, false)?;
    }
    let s = t.stats();
    let partitions: Vec<PartitionReport> = match args.kappa {
        Some(kappa) => (0..t.nmodes())
            .map(|m| PartitionReport::new(&t.mode_counts(m), kappa))
            .collect(),
        None => Vec::new(),
    };
    let shards: Vec<ShardPlan> = match args.gpus {
        Some(gpus) => ShardPlan::for_all_modes(&t, &ShardOptions::new(gpus, args.isps))?,
        None => Vec::new(),
    };
    let features = if args.features {
        let start = Instant::now();
        let f = TensorFeatures::compute(&t);
        Some((f, start.elapsed().as_secs_f64()))
    } else {
        None
    };
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
            "duplicates_merged": duplicates, "load_s": loaded.load_s,
            "coalesce_s": loaded.coalesce_s, "modes": modes,
            "partitions": partitions.iter().enumerate().map(|(m, p)| p.json(m)).collect::<Vec<_>>(),
            "gpus": shards.iter().map(shard_json).collect::<Vec<_>>(),
            "features": features.as_ref().map(|(f, secs)| features_json(f, *secs)),
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
    println!(
        "merged    {} lines that repeat a coordinate",
        thousands(duplicates as u64)
    );
    println!(
        "loaded in {:.2} s ({:.2} s of it on repeated coordinates)",
        loaded.load_s, loaded.coalesce_s
    );
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
    if let Some((f, secs)) = &features {
        print_features(f, *secs);
    }
    if let Some(kappa) = args.kappa {
        println!();
        println!(
            "partitions: {kappa} (largest / mean nonzeros per partition; rows above nnz/{kappa} split)"
        );
        println!(
            "{:>5} {:>12} {:>10} {:>12} {:>12} {:>12}",
            "mode", "threshold", "split rows", "LPT", "cyclic", "LPT whole"
        );
        for (m, p) in partitions.iter().enumerate() {
            println!(
                "{:>5} {:>12} {:>10} {:>12.3} {:>12.3} {:>12.3}",
                m + 1,
                thousands(p.threshold),
                thousands(p.split_rows),
                p.lpt.max_over_mean(),
                p.cyclic.max_over_mean(),
                p.whole.max_over_mean()
            );
        }
    }
    if let Some(gpus) = args.gpus {
        println!();
        println!(
            "GPUs: {gpus}, {} ISPs each (largest / mean nonzeros)",
            args.isps
        );
        println!(
            "{:>5} {:>14} {:>14} {:>10} {:>10} {:>14}",
            "mode", "largest shard", "smallest", "per GPU", "per ISP", "shared rows"
        );
        for plan in &shards {
            let g = plan.gpu_balance();
            println!(
                "{:>5} {:>14} {:>14} {:>10.3} {:>10.3} {:>14}",
                plan.mode() + 1,
                thousands(g.max),
                thousands(g.min),
                g.max_over_mean(),
                plan.isp_balance().max_over_mean(),
                thousands(plan.layout().shared().len() as u64)
            );
        }
    }
    Ok(())
}

/// One row of the features table: a name and how to read it from a mode.
type FeatureRow = (&'static str, fn(&ModeFeatures) -> String);

/// The rows of the features table and of its JSON, in order.
const FEATURE_ROWS: &[FeatureRow] = &[
    ("dim", |m| thousands(u64::from(m.dim))),
    ("fiber mode", |m| {
        m.fiber_mode.map_or("-".into(), |f| (f + 1).to_string())
    }),
    ("slices", |m| thousands(m.slices)),
    ("fibers", |m| thousands(m.fibers)),
    ("slices / dim", |m| format!("{:.4}", m.slice_ratio)),
    ("fibers / slice", |m| format!("{:.2}", m.fibers_per_slice)),
    ("max fibers / slice", |m| thousands(m.max_fibers_per_slice)),
    ("nnz / slice", |m| format!("{:.2}", m.nnz_per_slice)),
    ("max nnz / slice", |m| thousands(m.max_nnz_per_slice)),
    ("nnz / fiber", |m| format!("{:.3}", m.nnz_per_fiber)),
    ("max nnz / fiber", |m| thousands(m.max_nnz_per_fiber)),
    ("slice max / mean", |m| format!("{:.2}", m.slice_skew)),
    ("slice CV", |m| format!("{:.3}", m.slice_cv)),
    ("slice Gini", |m| format!("{:.3}", m.slice_gini)),
    ("fiber max / mean", |m| format!("{:.2}", m.fiber_skew)),
    ("fiber CV", |m| format!("{:.3}", m.fiber_cv)),
    ("hottest slice share", |m| format!("{:.4}", m.hot_share)),
];

/// Prints the features: one row per feature, one column per mode.
fn print_features(f: &TensorFeatures, secs: f64) {
    println!();
    println!("features (computed in {secs:.2} s; fibers pair a mode with its fiber mode)");
    print!("{:<20}", "");
    for m in &f.modes {
        print!(" {:>14}", format!("mode {}", m.mode + 1));
    }
    println!();
    for (name, get) in FEATURE_ROWS {
        print!("{name:<20}");
        for m in &f.modes {
            print!(" {:>14}", get(m));
        }
        println!();
    }
}

fn features_json(f: &TensorFeatures, secs: f64) -> serde_json::Value {
    let modes: Vec<_> = f
        .modes
        .iter()
        .map(|m| {
            json!({
                "mode": m.mode + 1, "dim": m.dim, "fiber_mode": m.fiber_mode.map(|w| w + 1),
                "slices": m.slices, "fibers": m.fibers, "slice_ratio": m.slice_ratio,
                "fibers_per_slice": m.fibers_per_slice,
                "max_fibers_per_slice": m.max_fibers_per_slice,
                "nnz_per_slice": m.nnz_per_slice, "max_nnz_per_slice": m.max_nnz_per_slice,
                "nnz_per_fiber": m.nnz_per_fiber, "max_nnz_per_fiber": m.max_nnz_per_fiber,
                "slice_skew": m.slice_skew, "slice_cv": m.slice_cv, "slice_gini": m.slice_gini,
                "fiber_skew": m.fiber_skew, "fiber_cv": m.fiber_cv, "hot_share": m.hot_share,
            })
        })
        .collect();
    json!({
        "nmodes": f.nmodes(), "nnz": f.nnz, "density": f.density,
        "seconds": secs, "modes": modes,
    })
}

/// Predicted balance of one mode over kappa partitions, from its row counts.
struct PartitionReport {
    threshold: u64,
    split_rows: u64,
    lpt: Balance,
    cyclic: Balance,
    whole: Balance,
}

impl PartitionReport {
    fn new(counts: &[u64], kappa: usize) -> Self {
        let nnz: u64 = counts.iter().sum();
        let threshold = nnz.div_ceil(kappa as u64).max(1);
        let units = unit_weights(counts, threshold);
        let whole = unit_weights(counts, u64::MAX);
        PartitionReport {
            threshold,
            split_rows: counts.iter().filter(|&&c| c > threshold).count() as u64,
            lpt: lpt(&units, kappa).balance(),
            cyclic: cyclic(&units, kappa).balance(),
            whole: lpt(&whole, kappa).balance(),
        }
    }

    fn json(&self, mode: usize) -> serde_json::Value {
        json!({
            "mode": mode + 1, "threshold": self.threshold, "split_rows": self.split_rows,
            "lpt_max_over_mean": self.lpt.max_over_mean(),
            "cyclic_max_over_mean": self.cyclic.max_over_mean(),
            "whole_rows_lpt_max_over_mean": self.whole.max_over_mean(),
            "lpt_max": self.lpt.max, "mean": self.lpt.mean,
        })
    }
}

fn shard_json(plan: &ShardPlan) -> serde_json::Value {
    let g = plan.gpu_balance();
    json!({
        "mode": plan.mode() + 1, "gpus": plan.gpus(),
        "largest_shard": g.max, "smallest_shard": g.min,
        "gpu_max_over_mean": g.max_over_mean(),
        "isp_max_over_mean": plan.isp_balance().max_over_mean(),
        "shared_rows_pieces": plan.layout().shared().len(),
    })
}

/// Prints every CUDA GPU's properties; an error (with the reason) if the
/// driver or NVRTC cannot be loaded or there is no GPU.
fn print_gpus(as_json: bool) -> Result<()> {
    let count = kruskal_device::Gpu::count()?;
    if count == 0 {
        return Err(kruskal_device::DeviceError::NoDevice {
            ordinal: 0,
            count: 0,
        }
        .into());
    }
    let mut all = Vec::new();
    for ordinal in 0..count {
        let gpu = kruskal_device::Gpu::open(ordinal)?;
        let p = gpu.properties();
        if as_json {
            all.push(json!({
                "ordinal": p.ordinal, "name": p.name, "arch": p.arch(), "sms": p.sms,
                "total_bytes": p.total_bytes, "free_bytes": p.free_bytes, "l2_bytes": p.l2_bytes,
                "shared_per_block": p.shared_per_block,
                "shared_per_block_optin": p.shared_per_block_optin,
                "max_threads_per_block": p.max_threads_per_block,
                "driver_version": p.driver_version,
            }));
        } else {
            let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
            println!(
                "gpu {}     {} ({}), driver CUDA {}.{}",
                p.ordinal,
                p.name,
                p.arch(),
                p.driver_version / 1000,
                p.driver_version % 1000 / 10
            );
            println!(
                "          {} SMs, {:.1} GiB ({:.1} GiB free), L2 {:.1} MiB, shared memory {} KiB per block ({} KiB opt-in), {} threads per block",
                p.sms,
                gib(p.total_bytes),
                gib(p.free_bytes),
                p.l2_bytes as f64 / (1 << 20) as f64,
                p.shared_per_block / 1024,
                p.shared_per_block_optin / 1024,
                p.max_threads_per_block
            );
        }
    }
    if as_json {
        println!("{}", serde_json::to_string_pretty(&json!({ "gpus": all }))?);
    }
    Ok(())
}
