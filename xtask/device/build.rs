//! Records the commit the xtask-device binary is built from, for `cargo
//! xtask bench` results measured where there is no git checkout (a GPU
//! machine running the bundled binaries).

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let commit = match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(head) if !head.is_empty() => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            format!("{head}{}", if dirty { "-dirty" } else { "" })
        }
        _ => "unknown".to_string(),
    };
    println!("cargo:rustc-env=KRUSKAL_BUILD_COMMIT={commit}");
    // A new commit or staged change rebuilds the record.
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        for f in ["HEAD", "index", "logs/HEAD"] {
            println!("cargo:rerun-if-changed={dir}/{f}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
