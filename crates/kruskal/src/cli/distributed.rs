//! `kruskal cpd --distributed`: this process is one rank of a job of
//! several processes, one GPU each, possibly on several hosts.
//!
//! 1. Who is who: rank, world size, local GPU, rendezvous address and job
//!    token from the launcher's variables or the flags
//!    ([`kruskal_launch::Launch`]).
//! 2. Rendezvous: rank 0 makes the NCCL unique id and hands it to every
//!    rank over TCP; the connections stay open as the membership that
//!    notices a lost rank.
//! 3. Communicator: NCCL across the processes ([`ProcessComm`]). A lost
//!    rank aborts it, so no collective waits for a dead peer, and a
//!    watchdog ends the process if it does not stop on its own.
//! 4. The tensor: every rank maps the `.ktns` file, counts the nonzeros of
//!    its 1/world share of it, and the counts are all-reduced (with the
//!    payload checksum, in parts); every rank then makes the same row plan
//!    and keeps only its own shards. No process holds the whole tensor.
//! 5. The CPD: the several-GPU algorithm, with rows exchanged and Grams
//!    and statistics all-reduced by NCCL. After a final barrier, only rank
//!    0 writes `--out`.
//!
//! Any error after the rendezvous is sent to the other ranks (ABORT), so
//! they stop with this rank's reason instead of waiting for it.

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use kruskal_cpd::{Backend, GroupBackend, ValueScale};
use kruskal_device::nccl::{Nccl, Reduce};
use kruskal_device::{Gpu, GpuGroup, ProcessComm};
use kruskal_formats::{CrcPart, MappedBinary};
use kruskal_launch::{Launch, LaunchOverrides, Membership, Rendezvous, RendezvousOptions};
use kruskal_partition::RowShards;
use serde_json::json;

use super::cpd::{CpdArgs, Starts, cpd_options, print_breakdown, print_summary, run_starts};
use kruskal::console::{dims_text, thousands};

/// Seconds a process waits, after learning that a rank was lost, for its
/// own run to stop before it ends itself (a call NCCL cannot abort, such
/// as joining the communicator, would otherwise wait for ever).
const WATCHDOG_S: u64 = 20;

/// One process of several (`kruskal cpd --distributed`).
#[derive(Args, Clone, Debug, Default)]
pub struct DistributedArgs {
    /// Run as one process of a job spread over several processes (and
    /// hosts), one GPU each. Rank, world size, local GPU and rendezvous
    /// come from KRUSKAL_RANK, KRUSKAL_WORLD_SIZE, KRUSKAL_LOCAL_GPU and
    /// KRUSKAL_RENDEZVOUS (or torchrun's, OpenMPI's or Slurm's variables),
    /// or from the flags below; KRUSKAL_JOB_TOKEN must hold the job's
    /// shared secret (at least 16 characters). Reads a .ktns file; only
    /// rank 0 prints the report and writes --out.
    #[arg(long, conflicts_with_all = ["gpus", "demo", "like"])]
    pub distributed: bool,
    /// This process's rank, 0 .. world size - 1 (`--rank` is the CP
    /// rank).
    #[arg(long, value_name = "N", requires = "distributed")]
    pub process_rank: Option<usize>,
    /// Number of processes in the job.
    #[arg(long, value_name = "N", requires = "distributed")]
    pub world_size: Option<usize>,
    /// The CUDA GPU this process uses on its host.
    #[arg(long, value_name = "ORDINAL", requires = "distributed")]
    pub local_gpu: Option<usize>,
    /// Rank 0's host and a free port, the same on every rank.
    #[arg(long, value_name = "HOST:PORT", requires = "distributed")]
    pub rendezvous: Option<String>,
    /// How long rank 0 waits for every rank to join, seconds.
    #[arg(long, default_value_t = 120, requires = "distributed")]
    pub join_timeout_s: u64,
    /// A rank not heard from for this long is lost, seconds.
    #[arg(long, default_value_t = 10, requires = "distributed")]
    pub peer_timeout_s: u64,
}

/// Runs this process's part of the job.
pub fn run(args: &CpdArgs) -> Result<()> {
    let d = &args.distributed;
    let launch = Launch::from_env_with(&LaunchOverrides {
        rank: d.process_rank,
        world_size: d.world_size,
        local_gpu: d.local_gpu,
        rendezvous: d.rendezvous.clone(),
        token: None,
    })?;
    let me = launch.rank;
    let Some(path) = args.input.file.as_deref() else {
        bail!("--distributed needs a tensor FILE (.ktns)");
    };
    if path.extension().and_then(|e| e.to_str()) != Some("ktns") {
        bail!(
            "{}: --distributed reads a kruskal binary tensor (.ktns), which every rank maps and reads in part; convert it first with `kruskal convert {} OUT.ktns`",
            path.display(),
            path.display()
        );
    }
    // Each rank reads only its share, so none could sum repeated
    // coordinates that fall in different shares: the file must claim that
    // it has none (every .ktns written from format version 2 on does), and
    // the ranks verify the claim in parts once they can add up their
    // answers (see `work`).
    if !MappedBinary::open(path)?.distinct() {
        bail!(
            "{}: --distributed needs a .ktns file that records distinct coordinates, and this \
             one was written by an older kruskal (format version 1) and may repeat some; \
             rewrite it with `kruskal convert {} NEW.ktns`, which sums repeated coordinates",
            path.display(),
            path.display()
        );
    }
    if d.join_timeout_s == 0 || d.peer_timeout_s == 0 {
        bail!("--join-timeout-s and --peer-timeout-s must be at least 1");
    }
    // Rank 0 writes the model: its --out is checked before the job starts
    // (the mode count is not known yet; the model's own names are checked
    // when it is written).
    let out_dir = match (&args.out, me) {
        (Some(dir), 0) => Some(super::preflight::OutDir::prepare(dir, 0)?),
        _ => None,
    };
    let opts = args.multi.options()?;
    let nccl = Nccl::load().map_err(|e| anyhow::anyhow!("--distributed needs NCCL: {e}"))?;
    let ropts = RendezvousOptions {
        join_timeout: Duration::from_secs(d.join_timeout_s),
        peer_timeout: Duration::from_secs(d.peer_timeout_s),
        ..RendezvousOptions::default()
    };
    let lead = me == 0 && !args.json;
    if lead {
        println!(
            "job        {} processes, rendezvous {} (ranks from {})",
            launch.world_size, launch.rendezvous, launch.source
        );
    }
    let started = Instant::now();
    let (id, membership) =
        Rendezvous::run(&launch, &ropts, || nccl.unique_id().map(|id| id.to_vec()))
            .context("the rendezvous")?;
    let rendezvous_s = started.elapsed().as_secs_f64();
    if lead {
        println!("rendezvous every rank joined in {rendezvous_s:.1} s");
    }
    membership.on_loss(Box::new(move |lost| {
        // This rank's own failure is reported as its error; a peer's here.
        if lost.rank != me {
            eprintln!("kruskal: rank {me}: {lost}; stopping");
        }
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(WATCHDOG_S));
            eprintln!(
                "kruskal: rank {me}: still running {WATCHDOG_S} s after a rank was lost; exiting, nothing written"
            );
            std::process::exit(1);
        });
    }));
    let done = match work(args, &launch, &id, &membership, path, &opts) {
        Ok(mut done) => {
            done.setup.insert(0, ("rendezvous", rendezvous_s));
            done
        }
        Err(e) => {
            // Tell the others why, unless they told us.
            if membership.lost().is_none() {
                membership.abort(&super::errors::error_line(&e));
            }
            return Err(e);
        }
    };
    // Every rank's run is done before anything is written.
    membership
        .finish()
        .context("the final barrier of the ranks")?;
    if me == 0 {
        report(args, path, &done)?;
    }
    if let Some(dir) = out_dir {
        dir.keep();
    }
    Ok(())
}

/// A finished run of this rank.
struct Done {
    backend: GroupBackend,
    runs: Starts,
    /// Seconds of each step before the CPD, in order.
    setup: Vec<(&'static str, f64)>,
    dims: Vec<u32>,
    nnz: usize,
    world: usize,
}

/// Everything after the rendezvous.
fn work(
    args: &CpdArgs,
    launch: &Launch,
    id: &[u8],
    membership: &Membership,
    path: &Path,
    opts: &kruskal_device::GroupOptions,
) -> Result<Done> {
    let (me, world) = (launch.rank, launch.world_size);
    let lead = me == 0 && !args.json;
    let say = |line: &str| {
        if lead {
            println!("{line}");
        }
    };
    let gpu = Gpu::open(launch.local_gpu)?;
    let t0 = Instant::now();
    let pc = ProcessComm::init(gpu, id, me, world, opts.timeout)?;
    let mut setup = vec![("communicator", t0.elapsed().as_secs_f64())];
    let abort = pc.abort_handle();
    membership.on_loss(Box::new(move |lost| abort.abort(&lost.to_string())));
    say(&format!(
        "nccl       communicator of {world} ranks in {:.1} s ({})",
        t0.elapsed().as_secs_f64(),
        pc.gpu().properties().name
    ));

    // This rank's share of the nonzeros: counts per row and the squared
    // norm, with its part of the payload checksum, summed over ranks.
    let t0 = Instant::now();
    let map = MappedBinary::open(path)?;
    let dims = map.dims().to_vec();
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
    // Each rank's checksum part and largest |value| in slots of its own.
    sums.resize(at + 3 * world, 0.0);
    sums[at + 2 * me..at + 2 * me + 2].copy_from_slice(&crc.to_f64s());
    sums[at + 2 * world + me] = counted.max_abs;
    pc.all_reduce(&mut sums, Reduce::Sum)
        .context("summing the nonzero counts over the ranks")?;
    let parts = (0..world)
        .map(|r| CrcPart::from_f64s([sums[at + 2 * r], sums[at + 2 * r + 1]]))
        .collect::<Result<Vec<_>, _>>()?;
    map.verify_payload(&parts)?;
    if sums[at - 2] > 0.0 {
        bail!(
            "{}: its coordinates are not in increasing order, so ranks that each read part of \
             it cannot tell whether a coordinate repeats (a file written by an older kruskal, or \
             changed since); rewrite it with `kruskal convert {} NEW.ktns`, which sums repeated \
             coordinates and writes them in order",
            path.display(),
            path.display()
        );
    }
    // Values far from 1 run scaled by a power of two, as in one process
    // (`kruskal_cpd::ValueScale`); the weights are scaled back below.
    let max_abs = sums[at + 2 * world..].iter().copied().fold(0.0, f64::max);
    let scale = ValueScale::for_max_abs(max_abs);
    let norm_sq = scale.norm_sq(sums[at - 1]);
    let mut counts = Vec::with_capacity(dims.len());
    let mut first = 0;
    for &d in &dims {
        counts.push(
            sums[first..first + d as usize]
                .iter()
                .map(|&x| x as u64)
                .collect(),
        );
        first += d as usize;
    }
    drop(sums);
    setup.push(("count", t0.elapsed().as_secs_f64()));
    say(&format!(
        "tensor     {}: {} modes, {}, {} nonzeros (counted and checked in parts in {:.1} s)",
        path.display(),
        dims.len(),
        dims_text(&dims),
        thousands(nnz as u64),
        t0.elapsed().as_secs_f64()
    ));

    if !scale.is_none() {
        say(&format!("values     {}", scale.describe(max_abs)));
    }

    // The plan, the same on every rank, and this rank's shards.
    let t0 = Instant::now();
    let plan = RowShards::from_counts(&dims, counts, world)?;
    let indices: Vec<&[u32]> = (0..dims.len()).map(|m| map.indices(m)).collect();
    let scaled = (!scale.is_none()).then(|| scale.applied(map.values()));
    let values = scaled.as_deref().unwrap_or(map.values());
    let shards = (0..dims.len())
        .map(|mode| plan.local_elements(mode, me, &indices, values))
        .collect::<Result<Vec<_>, _>>()?;
    drop(scaled);
    let mine: usize = (0..dims.len()).map(|m| plan.nnz(m, me) as usize).sum();
    setup.push(("shards", t0.elapsed().as_secs_f64()));
    say(&format!(
        "shards     planned and read in {:.1} s; rank 0 holds {} elements over {} modes ({:.1}% of {} per mode on average)",
        t0.elapsed().as_secs_f64(),
        thousands(mine as u64),
        dims.len(),
        100.0 * mine as f64 / (dims.len() * nnz).max(1) as f64,
        thousands(nnz as u64)
    ));
    drop(indices);
    drop(map);

    let cpd = cpd_options(args, &dims)?;
    let t0 = Instant::now();
    let mut progress = |line: &str| say(&format!("gpus       {line}"));
    let group = GpuGroup::distributed(pc, plan, shards, cpd.rank, opts, &mut progress)?;
    if lead {
        for line in group.describe() {
            println!("           {line}");
        }
    }
    let mut backend = GroupBackend::with_norm(group, norm_sq);
    let prep_s = t0.elapsed().as_secs_f64();
    setup.push(("group", prep_s));
    say(&format!(
        "backend    {} (prepared in {prep_s:.2} s)",
        backend.describe()
    ));

    // Ranks stop together, so none takes Ctrl-C on its own: an interrupt
    // ends the process and the others see it as lost.
    static NEVER: AtomicBool = AtomicBool::new(false);
    let mut runs = run_starts(args, &mut backend, &cpd, me != 0 || args.json, &NEVER)?;
    scale.restore(&mut runs.model);
    Ok(Done {
        backend,
        runs,
        setup,
        dims,
        nnz,
        world,
    })
}

/// Rank 0's output: the model (`--out`), then the report.
fn report(args: &CpdArgs, path: &Path, done: &Done) -> Result<()> {
    let (backend, runs, setup) = (&done.backend, &done.runs, &done.setup);
    let model = &runs.model;
    if let Some(dir) = &args.out {
        model
            .save(dir)
            .with_context(|| format!("writing the model to {}", dir.display()))?;
    }
    if args.json {
        let value = json!({
            "tensor": {
                "source": path.display().to_string(),
                "dims": done.dims,
                "nnz": done.nnz,
            },
            "backend": "distributed",
            "device": backend.group().gpus()[0].properties().name,
            "kernel": {
                "name": "shard",
                "processes": done.world,
                "exchange": "nccl",
                "placement": backend.group().describe(),
                "breakdown": backend.breakdown(),
            },
            "rank": model.rank(),
            "prepare_s": setup.iter().map(|s| s.1).sum::<f64>(),
            "setup_s": setup.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "cpd_s": runs.cpd_s,
            "fit": model.fit(),
            "converged": model.converged,
            "pseudo_inverse_solves": model.pseudo_inverse_solves,
            "iterations": model.iterations,
            "iterations_run": model.totals.count,
            "starts": runs.summaries,
            "lambda": model.lambda,
            "out": args.out.as_ref().map(|p| p.display().to_string()),
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print_breakdown(backend, "rank 0's GPU");
        print_summary(model, runs.cpd_s, runs.starts, None, args.out.as_ref());
    }
    Ok(())
}
