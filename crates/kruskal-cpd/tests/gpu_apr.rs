//! GPU CP-APR gives the CPU's answer: from the same initial factors, on
//! small count tensors of 3 and 4 modes (a mode with empty rows, repeated
//! coordinates summed, an entry the kappa fix must raise, rows long enough
//! to be cut into pieces) at ranks 3, 8
//! and 33, the same iterations (inner iteration counts, kappa fixes, the
//! stopping rule), the log-likelihood of every outer iteration within
//! 1e-9 relative and the factors within 1e-8; and a GPU run repeats bit
//! for bit. A group of GPUs (each a range of every mode's rows) gives the
//! same answer, with parts that own no row of a mode.
//!
//! Needs a CUDA GPU: each test notes the skip and passes where there is
//! none (`kruskal_device::testing::gpu_or_skip`), and runs where there is.

use std::ops::ControlFlow;

use kruskal_cpd::apr::{AprInit, AprModel, AprOptions, cp_apr};
use kruskal_cpd::decompose::BackendChoice;
use kruskal_cpd::{CpdError, cp_apr_gpu, cp_apr_on, random_factors};
use kruskal_formats::SparseTensor;
use kruskal_formats::generate::{PlantedSpec, planted};
use ndarray::Array2;

/// A planted tensor's values rounded up to counts, mode 0's row 3 left
/// empty (indices from 3 up moved one row down), and its first 25
/// nonzeros given twice (summed into one count each).
fn counts(dims: Vec<u32>, rank: usize, nnz: usize, seed: u64) -> SparseTensor {
    let p = planted(&PlantedSpec {
        dims,
        rank,
        nnz,
        noise: 0.0,
        seed,
    })
    .unwrap();
    let distinct = p.tensor.nnz();
    let (mut dims, mut idx, values) = p.tensor.into_parts();
    let mut values: Vec<f32> = values.iter().map(|v| (v * 20.0).ceil()).collect();
    dims[0] += 1;
    for i in idx[0].iter_mut() {
        if *i >= 3 {
            *i += 1;
        }
    }
    for m in idx.iter_mut() {
        let again: Vec<u32> = m[..25].to_vec();
        m.extend(again);
    }
    let again: Vec<f32> = values[..25].to_vec();
    values.extend(again);
    let t = SparseTensor::new(dims, idx, values).unwrap();
    assert_eq!(t.nnz(), distinct, "the repeats are summed");
    assert!(t.indices()[0].iter().all(|&i| i != 3), "row 3 is empty");
    t
}

fn options(t: &SparseTensor, rank: usize, seed: u64) -> AprOptions {
    let mut factors: Vec<Array2<f64>> = random_factors(t.dims(), rank, seed)
        .into_iter()
        .map(|f| f.mapv(|x| f64::from(x) + 0.05))
        .collect();
    // An entry the data wants to grow, stuck at zero: only kappa moves it.
    let row = t.indices()[1][0] as usize;
    factors[1][[row, 0]] = 0.0;
    let mut opts = AprOptions::new(rank);
    opts.init = AprInit::Given {
        factors,
        weights: None,
    };
    opts
}

fn run(t: &SparseTensor, opts: &AprOptions) -> AprModel {
    cp_apr(t, opts, &mut |_| ControlFlow::Continue(())).unwrap()
}

fn assert_same(cpu: &AprModel, gpu: &AprModel, what: &str) {
    assert_eq!(cpu.iterations.len(), gpu.iterations.len(), "{what}");
    assert_eq!(cpu.converged, gpu.converged, "{what}");
    assert_eq!(cpu.timed_out, gpu.timed_out, "{what}");
    for (c, g) in cpu.iterations.iter().zip(&gpu.iterations) {
        let at = format!("{what}, iteration {}", c.iteration);
        assert_eq!(c.iteration, g.iteration, "{at}");
        let (a, b) = (c.log_likelihood, g.log_likelihood);
        assert!(
            (a - b).abs() <= 1e-9 * a.abs(),
            "{at}: log-likelihood {a} (CPU) vs {b} (GPU)"
        );
        assert_eq!(c.inner_iters, g.inner_iters, "{at}: inner iterations");
        assert_eq!(c.kappa_fixes, g.kappa_fixes, "{at}: kappa fixes");
        assert!(
            (c.kkt_violation - g.kkt_violation).abs() <= 1e-9 * c.kkt_violation.max(1e-3),
            "{at}: KKT violation {} vs {}",
            c.kkt_violation,
            g.kkt_violation
        );
    }
    assert_eq!(
        cpu.log_likelihood,
        cpu.iterations.last().unwrap().log_likelihood
    );
    assert_eq!(
        gpu.log_likelihood,
        gpu.iterations.last().unwrap().log_likelihood
    );
    for (r, (a, b)) in cpu.lambda.iter().zip(&gpu.lambda).enumerate() {
        assert!(
            (a - b).abs() <= 1e-9 * a.abs().max(1.0),
            "{what}: lambda {r}: {a} vs {b}"
        );
    }
    for (m, (a, b)) in cpu.factors.iter().zip(&gpu.factors).enumerate() {
        assert_eq!(a.dim(), b.dim(), "{what}: factor {m}");
        for ((ix, x), y) in a.indexed_iter().zip(b.iter()) {
            assert!(
                (x - y).abs() <= 1e-8,
                "{what}: factor {m} entry {ix:?}: {x} vs {y}"
            );
        }
    }
}

#[test]
fn gpu_cp_apr_matches_the_cpu() {
    let Some(gpu) = kruskal_device::testing::gpu_or_skip("gpu_cp_apr_matches_the_cpu") else {
        return;
    };
    // The third: rows of the first mode of 450 nonzeros, each cut into
    // two pieces (kruskal_device::apr::PIECE_NNZ).
    let tensors = [
        ("3 modes", counts(vec![30, 24, 18], 3, 2_000, 3)),
        ("4 modes", counts(vec![14, 12, 10, 8], 3, 1_500, 5)),
        ("long rows", counts(vec![6, 40, 30], 3, 3_000, 4)),
    ];
    let mut longest = vec![0usize; tensors[2].1.dims()[0] as usize];
    for &i in &tensors[2].1.indices()[0] {
        longest[i as usize] += 1;
    }
    assert!(longest.iter().any(|&n| n > kruskal_device::apr::PIECE_NNZ));
    let mut kappa_fixes = 0;
    for (name, t) in &tensors {
        for rank in [3, 8, 33] {
            // A fixed number of iterations, every inner iteration run.
            let what = format!("{name} rank {rank}");
            let mut opts = options(t, rank, 11 + rank as u64);
            opts.max_iters = 6;
            opts.tol = 0.0;
            let cpu = run(t, &opts);
            let on_gpu =
                cp_apr_gpu(gpu.clone(), t, &opts, &mut |_| ControlFlow::Continue(())).unwrap();
            assert_same(&cpu, &on_gpu, &what);
            kappa_fixes += cpu.iterations.iter().map(|s| s.kappa_fixes).sum::<usize>();
        }
    }
    assert!(kappa_fixes > 0, "no kappa fix was tested");
}

#[test]
fn gpu_cp_apr_stops_where_the_cpu_does() {
    let Some(gpu) = kruskal_device::testing::gpu_or_skip("gpu_cp_apr_stops_where_the_cpu_does")
    else {
        return;
    };
    // Small tensors the KKT test stops within the iteration limit: the
    // inner iterations end early, then the outer ones.
    let tensors = [
        ("3 modes", counts(vec![12, 10, 8], 2, 300, 6)),
        ("4 modes", counts(vec![9, 8, 7, 6], 2, 400, 7)),
    ];
    for (name, t) in &tensors {
        let what = format!("{name} until the KKT test stops it");
        let mut opts = options(t, 2, 5);
        opts.max_iters = 1000;
        opts.tol = 1e-2;
        let cpu = run(t, &opts);
        assert!(cpu.converged, "{what}: the CPU run did not converge");
        let on_gpu = cp_apr_gpu(gpu.clone(), t, &opts, &mut |_| ControlFlow::Continue(())).unwrap();
        assert_same(&cpu, &on_gpu, &what);
    }
}

#[test]
fn gpu_cp_apr_repeats_bit_for_bit_and_reports_where_it_ran() {
    let Some(gpu) = kruskal_device::testing::gpu_or_skip(
        "gpu_cp_apr_repeats_bit_for_bit_and_reports_where_it_ran",
    ) else {
        return;
    };
    let t = counts(vec![40, 30, 20], 4, 5_000, 9);
    let mut opts = options(&t, 8, 2);
    opts.max_iters = 5;
    let mut heard = Vec::new();
    let a = cp_apr_gpu(gpu.clone(), &t, &opts, &mut |s| {
        heard.push(s.iteration);
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(heard, [1, 2, 3, 4, 5]);
    let b = cp_apr_gpu(gpu.clone(), &t, &opts, &mut |_| ControlFlow::Continue(())).unwrap();
    for (x, y) in a.iterations.iter().zip(&b.iterations) {
        assert_eq!(x.log_likelihood.to_bits(), y.log_likelihood.to_bits());
    }
    assert_eq!(a.factors, b.factors);
    // The callback stops the run after the current iteration.
    let stopped = cp_apr_gpu(gpu.clone(), &t, &opts, &mut |s| {
        if s.iteration == 2 {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })
    .unwrap();
    assert!(stopped.interrupted && stopped.iterations.len() == 2);
    // `auto` and `gpu` run here on the GPU.
    for choice in [BackendChoice::Auto, BackendChoice::Gpu] {
        let run = cp_apr_on(&t, &opts, choice, &mut |_| ControlFlow::Continue(())).unwrap();
        assert_eq!(run.backend, "gpu", "{choice:?}: {:?}", run.fallback);
        assert_eq!(run.device.as_deref(), Some(gpu.properties().name.as_str()));
        assert_eq!(run.model.factors, a.factors);
    }
    // A rank beyond the kernels: auto runs on the CPU and says why, gpu
    // refuses in one line.
    let mut wide = AprOptions::new(300);
    wide.max_iters = 1;
    let run = cp_apr_on(&t, &wide, BackendChoice::Auto, &mut |_| {
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(run.backend, "cpu");
    assert!(run.fallback.unwrap().contains("ranks 1 to 256"));
    let e = cp_apr_on(&t, &wide, BackendChoice::Gpu, &mut |_| {
        ControlFlow::Continue(())
    })
    .unwrap_err();
    assert!(matches!(e, CpdError::Gpu(_)), "{e}");
}

#[test]
fn gpu_cp_apr_refuses_what_does_not_fit_before_allocating() {
    let Some(gpu) = kruskal_device::testing::gpu_or_skip(
        "gpu_cp_apr_refuses_what_does_not_fit_before_allocating",
    ) else {
        return;
    };
    // Three nonzeros, one index of 3e9: at rank 10 the factors and Phi
    // alone take 480 GB.
    let t = SparseTensor::new(
        vec![3_000_000_000, 2, 2],
        vec![vec![0, 1, 2_999_999_999], vec![0, 1, 1], vec![1, 0, 1]],
        vec![1.0, 2.0, 3.0],
    )
    .unwrap();
    let e = cp_apr_gpu(gpu, &t, &AprOptions::new(10), &mut |_| {
        ControlFlow::Continue(())
    })
    .unwrap_err();
    assert!(
        matches!(e, CpdError::Gpu(_) | CpdError::Memory { .. }),
        "{e}"
    );
    let text = e.to_string();
    assert!(text.contains("CP-APR") && !text.contains('\n'), "{text}");
}

/// The GPUs a group of `parts` parts runs on: the machine's GPUs in turn
/// (on a machine of one GPU every part shares it, which runs the same
/// code, the copies between parts included).
fn group_of(parts: usize) -> Vec<std::sync::Arc<kruskal_device::Gpu>> {
    let count = kruskal_device::Gpu::count().unwrap();
    let gpus: Vec<_> = (0..count.min(parts))
        .map(|o| kruskal_device::Gpu::open(o).unwrap())
        .collect();
    (0..parts).map(|k| gpus[k % gpus.len()].clone()).collect()
}

#[test]
fn a_group_of_gpus_matches_the_cpu() {
    if kruskal_device::testing::gpu_or_skip("a_group_of_gpus_matches_the_cpu").is_none() {
        return;
    }
    // "long rows": 6 rows in mode 0 of about 500 nonzeros each, so with 8
    // parts some own no row of it; "4 modes" has 8 rows in its last mode.
    let tensors = [
        ("3 modes", counts(vec![30, 24, 18], 3, 2_000, 3)),
        ("4 modes", counts(vec![14, 12, 10, 8], 3, 1_500, 5)),
        ("long rows", counts(vec![6, 40, 30], 3, 3_000, 4)),
    ];
    let mut empty_parts = 0;
    for (name, t) in &tensors {
        for (parts, rank) in [(2, 3), (3, 33), (4, 8), (8, 8)] {
            let what = format!("{name}, {parts} parts, rank {rank}");
            let mut opts = options(t, rank, 21 + rank as u64);
            opts.max_iters = 5;
            opts.tol = 0.0;
            let cpu = run(t, &opts);
            let gpus = group_of(parts);
            let group =
                kruskal_cpd::cp_apr_gpus(&gpus, t, &opts, &mut |_| ControlFlow::Continue(()))
                    .unwrap();
            assert_same(&cpu, &group, &what);
            // The same group again: bit for bit.
            let again =
                kruskal_cpd::cp_apr_gpus(&gpus, t, &opts, &mut |_| ControlFlow::Continue(()))
                    .unwrap();
            assert_eq!(group.factors, again.factors, "{what}: a second run");
            for (x, y) in group.iterations.iter().zip(&again.iterations) {
                assert_eq!(x.log_likelihood.to_bits(), y.log_likelihood.to_bits());
            }
            if parts > t.dims().iter().copied().min().unwrap() as usize {
                empty_parts += 1;
            }
        }
    }
    assert!(empty_parts > 0, "no part without rows was tested");
}

#[test]
fn a_group_of_gpus_stops_where_the_cpu_does() {
    if kruskal_device::testing::gpu_or_skip("a_group_of_gpus_stops_where_the_cpu_does").is_none() {
        return;
    }
    let t = counts(vec![12, 10, 8], 2, 300, 6);
    let mut opts = options(&t, 2, 5);
    opts.max_iters = 1000;
    opts.tol = 1e-2;
    let cpu = run(&t, &opts);
    assert!(cpu.converged);
    // Inner loops that end early in some modes and iterations, not in
    // others: the parts must end each at the same iteration as the CPU.
    let inner: Vec<usize> = cpu.iterations.iter().map(|s| s.inner_iters).collect();
    assert!(
        inner.iter().any(|&n| n < 3 * opts.max_inner_iters) && inner.iter().any(|&n| n > 3),
        "{inner:?}"
    );
    // 8 parts: some own no row of a mode (8 rows in the last).
    for parts in [3, 8] {
        let group = kruskal_cpd::cp_apr_gpus(&group_of(parts), &t, &opts, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_same(
            &cpu,
            &group,
            &format!("{parts} parts until the KKT test stops it"),
        );
    }
    // On the machine's GPUs by ordinal: where it ran and on how many.
    let count = kruskal_device::Gpu::count().unwrap();
    let ordinals: Vec<usize> = (0..count.min(2)).collect();
    let run = kruskal_cpd::cp_apr_on_gpus(&t, &opts, &ordinals, &mut |_| ControlFlow::Continue(()))
        .unwrap();
    assert_eq!((run.backend, run.gpus), ("gpu", ordinals.len()));
    assert_same(&cpu, &run.model, "on the machine's GPUs");
    // No GPUs at all is an option error.
    let e =
        kruskal_cpd::cp_apr_gpus(&[], &t, &opts, &mut |_| ControlFlow::Continue(())).unwrap_err();
    assert!(matches!(e, CpdError::InvalidOption { .. }), "{e}");
}
