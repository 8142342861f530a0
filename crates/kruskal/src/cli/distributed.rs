//! `kruskal cpd --distributed`: this process is one rank of a job of
//! several processes, one GPU each, possibly on several hosts.
//!
//! The command line's part is the launch:
//!
//! 1. Who is who: rank, world size, local GPU, rendezvous address and job
//!    token from the launcher's variables or the flags
//!    ([`kruskal_launch::Launch`]).
//! 2. Rendezvous: rank 0 makes the NCCL unique id and hands it to every
//!    rank over TCP; the connections stay open as the membership that
//!    notices a lost rank, aborts the communicator, and ends the process
//!    by a watchdog if it does not stop on its own.
//! 3. The job itself, from the communicator to the model, is the
//!    library's ([`kruskal_cpd::decompose_distributed`]): counting the
//!    file's nonzeros in shares, the row plan, the GPU group, every start.
//! 4. After a final barrier, only rank 0 prints the report and writes
//!    `--out`.
//!
//! Any error after the rendezvous is sent to the other ranks (ABORT), so
//! they stop with this rank's reason instead of waiting for it.

use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use kruskal_cpd::DistributedDecomposition;
use kruskal_cpd::distributed::{Job, Transport, check_file};
use kruskal_launch::{Launch, LaunchOverrides, OverrideNames, Rendezvous, RendezvousOptions};
use serde_json::json;

use super::cpd::{CpdArgs, decompose_options, print_breakdown, print_summary};

/// Seconds a process waits, after learning that a rank was lost, for its
/// own run to stop before it ends itself (a call NCCL cannot abort, such
/// as joining the communicator, would otherwise wait for ever).
const WATCHDOG_S: u64 = 20;

/// The launch flags below, as the launch's messages name them.
const LAUNCH_FLAGS: OverrideNames = OverrideNames {
    rank: "--process-rank",
    world_size: "--world-size",
    local_gpu: "--local-gpu",
    rendezvous: "--rendezvous",
};

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
        names: LAUNCH_FLAGS,
    })?;
    let me = launch.rank;
    let Some(path) = args.input.file.as_deref() else {
        bail!("--distributed needs a tensor FILE (.ktns)");
    };
    // Every rank maps the file and reads only its share: checked (a
    // .ktns file of distinct coordinates) before the job starts, with the
    // shape the initial factors and --out are checked against.
    let shape = check_file(path)?;
    if d.join_timeout_s == 0 || d.peer_timeout_s == 0 {
        bail!("--join-timeout-s and --peer-timeout-s must be at least 1");
    }
    let opts = kruskal_cpd::DecomposeOptions {
        group: args.multi.options()?,
        ..decompose_options(args, &shape.dims)?
    };
    // Rank 0 writes the model: its --out is checked before the job starts.
    let out_dir = match (&args.out, me) {
        (Some(dir), 0) => Some(super::preflight::OutDir::for_model(
            dir,
            &shape.dims,
            opts.cpd.rank,
        )?),
        _ => None,
    };
    let nccl = Transport::load().map_err(|e| anyhow::anyhow!("--distributed: {e}"))?;
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
        Rendezvous::run(&launch, &ropts, || nccl.unique_id()).context("the rendezvous")?;
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
    let job = Job {
        rank: me,
        world: launch.world_size,
        local_gpu: launch.local_gpu,
        unique_id: &id,
    };
    // Ranks stop together, so none takes Ctrl-C on its own: an interrupt
    // ends the process and the others see it as lost.
    static NEVER: AtomicBool = AtomicBool::new(false);
    let run = super::show::decompose_distributed(
        &opts,
        &job,
        path,
        &mut |abort| membership.on_loss(Box::new(move |lost| abort.abort(&lost.to_string()))),
        me != 0 || args.json,
        &NEVER,
    );
    let done = match run {
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
        report(args, &done)?;
    }
    if let Some(dir) = out_dir {
        dir.keep();
    }
    Ok(())
}

/// Rank 0's output: the model (`--out`), then the report.
fn report(args: &CpdArgs, done: &DistributedDecomposition) -> Result<()> {
    let (backend, setup) = (&done.backend, &done.setup);
    let model = &done.model;
    if let Some(dir) = &args.out {
        model
            .save(dir)
            .with_context(|| format!("writing the model to {}", dir.display()))?;
    }
    if args.json {
        let value = json!({
            "tensor": {
                "source": done.path.display().to_string(),
                "dims": done.dims,
                "nnz": done.nnz,
            },
            "backend": "distributed",
            "device": backend.group().gpus()[0].properties().name,
            "kernel": {
                "name": "shard",
                "processes": done.world,
                "exchange": "nccl",
                "plan": backend.group().plan_note(),
                "placement": backend.group().describe(),
                "breakdown": backend.breakdown(),
            },
            "rank": model.rank(),
            "prepare_s": setup.iter().map(|s| s.1).sum::<f64>(),
            "setup_s": setup.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "cpd_s": done.cpd_s,
            "fit": model.fit(),
            "converged": model.converged,
            "pseudo_inverse_solves": model.pseudo_inverse_solves,
            "iterations": model.iterations,
            "iterations_run": model.totals.count,
            "starts": done.summaries,
            "lambda": model.lambda,
            "out": args.out.as_ref().map(|p| p.display().to_string()),
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print_breakdown(backend, "rank 0's GPU");
        print_summary(model, done.cpd_s, done.starts, None, args.out.as_ref());
    }
    Ok(())
}
