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

pub(crate) mod carry;
pub(crate) mod env;
mod host;
pub mod local;
mod mesh;
mod relay;
mod root_join;
pub(crate) mod topo;
mod unique_id;

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

pub(crate) use env::LaunchEnv;
pub(crate) use unique_id::park as park_listener;
pub(crate) use unique_id::parse_secret_hex;
pub use unique_id::{default_ip, UniqueId};

use crate::base::error::{Error, Result};
use crate::base::param::Config;
use crate::net::accept;
use crate::net::auth::{self, Deadlined, Hello, Purpose};
use crate::net::dial::{Dial, GaveUp};
use root_join::RootJoin;

/// The most ranks a communicator may have; larger world sizes are an
/// [`Error::InvalidArgument`] (or [`Error::Env`] from a launcher's variables).
pub(crate) const MAX_WORLD_SIZE: usize = 1 << 16;
/// Largest frame a rank accepts on a bootstrap connection (an allgather result).
pub(crate) const MAX_FRAME: usize = 256 << 20;
/// Largest join message (a [`PeerInfo`]) rank 0 accepts.
const MAX_JOIN: usize = 64 << 10;
/// Longest host id or host name a [`PeerInfo`] may carry.
const MAX_NAME: usize = 4096;
const JOIN_VERSION: u8 = 2;

/// What each rank tells the others at rendezvous.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The rank.
    pub rank: usize,
    /// Host identity: ranks with equal host ids share memory (see [`crate::bootstrap::topo`]).
    pub host_id: String,
    /// Host name, for messages.
    pub hostname: String,
    /// Process id, for messages and liveness checks of shared-memory peers.
    pub pid: u32,
    /// The address this rank's data connections listen on (the interface that routes to the
    /// rendezvous, or `OXCCL_SOCKET_IFNAME`'s).
    pub ip: IpAddr,
}

impl PeerInfo {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.rank as u32).to_le_bytes());
        out.extend_from_slice(&self.pid.to_le_bytes());
        encode_ip(self.ip, out);
        for s in [&self.host_id, &self.hostname] {
            let b = &s.as_bytes()[..s.len().min(MAX_NAME)];
            out.extend_from_slice(&(b.len() as u16).to_le_bytes());
            out.extend_from_slice(b);
        }
    }

    /// Reads what `encode` wrote; `None` for anything malformed.
    pub fn decode(r: &mut &[u8]) -> Option<PeerInfo> {
        let rank = take_u32(r)? as usize;
        let pid = take_u32(r)?;
        let ip = decode_ip(r)?;
        let mut strs = [String::new(), String::new()];
        for s in &mut strs {
            let len = u16::from_le_bytes(take(r, 2)?.try_into().ok()?) as usize;
            *s = String::from_utf8(take(r, len)?.to_vec()).ok()?;
        }
        let [host_id, hostname] = strs;
        Some(PeerInfo {
            rank,
            host_id,
            hostname,
            pid,
            ip,
        })
    }
}

/// Parses a join message (what each rank sends rank 0): version, world size, [`PeerInfo`],
/// the port of the rank's exchange listener (`u16`, 0 in a world of one).
pub(crate) fn parse_join(join: &[u8]) -> Option<(usize, PeerInfo, u16)> {
    let mut r = join;
    if take(&mut r, 1)?[0] != JOIN_VERSION {
        return None;
    }
    let ws = take_u32(&mut r)? as usize;
    let info = PeerInfo::decode(&mut r)?;
    let port = u16::from_le_bytes(take(&mut r, 2)?.try_into().ok()?);
    r.is_empty().then_some((ws, info, port))
}

fn take<'a>(r: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if r.len() < n {
        return None;
    }
    let (a, b) = r.split_at(n);
    *r = b;
    Some(a)
}

fn take_u32(r: &mut &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(take(r, 4)?.try_into().ok()?))
}

fn take_u64(r: &mut &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(take(r, 8)?.try_into().ok()?))
}

/// Writes an address as a family byte (4 or 6) and 16 address bytes.
pub(crate) fn encode_ip(ip: IpAddr, out: &mut Vec<u8>) {
    let mut b = [0u8; 16];
    match ip {
        IpAddr::V4(v) => {
            out.push(4);
            b[..4].copy_from_slice(&v.octets());
        }
        IpAddr::V6(v) => {
            out.push(6);
            b.copy_from_slice(&v.octets());
        }
    }
    out.extend_from_slice(&b);
}

/// Reads what [`encode_ip`] wrote.
pub(crate) fn decode_ip(r: &mut &[u8]) -> Option<IpAddr> {
    let fam = take(r, 1)?[0];
    let b: [u8; 16] = take(r, 16)?.try_into().ok()?;
    match fam {
        4 => Some(IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3]))),
        6 => Some(IpAddr::V6(Ipv6Addr::from(b))),
        _ => None,
    }
}

/// This host's identity for deciding who shares memory: `cfg.host_id` (`OXCCL_HOSTID`) if
/// set, else `hostname:boot_id:dev:inode`, where the boot id comes from
/// `/proc/sys/kernel/random/boot_id` and the device and inode are those of `/dev/shm` (so
/// containers with separate `/dev/shm` mounts do not count as one host).
pub fn local_host_id(cfg: &Config) -> String {
    if let Some(h) = &cfg.host_id {
        return h.clone();
    }
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "noboot".into());
    let shm = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/dev/shm")
            .map(|m| format!("{}:{}", m.dev(), m.ino()))
            .unwrap_or_else(|_| "noshm".into())
    };
    format!("{}:{boot}:{shm}", hostname())
}

fn hostname() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

/// The address this rank's data connections should listen on: the first address of the
/// interface `cfg.socket_ifname` names (preferring `toward`'s address family), else the
/// local address of a UDP socket "connected" to `toward` (which picks the route without
/// sending anything; no host name is looked up). An unknown interface name is an
/// [`Error::Env`] listing the interfaces that exist.
pub(crate) fn local_ip(cfg: &Config, toward: SocketAddr) -> Result<IpAddr> {
    if let Some(name) = &cfg.socket_ifname {
        let ifs = if_addrs::get_if_addrs().map_err(|e| {
            Error::Env(format!(
                "OXCCL_SOCKET_IFNAME={name}: cannot list network interfaces: {e}"
            ))
        })?;
        let mine: Vec<IpAddr> = ifs
            .iter()
            .filter(|i| &i.name == name)
            .map(|i| i.ip())
            .collect();
        return mine.iter().find(|ip| ip.is_ipv4() == toward.is_ipv4()).or(mine.first()).copied().ok_or_else(|| {
            let mut names: Vec<&str> = ifs.iter().map(|i| i.name.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            Error::Env(format!("OXCCL_SOCKET_IFNAME={name}: no such interface with an address; this host has: {}", names.join(", ")))
        });
    }
    let bind: SocketAddr = if toward.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let probe = || -> io::Result<IpAddr> {
        let s = UdpSocket::bind(bind)?;
        s.connect(toward)?;
        Ok(s.local_addr()?.ip())
    };
    match probe() {
        Ok(ip) if !ip.is_unspecified() => Ok(ip),
        Ok(_) => Ok(if toward.is_ipv4() {
            Ipv4Addr::LOCALHOST.into()
        } else {
            Ipv6Addr::LOCALHOST.into()
        }),
        Err(e) => Err(Error::Env(format!(
            "no route to {toward} to pick a local address ({e}); set OXCCL_SOCKET_IFNAME"
        ))),
    }
}

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

    fn bind_root(&self) -> Result<TcpListener> {
        if let Some(l) = unique_id::take_parked(self.root) {
            return Ok(l);
        }
        if self.root.port() == 0 {
            return Err(self.rz_err("the rendezvous address has port 0 and no listener of UniqueId::new in this process"));
        }
        let bind = |addr: SocketAddr| -> io::Result<TcpListener> {
            let s = socket2::Socket::new(
                socket2::Domain::for_address(addr),
                socket2::Type::STREAM,
                None,
            )?;
            s.set_reuse_address(true)?;
            s.bind(&addr.into())?;
            s.listen(accept::LISTEN_BACKLOG)?;
            Ok(s.into())
        };
        match bind(self.root) {
            Ok(l) => Ok(l),
            Err(e) if e.kind() == io::ErrorKind::AddrNotAvailable => {
                let any: IpAddr = if self.root.is_ipv4() {
                    Ipv4Addr::UNSPECIFIED.into()
                } else {
                    Ipv6Addr::UNSPECIFIED.into()
                };
                tracing::warn!(
                    "rank 0: {} is not an address of this host; listening on {any}:{} instead",
                    self.root.ip(),
                    self.root.port()
                );
                bind(SocketAddr::new(any, self.root.port())).map_err(|source| Error::Io {
                    rank: 0,
                    context: format!("binding the rendezvous port {}", self.root.port()),
                    source,
                })
            }
            Err(source) => Err(Error::Io {
                rank: 0,
                context: format!("binding the rendezvous address {}", self.root),
                source,
            }),
        }
    }

    /// Rank 0's side of the rendezvous: admits every rank, then answers each with the peer
    /// table (exchanges through rank 0) or with the addresses it dials for the direct
    /// exchanges; returns its own.
    fn init_root(
        &mut self,
        me: PeerInfo,
        port: u16,
        exchange_listener: &mut Option<TcpListener>,
        deadline: Instant,
        cfg: &Config,
    ) -> Result<Answer> {
        let n = self.world_size;
        let my_ip = me.ip;
        let listener = self.bind_root()?;
        let mut join = RootJoin {
            world: n,
            root: self.root,
            conns: (0..n).map(|_| None).collect(),
            infos: vec![None; n],
            ports: vec![0; n],
            via: vec![usize::MAX; n],
            leader: vec![false; n],
            accepts: 0,
            messages: 0,
            joined: 1,
            offender: None,
            start: Instant::now(),
            report_every: cfg.startup_report,
            next_report: None,
        };
        join.infos[0] = Some(me);
        join.ports[0] = port;
        join.next_report = cfg.startup_report.map(|p| join.start + p);
        if n > 1 {
            let keys = accept::Keys {
                secret: self.secret,
                purpose: Purpose::Rendezvous,
                tag: self.comm_tag(),
                rank: 0,
            };
            let res = accept::accept_loop(
                &listener,
                deadline,
                &std::sync::atomic::AtomicBool::new(false),
                &keys,
                &mut join,
            );
            let err = match res {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(accept::AcceptStop::Deadline(strangers)) => {
                    let missing = join.missing();
                    Some(match strangers.summary() {
                        None => Error::Timeout {
                            rank: 0,
                            call: "init",
                            seq: 0,
                            waiting_on: missing,
                            elapsed: self.timeout,
                        },
                        Some(s) => self.rz_err(format!(
                            "init timed out after {:?}, still waiting on rank(s) {}; {s}",
                            self.timeout,
                            crate::base::error::rank_list(&missing)
                        )),
                    })
                }
                Err(accept::AcceptStop::Io(source)) => Some(Error::Io {
                    rank: 0,
                    context: format!("accepting on the rendezvous address {}", self.root),
                    source,
                }),
            };
            if let Some(e) = err {
                // Tell everyone who joined (and the offender) why the rendezvous failed.
                let mut msg = vec![1u8];
                msg.extend_from_slice(e.to_string().as_bytes());
                for s in join
                    .conns
                    .iter_mut()
                    .flatten()
                    .chain(join.offender.as_mut())
                {
                    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
                    let _ = auth::write_frame(s, &msg);
                }
                // Ranks that have not joined yet would find nothing listening and blame
                // rank 0: for a little while, answer them with the same news.
                let linger = ROOT_LINGER.min(deadline.saturating_duration_since(Instant::now()));
                if !join.missing().is_empty() && !linger.is_zero() {
                    let mut tell = |_: Hello, s: TcpStream, _: SocketAddr| -> Result<bool> {
                        let mut d = Deadlined::new(&s, Instant::now() + Duration::from_secs(1));
                        let _ = auth::send_verdict(&mut d, auth::Verdict::Accepted)
                            .and_then(|_| auth::read_frame(&mut d, host::MAX_BATCH))
                            .and_then(|_| auth::write_frame(&mut d, &msg));
                        Ok(false)
                    };
                    let _ = accept::accept_loop(
                        &listener,
                        Instant::now() + linger,
                        &std::sync::atomic::AtomicBool::new(false),
                        &keys,
                        &mut tell,
                    );
                }
                return Err(e);
            }
            drop(listener);
        }
        let RootJoin {
            mut conns,
            infos,
            mut ports,
            via,
            leader,
            accepts,
            messages,
            ..
        } = join;
        self.traffic.rendezvous_accepts = accepts;
        self.traffic.rendezvous_received = messages;
        // Through rank 0 up to OXCCL_BOOTSTRAP_RELAY_MAX ranks, or when a rank has no
        // exchange listener (its setting differs from rank 0's). Ranks that joined through
        // their host's leader exchange directly (their setting said so; the leader cannot
        // relay the exchanges).
        let unready: Vec<usize> = (1..n).filter(|&r| ports[r] == 0).collect();
        let led: Vec<usize> = (1..n).filter(|&r| via[r] != r).collect();
        let no_listener = &unready;
        if !led.is_empty() && !no_listener.is_empty() {
            let e = self.rz_err(format!(
                "rank(s) {} joined through their host's leader for exchanges directly between \
                 ranks, rank(s) {} without an exchange listener for exchanges through rank 0: \
                 set OXCCL_BOOTSTRAP_RELAY_MAX alike on every rank",
                crate::base::error::rank_list(&led),
                crate::base::error::rank_list(no_listener)
            ));
            let mut msg = vec![1u8];
            msg.extend_from_slice(e.to_string().as_bytes());
            tell_all(&mut conns, usize::MAX, &msg);
            return Err(e);
        }
        let relay =
            n == 1 || (led.is_empty() && (n <= cfg.bootstrap_relay_max || !unready.is_empty()));
        if !relay && ports[0] == 0 {
            // Ranks joined through their host's leader (their setting says direct, rank 0's
            // says through rank 0): follow them, with an exchange listener made now.
            let l = mesh::listen(my_ip).map_err(|source| Error::Io {
                rank: 0,
                context: format!("listening on {my_ip} for the bootstrap's exchange links"),
                source,
            })?;
            ports[0] = l.local_addr().map(|a| a.port()).unwrap_or(0);
            *exchange_listener = Some(l);
            tracing::warn!(
                "rank 0: {n} ranks exchange directly although OXCCL_BOOTSTRAP_RELAY_MAX is {} \
                 here: rank(s) {} joined through their host's leader (set the variable alike on \
                 every rank)",
                cfg.bootstrap_relay_max,
                crate::base::error::rank_list(&led)
            );
        }
        if relay && n > cfg.bootstrap_relay_max && n > 1 {
            tracing::warn!(
                "rank 0: {n} ranks exchange through rank 0 although OXCCL_BOOTSTRAP_RELAY_MAX \
                 is {} here: rank(s) {} joined without an exchange listener (set the variable \
                 alike on every rank)",
                cfg.bootstrap_relay_max,
                crate::base::error::rank_list(&unready)
            );
        }
        let peers: Vec<PeerInfo> = infos.into_iter().flatten().collect();
        let addrs: Vec<SocketAddr> = peers
            .iter()
            .zip(&ports)
            .map(|(i, &port)| SocketAddr::new(i.ip, port))
            .collect();
        let mut table = Vec::new();
        if relay {
            for p in &peers {
                p.encode(&mut table);
            }
        }
        let rounds = if relay { 0 } else { mesh::rounds(n) };
        if 1 + 4 + table.len() + 4 + self.root_says.len() + 19 * rounds > MAX_FRAME {
            return Err(self.rz_err(if relay {
                "the peer table exceeds the bootstrap frame limit"
            } else {
                "rank 0's settings exceed the bootstrap frame limit"
            }));
        }
        // Each rank's answer: the peer table (through rank 0), or the addresses of the ranks
        // it sends to, one per round (O(log n) bytes, not the whole peer table: that is the
        // first exchange); then rank 0's settings.
        let answer = |r: usize| {
            if relay {
                let mut a = vec![TABLE_RELAY];
                a.extend_from_slice(&(n as u32).to_le_bytes());
                a.extend_from_slice(&table);
                a.extend_from_slice(&(self.root_says.len() as u32).to_le_bytes());
                a.extend_from_slice(&self.root_says);
                return a;
            }
            let mut a = vec![0u8];
            a.extend_from_slice(&(n as u32).to_le_bytes());
            for k in 0..mesh::rounds(n) {
                let to = addrs[mesh::sends_to(r, k, n)];
                encode_ip(to.ip(), &mut a);
                a.extend_from_slice(&to.port().to_le_bytes());
            }
            a.extend_from_slice(&(self.root_says.len() as u32).to_le_bytes());
            a.extend_from_slice(&self.root_says);
            a
        };
        // A host leader's answer: every rank's that joined through it, the leader's first.
        let host_answer = |l: usize| {
            let ranks: Vec<usize> = std::iter::once(l)
                .chain((1..n).filter(|&r| r != l && via[r] == l))
                .collect();
            let mut a = vec![host::TABLE_HOST];
            a.extend_from_slice(&(ranks.len() as u32).to_le_bytes());
            for r in ranks {
                let one = answer(r);
                a.extend_from_slice(&(r as u32).to_le_bytes());
                a.extend_from_slice(&(one.len() as u32).to_le_bytes());
                a.extend_from_slice(&one);
            }
            a
        };
        let mut answers = 0u64;
        let mut answer_bytes = 0u64;
        for r in 0..conns.len() {
            if let Some(s) = &mut conns[r] {
                let a = if leader[r] { host_answer(r) } else { answer(r) };
                answers += 1;
                answer_bytes += 4 + a.len() as u64;
                if let Err(e) = set_timeouts(s, self.timeout).and_then(|_| auth::write_frame(s, &a))
                {
                    let err = self.lost(r, "init", e);
                    // Rank r died after joining: tell the others that it is r, not rank 0.
                    // Those below r have their answer and read this as the answer to their
                    // first exchange (through rank 0) or while they make their exchange
                    // links; those above still wait for it.
                    let mut report = (r as u32).to_le_bytes().to_vec();
                    report.extend_from_slice(err.to_string().as_bytes());
                    let mut as_exchange = SEQ_LOST.to_le_bytes().to_vec();
                    as_exchange.extend_from_slice(&report);
                    let mut as_table = vec![TABLE_LOST];
                    as_table.extend_from_slice(&report);
                    let (below, above) = conns.split_at_mut(r);
                    tell_all(below, r, &as_exchange);
                    tell_all(above, 0, &as_table);
                    return Err(err);
                }
            }
        }
        self.links = Links::Root(conns);
        self.root_leaders = leader.iter().map(|&l| AtomicBool::new(l)).collect();
        self.traffic.rendezvous_sent = answers;
        tracing::debug!(
            rank = 0,
            accepted = accepts,
            join_messages = messages,
            answers,
            answer_bytes,
            host_leaders = (1..n).filter(|&r| leader[r]).count(),
            "bootstrap rendezvous at rank 0 (connections accepted, join messages read, answers sent)"
        );
        if relay {
            return Ok(Answer::Table(peers));
        }
        Ok(Answer::Direct(
            (0..rounds)
                .map(|k| addrs[mesh::sends_to(0, k, n)])
                .collect(),
        ))
    }

    /// This rank's join message: version, world size, [`PeerInfo`], exchange listener port.
    fn join_message(&self, me: &PeerInfo, port: u16) -> Vec<u8> {
        let mut join = vec![JOIN_VERSION];
        join.extend_from_slice(&(self.world_size as u32).to_le_bytes());
        me.encode(&mut join);
        join.extend_from_slice(&port.to_le_bytes());
        join
    }

    /// Dials rank 0's rendezvous and proves the secret, retrying until `deadline`; returns
    /// the connection and when the dial began.
    fn dial_root(&self, deadline: Instant, cfg: &Config) -> Result<(TcpStream, Instant)> {
        let addr = self.root.to_string();
        let hello = Hello {
            rank: self.rank,
            purpose: Purpose::Rendezvous,
            tag: self.comm_tag(),
        };
        let start = Instant::now();
        let mut next_report = cfg.startup_report.map(|p| start + p);
        let refused_limit = cfg.rendezvous_refused.min(self.timeout);
        let dial = Dial {
            addr: self.root,
            secret: &self.secret,
            hello,
            deadline,
            first_pause: Duration::from_millis(20),
            max_pause: Duration::from_millis(500),
            refused_limit: Some(refused_limit),
            connect: |a, t| TcpStream::connect_timeout(&a, t),
            stop: None,
        };
        let report = |now: Instant, last_err: &str| {
            if let (Some(at), Some(every)) = (next_report, cfg.startup_report) {
                if now >= at {
                    next_report = Some(now + every);
                    crate::base::debug::announce(&format!(
                        "rank {}: still cannot join the rendezvous at {addr} after {:.0?} ({last_err}); waiting for rank 0 up to OXCCL_TIMEOUT={:?}",
                        self.rank,
                        now - start,
                        self.timeout
                    ));
                }
            }
        };
        let give_up = |g: GaveUp| {
            let reason = if g.refused_for.is_some() {
                format!(
                    "{} for {:.0?} (OXCCL_RENDEZVOUS_REFUSED_SECS): nothing listens there; rank 0 is not running (it died, or was never started) or the address is wrong",
                    g.last_err, refused_limit
                )
            } else {
                g.last_err
            };
            Error::Connect {
                rank: self.rank,
                peer: 0,
                addr: addr.clone(),
                // Whole milliseconds: "3.203s", not "3.203556031s".
                timeout: Duration::from_millis((g.at - start).as_millis() as u64),
                reason,
            }
        };
        Ok((dial.run(report, give_up)?, start))
    }

    /// A member's side of the rendezvous: joins, and returns rank 0's answer (the peer
    /// table, or the addresses it dials for the direct exchanges).
    fn init_member(
        &mut self,
        me: PeerInfo,
        port: u16,
        deadline: Instant,
        cfg: &Config,
    ) -> Result<Answer> {
        let join = self.join_message(&me, port);
        let (stream, start) = self.dial_root(deadline, cfg)?;
        // Rank 0 gives up at its own deadline and then says why (which rank is missing):
        // wait a little longer than that for its word.
        let deadline = deadline + MEMBER_GRACE;
        let mut d = Deadlined::new(&stream, deadline);
        auth::write_frame(&mut d, &join).map_err(|e| self.lost(0, "init", e))?;
        self.traffic.rendezvous_sent = 1;
        if let Some(every) = cfg.startup_report {
            self.await_table(&stream, deadline, start, every);
        }
        let table = auth::read_frame(&mut d, MAX_FRAME).map_err(|e| match e.kind() {
            // Rank 0 names a rank that has not joined at its own deadline; silent past that
            // and the grace, it is itself stopped or hung (a SIGSTOPped rank 0 whose listener
            // had taken this rank's connection looked like "some rank has not joined").
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Error::PeerLost {
                rank: self.rank,
                peer: 0,
                call: "init",
                seq: self.seq,
                reason: format!(
                    "rank 0 (the rendezvous at {}) took this rank's join and then said nothing for {:?} and {:?} more, not even which rank had not joined, as it does at its deadline: it is stopped or hung",
                    self.root, self.timeout, MEMBER_GRACE
                ),
            },
            _ => self.lost(0, "init", e),
        })?;
        drop(d);
        self.traffic.rendezvous_received = 1;
        let answer = self.parse_answer(&table, 0)?;
        set_timeouts(&stream, self.timeout).map_err(|e| self.lost(0, "init", e))?;
        self.links = Links::Member(stream);
        Ok(answer)
    }

    /// Reads rank 0's answer to this rank's join (from rank `from`: 0, or this host's leader
    /// passing it on): the peer table or the direct exchanges' addresses, and rank 0's
    /// settings ([`root_says`](Self::root_says)); or the error it reports.
    fn parse_answer(&mut self, table: &[u8], from: usize) -> Result<Answer> {
        let mut r = table;
        let relay = match take(&mut r, 1) {
            Some([0]) => false,
            Some([TABLE_RELAY]) => true,
            Some([1]) => {
                return Err(self.rz_err(format!(
                    "rank 0 failed the rendezvous: {}",
                    String::from_utf8_lossy(r)
                )))
            }
            Some([TABLE_LOST]) => return Err(self.lost_report(from, r, "init")),
            _ => return Err(self.proto(from, "init", "malformed peer table")),
        };
        let n = take_u32(&mut r).ok_or_else(|| self.proto(from, "init", "malformed peer table"))?
            as usize;
        if n != self.world_size {
            return Err(self.rz_err(format!(
                "rank 0 has world size {n}, this rank {}",
                self.world_size
            )));
        }
        let mut peers = Vec::new();
        for i in 0..if relay { n } else { 0 } {
            match PeerInfo::decode(&mut r) {
                Some(p) if p.rank == i => peers.push(p),
                _ => return Err(self.proto(from, "init", "malformed peer table")),
            }
        }
        let mut to = Vec::new();
        for _ in 0..if relay { 0 } else { mesh::rounds(n) } {
            let ip = decode_ip(&mut r);
            let port = take(&mut r, 2).map(|p| u16::from_le_bytes([p[0], p[1]]));
            match (ip, port) {
                (Some(ip), Some(port)) => to.push(SocketAddr::new(ip, port)),
                _ => return Err(self.proto(from, "init", "malformed peer table")),
            }
        }
        let says = take_u32(&mut r).and_then(|len| take(&mut r, len as usize));
        match says {
            Some(says) if r.is_empty() => self.root_says = says.to_vec(),
            _ => return Err(self.proto(from, "init", "malformed peer table")),
        }
        Ok(if relay {
            Answer::Table(peers)
        } else {
            Answer::Direct(to)
        })
    }

    /// Waits until rank 0 sends something on `stream` or `deadline` passes, saying every
    /// `every` what it waits for.
    fn await_table(&self, stream: &TcpStream, deadline: Instant, start: Instant, every: Duration) {
        await_readable(stream, deadline, every, &|_| {
            format!(
                "rank {}: joined the rendezvous at {} {:.0?} ago; rank 0 is still waiting for other ranks",
                self.rank,
                self.root,
                start.elapsed()
            )
        });
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

/// How long rank 0, after a failed rendezvous, still answers ranks that join late with the
/// reason (so that they name the rank at fault, not rank 0 which is gone).
const ROOT_LINGER: Duration = Duration::from_secs(2);

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
