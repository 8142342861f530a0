//! Several processes, one per GPU, possibly on several hosts: who is who,
//! how they meet, and how they notice that one of them is gone.
//!
//! This crate moves no GPU data and needs no GPU. It gives the processes
//! of one job what NCCL needs to build a communicator across them (every
//! rank's number, the world size, and the NCCL unique id that rank 0
//! creates), and a liveness channel that turns a crashed or hung peer into
//! a prompt, named error instead of a collective that never returns.
//!
//! - [`env`](mod@env): [`Launch`], this process's rank, world size, local GPU,
//!   rendezvous address and job token, read from the variables a launcher
//!   sets (kruskal's own, torchrun's, OpenMPI's, Slurm's), with explicit
//!   values ([`LaunchOverrides`], from command-line flags) on top.
//! - [`rendezvous`]: [`Rendezvous`], rank 0 listens on the rendezvous port,
//!   every other rank connects and says HELLO; once all have, rank 0 sends
//!   each of them the same opaque payload (the NCCL unique id).
//! - [`membership`]: [`Membership`], the rendezvous connections kept open
//!   for the whole run: heartbeats both ways, loss detection, ABORT
//!   relayed by rank 0 to everyone, a final GOODBYE barrier.
//! - [`wire`]: the framing every message uses.
//!
//! ```no_run
//! use kruskal_launch::{Launch, Rendezvous, RendezvousOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let launch = Launch::from_env()?;
//! let (id, membership) = Rendezvous::run(&launch, &RendezvousOptions::default(), || {
//!     // Only rank 0 calls this: e.g. the 128 bytes of an NCCL unique id.
//!     Ok::<_, std::convert::Infallible>(vec![0u8; 128])
//! })?;
//! membership.on_loss(Box::new(|lost| eprintln!("{lost}; aborting the communicator")));
//! // ... build the communicator from `id`, run, polling `membership.lost()` ...
//! membership.finish()?; // every rank is done: rank 0 may write the output
//! # Ok(())
//! # }
//! ```
//!
//! # Protocol
//!
//! One TCP connection between rank 0 and each other rank, opened by the
//! other rank. Every message is one frame, integers big-endian:
//!
//! | bytes | field                                                      |
//! |-------|------------------------------------------------------------|
//! | 4     | magic `KRDV`                                               |
//! | 2     | protocol version, 1                                        |
//! | 1     | kind (below)                                               |
//! | 1     | reserved, 0                                                |
//! | 32    | token digest: SHA-256 of `kruskal job token v1\0` + token  |
//! | 4     | rank (what it means depends on the kind)                   |
//! | 4     | payload length, at most [`MAX_PAYLOAD_BYTES`]              |
//! | n     | payload                                                    |
//!
//! | kind          | from      | rank            | payload                  |
//! |---------------|-----------|-----------------|--------------------------|
//! | 1 HELLO       | rank k    | k               | world size, u32          |
//! | 2 ROOT        | rank 0    | k (recipient)   | rank 0's payload         |
//! | 3 HEARTBEAT   | both      | sender          | none                     |
//! | 4 GOODBYE     | both      | sender          | none                     |
//! | 5 ABORT       | both      | the lost rank   | reason, UTF-8            |
//! | 6 REFUSE      | rank 0    | claimed rank    | reason, UTF-8            |
//! | 7 BARRIER     | both      | sender          | generation, u64          |
//!
//! A frame whose magic, version, kind, reserved byte, length or token
//! digest is wrong is invalid; so is a payload of the wrong size for its
//! kind. Headers are checked as they arrive, so an over-long length is
//! refused before its payload is read. Token digests are compared in
//! constant time; the token itself never travels. REFUSE is the one kind
//! sent without the digest (all zeros): it goes to a peer that has not
//! proved it knows the token, and all it can do is end that peer's attempt.
//!
//! Flow: each rank k connects (retrying with backoff until rank 0 is up)
//! and sends HELLO. Rank 0 reads each new connection on its own thread
//! with a short timeout; a connection that sends garbage, a bad header, a
//! wrong token, a rank out of range, another world size or a rank that
//! has already joined, or that stays silent, is dropped with one line on
//! the log (well-framed ones get a REFUSE saying why), and rank 0 goes on
//! waiting for the real peers. When every rank 1..n-1 has joined, rank 0
//! computes its payload and sends ROOT to each. From then on both sides
//! send HEARTBEAT every [`RendezvousOptions::heartbeat`].
//!
//! # Timeouts and failure model
//!
//! - Joining: [`RendezvousOptions::join_timeout`] (120 s by default) for
//!   the whole rendezvous; rank 0's error names the ranks that did not
//!   join, and it tells the ranks that did (ABORT) before closing.
//! - A new connection must say HELLO within
//!   [`RendezvousOptions::hello_timeout`] (5 s), so a stray connection
//!   costs rank 0 one thread for that long and never delays a real peer.
//! - A peer is lost when its connection closes or fails without a prior
//!   GOODBYE, when it sends an invalid frame, or when nothing arrives from
//!   it for [`RendezvousOptions::peer_timeout`] (10 s). A process that
//!   crashes is seen at once (the kernel closes its sockets); a hung host
//!   or a cut network within the peer timeout.
//! - Rank 0 relays a loss to every other rank as ABORT naming the lost
//!   rank; a rank that loses rank 0 reports rank 0. Every rank thus learns
//!   the same missing rank, runs its [`Membership::on_loss`] callbacks
//!   once (to abort the NCCL communicator, so blocked collectives return)
//!   and answers [`Membership::lost`] from then on.
//! - [`Membership::finish`] is the clean end: every rank sends GOODBYE,
//!   rank 0 waits (up to [`RendezvousOptions::finish_timeout`]) for all of
//!   them, then answers GOODBYE to each: a final barrier after which rank 0
//!   may write its output. Dropping a [`Membership`] without `finish`
//!   closes its connections, which the peers see as a loss.
//!
//! What this is not: the token keeps stray and mismatched processes out
//! (another job, a rank started with the wrong variables); it is not
//! encryption or protection against someone who can read the network.

pub mod env;
pub mod membership;
pub mod rendezvous;
pub mod wire;

#[cfg(test)]
mod testkit;

use std::sync::Arc;
use std::time::Duration;

pub use env::{HostPort, Launch, LaunchOverrides, MIN_TOKEN_CHARS};
pub use membership::{Lost, Membership};
pub use rendezvous::{Rendezvous, RendezvousOptions};
pub use wire::MAX_PAYLOAD_BYTES;

/// Where one-line notices go (refused connections, losses); by default
/// standard error.
pub type LogFn = Arc<dyn Fn(&str) + Send + Sync>;

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

    /// A rank was lost during the run.
    #[error("{0}")]
    Lost(Lost),
}

pub type Result<T, E = LaunchError> = std::result::Result<T, E>;

/// The default log: one line on standard error.
pub fn stderr_log() -> LogFn {
    Arc::new(|line: &str| eprintln!("{line}"))
}

/// `120 s`, `0.5 s`: durations as messages show them.
pub(crate) fn secs(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// `rank 2` or `ranks 2, 3`.
pub(crate) fn ranks_phrase(ranks: &[usize]) -> String {
    let list = ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    if ranks.len() == 1 {
        format!("rank {list}")
    } else {
        format!("ranks {list}")
    }
}

/// Locks a mutex, recovering the data if a thread panicked holding it (the
/// state kept here stays meaningful after any partial update).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_phrases_read_well() {
        assert_eq!(secs(Duration::from_secs(120)), "120 s");
        assert_eq!(secs(Duration::from_millis(1500)), "1.5 s");
        assert_eq!(ranks_phrase(&[2]), "rank 2");
        assert_eq!(ranks_phrase(&[2, 3]), "ranks 2, 3");
    }
}
