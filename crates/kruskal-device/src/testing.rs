//! For tests, here and in the crates above: a GPU where one is present
//! (skipped, with a note on stderr, only where there is none; a GPU that
//! is present but does not open fails the test), and factors to run
//! engines on.

use std::sync::Arc;

use ndarray::Array2;

use crate::{DeviceError, Gpu};

/// GPU 0, or `None` (after a note naming `test`) when this machine has no
/// CUDA driver or no GPU. Any other failure to open it panics.
pub fn gpu_or_skip(test: &str) -> Option<Arc<Gpu>> {
    match Gpu::open(0) {
        Ok(gpu) => Some(gpu),
        Err(DeviceError::MissingLibrary { .. } | DeviceError::NoDevice { .. }) => {
            eprintln!("note: no CUDA GPU here; {test} runs where there is one");
            None
        }
        Err(e) => panic!("{test}: a CUDA GPU is present but does not open: {e}"),
    }
}

/// Deterministic pseudo-random factors in [-0.5, 0.5) (xorshift), one
/// `dims[w] x rank` matrix per mode.
pub fn factors(dims: &[u32], rank: usize, seed: u64) -> Vec<Array2<f32>> {
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
