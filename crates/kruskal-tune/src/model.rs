//! The trained model: a smartcore regression tree (or forest) in a JSON
//! file, and its ranked predictions.
//!
//! The repository's copy, `crates/kruskal-tune/model/model.json`, is
//! embedded in the binary; `KRUSKAL_TUNE_MODEL=FILE` replaces it at run
//! time. Before the first training on GPU measurements that copy is an
//! *untrained* placeholder (no regressor), and every prediction is an
//! error that says so; callers then keep the fixed default
//! ([`crate::choose`]).

use std::path::Path;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};
use smartcore::ensemble::random_forest_regressor::RandomForestRegressor;
use smartcore::linalg::basic::matrix::DenseMatrix;
use smartcore::tree::decision_tree_regressor::DecisionTreeRegressor;

use crate::{Config, Result, TensorFeatures, TuneError, row, row_names};

/// The `format` field of a model file.
pub const FORMAT: &str = "kruskal-tune-model";
/// Its `version` field.
pub const VERSION: u32 = 1;
/// The environment variable naming a model file to use instead of the
/// embedded one.
pub const MODEL_ENV: &str = "KRUSKAL_TUNE_MODEL";
/// The repository's model, embedded.
const EMBEDDED: &str = include_str!("../model/model.json");

type Matrix = DenseMatrix<f64>;
pub(crate) type Tree = DecisionTreeRegressor<f64, f64, Matrix, Vec<f64>>;
pub(crate) type Forest = RandomForestRegressor<f64, f64, Matrix, Vec<f64>>;

/// The fitted regressor.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Regressor {
    Tree(Tree),
    Forest(Forest),
}

impl Regressor {
    fn predict(&self, x: &Matrix) -> Result<Vec<f64>> {
        match self {
            Regressor::Tree(t) => t.predict(x),
            Regressor::Forest(f) => f.predict(x),
        }
        .map_err(|e| TuneError::Tune(format!("model prediction: {e}")))
    }
}

/// What a model was trained on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainedOn {
    /// The GPU of the measurements, and its SM count.
    pub gpu: String,
    pub sms: usize,
    pub tensors: usize,
    /// Training rows (tensor x rank x configuration x mode).
    pub rows: usize,
    /// The regressor and its parameters, e.g. `decision tree, max depth 14,
    /// min samples per leaf 3`.
    pub regressor: String,
}

/// A trained (or placeholder) model.
#[derive(Debug, Serialize, Deserialize)]
pub struct TuneModel {
    pub format: String,
    pub version: u32,
    /// [`crate::row_names`] when trained.
    pub feature_names: Vec<String>,
    /// What the target is (for readers of the file).
    pub target: String,
    /// The configurations it ranks.
    pub configs: Vec<Config>,
    /// `None` for the untrained placeholder.
    pub trained_on: Option<TrainedOn>,
    pub(crate) regressor: Option<Regressor>,
}

/// A configuration's predicted time for a tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Prediction {
    pub config: Config,
    /// Predicted ms per mode, mode order.
    pub mode_ms: Vec<f64>,
    /// Their sum.
    pub total_ms: f64,
}

/// The target the model learns: log2 of nanoseconds per nonzero.
pub(crate) fn target(ms: f64, nnz: u64) -> f64 {
    (ms * 1e6 / nnz.max(1) as f64).max(1e-9).log2()
}

const TARGET: &str = "log2(ns per nonzero) of one mode's MTTKRP";

impl TuneModel {
    /// The placeholder written before any training: it ranks nothing.
    pub fn untrained() -> Self {
        TuneModel {
            format: FORMAT.into(),
            version: VERSION,
            feature_names: row_names(),
            target: TARGET.into(),
            configs: Config::space(),
            trained_on: None,
            regressor: None,
        }
    }

    pub(crate) fn trained(regressor: Regressor, trained_on: TrainedOn) -> Self {
        TuneModel {
            trained_on: Some(trained_on),
            regressor: Some(regressor),
            ..TuneModel::untrained()
        }
    }

    pub fn is_trained(&self) -> bool {
        self.regressor.is_some()
    }

    /// The cached model when it is trained, else why it cannot be used
    /// (what `--kernel auto` prints before falling back to the defaults).
    pub fn usable() -> std::result::Result<&'static TuneModel, String> {
        match Self::cached() {
            Ok(m) if m.is_trained() => Ok(m),
            Ok(_) => Err("the tuning model is untrained".into()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Parses a model file's text; `what` names it in errors.
    pub fn from_json(text: &str, what: &str) -> Result<Self> {
        let bad = |m: String| TuneError::Tune(format!("{what}: {m}"));
        let model: TuneModel = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        if model.format != FORMAT || model.version != VERSION {
            return Err(bad(format!(
                "not a {FORMAT} file of version {VERSION} (format '{}', version {})",
                model.format, model.version
            )));
        }
        if model.feature_names != row_names() {
            return Err(bad(
                "trained on other features than this build computes; retrain it (cargo xtask train)".into(),
            ));
        }
        Ok(model)
    }

    /// Reads a model file.
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| TuneError::Tune(format!("{}: {e}", path.display())))?;
        Self::from_json(&text, &path.display().to_string())
    }

    /// Writes the model file (temporary name, then renamed).
    pub fn write(&self, path: &Path) -> Result<()> {
        let fail = |e: std::io::Error| TuneError::Tune(format!("{}: {e}", path.display()));
        let text = serde_json::to_string(self).map_err(|e| TuneError::Tune(e.to_string()))?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text + "\n").map_err(fail)?;
        std::fs::rename(&tmp, path).map_err(fail)
    }

    /// The embedded model (this crate's `model/model.json`).
    pub fn embedded() -> Result<Self> {
        Self::from_json(EMBEDDED, "the embedded tuning model")
    }

    /// The model named by `KRUSKAL_TUNE_MODEL`, else the embedded one.
    pub fn load() -> Result<Self> {
        match std::env::var_os(MODEL_ENV) {
            Some(path) => Self::read(Path::new(&path))
                .map_err(|e| TuneError::Tune(format!("{MODEL_ENV}: {e}"))),
            None => Self::embedded(),
        }
    }

    /// [`TuneModel::load`] once per process; later calls share it.
    pub fn cached() -> Result<&'static TuneModel> {
        static MODEL: OnceLock<std::result::Result<TuneModel, String>> = OnceLock::new();
        MODEL
            .get_or_init(|| Self::load().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| TuneError::Tune(e.clone()))
    }

    /// Every configuration's predicted time for a tensor of `features` at
    /// `rank`, fastest first (ties keep [`Config::DEFAULT`] first, then
    /// the order of [`Config::space`]).
    ///
    /// Errors: an untrained model, or a tensor without nonzeros.
    /// Cost: one tree (or forest) evaluation per configuration and mode.
    pub fn predict(&self, features: &TensorFeatures, rank: usize) -> Result<Vec<Prediction>> {
        let vectors: Vec<Vec<f64>> = (0..features.nmodes())
            .map(|m| features.mode_vector(m))
            .collect();
        self.predict_vectors(&vectors, features.nnz, rank)
    }

    /// [`TuneModel::predict`] from the mode vectors
    /// ([`TensorFeatures::mode_vector`] of every mode) and the nonzero
    /// count, as a measurements file stores them.
    pub fn predict_vectors(
        &self,
        mode_vectors: &[Vec<f64>],
        nnz: u64,
        rank: usize,
    ) -> Result<Vec<Prediction>> {
        let regressor = self.regressor.as_ref().ok_or_else(|| {
            TuneError::Tune(
                "the tuning model is untrained (run the GPU sweep, then cargo xtask train)".into(),
            )
        })?;
        if nnz == 0 || mode_vectors.is_empty() {
            return Err(TuneError::Tune("no nonzeros to predict for".into()));
        }
        let ncols = self.feature_names.len();
        let mut values = Vec::with_capacity(self.configs.len() * mode_vectors.len() * ncols);
        for &c in &self.configs {
            for v in mode_vectors {
                values.extend(row(v, rank, c));
            }
        }
        let nrows = values.len() / ncols;
        if nrows * ncols != values.len() {
            return Err(TuneError::Tune(format!(
                "feature vectors of {} values for a model of {ncols} columns",
                mode_vectors[0].len()
            )));
        }
        let x = DenseMatrix::new(nrows, ncols, values, false)
            .map_err(|e| TuneError::Tune(e.to_string()))?;
        let y = regressor.predict(&x)?;
        let modes = mode_vectors.len();
        let mut ranked: Vec<(usize, Prediction)> = self
            .configs
            .iter()
            .enumerate()
            .map(|(k, &config)| {
                let mode_ms: Vec<f64> = y[k * modes..(k + 1) * modes]
                    .iter()
                    .map(|&l| l.exp2() * nnz as f64 / 1e6)
                    .collect();
                let total_ms = mode_ms.iter().sum();
                (
                    k,
                    Prediction {
                        config,
                        mode_ms,
                        total_ms,
                    },
                )
            })
            .collect();
        ranked.sort_by(|(ka, a), (kb, b)| {
            a.total_ms
                .total_cmp(&b.total_ms)
                .then((a.config != Config::DEFAULT).cmp(&(b.config != Config::DEFAULT)))
                .then(ka.cmp(kb))
        });
        Ok(ranked.into_iter().map(|(_, p)| p).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_model_parses() {
        let m = TuneModel::embedded().unwrap();
        assert_eq!(m.configs, Config::space());
        if !m.is_trained() {
            let f = TensorFeatures::compute(
                &kruskal_formats::generate::power_law(
                    &kruskal_formats::generate::PowerLawSpec::new(vec![9, 8, 7], 100),
                )
                .unwrap(),
            );
            assert!(
                m.predict(&f, 16)
                    .unwrap_err()
                    .to_string()
                    .contains("untrained")
            );
        }
    }

    #[test]
    fn bad_model_files_are_refused_with_one_line() {
        assert!(TuneModel::from_json("{", "x").is_err());
        let mut m = TuneModel::untrained();
        m.version = 99;
        let e = TuneModel::from_json(&serde_json::to_string(&m).unwrap(), "x").unwrap_err();
        assert!(e.to_string().contains("version"));
        let mut m = TuneModel::untrained();
        m.feature_names.pop();
        let e = TuneModel::from_json(&serde_json::to_string(&m).unwrap(), "x").unwrap_err();
        assert!(e.to_string().contains("retrain"));
        assert!(!e.to_string().contains('\n'));
    }

    #[test]
    fn target_is_log2_ns_per_nonzero() {
        // 2 ms over 1M nonzeros: 2 ns each.
        assert!((target(2.0, 1_000_000) - 1.0).abs() < 1e-12);
    }
}
