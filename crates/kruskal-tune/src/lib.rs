//! Adaptive choice of kruskal's GPU engine and its launch parameters
//! (ScalFrag, CLUSTER'24, section IV-B): a regression model (here a random
//! forest of regression trees), trained on measured MTTKRP times, predicts
//! from a tensor's features how long each configuration of
//! [`Config::space`] takes, and the fastest predicted one is used when it
//! is predicted faster than the fixed default by more than [`MARGIN`].
//!
//! This crate needs no GPU and does not depend on the GPU runtime
//! (`kruskal-device`, cudarc): choosing, training and evaluating read only
//! a tensor (`kruskal-formats`) and files, so `cargo xtask train`, the
//! tests here and anything that only ranks configurations build without
//! the CUDA bindings. Measuring the configurations is the GPU's part and
//! stays in `kruskal-device` (`kruskal_device::tune::sweep`).
//!
//! - [`features`]: [`TensorFeatures`], what the model reads of a tensor
//!   (slices, fibers, their ratios and skew, per mode). They live here, not
//!   in `kruskal-formats`, because their only use is tuning: the feature
//!   vector is the model's input, its column names are checked against
//!   every model and measurements file, and changing it means measuring
//!   and training again; `kruskal info --features` prints the same
//!   features to show what the model sees.
//! - [`Config`]: one point of the search space (an [`Engine`] and its
//!   launch parameter).
//! - [`data`]: the measurements file (`cargo xtask tune`, run on a GPU
//!   machine with `kruskal tune sweep`) and the generated tensors it is
//!   measured on.
//! - [`model`]: [`TuneModel`], the trained model (a smartcore decision tree
//!   or random forest in a small JSON file), and its predictions. This
//!   crate's `model/model.json` is embedded in the binary; the environment
//!   variable `KRUSKAL_TUNE_MODEL` names another file. The measurements it
//!   was trained and judged on are beside it (`model/measurements.json`,
//!   `model/held-out.json`).
//! - [`train`]: fitting the model (`cargo xtask train`) and measuring how
//!   good its choices are (leave one tensor out, or held-out tensors).
//! - [`choose`] (one configuration, and on what [`Basis`]) and
//!   [`candidates`] (the default and the model's best others, to time):
//!   the rules the engine choice applies (`kruskal_cpd::engine_choice`,
//!   which `kruskal mttkrp --kernel auto` and the CPD backend both ask);
//!   [`pick`] and [`shortlist`] are their rules on a ranking, which
//!   [`train`] judges.
//!
//! A [`Config`] names its engine with the plain [`Engine`] enum, not with
//! the GPU runtime's `GpuEngine`, so that this crate stays free of it.
//! `kruskal-device` maps one to the other (`GpuEngine::from(Engine)`, and
//! `kruskal_device::tune::ConfigEngine` gives a configuration's
//! `GpuEngine` and `GpuOptions`); its tests check that the defaults here
//! ([`Config::DEFAULT`], [`Engine::default_config`]) are the engines'.
//!
//! The model is per mode: one training row is (a mode's features, the rank,
//! the configuration) and its target the measured time of that mode's
//! MTTKRP as log2 nanoseconds per nonzero. A configuration's predicted time
//! for a tensor is the sum over its modes, so engines built per tensor are
//! ranked by their whole-sweep time while the per-mode breakdown stays
//! available.
//!
//! ```
//! use kruskal_formats::generate;
//! use kruskal_tune::{Config, TensorFeatures, choose};
//!
//! let t = generate::power_law(&generate::PowerLawSpec::new(vec![60, 50, 40], 2_000)).unwrap();
//! let features = TensorFeatures::compute(&t);
//! // The model's choice, or the fixed default (with the reason) when no
//! // trained model is available. No GPU is needed to choose.
//! let choice = choose(&features, 32, None);
//! assert!(Config::space().contains(&choice.config));
//! ```

pub mod data;
pub mod features;
pub mod model;
pub mod train;

use std::fmt;
use std::str::FromStr;

use kruskal_formats::option::{OptionName, Spelling};

pub use data::{Failure, Measurements, Run, TensorRuns, TensorSpec};
pub use features::{ModeFeatures, TensorFeatures};
pub use model::{Prediction, TuneModel};

/// What can go wrong when tuning: one line each.
#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    /// A tuning model or measurements file that cannot be read, written
    /// or used, a model that cannot predict, or data it cannot be fitted
    /// to.
    #[error("tuning: {0}")]
    Tune(String),

    /// A tensor of the training or held-out set could not be generated.
    #[error("generating {spec}: {error}")]
    Generate {
        spec: String,
        error: kruskal_formats::FormatError,
    },
}

pub type Result<T, E = TuneError> = std::result::Result<T, E>;

/// A GPU MTTKRP engine of the search space, as `--kernel` names it
/// (`kruskal-device` maps it to its `GpuEngine`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Engine {
    /// `coo`: COO with atomics, no launch parameter.
    Coo,
    /// `hicoo`: HiCOO blocks, parameter the block width.
    Hicoo,
    /// `fcoo`: F-COO, parameter the nonzeros per thread.
    Fcoo,
    /// `flycoo`: LPT partitions, parameter their number per SM.
    Flycoo,
}

impl Engine {
    /// Every engine, in the order tables list them.
    pub const ALL: [Engine; 4] = [Engine::Coo, Engine::Hicoo, Engine::Fcoo, Engine::Flycoo];

    /// The name `--kernel` takes.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Coo => "coo",
            Engine::Hicoo => "hicoo",
            Engine::Fcoo => "fcoo",
            Engine::Flycoo => "flycoo",
        }
    }

    /// The engine's configuration at its default launch parameter (what
    /// it runs with when neither a flag nor the model gives one).
    pub fn default_config(self) -> Config {
        match self {
            Engine::Coo => Config::Coo,
            Engine::Hicoo => Config::Hicoo {
                block_bits: u32::from(kruskal_formats::Hicoo::DEFAULT_BLOCK_BITS),
            },
            Engine::Fcoo => Config::DEFAULT,
            Engine::Flycoo => Config::Flycoo {
                kappa_per_sm: FLYCOO_DEFAULT_KAPPA_PER_SM,
            },
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// HiCOO block widths tried: `2^5` to `2^8` indices.
pub const HICOO_BLOCK_BITS: [u32; 4] = [5, 6, 7, 8];
/// F-COO nonzeros per thread tried.
pub const FCOO_THREADLENS: [usize; 5] = [4, 8, 16, 32, 64];
/// FLYCOO partitions (thread blocks) per SM tried.
pub const FLYCOO_KAPPA_PER_SM: [usize; 4] = [1, 2, 4, 8];
/// F-COO's default nonzeros per thread (`kruskal_device::options::DEFAULT_THREADLEN`;
/// the device's tests check they agree).
pub const FCOO_DEFAULT_THREADLEN: usize = 8;
/// FLYCOO's default partitions per SM (what the device's `GpuOptions`
/// fills in; its tests check they agree).
pub const FLYCOO_DEFAULT_KAPPA_PER_SM: usize = 4;

/// One configuration: an engine and its launch parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Config {
    /// `coo_atomic`: no parameter.
    Coo,
    /// `hicoo` with blocks `2^block_bits` indices wide.
    Hicoo { block_bits: u32 },
    /// `fcoo` with `threadlen` nonzeros per thread.
    Fcoo { threadlen: usize },
    /// `flycoo` with `kappa_per_sm` LPT partitions per SM.
    Flycoo { kappa_per_sm: usize },
}

impl Config {
    /// What `--kernel auto` with default options ran before the model:
    /// `fcoo` with [`FCOO_DEFAULT_THREADLEN`].
    pub const DEFAULT: Config = Config::Fcoo {
        threadlen: FCOO_DEFAULT_THREADLEN,
    };

    /// Every configuration the sweep times and the model ranks: `coo`,
    /// `hicoo` over [`HICOO_BLOCK_BITS`], `fcoo` over [`FCOO_THREADLENS`],
    /// `flycoo` over [`FLYCOO_KAPPA_PER_SM`] (14 in all).
    pub fn space() -> Vec<Config> {
        let mut space = vec![Config::Coo];
        space.extend(HICOO_BLOCK_BITS.map(|block_bits| Config::Hicoo { block_bits }));
        space.extend(FCOO_THREADLENS.map(|threadlen| Config::Fcoo { threadlen }));
        space.extend(FLYCOO_KAPPA_PER_SM.map(|kappa_per_sm| Config::Flycoo { kappa_per_sm }));
        space
    }

    /// The engine this configuration runs.
    pub fn engine(self) -> Engine {
        match self {
            Config::Coo => Engine::Coo,
            Config::Hicoo { .. } => Engine::Hicoo,
            Config::Fcoo { .. } => Engine::Fcoo,
            Config::Flycoo { .. } => Engine::Flycoo,
        }
    }

    /// FLYCOO's partitions per mode on a GPU of `sms` SMs (the space
    /// counts them per SM; at least one SM is assumed); `None` for the
    /// other engines.
    pub fn kappa(self, sms: usize) -> Option<usize> {
        match self {
            Config::Flycoo { kappa_per_sm } => Some(kappa_per_sm * sms.max(1)),
            _ => None,
        }
    }

    /// The options that select this configuration on a GPU of `sms` SMs:
    /// the engine, then its parameter (FLYCOO's as partitions per mode).
    pub fn option_values(self, sms: usize) -> Vec<(OptionName, Option<String>)> {
        let mut options = vec![(OptionName::Kernel, Some(self.engine().to_string()))];
        match self {
            Config::Coo => {}
            Config::Hicoo { block_bits } => {
                options.push((OptionName::BlockBits, Some(block_bits.to_string())));
            }
            Config::Fcoo { threadlen } => {
                options.push((OptionName::Threadlen, Some(threadlen.to_string())));
            }
            Config::Flycoo { .. } => {
                let kappa = self.kappa(sms).unwrap_or(0);
                options.push((OptionName::Kappa, Some(kappa.to_string())));
            }
        }
        options
    }

    /// [`Config::option_values`] as a front end spells them: the command
    /// line's `--kernel fcoo --threadlen 16`, say.
    pub fn spelled(self, sms: usize, spell: Spelling) -> String {
        kruskal_formats::option::spell_all(&self.option_values(sms), spell)
    }

    /// The model's columns for this configuration: the engine one-hot, then
    /// its parameter in its own column (0 for the other engines).
    fn columns(self) -> [f64; 7] {
        let mut c = [0.0; 7];
        match self {
            Config::Coo => c[0] = 1.0,
            Config::Hicoo { block_bits } => {
                c[1] = 1.0;
                c[4] = f64::from(block_bits);
            }
            Config::Fcoo { threadlen } => {
                c[2] = 1.0;
                c[5] = threadlen as f64;
            }
            Config::Flycoo { kappa_per_sm } => {
                c[3] = 1.0;
                c[6] = kappa_per_sm as f64;
            }
        }
        c
    }
}

/// `coo`, `hicoo/block_bits=7`, `fcoo/threadlen=8`, `flycoo/kappa_per_sm=4`.
impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Config::Coo => f.write_str("coo"),
            Config::Hicoo { block_bits } => write!(f, "hicoo/block_bits={block_bits}"),
            Config::Fcoo { threadlen } => write!(f, "fcoo/threadlen={threadlen}"),
            Config::Flycoo { kappa_per_sm } => write!(f, "flycoo/kappa_per_sm={kappa_per_sm}"),
        }
    }
}

impl FromStr for Config {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "unknown configuration '{s}' (e.g. coo, hicoo/block_bits=7, fcoo/threadlen=8, flycoo/kappa_per_sm=4)"
            )
        };
        if s == "coo" {
            return Ok(Config::Coo);
        }
        let (engine, param) = s.split_once('/').ok_or_else(bad)?;
        let (name, value) = param.split_once('=').ok_or_else(bad)?;
        let value: usize = value.parse().map_err(|_| bad())?;
        match (engine, name) {
            ("hicoo", "block_bits") => u32::try_from(value)
                .map(|block_bits| Config::Hicoo { block_bits })
                .map_err(|_| bad()),
            ("fcoo", "threadlen") => Ok(Config::Fcoo { threadlen: value }),
            ("flycoo", "kappa_per_sm") => Ok(Config::Flycoo {
                kappa_per_sm: value,
            }),
            _ => Err(bad()),
        }
    }
}

impl serde::Serialize for Config {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Config {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Names of the columns [`row`] appends to a mode's feature vector.
pub const CONFIG_COLUMNS: [&str; 8] = [
    "rank",
    "engine_coo",
    "engine_hicoo",
    "engine_fcoo",
    "engine_flycoo",
    "block_bits",
    "threadlen",
    "kappa_per_sm",
];

/// The names of a model row's columns: [`TensorFeatures::MODE_VECTOR_NAMES`]
/// then [`CONFIG_COLUMNS`].
pub fn row_names() -> Vec<String> {
    TensorFeatures::MODE_VECTOR_NAMES
        .iter()
        .chain(CONFIG_COLUMNS.iter())
        .map(|s| s.to_string())
        .collect()
}

/// One model row: a mode's feature vector (from
/// [`TensorFeatures::mode_vector`]), the rank, and the configuration.
pub fn row(mode_vector: &[f64], rank: usize, config: Config) -> Vec<f64> {
    let mut r = Vec::with_capacity(mode_vector.len() + CONFIG_COLUMNS.len());
    r.extend_from_slice(mode_vector);
    r.push(rank as f64);
    r.extend(config.columns());
    r
}

/// A configuration picked for a tensor, and on what basis.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub config: Config,
    pub basis: Basis,
}

impl Choice {
    /// The model's predicted time for all modes of [`Choice::config`], in
    /// ms (`None` when no model could rank the configurations).
    pub fn predicted_ms(&self) -> Option<f64> {
        match self.basis {
            Basis::Model { predicted_ms } | Basis::Kept { predicted_ms, .. } => Some(predicted_ms),
            Basis::NoRanking(_) => None,
        }
    }
}

/// Why [`choose`] picked its configuration.
#[derive(Clone, Debug, PartialEq)]
pub enum Basis {
    /// The model's first choice, predicted `predicted_ms` for all modes.
    Model { predicted_ms: f64 },
    /// The default, kept by the [`MARGIN`] rule; predicted `predicted_ms`.
    Kept { predicted_ms: f64, kept: MarginKept },
    /// No model could rank the configurations (the reason: no trained
    /// model, or none of the engine's configurations ranked), so the
    /// default.
    NoRanking(String),
}

/// The margin rule kept `default` although `first` was ranked ahead of
/// it: `first` was predicted only `gain` (a fraction) faster.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MarginKept {
    pub default: Config,
    pub first: Config,
    pub gain: f64,
}

/// `default fcoo/threadlen=8 kept, flycoo/kappa_per_sm=2 predicted only
/// 4.0% faster, under the 30% margin`.
impl fmt::Display for MarginKept {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "default {} kept, {} predicted only {:.1}% faster, under the {:.0}% margin",
            self.default,
            self.first,
            100.0 * self.gain,
            100.0 * MARGIN
        )
    }
}

/// The least gain the model must predict before its first choice replaces
/// the default: the first choice is used only when its predicted time is
/// below `(1 - MARGIN)` times the default's predicted time.
///
/// Chosen by leaving one tensor out on the training measurements only
/// (`cargo xtask train` prints the table; `docs/performance.md` records
/// it): of [`train::MARGIN_GRID`], the margin whose choices have the
/// lowest mean time over the best, ties going to the larger margin. On the
/// 17 training tensors (H100) every margin from 7.5% up ties at the best,
/// 1.021 times the best against 1.023 with no margin: no predicted gain
/// over the default reached 7.5% (none of those margins leaves it), and
/// the smaller ones were not to be trusted (the first choice reached 1.25
/// times the best where the default was the best), so without timing only
/// a large predicted gain is acted on. The timed candidates
/// ([`candidates`]) are where the model helps.
pub const MARGIN: f64 = 0.3;

/// How many configurations `kruskal cpd --kernel auto` times on its first
/// iteration ([`candidates`]).
pub const CANDIDATES: usize = 3;

/// The margin rule on a ranking (fastest predicted first, as
/// [`TuneModel::predict`] returns it): the first prediction, unless it is
/// not predicted more than `margin` faster than `default`'s, then
/// `default`'s. `None` only for an empty ranking; the first when `default`
/// is not ranked.
///
/// Cost: one pass over the ranking.
pub fn pick(ranked: &[Prediction], default: Config, margin: f64) -> Option<&Prediction> {
    let first = ranked.first()?;
    match ranked.iter().find(|p| p.config == default) {
        Some(d) if first.total_ms >= (1.0 - margin) * d.total_ms => Some(d),
        _ => Some(first),
    }
}

/// The configurations worth timing from a ranking (fastest predicted
/// first): `default`, then the `k - 1` fastest predicted others (`k` at
/// least 1). [`pick`]'s choice is among them when `k` is 2 or more.
/// `default` comes first because the timed trial keeps the earlier of two
/// equal times.
///
/// Cost: one pass over the ranking.
pub fn shortlist(ranked: &[Prediction], default: Config, k: usize) -> Vec<Config> {
    std::iter::once(default)
        .chain(ranked.iter().map(|p| p.config).filter(|&c| c != default))
        .take(k.max(1))
        .collect()
}

/// The configuration to use for a tensor of `features` at `rank`: the
/// model's choice under the [`MARGIN`] rule ([`pick`]) against
/// [`Config::DEFAULT`], or, with `engine` given, among that engine's
/// configurations against its default parameter
/// ([`Engine::default_config`]); when no trained model can be loaded,
/// that default with the reason.
///
/// Cost: loading the model once per process (cached), then one tree
/// evaluation per configuration and mode (microseconds); computing the
/// features is the caller's (see [`TensorFeatures::compute`]).
pub fn choose(features: &TensorFeatures, rank: usize, engine: Option<Engine>) -> Choice {
    let default = engine.map_or(Config::DEFAULT, Engine::default_config);
    let fallback = |why: String| Choice {
        config: default,
        basis: Basis::NoRanking(why),
    };
    let ranked = match TuneModel::cached().and_then(|m| m.predict(features, rank)) {
        Ok(ranked) => ranked,
        Err(e) => return fallback(e.to_string()),
    };
    let ranked: Vec<Prediction> = ranked
        .into_iter()
        .filter(|p| engine.is_none_or(|e| p.config.engine() == e))
        .collect();
    match pick(&ranked, default, MARGIN) {
        None => fallback(format!(
            "the model ranks no {} configuration",
            engine.map_or("", Engine::name)
        )),
        Some(p) => Choice {
            config: p.config,
            basis: match &ranked[0] {
                first if first.config == p.config => Basis::Model {
                    predicted_ms: p.total_ms,
                },
                first => Basis::Kept {
                    predicted_ms: p.total_ms,
                    kept: MarginKept {
                        default: p.config,
                        first: first.config,
                        gain: 1.0 - first.total_ms / p.total_ms,
                    },
                },
            },
        },
    }
}

/// The configurations worth timing for a tensor before settling on one
/// (the online refinement on the first CPD iteration): [`shortlist`] of
/// the model's ranking, so [`Config::DEFAULT`] and the model's best
/// `k - 1` others (`k` in all, at least 1), or only [`Config::DEFAULT`]
/// when no trained model can be loaded. Cost as [`choose`].
pub fn candidates(features: &TensorFeatures, rank: usize, k: usize) -> Vec<Config> {
    TuneModel::cached()
        .and_then(|m| m.predict(features, rank))
        .map(|ranked| shortlist(&ranked, Config::DEFAULT, k))
        .unwrap_or_else(|_| vec![Config::DEFAULT])
}

/// The configurations `kruskal cpd --kernel auto` times on its first
/// iteration, chosen without the tensor's features: [`Config::DEFAULT`]
/// first (the timed trial keeps the earlier of two equal times), then the
/// two that, with it, come nearest the best configuration over the
/// training measurements (`model/measurements.json`; [`trial_set`] finds
/// them, and a test checks that it still finds these). On those and on
/// the held-out measurements the best configuration is an `fcoo` threadlen
/// in every case, and the best of these three is within 10% of the best in
/// every held-out case, as near as the model's shortlist comes: the
/// model's ranking, whose features take longer than a short run's
/// iterations, adds nothing to a timed trial.
pub const TRIAL: [Config; CANDIDATES] = [
    Config::DEFAULT,
    Config::Fcoo { threadlen: 16 },
    Config::Fcoo { threadlen: 64 },
];

/// For each tensor and rank of `m` that measured every configuration of
/// `set`, the time of the fastest of `set` over the fastest measured.
pub fn over_best(m: &Measurements, set: &[Config]) -> Vec<f64> {
    let mut out = Vec::new();
    for t in &m.tensors {
        for rank in t.ranks() {
            let times: Option<Vec<f64>> = set
                .iter()
                .map(|&c| t.run(c, rank).map(|r| r.total_ms))
                .collect();
            let (Some(times), Some(best)) = (times, t.best(rank)) else {
                continue;
            };
            let fastest = times.into_iter().fold(f64::INFINITY, f64::min);
            out.push(fastest / best.total_ms.max(f64::MIN_POSITIVE));
        }
    }
    out
}

/// The `k` configurations of [`Config::space`], `default` first, whose
/// fastest comes nearest the fastest measured on `m`: the lowest mean of
/// [`over_best`], ties going to the lower worst case, then to the earlier
/// set in the space's order.
///
/// Cost: one [`over_best`] per set of `k - 1` others (91 sets for `k` 3).
pub fn trial_set(m: &Measurements, default: Config, k: usize) -> Vec<Config> {
    let others: Vec<Config> = Config::space()
        .into_iter()
        .filter(|&c| c != default)
        .collect();
    let mut best: Option<(f64, f64, Vec<Config>)> = None;
    let mut pick = vec![0usize; k.saturating_sub(1)];
    // Every increasing choice of k - 1 indices into `others`.
    let mut choose = |set: Vec<Config>| {
        let ratios = over_best(m, &set);
        if ratios.is_empty() {
            return;
        }
        let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
        let worst = ratios.iter().copied().fold(0.0, f64::max);
        if best
            .as_ref()
            .is_none_or(|(m, w, _)| (mean, worst) < (*m, *w))
        {
            best = Some((mean, worst, set));
        }
    };
    fn walk(
        others: &[Config],
        from: usize,
        depth: usize,
        pick: &mut Vec<usize>,
        default: Config,
        visit: &mut dyn FnMut(Vec<Config>),
    ) {
        if depth == pick.len() {
            let set = std::iter::once(default)
                .chain(pick.iter().map(|&i| others[i]))
                .collect();
            visit(set);
            return;
        }
        for i in from..others.len() {
            pick[depth] = i;
            walk(others, i + 1, depth + 1, pick, default, visit);
        }
    }
    walk(&others, 0, 0, &mut pick, default, &mut choose);
    best.map_or_else(|| vec![default], |(_, _, set)| set)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One of the measurement files beside the model.
    fn measurements(name: &str) -> Measurements {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("model")
            .join(name);
        Measurements::read(&path).unwrap()
    }

    #[test]
    fn the_trial_set_is_the_nearest_to_the_best_on_the_measurements() {
        let training = measurements("measurements.json");
        assert_eq!(trial_set(&training, Config::DEFAULT, CANDIDATES), TRIAL);
        let held_out = measurements("held-out.json");
        let ratios = over_best(&held_out, &TRIAL);
        assert!(ratios.len() >= 20, "{} cases", ratios.len());
        let worst = ratios.iter().copied().fold(0.0, f64::max);
        assert!(
            worst <= 1.1,
            "held out, the trial's best is {worst} times the best"
        );
        // The best configuration of every case is an fcoo threadlen.
        for m in [&training, &held_out] {
            for t in &m.tensors {
                for rank in t.ranks() {
                    let best = t.best(rank).unwrap().config;
                    assert_eq!(best.engine(), Engine::Fcoo, "{} rank {rank}", t.id);
                }
            }
        }
        // A set missing a configuration a case measured is not judged there.
        assert!(over_best(&held_out, &[Config::Fcoo { threadlen: 3 }]).is_empty());
    }

    #[test]
    fn configurations_round_trip_through_their_labels() {
        let space = Config::space();
        assert_eq!(space.len(), 14);
        assert!(space.contains(&Config::DEFAULT));
        for c in space {
            assert_eq!(c.to_string().parse::<Config>().unwrap(), c);
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(serde_json::from_str::<Config>(&json).unwrap(), c);
        }
        for bad in [
            "fcoo",
            "fcoo/threadlen",
            "fcoo/kappa_per_sm=2",
            "sorted",
            "hicoo/block_bits=x",
        ] {
            assert!(
                bad.parse::<Config>()
                    .unwrap_err()
                    .contains("unknown configuration"),
                "{bad}"
            );
        }
    }

    /// An option as the command line spells it.
    fn dashed(option: OptionName, value: Option<&str>) -> String {
        let name = option.name().replace('_', "-");
        match value {
            Some(v) => format!("--{name} {v}"),
            None => format!("--{name}"),
        }
    }

    #[test]
    fn flags_name_the_parameter() {
        let c = Config::Flycoo { kappa_per_sm: 2 };
        assert_eq!(c.engine(), Engine::Flycoo);
        assert_eq!(c.kappa(132), Some(264));
        let flags = |c: Config| c.spelled(132, &dashed);
        assert_eq!(flags(c), "--kernel flycoo --kappa 264");
        assert_eq!(
            flags(Config::Hicoo { block_bits: 6 }),
            "--kernel hicoo --block-bits 6"
        );
        assert_eq!(
            flags(Config::Fcoo { threadlen: 16 }),
            "--kernel fcoo --threadlen 16"
        );
        assert_eq!(flags(Config::Coo), "--kernel coo");
        assert_eq!(
            Config::Fcoo { threadlen: 8 }.spelled(1, &kruskal_formats::option::neutral),
            "kernel fcoo threadlen 8"
        );
        // Every engine's default is in the space, under that engine.
        for e in Engine::ALL {
            assert_eq!(e.default_config().engine(), e);
            assert!(Config::space().contains(&e.default_config()), "{e}");
        }
    }

    #[test]
    fn without_a_trained_model_the_default_is_the_only_candidate() {
        let t = kruskal_formats::generate::power_law(
            &kruskal_formats::generate::PowerLawSpec::new(vec![30, 20, 10], 500),
        )
        .unwrap();
        let f = TensorFeatures::compute(&t);
        let trained = TuneModel::cached().is_ok_and(TuneModel::is_trained);
        let c = candidates(&f, 16, 3);
        assert_eq!(c.len(), if trained { 3 } else { 1 });
        assert_eq!(c[0], Config::DEFAULT);
        if trained {
            // The margin rule's choice is always among the candidates.
            assert!(c.contains(&choose(&f, 16, None).config), "{c:?}");
        } else {
            assert_eq!(c, vec![Config::DEFAULT]);
            let choice = choose(&f, 16, Some(Engine::Hicoo));
            assert_eq!(choice.config, Config::Hicoo { block_bits: 7 });
            match &choice.basis {
                Basis::NoRanking(why) => assert!(why.contains("untrained"), "{why}"),
                other => panic!("{other:?}"),
            }
            assert_eq!(choice.predicted_ms(), None);
        }
    }

    /// A ranking as [`TuneModel::predict`] returns it, fastest first.
    fn ranking(times: &[(Config, f64)]) -> Vec<Prediction> {
        let mut ranked: Vec<Prediction> = times
            .iter()
            .map(|&(config, ms)| Prediction {
                config,
                mode_ms: vec![ms],
                total_ms: ms,
            })
            .collect();
        ranked.sort_by(|a, b| a.total_ms.total_cmp(&b.total_ms));
        ranked
    }

    #[test]
    fn the_first_choice_replaces_the_default_only_beyond_the_margin() {
        let fly = Config::Flycoo { kappa_per_sm: 2 };
        let fcoo4 = Config::Fcoo { threadlen: 4 };
        let picked = |times: &[(Config, f64)], margin: f64| {
            pick(&ranking(times), Config::DEFAULT, margin).map(|p| (p.config, p.total_ms))
        };
        // 4% predicted gain: under a 5% margin the default stays.
        let close = [(Config::DEFAULT, 1.0), (fly, 0.96), (fcoo4, 0.98)];
        assert_eq!(picked(&close, 0.05), Some((Config::DEFAULT, 1.0)));
        assert_eq!(picked(&close, 0.03), Some((fly, 0.96)));
        assert_eq!(picked(&close, 0.0), Some((fly, 0.96)));
        // Exactly at the margin is not beyond it.
        assert_eq!(
            picked(&[(Config::DEFAULT, 1.0), (fly, 0.95)], 0.05),
            Some((Config::DEFAULT, 1.0))
        );
        // 10% predicted gain: the first choice is used.
        let far = [(Config::DEFAULT, 1.0), (fly, 0.9), (fcoo4, 0.97)];
        assert_eq!(picked(&far, 0.05), Some((fly, 0.9)));
        // The default ranked first stays at any margin.
        assert_eq!(
            picked(&[(Config::DEFAULT, 0.5), (fly, 0.9)], 0.0),
            Some((Config::DEFAULT, 0.5))
        );
        // Without the default in the ranking, the first; nothing ranked,
        // nothing picked.
        assert_eq!(picked(&[(fly, 0.9), (fcoo4, 1.0)], 0.05), Some((fly, 0.9)));
        assert_eq!(picked(&[], 0.05), None);
        // What the kept default says.
        let kept = MarginKept {
            default: Config::DEFAULT,
            first: fly,
            gain: 0.04,
        };
        assert_eq!(
            kept.to_string(),
            "default fcoo/threadlen=8 kept, flycoo/kappa_per_sm=2 predicted only 4.0% faster, \
             under the 30% margin"
        );
    }

    #[test]
    fn the_shortlist_always_holds_the_default() {
        let space = Config::space();
        // The default ranked last of all 14.
        let times: Vec<(Config, f64)> = space
            .iter()
            .enumerate()
            .map(|(k, &c)| {
                (
                    c,
                    if c == Config::DEFAULT {
                        100.0
                    } else {
                        k as f64
                    },
                )
            })
            .collect();
        let ranked = ranking(&times);
        assert_eq!(ranked.last().unwrap().config, Config::DEFAULT);
        let list = shortlist(&ranked, Config::DEFAULT, 3);
        assert_eq!(
            list,
            vec![Config::DEFAULT, ranked[0].config, ranked[1].config]
        );
        assert!(list.contains(&pick(&ranked, Config::DEFAULT, MARGIN).unwrap().config));
        // The default ranked first: it and the next two.
        let ranked = ranking(&[
            (Config::DEFAULT, 1.0),
            (Config::Coo, 3.0),
            (Config::Fcoo { threadlen: 4 }, 1.5),
            (Config::Fcoo { threadlen: 16 }, 2.0),
        ]);
        assert_eq!(
            shortlist(&ranked, Config::DEFAULT, 3),
            vec![
                Config::DEFAULT,
                Config::Fcoo { threadlen: 4 },
                Config::Fcoo { threadlen: 16 }
            ]
        );
        // k counts the default; 0 is taken as 1; no repeats past the end.
        assert_eq!(
            shortlist(&ranked, Config::DEFAULT, 1),
            vec![Config::DEFAULT]
        );
        assert_eq!(
            shortlist(&ranked, Config::DEFAULT, 0),
            vec![Config::DEFAULT]
        );
        assert_eq!(shortlist(&ranked, Config::DEFAULT, 10).len(), 4);
        // Not ranked at all, it is still the first candidate.
        assert_eq!(shortlist(&[], Config::DEFAULT, 3), vec![Config::DEFAULT]);
    }

    #[test]
    fn rows_append_rank_and_configuration() {
        let r = row(&[1.0, 2.0], 32, Config::Hicoo { block_bits: 7 });
        assert_eq!(r, vec![1.0, 2.0, 32.0, 0.0, 1.0, 0.0, 0.0, 7.0, 0.0, 0.0]);
        assert_eq!(
            row_names().len(),
            TensorFeatures::MODE_VECTOR_NAMES.len() + CONFIG_COLUMNS.len()
        );
    }
}
