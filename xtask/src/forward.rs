//! `cargo xtask kernels` and `cargo xtask bench`: the tasks that need the
//! GPU crates, run by the `xtask-device` binary (`device/`), so that this
//! package builds without them.
//!
//! The arguments go over untouched (`--help` too: `cargo xtask bench
//! --help` prints xtask-device's options) and its exit status comes back.
//! Which `xtask-device` runs:
//!
//! - under cargo (`cargo xtask`, which sets `CARGO`): `cargo run --package
//!   xtask-device --release -- TASK ARGS...`, so it is built from the
//!   sources at hand;
//! - otherwise the `xtask-device` beside this executable, if there is one:
//!   a bundle (`gpu-run/xtask bench ...`) on a machine without cargo;
//! - otherwise `cargo run` as above, with the `cargo` on `PATH`.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, ExitCode, ExitStatus};

use anyhow::{Context, Result};
use clap::Args;

use crate::{cargo_program, workspace_root};

/// The package, and binary, that runs the forwarded tasks.
pub const PACKAGE: &str = "xtask-device";

/// A forwarded task's arguments, parsed by `xtask-device`.
#[derive(Args, Debug)]
pub struct Forwarded {
    /// The task's options (`cargo xtask TASK --help` lists them).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
    pub args: Vec<OsString>,
}

/// Run `xtask-device TASK ARGS...` and return its exit status.
pub fn forward(task: &str, args: &[OsString]) -> Result<ExitCode> {
    let mut cmd = match beside_this_executable() {
        Some(exe) => Command::new(exe),
        None => {
            let mut c = Command::new(cargo_program());
            // The working directory stays the caller's: the task's relative
            // paths (`--out bench-out`) mean what they meant.
            c.arg("run")
                .arg("--manifest-path")
                .arg(workspace_root().join("Cargo.toml"))
                .args(["--package", PACKAGE, "--release", "--"]);
            c
        }
    };
    cmd.arg(task).args(args);
    let status = cmd.status().with_context(|| {
        format!(
            "running {} (cargo xtask {task} needs cargo, or {PACKAGE} beside {})",
            cmd.get_program().to_string_lossy(),
            std::env::current_exe().map_or_else(|_| "xtask".into(), |p| p.display().to_string())
        )
    })?;
    Ok(exit_code(status))
}

/// `xtask-device` in this executable's folder, unless cargo runs this one.
fn beside_this_executable() -> Option<PathBuf> {
    if std::env::var_os("CARGO").is_some() {
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    let sibling = exe.with_file_name(format!("{PACKAGE}{}", std::env::consts::EXE_SUFFIX));
    sibling.is_file().then_some(sibling)
}

/// The child's exit code; a child killed by signal N exits 128 + N, as a
/// shell reports it.
fn exit_code(status: ExitStatus) -> ExitCode {
    if let Some(code) = status.code() {
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            return ExitCode::from(u8::try_from(128 + signal).unwrap_or(1));
        }
    }
    ExitCode::FAILURE
}
