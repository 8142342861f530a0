//! Mutation fuzzing of the rendezvous frames: valid frames, sealed as a
//! session seals them, damaged by random mutations and delivered in
//! random pieces with timeouts between them. Whatever arrives, the
//! readers must return frames, Pending, or an error, never panic or spin;
//! a frame that passes the session's check must be one that was sent, in
//! its place (no forgery, no replay, no reordering); and a HELLO that is
//! admitted must be the one the rank made.
//!
//! Bounded for CI: `KRUSKAL_FUZZ_CASES` cases per property (default
//! 256). A failing case is kept in `proptest-regressions/fuzz.txt`
//! (commit it: it is replayed first).

use std::collections::VecDeque;
use std::io::{self, Read};

use proptest::prelude::*;
use proptest::sample::Index;

use crate::auth::{JobKey, nonce};
use crate::wire::{FrameReader, Kind, MAX_PAYLOAD_BYTES, ReadError, SessionReader};

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("KRUSKAL_FUZZ_CASES")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(256),
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::Direct("proptest-regressions/fuzz.txt"),
        )),
        ..ProptestConfig::default()
    }
}

/// Hands out bytes in the given piece sizes, a timeout after each piece
/// that asks for one, then the end of the stream.
struct Pieces {
    bytes: VecDeque<u8>,
    sizes: VecDeque<(usize, bool)>,
}

impl Read for Pieces {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.bytes.is_empty() {
            return Ok(0);
        }
        let (size, timeout) = self.sizes.pop_front().unwrap_or((usize::MAX, false));
        if timeout {
            self.sizes.push_front((size, false));
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let n = size.max(1).min(out.len()).min(self.bytes.len());
        for slot in &mut out[..n] {
            *slot = self.bytes.pop_front().unwrap_or(0);
        }
        Ok(n)
    }
}

/// A frame a session sends: its kind and a payload that fits it.
fn message() -> impl Strategy<Value = (Kind, Vec<u8>)> {
    prop_oneof![
        Just((Kind::Heartbeat, Vec::new())),
        Just((Kind::Goodbye, Vec::new())),
        any::<u64>().prop_map(|g| (Kind::Barrier, g.to_be_bytes().to_vec())),
        proptest::collection::vec(any::<u8>(), 0..64).prop_map(|p| (Kind::Abort, p)),
        proptest::collection::vec(any::<u8>(), 0..300).prop_map(|p| (Kind::Root, p)),
    ]
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip(Index, u8),
    Insert(Index, Vec<u8>),
    Delete(Index, usize),
    Duplicate(Index, usize),
    Truncate(Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<Index>(), proptest::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<Index>(), 1usize..64).prop_map(|(i, n)| Mutation::Delete(i, n)),
        (any::<Index>(), 1usize..200).prop_map(|(i, n)| Mutation::Duplicate(i, n)),
        any::<Index>().prop_map(Mutation::Truncate),
    ]
}

fn mutate(bytes: &mut Vec<u8>, mutations: &[Mutation]) {
    for m in mutations {
        let len = bytes.len();
        if len == 0 {
            return;
        }
        match m {
            Mutation::Flip(i, bit) => bytes[i.index(len)] ^= 1 << bit,
            Mutation::Insert(i, new) => {
                let p = i.index(len);
                bytes.splice(p..p, new.iter().copied());
            }
            Mutation::Delete(i, n) => {
                let p = i.index(len);
                bytes.drain(p..(p + n).min(len));
            }
            Mutation::Duplicate(i, n) => {
                let p = i.index(len);
                let piece = bytes[p..(p + n).min(len)].to_vec();
                bytes.splice(p..p, piece);
            }
            Mutation::Truncate(i) => bytes.truncate(i.index(len)),
        }
    }
}

fn pieces(bytes: Vec<u8>, sizes: Vec<(usize, bool)>) -> Pieces {
    Pieces {
        bytes: bytes.into(),
        sizes: sizes.into(),
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn session_frames_are_never_forged_by_mutation(
        messages in proptest::collection::vec(message(), 1..8),
        mutations in proptest::collection::vec(mutation(), 0..4),
        sizes in proptest::collection::vec((1usize..80, any::<bool>()), 0..40),
    ) {
        let key = JobKey::new("fuzz-token-0123456789");
        let challenge = nonce().unwrap();
        let (hello, rank_session) = key.hello(&challenge, 1, 2).unwrap();
        let mut hello_reader = FrameReader::new();
        let hello = hello_reader.read(&mut &hello[..]).unwrap();
        let root = key.admit(&challenge, &hello).unwrap();
        let mut sealer = rank_session.sealer;
        let mut sent = Vec::new();
        let mut bytes = Vec::new();
        for (kind, payload) in &messages {
            bytes.extend(sealer.seal(*kind, 1, payload));
            sent.push((*kind, payload.clone()));
        }
        let unchanged = mutations.is_empty();
        mutate(&mut bytes, &mutations);
        let total = bytes.len();
        let mut src = pieces(bytes, sizes);
        let mut reader = SessionReader::new(root.session.opener);
        let mut got = Vec::new();
        // Every call consumes a byte, returns a frame, or meets one of
        // the finite timeouts: more calls than that is a spin.
        let mut calls = 0;
        let end = loop {
            calls += 1;
            prop_assert!(calls <= 2 * total + 100, "the reader spins");
            match reader.read(&mut src) {
                // A REFUSE carries no code, by design: it can only end
                // the conversation (as cutting the connection would), and
                // every reader stops there.
                Ok(frame) if frame.kind == Kind::Refuse => {
                    prop_assert!(frame.payload.len() <= MAX_PAYLOAD_BYTES);
                    break ReadError::Closed;
                }
                Ok(frame) => {
                    prop_assert!(frame.payload.len() <= MAX_PAYLOAD_BYTES);
                    got.push((frame.kind, frame.payload));
                }
                Err(ReadError::Pending) => {}
                Err(other) => break other,
            }
        };
        // What passed is what was sent, from the start, in order.
        prop_assert!(got.len() <= sent.len());
        prop_assert_eq!(&got[..], &sent[..got.len()]);
        if unchanged {
            prop_assert_eq!(got.len(), sent.len());
            prop_assert!(matches!(end, ReadError::Closed), "{:?}", end);
        }
        // (`end` is Closed for a REFUSE too: its reason is the peer's.)
        if let ReadError::Invalid { reason, .. } = &end {
            prop_assert!(!reason.is_empty() && !reason.contains('\n'));
        }
    }

    #[test]
    fn only_the_hello_made_is_admitted(
        mutations in proptest::collection::vec(mutation(), 0..3),
        sizes in proptest::collection::vec((1usize..40, any::<bool>()), 0..10),
    ) {
        let key = JobKey::new("fuzz-token-0123456789");
        let challenge = nonce().unwrap();
        let (clean, _) = key.hello(&challenge, 3, 4).unwrap();
        let mut bytes = clean.clone();
        mutate(&mut bytes, &mutations);
        let mut src = pieces(bytes, sizes);
        let mut reader = FrameReader::new();
        let mut calls = 0;
        loop {
            calls += 1;
            prop_assert!(calls < 10_000, "the reader spins");
            match reader.read(&mut src) {
                Ok(frame) => {
                    if frame.kind == Kind::Hello {
                        if let Ok(admitted) = key.admit(&challenge, &frame) {
                            // Only the frame the rank made passes (bytes
                            // after it may have changed).
                            let mut first = FrameReader::new();
                            let made = first.read(&mut &clean[..]).unwrap();
                            prop_assert_eq!(frame, made);
                            prop_assert_eq!((admitted.rank, admitted.world_size), (3, 4));
                        }
                    }
                    break;
                }
                Err(ReadError::Pending) => {}
                Err(_) => break,
            }
        }
    }
}
