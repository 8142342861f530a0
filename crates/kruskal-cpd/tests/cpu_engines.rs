//! Every CPU engine gives the sorted engine's CPD: from the same initial
//! factors, the fit of every one of 20 iterations agrees within 1e-7 on the
//! real tensors of the repository's `data/` folder and on generated ones.
//! The sorted engine's fits are the ones compared with pyttb's
//! (`crates/kruskal-py/tests/test_cp_als.py`, `benches/compare_pyttb.py`),
//! so an engine that agrees with it to 1e-7 leaves those comparisons as
//! they were.

mod common;

use common::{ITERS, generated, options, real};
use kruskal_cpd::{CpuBackend, cpd_als};
use kruskal_cpu::CpuEngine;

const ENGINE_FIT_TOL: f64 = 1e-7;

// Two tests, the real tensors and the generated ones, so that the test
// harness runs them side by side.
#[test]
fn every_cpu_engine_gives_the_sorted_engines_fits_on_the_real_tensors() {
    for (name, t) in &real() {
        check_every_engine(name, t);
    }
}

#[test]
fn every_cpu_engine_gives_the_sorted_engines_fits_on_generated_tensors() {
    for (name, t) in &generated() {
        check_every_engine(name, t);
    }
}

fn check_every_engine(name: &str, t: &kruskal_formats::SparseTensor) {
    for rank in [4, 16] {
        let opts = options(t, rank);
        let base = cpd_als(
            &mut CpuBackend::with_kernel(t, CpuEngine::Sorted).unwrap(),
            &opts,
        )
        .unwrap();
        assert_eq!(base.iterations.len(), ITERS);
        for kernel in CpuEngine::ENGINES.into_iter().chain([CpuEngine::Auto]) {
            let mut backend = CpuBackend::with_kernel(t, kernel).unwrap();
            let model = cpd_als(&mut backend, &opts).unwrap();
            assert_eq!(model.iterations.len(), ITERS, "{name} {kernel}");
            let worst = base
                .iterations
                .iter()
                .zip(&model.iterations)
                .map(|(a, b)| (a.fit - b.fit).abs())
                .fold(0f64, f64::max);
            assert!(
                worst < ENGINE_FIT_TOL,
                "{name} rank {rank} {kernel} ({}): fits differ by up to {worst:.2e}",
                backend.kernel_name()
            );
        }
    }
}
