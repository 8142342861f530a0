//! `kruskal cp-apr`: the Poisson CP decomposition of a count tensor
//! (CP-APR with multiplicative updates, as pyttb's `cp_apr(algorithm="mu")`),
//! on the CPU, one GPU (`--backend`) or several (`--gpus`).

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use kruskal::measure;
use kruskal_cpd::apr::{self, AprInit, AprModel, AprOptions};
use kruskal_cpd::{AprRun, BackendChoice, IterationTotals, KruskalModel, load_factors};

use super::common::{InputArgs, parse_rank, parse_seed, parse_threads, set_threads};
use super::cpd::BackendArg;
use super::{cleanup, preflight};

#[derive(Args, Debug)]
pub struct CpAprArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Number of components.
    #[arg(long, short, default_value_t = 10, allow_negative_numbers = true, value_parser = parse_rank)]
    pub rank: usize,
    /// Outer iteration limit (pyttb's maxiters; 0: the output is the
    /// normalized initial factors).
    #[arg(long, default_value_t = apr::DEFAULT_MAX_ITERS, allow_negative_numbers = true)]
    pub iters: usize,
    /// Multiplicative updates per mode and outer iteration at most
    /// (maxinneriters).
    #[arg(long, default_value_t = apr::DEFAULT_MAX_INNER_ITERS, allow_negative_numbers = true)]
    pub inner_iters: usize,
    /// Stop when every mode's KKT violation is below this (stoptol).
    #[arg(long, default_value_t = apr::DEFAULT_TOL, allow_negative_numbers = true)]
    pub tol: f64,
    /// Offset added to factor entries stuck at zero that the data wants
    /// to grow (kappa).
    #[arg(long, default_value_t = apr::DEFAULT_KAPPA, allow_negative_numbers = true)]
    pub kappa: f64,
    /// Entries below this count as zero for the kappa fix (kappatol).
    #[arg(long, default_value_t = apr::DEFAULT_KAPPA_TOL, allow_negative_numbers = true)]
    pub kappa_tol: f64,
    /// Floor of the model's value where it divides a count (epsDivZero).
    #[arg(long, default_value_t = apr::DEFAULT_EPS_DIV_ZERO, allow_negative_numbers = true)]
    pub eps_div_zero: f64,
    /// Stop after the outer iteration that ends past this many seconds
    /// (stoptime).
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub time_limit: Option<f64>,
    /// Seed of the random initial factors (uniform in [0, 1), the ones
    /// `kruskal cpd --seed` draws).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = parse_seed)]
    pub seed: u64,
    /// Start from the non-negative factors in DIR (mode-1.npy ..
    /// mode-N.npy, optional lambda.npy).
    #[arg(long, value_name = "DIR")]
    pub init: Option<PathBuf>,
    /// Write lambda.npy and mode-<n>.npy (f32, columns of unit 1-norm)
    /// into DIR.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Where to run: auto (the GPU when one is usable, takes the rank and
    /// has the memory, else the CPU; the output says which ran and why),
    /// cpu, or gpu (the first CUDA GPU; an error when it cannot run).
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
    /// Run on several GPUs of this host: a count (the first N) or `all`
    /// (a GPU per million nonzeros, up to every GPU; the output says
    /// when fewer). Each GPU owns a range of every mode's rows, cut to
    /// equal nonzeros; the rows travel by peer copies after each mode.
    #[arg(long, value_name = "N|all")]
    pub gpus: Option<String>,
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = parse_threads)]
    pub threads: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

fn options(args: &CpAprArgs, nmodes: usize) -> Result<AprOptions> {
    let init = match &args.init {
        Some(dir) => {
            let factors = load_factors(dir, nmodes)?;
            if factors[0].ncols() != args.rank {
                bail!(
                    "{}: the initial factors have rank {}, --rank is {}",
                    dir.display(),
                    factors[0].ncols(),
                    args.rank
                );
            }
            AprInit::Given {
                factors: factors.iter().map(|f| f.mapv(f64::from)).collect(),
                weights: None,
            }
        }
        None => AprInit::Random { seed: args.seed },
    };
    Ok(AprOptions {
        rank: args.rank,
        max_iters: args.iters,
        max_inner_iters: args.inner_iters,
        tol: args.tol,
        kappa: args.kappa,
        kappa_tol: args.kappa_tol,
        eps_div_zero: args.eps_div_zero,
        time_limit_s: args.time_limit,
        init,
    })
}

pub fn run(args: CpAprArgs) -> Result<()> {
    set_threads(args.threads)?;
    if args.input.file.is_none() && args.input.like.is_none() {
        bail!("give a tensor FILE (or --like NAME)");
    }
    if args.gpus.is_some() && args.backend == BackendArg::Cpu {
        bail!("--gpus runs on GPUs; it does not go with --backend cpu");
    }
    // `--gpus`: None for all, else the count.
    let asked = match args.gpus.as_deref() {
        None => None,
        Some("all") => Some(None),
        Some(text) => Some(Some(text.parse::<usize>().map_err(|_| {
            anyhow::anyhow!("--gpus takes a count or 'all', not '{text}'")
        })?)),
    };
    if args.backend == BackendArg::Gpu || args.gpus.is_some() {
        preflight::check_gpu_present()?;
    }
    let loaded = args.input.load()?;
    let tensor = &loaded.tensor;
    let opts = options(&args, tensor.nmodes())?;
    let stop = super::cpd::interrupt_flag()?;
    let out_dir = match &args.out {
        Some(dir) => Some(preflight::OutDir::for_model(dir, tensor.dims(), args.rank)?),
        None => None,
    };
    if !args.json {
        let non_integer = apr::non_integer_values(tensor);
        println!(
            "tensor     {}: {} nonzeros, dims {:?}",
            loaded.source,
            tensor.nnz(),
            tensor.dims()
        );
        if non_integer > 0 {
            println!(
                "note       {non_integer} values are not whole numbers; the Poisson model is meant for counts"
            );
        }
    }
    let start = Instant::now();
    let quiet = args.json;
    let choice = match args.backend {
        BackendArg::Auto => BackendChoice::Auto,
        BackendArg::Cpu => BackendChoice::Cpu,
        BackendArg::Gpu => BackendChoice::Gpu,
    };
    let gpus = match asked {
        None => None,
        Some(None) => Some(kruskal_cpd::apr_all_gpus(
            tensor.nnz(),
            kruskal_device::Gpu::count()?,
        )),
        Some(Some(n)) => Some((kruskal_cpd::decompose::first_gpus(n)?, None)),
    };
    let run_opts = measure::CpAprRunOptions {
        apr: opts,
        backend: choice,
        gpus,
    };
    let mut last_s = 0.0;
    let run = measure::run_cp_apr(tensor, &run_opts, &mut |s| {
        if !quiet {
            println!(
                "iter {:>5}  log-likelihood {:.10e}  KKT violation {:.3e}  inner {:>3}  kappa fixes {}  {:.4} s",
                s.iteration,
                s.log_likelihood,
                s.kkt_violation,
                s.inner_iters,
                s.kappa_fixes,
                s.elapsed_s - last_s
            );
        }
        last_s = s.elapsed_s;
        if stop.load(Ordering::SeqCst) {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })?;
    let apr_s = start.elapsed().as_secs_f64();
    let model = &run.model;
    let ran_on = ran_on(&run);
    let steady_s = measure::seconds_per_iteration_after_first(model);
    if let Some(dir) = &args.out {
        let saved = as_saved(model);
        let track = cleanup::TrackStaging;
        let staged = saved
            .stage(dir, &track)
            .with_context(|| format!("writing the model to {}", dir.display()))?;
        let staging = staged.staging_path().to_path_buf();
        cleanup::committing(&staging, || staged.commit())
            .with_context(|| format!("writing the model to {}", dir.display()))?;
    }
    if let Some(dir) = out_dir {
        dir.keep();
    }
    let how = measure::stopped(model);
    if args.json {
        let report = measure::cp_apr_report(
            &loaded,
            &run_opts.apr,
            &run,
            apr_s,
            args.init.as_deref(),
            args.out.as_deref(),
        );
        // (Through a JSON value, as `kruskal cpd` prints its report.)
        let value = serde_json::to_value(&report)?;
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        println!("backend    {ran_on}");
        let its = model.iterations.len();
        println!(
            "final      log-likelihood {:.10e} after {its} iterations ({how})",
            model.log_likelihood
        );
        let inner: usize = model.iterations.iter().map(|s| s.inner_iters).sum();
        println!(
            "time       {apr_s:.3} s, {:.4} s per iteration, {inner} inner iterations{}",
            apr_s / its.max(1) as f64,
            steady_s.map_or_else(String::new, |s| format!(
                ", {s:.4} s per iteration after the first"
            ))
        );
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
        if let Some(dir) = &args.out {
            println!(
                "wrote      {}/lambda.npy, mode-1.npy .. mode-{}.npy",
                dir.display(),
                model.factors.len()
            );
        }
    }
    if model.interrupted || stop.load(Ordering::SeqCst) {
        std::process::exit(130);
    }
    Ok(())
}

/// Where the run went, in words: `gpu (NAME)`, `gpus (N x NAME; NOTE)`,
/// `cpu`, or `cpu (the GPU was not used: WHY)`.
fn ran_on(run: &AprRun) -> String {
    match (&run.device, &run.fallback) {
        (Some(name), _) if run.gpus > 1 || run.note.is_some() => format!(
            "gpus ({} x {name}{})",
            run.gpus,
            run.note
                .as_ref()
                .map_or_else(String::new, |n| format!("; {n}"))
        ),
        (Some(name), _) => format!("{} ({name})", run.backend),
        (None, Some(why)) => format!("{} (the GPU was not used: {why})", run.backend),
        (None, None) => run.backend.to_string(),
    }
}

/// The model in the files `kruskal cpd` writes (f32 factors, f64 weights).
fn as_saved(model: &AprModel) -> KruskalModel {
    KruskalModel {
        lambda: model.lambda.clone(),
        factors: model.factors.iter().map(|f| f.mapv(|x| x as f32)).collect(),
        iterations: Vec::new(),
        totals: IterationTotals::default(),
        converged: model.converged,
        pseudo_inverse_solves: 0,
        interrupted: model.interrupted,
    }
}
