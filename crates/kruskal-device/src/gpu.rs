//! One GPU: its context, a stream, its properties and its kernel cache.

use std::sync::Arc;

use cudarc::driver::sys::cudaError_enum;
use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DeviceRepr, DriverError, PushKernelArg,
    ValidAsZeroBits,
};

use crate::kernels::{Kernel, KernelCache};
use crate::probe::{NvrtcCheck, check_driver};
use crate::{DeviceError, Result, driver};

/// Words per pinned staging buffer of [`Gpu::upload_staged`] (16 MiB);
/// uploads of at most this many words in all are plain copies.
pub const STAGE_WORDS: usize = 4 << 20;

/// Bytes per page-locked piece of [`Gpu::upload_registered`], a multiple
/// of every page size: registering and unregistering cost about the same
/// per byte from 16 MiB pieces to one piece, and a piece is copied while
/// the next is registered.
const REGISTER_PIECE: usize = 16 << 20;

/// The pieces `[at, next)` that [`Gpu::upload_registered`] registers of
/// the host bytes `[start, end)`: cut at [`REGISTER_PIECE`] boundaries of
/// the address space, so pieces of one array share no page.
fn register_pieces(start: usize, end: usize) -> impl Iterator<Item = (usize, usize)> {
    let piece = move |at: usize| (at, ((at / REGISTER_PIECE + 1) * REGISTER_PIECE).min(end));
    std::iter::successors((start < end).then(|| piece(start)), move |&(_, next)| {
        (next < end).then(|| piece(next))
    })
}

/// Host memory page-locked by [`Gpu::upload_registered`] (piece start
/// addresses), unregistered on drop. It may be dropped on any thread once
/// the copies reading it have completed, which `upload_registered`
/// ensures before returning it. The pieces are registered as portable, so
/// every context may copy from them.
#[derive(Debug, Default)]
pub(crate) struct Registered {
    /// The context the pieces were registered in (none when no piece was).
    ctx: Option<Arc<CudaContext>>,
    pieces: Vec<usize>,
    /// (start address, bytes) of each array registered whole.
    spans: Vec<(usize, usize)>,
}

impl Registered {
    /// Whether exactly `parts`, in this order, were registered whole.
    pub(crate) fn covers(&self, parts: &[&[u32]]) -> bool {
        self.spans.len() == parts.len()
            && parts
                .iter()
                .zip(&self.spans)
                .all(|(p, &s)| (p.as_ptr() as usize, std::mem::size_of_val(*p)) == s)
    }

    /// Pieces registered.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.pieces.len()
    }

    /// Whether no piece is registered.
    pub(crate) fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        // Unregistering needs the context current on this thread.
        if let Some(ctx) = &self.ctx
            && ctx.bind_to_thread().is_err()
        {
            return;
        }
        for &p in &self.pieces {
            // SAFETY: p starts a piece registered by upload_registered and
            // not yet unregistered; no copy reads it any more. A failure
            // leaves the page locked, which only costs memory until exit.
            let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(p as *mut std::ffi::c_void) };
        }
    }
}

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

/// The GPUs the NVIDIA driver lists in `/proc/driver/nvidia/gpus` (one
/// directory each); `None` where it lists none, there is no listing, or
/// `CUDA_VISIBLE_DEVICES` is set.
fn listed_by_driver() -> Option<usize> {
    if std::env::var_os("CUDA_VISIBLE_DEVICES").is_some() {
        return None;
    }
    let n = std::fs::read_dir("/proc/driver/nvidia/gpus").ok()?.count();
    (n > 0).then_some(n)
}

impl Gpu {
    /// Number of CUDA devices (an error if the driver or NVRTC cannot be
    /// loaded).
    pub fn count() -> Result<usize> {
        let nvrtc = NvrtcCheck::start();
        let n = Self::driver_count();
        let checked = nvrtc.wait();
        let n = n?;
        checked?;
        Ok(n)
    }

    /// Number of CUDA devices, from the NVIDIA driver's listing under
    /// `/proc/driver/nvidia/gpus` where it lists at least one and
    /// `CUDA_VISIBLE_DEVICES` is not set (which CUDA applies and the
    /// listing does not); else [`Gpu::count`]. Either way the driver and
    /// NVRTC libraries are checked to load, but the listing does not start
    /// the driver (`cuInit`, about 0.1 s), which a run then does beside
    /// reading its tensor instead of before it. Where CUDA sees fewer
    /// devices than the listing (a GPU split into MIG instances), opening
    /// an ordinal past them is the error instead.
    pub fn count_listed() -> Result<usize> {
        match listed_by_driver() {
            Some(n) => {
                let nvrtc = NvrtcCheck::start();
                let driver = check_driver();
                let checked = nvrtc.wait();
                driver?;
                checked?;
                Ok(n)
            }
            None => Self::count(),
        }
    }

    /// Number of CUDA devices, checking only the driver.
    fn driver_count() -> Result<usize> {
        check_driver()?;
        match CudaContext::device_count() {
            Ok(n) => Ok(n.max(0) as usize),
            // The driver's start says so when none is visible (e.g.
            // `CUDA_VISIBLE_DEVICES` set empty): no GPU, not a failure.
            Err(e) if e.0 == cudaError_enum::CUDA_ERROR_NO_DEVICE => Ok(0),
            Err(e) => Err(driver("counting devices")(e)),
        }
    }

    /// Opens device `ordinal`. Never panics: a missing driver, NVRTC or
    /// device is a [`DeviceError`]. NVRTC is checked while the driver
    /// starts.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        let nvrtc = NvrtcCheck::start();
        let count = Self::driver_count()?;
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
        // The first stream-ordered allocation sets up the device's memory
        // pool: 9-13 ms on an H100, against 0.4 ms for 187 MB after it.
        // Paying it here moves it out of the first upload into opening,
        // which `kruskal cpd` overlaps with reading the file.
        let first = stream
            .alloc_zeros::<u32>(1)
            .map_err(driver("setting up the device's memory pool"))?;
        drop(first);
        stream
            .synchronize()
            .map_err(driver("setting up the device's memory pool"))?;
        nvrtc.wait()?;
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

    /// Turns a failed allocation into [`DeviceError::OutOfMemory`] when the
    /// driver says memory ran out (another process may have taken it after
    /// [`Gpu::ensure_free`]), else into a driver error.
    pub(crate) fn allocation_error(
        &self,
        what: &str,
        needed: usize,
        e: DriverError,
    ) -> DeviceError {
        if e.0 == cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            DeviceError::OutOfMemory {
                what: what.to_string(),
                needed,
                free: self.free_bytes().unwrap_or(0),
            }
        } else {
            DeviceError::Driver {
                what: format!("allocating {what}"),
                error: e,
            }
        }
    }

    /// `n` zeroed values of `T` on the device (at least one: the driver
    /// refuses empty allocations), checked against free memory first.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        what: &str,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        let needed = n.max(1) * std::mem::size_of::<T>();
        self.ensure_free(what, needed)?;
        self.stream
            .alloc_zeros::<T>(n.max(1))
            .map_err(|e| self.allocation_error(what, needed, e))
    }

    /// A device copy of `host` (a one-element zero buffer stands in for an
    /// empty slice), checked against free memory first.
    pub fn upload<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        what: &str,
        host: &[T],
    ) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            return self.alloc_zeros(what, 1);
        }
        let needed = std::mem::size_of_val(host);
        self.ensure_free(what, needed)?;
        self.stream
            .clone_htod(host)
            .map_err(|e| self.allocation_error(what, needed, e))
    }

    /// Device copies of `parts` (arrays of 4-byte words), checked against
    /// free memory first. Above [`STAGE_WORDS`] words in all, the host
    /// arrays are page-locked where they lie ([`Gpu::upload_registered`]),
    /// so the copies run at the bus's pinned speed without a host-side
    /// copy; if the driver refuses that, the words go through pinned
    /// staging buffers ([`Gpu::upload_through_staging`]).
    pub fn upload_staged(&self, what: &str, parts: &[&[u32]]) -> Result<Vec<CudaSlice<u32>>> {
        let (out, locked) = self.upload_locked(what, parts)?;
        drop(locked);
        Ok(out)
    }

    /// [`Gpu::upload_staged`], leaving the host arrays page-locked until
    /// the returned [`Registered`] drops. Unlocking 187 MB takes about
    /// 4 ms and holds up the driver's other calls meanwhile, so a caller
    /// that owns the arrays keeps the guard with them (the COO of the
    /// F-COO build keeps it with the tensor). The copies have completed
    /// when this returns.
    pub(crate) fn upload_locked(
        &self,
        what: &str,
        parts: &[&[u32]],
    ) -> Result<(Vec<CudaSlice<u32>>, Registered)> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total <= STAGE_WORDS {
            let out = parts
                .iter()
                .map(|p| self.upload(what, p))
                .collect::<Result<_>>()?;
            return Ok((out, Registered::default()));
        }
        self.ensure_free(what, 4 * total)?;
        match self.upload_registered(what, parts)? {
            Some(done) => Ok(done),
            None => Ok((
                self.upload_through_staging(what, parts)?,
                Registered::default(),
            )),
        }
    }

    /// Device copies of `parts`, each host array page-locked in place
    /// (`cuMemHostRegister`) piece by piece while the previous piece is
    /// copied: registering costs about a twentieth of what allocating
    /// pinned memory does (6 ms against 100 ms for 187 MB on an H100
    /// host), and no host copy is made. Pieces after an array's first
    /// start at [`REGISTER_PIECE`] boundaries of the address space, so
    /// pieces of one array share no page. `None` when the driver refuses a
    /// piece (for example a page two arrays share): the caller copies
    /// another way.
    pub(crate) fn upload_registered(
        &self,
        what: &str,
        parts: &[&[u32]],
    ) -> Result<Option<(Vec<CudaSlice<u32>>, Registered)>> {
        let mut out = Vec::with_capacity(parts.len());
        let mut locked = Registered {
            ctx: Some(self.ctx.clone()),
            pieces: Vec::new(),
            spans: Vec::new(),
        };
        let mut copy_all = || -> Result<bool> {
            for part in parts {
                let mut dst = self.alloc_zeros::<u32>(what, part.len())?;
                let (base, guard) =
                    cudarc::driver::DevicePtrMut::device_ptr_mut(&mut dst, &self.stream);
                let start = part.as_ptr() as usize;
                let end = start + std::mem::size_of_val(*part);
                for (at, next) in register_pieces(start, end) {
                    // SAFETY: [at, next) lies inside `part`, which outlives
                    // the registration: `Registered` unregisters it on drop,
                    // and the caller drops it before the arrays it borrows
                    // from. Pieces of one array do not overlap.
                    let rc = unsafe {
                        cudarc::driver::sys::cuMemHostRegister_v2(
                            at as *mut std::ffi::c_void,
                            next - at,
                            cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE,
                        )
                    };
                    if rc != cudaError_enum::CUDA_SUCCESS {
                        return Ok(false);
                    }
                    locked.pieces.push(at);
                    // SAFETY: the piece is page-locked host memory inside
                    // `part`, and `dst` holds part.len() words; it stays
                    // registered and alive until the stream is synchronized
                    // below.
                    unsafe { self.copy_piece(what, base, start, (at, next)) }?;
                }
                drop(guard);
                locked.spans.push((start, end - start));
                out.push(dst);
            }
            Ok(true)
        };
        let copied = copy_all();
        // The copies in flight read the registered pieces: wait for them
        // before anything is unregistered, on every path.
        let synced = self
            .stream
            .synchronize()
            .map_err(driver(format!("copying {what}")));
        match (copied?, synced) {
            (true, Ok(())) => Ok(Some((out, locked))),
            (false, Ok(())) => Ok(None),
            (_, Err(e)) => Err(e),
        }
    }

    /// Device copies of `parts`, which `locked` holds page-locked whole
    /// (an earlier [`Gpu::upload_registered`] of the same arrays, still
    /// registered): plain copies at the bus's pinned speed. The copies
    /// have completed when this returns.
    pub(crate) fn upload_registered_again(
        &self,
        what: &str,
        parts: &[&[u32]],
        locked: &Registered,
    ) -> Result<Vec<CudaSlice<u32>>> {
        assert!(locked.covers(parts), "the arrays must be registered whole");
        let mut out = Vec::with_capacity(parts.len());
        for part in parts {
            let mut dst = self.alloc_zeros::<u32>(what, part.len())?;
            let (base, guard) =
                cudarc::driver::DevicePtrMut::device_ptr_mut(&mut dst, &self.stream);
            let start = part.as_ptr() as usize;
            // One copy per registered piece: the driver refuses a copy
            // that spans two registrations.
            for (at, next) in register_pieces(start, start + std::mem::size_of_val(*part)) {
                // SAFETY: [at, next) is one page-locked piece of `part`
                // (`locked` covers it and outlives this call), and `dst`
                // holds part.len() words; the stream is synchronized
                // below, before `part` can go.
                unsafe { self.copy_piece(what, base, start, (at, next)) }?;
            }
            drop(guard);
            out.push(dst);
        }
        self.stream
            .synchronize()
            .map_err(driver(format!("copying {what}")))?;
        Ok(out)
    }

    /// Queues the copy of the host bytes `[at, next)` of an array starting
    /// at `start` to the same offset of the device buffer at `base`.
    ///
    /// # Safety
    /// `[at, next)` must be page-locked host memory, and the buffer at
    /// `base` must hold `next - start` bytes; both must stay so until the
    /// stream is synchronized.
    unsafe fn copy_piece(
        &self,
        what: &str,
        base: u64,
        start: usize,
        (at, next): (usize, usize),
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                base + (at - start) as u64,
                at as *const std::ffi::c_void,
                next - at,
                self.stream.cu_stream(),
            )
        }
        .result()
        .map_err(driver(format!("copying {what}")))
    }

    /// An event that marks a staged copy's completion (no timing).
    fn copy_event(&self) -> Result<CudaEvent> {
        self.ctx
            .new_event(None)
            .map_err(driver("creating an event"))
    }

    /// Device copies of `parts` through two pinned staging buffers in turn:
    /// the host's threads fill one while the other is copied.
    pub(crate) fn upload_through_staging(
        &self,
        what: &str,
        parts: &[&[u32]],
    ) -> Result<Vec<CudaSlice<u32>>> {
        use rayon::prelude::*;
        let mut out = parts
            .iter()
            .map(|p| self.alloc_zeros::<u32>(what, p.len()))
            .collect::<Result<Vec<_>>>()?;
        let pinned = || -> Result<cudarc::driver::PinnedHostSlice<u32>> {
            // SAFETY: page-locked host memory of STAGE_WORDS words, only
            // read and written through the slice below; cudarc frees it on
            // drop.
            unsafe { self.ctx.alloc_pinned::<u32>(STAGE_WORDS) }
                .map_err(driver("allocating a staging buffer"))
        };
        let mut staging = [pinned()?, pinned()?];
        let copied = [self.copy_event()?, self.copy_event()?];
        let mut turn = 0usize;
        for (part, dst) in parts.iter().zip(&mut out) {
            for (c, chunk) in part.chunks(STAGE_WORDS).enumerate() {
                let b = turn % 2;
                turn += 1;
                // The buffer's previous copy has finished.
                copied[b]
                    .synchronize()
                    .map_err(driver("waiting for a staged copy"))?;
                let buf = staging[b]
                    .as_mut_slice()
                    .map_err(driver("reaching a staging buffer"))?;
                let buf = &mut buf[..chunk.len()];
                buf.par_chunks_mut(1 << 16)
                    .zip(chunk.par_chunks(1 << 16))
                    .for_each(|(d, s)| d.copy_from_slice(s));
                let (base, guard) = cudarc::driver::DevicePtrMut::device_ptr_mut(dst, &self.stream);
                let at = base + (4 * c * STAGE_WORDS) as u64;
                // SAFETY: `dst` holds part.len() words and chunk c covers
                // words c * STAGE_WORDS .. + chunk.len() of it, so the copy
                // writes inside `dst`; it reads `buf`, pinned memory that is
                // not written again before `copied[b]`, recorded right
                // after the copy on the same stream, has completed, and
                // that outlives the copies (the stream is synchronized
                // before the buffers drop).
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(at, buf, self.stream.cu_stream())
                }
                .map_err(driver(format!("copying {what}")))?;
                drop(guard);
                copied[b]
                    .record(&self.stream)
                    .map_err(driver("recording an event"))?;
            }
        }
        self.stream
            .synchronize()
            .map_err(driver(format!("copying {what}")))?;
        Ok(out)
    }

    /// Copies `src` to the host piece by piece and hands each piece to
    /// `sink` (its index in `pieces` and its floats), in order. `pieces`
    /// are `(first float, floats)` ranges of `src`, each at most
    /// [`STAGE_WORDS`] floats. Above [`STAGE_WORDS`] floats in all, the
    /// copies go through two page-locked staging buffers in turn, so the
    /// bus copies one piece while `sink` (the host's threads) takes the
    /// other: a plain copy of gigabytes into fresh pageable memory runs at
    /// a fraction of the bus's speed and leaves the host's copy after it.
    pub fn download_through_staging(
        &self,
        what: &str,
        src: &CudaSlice<f32>,
        pieces: &[(usize, usize)],
        sink: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<()> {
        if let Some(&(first, len)) = pieces
            .iter()
            .find(|&&(first, len)| len > STAGE_WORDS || first + len > src.len())
        {
            return Err(DeviceError::Shape(format!(
                "a piece of {len} floats from float {first} of {} (at most {STAGE_WORDS} a piece)",
                src.len()
            )));
        }
        let total: usize = pieces.iter().map(|p| p.1).sum();
        if total <= STAGE_WORDS {
            let host = self
                .stream
                .clone_dtoh(src)
                .map_err(driver(format!("downloading {what}")))?;
            for (i, &(first, len)) in pieces.iter().enumerate() {
                sink(i, &host[first..first + len]);
            }
            return Ok(());
        }
        let pinned = || -> Result<cudarc::driver::PinnedHostSlice<f32>> {
            // SAFETY: page-locked host memory of STAGE_WORDS floats, only
            // reached through the slices below after the copies into it
            // have completed; cudarc frees it on drop. Not write-combined:
            // the host reads it.
            unsafe { self.ctx.alloc_pinned_with_flags::<f32>(STAGE_WORDS, 0) }
                .map_err(driver("allocating a staging buffer"))
        };
        let mut staging = [pinned()?, pinned()?];
        let copied = [self.copy_event()?, self.copy_event()?];
        let [a, b] = &mut staging;
        let bufs = [
            a.as_mut_slice()
                .map_err(driver("reaching a staging buffer"))?,
            b.as_mut_slice()
                .map_err(driver("reaching a staging buffer"))?,
        ];
        let (base, guard) = cudarc::driver::DevicePtr::device_ptr(src, &self.stream);
        let stream = self.stream.cu_stream();
        let issue = |i: usize, buf: &mut [f32]| -> Result<()> {
            let (first, len) = pieces[i];
            // SAFETY: floats [first, first + len) lie inside `src` (checked
            // above), which outlives the copies (the stream is synchronized
            // before this returns); `buf[..len]` is page-locked memory not
            // touched again until `copied` of its turn has completed.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut buf[..len],
                    base + (4 * first) as u64,
                    stream,
                )
            }
            .map_err(driver(format!("downloading {what}")))?;
            copied[i % 2]
                .record(&self.stream)
                .map_err(driver("recording an event"))
        };
        let mut result = issue(0, bufs[0]);
        for i in 0..pieces.len() {
            if result.is_err() {
                break;
            }
            // The other buffer's piece (i - 1) was handed over in the last
            // turn: it may take the next copy while this piece is read.
            if i + 1 < pieces.len() {
                result = issue(i + 1, bufs[(i + 1) % 2]);
                if result.is_err() {
                    break;
                }
            }
            result = copied[i % 2]
                .synchronize()
                .map_err(driver(format!("downloading {what}")));
            if result.is_ok() {
                sink(i, &bufs[i % 2][..pieces[i].1]);
            }
        }
        // Copies still in flight write the staging buffers: wait for them
        // before the buffers can drop, on every path.
        let synced = self
            .stream
            .synchronize()
            .map_err(driver(format!("downloading {what}")));
        drop(guard);
        result.and(synced)
    }

    /// Device-to-device copy bandwidth in bytes per second (bytes read plus
    /// bytes written), the median of 5 timed copies of a 256 MiB buffer
    /// (smaller when memory is short) after a warm-up: the denominator of
    /// the bandwidth floor.
    pub fn copy_bandwidth(&self) -> Result<f64> {
        let free = self.free_bytes()?;
        let bytes = (256usize << 20).min(free / 4).max(1 << 20);
        let n = bytes / 4;
        let src = self.alloc_zeros::<u32>("the bandwidth probe", n)?;
        let mut dst = self.alloc_zeros::<u32>("the bandwidth probe", n)?;
        let (start, end) = (self.timing_event()?, self.timing_event()?);
        let mut ms = Vec::new();
        for run in 0..6 {
            start
                .record(&self.stream)
                .map_err(driver("recording an event"))?;
            self.stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(driver("copying on the device"))?;
            end.record(&self.stream)
                .map_err(driver("recording an event"))?;
            end.synchronize().map_err(driver("waiting for a copy"))?;
            if run > 0 {
                ms.push(start.elapsed_ms(&end).map_err(driver("reading an event"))?);
            }
        }
        ms.sort_by(f32::total_cmp);
        let median_s = f64::from(ms[ms.len() / 2]) * 1e-3;
        Ok(2.0 * (n * 4) as f64 / median_s)
    }

    /// The bandwidth (bytes per second) of gathering factor-like rows of
    /// `rank` f32 from L2: kernel `l2_gather` of `kernels/probe.cu` on a
    /// buffer of at most a quarter of L2 (so it stays resident), loads that
    /// bypass L1, one warm-up launch, then the median of 5 timed launches.
    pub fn l2_gather_bandwidth(&self, rank: usize) -> Result<f64> {
        let rank = rank.max(1);
        let row_bytes = rank * 4;
        let budget = (self.props.l2_bytes / 4).max(row_bytes * 64);
        // The largest power of two of rows within the budget.
        let rows = 1usize << (usize::BITS - 1 - (budget / row_bytes).leading_zeros());
        let buf = self.alloc_zeros::<f32>("the L2 probe", rows * rank)?;
        const THREADS: u32 = 256;
        const ITERS: u32 = 2048;
        let blocks = (self.props.sms as u32 * 8).max(1);
        let mut out = self.alloc_zeros::<f32>("the L2 probe", (blocks * THREADS) as usize)?;
        let f = self
            .kernels()
            .function(&self.ctx, Kernel::L2Gather, &[("RANK", rank as i64)])?;
        let (start, end) = (self.timing_event()?, self.timing_event()?);
        let rows_u32 = rows as u32;
        let mut ms = Vec::new();
        for run in 0..6 {
            start
                .record(&self.stream)
                .map_err(driver("recording an event"))?;
            let mut launch = self.stream.launch_builder(&f);
            launch.arg(&buf).arg(&rows_u32).arg(&ITERS).arg(&mut out);
            // SAFETY: row numbers are masked below `rows` (a power of two)
            // and columns guarded below RANK, so every load lies in `buf`
            // (rows x rank floats); thread t of the grid writes out[t], and
            // `out` holds blocks x THREADS floats.
            unsafe {
                launch.launch(cudarc::driver::LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(driver("launching l2_gather"))?;
            end.record(&self.stream)
                .map_err(driver("recording an event"))?;
            end.synchronize().map_err(driver("waiting for the probe"))?;
            if run > 0 {
                ms.push(start.elapsed_ms(&end).map_err(driver("reading an event"))?);
            }
        }
        ms.sort_by(f32::total_cmp);
        let median_s = f64::from(ms[ms.len() / 2]) * 1e-3;
        let warps = u64::from(blocks * THREADS / 32);
        Ok((warps * u64::from(ITERS) * row_bytes as u64) as f64 / median_s)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listed_count_is_the_drivers() {
        // A machine without the driver (CI): both the same error; with a
        // GPU: the listing's count is CUDA's.
        let counted = Gpu::count().map_err(|e| e.to_string());
        let listed = Gpu::count_listed().map_err(|e| e.to_string());
        assert_eq!(listed, counted);
        if listed_by_driver().is_some() {
            assert!(counted.is_ok_and(|n| n > 0));
        }
    }

    #[test]
    fn register_pieces_cut_at_piece_boundaries_and_cover_the_range() {
        let p = REGISTER_PIECE;
        assert_eq!(register_pieces(5, 5).count(), 0);
        assert_eq!(register_pieces(8, 100).collect::<Vec<_>>(), vec![(8, 100)]);
        assert_eq!(
            register_pieces(p - 4, 2 * p + 12).collect::<Vec<_>>(),
            vec![(p - 4, p), (p, 2 * p), (2 * p, 2 * p + 12)]
        );
        assert_eq!(
            register_pieces(p, 2 * p).collect::<Vec<_>>(),
            vec![(p, 2 * p)]
        );
    }

    #[test]
    fn staged_uploads_arrive_whole_and_in_order() {
        let Some(gpu) = crate::testing::gpu_or_skip("staged_uploads_arrive_whole_and_in_order")
        else {
            return;
        };
        // Above the staging threshold: a part of several buffers with a
        // short last chunk, one of exactly one buffer, an empty one and a
        // short one, so buffers are reused across parts.
        let lens = [STAGE_WORDS * 2 + 12_345, STAGE_WORDS, 0, 7];
        let parts: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(p, &len)| {
                (0..len as u32)
                    .map(|k| k.wrapping_mul(2_654_435_761) ^ p as u32)
                    .collect()
            })
            .collect();
        let views: Vec<&[u32]> = parts.iter().map(Vec::as_slice).collect();
        let check = |dev: Vec<CudaSlice<u32>>| {
            assert_eq!(dev.len(), parts.len());
            for (d, h) in dev.iter().zip(&parts) {
                let back = gpu.stream().clone_dtoh(d).unwrap();
                // An empty part is a one-word zero buffer, as `upload` makes.
                assert_eq!(&back[..h.len()], &h[..]);
                assert_eq!(back.len(), h.len().max(1));
            }
        };
        check(gpu.upload_staged("a staged test", &views).unwrap());
        // Both ways, whichever upload_staged took: the arrays registered in
        // place (in several pieces: the first part spans 32 MiB) and the
        // pinned staging buffers.
        let (dev, locked) = gpu
            .upload_registered("a registered test", &views)
            .unwrap()
            .expect("the driver registers ordinary heap memory");
        assert!(locked.pieces.len() > 2, "{} pieces", locked.pieces.len());
        drop(locked);
        check(dev);
        check(gpu.upload_through_staging("a staged test", &views).unwrap());
    }

    #[test]
    fn too_large_an_allocation_is_a_typed_error_and_the_gpu_stays_usable() {
        let Some(gpu) = crate::testing::gpu_or_skip(
            "too_large_an_allocation_is_a_typed_error_and_the_gpu_stays_usable",
        ) else {
            return;
        };
        let p = gpu.properties();
        assert!(p.sms > 0 && p.total_bytes > 0 && !p.name.is_empty());
        let free = gpu.free_bytes().unwrap();
        match gpu.alloc_zeros::<u8>("a test buffer", free + (1 << 30)) {
            Err(DeviceError::OutOfMemory {
                needed, free: f, ..
            }) => {
                assert_eq!(needed, free + (1 << 30));
                assert!(f <= p.total_bytes);
            }
            Err(e) => panic!("expected OutOfMemory, got {e}"),
            Ok(_) => panic!("allocated more than is free"),
        }
        // Small work still runs afterwards.
        let host: Vec<u32> = (0..1000).collect();
        let dev = gpu.upload("a test buffer", &host).unwrap();
        assert_eq!(gpu.stream().clone_dtoh(&dev).unwrap(), host);
        let bw = gpu.copy_bandwidth().unwrap();
        assert!(bw > 1e11, "copy bandwidth {bw} bytes/s");
        // Rows gathered from L2 come faster than DRAM copies (rows of at
        // least two 32-byte sectors; narrower rows waste most of each
        // sector they read, and so do the engines' gathers of them).
        for rank in [16, 32, 100] {
            let l2 = gpu.l2_gather_bandwidth(rank).unwrap();
            assert!(l2 > bw, "rank {rank}: L2 gathers {l2} <= copy {bw} bytes/s");
        }
    }
}
