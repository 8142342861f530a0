//! Fitting the model to measurements (`cargo xtask train`) and judging its
//! choices: leave one tensor out of the training set, or held-out tensors.
//!
//! A choice is judged on measured times only: for each tensor and rank,
//! the measured time of the configuration the model ranks first against
//! the fastest configuration measured (the exhaustive sweep's best), next
//! to the fixed default ([`Config::DEFAULT`]) and to the best of the
//! model's first three (what a few timed candidates on the first CPD
//! iteration would find).

use std::fmt::Write as _;

use smartcore::ensemble::random_forest_regressor::RandomForestRegressorParameters;
use smartcore::linalg::basic::matrix::DenseMatrix;
use smartcore::tree::decision_tree_regressor::DecisionTreeRegressorParameters;

use super::model::{Forest, Regressor, TrainedOn, Tree, target};
use super::{Config, Measurements, TensorRuns, TuneModel, row, row_names};
use crate::{DeviceError, Result};

/// How to fit the model.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainParams {
    /// Deepest split.
    pub max_depth: u16,
    /// Fewest training rows in a leaf.
    pub min_samples_leaf: usize,
    /// 0: one decision tree (as ScalFrag); otherwise a random forest of
    /// this many trees (a larger file).
    pub trees: usize,
    /// Seed of the forest's bootstrap samples.
    pub seed: u64,
}

impl Default for TrainParams {
    fn default() -> Self {
        TrainParams {
            max_depth: 14,
            min_samples_leaf: 3,
            trees: 0,
            seed: 1,
        }
    }
}

impl TrainParams {
    /// E.g. `decision tree, max depth 14, min samples per leaf 3`.
    pub fn describe(&self) -> String {
        match self.trees {
            0 => format!(
                "decision tree, max depth {}, min samples per leaf {}",
                self.max_depth, self.min_samples_leaf
            ),
            n => format!(
                "random forest of {n} trees, max depth {}, min samples per leaf {}, seed {}",
                self.max_depth, self.min_samples_leaf, self.seed
            ),
        }
    }
}

/// The training rows of `tensors` (one per tensor, rank, configuration
/// and mode) and their targets.
pub fn dataset<'a>(tensors: impl IntoIterator<Item = &'a TensorRuns>) -> (Vec<f64>, Vec<f64>) {
    let mut x = Vec::new();
    let mut y = Vec::new();
    for t in tensors {
        for r in &t.runs {
            for (mode, &ms) in r.mode_ms.iter().enumerate() {
                x.extend(row(&t.features[mode], r.rank, r.config));
                y.push(target(ms, t.nnz));
            }
        }
    }
    (x, y)
}

/// Fits a model to every tensor of `m`.
///
/// Errors: no runs to learn from, or smartcore refusing the data.
/// Cost: smartcore's fit, well under a second for a sweep's few thousand
/// rows (a forest: that times its tree count).
pub fn train(m: &Measurements, params: &TrainParams) -> Result<TuneModel> {
    fit(m, m.tensors.iter(), params)
}

fn fit<'a>(
    m: &Measurements,
    tensors: impl IntoIterator<Item = &'a TensorRuns> + Clone,
    params: &TrainParams,
) -> Result<TuneModel> {
    let (x, y) = dataset(tensors.clone());
    let ncols = row_names().len();
    if y.is_empty() {
        return Err(DeviceError::Tune("no measured runs to train on".into()));
    }
    let fail = |e: smartcore::error::Failed| DeviceError::Tune(format!("training: {e}"));
    let rows = y.len();
    let x = DenseMatrix::new(rows, ncols, x, false).map_err(fail)?;
    let regressor = if params.trees == 0 {
        let p = DecisionTreeRegressorParameters::default()
            .with_max_depth(params.max_depth)
            .with_min_samples_leaf(params.min_samples_leaf)
            .with_min_samples_split(2 * params.min_samples_leaf);
        Regressor::Tree(Tree::fit(&x, &y, p).map_err(fail)?)
    } else {
        let p = RandomForestRegressorParameters::default()
            .with_n_trees(params.trees)
            .with_max_depth(params.max_depth)
            .with_min_samples_leaf(params.min_samples_leaf)
            .with_min_samples_split(2 * params.min_samples_leaf)
            .with_seed(params.seed);
        Regressor::Forest(Forest::fit(&x, &y, p).map_err(fail)?)
    };
    Ok(TuneModel::trained(
        regressor,
        TrainedOn {
            gpu: m.gpu.clone(),
            sms: m.sms,
            tensors: tensors.into_iter().count(),
            rows,
            regressor: params.describe(),
        },
    ))
}

/// How one choice fared on one tensor at one rank (times measured, ms for
/// all modes).
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub tensor: String,
    pub rank: usize,
    pub best: Config,
    pub best_ms: f64,
    /// The fixed default's time (`None` if it was not measured).
    pub default_ms: Option<f64>,
    /// The model's first choice among the measured configurations.
    pub chosen: Config,
    pub chosen_ms: f64,
    /// The fastest measured of the model's first three.
    pub top3: Config,
    pub top3_ms: f64,
}

/// Judges `model`'s choices on `tensors` (whose runs it ranks among the
/// configurations measured for each rank).
pub fn evaluate<'a>(
    model: &TuneModel,
    tensors: impl IntoIterator<Item = &'a TensorRuns>,
) -> Result<Vec<Outcome>> {
    let mut out = Vec::new();
    for t in tensors {
        for rank in t.ranks() {
            let Some(best) = t.best(rank) else { continue };
            let ranked: Vec<_> = model
                .predict_vectors(&t.features, t.nnz, rank)?
                .into_iter()
                .filter_map(|p| t.run(p.config, rank))
                .collect();
            let Some(&chosen) = ranked.first() else {
                continue;
            };
            let top3 = ranked
                .iter()
                .take(3)
                .min_by(|a, b| a.total_ms.total_cmp(&b.total_ms))
                .copied()
                .unwrap_or(chosen);
            out.push(Outcome {
                tensor: t.id.clone(),
                rank,
                best: best.config,
                best_ms: best.total_ms,
                default_ms: t.run(Config::DEFAULT, rank).map(|r| r.total_ms),
                chosen: chosen.config,
                chosen_ms: chosen.total_ms,
                top3: top3.config,
                top3_ms: top3.total_ms,
            });
        }
    }
    Ok(out)
}

/// Leave one tensor out: for each tensor of `m`, a model fitted to the
/// others judged on it.
pub fn leave_one_out(m: &Measurements, params: &TrainParams) -> Result<Vec<Outcome>> {
    let mut out = Vec::new();
    for held in &m.tensors {
        let others = m.tensors.iter().filter(|t| t.id != held.id);
        let model = fit(m, others, params)?;
        out.extend(evaluate(&model, [held])?);
    }
    Ok(out)
}

/// Outcomes summed up; ratios are measured time over the best measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    pub cases: usize,
    /// Cases whose model choice is within 10% of the best.
    pub chosen_within_10pct: usize,
    pub default_within_10pct: usize,
    /// Mean of the ratios.
    pub chosen_mean_ratio: f64,
    pub top3_mean_ratio: f64,
    pub default_mean_ratio: f64,
    pub chosen_worst_ratio: f64,
    /// Geometric mean of default time over chosen time (above 1: the
    /// model beats the default).
    pub speedup_over_default: f64,
}

/// Sums up `outcomes` (cases without a default time count for the model
/// only).
pub fn summarize(outcomes: &[Outcome]) -> Summary {
    let n = outcomes.len().max(1) as f64;
    let ratio = |ms: f64, o: &Outcome| ms / o.best_ms.max(f64::MIN_POSITIVE);
    let with_default: Vec<(&Outcome, f64)> = outcomes
        .iter()
        .filter_map(|o| o.default_ms.map(|d| (o, d)))
        .collect();
    let nd = with_default.len().max(1) as f64;
    Summary {
        cases: outcomes.len(),
        chosen_within_10pct: outcomes
            .iter()
            .filter(|o| ratio(o.chosen_ms, o) <= 1.1)
            .count(),
        default_within_10pct: with_default
            .iter()
            .filter(|(o, d)| ratio(*d, o) <= 1.1)
            .count(),
        chosen_mean_ratio: outcomes.iter().map(|o| ratio(o.chosen_ms, o)).sum::<f64>() / n,
        top3_mean_ratio: outcomes.iter().map(|o| ratio(o.top3_ms, o)).sum::<f64>() / n,
        default_mean_ratio: with_default.iter().map(|(o, d)| ratio(*d, o)).sum::<f64>() / nd,
        chosen_worst_ratio: outcomes
            .iter()
            .map(|o| ratio(o.chosen_ms, o))
            .fold(0.0, f64::max),
        speedup_over_default: (with_default
            .iter()
            .map(|(o, d)| (d / o.chosen_ms.max(f64::MIN_POSITIVE)).ln())
            .sum::<f64>()
            / nd)
            .exp(),
    }
}

/// A markdown table of `outcomes` (one row per tensor and rank) and the
/// summary lines under it, as `docs/performance.md` records them.
pub fn markdown(outcomes: &[Outcome]) -> String {
    let mut s = String::new();
    s.push_str("| tensor | rank | best (exhaustive) | ms | default `fcoo/threadlen=8` ms (x best) | model choice | ms (x best) | best of model's top 3, ms (x best) |\n");
    s.push_str("| --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for o in outcomes {
        let x = |ms: f64| ms / o.best_ms.max(f64::MIN_POSITIVE);
        let default = o
            .default_ms
            .map_or("-".into(), |d| format!("{d:.3} ({:.2})", x(d)));
        let _ = writeln!(
            s,
            "| {} | {} | `{}` | {:.3} | {default} | `{}` | {:.3} ({:.2}) | {:.3} ({:.2}) |",
            o.tensor,
            o.rank,
            o.best,
            o.best_ms,
            o.chosen,
            o.chosen_ms,
            x(o.chosen_ms),
            o.top3_ms,
            x(o.top3_ms)
        );
    }
    let sum = summarize(outcomes);
    let _ = writeln!(
        s,
        "\n{} cases: model choice within 10% of the best in {} ({:.0}%), the default in {}; \
         mean time over the best: model {:.3}, model's top 3 {:.3}, default {:.3}; \
         worst model case {:.2}; model over default (geometric mean speedup) {:.3}",
        sum.cases,
        sum.chosen_within_10pct,
        100.0 * sum.chosen_within_10pct as f64 / sum.cases.max(1) as f64,
        sum.default_within_10pct,
        sum.chosen_mean_ratio,
        sum.top3_mean_ratio,
        sum.default_mean_ratio,
        sum.chosen_worst_ratio,
        sum.speedup_over_default
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tune::{Run, TensorRuns};
    use kruskal_formats::TensorFeatures;
    use kruskal_formats::generate::{PowerLawSpec, power_law};

    /// A made-up timing law with a clear rule the tree can learn: `fcoo`
    /// is fastest with 4 nonzeros per thread on tensors whose mode has few
    /// nonzeros per slice and with 32 on the others; `coo` is slow. Only
    /// for testing the training code: these are not GPU numbers.
    fn synthetic_ms(features: &[f64], nnz: u64, rank: usize, config: Config) -> f64 {
        let per_slice = features[TensorFeatures::MODE_VECTOR_NAMES
            .iter()
            .position(|&n| n == "nnz_per_slice")
            .unwrap()];
        let ns = match config {
            Config::Coo => 40.0,
            Config::Hicoo { block_bits } => 3.0 + f64::from(8 - block_bits) * 0.1,
            Config::Fcoo { threadlen } => {
                let best = if per_slice < 100.0 { 4.0 } else { 32.0 };
                1.0 + 0.2 * (threadlen as f64 / best).log2().abs()
            }
            Config::Flycoo { kappa_per_sm } => 2.0 + 0.05 * kappa_per_sm as f64,
        };
        ns * nnz as f64 * (rank as f64 / 32.0) / 1e6
    }

    fn synthetic_measurements() -> Measurements {
        let mut m = Measurements::new("Synthetic", 4, 1);
        let shapes: [(&[u32], usize); 8] = [
            (&[50_000, 40_000, 30_000], 20_000),
            (&[60_000, 50_000, 70_000], 30_000),
            (&[80, 60, 70], 20_000),
            (&[50, 40, 30, 20], 30_000),
            (&[20_000, 30_000, 10_000, 40_000], 25_000),
            (&[100, 90, 30], 25_000),
            (&[40_000, 90, 30_000], 20_000),
            (&[30, 20, 10], 15_000),
        ];
        for (k, (dims, nnz)) in shapes.into_iter().enumerate() {
            let t = power_law(&PowerLawSpec::new(dims.to_vec(), nnz).with_seed(k as u64)).unwrap();
            let f = TensorFeatures::compute(&t);
            let features: Vec<Vec<f64>> = (0..t.nmodes()).map(|m| f.mode_vector(m)).collect();
            let mut runs = Vec::new();
            for rank in [16, 32] {
                for config in Config::space() {
                    let mode_ms: Vec<f64> = features
                        .iter()
                        .map(|v| synthetic_ms(v, f.nnz, rank, config))
                        .collect();
                    runs.push(Run {
                        config,
                        rank,
                        prepare_s: 0.0,
                        total_ms: mode_ms.iter().sum(),
                        mode_ms,
                    });
                }
            }
            m.tensors.push(TensorRuns {
                id: format!("t{k}"),
                spec: None,
                dims: dims.to_vec(),
                nnz: f.nnz,
                features,
                features_s: 0.0,
                runs,
                failures: vec![],
            });
        }
        m
    }

    #[test]
    fn a_tree_learns_the_synthetic_rule_and_survives_a_file_round_trip() {
        let m = synthetic_measurements();
        let model = train(&m, &TrainParams::default()).unwrap();
        assert!(model.is_trained());
        let on_training = summarize(&evaluate(&model, &m.tensors).unwrap());
        assert_eq!(on_training.chosen_within_10pct, on_training.cases);
        assert!(on_training.speedup_over_default >= 1.0);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.json");
        model.write(&path).unwrap();
        let back = TuneModel::read(&path).unwrap();
        let t = &m.tensors[0];
        assert_eq!(
            back.predict_vectors(&t.features, t.nnz, 32).unwrap(),
            model.predict_vectors(&t.features, t.nnz, 32).unwrap()
        );
        assert_eq!(back.trained_on.as_ref().unwrap().tensors, 8);
    }

    #[test]
    fn leave_one_out_judges_every_tensor_and_rank() {
        let m = synthetic_measurements();
        let outcomes = leave_one_out(&m, &TrainParams::default()).unwrap();
        assert_eq!(outcomes.len(), 16);
        for o in &outcomes {
            assert!(o.chosen_ms >= o.best_ms && o.top3_ms <= o.chosen_ms);
        }
        let s = summarize(&outcomes);
        assert!(s.chosen_mean_ratio >= 1.0 && s.top3_mean_ratio <= s.chosen_mean_ratio);
        let table = markdown(&outcomes);
        assert_eq!(
            table
                .lines()
                .filter(|l| l.starts_with("| t") && !l.starts_with("| tensor"))
                .count(),
            16
        );
        assert!(table.contains("16 cases"));
    }

    #[test]
    fn a_small_forest_trains_too() {
        let m = synthetic_measurements();
        let params = TrainParams {
            trees: 3,
            ..TrainParams::default()
        };
        let model = train(&m, &params).unwrap();
        let t = &m.tensors[1];
        let ranked = model.predict_vectors(&t.features, t.nnz, 16).unwrap();
        assert_eq!(ranked.len(), Config::space().len());
        assert!(ranked.windows(2).all(|w| w[0].total_ms <= w[1].total_ms));
    }

    #[test]
    fn nothing_to_learn_is_an_error() {
        let m = Measurements::new("Synthetic", 4, 1);
        assert!(train(&m, &TrainParams::default()).is_err());
    }
}
