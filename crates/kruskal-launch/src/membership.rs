//! After the rendezvous: the same connections, kept open as a liveness
//! channel (failure model in the [crate] doc).
//!
//! Each side runs one heartbeat thread and one reader thread per
//! connection (rank 0: one per other rank; the others: one, to rank 0).
//! The first loss wins: it is recorded, relayed by rank 0 as ABORT, and
//! runs the registered callbacks once; later ones are ignored.

use std::fmt;
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::auth::Sealer;
use super::rendezvous::RendezvousOptions;
use super::wire::{self, Kind, ReadError, SessionReader};
use super::{LaunchError, LogFn, Result, lock, ranks_phrase, secs};

/// A rank that is gone, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lost {
    pub rank: usize,
    pub reason: String,
}

impl fmt::Display for Lost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} was lost: {}", self.rank, self.reason)
    }
}

/// How much longer than rank 0 the other ranks wait in
/// [`Membership::finish`], so that rank 0's verdict reaches them.
const FINISH_GRACE: Duration = Duration::from_secs(5);

/// Run once when a loss is first seen.
pub type LossCallback = Box<dyn FnOnce(&Lost) + Send>;

/// The other ranks of a job, watched for the rest of the run. Dropping it
/// without [`Membership::finish`] closes the connections: the peers see
/// this rank as lost, which is what a crash looks like too.
pub struct Membership {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

struct Inner {
    me: usize,
    world: usize,
    heartbeat: Duration,
    peer_timeout: Duration,
    finish_timeout: Duration,
    log: LogFn,
    peers: Vec<Peer>,
    lost: OnceLock<Lost>,
    on_loss: Mutex<Vec<LossCallback>>,
    state: Mutex<State>,
    changed: Condvar,
    /// One barrier at a time per process.
    barrier: Mutex<()>,
}

struct Peer {
    rank: usize,
    out: Mutex<Outgoing>,
    /// The same socket, to shut down without waiting for a blocked write.
    socket: TcpStream,
}

struct Outgoing {
    stream: TcpStream,
    /// Seals the frames to this peer, in the order they go out.
    sealer: Sealer,
    /// False once GOODBYE or ABORT has gone out: nothing follows them.
    open: bool,
}

struct State {
    stopped: bool,
    /// Per rank, whether it has said GOODBYE (on a rank other than 0,
    /// entry 0 is rank 0's final GOODBYE).
    goodbye: Vec<bool>,
    /// Per rank, the last barrier generation heard from it.
    barrier: Vec<u64>,
    /// This process's last barrier generation.
    generation: u64,
}

/// One connection after its handshake, as the rendezvous hands it over.
pub(crate) struct Link {
    /// The rank at the other end.
    pub rank: usize,
    pub stream: TcpStream,
    pub reader: SessionReader,
    pub sealer: Sealer,
}

impl Membership {
    /// Starts watching `peers` from rank `me` of `world`.
    pub(crate) fn start(
        me: usize,
        world: usize,
        peers: Vec<Link>,
        opts: &RendezvousOptions,
    ) -> Result<Membership> {
        let io = |what: &'static str| {
            move |source| LaunchError::Io {
                what: what.into(),
                error: source,
            }
        };
        let mut readers = Vec::with_capacity(peers.len());
        let mut out = Vec::with_capacity(peers.len());
        for Link {
            rank,
            stream,
            reader,
            sealer,
        } in peers
        {
            // Writes that cannot go out within half the peer timeout mean
            // the peer is not reading: better lost than a blocked thread.
            stream
                .set_write_timeout(Some((opts.peer_timeout / 2).max(Duration::from_millis(1))))
                .map_err(io("setting a write timeout"))?;
            let clone = || {
                stream
                    .try_clone()
                    .map_err(io("cloning a membership connection"))
            };
            let (writer, socket) = (clone()?, clone()?);
            readers.push((rank, stream, reader));
            out.push(Peer {
                rank,
                out: Mutex::new(Outgoing {
                    stream: writer,
                    sealer,
                    open: true,
                }),
                socket,
            });
        }
        let inner = Arc::new(Inner {
            me,
            world,
            heartbeat: opts.heartbeat.max(Duration::from_millis(1)),
            peer_timeout: opts.peer_timeout,
            finish_timeout: opts.finish_timeout,
            log: opts.log.clone(),
            peers: out,
            lost: OnceLock::new(),
            on_loss: Mutex::new(Vec::new()),
            state: Mutex::new(State {
                stopped: false,
                goodbye: vec![false; world],
                barrier: vec![0; world],
                generation: 0,
            }),
            changed: Condvar::new(),
            barrier: Mutex::new(()),
        });
        let mut membership = Membership {
            inner: inner.clone(),
            threads: Vec::new(),
        };
        if inner.peers.is_empty() {
            return Ok(membership);
        }
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(io("starting a membership thread"))
        };
        for (rank, stream, reader) in readers {
            let inner = inner.clone();
            let t = spawn(
                format!("kruskal-watch-{rank}"),
                Box::new(move || read_loop(&inner, rank, stream, reader)),
            )?;
            membership.threads.push(t);
        }
        let beat = inner.clone();
        let t = spawn(
            "kruskal-heartbeat".into(),
            Box::new(move || beat_loop(&beat)),
        )?;
        membership.threads.push(t);
        Ok(membership)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.me
    }

    pub fn world_size(&self) -> usize {
        self.inner.world
    }

    /// The first loss seen, if any (cheap: for polling).
    pub fn lost(&self) -> Option<Lost> {
        self.inner.lost.get().cloned()
    }

    /// Runs `callback` once when the first loss is seen, on the thread that
    /// sees it (at once, on this thread, if a rank is already lost). Meant
    /// to abort the NCCL communicator so that blocked collectives return;
    /// it should not block for long.
    pub fn on_loss(&self, callback: LossCallback) {
        let mut callbacks = lock(&self.inner.on_loss);
        match self.inner.lost.get() {
            Some(lost) => {
                drop(callbacks);
                callback(lost);
            }
            None => callbacks.push(callback),
        }
    }

    /// Gives up on the run from this rank, telling the others why: they
    /// see this rank lost with `reason`. Runs this process's loss callbacks
    /// too.
    pub fn abort(&self, reason: &str) {
        let inner = &self.inner;
        let lost = Lost {
            rank: inner.me,
            reason: format!("aborted: {reason}"),
        };
        // Recorded before the frame goes out: rank 0's relay of this very
        // abort may come back before this thread runs on.
        let recorded = inner.record(&lost);
        if inner.me != 0 {
            for p in &inner.peers {
                let _ = p.send_last(Kind::Abort, inner.me, wire::clip(reason));
            }
        }
        if recorded {
            inner.announce(&lost);
        }
    }

    /// Waits until every rank has called `barrier` as often as this one
    /// (all meet through rank 0), up to `timeout`. Fails at once when a
    /// rank is lost.
    pub fn barrier(&self, timeout: Duration) -> Result<()> {
        let inner = &self.inner;
        if inner.peers.is_empty() {
            return Ok(());
        }
        let _one_at_a_time = lock(&inner.barrier);
        let generation = {
            let mut s = lock(&inner.state);
            s.generation += 1;
            s.generation
        };
        let payload = generation.to_be_bytes();
        let deadline = Instant::now() + timeout;
        if inner.me != 0 {
            let rank0 = &inner.peers[0];
            rank0
                .send(Kind::Barrier, inner.me, &payload)
                .map_err(|e| inner.loss_error(0, format!("sending to it failed: {e}")))?;
            inner
                .wait_until(deadline, |s| s.barrier[0] >= generation)
                .map_err(|e| match e {
                    LaunchError::Timeout(_) => LaunchError::Timeout(format!(
                        "rank 0 did not release barrier {generation} within {}",
                        secs(timeout)
                    )),
                    e => e,
                })
        } else {
            let late = inner.wait_until(deadline, |s| {
                (1..inner.world).all(|r| s.barrier[r] >= generation)
            });
            if let Err(LaunchError::Timeout(_)) = late {
                let s = lock(&inner.state);
                let missing: Vec<usize> = (1..inner.world)
                    .filter(|&r| s.barrier[r] < generation)
                    .collect();
                return Err(LaunchError::Timeout(format!(
                    "{} did not reach barrier {generation} within {}",
                    ranks_phrase(&missing),
                    secs(timeout)
                )));
            }
            late?;
            for p in &inner.peers {
                p.send(Kind::Barrier, 0, &payload)
                    .map_err(|e| inner.loss_error(p.rank, format!("sending to it failed: {e}")))?;
            }
            Ok(())
        }
    }

    /// The clean end of the run: says GOODBYE; rank 0 waits until every
    /// rank has, then answers each, the others wait for that answer (up to
    /// [`RendezvousOptions::finish_timeout`]). When it returns `Ok` on rank
    /// 0, every rank has finished. Closes the connections either way.
    pub fn finish(self) -> Result<()> {
        let result = self.say_goodbye();
        let mut this = self;
        let clean = result.is_ok();
        this.close();
        if clean {
            // The readers end on the closed sockets, the heartbeat thread
            // on the stop flag: this is quick.
            for t in this.threads.drain(..) {
                let _ = t.join();
            }
        }
        result
    }

    fn say_goodbye(&self) -> Result<()> {
        let inner = &self.inner;
        if let Some(lost) = inner.lost.get() {
            return Err(LaunchError::Lost(lost.clone()));
        }
        if inner.peers.is_empty() {
            return Ok(());
        }
        let start = Instant::now();
        if inner.me != 0 {
            // Rank 0 gives up first and says which rank it waited for.
            let deadline = start + inner.finish_timeout + FINISH_GRACE;
            inner.peers[0]
                .send_last(Kind::Goodbye, inner.me, &[])
                .map_err(|e| inner.loss_error(0, format!("saying GOODBYE failed: {e}")))?;
            inner
                .wait_until(deadline, |s| s.goodbye[0])
                .map_err(|e| match e {
                    LaunchError::Timeout(_) => LaunchError::Timeout(format!(
                        "rank 0 did not confirm the end of the run within {}",
                        secs(inner.finish_timeout + FINISH_GRACE)
                    )),
                    e => e,
                })
        } else {
            let deadline = start + inner.finish_timeout;
            match inner.wait_until(deadline, |s| s.goodbye[1..].iter().all(|&g| g)) {
                Ok(()) => {}
                Err(LaunchError::Timeout(_)) => {
                    let missing: Vec<usize> = {
                        let s = lock(&inner.state);
                        (1..inner.world).filter(|&r| !s.goodbye[r]).collect()
                    };
                    // (Unless the last GOODBYE came just after the deadline.)
                    if let Some(&first) = missing.first() {
                        let why = format!(
                            "{} did not finish within {} of rank 0",
                            ranks_phrase(&missing),
                            secs(inner.finish_timeout)
                        );
                        // The ranks that did finish learn who held them up.
                        inner.fire(Lost {
                            rank: first,
                            reason: why.clone(),
                        });
                        return Err(LaunchError::Timeout(why));
                    }
                }
                Err(e) => return Err(e),
            }
            for p in &inner.peers {
                if let Err(e) = p.send_last(Kind::Goodbye, 0, &[]) {
                    // That rank has finished; it will report rank 0 lost.
                    (inner.log)(&format!(
                        "membership: the final GOODBYE to rank {} failed: {e}",
                        p.rank
                    ));
                }
            }
            Ok(())
        }
    }

    /// Stops the threads and closes the connections (the peers see EOF).
    fn close(&mut self) {
        let inner = &self.inner;
        lock(&inner.state).stopped = true;
        inner.changed.notify_all();
        for p in &inner.peers {
            let _ = p.socket.shutdown(Shutdown::Both);
        }
    }
}

impl fmt::Debug for Membership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Membership")
            .field("rank", &self.inner.me)
            .field("world_size", &self.inner.world)
            .field("lost", &self.inner.lost.get())
            .finish_non_exhaustive()
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        // After finish this repeats harmless steps; the threads are not
        // joined here (a loss callback may be running on one of them).
        self.close();
    }
}

impl Peer {
    /// Sends a frame unless GOODBYE or ABORT has already gone out.
    fn send(&self, kind: Kind, rank: usize, payload: &[u8]) -> std::io::Result<()> {
        self.send_then(kind, rank, payload, true)
    }

    /// Sends a frame that ends this side of the conversation.
    fn send_last(&self, kind: Kind, rank: usize, payload: &[u8]) -> std::io::Result<()> {
        self.send_then(kind, rank, payload, false)
    }

    /// Seals and sends a frame under the lock (so frames leave in the
    /// order of their sequence numbers), leaving the conversation `open`
    /// or not.
    fn send_then(
        &self,
        kind: Kind,
        rank: usize,
        payload: &[u8],
        open: bool,
    ) -> std::io::Result<()> {
        let mut out = lock(&self.out);
        if !out.open {
            return Ok(());
        }
        out.open = open;
        let frame = out.sealer.seal(kind, rank as u32, payload);
        wire::send(&mut out.stream, &frame)
    }
}

impl Inner {
    /// Records `lost` unless a loss is already known or the membership has
    /// stopped; rank 0 relays it; the callbacks run.
    fn fire(&self, lost: Lost) {
        if self.record(&lost) {
            self.announce(&lost);
        }
    }

    /// Records `lost` as this membership's loss and wakes the waiters;
    /// false when a loss is already known or the membership has stopped.
    fn record(&self, lost: &Lost) -> bool {
        if lock(&self.state).stopped {
            return false;
        }
        if self.lost.set(lost.clone()).is_err() {
            return false;
        }
        // A rank that gives up the run itself is not "lost" to itself.
        let line = if lost.rank == self.me {
            format!(
                "membership (rank {}): this rank stops the job ({})",
                self.me, lost.reason
            )
        } else {
            format!("membership (rank {}): {lost}", self.me)
        };
        (self.log)(&line);
        // Taking the lock orders this after any waiter's check of `lost`.
        drop(lock(&self.state));
        self.changed.notify_all();
        true
    }

    /// What follows a recorded loss: rank 0 relays it, the callbacks run.
    fn announce(&self, lost: &Lost) {
        let relay = format!("{} (seen by rank 0)", lost.reason);
        let relay = wire::clip(&relay);
        if self.me == 0 {
            for p in self.peers.iter().filter(|p| p.rank != lost.rank) {
                let _ = p.send_last(Kind::Abort, lost.rank, relay);
            }
        }
        let callbacks = std::mem::take(&mut *lock(&self.on_loss));
        for callback in callbacks {
            callback(lost);
        }
        // Last, as it may be the slow one: tell the lost rank, in case it
        // is alive but cut off or hung.
        if self.me == 0 {
            for p in self.peers.iter().filter(|p| p.rank == lost.rank) {
                let _ = p.send_last(Kind::Abort, lost.rank, relay);
            }
        }
    }

    /// The connection to `peer` failed: a loss, unless that peer has
    /// already said GOODBYE (or we are stopping).
    fn peer_failed(&self, peer: usize, reason: String) {
        {
            let s = lock(&self.state);
            if s.stopped || s.goodbye[peer] {
                return;
            }
        }
        self.fire(Lost { rank: peer, reason });
    }

    /// Records and returns a loss found by this thread.
    fn loss_error(&self, peer: usize, reason: String) -> LaunchError {
        self.peer_failed(peer, reason.clone());
        LaunchError::Lost(
            self.lost
                .get()
                .cloned()
                .unwrap_or(Lost { rank: peer, reason }),
        )
    }

    /// Waits until `done(state)`, a loss, the end of the membership or
    /// `deadline`, whichever comes first.
    fn wait_until(&self, deadline: Instant, done: impl Fn(&State) -> bool) -> Result<()> {
        let mut s: MutexGuard<'_, State> = lock(&self.state);
        loop {
            if let Some(lost) = self.lost.get() {
                return Err(LaunchError::Lost(lost.clone()));
            }
            if done(&s) {
                return Ok(());
            }
            if s.stopped {
                return Err(LaunchError::Aborted("the membership has ended".into()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(LaunchError::Timeout(String::new()));
            }
            s = self
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Handles one frame from `peer`; false when reading should stop.
    fn handle(&self, peer: usize, frame: wire::Frame) -> bool {
        let claimed = frame.rank as usize;
        let invalid = |why: String| {
            self.peer_failed(peer, format!("sent an invalid message: {why}"));
            false
        };
        if frame.kind != Kind::Abort && claimed != peer {
            return invalid(format!("{} as rank {claimed}", frame.kind.name()));
        }
        match frame.kind {
            Kind::Heartbeat => true,
            Kind::Goodbye => {
                lock(&self.state).goodbye[peer] = true;
                self.changed.notify_all();
                // Rank 0's GOODBYE is its last word; rank 0 keeps reading
                // until the peer closes, and ignores that close.
                self.me == 0
            }
            Kind::Abort if self.me == 0 => {
                if claimed != peer {
                    return invalid(format!("ABORT naming rank {claimed}"));
                }
                self.fire(Lost {
                    rank: peer,
                    reason: format!("aborted: {}", frame.text()),
                });
                false
            }
            Kind::Abort => {
                if claimed >= self.world {
                    return invalid(format!("ABORT naming rank {claimed}"));
                }
                self.fire(Lost {
                    rank: claimed,
                    reason: frame.text(),
                });
                false
            }
            Kind::Barrier => {
                let generation = frame.number();
                let mut s = lock(&self.state);
                if generation != s.barrier[peer] + 1 {
                    let expected = s.barrier[peer] + 1;
                    drop(s);
                    return invalid(format!("barrier {generation}, expected {expected}"));
                }
                s.barrier[peer] = generation;
                drop(s);
                self.changed.notify_all();
                true
            }
            Kind::Hello | Kind::Root | Kind::Refuse | Kind::Challenge => {
                invalid(format!("{} after the rendezvous", frame.kind.name()))
            }
        }
    }
}

/// Reads `peer`'s frames until the connection ends, a loss, or the stop.
fn read_loop(inner: &Inner, peer: usize, mut stream: TcpStream, mut reader: SessionReader) {
    // Wake up often enough to notice silence and the stop flag.
    let tick = (inner.heartbeat / 2).clamp(Duration::from_millis(5), Duration::from_millis(500));
    if let Err(e) = stream.set_read_timeout(Some(tick)) {
        inner.peer_failed(peer, format!("setting a read timeout failed: {e}"));
        return;
    }
    let mut last_heard = Instant::now();
    loop {
        if lock(&inner.state).stopped {
            return;
        }
        match reader.read(&mut stream) {
            Ok(frame) => {
                last_heard = Instant::now();
                if !inner.handle(peer, frame) {
                    return;
                }
            }
            Err(ReadError::Pending) => {
                let silent = last_heard.elapsed();
                if silent > inner.peer_timeout {
                    // Ignored (and the reading ends) if it said GOODBYE.
                    inner.peer_failed(
                        peer,
                        format!("no heartbeat for {} (hung, or cut off)", secs(silent)),
                    );
                    return;
                }
            }
            Err(ReadError::Closed) => {
                inner.peer_failed(peer, "closed its connection without saying GOODBYE".into());
                return;
            }
            Err(ReadError::Io(e)) => {
                inner.peer_failed(peer, format!("its connection failed: {e}"));
                return;
            }
            Err(ReadError::Invalid { reason, .. }) => {
                inner.peer_failed(peer, format!("sent an invalid message: {reason}"));
                return;
            }
        }
    }
}

/// Sends HEARTBEAT to every peer every interval until the stop.
fn beat_loop(inner: &Inner) {
    loop {
        for p in &inner.peers {
            if let Err(e) = p.send(Kind::Heartbeat, inner.me, &[]) {
                inner.peer_failed(p.rank, format!("sending a heartbeat failed: {e}"));
            }
        }
        let s = lock(&inner.state);
        let (s, _) = inner
            .changed
            .wait_timeout_while(s, inner.heartbeat, |s| !s.stopped)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if s.stopped {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::super::testkit::{self, eventually};
    use super::super::wire;
    use super::*;

    /// Generous bound on how long a loss takes to reach everyone in these
    /// tests (peer timeout 0.6 s, heartbeats every 50 ms).
    const SOON: Duration = Duration::from_secs(3);

    fn lost_soon(m: &Membership) -> Lost {
        eventually(SOON, || m.lost()).unwrap_or_else(|| panic!("rank {} saw no loss", m.rank()))
    }

    /// Counts the callback's calls and keeps the last loss it saw.
    fn counting(m: &Membership) -> Arc<(AtomicUsize, Mutex<Option<Lost>>)> {
        let seen = Arc::new((AtomicUsize::new(0), Mutex::new(None)));
        let s = seen.clone();
        m.on_loss(Box::new(move |lost| {
            s.0.fetch_add(1, Ordering::SeqCst);
            *lock(&s.1) = Some(lost.clone());
        }));
        seen
    }

    #[test]
    fn a_clean_finish_reports_no_loss() {
        let (opts, log) = testkit::options();
        let world = testkit::world(3, &opts);
        // Several heartbeat intervals pass without a loss.
        std::thread::sleep(Duration::from_millis(300));
        let seen: Vec<_> = world.iter().map(counting).collect();
        let threads: Vec<_> = world
            .into_iter()
            .map(|m| std::thread::spawn(move || m.finish()))
            .collect();
        for t in threads {
            t.join().unwrap().unwrap();
        }
        std::thread::sleep(Duration::from_millis(200));
        for s in seen {
            assert_eq!(s.0.load(Ordering::SeqCst), 0);
        }
        assert!(log.lines().is_empty(), "{:?}", log.lines());
    }

    #[test]
    fn a_dropped_rank_is_named_on_every_rank() {
        let (opts, _) = testkit::options();
        let mut world = testkit::world(3, &opts);
        let seen0 = counting(&world[0]);
        let seen2 = counting(&world[2]);
        let start = Instant::now();
        drop(world.remove(1));
        let at0 = lost_soon(&world[0]);
        assert_eq!(
            at0,
            Lost {
                rank: 1,
                reason: "closed its connection without saying GOODBYE".into()
            }
        );
        let at2 = lost_soon(&world[1]);
        assert_eq!(
            at2.to_string(),
            "rank 1 was lost: closed its connection without saying GOODBYE (seen by rank 0)"
        );
        // A closed connection is seen at once, not after the peer timeout.
        assert!(start.elapsed() < opts.peer_timeout, "{:?}", start.elapsed());
        // The callbacks ran once each, with the same rank.
        let called = |s: &Arc<(AtomicUsize, Mutex<Option<Lost>>)>| {
            eventually(SOON, || (s.0.load(Ordering::SeqCst) > 0).then_some(()));
            std::thread::sleep(Duration::from_millis(100));
            (
                s.0.load(Ordering::SeqCst),
                lock(&s.1).as_ref().map(|l| l.rank),
            )
        };
        assert_eq!(called(&seen0), (1, Some(1)));
        assert_eq!(called(&seen2), (1, Some(1)));
        // A callback registered after the loss runs at once.
        let late = counting(&world[0]);
        assert_eq!(late.0.load(Ordering::SeqCst), 1);
        // Finishing after a loss reports it.
        let e = world.remove(0).finish().unwrap_err();
        assert_eq!(e.to_string(), at0.to_string());
    }

    #[test]
    fn losing_rank_0_names_rank_0() {
        let (opts, _) = testkit::options();
        let mut world = testkit::world(3, &opts);
        drop(world.remove(0));
        for m in &world {
            let lost = lost_soon(m);
            assert_eq!(lost.rank, 0);
            assert_eq!(lost.reason, "closed its connection without saying GOODBYE");
        }
    }

    #[test]
    fn a_silent_rank_is_lost_after_the_peer_timeout() {
        // Rank 2 is hand-made: it joins, then says nothing but keeps its
        // connection open (a hung process).
        let (opts, _) = testkit::options();
        let (world, mut hung, mut session) = testkit::world_with_hand_made_last(3, &opts);
        let (m0, m1) = (&world[0], &world[1]);
        let start = Instant::now();
        let lost = lost_soon(m0);
        let took = start.elapsed();
        assert_eq!(lost.rank, 2);
        assert!(
            lost.reason.starts_with("no heartbeat for "),
            "{}",
            lost.reason
        );
        assert!(took >= opts.peer_timeout / 2 && took < SOON, "{took:?}");
        assert_eq!(lost_soon(m1).rank, 2);
        // The hung rank is told too, should it wake up.
        let abort = eventually(SOON, || {
            let f = testkit::next_frame(&mut hung, &mut session);
            (f.kind == Kind::Abort).then_some(f)
        })
        .unwrap();
        assert_eq!(abort.rank, 2);
    }

    #[test]
    fn a_silent_rank_0_is_lost_after_the_peer_timeout() {
        // Rank 0 is hand-made: it hands out the payload, then hangs.
        let (opts, _) = testkit::options();
        let (mut hung, one) = testkit::hand_made_root(&opts);
        let mut hello = testkit::challenge_and_admit(&mut hung);
        assert_eq!((hello.rank, hello.world_size), (1, 2));
        let root = hello.session.sealer.seal(Kind::Root, 1, b"id");
        wire::send(&mut hung, &root).unwrap();
        let (got, m1) = one.join().unwrap().unwrap();
        assert_eq!(got, b"id");
        let lost = lost_soon(&m1);
        assert_eq!(lost.rank, 0);
        assert!(
            lost.reason.starts_with("no heartbeat for "),
            "{}",
            lost.reason
        );
    }

    #[test]
    fn a_replayed_frame_loses_its_sender() {
        // Rank 2 is hand-made: it joins, sends one good heartbeat, then
        // the same heartbeat again (as someone replaying it would).
        let (opts, _) = testkit::options();
        let (world, mut two, mut session) = testkit::world_with_hand_made_last(3, &opts);
        let beat = session.sealer.seal(Kind::Heartbeat, 2, &[]);
        two.write_all(&beat).unwrap();
        two.write_all(&beat).unwrap();
        let lost = lost_soon(&world[0]);
        assert_eq!(
            lost.to_string(),
            "rank 2 was lost: sent an invalid message: its authentication code does not match \
             (a forged message, or one replayed from another connection or out of order)"
        );
        assert_eq!(lost_soon(&world[1]).rank, 2);
    }

    #[test]
    fn a_frame_sealed_under_another_token_loses_its_sender() {
        // Rank 1 is hand-made with the right token for the handshake, then
        // seals a frame with a session of another job.
        let (opts, _) = testkit::options();
        let (world, mut one, _) = testkit::world_with_hand_made_last(2, &opts);
        let mut other = testkit::hello(&[1; 32], 1, 2, "another-job-token").1;
        let forged = other.sealer.seal(Kind::Abort, 1, b"forged");
        one.write_all(&forged).unwrap();
        let lost = lost_soon(&world[0]);
        assert_eq!(lost.rank, 1);
        assert!(
            lost.reason
                .starts_with("sent an invalid message: its authentication code does not match"),
            "{}",
            lost.reason
        );
    }

    #[test]
    fn an_abort_names_the_aborting_rank() {
        let (opts, log) = testkit::options();
        let world = testkit::world(3, &opts);
        world[2].abort("CUDA error 700");
        // The aborting rank says it stops the job, not that it was lost.
        let own = log.wait_for("membership (rank 2):", Duration::from_secs(2));
        assert_eq!(
            own.as_deref(),
            Some("membership (rank 2): this rank stops the job (aborted: CUDA error 700)")
        );
        assert_eq!(
            lost_soon(&world[2]),
            Lost {
                rank: 2,
                reason: "aborted: CUDA error 700".into()
            }
        );
        assert_eq!(
            lost_soon(&world[0]).to_string(),
            "rank 2 was lost: aborted: CUDA error 700"
        );
        assert_eq!(
            lost_soon(&world[1]).to_string(),
            "rank 2 was lost: aborted: CUDA error 700 (seen by rank 0)"
        );
        // Rank 0 can abort everyone too.
        let world = testkit::world(2, &opts);
        world[0].abort("out of memory");
        assert_eq!(
            lost_soon(&world[1]).to_string(),
            "rank 0 was lost: aborted: out of memory (seen by rank 0)"
        );
    }

    #[test]
    fn barriers_meet_and_time_out_with_names() {
        let (opts, _) = testkit::options();
        let world = testkit::world(3, &opts);
        let world: Vec<Arc<Membership>> = world.into_iter().map(Arc::new).collect();
        for _ in 0..2 {
            let threads: Vec<_> = world
                .iter()
                .map(|m| {
                    let m = m.clone();
                    std::thread::spawn(move || m.barrier(Duration::from_secs(2)))
                })
                .collect();
            for t in threads {
                t.join().unwrap().unwrap();
            }
        }
        // Rank 2 does not come to the third.
        let one = {
            let m = world[1].clone();
            std::thread::spawn(move || m.barrier(Duration::from_millis(400)))
        };
        let e = world[0].barrier(Duration::from_millis(300)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "timed out: rank 2 did not reach barrier 3 within 0.3 s"
        );
        let e = one.join().unwrap().unwrap_err();
        assert_eq!(
            e.to_string(),
            "timed out: rank 0 did not release barrier 3 within 0.4 s"
        );
        assert_eq!(world[0].lost(), None);
    }

    #[test]
    fn finish_names_the_ranks_that_did_not_finish() {
        let (mut opts, _) = testkit::options();
        opts.finish_timeout = Duration::from_millis(500);
        let mut world = testkit::world(3, &opts);
        let _busy = world.remove(2);
        let one = world.remove(1);
        let one = std::thread::spawn(move || one.finish());
        let e = world.remove(0).finish().unwrap_err();
        assert_eq!(
            e.to_string(),
            "timed out: rank 2 did not finish within 0.5 s of rank 0"
        );
        // Rank 1 said GOODBYE and hears from rank 0 whom it waited for.
        let e = one.join().unwrap().unwrap_err();
        assert_eq!(
            e.to_string(),
            "rank 2 was lost: rank 2 did not finish within 0.5 s of rank 0 (seen by rank 0)"
        );
    }

    #[test]
    fn a_rank_that_said_goodbye_may_leave() {
        // Rank 1 finishes while rank 0 is still busy, then its process
        // exits before rank 0's answer: not a loss for rank 0.
        let (opts, _) = testkit::options();
        let mut world = testkit::world(2, &opts);
        let one = world.remove(1);
        let one = std::thread::spawn(move || {
            // Stands for rank 1's finish racing its own exit.
            one.inner.peers[0].send_last(Kind::Goodbye, 1, &[]).unwrap();
            drop(one);
        });
        one.join().unwrap();
        std::thread::sleep(opts.peer_timeout + Duration::from_millis(200));
        assert_eq!(world[0].lost(), None);
        world.remove(0).finish().unwrap();
    }
}
