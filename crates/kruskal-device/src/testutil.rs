//! Helpers shared by the GPU engines' tests.

use kruskal_cpu::{mttkrp_reference, relative_error};
use kruskal_formats::SparseTensor;
use kruskal_formats::generate::{PowerLawSpec, power_law};
use ndarray::Array2;

use crate::GpuMttkrp;

pub(crate) use crate::testing::factors;

/// Power-law tensors of 3 to 6 modes whose hottest rows hold 10-40% of the
/// nonzeros; mode `m` has `50 + dim_step * m` rows.
pub(crate) fn hot_tensors(dim_step: u32) -> Vec<SparseTensor> {
    [(3, 1.1), (4, 0.8), (5, 1.3), (6, 0.6)]
        .into_iter()
        .map(|(nmodes, exponent)| {
            let dims: Vec<u32> = (0..nmodes).map(|m| 50 + dim_step * m as u32).collect();
            let mut spec = PowerLawSpec::new(dims, 40_000)
                .with_draws()
                .with_seed(nmodes as u64);
            spec.exponents = vec![exponent; nmodes];
            power_law(&spec).unwrap()
        })
        .collect()
}

/// Runs every mode of `engine` on `t` at `rank` with NaN-poisoned outputs
/// and asserts the relative error against the f64 reference is below 1e-5.
pub(crate) fn check_engine(engine: &mut dyn GpuMttkrp, t: &SparseTensor, rank: usize, what: &str) {
    let f = factors(t.dims(), rank, rank as u64);
    let views: Vec<_> = f.iter().map(|a| a.view()).collect();
    for mode in 0..t.nmodes() {
        let mut out = Array2::from_elem((t.dims()[mode] as usize, rank), f32::NAN);
        engine.mttkrp_host(mode, &f, &mut out).unwrap();
        let exact = mttkrp_reference(t, &views, mode).unwrap();
        let err = relative_error(out.view(), exact.view());
        assert!(err < 1e-5, "{what} rank {rank} mode {mode}: {err}");
    }
}

/// Relative error of a kernel model's output, whose rows no nonzero reaches
/// are left NaN: those rows must be exact zeros in the reference, and count
/// as zeros.
pub(crate) fn model_error(mut out: Array2<f32>, exact: &Array2<f64>) -> f64 {
    for (row, exact_row) in exact.rows().into_iter().enumerate() {
        if out[[row, 0]].is_nan() {
            assert!(exact_row.iter().all(|&x| x == 0.0), "row {row}");
            out.row_mut(row).fill(0.0);
        }
    }
    relative_error(out.view(), exact.view())
}
