//! Criterion benchmark of constrained CP (AO-ADMM, `--nonneg`) against
//! unconstrained ALS on the same tensor, start and iterations: a power-law
//! tensor of the nell-2 shape, rank 16, three outer iterations from the
//! seeded start, on the CPU and, where a GPU opens, on the first GPU (the
//! fcoo engine; the inner loop there runs in row blocks, see
//! `kruskal_device::admm`). The ratio of a pair is the cost of the
//! constraint.
//!
//! `cargo bench -p kruskal-benches --bench admm`; set `KRUSKAL_BENCH_NNZ`
//! to change the nonzero count (default 500,000).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kruskal_benches::nell2_like;
use kruskal_cpd::{AdmmOptions, Backend, CpdOptions, CpuBackend, GpuBackend, cpd_admm, cpd_als};
use kruskal_device::{Gpu, GpuEngine, GpuOptions};

const RANK: usize = 16;
const ITERS: usize = 3;

fn bench_admm(c: &mut Criterion) {
    let tensor = nell2_like(500_000);
    let mut opts = CpdOptions::new(RANK);
    opts.max_iters = ITERS;
    opts.tol = 0.0;
    let nonneg = AdmmOptions::nonneg();
    let mut group = c.benchmark_group(format!(
        "admm/nell-2-shape/{}nnz/rank{RANK}/{ITERS}iterations",
        tensor.nnz()
    ));
    group.sample_size(10);
    group.throughput(Throughput::Elements(tensor.nnz() as u64));

    let mut backends: Vec<(String, Box<dyn Backend>)> = vec![(
        format!("cpu-{}threads", rayon::current_num_threads()),
        Box::new(CpuBackend::new(&tensor)),
    )];
    match Gpu::open(0) {
        Ok(gpu) => {
            let candidates = [(GpuEngine::Fcoo, GpuOptions::default())];
            let backend = GpuBackend::new(gpu, &tensor, &candidates).expect("the tensor fits");
            backends.push(("gpu".into(), Box::new(backend)));
        }
        Err(e) => eprintln!("admm bench: no GPU run ({e})"),
    }
    for (name, mut backend) in backends {
        group.bench_function(BenchmarkId::new("als", &name), |b| {
            b.iter(|| cpd_als(backend.as_mut(), &opts).expect("runs"))
        });
        group.bench_function(BenchmarkId::new("admm-nonneg", &name), |b| {
            b.iter(|| cpd_admm(backend.as_mut(), &opts, &nonneg).expect("runs"))
        });
    }
    group.finish();
}

criterion_group!(benches, bench_admm);
criterion_main!(benches);
