//! `kruskal cpd --distributed`: several `kruskal` processes, one GPU each,
//! over 127.0.0.1. The argument checks run everywhere; the runs need two
//! GPUs and NCCL and are skipped (with a note) without them.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kruskal_formats::generate::{PlantedSpec, planted};

const TOKEN: &str = "distributed-test-token-0123456789";

fn bin() -> PathBuf {
    std::env::var_os("KRUSKAL_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_kruskal")))
}

/// A `kruskal` command with a clean launch environment: no launcher
/// variables from the caller's shell, the test's token.
fn kruskal() -> Command {
    let mut c = Command::new(bin());
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "KRUSKAL_RANK",
        "KRUSKAL_WORLD_SIZE",
        "KRUSKAL_LOCAL_GPU",
        "KRUSKAL_RENDEZVOUS",
    ] {
        c.env_remove(var);
    }
    c.env("KRUSKAL_JOB_TOKEN", TOKEN);
    c
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A failed run with one error line naming `needle`, and no panic.
fn assert_clean_failure(o: &Output, needle: &str) {
    let err = text(&o.stderr);
    assert!(!o.status.success(), "expected failure, got success: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    assert!(err.contains(needle), "'{needle}' not in: {err}");
}

/// A small tensor written as .ktns into `dir`: a planted rank-6 tensor
/// with noise, whose fit climbs over the iterations (so equal fits mean
/// something), with distinct coordinates.
fn tensor_file(dir: &Path, nnz: usize) -> PathBuf {
    let spec = PlantedSpec {
        dims: vec![3_000, 2_000, 1_500],
        rank: 6,
        nnz,
        noise: 0.3,
        seed: 5,
    };
    let t = planted(&spec).unwrap().tensor;
    let path = dir.join("t.ktns");
    kruskal_formats::binary::write_binary(&path, &t).unwrap();
    path
}

/// A port nobody listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn rank_args(rank: usize, port: u16) -> Vec<String> {
    vec![
        "--distributed".into(),
        "--process-rank".into(),
        rank.to_string(),
        "--world-size".into(),
        "2".into(),
        "--local-gpu".into(),
        rank.to_string(),
        "--rendezvous".into(),
        format!("127.0.0.1:{port}"),
    ]
}

/// `kruskal cpd FILE ... ARGS` as rank `rank` of two, standard error
/// captured.
fn spawn_rank(rank: usize, port: u16, file: &[&str], args: &[&str], stdout: Stdio) -> Child {
    kruskal()
        .arg("cpd")
        .args(file)
        .args(args)
        .args(rank_args(rank, port))
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Two GPUs and NCCL, or `None` with a note.
fn two_gpus() -> Option<()> {
    match kruskal_device::Gpu::count() {
        Ok(n) if n >= 2 => {}
        Ok(n) => {
            eprintln!("note: {n} GPU(s); skipping the run across processes (needs 2)");
            return None;
        }
        Err(e) => {
            eprintln!("note: no GPU ({e}); skipping the run across processes");
            return None;
        }
    }
    if let Err(e) = kruskal_group::nccl::Nccl::load() {
        eprintln!("note: {e}; skipping the run across processes");
        return None;
    }
    Some(())
}

/// Waits for `child` up to `limit`; kills it and fails the test after that.
fn wait_bounded(mut child: Child, limit: Duration, what: &str) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what} still ran after {} s; stderr: {}",
                limit.as_secs(),
                text(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn distributed_arguments_are_checked_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let file = tensor_file(dir.path(), 2_000);
    let f = file.to_str().unwrap();
    // Launch flags belong to --distributed.
    let o = kruskal()
        .args(["cpd", f, "--process-rank", "0"])
        .output()
        .unwrap();
    assert_clean_failure(&o, "--distributed");
    // One host's --gpus and several processes do not mix.
    let o = kruskal()
        .args(["cpd", f, "--distributed", "--gpus", "2"])
        .output()
        .unwrap();
    assert_clean_failure(&o, "--gpus");
    // Nothing says which rank this is.
    let o = kruskal()
        .args(["cpd", f, "--distributed"])
        .output()
        .unwrap();
    assert_clean_failure(&o, "KRUSKAL_RANK");
    // No token.
    let o = kruskal()
        .env_remove("KRUSKAL_JOB_TOKEN")
        .args(["cpd", f])
        .args(rank_args(0, 1))
        .output()
        .unwrap();
    assert_clean_failure(&o, "KRUSKAL_JOB_TOKEN");
    // A rank outside the world.
    let mut args = rank_args(0, 1);
    args[2] = "2".into();
    let o = kruskal().args(["cpd", f]).args(&args).output().unwrap();
    assert_clean_failure(&o, "2");
    // A text tensor: every rank must map a .ktns.
    let tns = dir.path().join("t.tns");
    std::fs::write(&tns, "1 1 1 1.0\n").unwrap();
    let o = kruskal()
        .args(["cpd", tns.to_str().unwrap()])
        .args(rank_args(0, 1))
        .output()
        .unwrap();
    assert_clean_failure(&o, ".ktns");
    // A version 1 .ktns may repeat coordinates, which ranks reading parts
    // of it could not sum: refused, with the command that rewrites it.
    let old = dir.path().join("old.ktns");
    let mut bytes = std::fs::read(&file).unwrap();
    // Version 1, no flags; 3 modes: the header checksum covers bytes 0..48.
    bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
    bytes[28..32].copy_from_slice(&0u32.to_le_bytes());
    let crc = crc32fast::hash(&bytes[..48]);
    bytes[48..52].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&old, &bytes).unwrap();
    let o = kruskal()
        .args(["cpd", old.to_str().unwrap()])
        .args(rank_args(0, 1))
        .output()
        .unwrap();
    assert_clean_failure(&o, "kruskal convert");
    assert!(text(&o.stderr).contains("version 1"), "{}", text(&o.stderr));
    // Several-GPU options without several GPUs.
    let o = kruskal()
        .args(["cpd", f, "--exchange", "p2p", "--backend", "cpu"])
        .output()
        .unwrap();
    assert_clean_failure(&o, "--gpus or --distributed");
}

/// Per-iteration fits of a `--json` report.
fn fits(report: &str) -> Vec<f64> {
    let v: serde_json::Value = serde_json::from_str(report)
        .unwrap_or_else(|e| panic!("not a JSON report ({e}): {report}"));
    v["iterations"]
        .as_array()
        .expect("iterations")
        .iter()
        .map(|s| s["fit"].as_f64().expect("a fit"))
        .collect()
}

/// The plan line of a `--json` report (`kernel.plan`).
fn plan_line(report: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(report)
        .unwrap_or_else(|e| panic!("not a JSON report ({e}): {report}"));
    v["kernel"]["plan"]
        .as_str()
        .unwrap_or_else(|| panic!("no kernel.plan in {report}"))
        .to_string()
}

#[test]
fn two_processes_match_one_process_on_two_gpus() {
    if two_gpus().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = tensor_file(dir.path(), 400_000);
    let f = file.to_str().unwrap();
    let common = ["--rank", "16", "--iters", "12", "--tol", "0", "--json"];
    // Rows by owner with every row all-gathered and with only the rows
    // each rank reads (its marks sent to the other rank as a bitmap), and
    // the plan split by mode 1 (mode 1's rows never travel; the other
    // modes' partial sums are reduced onto their owners across the
    // processes).
    for (plan, rows, line) in [
        ("rows", "all", "rows by owner"),
        ("rows", "read", "rows by owner"),
        ("split:1", "read", "split by mode 1"),
    ] {
        let args: Vec<&str> = common
            .iter()
            .copied()
            .chain(["--exchange-rows", rows, "--gpu-plan", plan])
            .collect();
        let single = kruskal()
            .args(["cpd", f, "--gpus", "2", "--exchange", "nccl"])
            .args(&args)
            .output()
            .unwrap();
        assert!(single.status.success(), "{}", text(&single.stderr));
        let report = text(&single.stdout);
        let want = fits(&report);
        assert!(
            plan_line(&report).starts_with(line),
            "{}",
            plan_line(&report)
        );
        // A fit that moves, not one stuck at a bound.
        assert!(
            want[0] < 0.999 && want[want.len() - 1] - want[0] > 1e-3,
            "the fits do not move: {want:?}"
        );

        let out = dir.path().join(format!("model-{plan}-{rows}"));
        let port = free_port();
        let rank1 = spawn_rank(1, port, &[f], &args, Stdio::piped());
        let rank0 = spawn_rank(
            0,
            port,
            &[f, "--out", out.to_str().unwrap()],
            &args,
            Stdio::piped(),
        );
        let o0 = wait_bounded(rank0, Duration::from_secs(180), "rank 0");
        let o1 = wait_bounded(rank1, Duration::from_secs(30), "rank 1");
        let what = format!("--gpu-plan {plan} --exchange-rows {rows}");
        assert!(o0.status.success(), "rank 0 ({what}): {}", text(&o0.stderr));
        assert!(o1.status.success(), "rank 1 ({what}): {}", text(&o1.stderr));
        assert!(o1.stdout.is_empty(), "rank 1 printed: {}", text(&o1.stdout));
        let report = text(&o0.stdout);
        assert!(
            plan_line(&report).starts_with(line),
            "{what} across processes: {}",
            plan_line(&report)
        );
        let got = fits(&report);
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4,
                "iteration {} ({what}): fit {a} across processes, {b} in one: {got:?} vs {want:?}",
                i + 1
            );
        }
        for name in ["lambda.npy", "mode-1.npy", "mode-2.npy", "mode-3.npy"] {
            assert!(out.join(name).is_file(), "rank 0 did not write {name}");
        }
        eprintln!("fits across processes ({what}) {got:?}\nfits in one process  {want:?}");
    }
}

/// Rank 0's `--json` report of a run of two processes on `file`.
fn two_process_report(file: &Path, args: &[&str]) -> serde_json::Value {
    let f = file.to_str().unwrap();
    let port = free_port();
    let rank1 = spawn_rank(1, port, &[f], args, Stdio::null());
    let rank0 = spawn_rank(0, port, &[f], args, Stdio::piped());
    let o0 = wait_bounded(rank0, Duration::from_secs(180), "rank 0");
    let o1 = wait_bounded(rank1, Duration::from_secs(30), "rank 1");
    assert!(o0.status.success(), "rank 0: {}", text(&o0.stderr));
    assert!(o1.status.success(), "rank 1: {}", text(&o1.stderr));
    serde_json::from_str(&text(&o0.stdout)).unwrap()
}

#[test]
fn values_far_from_one_give_the_same_fits_across_processes() {
    if two_gpus().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let base = tensor_file(dir.path(), 100_000);
    let mut t = kruskal_formats::binary::read_binary(&base).unwrap();
    t.scale_values_pow2(110).unwrap();
    let big = dir.path().join("big.ktns");
    kruskal_formats::binary::write_binary(&big, &t).unwrap();
    let args = ["--rank", "8", "--iters", "10", "--tol", "0", "--json"];
    let want = two_process_report(&base, &args);
    let got = two_process_report(&big, &args);
    let (want_fits, got_fits) = (fits(&want.to_string()), fits(&got.to_string()));
    for (a, b) in got_fits.iter().zip(&want_fits) {
        assert!((a - b).abs() <= 1e-6, "{got_fits:?} vs {want_fits:?}");
    }
    let weights = |v: &serde_json::Value| -> Vec<f64> {
        v["lambda"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_f64().unwrap())
            .collect()
    };
    for (a, b) in weights(&got).iter().zip(weights(&want)) {
        let b = b * 2f64.powi(110);
        assert!(a.is_finite() && (a - b).abs() <= 1e-3 * b, "{a} {b}");
    }
}

#[test]
fn a_false_claim_of_distinct_coordinates_is_refused_by_every_rank() {
    if two_gpus().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = tensor_file(dir.path(), 40_000);
    // Nonzero 20,000 (rank 1's first) made to repeat nonzero 19,999
    // (rank 0's last), the header's claim kept and both checksums sealed
    // again: only the pair across the shares' border shows it.
    let mut bytes = std::fs::read(&file).unwrap();
    // 3 modes: D = 48, H = 56, S = 4 * 40,000.
    let stride = 160_000;
    for mode in 0..3 {
        let at = 56 + mode * stride + 4 * 20_000;
        let before: [u8; 4] = bytes[at - 4..at].try_into().unwrap();
        bytes[at..at + 4].copy_from_slice(&before);
    }
    let payload = crc32fast::hash(&bytes[56..]);
    bytes[24..28].copy_from_slice(&payload.to_le_bytes());
    let crc = crc32fast::hash(&bytes[..48]);
    bytes[48..52].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    let f = file.to_str().unwrap();
    let port = free_port();
    let args = ["--rank", "4", "--iters", "3"];
    let rank1 = spawn_rank(1, port, &[f], &args, Stdio::null());
    let rank0 = spawn_rank(0, port, &[f], &args, Stdio::null());
    let o0 = wait_bounded(rank0, Duration::from_secs(120), "rank 0");
    let o1 = wait_bounded(rank1, Duration::from_secs(30), "rank 1");
    for o in [&o0, &o1] {
        assert_clean_failure(o, "not in increasing order");
        assert_clean_failure(o, "kruskal convert");
    }
}

#[test]
fn a_killed_rank_stops_the_other_with_its_name_and_nothing_written() {
    if two_gpus().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = tensor_file(dir.path(), 400_000);
    let f = file.to_str().unwrap();
    let out = dir.path().join("model");
    let port = free_port();
    let long = ["--rank", "16", "--iters", "100000", "--tol", "0"];
    let mut rank1 = spawn_rank(1, port, &[f], &long, Stdio::null());
    let mut rank0 = spawn_rank(
        0,
        port,
        &[f, "--out", out.to_str().unwrap()],
        &long,
        Stdio::piped(),
    );
    // Rank 0 prints a line per iteration: wait for a few.
    let mut lines = BufReader::new(rank0.stdout.take().unwrap()).lines();
    let mut seen = 0;
    for line in lines.by_ref() {
        if line.unwrap().contains("its =") {
            seen += 1;
            if seen == 3 {
                break;
            }
        }
    }
    assert_eq!(seen, 3, "rank 0 never iterated");
    rank1.kill().unwrap();
    let killed = Instant::now();
    rank1.wait().unwrap();
    // Drain stdout so rank 0 never blocks writing it.
    let drain = std::thread::spawn(move || lines.count());
    let o = wait_bounded(rank0, Duration::from_secs(60), "rank 0 after rank 1 died");
    drain.join().unwrap();
    let took = killed.elapsed();
    let err = text(&o.stderr);
    assert!(
        !o.status.success(),
        "rank 0 succeeded without rank 1: {err}"
    );
    assert!(err.contains("rank 1"), "rank 1 not named: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!out.exists(), "rank 0 wrote {} after a loss", out.display());
    eprintln!(
        "rank 0 stopped {:.1} s after rank 1 was killed: {}",
        took.as_secs_f64(),
        err.lines().last().unwrap_or("")
    );
}

#[test]
fn garbage_and_a_wrong_token_are_refused_and_the_job_still_runs() {
    if two_gpus().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = tensor_file(dir.path(), 100_000);
    let f = file.to_str().unwrap();
    let port = free_port();
    let common = ["--rank", "8", "--iters", "3", "--tol", "0"];
    let rank0 = spawn_rank(0, port, &[f], &common, Stdio::piped());
    // Garbage on the rendezvous port, once rank 0 listens.
    let start = Instant::now();
    let mut stream = loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(_) if start.elapsed() < Duration::from_secs(30) => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("rank 0 never listened: {e}"),
        }
    };
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    drop(stream);
    // A rank with another job's token.
    let stray = kruskal()
        .env("KRUSKAL_JOB_TOKEN", "another-jobs-token-9876543210")
        .args(["cpd", f, "--join-timeout-s", "20"])
        .args(common)
        .args(rank_args(1, port))
        .output()
        .unwrap();
    assert_clean_failure(&stray, "refused");
    // The real rank 1: the job completes.
    let rank1 = spawn_rank(1, port, &[f], &common, Stdio::piped());
    let o0 = wait_bounded(rank0, Duration::from_secs(120), "rank 0");
    let o1 = wait_bounded(rank1, Duration::from_secs(30), "rank 1");
    let err0 = text(&o0.stderr);
    assert!(o0.status.success(), "rank 0: {err0}");
    assert!(o1.status.success(), "rank 1: {}", text(&o1.stderr));
    assert!(
        text(&o0.stdout).contains("final fit"),
        "{}",
        text(&o0.stdout)
    );
    // Rank 0 logged both refusals.
    let refused = err0.lines().filter(|l| l.contains("127.0.0.1")).count();
    assert!(refused >= 2, "refusals not logged: {err0}");
    eprintln!("rank 0's log:\n{err0}");
}
