//! The acceptor of every listening port (rank 0's rendezvous and the TCP data ports): one
//! thread polls the listener and every connection whose handshake ([`auth`]) is under way, so
//! a stranger's connection costs the acceptor a file descriptor and a few bytes of state,
//! never a thread, and a real rank is never starved:
//!
//! - a connection must send its first bytes within [`FIRST_BYTES_TIMEOUT`] and finish the
//!   handshake within [`auth::HANDSHAKE_TIMEOUT`], else it is dropped;
//! - at most [`MAX_PENDING_PER_SOURCE`] unauthenticated connections per source address and
//!   [`MAX_PENDING`] in all are kept; a new one evicts the oldest of its source (or of all)
//!   that has sent nothing, else the oldest (a real rank sends its challenge as soon as it
//!   connects and finishes in a round trip, and retries when dropped);
//! - the listen backlog is [`LISTEN_BACKLOG`];
//! - authenticated connections leave the pending set at once and count against no limit.
//!
//! Every dropped connection is counted by source ([`Strangers`]), so that a job that times out
//! says who kept it from starting.
//!
//! The same loop serves TCP listeners and the Unix-domain listener of a host's rendezvous
//! leader (`bootstrap/host.rs`): [`Listen`] and [`Conn`]; a Unix connection's source counts
//! as `127.0.0.1`.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};

use super::auth::{self, Hello, Purpose, Verdict, HELLO_C_LEN, NONCE, PROOF_C_LEN};
use crate::base::error::Result;

/// How long an accepted connection may stay silent before it is dropped.
pub(crate) const FIRST_BYTES_TIMEOUT: Duration = Duration::from_secs(1);
/// At most this many unauthenticated connections from one source address are kept.
pub(crate) const MAX_PENDING_PER_SOURCE: usize = 64;
/// At most this many unauthenticated connections are kept in all.
pub(crate) const MAX_PENDING: usize = 512;
/// The listen backlog of every listener the acceptor serves.
pub(crate) const LISTEN_BACKLOG: i32 = 4096;
/// At most this many connections are taken from the backlog between two polls, so that
/// connections already accepted progress during a flood.
const ACCEPT_BURST: usize = 256;
/// The longest poll: how often the deadline, cancellation and `tick` are looked at.
const POLL: Duration = Duration::from_millis(50);

/// What the acceptor checks connections against.
#[derive(Clone, Copy)]
pub(crate) struct Keys {
    /// The communicator's secret.
    pub secret: [u8; 16],
    /// What connections to this listener are for.
    pub purpose: Purpose,
    /// The communicator's tag ([`auth::comm_tag`]).
    pub tag: u64,
    /// This rank, for messages.
    pub rank: usize,
}

/// A stream the acceptor can run the handshake on without blocking.
pub(crate) trait Conn: AsFd + Send + Sized {
    /// One `read`.
    fn read_some(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// One `write`.
    fn write_some(&self, buf: &[u8]) -> io::Result<usize>;
    /// Sets or clears `O_NONBLOCK`.
    fn nonblocking(&self, on: bool) -> io::Result<()>;
    /// Socket options for the handshake, set once accepted (best effort).
    fn prepare(&self) {}
}

impl Conn for TcpStream {
    fn read_some(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
    fn write_some(&self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }
    fn nonblocking(&self, on: bool) -> io::Result<()> {
        self.set_nonblocking(on)
    }
    fn prepare(&self) {
        // Handshake and join messages are small and answered at once: send each
        // without waiting for the peer's ACK of the last (Nagle's algorithm).
        let _ = self.set_nodelay(true);
    }
}

impl Conn for UnixStream {
    fn read_some(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
    fn write_some(&self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }
    fn nonblocking(&self, on: bool) -> io::Result<()> {
        self.set_nonblocking(on)
    }
}

/// A listener [`accept_loop`] serves.
pub(crate) trait Listen: AsFd {
    /// What it accepts.
    type Conn: Conn;
    /// One `accept`: the connection and its source.
    fn accept_conn(&self) -> io::Result<(Self::Conn, SocketAddr)>;
    /// Sets or clears `O_NONBLOCK`.
    fn nonblocking(&self, on: bool) -> io::Result<()>;
}

impl Listen for TcpListener {
    type Conn = TcpStream;
    fn accept_conn(&self) -> io::Result<(TcpStream, SocketAddr)> {
        self.accept()
    }
    fn nonblocking(&self, on: bool) -> io::Result<()> {
        self.set_nonblocking(on)
    }
}

impl Listen for UnixListener {
    type Conn = UnixStream;
    fn accept_conn(&self) -> io::Result<(UnixStream, SocketAddr)> {
        let (stream, _) = self.accept()?;
        Ok((stream, SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0)))
    }
    fn nonblocking(&self, on: bool) -> io::Result<()> {
        self.set_nonblocking(on)
    }
}

/// Writes through a [`Conn`] (for [`auth::send_verdict`]).
struct ConnWriter<'a, C>(&'a C);

impl<C: Conn> Write for ConnWriter<'_, C> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write_some(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Why [`accept_loop`] stopped without being told it is done.
pub(crate) enum AcceptStop {
    /// The deadline passed or the loop was cancelled; what strangers did meanwhile.
    Deadline(Strangers),
    /// The listener failed.
    Io(io::Error),
}

/// Why a connection was dropped before it authenticated.
#[derive(Clone, Copy, Debug)]
enum Why {
    Silent,
    Stalled,
    Closed,
    Garbage,
    Refused,
    Evicted,
}

const WHY: [(Why, &str); 6] = [
    (Why::Silent, "silent"),
    (Why::Stalled, "stalled mid-handshake"),
    (Why::Closed, "closed mid-handshake"),
    (Why::Garbage, "not oxccl"),
    (Why::Refused, "wrong secret or communicator"),
    (Why::Evicted, "evicted over the limits"),
];

/// Connections dropped without a valid handshake, counted by source address and reason.
#[derive(Default, Debug)]
pub(crate) struct Strangers {
    by_ip: BTreeMap<IpAddr, [usize; WHY.len()]>,
}

impl Strangers {
    fn note(&mut self, ip: IpAddr, why: Why) {
        self.by_ip.entry(ip).or_default()[why as usize] += 1;
    }

    /// E.g. "120 connection(s) from 10.0.0.9 dropped without a valid handshake (100 silent,
    /// 20 not oxccl)", the three busiest sources; `None` when nothing was dropped.
    pub(crate) fn summary(&self) -> Option<String> {
        let mut v: Vec<(usize, &IpAddr, &[usize; WHY.len()])> = self
            .by_ip
            .iter()
            .map(|(ip, c)| (c.iter().sum(), ip, c))
            .collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by_key(|a| std::cmp::Reverse(a.0));
        let parts: Vec<String> = v
            .iter()
            .take(3)
            .map(|(n, ip, c)| {
                let why: Vec<String> = WHY
                    .iter()
                    .filter(|(w, _)| c[*w as usize] > 0)
                    .map(|(w, name)| format!("{} {name}", c[*w as usize]))
                    .collect();
                format!("{n} connection(s) from {ip} ({})", why.join(", "))
            })
            .collect();
        let more = if v.len() > 3 {
            format!(" and more from {} other source(s)", v.len() - 3)
        } else {
            String::new()
        };
        Some(format!(
            "{}{more} dropped without a valid handshake",
            parts.join("; ")
        ))
    }
}

enum Stage {
    Challenge {
        buf: [u8; HELLO_C_LEN],
        n: usize,
    },
    Proof {
        nonce_c: [u8; NONCE],
        nonce_a: [u8; NONCE],
        buf: [u8; PROOF_C_LEN],
        n: usize,
    },
}

/// An accepted connection whose handshake is under way.
struct Pending<C> {
    stream: C,
    from: SocketAddr,
    opened: Instant,
    stage: Stage,
}

impl<C> Pending<C> {
    /// Whether it has sent anything yet.
    fn heard(&self) -> bool {
        !matches!(self.stage, Stage::Challenge { n: 0, .. })
    }
}

enum Step<C> {
    Wait(Pending<C>),
    Dropped,
    Authenticated(Hello, C, SocketAddr),
}

/// Reads what `p` has sent and moves its handshake on.
fn step<C: Conn>(mut p: Pending<C>, keys: &Keys, strangers: &mut Strangers) -> Step<C> {
    let ip = p.from.ip();
    let mut drop_as = |why: Why, msg: &dyn std::fmt::Display| {
        tracing::debug!(
            "rank {}: dropped a connection from {}: {msg}",
            keys.rank,
            p.from
        );
        strangers.note(ip, why);
        Step::Dropped
    };
    loop {
        let first = matches!(p.stage, Stage::Challenge { .. });
        let (buf, n): (&mut [u8], &mut usize) = match &mut p.stage {
            Stage::Challenge { buf, n } => (buf, n),
            Stage::Proof { buf, n, .. } => (buf, n),
        };
        match p.stream.read_some(&mut buf[*n..]) {
            Ok(0) if *n == 0 && first => {
                return drop_as(Why::Silent, &"closed without sending anything")
            }
            Ok(0) => return drop_as(Why::Closed, &"closed mid-handshake"),
            Ok(k) => {
                *n += k;
                if *n < buf.len() {
                    continue;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Wait(p),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return drop_as(Why::Closed, &e),
        }
        let addr = p.from.to_string();
        match p.stage {
            Stage::Challenge { buf, .. } => {
                match auth::answer_challenge(&buf, &keys.secret, keys.rank, &addr) {
                    Ok((nonce_a, m2)) => {
                        // A few dozen bytes into a fresh socket's empty send buffer: all or
                        // nothing.
                        if !matches!(p.stream.write_some(&m2), Ok(k) if k == m2.len()) {
                            return drop_as(Why::Closed, &"cannot answer the challenge");
                        }
                        let mut nonce_c = [0u8; NONCE];
                        nonce_c.copy_from_slice(&buf[10..]);
                        p.stage = Stage::Proof {
                            nonce_c,
                            nonce_a,
                            buf: [0; PROOF_C_LEN],
                            n: 0,
                        };
                    }
                    Err(e) => return drop_as(Why::Garbage, &e),
                }
            }
            Stage::Proof {
                nonce_c,
                nonce_a,
                buf,
                ..
            } => {
                return match auth::check_proof(
                    &buf,
                    &keys.secret,
                    &nonce_c,
                    &nonce_a,
                    keys.purpose,
                    keys.tag,
                    keys.rank,
                    &addr,
                ) {
                    Ok(hello) => match p.stream.nonblocking(false) {
                        Ok(()) => Step::Authenticated(hello, p.stream, p.from),
                        Err(e) => drop_as(Why::Closed, &e),
                    },
                    Err(e) => {
                        let _ = auth::send_verdict(&mut ConnWriter(&p.stream), Verdict::Refused);
                        drop_as(Why::Refused, &e)
                    }
                };
            }
        }
    }
}

/// Makes room for one more connection from `ip`: evicts the oldest silent connection of that
/// source (else its oldest) when it has [`MAX_PENDING_PER_SOURCE`], and likewise over all
/// sources at [`MAX_PENDING`].
fn make_room<C>(pending: &mut Vec<Pending<C>>, ip: IpAddr, strangers: &mut Strangers) {
    let evict = |pending: &mut Vec<Pending<C>>, strangers: &mut Strangers, same: bool| {
        let victim = pending
            .iter()
            .enumerate()
            .filter(|(_, p)| !same || p.from.ip() == ip)
            .min_by_key(|(_, p)| (p.heard(), p.opened))
            .map(|(i, _)| i);
        if let Some(i) = victim {
            let p = pending.remove(i);
            strangers.note(p.from.ip(), Why::Evicted);
        }
    };
    if pending.iter().filter(|p| p.from.ip() == ip).count() >= MAX_PENDING_PER_SOURCE {
        evict(pending, strangers, true);
    }
    if pending.len() >= MAX_PENDING {
        evict(pending, strangers, false);
    }
}

/// Takes up to [`ACCEPT_BURST`] connections from the backlog into `pending`.
fn accept_burst<L: Listen>(
    listener: &L,
    pending: &mut Vec<Pending<L::Conn>>,
    strangers: &mut Strangers,
) -> io::Result<()> {
    for _ in 0..ACCEPT_BURST {
        match listener.accept_conn() {
            Ok((stream, from)) => {
                if stream.nonblocking(true).is_err() {
                    continue;
                }
                stream.prepare();
                make_room(pending, from.ip(), strangers);
                pending.push(Pending {
                    stream,
                    from,
                    opened: Instant::now(),
                    stage: Stage::Challenge {
                        buf: [0; HELLO_C_LEN],
                        n: 0,
                    },
                });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            // Interrupted, or a connection that died in the backlog.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted
                        | io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::ConnectionReset
                ) => {}
            // Out of file descriptors: free one by dropping the oldest stranger.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                if pending.is_empty() {
                    return Ok(());
                }
                let p = pending.remove(0);
                strangers.note(p.from.ip(), Why::Evicted);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// What [`accept_loop`] does with authenticated connections (`C`: the listener's
/// [`Listen::Conn`]). Closures `FnMut(Hello, C, SocketAddr) -> Result<bool>` are admitters
/// without a `tick`.
pub(crate) trait Admit<C = TcpStream> {
    /// Runs for each connection that passed the handshake (blocking again, before the
    /// verdict: this sends it); `Ok(true)` once it has all it needs; an error ends the loop.
    fn admit(&mut self, hello: Hello, stream: C, from: SocketAddr) -> Result<bool>;

    /// Runs at least every 50 ms while the loop waits; an error ends the loop.
    fn tick(&mut self, _strangers: &Strangers) -> Result<()> {
        Ok(())
    }

    /// Asked after each `tick`: `true` ends the loop as `admit`'s `Ok(true)` does (what it
    /// needed came otherwise than through a new connection).
    fn done(&self) -> bool {
        false
    }
}

impl<C, F: FnMut(Hello, C, SocketAddr) -> Result<bool>> Admit<C> for F {
    fn admit(&mut self, hello: Hello, stream: C, from: SocketAddr) -> Result<bool> {
        self(hello, stream, from)
    }
}

/// Accepts and authenticates connections on `listener` (as [`Keys`] says) until `admit`
/// says it is done, `deadline` passes or `cancel` is set.
pub(crate) fn accept_loop<L: Listen>(
    listener: &L,
    deadline: Instant,
    cancel: &AtomicBool,
    keys: &Keys,
    admit: &mut dyn Admit<L::Conn>,
) -> std::result::Result<Result<()>, AcceptStop> {
    listener.nonblocking(true).map_err(AcceptStop::Io)?;
    // Raising the backlog of a listening socket is allowed; a failure leaves the old one.
    let _ = rustix::net::listen(listener, LISTEN_BACKLOG);
    let mut pending: Vec<Pending<L::Conn>> = Vec::new();
    let mut strangers = Strangers::default();
    let result = 'outer: loop {
        let now = Instant::now();
        if now >= deadline || cancel.load(Ordering::SeqCst) {
            break Err(AcceptStop::Deadline(std::mem::take(&mut strangers)));
        }
        if let Err(e) = admit.tick(&strangers) {
            break Ok(Err(e));
        }
        if admit.done() {
            break Ok(Ok(()));
        }
        pending.retain(|p| {
            let age = now.saturating_duration_since(p.opened);
            let why = if !p.heard() && age >= FIRST_BYTES_TIMEOUT {
                Why::Silent
            } else if age >= auth::HANDSHAKE_TIMEOUT {
                Why::Stalled
            } else {
                return true;
            };
            strangers.note(p.from.ip(), why);
            false
        });
        let wait = deadline.saturating_duration_since(now).min(POLL);
        let (listener_ready, ready) = {
            let mut fds = Vec::with_capacity(pending.len() + 1);
            fds.push(PollFd::new(listener, PollFlags::IN));
            fds.extend(
                pending
                    .iter()
                    .map(|p| PollFd::new(&p.stream, PollFlags::IN)),
            );
            let ts = Timespec {
                tv_sec: wait.as_secs() as _,
                tv_nsec: wait.subsec_nanos() as _,
            };
            match rustix::event::poll(&mut fds, Some(&ts)) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => break Err(AcceptStop::Io(e.into())),
            }
            let ready: Vec<bool> = fds[1..].iter().map(|f| !f.revents().is_empty()).collect();
            (!fds[0].revents().is_empty(), ready)
        };
        let mut keep = Vec::with_capacity(pending.len());
        let mut ready = ready.into_iter();
        let mut drained = pending.drain(..);
        for p in drained.by_ref() {
            if !ready.next().unwrap_or(false) {
                keep.push(p);
                continue;
            }
            match step(p, keys, &mut strangers) {
                Step::Wait(p) => keep.push(p),
                Step::Dropped => {}
                Step::Authenticated(hello, s, from) => match admit.admit(hello, s, from) {
                    Ok(false) => {}
                    Ok(true) => break 'outer Ok(Ok(())),
                    Err(e) => break 'outer Ok(Err(e)),
                },
            }
        }
        drop(drained);
        pending = keep;
        if listener_ready {
            if let Err(e) = accept_burst(listener, &mut pending, &mut strangers) {
                break Err(AcceptStop::Io(e));
            }
        }
    };
    if let Some(s) = strangers.summary() {
        tracing::warn!("rank {}: {s}", keys.rank);
    }
    result
}
