//! Criterion benchmarks of every storage format on a power-law tensor of
//! the nell-2 shape: how long each takes to build from COO (all modes), and
//! its CPU MTTKRP (rank 32, one sweep over all modes in order, as CPD-ALS
//! calls them; FLYCOO's dynamic remap relies on that order).
//!
//! Then the row plan of a group of GPUs: the nonzeros per row of each mode
//! and the rows dealt out from them.
//!
//! `cargo bench -p kruskal-benches --bench formats`; `KRUSKAL_BENCH_NNZ`
//! sets the nonzero count (default 2,000,000), `KRUSKAL_BENCH_LIKE` the
//! FROSTT shape (default nell-2).

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kruskal_cpu::{CpuEngine, CpuMttkrp, MttkrpEngine};
use kruskal_formats::fcoo::Fcoo;
use kruskal_formats::generate::{PowerLawSpec, power_law, preset};
use kruskal_formats::hicoo::Hicoo;
use kruskal_formats::{Csf, SparseTensor};
use kruskal_partition::RowShards;
use kruskal_partition::flycoo::build_flycoo;
use kruskal_partition::layout::LayoutOptions;
use ndarray::Array2;

fn tensor() -> (String, SparseTensor) {
    let nnz: usize = std::env::var("KRUSKAL_BENCH_NNZ")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000_000);
    let like = std::env::var("KRUSKAL_BENCH_LIKE").unwrap_or_else(|_| "nell-2".into());
    let spec =
        PowerLawSpec::like(preset(&like).expect("known preset"), Some(nnz)).expect("a count");
    let t = power_law(&spec).expect("valid spec");
    (format!("{like}-shape/{nnz}nnz"), t)
}

fn bench_build(c: &mut Criterion) {
    let (name, t) = tensor();
    let mut group = c.benchmark_group(format!(
        "format_build/{name}/{}threads",
        rayon::current_num_threads()
    ));
    group.sample_size(10);
    group.throughput(Throughput::Elements(t.nnz() as u64));
    let modes = 0..t.nmodes();
    group.bench_function("sorted", |b| b.iter(|| CpuMttkrp::new(&t)));
    group.bench_function("fcoo", |b| {
        b.iter(|| {
            modes
                .clone()
                .map(|m| Fcoo::for_mttkrp(&t, m, 8).expect("fits"))
                .collect::<Vec<_>>()
        })
    });
    for kappa in [132usize, 1056] {
        group.bench_function(BenchmarkId::new("flycoo", format!("kappa{kappa}")), |b| {
            b.iter(|| build_flycoo(&t, &LayoutOptions::new(kappa)).expect("fits"))
        });
    }
    group.bench_function("hicoo", |b| {
        b.iter(|| Hicoo::new(&t, Hicoo::DEFAULT_BLOCK_BITS).expect("fits"))
    });
    // One CSF tree per mode, each rooted at its mode (the csf engine's
    // default copies).
    group.bench_function("csf", |b| {
        b.iter(|| {
            modes
                .clone()
                .map(|m| Csf::new(&t, &Csf::root_first(t.dims(), m)).expect("fits"))
                .collect::<Vec<_>>()
        })
    });
    group.finish();
}

fn bench_mttkrp(c: &mut Criterion) {
    let (name, t) = tensor();
    let rank = 32;
    let factors: Vec<Array2<f32>> = t
        .dims()
        .iter()
        .map(|&d| Array2::from_shape_fn((d as usize, rank), |(i, j)| ((i + j) % 7) as f32 * 0.1))
        .collect();
    let mut outs: Vec<Array2<f32>> = t
        .dims()
        .iter()
        .map(|&d| Array2::zeros((d as usize, rank)))
        .collect();
    let mut group = c.benchmark_group(format!(
        "mttkrp_all_modes/{name}/rank{rank}/{}threads",
        rayon::current_num_threads()
    ));
    group.sample_size(10);
    group.throughput(Throughput::Elements((t.nnz() * t.nmodes()) as u64));
    for kernel in CpuEngine::ENGINES {
        let mut engine: Box<dyn MttkrpEngine> = kernel.build(&t).expect("fits");
        group.bench_function(kernel.name(), |b| {
            b.iter(|| {
                for (mode, out) in outs.iter_mut().enumerate() {
                    engine.mttkrp(mode, &factors, out).expect("shapes match");
                }
            })
        });
    }
    group.finish();
}

/// What a group of GPUs plans before building its shards: the nonzeros
/// per row of every mode, then the rows of every mode dealt to 1 and 4
/// GPUs from those counts.
fn bench_plan(c: &mut Criterion) {
    let (name, t) = tensor();
    let mut group = c.benchmark_group(format!(
        "row_plan/{name}/{}threads",
        rayon::current_num_threads()
    ));
    group.sample_size(10);
    group.throughput(Throughput::Elements(t.nnz() as u64));
    for mode in 0..t.nmodes() {
        group.bench_function(BenchmarkId::new("mode_counts", mode), |b| {
            b.iter(|| t.mode_counts(mode))
        });
    }
    let counts: Vec<Vec<u64>> = (0..t.nmodes()).map(|m| t.mode_counts(m)).collect();
    for gpus in [1usize, 4] {
        group.bench_function(
            BenchmarkId::new("from_counts", format!("{gpus}gpus")),
            |b| {
                b.iter_batched(
                    || counts.clone(),
                    |counts| RowShards::from_counts(t.dims(), counts, gpus).expect("a plan"),
                    BatchSize::LargeInput,
                )
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench_build, bench_mttkrp, bench_plan);
criterion_main!(benches);
