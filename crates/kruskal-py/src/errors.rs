//! The library's errors as Python exceptions: `ValueError` for arguments
//! and data, `OSError` for files, `MemoryError` for the host's memory,
//! `GpuError` for the device, `RuntimeError` for a run that failed on the
//! CPU. Their messages are the library's in Python's words: an option the
//! library names ([`kruskal_cpd::OptionName`]) as its keyword
//! ([`crate::words::keyword`]), modes counted from 0 ([`crate::words`]);
//! the bindings' own say Python's from the start.

use crate::words::{keyword, python_words};
use kruskal_cpd::CpdError;
use kruskal_device::DeviceError;
use kruskal_formats::FormatError;
use pyo3::PyErr;
use pyo3::exceptions::{
    PyFileNotFoundError, PyMemoryError, PyOSError, PyRuntimeError, PyTypeError, PyValueError,
};

pyo3::create_exception!(
    kruskal,
    GpuError,
    PyRuntimeError,
    "The GPU could not be used or failed (no CUDA driver or GPU, out of memory, a kernel error)."
);

/// A library error's message in Python's words: its own text and its
/// causes, each said once (`kruskal_device::error_line` joins them as the
/// command line does), modes counted from 0.
fn library_text(e: &dyn std::error::Error) -> String {
    python_words(&kruskal_device::error_line(e))
}

pub fn format_error(e: FormatError) -> PyErr {
    // A reader's error is whole (no causes), with its advice's option
    // spelled as a keyword.
    let text = python_words(&e.message(&keyword));
    match &e {
        FormatError::Io { error, .. } if error.kind() == std::io::ErrorKind::NotFound => {
            PyFileNotFoundError::new_err(text)
        }
        FormatError::Io { .. } | FormatError::File { .. } => PyOSError::new_err(text),
        FormatError::Memory(_) => PyMemoryError::new_err(text),
        _ => PyValueError::new_err(text),
    }
}

pub fn device_error(e: DeviceError) -> PyErr {
    GpuError::new_err(library_text(&e))
}

/// `on_gpu`: the run was on a GPU, so a failure of the run itself (a
/// diverged fit) is reported as the GPU's. Failures of the device and of
/// the CPU engines say which they are by their kind.
pub fn cpd_error(e: CpdError, on_gpu: bool) -> PyErr {
    // The error's own message with its options spelled as keywords, then
    // its causes.
    let mut text = e.message(&keyword);
    if let Some(source) = std::error::Error::source(&e) {
        text = format!("{text}: {}", kruskal_device::error_line(source));
    }
    let text = python_words(&text);
    match e {
        CpdError::Option(_)
        | CpdError::InvalidOption { .. }
        | CpdError::Shape(_)
        | CpdError::Invalid(_) => PyValueError::new_err(text),
        CpdError::Gpu(_) | CpdError::Device(_) => GpuError::new_err(text),
        CpdError::File { .. } | CpdError::Format(_) => PyOSError::new_err(text),
        CpdError::Partition(_) => PyValueError::new_err(text),
        CpdError::Memory { .. } => PyMemoryError::new_err(text),
        CpdError::Cpu(_) => PyRuntimeError::new_err(text),
        CpdError::Backend(_) | CpdError::NoFactors if on_gpu => GpuError::new_err(text),
        CpdError::Backend(_) | CpdError::NoFactors => PyRuntimeError::new_err(text),
    }
}

/// A `ValueError` with the bindings' own message (already in Python's
/// words).
pub fn value_error(text: impl Into<String>) -> PyErr {
    PyValueError::new_err(text.into())
}

/// A `ValueError` with a message of the library's.
pub fn library_value_error(e: &dyn std::error::Error) -> PyErr {
    PyValueError::new_err(library_text(e))
}

/// A `TypeError`: an argument of the wrong kind of object.
pub fn type_error(text: impl Into<String>) -> PyErr {
    PyTypeError::new_err(text.into())
}
