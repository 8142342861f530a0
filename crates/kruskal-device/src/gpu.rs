//! One GPU: its context, a stream, its properties and its kernel cache.

use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use crate::kernels::KernelCache;
use crate::probe::check_libraries;
use crate::{DeviceError, Result, driver};

/// What `kruskal info --gpu` shows, and what launch shapes are planned from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuProperties {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    pub sms: usize,
    pub total_bytes: usize,
    pub free_bytes: usize,
    pub l2_bytes: usize,
    /// Shared memory a block may use by default.
    pub shared_per_block: usize,
    /// Shared memory a block may use when it opts in.
    pub shared_per_block_optin: usize,
    pub max_threads_per_block: usize,
    /// The driver's CUDA version, e.g. 13000.
    pub driver_version: i32,
}

impl GpuProperties {
    /// NVRTC's name of the architecture, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }
}

/// A GPU ready for kernels.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    props: GpuProperties,
    kernels: KernelCache,
}

impl Gpu {
    /// Number of CUDA devices (an error if the driver cannot be loaded).
    pub fn count() -> Result<usize> {
        check_libraries()?;
        let n = CudaContext::device_count().map_err(driver("counting devices"))?;
        Ok(n.max(0) as usize)
    }

    /// Opens device `ordinal`. Never panics: a missing driver, NVRTC or
    /// device is a [`DeviceError`].
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        let count = Self::count()?;
        if ordinal >= count {
            return Err(DeviceError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(driver(format!("opening device {ordinal}")))?;
        let stream = ctx.default_stream();
        let attr = |a: CUdevice_attribute| -> Result<usize> {
            ctx.attribute(a)
                .map(|v| v.max(0) as usize)
                .map_err(driver(format!("reading attribute {a:?}")))
        };
        let (free_bytes, total_bytes) =
            ctx.mem_get_info().map_err(driver("reading free memory"))?;
        let driver_version = driver_version()?;
        let props = GpuProperties {
            ordinal,
            name: ctx.name().map_err(driver("reading the device name"))?,
            compute_capability: ctx
                .compute_capability()
                .map_err(driver("reading the compute capability"))?,
            sms: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            total_bytes,
            free_bytes,
            l2_bytes: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
            shared_per_block: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
            )?,
            shared_per_block_optin: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )?,
            max_threads_per_block: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
            )?,
            driver_version,
        };
        let kernels = KernelCache::new(props.arch(), props.driver_version);
        Ok(Arc::new(Gpu {
            ctx,
            stream,
            props,
            kernels,
        }))
    }

    pub fn properties(&self) -> &GpuProperties {
        &self.props
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn kernels(&self) -> &KernelCache {
        &self.kernels
    }

    /// Free device memory now, in bytes.
    pub fn free_bytes(&self) -> Result<usize> {
        self.ctx
            .mem_get_info()
            .map(|(free, _)| free)
            .map_err(driver("reading free memory"))
    }

    /// Errors with [`DeviceError::OutOfMemory`] unless `needed` bytes are
    /// free (checked before allocating, so a big upload fails cleanly).
    pub fn ensure_free(&self, what: &str, needed: usize) -> Result<()> {
        let free = self.free_bytes()?;
        if needed > free {
            return Err(DeviceError::OutOfMemory {
                what: what.to_string(),
                needed,
                free,
            });
        }
        Ok(())
    }

    /// An event that can time (`CU_EVENT_DEFAULT`; the default flags of
    /// cudarc disable timing).
    pub fn timing_event(&self) -> Result<CudaEvent> {
        self.ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver("creating an event"))
    }
}

/// The CUDA version the driver supports (e.g. 13000).
fn driver_version() -> Result<i32> {
    let mut version: std::ffi::c_int = 0;
    // SAFETY: the driver library was loaded (checked by `count`), and the
    // call writes one int through a valid pointer.
    let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
    status
        .result()
        .map_err(driver("reading the driver version"))?;
    Ok(version)
}
