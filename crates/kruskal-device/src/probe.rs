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
        if unsafe { libloading::Library::new(name) }.is_ok() {
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
    static NVRTC: OnceLock<Probe> = OnceLock::new();
    check_once("nvrtc", &NVRTC)
}

/// Checks once per process that the CUDA driver and NVRTC can be loaded.
pub fn check_libraries() -> Result<()> {
    static DRIVER: OnceLock<Probe> = OnceLock::new();
    check_once("cuda", &DRIVER)?;
    check_nvrtc()
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
