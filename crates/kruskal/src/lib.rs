//! kruskal: CP decomposition of large sparse tensors.
//!
//! This crate is the `kruskal` program and a facade over the library crates,
//! so a user can depend on one crate:
//!
//! - [`formats`]: the COO tensor, `.tns`/`.tns.gz`/`.ktns` I/O, generators;
//! - [`partition`]: greedy LPT, heavy-row splitting, FLYCOO layouts, AMPED
//!   shard plans;
//! - [`cpu`]: the CPU MTTKRP kernels (one per format) and the f64 reference;
//! - [`device`]: the GPU runtime (discovery, kernel cache, GPU MTTKRP
//!   engines, the dense CPD kernels);
//! - [`group`]: several GPUs as one group (one host's, or one per process
//!   of a job) and NCCL;
//! - [`tune`]: the adaptive choice of GPU engine and launch parameters
//!   (tensor features, the trained model, training), which needs no GPU;
//! - [`cpd`]: CPD-ALS over a backend, the model and its files;
//! - [`harness`]: every MTTKRP engine against the f64 reference (what
//!   `kruskal check` runs);
//! - [`measure`]: what `kruskal mttkrp`, `kruskal cpd` and `kruskal cp-apr`
//!   run, with typed options, so tools that measure the program (`cargo
//!   xtask bench`) run the same code as the command line, without
//!   spawning it;
//! - [`input`]: a tensor from a file or generated like a FROSTT tensor;
//! - [`console`]: warnings, notes, spinners and numbers as the program
//!   prints them.
//!
//! The command line itself (clap's options, one module per subcommand
//! under `src/cli/`) belongs to the binary, `src/main.rs`: none of it is
//! in this library's API.
//!
//! ```
//! use kruskal::cpd::{cpd_als, CpdOptions, CpuBackend};
//! use kruskal::formats::generate::{planted, PlantedSpec};
//!
//! let p = planted(&PlantedSpec { dims: vec![40, 30, 20], rank: 2, nnz: 2_000, noise: 0.0, seed: 1 }).unwrap();
//! let model = cpd_als(&mut CpuBackend::new(&p.tensor), &CpdOptions::new(2)).unwrap();
//! assert_eq!(model.factors.len(), 3);
//! ```

pub use kruskal_cpd as cpd;
pub use kruskal_cpu as cpu;
pub use kruskal_device as device;
pub use kruskal_formats as formats;
pub use kruskal_group as group;
pub use kruskal_partition as partition;
pub use kruskal_tune as tune;

pub mod console;
pub mod harness;
pub mod input;
pub mod measure;
pub mod wall;

/// The README's examples, compiled as doc tests so they stay true.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
