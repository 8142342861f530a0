//! A GPU that fails mid-run stops the whole group: the CPD returns an
//! error that names the GPU, within a bounded time, and nothing hangs.
//!
//! A test binary of its own: the failing GPU's context stays broken for
//! the rest of the process. Needs CUDA GPUs (`--include-ignored`); the
//! hook is `GroupOptions::fault` (hidden from the documentation).

use std::time::{Duration, Instant};

use kruskal_cpd::{CpdOptions, GroupBackend, cpd_als};
use kruskal_device::{DeviceError, Gpu, error_line};
use kruskal_formats::generate::{PowerLawSpec, power_law};
use kruskal_group::{GpuGroup, GroupOptions};

#[test]
#[ignore = "needs CUDA GPUs"]
fn a_failing_gpu_stops_the_group_with_an_error_naming_it() {
    let n = Gpu::count().unwrap().min(4);
    assert!(n >= 1, "no CUDA GPU");
    let gpus: Vec<usize> = (0..n).collect();
    let bad = n - 1;
    let t = power_law(
        &PowerLawSpec::new(vec![4_000, 3_000, 2_000], 300_000)
            .with_draws()
            .with_seed(9),
    )
    .unwrap();
    let opts = GroupOptions {
        timeout: Duration::from_secs(20),
        // The last GPU traps before its fifth MTTKRP (iteration 2, mode 2).
        fault: Some((bad, 4)),
        ..GroupOptions::default()
    };
    let group = GpuGroup::new(&gpus, &t, 16, &opts, &mut |_| {}).unwrap();
    let mut backend = GroupBackend::new(group, &t);
    let mut cpd = CpdOptions::new(16);
    cpd.max_iters = 10;
    cpd.tol = 0.0;
    let start = Instant::now();
    let e = cpd_als(&mut backend, &cpd).unwrap_err();
    let took = start.elapsed();
    let err = error_line(&e);
    eprintln!("error after {:.2} s: {err}", took.as_secs_f64());
    assert!(err.contains(&format!("GPU {bad}")), "{err}");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    // The failing GPU's own error is the cause, with its kind.
    assert!(
        matches!(
            e.device_error(),
            Some(DeviceError::GroupMember {
                source: Some(_),
                ..
            })
        ),
        "{err}"
    );
    // Later calls fail at once with the same cause.
    let again = error_line(&cpd_als(&mut backend, &cpd).unwrap_err());
    assert!(again.contains(&format!("GPU {bad}")), "{again}");
    drop(backend);
}
