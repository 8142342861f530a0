//! Criterion benchmark of the CPU MTTKRP on a power-law tensor of the
//! nell-2 shape (Zipf exponent 1.1 in every mode), rank 16 and 32, every
//! mode. Throughput is reported in nonzeros per second.
//!
//! `cargo bench -p kruskal-benches --bench mttkrp`; set `KRUSKAL_BENCH_NNZ`
//! to change the nonzero count (default 2,000,000).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kruskal_benches::nell2_like;
use kruskal_cpu::CpuMttkrp;
use ndarray::Array2;

fn bench_mttkrp(c: &mut Criterion) {
    let tensor = nell2_like(2_000_000);
    let nnz = tensor.nnz();
    let engine = CpuMttkrp::new(&tensor);
    let mut group = c.benchmark_group(format!(
        "cpu_mttkrp/nell-2-shape/{nnz}nnz/{}threads",
        rayon::current_num_threads()
    ));
    group.sample_size(10);
    group.throughput(Throughput::Elements(nnz as u64));
    for rank in [16usize, 32] {
        let factors: Vec<Array2<f32>> = tensor
            .dims()
            .iter()
            .map(|&d| {
                Array2::from_shape_fn((d as usize, rank), |(i, j)| ((i + j) % 7) as f32 * 0.1)
            })
            .collect();
        for mode in 0..tensor.nmodes() {
            let mut out = Array2::zeros((tensor.dims()[mode] as usize, rank));
            group.bench_function(
                BenchmarkId::new(format!("rank{rank}"), format!("mode{}", mode + 1)),
                |b| {
                    b.iter(|| {
                        engine
                            .mttkrp(mode, &factors, &mut out)
                            .expect("shapes match")
                    })
                },
            );
        }
    }
    group.finish();
}

criterion_group!(benches, bench_mttkrp);
criterion_main!(benches);
