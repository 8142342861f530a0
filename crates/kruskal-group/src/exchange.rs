//! The row exchange between the GPUs of a group: how rows travel
//! ([`Exchange`]: NCCL or peer-to-peer copies) and how that is chosen, the
//! state every worker shares ([`Shared`]: the abort flag, the
//! [`TimedBarrier`], the factor buffers' addresses, the rows each GPU
//! owns, the NCCL communicators), and each worker's part of the
//! all-gather after a mode: NCCL's grouped broadcasts, or AMPED's ring of
//! peer copies with a barrier between steps.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUresult, cudaError_enum};

use super::worker::{LeftRunning, Worker};
use crate::nccl::{Comm, Nccl};
use crate::process::ProcessComm;
use kruskal_device::{DeviceError, Gpu, Result, driver};

/// How factor rows travel between GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exchange {
    /// NCCL: a grouped in-place broadcast per owner of rows.
    Nccl,
    /// Peer-to-peer copies around the ring (one process only).
    P2p,
}

impl Exchange {
    /// The name `--exchange` spells.
    pub fn name(self) -> &'static str {
        match self {
            Exchange::Nccl => "nccl",
            Exchange::P2p => "p2p",
        }
    }
}

/// State every worker reads.
pub(super) struct Shared {
    pub(super) abort: AtomicBool,
    pub(super) barrier: TimedBarrier,
    /// Device address of each local GPU's factor buffer.
    pub(super) factor_ptrs: Mutex<Vec<u64>>,
    /// Per mode, the device address of each local GPU's MTTKRP output (0
    /// until its first MTTKRP of the mode).
    pub(super) output_ptrs: Mutex<Vec<Vec<u64>>>,
    /// Whether rows exchanged sparsely, and the partial sums of the rows
    /// read, travel by peer reads (one process, peer access between every
    /// pair; `--partial-reduce pull`) rather than by NCCL.
    pub(super) pull: bool,
    /// Each local GPU's context.
    pub(super) contexts: Vec<Arc<cudarc::driver::CudaContext>>,
    /// Per mode, per GPU of the whole group (all processes): the rows it
    /// owns.
    pub(super) rows: Vec<Vec<Range<u32>>>,
    /// Per mode and GPU: its rows that hold nonzeros, the first of `rows`
    /// (an empty row's update gives zero, so after a mode's first update
    /// its empty rows are skipped).
    pub(super) live: Vec<Vec<Range<u32>>>,
    /// First row of each mode in the concatenated factor buffer.
    pub(super) first_row: Vec<u64>,
    /// Per mode, the sparse exchange's counts (`None`: all-gathered).
    pub(super) sparse: Vec<Option<super::sparse::SparseMode>>,
    /// Per mode, whether several GPUs write its MTTKRP output rows (a
    /// split plan's partial modes): the partial sums are reduced onto the
    /// owners after the MTTKRP.
    pub(super) partial: Vec<bool>,
    /// Per mode, whether only its owners read it (a split plan's cut
    /// mode): its exchange sends nothing.
    pub(super) local: Vec<bool>,
    /// Per mode, how its partial sums reach their owners by peer copies
    /// (`None`: by NCCL's reductions, or the mode is not partial).
    pub(super) copy_reduce: Vec<Option<CopyReduce>>,
    /// `sent[h][o]`: GPU `h`'s copy of its partial sums of GPU `o`'s rows,
    /// done once this event is (recorded by `h`, waited on and taken by
    /// `o` within one MTTKRP).
    pub(super) sent: Mutex<Vec<Vec<Option<cudarc::driver::CudaEvent>>>>,
    pub(super) collective: Option<Collective>,
    pub(super) timeout: Duration,
}

/// A partial mode's reduction by peer copies (one process, peer access
/// between every pair): each GPU computes the partial MTTKRP owner by
/// owner, its own rows last, and copies each other owner's rows with
/// nonzeros into that owner's receive buffer as soon as they are summed,
/// so the copies run on the copy engines beside the rest of the MTTKRP;
/// each owner then adds the blocks it received to its own
/// (`sum_parts`).
pub(super) struct CopyReduce {
    /// Per GPU `g`, the first element of each owner's rows in `g`'s shard
    /// of the mode (`gpus + 1` offsets).
    pub(super) offsets: Vec<Vec<u64>>,
    /// Per owner, the device address of its receive buffer: a block of its
    /// rows with nonzeros per other GPU, sender `h`'s at block `h` (`h - 1`
    /// past the owner).
    pub(super) recv: Vec<u64>,
}

impl Shared {
    /// Whether the group, or the communicator across processes, stopped.
    pub(super) fn aborted(&self) -> bool {
        self.abort.load(Ordering::SeqCst)
            || matches!(&self.collective, Some(Collective::Process(p)) if p.aborted().is_some())
    }
}

/// The NCCL communicators of the exchange.
pub(super) enum Collective {
    /// One per GPU, all in this process.
    Local(&'static Nccl, Vec<Comm>),
    /// This process's one GPU in a communicator across processes.
    Process(Arc<ProcessComm>),
}

impl Collective {
    /// The library and local GPU `slot`'s communicator.
    pub(super) fn comm(&self, slot: usize) -> (&'static Nccl, &Comm) {
        match self {
            Collective::Local(nccl, comms) => (nccl, &comms[slot]),
            Collective::Process(p) => (p.nccl(), p.comm()),
        }
    }

    /// Aborts every communicator so that peers blocked in a collective
    /// return.
    pub(super) fn abort(&self, why: &str) {
        match self {
            Collective::Local(nccl, comms) => {
                for c in comms {
                    let _ = nccl.abort(c);
                }
            }
            Collective::Process(p) => p.abort(why),
        }
    }
}

/// How a group's rows travel, as [`choose`] found it.
pub(super) struct ChosenExchange {
    /// `None` with one GPU.
    pub(super) exchange: Option<Exchange>,
    /// Why the exchange is not what was asked for, or how peer access is.
    pub(super) note: Option<String>,
    pub(super) collective: Option<Collective>,
    /// Peer-to-peer copies only: whether every pair has peer access (a
    /// kernel can then read a peer's memory).
    pub(super) direct: bool,
    /// Per mode, for a partial mode reduced by peer copies: each GPU's
    /// nonzeros per owner of their rows ([`RowShards::owner_counts`]);
    /// empty or `None` otherwise.
    ///
    /// [`RowShards::owner_counts`]: kruskal_partition::RowShards::owner_counts
    pub(super) copy_reduce: Vec<Option<Vec<u64>>>,
    /// Rows read travel by peer reads (see [`Shared::pull`]).
    pub(super) pull: bool,
}

/// The exchange of a group of `gpus` (opened from `ordinals`) in one
/// process: none with one GPU; peer-to-peer copies when `want` says so;
/// otherwise NCCL's communicators when NCCL loads, else (unless NCCL was
/// asked for, which is then an error) peer-to-peer copies with a note
/// saying why. Peer access is enabled for peer-to-peer copies, and the
/// note says whether every pair has it.
pub(super) fn choose(
    ordinals: &[usize],
    gpus: &[Arc<Gpu>],
    want: Option<Exchange>,
) -> Result<ChosenExchange> {
    let (exchange, exchange_note, comms) = if gpus.len() == 1 {
        (None, None, None)
    } else {
        match want {
            Some(Exchange::P2p) => (Some(Exchange::P2p), None, None),
            want => match Nccl::load() {
                Ok(nccl) => {
                    let comms = nccl
                        .comm_init_all(ordinals)
                        .map_err(|e| DeviceError::Nccl(e.to_string()))?;
                    (
                        Some(Exchange::Nccl),
                        None,
                        Some(Collective::Local(nccl, comms)),
                    )
                }
                Err(missing) if want.is_none() => (
                    Some(Exchange::P2p),
                    Some(format!("peer-to-peer copies: {missing}")),
                    None,
                ),
                Err(missing) => return Err(DeviceError::Nccl(missing.to_string())),
            },
        }
    };
    let mut exchange_note = exchange_note;
    let mut direct = false;
    if exchange == Some(Exchange::P2p) {
        direct = enable_peer_access(gpus)?;
        let how = if direct {
            "peer access enabled between every pair"
        } else {
            "no peer access between some GPUs: the driver stages those copies through host memory"
        };
        exchange_note = Some(match exchange_note {
            Some(n) => format!("{n}; {how}"),
            None => format!("p2p: {how}"),
        });
    }
    Ok(ChosenExchange {
        exchange,
        note: exchange_note,
        collective: comms,
        direct,
        copy_reduce: Vec::new(),
        pull: false,
    })
}

/// Peer access between every pair that supports it (NVLink or PCIe P2P);
/// copies between other pairs go through host memory, which the driver
/// handles. True when every pair has it.
pub fn enable_peer_access(gpus: &[Arc<Gpu>]) -> Result<bool> {
    let mut all = true;
    for a in gpus {
        for b in gpus {
            if Arc::ptr_eq(a, b) {
                continue;
            }
            let mut can = 0;
            // SAFETY: both devices come from opened contexts; the call
            // writes one int.
            unsafe {
                cudarc::driver::sys::cuDeviceCanAccessPeer(
                    &mut can,
                    a.context().cu_device(),
                    b.context().cu_device(),
                )
            }
            .result()
            .map_err(driver("asking for peer access"))?;
            if can == 0 {
                all = false;
                continue;
            }
            a.context()
                .bind_to_thread()
                .map_err(driver("binding a context"))?;
            // SAFETY: `b`'s context is alive; enabling twice is reported
            // as an error code we accept.
            let r: CUresult =
                unsafe { cudarc::driver::sys::cuCtxEnablePeerAccess(b.context().cu_ctx(), 0) };
            if r != cudaError_enum::CUDA_SUCCESS
                && r != cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            {
                return Err(DeviceError::Driver {
                    what: "enabling peer access".into(),
                    error: cudarc::driver::DriverError(r),
                });
            }
            // Buffers come from the device's default memory pool
            // (stream-ordered allocation), which peer access does not
            // cover: grant `a` access to `b`'s pool too, or copies into
            // `b`'s buffers are staged through host memory.
            use cudarc::driver::sys as cu;
            let mut pool: cu::CUmemoryPool = std::ptr::null_mut();
            let desc = cu::CUmemAccessDesc {
                location: cu::CUmemLocation {
                    type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: a.properties().ordinal as i32,
                },
                flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: `pool` receives `b`'s default pool; `desc` is one
            // valid access descriptor.
            unsafe {
                cu::cuDeviceGetDefaultMemPool(&mut pool, b.context().cu_device())
                    .result()
                    .map_err(driver("finding a memory pool"))?;
                cu::cuMemPoolSetAccess(pool, &desc, 1)
                    .result()
                    .map_err(driver("granting a GPU access to a peer's memory pool"))?;
            }
        }
    }
    Ok(all)
}

/// A barrier whose waits end at a deadline or when the group aborts.
pub(super) struct TimedBarrier {
    parties: usize,
    state: Mutex<(usize, u64)>,
    cv: Condvar,
    released: AtomicBool,
}

impl TimedBarrier {
    pub(super) fn new(parties: usize) -> Self {
        TimedBarrier {
            parties,
            state: Mutex::new((0, 0)),
            cv: Condvar::new(),
            released: AtomicBool::new(false),
        }
    }

    /// Wakes every waiter for good (the group is aborting).
    pub(super) fn release(&self) {
        self.released.store(true, Ordering::SeqCst);
        self.cv.notify_all();
    }

    pub(super) fn wait(&self, timeout: Duration) -> std::result::Result<(), &'static str> {
        let deadline = Instant::now() + timeout;
        let mut s = self.state.lock().expect("barrier lock");
        let generation = s.1;
        s.0 += 1;
        if s.0 == self.parties {
            s.0 = 0;
            s.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        while s.1 == generation {
            if self.released.load(Ordering::SeqCst) {
                return Err("the group aborted");
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err("timed out waiting for the other GPUs");
            }
            s = self.cv.wait_timeout(s, left).expect("barrier lock").0;
        }
        Ok(())
    }
}

impl Worker {
    /// All-gathers every GPU's rows of `mode` into this GPU's factor
    /// buffer; returns the milliseconds it took. The first all-gather
    /// after the factors are loaded sends every row; later ones only the
    /// rows with nonzeros (the others are zero on every GPU by then).
    /// With `leave`, an all-gather by NCCL is left running on the stream
    /// and 0 is returned ([`Worker::leave_running`]).
    pub(super) fn exchange(&mut self, mode: usize, leave: bool) -> Result<f64> {
        let started = Instant::now();
        let stream = self.gpu.stream().clone();
        let m = self.shared.rows[mode].len();
        let r = self.rank as u64;
        let blocks = if self.exchanged[mode] {
            &self.shared.live[mode]
        } else {
            &self.shared.rows[mode]
        };
        self.exchanged[mode] = true;
        let block = |b: usize| -> (u64, usize) {
            let rows = &blocks[b];
            let first = (self.shared.first_row[mode] + u64::from(rows.start)) * r;
            (first * 4, rows.len() * self.rank)
        };
        let own_ptr = self.shared.factor_ptrs.lock().expect("pointer table")[self.slot];
        match &self.shared.collective {
            Some(collective) => {
                let (nccl, comm) = collective.comm(self.slot);
                let nccl_err = |e: crate::nccl::NcclError| DeviceError::Nccl(e.to_string());
                let left = self.leave_running(leave)?;
                nccl.group_start().map_err(nccl_err)?;
                for b in 0..m {
                    let (offset, count) = block(b);
                    if count == 0 {
                        continue;
                    }
                    // SAFETY: the block lies inside this GPU's factor
                    // buffer (same layout on every GPU), which lives
                    // until the wait below returns.
                    unsafe {
                        nccl.broadcast_f32(
                            comm,
                            own_ptr + offset,
                            count,
                            b,
                            stream.cu_stream() as _,
                        )
                    }
                    .map_err(nccl_err)?;
                }
                nccl.group_end().map_err(nccl_err)?;
                if let Some(start) = left {
                    // The factor buffer lives with the worker, and every
                    // later use of it is queued behind on this stream.
                    self.running = Some(LeftRunning::ends_here(&stream, mode, start)?);
                    return Ok(0.0);
                }
                self.wait(&stream, "the NCCL exchange")?;
            }
            None => {
                // Ring (AMPED Algorithm 3): at step z, pass block g - z to
                // the next GPU; every GPU's own rows must be final first.
                self.wait(&stream, "the update before the exchange")?;
                self.barrier()?;
                // One process: slots and plan indices agree.
                let next = (self.g + 1) % m;
                let next_ptr = self.shared.factor_ptrs.lock().expect("pointer table")[next];
                for z in 0..m - 1 {
                    let b = (self.g + m - z) % m;
                    let (offset, count) = block(b);
                    if count > 0 {
                        // SAFETY: source and destination are the same
                        // block of two factor buffers of equal layout,
                        // both alive; nobody else touches the block during
                        // this step (barriers around it).
                        unsafe {
                            cudarc::driver::result::memcpy_peer_async(
                                self.shared.contexts[next].cu_ctx(),
                                next_ptr + offset,
                                self.shared.contexts[self.slot].cu_ctx(),
                                own_ptr + offset,
                                count * 4,
                                stream.cu_stream(),
                            )
                        }
                        .map_err(driver("copying rows to the next GPU"))?;
                    }
                    self.wait(&stream, "a ring step of the exchange")?;
                    self.barrier()?;
                }
            }
        }
        Ok(started.elapsed().as_secs_f64() * 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_barrier_times_out_and_releases() {
        let b = Arc::new(TimedBarrier::new(2));
        // Alone, it times out.
        assert!(b.wait(Duration::from_millis(20)).is_err());
        // Two parties pass (the timed-out arrival above left the count at
        // one, so reset with a fresh barrier).
        let b = Arc::new(TimedBarrier::new(2));
        let b2 = b.clone();
        let t = std::thread::spawn(move || b2.wait(Duration::from_secs(5)));
        assert!(b.wait(Duration::from_secs(5)).is_ok());
        assert!(t.join().unwrap().is_ok());
        // A released barrier lets a waiter go with an error.
        let b = Arc::new(TimedBarrier::new(2));
        let b2 = b.clone();
        let t = std::thread::spawn(move || b2.wait(Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(20));
        b.release();
        assert_eq!(t.join().unwrap(), Err("the group aborted"));
    }
}
