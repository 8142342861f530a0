//! `kruskal gen`: write a synthetic tensor: power-law (optionally shaped like
//! a FROSTT tensor) or planted low-rank with its true factors.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use kruskal_cpd::KruskalModel;
use kruskal_formats::generate::{PRESETS, PlantedSpec, PowerLawSpec, planted, power_law, preset};
use kruskal_formats::write_tensor;

use super::common::parse_dims;
use kruskal::console::{dims_text, spinner, thousands};
use kruskal::input::parse_count;

#[derive(Args, Debug)]
pub struct GenArgs {
    /// Output file; its extension picks the format (.tns, .tns.gz, .ktns).
    #[arg(required_unless_present = "list")]
    pub output: Option<PathBuf>,
    /// Shape of a FROSTT tensor, by its short or FROSTT name (see --list).
    #[arg(long, value_name = "NAME", conflicts_with = "dims")]
    pub like: Option<String>,
    /// Dimensions, e.g. 1000,800,600.
    #[arg(long)]
    pub dims: Option<String>,
    /// Nonzeros (default: the preset's real count; required with --dims).
    #[arg(long, value_parser = parse_count)]
    pub nnz: Option<usize>,
    /// Zipf exponent of every mode, or one per mode (e.g. 1.1,0.5,1.1).
    #[arg(long, default_value = "1.1")]
    pub exponent: String,
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = super::common::parse_seed)]
    pub seed: u64,
    /// Accepted for old scripts: generated coordinates are always distinct
    /// (the nonzero count is that of distinct coordinates).
    #[arg(long, hide = true)]
    pub coalesce: bool,
    /// Generate a planted tensor of this rank instead of a power-law one.
    #[arg(long, value_name = "RANK")]
    pub planted: Option<usize>,
    /// Relative noise on the planted tensor's values.
    #[arg(long, default_value_t = 0.0, requires = "planted")]
    pub noise: f64,
    /// Write the planted factors (lambda.npy, mode-<n>.npy) into DIR.
    #[arg(long, value_name = "DIR", requires = "planted")]
    pub factors: Option<PathBuf>,
    /// List the FROSTT tensors --like knows (those `cargo xtask
    /// fetch-frostt` downloads).
    #[arg(long)]
    pub list: bool,
}

pub fn run(args: GenArgs) -> Result<()> {
    if args.list {
        // One list with `cargo xtask fetch-frostt`: either name works.
        println!(
            "{:<15} {:<19} {:>44} {:>15}",
            "name", "FROSTT's name", "dims", "nonzeros"
        );
        for p in PRESETS {
            println!(
                "{:<15} {:<19} {:>44} {:>15}",
                p.name,
                if p.frostt == p.name { "" } else { p.frostt },
                dims_text(p.dims),
                p.nnz.map_or("not recorded".to_string(), thousands)
            );
        }
        return Ok(());
    }
    let output = args.output.clone().context("give an output file")?;
    // Its extension picks the format: refused before anything is drawn.
    kruskal_formats::io::FileKind::from_path(&output)?;
    let (dims, nnz) = match (&args.like, &args.dims) {
        (Some(name), _) => {
            let p = preset(name)?;
            (p.dims.to_vec(), p.nnz_or(args.nnz)?)
        }
        (None, Some(d)) => (parse_dims(d)?, args.nnz.context("give --nnz with --dims")?),
        (None, None) => bail!("give --like NAME or --dims D1,D2,..."),
    };
    let start = Instant::now();
    let bar = spinner(&format!("generating {} nonzeros", thousands(nnz as u64)));
    let (tensor, truth) = if let Some(rank) = args.planted {
        let p = planted(&PlantedSpec {
            dims: dims.clone(),
            rank,
            nnz,
            noise: args.noise,
            seed: args.seed,
        })?;
        (p.tensor, Some((p.lambda, p.factors)))
    } else {
        let exponents: Vec<f64> = args
            .exponent
            .split(',')
            .map(|s| s.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .with_context(|| format!("--exponent '{}' is not a number list", args.exponent))?;
        let exponents = match exponents.len() {
            1 => vec![exponents[0]; dims.len()],
            n if n == dims.len() => exponents,
            n => bail!("--exponent has {n} values for {} modes", dims.len()),
        };
        let mut spec = PowerLawSpec::new(dims.clone(), nnz).with_seed(args.seed);
        spec.exponents = exponents;
        (power_law(&spec)?, None)
    };
    bar.set_message(format!("writing {}", output.display()));
    super::cleanup::track_output(&output);
    super::cleanup::quit_on_signal()?;
    write_tensor(&output, &tensor)?;
    bar.finish_and_clear();
    println!(
        "wrote {}: {} modes, {}, {} nonzeros in {:.2} s",
        output.display(),
        tensor.nmodes(),
        dims_text(tensor.dims()),
        thousands(tensor.nnz() as u64),
        start.elapsed().as_secs_f64()
    );
    if let (Some(dir), Some((lambda, factors))) = (&args.factors, truth) {
        KruskalModel {
            lambda,
            factors,
            iterations: Vec::new(),
            totals: Default::default(),
            converged: true,
            pseudo_inverse_solves: 0,
            interrupted: false,
        }
        .save(dir)?;
        println!("wrote the planted factors to {}", dir.display());
    }
    Ok(())
}
