//! This process's GPU in a group of several processes, one GPU each
//! (possibly on several hosts): the NCCL communicator across them,
//! all-reduces of host vectors through it, and aborting it from another
//! thread when a peer is lost.
//!
//! The processes meet through the `kruskal-launch` crate, which hands
//! every rank the bytes of rank 0's NCCL unique id; [`ProcessComm::init`]
//! turns them into a communicator. A [`GpuGroup`](crate::GpuGroup) made with
//! [`GpuGroup::distributed`](crate::GpuGroup::distributed) then exchanges
//! factor rows through it and all-reduces its Grams and column statistics.
//!
//! Every wait polls: it ends when the work is done, when the communicator
//! was aborted ([`CommAbort::abort`], e.g. from a membership loss
//! callback), or at the timeout. An aborted communicator is never
//! destroyed (NCCL frees it in the abort), and a destroyed one is never
//! aborted: one flag decides which of the two happens.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};

use crate::nccl::{Comm, Nccl, Reduce, UNIQUE_ID_BYTES};
use kruskal_device::{DeviceError, Gpu, Result, driver};

/// The communicator and whoever may abort it.
struct Shared {
    nccl: &'static Nccl,
    comm: Comm,
    /// Set once, by the first of abort and close.
    ended: AtomicBool,
    /// Why it was aborted.
    reason: Mutex<Option<String>>,
}

impl Shared {
    fn aborted(&self) -> Option<String> {
        self.reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// Aborts a [`ProcessComm`]'s communicator from any thread.
#[derive(Clone)]
pub struct CommAbort(Arc<Shared>);

impl CommAbort {
    /// Aborts the communicator: collectives in flight on any rank return,
    /// and every later wait of this process fails with `reason`. Does
    /// nothing after the first call or after the communicator was closed.
    pub fn abort(&self, reason: &str) {
        let mut slot = self
            .0
            .reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.0.ended.swap(true, Ordering::SeqCst) {
            return;
        }
        *slot = Some(reason.to_string());
        drop(slot);
        let _ = self.0.nccl.abort(&self.0.comm);
    }

    /// Why it was aborted, once it was.
    pub fn reason(&self) -> Option<String> {
        self.0.aborted()
    }
}

/// This process's member of a multi-process NCCL communicator.
pub struct ProcessComm {
    gpu: Arc<Gpu>,
    shared: Arc<Shared>,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// The buffers of the small all-reduces (statistics and Grams, a few
    /// lengths, every mode of every iteration), kept between calls.
    staging: Mutex<Vec<Staging>>,
}

/// Device and page-locked host memory of one all-reduce length.
struct Staging {
    device: CudaSlice<f64>,
    host: PinnedHostSlice<f64>,
}

/// All-reduces of at most this many values keep their buffers.
const KEEP_STAGING: usize = 8192;

impl ProcessComm {
    /// Joins the communicator of `world` processes whose rank 0 made `id`,
    /// as rank `rank`, on `gpu`. Blocks until every rank has joined (NCCL
    /// gives no timeout here; a launcher that loses a peer meanwhile must
    /// end the process). `timeout` bounds every later wait.
    pub fn init(
        gpu: Arc<Gpu>,
        id: &[u8],
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let id: &[u8; UNIQUE_ID_BYTES] = id.try_into().map_err(|_| {
            DeviceError::Nccl(format!(
                "a unique id has {UNIQUE_ID_BYTES} bytes, rank 0 sent {}",
                id.len()
            ))
        })?;
        if rank >= world {
            return Err(DeviceError::Shape(format!(
                "rank {rank} of a world of {world}"
            )));
        }
        let nccl = Nccl::load().map_err(|e| DeviceError::Nccl(e.to_string()))?;
        gpu.context()
            .bind_to_thread()
            .map_err(driver("binding the GPU's context"))?;
        let comm = nccl
            .comm_init_rank(world, id, rank)
            .map_err(|e| DeviceError::Nccl(e.to_string()))?;
        Ok(ProcessComm {
            gpu,
            shared: Arc::new(Shared {
                nccl,
                comm,
                ended: AtomicBool::new(false),
                reason: Mutex::new(None),
            }),
            rank,
            world,
            timeout,
            staging: Mutex::new(Vec::new()),
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A handle that aborts the communicator from another thread.
    pub fn abort_handle(&self) -> CommAbort {
        CommAbort(self.shared.clone())
    }

    /// Why the communicator was aborted, once it was.
    pub fn aborted(&self) -> Option<String> {
        self.shared.aborted()
    }

    pub(crate) fn nccl(&self) -> &'static Nccl {
        self.shared.nccl
    }

    pub(crate) fn comm(&self) -> &Comm {
        &self.shared.comm
    }

    /// Replaces `data` by its reduction `op` over every rank (every rank
    /// calls this with the same length, in the same order). The values go
    /// through page-locked host memory and this GPU's memory: the copies
    /// and the collective are queued together and waited for once. The
    /// buffers of short lengths are kept for the next call.
    pub fn all_reduce(&self, data: &mut [f64], op: Reduce) -> Result<()> {
        let n = data.len();
        if n == 0 {
            return Ok(());
        }
        self.check()?;
        let stream = self.gpu.stream().clone();
        let mut cache = self
            .staging
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = match cache.iter().position(|s| s.device.len() == n) {
            Some(at) => at,
            None => {
                let device = self.gpu.alloc_zeros::<f64>("an all-reduce buffer", n)?;
                // SAFETY: every element is written below before it is read.
                let host = unsafe { self.gpu.context().alloc_pinned::<f64>(n) }
                    .map_err(driver("pinning an all-reduce buffer"))?;
                cache.push(Staging { device, host });
                cache.len() - 1
            }
        };
        let result = self.all_reduce_in(&mut cache[at], data, op, &stream);
        if n > KEEP_STAGING || result.is_err() {
            cache.swap_remove(at);
        }
        result
    }

    /// [`ProcessComm::all_reduce`] through `buf`, whose length is `data`'s.
    fn all_reduce_in(
        &self,
        buf: &mut Staging,
        data: &mut [f64],
        op: Reduce,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        buf.host
            .as_mut_slice()
            .map_err(driver("writing an all-reduce buffer"))?
            .copy_from_slice(data);
        stream
            .memcpy_htod(&buf.host, &mut buf.device)
            .map_err(driver("uploading an all-reduce"))?;
        {
            let (ptr, _sync) = buf.device.device_ptr(stream);
            // SAFETY: `buf.device` holds `data.len()` f64 on this
            // communicator's GPU and lives until the wait below has seen
            // the stream finish (or, after an abort, is dropped from the
            // cache, by when NCCL no longer touches it).
            unsafe {
                self.shared.nccl.all_reduce_f64(
                    &self.shared.comm,
                    ptr,
                    data.len(),
                    op,
                    stream.cu_stream() as _,
                )
            }
            .map_err(|e| self.nccl_error(e))?;
        }
        stream
            .memcpy_dtoh(&buf.device, &mut buf.host)
            .map_err(driver("downloading an all-reduce"))?;
        self.wait(stream, "an all-reduce across processes")?;
        data.copy_from_slice(
            buf.host
                .as_slice()
                .map_err(driver("reading an all-reduce buffer"))?,
        );
        Ok(())
    }

    /// Waits for `stream`'s queued work, up to the timeout, giving up at
    /// once when the communicator is aborted.
    pub(crate) fn wait(&self, stream: &Arc<CudaStream>, what: &str) -> Result<()> {
        wait_polling(stream, what, self.timeout, || self.check())
    }

    /// An error once the communicator was aborted.
    pub(crate) fn check(&self) -> Result<()> {
        match self.shared.aborted() {
            Some(why) => Err(DeviceError::Aborted(why)),
            None => Ok(()),
        }
    }

    /// An NCCL error, or the abort's reason when the communicator was
    /// aborted meanwhile (the abort is what the user needs to hear).
    pub(crate) fn nccl_error(&self, e: crate::nccl::NcclError) -> DeviceError {
        match self.shared.aborted() {
            Some(why) => DeviceError::Aborted(why),
            None => DeviceError::Nccl(e.to_string()),
        }
    }

    /// Aborts the communicator (see [`CommAbort::abort`]).
    pub fn abort(&self, reason: &str) {
        self.abort_handle().abort(reason);
    }
}

/// Waits for `stream`'s queued work by polling an event, up to `timeout`;
/// `check` is asked between polls and ends the wait with its error (an
/// abort). Spins for the first 2 ms, then sleeps 50 us between polls.
pub(crate) fn wait_polling(
    stream: &Arc<CudaStream>,
    what: &str,
    timeout: Duration,
    check: impl Fn() -> Result<()>,
) -> Result<()> {
    let event = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
        .map_err(driver(format!("recording an event for {what}")))?;
    let start = Instant::now();
    loop {
        if event
            .try_is_complete()
            .map_err(driver(format!("waiting for {what}")))?
        {
            return Ok(());
        }
        check()?;
        let waited = start.elapsed();
        if waited > timeout {
            return Err(DeviceError::Timeout(format!(
                "{what} did not finish within {} s",
                timeout.as_secs()
            )));
        }
        if waited < Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Drop for ProcessComm {
    fn drop(&mut self) {
        // Destroy only a communicator nobody aborted; after an abort NCCL
        // has freed it.
        if !self.shared.ended.swap(true, Ordering::SeqCst) {
            let _ = self.shared.nccl.destroy(&self.shared.comm);
        }
    }
}
