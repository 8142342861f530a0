//! The frames of the rendezvous protocol (layout in the [crate] doc):
//! encoding, and a reader that keeps partial frames across read timeouts
//! and checks each header as soon as it has arrived.

use std::io::{self, Read, Write};

use super::auth::{HELLO_BYTES, NO_TAG, NONCE_BYTES, Opener, Tag};

/// The largest payload a frame may carry, in bytes.
pub const MAX_PAYLOAD_BYTES: usize = 4096;

pub(crate) const MAGIC: [u8; 4] = *b"KRDV";
pub(crate) const VERSION: u16 = 2;
pub(crate) const HEADER_BYTES: usize = 48;

/// The message kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Hello = 1,
    Root = 2,
    Heartbeat = 3,
    Goodbye = 4,
    Abort = 5,
    Refuse = 6,
    Barrier = 7,
    Challenge = 8,
}

impl Kind {
    fn from_byte(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::Root,
            3 => Kind::Heartbeat,
            4 => Kind::Goodbye,
            5 => Kind::Abort,
            6 => Kind::Refuse,
            7 => Kind::Barrier,
            8 => Kind::Challenge,
            _ => return None,
        })
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Hello => "HELLO",
            Kind::Root => "ROOT",
            Kind::Heartbeat => "HEARTBEAT",
            Kind::Goodbye => "GOODBYE",
            Kind::Abort => "ABORT",
            Kind::Refuse => "REFUSE",
            Kind::Barrier => "BARRIER",
            Kind::Challenge => "CHALLENGE",
        }
    }

    /// Whether a payload of `bytes` fits this kind (all are at most
    /// [`MAX_PAYLOAD_BYTES`]).
    fn payload_fits(self, bytes: usize) -> bool {
        match self {
            Kind::Hello => bytes == HELLO_BYTES,
            Kind::Challenge => bytes == NONCE_BYTES,
            Kind::Heartbeat | Kind::Goodbye => bytes == 0,
            Kind::Barrier => bytes == 8,
            Kind::Root | Kind::Abort | Kind::Refuse => true,
        }
    }
}

/// One received message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Frame {
    pub kind: Kind,
    /// The authentication code (all zeros on CHALLENGE and REFUSE).
    pub tag: Tag,
    pub rank: u32,
    pub payload: Vec<u8>,
}

impl Frame {
    /// The payload as text (ABORT and REFUSE reasons).
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.payload).into_owned()
    }

    /// The payload as a big-endian u64 (BARRIER).
    pub(crate) fn number(&self) -> u64 {
        self.payload
            .iter()
            .fold(0u64, |n, &b| (n << 8) | u64::from(b))
    }
}

/// The bytes of one frame with the code `tag` (made by [`super::auth`]).
/// The caller keeps `payload` within [`MAX_PAYLOAD_BYTES`] (see [`clip`]).
pub(crate) fn encode(kind: Kind, tag: &Tag, rank: u32, payload: &[u8]) -> Vec<u8> {
    debug_assert!(payload.len() <= MAX_PAYLOAD_BYTES);
    let mut out = Vec::with_capacity(HEADER_BYTES + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_be_bytes());
    out.push(kind as u8);
    out.push(0);
    out.extend_from_slice(tag);
    out.extend_from_slice(&rank.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// The bytes of a frame that carries no code: CHALLENGE and REFUSE, the
/// two kinds sent to a peer that has not proved it knows the token.
pub(crate) fn plain(kind: Kind, rank: u32, payload: &[u8]) -> Vec<u8> {
    debug_assert!(matches!(kind, Kind::Challenge | Kind::Refuse));
    encode(kind, &NO_TAG, rank, payload)
}

/// Writes one encoded frame in one call (small frames leave in one
/// segment).
pub(crate) fn send(w: &mut impl Write, frame: &[u8]) -> io::Result<()> {
    w.write_all(frame)?;
    w.flush()
}

/// `text` cut to at most [`MAX_PAYLOAD_BYTES`] bytes at a character edge.
pub(crate) fn clip(text: &str) -> &[u8] {
    let mut end = text.len().min(MAX_PAYLOAD_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text.as_bytes()[..end]
}

/// Why no frame was returned.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// No whole frame yet: the read timed out, or bytes arrived that do
    /// not complete the frame. What arrived so far is kept for the next
    /// call, so the caller sees the clock between any two reads.
    Pending,
    /// The peer closed the connection between frames.
    Closed,
    Io(io::Error),
    /// Not a valid frame. `peer` is true when at least the magic was
    /// right, i.e. the sender speaks this protocol and may be told why.
    Invalid {
        reason: String,
        peer: bool,
    },
}

/// Reads frames from a stream, one at a time, never past the current one.
/// It checks their form only; [`SessionReader`] checks their codes too.
pub(crate) struct FrameReader {
    buf: Vec<u8>,
}

impl FrameReader {
    pub(crate) fn new() -> Self {
        FrameReader {
            buf: Vec::with_capacity(HEADER_BYTES),
        }
    }

    /// The next frame. When the stream's read timeout expires, or a read
    /// returns fewer bytes than the frame still needs, it returns
    /// [`ReadError::Pending`] and resumes where it stopped on the next
    /// call. So a peer that trickles a byte now and then cannot keep a
    /// caller past its deadline: the caller's loop sees its clock (and sets
    /// the timeout to what is left) between any two short reads.
    pub(crate) fn read(&mut self, r: &mut impl Read) -> Result<Frame, ReadError> {
        let mut short = false;
        loop {
            let need = self.needed()?;
            let have = self.buf.len();
            if have == need {
                return Ok(self.take());
            }
            if short {
                return Err(ReadError::Pending);
            }
            self.buf.resize(need, 0);
            let got = r.read(&mut self.buf[have..]);
            self.buf.truncate(have + *got.as_ref().unwrap_or(&0));
            match got {
                Ok(0) if have == 0 => return Err(ReadError::Closed),
                Ok(0) => {
                    return Err(ReadError::Invalid {
                        reason: format!(
                            "the connection closed in the middle of a message ({have} bytes)"
                        ),
                        peer: have >= MAGIC.len(),
                    });
                }
                Ok(n) => short = n < need - have,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(ReadError::Pending);
                }
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
    }

    /// How many bytes the frame being read has in all, as far as the
    /// buffered bytes tell; an error as soon as they show it is invalid.
    fn needed(&self) -> Result<usize, ReadError> {
        let b = &self.buf;
        let invalid = |reason: String, peer: bool| Err(ReadError::Invalid { reason, peer });
        let m = b.len().min(MAGIC.len());
        if b[..m] != MAGIC[..m] {
            return invalid("not a kruskal rendezvous message (bad magic)".into(), false);
        }
        if b.len() < HEADER_BYTES {
            return Ok(HEADER_BYTES);
        }
        let version = u16::from_be_bytes([b[4], b[5]]);
        if version != VERSION {
            return invalid(
                format!("protocol version {version}; this build speaks version {VERSION}"),
                true,
            );
        }
        let Some(kind) = Kind::from_byte(b[6]) else {
            return invalid(format!("unknown message kind {}", b[6]), true);
        };
        if b[7] != 0 {
            return invalid(format!("reserved byte is {}, not 0", b[7]), true);
        }
        let len = u32::from_be_bytes([b[44], b[45], b[46], b[47]]) as usize;
        if len > MAX_PAYLOAD_BYTES {
            return invalid(
                format!("a payload of {len} bytes (at most {MAX_PAYLOAD_BYTES})"),
                true,
            );
        }
        if !kind.payload_fits(len) {
            return invalid(
                format!("{} with a payload of {len} bytes", kind.name()),
                true,
            );
        }
        Ok(HEADER_BYTES + len)
    }

    fn take(&mut self) -> Frame {
        let b = &self.buf;
        let frame = Frame {
            // needed() has checked the kind byte.
            kind: Kind::from_byte(b[6]).unwrap_or(Kind::Refuse),
            tag: b[8..40].try_into().unwrap_or(NO_TAG),
            rank: u32::from_be_bytes([b[40], b[41], b[42], b[43]]),
            payload: b[HEADER_BYTES..].to_vec(),
        };
        self.buf.clear();
        frame
    }
}

/// Reads the frames of one connection after its handshake: each must be
/// the next frame the other side sealed (see [`Opener::open`]), except a
/// REFUSE, which carries no code and can only end the conversation.
pub(crate) struct SessionReader {
    frames: FrameReader,
    opener: Opener,
}

impl SessionReader {
    pub(crate) fn new(opener: Opener) -> Self {
        SessionReader {
            frames: FrameReader::new(),
            opener,
        }
    }

    /// The next frame whose code verifies; [`FrameReader::read`] says how
    /// timeouts and partial frames are handled.
    pub(crate) fn read(&mut self, r: &mut impl Read) -> Result<Frame, ReadError> {
        let frame = self.frames.read(r)?;
        if frame.kind != Kind::Refuse {
            self.opener
                .open(&frame)
                .map_err(|reason| ReadError::Invalid {
                    reason: reason.into(),
                    peer: true,
                })?;
        }
        Ok(frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// Hands out the given chunks one read at a time, a timeout between
    /// chunks, then end of stream.
    struct Chunks(VecDeque<Option<Vec<u8>>>);

    impl Read for Chunks {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            match self.0.pop_front() {
                None => Ok(0),
                Some(None) => Err(io::ErrorKind::WouldBlock.into()),
                Some(Some(mut chunk)) => {
                    let n = chunk.len().min(out.len());
                    out[..n].copy_from_slice(&chunk[..n]);
                    if n < chunk.len() {
                        self.0.push_front(Some(chunk.split_off(n)));
                    }
                    Ok(n)
                }
            }
        }
    }

    /// A code as a sealer would make it (the reader does not check it).
    const TAG: Tag = [7; 32];

    /// What reading `bytes`, then the end of the stream, gives, past the
    /// Pending of a short read.
    fn read_all(bytes: Vec<u8>) -> Result<Frame, ReadError> {
        let mut src = Chunks([Some(bytes)].into());
        let mut r = FrameReader::new();
        loop {
            match r.read(&mut src) {
                Err(ReadError::Pending) => {}
                other => return other,
            }
        }
    }

    fn reason(r: Result<Frame, ReadError>) -> (String, bool) {
        match r {
            Err(ReadError::Invalid { reason, peer }) => (reason, peer),
            other => panic!("expected an invalid frame, got {other:?}"),
        }
    }

    #[test]
    fn launch_frames_round_trip() {
        let bytes = encode(Kind::Root, &TAG, 7, &[1, 2, 3]);
        assert_eq!(bytes.len(), HEADER_BYTES + 3);
        let f = read_all(bytes).unwrap();
        assert_eq!(
            f,
            Frame {
                kind: Kind::Root,
                tag: TAG,
                rank: 7,
                payload: vec![1, 2, 3]
            }
        );
        let barrier = read_all(encode(Kind::Barrier, &TAG, 1, &3u64.to_be_bytes())).unwrap();
        assert_eq!(barrier.number(), 3);
        let challenge = read_all(plain(Kind::Challenge, 0, &[9; NONCE_BYTES])).unwrap();
        assert_eq!((challenge.tag, challenge.payload), (NO_TAG, vec![9; 32]));
    }

    #[test]
    fn partial_frames_survive_timeouts() {
        let mut bytes = encode(Kind::Abort, &TAG, 2, b"gone");
        bytes.extend(encode(Kind::Heartbeat, &TAG, 0, &[]));
        let mut src = Chunks(
            [
                Some(bytes[..3].to_vec()),
                None,
                Some(bytes[3..50].to_vec()),
                None,
                Some(bytes[50..].to_vec()),
            ]
            .into(),
        );
        let mut r = FrameReader::new();
        // Each chunk that does not complete the frame, and each timeout,
        // is one Pending.
        for _ in 0..4 {
            assert!(matches!(r.read(&mut src), Err(ReadError::Pending)));
        }
        let f = r.read(&mut src).unwrap();
        assert_eq!(
            (f.kind, f.rank, f.text().as_str()),
            (Kind::Abort, 2, "gone")
        );
        assert_eq!(r.read(&mut src).unwrap().kind, Kind::Heartbeat);
        assert!(matches!(r.read(&mut src), Err(ReadError::Closed)));
    }

    #[test]
    fn a_trickle_returns_to_the_caller_after_every_read() {
        // One byte per read and no timeout in between: a reader looping
        // inside would wait for the whole frame however slowly it came.
        let bytes = encode(Kind::Heartbeat, &TAG, 1, &[]);
        let mut src = Chunks(bytes.iter().map(|&b| Some(vec![b])).collect());
        let mut r = FrameReader::new();
        for _ in 0..bytes.len() - 1 {
            assert!(matches!(r.read(&mut src), Err(ReadError::Pending)));
        }
        assert_eq!(r.read(&mut src).unwrap().kind, Kind::Heartbeat);
    }

    #[test]
    fn invalid_frames_are_named() {
        let good = encode(Kind::Heartbeat, &TAG, 1, &[]);
        let (why, peer) = reason(read_all(b"GET / HTTP/1.1\r\n".to_vec()));
        assert_eq!(
            (why.as_str(), peer),
            ("not a kruskal rendezvous message (bad magic)", false)
        );
        // Garbage is refused from its first bytes, before a header's worth.
        let (why, _) =
            reason(FrameReader::new().read(&mut Chunks([Some(b"KRx".to_vec()), None].into())));
        assert!(why.contains("bad magic"));

        let mut b = good.clone();
        b[5] = 9;
        assert_eq!(
            reason(read_all(b)).0,
            "protocol version 9; this build speaks version 2"
        );
        let mut b = good.clone();
        b[6] = 42;
        assert_eq!(reason(read_all(b)).0, "unknown message kind 42");
        let mut b = good.clone();
        b[7] = 1;
        assert_eq!(reason(read_all(b)).0, "reserved byte is 1, not 0");
        let mut b = encode(Kind::Root, &TAG, 1, &[]);
        b[44..48].copy_from_slice(&(1u32 << 30).to_be_bytes());
        assert_eq!(
            reason(read_all(b)).0,
            "a payload of 1073741824 bytes (at most 4096)"
        );
        assert_eq!(
            reason(read_all(encode(Kind::Heartbeat, &TAG, 1, &[0]))).0,
            "HEARTBEAT with a payload of 1 bytes"
        );
        assert_eq!(
            reason(read_all(encode(Kind::Hello, &TAG, 1, &[0, 0, 0, 2]))).0,
            "HELLO with a payload of 4 bytes"
        );
        let (why, _) = reason(read_all(good[..20].to_vec()));
        assert_eq!(
            why,
            "the connection closed in the middle of a message (20 bytes)"
        );
        // REFUSE travels without a code.
        let refuse = plain(Kind::Refuse, 3, b"no");
        assert_eq!(read_all(refuse).unwrap().text(), "no");
    }

    #[test]
    fn text_is_clipped_at_a_character_edge() {
        let long = "é".repeat(MAX_PAYLOAD_BYTES);
        let clipped = clip(&long);
        assert!(clipped.len() <= MAX_PAYLOAD_BYTES);
        assert!(std::str::from_utf8(clipped).is_ok());
        assert_eq!(clip("short"), b"short");
    }
}
