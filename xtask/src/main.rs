//! Development tasks, run as `cargo xtask <task>` (an alias in
//! `.cargo/config.toml`).
//!
//! - `bundle [DIR] [--benches]`: build the release `kruskal` and `xtask`
//!   binaries, the release test executables and, with `--benches`, the
//!   criterion benchmarks (`DIR/benches/NAME`, run as `NAME --bench
//!   [FILTER]`; together they pass the carry limit) and copy them into DIR
//!   (default `gpu-run/`, ignored by git),
//!   ready to be carried to a machine without a Rust toolchain (the GPU
//!   machines) and run there. Prints what to run on the other side.
//! - `kernels [--arch sm_80|sm_90]... [--ptxas PATH] [--jobs N] [--json]`:
//!   compile every kernel specialization with NVRTC for each architecture
//!   (default sm_80 and sm_90), assemble it with `ptxas -v` and print
//!   registers, spills and shared memory per function; fails on any compile
//!   error (see `kernels.rs` and `docs/kernels.md`).
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
//! - `bench [--matrix FILE] [--out DIR] ...`: run the evaluation matrix
//!   (`bench/*.toml`: tensors, engines, ranks, GPU counts) through the
//!   library, with the PyTorch baseline where torch is installed, and
//!   write `results.json`, `report.md` and SVG plots; `bench report` rebuilds
//!   the report from results files and updates `docs/performance.md` (see
//!   `bench/mod.rs`).
//!
//! The bundle is built without debug information, in its own target folder
//! (`target/bundle`, so ordinary release builds keep their cache), because
//! what is carried to the GPU machine is limited to 64 MiB.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use anyhow::{Context, Result, bail};

mod bench;
mod frostt;
mod kernels;
mod tune;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the error and its causes, outermost first.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("bundle") => {
            let benches = args[1..].iter().any(|a| a == "--benches");
            let dir = args[1..].iter().find(|a| !a.starts_with("--"));
            bundle(Path::new(dir.map_or("gpu-run", String::as_str)), benches)
        }
        Some("kernels") => kernels::kernels(&args[1..]),
        Some("tune") => tune::tune(&args[1..]),
        Some("train") => tune::train_task(&args[1..]),
        Some("fetch-frostt") => frostt::fetch_frostt(&args[1..]),
        Some("bench") => bench::bench(&args[1..]),
        _ => {
            eprintln!("usage: cargo xtask bundle [DIR] [--benches]");
            eprintln!("       {}", kernels::USAGE);
            eprintln!("       {}", tune::TUNE_USAGE);
            eprintln!("       {}", tune::TRAIN_USAGE);
            eprintln!("       {}", frostt::USAGE);
            eprintln!("       {}", bench::USAGE);
            eprintln!("  bundle   build release binaries and test executables into DIR (gpu-run/)");
            eprintln!(
                "  kernels  compile every kernel specialization (NVRTC + ptxas -v) and report registers, spills, shared memory"
            );
            eprintln!(
                "  tune     on a GPU machine: time every engine over its launch parameters (kruskal tune sweep)"
            );
            eprintln!(
                "  train    fit the tuning model to the measurements and write crates/kruskal-tune/model/model.json"
            );
            eprintln!(
                "  fetch-frostt  download FROSTT tensors, check them against xtask/frostt-manifest.json, convert to .ktns"
            );
            eprintln!(
                "  bench    run the evaluation matrix (bench/*.toml) and write results.json, report.md and plots"
            );
            bail!("unknown or missing task");
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits in the workspace root")
        .to_path_buf()
}

/// What may be carried to the GPU machine.
const CARRY_LIMIT_BYTES: u64 = 64 << 20;

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
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
        .args(["build", "--release", "-p", "kruskal", "-p", "xtask"])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("cargo build failed");
    }
    // The test executables: cargo lists them in its JSON messages. The
    // development tools (xtask, the benchmark crate) have none worth carrying.
    let out = bundle_cargo()
        .args([
            "test",
            "--release",
            "--workspace",
            "--exclude",
            "xtask",
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
    for name in ["kruskal", "xtask"] {
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
        "bundled kruskal, xtask, {} test executables{} into {} ({:.1} MiB)",
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
