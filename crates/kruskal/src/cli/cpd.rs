//! `kruskal cpd`: CP decomposition of a tensor file, or of a planted
//! low-rank tensor with `--demo`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use kruskal_cpd::{
    AdmmOptions, Chosen, CpdOptions, DecomposeOptions, Decomposition, EngineRequest, GroupBackend,
    Init, KernelPlan, KruskalModel, NonNeg, factor_match_score, load_factors,
};
use kruskal_formats::generate::{PlantedSpec, planted};
use ndarray::Array2;

use super::common::{
    GpuArgs, InputArgs, MultiGpuArgs, parse_rank, parse_seed, parse_threads, set_threads,
};
use super::{cleanup, compact, preflight};
use kruskal::console::{count_of, dims_text};
use kruskal::input::Loaded;
use kruskal::measure::{self, ConstraintFlags, TensorReport, cpd_report, parse_weight};

/// Where the decomposition runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// The GPU when one is usable and the run fits in its memory, else
    /// the CPU (the output says why).
    Auto,
    Cpu,
    /// The first CUDA GPU.
    Gpu,
}

#[derive(Args, Debug)]
pub struct CpdArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Decompose a generated planted low-rank tensor (no file needed) and
    /// report how well the planted factors are recovered.
    #[arg(long, conflicts_with_all = ["file", "like"])]
    pub demo: bool,
    /// Number of components (default 10, or the planted rank with --demo).
    #[arg(long, short, allow_negative_numbers = true, value_parser = parse_rank)]
    pub rank: Option<usize>,
    /// Iteration limit (0: the output is the initial factors).
    #[arg(long, default_value_t = kruskal_cpd::als::DEFAULT_MAX_ITERS, allow_negative_numbers = true)]
    pub iters: usize,
    /// Stop when the fit changes by less than this.
    #[arg(long, default_value_t = kruskal_cpd::als::DEFAULT_TOL, allow_negative_numbers = true)]
    pub tol: f64,
    /// Seed of the random initial factors.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = parse_seed)]
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
    /// Write lambda.npy and mode-<n>.npy (numpy format) into DIR (checked
    /// before the run: a directory, or one that can be created, where
    /// files can be written).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Relabel each mode to the indices that occur before decomposing, and
    /// write the factors in the file's own numbering (zero rows for
    /// indices that do not occur): for sparse id spaces (user ids, hashes)
    /// whose dimensions are far larger than the indices used.
    #[arg(long, conflicts_with_all = ["demo", "init", "distributed"])]
    pub compact: bool,
    /// Where to run: auto (the GPU when usable and the tensor fits, else
    /// the CPU), cpu or gpu.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
    /// MTTKRP engine. CPU: auto, sorted, fcoo, flycoo, hicoo, csf. GPU: auto
    /// (times three candidates on the first iteration, fcoo threadlen 8
    /// and the tuning model's two fastest other configurations, and keeps
    /// the fastest per mode), coo, fcoo, flycoo, hicoo.
    #[arg(long, default_value = "auto")]
    pub kernel: String,
    #[command(flatten)]
    pub gpu: GpuArgs,
    #[command(flatten)]
    pub multi: MultiGpuArgs,
    #[command(flatten)]
    pub distributed: super::distributed::DistributedArgs,
    /// Keep the factors non-negative (constrained CP by AO-ADMM, on one GPU
    /// or the CPU): in every mode, or in MODES, a comma list numbered from 1
    /// (`--nonneg 1,3`). Put the FILE before a bare --nonneg.
    #[arg(long, value_name = "MODES", num_args = 0..=1, default_missing_value = "all",
          value_parser = parse_nonneg)]
    pub nonneg: Option<NonNeg>,
    /// L1 penalty weight W on every factor (W ||A||_1; AO-ADMM).
    #[arg(long, value_name = "W", allow_negative_numbers = true, value_parser = parse_weight)]
    pub l1: Option<f64>,
    /// L2 penalty weight W on every factor (W ||A||_F^2; AO-ADMM).
    #[arg(long, value_name = "W", allow_negative_numbers = true, value_parser = parse_weight)]
    pub l2: Option<f64>,
    /// With --nonneg, --l1 or --l2 on the CPU: run AO-ADMM's inner loop
    /// with each row stopping on its own, as a GPU always does (default on
    /// the CPU: all rows stop together).
    #[arg(long)]
    pub admm_blocks: bool,
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = parse_threads)]
    pub threads: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `--nonneg`: `all` (no value) or a comma list of modes numbered from 1;
/// the error adds what a FILE after a bare `--nonneg` turns into.
fn parse_nonneg(text: &str) -> Result<NonNeg, String> {
    measure::parse_nonneg(text).map_err(|e| {
        format!("{e} (a value after --nonneg is its modes: put the FILE before a bare --nonneg)")
    })
}

impl CpdArgs {
    /// The engine `--kernel` asks for.
    fn engine(&self) -> Result<EngineRequest, kruskal_cpd::CpdError> {
        self.kernel.parse()
    }

    /// The constraint flags as given.
    fn constraint_flags(&self) -> ConstraintFlags {
        ConstraintFlags {
            nonneg: self.nonneg.clone(),
            l1: self.l1,
            l2: self.l2,
            admm_blocks: self.admm_blocks,
        }
    }

    /// The AO-ADMM options the flags ask for (`None`: plain ALS).
    pub(super) fn constraints(&self) -> Option<AdmmOptions> {
        self.constraint_flags().admm_options()
    }
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
        merged: 0,
        coalesce_s: 0.0,
    };
    Ok((loaded, p))
}

pub fn run(args: CpdArgs) -> Result<()> {
    set_threads(args.threads)?;
    args.multi.check_used(args.distributed.distributed)?;
    args.constraint_flags().check()?;
    let constrained = args.constraints().is_some();
    if constrained && args.distributed.distributed {
        bail!(
            "--nonneg, --l1 and --l2 (AO-ADMM) run on the GPUs of one process or the CPU: \
             they cannot be combined with --distributed"
        );
    }
    if args.distributed.distributed {
        return super::distributed::run(&args);
    }
    // What can be known before the tensor is read or generated is checked
    // first: the GPUs asked for, and the memory for the tensor's shape.
    args.multi.group()?;
    // (An unknown --kernel is refused where the options are made, a
    // CPU-only one by decompose.)
    let gpu_kernel = args.engine().is_ok_and(|k| k.gpu().is_some());
    if args.backend == BackendArg::Gpu && args.multi.gpus.is_none() && gpu_kernel {
        preflight::check_gpu_present()?;
    }
    let on_cpu = args.multi.gpus.is_none()
        && (args.backend == BackendArg::Cpu
            || (args.backend == BackendArg::Auto && preflight::no_gpu_here()));
    args.gpu.check(on_cpu)?;
    // (`--compact` shrinks the dimensions first; checked after it.)
    if on_cpu && !args.demo && !args.compact {
        let rank = args.rank.unwrap_or(DEMO_RANK);
        let starts = args.starts.unwrap_or(1);
        preflight::check_memory_ahead(&args.input, |dims, nnz| {
            let threads = rayon::current_num_threads();
            let need = kruskal_cpd::memory::cpu_need(dims, nnz, rank, threads, starts);
            if constrained {
                need.and(kruskal_cpd::memory::admm_need(dims, rank, threads))
            } else {
                need
            }
        })?;
    }
    // The driver takes a few tenths of a second to open a GPU: start it
    // while the tensor is read. The backend then opens the same (primary)
    // context, waiting only for what is left of the start (its `open_s`);
    // the handle keeps this thread's hold on the context until then.
    let opening = (!on_cpu && args.multi.gpus.is_none())
        .then(|| std::thread::spawn(|| kruskal_device::Gpu::open(0).ok()));
    let (mut loaded, truth) = if args.demo {
        let (loaded, p) = demo_tensor()?;
        (loaded, Some(p))
    } else {
        if args.input.file.is_none() && args.input.like.is_none() {
            bail!("give a tensor FILE (or --like NAME, or --demo)");
        }
        (args.input.load()?, None)
    };
    let compaction = args
        .compact
        .then(|| compact::compact_tensor(&mut loaded, args.json, args.out.is_some()))
        .transpose()?;
    // From here on a signal stops the run cleanly (reading above is ended
    // by it at once, as it leaves nothing behind).
    let stop = interrupt_flag()?;
    let out_dir = match &args.out {
        Some(dir) => {
            let dims = compaction
                .as_ref()
                .map_or(loaded.tensor.dims(), |c| &c.dims[..]);
            let rank = args.rank.unwrap_or(DEMO_RANK);
            Some(preflight::OutDir::for_model(dir, dims, rank)?)
        }
        None => None,
    };
    let opts = decompose_options(&args, loaded.tensor.dims())?;
    let (tensor, load_s) = (TensorReport::of(&loaded), loaded.load_s);
    let done = super::show::decompose(&opts, loaded, args.json, stop)?;
    drop(opening);
    let model = &done.model;
    let fms = truth
        .as_ref()
        .map(|p| factor_match_score(&model.lambda, &model.factors, &p.lambda, &p.factors));
    let writing = Instant::now();
    if let Some(dir) = &args.out {
        // Written into a staging directory the signal handler removes, and
        // moved into place under its lock: all of the model or none.
        let track = cleanup::TrackStaging;
        let staged = match &compaction {
            Some(map) => model.stage_expanded(dir, map, &track),
            None => model.stage(dir, &track),
        }
        .with_context(|| format!("writing the model to {}", dir.display()))?;
        let staging = staged.staging_path().to_path_buf();
        cleanup::committing(&staging, || staged.commit())
            .with_context(|| format!("writing the model to {}", dir.display()))?;
    }
    if let Some(dir) = out_dir {
        dir.keep();
    }
    let write_s = writing.elapsed().as_secs_f64();
    // The wall time's parts; the teardown (the backend's device memory and
    // threads) is timed before the report. (The tensor was freed during
    // the run, once the backend was built.)
    let (prepare_s, cpd_s) = (done.prep_s, done.cpd_s);
    // One start: its factors' setup (drawn, handed to the backend) and
    // finish (taken back, arranged) apart from its iterations; several:
    // all starts as one part.
    let (setup_s, finish_s) = if done.starts == 1 {
        (model.totals.setup_s, model.totals.finish_s)
    } else {
        (0.0, 0.0)
    };
    let (interrupted, fit) = (model.interrupted, model.fit());
    let teardown = |done: Decomposition| {
        let start = Instant::now();
        drop(done);
        start.elapsed().as_secs_f64()
    };
    let wall = |teardown_s: f64| {
        kruskal::wall::WallParts::now(&[
            ("load", load_s),
            ("preparation", prepare_s),
            ("setup", setup_s),
            ("iterations", (cpd_s - setup_s - finish_s).max(0.0)),
            ("finish", finish_s),
            ("model written", write_s),
            ("teardown", teardown_s),
        ])
    };
    if args.json {
        let mut value = serde_json::to_value(cpd_report(tensor, &done, fms, args.out.as_deref()))?;
        if let Some(map) = &compaction {
            value["compact"] = compact::json(map);
        }
        value["method"] = serde_json::json!(if constrained { "ao-admm" } else { "als" });
        value["constraints"] = serde_json::json!(args.constraints().map(|c| c.describe()));
        value["admm_inner"] = serde_json::json!(
            args.constraints()
                .map(|c| done.backend.admm_inner(c.inner).describe())
        );
        value["wall"] = wall(teardown(done)).json();
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        if let Some(plan) = &done.backend.plan() {
            print_plan(plan);
        }
        if let Chosen::Group(b) = &done.backend {
            print_breakdown(b, "slowest GPU");
        }
        if let Some(c) = args.constraints() {
            let inner: usize = model.iterations.iter().map(|s| s.inner_iters).sum();
            println!(
                "method     AO-ADMM, {}; {inner} inner iterations in the last {} (inner loop: {})",
                c.describe(),
                count_of(model.iterations.len() as u64, "iteration"),
                done.backend.admm_inner(c.inner).describe()
            );
        }
        print_summary(model, done.cpd_s, done.starts, fms, args.out.as_ref());
        println!("wall       {}", wall(teardown(done)).line());
    }
    // (The kept model may be an earlier start's, which ran to its end.)
    if interrupted || stop.load(Ordering::SeqCst) {
        // Stopped on purpose: the model so far is written; say so in the
        // exit status, as a shell expects of an interrupted program.
        std::process::exit(130);
    }
    if let Some(fms) = fms {
        if fit < 0.99 || fms < 0.95 {
            bail!(
                "the demo did not recover the planted tensor (fit {fit:.4}, factor match {fms:.4})"
            );
        }
    }
    Ok(())
}

/// What `args` ask of `kruskal_cpd::decompose` for a tensor of
/// dimensions `dims`.
pub(super) fn decompose_options(args: &CpdArgs, dims: &[u32]) -> Result<DecomposeOptions> {
    let (gpus, group) = args.multi.group()?;
    Ok(DecomposeOptions {
        cpd: cpd_options(args, dims)?,
        starts: args.starts.unwrap_or(if args.demo { 3 } else { 1 }),
        seed: args.seed,
        backend: match args.backend {
            BackendArg::Auto => kruskal_cpd::BackendChoice::Auto,
            BackendArg::Cpu => kruskal_cpd::BackendChoice::Cpu,
            BackendArg::Gpu => kruskal_cpd::BackendChoice::Gpu,
        },
        kernel: args.engine()?,
        gpu: args.gpu.options(),
        no_model: args.gpu.no_model,
        group,
        gpus,
        pick_gpus: args.multi.all(),
        // Already relabeled, a tensor has no mode left to compact.
        can_compact: !args.compact,
    })
}

/// The options `args` give for a tensor of dimensions `dims`: rank,
/// limits and the initial factors (random, or read from `--init`, whose
/// shapes are checked here, before any backend is prepared).
pub(super) fn cpd_options(args: &CpdArgs, dims: &[u32]) -> Result<CpdOptions> {
    let rank = args.rank.unwrap_or(DEMO_RANK);
    let mut opts = CpdOptions {
        rank,
        max_iters: args.iters,
        tol: args.tol,
        init: Init::Random { seed: args.seed },
        constraints: args.constraints(),
    };
    // Checked before any factor is read (the library's checks, whose
    // errors the program spells as its flags).
    opts.validate()?;
    if let Some(c) = &opts.constraints {
        c.check(dims.len())?;
    }
    let init = match &args.init {
        Some(dir) => {
            let factors = load_factors(dir, dims.len())?;
            check_init_rows(dir, &factors, dims)?;
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
    if let Init::Given(f) = &init {
        opts.rank = f[0].ncols();
    }
    opts.init = init;
    Ok(opts)
}

/// Checks that the factor of each mode in `dir` has as many rows as the
/// tensor's dimension. A text file's dimensions are its largest indices
/// (unless `--dims` gives them), so a tensor written from planted factors
/// may have fewer rows than they do: the error then names the `--dims`
/// that makes the two agree.
fn check_init_rows(dir: &Path, factors: &[Array2<f32>], dims: &[u32]) -> Result<()> {
    let rows: Vec<usize> = factors.iter().map(Array2::nrows).collect();
    let Some(m) = (0..dims.len()).find(|&m| rows[m] != dims[m] as usize) else {
        return Ok(());
    };
    let fits = rows.iter().zip(dims).all(|(&r, &d)| r >= d as usize);
    let hint = if fits {
        let wanted: Vec<String> = rows.iter().map(usize::to_string).collect();
        format!(
            "; a text file's dimensions are its largest indices ({}): read it with --dims {} \
             to give the factors' dimensions",
            dims_text(dims),
            wanted.join(",")
        )
    } else {
        String::new()
    };
    bail!(
        "{}: mode-{}.npy has {} rows, the tensor's mode {} has dimension {}{hint}",
        dir.display(),
        m + 1,
        rows[m],
        m + 1,
        dims[m]
    )
}

/// Per mode, where the time went on several GPUs (after the first
/// iteration).
pub(super) fn print_breakdown(b: &GroupBackend, whose: &str) {
    println!(
        "per mode   ms per iteration after the first ({whose}): h2d, kernel, MTTKRP, update, exchange (rows sent, MB moved of the all-gather's, GB/s); MTTKRP per GPU"
    );
    for (mode, m) in b.breakdown().iter().enumerate() {
        if m.calls == 0 {
            continue;
        }
        let c = m.calls as f64;
        let per_gpu: Vec<String> = m
            .per_gpu_mttkrp_ms
            .iter()
            .map(|x| format!("{:.2}", x / c))
            .collect();
        let exchange_ms = m.exchange_ms / c;
        let rate = if exchange_ms > 0.0 {
            format!(", {:.0} GB/s", m.exchange_bytes as f64 / exchange_ms / 1e6)
        } else {
            String::new()
        };
        let sent = if m.exchange_rows == "none" {
            format!(
                "none: the rows stay on their GPUs, the all-gather's {:.1} MB",
                m.all_gather_bytes as f64 / 1e6
            )
        } else {
            format!(
                "{} rows, {:.1} of {:.1} MB{rate}",
                m.exchange_rows,
                m.exchange_bytes as f64 / 1e6,
                m.all_gather_bytes as f64 / 1e6
            )
        };
        let reduce = if m.reduce_bytes > 0 {
            format!(
                ", reduce {:.2} ({:.1} MB)",
                m.reduce_ms / c,
                m.reduce_bytes as f64 / 1e6
            )
        } else {
            String::new()
        };
        let across = if m.all_reduce_ms > 0.0 {
            format!(" (all-reduces {:.2})", m.all_reduce_ms / c)
        } else {
            String::new()
        };
        println!(
            "  mode {}: h2d {:.2}, kernel {:.2}, MTTKRP {:.2}{reduce}, update {:.2}{across}, exchange {:.2} ({sent}); [{}]",
            mode + 1,
            m.h2d_ms / c,
            m.kernel_ms / c,
            m.mttkrp_ms / c,
            m.update_ms / c,
            exchange_ms,
            per_gpu.join(" ")
        );
    }
}

/// Ctrl-C presses so far; the first stops the run after the current
/// iteration (through [`STOP`]), the second ends the program at once.
static INTERRUPTS: AtomicUsize = AtomicUsize::new(0);
static STOP: AtomicBool = AtomicBool::new(false);

/// Installs the handler of Ctrl-C, SIGTERM and SIGHUP (once per
/// process): the first stops the run after the current iteration (the
/// model so far is written), the next ends the process at once, removing
/// the model's temporaries and the `--out` directories the run made.
pub(super) fn interrupt_flag() -> Result<&'static AtomicBool> {
    ctrlc::set_handler(|| {
        STOP.store(true, Ordering::SeqCst);
        if INTERRUPTS.fetch_add(1, Ordering::SeqCst) > 0 {
            cleanup::quit(130, "interrupted again");
        }
        eprintln!("kruskal: stopping after this iteration (Ctrl-C again to quit at once)");
    })
    .context("installing the Ctrl-C handler")?;
    Ok(&STOP)
}

/// The GPU kernel of each mode, and what the first iteration measured.
fn print_plan(plan: &KernelPlan) {
    println!("kernels    per mode: {}", plan.per_mode.join(", "));
    if !plan.trial_ms.is_empty() {
        let rows: Vec<String> = plan
            .candidates
            .iter()
            .zip(&plan.trial_ms)
            .map(|(c, ms)| {
                let ms: Vec<String> = ms.iter().map(|x| format!("{x:.2}")).collect();
                format!("{c} {}", ms.join("/"))
            })
            .collect();
        println!(
            "           chosen by timing each once on iteration 1 (ms per mode): {}",
            rows.join("; ")
        );
        println!(
            "           the choice cost {:.3} s of iteration 1 (warm-up with kernel compilation, and the slower candidates' runs)",
            plan.choice_s
        );
    }
}

pub(super) fn print_summary(
    model: &KruskalModel,
    cpd_s: f64,
    starts: usize,
    fms: Option<f64>,
    out: Option<&PathBuf>,
) {
    // Totals over every iteration (the history keeps only the last).
    let totals = &model.totals;
    let its = totals.count;
    // Times are never below zero: a total less its first iteration may
    // round to a hair under it (printed `-0.000`).
    let time = |s: f64| s.max(0.0) + 0.0;
    let (mttkrp, other) = (time(totals.mttkrp_s), time(totals.other_s));
    let how = if model.converged {
        "converged"
    } else if model.interrupted {
        "interrupted"
    } else {
        "iteration limit reached"
    };
    println!(
        "final fit  {:.6} after {} ({how})",
        model.fit(),
        count_of(its as u64, "iteration")
    );
    if starts > 1 {
        println!("time       {cpd_s:.3} s for {starts} starts; the kept run:");
    }
    let run_s = mttkrp + other;
    let (update, fit) = (time(totals.update_s), time(totals.fit_s));
    println!(
        "time       {:.3} s: MTTKRP {:.3} s ({:.0}%), update {:.3} s, fit {:.3} s, {:.4} s per iteration",
        if starts > 1 { run_s } else { cpd_s },
        mttkrp,
        100.0 * mttkrp / run_s.max(f64::MIN_POSITIVE),
        update,
        fit,
        run_s / its.max(1) as f64
    );
    if its > 1 {
        // The first iteration also compiles kernels (and, with --kernel
        // auto on the GPU, tries every candidate): the steady state is
        // the rest.
        let m = time(mttkrp - totals.first_mttkrp_s);
        let all = time(m + other - totals.first_other_s);
        println!(
            "           after the first iteration: {:.4} s per iteration, MTTKRP {:.0}%",
            all / (its - 1) as f64,
            100.0 * m / all.max(f64::MIN_POSITIVE)
        );
    }
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
            "wrote      {}/lambda.npy, mode-1.npy .. mode-{}.npy{}",
            dir.display(),
            model.factors.len(),
            if model.interrupted {
                " (the model so far)"
            } else {
                ""
            }
        );
    }
}
