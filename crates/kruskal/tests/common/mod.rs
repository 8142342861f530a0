//! What the end-to-end tests of the `kruskal` program share: running it,
//! its output, the repository's test tensors, and the shape of a clean
//! failure.

// Each test file uses its own part of this module.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The program under test: `KRUSKAL_BIN` when set (test executables carried
/// to another machine, see `cargo xtask bundle`), else the one cargo built.
pub fn kruskal_bin() -> PathBuf {
    std::env::var_os("KRUSKAL_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_kruskal")))
}

pub fn kruskal_command(args: &[&str]) -> Command {
    let mut c = Command::new(kruskal_bin());
    c.args(args);
    c
}

pub fn kruskal(args: &[&str]) -> Output {
    kruskal_command(args)
        .output()
        .expect("the kruskal binary runs")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A test tensor of the repository's `data/` folder (or of the folder
/// `KRUSKAL_TEST_DATA` names); a missing file fails the test.
pub fn data(name: &str) -> PathBuf {
    let dir = std::env::var_os("KRUSKAL_TEST_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data"));
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} not found: the repository's test tensors are missing",
        path.display()
    );
    path
}

/// Asserts a failed run: non-zero exit, one error line, no panic.
pub fn assert_clean_failure(o: &Output, needle: &str) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, got success: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(lines.len(), 1, "want one error line, got: {err}");
    assert!(err.contains(needle), "'{needle}' not in: {err}");
}

/// A successful `kruskal cpd FILE --json` at rank `rank` on the CPU, 8
/// iterations from seed 11 (`--tol 0`), with `extra` flags: the report and
/// the output.
pub fn cpd_json(file: &Path, rank: &str, extra: &[&str]) -> (serde_json::Value, Output) {
    let mut args = vec![
        "cpd",
        file.to_str().unwrap(),
        "--rank",
        rank,
        "--iters",
        "8",
        "--tol",
        "0",
        "--seed",
        "11",
        "--backend",
        "cpu",
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = kruskal(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v = serde_json::from_str(&stdout(&o)).unwrap();
    (v, o)
}

/// The fit of every iteration of a `kruskal cpd --json` report.
pub fn fits(report: &serde_json::Value) -> Vec<f64> {
    report["iterations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|it| it["fit"].as_f64().unwrap())
        .collect()
}
