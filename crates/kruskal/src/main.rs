//! The `kruskal` program: a thin layer that parses options and calls the
//! library (one module per subcommand under `cli/`, private to the
//! binary).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cli;

use cli as cmd;

/// CP decomposition of large sparse tensors.
#[derive(Parser, Debug)]
#[command(name = "kruskal", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Decompose a tensor by CPD-ALS (or try it on a planted tensor: --demo).
    Cpd(Box<cmd::cpd::CpdArgs>),
    /// Decompose a count tensor by CP-APR (Poisson CP, multiplicative
    /// updates; as pyttb's cp_apr).
    CpApr(cmd::cp_apr::CpAprArgs),
    /// Time the MTTKRP of each mode.
    Mttkrp(cmd::mttkrp::MttkrpArgs),
    /// Show a tensor's shape and per-mode statistics.
    Info(cmd::info::InfoArgs),
    /// Convert between .tns, .tns.gz and the binary .ktns format.
    Convert(cmd::convert::ConvertArgs),
    /// Generate a synthetic tensor (power-law or planted low-rank).
    Gen(cmd::generate::GenArgs),
    /// Check every MTTKRP engine against the f64 reference on this machine.
    Check(cmd::check::CheckArgs),
    /// GPU tuning: measure engines and launch parameters (sweep), judge
    /// the tuning model (eval), show its ranking for a tensor (predict).
    Tune(cmd::tune::TuneArgs),
}

impl Command {
    /// The subcommand's name, as typed.
    fn name(&self) -> &'static str {
        match self {
            Command::Cpd(_) => "cpd",
            Command::CpApr(_) => "cp-apr",
            Command::Mttkrp(_) => "mttkrp",
            Command::Info(_) => "info",
            Command::Convert(_) => "convert",
            Command::Gen(_) => "gen",
            Command::Check(_) => "check",
            Command::Tune(_) => "tune",
        }
    }
}

/// Rust ignores SIGPIPE, so printing into a closed pipe (`kruskal info X |
/// head -1`) would panic. Restoring the default action makes the program end
/// quietly when its reader goes away, as other Unix tools do.
#[cfg(unix)]
fn restore_sigpipe() {
    // SAFETY: called first in main, before any other thread exists; setting
    // a signal's disposition to its default has no other precondition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> ExitCode {
    kruskal::wall::mark_main();
    #[cfg(unix)]
    restore_sigpipe();
    let cli = Cli::parse();
    let name = cli.command.name();
    let result = match cli.command {
        Command::Cpd(a) => cmd::cpd::run(*a),
        Command::CpApr(a) => cmd::cp_apr::run(a),
        Command::Mttkrp(a) => cmd::mttkrp::run(a),
        Command::Info(a) => cmd::info::run(a),
        Command::Convert(a) => cmd::convert::run(a),
        Command::Gen(a) => cmd::generate::run(a),
        Command::Check(a) => cmd::check::run(a),
        Command::Tune(a) => cmd::tune::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the outermost context first, then its causes.
            // The words after the subcommand: the advice for a missing
            // GPU names the options that asked for one.
            let typed: Vec<String> = std::env::args().skip(2).collect();
            eprintln!("kruskal: error: {}", cmd::errors::report(name, &typed, &e));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// clap checks option definitions only when they are parsed; this
    /// checks every subcommand's at once.
    #[test]
    fn command_line_definition_is_consistent() {
        super::Cli::command().debug_assert();
    }
}
