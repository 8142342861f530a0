//! Choosing a CPU MTTKRP engine by name (`--kernel`).

use std::fmt;
use std::str::FromStr;

use kruskal_formats::{Csf, Hicoo, SparseTensor};

use crate::csf::CsfMttkrp;
use crate::fcoo::FcooMttkrp;
use crate::flycoo::FlycooMttkrp;
use crate::hicoo::HicooMttkrp;
use crate::{CpuError, CpuMttkrp, MttkrpEngine, Result};

/// The CPU MTTKRP engines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CpuEngine {
    /// The fastest engine for the tensor ([`CpuEngine::resolve`]; see
    /// `docs/formats.md` for the measurements behind the choice).
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
    /// CSF trees with fiber reuse, one per mode ([`CsfMttkrp`]).
    Csf,
}

impl CpuEngine {
    /// Every concrete engine, in the order reports list them.
    pub const ENGINES: [CpuEngine; 5] = [
        CpuEngine::Sorted,
        CpuEngine::Fcoo,
        CpuEngine::Flycoo,
        CpuEngine::Hicoo,
        CpuEngine::Csf,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CpuEngine::Auto => "auto",
            CpuEngine::Sorted => "sorted",
            CpuEngine::Fcoo => "fcoo",
            CpuEngine::Flycoo => "flycoo",
            CpuEngine::Hicoo => "hicoo",
            CpuEngine::Csf => "csf",
        }
    }

    /// The engine `Auto` stands for on `tensor` (any other kernel stands
    /// for itself).
    ///
    /// The rule, from the all-mode MTTKRP times of every engine on the
    /// FROSTT-shaped tensors of `docs/formats.md`: `csf` on tensors of three
    /// or more modes, where it was the fastest on six of the seven shapes
    /// measured (0.72 to 0.93 times the best other engine; on nell-1's
    /// shape, whose rows are mostly out of cache, within 13% of `fcoo`, and
    /// ahead of it in another run); `sorted` on two-mode tensors (a tree of
    /// two levels shares nothing) and past CSF's `u32::MAX` nonzeros.
    pub fn resolve(self, tensor: &SparseTensor) -> CpuEngine {
        match self {
            CpuEngine::Auto
                if tensor.nmodes() >= 3 && Csf::check_capacity(tensor.nnz() as u64).is_ok() =>
            {
                CpuEngine::Csf
            }
            CpuEngine::Auto => CpuEngine::Sorted,
            k => k,
        }
    }

    /// Builds this engine for `tensor` with its default parameters.
    pub fn build(self, tensor: &SparseTensor) -> Result<Box<dyn MttkrpEngine>> {
        Ok(match self.resolve(tensor) {
            CpuEngine::Auto | CpuEngine::Sorted => Box::new(CpuMttkrp::new(tensor)),
            CpuEngine::Fcoo => Box::new(FcooMttkrp::new(tensor, FcooMttkrp::DEFAULT_THREADLEN)?),
            CpuEngine::Flycoo => Box::new(FlycooMttkrp::new(tensor, None)?),
            CpuEngine::Hicoo => Box::new(HicooMttkrp::new(tensor, Hicoo::DEFAULT_BLOCK_BITS)?),
            CpuEngine::Csf => Box::new(CsfMttkrp::new(tensor)?),
        })
    }
}

impl fmt::Display for CpuEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CpuEngine {
    type Err = CpuError;

    fn from_str(s: &str) -> Result<Self> {
        [CpuEngine::Auto]
            .into_iter()
            .chain(CpuEngine::ENGINES)
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                CpuError::Argument(format!(
                    "unknown CPU kernel '{s}' (auto, sorted, fcoo, flycoo, hicoo, csf)"
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal_formats::generate::{PowerLawSpec, power_law};

    #[test]
    fn auto_is_csf_from_three_modes_and_sorted_below() {
        let t3 = power_law(&PowerLawSpec::new(vec![30, 20, 10], 500)).unwrap();
        let t4 = power_law(&PowerLawSpec::new(vec![30, 20, 10, 5], 500)).unwrap();
        let t2 = power_law(&PowerLawSpec::new(vec![30, 20], 300)).unwrap();
        assert_eq!(CpuEngine::Auto.resolve(&t3), CpuEngine::Csf);
        assert_eq!(CpuEngine::Auto.resolve(&t4), CpuEngine::Csf);
        assert_eq!(CpuEngine::Auto.resolve(&t2), CpuEngine::Sorted);
        assert_eq!(CpuEngine::Fcoo.resolve(&t3), CpuEngine::Fcoo);
        assert_eq!(CpuEngine::Auto.build(&t3).unwrap().name(), "csf");
        assert_eq!(CpuEngine::Auto.build(&t2).unwrap().name(), "sorted");
        for k in CpuEngine::ENGINES {
            assert_eq!(k.name().parse::<CpuEngine>().unwrap(), k);
            assert_eq!(k.build(&t4).unwrap().name(), k.name());
        }
        assert!("splatt".parse::<CpuEngine>().is_err());
    }
}
