//! Sparse tensor times matrix (SpTTM) on F-COO.
//!
//! Along mode `n`, `Y(i_1, .., i_{n-1}, :, i_{n+1}, ..) = sum_k X(.., k, ..)
//! U(k, :)` with `U` a `dims[n] x R` matrix. Every nonempty mode-`n` fiber of
//! `X` gives one dense length-`R` row of `Y`, every other fiber of `Y` is
//! zero: the result is *semi-sparse* ([`SemiSparse`]).
//!
//! [`spttm`] takes an [`Fcoo::for_ttm`] of mode `n`, whose segments are the
//! fibers in lexicographic order, and runs the same segmented block
//! reduction as the F-COO MTTKRP ([`mod@crate::fcoo`]): blocks of
//! `threadlen * BLOCK_THREADS` nonzeros in parallel, fibers wholly inside a
//! block written directly, fibers crossing a block edge summed from
//! partials in block order. Each nonzero adds `val * U(k, :)` (an f32
//! product) to an f64 accumulator; results are bit-identical for any thread
//! count.

use std::collections::BTreeMap;

use kruskal_formats::{Fcoo, FcooOp, SparseTensor};
use ndarray::{Array2, ArrayView2};

use crate::fcoo::{Block, BlockPartials, Reduction};
use crate::{CpuError, Result, row_of};

/// A semi-sparse tensor: sparse in every mode but `dense_mode`, dense along
/// it. The result of an SpTTM.
#[derive(Clone, Debug, PartialEq)]
pub struct SemiSparse {
    /// The result's dimensions: the input's, with `dims[dense_mode]` = `R`.
    pub dims: Vec<u32>,
    /// The mode that is dense (the SpTTM's mode `n`).
    pub dense_mode: usize,
    /// One coordinate vector per sparse mode (natural order, `dense_mode`
    /// skipped), one entry per fiber; fibers in lexicographic order.
    pub fiber_idx: Vec<Vec<u32>>,
    /// `fibers x R`: row `f` is the dense fiber at coordinates
    /// `fiber_idx[..][f]`.
    pub rows: Array2<f32>,
}

impl SemiSparse {
    /// Number of stored (nonempty) fibers.
    pub fn fibers(&self) -> usize {
        self.rows.nrows()
    }
}

/// `X x_n U` for the tensor in `fcoo`, which must come from
/// [`Fcoo::for_ttm`] of mode `n`; `u` is `dims[n] x R` with `R >= 1` (any
/// memory layout).
///
/// Errors: [`CpuError::Shape`] for an F-COO built for another operation or
/// a `u` of the wrong shape. Cost: `nnz * R` multiply-adds, parallel over
/// thread blocks; memory `fibers * R` f32 for the result.
pub fn spttm(fcoo: &Fcoo, u: &Array2<f32>) -> Result<SemiSparse> {
    let FcooOp::Ttm { mode } = fcoo.op() else {
        return Err(CpuError::Shape(format!(
            "SpTTM needs an F-COO built for a TTM, this one is for {:?}",
            fcoo.op()
        )));
    };
    let rank = check_matrix(fcoo.dims(), u.dim(), mode)?;
    let u = u.as_standard_layout();
    let u = u
        .as_slice()
        .ok_or_else(|| CpuError::Shape("matrix is not contiguous".into()))?;
    let mut rows = Array2::<f32>::zeros((fcoo.segments(), rank));
    let out = rows
        .as_slice_mut()
        .ok_or_else(|| CpuError::Shape("result is not contiguous".into()))?;
    let red = Reduction {
        fcoo,
        segment_rows: None,
        width: rank,
    };
    red.run(out, |block, mine, slots| {
        run_block(&red, block, u, mine, slots)
    });
    let mut dims = fcoo.dims().to_vec();
    dims[mode] = rank as u32;
    Ok(SemiSparse {
        dims,
        dense_mode: mode,
        fiber_idx: fcoo.segment_idx().to_vec(),
        rows,
    })
}

/// The f64 reference SpTTM along `mode`, computed independently of F-COO
/// (a map from fiber coordinates to rows): the fiber coordinates (one
/// vector per mode but `mode`, fibers in lexicographic order) and the
/// `fibers x R` rows, every product and sum in f64.
///
/// Cost: `nnz * R` multiply-adds and `nnz` map look-ups on one thread.
pub fn spttm_reference(
    tensor: &SparseTensor,
    u: ArrayView2<'_, f32>,
    mode: usize,
) -> Result<(Vec<Vec<u32>>, Array2<f64>)> {
    let rank = check_matrix(tensor.dims(), u.dim(), mode)?;
    let index_modes: Vec<usize> = (0..tensor.nmodes()).filter(|&w| w != mode).collect();
    let mut fibers: BTreeMap<Vec<u32>, Vec<f64>> = BTreeMap::new();
    for k in 0..tensor.nnz() {
        let coord: Vec<u32> = index_modes
            .iter()
            .map(|&w| tensor.mode_indices(w)[k])
            .collect();
        let v = f64::from(tensor.values()[k]);
        let row = fibers.entry(coord).or_insert_with(|| vec![0.0; rank]);
        let i = tensor.mode_indices(mode)[k] as usize;
        for (acc, &y) in row.iter_mut().zip(u.row(i)) {
            *acc += v * f64::from(y);
        }
    }
    let mut fiber_idx = vec![Vec::with_capacity(fibers.len()); index_modes.len()];
    let mut rows = Array2::<f64>::zeros((fibers.len(), rank));
    for (f, (coord, row)) in fibers.into_iter().enumerate() {
        for (idx, c) in fiber_idx.iter_mut().zip(coord) {
            idx.push(c);
        }
        rows.row_mut(f).assign(&ndarray::ArrayView1::from(&row));
    }
    Ok((fiber_idx, rows))
}

/// Checks that `mode` exists and the matrix is `dims[mode] x R` with
/// `1 <= R <= u32::MAX`; returns `R`.
fn check_matrix(dims: &[u32], (rows, cols): (usize, usize), mode: usize) -> Result<usize> {
    if mode >= dims.len() {
        return Err(CpuError::Shape(format!(
            "mode {mode} of a {}-mode tensor",
            dims.len()
        )));
    }
    if rows != dims[mode] as usize {
        return Err(CpuError::Shape(format!(
            "matrix has {rows} rows, the tensor's mode {mode} has dimension {}",
            dims[mode]
        )));
    }
    if cols == 0 || u32::try_from(cols).is_err() {
        return Err(CpuError::Shape(format!(
            "matrix has {cols} columns, must be from 1 to {}",
            u32::MAX
        )));
    }
    Ok(cols)
}

/// One SpTTM block, specialized for common ranks and the running CPU's
/// instruction set (every variant adds the same products in the same order).
fn run_block(
    red: &Reduction<'_>,
    block: &Block,
    u: &[f32],
    mine: &mut [f32],
    slots: &mut [f64],
) -> BlockPartials {
    by_rank!(
        red.width,
        run_block_fixed(red, block, u, mine, slots),
        run_block_any(red, block, u, mine, slots)
    )
}

#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma",))]
fn run_block_fixed<const R: usize>(
    red: &Reduction<'_>,
    block: &Block,
    u: &[f32],
    mine: &mut [f32],
    slots: &mut [f64],
) -> BlockPartials {
    let mut acc = [0f64; R];
    let values = red.fcoo.values();
    let idx = &red.fcoo.product_idx()[0];
    red.walk(block, mine, slots, &mut acc, |lo, hi, out| {
        let mut sum = [0f64; R];
        for k in lo..hi {
            let v = values[k];
            let y = row_of::<R>(u, idx[k]);
            for r in 0..R {
                sum[r] += f64::from(v * y[r]);
            }
        }
        out.copy_from_slice(&sum);
    })
}

#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma",))]
fn run_block_any(
    red: &Reduction<'_>,
    block: &Block,
    u: &[f32],
    mine: &mut [f32],
    slots: &mut [f64],
) -> BlockPartials {
    let rank = red.width;
    let mut acc = vec![0f64; rank];
    let values = red.fcoo.values();
    let idx = &red.fcoo.product_idx()[0];
    red.walk(block, mine, slots, &mut acc, |lo, hi, sum| {
        sum.fill(0.0);
        for k in lo..hi {
            let v = values[k];
            let i = idx[k] as usize;
            for (s, &y) in sum.iter_mut().zip(&u[i * rank..(i + 1) * rank]) {
                *s += f64::from(v * y);
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::relative_error;
    use crate::testutil::{factors_for, shared_tensors};
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use proptest::prelude::*;

    /// SpTTM of every mode equals the reference: identical fibers, relative
    /// Frobenius error below 1e-6.
    fn check_all_modes(t: &SparseTensor, threadlen: usize, rank: usize) {
        for mode in 0..t.nmodes() {
            let u = factors_for(&t.dims()[mode..=mode], rank, 11 + mode as u64).remove(0);
            let fcoo = Fcoo::for_ttm(t, mode, threadlen).unwrap();
            let y = spttm(&fcoo, &u).unwrap();
            let (fibers, exact) = spttm_reference(t, u.view(), mode).unwrap();
            assert_eq!(y.dense_mode, mode);
            assert_eq!(y.dims[mode] as usize, rank);
            assert_eq!(y.fiber_idx, fibers, "mode {mode}: fibers differ");
            assert_eq!(y.rows.dim(), exact.dim());
            let err = relative_error(y.rows.view(), exact.view());
            assert!(err < 1e-6, "mode {mode} rank {rank}: error {err}");
        }
    }

    #[test]
    fn small_example_by_hand() {
        // X(0,1,k) = 2 at k=0 and 4 at k=1; X(1,0,2) = 1.
        let t = SparseTensor::new(
            vec![2, 2, 3],
            vec![vec![0, 1, 0], vec![1, 0, 1], vec![1, 2, 0]],
            vec![4.0, 1.0, 2.0],
        )
        .unwrap();
        let u = Array2::from_shape_vec((3, 2), vec![1.0, 10.0, 2.0, 20.0, 3.0, 30.0]).unwrap();
        let y = spttm(&Fcoo::for_ttm(&t, 2, 1).unwrap(), &u).unwrap();
        assert_eq!(y.dims, vec![2, 2, 2]);
        assert_eq!(y.fibers(), 2);
        assert_eq!(y.fiber_idx, vec![vec![0, 1], vec![1, 0]]);
        // Fiber (0,1): 2 U(0,:) + 4 U(1,:); fiber (1,0): 1 U(2,:).
        assert_eq!(y.rows.row(0).to_vec(), vec![10.0, 100.0]);
        assert_eq!(y.rows.row(1).to_vec(), vec![3.0, 30.0]);
    }

    #[test]
    fn long_fibers_spanning_many_blocks() {
        // Two short modes and a long one: mode-2 fibers of thousands of
        // nonzeros, many blocks each at threadlen 1.
        let mut spec = PowerLawSpec::new(vec![3, 2, 5_000], 60_000).with_draws();
        spec.exponents = vec![0.5, 0.0, 0.3];
        let t = power_law(&spec).unwrap();
        check_all_modes(&t, 1, 8);
        check_all_modes(&t, 1, 5);
    }

    #[test]
    fn equals_reference_on_shared_tensors() {
        let tensors = shared_tensors();
        for (_, t) in &tensors {
            check_all_modes(t, 8, 16);
        }
    }

    #[test]
    fn transposed_matrix_is_accepted() {
        let t = power_law(&PowerLawSpec::new(vec![6, 5, 4], 100).with_draws()).unwrap();
        let u = factors_for(&[4], 3, 2).remove(0);
        let mut ut = Array2::zeros((3, 4));
        ut.assign(&u.t());
        let ut = ut.reversed_axes();
        assert!(ut.as_slice().is_none());
        let fcoo = Fcoo::for_ttm(&t, 2, 8).unwrap();
        assert_eq!(spttm(&fcoo, &u).unwrap(), spttm(&fcoo, &ut).unwrap());
    }

    #[test]
    fn empty_tensor_has_no_fibers() {
        let t = SparseTensor::new(vec![3, 2, 4], vec![vec![], vec![], vec![]], vec![]).unwrap();
        let y = spttm(&Fcoo::for_ttm(&t, 0, 8).unwrap(), &Array2::ones((3, 2))).unwrap();
        assert_eq!(y.fibers(), 0);
        assert_eq!(y.rows.dim(), (0, 2));
        assert_eq!(y.fiber_idx, vec![Vec::<u32>::new(); 2]);
    }

    #[test]
    fn result_does_not_depend_on_thread_count() {
        let mut spec = PowerLawSpec::new(vec![4, 3, 9_000], 50_000).with_draws();
        spec.exponents = vec![1.0, 0.5, 0.2];
        let t = power_law(&spec).unwrap();
        let fcoo = Fcoo::for_ttm(&t, 2, 1).unwrap();
        let u = factors_for(&[9_000], 16, 5).remove(0);
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| spttm(&fcoo, &u).unwrap())
        };
        assert_eq!(run(1), run(3));
    }

    #[test]
    fn shape_errors_are_reported() {
        let t = power_law(&PowerLawSpec::new(vec![5, 4, 3], 20).with_draws()).unwrap();
        let u = Array2::<f32>::ones((3, 2));
        let wrong_op = Fcoo::for_mttkrp(&t, 2, 8).unwrap();
        let err = spttm(&wrong_op, &u).unwrap_err();
        assert!(matches!(err, CpuError::Shape(_)), "{err}");
        let fcoo = Fcoo::for_ttm(&t, 2, 8).unwrap();
        assert!(spttm(&fcoo, &u).is_ok());
        let err = spttm(&fcoo, &Array2::ones((4, 2))).unwrap_err();
        assert!(err.to_string().contains("rows"), "{err}");
        let err = spttm(&fcoo, &Array2::ones((3, 0))).unwrap_err();
        assert!(err.to_string().contains("columns"), "{err}");
        assert!(spttm_reference(&t, u.view(), 3).is_err());
        assert!(spttm_reference(&t, u.view(), 0).is_err());
        assert!(spttm_reference(&t, u.view(), 2).is_ok());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn equals_reference_on_random_tensors(
            nmodes in 3usize..=6,
            dim_seed in any::<u64>(),
            nnz in 1usize..4_000,
            rank in prop_oneof![1usize..40, Just(64usize)],
            threadlen in prop_oneof![Just(1usize), Just(8), Just(256)],
            exponent in 0.0f64..1.6,
        ) {
            let dims: Vec<u32> = (0..nmodes)
                .map(|m| 1 + ((dim_seed >> (m * 8)) % 60) as u32)
                .collect();
            let mut spec = PowerLawSpec::new(dims, nnz).with_draws().with_seed(dim_seed);
            spec.exponents = vec![exponent; nmodes];
            let t = power_law(&spec).unwrap();
            check_all_modes(&t, threadlen, rank);
        }
    }
}
