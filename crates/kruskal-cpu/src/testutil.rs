//! Helpers shared by the tests of every engine.

use std::path::PathBuf;

use kruskal_formats::{ReadOptions, SparseTensor, read_tensor};
use ndarray::Array2;

use crate::{MttkrpEngine, mttkrp_reference, relative_error};

/// Deterministic pseudo-random factors in [-0.5, 0.5).
pub(crate) fn factors_for(dims: &[u32], rank: usize, seed: u64) -> Vec<Array2<f32>> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    dims.iter()
        .map(|&d| {
            Array2::from_shape_fn((d as usize, rank), |_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
        })
        .collect()
}

/// A tensor with one hot index in every mode: nonzero `k` sits in mode
/// `k % nmodes`'s index 0, its other indices spread uniformly (hashed from
/// `k`), so each mode's row 0 holds about `1 / nmodes` of the nonzeros, all
/// at distinct coordinates, while every other row is light. Values are in
/// [-1, 1).
pub(crate) fn hot_rows(dims: &[u32], nnz: usize) -> SparseTensor {
    let nmodes = dims.len();
    let hash = |k: usize, m: usize| {
        let mut x = (k as u64) ^ ((m as u64) << 48);
        x = (x ^ (x >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x = (x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^ (x >> 32)
    };
    let indices = (0..nmodes)
        .map(|m| {
            (0..nnz)
                .map(|k| {
                    if k % nmodes == m {
                        0
                    } else {
                        (hash(k, m) % u64::from(dims[m])) as u32
                    }
                })
                .collect()
        })
        .collect();
    let values = (0..nnz)
        .map(|k| (hash(k, nmodes) >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        .collect();
    SparseTensor::new(dims.to_vec(), indices, values).expect("valid by construction")
}

/// Runs `engine` on every mode, in the order given, with outputs poisoned by
/// NaN (so rows an engine forgets to write show), and checks each result
/// against the f64 reference: relative Frobenius error below `tol`.
pub(crate) fn check_engine(
    t: &SparseTensor,
    engine: &mut dyn MttkrpEngine,
    rank: usize,
    modes: &[usize],
    tol: f64,
) {
    let factors = factors_for(t.dims(), rank, 7);
    let views: Vec<_> = factors.iter().map(|f| f.view()).collect();
    // The same sums with every term made positive: where signed terms
    // cancel (a mode of one row sums thousands of them), rounding the f32
    // products alone leaves an error of about u * ||sum of |terms||| /
    // ||sum||, so the tolerance is relative to that condition number.
    let abs_t = SparseTensor::new(
        t.dims().to_vec(),
        t.indices().to_vec(),
        t.values().iter().map(|v| v.abs()).collect(),
    )
    .unwrap();
    let abs_factors: Vec<_> = factors.iter().map(|f| f.mapv(f32::abs)).collect();
    let abs_views: Vec<_> = abs_factors.iter().map(|f| f.view()).collect();
    for &mode in modes {
        let mut out = Array2::from_elem((t.dims()[mode] as usize, rank), f32::NAN);
        engine.mttkrp(mode, &factors, &mut out).unwrap();
        let exact = mttkrp_reference(t, &views, mode).unwrap();
        let err = relative_error(out.view(), exact.view());
        let norm = |m: &Array2<f64>| m.iter().map(|x| x * x).sum::<f64>().sqrt();
        let terms = norm(&mttkrp_reference(&abs_t, &abs_views, mode).unwrap());
        let cond = if norm(&exact) > 0.0 {
            (terms / norm(&exact)).max(1.0)
        } else {
            1.0
        };
        assert!(
            err < tol * cond,
            "{} mode {mode} rank {rank}: error {err} (condition {cond})",
            engine.name()
        );
    }
}

/// The small real tensors of the repository's `data/` folder
/// (`KRUSKAL_TEST_DATA` names another). Returns `(name, tensor)`. A
/// missing folder or file fails the test.
pub(crate) fn shared_tensors() -> Vec<(String, SparseTensor)> {
    let dir = std::env::var_os("KRUSKAL_TEST_DATA").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data"),
        PathBuf::from,
    );
    assert!(
        dir.is_dir(),
        "{} not found: the repository's test tensors are missing",
        dir.display()
    );
    let mut out = Vec::new();
    for (name, pattern) in [
        ("splatt-small.tns", false),
        ("splatt-med.tns.gz", false),
        ("splatt-med4.tns.gz", false),
        ("splatt-med5.tns.gz", false),
        ("kg-jf17k-5mode-novalues.tns.gz", true),
    ] {
        let path = dir.join(name);
        let opts = ReadOptions {
            pattern,
            ..ReadOptions::default()
        };
        let t = read_tensor(&path, &opts).unwrap_or_else(|e| panic!("{e}"));
        out.push((name.to_string(), t));
    }
    out
}
