//! Which MTTKRP engine runs, chosen in one place.
//!
//! - [`EngineRequest`]: what `--kernel` (Python's `kernel=`) asks for,
//!   parsed once from its text where the program or the Python package
//!   takes it; [`EngineRequest::cpu`] and [`EngineRequest::gpu`] say which
//!   CPU or GPU engine that names (the CPU's `auto` is resolved per tensor
//!   by [`CpuEngine::resolve`] when the engine is built).
//! - [`GpuRequest::choose`]: the GPU engines and launch parameters to build
//!   for a tensor ([`EngineChoice`]), and where they came from
//!   ([`ChoiceSource`]): the flags, the tuning model (`kruskal_tune`'s rules
//!   on its ranking), the fixed trial, or the fixed defaults and why.
//!   [`crate::decompose`] asks for the candidates its first iteration
//!   times ([`ChoiceRule::Trial`]: for `auto`, `kruskal_tune::TRIAL`,
//!   which needs no features); `kruskal mttkrp` for the one configuration it
//!   measures ([`ChoiceRule::One`]). Callers describe the choice; they do
//!   not make it.
//!
//! A configuration's [`GpuEngine`] and [`GpuOptions`] come from
//! `kruskal_device::tune::ConfigEngine`; the margin and the shortlist from
//! `kruskal_tune::{choose, shortlist}`.

use std::fmt;
use std::str::FromStr;
use std::time::Instant;

use kruskal_cpu::CpuEngine;
use kruskal_device::tune::ConfigEngine;
use kruskal_device::{GpuEngine, GpuOptions};
use kruskal_formats::SparseTensor;
use kruskal_tune::{Basis, CANDIDATES, Config, MarginKept, TensorFeatures, TuneModel};

use crate::error::{CpdError, OptionName, Spelling};

/// The GPU engines `--kernel auto` times, at their defaults, when no
/// tuning model ranks the configurations.
pub const AUTO_CANDIDATES: [GpuEngine; 3] = [GpuEngine::Fcoo, GpuEngine::Flycoo, GpuEngine::Hicoo];

/// What `--kernel` asks for. `fcoo`, `flycoo` and `hicoo` name an engine
/// of each kind; `sorted` and `csf` run on the CPU only, `coo` on the GPU
/// only, `shard` on a group of GPUs (`--gpus`) only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EngineRequest {
    /// The CPU's choice per tensor; on a GPU the tuning model's (or the
    /// fixed default); on several GPUs the shard kernel.
    #[default]
    Auto,
    Sorted,
    Csf,
    /// `coo` (also spelled `coo_atomic`): COO with atomics, GPU only.
    Coo,
    Fcoo,
    Flycoo,
    Hicoo,
    /// The several-GPU kernel.
    Shard,
}

impl EngineRequest {
    /// Every request, as `--kernel` spells it.
    pub const ALL: [EngineRequest; 8] = [
        EngineRequest::Auto,
        EngineRequest::Sorted,
        EngineRequest::Csf,
        EngineRequest::Coo,
        EngineRequest::Fcoo,
        EngineRequest::Flycoo,
        EngineRequest::Hicoo,
        EngineRequest::Shard,
    ];

    /// The name `--kernel` takes.
    pub fn name(self) -> &'static str {
        match self {
            EngineRequest::Auto => "auto",
            EngineRequest::Sorted => "sorted",
            EngineRequest::Csf => "csf",
            EngineRequest::Coo => "coo",
            EngineRequest::Fcoo => "fcoo",
            EngineRequest::Flycoo => "flycoo",
            EngineRequest::Hicoo => "hicoo",
            EngineRequest::Shard => "shard",
        }
    }

    /// The CPU engine it names; `None` for a GPU-only one.
    pub fn cpu(self) -> Option<CpuEngine> {
        match self {
            EngineRequest::Auto => Some(CpuEngine::Auto),
            EngineRequest::Sorted => Some(CpuEngine::Sorted),
            EngineRequest::Csf => Some(CpuEngine::Csf),
            EngineRequest::Fcoo => Some(CpuEngine::Fcoo),
            EngineRequest::Flycoo => Some(CpuEngine::Flycoo),
            EngineRequest::Hicoo => Some(CpuEngine::Hicoo),
            EngineRequest::Coo | EngineRequest::Shard => None,
        }
    }

    /// The one-GPU engine it names; `None` for a CPU-only one and for
    /// `shard`.
    pub fn gpu(self) -> Option<GpuEngine> {
        match self {
            EngineRequest::Auto => Some(GpuEngine::Auto),
            EngineRequest::Coo => Some(GpuEngine::CooAtomic),
            EngineRequest::Fcoo => Some(GpuEngine::Fcoo),
            EngineRequest::Flycoo => Some(GpuEngine::Flycoo),
            EngineRequest::Hicoo => Some(GpuEngine::Hicoo),
            EngineRequest::Sorted | EngineRequest::Csf | EngineRequest::Shard => None,
        }
    }
}

impl fmt::Display for EngineRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EngineRequest {
    type Err = CpdError;

    fn from_str(text: &str) -> Result<Self, CpdError> {
        if text == "coo_atomic" {
            return Ok(EngineRequest::Coo);
        }
        EngineRequest::ALL
            .into_iter()
            .find(|k| k.name() == text)
            .ok_or_else(|| {
                CpdError::Invalid(format!(
                    "unknown kernel '{text}' (CPU: auto, sorted, fcoo, flycoo, hicoo, csf; GPU: auto, coo, fcoo, flycoo, hicoo)"
                ))
            })
    }
}

/// How many configurations a choice for `auto` keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChoiceRule {
    /// One: the model's first choice under the margin rule
    /// (`kruskal_tune::choose`), or the fixed default.
    One,
    /// Those the first CPD iteration times: the fixed default and the
    /// model's best others (`kruskal_tune::shortlist`, [`CANDIDATES`] in
    /// all), or [`AUTO_CANDIDATES`] at their defaults without a model.
    Trial,
}

/// One GPU engine to build, with its options.
#[derive(Clone, Debug)]
pub struct GpuCandidate {
    pub engine: GpuEngine,
    /// The flags' options, with the model's parameter where no flag gives
    /// one.
    pub options: GpuOptions,
    /// The tuning configuration it came from, when the model was asked.
    pub config: Option<Config>,
    /// The model's predicted milliseconds for all modes, when it ranked
    /// this configuration.
    pub predicted_ms: Option<f64>,
}

/// Where a choice came from.
#[derive(Clone, Debug, PartialEq)]
pub enum ChoiceSource {
    /// The flags name the engine and give its launch parameter (or it has
    /// none).
    Flags,
    /// The tuning model's ranking; `kept` when the margin rule kept the
    /// default over the model's first choice.
    Model { kept: Option<MarginKept> },
    /// The fixed trial of `kruskal_tune::TRIAL` (`auto` timed on a
    /// decomposition's first iteration): no features, no ranking.
    Trial,
    /// The fixed defaults, and why.
    Default { why: DefaultReason },
}

/// Why a choice took the fixed defaults.
#[derive(Clone, Debug, PartialEq)]
pub enum DefaultReason {
    /// The caller asked for them ([`OptionName::NoModel`]).
    Asked,
    /// No usable trained model, or a model that could not rank the
    /// configurations: why.
    NoModel(String),
}

impl DefaultReason {
    /// The reason, with the option that asks for the defaults spelled by
    /// `spell`.
    pub fn text(&self, spell: Spelling) -> String {
        match self {
            DefaultReason::Asked => spell(OptionName::NoModel, None),
            DefaultReason::NoModel(why) => why.clone(),
        }
    }
}

/// The GPU engines chosen for a tensor, and where they came from.
#[derive(Clone, Debug)]
pub struct EngineChoice {
    /// What `--kernel` asked for (`auto` or an engine).
    pub requested: GpuEngine,
    /// What to build: one, or the candidates of a trial.
    pub candidates: Vec<GpuCandidate>,
    pub source: ChoiceSource,
    /// Seconds the tensor's features took (also when the caller computed
    /// them beforehand), when the model was asked.
    pub features_s: Option<f64>,
}

impl EngineChoice {
    /// The engines and options to build, in order.
    pub fn builds(&self) -> Vec<(GpuEngine, GpuOptions)> {
        self.candidates
            .iter()
            .map(|c| (c.engine, c.options.clone()))
            .collect()
    }

    /// What `kruskal cpd` and Python say of the engines chosen on a GPU of
    /// `sms` SMs (the `kernels` notes), options spelled by `spell`: for
    /// `auto`, what is timed and why; for an engine named without its
    /// parameter, the model's parameter and why; nothing when the options
    /// gave it all or the model was not asked.
    pub fn notes(&self, sms: usize, spell: Spelling) -> Vec<String> {
        let features_s = self.features_s;
        match (&self.source, self.requested) {
            (ChoiceSource::Trial, _) => {
                let names: Vec<String> = self
                    .candidates
                    .iter()
                    .filter_map(|c| Some(c.config?.spelled(sms, spell)))
                    .collect();
                vec![format!(
                    "timing {}: the configurations nearest the best over the tuning \
                     measurements",
                    names.join(", ")
                )]
            }
            (ChoiceSource::Default { why }, GpuEngine::Auto) => vec![format!(
                "timing fcoo, flycoo and hicoo at their defaults ({})",
                why.text(spell)
            )],
            (ChoiceSource::Model { .. }, GpuEngine::Auto) => {
                let names: Vec<String> = self
                    .candidates
                    .iter()
                    .filter_map(|c| {
                        let config = c.config?;
                        Some(format!(
                            "{} ({:.2} ms)",
                            config.spelled(sms, spell),
                            c.predicted_ms.unwrap_or(f64::NAN)
                        ))
                    })
                    .collect();
                vec![format!(
                    "the default and the tuning model's best {} others for this tensor \
                     (features in {:.2} s): {}",
                    self.candidates.len().saturating_sub(1),
                    features_s.unwrap_or(0.0),
                    names.join(", ")
                )]
            }
            (_, engine) => {
                let (Some(features_s), Some(config)) =
                    (features_s, self.candidates.first().and_then(|c| c.config))
                else {
                    return Vec::new();
                };
                let why = match &self.source {
                    ChoiceSource::Model { kept: None } => {
                        format!("the tuning model's best {} parameter", engine.name())
                    }
                    ChoiceSource::Model { kept: Some(kept) } => kept.to_string(),
                    ChoiceSource::Default { why } => why.text(spell),
                    ChoiceSource::Flags | ChoiceSource::Trial => return Vec::new(),
                };
                vec![format!(
                    "{} ({why}; features in {features_s:.2} s)",
                    config.spelled(sms, spell)
                )]
            }
        }
    }
}

/// What a GPU run asks of the choice.
#[derive(Clone, Copy, Debug)]
pub struct GpuRequest<'a> {
    /// `auto` or an engine.
    pub engine: GpuEngine,
    /// Launch options given by the flags; a parameter given wins over the
    /// model's.
    pub given: &'a GpuOptions,
    /// `--no-model`: the fixed defaults.
    pub no_model: bool,
    pub rank: usize,
    pub rule: ChoiceRule,
}

impl GpuRequest<'_> {
    /// Whether [`GpuRequest::choose`] will read the tensor's features (a
    /// caller may compute them beforehand, beside other work).
    pub fn wants_features(&self) -> bool {
        !self.no_model
            && !self.given.sets_parameter_of(self.engine)
            && !self.fixed_trial()
            && TuneModel::usable().is_ok()
    }

    /// Whether the choice is the fixed trial ([`kruskal_tune::TRIAL`]):
    /// `auto` timed on a decomposition's first iteration, with no F-COO
    /// parameter given (the trial's candidates differ by it).
    fn fixed_trial(&self) -> bool {
        self.engine == GpuEngine::Auto
            && self.rule == ChoiceRule::Trial
            && self.given.threadlen.is_none()
    }

    /// The engines to build for `t` on a GPU of `sms` SMs: flags given win;
    /// `--no-model` gives the fixed defaults; `auto` timed on a
    /// decomposition's first iteration gives the fixed trial
    /// ([`kruskal_tune::TRIAL`], no features); otherwise a parameter not
    /// given (and the engine, for `auto`) comes from the tuning model, or,
    /// without a trained model, from the fixed defaults. `features` holds the tensor's features and their seconds
    /// once computed; they are computed here (once) only when the model is
    /// asked.
    pub fn choose(
        &self,
        t: &SparseTensor,
        sms: usize,
        features: &mut Option<(TensorFeatures, f64)>,
    ) -> EngineChoice {
        let given = self.given;
        let one =
            |engine: GpuEngine, config: Option<Config>, predicted_ms: Option<f64>| GpuCandidate {
                engine,
                options: match config {
                    Some(c) => given.or(&c.options(sms)),
                    None => given.clone(),
                },
                config,
                predicted_ms,
            };
        let defaults = |why: DefaultReason, features_s: Option<f64>| {
            let candidates = match (self.engine, self.rule) {
                (GpuEngine::Auto, ChoiceRule::Trial) => AUTO_CANDIDATES
                    .iter()
                    .map(|&k| one(k, None, None))
                    .collect(),
                (k, _) => vec![one(k.resolve(), None, None)],
            };
            EngineChoice {
                requested: self.engine,
                candidates,
                source: ChoiceSource::Default { why },
                features_s,
            }
        };
        if given.sets_parameter_of(self.engine) {
            return EngineChoice {
                requested: self.engine,
                candidates: vec![one(self.engine.resolve(), None, None)],
                source: ChoiceSource::Flags,
                features_s: None,
            };
        }
        if self.no_model {
            return defaults(DefaultReason::Asked, None);
        }
        if self.fixed_trial() {
            return EngineChoice {
                requested: self.engine,
                candidates: kruskal_tune::TRIAL
                    .iter()
                    .map(|&c| one(c.kernel(), Some(c), None))
                    .collect(),
                source: ChoiceSource::Trial,
                features_s: None,
            };
        }
        let model = match TuneModel::usable() {
            Ok(model) => model,
            Err(why) => return defaults(DefaultReason::NoModel(why), None),
        };
        let (features, features_s) = &*features.get_or_insert_with(|| {
            let start = Instant::now();
            let f = TensorFeatures::compute(t);
            (f, start.elapsed().as_secs_f64())
        });
        let features_s = Some(*features_s);
        if self.engine == GpuEngine::Auto && self.rule == ChoiceRule::Trial {
            let ranked = match model.predict(features, self.rank) {
                Ok(ranked) => ranked,
                Err(e) => return defaults(DefaultReason::NoModel(e.to_string()), features_s),
            };
            // A parameter given overrides each candidate's own, so two
            // configurations may build the same engine: it is timed once.
            let mut candidates: Vec<GpuCandidate> = Vec::new();
            for c in kruskal_tune::shortlist(&ranked, Config::DEFAULT, CANDIDATES) {
                let ms = ranked.iter().find(|p| p.config == c).map(|p| p.total_ms);
                let candidate = one(c.kernel(), Some(c), ms);
                let (o, e) = (&candidate.options, candidate.engine);
                let built = candidates.iter().any(|k| {
                    k.engine == e
                        && (k.options.threadlen, k.options.kappa, k.options.block_bits)
                            == (o.threadlen, o.kappa, o.block_bits)
                });
                if !built {
                    candidates.push(candidate);
                }
            }
            return EngineChoice {
                requested: self.engine,
                candidates,
                source: ChoiceSource::Model { kept: None },
                features_s,
            };
        }
        let picked = kruskal_tune::choose(features, self.rank, self.engine.tune_engine());
        let candidate = one(
            picked.config.kernel(),
            Some(picked.config),
            picked.predicted_ms(),
        );
        let source = match picked.basis {
            Basis::Model { .. } => ChoiceSource::Model { kept: None },
            Basis::Kept { kept, .. } => ChoiceSource::Model { kept: Some(kept) },
            Basis::NoRanking(why) => ChoiceSource::Default {
                why: DefaultReason::NoModel(why),
            },
        };
        EngineChoice {
            requested: self.engine,
            candidates: vec![candidate],
            source,
            features_s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_take_the_engines_names() {
        for k in EngineRequest::ALL {
            assert_eq!(k.name().parse::<EngineRequest>().unwrap(), k);
            if let Some(c) = k.cpu() {
                assert_eq!(c.name(), k.name());
            }
            if let Some(g) = k.gpu() {
                assert_eq!(g.name(), k.name());
            }
        }
        // Every engine of either kind is a request of that name.
        for c in CpuEngine::ENGINES {
            let k: EngineRequest = c.name().parse().unwrap();
            assert_eq!(k.cpu(), Some(c));
        }
        for g in GpuEngine::ENGINES {
            let k: EngineRequest = g.name().parse().unwrap();
            assert_eq!(k.gpu(), Some(g));
        }
        assert_eq!(
            "coo_atomic".parse::<EngineRequest>().unwrap(),
            EngineRequest::Coo
        );
        assert_eq!(EngineRequest::Shard.cpu(), None);
        assert_eq!(EngineRequest::Shard.gpu(), None);
        let e = "bogus".parse::<EngineRequest>().unwrap_err().to_string();
        assert!(e.starts_with("unknown kernel 'bogus' (CPU: auto,"), "{e}");
    }

    fn tensor() -> SparseTensor {
        kruskal_formats::generate::power_law(&kruskal_formats::generate::PowerLawSpec::new(
            vec![60, 50, 40],
            2_000,
        ))
        .unwrap()
    }

    /// Each candidate's engine and F-COO threadlen (the parameter the
    /// tests give).
    fn built(c: &EngineChoice) -> Vec<(GpuEngine, Option<usize>)> {
        c.builds()
            .into_iter()
            .map(|(k, o)| (k, o.threadlen))
            .collect()
    }

    fn ask(
        engine: GpuEngine,
        given: &GpuOptions,
        no_model: bool,
        rule: ChoiceRule,
    ) -> EngineChoice {
        let request = GpuRequest {
            engine,
            given,
            no_model,
            rank: 16,
            rule,
        };
        request.choose(&tensor(), 132, &mut None)
    }

    #[test]
    fn flags_win_and_no_model_keeps_the_defaults() {
        let threadlen = GpuOptions {
            threadlen: Some(16),
            ..GpuOptions::default()
        };
        for rule in [ChoiceRule::One, ChoiceRule::Trial] {
            let c = ask(GpuEngine::Fcoo, &threadlen, false, rule);
            assert_eq!(c.source, ChoiceSource::Flags);
            assert_eq!(built(&c), vec![(GpuEngine::Fcoo, Some(16))]);
            assert_eq!(c.features_s, None);
            // coo has no parameter: the flags give it all.
            let c = ask(GpuEngine::CooAtomic, &GpuOptions::default(), false, rule);
            assert_eq!(c.source, ChoiceSource::Flags);
            // A named engine without the model: that engine as given.
            let c = ask(GpuEngine::Hicoo, &GpuOptions::default(), true, rule);
            assert_eq!(
                c.source,
                ChoiceSource::Default {
                    why: DefaultReason::Asked
                }
            );
            assert_eq!(built(&c), vec![(GpuEngine::Hicoo, None)]);
            assert_eq!(c.candidates[0].options.block_bits, None);
        }
        // `auto` without the model: the fixed default for one run, the
        // three engines at their defaults for a trial; the flags' options
        // kept as given.
        let c = ask(GpuEngine::Auto, &threadlen, true, ChoiceRule::One);
        assert_eq!(built(&c), vec![(GpuEngine::Fcoo, Some(16))]);
        let c = ask(GpuEngine::Auto, &threadlen, true, ChoiceRule::Trial);
        let want: Vec<_> = AUTO_CANDIDATES.iter().map(|&k| (k, Some(16))).collect();
        assert_eq!(built(&c), want);
    }

    #[test]
    fn the_model_gives_what_no_flag_gives() {
        let trained = TuneModel::usable().is_ok();
        let given = GpuOptions {
            deterministic: true,
            ..GpuOptions::default()
        };
        let c = ask(GpuEngine::Flycoo, &given, false, ChoiceRule::One);
        assert_eq!(c.candidates.len(), 1);
        let k = &c.candidates[0];
        assert_eq!(k.engine, GpuEngine::Flycoo);
        assert!(k.options.deterministic, "the flags' options are kept");
        if !trained {
            assert!(matches!(c.source, ChoiceSource::Default { .. }));
            assert_eq!(c.features_s, None);
            return;
        }
        assert!(c.features_s.is_some());
        assert_eq!(
            k.config.map(|c| c.engine()),
            Some(kruskal_tune::Engine::Flycoo)
        );
        assert_eq!(k.options.kappa, k.config.and_then(|c| c.kappa(132)));
        if let ChoiceSource::Model { .. } = c.source {
            assert!(k.predicted_ms.is_some());
        }
        // A trial of `auto`: the fixed trial, the default first, without
        // features; with a threadlen given (which the trial's candidates
        // differ by), the default and the model's best others.
        let request = GpuRequest {
            engine: GpuEngine::Auto,
            given: &GpuOptions::default(),
            no_model: false,
            rank: 16,
            rule: ChoiceRule::Trial,
        };
        assert!(!request.wants_features());
        let c = request.choose(&tensor(), 132, &mut None);
        let configs: Vec<_> = c.candidates.iter().map(|k| k.config).collect();
        assert_eq!(configs, kruskal_tune::TRIAL.map(Some).to_vec());
        assert_eq!(c.candidates[0].config, Some(Config::DEFAULT));
        assert_eq!(
            (c.source.clone(), c.features_s),
            (ChoiceSource::Trial, None)
        );
        let dashed = |o: OptionName, v: Option<&str>| format!("--{} {}", o.name(), v.unwrap_or(""));
        let notes = c.notes(132, &dashed);
        assert!(
            notes[0]
                .starts_with("timing --kernel fcoo --threadlen 8, --kernel fcoo --threadlen 16,"),
            "{notes:?}"
        );
        let threadlen = GpuOptions {
            threadlen: Some(16),
            ..GpuOptions::default()
        };
        let c = ask(GpuEngine::Auto, &threadlen, false, ChoiceRule::Trial);
        assert!((1..=CANDIDATES).contains(&c.candidates.len()));
        assert_eq!(c.candidates[0].config, Some(Config::DEFAULT));
        assert!(c.candidates.iter().all(|k| k.predicted_ms.is_some()));
        assert_eq!(c.source, ChoiceSource::Model { kept: None });
        // The threadlen given is every fcoo candidate's, so fcoo is built
        // once, and no engine twice with the same parameters.
        let fcoo: Vec<_> = c
            .candidates
            .iter()
            .filter(|k| k.engine == GpuEngine::Fcoo)
            .collect();
        assert_eq!(fcoo.len(), 1, "{:?}", c.candidates);
        assert_eq!(fcoo[0].options.threadlen, Some(16));
        for (i, a) in c.candidates.iter().enumerate() {
            for b in &c.candidates[i + 1..] {
                assert!(
                    a.engine != b.engine
                        || (a.options.kappa, a.options.block_bits)
                            != (b.options.kappa, b.options.block_bits),
                    "{:?}",
                    c.candidates
                );
            }
        }
    }
}
