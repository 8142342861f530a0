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
    /// run. Reads as the device's error, whose causes follow in the chain;
    /// match on the value for its kind.
    #[error(transparent)]
    Device(#[from] kruskal_device::DeviceError),

    /// A CPU engine failed: a format that cannot hold the tensor, or
    /// operands of the wrong shape. The engine's error is part of the
    /// message (not a source) and kept for its kind.
    #[error("backend: {0}")]
    Cpu(kruskal_cpu::CpuError),

    /// The GPU backend was asked for its factors (or for work that needs
    /// them) before any were loaded.
    #[error("backend: no factors loaded")]
    NoFactors,

    /// The run itself went wrong, whatever the backend: the fit diverged,
    /// or the backend was asked for results before it made them. Library
    /// failures are [`CpdError::Device`] and [`CpdError::Cpu`].
    #[error("backend: {0}")]
    Backend(String),

    /// A tensor file could not be read (the several-process run maps its
    /// `.ktns` file itself). Reads as the format's error.
    #[error(transparent)]
    Format(#[from] kruskal_formats::FormatError),

    /// The rows of a tensor could not be planned over the GPUs of a job.
    #[error(transparent)]
    Partition(#[from] kruskal_partition::PartitionError),

    /// Reading or writing a model file.
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
}

impl From<kruskal_cpu::CpuError> for CpdError {
    fn from(e: kruskal_cpu::CpuError) -> Self {
        CpdError::Cpu(e)
    }
}

impl CpdError {
    /// The device's error this one is, if it is one (a transparent
    /// variant is not a link of its own in the chain, so callers that look
    /// for a device's kind there ask here too).
    pub fn device_error(&self) -> Option<&kruskal_device::DeviceError> {
        match self {
            CpdError::Device(e) => Some(e),
            _ => None,
        }
    }

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
        // Its text is in the message, so it is not also a cause.
        assert!(e.source().is_none());
        // A device failure reads as the device's error, and its kind is
        // the value's.
        let e = CpdError::from(DeviceError::NoDevice {
            ordinal: 0,
            count: 0,
        });
        assert_eq!(
            e.to_string(),
            "no CUDA GPU 0 (the driver reports 0 device(s))"
        );
        assert!(matches!(e, CpdError::Device(DeviceError::NoDevice { .. })));
    }
}
