//! The one error type of this crate.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum CpdError {
    /// Options that cannot work (rank 0, negative tolerance, ...).
    #[error("invalid option: {0}")]
    Option(String),

    /// Factor matrices whose shapes do not fit the tensor or each other.
    #[error("shape mismatch: {0}")]
    Shape(String),

    /// Arguments that do not fit each other or the tensor; the message
    /// names them as the command line does.
    #[error("{0}")]
    Invalid(String),

    /// The GPU cannot take this run (its memory, say).
    #[error("{0}")]
    Gpu(String),

    /// The host cannot take this run: the need, its parts and the memory
    /// available, measured before anything sized by a dimension is made.
    #[error("{0}")]
    Memory(String),

    /// The GPU or its libraries failed. The device's error is this one's
    /// source (not hidden behind it), so callers find it in the chain.
    #[error("{0}")]
    Device(#[from] kruskal_device::DeviceError),

    /// A failure reported by the backend (CPU or GPU).
    #[error("backend: {0}")]
    Backend(String),

    /// Reading or writing a model file.
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
}

impl CpdError {
    pub(crate) fn file(path: impl Into<PathBuf>, message: impl ToString) -> Self {
        CpdError::File {
            path: path.into(),
            message: message.to_string(),
        }
    }
}

pub type Result<T, E = CpdError> = std::result::Result<T, E>;
