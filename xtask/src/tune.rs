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
use kruskal_tune::train::{
    MARGIN_GRID, TrainParams, best_margin, evaluate, leave_one_out_by_margin, margin_markdown,
    markdown, summarize, train,
};
use kruskal_tune::{CANDIDATES, Config, MARGIN, Measurements, TuneModel};

use crate::{cargo, workspace_root};

pub const TUNE_USAGE: &str = "cargo xtask tune [--out DIR] [KRUSKAL TUNE SWEEP OPTIONS...]";
pub const TRAIN_USAGE: &str = "cargo xtask train [--measurements FILE]... [--model FILE] \
     [--held-out FILE] [--max-depth D] [--min-leaf N] [--trees T] [--seed S] [--no-loo]";

/// Where the measurements and the model live in the repository (the
/// model is embedded by `kruskal-tune`'s `model.rs`).
fn tune_dir() -> PathBuf {
    workspace_root().join("crates/kruskal-tune/model")
}

/// Builds the release `kruskal` and runs `kruskal tune sweep --out DIR`
/// with the other arguments passed on (`--set eval`, `--scale`, ...).
pub fn tune(args: &[String]) -> Result<()> {
    let mut out = PathBuf::from("tune-out");
    let mut rest = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--out" {
            out = PathBuf::from(
                it.next()
                    .with_context(|| format!("--out needs a folder; usage: {TUNE_USAGE}"))?,
            );
        } else {
            rest.push(a.clone());
        }
    }
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

struct TrainOptions {
    measurements: Vec<PathBuf>,
    model: PathBuf,
    held_out: Option<PathBuf>,
    params: TrainParams,
    loo: bool,
}

fn parse_train(args: &[String]) -> Result<TrainOptions> {
    let mut o = TrainOptions {
        measurements: Vec::new(),
        model: tune_dir().join("model.json"),
        held_out: None,
        params: TrainParams::default(),
        loo: true,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .with_context(|| format!("{name} needs a value; usage: {TRAIN_USAGE}"))
        };
        let number = |name: &str, text: String| -> Result<u64> {
            text.parse()
                .with_context(|| format!("{name} takes a whole number, not '{text}'"))
        };
        match a.as_str() {
            "--measurements" => o.measurements.push(PathBuf::from(value(a)?)),
            "--model" => o.model = PathBuf::from(value(a)?),
            "--held-out" => o.held_out = Some(PathBuf::from(value(a)?)),
            "--max-depth" => {
                o.params.max_depth = u16::try_from(number(a, value(a)?)?)
                    .ok()
                    .filter(|&d| d > 0)
                    .context("--max-depth takes 1 to 65535")?
            }
            "--min-leaf" => {
                o.params.min_samples_leaf = usize::try_from(number(a, value(a)?)?)?.max(1)
            }
            "--trees" => o.params.trees = usize::try_from(number(a, value(a)?)?)?,
            "--seed" => o.params.seed = number(a, value(a)?)?,
            "--no-loo" => o.loo = false,
            other => bail!("unknown option {other}; usage: {TRAIN_USAGE}"),
        }
    }
    if o.measurements.is_empty() {
        o.measurements.push(tune_dir().join("measurements.json"));
    }
    Ok(o)
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
pub fn train_task(args: &[String]) -> Result<()> {
    let o = parse_train(args)?;
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

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn train_options_parse_and_bad_ones_are_refused() {
        let o = parse_train(&args(&["--trees", "8", "--max-depth", "9", "--no-loo"])).unwrap();
        assert_eq!((o.params.trees, o.params.max_depth, o.loo), (8, 9, false));
        assert!(o.measurements[0].ends_with("kruskal-tune/model/measurements.json"));
        assert!(o.model.ends_with("kruskal-tune/model/model.json"));
        for bad in [
            &["--max-depth", "0"][..],
            &["--trees", "x"],
            &["--model"],
            &["--what"],
        ] {
            assert!(parse_train(&args(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_missing_measurements_file_is_one_clear_error() {
        let e = train_task(&args(&[
            "--measurements",
            "/nonexistent/m.json",
            "--model",
            "/nonexistent/x.json",
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/m.json"), "{e}");
    }
}
