//! Several processes, one per GPU, possibly on several hosts: who is who,
//! how they meet, and how they notice that one of them is gone.
//!
//! This crate moves no GPU data and needs no GPU. It gives the processes
//! of one job what NCCL needs to build a communicator across them (every
//! rank's number, the world size, and the NCCL unique id that rank 0
//! creates), and a liveness channel that turns a crashed or hung peer into
//! a prompt, named error instead of a collective that never returns.
//!
//! - [`env`](mod@env): [`Launch`], the job identity of this process: its
//!   rank, the world size, its local GPU, the rendezvous address and the
//!   job token, read from the variables a launcher sets (kruskal's own,
//!   torchrun's, OpenMPI's, Slurm's), with explicit values
//!   ([`LaunchOverrides`], e.g. from command-line flags) on top, named in
//!   messages as the caller spells them ([`OverrideNames`]).
//! - [`rendezvous`]: [`Rendezvous`], rank 0 listens on the rendezvous port,
//!   every other rank connects and proves it holds the job token; once all
//!   have, rank 0 sends each of them the same opaque payload (the NCCL
//!   unique id).
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
//! | 2     | protocol version, 2                                        |
//! | 1     | kind (below)                                               |
//! | 1     | reserved, 0                                                |
//! | 32    | authentication code, HMAC-SHA256 (below)                   |
//! | 4     | rank (what it means depends on the kind)                   |
//! | 4     | payload length, at most [`MAX_PAYLOAD_BYTES`]              |
//! | n     | payload                                                    |
//!
//! | kind          | from      | rank            | payload                  |
//! |---------------|-----------|-----------------|--------------------------|
//! | 8 CHALLENGE   | rank 0    | 0               | nonce C, 32 bytes        |
//! | 1 HELLO       | rank k    | k               | world size u32, C, nonce A (32 bytes) |
//! | 2 ROOT        | rank 0    | k (recipient)   | rank 0's payload         |
//! | 3 HEARTBEAT   | both      | sender          | none                     |
//! | 4 GOODBYE     | both      | sender          | none                     |
//! | 5 ABORT       | both      | the lost rank   | reason, UTF-8            |
//! | 6 REFUSE      | rank 0    | claimed rank    | reason, UTF-8            |
//! | 7 BARRIER     | both      | sender          | generation, u64          |
//!
//! A frame whose magic, version, kind, reserved byte or length is wrong is
//! invalid; so is a payload of the wrong size for its kind. Headers are
//! checked as they arrive, so an over-long length is refused before its
//! payload is read; the code is checked once the whole frame is in.
//!
//! Flow, on each connection:
//!
//! 1. Rank k connects (retrying with backoff until rank 0 is up). Rank 0
//!    sends CHALLENGE with a fresh random nonce C (32 bytes from the
//!    operating system's generator).
//! 2. Rank k answers HELLO: its world size, C echoed, and a fresh nonce A
//!    of its own, with the code HMAC(token, `kruskal hello v2\0` ‖ C ‖
//!    kind ‖ rank ‖ length ‖ payload).
//! 3. Rank 0 checks that C is this connection's challenge (else: "its HELLO
//!    answers another connection's challenge (a replayed message)"), then
//!    the code, in constant time (else: "wrong job token", which is also
//!    what an altered HELLO gets), then the rank and world size. Each
//!    refusal is one line on rank 0's log and a REFUSE to the peer saying
//!    why; rank 0 goes on waiting for the real peers.
//! 4. Both sides derive the connection's two keys, one per direction:
//!    HMAC(token, `kruskal session v2\0` ‖ `from rank 0` or `to rank 0` ‖
//!    C ‖ A).
//! 5. When every rank 1..n-1 has joined, rank 0 computes its payload and
//!    sends ROOT to each. From then on both sides send HEARTBEAT every
//!    [`RendezvousOptions::heartbeat`], and BARRIER, GOODBYE and ABORT as
//!    the run needs them.
//!
//! Every frame from ROOT on carries HMAC(direction's key, n ‖ kind ‖ rank
//! ‖ length ‖ payload), where n counts the frames sent in that direction
//! from 0. The receiver expects the next n; a frame whose code does not
//! verify ends the connection (the sender is lost, "sent an invalid
//! message: its authentication code does not match ..."). CHALLENGE and
//! REFUSE carry no code (all zeros): they go to a peer that has not proved
//! anything yet, and all a REFUSE can do is end that peer's attempt.
//!
//! # The job token
//!
//! Every rank of a job holds the same secret, the job token
//! (`KRUSKAL_JOB_TOKEN`, at least [`MIN_TOKEN_CHARS`] characters; `openssl
//! rand -hex 16` makes a good one). It never travels; it is the key of the
//! HELLO's code and of the keys derived from it. What that protects:
//!
//! - Only a process that holds the token joins: a stray connection,
//!   garbage, another job's rank (another token) or a rank started with
//!   the wrong variables is refused with a reason.
//! - A HELLO captured on the network is good on its own connection only:
//!   sent on a new one it answers the wrong challenge. Rank 0's frames are
//!   likewise bound to the nonce A that the joining rank chose, so a
//!   joining rank also knows that rank 0 holds the token.
//! - After the handshake, no frame can be forged, altered, replayed,
//!   reordered, sent back to its sender or moved from one connection (or
//!   job) to another: each code covers the frame, its direction, its
//!   position, and the connection's nonces.
//!
//! What it does not protect:
//!
//! - Nothing is encrypted: anyone who can read the network sees the NCCL
//!   unique id in ROOT, the ranks, world size, abort reasons and timing.
//!   (NCCL's own traffic is not protected by kruskal at all.)
//! - Someone who can drop, delay or cut the traffic (or send a REFUSE, or
//!   reset the connection) can stop the job; the ranks then stop with an
//!   error naming the lost rank, as for a crash.
//! - A token is only as good as its secrecy and randomness: a short or
//!   guessable one can be found by trying HELLOs, or offline from one
//!   captured HELLO, and one that leaks (shell history, a world-readable
//!   job script) admits anyone.
//!
//! # Timeouts and failure model
//!
//! - Joining: [`RendezvousOptions::join_timeout`] (120 s by default) for
//!   the whole rendezvous; rank 0's error names the ranks that did not
//!   join, and it tells the ranks that did (ABORT) before closing.
//! - A new connection must answer its challenge with HELLO within
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

mod auth;
pub mod env;
pub mod membership;
pub mod rendezvous;
pub mod wire;

#[cfg(test)]
mod fuzz;
#[cfg(test)]
mod testkit;

use std::sync::Arc;
use std::time::Duration;

pub use env::{HostPort, Launch, LaunchOverrides, MIN_TOKEN_CHARS, OverrideNames};
pub use membership::{Lost, Membership};
pub use rendezvous::{Rendezvous, RendezvousOptions};
pub use wire::MAX_PAYLOAD_BYTES;

/// Where one-line notices go (refused connections, losses); by default
/// standard error.
pub type LogFn = Arc<dyn Fn(&str) + Send + Sync>;

/// Everything that can go wrong launching or running several processes.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// A variable or explicit value that cannot be used. `var` is a
    /// variable's name or an [`OverrideNames`] entry: one word is shown
    /// as `var="value"`, words as `words "value"`.
    #[error("{}: {problem}", named_value(var, value))]
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
    #[error("{what}: {error}")]
    Io { what: String, error: std::io::Error },

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

/// `KRUSKAL_RANK="x"` or `--world-size="0"` (one word, a variable or a
/// flag), `an explicit world size "0"` (words).
fn named_value(var: &str, value: &str) -> String {
    if var.contains(char::is_whitespace) {
        format!("{var} {value:?}")
    } else {
        format!("{var}={value:?}")
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
