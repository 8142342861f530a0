//! Helpers for the rendezvous and membership tests: ranks as threads of
//! this process, over 127.0.0.1, rank 0 on an ephemeral port.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::auth::{Admitted, JobKey, Nonce, Session};
use super::wire::{self, FrameReader, Kind};
use super::{HostPort, Launch, Membership, Rendezvous, RendezvousOptions, Result};

pub(crate) const TOKEN: &str = "launch-test-token";

/// A rank run on a thread: what its rendezvous returns.
pub(crate) type RankThread = JoinHandle<Result<(Vec<u8>, Membership)>>;

/// The payload rank 0 hands out: 128 bytes, like an NCCL unique id.
pub(crate) fn payload() -> Vec<u8> {
    (0..128u8).collect()
}

/// Log lines kept for the test to read.
#[derive(Clone, Default)]
pub(crate) struct Captured(Arc<Mutex<Vec<String>>>);

impl Captured {
    pub(crate) fn lines(&self) -> Vec<String> {
        super::lock(&self.0).clone()
    }

    /// Waits up to `timeout` for a line containing `part`.
    pub(crate) fn wait_for(&self, part: &str, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.lines().into_iter().find(|l| l.contains(part)) {
                return Some(line);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Short timeouts, rank 0 on an ephemeral port of 127.0.0.1, the log
/// captured.
pub(crate) fn options() -> (RendezvousOptions, Captured) {
    let captured = Captured::default();
    let sink = captured.clone();
    let opts = RendezvousOptions {
        join_timeout: Duration::from_secs(5),
        hello_timeout: Duration::from_millis(300),
        bind: Some(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))),
        heartbeat: Duration::from_millis(50),
        peer_timeout: Duration::from_millis(600),
        finish_timeout: Duration::from_secs(3),
        log: Arc::new(move |line: &str| super::lock(&sink.0).push(line.to_string())),
    };
    (opts, captured)
}

pub(crate) fn launch(rank: usize, world_size: usize, port: u16) -> Launch {
    Launch {
        rank,
        world_size,
        local_gpu: rank,
        rendezvous: HostPort {
            host: "127.0.0.1".into(),
            port,
        },
        token: TOKEN.into(),
        source: "test",
    }
}

/// Binds rank 0 of `world`; returns it and its port.
pub(crate) fn bind_root(world: usize, opts: &RendezvousOptions) -> (Rendezvous, u16) {
    let root = Rendezvous::bind(&launch(0, world, 0), opts).unwrap();
    let port = root.local_addr().unwrap().port();
    (root, port)
}

/// Completes rank 0 on a thread with [`payload`].
pub(crate) fn spawn_root(root: Rendezvous) -> RankThread {
    std::thread::spawn(move || root.complete(|| Ok::<_, String>(payload())))
}

/// Runs rank `rank` of `world` on a thread.
pub(crate) fn spawn_rank(
    rank: usize,
    world: usize,
    port: u16,
    opts: &RendezvousOptions,
) -> RankThread {
    let opts = opts.clone();
    std::thread::spawn(move || {
        Rendezvous::run(&launch(rank, world, port), &opts, || {
            Ok::<_, String>(b"only rank 0 makes the payload".to_vec())
        })
    })
}

/// A whole world that has met: memberships by rank.
pub(crate) fn world(n: usize, opts: &RendezvousOptions) -> Vec<Membership> {
    let (root, port) = bind_root(n, opts);
    let root = spawn_root(root);
    let others: Vec<_> = (1..n).map(|r| spawn_rank(r, n, port, opts)).collect();
    let mut all = vec![root.join().unwrap().unwrap().1];
    for t in others {
        let (got, membership) = t.join().unwrap().unwrap();
        assert_eq!(got, payload());
        all.push(membership);
    }
    all
}

/// A world of `n` whose last rank is hand-made: the memberships of the
/// real ranks, by rank, and the hand-made rank's connection and session,
/// its ROOT read.
pub(crate) fn world_with_hand_made_last(
    n: usize,
    opts: &RendezvousOptions,
) -> (Vec<Membership>, TcpStream, Session) {
    let (root, port) = bind_root(n, opts);
    let root = spawn_root(root);
    let others: Vec<_> = (1..n - 1).map(|r| spawn_rank(r, n, port, opts)).collect();
    let (mut s, mut session) = say_hello(port, n as u32 - 1, n as u32, TOKEN);
    let mut real = vec![root.join().unwrap().unwrap().1];
    real.extend(others.into_iter().map(|t| t.join().unwrap().unwrap().1));
    let f = next_frame(&mut s, &mut session);
    assert_eq!((f.kind, f.payload), (Kind::Root, payload()));
    (real, s, session)
}

/// A hand-made peer: connected, nothing read or sent yet.
pub(crate) fn raw(port: u16) -> TcpStream {
    let s = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// Reads rank 0's CHALLENGE on a hand-made peer's connection.
pub(crate) fn challenge(s: &mut TcpStream) -> Nonce {
    let f = next_plain(s);
    assert_eq!(f.kind, Kind::Challenge, "{f:?}");
    f.payload.try_into().unwrap()
}

/// The HELLO with which rank `rank` of `world` holding `token` answers
/// `challenge`, and the session it opens.
pub(crate) fn hello(challenge: &Nonce, rank: u32, world: u32, token: &str) -> (Vec<u8>, Session) {
    JobKey::new(token).hello(challenge, rank, world).unwrap()
}

/// A hand-made rank that has answered its connection's challenge.
pub(crate) fn say_hello(port: u16, rank: u32, world: u32, token: &str) -> (TcpStream, Session) {
    let mut s = raw(port);
    let c = challenge(&mut s);
    let (bytes, session) = hello(&c, rank, world, token);
    s.write_all(&bytes).unwrap();
    (s, session)
}

/// A real rank 1 of 2 on a thread, and a hand-made rank 0's end of its
/// connection (accepted, nothing sent yet).
pub(crate) fn hand_made_root(opts: &RendezvousOptions) -> (TcpStream, RankThread) {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    let one = spawn_rank(1, 2, port, opts);
    let (s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    (s, one)
}

/// A hand-made rank 0's half of the handshake on `s`: challenges it and
/// admits its HELLO under [`TOKEN`].
pub(crate) fn challenge_and_admit(s: &mut TcpStream) -> Admitted {
    let challenge = super::auth::nonce().unwrap();
    wire::send(s, &wire::plain(Kind::Challenge, 0, &challenge)).unwrap();
    let hello = next_plain(s);
    assert_eq!(hello.kind, Kind::Hello, "{hello:?}");
    JobKey::new(TOKEN)
        .admit(&challenge, &hello)
        .unwrap_or_else(|e| panic!("HELLO refused: {e}"))
}

/// The next frame on a hand-made peer's connection, its code unchecked
/// (CHALLENGE, REFUSE).
pub(crate) fn next_plain(s: &mut TcpStream) -> wire::Frame {
    FrameReader::new()
        .read(s)
        .unwrap_or_else(|e| panic!("no frame: {e:?}"))
}

/// The next frame of a hand-made peer's session, its code checked.
pub(crate) fn next_frame(s: &mut TcpStream, session: &mut Session) -> wire::Frame {
    let f = next_plain(s);
    if let Err(e) = session.opener.open(&f) {
        panic!("{e}: {f:?}");
    }
    f
}

/// Whether the peer closed `s` (reads to the end).
pub(crate) fn closed(s: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).is_ok()
}

/// Polls `f` every 10 ms until it gives a value or `timeout` passes.
pub(crate) fn eventually<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
