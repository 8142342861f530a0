//! Where a tensor comes from: a file, or a power-law tensor generated in
//! memory in the shape of a FROSTT tensor; and the tensor once loaded, with
//! what the loading found. The `kruskal` program and `cargo xtask bench`
//! load their tensors here, so both read and generate them the same way.
//!
//! Loading shows a byte-progress bar or a spinner on a terminal and prints
//! the reader's warnings on standard error (see [`crate::console`]), so a
//! `--json` report on standard output stays clean.
//!
//! ```
//! use kruskal::input::{TensorSource, parse_count};
//!
//! let source = TensorSource::Like { name: "nell-2".into(), nnz: Some(parse_count("2k").unwrap()), seed: 1 };
//! let loaded = source.load().unwrap();
//! assert_eq!(loaded.tensor.nnz(), 2_000);
//! assert_eq!(loaded.source, "generated like nell-2 (seed 1)");
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use kruskal_formats::generate::{PowerLawSpec, power_law, preset};
use kruskal_formats::{FormatError, ReadOptions, ReadReport, SparseTensor, read_tensor_report};

use crate::console::{note, spinner, thousands, warn};

/// Where a tensor comes from.
#[derive(Clone, Debug)]
pub enum TensorSource {
    /// A tensor file: FROSTT text (`.tns`, `.tns.gz`) or kruskal binary
    /// (`.ktns`), read with these options (their `progress` is replaced
    /// by the progress bar).
    File { path: PathBuf, read: ReadOptions },
    /// A power-law tensor generated in the shape of the FROSTT tensor
    /// `name` (`nell-2`, `nell-1`, `delicious-4d`, `flickr-4d`, `enron`,
    /// `vast-5d`, ...; see [`kruskal_formats::generate::preset`]).
    Like {
        name: String,
        /// Nonzeros (default: the real tensor's count).
        nnz: Option<usize>,
        /// Seed of the generator.
        seed: u64,
    },
}

/// A loaded tensor and where it came from.
#[derive(Clone, Debug)]
pub struct Loaded {
    pub tensor: SparseTensor,
    /// The file's path, or how the tensor was generated; reports show it.
    pub source: String,
    /// Seconds the reading or generating took.
    pub load_s: f64,
    /// Lines of the file summed into others (repeated coordinates).
    pub merged: usize,
    /// Seconds of the load spent on repeated coordinates (the order check,
    /// and the sort where needed).
    pub coalesce_s: f64,
}

impl TensorSource {
    /// Reads or generates the tensor (see the module's documentation for
    /// what it prints).
    pub fn load(&self) -> Result<Loaded, FormatError> {
        let start = Instant::now();
        match self {
            TensorSource::Like { name, nnz, seed } => {
                let p = preset(name)?;
                let spec = PowerLawSpec::like(p, *nnz)?.with_seed(*seed);
                let bar = spinner(&format!("generating {} nonzeros like {}", spec.nnz, p.name));
                let tensor = power_law(&spec)?;
                bar.finish_and_clear();
                Ok(Loaded {
                    tensor,
                    source: format!("generated like {} (seed {seed})", p.name),
                    load_s: start.elapsed().as_secs_f64(),
                    merged: 0,
                    coalesce_s: 0.0,
                })
            }
            TensorSource::File { path, read } => {
                let (tensor, report) = read_file(path, read)?;
                Ok(Loaded {
                    tensor,
                    source: path.display().to_string(),
                    load_s: start.elapsed().as_secs_f64(),
                    merged: report.merged,
                    coalesce_s: report.coalesce_s,
                })
            }
        }
    }
}

/// Reads a tensor file with a byte-progress bar on a terminal, and prints
/// (on standard error, so `--json` output stays clean) one line for the
/// repeated coordinates summed and one per warning of the reader.
pub fn read_file(
    path: &Path,
    read: &ReadOptions,
) -> Result<(SparseTensor, ReadReport), FormatError> {
    let mut opts = read.clone();
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(format!("reading {}", path.display()));
    let b = bar.clone();
    opts.progress = Some(Arc::new(move |done, total| {
        b.set_length(total);
        b.set_position(done);
    }));
    let read = read_tensor_report(path, &opts);
    bar.finish_and_clear();
    let (tensor, report) = read?;
    for w in &report.warnings {
        warn(&w.message(&crate::console::flag));
    }
    if report.merged > 0 {
        let (lines, verb) = match report.merged {
            1 => ("1 line repeats".to_string(), "was"),
            n => (format!("{} lines repeat", thousands(n as u64)), "were"),
        };
        note(&format!(
            "{}: {lines} a coordinate and {verb} summed into others ({} lines, {} nonzeros)",
            path.display(),
            thousands((tensor.nnz() + report.merged) as u64),
            thousands(tensor.nnz() as u64)
        ));
    }
    Ok((tensor, report))
}

/// Parses a count such as `1000000`, `1_000_000`, `2.5M`, `10k` or `1G`
/// (nonzeros of a generated tensor); the error is one line for the user.
pub fn parse_count(text: &str) -> Result<usize, String> {
    let t = text.trim().replace('_', "");
    let (num, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1e3),
        Some('m' | 'M') => (&t[..t.len() - 1], 1e6),
        Some('g' | 'G' | 'b' | 'B') => (&t[..t.len() - 1], 1e9),
        _ => (t.as_str(), 1.0),
    };
    let value: f64 = num
        .parse()
        .map_err(|_| format!("'{text}' is not a count (e.g. 1000000, 2.5M, 10k)"))?;
    let n = value * mult;
    if !(1.0..1.8e19).contains(&n) {
        return Err(format!("'{text}' must be a positive count"));
    }
    Ok(n.round() as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_parse_with_suffixes() {
        assert_eq!(parse_count("2.5M"), Ok(2_500_000));
        assert_eq!(parse_count("10k"), Ok(10_000));
        assert_eq!(parse_count("1_000"), Ok(1_000));
        assert!(parse_count("0").is_err());
        assert!(parse_count("lots").is_err());
    }
}
