//! Criterion benchmark of CP-APR on the CPU and, where a GPU opens, on the
//! first GPU: one outer iteration (every mode's `Pi`, ten multiplicative
//! updates each with its `Phi`, and the log-likelihood; on the GPU also
//! the upload of the sorted copies) on a power-law count tensor of the
//! nell-2 shape (values 1 to 5), rank 16. Throughput is reported in
//! nonzeros per second.
//!
//! `cargo bench -p kruskal-benches --bench cp_apr`; set `KRUSKAL_BENCH_NNZ`
//! to change the nonzero count (default 500,000).

use std::ops::ControlFlow;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kruskal_benches::nell2_like;
use kruskal_cpd::apr::{AprOptions, cp_apr};
use kruskal_cpd::cp_apr_gpu;
use kruskal_device::Gpu;
use kruskal_formats::SparseTensor;

fn bench_cp_apr(c: &mut Criterion) {
    let (dims, indices, values) = nell2_like(500_000).into_parts();
    // Uniform [0, 1) values as counts 1..=5.
    let counts = values.iter().map(|v| (v * 5.0).floor() + 1.0).collect();
    let tensor = SparseTensor::new(dims, indices, counts).expect("same shape");
    let mut group = c.benchmark_group(format!(
        "cp_apr/nell-2-shape/{}nnz/{}threads",
        tensor.nnz(),
        rayon::current_num_threads()
    ));
    group.sample_size(10);
    group.throughput(Throughput::Elements(tensor.nnz() as u64));
    let mut opts = AprOptions::new(16);
    opts.max_iters = 1;
    opts.tol = 0.0;
    group.bench_function("rank16/one-outer-iteration", |b| {
        b.iter(|| cp_apr(&tensor, &opts, &mut |_| ControlFlow::Continue(())).expect("counts"))
    });
    match Gpu::open(0) {
        Ok(gpu) => {
            group.bench_function("rank16/one-outer-iteration/gpu", |b| {
                b.iter(|| {
                    cp_apr_gpu(gpu.clone(), &tensor, &opts, &mut |_| {
                        ControlFlow::Continue(())
                    })
                    .expect("fits the GPU")
                })
            });
        }
        Err(e) => eprintln!("cp_apr bench: no GPU run ({e})"),
    }
    group.finish();
}

criterion_group!(benches, bench_cp_apr);
criterion_main!(benches);
