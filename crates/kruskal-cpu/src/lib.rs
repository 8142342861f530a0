//! CPU kernels for kruskal: the f64 reference MTTKRP used to verify every
//! other kernel, and a fast parallel f32 MTTKRP (the CPU backend).
//!
//! MTTKRP (matricized tensor times Khatri-Rao product) for output mode `d`
//! computes `M(i_d, :) += val * prod_{w != d} Y_w(i_w, :)` over all nonzeros;
//! it is most of the time of a CPD-ALS iteration.
//!
//! ```
//! use kruskal_cpu::{mttkrp_reference, relative_error, CpuMttkrp};
//! use kruskal_formats::generate::{power_law, PowerLawSpec};
//! use ndarray::Array2;
//!
//! let t = power_law(&PowerLawSpec::new(vec![30, 20, 10], 2_000)).unwrap();
//! let rank = 8;
//! let factors: Vec<Array2<f32>> = t.dims().iter()
//!     .map(|&d| Array2::from_elem((d as usize, rank), 0.5))
//!     .collect();
//! let engine = CpuMttkrp::new(&t);
//! let mut out = Array2::zeros((30, rank));
//! engine.mttkrp(0, &factors, &mut out).unwrap();
//! let views: Vec<_> = factors.iter().map(|f| f.view()).collect();
//! let exact = mttkrp_reference(&t, &views, 0).unwrap();
//! assert!(relative_error(out.view(), exact.view()) < 1e-6);
//! ```

/// Implements [`MttkrpEngine`] for an engine type by forwarding to its
/// inherent `dims`, `bytes` and `mttkrp` (every CPU engine's one way in).
macro_rules! forward_engine {
    ($engine:ty, $name:literal) => {
        impl $crate::MttkrpEngine for $engine {
            fn name(&self) -> &'static str {
                $name
            }

            fn dims(&self) -> &[u32] {
                <$engine>::dims(self)
            }

            fn bytes(&self) -> usize {
                <$engine>::bytes(self)
            }

            fn mttkrp(
                &mut self,
                mode: usize,
                factors: &[ndarray::Array2<f32>],
                out: &mut ndarray::Array2<f32>,
            ) -> $crate::Result<()> {
                <$engine>::mttkrp(self, mode, factors, out)
            }
        }
    };
}

/// Every engine's rank dispatch: `$fixed::<R>(args)` for the ranks with a
/// kernel specialized at compile time (8, 16, 32 and 64), else `$any`.
macro_rules! by_rank {
    ($rank:expr, $fixed:ident($($arg:expr),* $(,)?), $any:expr) => {
        match $rank {
            8 => $fixed::<8>($($arg),*),
            16 => $fixed::<16>($($arg),*),
            32 => $fixed::<32>($($arg),*),
            64 => $fixed::<64>($($arg),*),
            _ => $any,
        }
    };
}

pub mod csf;
pub mod fcoo;
pub mod flycoo;
pub mod hicoo;
pub mod kernel;
pub mod mttkrp;
pub mod reference;
pub mod spttm;

pub use csf::{CsfCopies, CsfMttkrp};
pub use fcoo::FcooMttkrp;
pub use flycoo::FlycooMttkrp;
pub use hicoo::HicooMttkrp;
pub use kernel::CpuEngine;
pub use mttkrp::{CpuMttkrp, ModePlan};
pub use reference::{mttkrp_reference, relative_error};
pub use spttm::{SemiSparse, spttm, spttm_reference};

use kruskal_formats::{FormatError, SparseTensor};
use ndarray::{Array2, ArrayView2};

/// Errors of the CPU kernels: shape mismatches between a tensor and the
/// matrices given with it, and formats that cannot hold a tensor.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error("shape mismatch: {0}")]
    Shape(String),

    #[error("invalid argument: {0}")]
    Argument(String),

    #[error(transparent)]
    Format(#[from] FormatError),

    #[error(transparent)]
    Partition(#[from] kruskal_partition::PartitionError),
}

/// One MTTKRP engine per storage format, behind one interface so the CPU
/// backend, `kruskal mttkrp` and the benchmarks can use any of them.
///
/// `mttkrp` takes `&mut self` because some formats carry state from one
/// mode to the next (FLYCOO keeps the tensor in the order of the mode it
/// will compute next).
pub trait MttkrpEngine: Send {
    /// Short name, as `--kernel` spells it.
    fn name(&self) -> &'static str;

    /// The dimensions of the tensor the engine was built for.
    fn dims(&self) -> &[u32];

    /// Bytes of tensor data the engine holds (all modes).
    fn bytes(&self) -> usize;

    /// Computes the MTTKRP for output `mode` into `out` (overwritten).
    ///
    /// `factors[w]` is `dims[w] x rank` for every mode and `out` is
    /// `dims[mode] x rank`, all in standard (row-major, contiguous) layout.
    fn mttkrp(&mut self, mode: usize, factors: &[Array2<f32>], out: &mut Array2<f32>)
    -> Result<()>;
}

/// An MTTKRP's operands as row-major slices: the rank, one slice per
/// factor, and the output.
pub(crate) type MttkrpSlices<'f, 'o> = (usize, Vec<&'f [f32]>, &'o mut [f32]);

/// Checks factor and output shapes for an MTTKRP on `mode` and returns the
/// rank, the factors as row-major slices and the output as a row-major slice.
pub(crate) fn mttkrp_slices<'f, 'o>(
    dims: &[u32],
    mode: usize,
    factors: &'f [Array2<f32>],
    out: &'o mut Array2<f32>,
) -> Result<MttkrpSlices<'f, 'o>> {
    let rank = check_factor_shapes(dims, factors.iter().map(|f| f.dim()), mode)?;
    if out.dim() != (dims[mode] as usize, rank) {
        return Err(CpuError::Shape(format!(
            "output is {:?}, expected ({}, {rank})",
            out.dim(),
            dims[mode]
        )));
    }
    let slices = factors
        .iter()
        .enumerate()
        .map(|(w, f)| {
            f.as_slice()
                .ok_or_else(|| CpuError::Shape(format!("factor {w} is not in standard layout")))
        })
        .collect::<Result<Vec<_>>>()?;
    let out = out
        .as_slice_mut()
        .ok_or_else(|| CpuError::Shape("output is not in standard layout".into()))?;
    Ok((rank, slices, out))
}

pub type Result<T, E = CpuError> = std::result::Result<T, E>;

/// Checks that there is one `dims[w] x rank` factor per mode (rank >= 1) and
/// that `mode` exists; returns the rank.
pub(crate) fn check_factors(
    tensor: &SparseTensor,
    factors: &[ArrayView2<'_, f32>],
    mode: usize,
) -> Result<usize> {
    check_factor_shapes(tensor.dims(), factors.iter().map(|f| f.dim()), mode)
}

#[cfg(test)]
pub(crate) mod testutil;

/// The row `i` of a row-major matrix with `R` columns (every engine's
/// factor-row gather for a rank known at compile time).
#[inline(always)]
pub(crate) fn row_of<const R: usize>(matrix: &[f32], i: u32) -> &[f32; R] {
    matrix[i as usize * R..]
        .first_chunk::<R>()
        .expect("indices are below the dimension, checked when the tensor was built")
}

pub(crate) fn check_factor_shapes(
    dims: &[u32],
    shapes: impl ExactSizeIterator<Item = (usize, usize)>,
    mode: usize,
) -> Result<usize> {
    if shapes.len() != dims.len() {
        return Err(CpuError::Shape(format!(
            "{} factor matrices for a {}-mode tensor",
            shapes.len(),
            dims.len()
        )));
    }
    if mode >= dims.len() {
        return Err(CpuError::Shape(format!(
            "mode {mode} of a {}-mode tensor",
            dims.len()
        )));
    }
    let mut rank = None;
    for (w, ((rows, cols), &dim)) in shapes.zip(dims).enumerate() {
        if rows != dim as usize {
            return Err(CpuError::Shape(format!(
                "factor {w} has {rows} rows, the tensor's mode {w} has dimension {dim}"
            )));
        }
        match rank {
            None => rank = Some(cols),
            Some(r) if r != cols => {
                return Err(CpuError::Shape(format!(
                    "factor {w} has {cols} columns, factor 0 has {r}"
                )));
            }
            _ => {}
        }
    }
    match rank {
        Some(r) if r > 0 => Ok(r),
        _ => Err(CpuError::Shape("rank must be at least 1".into())),
    }
}
