//! The `kruskal` program against input a careless or hostile user gives
//! it: files that lie about themselves, values at the ends of f32, options
//! at their limits, signals. Every case ends in a right answer or one
//! clear error line with a non-zero exit, never a silent wrong answer, a
//! crash, a hang or a file left behind.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kruskal_formats::{ReadOptions, SparseTensor, read_tensor, write_tensor};

mod common;

use common::{
    assert_clean_failure, data, fits, kruskal, kruskal_bin, kruskal_command, stderr, stdout,
};

/// The `--json` report of `kruskal cpd FILE` at rank `rank` on the CPU,
/// 8 iterations from seed 11, with `extra` flags.
fn cpd_json(file: &Path, rank: &str, extra: &[&str]) -> serde_json::Value {
    common::cpd_json(file, rank, extra).0
}

fn lambda(report: &serde_json::Value) -> Vec<f64> {
    report["lambda"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_f64().expect("a finite weight"))
        .collect()
}

fn read(path: &Path) -> SparseTensor {
    read_tensor(path, &ReadOptions::default()).unwrap()
}

/// Writes `t` with every value times `factor` (rounded once to f32) as a
/// `.tns` file in `dir`.
fn scaled_copy(dir: &Path, name: &str, t: &SparseTensor, factor: f64) -> PathBuf {
    let values = t
        .values()
        .iter()
        .map(|&v| (f64::from(v) * factor) as f32)
        .collect();
    let s = SparseTensor::new(t.dims().to_vec(), t.indices().to_vec(), values).unwrap();
    let path = dir.join(name);
    write_tensor(&path, &s).unwrap();
    path
}

/// Rewrites a 3-mode `.ktns` so that nonzero 1 repeats nonzero 0's
/// coordinate, keeping the header's claim of distinct coordinates and
/// sealing both checksums again. Returns the tensor the file now means
/// (the two lines summed).
fn repeat_first_coordinate(path: &Path) -> SparseTensor {
    let t = read(path);
    let nnz = t.nnz();
    let mut bytes = std::fs::read(path).unwrap();
    // 3 modes: D = 48, H = 56, S = align8(4 nnz).
    let stride = (4 * nnz).div_ceil(8) * 8;
    for mode in 0..3 {
        let at = 56 + mode * stride;
        let first: [u8; 4] = bytes[at..at + 4].try_into().unwrap();
        bytes[at + 4..at + 8].copy_from_slice(&first);
    }
    assert_eq!(&bytes[28..32], &1u32.to_le_bytes(), "the distinct flag");
    let payload = crc32fast::hash(&bytes[56..]);
    bytes[24..28].copy_from_slice(&payload.to_le_bytes());
    let crc = crc32fast::hash(&bytes[..48]);
    bytes[48..52].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(path, &bytes).unwrap();
    let mut indices = t.indices().to_vec();
    for idx in &mut indices {
        idx[1] = idx[0];
    }
    SparseTensor::new(t.dims().to_vec(), indices, t.values().to_vec()).unwrap()
}

#[test]
fn a_ktns_that_falsely_claims_distinct_coordinates_is_summed() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("lies.ktns");
    let o = kruskal(&[
        "convert",
        data("splatt-med.tns.gz").to_str().unwrap(),
        bin.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let meant = repeat_first_coordinate(&bin);
    assert_eq!(meant.nnz(), 99_999);
    let honest = dir.path().join("meant.tns");
    write_tensor(&honest, &meant).unwrap();

    // The same fit, iteration by iteration, as the tensor the file means.
    let want = fits(&cpd_json(&honest, "6", &[]));
    let got = fits(&cpd_json(&bin, "6", &[]));
    assert_eq!(got, want);
    // Every CPU engine.
    for kernel in ["fcoo", "flycoo", "hicoo"] {
        let want = fits(&cpd_json(&honest, "6", &["--kernel", kernel]));
        let got = fits(&cpd_json(&bin, "6", &["--kernel", kernel]));
        assert_eq!(got, want, "{kernel}");
    }
    // `info` counts the merged line and the summed norm.
    let info = |p: &Path| -> serde_json::Value {
        let o = kruskal(&["info", p.to_str().unwrap(), "--json"]);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str(&stdout(&o)).unwrap()
    };
    let (lies, meant) = (info(&bin), info(&honest));
    assert_eq!(lies["nnz"].as_u64(), Some(99_999));
    assert_eq!(lies["duplicates_merged"].as_u64(), Some(1));
    assert_eq!(lies["norm"], meant["norm"]);
}

/// The tensor of the two lines `1 1 1 v` and `2 2 2 v`.
fn two_lines(dir: &Path, name: &str, value: f32) -> PathBuf {
    let t = SparseTensor::new(vec![2, 2, 2], vec![vec![0, 1]; 3], vec![value; 2]).unwrap();
    let path = dir.join(name);
    write_tensor(&path, &t).unwrap();
    path
}

/// The per-iteration fits and the weights of `kruskal cpd` at rank 2 on
/// the two lines of value `big` equal, to the bit, those of the same
/// tensor scaled exactly into [1, 2) (which runs as it is), the weights
/// times the scale; and they are finite and right.
fn assert_same_run_as_near_one(dir: &Path, big: f32) {
    let exponent = kruskal::cpd::ValueScale::for_max_abs(f64::from(big)).exponent();
    assert_ne!(exponent, 0, "{big} is run scaled");
    let near_one = (f64::from(big) * 2f64.powi(exponent)) as f32;
    assert!((1.0..2.0).contains(&near_one));
    let out = dir.join(format!("model-{big:e}"));
    let v = cpd_json(
        &two_lines(dir, &format!("{big:e}.tns"), big),
        "2",
        &["--out", out.to_str().unwrap()],
    );
    let one = cpd_json(
        &two_lines(dir, &format!("{near_one:e}.tns"), near_one),
        "2",
        &[],
    );
    assert_eq!(fits(&v), fits(&one), "{big}");
    // Exactly the weights times the power (to the last bit JSON keeps).
    for (w, l) in lambda(&v).iter().zip(lambda(&one)) {
        let want = l * 2f64.powi(-exponent);
        assert!((w - want).abs() <= 1e-15 * want, "{big}: {w} {want}");
    }
    let fit = v["fit"].as_f64().unwrap();
    assert!(fit > 0.9999, "{big}: fit {fit}");
    for w in lambda(&v) {
        assert!(
            w.is_finite() && (w / f64::from(big) - 1.0).abs() < 1e-3,
            "{big}: {w}"
        );
    }
    // The files hold the same finite model.
    let saved = kruskal::cpd::load_factors(&out, 3).unwrap();
    assert!(saved.iter().flatten().all(|x| x.is_finite()));
    let bytes = std::fs::read(out.join("lambda.npy")).unwrap();
    let weights: Vec<f64> = bytes[bytes.len() - 16..]
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    for (a, b) in weights.iter().zip(lambda(&v)) {
        assert!((a - b).abs() <= 1e-15 * b, "{big}: {a} {b}");
    }
}

#[test]
fn values_at_the_top_of_f32_give_a_finite_model() {
    let dir = tempfile::tempdir().unwrap();
    for big in [3.4e38, f32::MAX, 1e30] {
        assert_same_run_as_near_one(dir.path(), big);
    }
}

#[test]
fn tiny_and_subnormal_values_give_the_fit_of_values_near_one() {
    let dir = tempfile::tempdir().unwrap();
    for tiny in [1e-23, 1e-30, 1e-40, f32::from_bits(1)] {
        assert_same_run_as_near_one(dir.path(), tiny);
    }
}

#[test]
fn the_fits_of_the_data_tensors_do_not_depend_on_the_scale_of_their_values() {
    let dir = tempfile::tempdir().unwrap();
    for (name, rank, pattern) in [
        ("splatt-small.tns", "2", false),
        ("splatt-med.tns.gz", "4", false),
        ("splatt-med4.tns.gz", "4", false),
        ("splatt-med5.tns.gz", "4", false),
        ("kg-jf17k-5mode-novalues.tns.gz", "4", true),
    ] {
        let opts = ReadOptions {
            pattern,
            ..ReadOptions::default()
        };
        let t = read_tensor(&data(name), &opts).unwrap();
        let flag: &[&str] = if pattern { &["--pattern"] } else { &[] };
        let base = fits(&cpd_json(&data(name), rank, flag));
        for factor in [1e-30, 1e30] {
            let file = scaled_copy(dir.path(), &format!("x{factor:e}-{name}"), &t, factor);
            let got = fits(&cpd_json(&file, rank, &[]));
            assert_eq!(got.len(), base.len());
            for (i, (a, b)) in got.iter().zip(&base).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6,
                    "{name} times {factor:e}, iteration {}: fit {a}, unscaled {b}",
                    i + 1
                );
            }
        }
    }
}

/// A `.ktns` of `nnz` nonzeros of 3 modes with a valid header and the
/// right length, whose payload is a hole: a few KiB on disk.
fn sparse_ktns(path: &Path, nnz: u64) {
    let mut header = Vec::new();
    header.extend_from_slice(b"KRUSKAL\0");
    header.extend_from_slice(&2u32.to_le_bytes());
    header.extend_from_slice(&3u32.to_le_bytes());
    header.extend_from_slice(&nnz.to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes()); // payload CRC
    header.extend_from_slice(&1u32.to_le_bytes()); // distinct
    for _ in 0..3 {
        header.extend_from_slice(&10u32.to_le_bytes());
    }
    header.resize(48, 0);
    let crc = crc32fast::hash(&header);
    header.extend_from_slice(&crc.to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes());
    std::fs::write(path, &header).unwrap();
    let stride = (4 * nnz).div_ceil(8) * 8;
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.set_len(56 + 4 * stride).unwrap();
}

/// `kruskal ARGS` under an address-space limit of `limit_kib` (`ulimit
/// -v`), as a user on a shared machine may run it.
fn kruskal_limited(limit_kib: u64, args: &[&str]) -> Output {
    // Two threads and two malloc arenas, so that the address space the
    // process takes before it allocates anything large does not grow
    // with the machine's cores (each arena reserves 64 MiB).
    Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {limit_kib} && exec \"$0\" \"$@\""))
        .arg(kruskal_bin())
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .env("MALLOC_ARENA_MAX", "2")
        .output()
        .expect("sh runs")
}

#[test]
fn a_ktns_promising_more_than_memory_is_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sparse.ktns");
    // 2^30 nonzeros: 16 GiB of arrays, under a 4 GiB limit.
    sparse_ktns(&file, 1 << 30);
    for cmd in ["info", "cpd"] {
        let start = std::time::Instant::now();
        let o = kruskal_limited(
            4 << 20,
            &[cmd, file.to_str().unwrap(), "--backend", "cpu"][..if cmd == "info" { 2 } else { 4 }],
        );
        assert_clean_failure(&o, "MemAvailable");
        // `cpd` knows from the header alone that the run cannot fit.
        let needle = if cmd == "info" {
            "1073741824 nonzeros"
        } else {
            "nothing was read"
        };
        assert_clean_failure(&o, needle);
        assert!(
            start.elapsed().as_secs() < 20,
            "{cmd} took {:?}",
            start.elapsed()
        );
    }
}

/// Whether a CUDA GPU is present (some refusals below are for machines
/// without one).
fn has_gpu() -> bool {
    kruskal_device::Gpu::count().is_ok_and(|n| n > 0)
}

#[test]
fn runs_that_cannot_work_are_refused_before_any_work() {
    // Each would generate or allocate tens to thousands of GiB; under an
    // 8 GiB limit each is refused in one line, at once.
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["cpd", "--like", "amazon", "--backend", "cpu"],
            "nothing was read or generated",
        ),
        (
            vec!["cpd", "--like", "patents", "--backend", "cpu"],
            "nothing was read or generated",
        ),
        (
            vec![
                "cpd",
                "--like",
                "nell-2",
                "--nnz",
                "1e11",
                "--backend",
                "cpu",
            ],
            "MemAvailable",
        ),
        (
            vec!["mttkrp", "--like", "nell-2", "--nnz", "1e11"],
            "MemAvailable",
        ),
        (
            vec!["info", "--like", "nell-2", "--nnz", "1e11"],
            "MemAvailable",
        ),
        (vec!["info", "--like", "amazon"], "MemAvailable"),
        (
            vec![
                "gen",
                "/nonexistent/x.tns",
                "--dims",
                "4294967295,4294967295",
                "--nnz",
                "10",
            ],
            "MemAvailable",
        ),
    ];
    // CP-APR on a 3-line file that names index 3e9: its f64 factors
    // alone would take 240 GB at rank 10.
    let dir = tempfile::tempdir().unwrap();
    let wide = dir.path().join("wide.tns");
    std::fs::write(&wide, "1 1 1 1\n2 2 2 2\n3000000000 2 2 3\n").unwrap();
    let wide = wide.to_str().unwrap().to_string();
    cases.push((vec!["cp-apr", &wide, "--rank", "10"], "MemAvailable"));
    if !has_gpu() {
        // Asking for GPUs where there are none is found out first.
        cases.push((
            vec!["cpd", "--like", "nell-1", "--nnz", "144M", "--gpus", "2"],
            "CUDA",
        ));
        cases.push((vec!["cpd", "--like", "nell-1", "--backend", "gpu"], "CUDA"));
        cases.push((
            vec![
                "mttkrp", "--like", "amazon", "--rank", "32", "--gpus", "1", "--stream", "always",
                "--verify",
            ],
            "CUDA",
        ));
    }
    for (args, needle) in cases {
        let start = std::time::Instant::now();
        let o = kruskal_limited(8 << 20, &args);
        assert_clean_failure(&o, needle);
        assert!(
            start.elapsed().as_secs() < 5,
            "{args:?} took {:?}",
            start.elapsed()
        );
    }
}

/// `kruskal ARGS` started with its standard output discarded and its
/// standard error captured.
fn spawn_quiet(args: &[&str]) -> std::process::Child {
    kruskal_command(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn a_billion_starts_allocate_nothing_ahead() {
    // Each start runs and only the best model is kept: the process stays
    // small while it works through them, and Ctrl-C ends it.
    let file = data("splatt-small.tns");
    let mut child = spawn_quiet(&[
        "cpd",
        file.to_str().unwrap(),
        "--rank",
        "2",
        "--iters",
        "2",
        "--starts",
        "1000000000",
        "--backend",
        "cpu",
        "--json",
    ]);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    assert!(child.try_wait().unwrap().is_none(), "ended early");
    signal(child.id(), "INT");
    let o = child.wait_with_output().unwrap();
    assert!(rss_kib < 500 << 10, "{rss_kib} KiB resident after 1.5 s");
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
}

#[test]
fn modes_and_threads_have_documented_limits() {
    let dir = tempfile::tempdir().unwrap();
    // A 40 KB file of 9,999 columns: refused at its first line.
    let wide = dir.path().join("wide.tns");
    let line: Vec<String> = (0..9_999).map(|_| "1".to_string()).collect();
    std::fs::write(&wide, format!("{}\n", line.join(" "))).unwrap();
    let start = std::time::Instant::now();
    let o = kruskal(&["cpd", wide.to_str().unwrap(), "--backend", "cpu"]);
    assert_clean_failure(&o, "at most 64");
    assert_clean_failure(&o, "wide.tns:1:");
    assert!(start.elapsed().as_secs() < 5, "{:?}", start.elapsed());
    // 64 modes are taken, 65 are not.
    let line = |n: usize| (0..n).map(|_| "1").collect::<Vec<_>>().join(" ");
    let ok = dir.path().join("ok.tns");
    std::fs::write(&ok, format!("{} 2.5\n", line(64))).unwrap();
    let o = kruskal(&["info", ok.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::write(&ok, format!("{} 2.5\n", line(65))).unwrap();
    assert_clean_failure(&kruskal(&["info", ok.to_str().unwrap()]), "at most 64");
    let dims = vec!["2"; 65].join(",");
    let out = dir.path().join("g.tns");
    let o = kruskal(&["gen", out.to_str().unwrap(), "--dims", &dims, "--nnz", "3"]);
    assert_clean_failure(&o, "at most 64");
    // Threads: a few per core, not a hundred thousand.
    let start = std::time::Instant::now();
    let small = data("splatt-small.tns");
    let o = kruskal(&["cpd", small.to_str().unwrap(), "--threads", "100000"]);
    assert_clean_failure(&o, "--threads 100000: at most");
    assert!(start.elapsed().as_secs() < 5, "{:?}", start.elapsed());
}

/// Sends `signal` (`TERM`, `INT`, `HUP`) to the process `pid`.
fn signal(pid: u32, signal: &str) {
    let sent = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}

/// Waits up to `limit` for `ready`, checking every 5 ms.
fn wait_until(limit: std::time::Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if ready() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    false
}

/// The names in `dir`, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// A long `kruskal cpd` of splatt-small writing its model to `out`.
fn long_run(file: &Path, out: &Path) -> std::process::Child {
    spawn_quiet(&[
        "cpd",
        file.to_str().unwrap(),
        "--rank",
        "2",
        "--iters",
        "100000000",
        "--tol",
        "0",
        "--backend",
        "cpu",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ])
}

/// Sends `sig` to `child`, waits (up to 20 s) until the program says it
/// will stop after this iteration, which shows the first signal was
/// handled, then sends `sig` again; returns what the program left: its
/// output with all of its stderr. Two signals sent without that wait may
/// reach the program as one on a loaded machine.
fn signal_twice(mut child: std::process::Child, sig: &str) -> Output {
    use std::io::Read;
    let mut pipe = child.stderr.take().expect("stderr is piped");
    let text = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let reader = {
        let text = text.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                match pipe.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => text.lock().unwrap().extend_from_slice(&buf[..n]),
                }
            }
        })
    };
    signal(child.id(), sig);
    let handled = wait_until(std::time::Duration::from_secs(20), || {
        String::from_utf8_lossy(&text.lock().unwrap()).contains("stopping after this iteration")
    });
    assert!(
        handled,
        "{sig}: the first signal was not acknowledged: {}",
        String::from_utf8_lossy(&text.lock().unwrap())
    );
    assert!(
        child.try_wait().unwrap().is_none(),
        "{sig}: the program ended before the second signal: {}",
        String::from_utf8_lossy(&text.lock().unwrap())
    );
    signal(child.id(), sig);
    let status = child.wait().unwrap();
    reader.join().unwrap();
    let stderr = std::mem::take(&mut *text.lock().unwrap());
    Output {
        status,
        stdout: Vec::new(),
        stderr,
    }
}

#[test]
fn sigterm_and_sighup_stop_cleanly_and_a_second_one_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let file = data("splatt-small.tns");
    // One SIGTERM (or SIGHUP): stop after the iteration, write the model.
    for sig in ["TERM", "HUP"] {
        let out = dir.path().join(format!("model-{sig}"));
        let child = long_run(&file, &out);
        assert!(wait_until(std::time::Duration::from_secs(20), || out.is_dir()));
        std::thread::sleep(std::time::Duration::from_millis(300));
        signal(child.id(), sig);
        let o = child.wait_with_output().unwrap();
        assert_eq!(o.status.code(), Some(130), "{sig}: {}", stderr(&o));
        assert_eq!(
            names_in(&out),
            ["lambda.npy", "mode-1.npy", "mode-2.npy", "mode-3.npy"],
            "{sig}"
        );
    }
    // Two: stop at once. Unless the model was in place before the second
    // arrived (and the program says so), the directories the run made are
    // gone.
    let out = dir.path().join("deep").join("model");
    let child = long_run(&file, &out);
    assert!(wait_until(std::time::Duration::from_secs(20), || out.is_dir()));
    std::thread::sleep(std::time::Duration::from_millis(300));
    let o = signal_twice(child, "TERM");
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(130), "{err}");
    if err.contains("nothing written") {
        assert!(!dir.path().join("deep").exists(), "{err}");
    } else {
        assert_eq!(names_in(&out).len(), 4, "{err}");
    }
}

#[test]
fn a_second_signal_while_the_model_is_written_leaves_all_or_nothing() {
    // A 40,000,000-row factor (--compact writes the file's numbering):
    // 320 MB to write, long enough to be interrupted while writing.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("wide.tns");
    std::fs::write(&file, "1 1 1 1.0\n2 2 2 2.0\n40000000 3 3 3.0\n").unwrap();
    let out = dir.path().join("model");
    let child = spawn_quiet(&[
        "cpd",
        file.to_str().unwrap(),
        "--rank",
        "2",
        "--iters",
        "2",
        "--compact",
        "--backend",
        "cpu",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ]);
    let staging = || {
        names_in(dir.path())
            .iter()
            .any(|n| n.starts_with(".kruskal-"))
    };
    let seen = wait_until(std::time::Duration::from_secs(60), staging);
    let o = signal_twice(child, "INT");
    let err = stderr(&o);
    assert!(seen, "no staging directory was seen: {err}");
    assert_eq!(o.status.code(), Some(130), "{err}");
    // Either nothing (and no directory), or the whole model, as it says.
    let left = names_in(dir.path());
    if err.contains("nothing written") {
        assert_eq!(left, ["wide.tns"], "{err}");
    } else {
        assert!(err.contains("the model was already written"), "{err}");
        assert_eq!(left, ["model", "wide.tns"], "{err}");
        assert_eq!(
            names_in(&out),
            ["lambda.npy", "mode-1.npy", "mode-2.npy", "mode-3.npy"]
        );
    }
}

#[test]
fn options_get_the_programs_own_rules() {
    let small = data("splatt-small.tns");
    let f = small.to_str().unwrap();
    // Negative numbers reach the rule, not the number parser.
    for (flag, value, rule) in [
        ("--seed", "-1", "a seed is a whole number from 0"),
        ("--threads", "-1", "--threads is 0 (one thread per core)"),
        ("--rank", "-3", "the rank is a whole number of at least 1"),
    ] {
        let o = kruskal(&["cpd", f, flag, value]);
        let err = stderr(&o);
        assert!(
            !o.status.success() && err.contains(rule),
            "{flag} {value}: {err}"
        );
        assert!(
            !err.contains("unexpected argument") && !err.contains("invalid digit"),
            "{err}"
        );
    }
    // GPU launch options: out of range anywhere, and refused on the CPU
    // rather than ignored.
    for (args, needle) in [
        (vec!["--threadlen", "3"], "--threadlen 3: a power of two"),
        (vec!["--block-bits", "99"], "--block-bits 99: from 1 to 8"),
        (vec!["--kappa", "0"], "--kappa 0"),
        (
            vec!["--backend", "cpu", "--threadlen", "4", "--kappa", "2"],
            "--kappa, --threadlen: options of the GPU engines",
        ),
    ] {
        let mut all = vec!["cpd", f];
        all.extend(&args);
        assert_clean_failure(&kruskal(&all), needle);
        all[0] = "mttkrp";
        assert_clean_failure(&kruskal(&all), needle);
    }
}

#[test]
fn bad_initial_factors_name_their_file() {
    let dir = tempfile::tempdir().unwrap();
    let small = data("splatt-small.tns");
    let f = small.to_str().unwrap();
    let model = dir.path().join("model");
    let o = kruskal(&[
        "cpd",
        f,
        "--rank",
        "2",
        "--backend",
        "cpu",
        "--out",
        model.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let init = |extra: &[&str]| {
        let mut args = vec![
            "cpd",
            f,
            "--backend",
            "cpu",
            "--init",
            model.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        kruskal(&args)
    };
    assert!(init(&[]).status.success());
    // A .npy of float64 values: the 2 weights, one of them NaN.
    let npy = |values: &[f64], shape: &str| {
        let dict = format!("{{'descr': '<f8', 'fortran_order': False, 'shape': {shape}, }}");
        let mut header = dict.into_bytes();
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(b' ');
        }
        header.push(b'\n');
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
        bytes.extend_from_slice(&header);
        for v in values {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        bytes
    };
    let lambda = model.join("lambda.npy");
    let good_lambda = std::fs::read(&lambda).unwrap();
    std::fs::write(&lambda, npy(&[1.0, f64::NAN], "(2,)")).unwrap();
    assert_clean_failure(&init(&[]), "lambda.npy: weight 2 is NaN");
    std::fs::write(&lambda, &good_lambda).unwrap();
    // splatt-small is 2 x 3 x 2: mode 3 has 2 rows of 2 columns.
    let mode3 = model.join("mode-3.npy");
    let good_mode3 = std::fs::read(&mode3).unwrap();
    std::fs::write(&mode3, npy(&[1.0, 0.5, f64::INFINITY, 2.0], "(2, 2)")).unwrap();
    assert_clean_failure(&init(&[]), "mode-3.npy: holds inf at row 2, column 1");
    std::fs::write(&mode3, npy(&[0.0; 4], "(2, 2)")).unwrap();
    assert_clean_failure(&init(&[]), "mode 3 is all zeros");
    std::fs::write(&mode3, &good_mode3).unwrap();
    std::fs::write(model.join("mode-4.npy"), &good_mode3).unwrap();
    assert_clean_failure(
        &init(&[]),
        "mode-4.npy: a factor beyond the tensor's 3 modes",
    );
}

#[test]
fn a_gzip_bomb_of_one_repeated_line_is_summed_within_the_limit() {
    // 400 KB of gzip, 24,000,000 copies of one line: 384 MB of columns
    // and as much again to sum them were they all held; summed while
    // read, they fit a 1 GiB limit.
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let bomb = dir.path().join("bomb.tns.gz");
    let mut gz = flate2::write::GzEncoder::new(
        std::fs::File::create(&bomb).unwrap(),
        flate2::Compression::fast(),
    );
    let block = b"1 1 1 1\n".repeat(1 << 20);
    let copies = 24_000_000 / (1 << 20) + 1;
    for _ in 0..copies {
        gz.write_all(&block).unwrap();
    }
    gz.finish().unwrap();
    let start = std::time::Instant::now();
    let o = kruskal_limited(1 << 20, &["info", bomb.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("nnz       1\n"), "{out}");
    let lines = copies * (1 << 20);
    let merged = format!("{}", lines - 1);
    assert!(
        out.replace(',', "")
            .contains(&format!("merged    {merged} lines")),
        "{out}"
    );
    assert!(start.elapsed().as_secs() < 60, "{:?}", start.elapsed());
}

#[test]
fn streams_and_devices_are_named_as_such_and_a_fifo_does_not_hang() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.tns.gz");
    let made = Command::new("mkfifo").arg(&fifo).status();
    let mut inputs = vec![PathBuf::from("/dev/zero"), PathBuf::from("/dev/urandom")];
    if made.is_ok_and(|s| s.success()) {
        inputs.push(fifo);
    }
    for input in &inputs {
        let start = std::time::Instant::now();
        let o = kruskal(&["info", input.to_str().unwrap()]);
        assert_clean_failure(&o, "not a regular file");
        assert!(start.elapsed().as_secs() < 5, "{}", input.display());
    }
    if Path::new("/proc/self/environ").is_file() {
        let o = kruskal(&["info", "/proc/self/environ"]);
        assert_clean_failure(&o, "reports a length of 0 but holds data");
    }
    // A .ktns that is neither the binary format nor text says so.
    let bad = dir.path().join("bad.ktns");
    std::fs::write(&bad, b"KRUSKAX\0\x02\x00\x00\x00\xff\xfe").unwrap();
    assert_clean_failure(
        &kruskal(&["info", bad.to_str().unwrap()]),
        "not a kruskal binary tensor",
    );
}

#[test]
fn a_signal_while_a_tensor_file_is_written_leaves_no_temporary() {
    // gen writes through a temporary beside the output; SIGTERM while it
    // does removes it (and the output never appears).
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("big.tns");
    let child = spawn_quiet(&[
        "gen",
        out.to_str().unwrap(),
        "--like",
        "nell-2",
        "--nnz",
        "8M",
    ]);
    let writing = || {
        names_in(dir.path())
            .iter()
            .any(|n| n.starts_with(".big.tns."))
    };
    let seen = wait_until(std::time::Duration::from_secs(120), writing);
    signal(child.id(), "TERM");
    let o = child.wait_with_output().unwrap();
    assert!(seen, "no temporary was seen: {}", stderr(&o));
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert!(stderr(&o).contains("nothing written"), "{}", stderr(&o));
    assert!(
        names_in(dir.path()).is_empty(),
        "{:?}",
        names_in(dir.path())
    );
}
