//! CP decomposition by alternating least squares (CPD-ALS) for sparse
//! tensors, over a [`Backend`] trait so the same driver runs on the CPU
//! ([`CpuBackend`]), one GPU ([`GpuBackend`]) or several ([`GroupBackend`]);
//! in [`admm`], non-negative and L1/L2-regularized CP by AO-ADMM (CPU or
//! one GPU);
//! in [`apr`], the Poisson CP of count tensors (CP-APR) on the CPU, and in
//! [`apr_gpu`] on one GPU; and,
//! in [`distributed`], one process's part of a run over several processes.
//!
//! ```
//! use kruskal_cpd::{cpd_als, CpdOptions, CpuBackend};
//! use kruskal_formats::generate::{planted, PlantedSpec};
//!
//! let p = planted(&PlantedSpec { dims: vec![60, 50, 40], rank: 3, nnz: 6_000, noise: 0.0, seed: 2 }).unwrap();
//! let mut backend = CpuBackend::new(&p.tensor);
//! let mut opts = CpdOptions::new(3);
//! opts.max_iters = 100;
//! let model = cpd_als(&mut backend, &opts).unwrap();
//! assert!(model.fit() > 0.99);
//! ```

pub mod admm;
pub mod als;
pub mod apr;
pub mod apr_gpu;
pub mod backend;
pub mod decompose;
pub mod dense;
pub mod distributed;
pub mod engine_choice;
pub mod error;
pub mod gpu;
pub mod gpu_count;
pub mod memory;
pub mod model;
pub mod multi;
pub mod scale;
pub mod score;
pub mod warnings;

pub use admm::{AdmmOptions, DataRows, InnerStop, NonNeg, cpd_admm, cpd_admm_with};
pub(crate) use als::check_factor_shapes;
pub use als::{Arrangement, CpdOptions, Init, arrange, cpd_als, cpd_als_with, random_factors};
pub use apr::{AprInit, AprIteration, AprModel, AprOptions, cp_apr};
pub use apr_gpu::{AprRun, apr_all_gpus, cp_apr_gpu, cp_apr_gpus, cp_apr_on, cp_apr_on_gpus};
pub use backend::{Backend, ColumnNorms, CpuBackend};
pub use decompose::{
    BackendChoice, Chosen, DecomposeOptions, Decomposition, Event, PrepareTimes, StartSummary,
    decompose, decompose_owned,
};
pub use distributed::{DistributedDecomposition, decompose_distributed};
pub use engine_choice::{EngineChoice, EngineRequest};
pub use error::{CpdError, OptionName, Result, Spelling};
pub use gpu::{GpuBackend, KernelPlan};
pub use model::{HISTORY, IterationStats, IterationTotals, KruskalModel, Staging, load_factors};
pub use multi::{GroupBackend, ModeBreakdown};
pub use scale::ValueScale;
pub use score::factor_match_score;
pub use warnings::{Warning, warnings};
