//! The meeting of all ranks: rank 0 listens, the others connect and say
//! HELLO, rank 0 answers each with the same payload (protocol and
//! timeouts in the [crate] doc).

use std::fmt;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use super::auth::{self, JobKey, Nonce, Sealer};
use super::membership::{Link, Membership};
use super::wire::{self, Frame, FrameReader, Kind, ReadError, SessionReader};
use super::{Launch, LaunchError, LogFn, Result, ranks_phrase, secs, stderr_log};

/// How often rank 0 looks for new connections and finished handshakes.
const POLL: Duration = Duration::from_millis(10);
/// How long a joined rank waits for ROOT beyond the join timeout (rank 0
/// may have started after it).
const ROOT_GRACE: Duration = Duration::from_secs(5);
/// Longest single connection attempt; the attempts repeat until the join
/// timeout.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);
/// Bound on a write to a peer that has not joined yet.
const STRAY_WRITE: Duration = Duration::from_secs(1);

/// Timeouts and addresses of the rendezvous and of the membership after it.
#[derive(Clone)]
pub struct RendezvousOptions {
    /// The whole rendezvous: rank 0 waits this long for every rank, the
    /// others keep trying to reach rank 0 this long.
    pub join_timeout: Duration,
    /// A new connection must send HELLO within this.
    pub hello_timeout: Duration,
    /// Where rank 0 listens; `None`: every interface, at the rendezvous
    /// port (`0.0.0.0`, or `[::]` when the rendezvous host is an IPv6
    /// address), so other hosts reach it whatever name they use.
    pub bind: Option<SocketAddr>,
    /// Interval between heartbeats.
    pub heartbeat: Duration,
    /// A peer silent this long is lost.
    pub peer_timeout: Duration,
    /// [`Membership::finish`] waits this long for the other ranks.
    pub finish_timeout: Duration,
    /// Where refused connections and losses are reported.
    pub log: LogFn,
}

impl Default for RendezvousOptions {
    fn default() -> Self {
        RendezvousOptions {
            join_timeout: Duration::from_secs(120),
            hello_timeout: Duration::from_secs(5),
            bind: None,
            heartbeat: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(10),
            finish_timeout: Duration::from_secs(300),
            log: stderr_log(),
        }
    }
}

impl fmt::Debug for RendezvousOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RendezvousOptions")
            .field("join_timeout", &self.join_timeout)
            .field("hello_timeout", &self.hello_timeout)
            .field("bind", &self.bind)
            .field("heartbeat", &self.heartbeat)
            .field("peer_timeout", &self.peer_timeout)
            .field("finish_timeout", &self.finish_timeout)
            .finish_non_exhaustive()
    }
}

/// A rendezvous in preparation: on rank 0, its listener is already bound.
pub struct Rendezvous {
    launch: Launch,
    opts: RendezvousOptions,
    key: JobKey,
    listener: Option<TcpListener>,
}

impl Rendezvous {
    /// Runs the whole rendezvous: [`Rendezvous::bind`], then
    /// [`Rendezvous::complete`]. Returns rank 0's payload (on rank 0 too)
    /// and the membership that watches the other ranks from now on.
    pub fn run<E: fmt::Display>(
        launch: &Launch,
        opts: &RendezvousOptions,
        payload_of_root: impl FnOnce() -> Result<Vec<u8>, E>,
    ) -> Result<(Vec<u8>, Membership)> {
        Rendezvous::bind(launch, opts)?.complete(payload_of_root)
    }

    /// On rank 0 of a world of several, binds the rendezvous listener
    /// (see [`RendezvousOptions::bind`]); elsewhere only checks `launch`
    /// (its token too, however it was made).
    pub fn bind(launch: &Launch, opts: &RendezvousOptions) -> Result<Rendezvous> {
        super::env::check_token(&launch.token, "the job token")?;
        if launch.world_size == 0 || launch.world_size > u32::MAX as usize {
            return Err(LaunchError::Inconsistent(format!(
                "a world of {} ranks cannot meet",
                launch.world_size
            )));
        }
        if launch.rank >= launch.world_size {
            return Err(LaunchError::Inconsistent(format!(
                "rank {} is not below the world size {}",
                launch.rank, launch.world_size
            )));
        }
        let listener = if launch.rank == 0 && launch.world_size > 1 {
            let addr = opts.bind.unwrap_or_else(|| {
                if launch.rendezvous.host.parse::<Ipv6Addr>().is_ok() {
                    (Ipv6Addr::UNSPECIFIED, launch.rendezvous.port).into()
                } else {
                    (Ipv4Addr::UNSPECIFIED, launch.rendezvous.port).into()
                }
            });
            let listener = TcpListener::bind(addr).map_err(|source| LaunchError::Io {
                what: format!(
                    "rank 0 listening for the rendezvous on {addr} (is the port free? another \
                     job may be using it)"
                ),
                error: source,
            })?;
            Some(listener)
        } else {
            None
        };
        Ok(Rendezvous {
            launch: launch.clone(),
            opts: opts.clone(),
            key: JobKey::new(&launch.token),
            listener,
        })
    }

    /// Where rank 0 listens (rank 0 of several only).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Meets the other ranks. Rank 0 calls `payload_of_root` once all have
    /// joined (at most [`super::MAX_PAYLOAD_BYTES`] bytes) and sends the
    /// result to each; the others return what they receive.
    pub fn complete<E: fmt::Display>(
        self,
        payload_of_root: impl FnOnce() -> Result<Vec<u8>, E>,
    ) -> Result<(Vec<u8>, Membership)> {
        match self.listener {
            None if self.launch.rank == 0 => {
                let payload = root_payload(payload_of_root).map_err(LaunchError::Aborted)?;
                let membership = Membership::start(0, 1, Vec::new(), &self.opts)?;
                Ok((payload, membership))
            }
            None => join(&self.launch, &self.opts, &self.key),
            Some(listener) => host(
                &self.launch,
                &self.opts,
                self.key,
                listener,
                payload_of_root,
            ),
        }
    }
}

/// Rank 0's payload, or why there is none.
fn root_payload<E: fmt::Display>(
    f: impl FnOnce() -> Result<Vec<u8>, E>,
) -> std::result::Result<Vec<u8>, String> {
    let payload = f().map_err(|e| format!("rank 0 could not create the payload: {e}"))?;
    if payload.len() > wire::MAX_PAYLOAD_BYTES {
        return Err(format!(
            "rank 0's payload has {} bytes, at most {} fit in a message",
            payload.len(),
            wire::MAX_PAYLOAD_BYTES
        ));
    }
    Ok(payload)
}

/// A connection whose HELLO answered its challenge under the token, as
/// its handshake thread hands it over.
struct Hello {
    stream: TcpStream,
    peer: SocketAddr,
    rank: u32,
    world_size: u64,
    reader: SessionReader,
    sealer: Sealer,
}

/// A rank that has joined.
struct Joined {
    stream: TcpStream,
    peer: SocketAddr,
    reader: SessionReader,
    sealer: Sealer,
}

/// Rank 0's side.
fn host<E: fmt::Display>(
    launch: &Launch,
    opts: &RendezvousOptions,
    key: JobKey,
    listener: TcpListener,
    payload_of_root: impl FnOnce() -> Result<Vec<u8>, E>,
) -> Result<(Vec<u8>, Membership)> {
    let world = launch.world_size;
    let here = listener
        .local_addr()
        .map_or_else(|_| launch.rendezvous.to_string(), |a| a.to_string());
    listener
        .set_nonblocking(true)
        .map_err(|source| LaunchError::Io {
            what: format!("setting up the rendezvous listener on {here}"),
            error: source,
        })?;
    let deadline = Instant::now() + opts.join_timeout;
    let (tx, rx): (Sender<Hello>, Receiver<Hello>) = mpsc::channel();
    let mut joined: Vec<Option<Joined>> = (0..world).map(|_| None).collect();
    let mut last_accept_error = String::new();
    loop {
        let missing: Vec<usize> = (1..world).filter(|&r| joined[r].is_none()).collect();
        if missing.is_empty() {
            break;
        }
        let now = Instant::now();
        if now >= deadline {
            let why = format!(
                "{} did not join the rendezvous at {here} within {}",
                ranks_phrase(&missing),
                secs(opts.join_timeout)
            );
            abandon(&mut joined, &why);
            return Err(LaunchError::Timeout(why));
        }
        loop {
            match listener.accept() {
                Ok((stream, peer)) => {
                    spawn_handshake(stream, peer, key.clone(), opts, tx.clone());
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    // e.g. out of file descriptors: say it once, keep going.
                    let line = format!("rendezvous: accepting a connection on {here}: {e}");
                    if line != last_accept_error {
                        (opts.log)(&line);
                        last_accept_error = line;
                    }
                    break;
                }
            }
        }
        match rx.recv_timeout(POLL.min(deadline - now)) {
            Ok(hello) => {
                admit(hello, world, &mut joined, opts);
                while let Ok(hello) = rx.try_recv() {
                    admit(hello, world, &mut joined, opts);
                }
            }
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {}
        }
    }
    // Every rank is in: no one else may join, free the port.
    drop(listener);

    let payload = match root_payload(payload_of_root) {
        Ok(p) => p,
        Err(why) => {
            abandon(&mut joined, &why);
            return Err(LaunchError::Aborted(why));
        }
    };
    let mut peers: Vec<Link> = Vec::with_capacity(world - 1);
    for rank in 0..world {
        let Some(mut j) = joined[rank].take() else {
            continue;
        };
        let root = j.sealer.seal(Kind::Root, rank as u32, &payload);
        if let Err(source) = wire::send(&mut j.stream, &root) {
            let why = format!("sending the payload to rank {rank} ({}) failed", j.peer);
            for p in &mut peers {
                let abort = p.sealer.seal(Kind::Abort, rank as u32, wire::clip(&why));
                let _ = wire::send(&mut p.stream, &abort);
            }
            abandon(&mut joined, &why);
            return Err(LaunchError::Io {
                what: why,
                error: source,
            });
        }
        peers.push(Link {
            rank,
            stream: j.stream,
            reader: j.reader,
            sealer: j.sealer,
        });
    }
    let membership = Membership::start(0, world, peers, opts)?;
    Ok((payload, membership))
}

/// Challenges one new connection and reads its HELLO on its own thread,
/// so that a silent or slow stray cannot hold up the real peers; refusals
/// it can decide alone (bad frames, wrong token, a replayed HELLO) it
/// makes and logs itself.
fn spawn_handshake(
    stream: TcpStream,
    peer: SocketAddr,
    key: JobKey,
    opts: &RendezvousOptions,
    tx: Sender<Hello>,
) {
    let timeout = opts.hello_timeout;
    let log = opts.log.clone();
    let spawned = std::thread::Builder::new()
        .name("kruskal-rendezvous-hello".into())
        .spawn(move || match read_hello(stream, peer, &key, timeout) {
            Ok(hello) => {
                // The receiver is gone only when the rendezvous has ended.
                let _ = tx.send(hello);
            }
            Err(reason) => log(&format!("rendezvous: refused {peer}: {reason}")),
        });
    if let Err(e) = spawned {
        (opts.log)(&format!(
            "rendezvous: refused {peer}: no thread to read it: {e}"
        ));
    }
}

/// Rank 0's half of the handshake: a fresh challenge out, a HELLO that
/// answers it under the token back.
fn read_hello(
    mut stream: TcpStream,
    peer: SocketAddr,
    key: &JobKey,
    timeout: Duration,
) -> std::result::Result<Hello, String> {
    // Accepted sockets must block (with timeouts), whatever the listener.
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_nodelay(true))
        .and_then(|()| stream.set_write_timeout(Some(STRAY_WRITE)))
        .map_err(|e| format!("setting up the connection: {e}"))?;
    let deadline = Instant::now() + timeout;
    let challenge = auth::nonce().map_err(|e| format!("making its challenge: {e}"))?;
    wire::send(&mut stream, &wire::plain(Kind::Challenge, 0, &challenge))
        .map_err(|e| format!("sending its challenge: {e}"))?;
    let mut reader = FrameReader::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("said nothing valid within {}", secs(timeout)));
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| format!("setting a read timeout: {e}"))?;
        match reader.read(&mut stream) {
            Ok(frame) if frame.kind == Kind::Hello => {
                return match key.admit(&challenge, &frame) {
                    Ok(admitted) => Ok(Hello {
                        stream,
                        peer,
                        rank: admitted.rank,
                        world_size: admitted.world_size,
                        reader: SessionReader::new(admitted.session.opener),
                        sealer: admitted.session.sealer,
                    }),
                    Err(why) => {
                        refuse(&stream, frame.rank, why);
                        Err(why.into())
                    }
                };
            }
            Ok(frame) => {
                let why = format!("sent {} instead of HELLO", frame.kind.name());
                refuse(&stream, frame.rank, &why);
                return Err(why);
            }
            Err(ReadError::Pending) => {}
            Err(ReadError::Closed) => return Err("closed the connection before HELLO".into()),
            Err(ReadError::Io(e)) => return Err(format!("reading HELLO: {e}")),
            Err(ReadError::Invalid { reason, peer }) => {
                if peer {
                    refuse(&stream, 0, &reason);
                }
                return Err(reason);
            }
        }
    }
}

/// Tells a connection why it is being dropped (best effort), then closes
/// it.
fn refuse(stream: &TcpStream, rank: u32, reason: &str) {
    let _ = wire::send(
        &mut &*stream,
        &wire::plain(Kind::Refuse, rank, wire::clip(reason)),
    );
    let _ = stream.shutdown(Shutdown::Both);
}

/// Rank 0 decides on a well-framed HELLO.
fn admit(hello: Hello, world: usize, joined: &mut [Option<Joined>], opts: &RendezvousOptions) {
    let rank = hello.rank as usize;
    let problem = if hello.world_size != world as u64 {
        Some(format!(
            "rank {rank} has world size {}, rank 0 has {world}",
            hello.world_size
        ))
    } else if rank == 0 || rank >= world {
        Some(format!(
            "rank {rank} is out of range: ranks 1 to {} join rank 0",
            world - 1
        ))
    } else {
        match &joined[rank] {
            Some(earlier) if !is_closed(&earlier.stream) => Some(format!(
                "rank {rank} has already joined from {}",
                earlier.peer
            )),
            Some(earlier) => {
                (opts.log)(&format!(
                    "rendezvous: rank {rank} joins again from {} (its connection from {} closed)",
                    hello.peer, earlier.peer
                ));
                None
            }
            None => None,
        }
    };
    match problem {
        Some(reason) => {
            refuse(&hello.stream, hello.rank, &reason);
            (opts.log)(&format!("rendezvous: refused {}: {reason}", hello.peer));
        }
        None => {
            joined[rank] = Some(Joined {
                stream: hello.stream,
                peer: hello.peer,
                reader: hello.reader,
                sealer: hello.sealer,
            });
        }
    }
}

/// Whether the peer has closed a connection that should be idle (a rank
/// waiting for ROOT sends nothing).
fn is_closed(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let mut byte = [0u8; 1];
    let closed = match stream.peek(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != io::ErrorKind::WouldBlock,
    };
    closed || stream.set_nonblocking(false).is_err()
}

/// Tells every joined rank that the rendezvous is off, and closes.
fn abandon(joined: &mut [Option<Joined>], why: &str) {
    for j in joined.iter_mut().flatten() {
        let abort = j.sealer.seal(Kind::Abort, 0, wire::clip(why));
        let _ = wire::send(&mut j.stream, &abort);
        let _ = j.stream.shutdown(Shutdown::Both);
    }
}

/// Every other rank's side: answers rank 0's challenge with HELLO, then
/// waits for the payload.
fn join(launch: &Launch, opts: &RendezvousOptions, key: &JobKey) -> Result<(Vec<u8>, Membership)> {
    let addr = launch.rendezvous.to_string();
    let me = launch.rank as u32;
    let io = |what: &str| {
        let what = format!("{what} (rendezvous at {addr})");
        move |source| LaunchError::Io {
            what,
            error: source,
        }
    };
    let mut stream = connect(launch, opts.join_timeout)?;
    stream
        .set_nodelay(true)
        .and_then(|()| stream.set_write_timeout(Some(opts.peer_timeout)))
        .map_err(io("setting up the connection to rank 0"))?;

    // One deadline for the challenge and the payload: rank 0 accepts as
    // soon as it listens, but sends the payload only once all have joined.
    let rank0 = FromRank0 {
        addr: &addr,
        me,
        wait: opts.join_timeout + ROOT_GRACE,
        deadline: Instant::now() + opts.join_timeout + ROOT_GRACE,
    };
    let mut frames = FrameReader::new();
    let frame = rank0.next(&mut stream, "its challenge", |s| frames.read(s))?;
    let challenge: Nonce = match frame.kind {
        // The frame reader has checked the length of a challenge.
        Kind::Challenge => frame.payload[..]
            .try_into()
            .unwrap_or([0; auth::NONCE_BYTES]),
        Kind::Refuse => return Err(rank0.refused(launch, &frame)),
        kind => {
            return Err(rank0.protocol(format!(
                "rank 0 sent {} instead of a challenge",
                kind.name()
            )));
        }
    };
    let (hello, session) = key
        .hello(&challenge, me, launch.world_size as u32)
        .map_err(io("answering rank 0's challenge"))?;
    wire::send(&mut stream, &hello).map_err(io("saying HELLO to rank 0"))?;

    let mut reader = SessionReader::new(session.opener);
    let frame = rank0.next(&mut stream, "the payload", |s| reader.read(s))?;
    let payload = match frame.kind {
        Kind::Root if frame.rank == me => frame.payload,
        Kind::Refuse => return Err(rank0.refused(launch, &frame)),
        Kind::Abort => return Err(LaunchError::Aborted(frame.text())),
        kind => {
            return Err(rank0.protocol(format!(
                "rank 0 sent {} (rank {}) instead of this rank's payload",
                kind.name(),
                frame.rank
            )));
        }
    };
    let membership = Membership::start(
        launch.rank,
        launch.world_size,
        vec![Link {
            rank: 0,
            stream,
            reader,
            sealer: session.sealer,
        }],
        opts,
    )?;
    Ok((payload, membership))
}

/// What a joining rank awaits from rank 0, and until when.
struct FromRank0<'a> {
    addr: &'a str,
    me: u32,
    wait: Duration,
    deadline: Instant,
}

impl FromRank0<'_> {
    /// The next frame `read` gets from `stream` before the deadline;
    /// `what` (the awaited message) names it in the errors.
    fn next(
        &self,
        stream: &mut TcpStream,
        what: &str,
        mut read: impl FnMut(&mut TcpStream) -> std::result::Result<Frame, ReadError>,
    ) -> Result<Frame> {
        let addr = self.addr;
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(LaunchError::Timeout(format!(
                    "rank 0 at {addr} did not send {what} within {} of rank {} connecting",
                    secs(self.wait),
                    self.me
                )));
            }
            stream
                .set_read_timeout(Some(left))
                .map_err(|source| LaunchError::Io {
                    what: format!("setting a read timeout (rendezvous at {addr})"),
                    error: source,
                })?;
            match read(stream) {
                Ok(frame) => return Ok(frame),
                Err(ReadError::Pending) => {}
                Err(ReadError::Closed) => {
                    return Err(self.protocol(format!(
                        "rank 0 closed the connection before sending {what}"
                    )));
                }
                Err(ReadError::Io(source)) => {
                    return Err(LaunchError::Io {
                        what: format!("waiting for {what} of rank 0 (rendezvous at {addr})"),
                        error: source,
                    });
                }
                Err(ReadError::Invalid { reason, .. }) => {
                    return Err(self.protocol(format!("rank 0 sent an invalid message: {reason}")));
                }
            }
        }
    }

    fn protocol(&self, message: String) -> LaunchError {
        LaunchError::Protocol {
            addr: self.addr.to_string(),
            message,
        }
    }

    fn refused(&self, launch: &Launch, frame: &Frame) -> LaunchError {
        LaunchError::Refused {
            addr: self.addr.to_string(),
            rank: launch.rank,
            reason: frame.text(),
        }
    }
}

/// Connects to rank 0, retrying with backoff (rank 0 may start later, its
/// host name may not resolve yet) until `timeout`.
fn connect(launch: &Launch, timeout: Duration) -> Result<TcpStream> {
    let target = &launch.rendezvous;
    let deadline = Instant::now() + timeout;
    let mut backoff = Duration::from_millis(20);
    let mut last_error = String::from("no attempt was made");
    loop {
        match (target.host.as_str(), target.port).to_socket_addrs() {
            Ok(addrs) => {
                for addr in addrs {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let attempt = left.min(CONNECT_ATTEMPT).max(Duration::from_millis(1));
                    match TcpStream::connect_timeout(&addr, attempt) {
                        Ok(stream) => return Ok(stream),
                        Err(e) => last_error = format!("{addr}: {e}"),
                    }
                }
            }
            Err(e) => last_error = format!("resolving {}: {e}", target.host),
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(LaunchError::Timeout(format!(
                "rank {} could not reach rank 0 at {target} within {} (last error: \
                 {last_error}); is rank 0 running, is {target} its address, and is the port \
                 open between the hosts?",
                launch.rank,
                secs(timeout)
            )));
        }
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    use super::super::testkit::{self, TOKEN, payload};
    use super::*;

    #[test]
    fn every_rank_gets_the_payload() {
        for n in [2, 3] {
            let (opts, _) = testkit::options();
            let world = testkit::world(n, &opts);
            assert_eq!(world.len(), n);
            for (rank, m) in world.iter().enumerate() {
                assert_eq!((m.rank(), m.world_size()), (rank, n));
                assert_eq!(m.lost(), None);
            }
        }
    }

    #[test]
    fn a_world_of_one_needs_no_network() {
        let (opts, _) = testkit::options();
        let mut launch = testkit::launch(0, 1, 1);
        launch.rendezvous.host = "no-such-host.invalid".into();
        let (got, m) = Rendezvous::run(&launch, &opts, || Ok::<_, String>(payload())).unwrap();
        assert_eq!(got, payload());
        m.barrier(Duration::from_millis(10)).unwrap();
        m.finish().unwrap();
    }

    #[test]
    fn a_short_token_is_refused_however_the_launch_was_made() {
        let (opts, _) = testkit::options();
        let mut launch = testkit::launch(1, 2, 1);
        launch.token = "0123456789abcde".into();
        let e = Rendezvous::bind(&launch, &opts)
            .err()
            .map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.starts_with("the job token has 15 characters, at least 16")),
            "{e:?}"
        );
        launch.token.push('f');
        assert!(Rendezvous::bind(&launch, &opts).is_ok());
    }

    #[test]
    fn a_rank_started_before_rank_0_still_joins() {
        let (mut opts, _) = testkit::options();
        // A free port, released again so that nothing listens on it yet.
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let early = testkit::spawn_rank(1, 2, port, &opts);
        std::thread::sleep(Duration::from_millis(300));
        opts.bind = Some(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
        let (root, _) = testkit::bind_root(2, &opts);
        let (got0, m0) = root.complete(|| Ok::<_, String>(payload())).unwrap();
        let (got1, m1) = early.join().unwrap().unwrap();
        assert_eq!((got0, got1), (payload(), payload()));
        drop((m0, m1));
    }

    /// A stray connects first and sends the bytes `make` gives it
    /// (nothing if empty); the real rank 1 joins after rank 0 has logged
    /// the refusal that contains `logged`.
    fn stray_then_real_peer(
        make: impl FnOnce(&mut TcpStream) -> Vec<u8>,
        logged: &str,
        hello_timeout: Duration,
    ) {
        let (mut opts, log) = testkit::options();
        opts.hello_timeout = hello_timeout;
        let (root, port) = testkit::bind_root(2, &opts);
        let root = testkit::spawn_root(root);
        let mut stray = testkit::raw(port);
        let bytes = make(&mut stray);
        stray.write_all(&bytes).unwrap();
        if !bytes.is_empty() {
            let line = log.wait_for(logged, Duration::from_secs(3));
            let line = line.unwrap_or_else(|| panic!("no refusal in {:?}", log.lines()));
            let here = stray.local_addr().unwrap().to_string();
            assert_eq!(line, format!("rendezvous: refused {here}: {logged}"));
        }
        let start = Instant::now();
        let real = testkit::spawn_rank(1, 2, port, &opts);
        let (got, _m1) = real.join().unwrap().unwrap();
        assert_eq!(got, payload());
        // A silent stray does not hold the real peer up.
        assert!(start.elapsed() < hello_timeout, "{:?}", start.elapsed());
        let (_, _m0) = root.join().unwrap().unwrap();
        if bytes.is_empty() {
            assert!(
                log.wait_for(logged, hello_timeout * 2).is_some(),
                "{:?}",
                log.lines()
            );
        }
        assert!(testkit::closed(&mut stray));
    }

    #[test]
    fn a_wrong_token_is_refused_and_told_why() {
        stray_then_real_peer(
            |s| testkit::hello(&testkit::challenge(s), 1, 2, "not-the-job-token").0,
            "wrong job token",
            Duration::from_secs(2),
        );
        // The refused peer hears why.
        let (opts, _) = testkit::options();
        let (root, port) = testkit::bind_root(2, &opts);
        let _root = testkit::spawn_root(root);
        let (mut stray, _) = testkit::say_hello(port, 1, 2, "not-the-job-token");
        let f = testkit::next_plain(&mut stray);
        assert_eq!(
            (f.kind, f.text().as_str()),
            (Kind::Refuse, "wrong job token")
        );
        // And a real rank with the wrong token gets a clear error.
        let mut launch = testkit::launch(1, 2, port);
        launch.token = "not-the-job-token".into();
        let e = Rendezvous::run(&launch, &opts, || Ok::<_, String>(vec![])).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("rank 0 at 127.0.0.1:{port} refused rank 1: wrong job token")
        );
    }

    #[test]
    fn a_replayed_or_altered_hello_is_refused_and_told_why() {
        let (opts, log) = testkit::options();
        let (root, port) = testkit::bind_root(3, &opts);
        let root = testkit::spawn_root(root);
        // A HELLO captured on the way: a real rank 1 sent it, answering
        // its own connection's challenge (the connection stays open).
        let mut first = testkit::raw(port);
        let (captured, _) = testkit::hello(&testkit::challenge(&mut first), 1, 3, TOKEN);
        first.write_all(&captured).unwrap();

        // Sent again on a new connection: refused, whatever rank it claims.
        let mut replay = testkit::raw(port);
        testkit::challenge(&mut replay);
        replay.write_all(&captured).unwrap();
        let f = testkit::next_plain(&mut replay);
        let why = "its HELLO answers another connection's challenge (a replayed message)";
        assert_eq!((f.kind, f.text().as_str()), (Kind::Refuse, why));
        assert!(testkit::closed(&mut replay));
        let here = replay.local_addr().unwrap();
        let line = log.wait_for(why, Duration::from_secs(1));
        assert_eq!(line, Some(format!("rendezvous: refused {here}: {why}")));

        // With the new challenge patched in, its code no longer verifies.
        let mut forged = testkit::raw(port);
        let challenge = testkit::challenge(&mut forged);
        let mut bytes = captured.clone();
        let echo = wire::HEADER_BYTES + 4;
        bytes[echo..echo + challenge.len()].copy_from_slice(&challenge);
        forged.write_all(&bytes).unwrap();
        let f = testkit::next_plain(&mut forged);
        assert_eq!(
            (f.kind, f.text().as_str()),
            (Kind::Refuse, "wrong job token")
        );

        // Rank 0 is still waiting: the real ranks join, rank 1 again (its
        // first connection gone) before rank 2 completes the world.
        drop(first);
        std::thread::sleep(Duration::from_millis(100));
        let one = testkit::spawn_rank(1, 3, port, &opts);
        let again = log.wait_for("rendezvous: rank 1 joins again", Duration::from_secs(2));
        assert!(again.is_some(), "{:?}", log.lines());
        let two = testkit::spawn_rank(2, 3, port, &opts);
        let (_, _m0) = root.join().unwrap().unwrap();
        for rank in [one, two] {
            assert_eq!(rank.join().unwrap().unwrap().0, payload());
        }
    }

    #[test]
    fn a_rank_answers_only_a_challenge() {
        // Something that is not rank 0 accepts and says ROOT at once.
        let (opts, _) = testkit::options();
        let (mut s, one) = testkit::hand_made_root(&opts);
        let port = s.local_addr().unwrap().port();
        let root = wire::encode(Kind::Root, &[0; 32], 1, b"id");
        wire::send(&mut s, &root).unwrap();
        let e = one.join().unwrap().unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("rendezvous at 127.0.0.1:{port}: rank 0 sent ROOT instead of a challenge")
        );
    }

    #[test]
    fn garbage_is_refused() {
        stray_then_real_peer(
            |_| b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            "not a kruskal rendezvous message (bad magic)",
            Duration::from_secs(2),
        );
    }

    #[test]
    fn an_over_long_length_is_refused() {
        stray_then_real_peer(
            |s| {
                let mut bytes = testkit::hello(&testkit::challenge(s), 1, 2, TOKEN).0;
                bytes[44..48].copy_from_slice(&u32::MAX.to_be_bytes());
                bytes.truncate(wire::HEADER_BYTES);
                bytes
            },
            "a payload of 4294967295 bytes (at most 4096)",
            Duration::from_secs(2),
        );
    }

    #[test]
    fn a_silent_connection_is_dropped() {
        stray_then_real_peer(
            |_| Vec::new(),
            "said nothing valid within 1 s",
            Duration::from_secs(1),
        );
    }

    #[test]
    fn a_trickling_connection_is_dropped_at_the_handshake_deadline() {
        // One byte of a valid header every 300 ms: each read returns
        // bytes, and still the connection is refused when the handshake's
        // time is up (the whole frame's time is bounded, not each read's).
        let (mut opts, log) = testkit::options();
        opts.hello_timeout = Duration::from_secs(1);
        let (root, port) = testkit::bind_root(2, &opts);
        let root = testkit::spawn_root(root);
        let mut stray = testkit::raw(port);
        let start = Instant::now();
        let trickle = std::thread::spawn(move || {
            for &b in wire::MAGIC.iter().chain(&[0u8, 2, 1, 0]).cycle().take(40) {
                if stray.write_all(&[b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        });
        let line = log.wait_for("said nothing valid within 1 s", Duration::from_secs(4));
        assert!(line.is_some(), "{:?}", log.lines());
        assert!(
            start.elapsed() < Duration::from_millis(2500),
            "{:?}",
            start.elapsed()
        );
        let real = testkit::spawn_rank(1, 2, port, &opts);
        assert_eq!(real.join().unwrap().unwrap().0, payload());
        let (_, _m0) = root.join().unwrap().unwrap();
        trickle.join().unwrap();
    }

    #[test]
    fn duplicate_and_out_of_range_ranks_are_refused() {
        let (opts, log) = testkit::options();
        let (root, port) = testkit::bind_root(3, &opts);
        let root = testkit::spawn_root(root);

        // A rank 1 that closes before the rendezvous ends may join again.
        let (gone, _) = testkit::say_hello(port, 1, 3, TOKEN);
        std::thread::sleep(Duration::from_millis(200));
        drop(gone);
        std::thread::sleep(Duration::from_millis(100));
        let first = testkit::spawn_rank(1, 3, port, &opts);
        assert!(
            log.wait_for(
                "rendezvous: rank 1 joins again from 127.0.0.1:",
                Duration::from_secs(2)
            )
            .is_some(),
            "{:?}",
            log.lines()
        );
        // A second live rank 1 is refused.
        let e = testkit::spawn_rank(1, 3, port, &opts)
            .join()
            .unwrap()
            .unwrap_err();
        let e = e.to_string();
        assert!(
            e.starts_with(&format!(
                "rank 0 at 127.0.0.1:{port} refused rank 1: rank 1 has already joined from \
                 127.0.0.1:"
            )),
            "{e}"
        );

        for (rank, world, why) in [
            (5, 3, "rank 5 is out of range: ranks 1 to 2 join rank 0"),
            (0, 3, "rank 0 is out of range: ranks 1 to 2 join rank 0"),
            (2, 4, "rank 2 has world size 4, rank 0 has 3"),
        ] {
            let (mut stray, _) = testkit::say_hello(port, rank, world, TOKEN);
            let f = testkit::next_plain(&mut stray);
            assert_eq!((f.kind, f.text().as_str()), (Kind::Refuse, why));
            assert!(testkit::closed(&mut stray));
            assert!(log.wait_for(why, Duration::from_secs(1)).is_some());
        }

        let last = testkit::spawn_rank(2, 3, port, &opts);
        let (_, _m0) = root.join().unwrap().unwrap();
        assert_eq!(first.join().unwrap().unwrap().0, payload());
        assert_eq!(last.join().unwrap().unwrap().0, payload());
    }

    #[test]
    fn missing_ranks_are_named_within_the_deadline() {
        let (mut opts, _) = testkit::options();
        opts.join_timeout = Duration::from_secs(1);
        let (root, port) = testkit::bind_root(4, &opts);
        let start = Instant::now();
        let root = testkit::spawn_root(root);
        let one = testkit::spawn_rank(1, 4, port, &opts);
        let e = root.join().unwrap().unwrap_err();
        let took = start.elapsed();
        let expected =
            format!("ranks 2, 3 did not join the rendezvous at 127.0.0.1:{port} within 1 s");
        assert_eq!(e.to_string(), format!("timed out: {expected}"));
        assert!(
            took >= Duration::from_secs(1) && took < Duration::from_secs(3),
            "{took:?}"
        );
        // The rank that did join hears it too.
        let e = one.join().unwrap().unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("the rendezvous was abandoned: {expected}")
        );
    }

    #[test]
    fn a_failing_payload_abandons_the_rendezvous() {
        let (opts, _) = testkit::options();
        let (root, port) = testkit::bind_root(2, &opts);
        let root = std::thread::spawn(move || root.complete(|| Err("no NCCL here")));
        let one = testkit::spawn_rank(1, 2, port, &opts);
        let why = "rank 0 could not create the payload: no NCCL here";
        let e = root.join().unwrap().unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("the rendezvous was abandoned: {why}")
        );
        let e = one.join().unwrap().unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("the rendezvous was abandoned: {why}")
        );
    }

    #[test]
    fn an_unreachable_rank_0_times_out_with_its_address() {
        let (mut opts, _) = testkit::options();
        opts.join_timeout = Duration::from_millis(300);
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = testkit::spawn_rank(1, 2, port, &opts)
            .join()
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!(
                "timed out: rank 1 could not reach rank 0 at 127.0.0.1:{port} within 0.3 s \
                 (last error: 127.0.0.1:{port}: "
            )),
            "{e}"
        );
    }
}
