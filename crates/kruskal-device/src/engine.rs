//! Building a GPU MTTKRP engine by name.
//!
//! [`GpuKernel`] names the engines as `--kernel` spells them and
//! [`build_engine`] prepares the device-resident format of a host tensor for
//! the chosen one. Every engine implements [`GpuMttkrp`].

use std::str::FromStr;
use std::sync::Arc;

use kruskal_formats::{Hicoo, SparseTensor};

use crate::{DeviceError, Gpu, GpuMttkrp, Result};

/// A GPU MTTKRP engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GpuKernel {
    /// The engine kruskal picks. [`build_engine`] resolves it to the fixed
    /// default, fcoo (the fastest single-GPU MTTKRP on every FROSTT shape
    /// measured, docs/performance.md); the adaptive choice per tensor is
    /// `kruskal_tune::choose`, which callers ask first.
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

impl GpuKernel {
    /// Every concrete engine, in the order tables list them.
    pub const ENGINES: [GpuKernel; 4] = [
        GpuKernel::CooAtomic,
        GpuKernel::Hicoo,
        GpuKernel::Fcoo,
        GpuKernel::Flycoo,
    ];

    /// The name `--kernel` takes.
    pub fn name(self) -> &'static str {
        match self {
            GpuKernel::Auto => "auto",
            GpuKernel::CooAtomic => "coo",
            GpuKernel::Hicoo => "hicoo",
            GpuKernel::Fcoo => "fcoo",
            GpuKernel::Flycoo => "flycoo",
        }
    }

    /// The engine `Auto` stands for.
    pub fn resolve(self) -> GpuKernel {
        match self {
            GpuKernel::Auto => GpuKernel::Fcoo,
            k => k,
        }
    }
}

impl std::fmt::Display for GpuKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for GpuKernel {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(GpuKernel::Auto),
            "coo" | "coo_atomic" => Ok(GpuKernel::CooAtomic),
            "hicoo" => Ok(GpuKernel::Hicoo),
            "fcoo" => Ok(GpuKernel::Fcoo),
            "flycoo" => Ok(GpuKernel::Flycoo),
            other => Err(format!(
                "unknown GPU kernel '{other}' (choose auto, coo, hicoo, fcoo or flycoo)"
            )),
        }
    }
}

/// The precision of the factor rows an engine gathers (fcoo).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FactorPrecision {
    /// The factors as they are.
    #[default]
    F32,
    /// A bfloat16 copy (8 bits of mantissa, f32's range).
    Bf16,
    /// An IEEE half copy (11 bits of mantissa, values up to 65504).
    F16,
}

impl FactorPrecision {
    /// The name `--factor-precision` takes.
    pub fn name(self) -> &'static str {
        match self {
            FactorPrecision::F32 => "f32",
            FactorPrecision::Bf16 => "bf16",
            FactorPrecision::F16 => "f16",
        }
    }

    /// The kernels' `HALF` define: 0, 1 (bf16) or 2 (f16).
    pub fn half_define(self) -> i64 {
        match self {
            FactorPrecision::F32 => 0,
            FactorPrecision::Bf16 => 1,
            FactorPrecision::F16 => 2,
        }
    }
}

impl FromStr for FactorPrecision {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(FactorPrecision::F32),
            "bf16" => Ok(FactorPrecision::Bf16),
            "f16" => Ok(FactorPrecision::F16),
            other => Err(format!(
                "unknown factor precision '{other}' (choose f32, bf16 or f16)"
            )),
        }
    }
}

/// Knobs of the engines; `Default` gives kruskal's choices.
#[derive(Clone, Debug, Default)]
pub struct GpuOptions {
    /// flycoo: LPT partitions (thread blocks) per mode; default 4 per SM.
    pub kappa: Option<usize>,
    /// flycoo: pieces of split rows combine through a scratch buffer summed
    /// in a fixed order (bit-identical results run to run).
    pub deterministic: bool,
    /// fcoo: nonzeros per thread (a power of two from 1 to 256; default
    /// [`crate::fcoo::DEFAULT_THREADLEN`]).
    pub threadlen: Option<usize>,
    /// hicoo: block width is `2^block_bits` (1 to 8; default
    /// `Hicoo::DEFAULT_BLOCK_BITS`, 7).
    pub block_bits: Option<u32>,
    /// fcoo: reuse each fiber's factor row (default
    /// [`crate::fcoo::DEFAULT_FIBER`]).
    pub fiber: Option<bool>,
    /// fcoo: gather factor rows from a 16-bit copy (default f32).
    pub precision: FactorPrecision,
    /// fcoo: lane teams at ranks 16, 32, 64 and 128 (default
    /// [`crate::fcoo::DEFAULT_TEAMS`]).
    pub teams: Option<bool>,
    /// fcoo: where the layout is built (default on the GPU).
    pub fcoo_build: crate::FcooBuild,
}

/// The launch parameters an engine is built with: [`GpuOptions`] with
/// kruskal's defaults filled in ([`GpuOptions::resolve`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchParams {
    /// flycoo: LPT partitions per mode.
    pub kappa: usize,
    /// fcoo: nonzeros per thread.
    pub threadlen: usize,
    /// hicoo: log2 of the block width.
    pub block_bits: u32,
    /// fcoo: fiber reuse.
    pub fiber: bool,
}

impl GpuOptions {
    /// Whether these options set `kernel`'s launch parameter (threadlen for
    /// fcoo, block bits for hicoo, kappa for flycoo; coo has none to set,
    /// so it counts as given).
    pub fn sets_parameter_of(&self, kernel: GpuKernel) -> bool {
        match kernel {
            GpuKernel::Auto => false,
            GpuKernel::CooAtomic => true,
            GpuKernel::Hicoo => self.block_bits.is_some(),
            GpuKernel::Fcoo => self.threadlen.is_some(),
            GpuKernel::Flycoo => self.kappa.is_some(),
        }
    }

    /// These options, with every parameter they leave open taken from
    /// `fill` (e.g. the tuning model's choice); `deterministic` and the
    /// F-COO build stay.
    pub fn or(&self, fill: &GpuOptions) -> GpuOptions {
        GpuOptions {
            kappa: self.kappa.or(fill.kappa),
            threadlen: self.threadlen.or(fill.threadlen),
            block_bits: self.block_bits.or(fill.block_bits),
            fiber: self.fiber.or(fill.fiber),
            deterministic: self.deterministic,
            precision: self.precision,
            teams: self.teams.or(fill.teams),
            fcoo_build: self.fcoo_build,
        }
    }

    /// The parameters these options give on a GPU of `sms` SMs, defaults
    /// filled in: kappa 4 per SM, threadlen
    /// [`crate::fcoo::DEFAULT_THREADLEN`], block bits
    /// `Hicoo::DEFAULT_BLOCK_BITS`.
    pub fn resolve(&self, sms: usize) -> LaunchParams {
        LaunchParams {
            kappa: self.kappa.unwrap_or(4 * sms).max(1),
            threadlen: self.threadlen.unwrap_or(crate::fcoo::DEFAULT_THREADLEN),
            block_bits: self
                .block_bits
                .unwrap_or(u32::from(Hicoo::DEFAULT_BLOCK_BITS)),
            fiber: self.fiber.unwrap_or(crate::fcoo::DEFAULT_FIBER),
        }
    }
}

/// Builds `kernel`'s device-resident format of `t` on `gpu`.
pub fn build_engine(
    kernel: GpuKernel,
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
        GpuKernel::CooAtomic => Box::new(crate::CooAtomic::new(gpu, t)?),
        GpuKernel::Flycoo => {
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
        GpuKernel::Fcoo => {
            let engine =
                crate::FcooGpu::new_variants(gpu, t, &[(threadlen, fiber)], opts.fcoo_build)
                    .pop()
                    .expect("one engine per variant")?;
            configured_fcoo(engine, opts)
        }
        GpuKernel::Hicoo => {
            let bits = u8::try_from(bits).map_err(|_| DeviceError::Prepare {
                format: "HiCOO",
                message: format!("block bits {bits} must be from 1 to 8"),
            })?;
            Box::new(crate::HicooGpu::new(gpu, t, bits)?)
        }
        GpuKernel::Auto => unreachable!("resolved above"),
    })
}

/// An fcoo engine with the kernel options of `opts` (16-bit gathers, lane
/// teams) set.
fn configured_fcoo(mut engine: crate::FcooGpu, opts: &GpuOptions) -> Box<dyn GpuMttkrp> {
    engine.set_precision(opts.precision);
    engine.set_teams(opts.teams.unwrap_or(crate::fcoo::DEFAULT_TEAMS));
    Box::new(engine)
}

/// Builds each of `candidates` as [`build_engine`] would, except that the
/// fcoo ones share one sort per mode ([`crate::FcooGpu::new_variants`]):
/// the candidates `kruskal cpd --kernel auto` times are often fcoo at
/// several threadlens. Entry `k` is candidate `k`'s engine or its error.
pub fn build_engines(
    gpu: Arc<Gpu>,
    t: &SparseTensor,
    candidates: &[(GpuKernel, GpuOptions)],
) -> Vec<Result<Box<dyn GpuMttkrp>>> {
    let sms = gpu.properties().sms;
    let fcoo: Vec<usize> = (0..candidates.len())
        .filter(|&k| candidates[k].0.resolve() == GpuKernel::Fcoo)
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
        for k in GpuKernel::ENGINES {
            assert_eq!(k.name().parse::<GpuKernel>().unwrap(), k);
        }
        assert_eq!(
            "auto".parse::<GpuKernel>().unwrap().resolve(),
            GpuKernel::Fcoo
        );
        let given = GpuOptions {
            threadlen: Some(16),
            ..GpuOptions::default()
        };
        assert!(given.sets_parameter_of(GpuKernel::Fcoo));
        assert!(!given.sets_parameter_of(GpuKernel::Hicoo));
        assert!(GpuOptions::default().sets_parameter_of(GpuKernel::CooAtomic));
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
                .parse::<GpuKernel>()
                .unwrap_err()
                .contains("unknown GPU kernel")
        );
    }
}
