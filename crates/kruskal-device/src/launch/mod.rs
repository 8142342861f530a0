//! Several processes, one per GPU, possibly on several hosts: who is who.
//!
//! This module moves no GPU data and needs no GPU.
//!
//! - [`env`](mod@env): [`Launch`], this process's rank, world size, local GPU,
//!   rendezvous address and job token, read from the variables a launcher
//!   sets (kruskal's own, torchrun's, OpenMPI's, Slurm's), with explicit
//!   values ([`LaunchOverrides`], from command-line flags) on top.

pub mod env;

pub use env::{HostPort, Launch, LaunchOverrides, MIN_TOKEN_CHARS};

/// Everything that can go wrong launching or running several processes.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// A variable or flag whose value cannot be used.
    #[error("{var}={value:?}: {problem}")]
    Invalid {
        var: &'static str,
        value: String,
        problem: String,
    },

    /// Something that must be set is not; the message says what to set.
    #[error("{0}")]
    Missing(String),

    /// Values that contradict each other.
    #[error("{0}")]
    Inconsistent(String),

    /// The job token is missing or too short (its value is never shown).
    #[error("{0}")]
    Token(String),

    /// A socket operation failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },

    /// Rank 0 refused this rank.
    #[error("rank 0 at {addr} refused rank {rank}: {reason}")]
    Refused {
        addr: String,
        rank: usize,
        reason: String,
    },

    /// Rank 0 sent something this rank cannot understand.
    #[error("rendezvous at {addr}: {message}")]
    Protocol { addr: String, message: String },

    /// Something did not happen in time; the message says what.
    #[error("timed out: {0}")]
    Timeout(String),

    /// The rendezvous was given up (by rank 0, or because rank 0's payload
    /// could not be made).
    #[error("the rendezvous was abandoned: {0}")]
    Aborted(String),
}

pub type Result<T, E = LaunchError> = std::result::Result<T, E>;
