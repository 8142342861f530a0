//! What the engines are built with: the options a caller sets
//! ([`GpuOptions`]), the launch parameters they resolve to
//! ([`LaunchParams`]), the precision of the gathered factor rows and where
//! F-COO's layout is built, and F-COO's defaults. Below every engine, so
//! that each reads its options from here and the engine list
//! (`engine.rs`) sits above them all.

use std::str::FromStr;

use kruskal_formats::Hicoo;

/// Nonzeros per thread by default: 8, one byte of bit flags, as in the paper.
pub const DEFAULT_THREADLEN: usize = 8;
/// Fiber reuse by default (measured in docs/performance.md).
pub const DEFAULT_FIBER: bool = false;
/// Lane teams by default, where the rank allows them ([`teams_fit`](crate::engines::fcoo::teams_fit)).
pub const DEFAULT_TEAMS: bool = true;
/// How fcoo's lane-team kernel overlaps its loads by default (measured in
/// docs/performance.md).
pub const DEFAULT_PIPELINE: TeamPipeline = TeamPipeline {
    rounds: 2,
    prefetch: false,
    min_blocks: 2,
    group_sums: true,
};

/// How fcoo's lane-team kernel keeps loads in flight: `rounds` rounds of
/// gathers (each `128 / rank` nonzeros per warp) issued before the first
/// is added (1, 2, 4 or 8), the next 32 nonzeros' indices loaded before the
/// current ones' gathers (`prefetch`), and the thread blocks per SM its
/// registers must leave room for (`min_blocks`, 1 to 4: 1 leaves the
/// compiler free); with `group_sums` each group of 32 nonzeros' products
/// are summed in f32 (at most `128 / rank` per lane) before they join the
/// f64 sums, one conversion per group instead of one per product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TeamPipeline {
    pub rounds: u32,
    pub prefetch: bool,
    pub min_blocks: u32,
    pub group_sums: bool,
}

impl TeamPipeline {
    /// Whether the kernel is built for `rounds` (1, 2, 4 or 8).
    pub fn rounds_ok(rounds: u32) -> bool {
        matches!(rounds, 1 | 2 | 4 | 8)
    }

    /// Whether `min_blocks` is one the kernel takes (1 to 4).
    pub fn min_blocks_ok(min_blocks: u32) -> bool {
        (1..=4).contains(&min_blocks)
    }

    /// The values each parameter may take, as a message names them.
    pub fn check(&self) -> std::result::Result<(), String> {
        if !Self::rounds_ok(self.rounds) {
            return Err(format!("rounds {}: 1, 2, 4 or 8", self.rounds));
        }
        if !Self::min_blocks_ok(self.min_blocks) {
            return Err(format!("min blocks {}: from 1 to 4", self.min_blocks));
        }
        Ok(())
    }
}

/// Where [`FcooGpu`](crate::FcooGpu) builds its layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FcooBuild {
    /// On the GPU, from one upload of the COO (radix sort and scans,
    /// `kernels/fcoo_build.cu`); the host path where the GPU lacks the
    /// memory for the sort, for fiber reuse, and for an empty tensor.
    #[default]
    Device,
    /// On the host ([`Fcoo::for_mttkrp`](kruskal_formats::Fcoo::for_mttkrp)), each mode's arrays uploaded.
    Host,
}

impl FromStr for FcooBuild {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "gpu" | "device" => Ok(FcooBuild::Device),
            "host" | "cpu" => Ok(FcooBuild::Host),
            other => Err(format!(
                "unknown F-COO build '{other}' (choose gpu or host)"
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
    /// [`DEFAULT_THREADLEN`]).
    pub threadlen: Option<usize>,
    /// hicoo: block width is `2^block_bits` (1 to 8; default
    /// `Hicoo::DEFAULT_BLOCK_BITS`, 7).
    pub block_bits: Option<u32>,
    /// fcoo: reuse each fiber's factor row (default
    /// [`DEFAULT_FIBER`]).
    pub fiber: Option<bool>,
    /// fcoo: gather factor rows from a 16-bit copy (default f32).
    pub precision: FactorPrecision,
    /// fcoo: lane teams at ranks 16, 32, 64 and 128 (default
    /// [`DEFAULT_TEAMS`]).
    pub teams: Option<bool>,
    /// fcoo: where the layout is built (default on the GPU).
    pub fcoo_build: FcooBuild,
    /// fcoo lane teams: rounds of gathers in flight (default
    /// [`DEFAULT_PIPELINE`]'s).
    pub rounds: Option<u32>,
    /// fcoo lane teams: load the next indices before the current gathers.
    pub prefetch: Option<bool>,
    /// fcoo: thread blocks per SM the kernel's registers leave room for.
    pub min_blocks: Option<u32>,
    /// fcoo lane teams: f32 sums per group of 32 nonzeros.
    pub group_sums: Option<bool>,
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
            rounds: self.rounds.or(fill.rounds),
            prefetch: self.prefetch.or(fill.prefetch),
            min_blocks: self.min_blocks.or(fill.min_blocks),
            group_sums: self.group_sums.or(fill.group_sums),
        }
    }

    /// The lane-team pipeline these options give, defaults filled in.
    pub fn pipeline(&self) -> TeamPipeline {
        TeamPipeline {
            rounds: self.rounds.unwrap_or(DEFAULT_PIPELINE.rounds),
            prefetch: self.prefetch.unwrap_or(DEFAULT_PIPELINE.prefetch),
            min_blocks: self.min_blocks.unwrap_or(DEFAULT_PIPELINE.min_blocks),
            group_sums: self.group_sums.unwrap_or(DEFAULT_PIPELINE.group_sums),
        }
    }

    /// The parameters these options give on a GPU of `sms` SMs, defaults
    /// filled in: kappa 4 per SM, threadlen
    /// [`DEFAULT_THREADLEN`], block bits
    /// `Hicoo::DEFAULT_BLOCK_BITS`.
    pub fn resolve(&self, sms: usize) -> LaunchParams {
        LaunchParams {
            kappa: self.kappa.unwrap_or(4 * sms).max(1),
            threadlen: self.threadlen.unwrap_or(DEFAULT_THREADLEN),
            block_bits: self
                .block_bits
                .unwrap_or(u32::from(Hicoo::DEFAULT_BLOCK_BITS)),
            fiber: self.fiber.unwrap_or(DEFAULT_FIBER),
        }
    }
}
