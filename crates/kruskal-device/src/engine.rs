//! Building a GPU MTTKRP engine by name.
//!
//! [`GpuEngine`] names the engines as `--kernel` spells them and
//! [`build_engine`] prepares the device-resident format of a host tensor for
//! the chosen one. Every engine implements [`GpuMttkrp`].

use std::str::FromStr;
use std::sync::Arc;

use kruskal_formats::SparseTensor;

use crate::options::{GpuOptions, LaunchParams};
use crate::{DeviceError, Gpu, GpuMttkrp, Result};

/// A GPU MTTKRP engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GpuEngine {
    /// The engine kruskal picks. [`build_engine`] resolves it to the fixed
    /// default, fcoo (the fastest single-GPU MTTKRP on every FROSTT shape
    /// measured, docs/performance.md); the adaptive choice per tensor is
    /// `kruskal_cpd::engine_choice`'s, which callers ask first.
    Auto,
    /// COO with one f64 atomic per (nonzero, column): the baseline.
    CooAtomic,
    /// HiCOO blocks grouped per output mode, rows summed in shared memory;
    /// atomics only for groups split between thread blocks.
    Hicoo,
    /// F-COO per mode: segmented scan, atomics only at block edges.
    Fcoo,
    /// FLYCOO: LPT partitions own their rows; dynamic remap.
    Flycoo,
}

impl GpuEngine {
    /// Every concrete engine, in the order tables list them.
    pub const ENGINES: [GpuEngine; 4] = [
        GpuEngine::CooAtomic,
        GpuEngine::Hicoo,
        GpuEngine::Fcoo,
        GpuEngine::Flycoo,
    ];

    /// The name `--kernel` takes.
    pub fn name(self) -> &'static str {
        match self {
            GpuEngine::Auto => "auto",
            GpuEngine::CooAtomic => "coo",
            GpuEngine::Hicoo => "hicoo",
            GpuEngine::Fcoo => "fcoo",
            GpuEngine::Flycoo => "flycoo",
        }
    }

    /// The engine `Auto` stands for.
    pub fn resolve(self) -> GpuEngine {
        match self {
            GpuEngine::Auto => GpuEngine::Fcoo,
            k => k,
        }
    }
}

impl std::fmt::Display for GpuEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for GpuEngine {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(GpuEngine::Auto),
            "coo" | "coo_atomic" => Ok(GpuEngine::CooAtomic),
            "hicoo" => Ok(GpuEngine::Hicoo),
            "fcoo" => Ok(GpuEngine::Fcoo),
            "flycoo" => Ok(GpuEngine::Flycoo),
            other => Err(format!(
                "unknown GPU kernel '{other}' (choose auto, coo, hicoo, fcoo or flycoo)"
            )),
        }
    }
}

impl GpuOptions {
    /// Whether these options set `kernel`'s launch parameter (threadlen for
    /// fcoo, block bits for hicoo, kappa for flycoo; coo has none to set,
    /// so it counts as given).
    pub fn sets_parameter_of(&self, kernel: GpuEngine) -> bool {
        match kernel {
            GpuEngine::Auto => false,
            GpuEngine::CooAtomic => true,
            GpuEngine::Hicoo => self.block_bits.is_some(),
            GpuEngine::Fcoo => self.threadlen.is_some(),
            GpuEngine::Flycoo => self.kappa.is_some(),
        }
    }
}

/// Builds `kernel`'s device-resident format of `t` on `gpu`.
pub fn build_engine(
    kernel: GpuEngine,
    gpu: Arc<Gpu>,
    t: &SparseTensor,
    opts: &GpuOptions,
) -> Result<Box<dyn GpuMttkrp>> {
    let LaunchParams {
        kappa,
        threadlen,
        block_bits: bits,
        fiber,
    } = opts.resolve(gpu.properties().sms);
    Ok(match kernel.resolve() {
        GpuEngine::CooAtomic => Box::new(crate::CooGpu::new(gpu, t)?),
        GpuEngine::Flycoo => {
            let (f, _) = kruskal_partition::flycoo::build_flycoo(
                t,
                &kruskal_partition::layout::LayoutOptions::new(kappa),
            )
            .map_err(|e| DeviceError::Prepare {
                format: "FLYCOO",
                message: e.to_string(),
            })?;
            let mut engine = crate::FlycooGpu::new(gpu, &f)?;
            engine.set_deterministic(opts.deterministic);
            Box::new(engine)
        }
        GpuEngine::Fcoo => {
            let engine =
                crate::FcooGpu::new_variants(gpu, t, &[(threadlen, fiber)], opts.fcoo_build)
                    .pop()
                    .expect("one engine per variant")?;
            configured_fcoo(engine, opts)
        }
        GpuEngine::Hicoo => {
            let bits = u8::try_from(bits).map_err(|_| DeviceError::Prepare {
                format: "HiCOO",
                message: format!("block bits {bits} must be from 1 to 8"),
            })?;
            Box::new(crate::HicooGpu::new(gpu, t, bits)?)
        }
        GpuEngine::Auto => unreachable!("resolved above"),
    })
}

/// An fcoo engine with the kernel options of `opts` (16-bit gathers, lane
/// teams and their pipeline) set.
fn configured_fcoo(mut engine: crate::FcooGpu, opts: &GpuOptions) -> Box<dyn GpuMttkrp> {
    engine.set_precision(opts.precision);
    engine.set_teams(opts.teams.unwrap_or(crate::options::DEFAULT_TEAMS));
    engine.set_pipeline(opts.pipeline());
    Box::new(engine)
}

/// Builds each of `candidates` as [`build_engine`] would, except that the
/// fcoo ones share one sort per mode ([`crate::FcooGpu::new_variants`]):
/// the candidates `kruskal cpd --kernel auto` times are often fcoo at
/// several threadlens. Entry `k` is candidate `k`'s engine or its error.
pub fn build_engines(
    gpu: Arc<Gpu>,
    t: &SparseTensor,
    candidates: &[(GpuEngine, GpuOptions)],
) -> Vec<Result<Box<dyn GpuMttkrp>>> {
    let sms = gpu.properties().sms;
    let fcoo: Vec<usize> = (0..candidates.len())
        .filter(|&k| candidates[k].0.resolve() == GpuEngine::Fcoo)
        .collect();
    let mut built: Vec<Option<Result<Box<dyn GpuMttkrp>>>> =
        (0..candidates.len()).map(|_| None).collect();
    if fcoo.len() > 1 {
        let variants: Vec<(usize, bool)> = fcoo
            .iter()
            .map(|&k| {
                let p = candidates[k].1.resolve(sms);
                (p.threadlen, p.fiber)
            })
            .collect();
        // One build for all: the first fcoo candidate's choice of where.
        let build = candidates[fcoo[0]].1.fcoo_build;
        let engines = crate::FcooGpu::new_variants(gpu.clone(), t, &variants, build);
        for (&k, engine) in fcoo.iter().zip(engines) {
            built[k] = Some(engine.map(|e| configured_fcoo(e, &candidates[k].1)));
        }
    }
    built
        .into_iter()
        .zip(candidates)
        .map(|(b, (kernel, opts))| b.unwrap_or_else(|| build_engine(*kernel, gpu.clone(), t, opts)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for k in GpuEngine::ENGINES {
            assert_eq!(k.name().parse::<GpuEngine>().unwrap(), k);
        }
        assert_eq!(
            "auto".parse::<GpuEngine>().unwrap().resolve(),
            GpuEngine::Fcoo
        );
        let given = GpuOptions {
            threadlen: Some(16),
            ..GpuOptions::default()
        };
        assert!(given.sets_parameter_of(GpuEngine::Fcoo));
        assert!(!given.sets_parameter_of(GpuEngine::Hicoo));
        assert!(GpuOptions::default().sets_parameter_of(GpuEngine::CooAtomic));
        let fill = GpuOptions {
            threadlen: Some(4),
            block_bits: Some(6),
            deterministic: true,
            ..GpuOptions::default()
        };
        let both = given.or(&fill);
        assert_eq!(
            (both.threadlen, both.block_bits, both.deterministic),
            (Some(16), Some(6), false)
        );
        let p = GpuOptions::default().resolve(132);
        assert_eq!((p.kappa, p.threadlen, p.block_bits), (528, 8, 7));
        let given = GpuOptions {
            kappa: Some(0),
            threadlen: Some(32),
            ..GpuOptions::default()
        };
        assert_eq!(given.resolve(132).kappa, 1);
        assert_eq!(given.resolve(132).threadlen, 32);
        assert!(
            "sorted"
                .parse::<GpuEngine>()
                .unwrap_err()
                .contains("unknown GPU kernel")
        );
    }
}
