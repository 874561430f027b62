//! Bootstrap: how the ranks of a communicator find each other.
//!
//! Rank 0 hosts the rendezvous at the address in the [`UniqueId`] (or `MASTER_ADDR:MASTER_PORT`
//! / `OXCCL_ROOT` under a launcher). Every rank connects to it, proves that it knows the
//! secret ([`auth`]), and sends its [`PeerInfo`] (and, in a large communicator, the port of
//! its exchange listener). The small out-of-band exchanges ([`Exchange::allgather`],
//! [`Exchange::barrier`]) that transports use to set up their links go one of two ways,
//! chosen by rank 0 from the world size and `OXCCL_BOOTSTRAP_RELAY_MAX`:
//! - up to that many ranks, through rank 0 (`relay.rs`): rank 0 answers each join with the
//!   peer table, and each exchange is one round trip to rank 0 (O(n^2) bytes at rank 0, the
//!   fewest connections and messages: small groups start fastest);
//! - above it, directly between ranks (`mesh.rs`): rank 0 answers each join with only the
//!   addresses of the ranks it exchanges with, and the exchanges, the peer table first, are
//!   Bruck's allgather in `ceil(log2 n)` rounds: O(log n) messages and connections and O(n)
//!   bytes per exchange at every rank, rank 0 included.
//!
//! Directly, the ranks of a host other than rank 0 join through one of them, their host's
//! leader (`host.rs`, `OXCCL_BOOTSTRAP_HOST_LEADERS`): rank 0 accepts one connection per
//! host and answers one message per host.
//!
//! The communicator's watchdog takes over what stays open after init: through rank 0, the
//! connections to rank 0 (a star: n-1 at rank 0, one at the others); directly, the exchange
//! links (2 ceil(log2 n) at every rank, rank 0 included), and the connections to rank 0 are
//! closed as soon as the peer table is exchanged.
//!
//! This file holds the [`Bootstrap`], its start ([`Bootstrap::init_saying`]) and the
//! [`Exchange`] trait; rank 0's side of the rendezvous is `root.rs` (with `root_join.rs` for
//! the joins as they come), a rank's own join of rank 0 `member.rs`, what ranks tell each
//! other `peer_info.rs`, and where this rank is (host identity, address) `address.rs`.

mod address;
pub(crate) mod carry;
pub(crate) mod env;
mod host;
pub mod local;
mod member;
mod mesh;
mod peer_info;
mod relay;
mod root;
mod root_join;
pub(crate) mod topo;
mod unique_id;

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use address::hostname;
pub use address::local_host_id;
pub(crate) use address::local_ip;
pub(crate) use env::LaunchEnv;
pub(crate) use peer_info::PeerInfo;
pub(crate) use peer_info::{decode_ip, encode_ip, parse_join};
use peer_info::{take, take_u32, take_u64, JOIN_VERSION, MAX_JOIN, MAX_NAME};
pub(crate) use unique_id::park as park_listener;
pub(crate) use unique_id::parse_secret_hex;
pub use unique_id::{default_ip, UniqueId};

use crate::base::error::{Error, Result};
use crate::base::param::Config;
use crate::net::auth;

/// The most ranks a communicator may have; larger world sizes are an
/// [`Error::InvalidArgument`] (or [`Error::Env`] from a launcher's variables).
pub(crate) const MAX_WORLD_SIZE: usize = 1 << 16;
/// Largest frame a rank accepts on a bootstrap connection (an allgather result).
pub(crate) const MAX_FRAME: usize = 256 << 20;

/// Out-of-band exchange between the ranks of a communicator: what transports use to set up
/// their links. `Bootstrap` implements it over TCP; [`local::LocalExchange`] over threads,
/// for tests.
pub trait Exchange: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world_size(&self) -> usize;
    /// Every rank contributes `mine`; every rank gets all contributions, indexed by rank.
    /// Collective: every rank must call it, in the same order as the others.
    fn allgather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<()> {
        self.allgather(&[]).map(|_| ())
    }
}

enum Links {
    /// Rank 0: a connection to every other rank, indexed by rank (`None` at 0).
    Root(Vec<Option<TcpStream>>),
    /// Other ranks: the connection to rank 0.
    Member(TcpStream),
    /// A rank that joined through its host's leader (`host.rs`): the leader's rank and the
    /// connection to it.
    Via(usize, UnixStream),
}

/// A rank's connection to the rendezvous, kept open for out-of-band exchanges.
pub(crate) struct Bootstrap {
    rank: usize,
    world_size: usize,
    peers: Vec<PeerInfo>,
    secret: [u8; 16],
    root: SocketAddr,
    timeout: Duration,
    /// How often a wait on another rank says what it waits for (`OXCCL_STARTUP_REPORT_SECS`).
    report_every: Option<Duration>,
    links: Links,
    seq: u64,
    /// The exchanges this rank has finished (`seq` counts those started).
    finished: u64,
    /// What rank 0 sent with the peer table ([`Bootstrap::init_saying`]).
    root_says: Vec<u8>,
    /// The exchange connections (`mesh.rs`); `None` when the exchanges go through rank 0
    /// (`relay.rs`, and in a world of one) and after
    /// [`take_connections`](Self::take_connections).
    mesh: Option<mesh::Mesh>,
    /// What this rank's exchanges sent, for the `bootstrap traffic` debug line.
    traffic: mesh::Traffic,
    /// Set once the peer table is exchanged: from then on the connections to rank 0 belong
    /// to the watchdogs (which start as each rank's init ends), not to the exchanges.
    joined: bool,
    /// A host leader's connections to the ranks that joined through it (`host.rs`), until
    /// the peer table is exchanged.
    local: Vec<(usize, UnixStream)>,
    /// Set when this rank's host leader said it is done ([`host::SEQ_DONE`]): its
    /// connection closing is then no failure.
    leader_done: AtomicBool,
    /// Whether this rank leads its host's ranks (it tells rank 0 when it is done).
    leads: bool,
    /// Rank 0: by rank, set for each host leader until it says it is done; its connection
    /// closing before that is its death.
    root_leaders: Vec<AtomicBool>,
}

impl std::fmt::Debug for Bootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.debug_struct("Bootstrap")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("root", &self.root)
            .field("comm_tag", &format_args!("{:016x}", self.comm_tag()))
            .finish_non_exhaustive()
    }
}

fn set_timeouts(s: &TcpStream, t: Duration) -> io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(t))?;
    s.set_write_timeout(Some(t))?;
    s.set_nodelay(true)
}

impl Bootstrap {
    /// Joins the rendezvous of `id` as `rank` of `world_size`; blocks until every rank has
    /// joined or `cfg.timeout` passes.
    ///
    /// Rank 0 takes over the listener [`UniqueId::new`] left in this process for `id.addr`,
    /// or binds `id.addr`; it authenticates every connection, refuses strangers and goes on,
    /// and fails with [`Error::Rendezvous`] when two connections claim one rank or a rank
    /// has another world size (telling the ranks already joined). The other ranks connect
    /// with retries until `cfg.timeout`, then fail with [`Error::Connect`].
    #[cfg(test)]
    pub(crate) fn init(
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        cfg: &Config,
    ) -> Result<Bootstrap> {
        Self::init_saying(id, rank, world_size, cfg, &[])
    }

    /// As [`init`](Self::init); rank 0 also sends `says` to every rank with the peer table
    /// (what it says elsewhere is ignored): [`root_says`](Self::root_says), with no exchange
    /// of its own (the communicator's settings, `comm/settings.rs`).
    pub(crate) fn init_saying(
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        cfg: &Config,
        says: &[u8],
    ) -> Result<Bootstrap> {
        if world_size == 0 || rank >= world_size || world_size > MAX_WORLD_SIZE {
            let msg = if world_size > MAX_WORLD_SIZE {
                format!("world size {world_size} is more than the {MAX_WORLD_SIZE} ranks oxccl supports")
            } else {
                format!("rank {rank} is not below world size {world_size}")
            };
            return Err(Error::InvalidArgument {
                rank,
                call: "init",
                seq: 0,
                msg,
            });
        }
        let me = PeerInfo {
            rank,
            host_id: local_host_id(cfg),
            hostname: hostname(),
            pid: std::process::id(),
            ip: local_ip(cfg, id.addr)?,
        };
        if me.host_id.len() > MAX_NAME {
            return Err(Error::Env(format!(
                "OXCCL_HOSTID is longer than {MAX_NAME} bytes"
            )));
        }
        let deadline = Instant::now() + cfg.timeout;
        let mut b = Bootstrap {
            rank,
            world_size,
            peers: Vec::new(),
            secret: id.secret,
            root: id.addr,
            timeout: cfg.timeout,
            report_every: cfg.startup_report,
            links: Links::Root(Vec::new()),
            seq: 0,
            finished: 0,
            root_says: says.to_vec(),
            mesh: None,
            traffic: mesh::Traffic::default(),
            joined: false,
            local: Vec::new(),
            leader_done: AtomicBool::new(false),
            leads: false,
            root_leaders: Vec::new(),
        };
        // Direct exchanges (`mesh.rs`) above OXCCL_BOOTSTRAP_RELAY_MAX ranks. Their listener
        // is open before joining: rank 0 gives its port to the ranks that dial it. Rank 0's
        // setting decides; it relays when a rank joins without a listener, and exchanges
        // directly when a rank joins through its host's leader (`host.rs`).
        let mut listener = if world_size > 1 && world_size > cfg.bootstrap_relay_max {
            Some(mesh::listen(me.ip).map_err(|source| Error::Io {
                rank,
                context: format!("listening on {} for the bootstrap's exchange links", me.ip),
                source,
            })?)
        } else {
            None
        };
        let port = match &listener {
            Some(l) => l.local_addr().map(|a| a.port()).unwrap_or(0),
            None => 0,
        };
        // Directly, the ranks of a host but rank 0 join through one of them (`host.rs`).
        let local = if rank != 0 && listener.is_some() && cfg.bootstrap_host_leaders {
            host::elect(
                &host::leader_name(b.comm_tag(), id.addr, &me.host_id),
                rank,
                deadline,
            )
        } else {
            None
        };
        let answer = match local {
            _ if rank == 0 => b.init_root(me.clone(), port, &mut listener, deadline, cfg)?,
            Some(host::Local::Leader(l)) => b.init_leader(l, &me, port, deadline, cfg)?,
            Some(host::Local::Member(s)) => match b.init_via_leader(s, &me, port, deadline)? {
                Some(a) => a,
                None => b.init_member(me.clone(), port, deadline, cfg)?,
            },
            None => b.init_member(me.clone(), port, deadline, cfg)?,
        };
        // Through rank 0, its answer was the peer table; else the peer table is the first
        // exchange, over the exchange links.
        let table = match (answer, listener) {
            (Answer::Table(t), _) => Ok(t),
            (Answer::Direct(_), None) => Err(b.proto(
                0,
                "init",
                "rank 0 chose direct exchanges, but this rank has no exchange listener",
            )),
            (Answer::Direct(to), Some(l)) => b
                .connect_mesh(l, &to, deadline + MEMBER_GRACE)
                .and_then(|m| {
                    b.mesh = Some(m);
                    let mut mine = Vec::new();
                    me.encode(&mut mine);
                    b.allgather_mesh(&mine, 0, "init")
                })
                .and_then(|all| {
                    all.iter()
                        .enumerate()
                        .map(|(i, m)| match PeerInfo::decode(&mut &m[..]) {
                            Some(p) if p.rank == i => Ok(p),
                            _ => Err(b.proto(i, "init", "malformed peer table entry")),
                        })
                        .collect()
                }),
        };
        match table {
            Ok(t) => {
                b.peers = t;
                b.joined = true;
                if b.mesh.is_some() {
                    // Directly, the rendezvous connections carried failure news only until
                    // now (see `mesh.rs`); the watchdog takes the exchange links. Close them:
                    // nothing stays open at rank 0 per rank. A host leader first tells its
                    // members that it closes for that reason, not because it died.
                    if let (true, Links::Member(s)) = (b.leads, &b.links) {
                        let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
                        let _ = auth::write_frame(&mut &*s, &host::SEQ_DONE.to_le_bytes());
                    }
                    b.links = Links::Root(Vec::new());
                    for (_, s) in std::mem::take(&mut b.local) {
                        let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
                        let _ = auth::write_frame(&mut &s, &host::SEQ_DONE.to_le_bytes());
                    }
                }
            }
            Err(e) => {
                b.spread_failure(&e);
                return Err(e);
            }
        }
        tracing::debug!(
            "rank {rank}/{world_size}: rendezvous at {} complete",
            id.addr
        );
        Ok(b)
    }

    fn rz_err(&self, msg: impl Into<String>) -> Error {
        Error::Rendezvous {
            rank: self.rank,
            addr: self.root.to_string(),
            msg: msg.into(),
        }
    }

    fn proto(&self, peer: usize, call: &'static str, msg: &str) -> Error {
        Error::Protocol {
            rank: self.rank,
            peer,
            call,
            seq: self.seq,
            msg: msg.into(),
        }
    }

    /// Turns an I/O error on the connection to `peer` into the error that says what it means.
    fn lost(&self, peer: usize, call: &'static str, e: io::Error) -> Error {
        match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Error::Timeout {
                rank: self.rank,
                call,
                seq: self.seq,
                waiting_on: vec![peer],
                elapsed: self.timeout,
            },
            io::ErrorKind::InvalidData => self.proto(peer, call, &e.to_string()),
            io::ErrorKind::UnexpectedEof => Error::PeerLost {
                rank: self.rank,
                peer,
                call,
                seq: self.seq,
                reason: "bootstrap connection closed".into(),
            },
            _ => Error::PeerLost {
                rank: self.rank,
                peer,
                call,
                seq: self.seq,
                reason: format!(
                    "bootstrap connection: {}",
                    crate::base::error::describe_io(&e)
                ),
            },
        }
    }

    /// The error for rank `from`'s report that it lost a rank (`rest`: the lost rank as a
    /// `u32`, then `from`'s own error): names the lost rank, not `from`.
    fn lost_report(&self, from: usize, mut rest: &[u8], call: &'static str) -> Error {
        match take_u32(&mut rest) {
            Some(peer) if (peer as usize) < self.world_size && peer as usize != self.rank => {
                Error::PeerLost {
                    rank: self.rank,
                    peer: peer as usize,
                    call,
                    seq: self.seq,
                    reason: format!("rank {from} reports it: {}", String::from_utf8_lossy(rest)),
                }
            }
            _ => self.proto(from, call, "malformed lost-rank report"),
        }
    }

    /// This rank.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub(crate) fn world_size(&self) -> usize {
        self.world_size
    }

    /// Every rank's [`PeerInfo`], indexed by rank.
    pub(crate) fn peers(&self) -> &[PeerInfo] {
        &self.peers
    }

    /// What rank 0 sent with the peer table ([`init_saying`](Self::init_saying)); rank 0's
    /// own `says`.
    pub(crate) fn root_says(&self) -> &[u8] {
        &self.root_says
    }

    /// The communicator's secret (from the [`UniqueId`]).
    pub(crate) fn secret(&self) -> &[u8; 16] {
        &self.secret
    }

    /// A 64-bit tag naming this communicator, derived from its secret (it reveals nothing of
    /// the secret): for naming shared-memory segments and telling communicators apart.
    pub(crate) fn comm_tag(&self) -> u64 {
        auth::comm_tag(&self.secret)
    }

    /// The exchanges this rank has finished. Once it has finished its last, everything it
    /// sends on the connections that stay open is for the peers' watchdogs: they read
    /// nothing else on them.
    pub(crate) fn exchanges_finished(&self) -> u64 {
        self.finished
    }

    /// Hands over the connections that stay open, each with its peer's rank and whether
    /// heartbeats go over it, for the communicator's watchdog (`fault::control`), and
    /// whether they are a graph in which every rank passes failures on (true) or a star
    /// around rank 0 (false). Directly (above `OXCCL_BOOTSTRAP_RELAY_MAX` ranks): the
    /// exchange links, `2 ceil(log2 n)` at every rank (a peer may have two), heartbeats only
    /// over the first round's (the ring of ranks ±1). Through rank 0: the rendezvous
    /// connections, one per other rank at rank 0, the one to rank 0 at the others.
    /// Exchanges are impossible afterwards.
    pub(crate) fn take_connections(&mut self) -> (Vec<(usize, TcpStream, bool)>, bool) {
        let links = std::mem::replace(&mut self.links, Links::Root(Vec::new()));
        if let Some(mesh) = self.mesh.take() {
            let conns: Vec<(usize, TcpStream, bool)> = mesh
                .rounds
                .into_iter()
                .enumerate()
                .flat_map(|(k, rd)| [(rd.to, rd.tx, k == 0), (rd.from, rd.rx, k == 0)])
                .collect();
            tracing::debug!(
                rank = self.rank,
                connections = conns.len(),
                "bootstrap: the watchdog takes the exchange links (a graph; no connection to rank 0 stays open)"
            );
            return (conns, true);
        }
        let conns: Vec<(usize, TcpStream, bool)> = match links {
            Links::Root(conns) => conns
                .into_iter()
                .enumerate()
                .filter_map(|(r, c)| c.map(|c| (r, c, true)))
                .collect(),
            Links::Member(s) => vec![(0, s, true)],
            // (Joined through a host leader: the exchanges were direct, `mesh` above.)
            Links::Via(..) => Vec::new(),
        };
        tracing::debug!(
            rank = self.rank,
            connections = conns.len(),
            "bootstrap: the watchdog takes the rendezvous connections (a star around rank 0)"
        );
        (conns, false)
    }

    /// Whether the watchdog will get a star around rank 0 ([`take_connections`](Self::take_connections)),
    /// not the exchanges' graph.
    pub(crate) fn is_star(&self) -> bool {
        self.mesh.is_none()
    }

    /// Forwards to [`Exchange::allgather`].
    #[cfg(test)]
    pub(crate) fn allgather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        <Self as Exchange>::allgather(self, mine)
    }

    /// Forwards to [`Exchange::barrier`].
    #[cfg(test)]
    pub(crate) fn barrier(&mut self) -> Result<()> {
        <Self as Exchange>::barrier(self)
    }
}

/// Waits until `stream` is readable (or closed) or `deadline` passes, calling
/// `say(waited)` and printing its line every `every` while it waits.
fn await_readable(
    stream: &impl AsFd,
    deadline: Instant,
    every: Duration,
    say: &dyn Fn(Duration) -> String,
) {
    let start = Instant::now();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let wait = left.min(every);
        let mut fds = [rustix::event::PollFd::new(
            stream,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: wait.as_secs() as _,
            tv_nsec: wait.subsec_nanos() as _,
        };
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(0) if !left.is_zero() && wait < left => {
                crate::base::debug::announce(&say(start.elapsed()))
            }
            Err(rustix::io::Errno::INTR) => {}
            _ => return,
        }
    }
}

const CALL: &str = "bootstrap_allgather";

/// First byte of rank 0's answer to a join when a rank died after joining (then the rank as
/// a `u32` and rank 0's error); 0 is the addresses for the direct exchanges, 1 a failed
/// rendezvous, [`TABLE_RELAY`] the peer table.
const TABLE_LOST: u8 = 2;
/// First byte of rank 0's answer to a join that carries the peer table: the exchanges go
/// through rank 0 (`relay.rs`).
const TABLE_RELAY: u8 = 3;

/// Rank 0's answer to a join, as [`Bootstrap::init_root`] and [`Bootstrap::init_member`]
/// return it.
enum Answer {
    /// Exchanges through rank 0; the peer table.
    Table(Vec<PeerInfo>),
    /// Direct exchanges; the address this rank dials in each round.
    Direct(Vec<SocketAddr>),
}
/// The sequence number of rank 0's answer to an exchange when it lost a rank (then the rank
/// as a `u32` and rank 0's error), so that the others name that rank, not rank 0.
const SEQ_LOST: u64 = u64::MAX;
/// Extra time a member waits for rank 0's answer beyond the timeout, so that rank 0, which
/// sees a silent rank first, can name it to everyone before the members give up on rank 0.
const MEMBER_GRACE: Duration = Duration::from_secs(2);

/// Sends `msg` to every connection but `except`'s, each with a short write timeout; errors
/// are ignored (this is the last word before closing).
fn tell_all(conns: &mut [Option<TcpStream>], except: usize, msg: &[u8]) {
    for (r, c) in conns.iter_mut().enumerate() {
        if let (Some(s), true) = (c, r != except) {
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = auth::write_frame(s, msg);
        }
    }
}

impl Exchange for Bootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn allgather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.seq += 1;
        let res = if self.mesh.is_none() {
            self.allgather_relay(mine, self.seq)
        } else {
            let res = self.allgather_mesh(mine, self.seq, CALL);
            if let Err(e) = &res {
                // The ranks this one sends to wait on it: name the rank at fault to them.
                self.spread_failure(e);
            }
            res
        };
        if res.is_ok() {
            self.finished += 1;
        }
        tracing::debug!(
            rank = self.rank,
            exchange = self.seq,
            messages = self.traffic.messages,
            bytes = self.traffic.bytes,
            rendezvous_accepted = self.traffic.rendezvous_accepts,
            rendezvous_received = self.traffic.rendezvous_received,
            rendezvous_sent = self.traffic.rendezvous_sent,
            host_leader_accepted = self.traffic.local_accepts,
            "bootstrap traffic (sent by this rank in its exchanges so far; rendezvous: connections accepted over TCP, messages received and sent; connections accepted as its host's leader)"
        );
        res
    }
}

#[cfg(test)]
mod tests;
