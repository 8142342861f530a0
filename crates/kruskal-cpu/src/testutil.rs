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
    for &mode in modes {
        let mut out = Array2::from_elem((t.dims()[mode] as usize, rank), f32::NAN);
        engine.mttkrp(mode, &factors, &mut out).unwrap();
        let exact = mttkrp_reference(t, &views, mode).unwrap();
        let err = relative_error(out.view(), exact.view());
        assert!(
            err < tol,
            "{} mode {mode} rank {rank}: error {err}",
            engine.name()
        );
    }
}

/// The small real tensors of the shared data folder beside the repository
/// (`KRUSKAL_TEST_DATA` names another). Returns `(name, tensor)`.
///
/// A checkout without the folder gets none, with a note on stderr (as the
/// command-line tests do); a folder that exists must hold every file.
pub(crate) fn shared_tensors() -> Vec<(String, SparseTensor)> {
    let dir = std::env::var_os("KRUSKAL_TEST_DATA").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"),
        PathBuf::from,
    );
    if !dir.is_dir() {
        eprintln!(
            "note: {} not found; skipping the shared tensors",
            dir.display()
        );
        return Vec::new();
    }
    let mut out = Vec::new();
    for (name, pattern) in [
        ("splatt-small.tns", false),
        ("splatt-med.tns", false),
        ("splatt-med4.tns", false),
        ("splatt-med5.tns", false),
        ("kg-jf17k-5mode-novalues.tns", true),
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
