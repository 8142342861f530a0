//! End-to-end tests of the `kruskal` program: real files in, real files out,
//! exit codes and one-line errors.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;

use common::{assert_clean_failure, data, kruskal, kruskal_command, stderr, stdout};

#[test]
fn demo_reaches_the_planted_fit() {
    let o = kruskal(&["cpd", "--demo", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert!(v["fit"].as_f64().unwrap() >= 0.99, "{v}");
    assert!(v["factor_match_score"].as_f64().unwrap() >= 0.95, "{v}");
    assert!(v["iterations"].as_array().unwrap().len() >= 2);
    // Three random starts by default; the kept model is the best of them.
    let starts = v["starts"].as_array().unwrap();
    assert_eq!(starts.len(), 3);
    let best = starts
        .iter()
        .map(|s| s["fit"].as_f64().unwrap())
        .fold(f64::MIN, f64::max);
    assert_eq!(v["fit"].as_f64().unwrap(), best);
    // The wall time in parts: the run's own steps as reported above, and
    // the parts with the rest add up to the whole.
    // Several starts: all of them as one part.
    let wall = &v["wall"];
    assert_eq!(wall["iterations_s"], v["cpd_s"], "{wall}");
    assert_eq!(
        (wall["setup_s"].as_f64(), wall["finish_s"].as_f64()),
        (Some(0.0), Some(0.0))
    );
    assert_eq!(wall["preparation_s"], v["prepare_s"], "{wall}");
    let parts = [
        "start",
        "load",
        "preparation",
        "setup",
        "iterations",
        "finish",
        "model_written",
        "teardown",
        "other",
    ];
    let sum_of = |wall: &serde_json::Value| -> f64 {
        parts
            .iter()
            .map(|p| wall[format!("{p}_s")].as_f64().unwrap())
            .sum()
    };
    let total = wall["total_s"].as_f64().unwrap();
    assert!(total > 0.0 && (sum_of(wall) - total).abs() < 1e-6, "{wall}");
    // One start: its factors' setup and finish apart from its iterations,
    // the three making the decomposition's time.
    let o = kruskal(&[
        "cpd", "--like", "nips", "--nnz", "30k", "--rank", "4", "--iters", "3", "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let wall = &v["wall"];
    let part = |p: &str| wall[format!("{p}_s")].as_f64().unwrap();
    assert!(part("setup") > 0.0 && part("finish") > 0.0, "{wall}");
    let cpd_s = v["cpd_s"].as_f64().unwrap();
    assert!(
        (part("setup") + part("iterations") + part("finish") - cpd_s).abs() < 1e-9,
        "{wall}"
    );
    assert!((sum_of(wall) - part("total")).abs() < 1e-6, "{wall}");
}

#[test]
fn cpd_writes_numpy_files_and_restarts_from_them() {
    let file = data("splatt-med.tns.gz");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model");
    let o = kruskal(&[
        "cpd",
        file.to_str().unwrap(),
        "--rank",
        "5",
        "--iters",
        "5",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("its =   5"), "{}", stdout(&o));
    for name in ["lambda.npy", "mode-1.npy", "mode-2.npy", "mode-3.npy"] {
        let bytes = std::fs::read(out.join(name)).unwrap();
        assert_eq!(&bytes[..6], b"\x93NUMPY", "{name} is not .npy");
    }
    // Restarting from the model continues where it stopped: the first fit
    // is at least the last fit of the first run (minus rounding).
    let first: serde_json::Value = {
        let o = kruskal(&[
            "cpd",
            file.to_str().unwrap(),
            "--rank",
            "5",
            "--iters",
            "5",
            "--json",
        ]);
        serde_json::from_str(&stdout(&o)).unwrap()
    };
    let o = kruskal(&[
        "cpd",
        file.to_str().unwrap(),
        "--iters",
        "2",
        "--init",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let second: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(second["rank"], 5);
    let last_fit = first["fit"].as_f64().unwrap();
    let restart_fit = second["iterations"][0]["fit"].as_f64().unwrap();
    assert!(restart_fit >= last_fit - 1e-4, "{restart_fit} < {last_fit}");
}

#[test]
fn bad_lines_give_one_line_errors_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.tns");
    std::fs::write(&path, "1 1 1 1.0\n2 2 2 2.0\n3 x 3 1.0\n").unwrap();
    let o = kruskal(&["info", path.to_str().unwrap()]);
    assert_clean_failure(&o, "bad.tns:3");
    std::fs::write(&path, "1 1 1 1.0\n0 2 2 2.0\n").unwrap();
    let o = kruskal(&["cpd", path.to_str().unwrap(), "--rank", "2"]);
    assert_clean_failure(&o, "--zero-based");
    let o = kruskal(&["info", dir.path().join("missing.tns").to_str().unwrap()]);
    assert_clean_failure(&o, "missing.tns");
}

#[test]
fn pattern_files_are_read_as_values_with_a_warning() {
    let file = data("kg-jf17k-4mode-novalues.tns.gz");
    let o = kruskal(&["info", file.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["nmodes"], 3);
    let err = stderr(&o);
    assert_eq!(
        err.lines().filter(|l| l.contains("warning")).count(),
        1,
        "{err}"
    );
    assert!(
        err.contains("looks like an index") && err.contains("--pattern"),
        "{err}"
    );
    let o = kruskal(&["info", file.to_str().unwrap(), "--pattern", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("warning"), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["nmodes"], 4);
    assert_eq!(v["nnz"], 34_544);

    // The same rule for a two-line file.
    let dir = tempfile::tempdir().unwrap();
    let tiny = dir.path().join("tiny.tns");
    std::fs::write(&tiny, "1 1 1\n2 2 2\n").unwrap();
    let o = kruskal(&["info", tiny.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("--pattern"), "{}", stderr(&o));
    // Counts are values, without a word: large whole numbers, rarely 1.
    let counts = dir.path().join("counts.tns");
    let text: String = (0..3000u32)
        .map(|i| {
            format!(
                "{} {} {}\n",
                i % 60 + 1,
                i / 60 + 1,
                [3, 1, 12, 250, 7][i as usize % 5]
            )
        })
        .collect();
    std::fs::write(&counts, text).unwrap();
    let o = kruskal(&["info", counts.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(
        (v["nmodes"].as_u64(), v["nnz"].as_u64()),
        (Some(2), Some(3000))
    );
}

/// Per-iteration fits of a `kruskal cpd --json` run.
fn cpd_fits(file: &Path, extra: &[&str]) -> (Vec<f64>, Output) {
    let (v, o) = common::cpd_json(file, "6", extra);
    (common::fits(&v), o)
}

#[test]
fn repeated_coordinates_give_the_fit_of_the_summed_tensor() {
    // The repeats file is splatt-med with 4,041 extra lines (values split
    // over two or three lines) in shuffled order.
    let (clean, _) = cpd_fits(&data("splatt-med.tns.gz"), &[]);
    let (repeats, o) = cpd_fits(&data("splatt-med-repeats.tns.gz"), &[]);
    assert_eq!(clean.len(), 8);
    assert_eq!(clean, repeats, "every iteration's fit");
    assert!(clean.iter().all(|&f| f > 0.0 && f < 0.9), "{clean:?}");
    let err = stderr(&o);
    assert!(
        err.contains("4,041 lines repeat a coordinate") && err.contains("100,000 nonzeros"),
        "{err}"
    );
    // The same through a .ktns written from it, and `info` agrees.
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("r.ktns");
    let o = kruskal(&[
        "convert",
        data("splatt-med-repeats.tns.gz").to_str().unwrap(),
        bin.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (from_bin, o) = cpd_fits(&bin, &[]);
    assert_eq!(from_bin, clean);
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
    let o = kruskal(&["info", bin.to_str().unwrap(), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(
        (v["nnz"].as_u64(), v["duplicates_merged"].as_u64()),
        (Some(100_000), Some(0))
    );
}

#[test]
fn generated_tensors_have_the_nonzeros_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("g.tns");
    let o = kruskal(&[
        "gen",
        t.to_str().unwrap(),
        "--like",
        "nell-2",
        "--nnz",
        "30k",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = kruskal(&["info", t.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(
        (v["nnz"].as_u64(), v["duplicates_merged"].as_u64()),
        (Some(30_000), Some(0))
    );
    // A generated tensor's fit is below 1: its norm is that of distinct
    // coordinates.
    let o = kruskal(&[
        "cpd",
        "--like",
        "nell-2",
        "--nnz",
        "30k",
        "--rank",
        "4",
        "--iters",
        "3",
        "--backend",
        "cpu",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let fit = v["fit"].as_f64().unwrap();
    assert!(fit > 0.0 && fit < 0.99, "{fit}");
}

#[test]
fn convert_round_trips_through_binary_and_gzip() {
    let dir = tempfile::tempdir().unwrap();
    let tns = dir.path().join("t.tns");
    let o = kruskal(&[
        "gen",
        tns.to_str().unwrap(),
        "--like",
        "enron",
        "--nnz",
        "5000",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bin = dir.path().join("t.ktns");
    let gz = dir.path().join("t.tns.gz");
    for (from, to) in [(&tns, &bin), (&bin, &gz)] {
        let o = kruskal(&["convert", from.to_str().unwrap(), to.to_str().unwrap()]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(stdout(&o).contains("MB/s"));
    }
    let info = |p: &Path| -> serde_json::Value {
        serde_json::from_str(&stdout(&kruskal(&["info", p.to_str().unwrap(), "--json"]))).unwrap()
    };
    let (a, b) = (info(&tns), info(&gz));
    assert_eq!(a["dims"], b["dims"]);
    assert_eq!(a["nnz"], 5000);
    assert_eq!(a["norm"], b["norm"]);
}

#[test]
fn planted_gen_writes_its_factors() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("p.ktns");
    let f = dir.path().join("truth");
    let o = kruskal(&[
        "gen",
        t.to_str().unwrap(),
        "--dims",
        "50,40,30",
        "--nnz",
        "3000",
        "--planted",
        "3",
        "--factors",
        f.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(f.join("mode-3.npy").exists() && f.join("lambda.npy").exists());
    // Starting from the true factors, the first iteration already fits.
    let o = kruskal(&[
        "cpd",
        t.to_str().unwrap(),
        "--init",
        f.to_str().unwrap(),
        "--iters",
        "1",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert!(v["fit"].as_f64().unwrap() > 0.999, "{v}");
}

#[test]
fn init_shapes_are_checked_before_the_run_and_name_the_dims_that_fit() {
    // A sparse planted tensor written as text: its dimensions are its
    // largest indices, fewer than the factors' rows.
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("p.tns");
    let f = dir.path().join("truth");
    let o = kruskal(&[
        "gen",
        t.to_str().unwrap(),
        "--dims",
        "300,200,100",
        "--nnz",
        "400",
        "--planted",
        "3",
        "--factors",
        f.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let cpd = |extra: &[&str]| {
        let mut args = vec![
            "cpd",
            t.to_str().unwrap(),
            "--init",
            f.to_str().unwrap(),
            "--iters",
            "1",
            "--backend",
            "cpu",
        ];
        args.extend_from_slice(extra);
        kruskal(&args)
    };
    let o = cpd(&[]);
    assert_clean_failure(
        &o,
        "read it with --dims 300,200,100 to give the factors' dimensions",
    );
    // Refused before any backend is prepared or iteration runs.
    assert!(!stdout(&o).contains("backend"), "{}", stdout(&o));
    assert!(!stdout(&o).contains("its ="), "{}", stdout(&o));
    // With the dimensions the error names, the same files run.
    let o = cpd(&["--dims", "300,200,100", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert!(v["fit"].as_f64().unwrap() > 0.999, "{v}");
}

#[test]
fn mttkrp_verifies_against_the_reference() {
    let o = kruskal(&[
        "mttkrp", "--like", "vast-5d", "--nnz", "20000", "--rank", "7", "--repeat", "2",
        "--verify", "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let modes = v["modes"].as_array().unwrap();
    assert_eq!(modes.len(), 5);
    for m in modes {
        assert!(m["relative_error"].as_f64().unwrap() < 1e-5, "{m}");
        assert!(m["median_ms"].as_f64().unwrap() > 0.0);
    }
    let o = kruskal(&["mttkrp", "--like", "nell-2", "--nnz", "100", "--mode", "4"]);
    assert_clean_failure(&o, "--mode");
}

#[test]
fn failed_output_leaves_no_model_behind() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model");
    std::fs::create_dir_all(out.join("mode-2.npy")).unwrap();
    let o = kruskal(&[
        "cpd",
        "--like",
        "nell-2",
        "--nnz",
        "2000",
        "--rank",
        "2",
        "--iters",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_clean_failure(&o, "mode-2.npy");
    let names: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["mode-2.npy"]);
}

#[test]
fn gen_lists_presets_and_rejects_unknown_ones() {
    let o = kruskal(&["gen", "--list"]);
    assert!(stdout(&o).contains("delicious-4d"));
    let dir = tempfile::tempdir().unwrap();
    let o = kruskal(&[
        "gen",
        dir.path().join("x.tns").to_str().unwrap(),
        "--like",
        "nell-9",
    ]);
    assert_clean_failure(&o, "unknown tensor 'nell-9'");
    assert!(!dir.path().join("x.tns").exists());
    // One list with `cargo xtask fetch-frostt`: FROSTT's names work too,
    // and --list shows both.
    assert!(stdout(&kruskal(&["gen", "--list"])).contains("amazon-reviews"));
    let out = dir.path().join("v.ktns");
    let o = kruskal(&[
        "gen",
        out.to_str().unwrap(),
        "--like",
        "vast-2015-mc1-5d",
        "--nnz",
        "1000",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("5 modes"), "{}", stdout(&o));
}

#[test]
fn given_dims_are_used_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.tns");
    std::fs::write(&path, "1 2 3 1.5\n4 1 1 2.0\n").unwrap();
    let o = kruskal(&[
        "info",
        path.to_str().unwrap(),
        "--dims",
        "10,20,30",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["dims"], serde_json::json!([10, 20, 30]));
    let o = kruskal(&["info", path.to_str().unwrap(), "--dims", "3,20,30"]);
    assert_clean_failure(&o, "t.tns:2");
}

#[test]
fn every_kernel_agrees_with_the_reference_and_cpd_accepts_each() {
    let o = kruskal(&[
        "mttkrp", "--like", "enron", "--nnz", "20000", "--rank", "7", "--repeat", "1", "--kernel",
        "all", "--verify", "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let runs = v["runs"].as_array().unwrap();
    let names: Vec<&str> = runs.iter().map(|r| r["kernel"].as_str().unwrap()).collect();
    assert_eq!(names, ["sorted", "fcoo", "flycoo", "hicoo", "csf"]);
    for r in runs {
        let modes = r["modes"].as_array().unwrap();
        assert_eq!(modes.len(), 4);
        for m in modes {
            assert!(m["relative_error"].as_f64().unwrap() < 1e-5, "{r}");
        }
    }
    // The same CPD, iteration by iteration, whatever the engine.
    let fits = |kernel: &str| -> Vec<f64> {
        let o = kruskal(&[
            "cpd",
            "--like",
            "nips",
            "--nnz",
            "20000",
            "--rank",
            "4",
            "--iters",
            "5",
            "--tol",
            "0",
            "--backend",
            "cpu",
            "--kernel",
            kernel,
            "--json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(v["kernel"], kernel);
        v["iterations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["fit"].as_f64().unwrap())
            .collect()
    };
    let base = fits("sorted");
    for kernel in ["fcoo", "flycoo", "hicoo", "csf"] {
        for (a, b) in base.iter().zip(fits(kernel)) {
            assert!((a - b).abs() < 1e-5, "{kernel}: fit {b} vs {a}");
        }
    }
    assert_clean_failure(
        &kruskal(&["cpd", "--demo", "--kernel", "splatt"]),
        "unknown kernel 'splatt'",
    );
}

#[test]
fn info_reports_partition_and_gpu_balance() {
    let o = kruskal(&[
        "info", "--like", "nell-2", "--nnz", "200000", "--kappa", "64", "--gpus", "2", "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    for p in v["partitions"].as_array().unwrap() {
        let lpt = p["lpt_max_over_mean"].as_f64().unwrap();
        // Splitting heavy rows balances what whole rows cannot.
        assert!(lpt < 1.1, "{p}");
        assert!(
            p["whole_rows_lpt_max_over_mean"].as_f64().unwrap() > 2.0 * lpt,
            "{p}"
        );
        assert!(p["cyclic_max_over_mean"].as_f64().unwrap() >= lpt, "{p}");
    }
    let gpus = v["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 3);
    for g in gpus {
        assert!(g["gpu_max_over_mean"].as_f64().unwrap() < 1.05, "{g}");
    }
    assert_clean_failure(
        &kruskal(&["info", "--like", "nips", "--kappa", "0"]),
        "at least 1",
    );
}

#[test]
fn check_prints_its_table_and_fails_cleanly_without_a_gpu() {
    let o = kruskal_command(&["check", "--quick"])
        .env_remove("KRUSKAL_TEST_DATA")
        .output()
        .expect("the kruskal binary runs");
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "engine",
        "worst error",
        "cpu sorted",
        "cpu hicoo",
        "determinism",
        "remap",
        "--data DIR",
        "cp-apr phi (cpu)",
        "ao-admm prox (cpu)",
        "ao-admm inner (cpu)",
        "algorithm",
        "counts 3 modes",
    ] {
        assert!(out.contains(needle), "'{needle}' not in: {out}");
    }
    assert!(!out.contains("FAIL"), "{out}");

    let o = kruskal(&[
        "check",
        "--quick",
        "--json",
        "--data",
        "/nonexistent/kruskal",
    ]);
    assert_clean_failure(&o, "not a folder");

    // Where a GPU can be used, `check --gpu` runs every GPU engine and
    // the GPU's CP-APR and AO-ADMM steps (the engines themselves are
    // checked case by case in kruskal-device's `devices` tests); elsewhere
    // its error is checked.
    if kruskal(&["info", "--gpu"]).status.success() {
        let o = kruskal(&["check", "--gpu", "--quick", "--json"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        for engine in [
            "gpu coo",
            "gpu hicoo",
            "gpu fcoo",
            "gpu flycoo",
            "gpu flycoo kappa=7 deterministic",
            "cp-apr phi (gpu)",
            "ao-admm prox (gpu)",
            "ao-admm inner (gpu)",
        ] {
            assert!(
                out.contains(&format!("\"{engine}")),
                "{engine} missing: {out}"
            );
        }
        return;
    }
    // The advice fits the command: check has no --backend.
    let o = kruskal(&["check", "--gpu"]);
    assert_clean_failure(&o, "without --gpu, check tests the CPU engines");
    assert!(!stderr(&o).contains("--backend"), "{}", stderr(&o));
}

/// Whether this machine has a usable GPU (`info --gpu` succeeds).
fn has_gpu() -> bool {
    kruskal(&["info", "--gpu"]).status.success()
}

#[test]
fn cpd_picks_a_backend_and_reports_the_time_split() {
    let base = [
        "cpd", "--like", "nips", "--nnz", "30k", "--rank", "4", "--iters", "3", "--tol", "0",
    ];
    let run = |extra: &[&str]| kruskal(&[&base[..], extra].concat());
    let o = run(&["--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let gpu = has_gpu();
    assert_eq!(v["backend"], if gpu { "gpu" } else { "cpu" }, "{v}");
    if !gpu {
        let why = v["gpu_not_used"].as_str().unwrap();
        assert!(why.contains("CUDA"), "{why}");
    }
    for it in v["iterations"].as_array().unwrap() {
        let modes = it["mttkrp_modes_s"].as_array().unwrap();
        assert_eq!(modes.len(), 4, "{it}");
        let sum: f64 = modes.iter().map(|x| x.as_f64().unwrap()).sum();
        assert!(
            (sum - it["mttkrp_s"].as_f64().unwrap()).abs() < 1e-9,
            "{it}"
        );
        assert!(it["update_s"].as_f64().unwrap() > 0.0, "{it}");
        assert!(it["fit_s"].as_f64().unwrap() >= 0.0, "{it}");
    }
    let text = stdout(&run(&[]));
    assert!(
        text.contains("update") && text.contains("its =   3"),
        "{text}"
    );
    if !gpu {
        assert!(
            text.contains("GPU not used") && text.contains("backend    cpu"),
            "{text}"
        );
    }

    assert_clean_failure(&run(&["--kernel", "bogus"]), "unknown kernel");
    assert_clean_failure(
        &run(&["--backend", "cpu", "--kernel", "coo"]),
        "runs on the GPU only",
    );
    assert_clean_failure(
        &run(&["--backend", "gpu", "--kernel", "sorted"]),
        "runs on the CPU only",
    );
    if gpu {
        eprintln!("note: a GPU is present; its runs are the GPU machine's tests");
        return;
    }
    assert_clean_failure(&run(&["--backend", "gpu"]), "drop --backend gpu");
    assert_clean_failure(
        &run(&["--kernel", "coo"]),
        "runs on the GPU only, and the GPU cannot be used",
    );
}

#[cfg(unix)]
#[test]
fn ctrl_c_stops_after_the_iteration_and_writes_the_model() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model");
    let mut child = kruskal_command(&[
        "cpd",
        "--like",
        "nips",
        "--nnz",
        "200k",
        "--rank",
        "8",
        "--iters",
        "100000",
        "--tol",
        "0",
        "--out",
        out.to_str().unwrap(),
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let first_iteration = line.contains("its =   1");
        seen.push(line);
        if first_iteration {
            break;
        }
    }
    assert!(
        seen.last().is_some_and(|l| l.contains("its =")),
        "no iteration line: {seen:?}"
    );
    // SAFETY: kill(2) with the child's pid and SIGINT; no memory involved.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    let status = child.wait().unwrap();
    let text = rest.join("\n");
    assert_eq!(status.code(), Some(130), "{text}");
    assert!(text.contains("interrupted"), "{text}");
    assert!(text.contains("the model so far"), "{text}");
    let iterations = rest.iter().filter(|l| l.contains("its =")).count();
    assert!(
        iterations < 1000,
        "did not stop: {iterations} more iterations"
    );
    for name in ["lambda.npy", "mode-1.npy", "mode-4.npy"] {
        let bytes = std::fs::read(out.join(name)).unwrap();
        assert_eq!(&bytes[..6], b"\x93NUMPY", "{name} is not .npy");
    }
}

#[test]
fn info_prints_tensor_features() {
    let o = kruskal(&[
        "info",
        "--like",
        "nell-2",
        "--nnz",
        "20000",
        "--features",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let modes = v["features"]["modes"].as_array().unwrap();
    assert_eq!(modes.len(), 3);
    for m in modes {
        let (slices, fibers) = (m["slices"].as_u64().unwrap(), m["fibers"].as_u64().unwrap());
        assert!(slices > 0 && fibers >= slices && fibers <= 20_000, "{m}");
        assert!(m["slice_gini"].as_f64().unwrap() > 0.0, "{m}");
    }
    // nell-2's smallest dimension is mode 2: the fiber mode of modes 1 and 3.
    assert_eq!(modes[0]["fiber_mode"], 2);
    let o = kruskal(&["info", "--like", "nell-2", "--nnz", "20000", "--features"]);
    assert!(stdout(&o).contains("max nnz / fiber"), "{}", stdout(&o));
}

/// A model trained on made-up times (fcoo with 16 nonzeros per thread
/// always fastest; not GPU numbers) drives `tune predict` and `tune eval`
/// through `KRUSKAL_TUNE_MODEL`.
#[test]
fn tune_predicts_and_judges_with_a_given_model() {
    use kruskal_tune::train::{TrainParams, train};
    use kruskal_tune::{Config, Measurements, Run, TensorFeatures, TensorRuns, TensorSpec};

    let dir = tempfile::tempdir().unwrap();
    let mut m = Measurements::new("Made-up GPU", 100, 1);
    for (like, seed) in [("nell-2", 1), ("vast-5d", 2), ("uber", 3), ("nips", 4)] {
        let spec = TensorSpec::new(like, 20_000, seed, 1.1);
        let t = spec.generate().unwrap();
        let f = TensorFeatures::compute(&t);
        let features: Vec<Vec<f64>> = (0..t.nmodes()).map(|w| f.mode_vector(w)).collect();
        let mut runs = Vec::new();
        for config in Config::space() {
            let ms = match config {
                Config::Fcoo { threadlen: 16 } => 1.0,
                Config::Coo => 9.0,
                _ => 2.0,
            };
            runs.push(Run {
                config,
                rank: 16,
                prepare_s: 0.0,
                mode_ms: vec![ms; t.nmodes()],
                total_ms: ms * t.nmodes() as f64,
            });
        }
        m.tensors.push(TensorRuns {
            id: spec.id(),
            spec: Some(spec),
            dims: t.dims().to_vec(),
            nnz: t.nnz() as u64,
            features,
            features_s: 0.0,
            runs,
            failures: vec![],
        });
    }
    let measurements = dir.path().join("m.json");
    m.write(&measurements).unwrap();
    let model = dir.path().join("model.json");
    train(&m, &TrainParams::default())
        .unwrap()
        .write(&model)
        .unwrap();

    let with_model = |args: &[&str]| {
        kruskal_command(args)
            .env("KRUSKAL_TUNE_MODEL", &model)
            .output()
            .unwrap()
    };
    let o = with_model(&[
        "tune", "predict", "--like", "enron", "--nnz", "30k", "--rank", "16", "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let ranked = v["ranked"].as_array().unwrap();
    assert_eq!(ranked.len(), Config::space().len());
    assert_eq!(ranked[0]["config"], "fcoo/threadlen=16");
    assert_eq!(ranked[0]["flags"], "--kernel fcoo --threadlen 16");
    // Predicted twice as fast as the default: far beyond the margin.
    assert_eq!(v["chosen"], "fcoo/threadlen=16");
    let candidates = v["candidates"].as_array().unwrap();
    assert_eq!(candidates.len(), 3);
    assert_eq!(candidates[0], "fcoo/threadlen=8");
    assert_eq!(candidates[1], "fcoo/threadlen=16");

    let o = with_model(&["tune", "eval", measurements.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o)
            .contains("model choice (engine `auto`, one run): within 10% of the best in 4 (100%)"),
        "{}",
        stdout(&o)
    );

    // Bad models and options: one line each.
    let o = kruskal_command(&["tune", "predict", "--like", "nips", "--nnz", "1k"])
        .env("KRUSKAL_TUNE_MODEL", "/nonexistent/model.json")
        .output()
        .unwrap();
    assert_clean_failure(&o, "/nonexistent/model.json");
    assert_clean_failure(
        &with_model(&["tune", "eval", "/nonexistent/m.json"]),
        "/nonexistent/m.json",
    );
    let out = dir.path().to_str().unwrap();
    for (option, value, needle) in [
        ("--only", "no-such-tensor", "no tensor"),
        ("--scale", "0", "--scale"),
    ] {
        let args = ["tune", "sweep", "--out", out, option, value];
        assert_clean_failure(&kruskal(&args), needle);
    }
}

/// A 3-line text file whose first mode's largest index is `big`.
fn huge_index_file(dir: &Path, big: u64) -> PathBuf {
    let path = dir.join("huge.tns");
    std::fs::write(&path, format!("{big} 1 1 1.5\n7 2 1 2.5\n7 2 3 -0.5\n")).unwrap();
    path
}

#[test]
fn info_on_an_index_of_three_billion_is_small_and_fast() {
    let dir = tempfile::tempdir().unwrap();
    let path = huge_index_file(dir.path(), 3_000_000_000);
    let start = std::time::Instant::now();
    let o = kruskal(&["info", path.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Counters per index would take 24 GB and many seconds.
    assert!(start.elapsed().as_secs_f64() < 10.0);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["dims"][0], 3_000_000_000u64);
    let m1 = &v["modes"][0];
    assert_eq!(m1["nonempty_slices"], 2);
    assert_eq!(m1["empty_slices"], 2_999_999_998u64);
    assert_eq!(m1["degree_max"], 2);
    assert_eq!(m1["hottest_index"], 7);
    // Partition plans do count per index: refused in one line, not killed.
    let o = kruskal(&["info", path.to_str().unwrap(), "--kappa", "4"]);
    assert_clean_failure(&o, "per-index counts");
}

#[test]
fn cpd_refuses_a_run_larger_than_memory_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = huge_index_file(dir.path(), 3_000_000_000);
    // Rank 64: 2.3 TB of factors, outputs and model, more than any machine the
    // tests run on.
    let o = kruskal(&["cpd", path.to_str().unwrap(), "--rank", "64"]);
    assert_clean_failure(&o, "are available (MemAvailable)");
    let err = stderr(&o);
    // (The dense steps' part grows with the thread count: the total's last
    // digit differs between machines.)
    assert!(err.contains("the run needs 2145."), "{err}");
    assert!(
        err.contains(" GiB (factors 715.3 GiB, MTTKRP outputs 715.3 GiB, model copy 715.3 GiB"),
        "{err}"
    );
    assert!(
        err.contains("mode 1 has dimension 3,000,000,000 but 2 indices occur"),
        "{err}"
    );
    assert!(err.contains("--compact"), "{err}");
    // With --out, the run is refused (for its memory or, first, for the
    // model's size on disk) and leaves no directory behind.
    let out = dir.path().join("model");
    let o = kruskal(&[
        "cpd",
        path.to_str().unwrap(),
        "--rank",
        "64",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_clean_failure(&o, "the ");
    assert!(!out.exists(), "the failed run left {}", out.display());
    let o = kruskal(&["mttkrp", path.to_str().unwrap(), "--rank", "64"]);
    assert_clean_failure(&o, "are available (MemAvailable)");
    let o = kruskal(&[
        "mttkrp",
        path.to_str().unwrap(),
        "--rank",
        "64",
        "--compact",
        "--repeat",
        "1",
        "--verify",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn cpd_compact_writes_factors_in_the_files_numbering() {
    let dir = tempfile::tempdir().unwrap();
    let big: u64 = 20_000_000;
    let path = huge_index_file(dir.path(), big);
    let out = dir.path().join("model");
    let o = kruskal(&[
        "cpd",
        path.to_str().unwrap(),
        "--compact",
        "--rank",
        "2",
        "--iters",
        "5",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("mode 1: 20,000,000 -> 2"), "{text}");
    assert!(text.contains("mode 3: 3 -> 2"), "{text}");
    let bytes = std::fs::read(out.join("mode-1.npy")).unwrap();
    let header = String::from_utf8_lossy(&bytes[..128]);
    assert!(header.contains("'shape': (20000000, 2)"), "{header}");
    let data_start = 10 + u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    assert_eq!(bytes.len(), data_start + 20_000_000 * 2 * 4);
    let row = |i: usize| -> Vec<f32> {
        (0..2)
            .map(|j| {
                let at = data_start + (i * 2 + j) * 4;
                f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
            })
            .collect()
    };
    // Rows of the indices that occur (7 and the largest) hold the model,
    // every other row is zero.
    assert!(row(6).iter().any(|&x| x != 0.0), "{:?}", row(6));
    assert!(row(big as usize - 1).iter().any(|&x| x != 0.0));
    for i in [0, 5, 7, 1_000_000, big as usize - 2] {
        assert_eq!(row(i), vec![0.0, 0.0], "row {i}");
    }
    let o = kruskal(&[
        "cpd",
        path.to_str().unwrap(),
        "--compact",
        "--rank",
        "2",
        "--iters",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["compact"][0]["dim"], big);
    assert_eq!(v["compact"][0]["occurring"], 2);
    assert_eq!(v["tensor"]["dims"][0], 2);
    let m3 = std::fs::read(out.join("mode-3.npy")).unwrap();
    assert!(String::from_utf8_lossy(&m3[..128]).contains("'shape': (3, 2)"));
}

#[test]
fn out_is_checked_before_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("taken");
    std::fs::write(&file, b"x").unwrap();
    let demo = |out: &Path| {
        kruskal(&[
            "cpd",
            "--demo",
            "--starts",
            "1",
            "--out",
            out.to_str().unwrap(),
        ])
    };
    // A file where the directory should be: refused before any iteration.
    let o = demo(&file);
    assert_clean_failure(&o, "exists and is not a directory");
    assert!(!stdout(&o).contains("its ="), "{}", stdout(&o));
    // Below a file nothing can be created.
    let o = demo(&file.join("sub"));
    assert_clean_failure(&o, "cannot create");
    // A run that fails after the check leaves no new directory behind.
    let tensor = huge_index_file(dir.path(), 40);
    let out = dir.path().join("new/model");
    let o = kruskal(&[
        "cpd",
        tensor.to_str().unwrap(),
        "--kernel",
        "no-such-kernel",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_clean_failure(&o, "unknown kernel");
    assert!(!dir.path().join("new").exists());
    // --distributed: rank 0, which writes the model, checks before the job.
    let ktns = dir.path().join("t.ktns");
    let o = kruskal(&["convert", tensor.to_str().unwrap(), ktns.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = kruskal_command(&[
        "cpd",
        ktns.to_str().unwrap(),
        "--distributed",
        "--process-rank",
        "0",
        "--world-size",
        "1",
        "--local-gpu",
        "0",
        "--rendezvous",
        "127.0.0.1:9",
        "--out",
        file.to_str().unwrap(),
    ])
    .env("KRUSKAL_JOB_TOKEN", "0123456789abcdef0123456789abcdef")
    .output()
    .unwrap();
    assert_clean_failure(&o, "exists and is not a directory");
}

#[cfg(unix)]
#[test]
fn read_only_out_is_refused_before_the_run() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let ro = dir.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    // root writes anywhere; there the check has nothing to refuse.
    if std::fs::write(ro.join("probe"), b"x").is_ok() {
        eprintln!("note: running as root; skipping the read-only --out check");
        return;
    }
    let o = kruskal(&[
        "cpd",
        "--demo",
        "--starts",
        "1",
        "--out",
        ro.to_str().unwrap(),
    ]);
    assert_clean_failure(&o, "cannot write there");
    assert!(!stdout(&o).contains("its ="));
}

#[test]
fn negative_numbers_reach_the_programs_own_checks() {
    let o = kruskal(&["cpd", "--demo", "--tol", "-1"]);
    assert_clean_failure(&o, "must be finite and >= 0");
    let err = stderr(&o);
    assert!(!err.contains("unexpected argument"), "{err}");
    let o = kruskal(&["cpd", "--demo", "--iters", "-3"]);
    let err = stderr(&o);
    assert!(!o.status.success());
    assert!(err.contains("'-3'") && err.contains("--iters"), "{err}");
    assert!(!err.contains("unexpected argument"), "{err}");
}

#[test]
fn doubtful_runs_get_one_warning_line_each() {
    let dir = tempfile::tempdir().unwrap();
    let path = huge_index_file(dir.path(), 40);
    let o = kruskal(&["cpd", path.to_str().unwrap(), "--rank", "3", "--iters", "0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("warning")).collect();
    // Mode 2 has dimension 2, and no iteration runs.
    assert_eq!(warnings.len(), 2, "{err}");
    assert!(
        warnings[0].contains("rank 3 is larger than mode 2's dimension 2"),
        "{err}"
    );
    assert!(
        warnings[1].contains("the output is the initial factors"),
        "{err}"
    );
    let zeros = dir.path().join("zeros.tns");
    std::fs::write(&zeros, "1 1 1 0.0\n2 2 2 0.0\n").unwrap();
    let o = kruskal(&[
        "cpd",
        zeros.to_str().unwrap(),
        "--rank",
        "1",
        "--iters",
        "2",
    ]);
    let err = stderr(&o);
    assert!(err.contains("warning: the tensor is all zeros"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn an_io_error_is_said_once() {
    let dir = tempfile::tempdir().unwrap();
    let o = kruskal(&["info", dir.path().to_str().unwrap()]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "{err}");
    let cause = "is a directory";
    assert_eq!(err.matches(cause).count(), 1, "{err}");
}

#[test]
fn no_gpu_advice_fits_the_command() {
    if has_gpu() {
        eprintln!("note: a GPU is present; skipping the no-GPU messages");
        return;
    }
    let o = kruskal(&["info", "--gpu"]);
    assert_clean_failure(&o, "without --gpu");
    assert!(!stderr(&o).contains("--backend"), "{}", stderr(&o));
    let o = kruskal(&["cpd", "--demo", "--backend", "gpu"]);
    assert_clean_failure(&o, "or drop --backend gpu to run on the CPU");
    // The advice names the option that asked for GPUs, not one given.
    for args in [
        &["cpd", "--demo", "--gpus", "2"][..],
        &["cpd", "--demo", "--gpus", "2", "--backend", "cpu"],
        &["mttkrp", "--like", "nell-2", "--nnz", "1000", "--gpus", "2"],
    ] {
        let o = kruskal(args);
        assert_clean_failure(&o, "or drop --gpus 2 to run on the CPU");
        assert!(!stderr(&o).contains("use --backend cpu"), "{}", stderr(&o));
    }
}

#[cfg(unix)]
#[test]
fn model_files_get_the_permissions_of_other_outputs() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model");
    let tensor = dir.path().join("t.tns");
    let o = kruskal(&[
        "gen",
        tensor.to_str().unwrap(),
        "--dims",
        "30,20,10",
        "--nnz",
        "500",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = kruskal(&[
        "cpd",
        tensor.to_str().unwrap(),
        "--rank",
        "2",
        "--iters",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let want = mode(&tensor);
    for name in ["lambda.npy", "mode-1.npy", "mode-3.npy"] {
        assert_eq!(mode(&out.join(name)), want, "{name}");
    }
}

#[test]
fn data_readme_gives_each_files_line_count() {
    // The table of data/README.md: `| `file` | modes | lines | ... |`, the
    // lines being those that hold a nonzero (not comments, not blank).
    let readme = std::fs::read_to_string(data("README.md")).unwrap();
    let mut checked = 0;
    for row in readme.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let name = cells[1].trim_matches('`');
        let lines: usize = cells[3].replace(',', "").parse().unwrap();
        let raw = std::fs::read(data(name)).unwrap();
        let text = if name.ends_with(".gz") {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&raw[..]), &mut s)
                .unwrap();
            s
        } else {
            String::from_utf8(raw).unwrap()
        };
        let counted = text
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .count();
        assert_eq!(counted, lines, "{name}: data/README.md says {lines} lines");
        checked += 1;
    }
    assert!(
        checked >= 10,
        "only {checked} rows in data/README.md's table"
    );
}

#[test]
fn readme_file_example_runs_and_fits_as_it_says() {
    // The README's "Decomposing a file" commands (`$K ...`), run from a
    // folder with the repository's data/, and the fit its text states.
    let readme = std::fs::read_to_string(data("../README.md")).unwrap();
    let block = readme
        .split("```bash\n")
        .find(|b| b.contains("K=target/release/kruskal"))
        .and_then(|b| b.split("```").next())
        .expect("the README's file example");
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("target")).unwrap();
    let mut last = None;
    let mut ran = 0;
    for line in block.lines().filter(|l| l.starts_with("$K ")) {
        let words: Vec<&str> = line
            .split('#')
            .next()
            .unwrap()
            .split_whitespace()
            .skip(1)
            .collect();
        let o = kruskal_command(&words)
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(o.status.success(), "{line}: {}", stderr(&o));
        last = Some(stdout(&o));
        ran += 1;
    }
    assert!(ran >= 3, "{block}");
    let claimed = readme
        .split("The run ends at `")
        .nth(1)
        .and_then(|r| r.split('`').next())
        .expect("the README states the fit");
    // To 1e-4: another machine's threads (or its GPU) sum in another order.
    let fit_of = |text: &str| -> f64 {
        let rest = text.split("final fit").nth(1).expect("a final fit");
        rest.split_whitespace().next().unwrap().parse().unwrap()
    };
    let out = last.unwrap();
    assert!(
        (fit_of(&out) - fit_of(claimed)).abs() < 1e-4,
        "README says {claimed:?}; the run printed\n{out}"
    );
    assert!(dir.path().join("target/model/mode-3.npy").is_file());
}

/// A successful `kruskal cp-apr FILE --rank 3 --json` with `extra` flags:
/// the report.
fn cp_apr_json(file: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["cp-apr", file.to_str().unwrap(), "--rank", "3", "--json"];
    args.extend_from_slice(extra);
    let o = kruskal(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_str(&stdout(&o)).unwrap()
}

#[test]
fn cp_apr_reports_every_iteration_and_writes_its_model() {
    let file = data("splatt-med.tns.gz");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("apr");
    let v = cp_apr_json(&file, &["--iters", "4", "--out", out.to_str().unwrap()]);
    let its = v["iterations"].as_array().unwrap();
    assert_eq!(its.len(), 4);
    let ll: Vec<f64> = its
        .iter()
        .map(|s| s["log_likelihood"].as_f64().unwrap())
        .collect();
    assert!(ll.iter().all(|x| x.is_finite()) && ll[3] > ll[0], "{ll:?}");
    assert_eq!(v["log_likelihood"].as_f64().unwrap(), ll[3]);
    assert_eq!(v["non_integer_values"].as_u64(), Some(0));
    for name in ["lambda.npy", "mode-1.npy", "mode-2.npy", "mode-3.npy"] {
        let bytes = std::fs::read(out.join(name)).unwrap();
        assert_eq!(&bytes[..6], b"\x93NUMPY", "{name} is not .npy");
    }
    // Restarted from its own model (f32 files), the first iteration (no
    // kappa fix, multiplicative updates only) does not fall below where
    // the run stopped.
    let again = cp_apr_json(&file, &["--iters", "1", "--init", out.to_str().unwrap()]);
    let first = again["iterations"][0]["log_likelihood"].as_f64().unwrap();
    assert!(first >= ll[3] - 1e-6 * ll[3].abs(), "{first} < {}", ll[3]);
}

#[test]
fn cp_apr_says_where_it_ran_and_the_gpu_gives_the_cpus_answer() {
    let file = data("splatt-med.tns.gz");
    let lls = |v: &serde_json::Value| -> Vec<f64> {
        v["iterations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["log_likelihood"].as_f64().unwrap())
            .collect()
    };
    let cpu = cp_apr_json(&file, &["--iters", "3", "--backend", "cpu"]);
    assert_eq!(cpu["backend"], "cpu", "{cpu}");
    assert!(
        cpu["fallback"].is_null() && cpu["device"].is_null(),
        "{cpu}"
    );
    assert!(cpu["seconds_per_iteration_after_first"].as_f64().unwrap() > 0.0);
    let auto = cp_apr_json(&file, &["--iters", "3"]);
    if has_gpu() {
        assert_eq!(auto["backend"], "gpu", "{auto}");
        assert!(auto["device"].is_string(), "{auto}");
        let gpu = cp_apr_json(&file, &["--iters", "3", "--backend", "gpu"]);
        for (a, b) in lls(&cpu).iter().zip(lls(&gpu)) {
            assert!((a - b).abs() <= 1e-9 * a.abs(), "CPU {a} vs GPU {b}");
        }
        assert_eq!(lls(&gpu).len(), 3);
    } else {
        assert_eq!(auto["backend"], "cpu", "{auto}");
        let why = auto["fallback"].as_str().unwrap();
        assert!(why.contains("CUDA"), "{why}");
        assert_eq!(lls(&auto), lls(&cpu));
        let o = kruskal(&[
            "cp-apr",
            file.to_str().unwrap(),
            "--rank",
            "3",
            "--backend",
            "gpu",
        ]);
        assert_clean_failure(&o, "CUDA");
    }
}

#[test]
fn cp_apr_on_several_gpus_gives_the_cpus_answer_or_says_why_not() {
    let file = data("splatt-med.tns.gz");
    let f = file.to_str().unwrap();
    // Options that do not go together, or are not counts: one line, no run.
    for (args, says) in [
        (vec!["--gpus", "2", "--backend", "cpu"], "--backend cpu"),
        (vec!["--gpus", "two"], "--gpus takes a count or 'all'"),
    ] {
        let mut all = vec!["cp-apr", f, "--rank", "3"];
        all.extend(args);
        assert_clean_failure(&kruskal(&all), says);
    }
    if !has_gpu() {
        assert_clean_failure(
            &kruskal(&["cp-apr", f, "--rank", "3", "--gpus", "2"]),
            "CUDA",
        );
        return;
    }
    let cpu = cp_apr_json(&file, &["--iters", "3", "--backend", "cpu"]);
    // 100,000 nonzeros: `all` takes one GPU and, where there are more, says
    // why; a count takes what it names (where the machine has them).
    let all = cp_apr_json(&file, &["--iters", "3", "--gpus", "all"]);
    assert_eq!(all["gpus"], 1, "{all}");
    let count = kruskal(&["info", "--gpu", "--json"]);
    let gpus = serde_json::from_str::<serde_json::Value>(&stdout(&count)).ok();
    let n = gpus
        .as_ref()
        .and_then(|v| v["gpus"].as_array().map(|a| a.len()))
        .unwrap_or(1);
    assert_eq!(all["gpus_note"].is_null(), n == 1, "{all}");
    let mut runs = vec![all];
    if n >= 2 {
        let two = cp_apr_json(&file, &["--iters", "3", "--gpus", "2"]);
        assert_eq!(
            (two["backend"].as_str(), two["gpus"].as_u64()),
            (Some("gpu"), Some(2))
        );
        runs.push(two);
    }
    for run in &runs {
        for (a, b) in cpu["iterations"]
            .as_array()
            .unwrap()
            .iter()
            .zip(run["iterations"].as_array().unwrap())
        {
            let (a, b) = (
                a["log_likelihood"].as_f64().unwrap(),
                b["log_likelihood"].as_f64().unwrap(),
            );
            assert!((a - b).abs() <= 1e-9 * a.abs(), "CPU {a} vs GPUs {b}");
        }
    }
}

#[test]
fn cp_apr_refuses_negative_values() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("neg.tns");
    std::fs::write(&file, "1 1 1 2\n2 2 2 -3\n").unwrap();
    let out = dir.path().join("model");
    let o = kruskal(&[
        "cp-apr",
        file.to_str().unwrap(),
        "--rank",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_clean_failure(&o, "non-negative counts");
    assert!(stderr(&o).contains("(2, 2, 2)"), "{}", stderr(&o));
    assert!(!out.exists(), "a model directory was left behind");
}

#[test]
fn nonneg_l1_and_l2_run_ao_admm_with_non_negative_factors() {
    let file = data("splatt-med.tns.gz");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model");
    // A bare --nonneg after the FILE: every mode.
    let (v, o) = common::cpd_json(&file, "4", &["--nonneg", "--out", out.to_str().unwrap()]);
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
    assert_eq!(v["method"], "ao-admm", "{v}");
    assert_eq!(v["constraints"], "non-negative (all modes)", "{v}");
    assert_eq!(v["backend"], "cpu", "{v}");
    assert_eq!(v["admm_inner"], "all rows together", "{v}");
    // The GPU's blocked inner loop, asked of the CPU.
    let (b, _) = common::cpd_json(&file, "4", &["--l1", "0.1", "--admm-blocks"]);
    assert_eq!(b["admm_inner"], "each row on its own", "{b}");
    assert!(common::fits(&b).iter().all(|&f| f > 0.0 && f < 1.0), "{b}");
    let fits = common::fits(&v);
    assert!(fits.iter().all(|&f| f > 0.0 && f < 1.0), "{fits:?}");
    let inner = v["iterations"][0]["inner_iters"].as_u64().unwrap();
    assert!(inner >= 3, "{v}");
    let factors = kruskal_cpd::load_factors(&out, 3).unwrap();
    for (m, f) in factors.iter().enumerate() {
        assert!(
            f.iter().all(|&x| x >= 0.0),
            "mode {} has a negative entry",
            m + 1
        );
    }
    // Plain ALS says it is ALS.
    let (als, _) = common::cpd_json(&file, "4", &[]);
    assert_eq!(als["method"], "als");
    assert!(als["constraints"].is_null());
    assert!(als["admm_inner"].is_null());
    // Chosen modes and penalties, with --backend auto: where an ALS run
    // would go (a GPU runs the inner loop on each row on its own).
    let o = kruskal(&[
        "cpd",
        file.to_str().unwrap(),
        "--rank",
        "3",
        "--iters",
        "3",
        "--nonneg",
        "1,3",
        "--l1",
        "0.5",
        "--l2",
        "0.25",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("method     AO-ADMM, non-negative (modes 1, 3), l1 0.5, l2 0.25"),
        "{text}"
    );
    let (backend, inner) = if has_gpu() {
        ("backend    gpu", "(inner loop: each row on its own)")
    } else {
        ("backend    cpu", "(inner loop: all rows together)")
    };
    assert!(text.contains(backend) && text.contains(inner), "{text}");
}

#[test]
fn bad_constraint_flags_are_one_line_errors() {
    let file = data("splatt-med.tns.gz");
    let f = file.to_str().unwrap();
    for (args, needle) in [
        (vec!["--nonneg", "4"], "names mode 4"),
        (vec!["--nonneg", "0"], "not a comma list of modes"),
        (vec!["--nonneg", "1,x"], "not a comma list of modes"),
        (vec!["--l1", "-1"], "not a finite weight >= 0"),
        (vec!["--l2", "nan"], "not a finite weight >= 0"),
        (vec!["--l2", "inf"], "not a finite weight >= 0"),
        (
            vec!["--nonneg", "--distributed"],
            "cannot be combined with --distributed",
        ),
        (vec!["--admm-blocks"], "give it with --nonneg, --l1 or --l2"),
    ] {
        let mut all = vec!["cpd", f, "--iters", "2"];
        all.extend(&args);
        let o = kruskal(&all);
        assert_clean_failure(&o, needle);
    }
    // A FILE after a bare --nonneg is read as its modes: the error says so.
    let o = kruskal(&["cpd", "--nonneg", f]);
    assert_clean_failure(&o, "put the FILE before a bare --nonneg");
}
