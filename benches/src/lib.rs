//! Shared inputs for kruskal's criterion benchmarks (see `benches/`).
//!
//! Run them with `cargo bench -p kruskal-benches`; each benchmark names the
//! tensor it builds so results can be compared across machines.

use kruskal_formats::SparseTensor;
use kruskal_formats::generate::{PowerLawSpec, power_law, preset};

/// The nonzero count a benchmark runs on: `KRUSKAL_BENCH_NNZ` where it is
/// set to a number, else `default`.
pub fn bench_nnz(default: usize) -> usize {
    std::env::var("KRUSKAL_BENCH_NNZ")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// A power-law tensor of the nell-2 shape (Zipf exponent 1.1 in every
/// mode, values uniform in [0, 1)) with [`bench_nnz`]`(default)` nonzeros.
pub fn nell2_like(default: usize) -> SparseTensor {
    let spec = PowerLawSpec::like(
        preset("nell-2").expect("known preset"),
        Some(bench_nnz(default)),
    )
    .expect("a count");
    power_law(&spec).expect("valid spec")
}
