//! The one error type of this crate, and the options its messages name.
//!
//! A message about an option names it by an [`OptionName`], which each
//! front end spells in its own words ([`CpdError::message`]): the command
//! line as its flag (`--rank`), Python as its keyword (`rank=`). The
//! library's own text ([`std::fmt::Display`]) uses the neutral name.

use std::path::PathBuf;

pub use kruskal_formats::option::{OptionName, Spelling, neutral};

/// The text of an [`CpdError::InvalidOption`]: the option (and value)
/// spelled, then the reason.
fn option_text(option: OptionName, value: Option<&str>, reason: &str, spell: Spelling) -> String {
    format!("{} {reason}", spell(option, value))
}

/// The text of a [`CpdError::Memory`]: the refusal, then, where a mode's
/// dimension dwarfs the indices that occur, that relabeling would help.
fn memory_text(message: &str, sparse_modes: Option<&str>, spell: Spelling) -> String {
    match sparse_modes {
        Some(modes) => format!(
            "{message}; {modes}: {} relabels each mode to the indices that occur",
            spell(OptionName::Compact, None)
        ),
        None => message.to_string(),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CpdError {
    /// Options that cannot work (rank 0, negative tolerance, ...).
    #[error("invalid option: {0}")]
    Option(String),

    /// Factor matrices whose shapes do not fit the tensor or each other.
    #[error("shape mismatch: {0}")]
    Shape(String),

    /// Arguments that do not fit each other or the tensor, where no one
    /// option is at fault (factors of the wrong shape, say).
    #[error("{0}")]
    Invalid(String),

    /// An option that cannot work, or that does not fit another option or
    /// the machine: `option` (with the `value` given, where the reason is
    /// about it) and why. `reason` follows the option's name and names no
    /// front end's flag; [`CpdError::message`] spells the option as a
    /// front end does.
    #[error("{}", option_text(*option, value.as_deref(), reason, &neutral))]
    InvalidOption {
        option: OptionName,
        value: Option<String>,
        reason: String,
    },

    /// The GPU cannot take this run (its memory, say).
    #[error("{0}")]
    Gpu(String),

    /// The host cannot take this run: the need, its parts and the memory
    /// available, measured before anything sized by a dimension is made;
    /// `sparse_modes` lists the modes whose dimension dwarfs the indices
    /// that occur in them, where the caller can relabel them
    /// ([`OptionName::Compact`]).
    #[error("{}", memory_text(message, sparse_modes.as_deref(), &neutral))]
    Memory {
        message: String,
        sparse_modes: Option<String>,
    },

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

    /// An [`CpdError::InvalidOption`] of `option` alone.
    pub fn option(option: OptionName, reason: impl Into<String>) -> Self {
        CpdError::InvalidOption {
            option,
            value: None,
            reason: reason.into(),
        }
    }

    /// An [`CpdError::InvalidOption`] of `option` given `value`.
    pub fn option_value(
        option: OptionName,
        value: impl ToString,
        reason: impl Into<String>,
    ) -> Self {
        CpdError::InvalidOption {
            option,
            value: Some(value.to_string()),
            reason: reason.into(),
        }
    }

    /// A [`CpdError::Memory`] with no mode to relabel.
    pub fn memory(message: impl Into<String>) -> Self {
        CpdError::Memory {
            message: message.into(),
            sparse_modes: None,
        }
    }

    /// This error's own message (not its causes) with every option
    /// written by `spell`: how a front end shows it. The same as
    /// `to_string()` for an error that names no option.
    pub fn message(&self, spell: Spelling) -> String {
        match self {
            CpdError::InvalidOption {
                option,
                value,
                reason,
            } => option_text(*option, value.as_deref(), reason, spell),
            CpdError::Memory {
                message,
                sparse_modes,
            } => memory_text(message, sparse_modes.as_deref(), spell),
            CpdError::Format(e) => e.message(spell),
            other => other.to_string(),
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

    #[test]
    fn options_are_spelled_by_the_front_end() {
        let flag = |o: OptionName, v: Option<&str>| match v {
            Some(v) => format!("--{o} {v}"),
            None => format!("--{o}"),
        };
        let e = CpdError::option(OptionName::Rank, "must be at least 1");
        assert_eq!(e.to_string(), "rank must be at least 1");
        assert_eq!(e.message(&flag), "--rank must be at least 1");
        let e = CpdError::option_value(OptionName::Kernel, "coo", "runs on the GPU only");
        assert_eq!(e.to_string(), "kernel coo runs on the GPU only");
        assert_eq!(e.message(&flag), "--kernel coo runs on the GPU only");
        let e = CpdError::Memory {
            message: "the run needs 9 GB".into(),
            sparse_modes: Some("mode 1 has dimension 9 but 1 indices occur".into()),
        };
        assert_eq!(
            e.message(&flag),
            "the run needs 9 GB; mode 1 has dimension 9 but 1 indices occur: --compact \
             relabels each mode to the indices that occur"
        );
        assert!(e.to_string().contains(": compact relabels"), "{e}");
        // A reader's advice, passed on unchanged, is spelled the same way.
        let e = CpdError::from(kruskal_formats::FormatError::Advised {
            error: Box::new(kruskal_formats::FormatError::Argument(
                "the nonzero count of x is not recorded".into(),
            )),
            advice: kruskal_formats::Advice::GiveNnz,
        });
        assert_eq!(
            e.message(&flag),
            "invalid argument: the nonzero count of x is not recorded: give one (--nnz)"
        );
        assert!(e.to_string().ends_with("give one (nnz)"), "{e}");
        // An error that names no option reads the same either way.
        let e = CpdError::memory("the run needs 9 GB");
        assert_eq!(e.message(&flag), e.to_string());
    }
}
