//! The measurements file written by `kruskal tune sweep` and read by
//! `cargo xtask train`, and the generated tensors the sweep measures.
//!
//! One JSON object: the GPU, the feature names, and per tensor its
//! generator spec, its per-mode feature vectors and one [`Run`] per
//! (configuration, rank) with the median time of each mode. Files from
//! several sweeps can be merged ([`Measurements::merge`]).

use std::path::Path;

use kruskal_formats::SparseTensor;
use kruskal_formats::generate::{PowerLawSpec, power_law, preset};
use serde::{Deserialize, Serialize};

use crate::{Config, Result, TuneError};

/// The `format` field of a measurements file.
pub const FORMAT: &str = "kruskal-tune-measurements";
/// Its `version` field.
pub const VERSION: u32 = 1;

/// A generated tensor: a FROSTT shape (`--like`), a nonzero count, a seed
/// and a Zipf exponent for every mode.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorSpec {
    pub like: String,
    pub nnz: usize,
    pub seed: u64,
    pub exponent: f64,
}

impl TensorSpec {
    pub fn new(like: &str, nnz: usize, seed: u64, exponent: f64) -> Self {
        TensorSpec {
            like: like.into(),
            nnz,
            seed,
            exponent,
        }
    }

    /// A short name, e.g. `nell-2/8M/s12/z1.1`.
    pub fn id(&self) -> String {
        let nnz = if self.nnz % 1_000_000 == 0 {
            format!("{}M", self.nnz / 1_000_000)
        } else {
            self.nnz.to_string()
        };
        format!("{}/{nnz}/s{}/z{}", self.like, self.seed, self.exponent)
    }

    /// The spec with `factor` times the nonzeros (at least 1,000).
    pub fn scaled(&self, factor: f64) -> Self {
        TensorSpec {
            nnz: ((self.nnz as f64 * factor) as usize).max(1_000),
            ..self.clone()
        }
    }

    /// Generates the tensor (deterministic: the same spec gives the same
    /// tensor on any machine).
    pub fn generate(&self) -> Result<SparseTensor> {
        let prepare = |source: kruskal_formats::FormatError| TuneError::Generate {
            spec: self.id(),
            error: source,
        };
        let p = preset(&self.like).map_err(prepare)?;
        let mut spec = PowerLawSpec::like(p, Some(self.nnz))
            .map_err(prepare)?
            .with_seed(self.seed);
        spec.exponents = vec![self.exponent; p.dims.len()];
        power_law(&spec).map_err(prepare)
    }
}

/// `(shape, million nonzeros, seed, Zipf exponent)` of the training set,
/// every shape once at a small size first, so a sweep cut short by its time
/// budget still spans the shapes.
const TRAINING: &[(&str, usize, u64, f64)] = &[
    ("nell-2", 2, 11, 1.1),
    ("nell-1", 4, 11, 1.1),
    ("amazon", 4, 11, 1.1),
    ("reddit", 6, 11, 1.1),
    ("delicious-4d", 4, 11, 1.1),
    ("nips", 3, 11, 1.1),
    ("uber", 3, 11, 1.1),
    ("chicago-crime", 5, 11, 1.1),
    ("vast-5d", 2, 11, 1.1),
    ("nell-2", 8, 12, 1.1),
    ("vast-5d", 6, 12, 1.1),
    ("chicago-crime", 2, 12, 1.4),
    ("delicious-4d", 10, 12, 0.8),
    ("nell-1", 10, 12, 1.3),
    ("amazon", 10, 12, 0.8),
    ("nell-2", 16, 13, 0.8),
    ("vast-5d", 10, 13, 0.8),
];

/// `(shape, million nonzeros, seed, Zipf exponent)` of the held-out set:
/// shapes the training set does not have (enron, flickr-4d, patents with
/// its 3.6 billion nonzeros scaled down) and other seeds and sizes of ones
/// it has. Exponent 1.1 is what `--like` generates.
const HELD_OUT: &[(&str, usize, u64, f64)] = &[
    ("enron", 6, 21, 1.1),
    ("enron", 16, 22, 1.1),
    ("flickr-4d", 12, 21, 1.1),
    ("patents", 16, 21, 1.1),
    ("nell-2", 6, 23, 1.1),
    ("vast-5d", 5, 23, 1.1),
    ("chicago-crime", 4, 23, 1.1),
];

fn specs(table: &[(&str, usize, u64, f64)]) -> Vec<TensorSpec> {
    table
        .iter()
        .map(|&(like, m, seed, z)| TensorSpec::new(like, m * 1_000_000, seed, z))
        .collect()
}

/// The tensors `kruskal tune sweep --set train` measures: FROSTT shapes of
/// 3, 4 and 5 modes, small and huge dimensions, 2 to 16 million nonzeros,
/// Zipf exponents 0.8 to 1.4 (105 million nonzeros in all).
pub fn training_set() -> Vec<TensorSpec> {
    specs(TRAINING)
}

/// The tensors `kruskal tune sweep --set eval` measures; none is in
/// [`training_set`].
pub fn held_out_set() -> Vec<TensorSpec> {
    specs(HELD_OUT)
}

/// One timed configuration at one rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Run {
    pub config: Config,
    pub rank: usize,
    /// Building and uploading the engine, in seconds (shared by the ranks).
    pub prepare_s: f64,
    /// Median ms per mode, mode order.
    pub mode_ms: Vec<f64>,
    /// Sum of `mode_ms`.
    pub total_ms: f64,
}

/// A configuration that could not be built or timed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    pub config: Config,
    /// `None` when the engine could not be built (every rank fails).
    pub rank: Option<usize>,
    pub message: String,
}

/// Everything measured on one tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorRuns {
    /// Unique in a file ([`TensorSpec::id`] for generated tensors).
    pub id: String,
    pub spec: Option<TensorSpec>,
    pub dims: Vec<u32>,
    pub nnz: u64,
    /// [`crate::TensorFeatures::mode_vector`] of every mode.
    pub features: Vec<Vec<f64>>,
    pub features_s: f64,
    pub runs: Vec<Run>,
    pub failures: Vec<Failure>,
}

impl TensorRuns {
    /// The ranks measured, ascending.
    pub fn ranks(&self) -> Vec<usize> {
        let mut r: Vec<usize> = self.runs.iter().map(|r| r.rank).collect();
        r.sort_unstable();
        r.dedup();
        r
    }

    /// The run of `config` at `rank`, if any.
    pub fn run(&self, config: Config, rank: usize) -> Option<&Run> {
        self.runs
            .iter()
            .find(|r| r.config == config && r.rank == rank)
    }

    /// The fastest run at `rank` (all modes).
    pub fn best(&self, rank: usize) -> Option<&Run> {
        self.runs
            .iter()
            .filter(|r| r.rank == rank)
            .min_by(|a, b| a.total_ms.total_cmp(&b.total_ms))
    }
}

/// A measurements file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Measurements {
    pub format: String,
    pub version: u32,
    /// The GPU's name and SM count.
    pub gpu: String,
    pub sms: usize,
    /// Timed sweeps per run (after one warm-up); times are medians.
    pub repeat: usize,
    /// [`crate::TensorFeatures::MODE_VECTOR_NAMES`] when measured.
    pub feature_names: Vec<String>,
    pub tensors: Vec<TensorRuns>,
}

impl Measurements {
    /// An empty file for `gpu` with `sms` SMs.
    pub fn new(gpu: &str, sms: usize, repeat: usize) -> Self {
        Measurements {
            format: FORMAT.into(),
            version: VERSION,
            gpu: gpu.into(),
            sms,
            repeat,
            feature_names: crate::TensorFeatures::MODE_VECTOR_NAMES
                .iter()
                .map(|s| s.to_string())
                .collect(),
            tensors: Vec::new(),
        }
    }

    /// Reads and checks a file: its format, version and that its feature
    /// names are this build's (otherwise the sweep must be run again).
    pub fn read(path: &Path) -> Result<Self> {
        let bad = |message: String| TuneError::Tune(format!("{}: {message}", path.display()));
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let m: Measurements = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if m.format != FORMAT || m.version != VERSION {
            return Err(bad(format!(
                "not a {FORMAT} file of version {VERSION} (format '{}', version {})",
                m.format, m.version
            )));
        }
        let names = Measurements::new("", 0, 0).feature_names;
        if m.feature_names != names {
            return Err(bad(
                "measured with other tensor features than this build computes; run the sweep again"
                    .into(),
            ));
        }
        for t in &m.tensors {
            if t.features.len() != t.dims.len() || t.features.iter().any(|v| v.len() != names.len())
            {
                return Err(bad(format!(
                    "tensor {}: one feature vector of {} values per mode expected",
                    t.id,
                    names.len()
                )));
            }
            if let Some(r) = t.runs.iter().find(|r| r.mode_ms.len() != t.dims.len()) {
                return Err(bad(format!(
                    "tensor {}: run {} at rank {} has {} mode times for {} modes",
                    t.id,
                    r.config,
                    r.rank,
                    r.mode_ms.len(),
                    t.dims.len()
                )));
            }
        }
        Ok(m)
    }

    /// Writes the file (to a temporary name first, then renamed, so a
    /// reader never sees half a file).
    pub fn write(&self, path: &Path) -> Result<()> {
        let fail = |e: std::io::Error| TuneError::Tune(format!("{}: {e}", path.display()));
        let text =
            serde_json::to_string_pretty(self).map_err(|e| TuneError::Tune(e.to_string()))?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text + "\n").map_err(fail)?;
        std::fs::rename(&tmp, path).map_err(fail)
    }

    /// Adds `other`'s tensors (same GPU model and SM count required);
    /// a tensor id already present is an error.
    pub fn merge(&mut self, other: Measurements) -> Result<()> {
        if (other.gpu.as_str(), other.sms) != (self.gpu.as_str(), self.sms) {
            return Err(TuneError::Tune(format!(
                "measurements of {} ({} SMs) and {} ({} SMs) cannot be merged",
                self.gpu, self.sms, other.gpu, other.sms
            )));
        }
        for t in other.tensors {
            if self.tensors.iter().any(|u| u.id == t.id) {
                return Err(TuneError::Tune(format!(
                    "tensor {} is measured twice",
                    t.id
                )));
            }
            self.tensors.push(t);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_are_disjoint_and_generate() {
        let train: Vec<String> = training_set().iter().map(TensorSpec::id).collect();
        for s in held_out_set() {
            assert!(!train.contains(&s.id()), "{}", s.id());
            assert!(preset(&s.like).is_ok());
        }
        for s in training_set() {
            assert!(preset(&s.like).is_ok());
        }
        // Shapes the evaluation names must not be trained on.
        for like in ["enron", "flickr-4d", "patents"] {
            assert!(training_set().iter().all(|s| s.like != like));
        }
        let t = TensorSpec::new("vast-5d", 5_000, 3, 1.1)
            .generate()
            .unwrap();
        assert_eq!((t.nmodes(), t.nnz()), (5, 5_000));
        assert_eq!(
            TensorSpec::new("nell-2", 8_000_000, 12, 1.1).id(),
            "nell-2/8M/s12/z1.1"
        );
        assert_eq!(
            TensorSpec::new("nell-2", 8_000_000, 12, 1.1)
                .scaled(0.001)
                .nnz,
            8_000
        );
        assert!(TensorSpec::new("nosuch", 10, 1, 1.1).generate().is_err());
    }

    #[test]
    fn files_round_trip_and_bad_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.json");
        let mut m = Measurements::new("Test GPU", 4, 3);
        m.tensors.push(TensorRuns {
            id: "a".into(),
            spec: None,
            dims: vec![3, 4],
            nnz: 5,
            features: vec![vec![0.0; m.feature_names.len()]; 2],
            features_s: 0.0,
            runs: vec![Run {
                config: Config::Coo,
                rank: 16,
                prepare_s: 0.1,
                mode_ms: vec![1.0, 2.0],
                total_ms: 3.0,
            }],
            failures: vec![],
        });
        m.write(&path).unwrap();
        assert_eq!(Measurements::read(&path).unwrap(), m);

        let mut twice = m.clone();
        assert!(
            twice
                .merge(m.clone())
                .unwrap_err()
                .to_string()
                .contains("measured twice")
        );
        let mut other = Measurements::new("Other GPU", 4, 3);
        assert!(other.merge(m.clone()).is_err());

        let mut short = m.clone();
        short.tensors[0].runs[0].mode_ms.pop();
        short.write(&path).unwrap();
        assert!(
            Measurements::read(&path)
                .unwrap_err()
                .to_string()
                .contains("mode times")
        );
        let mut renamed = m.clone();
        renamed.feature_names[0] = "something else".into();
        renamed.write(&path).unwrap();
        assert!(
            Measurements::read(&path)
                .unwrap_err()
                .to_string()
                .contains("run the sweep again")
        );
        std::fs::write(&path, "{").unwrap();
        assert!(Measurements::read(&path).is_err());
    }
}
