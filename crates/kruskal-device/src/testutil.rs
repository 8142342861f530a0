//! Helpers shared by the GPU engines' tests.

use ndarray::Array2;

/// Deterministic pseudo-random factors in [-0.5, 0.5) (xorshift).
pub(crate) fn factors(dims: &[u32], rank: usize, seed: u64) -> Vec<Array2<f32>> {
    let mut x = seed | 1;
    dims.iter()
        .map(|&d| {
            Array2::from_shape_fn((d as usize, rank), |_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
        })
        .collect()
}
