//! The f64 reference MTTKRP: plain, sequential and obviously correct.
//! Every fast kernel (CPU or GPU) is checked against it.

use kruskal_formats::SparseTensor;
use ndarray::{Array2, ArrayView2};

use crate::{Result, check_factors};

/// `M(i_mode, :) = sum over nonzeros of val * prod_{w != mode} Y_w(i_w, :)`,
/// every product and sum in f64.
///
/// Shapes: `factors[w]` is `dims[w] x rank` for every mode `w` (the factor
/// of `mode` itself is not read but must have the right shape); the result is
/// `dims[mode] x rank`. Cost: `nnz * (nmodes - 1) * rank` multiplications on
/// one thread.
pub fn mttkrp_reference(
    tensor: &SparseTensor,
    factors: &[ArrayView2<'_, f32>],
    mode: usize,
) -> Result<Array2<f64>> {
    let rank = check_factors(tensor, factors, mode)?;
    let mut out = Array2::<f64>::zeros((tensor.dims()[mode] as usize, rank));
    let mut row = vec![0f64; rank];
    for k in 0..tensor.nnz() {
        row.fill(f64::from(tensor.values()[k]));
        for (w, factor) in factors.iter().enumerate() {
            if w == mode {
                continue;
            }
            let i = tensor.mode_indices(w)[k] as usize;
            for (acc, &y) in row.iter_mut().zip(factor.row(i)) {
                *acc *= f64::from(y);
            }
        }
        let i = tensor.mode_indices(mode)[k] as usize;
        for (o, &r) in out.row_mut(i).iter_mut().zip(&row) {
            *o += r;
        }
    }
    Ok(out)
}

/// Relative Frobenius error `|a - b| / |b|` of an f32 result against an f64
/// reference of the same shape (`|b| = 0` gives the absolute error).
pub fn relative_error(a: ArrayView2<'_, f32>, b: ArrayView2<'_, f64>) -> f64 {
    assert_eq!(a.dim(), b.dim(), "relative_error: shapes differ");
    let mut diff = 0f64;
    let mut norm = 0f64;
    for (&x, &y) in a.iter().zip(b.iter()) {
        diff += (f64::from(x) - y).powi(2);
        norm += y * y;
    }
    if norm == 0.0 {
        diff.sqrt()
    } else {
        (diff / norm).sqrt()
    }
}
