//! For tests that need a GPU, here and in the crates above: run where a
//! CUDA GPU is present, skip (with a note on stderr) only where there is
//! none. A GPU that is present but does not open fails the test.

use std::sync::Arc;

use crate::{DeviceError, Gpu};

/// GPU 0, or `None` (after a note naming `test`) when this machine has no
/// CUDA driver or no GPU. Any other failure to open it panics.
pub fn gpu_or_skip(test: &str) -> Option<Arc<Gpu>> {
    match Gpu::open(0) {
        Ok(gpu) => Some(gpu),
        Err(DeviceError::MissingLibrary { .. } | DeviceError::NoDevice { .. }) => {
            eprintln!("note: no CUDA GPU here; {test} runs where there is one");
            None
        }
        Err(e) => panic!("{test}: a CUDA GPU is present but does not open: {e}"),
    }
}
