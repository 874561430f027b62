//! Host leaders: the ranks of one host join the rendezvous through one of them, so that rank
//! 0 accepts one connection per host, not one per rank (with the exchanges directly between
//! ranks, above `OXCCL_BOOTSTRAP_RELAY_MAX` ranks, and `OXCCL_BOOTSTRAP_HOST_LEADERS=1`).
//!
//! The ranks of a host other than rank 0 find each other through an abstract Unix socket
//! (Linux) whose name is a hash of the communicator's tag, the rendezvous address and the host
//! id (never the secret; two communicators or two jobs on one host get two names): the
//! first rank to bind it leads ([`elect`]); the others connect to it, prove the secret (the
//! handshake of the TCP rendezvous, [`crate::net::auth`]) and send their join message as they
//! would to rank 0. An abstract socket vanishes with its process: a dead leader leaves no
//! stale name. Rank 0 stays out of the election (it hosts the rendezvous); its host's other
//! ranks elect a leader like any host's.
//!
//! The leader accepts its members in a thread ([`accept::accept_loop`]: strangers and silent
//! connections are dropped after their deadlines and cannot block the others), dials rank 0,
//! and sends rank 0 its own join and its members' in batches ([`JOIN_BATCH`]; the first at
//! once, then at most one per gap, the gap doubling from [`FIRST_GAP`] to [`MAX_GAP`], since
//! nobody knows how many ranks a host has). Rank 0 answers each leader once, when every rank
//! has joined ([`TABLE_HOST`]: each rank's answer as a rank joining directly gets it), and
//! the leader hands each member its part. Until the peer table is exchanged the leader
//! passes failure reports both ways (as rank 0 does for the ranks that join it directly);
//! then it tells each member it is done ([`SEQ_DONE`]) and closes their connections.
//!
//! Failures: a member that closes its connection before rank 0 answered makes the leader
//! fail naming it, and tell rank 0 ([`HOST_LOST`]) and the other members; a leader that dies
//! is named by its members (its connection closed before the answer, or before it said it
//! was done) and by rank 0 (its connection closed before every rank had joined). A leader
//! whose own join fails tells its members why ([`TABLE_LEADER_FAILED`], or the rank it
//! blames). Where the socket cannot be made (no abstract sockets, a squatter that fails the
//! handshake), a rank joins rank 0 itself.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::{
    parse_join, take, take_u32, Answer, Bootstrap, Links, PeerInfo, MAX_JOIN, MEMBER_GRACE,
    SEQ_LOST, TABLE_LOST,
};
use crate::base::error::{Error, Result};
use crate::base::param::Config;
use crate::net::accept::{self, Admit, Keys};
use crate::net::auth::{self, Hello, Purpose, Verdict};

/// First byte of a host leader's message to rank 0 carrying joins: then a `u32` count and
/// that many frames (`u32` length, a join message as a rank sends rank 0). The leader's own
/// join is the first of its first batch.
pub(super) const JOIN_BATCH: u8 = 0x80;
/// First byte of a host leader's message to rank 0 naming a rank of its host that died before
/// rank 0 answered: then the rank as a `u32` and the leader's error.
pub(super) const HOST_LOST: u8 = 0x81;
/// First byte of rank 0's answer to a host leader: a `u32` count, then for each rank that
/// joined through it (the leader first) the rank as a `u32`, a `u32` length and the answer
/// that rank would have had joining directly.
pub(super) const TABLE_HOST: u8 = 4;
/// First byte of a leader's answer to a member when the leader's own join failed with an
/// error that names no rank: then the error.
pub(super) const TABLE_LEADER_FAILED: u8 = 5;
/// The sequence number of the leader's last word to a member: the peer table is exchanged,
/// the connection closes, and that is no failure.
pub(super) const SEQ_DONE: u64 = u64::MAX - 1;
/// Largest batch of joins rank 0 reads.
pub(super) const MAX_BATCH: usize = 64 << 20;
/// The least time between two batches of joins a leader sends rank 0; it doubles after each.
const FIRST_GAP: Duration = Duration::from_millis(5);
/// The most time between two batches.
const MAX_GAP: Duration = Duration::from_millis(50);
/// How much longer a member waits for the leader's answer than the leader waits for rank 0.
const LEADER_GRACE: Duration = Duration::from_secs(1);

/// A rank's place on its host.
pub(super) enum Local {
    /// This rank leads: the listener its members connect to.
    Leader(UnixListener),
    /// Another rank leads: the (not yet authenticated) connection to it.
    Member(UnixStream),
}

/// The abstract socket name of the leader of the ranks on host `host_id` of the communicator
/// with tag `tag` and rendezvous `root`: `oxccl-` and 32 hex digits of a SHA-256.
pub(super) fn leader_name(tag: u64, root: SocketAddr, host_id: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"oxccl-host-leader");
    h.update(tag.to_le_bytes());
    h.update(root.to_string().as_bytes());
    h.update([0u8]);
    h.update(host_id.as_bytes());
    let d = h.finalize();
    let hex: String = d[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("oxccl-{hex}")
}

/// Binds `name` as an abstract Unix socket: `Ok(None)` when it is taken.
pub(super) fn bind_name(name: &str) -> io::Result<Option<UnixListener>> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let addr = SocketAddrUnix::new_abstract_name(name.as_bytes())?;
    match rustix::net::bind(&fd, &addr) {
        Ok(()) => {}
        Err(rustix::io::Errno::ADDRINUSE) => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    rustix::net::listen(&fd, accept::LISTEN_BACKLOG)?;
    Ok(Some(UnixListener::from(fd)))
}

/// Connects to the abstract Unix socket `name` by `deadline` (a full backlog is retried, never
/// waited on without a bound): `Ok(None)` when nothing listens there.
pub(super) fn connect_name(name: &str, deadline: Instant) -> io::Result<Option<UnixStream>> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let addr = SocketAddrUnix::new_abstract_name(name.as_bytes())?;
    loop {
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?;
        match rustix::net::connect(&fd, &addr) {
            Ok(()) => {
                let s = UnixStream::from(fd);
                s.set_nonblocking(false)?;
                return Ok(Some(s));
            }
            Err(rustix::io::Errno::CONNREFUSED | rustix::io::Errno::NOENT) => return Ok(None),
            // The leader's backlog is full: it is busy accepting; try again shortly.
            Err(rustix::io::Errno::AGAIN) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Finds this host's leader for the socket `name`: binds it (this rank leads) or connects to
/// the rank that did. `None` where abstract sockets cannot be had (the rank then joins rank
/// 0 itself).
pub(super) fn elect(name: &str, rank: usize, deadline: Instant) -> Option<Local> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    // A leader that closes its listener between our bind and our connect (it died, or every
    // rank has joined and this one belongs elsewhere) makes us try again.
    for _ in 0..8 {
        let res = match bind_name(name) {
            Ok(Some(l)) => return Some(Local::Leader(l)),
            Ok(None) => connect_name(name, deadline),
            Err(e) => Err(e),
        };
        match res {
            Ok(Some(s)) => return Some(Local::Member(s)),
            Ok(None) => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => {
                tracing::debug!(
                    rank,
                    "no host leader for the rendezvous (abstract socket {name}: {e}); joining rank 0 directly"
                );
                return None;
            }
        }
    }
    None
}

/// Waits until `fd` is readable (or closed) for at most `wait`.
fn readable_within(fd: &impl AsFd, wait: Duration) -> bool {
    let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
    let ts = rustix::event::Timespec {
        tv_sec: wait.as_secs() as _,
        tv_nsec: wait.subsec_nanos() as _,
    };
    matches!(rustix::event::poll(&mut fds, Some(&ts)), Ok(k) if k > 0)
}

/// One byte peeked without waiting: `Ok(0)` for a closed connection, an error `WouldBlock`
/// when there is nothing.
pub(super) fn peek1(fd: &impl AsFd) -> io::Result<usize> {
    use rustix::net::RecvFlags;
    let mut b = [0u8; 1];
    rustix::net::recv(fd, &mut b, RecvFlags::PEEK | RecvFlags::DONTWAIT)
        .map(|(n, _)| n)
        .map_err(io::Error::from)
}

/// Sets both timeouts of a Unix stream (at least 1 ms: zero would mean none).
fn set_unix_timeouts(s: &UnixStream, t: Duration) -> io::Result<()> {
    let t = Some(t.max(Duration::from_millis(1)));
    s.set_read_timeout(t)?;
    s.set_write_timeout(t)
}

/// What a leader's accepting thread hands its main thread.
#[derive(Default)]
struct Arrivals {
    /// Members' join messages, in order of arrival.
    joins: Vec<Vec<u8>>,
    /// Members' connections, by rank, in order of arrival.
    members: Vec<(usize, UnixStream)>,
    /// Connections accepted (handshakes passed).
    accepted: u64,
}

/// The leader's accepting side: each member that proves the secret is told the leader's rank
/// and pid, then sends its join.
struct LocalAdmit<'a> {
    leader: usize,
    arrivals: &'a Mutex<Arrivals>,
}

impl Admit<UnixStream> for LocalAdmit<'_> {
    fn admit(&mut self, hello: Hello, stream: UnixStream, _from: SocketAddr) -> Result<bool> {
        let join = set_unix_timeouts(&stream, auth::HANDSHAKE_TIMEOUT)
            .and_then(|_| auth::send_verdict(&mut &stream, Verdict::Accepted))
            .and_then(|_| {
                let mut me = (self.leader as u32).to_le_bytes().to_vec();
                me.extend_from_slice(&std::process::id().to_le_bytes());
                auth::write_frame(&mut &stream, &me)
            })
            .and_then(|_| auth::read_frame(&mut &stream, MAX_JOIN));
        let join = match join {
            Ok(j) => j,
            Err(e) => {
                tracing::debug!(
                    "rank {}: lost rank {} on the host leader's socket before its join: {e}",
                    self.leader,
                    hello.rank
                );
                return Ok(false);
            }
        };
        // Rank 0 checks the rest (world size, ranks twice) as for a direct join.
        if !matches!(parse_join(&join), Some((_, info, _)) if info.rank == hello.rank && info.rank != 0)
        {
            let mut no = vec![TABLE_LEADER_FAILED];
            no.extend_from_slice(
                format!(
                    "malformed join message, or one for another rank than rank {} of the handshake",
                    hello.rank
                )
                .as_bytes(),
            );
            let _ = auth::write_frame(&mut &stream, &no);
            return Ok(false);
        }
        let mut a = self.arrivals.lock().unwrap_or_else(|p| p.into_inner());
        a.joins.push(join);
        a.members.push((hello.rank, stream));
        a.accepted += 1;
        Ok(false)
    }
}

/// Writes `msg` to each of `members` but `except`, briefly (the last word before failing).
fn tell_members(members: &[(usize, UnixStream)], except: usize, msg: &[u8]) {
    for (r, s) in members {
        if *r != except {
            let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
            let _ = auth::write_frame(&mut &*s, msg);
        }
    }
}

/// `[code][rank u32][text]`.
fn report(code: &[u8], rank: usize, text: &str) -> Vec<u8> {
    let mut m = code.to_vec();
    m.extend_from_slice(&(rank as u32).to_le_bytes());
    m.extend_from_slice(text.as_bytes());
    m
}

/// A batch of joins for rank 0.
fn batch<'a>(joins: impl Iterator<Item = &'a Vec<u8>>) -> Vec<u8> {
    let joins: Vec<&Vec<u8>> = joins.collect();
    let mut m = vec![JOIN_BATCH];
    m.extend_from_slice(&(joins.len() as u32).to_le_bytes());
    for j in joins {
        m.extend_from_slice(&(j.len() as u32).to_le_bytes());
        m.extend_from_slice(j);
    }
    m
}

/// Reads a batch of joins: the join messages, or `None` if malformed.
pub(super) fn parse_batch(frame: &[u8]) -> Option<Vec<&[u8]>> {
    let mut r = frame;
    if take(&mut r, 1)? != [JOIN_BATCH] {
        return None;
    }
    let count = take_u32(&mut r)? as usize;
    let mut joins = Vec::with_capacity(count.min(1 << 16));
    for _ in 0..count {
        let len = take_u32(&mut r)? as usize;
        joins.push(take(&mut r, len)?);
    }
    r.is_empty().then_some(joins)
}

/// Rank 0's answer to a leader: `(rank, answer)` for each rank of its host.
fn parse_host_answer(frame: &[u8]) -> Option<Vec<(usize, &[u8])>> {
    let mut r = frame;
    if take(&mut r, 1)? != [TABLE_HOST] {
        return None;
    }
    let count = take_u32(&mut r)? as usize;
    let mut out = Vec::with_capacity(count.min(1 << 16));
    for _ in 0..count {
        let rank = take_u32(&mut r)? as usize;
        let len = take_u32(&mut r)? as usize;
        out.push((rank, take(&mut r, len)?));
    }
    r.is_empty().then_some(out)
}

impl Bootstrap {
    /// A host leader's side of the rendezvous: accepts its members on `listener` while it
    /// joins rank 0 for itself and them, hands each member its part of rank 0's answer, and
    /// returns its own.
    pub(super) fn init_leader(
        &mut self,
        listener: UnixListener,
        me: &PeerInfo,
        port: u16,
        deadline: Instant,
        cfg: &Config,
    ) -> Result<Answer> {
        let keys = Keys {
            secret: self.secret,
            purpose: Purpose::Rendezvous,
            tag: self.comm_tag(),
            rank: self.rank,
        };
        let arrivals = Mutex::new(Arrivals::default());
        let cancel = AtomicBool::new(false);
        let own = self.join_message(me, port);
        let this = &*self;
        let led = std::thread::scope(|sc| {
            let accepter = sc.spawn(|| {
                let mut adm = LocalAdmit {
                    leader: keys.rank,
                    arrivals: &arrivals,
                };
                let res = accept::accept_loop(
                    &listener,
                    deadline + MEMBER_GRACE,
                    &cancel,
                    &keys,
                    &mut adm,
                );
                // Nothing more joins through this leader: free the name.
                drop(listener);
                res
            });
            let led = this.lead(&own, &arrivals, deadline, cfg);
            cancel.store(true, Ordering::SeqCst);
            let _ = accepter.join();
            led
        });
        let Arrivals {
            members, accepted, ..
        } = arrivals.into_inner().unwrap_or_else(|p| p.into_inner());
        self.traffic.local_accepts = accepted;
        let (stream, answer, batches) = match led {
            Ok(x) => x,
            Err(e) => {
                // Members wait on this leader: tell them why it failed.
                let msg = match super::mesh::blame(&e) {
                    Some(r) => report(&[TABLE_LOST], r, &e.to_string()),
                    None => {
                        let mut m = vec![TABLE_LEADER_FAILED];
                        m.extend_from_slice(e.to_string().as_bytes());
                        m
                    }
                };
                tell_members(&members, usize::MAX, &msg);
                return Err(e);
            }
        };
        self.traffic.rendezvous_sent = batches;
        self.traffic.rendezvous_received = 1;
        let Some(parts) = parse_host_answer(&answer) else {
            // A failure (or something malformed): every member gets it as it is.
            tell_members(&members, usize::MAX, &answer);
            self.parse_answer(&answer, 0)?;
            return Err(self.proto(0, "init", "rank 0 answered a host leader as a single rank"));
        };
        let Some(&(_, own)) = parts.iter().find(|(r, _)| *r == self.rank) else {
            let e = self.proto(
                0,
                "init",
                "rank 0's answer to this host has none for its leader",
            );
            tell_members(
                &members,
                usize::MAX,
                &report(&[TABLE_LOST], 0, &e.to_string()),
            );
            return Err(e);
        };
        for (i, (r, s)) in members.iter().enumerate() {
            let Some(&(_, part)) = parts.iter().find(|(p, _)| p == r) else {
                // Cannot happen: rank 0 answered once every rank had joined, this one too.
                continue;
            };
            let sent =
                set_unix_timeouts(s, self.timeout).and_then(|_| auth::write_frame(&mut &*s, part));
            if let Err(e) = sent {
                // Rank r died after joining: as rank 0 does, tell those answered already that
                // it is r (they read it as a failure report), and those not yet answered.
                let err = self.lost(*r, "init", e);
                let text = err.to_string();
                let as_exchange = report(&SEQ_LOST.to_le_bytes(), *r, &text);
                let _ = stream.set_write_timeout(Some(Duration::from_millis(500)));
                let _ = auth::write_frame(&mut &stream, &as_exchange);
                let (below, above) = members.split_at(i);
                tell_members(below, *r, &as_exchange);
                tell_members(above, *r, &report(&[TABLE_LOST], *r, &text));
                return Err(err);
            }
        }
        self.traffic.rendezvous_sent += members.len() as u64;
        let own = self.parse_answer(own, 0)?;
        super::set_timeouts(&stream, self.timeout).map_err(|e| self.lost(0, "init", e))?;
        self.links = Links::Member(stream);
        self.local = members;
        self.leads = true;
        tracing::debug!(
            rank = self.rank,
            members = self.local.len(),
            batches,
            "bootstrap: led this host's ranks into the rendezvous"
        );
        Ok(own)
    }

    /// The leader's main thread until rank 0 answers: dials rank 0, sends it the joins in
    /// batches, and watches its members' connections. Returns the connection to rank 0,
    /// rank 0's answer and the number of batches sent.
    fn lead(
        &self,
        own: &[u8],
        arrivals: &Mutex<Arrivals>,
        deadline: Instant,
        cfg: &Config,
    ) -> Result<(TcpStream, Vec<u8>, u64)> {
        let (stream, start) = self.dial_root(deadline, cfg)?;
        let answer_by = deadline + MEMBER_GRACE;
        let send = |m: &[u8]| -> Result<()> {
            let _ = stream.set_write_timeout(Some(
                answer_by
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1)),
            ));
            auth::write_frame(&mut &stream, m).map_err(|e| self.lost(0, "init", e))
        };
        let mut sent = {
            let a = arrivals.lock().unwrap_or_else(|p| p.into_inner());
            send(&batch(std::iter::once(&own.to_vec()).chain(&a.joins)))?;
            a.joins.len()
        };
        let mut batches = 1u64;
        let mut gap = FIRST_GAP;
        let mut last = Instant::now();
        let mut next_report = cfg.startup_report.map(|p| start + p);
        loop {
            let now = Instant::now();
            if now >= answer_by {
                return Err(self.rz_err(format!(
                    "rank 0 did not answer this host's leader within {:?}: some rank has not joined",
                    self.timeout
                )));
            }
            if readable_within(&stream, answer_by.saturating_duration_since(now).min(gap)) {
                let _ = stream.set_read_timeout(Some(
                    answer_by
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1)),
                ));
                let answer =
                    auth::read_frame(&mut &stream, super::MAX_FRAME).map_err(|e| {
                        match e.kind() {
                            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => {
                                self.rz_err(format!(
                            "rank 0 did not send its answer within {:?}: some rank has not joined",
                            self.timeout
                        ))
                            }
                            _ => self.lost(0, "init", e),
                        }
                    })?;
                return Ok((stream, answer, batches));
            }
            // (The lock is not held while writing to rank 0: the accepting thread needs it.)
            let now = Instant::now();
            let (dead, due, members) = {
                let a = arrivals.lock().unwrap_or_else(|p| p.into_inner());
                // A member has nothing to send before its answer: a readable connection
                // closed.
                let conns: Vec<(usize, &UnixStream)> =
                    a.members.iter().map(|(r, s)| (*r, s)).collect();
                let dead = crate::net::readable_now(&conns).first().map(|&(r, s)| {
                    let gone = match peek1(s) {
                        Ok(0) => "closed its connection".to_string(),
                        Ok(_) => "sent data before the rendezvous completed".to_string(),
                        Err(e) => format!("lost its connection ({e})"),
                    };
                    (r, gone)
                });
                let due = (a.joins.len() > sent && now >= last + gap)
                    .then(|| (batch(a.joins[sent..].iter()), a.joins.len()));
                (dead, due, a.members.len())
            };
            if let Some((r, gone)) = dead {
                let err = Error::PeerLost {
                    rank: self.rank,
                    peer: r,
                    call: "init",
                    seq: 0,
                    reason: format!(
                        "rank {r} joined the rendezvous through this host's leader (rank {}) and then {gone} before rank 0 answered; it died or was stopped",
                        self.rank
                    ),
                };
                let _ = send(&report(&[HOST_LOST], r, &err.to_string()));
                return Err(err);
            }
            if let Some((msg, upto)) = due {
                send(&msg)?;
                sent = upto;
                batches += 1;
                last = now;
                gap = (gap * 2).min(MAX_GAP);
            }
            if let (Some(at), Some(every)) = (next_report, cfg.startup_report) {
                if now >= at {
                    next_report = Some(now + every);
                    crate::base::debug::announce(&format!(
                        "rank {}: leads {members} other rank(s) of this host into the rendezvous at {}, joined {:.0?} ago; rank 0 is still waiting for other ranks",
                        self.rank,
                        self.root,
                        start.elapsed()
                    ));
                }
            }
        }
    }

    /// Tells rank 0 (a connection of its own, a short bounded dial; best effort) that rank
    /// `lost` died during the rendezvous, as `e` says.
    fn report_to_root(&self, lost: usize, e: &Error, deadline: Instant) {
        let by = deadline.min(Instant::now() + Duration::from_secs(1));
        let dial = crate::net::dial::Dial {
            addr: self.root,
            secret: &self.secret,
            hello: Hello {
                rank: self.rank,
                purpose: Purpose::Rendezvous,
                tag: self.comm_tag(),
            },
            deadline: by,
            first_pause: Duration::from_millis(10),
            max_pause: Duration::from_millis(100),
            refused_limit: Some(Duration::from_millis(200)),
            connect: |a, t| TcpStream::connect_timeout(&a, t),
            stop: None,
        };
        if let Ok(s) = dial.run(|_, _| {}, |g| self.rz_err(g.last_err)) {
            let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
            let _ = auth::write_frame(&mut &s, &report(&[HOST_LOST], lost, &e.to_string()));
        }
    }

    /// A member's side of the rendezvous through its host's leader on `s`: proves the secret,
    /// sends its join, and returns rank 0's answer as the leader passes it on. `Ok(None)`
    /// when the socket fails before the join is sent (its owner is not this communicator's
    /// leader, or died): the rank then joins rank 0 itself.
    pub(super) fn init_via_leader(
        &mut self,
        s: UnixStream,
        me: &PeerInfo,
        port: u16,
        deadline: Instant,
    ) -> Result<Option<Answer>> {
        let rank = self.rank;
        let hello = Hello {
            rank,
            purpose: Purpose::Rendezvous,
            tag: self.comm_tag(),
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let shaken = set_unix_timeouts(&s, auth::HANDSHAKE_TIMEOUT.min(left))
            .map_err(|e| e.to_string())
            .and_then(|_| {
                auth::client_handshake(
                    &mut &s,
                    &self.secret,
                    &hello,
                    rank,
                    "the host leader's socket",
                )
                .map_err(|e| e.to_string())
            })
            .and_then(|_| auth::read_frame(&mut &s, 8).map_err(|e| e.to_string()))
            .and_then(|who| {
                let mut r = &who[..];
                match (take_u32(&mut r), take_u32(&mut r)) {
                    (Some(l), Some(pid)) if r.is_empty() => Ok((l as usize, pid)),
                    _ => Err("malformed greeting".into()),
                }
            })
            .and_then(|who| {
                auth::write_frame(&mut &s, &self.join_message(me, port))
                    .map(|_| who)
                    .map_err(|e| e.to_string())
            });
        let (leader, pid) = match shaken {
            Ok(w) => w,
            Err(e) => {
                tracing::debug!(
                    rank,
                    "the host leader's socket failed before this rank's join ({e}); joining rank 0 directly"
                );
                return Ok(None);
            }
        };
        let by = deadline + MEMBER_GRACE + LEADER_GRACE;
        let _ = s.set_read_timeout(Some(
            by.saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        ));
        if let Some(every) = self.report_every {
            let start = Instant::now();
            super::await_readable(&s, by, every, &|_| {
                format!(
                    "rank {rank}: joined the rendezvous at {} through this host's leader, rank {leader}, {:.0?} ago; rank 0 is still waiting for other ranks",
                    self.root,
                    start.elapsed()
                )
            });
        }
        let answer = auth::read_frame(&mut &s, super::MAX_FRAME).map_err(|e| match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Error::Timeout {
                rank,
                call: "init",
                seq: 0,
                waiting_on: vec![leader],
                elapsed: self.timeout,
            },
            _ => {
                let how = match e.kind() {
                    io::ErrorKind::UnexpectedEof => "closed its connection".to_string(),
                    _ => format!(
                        "lost its connection ({})",
                        crate::base::error::describe_io(&e)
                    ),
                };
                let e = Error::PeerLost {
                    rank,
                    peer: leader,
                    call: "init",
                    seq: 0,
                    reason: format!(
                        "rank {leader} (pid {pid}), this host's leader for the rendezvous, {how} before rank 0's answer came: it died or was stopped"
                    ),
                };
                // Rank 0 may not know it (the leader may have died before joining it): tell
                // rank 0, which then fails at once naming it to every rank.
                self.report_to_root(leader, &e, deadline);
                e
            }
        })?;
        if answer.first() == Some(&TABLE_LEADER_FAILED) {
            return Err(self.rz_err(format!(
                "this host's leader for the rendezvous, rank {leader}, failed: {}",
                String::from_utf8_lossy(&answer[1..])
            )));
        }
        let own = self.parse_answer(&answer, leader)?;
        set_unix_timeouts(&s, self.timeout).map_err(|e| self.lost(leader, "init", e))?;
        self.links = Links::Via(leader, s);
        Ok(Some(own))
    }
}
