//! `kruskal tune`: the GPU side of the adaptive engine choice.
//!
//! - `sweep`: times every configuration (engine and launch parameter) of
//!   the generated training set, or of the held-out set, at ranks 16, 32
//!   and 64 on the first GPU, and writes the measurements file that
//!   `cargo xtask train` fits the model to. With `--set eval` it also
//!   judges the model in this binary on the held-out tensors.
//! - `eval`: judges the model on a measurements file (no GPU needed).
//! - `predict`: the model's ranking of every configuration for a tensor,
//!   and what `--kernel auto` makes of it (no GPU needed).
//!
//! The work itself is in `kruskal_tune` (and the GPU sweep in
//! `kruskal_device::tune::sweep`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use kruskal_cpd::engine_choice::{ChoiceRule, GpuRequest};
use kruskal_device::tune::sweep::{SweepOptions, sweep_tensor};
use kruskal_tune::data::{held_out_set, training_set};
use kruskal_tune::train::{evaluate, markdown};
use kruskal_tune::{Config, MARGIN, Measurements, TensorFeatures, TensorRuns, TuneModel};
use serde_json::json;

use super::common::InputArgs;
use kruskal::console::{dims_text, flag, thousands};

#[derive(Args, Debug)]
pub struct TuneArgs {
    #[command(subcommand)]
    pub command: TuneCommand,
}

#[derive(Subcommand, Debug)]
pub enum TuneCommand {
    /// Time every configuration of a set of generated tensors on the GPU
    /// and write the measurements (JSON).
    Sweep(SweepArgs),
    /// Judge the tuning model on a measurements file: its choice against
    /// the best measured and the fixed default, per tensor and rank.
    Eval(EvalArgs),
    /// The tuning model's ranking of every configuration for a tensor.
    Predict(PredictArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Set {
    /// The training set (FROSTT shapes of 3 to 5 modes, 2M to 16M nonzeros).
    Train,
    /// The held-out set (enron, flickr-4d, patents scaled, other seeds).
    Eval,
}

#[derive(Args, Debug)]
pub struct SweepArgs {
    /// Folder for `measurements-<set>.json` (and `eval.md` with --set eval).
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, value_enum, default_value_t = Set::Train)]
    pub set: Set,
    /// Multiply every tensor's nonzero count (e.g. 0.01 for a quick check).
    #[arg(long, default_value_t = 1.0)]
    pub scale: f64,
    /// Timed sweeps over all modes per configuration and rank, after one
    /// warm-up sweep; medians are kept.
    #[arg(long, default_value_t = 5)]
    pub repeat: usize,
    /// Ranks, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64")]
    pub ranks: Vec<usize>,
    /// Only tensors whose id contains this text (e.g. nell-2).
    #[arg(long)]
    pub only: Option<String>,
    /// Start no tensor that would end later than this many seconds after
    /// the start, at the rate measured so far (0: no limit).
    #[arg(long, default_value_t = 0.0)]
    pub budget_s: f64,
}

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// A measurements file (from `kruskal tune sweep`).
    pub measurements: PathBuf,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct PredictArgs {
    #[command(flatten)]
    pub input: InputArgs,
    #[arg(long, short, default_value_t = 32)]
    pub rank: usize,
    /// SMs of the GPU, for FLYCOO's kappa in the printed flags (default:
    /// the model's training GPU).
    #[arg(long)]
    pub sms: Option<usize>,
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: TuneArgs) -> Result<()> {
    match args.command {
        TuneCommand::Sweep(a) => sweep(a),
        TuneCommand::Eval(a) => eval(a),
        TuneCommand::Predict(a) => predict(a),
    }
}

fn sweep(args: SweepArgs) -> Result<()> {
    if args.repeat == 0 || args.ranks.is_empty() || args.ranks.contains(&0) {
        bail!("--repeat and every rank must be at least 1");
    }
    if !(args.scale.is_finite() && args.scale > 0.0) {
        bail!("--scale must be a positive number, not {}", args.scale);
    }
    let (name, set) = match args.set {
        Set::Train => ("train", training_set()),
        Set::Eval => ("eval", held_out_set()),
    };
    let specs: Vec<_> = set
        .iter()
        .map(|s| s.scaled(args.scale))
        .filter(|s| {
            args.only
                .as_ref()
                .is_none_or(|o| s.id().contains(o.as_str()))
        })
        .collect();
    if specs.is_empty() {
        bail!("no tensor of the {name} set matches --only");
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let path = args.out.join(format!("measurements-{name}.json"));
    let gpu = kruskal_device::Gpu::open(0)?;
    let p = gpu.properties();
    println!(
        "tune sweep: {} tensors of the {name} set on {} ({} SMs), ranks {:?}, {} configurations, {} timed sweeps each; writing {}",
        specs.len(),
        p.name,
        p.sms,
        args.ranks,
        kruskal_tune::Config::space().len(),
        args.repeat,
        path.display()
    );
    let opts = SweepOptions {
        ranks: args.ranks.clone(),
        repeat: args.repeat,
        ..SweepOptions::default()
    };
    let mut m = Measurements::new(&p.name, p.sms, args.repeat);
    let start = Instant::now();
    let (mut done_nnz, mut skipped) = (0usize, Vec::new());
    for (k, spec) in specs.iter().enumerate() {
        let elapsed = start.elapsed().as_secs_f64();
        let rate = if done_nnz > 0 {
            elapsed / done_nnz as f64
        } else {
            0.0
        };
        if args.budget_s > 0.0 && elapsed + rate * spec.nnz as f64 > args.budget_s {
            skipped.push(spec.id());
            continue;
        }
        let t0 = Instant::now();
        let t = spec.generate()?;
        let gen_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let features = TensorFeatures::compute(&t);
        let features_s = t1.elapsed().as_secs_f64();
        println!(
            "[{}/{}] {} ({}, {} nonzeros): generated in {gen_s:.2} s, features in {features_s:.2} s",
            k + 1,
            specs.len(),
            spec.id(),
            dims_text(t.dims()),
            thousands(t.nnz() as u64)
        );
        let (runs, failures) = sweep_tensor(&gpu, &t, &opts, &mut |line| println!("{line}"))?;
        m.tensors.push(TensorRuns {
            id: spec.id(),
            spec: Some(spec.clone()),
            dims: t.dims().to_vec(),
            nnz: t.nnz() as u64,
            features: (0..t.nmodes()).map(|w| features.mode_vector(w)).collect(),
            features_s,
            runs,
            failures,
        });
        // Written after every tensor: a run cut short keeps what it measured.
        m.write(&path)?;
        done_nnz += spec.nnz;
        println!(
            "      done in {:.1} s ({:.1} s since the start)",
            t0.elapsed().as_secs_f64(),
            start.elapsed().as_secs_f64()
        );
    }
    if !skipped.is_empty() {
        println!(
            "skipped (over --budget-s {}): {}",
            args.budget_s,
            skipped.join(", ")
        );
    }
    let runs: usize = m.tensors.iter().map(|t| t.runs.len()).sum();
    let failures: usize = m.tensors.iter().map(|t| t.failures.len()).sum();
    println!(
        "measured {} tensors, {runs} runs, {failures} failures, in {:.1} s: {}",
        m.tensors.len(),
        start.elapsed().as_secs_f64(),
        path.display()
    );
    print_best(&m);
    if args.set == Set::Eval {
        let text = judge(&m)?;
        let md = args.out.join("eval.md");
        std::fs::write(&md, &text).with_context(|| format!("writing {}", md.display()))?;
        println!("\n{text}");
    }
    Ok(())
}

/// One line per tensor and rank: the fastest configuration and the
/// default's time.
fn print_best(m: &Measurements) {
    use kruskal_tune::Config;
    println!(
        "{:<28} {:>5} {:<24} {:>10} {:>12}",
        "tensor", "rank", "best", "ms", "default x"
    );
    for t in &m.tensors {
        for rank in t.ranks() {
            if let Some(best) = t.best(rank) {
                let default = t
                    .run(Config::DEFAULT, rank)
                    .map_or("-".into(), |d| format!("{:.3}", d.total_ms / best.total_ms));
                println!(
                    "{:<28} {:>5} {:<24} {:>10.3} {:>12}",
                    t.id,
                    rank,
                    best.config.to_string(),
                    best.total_ms,
                    default
                );
            }
        }
    }
}

/// The markdown evaluation of the loaded model on `m`, or why there is none.
fn judge(m: &Measurements) -> Result<String> {
    let model = TuneModel::load()?;
    if !model.is_trained() {
        return Ok("The tuning model in this binary is untrained: train it (cargo xtask train), rebuild, and judge these measurements with `kruskal tune eval FILE`.\n".into());
    }
    Ok(markdown(&evaluate(&model, &m.tensors)?))
}

fn eval(args: EvalArgs) -> Result<()> {
    let m = Measurements::read(&args.measurements)?;
    let model = TuneModel::load()?;
    if !model.is_trained() {
        bail!(
            "the tuning model is untrained (cargo xtask train writes one; KRUSKAL_TUNE_MODEL=FILE names another)"
        );
    }
    let outcomes = evaluate(&model, &m.tensors)?;
    if args.json {
        let s = kruskal_tune::train::summarize(&outcomes);
        let rows: Vec<_> = outcomes
            .iter()
            .map(|o| {
                json!({
                    "tensor": o.tensor, "rank": o.rank, "best": o.best.to_string(), "best_ms": o.best_ms,
                    "default_ms": o.default_ms, "chosen": o.chosen.to_string(), "chosen_ms": o.chosen_ms,
                    "candidate": o.candidate.to_string(), "candidate_ms": o.candidate_ms,
                })
            })
            .collect();
        let value = json!({
            "cases": s.cases, "chosen_within_10pct": s.chosen_within_10pct,
            "default_within_10pct": s.default_within_10pct,
            "chosen_not_default": s.chosen_not_default,
            "candidate_within_10pct": s.candidate_within_10pct,
            "chosen_mean_ratio": s.chosen_mean_ratio, "candidate_mean_ratio": s.candidate_mean_ratio,
            "default_mean_ratio": s.default_mean_ratio, "chosen_worst_ratio": s.chosen_worst_ratio,
            "candidate_worst_ratio": s.candidate_worst_ratio,
            "speedup_over_default": s.speedup_over_default,
            "candidate_speedup_over_default": s.candidate_speedup_over_default,
            "margin": kruskal_tune::MARGIN, "candidates": kruskal_tune::CANDIDATES,
            "outcomes": rows,
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print!("{}", markdown(&outcomes));
    }
    Ok(())
}

fn predict(args: PredictArgs) -> Result<()> {
    if args.rank == 0 {
        bail!("--rank must be at least 1");
    }
    let loaded = args.input.load()?;
    let t = &loaded.tensor;
    let start = Instant::now();
    let features = TensorFeatures::compute(t);
    let features_s = start.elapsed().as_secs_f64();
    let model = TuneModel::load()?;
    let ranked = model.predict(&features, args.rank)?;
    let sms = args
        .sms
        .or(model.trained_on.as_ref().map(|o| o.sms))
        .unwrap_or(1);
    // What `--kernel auto` runs and what `cpd --kernel auto` times, as the
    // engine choice makes them from these features.
    let mut computed = Some((features, features_s));
    let no_flags = kruskal_device::GpuOptions::default();
    let ask = |rule| GpuRequest {
        engine: kruskal_device::GpuEngine::Auto,
        given: &no_flags,
        no_model: false,
        rank: args.rank,
        rule,
    };
    let configs = |choice: kruskal_cpd::EngineChoice| -> Vec<Config> {
        choice.candidates.iter().filter_map(|c| c.config).collect()
    };
    let chosen = configs(ask(ChoiceRule::One).choose(t, sms, &mut computed))
        .first()
        .copied()
        .unwrap_or(Config::DEFAULT);
    let candidates = configs(ask(ChoiceRule::Trial).choose(t, sms, &mut computed));
    if args.json {
        let rows: Vec<_> = ranked
            .iter()
            .map(|p| {
                json!({
                    "config": p.config.to_string(), "flags": p.config.spelled(sms, &flag),
                    "predicted_ms": p.total_ms, "predicted_mode_ms": p.mode_ms,
                })
            })
            .collect();
        let value = json!({
            "tensor": { "source": loaded.source, "dims": t.dims(), "nnz": t.nnz() },
            "rank": args.rank, "features_s": features_s, "ranked": rows,
            "chosen": chosen.to_string(),
            "candidates": candidates.iter().map(Config::to_string).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    println!("tensor   {}", loaded.source);
    println!(
        "         {}, {} nonzeros; rank {}; features in {features_s:.2} s",
        dims_text(t.dims()),
        thousands(t.nnz() as u64),
        args.rank
    );
    println!(
        "{:>4} {:<24} {:>13} {:<32} per mode ms",
        "", "configuration", "predicted ms", "flags"
    );
    for (k, p) in ranked.iter().enumerate() {
        let modes: Vec<String> = p.mode_ms.iter().map(|ms| format!("{ms:.3}")).collect();
        println!(
            "{:>4} {:<24} {:>13.3} {:<32} {}",
            k + 1,
            p.config.to_string(),
            p.total_ms,
            p.config.spelled(sms, &flag),
            modes.join(" / ")
        );
    }
    let names: Vec<String> = candidates.iter().map(Config::to_string).collect();
    println!(
        "--kernel auto runs {chosen} (the first above replaces the default {} only when predicted \
         more than {:.0}% faster); cpd --kernel auto times {}",
        Config::DEFAULT,
        100.0 * MARGIN,
        names.join(", ")
    );
    Ok(())
}
