//! The GPU backend gives the CPU backend's answer: from the same initial
//! factors, the fit of every one of 20 iterations agrees within 1e-4, on
//! generated tensors and on the real tensors of the shared data folder,
//! with every GPU engine and with `--kernel auto`'s trial.
//!
//! Needs a CUDA GPU: run with `--include-ignored` on the GPU machine.

use std::path::PathBuf;

use kruskal_cpd::{
    CpdOptions, CpuBackend, GpuBackend, Init, KruskalModel, cpd_als, random_factors,
};
use kruskal_device::{Gpu, GpuKernel, GpuOptions};
use kruskal_formats::generate::{PlantedSpec, PowerLawSpec, planted, power_law};
use kruskal_formats::{ReadOptions, SparseTensor, read_tensor};

const ITERS: usize = 20;
const FIT_TOL: f64 = 1e-4;

fn generated() -> Vec<(String, SparseTensor)> {
    let mut out = Vec::new();
    for (nmodes, nnz, exponent) in [(3, 200_000, 1.1), (4, 150_000, 0.9), (5, 100_000, 1.2)] {
        let dims: Vec<u32> = (0..nmodes).map(|m| 3_000 + 1_700 * m as u32).collect();
        let mut spec = PowerLawSpec::new(dims, nnz).with_seed(nmodes as u64);
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

/// The real tensors of the shared data folder (beside the repository, or
/// `KRUSKAL_TEST_DATA`); none, with a note, when the folder is absent.
fn real() -> Vec<(String, SparseTensor)> {
    let dir = std::env::var_os("KRUSKAL_TEST_DATA").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"),
        PathBuf::from,
    );
    if !dir.is_dir() {
        eprintln!("note: {} not found; generated tensors only", dir.display());
        return Vec::new();
    }
    [
        ("splatt-med.tns", false),
        ("splatt-med4.tns", false),
        ("splatt-med5.tns", false),
        ("kg-jf17k-4mode-novalues.tns", true),
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

fn options(t: &SparseTensor, rank: usize) -> CpdOptions {
    let mut opts = CpdOptions::new(rank);
    opts.max_iters = ITERS;
    opts.tol = 0.0;
    opts.init = Init::Given(random_factors(t.dims(), rank, 5));
    opts
}

fn assert_same_fits(cpu: &KruskalModel, gpu: &KruskalModel, what: &str) {
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

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_fits_match_the_cpu_for_every_engine() {
    let gpu = Gpu::open(0).expect("a GPU");
    let mut tensors = generated();
    tensors.extend(real());
    for (name, t) in &tensors {
        for rank in [7, 16, 32] {
            let opts = options(t, rank);
            let cpu = cpd_als(&mut CpuBackend::new(t), &opts).unwrap();
            let mut runs: Vec<(String, Vec<(GpuKernel, GpuOptions)>)> = GpuKernel::ENGINES
                .iter()
                .map(|&k| (k.name().to_string(), vec![(k, GpuOptions::default())]))
                .collect();
            runs.push((
                "auto".to_string(),
                [GpuKernel::Fcoo, GpuKernel::Flycoo, GpuKernel::Hicoo]
                    .iter()
                    .map(|&k| (k, GpuOptions::default()))
                    .collect(),
            ));
            for (label, candidates) in runs {
                let what = format!("{name} rank {rank} {label}");
                let mut backend = GpuBackend::new(gpu.clone(), t, &candidates).unwrap();
                let model = cpd_als(&mut backend, &opts).unwrap();
                assert_same_fits(&cpu, &model, &what);
                let plan = backend.plan();
                assert_eq!(plan.per_mode.len(), t.nmodes(), "{what}");
                for chosen in &plan.per_mode {
                    assert!(plan.candidates.contains(chosen), "{what}: plan {plan:?}");
                }
                if candidates.len() > 1 {
                    assert!(
                        plan.trial_ms.iter().flatten().all(|ms| *ms > 0.0),
                        "{what}: trial times {plan:?}"
                    );
                }
                // The factors come back with the model's shapes.
                for (f, &d) in model.factors.iter().zip(t.dims()) {
                    assert_eq!(f.dim(), (d as usize, rank), "{what}");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_gpu_backend_runs_from_random_starts_and_refuses_bad_ranks() {
    let gpu = Gpu::open(0).expect("a GPU");
    let (_, t) = generated().remove(0);
    let candidates = [(GpuKernel::Fcoo, GpuOptions::default())];
    let mut backend = GpuBackend::new(gpu, &t, &candidates).unwrap();
    // Two runs on one backend (as --starts does), the same seed twice: the
    // same fits (up to the order of fcoo's f64 atomics at block edges).
    let mut opts = CpdOptions::new(10);
    opts.max_iters = 5;
    opts.tol = 0.0;
    let a = cpd_als(&mut backend, &opts).unwrap();
    let b = cpd_als(&mut backend, &opts).unwrap();
    for (x, y) in a.iterations.iter().zip(&b.iterations) {
        assert!((x.fit - y.fit).abs() < 1e-9, "{} vs {}", x.fit, y.fit);
    }
    assert!(a.fit().is_finite() && a.fit() > 0.0, "{}", a.fit());
    opts.rank = 300;
    let err = cpd_als(&mut backend, &opts).unwrap_err().to_string();
    assert!(err.contains("ranks 1 to 256"), "{err}");
}
