//! The GPU runtime of kruskal.
//!
//! - [`probe`]: finds the CUDA driver and NVRTC libraries *before* cudarc
//!   touches them (cudarc's dynamic loading panics when a library is
//!   missing), so a machine without a GPU gets a typed error that says what
//!   was tried and suggests `--backend cpu`.
//! - [`gpu`]: [`Gpu`], one CUDA context and stream, the device's properties
//!   and its kernel cache.
//! - [`kernels`]: the CUDA sources of `kernels/` (embedded in the binary),
//!   compiled at run time by NVRTC for the device's architecture with
//!   `-DNMODES`, `-DRANK` and launch-shape defines, cached in memory and on
//!   disk.
//! - [`coo`]: the `coo_atomic` MTTKRP engine (the COO baseline).
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

pub mod coo;
pub mod gpu;
pub mod kernels;
pub mod probe;

pub use coo::CooAtomic;
pub use gpu::{Gpu, GpuProperties};

use cudarc::driver::DriverError;

/// Everything that can go wrong on the GPU side.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A CUDA library could not be loaded.
    #[error("no CUDA {library} library could be loaded (tried {}); install the NVIDIA driver or use --backend cpu", tried.join(", "))]
    MissingLibrary {
        library: &'static str,
        tried: Vec<String>,
    },

    /// The driver loaded but reports no device (or not this one).
    #[error("no CUDA GPU {ordinal} (the driver reports {count} device(s)); use --backend cpu")]
    NoDevice { ordinal: usize, count: usize },

    /// A driver call failed.
    #[error("CUDA {what}: {source}")]
    Driver {
        what: String,
        #[source]
        source: DriverError,
    },

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

    /// Operands of the wrong shape.
    #[error("shape mismatch: {0}")]
    Shape(String),
}

pub type Result<T, E = DeviceError> = std::result::Result<T, E>;

/// Wraps a driver error with what was being done.
pub(crate) fn driver(what: impl Into<String>) -> impl FnOnce(DriverError) -> DeviceError {
    let what = what.into();
    move |source| DeviceError::Driver { what, source }
}
