//! CPU time of each CPU engine's MTTKRP, per mode, at rank 32.
//!
//!     cargo run --release -p kruskal-cpu --example engine_cpu_time -- FILE THREADS SWEEPS KERNEL...
//!
//! With one thread the time is the thread's CPU time (Linux
//! `/proc/thread-self/schedstat`), mean over the sweeps: on a machine
//! shared with other work it counts only the time this thread ran, where
//! wall-clock time also counts the time it waited. With more threads it is
//! the smallest wall-clock time of the sweeps. No warm-up sweep: the
//! engines are built (and their arrays touched) before the first.

use std::error::Error;
use std::path::Path;
use std::time::Instant;

use kruskal_cpu::{CpuEngine, MttkrpEngine};
use kruskal_formats::{ReadOptions, read_tensor};
use ndarray::Array2;

/// Nanoseconds this thread has run, from the scheduler's statistics.
fn thread_cpu_ns() -> Result<u64, Box<dyn Error + Send + Sync>> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat")?;
    let first = text.split_whitespace().next().ok_or("empty schedstat")?;
    Ok(first.parse()?)
}

fn main() -> Result<(), Box<dyn Error + Send + Sync>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        return Err("usage: engine_cpu_time FILE THREADS SWEEPS KERNEL...".into());
    }
    let t = read_tensor(Path::new(&args[1]), &ReadOptions::default())?;
    let threads: usize = args[2].parse()?;
    let sweeps: usize = args[3].parse::<usize>()?.max(1);
    let rank = 32;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    let factors: Vec<Array2<f32>> = t
        .dims()
        .iter()
        .map(|&d| {
            Array2::from_shape_fn((d as usize, rank), |(i, j)| ((i * 7 + j) % 13) as f32 * 0.1)
        })
        .collect();
    let mut outs: Vec<Array2<f32>> = t
        .dims()
        .iter()
        .map(|&d| Array2::zeros((d as usize, rank)))
        .collect();
    let kernels = args[4..]
        .iter()
        .map(|s| s.parse::<CpuEngine>())
        .collect::<Result<Vec<_>, _>>()?;
    let mut engines: Vec<Box<dyn MttkrpEngine>> = kernels
        .iter()
        .map(|k| k.build(&t))
        .collect::<Result<_, _>>()?;
    let nmodes = t.nmodes();
    let mut ms = vec![vec![0f64; nmodes]; kernels.len()];
    let mut best = vec![vec![f64::INFINITY; nmodes]; kernels.len()];
    pool.install(|| -> Result<(), Box<dyn Error + Send + Sync>> {
        for _ in 0..sweeps {
            for (e, engine) in engines.iter_mut().enumerate() {
                for (m, out) in outs.iter_mut().enumerate() {
                    let cpu = if threads == 1 { thread_cpu_ns()? } else { 0 };
                    let wall = Instant::now();
                    engine.mttkrp(m, &factors, out)?;
                    best[e][m] = best[e][m].min(wall.elapsed().as_secs_f64() * 1e3);
                    if threads == 1 {
                        ms[e][m] += (thread_cpu_ns()? - cpu) as f64 * 1e-6 / sweeps as f64;
                    }
                }
            }
        }
        Ok(())
    })?;
    let what = if threads == 1 {
        "CPU ms, mean"
    } else {
        "wall ms, min"
    };
    println!(
        "{}: {} nonzeros, rank {rank}, {threads} threads, {sweeps} sweeps ({what})",
        args[1],
        t.nnz()
    );
    for (e, k) in kernels.iter().enumerate() {
        let per_mode = if threads == 1 { &ms[e] } else { &best[e] };
        let text: Vec<String> = per_mode.iter().map(|x| format!("{x:.1}")).collect();
        println!(
            "{:>8}: modes [{}] all {:.1}",
            k.name(),
            text.join(", "),
            per_mode.iter().sum::<f64>()
        );
    }
    Ok(())
}
