//! The GPU runtime of kruskal.
//!
//! - [`probe`]: finds the CUDA driver and NVRTC libraries *before* cudarc
//!   touches them (cudarc's dynamic loading panics when a library is
//!   missing), so a machine without a GPU gets a typed error that says what
//!   was tried (the program adds what to do instead, which depends on the
//!   command).
//! - [`gpu`]: [`Gpu`], one CUDA context and stream, the device's properties
//!   and its kernel cache.
//! - [`kernels`]: the CUDA sources of the crate's `kernels/` folder
//!   (embedded in the binary), compiled at run time by NVRTC for the
//!   device's architecture with `-DNMODES`, `-DRANK` and launch-shape
//!   defines, cached in memory and on disk.
//! - [`coo`]: the `coo_atomic` MTTKRP engine (the COO baseline) and the
//!   device-resident factor matrices.
//! - [`fcoo`]: the `fcoo` engine (F-COO per mode, segmented reduction over
//!   equal shares of nonzeros, atomics only for rows crossing block edges).
//! - [`hicoo`]: the `hicoo` engine (one HiCOO copy, blocks grouped per
//!   output mode, rows accumulated in shared memory).
//! - [`flycoo`]: the `flycoo` engine (one thread block per LPT partition,
//!   dynamic remap in the same pass).
//! - [`dense`]: the dense steps of CPD-ALS (factor update with column
//!   statistics, scaling, Gram matrix), f64 sums in a fixed order.
//! - [`apr`]: the steps of CP-APR (Poisson CP) in f64 (`Pi`, `Phi` with
//!   the KKT violation, the multiplicative update, the kappa fix, column
//!   1-norms, the log-likelihood); the driver is `kruskal_cpd::apr_gpu`.
//! - Several GPUs (one host's, or one per process of a job) run as a group
//!   in the `kruskal-group` crate, above this one: the engines' layouts,
//!   kernels and dense steps are this crate's, the scheduling of several
//!   GPUs and NCCL are the group's.
//! - [`tune`]: the GPU's part of the adaptive choice of engine and launch
//!   parameters: the sweep that measures the model's training data, and
//!   the mapping of a tuning configuration to an engine and its options.
//!   The configuration space, the tensor features, the model, its training
//!   and evaluation need no GPU and are the `kruskal-tune` crate.
//!
//! This crate builds and its CPU-side tests run everywhere; everything that
//! needs a GPU returns [`DeviceError`] when there is none.
//!
//! ```
//! // On a machine without a GPU this is an error, never a panic.
//! match kruskal_device::Gpu::open(0) {
//!     Ok(gpu) => println!("{}", gpu.properties().name),
//!     Err(e) => println!("no GPU: {e}"),
//! }
//! ```

/// Implements [`GpuMttkrp`] for an engine with `gpu` and `dims` fields and
/// an inherent `mttkrp`, under the name `--kernel` spells.
macro_rules! forward_gpu_mttkrp {
    ($engine:ty, $name:literal) => {
        forward_gpu_mttkrp!($engine, $name, {});
    };
    // An engine with its own count of gathered rows.
    ($engine:ty, $name:literal, gathers) => {
        forward_gpu_mttkrp!($engine, $name, {
            fn gathers_per_nonzero(&self, mode: usize) -> f64 {
                <$engine>::gathers_per_nonzero(self, mode)
            }

            fn preparation(&self) -> &[(&'static str, f64)] {
                <$engine>::preparation(self)
            }
        });
    };
    ($engine:ty, $name:literal, { $($extra:item)* }) => {
        impl $crate::GpuMttkrp for $engine {
            $($extra)*
            fn name(&self) -> &'static str {
                $name
            }

            fn gpu(&self) -> &std::sync::Arc<$crate::Gpu> {
                &self.gpu
            }

            fn dims(&self) -> &[u32] {
                &self.dims
            }

            fn mttkrp(
                &mut self,
                mode: usize,
                factors: &$crate::factors::DeviceFactors,
                out: &mut cudarc::driver::CudaSlice<f32>,
            ) -> $crate::Result<()> {
                <$engine>::mttkrp(self, mode, factors, out)
            }
        }
    };
}

pub mod admm;
pub mod apr;
pub mod catalog;
pub mod dense;
pub mod engine;
pub mod engines;
pub mod factors;
pub mod gpu;
pub mod kernels;
pub mod options;
pub mod probe;
pub mod random;
#[doc(hidden)]
pub mod testing;
pub mod tune;

#[cfg(test)]
mod testutil;

#[cfg(test)]
mod tests {
    #[test]
    fn the_floor_counts_the_tensor_once_and_every_factor_row_once() {
        // 3 modes: 16 bytes per nonzero; (10 + 20 + 30) rows of 4 floats.
        assert_eq!(super::floor_bytes(&[10, 20, 30], 1000, 4), 16_000 + 60 * 16);
    }

    #[test]
    fn the_l2_floor_counts_every_gathered_row() {
        // 1000 nonzeros, 1.5 rows each, 32 floats per row.
        assert_eq!(super::l2_floor_bytes(1000, 1.5, 32), 1000.0 * 1.5 * 128.0);
    }

    #[test]
    fn a_group_members_own_error_is_its_source_with_its_kind() {
        use super::{DeviceError, MemberError, error_line};
        use std::error::Error;
        let e = DeviceError::GroupMember {
            gpu: 1,
            name: "NVIDIA H100".into(),
            what: "the MTTKRP of mode 2".into(),
            source: Some(MemberError::new(DeviceError::OutOfMemory {
                what: "the output".into(),
                needed: 2048,
                free: 1024,
            })),
        };
        // The source is the device's error itself, not a box around it.
        let cause = e.source().and_then(|c| c.downcast_ref::<DeviceError>());
        assert!(matches!(cause, Some(DeviceError::OutOfMemory { .. })));
        assert_eq!(e.to_string(), "GPU 1 (NVIDIA H100): the MTTKRP of mode 2");
        assert_eq!(
            error_line(&e),
            "GPU 1 (NVIDIA H100): the MTTKRP of mode 2: out of GPU memory: the output needs 2048 \
             bytes, 1024 are free"
        );
    }
}

pub use engine::{GpuEngine, build_engine, build_engines};
pub use engines::coo::CooGpu;
pub use engines::fcoo::FcooGpu;
pub use engines::flycoo::FlycooGpu;
pub use engines::hicoo::HicooGpu;
pub use factors::DeviceFactors;
pub use gpu::{Gpu, GpuProperties};
pub use options::{FactorPrecision, FcooBuild, GpuOptions, LaunchParams};

use cudarc::driver::DriverError;

/// Everything that can go wrong on the GPU side.
///
/// A message never repeats its `source()`: [`DeviceError::GroupMember`]
/// says which GPU failed and at what, and its source is that GPU's own
/// error (so an out-of-memory error of one GPU of a group can be matched);
/// the driver's error of [`DeviceError::Driver`] is part of its message and
/// not a source. [`error_line`] prints the whole chain.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A CUDA library could not be loaded.
    #[error("no CUDA {library} library could be loaded (tried {})", tried.join(", "))]
    MissingLibrary {
        library: &'static str,
        tried: Vec<String>,
    },

    /// The driver loaded but reports no device (or not this one).
    #[error("no CUDA GPU {ordinal} (the driver reports {count} device(s))")]
    NoDevice { ordinal: usize, count: usize },

    /// A driver call failed.
    #[error("CUDA {what}: {error}")]
    Driver { what: String, error: DriverError },

    /// NVRTC refused a kernel; the log says why.
    #[error("compiling kernel {kernel} with {options}:\n{log}")]
    Compile {
        kernel: String,
        options: String,
        log: String,
    },

    /// Not enough free device memory.
    #[error("out of GPU memory: {what} needs {needed} bytes, {free} are free")]
    OutOfMemory {
        what: String,
        needed: usize,
        free: usize,
    },

    /// The host format for an engine could not be built.
    #[error("building {format} for the GPU: {message}")]
    Prepare {
        format: &'static str,
        message: String,
    },

    /// Operands of the wrong shape.
    #[error("shape mismatch: {0}")]
    Shape(String),

    /// One GPU of a group failed; the group has stopped. `what` is the
    /// step it failed at; `source`, the GPU's own error, where it returned
    /// one (none when its worker stopped or did not answer in time).
    #[error("GPU {gpu} ({name}): {what}")]
    GroupMember {
        gpu: usize,
        name: String,
        what: String,
        #[source]
        source: Option<MemberError>,
    },

    /// A GPU operation did not finish in time.
    #[error("timed out: {0}")]
    Timeout(String),

    /// The group stopped after an earlier error.
    #[error("the GPU group has stopped: {0}")]
    Aborted(String),

    /// An NCCL call failed, or NCCL was asked for and is missing.
    #[error("NCCL: {0}")]
    Nccl(String),
}

pub type Result<T, E = DeviceError> = std::result::Result<T, E>;

/// The error one GPU of a group returned, held by
/// [`DeviceError::GroupMember`]; derefs to it. Its `source()` is this
/// [`DeviceError`] itself (not a box around it), so a walk down the chain
/// finds it with `downcast_ref::<DeviceError>()`. (Not an error type of
/// its own, on purpose: the derive then takes the source through `Deref`.)
#[derive(Debug)]
pub struct MemberError(Box<DeviceError>);

impl MemberError {
    pub fn new(e: DeviceError) -> Self {
        MemberError(Box::new(e))
    }

    pub fn into_inner(self) -> DeviceError {
        *self.0
    }
}

impl std::ops::Deref for MemberError {
    type Target = DeviceError;
    fn deref(&self) -> &DeviceError {
        &self.0
    }
}

/// One GPU MTTKRP engine, whatever its format.
pub trait GpuMttkrp {
    /// Short name, as `--kernel` spells it.
    fn name(&self) -> &'static str;
    fn gpu(&self) -> &std::sync::Arc<Gpu>;
    fn dims(&self) -> &[u32];
    /// `out = MTTKRP(mode)` on the device (asynchronous on the GPU's
    /// stream); `out` holds `dims[mode] x rank` floats.
    fn mttkrp(
        &mut self,
        mode: usize,
        factors: &factors::DeviceFactors,
        out: &mut cudarc::driver::CudaSlice<f32>,
    ) -> Result<()>;

    /// Factor rows the engine gathers per nonzero of `mode` (on average):
    /// `nmodes - 1` unless it reuses rows (fcoo's fiber reuse). Times the
    /// row bytes, the L2 traffic of its gathers ([`l2_floor_bytes`]).
    fn gathers_per_nonzero(&self, mode: usize) -> f64 {
        let _ = mode;
        self.dims().len().saturating_sub(1) as f64
    }
    /// The steps of building this engine and their seconds, where the
    /// engine records them (fcoo: the upload, the sort and the tables);
    /// empty otherwise.
    fn preparation(&self) -> &[(&'static str, f64)] {
        &[]
    }

    /// Host-to-host convenience (tests, `kruskal check`): uploads the
    /// factors and `out`'s current contents (fill it with NaN to see rows
    /// an engine leaves unwritten), runs `mode` and copies the result back
    /// into `out`.
    fn mttkrp_host(
        &mut self,
        mode: usize,
        factors: &[ndarray::Array2<f32>],
        out: &mut ndarray::Array2<f32>,
    ) -> Result<()> {
        let gpu = self.gpu().clone();
        let dev = factors::DeviceFactors::upload(&gpu, factors)?;
        let stream = gpu.stream().clone();
        let initial: Vec<f32> = out.iter().copied().collect();
        let mut d_out = gpu.upload("the output", &initial)?;
        self.mttkrp(mode, &dev, &mut d_out)?;
        let host = stream
            .clone_dtoh(&d_out)
            .map_err(driver("downloading the output"))?;
        *out = ndarray::Array2::from_shape_vec(out.dim(), host)
            .map_err(|e| DeviceError::Shape(e.to_string()))?;
        Ok(())
    }

    /// Times `repeat` sweeps over `modes` in order (after one warm-up
    /// sweep) with CUDA events; returns milliseconds per run, per mode.
    fn time_sweeps(
        &mut self,
        factors: &factors::DeviceFactors,
        modes: &[usize],
        repeat: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let gpu = self.gpu().clone();
        let stream = gpu.stream().clone();
        let mut outs = modes
            .iter()
            .map(|&m| gpu.alloc_zeros::<f32>("an output", self.dims()[m] as usize * factors.rank()))
            .collect::<Result<Vec<_>>>()?;
        let (start, end) = (gpu.timing_event()?, gpu.timing_event()?);
        let mut times = vec![Vec::with_capacity(repeat); modes.len()];
        for sweep in 0..=repeat {
            for (k, &mode) in modes.iter().enumerate() {
                start
                    .record(&stream)
                    .map_err(driver("recording an event"))?;
                self.mttkrp(mode, factors, &mut outs[k])?;
                end.record(&stream).map_err(driver("recording an event"))?;
                end.synchronize()
                    .map_err(driver("waiting for the kernel"))?;
                if sweep > 0 {
                    times[k].push(start.elapsed_ms(&end).map_err(driver("reading an event"))?);
                }
            }
        }
        Ok(times)
    }
}

/// The fewest bytes an MTTKRP of any mode must move: every nonzero's indices
/// and value read once (4 bytes each), every input factor row read once and
/// every output row written once (`rank` f32 each). Divided by the copy
/// bandwidth ([`Gpu::copy_bandwidth`]) it is the time floor engines are
/// compared with.
pub fn floor_bytes(dims: &[u32], nnz: usize, rank: usize) -> usize {
    let rows: usize = dims.iter().map(|&d| d as usize).sum();
    nnz * 4 * (dims.len() + 1) + rows * rank * 4
}

/// Bytes of factor rows one MTTKRP of a mode gathers: `nnz` nonzeros times
/// `gathers_per_nonzero` rows of `rank` f32. Divided by the measured L2
/// gather bandwidth ([`Gpu::l2_gather_bandwidth`]) it is the *L2 gather
/// floor*: where the factors fit in L2, the gathers, not DRAM, bound an
/// engine (rows found in L1 can still beat it).
pub fn l2_floor_bytes(nnz: usize, gathers_per_nonzero: f64, rank: usize) -> f64 {
    nnz as f64 * gathers_per_nonzero * (rank * 4) as f64
}

/// Launch shape of a grid-stride kernel of 256-thread blocks over `items`
/// work items, `per_block` of them per block in one pass (256 for a thread
/// per item, 8 for a warp per item): at least one block, at most 65,535.
#[doc(hidden)]
pub fn grid_stride(items: u64, per_block: u64) -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig {
        grid_dim: (items.div_ceil(per_block).clamp(1, 65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Wraps a driver error with what was being done.
#[doc(hidden)]
pub fn driver(what: impl Into<String>) -> impl FnOnce(DriverError) -> DeviceError {
    let what = what.into();
    move |error| DeviceError::Driver { what, error }
}

/// An error and its causes on one line, outermost first, joined by ": "
/// (as `anyhow` prints an error with `{:#}`). Each error of the workspace
/// keeps its causes out of its own message, so each is said once.
pub fn error_line(e: &dyn std::error::Error) -> String {
    std::iter::successors(Some(e), |&e| e.source())
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}
