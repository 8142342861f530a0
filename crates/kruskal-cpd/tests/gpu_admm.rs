//! Constrained CP (AO-ADMM) on one GPU gives the CPU's blocked variant's
//! answer (`InnerStop::RowBlocks`, each row to the same stopping rule):
//! from the same initial factors, with the coo engine (whose MTTKRP sums
//! as the CPU's does), the fit of each of 20 iterations agrees within 1e-4
//! and the weights and factors within 1e-4 (of their largest entry); with
//! the default fcoo engine within 1e-4 and 1e-3. Non-negative modes have
//! no negative entry, and nothing is NaN.
//!
//! Needs a CUDA GPU: each test notes the skip and passes where there is
//! none (`kruskal_device::testing::gpu_or_skip`), and runs where there is.

mod common;

use common::{ITERS, generated, options};
use kruskal_cpd::{
    AdmmOptions, Backend, CpdOptions, CpuBackend, DataRows, GpuBackend, InnerStop, KruskalModel,
    NonNeg, cpd_admm,
};
use kruskal_device::{GpuEngine, GpuOptions};
use kruskal_formats::SparseTensor;

/// The planted non-negative tensor of the GPU tests, and copies of it and
/// of their four-mode power-law tensor with every third value negated (so
/// unconstrained modes have negative entries).
fn tensors() -> Vec<(String, SparseTensor)> {
    let all = generated();
    let find = |prefix: &str| {
        all.iter()
            .find(|(name, _)| name.starts_with(prefix))
            .map(|(_, t)| t.clone())
            .unwrap()
    };
    let negate = |t: &SparseTensor| {
        let vals: Vec<f32> = t
            .values()
            .iter()
            .enumerate()
            .map(|(i, &v)| if i % 3 == 0 { -v } else { v })
            .collect();
        SparseTensor::new(t.dims().to_vec(), t.indices().to_vec(), vals).unwrap()
    };
    let planted = find("planted");
    let four = find("power-law 4 modes");
    vec![
        ("planted".into(), planted.clone()),
        ("planted, signs mixed".into(), negate(&planted)),
        ("power-law 4 modes, signs mixed".into(), negate(&four)),
    ]
}

/// Tolerances of fits (absolute) and of weights and factors (relative).
struct Tolerance {
    fit: f64,
    factors: f32,
}

/// The coo engine sums the MTTKRP as the CPU's does (f32 products, f64
/// sums), so only the ADMM can differ: the two sides add a row's
/// residuals and products in other orders, so a row can stop one inner
/// iteration apart, which moves the fits of the next few iterations
/// (on one H100, 2026-11-27: 1.01e-5 at iteration 13 of the planted rank-8
/// case, 4e-8 at its end). fcoo's f32 sums differ from the CPU's by about
/// 1e-7 relative, which the outer iterations carry on.
const STRICT: Tolerance = Tolerance {
    fit: 1e-4,
    factors: 1e-4,
};
const FCOO: Tolerance = Tolerance {
    fit: 1e-4,
    factors: 1e-3,
};

fn assert_same_run(
    cpu: &KruskalModel,
    gpu: &KruskalModel,
    admm: &AdmmOptions,
    tol: &Tolerance,
    what: &str,
) {
    assert_eq!(cpu.iterations.len(), ITERS, "{what}: CPU iterations");
    assert_eq!(gpu.iterations.len(), ITERS, "{what}: GPU iterations");
    for (c, g) in cpu.iterations.iter().zip(&gpu.iterations) {
        assert!(
            (c.fit - g.fit).abs() < tol.fit,
            "{what}: iteration {}: fit {} on the CPU, {} on the GPU",
            c.iteration,
            c.fit,
            g.fit
        );
        assert!(g.inner_iters >= 1, "{what}: iteration {}", g.iteration);
    }
    for (r, (c, g)) in cpu.lambda.iter().zip(&gpu.lambda).enumerate() {
        assert!(
            (c - g).abs() <= f64::from(tol.factors) * c.abs().max(1e-30),
            "{what}: weight {r}: {c} vs {g}"
        );
    }
    for (m, (c, g)) in cpu.factors.iter().zip(&gpu.factors).enumerate() {
        let scale = c.iter().fold(0f32, |s, x| s.max(x.abs()));
        for (((i, r), &x), &y) in c.indexed_iter().zip(g.iter()) {
            assert!(y.is_finite(), "{what}: mode {} ({i}, {r}) is {y}", m + 1);
            assert!(
                (x - y).abs() <= tol.factors * scale,
                "{what}: mode {} ({i}, {r}): {x} on the CPU, {y} on the GPU",
                m + 1
            );
        }
        if admm.nonneg.holds(m) {
            assert!(
                g.iter().all(|&y| y >= 0.0),
                "{what}: mode {} has a negative entry",
                m + 1
            );
        }
    }
}

#[test]
fn gpu_admm_matches_the_cpus_row_blocks() {
    let Some(gpu) = kruskal_device::testing::gpu_or_skip("gpu_admm_matches_the_cpus_row_blocks")
    else {
        return;
    };
    let cases = [
        // (tensor, rank, constraints)
        (0, 8, AdmmOptions::nonneg()),
        (
            1,
            7,
            AdmmOptions {
                nonneg: NonNeg::Modes(vec![0, 2]),
                l1: 0.1,
                ..AdmmOptions::default()
            },
        ),
        (
            1,
            40,
            AdmmOptions {
                l2: 0.5,
                ..AdmmOptions::default()
            },
        ),
        (2, 32, AdmmOptions::nonneg()),
        (
            2,
            16,
            AdmmOptions {
                nonneg: NonNeg::Modes(vec![1]),
                l1: 0.05,
                l2: 0.1,
                ..AdmmOptions::default()
            },
        ),
    ];
    let tensors = tensors();
    for (which, rank, admm) in cases {
        let (name, t) = &tensors[which];
        let what = format!("{name}, rank {rank}, {}", admm.describe());
        let opts = options(t, rank);
        let blocked = AdmmOptions {
            inner: InnerStop::RowBlocks,
            ..admm.clone()
        };
        let cpu = cpd_admm(&mut CpuBackend::new(t), &opts, &blocked).unwrap();
        for (engine, tol) in [(GpuEngine::CooAtomic, STRICT), (GpuEngine::Fcoo, FCOO)] {
            let what = format!("{what}, {}", engine.name());
            let candidates = [(engine, GpuOptions::default())];
            let mut backend = GpuBackend::new(gpu.clone(), t, &candidates).unwrap();
            // The GPU runs each row on its own whatever the options ask.
            let model = cpd_admm(&mut backend, &opts, &admm).unwrap();
            eprintln!(
                "{what}: fit {} on the CPU, {} on the GPU",
                cpu.fit(),
                model.fit()
            );
            assert_same_run(&cpu, &model, &admm, &tol, &what);
            for (f, &d) in model.factors.iter().zip(t.dims()) {
                assert_eq!(f.dim(), (d as usize, rank), "{what}");
            }
        }
    }
}

/// With the rows with data (as `decompose` gives them), the GPU's loop
/// runs on those rows only, as the CPU's does: the same
/// run, and the empty rows exactly 0.
#[test]
fn gpu_admm_on_rows_with_data_matches_the_cpu() {
    let Some(gpu) =
        kruskal_device::testing::gpu_or_skip("gpu_admm_on_rows_with_data_matches_the_cpu")
    else {
        return;
    };
    // The planted tensor with empty rows between its rows: mode 1's
    // indices spread by 5, mode 3's by 3.
    let (_, planted) = tensors().remove(0);
    let spread = [5u32, 1, 3];
    let dims: Vec<u32> = planted
        .dims()
        .iter()
        .zip(spread)
        .map(|(&d, s)| d * s)
        .collect();
    let indices: Vec<Vec<u32>> = planted
        .indices()
        .iter()
        .zip(spread)
        .map(|(idx, s)| idx.iter().map(|&i| i * s + s / 2).collect())
        .collect();
    let t = SparseTensor::new(dims, indices, planted.values().to_vec()).unwrap();
    let rows = std::sync::Arc::new(DataRows::of(&t));
    assert!(rows.mode(0).is_some() && rows.mode(2).is_some());
    for (rank, admm) in [
        (8, AdmmOptions::nonneg()),
        (
            5,
            AdmmOptions {
                nonneg: NonNeg::Modes(vec![0]),
                l1: 0.05,
                ..AdmmOptions::default()
            },
        ),
    ] {
        let what = format!("rows with data, rank {rank}, {}", admm.describe());
        let opts = options(&t, rank);
        let blocked = AdmmOptions {
            inner: InnerStop::RowBlocks,
            ..admm.clone()
        };
        let mut cpu_backend = CpuBackend::new(&t);
        cpu_backend.set_data_rows(rows.clone()).unwrap();
        let cpu = cpd_admm(&mut cpu_backend, &opts, &blocked).unwrap();
        let candidates = [(GpuEngine::CooAtomic, GpuOptions::default())];
        let mut backend = GpuBackend::new(gpu.clone(), &t, &candidates).unwrap();
        backend.set_data_rows(rows.clone()).unwrap();
        let model = cpd_admm(&mut backend, &opts, &admm).unwrap();
        eprintln!(
            "{what}: fit {} on the CPU, {} on the GPU",
            cpu.fit(),
            model.fit()
        );
        assert_same_run(&cpu, &model, &admm, &STRICT, &what);
        for m in [0, 2] {
            let list = rows.mode(m).unwrap();
            for (i, row) in model.factors[m].rows().into_iter().enumerate() {
                if list.binary_search(&(i as u32)).is_err() {
                    assert!(
                        row.iter().all(|&x| x == 0.0),
                        "{what}: mode {} row {i}",
                        m + 1
                    );
                }
            }
        }
    }
}

#[test]
fn gpu_admm_runs_again_from_random_starts_and_refuses_large_ranks() {
    let Some(gpu) = kruskal_device::testing::gpu_or_skip(
        "gpu_admm_runs_again_from_random_starts_and_refuses_large_ranks",
    ) else {
        return;
    };
    let (_, t) = tensors().remove(1);
    let candidates = [(GpuEngine::CooAtomic, GpuOptions::default())];
    let mut backend = GpuBackend::new(gpu, &t, &candidates).unwrap();
    let mut opts = CpdOptions::new(6);
    opts.max_iters = 6;
    opts.tol = 0.0;
    let admm = AdmmOptions::nonneg();
    // Seeded factors drawn on the device are the host's: the same run as
    // the CPU's blocked variant. Two runs on one backend (as --starts
    // does) start H and U afresh each time.
    let blocked = AdmmOptions {
        inner: InnerStop::RowBlocks,
        ..admm.clone()
    };
    let cpu = cpd_admm(&mut CpuBackend::new(&t), &opts, &blocked).unwrap();
    for run in 0..2 {
        let model = cpd_admm(&mut backend, &opts, &admm).unwrap();
        for (c, g) in cpu.iterations.iter().zip(&model.iterations) {
            assert!(
                (c.fit - g.fit).abs() < 1e-5,
                "run {run}: {} {}",
                c.fit,
                g.fit
            );
        }
        assert!(model.factors.iter().all(|f| f.iter().all(|&x| x >= 0.0)));
    }
    // Above the inner loop's largest rank: an error, not a panic.
    opts.rank = kruskal_device::admm::MAX_RANK + 1;
    let err = cpd_admm(&mut backend, &opts, &admm).unwrap_err();
    assert!(err.to_string().contains("ranks 1 to 128"), "{err}");
}
