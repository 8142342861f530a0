//! The one error type of this crate.

use std::path::PathBuf;

use crate::option::{OptionName, Spelling, neutral};

/// Advice a message ends with, naming the option that would help; each
/// front end spells the option ([`FormatError::message`],
/// [`ReadWarning::message`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Advice {
    /// A line of one column: the file may list only indices.
    PatternIfIndicesOnly,
    /// A value column that looks like an index: every line may be only
    /// indices.
    PatternIfEveryLineIsIndices,
    /// Index 0 in a file read as 1-based.
    ZeroBased,
    /// A generator's preset without a recorded nonzero count.
    GiveNnz,
}

impl Advice {
    /// The advice as it follows the message, with the option spelled by
    /// `spell`.
    pub fn text(self, spell: Spelling) -> String {
        match self {
            Advice::PatternIfIndicesOnly => format!(
                " (use {} if the file lists only indices)",
                spell(OptionName::Pattern, None)
            ),
            Advice::PatternIfEveryLineIsIndices => format!(
                ": if every line is only indices, use {}",
                spell(OptionName::Pattern, None)
            ),
            Advice::ZeroBased => format!(
                "; use {} for files whose indices start at 0",
                spell(OptionName::ZeroBased, None)
            ),
            Advice::GiveNnz => format!(": give one ({})", spell(OptionName::Nnz, None)),
        }
    }
}

/// Something about a file the user should know that did not stop the
/// read (a value column that looks like an index): one line naming the
/// file, with advice where an option would help.
#[derive(Clone, Debug, PartialEq)]
pub struct ReadWarning {
    pub text: String,
    pub advice: Option<Advice>,
}

impl ReadWarning {
    /// The warning with the option of its advice spelled by `spell`.
    pub fn message(&self, spell: Spelling) -> String {
        match self.advice {
            Some(a) => format!("{}{}", self.text, a.text(spell)),
            None => self.text.clone(),
        }
    }
}

impl std::fmt::Display for ReadWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message(&neutral))
    }
}

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

    /// An error that ends with advice naming an option
    /// ([`FormatError::message`] spells it as a front end does).
    #[error("{error}{}", advice.text(&neutral))]
    Advised {
        error: Box<FormatError>,
        advice: Advice,
    },
}

impl FormatError {
    /// The message with the option its advice names spelled by `spell`
    /// (the command line's flag, Python's keyword); [`std::fmt::Display`]
    /// uses the neutral name.
    pub fn message(&self, spell: Spelling) -> String {
        match self {
            FormatError::Advised { error, advice } => {
                format!("{}{}", error.message(spell), advice.text(spell))
            }
            other => other.to_string(),
        }
    }

    /// This error, ending with `advice`.
    pub(crate) fn advise(self, advice: Advice) -> Self {
        FormatError::Advised {
            error: Box::new(self),
            advice,
        }
    }

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
