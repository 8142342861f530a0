//! Several GPUs of one host (AMPED): one worker thread per GPU, the
//! tensor's shards resident on their GPUs or streamed from pinned host
//! memory, factor rows exchanged after every mode.
//!
//! - **Plan** ([`RowShards`]): each mode's output rows go to GPUs by LPT
//!   on their nonzero counts and are relabeled GPU by GPU, so GPU `g` owns
//!   one contiguous block of every relabeled factor. Every GPU keeps a full
//!   copy of every (relabeled) factor.
//! - **MTTKRP** (`kernels/mttkrp_shard.cu`): each GPU runs the `shard`
//!   kernel over its shard of the mode, cut into equal inter-shard
//!   partitions (ISPs), one thread block each; rows shared by ISPs combine
//!   by atomics inside the GPU only.
//! - **Update**: each GPU solves its own rows (`M V^+`, the fused dense
//!   kernels of [`crate::dense`]) and returns column statistics and a
//!   partial Gram matrix; the coordinator sums them in GPU order (an
//!   all-reduce of R x R values that the CPD driver needs on the host
//!   anyway).
//! - **Exchange**: the updated blocks are all-gathered around the ring,
//!   by NCCL (a grouped in-place broadcast per owner: all-gather with
//!   uneven counts) or by peer-to-peer copies (AMPED Algorithm 3: M - 1
//!   steps, each GPU passing one block to the next with a barrier between
//!   steps). NCCL is the default when it loads ([`crate::nccl`]).
//! - **Streaming** (ScalFrag, AMPED's out-of-memory case): a shard that
//!   does not fit stays in pinned host memory and is copied in segments
//!   on several streams, each segment's kernel overlapping the next
//!   segment's copy. Decided per GPU and mode from free memory.
//! - **Failure**: every wait has a deadline. When a GPU fails, the group
//!   aborts (NCCL communicators are aborted so peers stop waiting) and the
//!   error names the GPU; later calls fail at once.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUresult, cudaError_enum};
use cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use kruskal_formats::SparseTensor;
use kruskal_partition::RowShards;
use ndarray::Array2;

use crate::coo::DeviceFactors;
use crate::dense::{DenseKernels, UpdateStats, check_rank};
use crate::kernels::Kernel;
use crate::nccl::{Comm, Nccl, Reduce};
use crate::process::ProcessComm;
use crate::{DeviceError, Gpu, Result, driver};

/// Warps per block of the shard kernel (its P).
pub const WARPS: usize = 8;
/// ISPs per SM a launch aims for: several waves of blocks, so the last,
/// partly filled wave costs little (at 8 per SM, one block per SM slot, a
/// launch just over one wave took nearly two waves' time).
const ISPS_PER_SM: u64 = 32;
/// Device memory kept free besides the plan (NCCL buffers, modules).
const MARGIN_BYTES: usize = 1 << 30;

/// How factor rows travel between GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exchange {
    Nccl,
    P2p,
}

impl Exchange {
    pub fn name(self) -> &'static str {
        match self {
            Exchange::Nccl => "nccl",
            Exchange::P2p => "p2p",
        }
    }
}

/// When shards are streamed from host memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamPolicy {
    /// Resident when it fits in free memory, streamed otherwise.
    #[default]
    Auto,
    /// Every shard streamed (to measure streaming on a tensor that fits).
    Always,
    /// Every shard resident; not fitting is an error.
    Never,
}

/// Options of a group.
#[derive(Clone, Debug)]
pub struct GroupOptions {
    /// `None`: NCCL when it loads, else peer-to-peer copies.
    pub exchange: Option<Exchange>,
    pub stream: StreamPolicy,
    /// CUDA streams a streamed shard is copied on.
    pub streams: usize,
    /// Bytes per streamed segment.
    pub segment_bytes: usize,
    /// Longest wait for any GPU operation.
    pub timeout: Duration,
    /// Test hook: GPU `.0` runs a trapping kernel before its `.1`-th
    /// MTTKRP (counted from 0), putting it into a real CUDA error.
    #[doc(hidden)]
    pub fault: Option<(usize, usize)>,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            exchange: None,
            stream: StreamPolicy::Auto,
            streams: 3,
            segment_bytes: 256 << 20,
            timeout: Duration::from_secs(300),
            fault: None,
        }
    }
}

/// Where one GPU's shard of one mode lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    Resident,
    /// Copied from pinned host memory in this many segments per MTTKRP.
    Streamed {
        segments: u64,
    },
}

/// What one GPU's last MTTKRP took (CUDA events).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MttkrpTimes {
    /// From the first copy or kernel to the last.
    pub total_ms: f64,
    /// Time the host-to-device copies were running (0 when resident).
    pub h2d_ms: f64,
    /// Time the kernels were running.
    pub kernel_ms: f64,
}

/// Several GPUs running one CPD together.
pub struct GpuGroup {
    /// This process's GPUs.
    gpus: Vec<Arc<Gpu>>,
    /// Each local GPU's index in the plan (`0..m` in one process; the
    /// rank across processes).
    members: Vec<usize>,
    plan: RowShards,
    rank: usize,
    exchange: Option<Exchange>,
    exchange_note: Option<String>,
    residency: Vec<Vec<Residency>>,
    workers: Vec<WorkerHandle>,
    replies: Receiver<(usize, Result<Reply>)>,
    shared: Arc<Shared>,
    timeout: Duration,
    failed: Option<String>,
}

struct WorkerHandle {
    tx: Sender<Cmd>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// State every worker reads.
struct Shared {
    abort: AtomicBool,
    barrier: TimedBarrier,
    /// Device address of each local GPU's factor buffer.
    factor_ptrs: Mutex<Vec<u64>>,
    /// Each local GPU's context.
    contexts: Vec<Arc<cudarc::driver::CudaContext>>,
    /// Per mode, per GPU of the whole group (all processes): the rows it
    /// owns.
    rows: Vec<Vec<Range<u32>>>,
    /// First row of each mode in the concatenated factor buffer.
    first_row: Vec<u64>,
    collective: Option<Collective>,
    timeout: Duration,
}

impl Shared {
    /// Whether the group, or the communicator across processes, stopped.
    fn aborted(&self) -> bool {
        self.abort.load(Ordering::SeqCst)
            || matches!(&self.collective, Some(Collective::Process(p)) if p.aborted().is_some())
    }
}

/// The NCCL communicators of the exchange.
enum Collective {
    /// One per GPU, all in this process.
    Local(&'static Nccl, Vec<Comm>),
    /// This process's one GPU in a communicator across processes.
    Process(Arc<ProcessComm>),
}

impl Collective {
    /// The library and local GPU `slot`'s communicator.
    fn comm(&self, slot: usize) -> (&'static Nccl, &Comm) {
        match self {
            Collective::Local(nccl, comms) => (nccl, &comms[slot]),
            Collective::Process(p) => (p.nccl(), p.comm()),
        }
    }

    /// Aborts every communicator so that peers blocked in a collective
    /// return.
    fn abort(&self, why: &str) {
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

enum Cmd {
    Load(Arc<Vec<f32>>),
    Mttkrp(usize),
    Sync,
    Update(usize, Arc<Vec<f64>>),
    ScaleGram(usize, Option<Arc<Vec<f32>>>),
    Exchange(usize),
    Output(usize),
    Factors,
}

enum Reply {
    Done,
    Times(MttkrpTimes),
    Stats(UpdateStats),
    Gram(Vec<f64>),
    Floats(Vec<f32>),
    Millis(f64),
}

/// A shard on the device, or in pinned host memory.
enum Shard {
    Resident {
        elems: CudaSlice<u32>,
        count: u64,
    },
    Streamed {
        host: Arc<PinnedHostSlice<u32>>,
        /// First element of this GPU's shard in `host`.
        first: u64,
        count: u64,
    },
}

impl GpuGroup {
    /// Plans `t` over the GPUs `ordinals`, decides each shard's residency
    /// from free memory, builds and uploads the shards (or pins them), and
    /// starts one worker thread per GPU. `progress` hears about long steps.
    pub fn new(
        ordinals: &[usize],
        t: &SparseTensor,
        rank: usize,
        opts: &GroupOptions,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Self> {
        check_rank(rank)?;
        if ordinals.is_empty() {
            return Err(DeviceError::Shape(
                "a GPU group needs at least one GPU".into(),
            ));
        }
        let mut sorted = ordinals.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != ordinals.len() {
            return Err(DeviceError::Shape(format!(
                "GPU {ordinals:?} lists a GPU twice"
            )));
        }
        if opts.streams == 0 || opts.segment_bytes == 0 {
            return Err(DeviceError::Shape(
                "streaming needs at least one stream and a segment of at least one byte".into(),
            ));
        }
        let gpus = ordinals
            .iter()
            .map(|&o| Gpu::open(o))
            .collect::<Result<Vec<_>>>()?;
        let m = gpus.len();
        let started = Instant::now();
        let plan = RowShards::new(t, m).map_err(|e| DeviceError::Prepare {
            format: "shards",
            message: e.to_string(),
        })?;
        progress(&format!(
            "planned {} modes over {m} GPU(s) in {:.1} s",
            t.nmodes(),
            started.elapsed().as_secs_f64()
        ));
        let n = t.nmodes();
        let stride = plan.stride();

        // Residency per GPU and mode.
        let residency = gpus
            .iter()
            .enumerate()
            .map(|(g, gpu)| decide_residency(gpu, &plan, g, rank, opts))
            .collect::<Result<Vec<_>>>()?;
        // Shards: built once per mode, uploaded or kept pinned.
        let mut shards: Vec<Vec<Shard>> = (0..m).map(|_| Vec::with_capacity(n)).collect();
        for mode in 0..n {
            let t0 = Instant::now();
            let words = t.nnz() * stride;
            let any_streamed = residency.iter().any(|r| r[mode] != Residency::Resident);
            let fill = |buf: &mut [u32]| {
                plan.fill_elements(t, mode, buf)
                    .map_err(|e| DeviceError::Prepare {
                        format: "shards",
                        message: e.to_string(),
                    })
            };
            if any_streamed {
                // SAFETY: the buffer is filled completely by
                // `fill_elements` (every element written once) before
                // anything reads it.
                let mut pinned = unsafe {
                    gpus[0].context().alloc_pinned_with_flags::<u32>(
                        words.max(1),
                        cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE,
                    )
                }
                .map_err(driver(format!(
                    "pinning {} bytes of host memory",
                    words * 4
                )))?;
                let ptr = pinned
                    .as_mut_ptr()
                    .map_err(driver("reading pinned memory"))?;
                // SAFETY: `ptr` addresses `words` (or 1) u32 the slice owns.
                let buf = unsafe { std::slice::from_raw_parts_mut(ptr, words) };
                let offsets = fill(buf)?;
                let host = Arc::new(pinned);
                for g in 0..m {
                    let count = offsets[g + 1] - offsets[g];
                    shards[g].push(match residency[g][mode] {
                        Residency::Resident => Shard::Resident {
                            elems: gpus[g].upload(
                                "a shard",
                                &buf[(offsets[g] as usize * stride)
                                    ..(offsets[g + 1] as usize * stride)],
                            )?,
                            count,
                        },
                        Residency::Streamed { .. } => Shard::Streamed {
                            host: host.clone(),
                            first: offsets[g],
                            count,
                        },
                    });
                }
            } else {
                let mut buf = vec![0u32; words];
                let offsets = fill(&mut buf)?;
                for g in 0..m {
                    let range = (offsets[g] as usize * stride)..(offsets[g + 1] as usize * stride);
                    shards[g].push(Shard::Resident {
                        elems: gpus[g].upload("a shard", &buf[range])?,
                        count: offsets[g + 1] - offsets[g],
                    });
                }
            }
            progress(&format!(
                "mode {}: shards built and placed in {:.1} s ({})",
                mode + 1,
                t0.elapsed().as_secs_f64(),
                if any_streamed {
                    "pinned for streaming"
                } else {
                    "resident"
                }
            ));
        }

        // The exchange.
        let (exchange, exchange_note, comms) = if m == 1 {
            (None, None, None)
        } else {
            match opts.exchange {
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
        if exchange == Some(Exchange::P2p) {
            let direct = enable_peer_access(&gpus)?;
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

        let members = (0..m).collect();
        Self::start(
            gpus,
            members,
            plan,
            rank,
            residency,
            shards,
            (exchange, exchange_note, comms),
            opts,
        )
    }

    /// This process's part of a group spread over several processes, one
    /// GPU each (possibly on several hosts): `pc` is its communicator
    /// (rank `pc.rank()` of `pc.world()`), `plan` the row plan over all
    /// of them (made the same way on every rank, e.g. with
    /// [`RowShards::from_counts`]), and `shards[mode]` this rank's
    /// elements of each mode ([`RowShards::local_elements`]). Rows are
    /// exchanged, and Grams and column statistics all-reduced, through
    /// NCCL; every rank must make the same calls in the same order.
    pub fn distributed(
        pc: ProcessComm,
        plan: RowShards,
        shards: Vec<Vec<u32>>,
        rank: usize,
        opts: &GroupOptions,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Self> {
        check_rank(rank)?;
        let g = pc.rank();
        let n = plan.dims().len();
        let stride = plan.stride();
        if plan.gpus() != pc.world() {
            return Err(DeviceError::Shape(format!(
                "a plan over {} GPUs for a world of {} processes",
                plan.gpus(),
                pc.world()
            )));
        }
        if shards.len() != n
            || shards
                .iter()
                .enumerate()
                .any(|(mode, s)| s.len() != plan.nnz(mode, g) as usize * stride)
        {
            return Err(DeviceError::Shape(format!(
                "rank {g}'s shards do not match the plan's nonzero counts"
            )));
        }
        if opts.exchange == Some(Exchange::P2p) {
            return Err(DeviceError::Shape(
                "peer-to-peer copies work inside one process; across processes rows travel by NCCL"
                    .into(),
            ));
        }
        if opts.streams == 0 || opts.segment_bytes == 0 {
            return Err(DeviceError::Shape(
                "streaming needs at least one stream and a segment of at least one byte".into(),
            ));
        }
        let gpu = pc.gpu().clone();
        let residency = decide_residency(&gpu, &plan, g, rank, opts)?;
        let t0 = Instant::now();
        let mut placed = Vec::with_capacity(n);
        for (mode, elems) in shards.into_iter().enumerate() {
            let count = plan.nnz(mode, g);
            placed.push(match residency[mode] {
                Residency::Resident => Shard::Resident {
                    elems: gpu.upload("a shard", &elems)?,
                    count,
                },
                Residency::Streamed { .. } => {
                    // SAFETY: filled completely by the copy below before
                    // anything reads it.
                    let mut pinned = unsafe {
                        gpu.context()
                            .alloc_pinned_with_flags::<u32>(
                                elems.len().max(1),
                                cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE,
                            )
                            .map_err(driver(format!(
                                "pinning {} bytes of host memory",
                                elems.len() * 4
                            )))?
                    };
                    let ptr = pinned
                        .as_mut_ptr()
                        .map_err(driver("reading pinned memory"))?;
                    // SAFETY: `ptr` addresses at least `elems.len()` u32
                    // that the pinned buffer owns.
                    unsafe { std::slice::from_raw_parts_mut(ptr, elems.len()) }
                        .copy_from_slice(&elems);
                    Shard::Streamed {
                        host: Arc::new(pinned),
                        first: 0,
                        count,
                    }
                }
            });
        }
        progress(&format!(
            "rank {g}: shards of {n} modes placed in {:.1} s",
            t0.elapsed().as_secs_f64()
        ));
        let collective = Collective::Process(Arc::new(pc));
        Self::start(
            vec![gpu],
            vec![g],
            plan,
            rank,
            vec![residency],
            vec![placed],
            (Some(Exchange::Nccl), None, Some(collective)),
            opts,
        )
    }

    /// Starts one worker per local GPU; `members[slot]` is local GPU
    /// `slot`'s index in the plan.
    #[allow(clippy::too_many_arguments)]
    fn start(
        gpus: Vec<Arc<Gpu>>,
        members: Vec<usize>,
        plan: RowShards,
        rank: usize,
        residency: Vec<Vec<Residency>>,
        shards: Vec<Vec<Shard>>,
        exchange: (Option<Exchange>, Option<String>, Option<Collective>),
        opts: &GroupOptions,
    ) -> Result<Self> {
        let (exchange, exchange_note, collective) = exchange;
        let m = gpus.len();
        let n = plan.dims().len();
        let stride = plan.stride();
        let dims = plan.dims().to_vec();
        let first_row: Vec<u64> = dims
            .iter()
            .scan(0u64, |acc, &d| {
                let this = *acc;
                *acc += u64::from(d);
                Some(this)
            })
            .collect();
        let shared = Arc::new(Shared {
            abort: AtomicBool::new(false),
            barrier: TimedBarrier::new(m),
            factor_ptrs: Mutex::new(vec![0; m]),
            contexts: gpus.iter().map(|g| g.context().clone()).collect(),
            rows: (0..n)
                .map(|mode| (0..plan.gpus()).map(|g| plan.rows(mode, g)).collect())
                .collect(),
            first_row,
            collective,
            timeout: opts.timeout,
        });

        let (reply_tx, replies) = mpsc::channel();
        let mut workers = Vec::with_capacity(m);
        for (slot, shards) in shards.into_iter().enumerate() {
            let gpu = &gpus[slot];
            let streams = if shards.iter().any(|s| matches!(s, Shard::Streamed { .. })) {
                (0..opts.streams)
                    .map(|_| gpu.context().new_stream())
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(driver("creating streams"))?
            } else {
                Vec::new()
            };
            let g = members[slot];
            let worker = Worker {
                slot,
                g,
                gpu: gpu.clone(),
                shared: shared.clone(),
                dims: dims.clone(),
                rank,
                shards,
                segment_elems: (opts.segment_bytes / (stride * 4)).max(1) as u64,
                streams,
                segment_bufs: Vec::new(),
                factors: None,
                dense: None,
                outputs: (0..n).map(|_| None).collect(),
                last: None,
                calls: 0,
                fault: opts
                    .fault
                    .and_then(|(gpu, call)| (gpu == g).then_some(call)),
            };
            let (tx, rx) = mpsc::channel();
            let reply_tx = reply_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("kruskal-gpu-{g}"))
                .spawn(move || worker.run(rx, reply_tx))
                .map_err(|e| DeviceError::Shape(format!("starting a worker thread: {e}")))?;
            workers.push(WorkerHandle {
                tx,
                thread: Some(thread),
            });
        }
        Ok(GpuGroup {
            gpus,
            members,
            plan,
            rank,
            exchange,
            exchange_note,
            residency,
            workers,
            replies,
            shared,
            timeout: opts.timeout,
            failed: None,
        })
    }

    pub fn gpus(&self) -> &[Arc<Gpu>] {
        &self.gpus
    }

    pub fn plan(&self) -> &RowShards {
        &self.plan
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The exchange in use (`None` with one GPU).
    pub fn exchange(&self) -> Option<Exchange> {
        self.exchange
    }

    /// Why the exchange is not NCCL, when NCCL was wanted but not found.
    pub fn exchange_note(&self) -> Option<&str> {
        self.exchange_note.as_deref()
    }

    /// Where local GPU `slot`'s shard of `mode` lives.
    pub fn residency(&self, slot: usize, mode: usize) -> Residency {
        self.residency[slot][mode]
    }

    /// Each local GPU's index in the plan: `0..m` in one process, the
    /// process's rank across processes.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// `(rank, world size)` when the group spans several processes.
    pub fn process(&self) -> Option<(usize, usize)> {
        match &self.shared.collective {
            Some(Collective::Process(p)) => Some((p.rank(), p.world())),
            _ => None,
        }
    }

    /// Aborts the communicator across processes from another thread (a
    /// membership loss callback): every wait of the group then fails with
    /// `reason`. `None` for a group of one process.
    pub fn abort_handle(&self) -> Option<crate::process::CommAbort> {
        match &self.shared.collective {
            Some(Collective::Process(p)) => Some(p.abort_handle()),
            _ => None,
        }
    }

    /// One line per local GPU: device, nonzeros and residency per mode.
    pub fn describe(&self) -> Vec<String> {
        let n = self.plan.dims().len();
        self.gpus
            .iter()
            .enumerate()
            .map(|(slot, gpu)| {
                let g = self.members[slot];
                let modes: Vec<String> = (0..n)
                    .map(|mode| {
                        let r = match self.residency[slot][mode] {
                            Residency::Resident => "resident".to_string(),
                            Residency::Streamed { segments } => {
                                format!("streamed in {segments} segments")
                            }
                        };
                        format!("mode {} {} nnz {r}", mode + 1, self.plan.nnz(mode, g))
                    })
                    .collect();
                let rank = match self.process() {
                    Some((rank, world)) => format!("rank {rank} of {world}, "),
                    None => String::new(),
                };
                format!(
                    "{rank}gpu {} ({}): {}",
                    gpu.properties().ordinal,
                    gpu.properties().name,
                    modes.join(", ")
                )
            })
            .collect()
    }

    /// Sends `cmd` to every worker and gathers the replies, in GPU order.
    fn all(&mut self, cmd: impl Fn() -> Cmd, what: &str) -> Result<Vec<Reply>> {
        self.some(&(0..self.workers.len()).collect::<Vec<_>>(), cmd, what)
    }

    fn some(&mut self, gpus: &[usize], cmd: impl Fn() -> Cmd, what: &str) -> Result<Vec<Reply>> {
        if let Some(why) = &self.failed {
            return Err(DeviceError::Aborted(why.clone()));
        }
        for &g in gpus {
            if self.workers[g].tx.send(cmd()).is_err() {
                return Err(self.fail(g, format!("its worker thread stopped before {what}")));
            }
        }
        let mut out: Vec<Option<Reply>> = (0..self.workers.len()).map(|_| None).collect();
        // Workers time out their own waits; this deadline also catches a
        // worker stuck inside a driver call.
        let deadline = Instant::now() + self.timeout + Duration::from_secs(5);
        let mut missing = gpus.len();
        while missing > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.replies.recv_timeout(left) {
                Ok((g, Ok(reply))) => {
                    out[g] = Some(reply);
                    missing -= 1;
                }
                Ok((g, Err(e))) => return Err(self.fail(g, format!("{what}: {e}"))),
                Err(RecvTimeoutError::Timeout) => {
                    let g = *gpus
                        .iter()
                        .find(|&&g| out[g].is_none())
                        .expect("a GPU is missing");
                    return Err(self.fail(
                        g,
                        format!("{what} did not finish within {} s", self.timeout.as_secs()),
                    ));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(DeviceError::Aborted("every worker thread stopped".into()));
                }
            }
        }
        Ok(gpus
            .iter()
            .map(|&g| out[g].take().expect("every reply arrived"))
            .collect())
    }

    /// Stops the group after GPU `g` failed: workers stop waiting, NCCL
    /// communicators are aborted (so peers blocked in a collective return),
    /// and every later call fails with the same message.
    fn fail(&mut self, g: usize, message: String) -> DeviceError {
        if let Some(Collective::Process(pc)) = &self.shared.collective {
            if let Some(why) = pc.aborted() {
                // A peer was lost: that, not this GPU's wait, is the news.
                self.failed = Some(why.clone());
                self.shared.abort.store(true, Ordering::SeqCst);
                return DeviceError::Aborted(why);
            }
        }
        let p = self.gpus[g].properties();
        let err = DeviceError::GroupMember {
            gpu: p.ordinal,
            name: p.name.clone(),
            message,
        };
        self.failed = Some(err.to_string());
        self.shared.abort.store(true, Ordering::SeqCst);
        self.shared.barrier.release();
        if let Some(c) = &self.shared.collective {
            c.abort(&self.failed.clone().unwrap_or_default());
        }
        err
    }

    /// Uploads `factors` (`dims[w] x rank`, original row order) to every
    /// GPU, relabeled.
    pub fn load_factors(&mut self, factors: &[Array2<f32>]) -> Result<()> {
        let dims = self.plan.dims().to_vec();
        if factors.len() != dims.len()
            || factors
                .iter()
                .zip(&dims)
                .any(|(f, &d)| f.nrows() != d as usize || f.ncols() != self.rank)
        {
            return Err(DeviceError::Shape(format!(
                "factors for dims {dims:?} at rank {} expected",
                self.rank
            )));
        }
        let r = self.rank;
        let total: usize = dims.iter().map(|&d| d as usize).sum();
        let mut rows = vec![0f32; total * r];
        let mut first = 0;
        for (mode, f) in factors.iter().enumerate() {
            let labels = self.plan.relabel(mode);
            for (old, row) in f.outer_iter().enumerate() {
                let at = (first + labels[old] as usize) * r;
                for (dst, &x) in rows[at..at + r].iter_mut().zip(row.iter()) {
                    *dst = x;
                }
            }
            first += f.nrows();
        }
        let rows = Arc::new(rows);
        self.all(|| Cmd::Load(rows.clone()), "loading the factors")?;
        Ok(())
    }

    /// Queues `M = MTTKRP(mode)` on every GPU (returns before it is done).
    pub fn mttkrp(&mut self, mode: usize) -> Result<()> {
        self.check_mode(mode)?;
        self.all(|| Cmd::Mttkrp(mode), "the MTTKRP")?;
        Ok(())
    }

    /// Waits for the queued MTTKRP; returns each GPU's times.
    pub fn sync(&mut self) -> Result<Vec<MttkrpTimes>> {
        self.all(|| Cmd::Sync, "the MTTKRP")?
            .into_iter()
            .map(|r| match r {
                Reply::Times(t) => Ok(t),
                _ => Ok(MttkrpTimes::default()),
            })
            .collect()
    }

    /// `A_mode = M W` on every GPU's rows; the column statistics summed
    /// (max for the largest magnitude) over GPUs.
    pub fn update(&mut self, mode: usize, w: &[f64]) -> Result<UpdateStats> {
        self.check_mode(mode)?;
        if w.len() != self.rank * self.rank {
            return Err(DeviceError::Shape(format!(
                "W has {} entries, rank {} needs {}",
                w.len(),
                self.rank,
                self.rank * self.rank
            )));
        }
        let w = Arc::new(w.to_vec());
        let replies = self.all(|| Cmd::Update(mode, w.clone()), "the factor update")?;
        let r = self.rank;
        let mut total = UpdateStats {
            sumsq: vec![0.0; r],
            max_abs: vec![0.0; r],
            inner: vec![0.0; r],
        };
        for reply in replies {
            if let Reply::Stats(s) = reply {
                for c in 0..r {
                    total.sumsq[c] += s.sumsq[c];
                    total.max_abs[c] = total.max_abs[c].max(s.max_abs[c]);
                    total.inner[c] += s.inner[c];
                }
            }
        }
        if let Some((me, world)) = self.process() {
            // One collective for sums and maxima: every rank's three
            // vectors gathered (an all-reduce of a buffer that is zero
            // outside each rank's slot), combined in rank order.
            let mut all = vec![0f64; world * 3 * r];
            let own = &mut all[me * 3 * r..(me + 1) * 3 * r];
            own[..r].copy_from_slice(&total.sumsq);
            own[r..2 * r].copy_from_slice(&total.inner);
            own[2 * r..].copy_from_slice(&total.max_abs);
            self.across(&mut all, Reduce::Sum, "the column statistics")?;
            total.sumsq.fill(0.0);
            total.inner.fill(0.0);
            total.max_abs.fill(0.0);
            for slot in all.chunks_exact(3 * r) {
                for c in 0..r {
                    total.sumsq[c] += slot[c];
                    total.inner[c] += slot[r + c];
                    total.max_abs[c] = total.max_abs[c].max(slot[2 * r + c]);
                }
            }
        }
        Ok(total)
    }

    /// All-reduces `data` across the processes (workers idle meanwhile, so
    /// the communicator has one user).
    fn across(&mut self, data: &mut [f64], op: Reduce, what: &str) -> Result<()> {
        let Some(Collective::Process(pc)) = &self.shared.collective else {
            return Ok(());
        };
        let pc = pc.clone();
        pc.all_reduce(data, op)
            .map_err(|e| self.fail(0, format!("all-reducing {what} across processes: {e}")))
    }

    /// Scales every GPU's rows of `mode` by `inv` (if given) and returns
    /// the Gram matrix of the whole factor (partial Grams summed in GPU
    /// order).
    pub fn scale_gram(&mut self, mode: usize, inv: Option<&[f32]>) -> Result<Vec<f64>> {
        self.check_mode(mode)?;
        let inv = inv.map(|v| Arc::new(v.to_vec()));
        let replies = self.all(|| Cmd::ScaleGram(mode, inv.clone()), "the Gram matrix")?;
        let mut gram = vec![0f64; self.rank * self.rank];
        for reply in replies {
            if let Reply::Gram(g) = reply {
                gram.iter_mut().zip(&g).for_each(|(a, b)| *a += b);
            }
        }
        self.across(&mut gram, Reduce::Sum, "the Gram matrix")?;
        Ok(gram)
    }

    /// All-gathers every GPU's rows of `mode`; returns the slowest GPU's
    /// exchange time in milliseconds (0 with one GPU).
    pub fn exchange_rows(&mut self, mode: usize) -> Result<f64> {
        self.check_mode(mode)?;
        if self.plan.gpus() == 1 {
            return Ok(0.0);
        }
        let replies = self.all(|| Cmd::Exchange(mode), "the factor exchange")?;
        Ok(replies
            .into_iter()
            .map(|r| if let Reply::Millis(ms) = r { ms } else { 0.0 })
            .fold(0.0, f64::max))
    }

    /// The last MTTKRP of `mode`, downloaded, in the original row order
    /// (a group of one process only: across processes each holds its own
    /// rows).
    pub fn output(&mut self, mode: usize) -> Result<Array2<f32>> {
        self.check_mode(mode)?;
        if self.process().is_some() {
            return Err(DeviceError::Shape(
                "the MTTKRP output of a group across processes is spread over them".into(),
            ));
        }
        let replies = self.all(|| Cmd::Output(mode), "downloading the MTTKRP")?;
        let r = self.rank;
        let mut relabeled = Vec::with_capacity(self.plan.dims()[mode] as usize * r);
        for reply in replies {
            if let Reply::Floats(v) = reply {
                relabeled.extend_from_slice(&v);
            }
        }
        Ok(self.unlabel(mode, &relabeled))
    }

    /// Every factor, from the first GPU, in the original row order.
    pub fn factors(&mut self) -> Result<Vec<Array2<f32>>> {
        let reply = self.some(&[0], || Cmd::Factors, "downloading the factors")?;
        let Some(Reply::Floats(rows)) = reply.into_iter().next() else {
            return Err(DeviceError::Shape("no factors came back".into()));
        };
        let r = self.rank;
        let mut out = Vec::new();
        let mut first = 0;
        for mode in 0..self.plan.dims().len() {
            let d = self.plan.dims()[mode] as usize;
            out.push(self.unlabel(mode, &rows[first * r..(first + d) * r]));
            first += d;
        }
        Ok(out)
    }

    /// Rows in relabeled order back to the original order.
    fn unlabel(&self, mode: usize, relabeled: &[f32]) -> Array2<f32> {
        let r = self.rank;
        let labels = self.plan.relabel(mode);
        let mut out = Array2::zeros((labels.len(), r));
        for (old, mut row) in out.outer_iter_mut().enumerate() {
            let at = labels[old] as usize * r;
            for (dst, &x) in row.iter_mut().zip(&relabeled[at..at + r]) {
                *dst = x;
            }
        }
        out
    }

    fn check_mode(&self, mode: usize) -> Result<()> {
        if mode >= self.plan.dims().len() {
            return Err(DeviceError::Shape(format!(
                "mode {mode} of a {}-mode tensor",
                self.plan.dims().len()
            )));
        }
        Ok(())
    }
}

impl Drop for GpuGroup {
    fn drop(&mut self) {
        // Closing the command channels ends the workers' loops.
        let threads: Vec<_> = self
            .workers
            .iter_mut()
            .filter_map(|w| w.thread.take())
            .collect();
        self.workers.clear();
        if self.failed.is_some() {
            // A failed GPU may never return; leave its thread behind.
            return;
        }
        for t in threads {
            let _ = t.join();
        }
        // A communicator across processes is destroyed with the last
        // reference to it; local ones here, unless a peer aborted them.
        if let Some(Collective::Local(nccl, comms)) = &self.shared.collective {
            if !self.shared.aborted() {
                for c in comms {
                    let _ = nccl.destroy(c);
                }
            }
        }
    }
}

/// Where GPU `g`'s shard of each mode lives: resident when everything fits
/// in its free memory, else (policy allowing) the largest shards streamed
/// until the rest fits.
fn decide_residency(
    gpu: &Gpu,
    plan: &RowShards,
    g: usize,
    rank: usize,
    opts: &GroupOptions,
) -> Result<Vec<Residency>> {
    let n = plan.dims().len();
    let stride = plan.stride();
    let rows_total: usize = plan.dims().iter().map(|&d| d as usize).sum();
    let free = gpu.free_bytes()?;
    let fixed = rows_total * rank * 4
        + (0..n)
            .map(|mode| plan.rows(mode, g).len() * rank * 4)
            .sum::<usize>()
        + MARGIN_BYTES;
    let need: Vec<usize> = (0..n)
        .map(|mode| plan.nnz(mode, g) as usize * stride * 4)
        .collect();
    let stream_buffers = opts.streams * opts.segment_bytes;
    let segments = |mode: usize| {
        let per = (opts.segment_bytes / (stride * 4)).max(1) as u64;
        plan.nnz(mode, g).div_ceil(per).max(1)
    };
    let resident_total = fixed + need.iter().sum::<usize>();
    let streamed: Vec<usize> = match opts.stream {
        StreamPolicy::Never => {
            if resident_total > free {
                return Err(DeviceError::OutOfMemory {
                    what: format!(
                        "GPU {}'s resident shards (streaming was turned off)",
                        gpu.properties().ordinal
                    ),
                    needed: resident_total,
                    free,
                });
            }
            Vec::new()
        }
        StreamPolicy::Always => (0..n).collect(),
        StreamPolicy::Auto => {
            if resident_total <= free {
                Vec::new()
            } else {
                // Stream the largest shards until the rest fits.
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by_key(|&mode| std::cmp::Reverse(need[mode]));
                let mut kept = resident_total + stream_buffers;
                let mut out = Vec::new();
                for mode in order {
                    if kept <= free {
                        break;
                    }
                    kept -= need[mode];
                    out.push(mode);
                }
                out
            }
        }
    };
    let needed = fixed
        + (0..n)
            .filter(|mode| !streamed.contains(mode))
            .map(|mode| need[mode])
            .sum::<usize>()
        + if streamed.is_empty() {
            0
        } else {
            stream_buffers
        };
    if needed > free {
        return Err(DeviceError::OutOfMemory {
            what: format!(
                "GPU {}'s factors, outputs and stream buffers",
                gpu.properties().ordinal
            ),
            needed,
            free,
        });
    }
    let mut residency = vec![Residency::Resident; n];
    for mode in streamed {
        residency[mode] = Residency::Streamed {
            segments: segments(mode),
        };
    }
    Ok(residency)
}

/// Peer access between every pair that supports it (NVLink or PCIe P2P);
/// copies between other pairs go through host memory, which the driver
/// handles. True when every pair has it.
fn enable_peer_access(gpus: &[Arc<Gpu>]) -> Result<bool> {
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
                    source: cudarc::driver::DriverError(r),
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
struct TimedBarrier {
    parties: usize,
    state: Mutex<(usize, u64)>,
    cv: Condvar,
    released: AtomicBool,
}

impl TimedBarrier {
    fn new(parties: usize) -> Self {
        TimedBarrier {
            parties,
            state: Mutex::new((0, 0)),
            cv: Condvar::new(),
            released: AtomicBool::new(false),
        }
    }

    /// Wakes every waiter for good (the group is aborting).
    fn release(&self) {
        self.released.store(true, Ordering::SeqCst);
        self.cv.notify_all();
    }

    fn wait(&self, timeout: Duration) -> std::result::Result<(), &'static str> {
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

/// The events of one MTTKRP, read at the next sync.
struct Recorded {
    start: CudaEvent,
    end: CudaEvent,
    /// Per launch: (copy start, copy end, kernel end); copies absent when
    /// resident.
    launches: Vec<(Option<(CudaEvent, CudaEvent)>, CudaEvent)>,
}

/// One GPU's worker: owns everything on its device.
struct Worker {
    /// Index among this process's GPUs.
    slot: usize,
    /// Index in the plan.
    g: usize,
    gpu: Arc<Gpu>,
    shared: Arc<Shared>,
    dims: Vec<u32>,
    rank: usize,
    shards: Vec<Shard>,
    segment_elems: u64,
    streams: Vec<Arc<CudaStream>>,
    segment_bufs: Vec<CudaSlice<u32>>,
    factors: Option<DeviceFactors>,
    dense: Option<DenseKernels>,
    outputs: Vec<Option<CudaSlice<f32>>>,
    last: Option<Recorded>,
    calls: usize,
    fault: Option<usize>,
}

impl Worker {
    fn run(mut self, rx: Receiver<Cmd>, tx: Sender<(usize, Result<Reply>)>) {
        while let Ok(cmd) = rx.recv() {
            let result = if self.shared.aborted() {
                Err(DeviceError::Aborted("the group stopped".into()))
            } else {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.handle(cmd)))
                    .unwrap_or_else(|p| {
                        let msg = p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "unknown panic".into());
                        Err(DeviceError::Aborted(format!("worker panicked: {msg}")))
                    })
            };
            if tx.send((self.slot, result)).is_err() {
                break;
            }
        }
        if self.shared.aborted() {
            // The device may be in an error state or still running an
            // aborted collective: do not wait in destructors.
            std::mem::forget(self);
        }
    }

    fn handle(&mut self, cmd: Cmd) -> Result<Reply> {
        match cmd {
            Cmd::Load(rows) => self.load(&rows).map(|()| Reply::Done),
            Cmd::Mttkrp(mode) => self.mttkrp(mode).map(|()| Reply::Done),
            Cmd::Sync => self.sync().map(Reply::Times),
            Cmd::Update(mode, w) => self.update(mode, &w).map(Reply::Stats),
            Cmd::ScaleGram(mode, inv) => self
                .scale_gram(mode, inv.as_deref().map(Vec::as_slice))
                .map(Reply::Gram),
            Cmd::Exchange(mode) => self.exchange(mode).map(Reply::Millis),
            Cmd::Output(mode) => {
                let stream = self.gpu.stream().clone();
                let out = self.output(mode)?;
                let v = stream
                    .clone_dtoh(out)
                    .map_err(driver("downloading the MTTKRP"))?;
                let len = self.shared.rows[mode][self.g].len() * self.rank;
                Ok(Reply::Floats(v[..len].to_vec()))
            }
            Cmd::Factors => {
                let f = self
                    .factors
                    .as_ref()
                    .ok_or_else(|| DeviceError::Shape("no factors loaded".into()))?;
                self.wait(self.gpu.stream(), "the last update")?;
                let all = f.download(&self.gpu)?;
                Ok(Reply::Floats(
                    all.into_iter().flat_map(|a| a.into_iter()).collect(),
                ))
            }
        }
    }

    /// Waits for `stream`'s queued work, up to the group's timeout, giving
    /// up early when the group aborts.
    fn wait(&self, stream: &Arc<CudaStream>, what: &str) -> Result<()> {
        crate::process::wait_polling(stream, what, self.shared.timeout, || {
            if self.shared.aborted() {
                Err(DeviceError::Aborted("the group stopped".into()))
            } else {
                Ok(())
            }
        })
    }

    fn barrier(&self) -> Result<()> {
        self.shared
            .barrier
            .wait(self.shared.timeout)
            .map_err(|e| DeviceError::Timeout(e.to_string()))
    }

    fn load(&mut self, rows: &[f32]) -> Result<()> {
        match &mut self.factors {
            Some(f) if f.data.len() == rows.len() => self
                .gpu
                .stream()
                .memcpy_htod(rows, &mut f.data)
                .map_err(driver("uploading the factors"))?,
            _ => {
                self.factors = None;
                self.factors = Some(DeviceFactors::upload_rows(
                    &self.gpu, &self.dims, self.rank, rows,
                )?);
            }
        }
        if self.dense.is_none() {
            self.dense = Some(DenseKernels::new(self.gpu.clone(), self.rank)?);
        }
        let f = self.factors.as_ref().expect("loaded above");
        let (ptr, _sync) = f.data.device_ptr(self.gpu.stream());
        self.shared.factor_ptrs.lock().expect("pointer table")[self.slot] = ptr;
        drop(_sync);
        self.wait(self.gpu.stream(), "the factor upload")
    }

    /// This GPU's output buffer of `mode` (its rows only).
    fn output(&mut self, mode: usize) -> Result<&mut CudaSlice<f32>> {
        if self.outputs[mode].is_none() {
            let len = self.shared.rows[mode][self.g].len() * self.rank;
            self.outputs[mode] = Some(self.gpu.alloc_zeros("an MTTKRP output", len)?);
        }
        Ok(self.outputs[mode].as_mut().expect("allocated above"))
    }

    /// ISP length for a launch over `count` elements.
    fn isp_len(&self, count: u64) -> u64 {
        let target = self.gpu.properties().sms.max(1) as u64 * ISPS_PER_SM;
        count.div_ceil(target).max(256)
    }

    fn mttkrp(&mut self, mode: usize) -> Result<()> {
        let n = self.dims.len();
        let defines = [
            ("NMODES", n as i64),
            ("RANK", self.rank as i64),
            ("WARPS", WARPS as i64),
        ];
        let kernel =
            self.gpu
                .kernels()
                .function(self.gpu.context(), Kernel::MttkrpShard, &defines)?;
        if self.fault == Some(self.calls) {
            let trap =
                self.gpu
                    .kernels()
                    .function(self.gpu.context(), Kernel::ShardFault, &defines)?;
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the kernel takes no arguments; it traps on purpose.
            unsafe { self.gpu.stream().launch_builder(&trap).launch(cfg) }
                .map_err(driver("launching the fault kernel"))?;
        }
        self.calls += 1;
        if self.factors.is_none() {
            return Err(DeviceError::Shape("no factors loaded".into()));
        }
        let row_lo = self.shared.rows[mode][self.g].start;
        let main = self.gpu.stream().clone();
        let start = self.gpu.timing_event()?;
        let end = self.gpu.timing_event()?;
        {
            let out = self.output(mode)?;
            main.memset_zeros(out)
                .map_err(driver("zeroing the output"))?;
        }
        start.record(&main).map_err(driver("recording an event"))?;
        let mut launches = Vec::new();
        let at = (row_lo, mode as i32);
        match &self.shards[mode] {
            Shard::Resident { elems, count } => {
                let (count, isp) = (*count, self.isp_len(*count));
                if count > 0 {
                    let factors = self.factors.as_ref().expect("checked above");
                    let out = self.outputs[mode].as_mut().expect("allocated above");
                    // SAFETY: `elems` holds the shard's `count` elements.
                    unsafe { launch_shard(&main, &kernel, elems, factors, out, &at, count, isp) }?;
                    let done = self.gpu.timing_event()?;
                    done.record(&main).map_err(driver("recording an event"))?;
                    launches.push((None, done));
                }
            }
            Shard::Streamed { host, first, count } => {
                let (host, first, count) = (host.clone(), *first, *count);
                let stride = n + 1;
                let seg = self.segment_elems;
                if self.segment_bufs.is_empty() {
                    for _ in &self.streams {
                        let buf = self
                            .gpu
                            .alloc_zeros::<u32>("a stream segment buffer", seg as usize * stride)?;
                        self.segment_bufs.push(buf);
                    }
                }
                for s in &self.streams {
                    s.wait(&start).map_err(driver("ordering the streams"))?;
                }
                let base = host.as_ptr().map_err(driver("reading pinned memory"))?;
                let segments = count.div_ceil(seg);
                for s in 0..segments {
                    let k = (s as usize) % self.streams.len();
                    let stream = self.streams[k].clone();
                    let len = seg.min(count - s * seg);
                    let lo = (first + s * seg) as usize * stride;
                    // SAFETY: `host` holds the whole mode's elements and
                    // outlives the copy (the Arc is kept in `shards`); the
                    // range lies inside this GPU's shard.
                    let src =
                        unsafe { std::slice::from_raw_parts(base.add(lo), len as usize * stride) };
                    let c0 = self.gpu.timing_event()?;
                    let c1 = self.gpu.timing_event()?;
                    let k1 = self.gpu.timing_event()?;
                    c0.record(&stream).map_err(driver("recording an event"))?;
                    let buf = &mut self.segment_bufs[k];
                    stream
                        .memcpy_htod(src, &mut buf.slice_mut(..len as usize * stride))
                        .map_err(driver("copying a segment"))?;
                    c1.record(&stream).map_err(driver("recording an event"))?;
                    let isp = self.isp_len(len);
                    let factors = self.factors.as_ref().expect("checked above");
                    let out = self.outputs[mode].as_mut().expect("allocated above");
                    let buf = &self.segment_bufs[k];
                    // SAFETY: the buffer holds the segment's `len` elements,
                    // copied just before on the same stream.
                    unsafe { launch_shard(&stream, &kernel, buf, factors, out, &at, len, isp) }?;
                    k1.record(&stream).map_err(driver("recording an event"))?;
                    launches.push((Some((c0, c1)), k1));
                }
                for s in &self.streams {
                    main.join(s).map_err(driver("joining the streams"))?;
                }
            }
        }
        end.record(&main).map_err(driver("recording an event"))?;
        self.last = Some(Recorded {
            start,
            end,
            launches,
        });
        Ok(())
    }

    fn sync(&mut self) -> Result<MttkrpTimes> {
        self.wait(&self.gpu.stream().clone(), "the MTTKRP")?;
        let Some(rec) = self.last.take() else {
            return Ok(MttkrpTimes::default());
        };
        let ms = |a: &CudaEvent, b: &CudaEvent| -> Result<f64> {
            Ok(f64::from(
                a.elapsed_ms(b).map_err(driver("reading an event"))?,
            ))
        };
        let total_ms = ms(&rec.start, &rec.end)?;
        // Busy time of the copies and of the kernels: each interval counts
        // from when it could start (its own start, or the end of the
        // previous one of its kind) so waiting in a queue is not counted.
        let (mut h2d_ms, mut kernel_ms) = (0.0, 0.0);
        let mut prev_copy: Option<&CudaEvent> = None;
        let mut prev_kernel: &CudaEvent = &rec.start;
        for (copy, kernel_end) in &rec.launches {
            let kernel_start = match copy {
                Some((c0, c1)) => {
                    let from = match prev_copy {
                        Some(p) if ms(c0, p)? > 0.0 => p,
                        _ => c0,
                    };
                    h2d_ms += ms(from, c1)?.max(0.0);
                    prev_copy = Some(c1);
                    if ms(c1, prev_kernel)? > 0.0 {
                        prev_kernel
                    } else {
                        c1
                    }
                }
                None => prev_kernel,
            };
            kernel_ms += ms(kernel_start, kernel_end)?.max(0.0);
            prev_kernel = kernel_end;
        }
        Ok(MttkrpTimes {
            total_ms,
            h2d_ms,
            kernel_ms,
        })
    }

    fn update(&mut self, mode: usize, w: &[f64]) -> Result<UpdateStats> {
        let rows = self.shared.rows[mode][self.g].clone();
        let r = self.rank;
        if rows.is_empty() {
            return Ok(UpdateStats {
                sumsq: vec![0.0; r],
                max_abs: vec![0.0; r],
                inner: vec![0.0; r],
            });
        }
        self.wait(&self.gpu.stream().clone(), "the MTTKRP")?;
        self.output(mode)?;
        let m = self.outputs[mode].as_ref().expect("allocated above");
        let (dense, mut own) = own_rows(&mut self.factors, &mut self.dense, mode, rows.clone())?;
        dense.update(m, w, &mut own, rows.len())
    }

    fn scale_gram(&mut self, mode: usize, inv: Option<&[f32]>) -> Result<Vec<f64>> {
        let rows = self.shared.rows[mode][self.g].clone();
        let r = self.rank;
        if rows.is_empty() {
            return Ok(vec![0.0; r * r]);
        }
        let (dense, mut own) = own_rows(&mut self.factors, &mut self.dense, mode, rows.clone())?;
        dense.scale_gram(&mut own, inv, rows.len())
    }

    fn exchange(&mut self, mode: usize) -> Result<f64> {
        let started = Instant::now();
        let stream = self.gpu.stream().clone();
        let m = self.shared.rows[mode].len();
        let r = self.rank as u64;
        let block = |b: usize| -> (u64, usize) {
            let rows = &self.shared.rows[mode][b];
            let first = (self.shared.first_row[mode] + u64::from(rows.start)) * r;
            (first * 4, rows.len() * self.rank)
        };
        let own_ptr = self.shared.factor_ptrs.lock().expect("pointer table")[self.slot];
        match &self.shared.collective {
            Some(collective) => {
                let (nccl, comm) = collective.comm(self.slot);
                let nccl_err = |e: crate::nccl::NcclError| DeviceError::Nccl(e.to_string());
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

/// A worker's rows `rows` of `mode` in its factor buffer, with the dense
/// kernels that update them (fields of the worker, borrowed apart from the
/// MTTKRP output the update reads).
fn own_rows<'a>(
    factors: &'a mut Option<DeviceFactors>,
    dense: &'a mut Option<DenseKernels>,
    mode: usize,
    rows: Range<u32>,
) -> Result<(&'a mut DenseKernels, cudarc::driver::CudaViewMut<'a, f32>)> {
    let factors = factors
        .as_mut()
        .ok_or_else(|| DeviceError::Shape("no factors loaded".into()))?;
    let dense = dense.as_mut().expect("made with the factors");
    Ok((dense, factors.rows_mut(mode, rows)))
}

/// Queues the shard kernel on `stream` over `count` elements of `elems`
/// in ISPs of `isp`, for output rows starting at `at.0` of mode `at.1`.
///
/// # Safety
/// `elems` must hold `count` elements of NMODES + 1 words whose indices
/// are below each mode's dimension (relabeled by the group's RowShards),
/// the output mode's inside this GPU's rows, so that every factor read
/// lies inside `factors` and every output write inside `out`.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_shard(
    stream: &Arc<CudaStream>,
    kernel: &cudarc::driver::CudaFunction,
    elems: &CudaSlice<u32>,
    factors: &DeviceFactors,
    out: &mut CudaSlice<f32>,
    at: &(u32, i32),
    count: u64,
    isp: u64,
) -> Result<()> {
    let mut l = stream.launch_builder(kernel);
    l.arg(elems)
        .arg(&count)
        .arg(&isp)
        .arg(&factors.data)
        .arg(&factors.row_offset)
        .arg(out)
        .arg(&at.0)
        .arg(&at.1);
    // SAFETY: the caller's contract.
    unsafe { l.launch(shard_config(count, isp)) }.map_err(driver("launching mttkrp_shard"))?;
    Ok(())
}

fn shard_config(count: u64, isp: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (count.div_ceil(isp).max(1) as u32, 1, 1),
        block_dim: ((WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
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

    #[test]
    fn bad_groups_are_errors_not_panics() {
        let t = kruskal_formats::generate::power_law(
            &kruskal_formats::generate::PowerLawSpec::new(vec![20, 30, 40], 500).with_draws(),
        )
        .unwrap();
        let opts = GroupOptions::default();
        let mut quiet = |_: &str| {};
        assert!(GpuGroup::new(&[], &t, 8, &opts, &mut quiet).is_err());
        assert!(GpuGroup::new(&[0, 0], &t, 8, &opts, &mut quiet).is_err());
        assert!(GpuGroup::new(&[0], &t, 0, &opts, &mut quiet).is_err());
    }
}
