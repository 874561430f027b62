//! The watchdog: one thread per communicator that watches every rank through the
//! bootstrap's connections and spreads failures, so that no rank waits for ever.
//!
//! Those connections are, up to `OXCCL_BOOTSTRAP_RELAY_MAX` ranks, the rendezvous's (a star
//! around rank 0), above it the exchange links of Bruck's allgather (a graph: each rank
//! linked to the ranks at distances 1, 2, 4, ... both ways, `2 ceil(log2 n)` connections,
//! rank 0 included; see `bootstrap/mesh.rs`). After init they carry only small control
//! frames, never collective data, so nothing here can interleave with a call's bytes:
//!
//! - heartbeats, both ways (in a graph only over the ring of ranks ±1), every
//!   [`Config::heartbeat`](crate::Config::heartbeat)`/8`: a rank that sends nothing for
//!   `heartbeat` (host gone, link cut without a FIN, process stopped) is lost; a closed
//!   connection (process exited or killed) is lost at once;
//! - failure reports: a rank whose call fails (a mismatch, a timeout, a lost peer, an abort)
//!   tells its peers; in a star rank 0 tells every other rank and reports the ranks it
//!   loses; in a graph every rank passes each failure on once and reports the ranks it
//!   loses, so that it floods the graph;
//! - goodbyes: a rank that drops its communicator says so and is not reported as lost; the
//!   hub of a star hands over to the lowest rank it still watches ([`Frame::Handover`]): that
//!   rank accepts the others' connections on its control listener (opened at init,
//!   [`Handoff`]; an acceptor thread, `net::accept`), the others dial it
//!   (`net::dial`), and the star goes on around it (see
//!   `fault::watchdog`).
//!
//! Whatever arrives marks the communicator's [`Health`] failed, which wakes a blocked call
//! and makes the next call fail at once. Every write is non-blocking (`MSG_DONTWAIT`): a
//! peer that stops reading is lost, never waited for.
//!
//! The frames are in `fault::frame`; every decision (when a peer is lost, what to
//! pass on, what to report) is `fault::watchdog::Watch`'s, driven by this module's
//! thread, which owns the sockets and the clock.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::net::{RecvFlags, SendFlags};

use crate::base::error::Error;
pub use crate::fault::frame::{Frame, MAX_FRAME};
use crate::fault::health::Health;
pub use crate::fault::watchdog::WatchSettings;
use crate::fault::watchdog::{report_frame, Handover, Watch};
use crate::net::accept::{self, Keys};
use crate::net::auth::{self, Deadlined, Hello, Purpose, Verdict};
use crate::net::dial::Dial;

/// How long a rank leaving its communicator tries to reach a new hub to say goodbye to it.
const LEAVING_DIAL: Duration = Duration::from_millis(300);
/// A new hub that refuses connections this long is gone (it left too, or died).
const REFUSED_LIMIT: Duration = Duration::from_millis(300);
/// How long a new hub may take to answer when heartbeats are not required.
pub const DEFAULT_ANSWER: Duration = Duration::from_secs(10);

/// What a rank of a star needs for a handover of the hub (see the module documentation).
#[derive(Debug)]
pub struct Handoff {
    /// This rank's control listener, where it accepts the others once it is the hub.
    pub listener: Option<TcpListener>,
    /// Every rank's control listener (port 0: it has none).
    pub addrs: Vec<SocketAddr>,
    /// The communicator's secret (connections are authenticated as the rendezvous's).
    pub secret: [u8; 16],
    /// The communicator's tag.
    pub tag: u64,
    /// How long a new hub may take to answer a dial before it is lost (the heartbeat
    /// timeout: a stopped rank is lost after it anyway).
    pub answer_within: Duration,
}

struct Shared {
    rank: usize,
    health: Arc<Health>,
    outbox: Mutex<Vec<Frame>>,
    stop: AtomicBool,
    wake: Option<OwnedFd>,
}

impl Shared {
    fn poke(&self) {
        if let Some(fd) = &self.wake {
            let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
        }
    }
}

/// A communicator's watchdog thread; see the module documentation. Dropping it says goodbye
/// to the peers and joins the thread (promptly: nothing it does blocks).
pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog")
            .field("rank", &self.shared.rank)
            .finish_non_exhaustive()
    }
}

impl Watchdog {
    /// Starts watching. `conns` are the bootstrap's connections, each with its peer's rank
    /// and whether heartbeats go over it: in a star (`graph` false) for rank 0 one per
    /// other rank, for the others the one to rank 0; in a graph (`graph` true) the exchange
    /// links, where every rank passes failures on. `on_failure` runs on the watchdog thread
    /// when a failure first arrives from elsewhere (e.g. to write the flight recorder).
    /// `handoff`: what a star needs so that it outlives its hub (none: the star ends with
    /// it; unused in a graph).
    pub fn start(
        rank: usize,
        conns: Vec<(usize, TcpStream, bool)>,
        graph: bool,
        health: Arc<Health>,
        settings: WatchSettings,
        on_failure: Box<dyn Fn() + Send>,
        handoff: Option<Handoff>,
    ) -> std::io::Result<Watchdog> {
        let wake = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .ok();
        let shared = Arc::new(Shared {
            rank,
            health,
            outbox: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            wake,
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("oxccl-watch-{rank}"))
            .spawn(move || run(sh, conns, graph, settings, on_failure, handoff))?;
        Ok(Watchdog {
            shared,
            thread: Some(thread),
        })
    }

    /// Tells the other ranks that this rank failed with `e` (queued; sent at once by the
    /// watchdog thread).
    pub fn report(&self, e: &Error) {
        let Some(f) = report_frame(self.shared.rank, e) else {
            return;
        };
        self.shared
            .outbox
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(f);
        self.shared.poke();
    }
}

impl Watchdog {
    /// Starts the goodbye a drop says, without waiting for it: the thread says it and ends
    /// (see [`finish_leaving`](Self::finish_leaving)).
    pub fn begin_leaving(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.poke();
    }

    /// Waits until `by` for the goodbye [`begin_leaving`](Self::begin_leaving) started:
    /// true once the thread ended (the goodbye went out); false at `by`, the thread left to
    /// end on its own (a process exiting does not wait for it longer).
    pub fn finish_leaving(mut self, by: Instant) -> bool {
        let Some(t) = self.thread.take() else {
            return true;
        };
        while !t.is_finished() {
            if Instant::now() >= by {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let _ = t.join();
        true
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.poke();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Sends a whole frame without blocking; false if it could not (the peer is not reading
/// or is gone).
fn send_frame(s: &TcpStream, f: &Frame) -> bool {
    let b = f.encode();
    matches!(
        rustix::net::send(s, &b, SendFlags::DONTWAIT | SendFlags::NOSIGNAL),
        Ok(n) if n == b.len()
    )
}

/// The acceptor of a rank that became the hub of a star: admits the ranks' control
/// connections into `inbox` (and wakes the watchdog) until `cancel`.
struct HubAcceptor {
    listener: Arc<TcpListener>,
    cancel: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HubAcceptor {
    fn start(
        listener: TcpListener,
        keys: Keys,
        nranks: usize,
        inbox: Arc<Mutex<Vec<(usize, TcpStream)>>>,
        sh: Arc<Shared>,
    ) -> std::io::Result<HubAcceptor> {
        let listener = Arc::new(listener);
        let cancel = Arc::new(AtomicBool::new(false));
        let (l, c) = (listener.clone(), cancel.clone());
        let thread = std::thread::Builder::new()
            .name(format!("oxccl-hub-{}", keys.rank))
            .spawn(move || {
                let mut admit = |hello: Hello, s: TcpStream, from: SocketAddr| {
                    let ok = hello.rank < nranks && hello.rank != keys.rank;
                    let verdict = if ok {
                        Verdict::Accepted
                    } else {
                        Verdict::UnexpectedRank
                    };
                    // One byte into a fresh socket's empty send buffer: it does not block.
                    let sent = auth::send_verdict(
                        &mut Deadlined::new(&s, Instant::now() + auth::HANDSHAKE_TIMEOUT),
                        verdict,
                    );
                    if ok && sent.is_ok() {
                        let _ = s.set_nodelay(true);
                        inbox
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push((hello.rank, s));
                        sh.poke();
                    } else if !ok {
                        tracing::warn!(
                            "rank {}: refused a control connection from {from} claiming rank {}",
                            keys.rank,
                            hello.rank
                        );
                    }
                    Ok::<bool, Error>(false)
                };
                let forever = Instant::now() + Duration::from_secs(365 * 24 * 3600);
                let _ = accept::accept_loop(&*l, forever, &c, &keys, &mut admit);
            })?;
        Ok(HubAcceptor {
            listener,
            cancel,
            thread: Some(thread),
        })
    }
}

impl Drop for HubAcceptor {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::SeqCst);
        let _ = socket2::SockRef::from(&*self.listener).shutdown(std::net::Shutdown::Read);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How a dial of a new hub ended.
enum Dialed {
    Connected(TcpStream),
    /// Nothing listens there (it left too, or died): pass it over.
    Unreachable,
    /// It took the connection but did not answer in time: lost.
    Silent(String),
}

/// Dials rank `hub`'s control listener as rank `me`, until `deadline` or `stop`; a rank
/// `leaving` does not retry a refused connection (every rank may be leaving at once: each
/// drop must stay prompt).
fn dial_hub(
    h: &Handoff,
    me: usize,
    hub: usize,
    deadline: Instant,
    stop: &dyn Fn() -> bool,
    leaving: bool,
) -> Dialed {
    let Some(&addr) = h.addrs.get(hub).filter(|a| a.port() != 0) else {
        return Dialed::Unreachable;
    };
    let gone = std::cell::Cell::new(false);
    let d = Dial {
        addr,
        secret: &h.secret,
        hello: Hello {
            rank: me,
            purpose: Purpose::Control,
            tag: h.tag,
        },
        deadline,
        first_pause: Duration::from_millis(5),
        max_pause: Duration::from_millis(50),
        refused_limit: Some(if leaving {
            Duration::ZERO
        } else {
            REFUSED_LIMIT
        }),
        connect: |a, t| TcpStream::connect_timeout(&a, t),
        stop: Some(stop),
    };
    let res = d.run(
        |_, _| {},
        |g| {
            // Refused throughout, or never connected: nothing listens.
            gone.set(g.refused_for.is_some() || g.last_err.starts_with("connecting"));
            Error::Io {
                rank: me,
                context: format!("dialing the new hub rank {hub} at {addr}: {}", g.last_err),
                source: std::io::Error::from(std::io::ErrorKind::TimedOut),
            }
        },
    );
    match res {
        Ok(s) => Dialed::Connected(s),
        Err(_) if gone.get() => Dialed::Unreachable,
        Err(e) => Dialed::Silent(format!(
            "it is the new hub of the control connections (the hub left) and did not answer ({e})"
        )),
    }
}

/// One round's reads: what each watched connection has, fed to `w`.
fn read_round(w: &mut Watch, conns: &[Option<TcpStream>], tmp: &mut [u8]) {
    for (i, s) in conns.iter().enumerate() {
        if !w.is_watched(i) {
            continue;
        }
        if let Some(s) = s {
            loop {
                match rustix::net::recv(s, &mut *tmp, RecvFlags::DONTWAIT) {
                    Ok((0, _)) => {
                        w.handle_closed(i);
                        break;
                    }
                    Ok((n, _)) => {
                        w.handle_data(i, &tmp[..n], Instant::now());
                        if n < tmp.len() {
                            break;
                        }
                    }
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => {
                        w.handle_error(
                            i,
                            &crate::base::error::describe_io(&std::io::Error::from(e)),
                        );
                        break;
                    }
                }
            }
        }
        w.input_done(i, Instant::now());
    }
}

fn run(
    sh: Arc<Shared>,
    conns: Vec<(usize, TcpStream, bool)>,
    graph: bool,
    settings: WatchSettings,
    on_failure: Box<dyn Fn()>,
    mut handoff: Option<Handoff>,
) {
    let peers: Vec<usize> = conns.iter().map(|(p, _, _)| *p).collect();
    let beats: Vec<bool> = conns.iter().map(|(_, _, b)| *b).collect();
    let mut conns: Vec<Option<TcpStream>> = conns.into_iter().map(|(_, s, _)| Some(s)).collect();
    let mut w = Watch::new(sh.rank, &peers, settings, Instant::now());
    if graph {
        w = w.relaying(&beats);
        handoff = None;
    }
    let inbox: Arc<Mutex<Vec<(usize, TcpStream)>>> = Arc::default();
    let mut acceptor: Option<HubAcceptor> = None;
    let flush = |w: &mut Watch, conns: &[Option<TcpStream>]| {
        while let Some((i, f)) = w.poll_transmit() {
            let ok = conns[i].as_ref().is_some_and(|s| send_frame(s, f));
            w.sent(ok);
        }
    };
    // Takes the connections made for a handover: dials the new hub (until `deadline`), or
    // starts accepting as the new hub (not when leaving), and adopts what was accepted.
    let mut handover = |w: &mut Watch,
                        conns: &mut Vec<Option<TcpStream>>,
                        acceptor: &mut Option<HubAcceptor>,
                        leaving: bool| {
        let Some(h) = handoff.as_mut() else {
            return;
        };
        while let Some(step) = w.take_handover() {
            match step {
                Handover::Dial { hub } => {
                    let limit = if leaving {
                        LEAVING_DIAL
                    } else {
                        h.answer_within
                    };
                    let stop = || !leaving && sh.stop.load(Ordering::SeqCst);
                    match dial_hub(h, sh.rank, hub, Instant::now() + limit, &stop, leaving) {
                        Dialed::Connected(s) => {
                            let i = w.adopt(hub, Instant::now());
                            conns.resize_with(w.connections(), || None);
                            conns[i] = Some(s);
                        }
                        Dialed::Unreachable => w.hub_unreachable(hub, Instant::now()),
                        // (Given up because this rank is leaving: nothing more to do.)
                        Dialed::Silent(_) if sh.stop.load(Ordering::SeqCst) => {}
                        Dialed::Silent(why) => w.hub_lost(hub, why),
                    }
                }
                Handover::Serve if !leaving && acceptor.is_none() => {
                    if let Some(l) = h.listener.take() {
                        let keys = Keys {
                            secret: h.secret,
                            purpose: Purpose::Control,
                            tag: h.tag,
                            rank: sh.rank,
                        };
                        match HubAcceptor::start(l, keys, h.addrs.len(), inbox.clone(), sh.clone())
                        {
                            Ok(a) => *acceptor = Some(a),
                            Err(e) => tracing::warn!(
                                "rank {}: cannot start the control acceptor as the new hub: {e}",
                                sh.rank
                            ),
                        }
                    }
                }
                Handover::Serve => {}
            }
        }
        conns.resize_with(w.connections(), || None);
        let taken = std::mem::take(&mut *inbox.lock().unwrap_or_else(|e| e.into_inner()));
        for (rank, s) in taken {
            let i = w.adopt(rank, Instant::now());
            conns.resize_with(w.connections(), || None);
            conns[i] = Some(s);
        }
    };
    let record = |w: &mut Watch, conns: &[Option<TcpStream>]| {
        let failures = w.end_round();
        flush(w, conns);
        let mut reported = false;
        for f in failures {
            if sh.health.fail(f) {
                reported = true;
            }
        }
        if reported {
            on_failure();
        }
    };
    let mut tmp = vec![0u8; 4096];
    loop {
        // Outgoing failure reports of this rank (before a goodbye: they must go out).
        let stopping = sh.stop.load(Ordering::SeqCst);
        let out: Vec<Frame> =
            std::mem::take(&mut *sh.outbox.lock().unwrap_or_else(|e| e.into_inner()));
        for f in out {
            w.report(f);
        }
        flush(&mut w, &conns);
        if stopping {
            // A new hub stops admitting first: every connection its acceptor admitted is
            // then in the inbox, adopted below, and hears this rank's goodbye. One admitted
            // after the goodbye would close without one, and its rank, still in a call,
            // would report this rank lost.
            drop(acceptor.take());
            // A hub's goodbye that came meanwhile: the new hub hears this rank's goodbye too
            // (else it would wait for this rank).
            read_round(&mut w, &conns, &mut tmp);
            handover(&mut w, &mut conns, &mut acceptor, true);
            flush(&mut w, &conns);
            w.goodbye();
            flush(&mut w, &conns);
            // Take what the peers sent meanwhile (heartbeats) before the sockets close: a
            // close with unread bytes resets the connection, and a reset may drop the goodbye
            // before it leaves (the peer would then report this rank lost).
            for s in conns.iter().flatten() {
                for _ in 0..64 {
                    match rustix::net::recv(s, &mut tmp, RecvFlags::DONTWAIT) {
                        Ok((n, _)) if n > 0 => {}
                        _ => break,
                    }
                }
            }
            return;
        }
        w.handle_timeout(Instant::now());
        flush(&mut w, &conns);
        // Wait for frames, a wake-up, or the next heartbeat.
        {
            let timeout = w.poll_timeout().saturating_duration_since(Instant::now());
            let mut fds: Vec<PollFd<'_>> = conns
                .iter()
                .enumerate()
                .filter(|(i, _)| w.is_watched(*i))
                .filter_map(|(_, s)| s.as_ref())
                .map(|s| PollFd::new(s, PollFlags::IN))
                .collect();
            if let Some(fd) = &sh.wake {
                fds.push(PollFd::from_borrowed_fd(fd.as_fd(), PollFlags::IN));
            }
            let ts = rustix::time::Timespec {
                tv_sec: timeout.as_secs() as _,
                tv_nsec: timeout.subsec_nanos() as _,
            };
            let _ = rustix::event::poll(&mut fds, Some(&ts));
        }
        if let Some(fd) = &sh.wake {
            let mut b = [0u8; 8];
            let _ = rustix::io::read(fd, &mut b);
        }
        // Read what arrived.
        read_round(&mut w, &conns, &mut tmp);
        // Pass on (the hub of a star, every rank of a graph), then record: once recorded the
        // process may exit, and its peers must hear the cause before its links close.
        record(&mut w, &conns);
        // A hub's goodbye: connect to the new hub (or accept as it), and what was accepted;
        // after the round's failures are recorded (a dial may take a while: a call that lost
        // a link waits only `CAUSE_GRACE` for them), and what the dial found.
        handover(&mut w, &mut conns, &mut acceptor, false);
        record(&mut w, &conns);
    }
}
