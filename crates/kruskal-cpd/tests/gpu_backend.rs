//! The GPU backend gives the CPU backend's answer: from the same initial
//! factors, the fit of every one of 20 iterations agrees within 1e-4, on
//! generated tensors and on the real tensors of the shared data folder,
//! with every GPU engine and with `--kernel auto`'s trial.
//!
//! Needs a CUDA GPU: each test notes the skip and passes where there is
//! none (`kruskal_device::testing::gpu_or_skip`), and runs where there is.

mod common;

use common::{assert_same_fits, generated, options, real};
use kruskal_cpd::{CpdOptions, CpuBackend, GpuBackend, cpd_als};
use kruskal_device::{Gpu, GpuEngine, GpuOptions};

#[test]
fn gpu_fits_match_the_cpu_for_every_engine() {
    let Some(gpu) = kruskal_device::testing::gpu_or_skip("gpu_fits_match_the_cpu_for_every_engine")
    else {
        return;
    };
    let mut tensors = generated();
    tensors.extend(real());
    for (name, t) in &tensors {
        for rank in [7, 16, 32] {
            let opts = options(t, rank);
            let cpu = cpd_als(&mut CpuBackend::new(t), &opts).unwrap();
            let mut runs: Vec<(String, Vec<(GpuEngine, GpuOptions)>)> = GpuEngine::ENGINES
                .iter()
                .map(|&k| (k.name().to_string(), vec![(k, GpuOptions::default())]))
                .collect();
            runs.push((
                "auto".to_string(),
                [GpuEngine::Fcoo, GpuEngine::Flycoo, GpuEngine::Hicoo]
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
fn the_gpu_backend_runs_from_random_starts_and_refuses_bad_ranks() {
    let Some(gpu) = kruskal_device::testing::gpu_or_skip(
        "the_gpu_backend_runs_from_random_starts_and_refuses_bad_ranks",
    ) else {
        return;
    };
    let (_, t) = generated().remove(0);
    let candidates = [(GpuEngine::Fcoo, GpuOptions::default())];
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

/// Values at the ends of f32 run on the GPU (one, and a group of every
/// GPU there is) as on the CPU: `decompose` scales them by a power of two
/// and the weights back, so the fits equal the CPU's and no weight is NaN.
#[test]
fn values_at_the_ends_of_f32_run_on_the_gpu() {
    use kruskal_cpd::{BackendChoice, DecomposeOptions, decompose};
    use std::sync::atomic::AtomicBool;
    if kruskal_device::testing::gpu_or_skip("values_at_the_ends_of_f32_run_on_the_gpu").is_none() {
        return;
    }
    let (_, t) = generated().into_iter().next().expect("a generated tensor");
    let gpus = Gpu::count().expect("a GPU");
    for exponent in [100, -120] {
        let mut scaled = t.clone();
        scaled.scale_values_pow2(exponent).unwrap();
        let run = |backend: BackendChoice, group: Option<Vec<usize>>| {
            let mut opts = DecomposeOptions::new(8);
            opts.cpd.max_iters = common::ITERS;
            opts.cpd.tol = 0.0;
            opts.backend = backend;
            if group.is_some() {
                opts.kernel = kruskal_cpd::EngineRequest::Shard;
            }
            opts.gpus = group;
            decompose(
                &scaled,
                &opts,
                &mut |_| std::ops::ControlFlow::Continue(()),
                &AtomicBool::new(false),
            )
            .unwrap()
            .model
        };
        let cpu = run(BackendChoice::Cpu, None);
        let mut on_gpus = vec![("gpu", run(BackendChoice::Gpu, None))];
        if gpus > 1 {
            on_gpus.push(("gpus", run(BackendChoice::Auto, Some((0..gpus).collect()))));
        }
        for (what, model) in &on_gpus {
            assert_same_fits(&cpu, model, &format!("2^{exponent} on {what}"));
            for (a, b) in model.lambda.iter().zip(&cpu.lambda) {
                assert!(
                    a.is_finite() && (a - b).abs() <= 1e-3 * b.abs(),
                    "{what}: {a} {b}"
                );
            }
        }
    }
}

/// Seeded factors drawn on the GPU are the host's draw bit for bit, and
/// the arrangement made on the way down (column statistics on the device,
/// rows arranged as they arrive through the staging buffers) is the CPU
/// backend's arrangement of the same factors: the same order and signs,
/// weights within 1e-12 and entries within 1e-6.
#[test]
fn gpu_random_starts_and_arrangements_match_the_host() {
    use kruskal_cpd::{Backend, random_factors};
    use kruskal_formats::SparseTensor;
    let Some(gpu) =
        kruskal_device::testing::gpu_or_skip("gpu_random_starts_and_arrangements_match_the_host")
    else {
        return;
    };
    // Mode 1 alone holds more floats than a staging buffer (4M) at rank
    // 32, so the download goes in several pieces.
    let dims = vec![150_001u32, 7, 20_003];
    let t = SparseTensor::new(
        dims.clone(),
        vec![vec![0, 150_000, 3], vec![0, 6, 2], vec![0, 20_002, 5]],
        vec![1.0, 2.0, 3.0],
    )
    .unwrap();
    let candidates = [(GpuEngine::Fcoo, GpuOptions::default())];
    for (rank, seed) in [(32, 0u64), (7, 42), (1, u64::MAX), (100, 5)] {
        let mut g = GpuBackend::new(gpu.clone(), &t, &candidates).unwrap();
        g.load_random(rank, seed).unwrap();
        let drawn = g.take_factors().unwrap();
        let host = random_factors(&dims, rank, seed);
        for (m, (a, b)) in drawn.iter().zip(&host).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same && a.dim() == b.dim(),
                "rank {rank} seed {seed} mode {}",
                m + 1
            );
        }
    }
    for rank in [32, 5, 100] {
        let mut f = random_factors(&dims, rank, 9);
        for x in f.iter_mut().flat_map(|f| f.iter_mut()) {
            *x -= 0.5;
        }
        // A zero column; ties of magnitude with opposite signs (the first
        // entry in row order decides); a largest entry in the last piece.
        f[0].column_mut(rank - 1).fill(0.0);
        f[1][[1, 0]] = -2.0;
        f[1][[5, 0]] = 2.0;
        f[2][[10, rank / 2]] = 3.0;
        f[2][[20_000, rank / 2]] = -3.0;
        f[0][[149_999, 1]] = -9.0;
        let lambda: Vec<f64> = (0..rank).map(|r| 1.0 + 0.37 * r as f64).collect();
        for keep in [
            [false; 3],
            [true, false, false],
            [false, false, true],
            [true; 3],
        ] {
            let what = format!("rank {rank} keep {keep:?}");
            let mut c = CpuBackend::new(&t);
            c.load_factors(f.clone()).unwrap();
            let (lc, fc) = c.take_arranged(lambda.clone(), &keep).unwrap();
            let mut g = GpuBackend::new(gpu.clone(), &t, &candidates).unwrap();
            g.load_factors(f.clone()).unwrap();
            let (lg, fg) = g.take_arranged(lambda.clone(), &keep).unwrap();
            for (a, b) in lc.iter().zip(&lg) {
                assert!(
                    (a - b).abs() <= 1e-12 * a.abs(),
                    "{what}: weights {a} and {b}"
                );
            }
            for (m, (a, b)) in fc.iter().zip(&fg).enumerate() {
                assert_eq!(a.dim(), b.dim(), "{what}");
                let worst = a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(worst <= 1e-6, "{what}: mode {} differs by {worst}", m + 1);
            }
        }
    }
}
