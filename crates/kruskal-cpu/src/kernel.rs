//! Choosing a CPU MTTKRP engine by name (`--kernel`).

use std::fmt;
use std::str::FromStr;

use kruskal_formats::{Hicoo, SparseTensor};

use crate::fcoo::FcooMttkrp;
use crate::flycoo::FlycooMttkrp;
use crate::hicoo::HicooMttkrp;
use crate::{CpuError, CpuMttkrp, MttkrpEngine, Result};

/// The CPU MTTKRP engines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CpuKernel {
    /// The fastest engine on the CPU (see `docs/formats.md` for the
    /// measurements behind the choice).
    #[default]
    Auto,
    /// One sorted copy per mode, row-owning chunks ([`CpuMttkrp`]).
    Sorted,
    /// F-COO segmented reduction ([`FcooMttkrp`]).
    Fcoo,
    /// FLYCOO: one LPT partition per task, dynamic remap ([`FlycooMttkrp`]).
    Flycoo,
    /// HiCOO, block by block ([`HicooMttkrp`]).
    Hicoo,
}

impl CpuKernel {
    /// Every concrete engine, in the order reports list them.
    pub const ENGINES: [CpuKernel; 4] = [
        CpuKernel::Sorted,
        CpuKernel::Fcoo,
        CpuKernel::Flycoo,
        CpuKernel::Hicoo,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CpuKernel::Auto => "auto",
            CpuKernel::Sorted => "sorted",
            CpuKernel::Fcoo => "fcoo",
            CpuKernel::Flycoo => "flycoo",
            CpuKernel::Hicoo => "hicoo",
        }
    }

    /// The engine `Auto` stands for.
    pub fn resolve(self) -> CpuKernel {
        match self {
            CpuKernel::Auto => CpuKernel::Sorted,
            k => k,
        }
    }

    /// Builds this engine for `tensor` with its default parameters.
    pub fn build(self, tensor: &SparseTensor) -> Result<Box<dyn MttkrpEngine>> {
        Ok(match self {
            CpuKernel::Auto | CpuKernel::Sorted => Box::new(CpuMttkrp::new(tensor)),
            CpuKernel::Fcoo => Box::new(FcooMttkrp::new(tensor, FcooMttkrp::DEFAULT_THREADLEN)?),
            CpuKernel::Flycoo => Box::new(FlycooMttkrp::new(tensor, None)?),
            CpuKernel::Hicoo => Box::new(HicooMttkrp::new(tensor, Hicoo::DEFAULT_BLOCK_BITS)?),
        })
    }
}

impl fmt::Display for CpuKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CpuKernel {
    type Err = CpuError;

    fn from_str(s: &str) -> Result<Self> {
        [CpuKernel::Auto]
            .into_iter()
            .chain(CpuKernel::ENGINES)
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                CpuError::Argument(format!(
                    "unknown CPU kernel '{s}' (auto, sorted, fcoo, flycoo, hicoo)"
                ))
            })
    }
}
