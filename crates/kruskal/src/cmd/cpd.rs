//! `kruskal cpd`: CP decomposition of a tensor file, or of a planted
//! low-rank tensor with `--demo`.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kruskal_cpd::{
    CpdOptions, CpuBackend, Init, IterationStats, KruskalModel, cpd_als_with, factor_match_score,
    load_factors,
};
use kruskal_formats::generate::{PlantedSpec, planted};
use serde_json::json;

use kruskal_cpu::CpuKernel;

use super::common::{InputArgs, Loaded, dims_text, parse_cpu_kernel, set_threads, thousands};

#[derive(Args, Debug)]
pub struct CpdArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Decompose a generated planted low-rank tensor (no file needed) and
    /// report how well the planted factors are recovered.
    #[arg(long, conflicts_with_all = ["file", "like"])]
    pub demo: bool,
    /// Number of components (default 10, or the planted rank with --demo).
    #[arg(long, short)]
    pub rank: Option<usize>,
    /// Iteration limit.
    #[arg(long, default_value_t = kruskal_cpd::als::DEFAULT_MAX_ITERS)]
    pub iters: usize,
    /// Stop when the fit changes by less than this.
    #[arg(long, default_value_t = kruskal_cpd::als::DEFAULT_TOL)]
    pub tol: f64,
    /// Seed of the random initial factors.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Run from this many random starts (seeds SEED, SEED+1, ...) and keep
    /// the model with the best fit: ALS from one start can stop in a local
    /// minimum. Default 1, or 3 with --demo.
    #[arg(long, conflicts_with = "init")]
    pub starts: Option<usize>,
    /// Start from the factors in DIR (mode-1.npy .. mode-N.npy, optional
    /// lambda.npy), e.g. the output of an earlier run.
    #[arg(long, value_name = "DIR")]
    pub init: Option<PathBuf>,
    /// Write lambda.npy and mode-<n>.npy (numpy format) into DIR.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// MTTKRP engine: auto, sorted, fcoo, flycoo or hicoo (auto picks the
    /// fastest on the CPU; see docs/formats.md).
    #[arg(long, default_value = "auto", value_parser = parse_cpu_kernel)]
    pub kernel: CpuKernel,
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Rank of the demo's planted tensor.
const DEMO_RANK: usize = 10;

fn demo_tensor() -> Result<(Loaded, kruskal_formats::generate::Planted)> {
    let start = Instant::now();
    let spec = PlantedSpec {
        dims: vec![2_000, 1_500, 1_000],
        rank: DEMO_RANK,
        nnz: 1_000_000,
        noise: 0.0,
        seed: 7,
    };
    let p = planted(&spec)?;
    let loaded = Loaded {
        tensor: p.tensor.clone(),
        source: format!(
            "demo: planted rank-{} tensor, seed {}",
            spec.rank, spec.seed
        ),
        load_s: start.elapsed().as_secs_f64(),
    };
    Ok((loaded, p))
}

pub fn run(args: CpdArgs) -> Result<()> {
    set_threads(args.threads)?;
    let (loaded, truth) = if args.demo {
        let (loaded, p) = demo_tensor()?;
        (loaded, Some(p))
    } else {
        if args.input.file.is_none() && args.input.like.is_none() {
            bail!("give a tensor FILE (or --like NAME, or --demo)");
        }
        (args.input.load()?, None)
    };
    let rank = args.rank.unwrap_or(DEMO_RANK);
    if rank == 0 {
        bail!("--rank must be at least 1");
    }
    let tensor = &loaded.tensor;
    let init = match &args.init {
        Some(dir) => {
            let factors = load_factors(dir, tensor.nmodes())?;
            if factors[0].ncols() != rank && args.rank.is_some() {
                bail!(
                    "{}: the initial factors have rank {}, --rank is {rank}",
                    dir.display(),
                    factors[0].ncols()
                );
            }
            Init::Given(factors)
        }
        None => Init::Random { seed: args.seed },
    };
    let rank = match &init {
        Init::Given(f) => f[0].ncols(),
        Init::Random { .. } => rank,
    };
    let opts = CpdOptions {
        rank,
        max_iters: args.iters,
        tol: args.tol,
        init,
    };

    if !args.json {
        println!("tensor     {}", loaded.source);
        println!(
            "           {} modes, {}, {} nonzeros (loaded in {:.2} s)",
            tensor.nmodes(),
            dims_text(tensor.dims()),
            thousands(tensor.nnz() as u64),
            loaded.load_s
        );
    }
    let prep = Instant::now();
    let mut backend = CpuBackend::with_kernel(tensor, args.kernel)?;
    let prep_s = prep.elapsed().as_secs_f64();
    if !args.json {
        println!(
            "backend    cpu, {} threads, {} kernel (prepared in {:.2} s)",
            rayon::current_num_threads(),
            backend.kernel_name(),
            prep_s
        );
        println!(
            "rank {rank}, up to {} iterations, tol {:e}",
            opts.max_iters, opts.tol
        );
    }

    let starts = args.starts.unwrap_or(if args.demo { 3 } else { 1 });
    if starts == 0 {
        bail!("--starts must be at least 1");
    }
    let start = Instant::now();
    let mut runs: Vec<(u64, KruskalModel)> = Vec::with_capacity(starts);
    for k in 0..starts {
        let seed = args.seed + k as u64;
        let mut opts = opts.clone();
        if starts > 1 {
            opts.init = Init::Random { seed };
            if !args.json {
                println!("start {} of {starts} (seed {seed})", k + 1);
            }
        }
        let model = run_one(&mut backend, &opts, args.json)?;
        runs.push((seed, model));
    }
    let cpd_s = start.elapsed().as_secs_f64();
    let summaries: Vec<_> = runs
        .iter()
        .map(|(seed, m)| json!({"seed": seed, "fit": m.fit(), "iterations": m.iterations.len()}))
        .collect();
    if starts > 1 && !args.json {
        for (seed, m) in &runs {
            println!(
                "start seed {seed}: fit {:.6} after {} iterations",
                m.fit(),
                m.iterations.len()
            );
        }
    }
    let (_, model) = runs
        .into_iter()
        .max_by(|a, b| a.1.fit().total_cmp(&b.1.fit()))
        .expect("at least one start");

    let fms = truth
        .as_ref()
        .map(|p| factor_match_score(&model.lambda, &model.factors, &p.lambda, &p.factors));
    if let Some(dir) = &args.out {
        model
            .save(dir)
            .with_context(|| format!("writing the model to {}", dir.display()))?;
    }

    if args.json {
        print_json(
            &loaded,
            &model,
            (backend.kernel_name(), prep_s),
            cpd_s,
            fms,
            &summaries,
            args.out.as_ref(),
        )?;
    } else {
        print_summary(&model, cpd_s, starts, fms, args.out.as_ref());
    }
    if let Some(fms) = fms {
        if model.fit() < 0.99 || fms < 0.95 {
            bail!(
                "the demo did not recover the planted tensor (fit {:.4}, factor match {:.4})",
                model.fit(),
                fms
            );
        }
    }
    Ok(())
}

/// One CPD run with a progress bar and, unless `json`, a line per
/// iteration.
fn run_one(backend: &mut CpuBackend, opts: &CpdOptions, json: bool) -> Result<KruskalModel> {
    let bar = ProgressBar::new(opts.max_iters as u64);
    bar.set_style(
        ProgressStyle::with_template("iterating [{bar:30}] {pos}/{len} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut report = |s: &IterationStats| {
        bar.set_position(s.iteration as u64);
        bar.set_message(format!("fit {:.6}", s.fit));
        if !json {
            bar.suspend(|| {
                println!(
                    "  its = {:3} ({:.3}s)  fit = {:.6}  delta = {:+.4e}",
                    s.iteration,
                    s.mttkrp_s + s.other_s,
                    s.fit,
                    s.delta
                )
            });
        }
        ControlFlow::Continue(())
    };
    let model = cpd_als_with(backend, opts, &mut report);
    bar.finish_and_clear();
    Ok(model?)
}

fn print_summary(
    model: &KruskalModel,
    cpd_s: f64,
    starts: usize,
    fms: Option<f64>,
    out: Option<&PathBuf>,
) {
    let its = model.iterations.len();
    let mttkrp: f64 = model.iterations.iter().map(|s| s.mttkrp_s).sum();
    let other: f64 = model.iterations.iter().map(|s| s.other_s).sum();
    let how = if model.converged {
        "converged"
    } else if model.interrupted {
        "interrupted"
    } else {
        "iteration limit reached"
    };
    println!(
        "final fit  {:.6} after {its} iterations ({how})",
        model.fit()
    );
    if starts > 1 {
        println!("time       {cpd_s:.3} s for {starts} starts; the kept run:");
    }
    let run_s = mttkrp + other;
    println!(
        "time       {:.3} s: MTTKRP {:.3} s ({:.0}%), other {:.3} s, {:.4} s per iteration",
        if starts > 1 { run_s } else { cpd_s },
        mttkrp,
        100.0 * mttkrp / run_s.max(f64::MIN_POSITIVE),
        other,
        run_s / its.max(1) as f64
    );
    if model.pseudo_inverse_solves > 0 {
        println!(
            "note       {} mode updates had a singular Gram product and used the pseudo-inverse",
            model.pseudo_inverse_solves
        );
    }
    let shown: Vec<String> = model
        .lambda
        .iter()
        .take(5)
        .map(|l| format!("{l:.4e}"))
        .collect();
    println!(
        "lambda     {}{}",
        shown.join(" "),
        if model.lambda.len() > 5 { " ..." } else { "" }
    );
    if let Some(fms) = fms {
        println!(
            "demo       fit {:.4} (needs >= 0.99), factor match score {:.4} against the planted factors",
            model.fit(),
            fms
        );
    }
    if let Some(dir) = out {
        println!(
            "wrote      {}/lambda.npy, mode-1.npy .. mode-{}.npy",
            dir.display(),
            model.factors.len()
        );
    }
}

fn print_json(
    loaded: &Loaded,
    model: &KruskalModel,
    (kernel, prep_s): (&str, f64),
    cpd_s: f64,
    fms: Option<f64>,
    starts: &[serde_json::Value],
    out: Option<&PathBuf>,
) -> Result<()> {
    let t = &loaded.tensor;
    let value = json!({
        "tensor": {
            "source": loaded.source,
            "dims": t.dims(),
            "nnz": t.nnz(),
            "load_s": loaded.load_s,
        },
        "backend": "cpu",
        "kernel": kernel,
        "threads": rayon::current_num_threads(),
        "rank": model.rank(),
        "prepare_s": prep_s,
        "cpd_s": cpd_s,
        "fit": model.fit(),
        "converged": model.converged,
        "interrupted": model.interrupted,
        "pseudo_inverse_solves": model.pseudo_inverse_solves,
        "iterations": model.iterations,
        "starts": starts,
        "lambda": model.lambda,
        "factor_match_score": fms,
        "out": out.map(|p| p.display().to_string()),
    });
    println!("{}", serde_json::to_string_pretty(&value)?);
    Ok(())
}
