//! The agent's listening thread and its answers: it accepts every connection at once into a
//! table of pending requests, reads them with `poll(2)`, and answers each complete request on
//! a thread of its own (the module docs have the limits).

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::client::{hex, mac_parts, parse_secret};
use super::report::{error_json, job_json, local_json};
use super::{Shared, IO_TIMEOUT, MAX_CONNECTIONS, MAX_PENDING, MAX_REQUEST};
use crate::net::auth;

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
pub(super) fn accept_loop(listener: &TcpListener, sh: &Arc<Shared>) {
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
                    let _ = (&p.s).write_all(format!("{}\n", error_json(NO_REQUEST)).as_bytes());
                }
                Got::More => keep.push_back(p),
            }
        }
        pending = keep;
    }
}

/// The error answered to a connection that sent no request (within [`IO_TIMEOUT`]).
const NO_REQUEST: &str = "no request (send 'status' or 'local')";

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
    let answer = error_json("busy: too many status connections, try again");
    let out = match parse_request(line.trim()) {
        Ok(r) => with_mac(answer.clone(), r.word, r.nonce, sh),
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
        let tag = auth::mac_tag(&sh.secret, &mac_parts(&n, word, &answer));
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
    let err = |m: &str| error_json(m);
    let (answer, word, nonce) = match line.trim() {
        "" => (error_json(NO_REQUEST), "", None),
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
