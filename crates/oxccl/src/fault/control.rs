//! The watchdog: one thread per communicator that watches every rank through the
//! rendezvous connections and spreads failures, so that no rank waits for ever.
//!
//! After init the rendezvous connections (a star around rank 0) carry only small control
//! frames, never collective data, so nothing here can interleave with a call's bytes:
//!
//! - heartbeats, both ways, every [`Config::heartbeat`](crate::Config::heartbeat)`/8`: a rank
//!   that sends nothing for `heartbeat` (host gone, link cut without a FIN, process stopped)
//!   is lost; a closed connection (process exited or killed) is lost at once;
//! - failure reports: a rank whose call fails (a mismatch, a timeout, a lost peer, an abort)
//!   tells rank 0, which tells every other rank; rank 0 reports the ranks it loses;
//! - goodbyes: a rank that drops its communicator says so and is not reported as lost.
//!
//! Whatever arrives marks the communicator's [`Health`] failed, which wakes a blocked call
//! and makes the next call fail at once. Every write is non-blocking (`MSG_DONTWAIT`): a
//! peer that stops reading is lost, never waited for.
//!
//! Frame: `u32` length (LE, of what follows), type byte, payload. Types: 1 heartbeat (no
//! payload), 2 failure (`u32` origin, kind byte, `u32` lost peer or `u32::MAX`, UTF-8
//! message), 3 goodbye. Frames over [`MAX_FRAME`] are a protocol violation.

use std::net::TcpStream;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::net::{RecvFlags, SendFlags};

use crate::base::error::{Error, FailureKind};
use crate::fault::health::{Failure, Health};

/// Largest control frame accepted (length field).
pub const MAX_FRAME: usize = 8 << 10;
const T_HEARTBEAT: u8 = 1;
const T_FAIL: u8 = 2;
const T_BYE: u8 = 3;
const NO_PEER: u32 = u32::MAX;
const MAX_MSG: usize = 4000;

/// A decoded control frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// "I am alive."
    Heartbeat,
    /// A failure: `origin` failed with `kind`; `peer` is the lost rank for a lost peer.
    Fail {
        /// The failing (or reporting) rank.
        origin: u32,
        /// What happened.
        kind: FailureKind,
        /// The lost rank, for [`FailureKind::PeerLost`].
        peer: Option<u32>,
        /// The error's text.
        msg: String,
    },
    /// "I dropped my communicator."
    Bye,
}

impl Frame {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        match self {
            Frame::Heartbeat => body.push(T_HEARTBEAT),
            Frame::Bye => body.push(T_BYE),
            Frame::Fail {
                origin,
                kind,
                peer,
                msg,
            } => {
                body.push(T_FAIL);
                body.extend_from_slice(&origin.to_le_bytes());
                body.push(kind.code());
                body.extend_from_slice(&peer.unwrap_or(NO_PEER).to_le_bytes());
                let mut end = msg.len().min(MAX_MSG);
                while !msg.is_char_boundary(end) {
                    end -= 1;
                }
                body.extend_from_slice(&msg.as_bytes()[..end]);
            }
        }
        let mut out = (body.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(&body);
        out
    }

    /// Takes one frame from the front of `buf`: `Ok(Some((frame, bytes used)))`, `Ok(None)`
    /// when more bytes are needed, `Err` when the bytes cannot be a frame.
    pub fn decode(buf: &[u8]) -> Result<Option<(Frame, usize)>, String> {
        if buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
        if len == 0 || len > MAX_FRAME {
            return Err(format!("control frame of {len} bytes (1 to {MAX_FRAME})"));
        }
        if buf.len() < 4 + len {
            return Ok(None);
        }
        let body = &buf[4..4 + len];
        let f = match body[0] {
            T_HEARTBEAT if len == 1 => Frame::Heartbeat,
            T_BYE if len == 1 => Frame::Bye,
            T_FAIL if len >= 10 => {
                let origin = u32::from_le_bytes(body[1..5].try_into().expect("4 bytes"));
                let kind = FailureKind::from_code(body[5]);
                let peer = u32::from_le_bytes(body[6..10].try_into().expect("4 bytes"));
                Frame::Fail {
                    origin,
                    kind,
                    peer: (peer != NO_PEER).then_some(peer),
                    msg: String::from_utf8_lossy(&body[10..]).into_owned(),
                }
            }
            t => return Err(format!("control frame of type {t} and {len} bytes")),
        };
        Ok(Some((f, 4 + len)))
    }
}

/// Settings of a [`Watchdog`].
#[derive(Clone, Copy, Debug)]
pub struct WatchSettings {
    /// A peer silent this long is lost (`None`: heartbeats are sent but not required).
    pub heartbeat: Option<Duration>,
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

struct Conn {
    peer: usize,
    stream: TcpStream,
    buf: Vec<u8>,
    last_seen: Instant,
    /// Closed, lost or said goodbye: no longer watched.
    done: bool,
}

impl Watchdog {
    /// Starts watching. `conns` are the rendezvous connections: for rank 0 one per other
    /// rank, for the others the one to rank 0. `on_failure` runs on the watchdog thread
    /// when a failure first arrives from elsewhere (e.g. to write the flight recorder).
    pub fn start(
        rank: usize,
        conns: Vec<(usize, TcpStream)>,
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
        let now = Instant::now();
        let conns: Vec<Conn> = conns
            .into_iter()
            .map(|(peer, stream)| Conn {
                peer,
                stream,
                buf: Vec::new(),
                last_seen: now,
                done: false,
            })
            .collect();
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("oxccl-watch-{rank}"))
            .spawn(move || run(sh, conns, settings, on_failure))?;
        Ok(Watchdog {
            shared,
            thread: Some(thread),
        })
    }

    /// Tells the other ranks that this rank failed with `e` (queued; sent at once by the
    /// watchdog thread).
    pub fn report(&self, e: &Error) {
        let peer = match e {
            Error::PeerLost { peer, .. } => Some(*peer as u32),
            _ => None,
        };
        let origin = match e {
            Error::Remote { .. } => return, // it came from elsewhere: everyone knows
            _ => self.shared.rank as u32,
        };
        self.shared
            .outbox
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Frame::Fail {
                origin,
                kind: e.failure_kind(),
                peer,
                msg: e.to_string(),
            });
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

fn run(sh: Arc<Shared>, mut conns: Vec<Conn>, settings: WatchSettings, on_failure: Box<dyn Fn()>) {
    let period = settings.heartbeat.map_or(Duration::from_millis(500), |h| {
        (h / 8).max(Duration::from_millis(10))
    });
    let mut next_beat = Instant::now();
    let is_root = sh.rank == 0;
    let mut reported = false;
    let mut tmp = vec![0u8; 4096];
    loop {
        // Lost peers found in this round: (rank, reason).
        let mut lost: Vec<(usize, String)> = Vec::new();
        // Failures received: frames to apply (and, on rank 0, to pass on).
        let mut received: Vec<(usize, Frame)> = Vec::new();

        // Outgoing failure reports of this rank (before a goodbye: they must go out).
        let stopping = sh.stop.load(Ordering::SeqCst);
        let out: Vec<Frame> =
            std::mem::take(&mut *sh.outbox.lock().unwrap_or_else(|e| e.into_inner()));
        for f in &out {
            for c in conns.iter_mut().filter(|c| !c.done) {
                if !send_frame(&c.stream, f) {
                    c.done = true;
                    lost.push((c.peer, "its control connection does not take data".into()));
                }
            }
        }
        if stopping {
            for c in conns.iter().filter(|c| !c.done) {
                let _ = send_frame(&c.stream, &Frame::Bye);
            }
            return;
        }
        let now = Instant::now();
        if now >= next_beat {
            next_beat = now + period;
            for c in conns.iter_mut().filter(|c| !c.done) {
                if !send_frame(&c.stream, &Frame::Heartbeat) {
                    c.done = true;
                    lost.push((c.peer, "its control connection does not take data".into()));
                }
            }
        }
        // Wait for frames, a wake-up, or the next heartbeat.
        {
            let timeout = next_beat.saturating_duration_since(Instant::now());
            let mut fds: Vec<PollFd<'_>> = conns
                .iter()
                .filter(|c| !c.done)
                .map(|c| PollFd::new(&c.stream, PollFlags::IN))
                .collect();
            if let Some(w) = &sh.wake {
                fds.push(PollFd::from_borrowed_fd(w.as_fd(), PollFlags::IN));
            }
            let ts = rustix::time::Timespec {
                tv_sec: timeout.as_secs() as _,
                tv_nsec: timeout.subsec_nanos() as _,
            };
            let _ = rustix::event::poll(&mut fds, Some(&ts));
        }
        if let Some(w) = &sh.wake {
            let mut b = [0u8; 8];
            let _ = rustix::io::read(w, &mut b);
        }
        // Read what arrived.
        for c in conns.iter_mut().filter(|c| !c.done) {
            loop {
                match rustix::net::recv(&c.stream, &mut tmp, RecvFlags::DONTWAIT) {
                    Ok((0, _)) => {
                        c.done = true;
                        lost.push((c.peer, "its process exited or its connection closed".into()));
                        break;
                    }
                    Ok((n, _)) => {
                        c.buf.extend_from_slice(&tmp[..n]);
                        c.last_seen = Instant::now();
                        if n < tmp.len() {
                            break;
                        }
                    }
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => {
                        c.done = true;
                        lost.push((
                            c.peer,
                            format!(
                                "control connection: {}",
                                crate::base::error::describe_io(&std::io::Error::from(e))
                            ),
                        ));
                        break;
                    }
                }
            }
            let mut used = 0;
            loop {
                match Frame::decode(&c.buf[used..]) {
                    Ok(Some((f, n))) => {
                        used += n;
                        match f {
                            Frame::Heartbeat => {}
                            Frame::Bye => {
                                // Gone on purpose: not watched any more, not reported.
                                c.done = true;
                                lost.retain(|(p, _)| *p != c.peer);
                                break;
                            }
                            f @ Frame::Fail { .. } => received.push((c.peer, f)),
                        }
                    }
                    Ok(None) => break,
                    Err(m) => {
                        c.done = true;
                        lost.push((c.peer, format!("malformed control data: {m}")));
                        break;
                    }
                }
            }
            c.buf.drain(..used.min(c.buf.len()));
            if let Some(h) = settings.heartbeat {
                if !c.done && c.last_seen.elapsed() > h {
                    c.done = true;
                    lost.push((
                        c.peer,
                        format!(
                            "no heartbeat for {:?} (host down, link cut or process stopped)",
                            c.last_seen.elapsed()
                        ),
                    ));
                }
            }
        }
        // Apply, and on rank 0 pass on.
        let mut relay: Vec<(usize, Frame)> = Vec::new();
        for (peer, reason) in lost {
            let failure = Failure::Lost {
                peer,
                reason: reason.clone(),
            };
            if sh.health.fail(failure) {
                reported = true;
            }
            if is_root {
                relay.push((
                    peer,
                    Frame::Fail {
                        origin: 0,
                        kind: FailureKind::PeerLost,
                        peer: Some(peer as u32),
                        msg: format!("rank 0 lost rank {peer}: {reason}"),
                    },
                ));
            }
        }
        for (from, f) in received {
            if let Frame::Fail {
                origin,
                kind,
                peer,
                ref msg,
            } = f
            {
                let failure = match (kind, peer) {
                    (FailureKind::PeerLost, Some(p)) => Failure::Lost {
                        peer: p as usize,
                        reason: format!("reported by rank {origin}: {msg}"),
                    },
                    _ => Failure::Remote {
                        origin: origin as usize,
                        kind,
                        msg: msg.clone(),
                    },
                };
                if sh.health.fail(failure) {
                    reported = true;
                }
                if is_root {
                    relay.push((from, f));
                }
            }
        }
        for (skip, f) in &relay {
            for c in conns.iter_mut().filter(|c| !c.done && c.peer != *skip) {
                if !send_frame(&c.stream, f) {
                    c.done = true;
                }
            }
        }
        if reported {
            reported = false;
            on_failure();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_reject_junk() {
        for f in [
            Frame::Heartbeat,
            Frame::Bye,
            Frame::Fail {
                origin: 3,
                kind: FailureKind::Mismatch,
                peer: None,
                msg: "rank 3: call #2 mismatch".into(),
            },
            Frame::Fail {
                origin: 0,
                kind: FailureKind::PeerLost,
                peer: Some(5),
                msg: "é".repeat(3000),
            },
        ] {
            let b = f.encode();
            let (g, n) = Frame::decode(&b).unwrap().unwrap();
            assert_eq!(n, b.len());
            if let Frame::Fail { msg, .. } = &g {
                assert!(msg.len() <= MAX_MSG);
            } else {
                assert_eq!(g, f);
            }
            assert_eq!(Frame::decode(&b[..b.len() - 1]).unwrap(), None);
        }
        assert!(Frame::decode(&[0, 0, 0, 0]).is_err());
        assert!(Frame::decode(&[255, 255, 255, 255]).is_err());
        assert!(Frame::decode(&[1, 0, 0, 0, 9]).is_err());
        assert!(Frame::decode(&[2, 0, 0, 0, 1, 1]).is_err());
    }
}
