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
//! - goodbyes: a rank that drops its communicator says so and is not reported as lost.
//!
//! Whatever arrives marks the communicator's [`Health`] failed, which wakes a blocked call
//! and makes the next call fail at once. Every write is non-blocking (`MSG_DONTWAIT`): a
//! peer that stops reading is lost, never waited for.
//!
//! The frames are in [`crate::fault::frame`]; every decision (when a peer is lost, what to
//! pass on, what to report) is [`crate::fault::watchdog::Watch`]'s, driven by this module's
//! thread, which owns the sockets and the clock.

use std::net::TcpStream;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use rustix::event::{PollFd, PollFlags};
use rustix::net::{RecvFlags, SendFlags};

use crate::base::error::Error;
pub use crate::fault::frame::{Frame, MAX_FRAME};
use crate::fault::health::Health;
pub use crate::fault::watchdog::WatchSettings;
use crate::fault::watchdog::{report_frame, Watch};

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
    pub fn start(
        rank: usize,
        conns: Vec<(usize, TcpStream, bool)>,
        graph: bool,
        health: Arc<Health>,
        settings: WatchSettings,
        on_failure: Box<dyn Fn() + Send>,
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
            .spawn(move || run(sh, conns, graph, settings, on_failure))?;
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

fn run(
    sh: Arc<Shared>,
    conns: Vec<(usize, TcpStream, bool)>,
    graph: bool,
    settings: WatchSettings,
    on_failure: Box<dyn Fn()>,
) {
    let peers: Vec<usize> = conns.iter().map(|(p, _, _)| *p).collect();
    let beats: Vec<bool> = conns.iter().map(|(_, _, b)| *b).collect();
    let conns: Vec<TcpStream> = conns.into_iter().map(|(_, s, _)| s).collect();
    let mut w = Watch::new(sh.rank, &peers, settings, Instant::now());
    if graph {
        w = w.relaying(&beats);
    }
    let flush = |w: &mut Watch| {
        while let Some((i, f)) = w.poll_transmit() {
            let ok = send_frame(&conns[i], f);
            w.sent(ok);
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
        flush(&mut w);
        if stopping {
            w.goodbye();
            flush(&mut w);
            // Take what the peers sent meanwhile (heartbeats) before the sockets close: a
            // close with unread bytes resets the connection, and a reset may drop the goodbye
            // before it leaves (the peer would then report this rank lost).
            for s in &conns {
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
        flush(&mut w);
        // Wait for frames, a wake-up, or the next heartbeat.
        {
            let timeout = w.poll_timeout().saturating_duration_since(Instant::now());
            let mut fds: Vec<PollFd<'_>> = conns
                .iter()
                .enumerate()
                .filter(|(i, _)| w.is_watched(*i))
                .map(|(_, s)| PollFd::new(s, PollFlags::IN))
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
        for (i, s) in conns.iter().enumerate() {
            if !w.is_watched(i) {
                continue;
            }
            loop {
                match rustix::net::recv(s, &mut tmp, RecvFlags::DONTWAIT) {
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
            w.input_done(i, Instant::now());
        }
        // Pass on (rank 0 of a star, every rank of a graph), then record: once recorded the
        // process may exit, and its peers must hear the cause before its links close.
        let failures = w.end_round();
        flush(&mut w);
        let mut reported = false;
        for f in failures {
            if sh.health.fail(f) {
                reported = true;
            }
        }
        if reported {
            on_failure();
        }
    }
}
