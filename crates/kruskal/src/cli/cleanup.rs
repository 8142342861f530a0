//! What a run must not leave behind when it is ended early: the model's
//! staging directory, the `--out` directories the pre-run check made, and
//! the temporaries of a tensor file being written (`convert`, `gen`).
//!
//! Paths are registered while they exist; [`quit`] (the signal handler's
//! way out: a second Ctrl-C, SIGTERM or SIGHUP) removes them before the
//! process exits. Moving the model into place holds the same lock
//! ([`committing`]), so a quit either comes before it (nothing written)
//! or after it (the whole model written), never in the middle, and says
//! which.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// The registered paths.
struct Registry {
    /// Staging directories, removed whole.
    staging: Vec<PathBuf>,
    /// Directories made for `--out`, outermost first; removed if empty.
    created: Vec<PathBuf>,
    /// Files being written through temporaries beside them, removed
    /// (`kruskal_formats::io::remove_temporaries`).
    outputs: Vec<PathBuf>,
    /// The model was moved into place.
    written: bool,
}

/// Held while a registered path is created (and registered), and by
/// [`quit`] from its start to the process's end: a quit never meets a
/// path made but not yet registered, nor a file appearing in a
/// directory it removes. Taken before [`REGISTRY`].
static CREATING: Mutex<()> = Mutex::new(());

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    staging: Vec::new(),
    created: Vec::new(),
    outputs: Vec::new(),
    written: false,
});

fn registry() -> MutexGuard<'static, Registry> {
    // A panic while holding the lock leaves the lists as they were.
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `make`, which creates a path a quit must remove (and registers
/// it), where no quit runs at the same time.
pub fn creating<T>(make: impl FnOnce() -> T) -> T {
    let _creating = CREATING.lock().unwrap_or_else(|e| e.into_inner());
    make()
}

/// The model's staging directory and files ([`kruskal_cpd::Staging`]):
/// made inside [`creating`], the directory registered until
/// [`committing`] moves it (one that its owner removed on a failure stays
/// registered, harmlessly).
pub struct TrackStaging;

impl kruskal_cpd::Staging for TrackStaging {
    fn creating(&self, make: &mut dyn FnMut()) {
        creating(make)
    }

    fn made(&self, staging: &Path) {
        registry().staging.push(staging.to_path_buf());
    }
}

/// Registers directories made for `--out` (outermost first).
pub fn track_created(dirs: &[PathBuf]) {
    registry().created.extend_from_slice(dirs);
}

/// Unregisters directories made for `--out` (kept, or removed by their
/// owner).
pub fn forget_created(dirs: &[PathBuf]) {
    registry().created.retain(|d| !dirs.contains(d));
}

/// Registers a tensor file about to be written (`convert`, `gen`): a
/// quit removes the temporaries it is written through.
pub fn track_output(path: &Path) {
    registry().outputs.push(path.to_path_buf());
}

/// Installs the handler of Ctrl-C, SIGTERM and SIGHUP of a command that
/// has no run to stop gently: the first signal quits, removing what is
/// registered.
pub fn quit_on_signal() -> anyhow::Result<()> {
    use anyhow::Context;
    ctrlc::set_handler(|| quit(130, "interrupted")).context("installing the Ctrl-C handler")
}

/// Runs `commit` (moving the staged model into place) under the lock a
/// quit takes, then unregisters `staging`.
pub fn committing<T>(staging: &Path, commit: impl FnOnce() -> T) -> T {
    let mut r = registry();
    let out = commit();
    r.staging.retain(|p| p != staging);
    r.written = true;
    r.created.clear();
    out
}

/// Removes what is registered, says `why` and what was written, and ends
/// the process with `code`. Waits for a model being moved into place.
pub fn quit(code: i32, why: &str) -> ! {
    // Held until the exit: whatever is being made finishes first (and is
    // registered); nothing is made after.
    let _creating = CREATING.lock().unwrap_or_else(|e| e.into_inner());
    let r = registry();
    for dir in &r.staging {
        let _ = std::fs::remove_dir_all(dir);
    }
    for path in &r.outputs {
        kruskal_formats::io::remove_temporaries(path);
    }
    // Innermost first; only empty directories go, so nothing the user put
    // there meanwhile is lost.
    for dir in r.created.iter().rev() {
        let _ = std::fs::remove_dir(dir);
    }
    let written = if r.written {
        "the model was already written"
    } else {
        "nothing written"
    };
    eprintln!("kruskal: {why}; stopping now, {written}");
    std::process::exit(code);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_paths_come_and_go() {
        let root = tempfile::tempdir().unwrap();
        let staging = root.path().join(".kruskal-m.tmp");
        kruskal_cpd::Staging::creating(&TrackStaging, &mut || {
            std::fs::create_dir(&staging).unwrap();
            kruskal_cpd::Staging::made(&TrackStaging, &staging);
        });
        assert!(registry().staging.contains(&staging));
        let made = vec![root.path().join("a")];
        track_created(&made);
        let moved = committing(&staging, || {
            std::fs::rename(&staging, root.path().join("m"))
        });
        moved.unwrap();
        let r = registry();
        assert!(!r.staging.contains(&staging) && r.written && r.created.is_empty());
    }
}
