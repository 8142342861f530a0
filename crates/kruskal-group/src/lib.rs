//! Several GPUs as one group for kruskal's CPD: the GPUs of one host
//! (AMPED), or one GPU per process of a job ([`GpuGroup::distributed`] over
//! a [`ProcessComm`]): one worker thread per GPU, the tensor's shards
//! resident on their GPUs or streamed from pinned host memory, factor rows
//! exchanged after every mode. The engines' kernels, the dense steps and
//! the GPU runtime are `kruskal_device`'s; this crate schedules them over
//! several GPUs.
//!
//! - [`nccl`]: NCCL, found and loaded by kruskal (`libnccl.so.2`).
//! - [`process`]: this process's GPU in a job of several processes (the
//!   NCCL communicator across them). How the processes find each other,
//!   agree on rank 0's NCCL unique id and notice a lost peer needs no GPU
//!   and lives in the `kruskal-launch` crate.
//!
//! - **Plan** ([`RowShards`]): each mode's output rows go to GPUs by LPT
//!   on their nonzero counts and are relabeled GPU by GPU, so GPU `g` owns
//!   one contiguous block of every relabeled factor. Every GPU keeps a full
//!   copy of every (relabeled) factor. A split plan ([`plan`]) gives every
//!   mode's nonzeros to the owners of one mode's rows instead: that mode's
//!   rows never travel, and the other modes' MTTKRPs are partial sums,
//!   reduced onto the rows' owners through NCCL before their update.
//! - **MTTKRP** (`kernels/mttkrp_shard.cu`): each GPU runs the `shard`
//!   kernel over its shard of the mode, cut into equal inter-shard
//!   partitions (ISPs), one thread block each; rows shared by ISPs combine
//!   by atomics inside the GPU only.
//! - **Update**: each GPU solves its own rows (`M V^+`, the fused dense
//!   kernels of [`kruskal_device::dense`]) and returns column statistics and a
//!   partial Gram matrix; the coordinator sums them in GPU order (an
//!   all-reduce of R x R values that the CPD driver needs on the host
//!   anyway).
//! - **Exchange**: the updated blocks are all-gathered around the ring,
//!   by NCCL (a grouped in-place broadcast per owner: all-gather with
//!   uneven counts) or by peer-to-peer copies (AMPED Algorithm 3: M - 1
//!   steps, each GPU passing one block to the next with a barrier between
//!   steps). NCCL is the default when it loads ([`crate::nccl`]). Where a
//!   mode's rows are read by few GPUs, only the rows each GPU reads are
//!   sent (`sparse.rs`, [`RowExchange`]).
//! - **Streaming** (ScalFrag, AMPED's out-of-memory case): a shard that
//!   does not fit stays in pinned host memory and is copied in segments
//!   on several streams, each segment's kernel overlapping the next
//!   segment's copy. Decided per GPU and mode from free memory.
//! - **Failure**: every wait has a deadline. When a GPU fails, the group
//!   aborts (NCCL communicators are aborted so peers stop waiting) and the
//!   error names the GPU; later calls fail at once.
//!
//! The files, one concept each: this one the [`GpuGroup`] API (building
//! the group, the commands the CPD driver sends to every GPU and the
//! gathering of their replies); `worker.rs` the worker thread of one GPU
//! and its work; `residency.rs` where each shard lives ([`Residency`],
//! [`StreamPolicy`]); `exchange.rs` the row exchange between the GPUs
//! (NCCL or peer-to-peer copies) and the state the workers share;
//! `sparse.rs` the exchange of only the rows each GPU reads; [`plan`] the
//! choice between rows by owner and a split plan.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, DevicePtr};
use kruskal_formats::SparseTensor;
use kruskal_partition::{RowReaders, RowShards};
use ndarray::Array2;

use crate::nccl::Reduce;
use kruskal_device::dense::{UpdateStats, check_rank};
use kruskal_device::{DeviceError, FcooBuild, Gpu, Result, driver};

mod build;
mod exchange;
pub mod nccl;
pub mod plan;
pub mod process;
mod residency;
mod sparse;
mod worker;

pub use exchange::{Exchange, enable_peer_access};
pub use plan::{PlanChoice, PlanDecision};
pub use process::{CommAbort, ProcessComm};
pub use residency::{Residency, StreamPolicy};
pub use sparse::{ExchangeVolume, RowExchange};
pub use worker::WARPS;

use exchange::{ChosenExchange, Collective, CopyReduce, Shared, TimedBarrier};
use residency::{decide_residency, resident_bytes};
use sparse::{DeviceLists, SparsePlan};
use worker::{Cmd, Reply, Shard, Worker, WorkerHandle};

/// Options of a group.
#[derive(Clone, Debug)]
pub struct GroupOptions {
    /// `None`: NCCL when it loads, else peer-to-peer copies.
    pub exchange: Option<Exchange>,
    /// Which rows the exchange after a mode sends.
    pub rows: RowExchange,
    /// Rows by owner, or split by one mode ([`plan`]).
    pub plan: PlanChoice,
    /// Where the shards are built: on the GPUs (each its own, where every
    /// shard stays resident and the build fits; the host otherwise) or on
    /// the host.
    pub build: FcooBuild,
    /// When shards are streamed from host memory.
    pub stream: StreamPolicy,
    /// CUDA streams a streamed shard is copied on.
    pub streams: usize,
    /// Bytes per streamed segment.
    pub segment_bytes: usize,
    /// Longest wait for any GPU operation.
    pub timeout: Duration,
    /// How a split plan's partial sums reach their owners in one process:
    /// by NCCL (the default), by peer reads of the rows read where only
    /// those are exchanged (where every pair of GPUs has peer access), or
    /// by peer copies beside the MTTKRP (where every pair has peer access
    /// and every shard stays resident). See [`PartialReduce`].
    pub reduce: PartialReduce,
    /// Test hook: GPU `.0` runs a trapping kernel before its `.1`-th
    /// MTTKRP (counted from 0), putting it into a real CUDA error. Used
    /// by the failure tests only (`None` everywhere else); always compiled,
    /// so that the tests and the program build this crate alike.
    #[doc(hidden)]
    pub fault: Option<(usize, usize)>,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            exchange: None,
            rows: RowExchange::Auto,
            plan: PlanChoice::Auto,
            build: FcooBuild::Device,
            stream: StreamPolicy::Auto,
            streams: 3,
            segment_bytes: 256 << 20,
            timeout: Duration::from_secs(300),
            reduce: PartialReduce::Nccl,
            fault: None,
        }
    }
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
    /// After the MTTKRP, the reduction of a partial mode's sums onto
    /// their owners (a split plan; 0 otherwise).
    pub reduce_ms: f64,
    /// The exchange left running before this MTTKRP
    /// ([`GpuGroup::scale_gram_exchange`]): its mode and milliseconds
    /// (CUDA events), read once the stream had passed it.
    pub exchanged: Option<(usize, f64)>,
}

/// What a [`GpuGroup::update`] waited for before it ran, and its time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Waited {
    /// Per GPU, the MTTKRP the update waited for (empty when
    /// [`GpuGroup::sync`] had taken its times already, the MTTKRP's own
    /// fields 0), with any exchange left running before it.
    pub times: Vec<MttkrpTimes>,
    /// The update itself once the MTTKRP was done, slowest GPU (ms).
    pub update_ms: f64,
}

/// Several GPUs running one CPD together.
pub struct GpuGroup {
    /// This process's GPUs.
    gpus: Vec<Arc<Gpu>>,
    /// Each local GPU's index in the plan (`0..m` in one process; the
    /// rank across processes).
    members: Vec<usize>,
    plan: RowShards,
    /// Why the plan is what it is (`None` across processes).
    plan_note: Option<String>,
    rank: usize,
    exchange: Option<Exchange>,
    exchange_note: Option<String>,
    /// Per mode, what its exchange moves.
    volumes: Vec<ExchangeVolume>,
    residency: Vec<Vec<Residency>>,
    workers: Vec<WorkerHandle>,
    replies: Receiver<(usize, Result<Reply>)>,
    shared: Arc<Shared>,
    timeout: Duration,
    failed: Option<String>,
    /// Wall time of the all-reduces across processes since the last
    /// [`GpuGroup::take_across_ms`] (ms).
    across_ms: f64,
    /// What the last update's workers waited for, and its time.
    waited: Waited,
    /// Across processes, the Gram of the rows the last update wrote before
    /// their scaling (its mode), all-reduced with the update's statistics:
    /// the mode's [`GpuGroup::scale_gram_exchange`] scales it on the host
    /// instead of all-reducing a Gram of its own.
    raw_gram: Option<(usize, Vec<f64>)>,
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
        // The GPUs open (each on its own thread) while the rows are planned.
        let m = ordinals.len();
        let started = Instant::now();
        let (gpus, plan) = std::thread::scope(|s| {
            let opening: Vec<_> = ordinals
                .iter()
                .map(|&o| s.spawn(move || Gpu::open(o)))
                .collect();
            let plan = RowShards::new(t, m).map_err(prepare).and_then(|mut plan| {
                let note = choose_plan(&mut plan, opts)?;
                // Rows of a mode read by few GPUs go to one of their
                // readers, so a sparse exchange (and a split plan's
                // reduction) sends them to fewer.
                let pull = opts.reduce == PartialReduce::Pull;
                for (mode, prefer) in sparse::modes_to_prefer(&plan, opts.rows, pull)
                    .into_iter()
                    .enumerate()
                {
                    if prefer {
                        plan.prefer_readers(t, mode).map_err(prepare)?;
                    }
                }
                Ok((plan, note))
            });
            let planned_s = started.elapsed().as_secs_f64();
            let gpus = opening
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect::<Result<Vec<_>>>();
            (gpus, plan.map(|p| (p, planned_s)))
        });
        let gpus = gpus?;
        let ((plan, plan_note), planned_s) = plan?;
        progress(&format!(
            "planned {} modes over {m} GPU(s) in {planned_s:.1} s (GPUs opened meanwhile, \
             {:.1} s in all)",
            t.nmodes(),
            started.elapsed().as_secs_f64()
        ));
        let n = t.nmodes();
        // The rows each GPU reads, marked from its shards as they are built.
        let marked = sparse::modes_to_mark(&plan, opts.rows);
        let mut readers = RowReaders::for_modes(&plan, &marked).map_err(prepare)?;

        // Residency per GPU and mode.
        let free = gpus
            .iter()
            .map(|gpu| gpu.free_bytes())
            .collect::<Result<Vec<_>>>()?;
        let residency = gpus
            .iter()
            .enumerate()
            .map(|(g, gpu)| {
                decide_residency(&plan, g, gpu.properties().ordinal, free[g], rank, opts)
            })
            .collect::<Result<Vec<_>>>()?;
        // Each GPU builds its own shards where all of them stay resident
        // and the build fits beside them; the host builds them otherwise.
        let on_device = opts.build == FcooBuild::Device
            && (0..m).all(|g| {
                residency[g].iter().all(|r| *r == Residency::Resident)
                    && build::fits(&plan, g, t.nnz(), resident_bytes(&plan, g, rank), free[g])
            });
        // NCCL's communicators start on a thread of their own meanwhile.
        // A split plan's reduction by peer copies needs every shard
        // resident and each GPU's nonzeros per owner (counted meanwhile).
        let copy_candidate = m > 1
            && opts.reduce == PartialReduce::Copies
            && plan.split().is_some()
            && residency
                .iter()
                .all(|r| r.iter().all(|x| *x == Residency::Resident));
        let (shards, mut chosen, pairs) = std::thread::scope(|s| -> Result<_> {
            let nccl = s.spawn(|| exchange::choose(ordinals, &gpus, opts.exchange));
            let pairs = s.spawn(|| -> Result<Vec<Option<Vec<u64>>>> {
                (0..n)
                    .map(|mode| {
                        if copy_candidate && plan.partial(mode) {
                            plan.owner_counts(t, mode).map(Some).map_err(prepare)
                        } else {
                            Ok(None)
                        }
                    })
                    .collect()
            });
            let shards = if on_device {
                let t0 = Instant::now();
                let built: Vec<Result<build::Built>> = std::thread::scope(|s| {
                    let (plan, marked) = (&plan, &marked);
                    let handles: Vec<_> = gpus
                        .iter()
                        .enumerate()
                        .map(|(g, gpu)| s.spawn(move || build::build(gpu, t, plan, g, marked)))
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                        .collect()
                });
                let mut shards: Vec<Vec<Shard>> = Vec::with_capacity(m);
                for (g, b) in built.into_iter().enumerate() {
                    let b = b?;
                    if let Some(bits) = &b.bitmap {
                        readers.merge_bitmap(g, bits).map_err(prepare)?;
                    }
                    shards.push(
                        b.shards
                            .into_iter()
                            .map(|(elems, count)| Shard::Resident { elems, count })
                            .collect(),
                    );
                }
                progress(&format!(
                    "shards of {n} modes built on the GPUs in {:.1} s",
                    t0.elapsed().as_secs_f64()
                ));
                shards
            } else {
                Self::host_shards(t, &plan, &gpus, &residency, &readers, progress)?
            };
            let chosen = nccl
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))?;
            let pairs = pairs
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))?;
            Ok((shards, chosen, pairs))
        })?;
        if pairs.iter().any(Option::is_some)
            && chosen.exchange == Some(Exchange::Nccl)
            && exchange::enable_peer_access(&gpus)?
        {
            chosen.copy_reduce = pairs;
        }
        // Peer reads of the rows read, where asked for and every pair has
        // peer access.
        chosen.pull = m > 1
            && opts.reduce == PartialReduce::Pull
            && plan.split().is_some()
            && chosen.exchange == Some(Exchange::Nccl)
            && exchange::enable_peer_access(&gpus)?;

        // Which rows travel.
        let members: Vec<usize> = (0..m).collect();
        let rows = if chosen.exchange == Some(Exchange::P2p) && !chosen.direct {
            // Pulling rows needs peer access between every pair.
            RowExchange::All
        } else {
            opts.rows
        };
        let t0 = Instant::now();
        let sparse = sparse::plan_modes(&plan, &readers, &marked, rows, &members, chosen.pull)?;
        drop(readers);
        if marked.iter().any(|&x| x) {
            progress(&format!(
                "exchange lists of {} mode(s) in {:.1} s",
                marked.iter().filter(|&&x| x).count(),
                t0.elapsed().as_secs_f64()
            ));
        }
        let mut group = Self::start(
            gpus, members, plan, rank, residency, shards, chosen, sparse, opts,
        )?;
        group.plan_note = Some(plan_note);
        Ok(group)
    }

    /// The shards built on the host, one mode at a time: uploaded to their
    /// GPUs, or kept in pinned memory for streaming. The rows each GPU's
    /// shards read are marked in `readers` on the way.
    fn host_shards(
        t: &SparseTensor,
        plan: &RowShards,
        gpus: &[Arc<Gpu>],
        residency: &[Vec<Residency>],
        readers: &RowReaders,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Vec<Vec<Shard>>> {
        let (m, n, stride) = (gpus.len(), t.nmodes(), plan.stride());
        let words = t.nnz() * stride;
        let mut shards: Vec<Vec<Shard>> = (0..m).map(|_| Vec::with_capacity(n)).collect();
        // One buffer for every mode whose shards all stay resident.
        let mut resident_buf: Vec<u32> = Vec::new();
        for mode in 0..n {
            let t0 = Instant::now();
            let any_streamed = residency.iter().any(|r| r[mode] != Residency::Resident);
            let fill = |buf: &mut [u32]| plan.fill_elements(t, mode, buf).map_err(prepare);
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
                mark(readers, mode, buf, &offsets, stride)?;
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
                resident_buf.resize(words, 0);
                let offsets = fill(&mut resident_buf)?;
                mark(readers, mode, &resident_buf, &offsets, stride)?;
                for g in 0..m {
                    let range = (offsets[g] as usize * stride)..(offsets[g + 1] as usize * stride);
                    shards[g].push(Shard::Resident {
                        elems: gpus[g].upload("a shard", &resident_buf[range])?,
                        count: offsets[g + 1] - offsets[g],
                    });
                }
            }
            progress(&format!(
                "mode {}: shards built on the host and placed in {:.1} s ({})",
                mode + 1,
                t0.elapsed().as_secs_f64(),
                if any_streamed {
                    "pinned for streaming"
                } else {
                    "resident"
                }
            ));
        }
        Ok(shards)
    }

    /// This process's part of a group spread over several processes, one
    /// GPU each (possibly on several hosts): `pc` is its communicator
    /// (rank `pc.rank()` of `pc.world()`), `plan` the plan over all of them
    /// (made the same way on every rank, e.g. with
    /// [`RowShards::from_counts`] and [`choose_plan`], whose line is
    /// `plan_note`; a split plan's partial sums are reduced through the
    /// communicator), and `shards[mode]` this rank's elements of each mode
    /// ([`RowShards::local_elements`]). Rows are exchanged, and Grams and
    /// column statistics all-reduced, through NCCL; every rank must make
    /// the same calls in the same order.
    pub fn distributed(
        pc: ProcessComm,
        plan: RowShards,
        plan_note: Option<String>,
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
        let free = gpu.free_bytes()?;
        let residency = decide_residency(&plan, g, gpu.properties().ordinal, free, rank, opts)?;
        let t0 = Instant::now();
        let mut placed = Vec::with_capacity(n);
        for (mode, elems) in shards.iter().enumerate() {
            let count = plan.nnz(mode, g);
            placed.push(match residency[mode] {
                Residency::Resident => Shard::Resident {
                    elems: gpu.upload("a shard", elems)?,
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
                        .copy_from_slice(elems);
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
        // The rows every rank reads: each marks its own, and the marks
        // travel as bitmaps (an all-reduce of a buffer that is zero outside
        // each rank's slot), so every rank derives the same lists.
        let t0 = Instant::now();
        let marked = sparse::modes_to_mark(&plan, opts.rows);
        let mut readers = RowReaders::for_modes(&plan, &marked).map_err(prepare)?;
        if marked.iter().any(|&x| x) {
            for (mode, elems) in shards.iter().enumerate() {
                readers.mark(g, mode, elems).map_err(prepare)?;
            }
            let words = readers.bitmap_words();
            let world = pc.world();
            let mut all = vec![0f64; world * words];
            for (slot, &w) in all[g * words..(g + 1) * words]
                .iter_mut()
                .zip(&readers.bitmap(g))
            {
                *slot = f64::from(w);
            }
            pc.all_reduce(&mut all, Reduce::Sum)?;
            for (rank_g, bits) in all.chunks_exact(words.max(1)).enumerate().take(world) {
                if rank_g == g {
                    continue;
                }
                let bits: Vec<u32> = bits.iter().map(|&x| x as u32).collect();
                readers.merge_bitmap(rank_g, &bits).map_err(prepare)?;
            }
        }
        drop(shards);
        let sparse = sparse::plan_modes(&plan, &readers, &marked, opts.rows, &[g], false)?;
        drop(readers);
        if marked.iter().any(|&x| x) {
            progress(&format!(
                "rank {g}: exchange lists of {} mode(s) in {:.1} s",
                marked.iter().filter(|&&x| x).count(),
                t0.elapsed().as_secs_f64()
            ));
        }
        let chosen = ChosenExchange {
            exchange: Some(Exchange::Nccl),
            note: None,
            collective: Some(Collective::Process(Arc::new(pc))),
            direct: false,
            copy_reduce: Vec::new(),
            pull: false,
        };
        let mut group = Self::start(
            vec![gpu],
            vec![g],
            plan,
            rank,
            vec![residency],
            vec![placed],
            chosen,
            sparse,
            opts,
        )?;
        group.plan_note = plan_note;
        Ok(group)
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
        chosen: ChosenExchange,
        sparse: SparsePlan,
        opts: &GroupOptions,
    ) -> Result<Self> {
        let ChosenExchange {
            exchange,
            note: mut exchange_note,
            collective,
            copy_reduce,
            pull,
            ..
        } = chosen;
        let SparsePlan {
            modes: sparse_modes,
            lists: host_lists,
        } = sparse;
        let volumes = (0..plan.dims().len())
            .map(|mode| sparse::volume(&plan, mode, rank, sparse_modes[mode].as_ref()))
            .collect();
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
        // Receive buffers of the reductions by peer copies, per local GPU
        // and mode: a block of the owner's rows with nonzeros per other
        // GPU. Where one does not fit, NCCL reduces every mode instead.
        let mut reduce_bufs: Vec<Vec<Option<CudaSlice<f32>>>> =
            (0..m).map(|_| (0..n).map(|_| None).collect()).collect();
        let mut copy_modes: Vec<Option<CopyReduce>> = (0..n).map(|_| None).collect();
        if copy_reduce.iter().any(Option::is_some) {
            let built = (0..n)
                .map(|mode| -> Result<Option<CopyReduce>> {
                    let Some(pairs) = copy_reduce.get(mode).and_then(Option::as_ref) else {
                        return Ok(None);
                    };
                    let mut recv = Vec::with_capacity(m);
                    for (slot, gpu) in gpus.iter().enumerate() {
                        let live = plan.rows_with_nonzeros(mode, slot).len();
                        let buf = gpu.alloc_zeros::<f32>(
                            "a receive buffer of the partial sums",
                            (m - 1) * live * rank,
                        )?;
                        recv.push(buf.device_ptr(gpu.stream()).0);
                        reduce_bufs[slot][mode] = Some(buf);
                    }
                    let offsets = (0..m)
                        .map(|g| {
                            std::iter::once(0)
                                .chain(pairs[g * m..(g + 1) * m].iter().scan(0u64, |acc, &c| {
                                    *acc += c;
                                    Some(*acc)
                                }))
                                .collect()
                        })
                        .collect();
                    Ok(Some(CopyReduce { offsets, recv }))
                })
                .collect::<Result<Vec<_>>>();
            match built {
                Ok(modes) => {
                    copy_modes = modes;
                    exchange_note = Some(
                        "nccl; a split plan's partial sums reach their owners by peer copies \
                         beside the MTTKRP"
                            .into(),
                    );
                }
                Err(_) => reduce_bufs.iter_mut().flatten().for_each(|b| *b = None),
            }
        }
        // Peer reads carry only the modes exchanged sparsely.
        let pull = pull && sparse_modes.iter().any(Option::is_some);
        if pull {
            exchange_note = Some(
                "nccl; the rows exchanged sparsely, and a split plan's partial sums of them, \
                 travel by peer reads"
                    .into(),
            );
        }
        let copying = copy_modes.iter().any(Option::is_some);
        let shared = Arc::new(Shared {
            abort: AtomicBool::new(false),
            barrier: TimedBarrier::new(m),
            factor_ptrs: Mutex::new(vec![0; m]),
            output_ptrs: Mutex::new(vec![vec![0; m]; n]),
            pull,
            contexts: gpus.iter().map(|g| g.context().clone()).collect(),
            rows: (0..n)
                .map(|mode| (0..plan.gpus()).map(|g| plan.rows(mode, g)).collect())
                .collect(),
            live: (0..n)
                .map(|mode| {
                    (0..plan.gpus())
                        .map(|g| plan.rows_with_nonzeros(mode, g))
                        .collect()
                })
                .collect(),
            first_row,
            sparse: sparse_modes,
            partial: (0..n).map(|mode| plan.partial(mode)).collect(),
            local: (0..n).map(|mode| plan.split() == Some(mode)).collect(),
            copy_reduce: copy_modes,
            sent: Mutex::new(
                (0..plan.gpus())
                    .map(|_| (0..plan.gpus()).map(|_| None).collect())
                    .collect(),
            ),
            collective,
            timeout: opts.timeout,
        });

        let (reply_tx, replies) = mpsc::channel();
        let mut workers = Vec::with_capacity(m);
        for (slot, ((shards, lists), reduce_bufs)) in shards
            .into_iter()
            .zip(host_lists)
            .zip(reduce_bufs)
            .enumerate()
        {
            let gpu = &gpus[slot];
            let lists = lists
                .iter()
                .map(|l| l.as_ref().map(|l| DeviceLists::upload(gpu, l)).transpose())
                .collect::<Result<Vec<_>>>()?;
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
                lists,
                send_buf: None,
                recv_buf: None,
                updated: vec![false; n],
                exchanged: vec![false; n],
                admm: None,
                admm_rows: false,
                copy_stream: if copying {
                    Some(
                        gpu.context()
                            .new_stream()
                            .map_err(driver("creating a copy stream"))?,
                    )
                } else {
                    None
                },
                reduce_bufs,
                running: None,
                calls: 0,
                fault: opts
                    .fault
                    .and_then(|(gpu, call)| (gpu == g).then_some(call)),
            };
            workers.push(worker.spawn(reply_tx.clone())?);
        }
        Ok(GpuGroup {
            gpus,
            members,
            plan,
            plan_note: None,
            rank,
            exchange,
            exchange_note,
            volumes,
            residency,
            workers,
            replies,
            shared,
            timeout: opts.timeout,
            failed: None,
            across_ms: 0.0,
            raw_gram: None,
            waited: Waited::default(),
        })
    }

    /// This process's GPUs, in slot order.
    pub fn gpus(&self) -> &[Arc<Gpu>] {
        &self.gpus
    }

    /// The row plan over every GPU of the group.
    pub fn plan(&self) -> &RowShards {
        &self.plan
    }

    /// Why the group's plan is rows by owner or split by a mode, with the
    /// rows each would send (`None` for a group across processes, whose
    /// plan is always rows by owner).
    pub fn plan_note(&self) -> Option<&str> {
        self.plan_note.as_deref()
    }

    /// The CPD rank (columns of every factor).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The exchange in use (`None` with one GPU).
    pub fn exchange(&self) -> Option<Exchange> {
        self.exchange
    }

    /// What the exchange after `mode` moves per call: only the rows read,
    /// or the all-gather, and the bytes of both.
    pub fn exchange_volume(&self, mode: usize) -> ExchangeVolume {
        self.volumes[mode]
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

    /// One line per local GPU: device, and per mode its nonzeros, owned rows
    /// (those with nonzeros) and residency.
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
                        let rows = self.plan.rows(mode, g).len();
                        let live = self.plan.rows_with_nonzeros(mode, g).len();
                        format!(
                            "mode {} {} nnz {rows} rows ({live} with nonzeros) {r}",
                            mode + 1,
                            self.plan.nnz(mode, g)
                        )
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
        // Any command may change the rows the last update wrote: its Gram
        // serves only the mode's scaling that follows it at once.
        self.raw_gram = None;
        if let Some(why) = &self.failed {
            return Err(DeviceError::Aborted(why.clone()));
        }
        for &g in gpus {
            if self.workers[g].tx.send(cmd()).is_err() {
                return Err(self.fail(g, format!("its worker thread stopped before {what}"), None));
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
                Ok((g, Err(e))) => return Err(self.fail(g, what.to_string(), Some(e))),
                Err(RecvTimeoutError::Timeout) => {
                    let g = *gpus
                        .iter()
                        .find(|&&g| out[g].is_none())
                        .expect("a GPU is missing");
                    return Err(self.fail(
                        g,
                        format!("{what} did not finish within {} s", self.timeout.as_secs()),
                        None,
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
    /// and every later call fails with the same message. `what` is the step
    /// GPU `g` failed at, `source` its own error where it returned one.
    fn fail(&mut self, g: usize, what: String, source: Option<DeviceError>) -> DeviceError {
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
            what,
            source: source.map(kruskal_device::MemberError::new),
        };
        self.failed = Some(kruskal_device::error_line(&err));
        self.shared.abort.store(true, Ordering::SeqCst);
        self.shared.barrier.release();
        if let Some(c) = &self.shared.collective {
            c.abort(&self.failed.clone().unwrap_or_default());
        }
        err
    }

    /// Uploads `factors` (`dims[w] x rank`, original row order) to every
    /// GPU, relabeled, one mode at a time ([`GpuGroup::load_mode`]).
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
        for (mode, f) in factors.iter().enumerate() {
            self.load_mode(mode, f.clone())?;
        }
        Ok(())
    }

    /// Uploads mode `mode`'s factor (`dims[mode] x rank`, original row
    /// order) to every GPU, relabeled in place (the rows permuted along
    /// the label cycles): the host holds no second copy, so a caller that
    /// draws or reads the factors mode by mode holds one mode beyond the
    /// tensor at a time. The mode's update and exchange start again; every
    /// mode must be loaded before the first MTTKRP.
    pub fn load_mode(&mut self, mode: usize, factor: Array2<f32>) -> Result<()> {
        self.check_mode(mode)?;
        let d = self.plan.dims()[mode] as usize;
        let r = self.rank;
        if factor.nrows() != d || factor.ncols() != r {
            return Err(DeviceError::Shape(format!(
                "a factor of {} x {} for mode {} of {d} rows at rank {r}",
                factor.nrows(),
                factor.ncols(),
                mode + 1
            )));
        }
        let factor = if factor.is_standard_layout() {
            factor
        } else {
            factor.as_standard_layout().into_owned()
        };
        // A standard-layout array's elements are contiguous in its buffer
        // from the offset on; a buffer larger than them is cut to them.
        let (mut rows, offset) = factor.into_raw_vec_and_offset();
        let offset = offset.unwrap_or(0);
        if offset != 0 || rows.len() != d * r {
            rows.drain(..offset);
            rows.truncate(d * r);
        }
        permute_rows(&mut rows, r, self.plan.relabel(mode));
        let rows = Arc::new(rows);
        self.all(|| Cmd::Load(mode, rows.clone()), "loading the factors")?;
        Ok(())
    }

    /// Draws mode `mode`'s seeded initial factor on every GPU, in blocks
    /// of `block` floats: each GPU draws the mode in the original row
    /// order into a scratch copy (`uniform_fill`, the host's draw of the
    /// same seed bit for bit) and moves every row to its label, so nothing
    /// is drawn, permuted or uploaded on the host (on nell-1-like, 3.3 GB
    /// for its longest mode, per GPU). Returns false when some GPU has no
    /// room for the scratch copy: the caller then draws on the host and
    /// loads the mode ([`GpuGroup::load_mode`]), which overwrites whatever
    /// the others drew. The mode's update and exchange start again.
    pub fn draw_mode(&mut self, mode: usize, seed: u64, block: usize) -> Result<bool> {
        self.check_mode(mode)?;
        let labels = Arc::new(self.plan.relabel(mode).to_vec());
        let replies = self.all(
            || Cmd::Draw(mode, seed, block, labels.clone()),
            "drawing the factors",
        )?;
        Ok(replies.iter().all(|r| matches!(r, Reply::Drawn(true))))
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
        // Across processes the update also brings the Gram of its rows,
        // all-reduced below with the statistics.
        let across = self.process();
        let replies = if across.is_some() {
            self.all(|| Cmd::UpdateGram(mode, w.clone()), "the factor update")?
        } else {
            self.all(|| Cmd::Update(mode, w.clone()), "the factor update")?
        };
        let r = self.rank;
        let mut total = UpdateStats {
            sumsq: vec![0.0; r],
            max_abs: vec![0.0; r],
            inner: vec![0.0; r],
        };
        let mut gram = vec![0f64; r * r];
        self.waited = Waited::default();
        for reply in replies {
            let (s, times, ms) = match reply {
                Reply::Stats(s, times, ms) => (s, times, ms),
                Reply::StatsGram(s, g, times, ms) => {
                    gram.iter_mut().zip(&g).for_each(|(a, b)| *a += b);
                    (s, times, ms)
                }
                _ => continue,
            };
            self.waited.times.push(times);
            self.waited.update_ms = self.waited.update_ms.max(ms);
            for c in 0..r {
                total.sumsq[c] += s.sumsq[c];
                total.max_abs[c] = total.max_abs[c].max(s.max_abs[c]);
                total.inner[c] += s.inner[c];
            }
        }
        if let Some((me, world)) = across {
            // One collective for sums, maxima and the Gram: every rank's
            // three vectors gathered (an all-reduce of a buffer that is
            // zero outside each rank's slot), combined in rank order, and
            // the Gram summed after them.
            let slots = world * 3 * r;
            let mut all = vec![0f64; slots + r * r];
            let own = &mut all[me * 3 * r..(me + 1) * 3 * r];
            own[..r].copy_from_slice(&total.sumsq);
            own[r..2 * r].copy_from_slice(&total.inner);
            own[2 * r..].copy_from_slice(&total.max_abs);
            all[slots..].copy_from_slice(&gram);
            self.across(
                &mut all,
                Reduce::Sum,
                "the column statistics and the Gram matrix",
            )?;
            total.sumsq.fill(0.0);
            total.inner.fill(0.0);
            total.max_abs.fill(0.0);
            for slot in all[..slots].chunks_exact(3 * r) {
                for c in 0..r {
                    total.sumsq[c] += slot[c];
                    total.inner[c] += slot[r + c];
                    total.max_abs[c] = total.max_abs[c].max(slot[2 * r + c]);
                }
            }
            gram.copy_from_slice(&all[slots..]);
            self.raw_gram = Some((mode, gram));
        }
        Ok(total)
    }

    /// What the last [`GpuGroup::update`] waited for and took (empty once
    /// taken).
    pub fn take_waited(&mut self) -> Waited {
        std::mem::take(&mut self.waited)
    }

    /// All-reduces `data` across the processes (workers idle meanwhile, so
    /// the communicator has one user).
    fn across(&mut self, data: &mut [f64], op: Reduce, what: &str) -> Result<()> {
        let Some(Collective::Process(pc)) = &self.shared.collective else {
            return Ok(());
        };
        let pc = pc.clone();
        let t = Instant::now();
        let done = pc
            .all_reduce(data, op)
            .map_err(|e| self.fail(0, format!("all-reducing {what} across processes"), Some(e)));
        self.across_ms += t.elapsed().as_secs_f64() * 1e3;
        done
    }

    /// Milliseconds spent in the all-reduces across processes (column
    /// statistics and Grams) since the last call; 0 in one process.
    pub fn take_across_ms(&mut self) -> f64 {
        std::mem::take(&mut self.across_ms)
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

    /// [`GpuGroup::scale_gram`] with the scales `inv`, then the mode's
    /// exchange ([`GpuGroup::exchange_rows`]) in the same command, so no
    /// GPU idles for a round trip between the two (across processes the
    /// worker all-reduces the Gram before it queues the exchange). An
    /// exchange by NCCL is left running: the next MTTKRP queues behind
    /// it, and its time comes with the next [`GpuGroup::sync`] or
    /// [`GpuGroup::update`] ([`MttkrpTimes::exchanged`]); pulls and
    /// peer-copy rings are waited for. Returns the Gram and the exchange's
    /// milliseconds when waited for (the slowest GPU's; 0 when left
    /// running).
    pub fn scale_gram_exchange(&mut self, mode: usize, inv: &[f32]) -> Result<(Vec<f64>, f64)> {
        self.check_mode(mode)?;
        if self.plan.gpus() == 1 {
            return Ok((self.scale_gram(mode, Some(inv))?, 0.0));
        }
        if inv.len() != self.rank {
            return Err(DeviceError::Shape(format!(
                "{} column scales for rank {}",
                inv.len(),
                self.rank
            )));
        }
        let inv = Arc::new(inv.to_vec());
        if let Some((_, raw)) = self.raw_gram.take().filter(|(m, _)| *m == mode) {
            let gram = scaled_gram(raw, &inv);
            let replies = self.all(
                || Cmd::ScaleExchange(mode, inv.clone()),
                "the scaling and the factor exchange",
            )?;
            let waited = replies
                .into_iter()
                .map(|r| match r {
                    Reply::Millis(ms) => ms,
                    _ => 0.0,
                })
                .fold(0.0, f64::max);
            return Ok((gram, waited));
        }
        let replies = self.all(
            || Cmd::ScaleGramExchange(mode, inv.clone()),
            "the Gram matrix and the factor exchange",
        )?;
        let mut gram = vec![0f64; self.rank * self.rank];
        let mut waited = 0f64;
        for reply in replies {
            if let Reply::GramExchanged(g, ms, across_ms) = reply {
                // Across processes the one worker has all-reduced it.
                gram.iter_mut().zip(&g).for_each(|(a, b)| *a += b);
                waited = waited.max(ms);
                self.across_ms += across_ms;
            }
        }
        Ok((gram, waited))
    }

    /// AO-ADMM's blocked inner loop of `mode` on every GPU's own rows, from
    /// the last MTTKRP and `w = (G + rho I)^{-1}` (rank x rank, row-major):
    /// each GPU runs the one-GPU kernel on its rows. The column statistics
    /// summed (max for the largest magnitude), the inner iterations the
    /// most any GPU ran. One process only.
    pub fn admm_inner(
        &mut self,
        mode: usize,
        w: &[f64],
        params: &kruskal_device::admm::InnerParams,
    ) -> Result<kruskal_device::admm::InnerStats> {
        self.check_mode(mode)?;
        if self.process().is_some() {
            return Err(DeviceError::Shape(
                "AO-ADMM runs on the GPUs of one process".into(),
            ));
        }
        let r = self.rank;
        if w.len() != r * r {
            return Err(DeviceError::Shape(format!(
                "W has {} entries, rank {r} needs {}",
                w.len(),
                r * r
            )));
        }
        let w = Arc::new(w.to_vec());
        let replies = self.all(
            || Cmd::AdmmInner(mode, w.clone(), *params),
            "the ADMM inner loop",
        )?;
        let mut total = kruskal_device::admm::InnerStats::empty(r);
        for reply in replies {
            if let Reply::Admm(s) = reply {
                for c in 0..r {
                    total.sumsq[c] += s.sumsq[c];
                    total.inner[c] += s.inner[c];
                    total.max_abs[c] = total.max_abs[c].max(s.max_abs[c]);
                }
                total.iters = total.iters.max(s.iters);
            }
        }
        Ok(total)
    }

    /// Has AO-ADMM's inner loop run on the rows with data: each GPU's
    /// own rows that hold a nonzero, the first of its rows under the
    /// plan's labels (`RowShards::rows_with_nonzeros`), with H and U for
    /// those rows only; its other rows of the factor are 0 after the
    /// mode's first update (their solution). One process only.
    pub fn admm_on_rows_with_data(&mut self) -> Result<()> {
        if self.process().is_some() {
            return Err(DeviceError::Shape(
                "AO-ADMM runs on the GPUs of one process".into(),
            ));
        }
        self.all(|| Cmd::AdmmRows, "the ADMM's rows")?;
        Ok(())
    }

    /// AO-ADMM's scaling of `mode` on every GPU (H and U divided by
    /// `divisors`, the factor rows written from H); returns the Gram
    /// matrix of the whole factor (partial Grams summed in GPU order).
    /// The rows are exchanged by [`GpuGroup::exchange_rows`] after it.
    pub fn admm_scale(&mut self, mode: usize, divisors: &[f64]) -> Result<Vec<f64>> {
        self.check_mode(mode)?;
        if divisors.len() != self.rank {
            return Err(DeviceError::Shape(format!(
                "{} column divisors for rank {}",
                divisors.len(),
                self.rank
            )));
        }
        let d = Arc::new(divisors.to_vec());
        let replies = self.all(|| Cmd::AdmmScale(mode, d.clone()), "the ADMM scaling")?;
        let mut gram = vec![0f64; self.rank * self.rank];
        for reply in replies {
            if let Reply::Gram(g) = reply {
                gram.iter_mut().zip(&g).for_each(|(a, b)| *a += b);
            }
        }
        Ok(gram)
    }

    /// All-gathers every GPU's rows of `mode`; returns the slowest GPU's
    /// exchange time in milliseconds (0 with one GPU).
    pub fn exchange_rows(&mut self, mode: usize) -> Result<f64> {
        self.check_mode(mode)?;
        // A split plan's cut mode stays on its GPUs: no round trip.
        if self.plan.gpus() == 1 || self.shared.local[mode] {
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

    /// Every factor, from the first GPU, in the original row order. Modes
    /// exchanged sparsely, and a split plan's cut mode, are all-gathered
    /// first (on every GPU, so across
    /// processes every rank calls this), since no GPU holds all of their
    /// rows.
    pub fn factors(&mut self) -> Result<Vec<Array2<f32>>> {
        if self.plan.gpus() > 1 {
            for mode in 0..self.plan.dims().len() {
                if self.volumes[mode].read_only || self.volumes[mode].local {
                    self.all(|| Cmd::ExchangeAll(mode), "gathering the factors")?;
                }
            }
        }
        self.factors_on(0)
    }

    /// Every factor as local GPU `slot` holds it, in the original row
    /// order, without gathering first: after a sparse exchange, the rows
    /// this GPU neither owns nor reads are stale. What the exchange tests
    /// compare; [`GpuGroup::factors`] is the whole model.
    pub fn factors_on(&mut self, slot: usize) -> Result<Vec<Array2<f32>>> {
        if slot >= self.workers.len() {
            return Err(DeviceError::Shape(format!(
                "local GPU {slot} of a group of {}",
                self.workers.len()
            )));
        }
        // One mode at a time, put back in the original row order on the
        // GPU and downloaded into the model's matrix (or, without room on
        // the GPU, each row written where it belongs as the pieces come
        // down): the host holds the model and no other copy.
        let mut out = Vec::new();
        for mode in 0..self.plan.dims().len() {
            let order = Arc::new(self.original_rows(mode));
            let labels = Arc::new(self.plan.relabel(mode).to_vec());
            let reply = self.some(
                &[slot],
                || Cmd::Factor(mode, order.clone(), labels.clone()),
                "downloading the factors",
            )?;
            let Some(Reply::Factor(f)) = reply.into_iter().next() else {
                return Err(DeviceError::Shape("no factors came back".into()));
            };
            out.push(f);
        }
        Ok(out)
    }

    /// Per relabeled row of `mode`, its original row.
    fn original_rows(&self, mode: usize) -> Vec<u32> {
        let labels = self.plan.relabel(mode);
        let mut order = vec![0u32; labels.len()];
        for (old, &new) in labels.iter().enumerate() {
            order[new as usize] = old as u32;
        }
        order
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

/// How a split plan's partial sums reach their owners (`--partial-reduce`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PartialReduce {
    /// Peer copies on the copy engines, each owner's rows sent as soon as
    /// a GPU has summed them, while it sums the next owner's; the owner
    /// adds what it received. Needs one process, peer access between
    /// every pair and resident shards; NCCL's reductions otherwise. Not
    /// the default: on 2 x H200 the exposed reduction fell from 0.57 to
    /// 0.12 ms per mode of nell-1, but the MTTKRP beside the copies rose
    /// from 3.12 to 3.84 ms (docs/performance.md).
    Copies,
    /// After the whole MTTKRP: one NCCL reduction per owner, or, for a
    /// mode whose exchange sends only the rows read, NCCL sends and
    /// receives of those rows' partial sums (the exchange run backwards).
    #[default]
    Nccl,
    /// Peer reads, for the modes exchanged by the rows read: once every
    /// GPU's MTTKRP is done, each owner reads the partial sums of its rows
    /// out of the GPUs that read them and adds them, and after the update
    /// each reader reads its rows out of their owners; no NCCL kernel and
    /// no packing. Needs one process and peer access between every pair;
    /// NCCL otherwise, and for the modes all-gathered. Not the default:
    /// faster on 2 x H200 (nell-1-like 144M: 13.73 against 14.29 ms per
    /// iteration), slower on 4 (10.84 against 10.32; the peer reads ran at
    /// about half the all-gather's rate per GPU there), docs/performance.md.
    Pull,
}

impl PartialReduce {
    /// The name `--partial-reduce` spells.
    pub fn name(self) -> &'static str {
        match self {
            PartialReduce::Copies => "copies",
            PartialReduce::Nccl => "nccl",
            PartialReduce::Pull => "pull",
        }
    }
}

impl std::str::FromStr for PartialReduce {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "copies" => Ok(PartialReduce::Copies),
            "nccl" => Ok(PartialReduce::Nccl),
            "pull" => Ok(PartialReduce::Pull),
            other => Err(format!("takes copies, nccl or pull, not '{other}'")),
        }
    }
}

/// Takes the plan `opts.plan` asks for on `plan`, a rows plan over the
/// group's GPUs (those of one process, or one per process of a job):
/// splits it by a mode where a split plan is chosen (see `plan.rs`), and
/// returns the line that says which plan was taken and why. Every process
/// of a job makes the same choice from the same counts.
pub fn choose_plan(plan: &mut RowShards, opts: &GroupOptions) -> Result<String> {
    let decision = plan::choose(plan, opts.plan, opts.rows, split_ok(plan.gpus(), opts))
        .map_err(DeviceError::Shape)?;
    if let Some(cut) = decision.split {
        plan.split_by(cut).map_err(prepare)?;
    }
    Ok(decision.note)
}

/// Whether a group of `gpus` GPUs (of this process, or one per process)
/// with `opts` may take a split plan (`auto` considers one; see
/// `plan.rs`): its partial sums are reduced through NCCL.
pub fn split_possible(gpus: usize, opts: &GroupOptions) -> bool {
    opts.plan != PlanChoice::Rows && split_ok(gpus, opts).is_ok()
}

fn split_ok(m: usize, opts: &GroupOptions) -> std::result::Result<(), String> {
    if m == 1 {
        return Err("one GPU".into());
    }
    if opts.exchange == Some(Exchange::P2p) {
        return Err("the partial sums are reduced by NCCL, and p2p copies were asked for".into());
    }
    if let Err(missing) = nccl::Nccl::load() {
        return Err(format!("the partial sums are reduced by NCCL: {missing}"));
    }
    Ok(())
}

/// The Gram matrix (rank x rank, row-major) of a factor whose column j is
/// scaled by `inv[j]`, from `raw`, the Gram of the factor before:
/// `raw_ij inv_i inv_j`.
fn scaled_gram(mut raw: Vec<f64>, inv: &[f32]) -> Vec<f64> {
    let r = inv.len();
    for (i, row) in raw.chunks_exact_mut(r).enumerate() {
        for (j, g) in row.iter_mut().enumerate() {
            *g *= f64::from(inv[i]) * f64::from(inv[j]);
        }
    }
    raw
}

/// A partitioning error while preparing the shards or the exchange.
fn prepare(e: kruskal_partition::PartitionError) -> DeviceError {
    DeviceError::Prepare {
        format: "shards",
        message: e.to_string(),
    }
}

/// Marks the rows every GPU's shard of `mode` reads: GPU `g`'s elements
/// are `buf`'s elements `offsets[g]..offsets[g + 1]`.
fn mark(
    readers: &RowReaders,
    mode: usize,
    buf: &[u32],
    offsets: &[u64],
    stride: usize,
) -> Result<()> {
    for g in 0..offsets.len() - 1 {
        let range = offsets[g] as usize * stride..offsets[g + 1] as usize * stride;
        readers.mark(g, mode, &buf[range]).map_err(prepare)?;
    }
    Ok(())
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

/// Moves row `k` of `rows` (`rank` floats each) to row `labels[k]`, in
/// place: each cycle of the permutation is walked once, carrying one row,
/// and a flag per row marks the rows already placed.
fn permute_rows(rows: &mut [f32], rank: usize, labels: &[u32]) {
    let n = labels.len();
    let mut placed = vec![false; n];
    let mut carry = vec![0f32; rank];
    let mut spare = vec![0f32; rank];
    for start in 0..n {
        if placed[start] {
            continue;
        }
        carry.copy_from_slice(&rows[start * rank..(start + 1) * rank]);
        let mut to = labels[start] as usize;
        while to != start {
            // Row `to` is displaced by the carried row, and carried on.
            let dst = &mut rows[to * rank..(to + 1) * rank];
            spare.copy_from_slice(dst);
            dst.copy_from_slice(&carry);
            std::mem::swap(&mut carry, &mut spare);
            placed[to] = true;
            to = labels[to] as usize;
        }
        rows[start * rank..(start + 1) * rank].copy_from_slice(&carry);
        placed[start] = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gram_scaled_on_the_host_equals_the_gram_of_the_scaled_rows() {
        // Across processes the Gram of the scaled factor is made from the
        // Gram of the update's rows; it must match the Gram of the rows
        // scaled first, to rounding, for scales far from one too.
        let (rows, rank) = (40usize, 5usize);
        let a: Vec<f32> = (0..rows * rank)
            .map(|k| ((k * 37 % 101) as f32 - 50.0) * 3.0)
            .collect();
        let inv: Vec<f32> = vec![1.0, 0.5, 1e-3, 2f32.powi(-60), 7.25];
        let gram = |a: &[f32]| {
            let mut g = vec![0f64; rank * rank];
            for row in a.chunks_exact(rank) {
                for i in 0..rank {
                    for j in 0..rank {
                        g[i * rank + j] += f64::from(row[i]) * f64::from(row[j]);
                    }
                }
            }
            g
        };
        let scaled: Vec<f32> = a
            .chunks_exact(rank)
            .flat_map(|row| row.iter().zip(&inv).map(|(x, s)| x * s))
            .collect();
        let want = gram(&scaled);
        let got = scaled_gram(gram(&a), &inv);
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            let scale = (want[(k / rank) * (rank + 1)] * want[(k % rank) * (rank + 1)]).sqrt();
            assert!(
                (g - w).abs() <= 1e-6 * scale,
                "entry {k}: {g} from the raw Gram, {w} from the scaled rows"
            );
        }
    }

    #[test]
    fn rows_are_permuted_in_place_as_a_scatter_would() {
        // Permutations with fixed points, 2-cycles and one long cycle.
        let rank = 3;
        for (n, seed) in [(1usize, 1u64), (2, 2), (7, 3), (50, 4), (257, 5)] {
            let mut labels: Vec<u32> = (0..n as u32).collect();
            let mut x = seed;
            for i in (1..n).rev() {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let j = (x >> 33) as usize % (i + 1);
                if j % 3 != 0 {
                    labels.swap(i, j);
                }
            }
            let rows: Vec<f32> = (0..n * rank).map(|v| v as f32).collect();
            let mut want = vec![0f32; n * rank];
            for (k, &to) in labels.iter().enumerate() {
                let to = to as usize;
                want[to * rank..(to + 1) * rank].copy_from_slice(&rows[k * rank..(k + 1) * rank]);
            }
            let mut got = rows.clone();
            permute_rows(&mut got, rank, &labels);
            assert_eq!(got, want, "n = {n}");
        }
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
