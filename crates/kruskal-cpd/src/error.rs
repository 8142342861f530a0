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

    /// The GPU or its libraries failed, opening the device or during the
    /// run. The device's error is this one's source (not hidden behind
    /// it), so callers find it in the chain and match on its kind.
    #[error("{0}")]
    Device(#[from] kruskal_device::DeviceError),

    /// A CPU engine failed: a format that cannot hold the tensor, or
    /// operands of the wrong shape. The engine's error is the source.
    #[error("backend: {0}")]
    Cpu(#[from] kruskal_cpu::CpuError),

    /// The run itself went wrong, whatever the backend: the fit diverged,
    /// or the backend was asked for results before it made them. Library
    /// failures are [`CpdError::Device`] and [`CpdError::Cpu`].
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

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal_cpu::CpuError;
    use kruskal_device::DeviceError;
    use std::error::Error;

    #[test]
    fn library_errors_keep_their_kind_and_message() {
        // A CPU engine's failure reads as it did when it was carried as
        // text, and its kind is still there to match on.
        let e = CpdError::from(CpuError::Shape("factor 1 has 3 rows".into()));
        assert_eq!(
            e.to_string(),
            "backend: shape mismatch: factor 1 has 3 rows"
        );
        assert!(matches!(e, CpdError::Cpu(CpuError::Shape(_))));
        // A device failure is its own message, and the source of the chain.
        let e = CpdError::from(DeviceError::NoDevice {
            ordinal: 0,
            count: 0,
        });
        assert_eq!(
            e.to_string(),
            "no CUDA GPU 0 (the driver reports 0 device(s))"
        );
        let source = e.source().and_then(|s| s.downcast_ref::<DeviceError>());
        assert!(matches!(source, Some(DeviceError::NoDevice { .. })));
    }
}
