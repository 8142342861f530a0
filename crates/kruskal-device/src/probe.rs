//! Finding the CUDA libraries without letting cudarc panic.
//!
//! With `dynamic-loading`, cudarc opens `libcuda` and `libnvrtc` on first
//! use and panics if it cannot. [`check_libraries`] tries the very names
//! cudarc will try (its own candidate list) with `libloading` first, and
//! turns a miss into [`DeviceError::MissingLibrary`].

use std::sync::OnceLock;

use crate::{DeviceError, Result};

/// Opens the first loadable candidate name of `lib` ("cuda", "nvrtc").
fn try_load(lib: &'static str) -> Result<()> {
    let mut tried = cudarc::get_lib_name_candidates(lib);
    let mut seen = std::collections::HashSet::new();
    tried.retain(|name| seen.insert(name.clone()));
    for name in &tried {
        // SAFETY: loading a shared library runs its initializers; the CUDA
        // driver and NVRTC are the libraries cudarc itself is about to load.
        if let Ok(library) = unsafe { libloading::Library::new(name) } {
            // Kept loaded: cudarc opens the same library when it first
            // needs it, and unloading NVRTC (110 MB) only to map it again
            // costs milliseconds.
            std::mem::forget(library);
            return Ok(());
        }
    }
    Err(DeviceError::MissingLibrary {
        library: match lib {
            "cuda" => "driver (libcuda)",
            "nvrtc" => "NVRTC (libnvrtc)",
            other => other,
        },
        tried,
    })
}

type Probe = std::result::Result<(), (&'static str, Vec<String>)>;

/// Checks `lib` once per process.
fn check_once(lib: &'static str, cell: &'static OnceLock<Probe>) -> Result<()> {
    cell.get_or_init(|| match try_load(lib) {
        Err(DeviceError::MissingLibrary { library, tried }) => Err((library, tried)),
        _ => Ok(()),
    })
    .clone()
    .map_err(|(library, tried)| DeviceError::MissingLibrary { library, tried })
}

/// Checks once per process that NVRTC can be loaded (compiling kernels
/// needs nothing else, not even a GPU).
pub fn check_nvrtc() -> Result<()> {
    check_once("nvrtc", &NVRTC)
}

/// [`check_nvrtc`]'s answer, once known.
static NVRTC: OnceLock<Probe> = OnceLock::new();

/// Checks once per process that the CUDA driver can be loaded.
pub fn check_driver() -> Result<()> {
    static DRIVER: OnceLock<Probe> = OnceLock::new();
    check_once("cuda", &DRIVER)
}

/// Checks once per process that the CUDA driver and NVRTC can be loaded.
pub fn check_libraries() -> Result<()> {
    check_driver()?;
    check_nvrtc()
}

/// [`check_nvrtc`] on another thread. Loading NVRTC takes 5 ms with the
/// library in the page cache and 150 ms from disk (measured on an H100
/// host), which the driver's own start (`cuInit`, 100 ms) hides when the
/// two run side by side.
/// No thread is started once the answer is known.
pub(crate) struct NvrtcCheck(Option<std::thread::JoinHandle<Result<()>>>);

impl NvrtcCheck {
    pub(crate) fn start() -> Self {
        NvrtcCheck(
            NVRTC
                .get()
                .is_none()
                .then(|| std::thread::spawn(check_nvrtc)),
        )
    }

    /// The check's result, once it has run (a panic in it goes on here).
    pub(crate) fn wait(self) -> Result<()> {
        match self.0 {
            Some(thread) => thread
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
            None => check_nvrtc(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_typed_error_naming_what_was_tried() {
        let err = try_load("kruskal-no-such-library").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("libkruskal-no-such-library.so"), "{text}");
        // No command-line advice here: the program adds the advice that
        // fits the command (`info --gpu` cannot use `--backend cpu`).
        assert!(!text.contains("--backend"), "{text}");
    }
}
