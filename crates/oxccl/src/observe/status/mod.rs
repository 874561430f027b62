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

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::fault::health::Health;
use crate::observe::flight::Recorder;

mod client;
mod report;
mod server;

pub use client::{ask, parse_secret, secret_from_env};

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
            .spawn(move || server::accept_loop(&listener, &sh))?;
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
    use super::report::settle;
    use super::*;
    use crate::fault::fingerprint::Fingerprint;
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::Instant;

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
            .all(|a| report::reached_of(a).is_some()));
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
