//! The live status agent (`OXCCL_STATUS`), as NCCL's RAS: a running job answers "where is
//! every rank?" on a TCP port, for `oxccl status ADDR` (or `nc`).
//!
//! With `OXCCL_STATUS=PORT` (listening on 127.0.0.1) or `HOST:PORT`, rank 0 listens there;
//! every other rank where it is set listens on an ephemeral port of its data interface, and
//! the ranks learn each other's addresses at init. A process runs one agent per listening
//! address: every later communicator of the process (a split, a shrink) joins it, so one
//! answer covers every communicator of the process.
//!
//! The protocol is one request line, one answer line (and, when the request carried a nonce,
//! a second line `mac HEX`), then the connection closes:
//!
//! - `status [NONCE]`: the whole job, gathered by the asked rank from every rank's agent: per
//!   rank whether it answered, its current call and sequence number, its last completed one,
//!   its recent errors, its other communicators; the highest sequence number reached and the
//!   ranks behind it (JSON).
//! - `local [NONCE [COMM RANK]]`: this process only (JSON), seen from communicator `COMM`
//!   (16 hex digits) rank `RANK` if it has it, else from its first communicator.
//!
//! NONCE is 32 hex digits (16 random bytes) chosen by the client; the agent then proves it
//! belongs to the job: `mac` is `HMAC-SHA256(secret, "oxccl-status-v1\0" || nonce || request
//! word || "\0" || answer line)` with the job's secret (that of the process's first
//! communicator: `OXCCL_SECRET`, or the one derived from the job's identity). `oxccl status`
//! always sends a nonce and rejects an answer without a valid MAC ("not this job's agent");
//! the asked rank checks every other rank's answer the same way.
//!
//! "Behind" is decided at one moment: the asked rank gathers every rank's state; a rank whose
//! last started call is below the highest one seen (taken anew after each round) is asked again (a few times, within
//! [`SETTLE`]) and reported behind only if it still has not reached that call, so a healthy
//! job whose ranks are a call apart for a microsecond shows nobody behind.
//!
//! The listening thread accepts every connection at once (non-blocking) into a table of at
//! most [`MAX_PENDING`] connections whose request line has not come yet, and reads them all
//! with `poll(2)`: a connection silent for [`IO_TIMEOUT`] is answered "no request" and
//! closed, and a new connection to a full table closes the oldest one there, so that a flood
//! of silent connections of any size from strangers (no secret needed to connect) cannot
//! keep the job's own operator out: the operator's request comes with its connection and is
//! read before a flood could push it out. A complete request is answered on its own thread
//! (at most [`MAX_CONNECTIONS`] at once; beyond, a short "busy" answer, read first and
//! authenticated like any answer). A rank whose agent does not answer the asked rank is not
//! reported dead where the asked rank's communicator has not lost it: its agent is "busy or
//! unreachable", and it is not counted behind. The agent reads the flight recorder
//! ([`crate::observe::flight`]), which takes no lock on the call path: it never blocks or
//! slows calls.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::fault::health::Health;
use crate::observe::flight::{json_str, CallState, Recorder};

type HmacSha256 = Hmac<Sha256>;

/// Bound of every read and write of the agent, and of its connections to other ranks.
pub const IO_TIMEOUT: Duration = Duration::from_millis(1000);
/// How long the asked rank keeps asking a rank that seems behind before reporting it so.
pub const SETTLE: Duration = Duration::from_millis(200);
/// Connections served at once; more get a short "busy" answer.
pub const MAX_CONNECTIONS: usize = 64;
/// Connections held waiting for their request line; a new one beyond closes the oldest.
pub const MAX_PENDING: usize = 256;
/// The longest request line.
const MAX_REQUEST: usize = 128;
/// The longest answer read from another rank.
const MAX_ANSWER: usize = 1 << 20;
/// Domain separation of the answers' MAC.
const MAC_CONTEXT: &[u8] = b"oxccl-status-v1\0";
/// What `oxccl status` reports of an agent whose answer fails authentication.
pub const NOT_THIS_JOB: &str = "not this job's agent (authentication failed)";

/// What the agent reads of one communicator.
#[derive(Clone, Debug)]
pub struct Source {
    /// The communicator's tag ([`crate::net::auth::comm_tag`]).
    pub comm: u64,
    /// This rank.
    pub rank: usize,
    /// The communicator's size.
    pub nranks: usize,
    /// The flight recorder of the communicator.
    pub recorder: Arc<Recorder>,
    /// Its health.
    pub health: Arc<Health>,
    /// Its links to the other ranks.
    pub links: Arc<Vec<LinkInfo>>,
}

/// One link of a communicator, as made at init.
#[derive(Clone, Debug)]
pub struct LinkInfo {
    /// The peer's rank.
    pub peer: usize,
    /// The transport (`"shm"` or `"tcp"`).
    pub transport: &'static str,
    /// The peer's host name.
    pub host: String,
    /// The peer's address (its data interface).
    pub ip: IpAddr,
    /// The peer's process id.
    pub pid: u32,
    /// The link's byte counters and last progress (none where the link is not counted).
    pub stats: Option<Arc<crate::transport::counted::LinkStats>>,
}

/// A communicator known to an agent, with every rank's agent address.
#[derive(Debug)]
struct Member {
    id: u64,
    src: Source,
    peers: Vec<Option<SocketAddr>>,
}

/// What the agent's threads share.
#[derive(Debug)]
struct Shared {
    secret: [u8; 16],
    addr: SocketAddr,
    stop: AtomicBool,
    active: AtomicUsize,
    members: Mutex<Vec<Member>>,
    next_id: AtomicU64,
}

/// The listening thread of an agent; dropped (stopped) with the last communicator.
#[derive(Debug)]
struct Agent {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The agents of this process.
static AGENTS: Mutex<Vec<Weak<Agent>>> = Mutex::new(Vec::new());

/// A communicator's place in a running agent; dropping it takes the communicator off (and
/// stops the agent with its last communicator).
#[derive(Debug)]
pub struct StatusAgent {
    agent: Arc<Agent>,
    id: u64,
}

/// Parses `OXCCL_STATUS`: a port (on 127.0.0.1) or `host:port`.
pub fn parse_addr(v: &str) -> Result<SocketAddr, String> {
    if let Ok(p) = v.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], p)));
    }
    use std::net::ToSocketAddrs;
    v.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| {
            format!(
                "expected a port or host:port, got '{}'",
                crate::base::param::table::shown(v)
            )
        })
}

/// Parses a secret written as 32 hex digits (surrounding whitespace allowed), as the
/// bootstrap reads `OXCCL_SECRET`.
pub fn parse_secret(s: &str) -> Option<[u8; 16]> {
    crate::bootstrap::parse_secret_hex(s.trim())
}

fn hex(b: &[u8]) -> String {
    b.iter()
        .fold(String::with_capacity(2 * b.len()), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

/// The job's secret as a process started with this environment has it (for `oxccl status`):
/// `OXCCL_SECRET`, else the one derived from the rendezvous address and the launcher's job
/// id (as [`crate::Communicator::from_env`] derives it).
pub fn secret_from_env() -> Result<[u8; 16], String> {
    let get = |n: &str| std::env::var(n).ok();
    if let Some(s) = get(crate::base::param::table::SECRET.name) {
        return parse_secret(&s)
            .ok_or_else(|| "OXCCL_SECRET must be 32 hex digits (16 bytes)".to_string());
    }
    // The derivation does not depend on the rank: stand in for one where none is set.
    let has_root = get("OXCCL_ROOT").is_some() || get("MASTER_ADDR").is_some();
    if !has_root {
        return Err("no job secret: set OXCCL_SECRET (or --secret) to the job's, or OXCCL_ROOT/MASTER_ADDR and MASTER_PORT as the job had them".into());
    }
    let launcher = ["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"]
        .iter()
        .any(|v| get(v).is_some());
    crate::bootstrap::env::LaunchEnv::from_vars(|n| match n {
        "RANK" if !launcher => Some("0".into()),
        "WORLD_SIZE" if !launcher => Some("1".into()),
        _ => get(n),
    })
    .map(|e| e.secret)
    .map_err(|e| e.to_string())
}

/// The MAC of `answer` to request `word` with `nonce`.
fn mac(secret: &[u8; 16], nonce: &[u8; 16], word: &str, answer: &str) -> HmacSha256 {
    let mut m = <HmacSha256 as KeyInit>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    m.update(MAC_CONTEXT);
    m.update(nonce);
    m.update(word.as_bytes());
    m.update(b"\0");
    m.update(answer.as_bytes());
    m
}

impl StatusAgent {
    /// Starts an agent answering on `listener` with the job's `secret`, for the communicator
    /// `src` whose ranks' agents are at `peers` (`None` where a rank has none). Where this
    /// process already runs an agent, the new one proves the same secret as it (the job's,
    /// that of the process's first communicator), not `secret`.
    pub fn start(
        listener: TcpListener,
        secret: [u8; 16],
        src: Source,
        peers: Vec<Option<SocketAddr>>,
    ) -> std::io::Result<StatusAgent> {
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let secret = AGENTS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find_map(Weak::upgrade)
            .map_or(secret, |a| a.shared.secret);
        let shared = Arc::new(Shared {
            secret,
            addr,
            stop: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            members: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("oxccl-status".into())
            .spawn(move || accept_loop(&listener, &sh))?;
        let agent = Arc::new(Agent {
            shared,
            thread: Some(thread),
        });
        {
            let mut all = AGENTS.lock().unwrap_or_else(|e| e.into_inner());
            all.retain(|w| w.strong_count() > 0);
            all.push(Arc::downgrade(&agent));
        }
        tracing::info!(%addr, "status agent listening");
        Ok(StatusAgent::join(agent, src, peers))
    }

    fn join(agent: Arc<Agent>, src: Source, peers: Vec<Option<SocketAddr>>) -> StatusAgent {
        let id = agent.shared.next_id.fetch_add(1, Ordering::Relaxed);
        agent
            .shared
            .members
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Member { id, src, peers });
        StatusAgent { agent, id }
    }

    /// The address of this process's running agent that `want` accepts, if any (a later
    /// communicator joins it with [`StatusAgent::join_running`] instead of listening anew).
    pub fn running(want: impl Fn(SocketAddr) -> bool) -> Option<SocketAddr> {
        AGENTS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(Weak::upgrade)
            .map(|a| a.shared.addr)
            .find(|a| want(*a))
    }

    /// Adds communicator `src` to this process's running agent at `addr`; `None` if it has
    /// stopped meanwhile.
    pub fn join_running(
        addr: SocketAddr,
        src: Source,
        peers: Vec<Option<SocketAddr>>,
    ) -> Option<StatusAgent> {
        let agent = AGENTS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(Weak::upgrade)
            .find(|a| a.shared.addr == addr)?;
        Some(StatusAgent::join(agent, src, peers))
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.agent.shared.addr
    }
}

impl Drop for StatusAgent {
    fn drop(&mut self) {
        self.agent
            .shared
            .members
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|m| m.id != self.id);
    }
}

/// A connection whose request line has not fully come yet.
struct Pending {
    s: TcpStream,
    since: Instant,
    buf: Vec<u8>,
}

/// What a read of a pending connection gave.
enum Got {
    /// A whole line, or as much as a request may be, or the client's end of sending.
    Request,
    /// Nothing more yet.
    More,
    /// The connection failed.
    Broken,
}

impl Pending {
    /// Reads whatever has come, without blocking.
    fn read(&mut self) -> Got {
        let mut chunk = [0u8; MAX_REQUEST];
        loop {
            match (&self.s).read(&mut chunk) {
                Ok(0) => return Got::Request,
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    if self.buf.contains(&b'\n') || self.buf.len() >= MAX_REQUEST {
                        return Got::Request;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Got::More,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Got::Broken,
            }
        }
    }

    /// The request line (at most [`MAX_REQUEST`] bytes).
    fn line(&self) -> String {
        let line = self.buf.split(|&b| b == b'\n').next().unwrap_or_default();
        String::from_utf8_lossy(&line[..line.len().min(MAX_REQUEST)]).into_owned()
    }
}

/// Waits up to `timeout` for a new connection on `listener` or bytes on a pending one.
fn wait_readable(listener: &TcpListener, pending: &std::collections::VecDeque<Pending>) {
    use std::os::fd::AsRawFd;
    let mut fds: Vec<libc::pollfd> = std::iter::once(listener.as_raw_fd())
        .chain(pending.iter().map(|p| p.s.as_raw_fd()))
        .map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `fds` is a valid array of `fds.len()` pollfd entries, each an open descriptor
    // owned by `listener` or `pending` for the duration of the call.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 10) };
}

/// Accepts until stopped; see the module documentation: every connection is taken at once,
/// held until its request line comes (at most [`MAX_PENDING`], the oldest closed first,
/// each for at most [`IO_TIMEOUT`]), then answered on its own thread (at most
/// [`MAX_CONNECTIONS`] at once).
fn accept_loop(listener: &TcpListener, sh: &Arc<Shared>) {
    let mut pending: std::collections::VecDeque<Pending> = Default::default();
    while !sh.stop.load(Ordering::Relaxed) {
        wait_readable(listener, &pending);
        // Everything in the backlog (bounded, so that the pending ones are read too).
        for _ in 0..2 * MAX_PENDING {
            match listener.accept() {
                Ok((s, _)) => {
                    if s.set_nonblocking(true).is_err() {
                        continue;
                    }
                    if pending.len() >= MAX_PENDING {
                        pending.pop_front();
                    }
                    pending.push_back(Pending {
                        s,
                        since: Instant::now(),
                        buf: Vec::new(),
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let now = Instant::now();
        let mut keep = std::collections::VecDeque::with_capacity(pending.len());
        for mut p in pending.drain(..) {
            match p.read() {
                Got::Request => {
                    let line = p.line();
                    dispatch(p.s, line, sh)
                }
                Got::Broken => {}
                Got::More if now.duration_since(p.since) >= IO_TIMEOUT => {
                    let _ = (&p.s).write_all(NO_REQUEST.as_bytes());
                }
                Got::More => keep.push_back(p),
            }
        }
        pending = keep;
    }
}

/// The answer to a connection that sent no request (within [`IO_TIMEOUT`]).
const NO_REQUEST: &str = "{\"error\":\"no request (send 'status' or 'local')\"}\n";

/// Answers request `line` on `s`: on a thread of its own, or where [`MAX_CONNECTIONS`] are
/// being answered, at once with a short "busy" answer.
fn dispatch(s: TcpStream, line: String, sh: &Arc<Shared>) {
    if sh.active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
        sh.active.fetch_sub(1, Ordering::AcqRel);
        busy(&s, &line, sh);
        return;
    }
    let sh2 = sh.clone();
    let spawned = std::thread::Builder::new()
        .name("oxccl-status-conn".into())
        .spawn(move || {
            serve(&s, &line, &sh2);
            sh2.active.fetch_sub(1, Ordering::AcqRel);
        });
    if spawned.is_err() {
        sh.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Tells a client over the limit to come back (authenticated where it sent a nonce), without
/// waiting on it.
fn busy(s: &TcpStream, line: &str, sh: &Shared) {
    let answer = "{\"error\":\"busy: too many status connections, try again\"}";
    let out = match parse_request(line.trim()) {
        Ok(r) => with_mac(answer.to_string(), r.word, r.nonce, sh),
        Err(_) => format!("{answer}\n"),
    };
    let _ = s.set_nonblocking(true);
    let _ = (&*s).write_all(out.as_bytes());
}

/// `answer` as sent: its line, then where the request had a nonce, its MAC line.
fn with_mac(answer: String, word: &str, nonce: Option<[u8; 16]>, sh: &Shared) -> String {
    let mut out = answer.clone();
    out.push('\n');
    if let Some(n) = nonce {
        let tag = mac(&sh.secret, &n, word, &answer).finalize().into_bytes();
        let _ = writeln!(out, "mac {}", hex(&tag));
    }
    out
}

/// A parsed request.
struct Request<'a> {
    word: &'a str,
    nonce: Option<[u8; 16]>,
    comm: Option<(u64, usize)>,
}

fn parse_request(line: &str) -> Result<Request<'_>, String> {
    let mut it = line.split_whitespace();
    let word = it.next().unwrap_or("");
    let nonce = match it.next() {
        None => None,
        Some(n) => Some(parse_secret(n).ok_or("the nonce must be 32 hex digits")?),
    };
    let comm = match (it.next(), it.next()) {
        (Some(c), Some(r)) => Some((
            u64::from_str_radix(c, 16).map_err(|_| "bad communicator tag")?,
            r.parse().map_err(|_| "bad rank")?,
        )),
        _ => None,
    };
    Ok(Request { word, nonce, comm })
}

/// Answers request `line` (empty: none came within [`IO_TIMEOUT`]) on connection `s`.
fn serve(s: &TcpStream, line: &str, sh: &Shared) {
    let _ = s.set_nonblocking(false);
    let _ = s.set_write_timeout(Some(IO_TIMEOUT));
    let err = |m: &str| format!("{{\"error\":{}}}", json_str(m));
    let (answer, word, nonce) = match line.trim() {
        "" => (NO_REQUEST.trim_end().to_string(), "", None),
        l => match parse_request(l) {
            Err(e) => (err(&e), "", None),
            Ok(r) => {
                let a = match r.word {
                    "local" => local_json(sh, r.comm),
                    "status" => job_json(sh),
                    other => err(&format!(
                        "unknown request '{}' (send 'status' or 'local')",
                        other.chars().take(32).collect::<String>()
                    )),
                };
                (a, r.word, r.nonce)
            }
        },
    };
    let out = with_mac(answer, word, nonce, sh);
    let _ = (&*s).write_all(out.as_bytes());
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// One communicator's state (JSON members, no braces): where its rank is.
fn comm_fields(src: &Source) -> String {
    let entries = src.recorder.entries();
    let mut s = String::new();
    let _ = write!(
        s,
        "\"comm\":\"{:016x}\",\"rank\":{},\"world_size\":{},\"health\":{}",
        src.comm,
        src.rank,
        src.nranks,
        match src.health.failure() {
            None => "\"ok\"".to_string(),
            Some(_) => json_str(&src.health.error(src.rank, "status", 0).to_string()),
        }
    );
    let current = entries.iter().rev().find(|e| e.state == CallState::Running);
    match current {
        Some(e) => {
            let _ = write!(
                s,
                ",\"current\":{{\"seq\":{},\"call\":{},\"coll_seq\":{},\"algo\":{},\"running_ms\":{}}}",
                e.seq,
                json_str(e.call),
                e.mseq,
                json_str(e.algo),
                now_us().saturating_sub(e.start_us) / 1000
            );
        }
        None => s.push_str(",\"current\":null"),
    }
    let last_done = entries
        .iter()
        .rev()
        .find(|e| e.state == CallState::Completed);
    match last_done {
        Some(e) => {
            let _ = write!(
                s,
                ",\"last_completed\":{{\"seq\":{},\"call\":{},\"ms_ago\":{}}}",
                e.seq,
                json_str(e.call),
                now_us().saturating_sub(e.start_us + e.dur_us.unwrap_or(0)) / 1000
            );
        }
        None => s.push_str(",\"last_completed\":null"),
    }
    let reached = entries.last().map_or(0, |e| e.seq);
    let _ = write!(s, ",\"reached\":{reached},\"recent_errors\":[");
    let errors: Vec<_> = entries
        .iter()
        .filter_map(|e| match &e.state {
            CallState::Failed(m) => Some((e.seq, e.call, m)),
            _ => None,
        })
        .collect();
    for (i, (seq, call, m)) in errors.iter().rev().take(8).enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(
            s,
            "{{\"seq\":{seq},\"call\":{},\"error\":{}}}",
            json_str(call),
            json_str(m)
        );
    }
    s.push_str("],\"links\":[");
    for (i, l) in src.links.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(
            s,
            "{{\"peer\":{},\"transport\":\"{}\",\"host\":{},\"ip\":\"{}\",\"pid\":{}",
            l.peer,
            l.transport,
            json_str(&l.host),
            l.ip,
            l.pid
        );
        if let Some(st) = &l.stats {
            let ago = st
                .last_progress_ms_ago()
                .map_or("null".to_string(), |a| a.to_string());
            let _ = write!(
                s,
                ",\"sent\":{},\"received\":{},\"progress_ms_ago\":{ago}",
                st.sent(),
                st.received()
            );
        }
        s.push('}');
    }
    s.push(']');
    s
}

/// This process's state as one JSON object: communicator `comm` (tag, rank) if it has it,
/// else its first, at the top; every communicator of the process under `comms`.
fn local_json(sh: &Shared, comm: Option<(u64, usize)>) -> String {
    let members = sh.members.lock().unwrap_or_else(|e| e.into_inner());
    let srcs: Vec<Source> = members.iter().map(|m| m.src.clone()).collect();
    drop(members);
    local_of(&srcs, comm, sh.addr)
}

/// [`local_json`] of these communicators.
fn local_of(srcs: &[Source], comm: Option<(u64, usize)>, agent: SocketAddr) -> String {
    let host = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    let main = comm
        .and_then(|(c, r)| srcs.iter().find(|s| s.comm == c && s.rank == r))
        .or(srcs.first());
    let mut s = format!(
        "{{\"pid\":{},\"host\":{},\"agent\":\"{agent}\",\"alive\":true",
        std::process::id(),
        json_str(&host)
    );
    if let Some(m) = main {
        s.push(',');
        s.push_str(&comm_fields(m));
    }
    s.push_str(",\"comms\":[");
    for (i, c) in srcs.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push('{');
        s.push_str(&comm_fields(c));
        s.push('}');
    }
    s.push_str("]}");
    s
}

/// Asks the agent at `addr` for `request`, with a fresh nonce: the answer line once its MAC
/// proves the agent knows `secret` (an error of kind `PermissionDenied` saying
/// [`NOT_THIS_JOB`] otherwise); bounded in time and size. Without `secret`, no nonce is sent
/// and the answer is taken as it is.
pub fn ask(
    addr: SocketAddr,
    request: &str,
    secret: Option<&[u8; 16]>,
    timeout: Duration,
) -> std::io::Result<String> {
    let deadline = Instant::now() + timeout;
    let s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_write_timeout(Some(timeout))?;
    let mut words = request.split_whitespace();
    let word = words.next().unwrap_or("").to_string();
    let rest: Vec<&str> = words.collect();
    let mut nonce = [0u8; 16];
    let line = match secret {
        Some(_) => {
            getrandom::fill(&mut nonce).map_err(|e| std::io::Error::other(e.to_string()))?;
            let mut l = format!("{word} {}", hex(&nonce));
            for w in rest {
                l.push(' ');
                l.push_str(w);
            }
            l
        }
        None => request.to_string(),
    };
    (&s).write_all(format!("{line}\n").as_bytes())?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        let left = deadline
            .checked_duration_since(Instant::now())
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out"))?;
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        let n = (&s).read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_ANSWER {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "answer too long",
            ));
        }
    }
    let text = String::from_utf8_lossy(&buf);
    let mut lines = text.lines();
    let answer = lines.next().unwrap_or("").to_string();
    if answer.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "no answer",
        ));
    }
    let Some(secret) = secret else {
        return Ok(answer);
    };
    let denied = || std::io::Error::new(std::io::ErrorKind::PermissionDenied, NOT_THIS_JOB);
    let tag = lines
        .next()
        .and_then(|l| l.strip_prefix("mac "))
        .map(str::trim)
        .filter(|t| t.len() == 64)
        .ok_or_else(denied)?;
    let tag: Vec<u8> = (0..32)
        .map(|i| u8::from_str_radix(&tag[2 * i..2 * i + 2], 16))
        .collect::<Result<_, _>>()
        .map_err(|_| denied())?;
    mac(secret, &nonce, &word, &answer)
        .verify_slice(&tag)
        .map_err(|_| denied())?;
    Ok(answer)
}

/// A number field of an answer (written by [`comm_fields`]).
fn number_of(answer: &str, key: &str) -> Option<u64> {
    let pat = format!("\"{key}\":");
    let rest = &answer[answer.find(&pat)? + pat.len()..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Asks every rank in `ranks` of `m` for its state, in parallel (64 at a time).
fn gather(sh: &Shared, m: &Member, ranks: &[usize]) -> Vec<Result<String, String>> {
    let mut answers = Vec::with_capacity(ranks.len());
    for chunk in ranks.chunks(64) {
        std::thread::scope(|sc| {
            let hs: Vec<_> = chunk
                .iter()
                .map(|&r| {
                    let addr = m.peers.get(r).copied().flatten();
                    sc.spawn(move || {
                        if r == m.src.rank {
                            return Ok(local_json(sh, Some((m.src.comm, r))));
                        }
                        let Some(a) = addr else {
                            return Err("no status agent (OXCCL_STATUS unset on that rank)".into());
                        };
                        let req = format!("local {:016x} {r}", m.src.comm);
                        ask(a, &req, Some(&sh.secret), IO_TIMEOUT).map_err(|e| {
                            if e.kind() == std::io::ErrorKind::PermissionDenied {
                                format!("{a}: {NOT_THIS_JOB}")
                            } else {
                                format!("no answer from {a}: {e}")
                            }
                        })
                    })
                })
                .collect();
            answers.extend(hs.into_iter().map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("agent query panicked".into()))
            }));
        });
    }
    answers
}

/// Decides who is behind from every rank's first answer (`answers`, by rank), asking the
/// ranks below the highest call seen again (`again`, answers in the order asked) every 20 ms
/// within `settle`. Returns the answers last seen, the highest call they reach, and the ranks
/// behind: those without an answer, and those whose last answer is below the highest call
/// seen when it was asked for.
///
/// The highest call is taken anew after each round: ranks asked again may have gone on
/// past it (a sample once showed ranks 0 and 1 in call #6, asked again, with the highest
/// call still the 5 of the first answers and nobody behind, while rank 2, stopped after
/// call #5, was).
fn settle(
    mut answers: Vec<Result<String, String>>,
    mut again: impl FnMut(&[usize]) -> Vec<Result<String, String>>,
    settle: Duration,
) -> (Vec<Result<String, String>>, u64, Vec<usize>) {
    let reached =
        |a: &Result<String, String>| a.as_ref().ok().and_then(|s| number_of(s, "reached"));
    let max_of =
        |answers: &[Result<String, String>]| answers.iter().filter_map(reached).max().unwrap_or(0);
    // Per rank: the highest call seen when its last answer was asked for.
    let mut target = vec![max_of(&answers); answers.len()];
    // One moment: a rank below the highest call seen may only be a call behind for an instant;
    // ask it again until it reaches that call or `settle` passes. Past `settle`, one last
    // round asks only the ranks never asked against the highest call seen (so that one
    // slow round does not leave a rank judged against an older one).
    let start = Instant::now();
    let mut last_round = false;
    loop {
        let max = max_of(&answers);
        let mut lagging: Vec<usize> = (0..answers.len())
            .filter(|&r| answers[r].is_ok() && reached(&answers[r]).is_some_and(|x| x < max))
            .collect();
        if start.elapsed() >= settle {
            lagging.retain(|&r| target[r] < max);
            if last_round {
                break;
            }
            last_round = true;
        }
        if lagging.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        for (r, a) in lagging.iter().zip(again(&lagging)) {
            if a.is_ok() {
                answers[*r] = a;
                target[*r] = max;
            }
        }
    }
    let behind = (0..answers.len())
        .filter(|&r| reached(&answers[r]).is_none_or(|x| x < target[r]))
        .collect();
    let max = max_of(&answers);
    (answers, max, behind)
}

/// Every rank's state of this process's first communicator, gathered from their agents
/// (each bounded by [`IO_TIMEOUT`]; ranks that seem behind asked again within [`SETTLE`]),
/// as one JSON object.
fn job_json(sh: &Shared) -> String {
    let members = sh.members.lock().unwrap_or_else(|e| e.into_inner());
    let Some(m) = members.first().map(|m| Member {
        id: m.id,
        src: m.src.clone(),
        peers: m.peers.clone(),
    }) else {
        return "{\"error\":\"no communicator (the job is shutting down)\"}".into();
    };
    drop(members);
    let all: Vec<usize> = (0..m.src.nranks).collect();
    let first = gather(sh, &m, &all);
    let (answers, max, behind) = settle(first, |ranks| gather(sh, &m, ranks), SETTLE);
    // A rank whose agent did not answer, which this communicator has not lost: its agent is
    // busy (strangers may hold it) or unreachable, which says nothing of the rank itself.
    let lost = m.src.health.failure().and_then(|f| match f {
        crate::fault::health::Failure::Lost { peer, .. } => Some(peer),
        _ => None,
    });
    let unreachable: Vec<usize> = (0..answers.len())
        .filter(|&r| {
            // (An answer that failed authentication is no agent of this job: that rank's
            // own agent is not there.)
            answers[r]
                .as_ref()
                .is_err_and(|e| !e.contains(NOT_THIS_JOB))
                && m.peers.get(r).is_some_and(Option::is_some)
        })
        .filter(|&r| lost != Some(r))
        .collect();
    let list = |v: &[usize]| {
        v.iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let behind: Vec<usize> = behind
        .into_iter()
        .filter(|r| !unreachable.contains(r))
        .collect();
    let mut s = format!(
        "{{\"world_size\":{},\"comm\":\"{:016x}\",\"asked_rank\":{},\"time_us\":{},\"max_seq\":{max},\"behind\":[{}],\"unreachable\":[{}],\"ranks\":[",
        m.src.nranks,
        m.src.comm,
        m.src.rank,
        now_us(),
        list(&behind),
        list(&unreachable)
    );
    for (r, a) in answers.iter().enumerate() {
        if r > 0 {
            s.push(',');
        }
        match a {
            Ok(j) => s.push_str(j),
            Err(e) => {
                let addr = m
                    .peers
                    .get(r)
                    .copied()
                    .flatten()
                    .map_or("null".to_string(), |a| json_str(&a.to_string()));
                let (alive, e) = if unreachable.contains(&r) {
                    (
                        "null",
                        format!(
                            "agent busy or unreachable ({e}); rank {} has not lost it",
                            m.src.rank
                        ),
                    )
                } else {
                    ("false", e.clone())
                };
                let _ = write!(
                    s,
                    "{{\"rank\":{r},\"alive\":{alive},\"addr\":{addr},\"error\":{}}}",
                    json_str(&e)
                );
            }
        }
    }
    s.push_str("]}");
    s
}

/// Opens this rank's status listener: `addr`, or for a port taken by another process, a
/// warning on stderr (whatever `OXCCL_DEBUG` says) and `None`.
pub fn listen(rank: usize, addr: SocketAddr) -> Option<TcpListener> {
    match TcpListener::bind(addr) {
        Ok(l) => Some(l),
        Err(e) => {
            crate::base::debug::announce(&taken_warning(rank, addr, &e));
            None
        }
    }
}

/// The warning of a status address that cannot be listened on.
pub fn taken_warning(rank: usize, addr: SocketAddr, e: &std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::AddrInUse {
        format!(
            "warning: OXCCL_STATUS: {addr} is already taken by another process; the status agent is off for rank {rank} \
             (oxccl status {addr} would reach that process, not this job): free the port or set OXCCL_STATUS to a free one"
        )
    } else {
        format!(
            "warning: OXCCL_STATUS: cannot listen on {addr}: {e}; the status agent is off for rank {rank}: \
             set OXCCL_STATUS to a local address and free port"
        )
    }
}

/// Whether an agent listening at `a` serves a rank whose data interface is `ip`.
pub fn serves(a: SocketAddr, ip: IpAddr) -> bool {
    a.ip() == ip
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::fingerprint::Fingerprint;

    const SECRET: [u8; 16] = *b"status-test-key!";

    fn source(rank: usize, nranks: usize, calls: u64) -> Source {
        let rec = Recorder::new(rank, nranks, 9, 16, None, None);
        for seq in 1..=calls {
            rec.begin(seq, "all_reduce", Fingerprint::default(), seq, "ring");
            rec.end(seq, None);
        }
        Source {
            comm: 0xc0,
            rank,
            nranks,
            recorder: rec,
            health: Arc::new(Health::new()),
            links: Arc::new(vec![LinkInfo {
                peer: 1 - rank.min(1),
                transport: "tcp",
                host: "h".into(),
                ip: IpAddr::from([127, 0, 0, 1]),
                pid: 7,
                stats: Some(counted_stats(100)),
            }]),
        }
    }

    /// The counters of a link that has sent `n` bytes.
    fn counted_stats(n: usize) -> Arc<crate::transport::counted::LinkStats> {
        let mut g = crate::transport::mem::group(2, 1024).into_iter();
        let (mut a, st) = crate::transport::counted::counted(g.next().unwrap().pop().unwrap().1);
        assert_eq!(a.try_send(&vec![1u8; n]).unwrap(), n);
        st
    }

    fn start(src: Source, peers: Vec<Option<SocketAddr>>) -> StatusAgent {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        StatusAgent::start(l, SECRET, src, peers).unwrap()
    }

    #[test]
    fn answers_status_and_local_and_bounds_strangers() {
        let src = source(0, 2, 0);
        let rec = src.recorder.clone();
        rec.begin(1, "all_reduce", Fingerprint::default(), 1, "ring");
        rec.end(1, None);
        rec.begin(2, "broadcast", Fingerprint::default(), 2, "chain");
        rec.end(2, Some("boom".into()));
        rec.begin(3, "all_reduce", Fingerprint::default(), 3, "ring");
        let a = start(src, vec![None, None]);
        // A stranger that connects and says nothing is answered (and dropped) within the bound.
        let t = Instant::now();
        let mut quiet = TcpStream::connect(a.addr()).unwrap();
        quiet
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut got = String::new();
        let _ = quiet.read_to_string(&mut got);
        assert!(got.contains("no request"), "{got}");
        // `IO_TIMEOUT` (1 s) quiet: ten times that.
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        let local = ask(a.addr(), "local", Some(&SECRET), Duration::from_secs(5)).unwrap();
        for want in [
            "\"current\":{\"seq\":3,\"call\":\"all_reduce\"",
            "\"last_completed\":{\"seq\":1,",
            "\"reached\":3",
            "\"error\":\"boom\"",
            "\"comms\":[{\"comm\":\"00000000000000c0\",\"rank\":0",
            "\"links\":[{\"peer\":1,\"transport\":\"tcp\",\"host\":\"h\",\"ip\":\"127.0.0.1\",\"pid\":7,\"sent\":100,\"received\":0,\"progress_ms_ago\":",
        ] {
            assert!(local.contains(want), "{want} not in {local}");
        }
        let job = ask(a.addr(), "status", Some(&SECRET), Duration::from_secs(5)).unwrap();
        assert!(
            job.contains("\"max_seq\":3,\"behind\":[1]") && job.contains("OXCCL_STATUS unset"),
            "{job}"
        );
        let bad = ask(a.addr(), "gimme", Some(&SECRET), Duration::from_secs(5)).unwrap();
        assert!(bad.contains("unknown request 'gimme'"), "{bad}");
        // Without a nonce (nc): the answer, unauthenticated; with a wrong secret: refused.
        assert!(ask(a.addr(), "local", None, Duration::from_secs(5))
            .unwrap()
            .contains("\"reached\":3"));
        let e = ask(a.addr(), "local", Some(&[1; 16]), Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
        assert_eq!(e.to_string(), NOT_THIS_JOB);
    }

    #[test]
    fn silent_connections_neither_block_nor_falsify() {
        // Two ranks' agents; 24 silent connections to each; `status` still answers at once
        // with both ranks alive.
        let a1 = start(source(1, 2, 5), vec![None, None]);
        let a0 = start(source(0, 2, 5), vec![None, Some(a1.addr())]);
        let silent: Vec<TcpStream> = (0..24)
            .flat_map(|_| {
                [
                    TcpStream::connect(a0.addr()).unwrap(),
                    TcpStream::connect(a1.addr()).unwrap(),
                ]
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..3 {
            let t = Instant::now();
            let job = ask(a0.addr(), "status", Some(&SECRET), Duration::from_secs(30)).unwrap();
            // Quiet, an answer takes milliseconds; agents blocked by the 24 silent connections
            // each would take their `IO_TIMEOUT` (1 s) each, 24 s or more.
            assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
            assert!(
                job.contains("\"max_seq\":5,\"behind\":[]") && !job.contains("\"alive\":false"),
                "{job}"
            );
        }
        drop(silent);
    }

    #[test]
    fn a_flood_of_silent_strangers_does_not_keep_the_operator_out() {
        // 500 silent connections held on each of two ranks' agents, and more coming all the
        // time: `status` is answered, with both ranks alive and nobody behind.
        let a1 = start(source(1, 2, 5), vec![None, None]);
        let a0 = start(source(0, 2, 5), vec![None, Some(a1.addr())]);
        let stop = Arc::new(AtomicBool::new(false));
        let flood = |addr: SocketAddr| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut held = std::collections::VecDeque::new();
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(c) = TcpStream::connect(addr) {
                        held.push_back(c);
                    }
                    if held.len() > 500 {
                        held.pop_front();
                    }
                }
            })
        };
        let floods = [flood(a0.addr()), flood(a1.addr())];
        std::thread::sleep(Duration::from_millis(500));
        for _ in 0..3 {
            let job = ask(a0.addr(), "status", Some(&SECRET), Duration::from_secs(10)).unwrap();
            assert!(
                job.contains("\"max_seq\":5,\"behind\":[],\"unreachable\":[]")
                    && !job.contains("\"alive\":false")
                    && !job.contains("\"alive\":null"),
                "{job}"
            );
        }
        stop.store(true, Ordering::Relaxed);
        for f in floods {
            f.join().unwrap();
        }
    }

    #[test]
    fn a_rank_whose_agent_does_not_answer_is_not_reported_dead_unless_lost() {
        // Rank 1's agent address leads to a listener that never answers.
        let mute = TcpListener::bind("127.0.0.1:0").unwrap();
        let src = source(0, 2, 5);
        let health = src.health.clone();
        let a0 = start(src, vec![None, Some(mute.local_addr().unwrap())]);
        let job = ask(a0.addr(), "status", Some(&SECRET), Duration::from_secs(10)).unwrap();
        assert!(
            job.contains("\"behind\":[],\"unreachable\":[1]")
                && job.contains("{\"rank\":1,\"alive\":null")
                && job.contains("agent busy or unreachable"),
            "{job}"
        );
        // Once the communicator has lost it, it is dead and behind.
        health.fail(crate::fault::health::Failure::Lost {
            peer: 1,
            reason: "test".into(),
        });
        let job = ask(a0.addr(), "status", Some(&SECRET), Duration::from_secs(10)).unwrap();
        assert!(
            job.contains("\"behind\":[1],\"unreachable\":[]")
                && job.contains("{\"rank\":1,\"alive\":false"),
            "{job}"
        );
    }

    #[test]
    fn a_stranger_on_the_port_is_not_believed() {
        // A fake agent answers every request with a made-up healthy rank and a made-up MAC.
        let fake = TcpListener::bind("127.0.0.1:0").unwrap();
        let fake_addr = fake.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        fake.set_nonblocking(true).unwrap();
        let t = std::thread::spawn(move || {
            let until = Instant::now() + Duration::from_secs(20);
            while !st.load(Ordering::Relaxed) && Instant::now() < until {
                match fake.accept() {
                    Ok((s, _)) => {
                        let _ = s.set_nonblocking(false);
                        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                        let mut b = [0u8; 128];
                        let _ = (&s).read(&mut b);
                        let _ = (&s).write_all(
                            format!(
                                "{{\"rank\":1,\"alive\":true,\"reached\":5}}\nmac {}\n",
                                "ab".repeat(32)
                            )
                            .as_bytes(),
                        );
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        let e = ask(fake_addr, "status", Some(&SECRET), Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
        // The gathering rank does not believe it either.
        let a0 = start(source(0, 2, 5), vec![None, Some(fake_addr)]);
        let job = ask(a0.addr(), "status", Some(&SECRET), Duration::from_secs(5)).unwrap();
        assert!(
            job.contains(&format!("\"rank\":1,\"alive\":false,\"addr\":\"{fake_addr}\",\"error\":\"{fake_addr}: {NOT_THIS_JOB}\""))
                && job.contains("\"behind\":[1]"),
            "{job}"
        );
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap();
    }

    #[test]
    fn every_communicator_of_the_process_and_a_taken_port() {
        let a = start(source(0, 2, 3), vec![None, None]);
        assert_eq!(StatusAgent::running(|x| x == a.addr()), Some(a.addr()));
        let mut other = source(1, 4, 7);
        other.comm = 0xd1;
        let b = StatusAgent::join_running(a.addr(), other, vec![None; 4]).unwrap();
        let local = ask(a.addr(), "local", Some(&SECRET), Duration::from_secs(5)).unwrap();
        assert!(
            local.contains("\"comm\":\"00000000000000c0\",\"rank\":0,\"world_size\":2")
                && local.contains("{\"comm\":\"00000000000000d1\",\"rank\":1,\"world_size\":4"),
            "{local}"
        );
        // Seen from the second communicator.
        let l2 = ask(
            a.addr(),
            "local 00000000000000d1 1",
            Some(&SECRET),
            Duration::from_secs(5),
        )
        .unwrap();
        assert!(
            l2.contains("\"alive\":true,\"comm\":\"00000000000000d1\",\"rank\":1"),
            "{l2}"
        );
        drop(b);
        let local = ask(a.addr(), "local", Some(&SECRET), Duration::from_secs(5)).unwrap();
        assert!(!local.contains("00000000000000d1"), "{local}");
        // The port is taken (by this agent): a second listener is refused, with the warning.
        assert!(listen(0, a.addr()).is_none());
        let e = TcpListener::bind(a.addr()).unwrap_err();
        let w = taken_warning(3, a.addr(), &e);
        assert!(
            w.contains(&format!("{} is already taken", a.addr()))
                && w.contains("status agent is off for rank 3")
                && w.contains("free the port"),
            "{w}"
        );
        // A second agent of the process (a split whose rank has another address) proves the
        // first one's secret, the job's.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let second = StatusAgent::start(l, [9; 16], source(2, 3, 1), vec![None; 3]).unwrap();
        assert!(ask(
            second.addr(),
            "local",
            Some(&SECRET),
            Duration::from_secs(5)
        )
        .is_ok());
        let addr = a.addr();
        drop(second);
        drop(a);
        assert_eq!(StatusAgent::running(|x| x == addr), None);
    }

    /// A rank's answer reaching call `seq`.
    fn at(seq: u64) -> Result<String, String> {
        Ok(format!("{{\"alive\":true,\"reached\":{seq}}}"))
    }

    #[test]
    fn the_highest_call_is_taken_after_asking_again() {
        // The sample seen once: rank 2 had begun call #5 while ranks 0 and 1 finished call
        // #4; asked again, 0 and 1 are in call #6, waiting for rank 2, stopped in call #5.
        let mut asked = Vec::new();
        let (answers, max, behind) = settle(
            vec![at(4), at(4), at(5)],
            |ranks| {
                asked.push(ranks.to_vec());
                ranks
                    .iter()
                    .map(|&r| at(if r == 2 { 5 } else { 6 }))
                    .collect()
            },
            Duration::from_millis(100),
        );
        assert_eq!(asked[0], vec![0, 1]);
        assert_eq!(asked[1], vec![2], "{asked:?}");
        assert_eq!((max, behind), (6, vec![2]));
        assert_eq!(answers[0], at(6));
        // Past the settle time after one round: rank 2 is still asked once against call #6.
        let (_, max, behind) = settle(
            vec![at(4), at(4), at(5)],
            |ranks| {
                std::thread::sleep(Duration::from_millis(30));
                ranks
                    .iter()
                    .map(|&r| at(if r == 2 { 5 } else { 6 }))
                    .collect()
            },
            Duration::from_millis(10),
        );
        assert_eq!((max, behind), (6, vec![2]));
    }

    #[test]
    fn a_busy_healthy_job_has_nobody_behind() {
        // Every rank asked again has gone one call past the highest seen: a chase, cut at the
        // settle time; nobody is behind what it was asked against.
        let mut top = 9;
        let (answers, max, behind) = settle(
            vec![at(7), at(9), at(8), Err("no answer".into())],
            |ranks| {
                top += 1;
                ranks.iter().map(|_| at(top)).collect()
            },
            Duration::from_millis(100),
        );
        assert_eq!(behind, vec![3], "only the rank that never answered");
        assert_eq!(max, top);
        assert!(answers
            .iter()
            .filter_map(|a| a.as_ref().ok())
            .all(|a| number_of(a, "reached").is_some()));
    }

    #[test]
    fn secrets_parse() {
        assert_eq!(
            parse_secret("000102030405060708090a0b0c0d0e0f"),
            Some([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15])
        );
        assert_eq!(parse_secret("0001"), None);
        assert_eq!(parse_secret("g00102030405060708090a0b0c0d0e0f"), None);
    }
}
