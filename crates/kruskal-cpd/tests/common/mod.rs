//! Tensors, options and the fit comparison shared by the GPU tests.

#![allow(dead_code)]

use std::path::PathBuf;

use kruskal_cpd::{CpdOptions, Init, KruskalModel, random_factors};
use kruskal_formats::generate::{PlantedSpec, PowerLawSpec, planted, power_law};
use kruskal_formats::{ReadOptions, SparseTensor, read_tensor};

pub const ITERS: usize = 20;
pub const FIT_TOL: f64 = 1e-4;

pub fn generated() -> Vec<(String, SparseTensor)> {
    let mut out = Vec::new();
    for (nmodes, nnz, exponent) in [(3, 200_000, 1.1), (4, 150_000, 0.9), (5, 100_000, 1.2)] {
        let dims: Vec<u32> = (0..nmodes).map(|m| 3_000 + 1_700 * m as u32).collect();
        let mut spec = PowerLawSpec::new(dims, nnz)
            .with_draws()
            .with_seed(nmodes as u64);
        spec.exponents = vec![exponent; nmodes];
        out.push((
            format!("power-law {nmodes} modes"),
            power_law(&spec).unwrap(),
        ));
    }
    let p = planted(&PlantedSpec {
        dims: vec![900, 700, 500],
        rank: 8,
        nnz: 120_000,
        noise: 0.05,
        seed: 4,
    })
    .unwrap();
    out.push(("planted rank 8".to_string(), p.tensor));
    out
}

/// The real tensors of the repository's `data/` folder (or the folder
/// `KRUSKAL_TEST_DATA` names); a missing folder fails the test.
pub fn real() -> Vec<(String, SparseTensor)> {
    let dir = std::env::var_os("KRUSKAL_TEST_DATA").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data"),
        PathBuf::from,
    );
    assert!(
        dir.is_dir(),
        "{} not found: the repository's test tensors are missing",
        dir.display()
    );
    [
        ("splatt-med.tns.gz", false),
        ("splatt-med4.tns.gz", false),
        ("splatt-med5.tns.gz", false),
        ("kg-jf17k-4mode-novalues.tns.gz", true),
    ]
    .into_iter()
    .map(|(name, pattern)| {
        let opts = ReadOptions {
            pattern,
            ..ReadOptions::default()
        };
        let t = read_tensor(&dir.join(name), &opts).unwrap_or_else(|e| panic!("{e}"));
        (name.to_string(), t)
    })
    .collect()
}

pub fn options(t: &SparseTensor, rank: usize) -> CpdOptions {
    let mut opts = CpdOptions::new(rank);
    opts.max_iters = ITERS;
    opts.tol = 0.0;
    opts.init = Init::Given(random_factors(t.dims(), rank, 5));
    opts
}

pub fn assert_same_fits(cpu: &KruskalModel, gpu: &KruskalModel, what: &str) {
    assert_eq!(cpu.iterations.len(), ITERS, "{what}: CPU iterations");
    assert_eq!(gpu.iterations.len(), ITERS, "{what}: GPU iterations");
    for (c, g) in cpu.iterations.iter().zip(&gpu.iterations) {
        assert!(
            (c.fit - g.fit).abs() < FIT_TOL,
            "{what}: iteration {}: CPU fit {} vs GPU fit {}",
            c.iteration,
            c.fit,
            g.fit
        );
    }
    let max_diff = cpu
        .iterations
        .iter()
        .zip(&gpu.iterations)
        .map(|(c, g)| (c.fit - g.fit).abs())
        .fold(0f64, f64::max);
    eprintln!(
        "{what}: final fit CPU {:.6} GPU {:.6}, largest difference {max_diff:.2e}",
        cpu.fit(),
        gpu.fit()
    );
}
