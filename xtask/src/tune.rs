//! `cargo xtask tune` and `cargo xtask train`: measuring the GPU engines
//! over their launch parameters, and fitting the tuning model to the
//! measurements (`kruskal_tune`; the sweep itself is
//! `kruskal_device::tune::sweep`, run by the `kruskal` binary).
//!
//! The sweep runs the release `kruskal tune sweep` (a GPU machine without a
//! Rust toolchain runs the bundled binary the same way: `gpu-run/tune.sh`).
//! Training needs no GPU: it reads the measurements committed under
//! `crates/kruskal-tune/model/`, prints how good the choices of a model
//! fitted without each tensor are, and writes the model file that the
//! binaries embed.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Parser;
use kruskal_tune::train::{
    MARGIN_GRID, TrainParams, best_margin, evaluate, leave_one_out_by_margin, margin_markdown,
    markdown, summarize, train,
};
use kruskal_tune::{CANDIDATES, Config, MARGIN, Measurements, TuneModel};

use crate::{cargo, workspace_root};

/// Where the measurements and the model live in the repository (the
/// model is embedded by `kruskal-tune`'s `model.rs`).
fn tune_dir() -> PathBuf {
    workspace_root().join("crates/kruskal-tune/model")
}

/// `cargo xtask tune`.
#[derive(Parser, Debug)]
// As before clap, an option given twice takes its last value.
#[command(name = "tune", args_override_self = true)]
pub struct TuneArgs {
    /// Where the sweep writes its measurements.
    #[arg(long, value_name = "DIR", default_value = "tune-out")]
    out: PathBuf,
    /// Passed on to `kruskal tune sweep` (`--set eval`, `--scale 2`, ...;
    /// `kruskal tune sweep --help` lists them): everything from the first
    /// of them on, so `--out` comes before them.
    #[arg(value_name = "KRUSKAL TUNE SWEEP OPTIONS", allow_hyphen_values = true)]
    rest: Vec<String>,
}

/// Builds the release `kruskal` and runs `kruskal tune sweep --out DIR`
/// with the other arguments passed on (`--set eval`, `--scale`, ...).
pub fn tune(args: TuneArgs) -> Result<()> {
    let TuneArgs { out, rest } = args;
    let status = cargo()
        .args(["build", "--release", "-p", "kruskal"])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("cargo build failed");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace_root().join("target"), PathBuf::from);
    let bin = target.join("release/kruskal");
    let status = std::process::Command::new(&bin)
        .args(["tune", "sweep", "--out"])
        .arg(&out)
        .args(&rest)
        .status()
        .with_context(|| format!("running {}", bin.display()))?;
    if !status.success() {
        bail!("kruskal tune sweep failed");
    }
    println!(
        "copy {} to {} and run cargo xtask train",
        out.join("measurements-train.json").display(),
        tune_dir().join("measurements.json").display()
    );
    Ok(())
}

/// `cargo xtask train`.
#[derive(Parser, Debug)]
// As before clap, an option given twice takes its last value.
#[command(name = "train", args_override_self = true)]
pub struct TrainArgs {
    /// A measurements file; repeat for several, merged (default
    /// crates/kruskal-tune/model/measurements.json).
    #[arg(long = "measurements", value_name = "FILE")]
    measurements: Vec<PathBuf>,
    /// Where the model goes (default crates/kruskal-tune/model/model.json).
    #[arg(long, value_name = "FILE")]
    model: Option<PathBuf>,
    /// Measurements of tensors left out of the training, to judge the
    /// model on.
    #[arg(long, value_name = "FILE")]
    held_out: Option<PathBuf>,
    /// Deepest split, 1 to 65535.
    #[arg(long, value_name = "D", default_value_t = TrainParams::default().max_depth,
          value_parser = clap::value_parser!(u16).range(1..))]
    max_depth: u16,
    /// Fewest training rows in a leaf (at least 1).
    #[arg(long, value_name = "N", default_value_t = TrainParams::default().min_samples_leaf)]
    min_leaf: usize,
    /// 0: one decision tree; otherwise a random forest of this many trees.
    #[arg(long, value_name = "T", default_value_t = TrainParams::default().trees)]
    trees: usize,
    /// Seed of the forest's bootstrap samples.
    #[arg(long, value_name = "S", default_value_t = TrainParams::default().seed)]
    seed: u64,
    /// Skip the leave-one-tensor-out tables.
    #[arg(long)]
    no_loo: bool,
}

struct TrainOptions {
    measurements: Vec<PathBuf>,
    model: PathBuf,
    held_out: Option<PathBuf>,
    params: TrainParams,
    loo: bool,
}

impl TrainArgs {
    /// The options with the repository's files as defaults.
    fn options(self) -> TrainOptions {
        let mut measurements = self.measurements;
        if measurements.is_empty() {
            measurements.push(tune_dir().join("measurements.json"));
        }
        TrainOptions {
            measurements,
            model: self.model.unwrap_or_else(|| tune_dir().join("model.json")),
            held_out: self.held_out,
            params: TrainParams {
                max_depth: self.max_depth,
                min_samples_leaf: self.min_leaf.max(1),
                trees: self.trees,
                seed: self.seed,
            },
            loo: !self.no_loo,
        }
    }
}

/// Reads and merges measurement files.
fn read_all(paths: &[PathBuf]) -> Result<Measurements> {
    let mut all: Option<Measurements> = None;
    for p in paths {
        let m = Measurements::read(p)?;
        match &mut all {
            None => all = Some(m),
            Some(a) => a.merge(m)?,
        }
    }
    all.context("no measurements file given")
}

/// Fits the model to the measurements, prints leave-one-tensor-out and
/// held-out results, and writes the model file.
pub fn train_task(args: TrainArgs) -> Result<()> {
    let o = args.options();
    let m = read_all(&o.measurements)?;
    let runs: usize = m.tensors.iter().map(|t| t.runs.len()).sum();
    println!(
        "measurements: {} tensors, {runs} runs on {} ({} SMs); {}",
        m.tensors.len(),
        m.gpu,
        m.sms,
        o.params.describe()
    );
    println!(
        "rule: the model's first choice replaces {} when predicted more than {:.0}% faster \
         (tune::MARGIN); cpd --kernel auto times {} and the model's best {} others",
        Config::DEFAULT,
        100.0 * MARGIN,
        Config::DEFAULT,
        CANDIDATES - 1
    );
    if o.loo && m.tensors.len() > 1 {
        let by_margin = leave_one_out_by_margin(&m, &o.params, &MARGIN_GRID)?;
        println!(
            "\nleave one tensor out at each margin (the chosen one: lowest mean time over the best, \
             ties to the larger margin):\n"
        );
        print!("{}", margin_markdown(&MARGIN_GRID, &by_margin));
        let chosen = best_margin(&MARGIN_GRID, &by_margin);
        if chosen != Some(MARGIN) {
            println!(
                "\nnote: leave-one-out picks margin {chosen:?}, tune::MARGIN is {MARGIN}; \
                 set it and rebuild if these measurements are the ones to follow"
            );
        }
        let k = MARGIN_GRID
            .iter()
            .position(|&x| x == MARGIN)
            .context("tune::MARGIN is not one of train::MARGIN_GRID")?;
        println!(
            "\nleave one tensor out at margin {:.0}% (a model fitted without the tensor chooses for it):\n",
            100.0 * MARGIN
        );
        print!("{}", markdown(&by_margin[k]));
    }
    let model = train(&m, &o.params)?;
    let on_training = summarize(&evaluate(&model, &m.tensors)?);
    println!(
        "\non the training tensors: model choice within 10% of the best in {} of {} cases, mean time over the best {:.3}",
        on_training.chosen_within_10pct, on_training.cases, on_training.chosen_mean_ratio
    );
    if let Some(path) = &o.held_out {
        let held = Measurements::read(path)?;
        println!("\nheld-out tensors ({}):\n", path.display());
        print!("{}", markdown(&evaluate(&model, &held.tensors)?));
    }
    model.write(&o.model)?;
    let bytes = std::fs::metadata(&o.model).map_or(0, |m| m.len());
    println!(
        "\nwrote {} ({:.1} KiB); rebuild (cargo build --release, cargo xtask bundle) to embed it",
        display(&o.model),
        bytes as f64 / 1024.0
    );
    // The file must load back as the binaries will load it.
    TuneModel::read(&o.model)?;
    Ok(())
}

fn display(p: &Path) -> String {
    p.strip_prefix(workspace_root())
        .unwrap_or(p)
        .display()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_train(args: &[&str]) -> Result<TrainOptions, clap::Error> {
        let argv = std::iter::once("train").chain(args.iter().copied());
        Ok(TrainArgs::try_parse_from(argv)?.options())
    }

    #[test]
    fn tune_passes_on_what_is_not_its_own() {
        let a = TuneArgs::try_parse_from(["tune", "--out", "d", "--set", "eval", "--scale", "2"])
            .unwrap();
        assert_eq!(a.out, PathBuf::from("d"));
        assert_eq!(a.rest, ["--set", "eval", "--scale", "2"]);
        // From the first option of the sweep on, everything is the sweep's.
        let a = TuneArgs::try_parse_from(["tune", "--set", "eval", "--out", "d"]).unwrap();
        assert_eq!(a.out, PathBuf::from("tune-out"));
        assert_eq!(a.rest, ["--set", "eval", "--out", "d"]);
        let a = TuneArgs::try_parse_from(["tune"]).unwrap();
        assert_eq!(a.out, PathBuf::from("tune-out"));
        assert!(a.rest.is_empty());
    }

    #[test]
    fn train_options_parse_and_bad_ones_are_refused() {
        let o = parse_train(&["--trees", "8", "--max-depth", "9", "--no-loo"]).unwrap();
        assert_eq!((o.params.trees, o.params.max_depth, o.loo), (8, 9, false));
        assert!(o.measurements[0].ends_with("kruskal-tune/model/measurements.json"));
        assert!(o.model.ends_with("kruskal-tune/model/model.json"));
        for bad in [
            &["--max-depth", "0"][..],
            &["--trees", "x"],
            &["--model"],
            &["--what"],
        ] {
            assert!(parse_train(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_missing_measurements_file_is_one_clear_error() {
        let args = TrainArgs::try_parse_from([
            "train",
            "--measurements",
            "/nonexistent/m.json",
            "--model",
            "/nonexistent/x.json",
        ])
        .unwrap();
        let e = train_task(args).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/m.json"), "{e}");
    }
}
