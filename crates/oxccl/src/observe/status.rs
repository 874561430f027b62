//! The live status agent (`OXCCL_STATUS`), as NCCL's RAS: a running job answers "where is
//! every rank?" on a TCP port, for `oxccl status ADDR` (or `nc`).
//!
//! With `OXCCL_STATUS=PORT` (listening on 127.0.0.1) or `HOST:PORT`, rank 0 listens there;
//! every other rank where it is set listens on an ephemeral port of its data interface, and
//! the ranks learn each other's addresses at init. The protocol is one request line, one
//! answer line, then the connection closes:
//!
//! - `status`: the whole job, gathered by the asked rank from every rank's agent: per rank
//!   whether it answered, its current call and sequence number, its last completed one, its
//!   recent errors; the highest sequence number reached and the ranks behind it (JSON).
//! - `local`: this rank only (JSON).
//!
//! The agent runs on its own thread and reads the flight recorder ([`crate::observe::flight`]), which
//! takes no lock on the call path: it never blocks or slows calls. Every read and write is
//! bounded by a timeout; a request longer than a line or slower than [`IO_TIMEOUT`] gets a
//! short error answer.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::fault::health::Health;
use crate::observe::flight::{json_str, CallState, Recorder};

/// Bound of every read and write of the agent, and of its connections to other ranks.
pub const IO_TIMEOUT: Duration = Duration::from_millis(1000);
/// The longest request line.
const MAX_REQUEST: u64 = 64;
/// The longest answer read from another rank.
const MAX_ANSWER: u64 = 1 << 20;

/// What the agent reads.
#[derive(Clone, Debug)]
pub struct Source {
    /// This rank.
    pub rank: usize,
    /// The job's size.
    pub nranks: usize,
    /// The flight recorder of the communicator.
    pub recorder: Arc<Recorder>,
    /// Its health.
    pub health: Arc<Health>,
}

/// A running agent; dropping it stops the thread.
#[derive(Debug)]
pub struct StatusAgent {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    addr: SocketAddr,
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
    /// Starts answering on `listener`; `peers` holds every rank's agent address (`None`
    /// where a rank has none).
    pub fn start(
        listener: TcpListener,
        src: Source,
        peers: Vec<Option<SocketAddr>>,
    ) -> std::io::Result<StatusAgent> {
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let thread = std::thread::Builder::new()
            .name("oxccl-status".into())
            .spawn(move || {
                while !st.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((s, _)) => serve(s, &src, &peers),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(50))
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(50)),
                    }
                }
            })?;
        tracing::info!(%addr, "status agent listening");
        Ok(StatusAgent {
            stop,
            thread: Some(thread),
            addr,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StatusAgent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Answers one connection (every step bounded by [`IO_TIMEOUT`]).
fn serve(s: TcpStream, src: &Source, peers: &[Option<SocketAddr>]) {
    let _ = s.set_nonblocking(false);
    let _ = s.set_read_timeout(Some(IO_TIMEOUT));
    let _ = s.set_write_timeout(Some(IO_TIMEOUT));
    let mut line = String::new();
    let read = BufReader::new((&s).take(MAX_REQUEST)).read_line(&mut line);
    let answer = match (read, line.trim()) {
        (Ok(_), "local") => local_json(src),
        (Ok(_), "status") => job_json(src, peers),
        (Ok(_), "") | (Err(_), _) => "{\"error\":\"no request (send 'status' or 'local')\"}".into(),
        (Ok(_), other) => format!(
            "{{\"error\":{}}}",
            json_str(&format!(
                "unknown request '{}' (send 'status' or 'local')",
                other.chars().take(32).collect::<String>()
            ))
        ),
    };
    let _ = (&s).write_all(answer.as_bytes());
    let _ = (&s).write_all(b"\n");
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// This rank's state as one JSON object.
pub fn local_json(src: &Source) -> String {
    let entries = src.recorder.entries();
    let host = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    let mut s = String::new();
    let _ = write!(
        s,
        "{{\"rank\":{},\"world_size\":{},\"pid\":{},\"host\":{},\"alive\":true,\"health\":{}",
        src.rank,
        src.nranks,
        std::process::id(),
        json_str(&host),
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
                ",\"last_completed\":{{\"seq\":{},\"call\":{}}}",
                e.seq,
                json_str(e.call)
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
    s.push_str("]}");
    s
}

/// Asks the agent at `addr` for `request`; the answer line, bounded in time and size.
pub fn ask(addr: SocketAddr, request: &str, timeout: Duration) -> std::io::Result<String> {
    let s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    (&s).write_all(format!("{request}\n").as_bytes())?;
    let mut line = String::new();
    BufReader::new((&s).take(MAX_ANSWER)).read_line(&mut line)?;
    if line.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "no answer",
        ));
    }
    Ok(line.trim_end().to_string())
}

/// The "reached" field of a local answer (a number written by [`local_json`]).
fn reached_of(answer: &str) -> Option<u64> {
    let rest = &answer[answer.find("\"reached\":")? + 10..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Every rank's state, gathered from their agents (64 at a time, each bounded by
/// [`IO_TIMEOUT`]), as one JSON object.
pub fn job_json(src: &Source, peers: &[Option<SocketAddr>]) -> String {
    // In parallel, at most 64 ranks at a time.
    let mut answers: Vec<Result<String, String>> = Vec::with_capacity(src.nranks);
    for first in (0..src.nranks).step_by(64) {
        let last = (first + 64).min(src.nranks);
        std::thread::scope(|sc| {
            let hs: Vec<_> = (first..last)
                .map(|r| {
                    let addr = peers.get(r).copied().flatten();
                    sc.spawn(move || {
                        if r == src.rank {
                            return Ok(local_json(src));
                        }
                        let Some(a) = addr else {
                            return Err("no status agent (OXCCL_STATUS unset on that rank)".into());
                        };
                        ask(a, "local", IO_TIMEOUT).map_err(|e| format!("no answer from {a}: {e}"))
                    })
                })
                .collect();
            answers.extend(hs.into_iter().map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("agent query panicked".into()))
            }));
        });
    }
    let reached: Vec<Option<u64>> = answers
        .iter()
        .map(|a| a.as_ref().ok().and_then(|s| reached_of(s)))
        .collect();
    let max = reached.iter().flatten().copied().max().unwrap_or(0);
    let behind: Vec<String> = reached
        .iter()
        .enumerate()
        .filter(|(_, r)| r.is_none_or(|r| r < max))
        .map(|(i, _)| i.to_string())
        .collect();
    let mut s = format!(
        "{{\"world_size\":{},\"asked_rank\":{},\"time_us\":{},\"max_seq\":{max},\"behind\":[{}],\"ranks\":[",
        src.nranks,
        src.rank,
        now_us(),
        behind.join(",")
    );
    for (r, a) in answers.iter().enumerate() {
        if r > 0 {
            s.push(',');
        }
        match a {
            Ok(j) => s.push_str(j),
            Err(e) => {
                let addr = peers
                    .get(r)
                    .copied()
                    .flatten()
                    .map_or("null".to_string(), |a| json_str(&a.to_string()));
                let _ = write!(
                    s,
                    "{{\"rank\":{r},\"alive\":false,\"addr\":{addr},\"error\":{}}}",
                    json_str(e)
                );
            }
        }
    }
    s.push_str("]}");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::fingerprint::Fingerprint;

    #[test]
    fn answers_status_and_local_and_bounds_strangers() {
        let rec = Recorder::new(0, 1, 9, 16, None, None);
        rec.begin(1, "all_reduce", Fingerprint::default(), 1, "ring");
        rec.end(1, None);
        rec.begin(2, "broadcast", Fingerprint::default(), 2, "chain");
        rec.end(2, Some("boom".into()));
        rec.begin(3, "all_reduce", Fingerprint::default(), 3, "ring");
        let src = Source {
            rank: 0,
            nranks: 2,
            recorder: rec,
            health: Arc::new(Health::new()),
        };
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = StatusAgent::start(l, src, vec![None, None]).unwrap();
        // A stranger that connects and says nothing is answered (and dropped) within the bound.
        let t = std::time::Instant::now();
        let mut quiet = TcpStream::connect(a.addr()).unwrap();
        quiet
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut got = String::new();
        let _ = quiet.read_to_string(&mut got);
        assert!(got.contains("no request"), "{got}");
        assert!(t.elapsed() < Duration::from_secs(4));
        let local = ask(a.addr(), "local", Duration::from_secs(5)).unwrap();
        for want in [
            "\"current\":{\"seq\":3,\"call\":\"all_reduce\"",
            "\"last_completed\":{\"seq\":1,",
            "\"reached\":3",
            "\"error\":\"boom\"",
        ] {
            assert!(local.contains(want), "{want} not in {local}");
        }
        let job = ask(a.addr(), "status", Duration::from_secs(5)).unwrap();
        assert!(
            job.contains("\"max_seq\":3,\"behind\":[1]") && job.contains("OXCCL_STATUS unset"),
            "{job}"
        );
        let bad = ask(a.addr(), "gimme", Duration::from_secs(5)).unwrap();
        assert!(bad.contains("unknown request 'gimme'"), "{bad}");
    }
}
