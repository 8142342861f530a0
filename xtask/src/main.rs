//! Development tasks, run as `cargo xtask <task>` (an alias in
//! `.cargo/config.toml`); clap parses the arguments, and `cargo xtask
//! --help` (or `cargo xtask <task> --help`) lists them.
//!
//! This package builds without the GPU crates (no `kruskal`, no
//! `kruskal-device`, so no cudarc): `train`, `fetch-frostt`, `tune` and
//! `bundle` run here. `kernels` and `bench`, which need them, are the
//! `xtask-device` package (`xtask/device/`); this binary forwards their
//! arguments to it untouched and passes its exit status back (see
//! `forward.rs`), so both are run as before.
//!
//! - `bundle [DIR] [--benches]`: build the release `kruskal`, `xtask` and
//!   `xtask-device` binaries, the release test executables and, with
//!   `--benches`, the criterion benchmarks (`DIR/benches/NAME`, run as
//!   `NAME --bench [FILTER]`; together they pass the carry limit) and copy
//!   them into DIR (default `gpu-run/`, ignored by git),
//!   ready to be carried to a machine without a Rust toolchain (the GPU
//!   machines) and run there (`DIR/xtask bench ...` runs the
//!   `DIR/xtask-device` beside it). Prints what to run on the other side.
//! - `tune [--out DIR] [OPTIONS]`: on a GPU machine, build the release
//!   `kruskal` and run `kruskal tune sweep` (every engine over its launch
//!   parameters on the generated training set; see `tune.rs`).
//! - `train [--measurements FILE]... [--model FILE] [--held-out FILE]
//!   [--max-depth D] [--min-leaf N] [--trees T]`: fit the tuning model to
//!   the measurements in `crates/kruskal-tune/model/`, print how good its
//!   choices are, and write `crates/kruskal-tune/model/model.json`.
//! - `fetch-frostt NAME... | --list | --all [--dir DIR] [--mirror URL]
//!   [--manifest FILE] [--timeout-s S]`: download FROSTT tensors (resuming
//!   a partial download), check their size and SHA-256 against
//!   `xtask/frostt-manifest.json` (recording them there on a first
//!   download), and convert them to `.ktns` in DIR (default `frostt/`; see
//!   `frostt.rs`).
//! - `kernels [--arch sm_80|sm_90]... [--ptxas PATH] [--jobs N] [--json]`
//!   and `bench [--matrix FILE] [--out DIR] ...`: forwarded to
//!   `xtask-device` (its `main.rs` describes them).
//!
//! The bundle is built without debug information, in its own target folder
//! (`target/bundle`, so ordinary release builds keep their cache), because
//! what is carried to the GPU machine is limited to 64 MiB.

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

mod forward;
mod frostt;
mod tune;

/// Development tasks for kruskal.
#[derive(Parser, Debug)]
#[command(name = "xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand, Debug)]
enum Task {
    /// Build release binaries and test executables into DIR (gpu-run/).
    Bundle(BundleArgs),
    /// Compile every kernel specialization (NVRTC + ptxas -v) and report
    /// registers, spills, shared memory.
    #[command(disable_help_flag = true)]
    Kernels(forward::Forwarded),
    /// On a GPU machine: time every engine over its launch parameters
    /// (kruskal tune sweep).
    Tune(tune::TuneArgs),
    /// Fit the tuning model to the measurements and write
    /// crates/kruskal-tune/model/model.json.
    Train(tune::TrainArgs),
    /// Download FROSTT tensors, check them against
    /// xtask/frostt-manifest.json, convert to .ktns.
    FetchFrostt(frostt::FetchArgs),
    /// Run the evaluation matrix (bench/*.toml) and write results.json,
    /// report.md and plots.
    #[command(disable_help_flag = true)]
    Bench(forward::Forwarded),
}

/// `cargo xtask bundle`.
#[derive(Args, Debug)]
struct BundleArgs {
    /// Where the binaries go, relative to the workspace root.
    #[arg(default_value = "gpu-run")]
    dir: PathBuf,
    /// Also build the criterion benchmarks (the bundle then passes the
    /// carry limit: bundle them into another folder).
    #[arg(long)]
    benches: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.task) {
        Ok(code) => code,
        Err(e) => {
            // One line: the error and its causes, outermost first.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(task: Task) -> Result<ExitCode> {
    let done = match task {
        Task::Kernels(a) => return forward::forward("kernels", &a.args),
        Task::Bench(a) => return forward::forward("bench", &a.args),
        Task::Bundle(a) => bundle(&a.dir, a.benches),
        Task::Tune(a) => tune::tune(a),
        Task::Train(a) => tune::train_task(a),
        Task::FetchFrostt(a) => frostt::fetch_frostt(a),
    };
    done.map(|()| ExitCode::SUCCESS)
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits in the workspace root")
        .to_path_buf()
}

/// The binaries a bundle carries (each its package's name): the program,
/// and xtask with the xtask-device it runs for `kernels` and `bench`.
const BUNDLED: [&str; 3] = ["kruskal", "xtask", forward::PACKAGE];

/// What may be carried to the GPU machine.
const CARRY_LIMIT_BYTES: u64 = 64 << 20;

/// The cargo that runs this task (`CARGO`, which `cargo run` sets), else
/// the one on `PATH`.
fn cargo_program() -> OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into())
}

/// Cargo in the workspace root.
fn cargo() -> Command {
    let mut c = Command::new(cargo_program());
    c.current_dir(workspace_root());
    c
}

/// Cargo for the bundle: stripped release builds in `target/bundle`.
fn bundle_cargo() -> Command {
    let mut c = cargo();
    c.env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env("CARGO_PROFILE_RELEASE_STRIP", "symbols")
        .env("CARGO_TARGET_DIR", workspace_root().join("target/bundle"));
    c
}

fn bundle(dir: &Path, benches: bool) -> Result<()> {
    let dir = workspace_root().join(dir);
    let status = bundle_cargo()
        .args(["build", "--release"])
        .args(BUNDLED.iter().flat_map(|name| ["-p", name]))
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("cargo build failed");
    }
    // The test executables: cargo lists them in its JSON messages. The
    // development tools (xtask, xtask-device, the benchmark crate) have none
    // worth carrying.
    let out = bundle_cargo()
        .args([
            "test",
            "--release",
            "--workspace",
            "--exclude",
            "xtask",
            "--exclude",
            forward::PACKAGE,
            "--exclude",
            "kruskal-benches",
            "--no-run",
            "--message-format=json",
        ])
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the test executables failed");
    }
    // Start from empty folders: executables of an earlier bundle carry
    // other hashes in their names and would run again, stale.
    for sub in ["tests", "benches"] {
        if dir.join(sub).exists() {
            fs::remove_dir_all(dir.join(sub))?;
        }
    }
    fs::create_dir_all(dir.join("tests"))?;
    let mut tests = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let is_test = msg["profile"]["test"].as_bool() == Some(true);
        if let (true, Some(exe)) = (is_test, msg["executable"].as_str()) {
            let name = Path::new(exe)
                .file_name()
                .context("executable has a name")?;
            fs::copy(exe, dir.join("tests").join(name))?;
            tests.push(name.to_string_lossy().into_owned());
        }
    }
    // The criterion benchmarks, run there as `BENCH --bench [FILTER]`;
    // only when asked, since with them the bundle passes the carry limit.
    if benches {
        let out = bundle_cargo()
            .args([
                "bench",
                "-p",
                "kruskal-benches",
                "--no-run",
                "--message-format=json",
            ])
            .stderr(Stdio::inherit())
            .output()
            .context("running cargo bench --no-run")?;
        if !out.status.success() {
            bail!("building the benchmarks failed");
        }
        fs::create_dir_all(dir.join("benches"))?;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let is_bench = msg["target"]["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|x| x == "bench"));
            if let (true, Some(exe)) = (is_bench, msg["executable"].as_str()) {
                let name = msg["target"]["name"].as_str().context("bench has a name")?;
                fs::copy(exe, dir.join("benches").join(name))?;
            }
        }
    }
    let mut bytes = 0;
    for name in BUNDLED {
        let bin = workspace_root().join("target/bundle/release").join(name);
        fs::copy(&bin, dir.join(name)).with_context(|| format!("copying {}", bin.display()))?;
        bytes += fs::metadata(dir.join(name))?.len();
    }
    for sub in ["tests", "benches"] {
        if !dir.join(sub).is_dir() {
            continue;
        }
        bytes += fs::read_dir(dir.join(sub))?
            .filter_map(|e| e.ok()?.metadata().ok())
            .map(|m| m.len())
            .sum::<u64>();
    }
    println!(
        "bundled kruskal, xtask, {}, {} test executables{} into {} ({:.1} MiB)",
        forward::PACKAGE,
        tests.len(),
        if benches { " and the benchmarks" } else { "" },
        dir.display(),
        bytes as f64 / (1 << 20) as f64
    );
    let rel = dir.strip_prefix(workspace_root()).unwrap_or(&dir).display();
    println!(
        "run there (from the repository root): for t in {rel}/tests/*; do \
         KRUSKAL_BIN={rel}/kruskal KRUSKAL_TEST_DATA=data $t --include-ignored; done"
    );
    println!(
        "and the benchmark matrix: {rel}/xtask bench --matrix bench/gpu.toml --out $OUT/bench"
    );
    if bytes > CARRY_LIMIT_BYTES {
        bail!(
            "the bundle is {:.1} MiB, more than the {} MiB that can be carried",
            bytes as f64 / (1 << 20) as f64,
            CARRY_LIMIT_BYTES >> 20
        );
    }
    Ok(())
}

#[cfg(test)]
mod cli_tests {
    use clap::{CommandFactory, Parser};

    /// clap checks option definitions only when they are parsed; this
    /// checks every task's at once.
    #[test]
    fn command_line_definition_is_consistent() {
        super::Cli::command().debug_assert();
    }

    fn parse(line: &str) -> super::Cli {
        let argv = std::iter::once("xtask").chain(line.split_whitespace());
        super::Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("`cargo xtask {line}`: {e}"))
    }

    /// The invocations the README, the docs, CI and the GPU scripts use
    /// (`xtask/invocations.txt`; xtask-device's test parses those of the
    /// tasks forwarded to it).
    #[test]
    fn documented_invocations_parse() {
        for line in include_str!("../invocations.txt").lines() {
            if !line.starts_with('#') && !line.trim().is_empty() {
                parse(line);
            }
        }
    }

    /// `kernels` and `bench` hand every argument on as given, options and
    /// `--help` included.
    #[test]
    fn forwarded_arguments_are_untouched() {
        for line in [
            "bench --help",
            "bench -h",
            "bench report a.json --out x --doc docs/performance.md",
            "bench --matrix bench/gpu.toml --only t3",
            "kernels --arch sm_90 --json",
            "kernels --help",
            "kernels",
        ] {
            let (task, rest) = line.split_once(' ').unwrap_or((line, ""));
            let args = match parse(line).task {
                super::Task::Bench(a) if task == "bench" => a.args,
                super::Task::Kernels(a) if task == "kernels" => a.args,
                other => panic!("`cargo xtask {line}` parsed as {other:?}"),
            };
            let args: Vec<_> = args.iter().map(|a| a.to_str().unwrap()).collect();
            assert_eq!(args, rest.split_whitespace().collect::<Vec<_>>(), "{line}");
        }
    }
}
