//! The `flags` of a matrix entry: more options of `kruskal mttkrp` or
//! `kruskal cpd`, written as on the command line and laid over the options
//! the entry's own keys give ([`kruskal::measure::MttkrpOptions`],
//! [`kruskal::measure::CpdRunOptions`]). The entry's keys set the backend,
//! ranks, repeats, iterations and GPU counts; the flags take the rest of
//! what shapes a measurement (see `kruskal mttkrp --help` and `kruskal cpd
//! --help` for what each means):
//!
//! - both: `--no-model`, `--deterministic`, `--kappa K`, `--threadlen N`,
//!   `--block-bits B`, `--fiber on|off`, `--factor-precision f32|bf16|f16`,
//!   `--teams on|off`, `--fcoo-build gpu|host`;
//! - `[[mttkrp]]`: `--mode all|M`, `--verify`;
//! - `[[cpd]]`: `--kernel K`, `--seed S`, `--starts N`, and for a group of
//!   GPUs `--stream auto|always|never`, `--streams N`, `--segment-mb MB`,
//!   `--gpu-timeout-s S`, `--exchange-rows auto|all|read`.

use std::time::Duration;

use anyhow::Result;
use clap::{Args, Parser, ValueEnum};
use kruskal::measure::{CpdRunOptions, MttkrpOptions};
use kruskal_device::{FactorPrecision, GpuOptions};
use kruskal_group::{RowExchange, StreamPolicy};

/// `on` or `off`, as the program takes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Switch {
    On,
    Off,
}

impl Switch {
    fn given(s: Option<Switch>) -> Option<bool> {
        s.map(|s| s == Switch::On)
    }
}

/// The launch options of the GPU engines.
#[derive(Args, Debug)]
struct Launch {
    #[arg(long)]
    no_model: bool,
    #[arg(long)]
    deterministic: bool,
    #[arg(long)]
    kappa: Option<usize>,
    #[arg(long)]
    threadlen: Option<usize>,
    #[arg(long)]
    block_bits: Option<u32>,
    #[arg(long, value_enum)]
    fiber: Option<Switch>,
    #[arg(long, default_value = "f32")]
    factor_precision: FactorPrecision,
    #[arg(long, value_enum)]
    teams: Option<Switch>,
    #[arg(long)]
    rounds: Option<u32>,
    #[arg(long, value_enum)]
    prefetch: Option<Switch>,
    #[arg(long)]
    min_blocks: Option<u32>,
    #[arg(long, value_enum)]
    group_sums: Option<Switch>,
    #[arg(long, default_value = "gpu")]
    fcoo_build: kruskal_device::FcooBuild,
}

impl Launch {
    fn options(&self) -> GpuOptions {
        GpuOptions {
            kappa: self.kappa,
            deterministic: self.deterministic,
            threadlen: self.threadlen,
            block_bits: self.block_bits,
            fiber: Switch::given(self.fiber),
            precision: self.factor_precision,
            teams: Switch::given(self.teams),
            fcoo_build: self.fcoo_build,
            rounds: self.rounds,
            prefetch: Switch::given(self.prefetch),
            min_blocks: self.min_blocks,
            group_sums: Switch::given(self.group_sums),
        }
    }
}

/// The flags of an `[[mttkrp]]` entry.
#[derive(Parser, Debug)]
#[command(name = "kruskal mttkrp")]
struct MttkrpFlags {
    #[arg(long, default_value = "all")]
    mode: String,
    #[arg(long)]
    verify: bool,
    #[command(flatten)]
    launch: Launch,
}

/// How shards stream on a group of GPUs, as `--stream` names it.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum Stream {
    Auto,
    Always,
    Never,
}

/// The flags of a `[[cpd]]` entry.
#[derive(Parser, Debug)]
#[command(name = "kruskal cpd")]
struct CpdFlags {
    #[arg(long, default_value = "auto")]
    kernel: String,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value_t = 1)]
    starts: usize,
    #[arg(long, value_enum, default_value = "auto")]
    stream: Stream,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    streams: u64,
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    segment_mb: u64,
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    gpu_timeout_s: u64,
    #[arg(long, default_value = "auto")]
    exchange_rows: RowExchange,
    #[command(flatten)]
    launch: Launch,
}

/// Parses `flags` as `what` (`mttkrp` or `cpd`) takes them; the error is
/// one line naming the flags.
fn parse<P: Parser>(what: &str, flags: &[String]) -> Result<P> {
    let argv = std::iter::once(what.to_string()).chain(flags.iter().cloned());
    P::try_parse_from(argv).map_err(|e| {
        anyhow::anyhow!(
            "`kruskal {what} {}`: {}",
            flags.join(" "),
            first_line(&e.to_string())
        )
    })
}

fn first_line(s: &str) -> &str {
    s.trim().lines().next().unwrap_or("")
}

/// Lays an `[[mttkrp]]` entry's flags over `opts`.
pub fn mttkrp(flags: &[String], opts: &mut MttkrpOptions) -> Result<()> {
    let f: MttkrpFlags = parse("mttkrp", flags)?;
    opts.mode = f.mode;
    opts.verify |= f.verify;
    opts.gpu = f.launch.options();
    opts.no_model = f.launch.no_model;
    Ok(())
}

/// Lays a `[[cpd]]` entry's flags over `opts`.
pub fn cpd(flags: &[String], opts: &mut CpdRunOptions) -> Result<()> {
    let f: CpdFlags = parse("cpd", flags)?;
    let d = &mut opts.decompose;
    d.kernel = f.kernel.parse()?;
    d.seed = f.seed;
    d.cpd.init = kruskal::cpd::Init::Random { seed: f.seed };
    d.starts = f.starts;
    d.gpu = f.launch.options();
    d.no_model = f.launch.no_model;
    d.group.stream = match f.stream {
        Stream::Auto => StreamPolicy::Auto,
        Stream::Always => StreamPolicy::Always,
        Stream::Never => StreamPolicy::Never,
    };
    d.group.streams = f.streams as usize;
    d.group.segment_bytes = (f.segment_mb as usize) << 20;
    d.group.timeout = Duration::from_secs(f.gpu_timeout_s);
    d.group.rows = f.exchange_rows;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_matrices_flags_are_laid_over_the_entry() {
        let mut m = MttkrpOptions {
            verify: true,
            ..MttkrpOptions::default()
        };
        mttkrp(&strings(&["--no-model", "--threadlen", "16"]), &mut m).unwrap();
        assert!(m.no_model && m.verify);
        assert_eq!(m.gpu.threadlen, Some(16));
        let mut c = CpdRunOptions::default();
        cpd(&strings(&["--kernel", "fcoo", "--no-model"]), &mut c).unwrap();
        assert_eq!(c.decompose.kernel, kruskal::cpd::EngineRequest::Fcoo);
        assert!(c.decompose.no_model);
        cpd(&strings(&["--exchange-rows", "all"]), &mut c).unwrap();
        assert_eq!(c.decompose.group.rows, RowExchange::All);
        // Without flags, the program's defaults.
        let mut c = CpdRunOptions::default();
        cpd(&[], &mut c).unwrap();
        assert_eq!(c.decompose.group.segment_bytes, 256 << 20);
        assert_eq!((c.decompose.seed, c.decompose.starts), (1, 1));
    }

    #[test]
    fn unknown_and_bad_flags_are_one_line_errors() {
        let mut m = MttkrpOptions::default();
        let e = mttkrp(&strings(&["--frobnicate"]), &mut m).unwrap_err();
        assert!(
            e.to_string().starts_with("`kruskal mttkrp --frobnicate`: "),
            "{e}"
        );
        assert_eq!(e.to_string().lines().count(), 1);
        let mut c = CpdRunOptions::default();
        assert!(cpd(&strings(&["--streams", "0"]), &mut c).is_err());
        assert!(cpd(&strings(&["--factor-precision", "f8"]), &mut c).is_err());
    }
}
