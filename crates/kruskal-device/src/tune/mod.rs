//! The GPU's part of the adaptive choice of engine and launch parameters;
//! the rest (configuration space, features, measurements files, the model,
//! training) is the `kruskal-tune` crate, which needs no GPU.
//!
//! - [`sweep`]: times every configuration of one tensor on the GPU (the
//!   measurements the model is trained on).
//! - [`ConfigEngine`]: a [`kruskal_tune::Config`]'s engine and options as
//!   this crate builds them ([`GpuEngine`], [`GpuOptions`]), and the
//!   mapping between [`kruskal_tune::Engine`] and [`GpuEngine`].
//!
//! `kruskal-tune` names engines with its own plain enum so that it does not
//! depend on this crate (and on cudarc); the mapping lives here, beside the
//! types it maps to, and the tests below check that the defaults the two
//! crates spell separately agree.

pub mod sweep;

use kruskal_tune::{Config, Engine};

use crate::{GpuEngine, GpuOptions};

impl From<Engine> for GpuEngine {
    fn from(e: Engine) -> GpuEngine {
        match e {
            Engine::Coo => GpuEngine::CooAtomic,
            Engine::Hicoo => GpuEngine::Hicoo,
            Engine::Fcoo => GpuEngine::Fcoo,
            Engine::Flycoo => GpuEngine::Flycoo,
        }
    }
}

impl GpuEngine {
    /// The tuning model's name for this engine; `None` for
    /// [`GpuEngine::Auto`], which names no engine (what
    /// [`kruskal_tune::choose`] takes: `None` lets the model pick one).
    pub fn tune_engine(self) -> Option<Engine> {
        match self {
            GpuEngine::Auto => None,
            GpuEngine::CooAtomic => Some(Engine::Coo),
            GpuEngine::Hicoo => Some(Engine::Hicoo),
            GpuEngine::Fcoo => Some(Engine::Fcoo),
            GpuEngine::Flycoo => Some(Engine::Flycoo),
        }
    }
}

/// A tuning configuration as this crate builds it: import the trait to
/// call `config.kernel()` and `config.options(sms)`.
pub trait ConfigEngine {
    /// The engine [`crate::build_engine`] builds for it.
    fn kernel(self) -> GpuEngine;

    /// Its engine options on a GPU of `sms` SMs (FLYCOO's kappa is per SM
    /// in the configuration, per mode in the options); the others stay at
    /// their defaults.
    fn options(self, sms: usize) -> GpuOptions;
}

impl ConfigEngine for Config {
    fn kernel(self) -> GpuEngine {
        self.engine().into()
    }

    fn options(self, sms: usize) -> GpuOptions {
        let mut o = GpuOptions::default();
        match self {
            Config::Coo => {}
            Config::Hicoo { block_bits } => o.block_bits = Some(block_bits),
            Config::Fcoo { threadlen } => o.threadlen = Some(threadlen),
            Config::Flycoo { .. } => o.kappa = self.kappa(sms),
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_name_the_parameter() {
        let c = Config::Flycoo { kappa_per_sm: 2 };
        assert_eq!(c.kernel(), GpuEngine::Flycoo);
        assert_eq!(c.options(132).kappa, Some(264));
        assert_eq!(
            Config::Fcoo { threadlen: 16 }.options(1).threadlen,
            Some(16)
        );
        assert_eq!(
            Config::Hicoo { block_bits: 6 }.options(1).block_bits,
            Some(6)
        );
    }

    #[test]
    fn engines_map_both_ways_under_the_same_name() {
        for e in Engine::ALL {
            let k = GpuEngine::from(e);
            assert_eq!(k.name(), e.name());
            assert_eq!(k.tune_engine(), Some(e));
            assert_eq!(e.default_config().kernel(), k);
        }
        assert_eq!(GpuEngine::Auto.tune_engine(), None);
        assert_eq!(GpuEngine::ENGINES.len(), Engine::ALL.len());
    }

    #[test]
    fn the_tuning_defaults_are_the_engines_defaults() {
        // An engine's default configuration builds what default options
        // build, and `--kernel auto`'s default is the engine auto resolves
        // to.
        let sms = 132;
        let defaults = GpuOptions::default().resolve(sms);
        for e in Engine::ALL {
            let p = e.default_config().options(sms).resolve(sms);
            assert_eq!(p, defaults, "{e}");
        }
        assert_eq!(Config::DEFAULT.kernel(), GpuEngine::Auto.resolve());
        assert_eq!(
            Config::DEFAULT,
            Config::Fcoo {
                threadlen: crate::options::DEFAULT_THREADLEN
            }
        );
    }
}
