//! `cargo xtask bench` end to end on the smoke matrix (small generated
//! tensors, CPU engines; GPU entries are listed as not measured where
//! there is no GPU), and `bench report` updating a document. The tests run
//! the `xtask-device` binary, which `cargo xtask bench` forwards to.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
}

fn xtask(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_xtask-device"))
        .current_dir(root())
        .args(args)
        // No PyTorch baseline attempt with whatever python3 is around.
        .output()
        .unwrap()
}

#[test]
fn the_smoke_matrix_measures_reports_and_plots() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("smoke");
    let o = xtask(&[
        "bench",
        "--matrix",
        "bench/smoke.toml",
        "--out",
        out.to_str().unwrap(),
        "--no-torch",
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let results: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let ms = results["measurements"].as_array().unwrap();
    let cpu: Vec<&Value> = ms.iter().filter(|m| m["backend"] == "cpu").collect();
    // 2 tensors x 4 CPU engines, CPD by ALS and by AO-ADMM, CP-APR.
    assert_eq!(cpu.len(), 11, "{stdout}");
    for m in &cpu {
        let total = m["total_ms"].as_f64().unwrap();
        assert!(total > 0.0 && total.is_finite(), "{m}");
        assert!(!m["commit"].as_str().unwrap().is_empty());
        assert!(m["date"].as_str().unwrap().starts_with("20"));
        assert!(m["machine"]["cores"].as_u64().unwrap() >= 1);
        let modes = m["mode_ms"].as_array().unwrap();
        if m["kind"] == "cp_apr" {
            // No MTTKRP per mode; the values were made counts.
            assert!(modes.is_empty(), "{m}");
            assert!(m["log_likelihood"].as_f64().unwrap().is_finite(), "{m}");
            assert_eq!(m["report"]["non_integer_values"], 0, "{m}");
            assert_eq!(m["report"]["iterations"].as_array().unwrap().len(), 3);
            continue;
        }
        assert_eq!(modes.len(), m["dims"].as_array().unwrap().len());
        if m["kind"] == "mttkrp" {
            // verify = true in the matrix: every mode was checked.
            let e = m["max_relative_error"].as_f64().unwrap();
            assert!(e < 1e-5, "{m}");
            let sum: f64 = modes.iter().map(|x| x.as_f64().unwrap()).sum();
            assert!((sum - total).abs() <= 1e-9 * total.max(1.0), "{m}");
        } else {
            assert_eq!(m["kind"], "cpd");
            let method = m["method"].as_str().unwrap();
            let tag = m["label"].as_str().unwrap().ends_with("(ao-admm nonneg)");
            assert_eq!(method == "ao-admm", tag, "{m}");
            let fit = m["fit"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&fit), "{m}");
        }
    }
    // Without a GPU, the GPU entries (1 MTTKRP tensor, 2 group sizes,
    // CP-APR) are listed as not measured, never silently dropped.
    let gpus = ms.iter().filter(|m| m["backend"] != "cpu").count();
    let skipped = results["skipped"].as_array().unwrap().len();
    assert_eq!(gpus + skipped, if gpus == 0 { 4 } else { gpus + skipped });
    if gpus == 0 {
        assert_eq!(skipped, 4, "{stdout}");
    }

    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    for want in [
        "#### Machines and runs",
        "CPU MTTKRP on",
        "| nell-2 small | 30.0k |",
        "`flycoo`",
        "#### CPD (ALS and AO-ADMM), ms per iteration",
        "AO-ADMM against ALS on the same tensor",
        "(ao-admm nonneg)` |",
        "#### CP-APR, ms per outer iteration",
        "| counts small | 20.0k | 8 |",
    ] {
        assert!(md.contains(want), "report.md lacks {want:?}:\n{md}");
    }
    let svgs: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".svg"))
        .collect();
    assert!(svgs.len() >= 2, "{svgs:?}");
    for s in &svgs {
        assert!(md.contains(&format!("]({s})")), "{s} is not in report.md");
        let text = std::fs::read_to_string(out.join(s)).unwrap();
        assert!(text.starts_with("<svg") && text.contains("mode 1"), "{s}");
    }

    // The report rebuilt from the results, spliced into a document whose
    // plots live in a sub-folder.
    let doc = dir.path().join("perf.md");
    std::fs::write(
        &doc,
        "# Perf\n\nkept\n<!-- bench:begin -->\nold\n<!-- bench:end -->\nkept too\n",
    )
    .unwrap();
    let o = xtask(&[
        "bench",
        "report",
        out.join("results.json").to_str().unwrap(),
        "--out",
        dir.path().join("bench").to_str().unwrap(),
        "--doc",
        doc.to_str().unwrap(),
        "--image-dir",
        "bench",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&doc).unwrap();
    assert!(text.starts_with("# Perf\n\nkept\n<!-- bench:begin -->\nGenerated by"));
    assert!(text.ends_with("<!-- bench:end -->\nkept too\n"));
    assert!(!text.contains("old"));
    assert!(text.contains(&format!("](bench/{})", svgs[0])), "{text}");
    assert!(dir.path().join("bench").join(&svgs[0]).is_file());
}

#[test]
fn bad_matrices_and_names_fail_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[tensor]]\nname = \"a\"\nlike = \"nell-2\"\n\n[[mttkrp]]\nbackend = \"cpu\"\ntensors = [\"b\"]\nengines = [\"fcoo\"]\n",
    )
    .unwrap();
    let out = dir.path().join("out");
    let cases: [(Vec<&str>, &str); 3] = [
        (
            vec![
                "bench",
                "--matrix",
                bad.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ],
            "names tensor 'b', which no [[tensor]] defines",
        ),
        (
            vec![
                "bench",
                "--matrix",
                "bench/smoke.toml",
                "--only",
                "nope",
                "--out",
                out.to_str().unwrap(),
            ],
            "--only nope",
        ),
        (
            vec![
                "bench",
                "--matrix",
                "bench/none.toml",
                "--out",
                out.to_str().unwrap(),
            ],
            "bench/none.toml",
        ),
    ];
    for (args, want) in cases {
        let o = xtask(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?}");
        assert!(err.contains(want), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    assert!(!out.join("results.json").exists());
}
