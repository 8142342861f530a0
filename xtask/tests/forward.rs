//! `cargo xtask kernels` and `cargo xtask bench` from a bundle, where there
//! is no cargo: the `xtask` binary runs the `xtask-device` beside it (here a
//! stand-in script), hands it the arguments as given and passes its exit
//! status back; with neither beside it nor cargo, one line says so.
#![cfg(unix)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

fn run(xtask: &Path, args: &[&str], path: &Path) -> Output {
    Command::new(xtask)
        // Not run by cargo, as on a GPU machine.
        .env_remove("CARGO")
        .env("PATH", path)
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn a_bundle_runs_the_xtask_device_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let xtask = dir.path().join("xtask");
    std::fs::copy(env!("CARGO_BIN_EXE_xtask"), &xtask).unwrap();
    let device = dir.path().join("xtask-device");
    let seen = dir.path().join("seen");
    std::fs::write(
        &device,
        format!(
            "#!/bin/sh\nprintf '%s\\n' \"$@\" > '{}'\nexit 7\n",
            seen.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&device, std::fs::Permissions::from_mode(0o755)).unwrap();
    // A PATH without cargo (sh is found by the script's #! line).
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();

    for args in [
        &["bench", "--help"][..],
        &["bench", "report", "a b.json", "--out", "-x", "--", "z"],
        &["kernels", "--arch", "sm_90", "--json"],
        &["kernels"],
    ] {
        let o = run(&xtask, args, &empty);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(7), "{args:?}: {err}");
        let got = std::fs::read_to_string(&seen).unwrap();
        assert_eq!(got.lines().collect::<Vec<_>>(), args, "{err}");
    }

    std::fs::remove_file(&device).unwrap();
    let o = run(&xtask, &["bench"], &empty);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("needs cargo, or xtask-device beside"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
