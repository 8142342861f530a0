//! The job token at work (protocol in the [crate] doc): the
//! challenge-response that admits a rank, and the session key whose
//! authentication code every later frame carries.
//!
//! All codes are HMAC-SHA256. The token itself is the key of the HELLO's
//! code and of the session key's derivation; it never travels. Codes are
//! checked with [`Mac::verify_slice`], which compares in constant time.

use std::fmt;
use std::io;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::wire::{self, Frame, Kind};

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a nonce: rank 0's challenge, a rank's answer.
pub(crate) const NONCE_BYTES: usize = 32;
pub(crate) type Nonce = [u8; NONCE_BYTES];

/// An authentication code, as a frame carries it.
pub(crate) type Tag = [u8; 32];

/// What CHALLENGE and REFUSE carry instead of a code: they are sent before
/// (or instead of) a session, to a peer that has not proved anything.
pub(crate) const NO_TAG: Tag = [0; 32];

/// Bytes of a HELLO's payload: world size (u32), the challenge it
/// answers, the rank's own nonce.
pub(crate) const HELLO_BYTES: usize = 4 + 2 * NONCE_BYTES;

/// Why a HELLO that echoes an earlier challenge is refused.
pub(crate) const REPLAYED: &str =
    "its HELLO answers another connection's challenge (a replayed message)";
/// Why a HELLO whose code does not verify is refused: the token differs,
/// or the message was altered on the way (the two look the same).
pub(crate) const WRONG_TOKEN: &str = "wrong job token";
/// Why a frame of a session whose code does not verify is refused.
pub(crate) const BAD_CODE: &str = "its authentication code does not match (a forged message, \
     or one replayed from another connection or out of order)";

/// A fresh random nonce from the operating system's generator.
pub(crate) fn nonce() -> io::Result<Nonce> {
    let mut n = [0u8; NONCE_BYTES];
    getrandom::fill(&mut n)
        .map_err(|e| io::Error::other(format!("no random numbers from the system: {e}")))?;
    Ok(n)
}

/// The job token as the key of every code.
#[derive(Clone)]
pub(crate) struct JobKey(Vec<u8>);

/// The token is a secret: debug output shows nothing of it.
impl fmt::Debug for JobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobKey(<secret>)")
    }
}

/// Which end of a connection a session is for. Each direction has its own
/// key, so a frame cannot be sent back to the side that sealed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// Rank 0, which sends the challenge.
    Root,
    /// Any other rank, which answers it.
    Rank,
}

/// One connection's keys after the handshake.
pub(crate) struct Session {
    /// Seals what this side sends.
    pub sealer: Sealer,
    /// Checks what the other side sends.
    pub opener: Opener,
}

/// What rank 0 learns from a HELLO that verifies.
pub(crate) struct Admitted {
    pub rank: u32,
    pub world_size: u64,
    pub session: Session,
}

impl JobKey {
    pub(crate) fn new(token: &str) -> Self {
        JobKey(token.as_bytes().to_vec())
    }

    fn mac(&self, label: &[u8]) -> HmacSha256 {
        // HMAC accepts keys of any length; only fixed-size MACs refuse one.
        let mut mac =
            HmacSha256::new_from_slice(&self.0).expect("HMAC-SHA256 takes a key of any length");
        mac.update(label);
        mac
    }

    /// A rank's answer to `challenge`: the HELLO's bytes (rank `rank` of a
    /// world of `world`), and the session it opens once rank 0 accepts it.
    pub(crate) fn hello(
        &self,
        challenge: &Nonce,
        rank: u32,
        world: u32,
    ) -> io::Result<(Vec<u8>, Session)> {
        let answer = nonce()?;
        let mut payload = Vec::with_capacity(HELLO_BYTES);
        payload.extend_from_slice(&world.to_be_bytes());
        payload.extend_from_slice(challenge);
        payload.extend_from_slice(&answer);
        let tag = self.hello_tag(challenge, rank, &payload);
        let bytes = wire::encode(Kind::Hello, &tag, rank, &payload);
        Ok((bytes, self.session(challenge, &answer, Side::Rank)))
    }

    /// Rank 0's check of a HELLO received on the connection it sent
    /// `challenge` to: the challenge echoed must be this one (else the
    /// HELLO was captured from another connection), and its code must
    /// verify under the token.
    pub(crate) fn admit(&self, challenge: &Nonce, hello: &Frame) -> Result<Admitted, &'static str> {
        debug_assert_eq!(hello.kind, Kind::Hello);
        // The frame reader has checked the length of a HELLO's payload.
        let p = &hello.payload;
        let world = u32::from_be_bytes([p[0], p[1], p[2], p[3]]);
        let echoed = &p[4..4 + NONCE_BYTES];
        let answer: Nonce = p[4 + NONCE_BYTES..HELLO_BYTES]
            .try_into()
            .map_err(|_| WRONG_TOKEN)?;
        if echoed != challenge {
            return Err(REPLAYED);
        }
        self.hello_mac(challenge, hello.rank, p)
            .verify_slice(&hello.tag)
            .map_err(|_| WRONG_TOKEN)?;
        Ok(Admitted {
            rank: hello.rank,
            world_size: u64::from(world),
            session: self.session(challenge, &answer, Side::Root),
        })
    }

    fn hello_mac(&self, challenge: &Nonce, rank: u32, payload: &[u8]) -> HmacSha256 {
        let mut mac = self.mac(b"kruskal hello v2\0");
        mac.update(challenge);
        update_frame(&mut mac, Kind::Hello, rank, payload);
        mac
    }

    fn hello_tag(&self, challenge: &Nonce, rank: u32, payload: &[u8]) -> Tag {
        self.hello_mac(challenge, rank, payload)
            .finalize()
            .into_bytes()
            .into()
    }

    /// The keys of the connection whose handshake used `challenge` and
    /// `answer`, for `side`. Both nonces are fresh, so no two connections
    /// share a key, even with the same token.
    fn session(&self, challenge: &Nonce, answer: &Nonce, side: Side) -> Session {
        let key = |direction: &[u8]| -> [u8; 32] {
            let mut mac = self.mac(b"kruskal session v2\0");
            mac.update(direction);
            mac.update(challenge);
            mac.update(answer);
            mac.finalize().into_bytes().into()
        };
        let (from_root, from_rank) = (key(b"from rank 0"), key(b"to rank 0"));
        let (send, receive) = match side {
            Side::Root => (from_root, from_rank),
            Side::Rank => (from_rank, from_root),
        };
        Session {
            sealer: Sealer { key: send, seq: 0 },
            opener: Opener {
                key: receive,
                seq: 0,
            },
        }
    }
}

/// Feeds a frame's fields other than its code to `mac`.
fn update_frame(mac: &mut HmacSha256, kind: Kind, rank: u32, payload: &[u8]) {
    mac.update(&[kind as u8]);
    mac.update(&rank.to_be_bytes());
    mac.update(&(payload.len() as u32).to_be_bytes());
    mac.update(payload);
}

/// The code of the frame number `seq` of one direction of a session.
fn frame_mac(key: &[u8; 32], seq: u64, kind: Kind, rank: u32, payload: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC-SHA256 takes a key of any length");
    mac.update(&seq.to_be_bytes());
    update_frame(&mut mac, kind, rank, payload);
    mac
}

/// Seals the frames one side of a session sends: each code covers the
/// frame and its number in the direction, so a frame is good once, in
/// its place, on its connection.
pub(crate) struct Sealer {
    key: [u8; 32],
    seq: u64,
}

impl Sealer {
    /// The bytes of the next frame. The caller keeps `payload` within
    /// [`wire::MAX_PAYLOAD_BYTES`] and sends the frames in the order they
    /// were sealed.
    pub(crate) fn seal(&mut self, kind: Kind, rank: u32, payload: &[u8]) -> Vec<u8> {
        let tag: Tag = frame_mac(&self.key, self.seq, kind, rank, payload)
            .finalize()
            .into_bytes()
            .into();
        self.seq += 1;
        wire::encode(kind, &tag, rank, payload)
    }
}

/// Checks the frames the other side of a session sends, in order.
pub(crate) struct Opener {
    key: [u8; 32],
    seq: u64,
}

impl Opener {
    /// Whether `frame` is the next frame the other side sealed; a frame
    /// that is not leaves the expected number where it was.
    pub(crate) fn open(&mut self, frame: &Frame) -> Result<(), &'static str> {
        frame_mac(&self.key, self.seq, frame.kind, frame.rank, &frame.payload)
            .verify_slice(&frame.tag)
            .map_err(|_| BAD_CODE)?;
        self.seq += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::FrameReader;

    const TOKEN: &str = "launch-test-token";

    fn frame(bytes: &[u8]) -> Frame {
        FrameReader::new()
            .read(&mut &bytes[..])
            .unwrap_or_else(|e| panic!("not a frame: {e:?}"))
    }

    /// A handshake as both sides make it: (rank 0's session, the rank's).
    fn handshake(key: &JobKey) -> (Session, Session) {
        let challenge = nonce().unwrap();
        let (hello, rank) = key.hello(&challenge, 1, 2).unwrap();
        let root = key.admit(&challenge, &frame(&hello)).unwrap();
        assert_eq!((root.rank, root.world_size), (1, 2));
        (root.session, rank)
    }

    #[test]
    fn nonces_are_fresh() {
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }

    #[test]
    fn a_hello_verifies_only_on_its_own_connection_and_token() {
        let key = JobKey::new(TOKEN);
        let challenge = nonce().unwrap();
        let (hello, _) = key.hello(&challenge, 1, 2).unwrap();
        assert!(key.admit(&challenge, &frame(&hello)).is_ok());
        // Replayed on a connection that sent another challenge.
        let e = key.admit(&nonce().unwrap(), &frame(&hello)).err();
        assert_eq!(e, Some(REPLAYED));
        // Under another token.
        let e = JobKey::new("another-job-token")
            .admit(&challenge, &frame(&hello))
            .err();
        assert_eq!(e, Some(WRONG_TOKEN));
        // Altered on the way: another rank, another world size, or the
        // echoed challenge patched to a new connection's.
        let mut f = frame(&hello);
        f.rank = 2;
        assert_eq!(key.admit(&challenge, &f).err(), Some(WRONG_TOKEN));
        let mut f = frame(&hello);
        f.payload[3] = 3;
        assert_eq!(key.admit(&challenge, &f).err(), Some(WRONG_TOKEN));
        let other = nonce().unwrap();
        let mut f = frame(&hello);
        f.payload[4..4 + NONCE_BYTES].copy_from_slice(&other);
        assert_eq!(key.admit(&other, &f).err(), Some(WRONG_TOKEN));
    }

    #[test]
    fn session_frames_are_good_once_in_order_on_their_connection() {
        let key = JobKey::new(TOKEN);
        let (mut root, mut rank) = handshake(&key);
        let first = rank.sealer.seal(Kind::Heartbeat, 1, &[]);
        let second = rank.sealer.seal(Kind::Barrier, 1, &1u64.to_be_bytes());
        // Out of order, then in order; a repeat is refused.
        assert_eq!(root.opener.open(&frame(&second)), Err(BAD_CODE));
        assert_eq!(root.opener.open(&frame(&first)), Ok(()));
        assert_eq!(root.opener.open(&frame(&first)), Err(BAD_CODE));
        assert_eq!(root.opener.open(&frame(&second)), Ok(()));
        // Rank 0's frames open on the rank, never back on rank 0.
        let down = root.sealer.seal(Kind::Root, 1, b"id");
        assert_eq!(root.opener.open(&frame(&down)), Err(BAD_CODE));
        assert_eq!(rank.opener.open(&frame(&down)), Ok(()));
        // Another connection of the same job does not take this one's
        // frames, even at the same position.
        let (mut root_a, mut rank_a) = handshake(&key);
        let (mut root_b, mut rank_b) = handshake(&key);
        let from_a = rank_a.sealer.seal(Kind::Heartbeat, 1, &[]);
        let from_b = rank_b.sealer.seal(Kind::Heartbeat, 1, &[]);
        assert_eq!(root_b.opener.open(&frame(&from_a)), Err(BAD_CODE));
        assert_eq!(root_a.opener.open(&frame(&from_b)), Err(BAD_CODE));
        assert_eq!(root_a.opener.open(&frame(&from_a)), Ok(()));
        assert_eq!(root_b.opener.open(&frame(&from_b)), Ok(()));
        // A changed payload does not verify.
        let mut f = frame(&rank.sealer.seal(Kind::Abort, 1, b"gone"));
        f.payload[0] = b'G';
        assert_eq!(root.opener.open(&f), Err(BAD_CODE));
    }

    #[test]
    fn the_key_is_never_shown() {
        assert!(!format!("{:?}", JobKey::new(TOKEN)).contains(TOKEN));
    }
}
