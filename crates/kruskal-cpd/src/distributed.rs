//! One process's part of a CPD spread over several processes, one GPU
//! each, possibly on several hosts ([`decompose_distributed`]).
//!
//! How the processes are started, find each other and agree on rank 0's
//! NCCL unique id, and how they notice a lost peer, is the launcher's
//! business (the `kruskal-launch` crate; [`Transport::unique_id`] makes
//! the id rank 0 hands out). From the id on, the job is this module's:
//!
//! 1. Communicator: NCCL across the processes. [`decompose_distributed`]
//!    hands its caller an [`Abort`] as soon as it exists, so a lost peer
//!    can abort it and no collective waits for a dead rank.
//! 2. The tensor: every rank maps the `.ktns` file, counts the nonzeros of
//!    its 1/world share of it, and the counts are all-reduced together with
//!    the payload checksum (in parts), the order check of the distinct
//!    coordinates and the largest |value|; every rank then makes the same
//!    plan from the counts (rows by owner, or split by a mode whose rows
//!    then never travel: [`kruskal_group::choose_plan`]) and keeps only its
//!    own shards. No process holds the whole tensor.
//! 3. The CPD: the several-GPU algorithm ([`GroupBackend`]), rows
//!    exchanged and Grams and statistics all-reduced by NCCL, every start
//!    run as [`crate::decompose`] runs them.
//!
//! Like [`crate::decompose`] it prints nothing: its choices and each
//! iteration arrive as [`Event`]s (topics `nccl`, `tensor`, `values`,
//! `shards`, `gpus`, `plan`).

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use kruskal_device::Gpu;
use kruskal_formats::{CrcPart, MappedBinary};
use kruskal_group::nccl::{Nccl, Reduce};
use kruskal_group::{GpuGroup, ProcessComm};
use kruskal_partition::RowShards;

use crate::backend::Backend;
use crate::decompose::{DecomposeOptions, Event, PrepareTimes, StartSummary, run_scaled};
use crate::error::{CpdError, Result};
use crate::memory::{dims_text, thousands};
use crate::model::KruskalModel;
use crate::multi::GroupBackend;
use crate::scale::ValueScale;

pub use kruskal_group::CommAbort as Abort;

/// This process's place in the job, from the launcher.
#[derive(Clone, Copy, Debug)]
pub struct Job<'a> {
    /// This process's rank, 0 .. `world - 1`.
    pub rank: usize,
    /// Number of processes.
    pub world: usize,
    /// The CUDA GPU this process uses on its host.
    pub local_gpu: usize,
    /// Rank 0's NCCL unique id ([`Transport::unique_id`]), the same bytes
    /// on every rank.
    pub unique_id: &'a [u8],
}

/// The library that carries the job's collectives (NCCL), loaded once per
/// process.
pub struct Transport(&'static Nccl);

impl Transport {
    /// Loads NCCL, or says where it was looked for.
    pub fn load() -> Result<Transport> {
        Nccl::load()
            .map(Transport)
            .map_err(|e| CpdError::Gpu(format!("several processes need NCCL: {e}")))
    }

    /// A new unique id of a communicator (rank 0 makes it and hands its
    /// bytes to the others).
    pub fn unique_id(&self) -> Result<Vec<u8>> {
        self.0
            .unique_id()
            .map(|id| id.to_vec())
            .map_err(|e| CpdError::Gpu(e.to_string()))
    }
}

/// What a `.ktns` file holds, read from its header by [`check_file`].
#[derive(Clone, Debug)]
pub struct FileShape {
    pub dims: Vec<u32>,
    pub nnz: usize,
}

/// Checks, before a job starts, that `path` is a file every rank can read
/// its share of: a kruskal binary tensor (`.ktns`) that records distinct
/// coordinates (each rank reads only its share, so none could sum a
/// coordinate repeated across shares). Returns its shape, so initial
/// factors can be checked against it before the job begins.
pub fn check_file(path: &Path) -> Result<FileShape> {
    let shown = path.display();
    if path.extension().and_then(|e| e.to_str()) != Some("ktns") {
        return Err(CpdError::Invalid(format!(
            "{shown}: a job of several processes reads a kruskal binary tensor (.ktns), which \
             every rank maps and reads in part; convert it first (`kruskal convert {shown} \
             OUT.ktns`)"
        )));
    }
    let map = MappedBinary::open(path)?;
    if !map.distinct() {
        return Err(CpdError::Invalid(format!(
            "{shown}: a job of several processes needs a .ktns file that records distinct \
             coordinates, and this one was written by an older kruskal (format version 1) and \
             may repeat some; rewrite it (`kruskal convert {shown} NEW.ktns`), which sums \
             repeated coordinates"
        )));
    }
    Ok(FileShape {
        dims: map.dims().to_vec(),
        nnz: map.nnz(),
    })
}

/// A finished run of this rank: every rank ends with the same model.
pub struct DistributedDecomposition {
    /// The best start's model, values scaled back.
    pub model: KruskalModel,
    pub backend: GroupBackend,
    /// Seconds of each step before the CPD, in order: `communicator`,
    /// `count`, `shards`, `group`.
    pub setup: Vec<(&'static str, f64)>,
    pub path: PathBuf,
    pub dims: Vec<u32>,
    pub nnz: usize,
    /// Number of processes.
    pub world: usize,
    /// Seconds of all starts.
    pub cpd_s: f64,
    pub starts: usize,
    /// Every start, in the order run.
    pub summaries: Vec<StartSummary>,
}

/// Runs this rank's part of the decomposition `opts` asks for of the
/// `.ktns` file `path` (every rank calls it with the same arguments but
/// its own [`Job::rank`] and [`Job::local_gpu`]).
///
/// `on_abort` receives the communicator's [`Abort`] as soon as it exists:
/// calling it (a peer was lost, say) makes every collective of this rank
/// fail at once instead of waiting. `progress` hears every [`Event`];
/// returning `ControlFlow::Break` or setting `stop` ends the run after the
/// current iteration, which only works when every rank does so together
/// (a rank that stops alone leaves the others waiting for it until the
/// group's timeout).
///
/// `opts.gpus`, `opts.backend` and `opts.kernel` are not used: every rank
/// runs the shard kernel on its own GPU.
pub fn decompose_distributed(
    job: &Job<'_>,
    path: &Path,
    opts: &DecomposeOptions,
    on_abort: &mut dyn FnMut(Abort),
    progress: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
    stop: &AtomicBool,
) -> Result<DistributedDecomposition> {
    opts.validate()?;
    if opts.cpd.constraints.is_some() {
        return Err(CpdError::option(
            crate::OptionName::Nonneg,
            "constrained CP runs on one GPU or the CPU, not across processes",
        ));
    }
    let (me, world) = (job.rank, job.world);
    if world == 0 || me >= world {
        return Err(CpdError::Invalid(format!(
            "rank {me} of a job of {world} processes"
        )));
    }
    let mut note = |topic: &str, text: &str| {
        let _ = progress(Event::Note { topic, text });
    };
    let gpu = Gpu::open(job.local_gpu)?;
    let t0 = Instant::now();
    let pc = ProcessComm::init(gpu, job.unique_id, me, world, opts.group.timeout)?;
    let mut setup = vec![("communicator", t0.elapsed().as_secs_f64())];
    on_abort(pc.abort_handle());
    note(
        "nccl",
        &format!(
            "communicator of {world} ranks in {:.1} s ({})",
            t0.elapsed().as_secs_f64(),
            pc.gpu().properties().name
        ),
    );

    let t0 = Instant::now();
    let map = MappedBinary::open(path)?;
    let counted = count_shares(&pc, &map, path)?;
    setup.push(("count", t0.elapsed().as_secs_f64()));
    let dims = map.dims().to_vec();
    let nnz = map.nnz();
    note(
        "tensor",
        &format!(
            "{}: {} modes, {}, {} nonzeros (counted and checked in parts in {:.1} s)",
            path.display(),
            dims.len(),
            dims_text(&dims),
            thousands(nnz as u64),
            t0.elapsed().as_secs_f64()
        ),
    );
    let scale = counted.scale;
    if !scale.is_none() {
        note("values", &scale.describe(counted.max_abs));
    }

    // The plan, the same on every rank, and this rank's shards.
    let t0 = Instant::now();
    let mut plan = RowShards::from_counts(&dims, counted.counts, world)?;
    let plan_note = kruskal_group::choose_plan(&mut plan, &opts.group)?;
    let indices: Vec<&[u32]> = (0..dims.len()).map(|m| map.indices(m)).collect();
    let scaled = (!scale.is_none()).then(|| scale.applied(map.values()));
    let values = scaled.as_deref().unwrap_or(map.values());
    let shards = (0..dims.len())
        .map(|mode| plan.local_elements(mode, me, &indices, values))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    drop(scaled);
    let mine: usize = (0..dims.len()).map(|m| plan.nnz(m, me) as usize).sum();
    setup.push(("shards", t0.elapsed().as_secs_f64()));
    note(
        "shards",
        &format!(
            "planned and read in {:.1} s; rank {me} holds {} elements over {} modes ({:.1}% of {} per mode on average)",
            t0.elapsed().as_secs_f64(),
            thousands(mine as u64),
            dims.len(),
            100.0 * mine as f64 / (dims.len() * nnz).max(1) as f64,
            thousands(nnz as u64)
        ),
    );
    drop(indices);
    drop(map);

    let rank = opts.cpd.rank;
    let t0 = Instant::now();
    let group_opts = kruskal_group::GroupOptions {
        build: opts.gpu.fcoo_build,
        ..opts.group.clone()
    };
    let group = GpuGroup::distributed(
        pc,
        plan,
        Some(plan_note.clone()),
        shards,
        rank,
        &group_opts,
        &mut |line| note("gpus", line),
    )?;
    for line in group.describe() {
        note("", &line);
    }
    note("plan", &plan_note);
    let mut backend = GroupBackend::with_norm(group, counted.norm_sq);
    let prep_s = t0.elapsed().as_secs_f64();
    setup.push(("group", prep_s));
    let _ = progress(Event::Ready {
        backend: &backend.describe(),
        prep_s,
        prepare: PrepareTimes {
            build_s: prep_s,
            ..PrepareTimes::default()
        },
        fallback: None,
    });

    let runs = run_scaled(&mut backend, opts, scale, progress, stop)?;
    Ok(DistributedDecomposition {
        model: runs.model,
        backend,
        setup,
        path: path.to_path_buf(),
        dims,
        nnz,
        world,
        cpd_s: runs.cpd_s,
        starts: runs.starts,
        summaries: runs.summaries,
    })
}

/// The whole tensor's counts, as every rank learns them from its share.
struct Counted {
    /// Nonzeros per row of each mode.
    counts: Vec<Vec<u64>>,
    /// The squared norm of the scaled values.
    norm_sq: f64,
    max_abs: f64,
    scale: ValueScale,
}

/// Counts this rank's 1/world share of the nonzeros and all-reduces, in
/// one call: the counts per row, the squared norm, the order check of the
/// distinct coordinates, each rank's part of the payload checksum and its
/// largest |value| (the last two in slots of their own). Then verifies
/// the checksum and the order, and picks the value scale.
fn count_shares(pc: &ProcessComm, map: &MappedBinary, path: &Path) -> Result<Counted> {
    let (me, world) = (pc.rank(), pc.world());
    let dims = map.dims();
    let nnz = map.nnz();
    let share = nnz * me / world..nnz * (me + 1) / world;
    let counted = map.count_range(share.clone())?;
    let crc = map.payload_crc_part(me, world)?;
    // The header's claim of distinct coordinates, verified: they must be
    // in strictly increasing order (as kruskal writes them), which every
    // rank checks for its share and the sum below gathers.
    let disorder = if map.in_order(share)? { 0.0 } else { 1.0 };
    let rows: usize = dims.iter().map(|&d| d as usize).sum();
    let mut sums: Vec<f64> = Vec::with_capacity(rows + 2 + 3 * world);
    for c in &counted.counts {
        sums.extend(c.iter().map(|&x| x as f64));
    }
    sums.push(disorder);
    sums.push(counted.norm_sq);
    let at = sums.len();
    sums.resize(at + 3 * world, 0.0);
    sums[at + 2 * me..at + 2 * me + 2].copy_from_slice(&crc.to_f64s());
    sums[at + 2 * world + me] = counted.max_abs;
    pc.all_reduce(&mut sums, Reduce::Sum)?;
    let parts = (0..world)
        .map(|r| CrcPart::from_f64s([sums[at + 2 * r], sums[at + 2 * r + 1]]))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    map.verify_payload(&parts)?;
    if sums[at - 2] > 0.0 {
        let shown = path.display();
        return Err(CpdError::Invalid(format!(
            "{shown}: its coordinates are not in increasing order, so ranks that each read part \
             of it cannot tell whether a coordinate repeats (a file written by an older kruskal, \
             or changed since); rewrite it (`kruskal convert {shown} NEW.ktns`), which sums \
             repeated coordinates and writes them in order"
        )));
    }
    // Values far from 1 run scaled by a power of two, as in one process;
    // the weights are scaled back after the run.
    let max_abs = sums[at + 2 * world..].iter().copied().fold(0.0, f64::max);
    let scale = ValueScale::for_max_abs(max_abs);
    let norm_sq = scale.norm_sq(sums[at - 1]);
    let mut counts = Vec::with_capacity(dims.len());
    let mut first = 0;
    for &d in dims {
        counts.push(
            sums[first..first + d as usize]
                .iter()
                .map(|&x| x as u64)
                .collect(),
        );
        first += d as usize;
    }
    Ok(Counted {
        counts,
        norm_sq,
        max_abs,
        scale,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_file_or_a_missing_file_is_refused_before_the_job() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("t.tns");
        std::fs::write(&text, "1 1 1 1.0\n").unwrap();
        let e = check_file(&text).unwrap_err().to_string();
        assert!(e.contains("t.tns") && e.contains(".ktns"), "{e}");
        assert!(check_file(&dir.path().join("none.ktns")).is_err());
    }

    #[test]
    fn a_rank_outside_the_job_is_refused() {
        static NEVER: AtomicBool = AtomicBool::new(false);
        let job = Job {
            rank: 2,
            world: 2,
            local_gpu: 0,
            unique_id: &[],
        };
        let e = decompose_distributed(
            &job,
            Path::new("x.ktns"),
            &DecomposeOptions::new(4),
            &mut |_| {},
            &mut |_| ControlFlow::Continue(()),
            &NEVER,
        )
        .err()
        .expect("refused");
        assert!(e.to_string().contains("rank 2 of a job of 2"), "{e}");
    }
}
