//! Shared inputs for kruskal's criterion benchmarks (see `benches/`).
//!
//! Run them with `cargo bench -p kruskal-benches`; each benchmark names the
//! tensor it builds so results can be compared across machines.
