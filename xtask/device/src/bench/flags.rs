//! The `flags` of a matrix entry: more options of `kruskal mttkrp`,
//! `kruskal cpd` or `kruskal cp-apr`, written as on the command line and
//! laid over the options the entry's own keys give
//! ([`kruskal::measure::MttkrpOptions`], [`kruskal::measure::CpdRunOptions`],
//! [`kruskal::cpd::AprOptions`]). The entry's keys set the backend,
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
//!   `--gpu-timeout-s S`, `--exchange-rows auto|all|read`,
//!   `--gpu-plan auto|rows|split[:MODE]`; AO-ADMM (on the CPU, one GPU or
//!   a group) with `--nonneg [MODES]` (all modes, or a comma
//!   list numbered from 1), `--l1 W`, `--l2 W` (weights >= 0) and
//!   `--admm-blocks` (with one of those three);
//! - `[[cp_apr]]`: `--inner-iters N` (>= 1), `--tol T`, `--kappa K`,
//!   `--kappa-tol T` (>= 0), `--eps-div-zero E` (> 0), `--seed S`. Its
//!   defaults are `kruskal cp-apr`'s, stopping rule included: a run that
//!   meets `--tol` early counts the iterations it ran.

use std::time::Duration;

use anyhow::Result;
use clap::{Args, Parser, ValueEnum};
use kruskal::cpd::apr::{self, AprInit, AprOptions};
use kruskal::cpd::{InnerStop, NonNeg};
use kruskal::measure::{ConstraintFlags, CpdRunOptions, MttkrpOptions, parse_nonneg, parse_weight};
use kruskal_device::{FactorPrecision, GpuOptions};
use kruskal_group::{PlanChoice, RowExchange, StreamPolicy};

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
    #[arg(long, default_value = "auto")]
    gpu_plan: PlanChoice,
    #[arg(long, value_name = "MODES", num_args = 0..=1, default_missing_value = "all",
          value_parser = parse_nonneg)]
    nonneg: Option<NonNeg>,
    #[arg(long, value_name = "W", allow_negative_numbers = true, value_parser = parse_weight)]
    l1: Option<f64>,
    #[arg(long, value_name = "W", allow_negative_numbers = true, value_parser = parse_weight)]
    l2: Option<f64>,
    #[arg(long)]
    admm_blocks: bool,
    #[command(flatten)]
    launch: Launch,
}

impl CpdFlags {
    /// The constraint flags, which `kruskal cpd` reads the same way.
    fn constraints(&self) -> ConstraintFlags {
        ConstraintFlags {
            nonneg: self.nonneg.clone(),
            l1: self.l1,
            l2: self.l2,
            admm_blocks: self.admm_blocks,
        }
    }
}

/// A finite value >= 0 (CP-APR's tolerances).
fn parse_tolerance(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(w) if w.is_finite() && w >= 0.0 => Ok(w),
        _ => Err(format!("'{text}' is not a finite number >= 0")),
    }
}

/// A finite value > 0 (`--eps-div-zero`).
fn parse_positive(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(w) if w.is_finite() && w > 0.0 => Ok(w),
        _ => Err(format!("'{text}' is not a finite number > 0")),
    }
}

/// The flags of a `[[cp_apr]]` entry.
#[derive(Parser, Debug)]
#[command(name = "kruskal cp-apr")]
struct CpAprFlags {
    #[arg(long, default_value_t = apr::DEFAULT_MAX_INNER_ITERS as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    inner_iters: u64,
    #[arg(long, default_value_t = apr::DEFAULT_TOL, value_parser = parse_tolerance)]
    tol: f64,
    #[arg(long, default_value_t = apr::DEFAULT_KAPPA, value_parser = parse_tolerance)]
    kappa: f64,
    #[arg(long, default_value_t = apr::DEFAULT_KAPPA_TOL, value_parser = parse_tolerance)]
    kappa_tol: f64,
    #[arg(long, default_value_t = apr::DEFAULT_EPS_DIV_ZERO, value_parser = parse_positive)]
    eps_div_zero: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Parses `flags` as `what` (`mttkrp`, `cpd` or `cp-apr`) takes them; the error is
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
    d.group.plan = f.gpu_plan;
    let constraints = f.constraints();
    constraints
        .check()
        .map_err(|e| anyhow::anyhow!("`kruskal cpd {}`: {e}", flags.join(" ")))?;
    d.cpd.constraints = constraints.admm_options();
    Ok(())
}

/// What tells a constrained entry's rows from ALS ones when the entry has
/// no `tag`: `ao-admm` and its constraints (`ao-admm nonneg`,
/// `ao-admm nonneg 1,3, l1 0.1, blocks`); `None` for ALS.
pub fn cpd_tag(opts: &CpdRunOptions) -> Option<String> {
    let c = opts.decompose.cpd.constraints.as_ref()?;
    let mut parts = Vec::new();
    match &c.nonneg {
        NonNeg::None => {}
        NonNeg::All => parts.push("nonneg".to_string()),
        NonNeg::Modes(m) => {
            let modes: Vec<String> = m.iter().map(|m| (m + 1).to_string()).collect();
            parts.push(format!("nonneg {}", modes.join(",")));
        }
    }
    if c.l1 > 0.0 {
        parts.push(format!("l1 {}", c.l1));
    }
    if c.l2 > 0.0 {
        parts.push(format!("l2 {}", c.l2));
    }
    if c.inner == InnerStop::RowBlocks {
        parts.push("blocks".into());
    }
    Some(
        format!("ao-admm {}", parts.join(", "))
            .trim_end()
            .to_string(),
    )
}

/// Lays a `[[cp_apr]]` entry's flags over `opts` (rank and outer
/// iterations are the entry's).
pub fn cp_apr(flags: &[String], opts: &mut AprOptions) -> Result<()> {
    let f: CpAprFlags = parse("cp-apr", flags)?;
    opts.max_inner_iters = f.inner_iters as usize;
    opts.tol = f.tol;
    opts.kappa = f.kappa;
    opts.kappa_tol = f.kappa_tol;
    opts.eps_div_zero = f.eps_div_zero;
    opts.init = AprInit::Random { seed: f.seed };
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
        cpd(&strings(&["--gpu-plan", "split:3"]), &mut c).unwrap();
        assert_eq!(c.decompose.group.plan, PlanChoice::Split(Some(2)));
        assert!(cpd(&strings(&["--gpu-plan", "grid"]), &mut c).is_err());
        // Without flags, the program's defaults.
        let mut c = CpdRunOptions::default();
        cpd(&[], &mut c).unwrap();
        assert_eq!(c.decompose.group.segment_bytes, 256 << 20);
        assert_eq!((c.decompose.seed, c.decompose.starts), (1, 1));
    }

    #[test]
    fn constraint_flags_ask_for_ao_admm_and_name_its_rows() {
        let mut c = CpdRunOptions::default();
        cpd(&[], &mut c).unwrap();
        assert!(c.decompose.cpd.constraints.is_none());
        assert_eq!(cpd_tag(&c), None);
        cpd(&strings(&["--nonneg"]), &mut c).unwrap();
        let a = c.decompose.cpd.constraints.clone().unwrap();
        assert_eq!((a.nonneg, a.l1, a.l2), (NonNeg::All, 0.0, 0.0));
        assert_eq!(a.inner, InnerStop::AllRows);
        assert_eq!(cpd_tag(&c).as_deref(), Some("ao-admm nonneg"));
        let mut c = CpdRunOptions::default();
        cpd(
            &strings(&["--nonneg", "3,1", "--l1", "0.1", "--admm-blocks"]),
            &mut c,
        )
        .unwrap();
        let a = c.decompose.cpd.constraints.clone().unwrap();
        assert_eq!(a.nonneg, NonNeg::Modes(vec![0, 2]));
        assert_eq!(a.inner, InnerStop::RowBlocks);
        assert_eq!(
            cpd_tag(&c).as_deref(),
            Some("ao-admm nonneg 1,3, l1 0.1, blocks")
        );
        let mut c = CpdRunOptions::default();
        cpd(&strings(&["--l2", "0.5"]), &mut c).unwrap();
        let a = c.decompose.cpd.constraints.clone().unwrap();
        assert_eq!((a.nonneg, a.l2), (NonNeg::None, 0.5));
        assert_eq!(cpd_tag(&c).as_deref(), Some("ao-admm l2 0.5"));
        // The constraint flags' values are checked.
        for bad in [
            &["--nonneg", "0"][..],
            &["--nonneg", "x"],
            &["--l1", "-1"],
            &["--l2", "inf"],
            &["--admm-blocks"],
        ] {
            let e = cpd(&strings(bad), &mut CpdRunOptions::default()).unwrap_err();
            assert_eq!(e.to_string().lines().count(), 1, "{e}");
        }
    }

    #[test]
    fn cp_apr_flags_are_laid_over_the_options() {
        let mut o = AprOptions::new(16);
        o.max_iters = 5;
        cp_apr(&[], &mut o).unwrap();
        // The program's defaults; rank and iterations stay the entry's.
        assert_eq!((o.rank, o.max_iters), (16, 5));
        assert_eq!(o.max_inner_iters, apr::DEFAULT_MAX_INNER_ITERS);
        assert_eq!(o.tol, apr::DEFAULT_TOL);
        cp_apr(
            &strings(&[
                "--inner-iters",
                "3",
                "--tol",
                "0",
                "--kappa",
                "0.5",
                "--kappa-tol",
                "1e-8",
                "--eps-div-zero",
                "1e-12",
                "--seed",
                "7",
            ]),
            &mut o,
        )
        .unwrap();
        assert_eq!(o.max_inner_iters, 3);
        assert_eq!((o.tol, o.kappa, o.kappa_tol), (0.0, 0.5, 1e-8));
        assert_eq!(o.eps_div_zero, 1e-12);
        assert!(matches!(o.init, AprInit::Random { seed: 7 }));
        for bad in [
            &["--inner-iters", "0"][..],
            &["--tol", "-1"],
            &["--kappa", "nan"],
            &["--eps-div-zero", "0"],
            &["--iters", "5"],
            &["--rank", "3"],
            &["--nonneg"],
        ] {
            let e = cp_apr(&strings(bad), &mut o).unwrap_err().to_string();
            assert!(e.starts_with("`kruskal cp-apr "), "{e}");
            assert_eq!(e.lines().count(), 1, "{e}");
        }
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
