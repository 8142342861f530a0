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
pub enum CpuKernel {
    /// The fastest engine for the tensor ([`CpuKernel::resolve`]; see
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

impl CpuKernel {
    /// Every concrete engine, in the order reports list them.
    pub const ENGINES: [CpuKernel; 5] = [
        CpuKernel::Sorted,
        CpuKernel::Fcoo,
        CpuKernel::Flycoo,
        CpuKernel::Hicoo,
        CpuKernel::Csf,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CpuKernel::Auto => "auto",
            CpuKernel::Sorted => "sorted",
            CpuKernel::Fcoo => "fcoo",
            CpuKernel::Flycoo => "flycoo",
            CpuKernel::Hicoo => "hicoo",
            CpuKernel::Csf => "csf",
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
    pub fn resolve(self, tensor: &SparseTensor) -> CpuKernel {
        match self {
            CpuKernel::Auto
                if tensor.nmodes() >= 3 && Csf::check_capacity(tensor.nnz() as u64).is_ok() =>
            {
                CpuKernel::Csf
            }
            CpuKernel::Auto => CpuKernel::Sorted,
            k => k,
        }
    }

    /// Builds this engine for `tensor` with its default parameters.
    pub fn build(self, tensor: &SparseTensor) -> Result<Box<dyn MttkrpEngine>> {
        Ok(match self.resolve(tensor) {
            CpuKernel::Auto | CpuKernel::Sorted => Box::new(CpuMttkrp::new(tensor)),
            CpuKernel::Fcoo => Box::new(FcooMttkrp::new(tensor, FcooMttkrp::DEFAULT_THREADLEN)?),
            CpuKernel::Flycoo => Box::new(FlycooMttkrp::new(tensor, None)?),
            CpuKernel::Hicoo => Box::new(HicooMttkrp::new(tensor, Hicoo::DEFAULT_BLOCK_BITS)?),
            CpuKernel::Csf => Box::new(CsfMttkrp::new(tensor)?),
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
        assert_eq!(CpuKernel::Auto.resolve(&t3), CpuKernel::Csf);
        assert_eq!(CpuKernel::Auto.resolve(&t4), CpuKernel::Csf);
        assert_eq!(CpuKernel::Auto.resolve(&t2), CpuKernel::Sorted);
        assert_eq!(CpuKernel::Fcoo.resolve(&t3), CpuKernel::Fcoo);
        assert_eq!(CpuKernel::Auto.build(&t3).unwrap().name(), "csf");
        assert_eq!(CpuKernel::Auto.build(&t2).unwrap().name(), "sorted");
        for k in CpuKernel::ENGINES {
            assert_eq!(k.name().parse::<CpuKernel>().unwrap(), k);
            assert_eq!(k.build(&t4).unwrap().name(), k.name());
        }
        assert!("splatt".parse::<CpuKernel>().is_err());
    }
}
