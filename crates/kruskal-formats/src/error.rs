//! The one error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong while building, reading or writing a tensor.
///
/// Errors that come from a file name the file and, for text files, the
/// 1-based line number, so the program can print one line that says where
/// the problem is and what was expected.
///
/// Every message is whole: no variant has a `source()`. The operating
/// system's error of [`FormatError::Io`] is part of its message and is kept
/// as a value only so callers can match on its kind.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },

    #[error("{path}:{line}: {message}")]
    Parse {
        path: PathBuf,
        line: u64,
        message: String,
    },

    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },

    /// A tensor built in memory broke an invariant (lengths, bounds, modes).
    #[error("invalid tensor: {0}")]
    Invalid(String),

    /// The host's memory cannot hold what a file or the arguments ask for:
    /// the need and what is available, found before allocating.
    #[error("{0}")]
    Memory(String),

    /// A generator or other option was given a value it cannot use.
    #[error("invalid argument: {0}")]
    Argument(String),

    /// A storage format cannot hold this tensor with its index widths
    /// (a dimension, nonzero count or block coordinate too large for them).
    #[error("{format} cannot hold this tensor: {message}")]
    Capacity {
        format: &'static str,
        message: String,
    },
}

impl FormatError {
    pub(crate) fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        FormatError::Io {
            path: path.into(),
            error,
        }
    }

    pub(crate) fn parse(path: impl Into<PathBuf>, line: u64, message: impl Into<String>) -> Self {
        FormatError::Parse {
            path: path.into(),
            line,
            message: message.into(),
        }
    }

    pub(crate) fn file(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        FormatError::File {
            path: path.into(),
            message: message.into(),
        }
    }
}

pub type Result<T, E = FormatError> = std::result::Result<T, E>;
