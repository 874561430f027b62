//! One authenticated dial, shared by the rendezvous (a rank joining rank 0) and the TCP
//! transport (a rank connecting to its lower-ranked peers): connect within a timeout, run
//! the connector's side of the handshake ([`crate::net::auth::client_handshake`]), and on a
//! failure that a retry may cure sleep a capped, doubling pause and try again until a
//! deadline. A failure that retrying cannot help (the acceptor does not know the secret, or
//! refuses us: [`Error::Auth`]) is returned at once.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::base::error::{Error, Result};
use crate::net::auth::{self, Deadlined, Hello};

/// The longest one connection attempt may take (less when the deadline is nearer).
pub(crate) const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

/// How often a handshake that waits for the acceptor's answer lets the caller report it.
pub(crate) const HANDSHAKE_TICK: Duration = Duration::from_secs(1);

/// How often a handshake that waits for the acceptor's answer asks [`Dial::stop`]: a
/// communicator dropped while its watchdog dials a stopped rank (the new hub of the star)
/// waits this long for the dial to end, not a [`HANDSHAKE_TICK`].
pub(crate) const STOP_TICK: Duration = Duration::from_millis(10);

/// How to reach one acceptor; see the module documentation.
pub(crate) struct Dial<'a> {
    /// The acceptor's address.
    pub(crate) addr: SocketAddr,
    /// The communicator's secret.
    pub(crate) secret: &'a [u8; 16],
    /// Who we are and what for (its rank names this rank in errors).
    pub(crate) hello: Hello,
    /// When to give up (the handshake of an attempt ends by it too).
    pub(crate) deadline: Instant,
    /// The pause after the first failed attempt; it doubles after each.
    pub(crate) first_pause: Duration,
    /// The longest pause between attempts.
    pub(crate) max_pause: Duration,
    /// Give up early once every attempt for this long was refused (nothing listens).
    pub(crate) refused_limit: Option<Duration>,
    /// Opens the connection within a timeout (with the caller's socket options).
    pub(crate) connect: fn(SocketAddr, Duration) -> io::Result<TcpStream>,
    /// Asked before every attempt and while a handshake waits: `true` gives up at once
    /// (the caller's communicator failed). `None`: only the deadline ends the dial.
    pub(crate) stop: Option<&'a dyn Fn() -> bool>,
}

/// Why a [`Dial`] stopped retrying, for the caller's error.
#[derive(Debug)]
pub(crate) struct GaveUp {
    /// The last attempt's failure ("no attempt made" if none was).
    pub(crate) last_err: String,
    /// Set when it stopped because every attempt for this long was refused
    /// ([`Dial::refused_limit`]); `None` when the deadline passed.
    pub(crate) refused_for: Option<Duration>,
    /// When it gave up.
    pub(crate) at: Instant,
}

impl Dial<'_> {
    /// Dials until connected and authenticated. Before each attempt `round(now, last_err)`
    /// runs (to report progress); when the deadline passes or nothing listened for
    /// [`Dial::refused_limit`], the error is `give_up`'s.
    pub(crate) fn run(
        &self,
        mut round: impl FnMut(Instant, &str),
        give_up: impl FnOnce(GaveUp) -> Error,
    ) -> Result<TcpStream> {
        let addr = self.addr.to_string();
        let mut last_err = String::from("no attempt made");
        let mut pause = self.first_pause;
        // Since when every attempt was refused (nothing listens at the address).
        let mut refused_since: Option<Instant> = None;
        loop {
            let now = Instant::now();
            let left = self.deadline.saturating_duration_since(now);
            let refused_for = self
                .refused_limit
                .filter(|limit| refused_since.is_some_and(|t| now - t >= *limit));
            if left.is_zero() || refused_for.is_some() || self.stop.is_some_and(|f| f()) {
                return Err(give_up(GaveUp {
                    last_err,
                    refused_for,
                    at: now,
                }));
            }
            round(now, &last_err);
            match (self.connect)(self.addr, left.min(ATTEMPT_TIMEOUT)) {
                Ok(s) => {
                    refused_since = None;
                    // The handshake and what follows it (the rendezvous join) are small
                    // messages each answered at once: no Nagle delay behind an unacked one.
                    let _ = s.set_nodelay(true);
                    // An acceptor that takes the connection and says nothing (another
                    // program on the port, a stopped rank 0) would keep this rank silent
                    // until the deadline: say so every HANDSHAKE_TICK (`round` reports it
                    // at its own pace).
                    let since = Instant::now();
                    let round = &mut round;
                    let stop = self.stop;
                    let sref = &s;
                    // With a stop to ask, ask it often (a drop waits for it); report at the
                    // report's pace.
                    let tick = if stop.is_some() {
                        STOP_TICK
                    } else {
                        HANDSHAKE_TICK
                    };
                    let mut reported = since;
                    let mut d = Deadlined::new(&s, self.deadline).with_tick(tick, || {
                        if stop.is_some_and(|f| f()) {
                            // Ends the wait: the read fails, and the loop's next round stops.
                            let _ = sref.shutdown(std::net::Shutdown::Both);
                        }
                        let now = Instant::now();
                        if now - reported < HANDSHAKE_TICK {
                            return;
                        }
                        reported = now;
                        round(
                            now,
                            &format!(
                                "connected to {addr}, but it has not answered the oxccl handshake for {:.0?}: another program may hold the port, or the rank there is stopped or overloaded",
                                since.elapsed()
                            ),
                        )
                    });
                    let shaken = auth::client_handshake(
                        &mut d,
                        self.secret,
                        &self.hello,
                        self.hello.rank,
                        &addr,
                    );
                    drop(d);
                    match shaken {
                        Ok(()) => return Ok(s),
                        // Wrong secret or refused: retrying cannot help.
                        Err(e @ Error::Auth { .. }) => return Err(e),
                        Err(e) => last_err = e.to_string(),
                    }
                }
                Err(e) => {
                    if e.kind() == io::ErrorKind::ConnectionRefused {
                        refused_since.get_or_insert(now);
                    } else {
                        refused_since = None;
                    }
                    last_err = format!("connecting: {e}");
                }
            }
            std::thread::sleep(pause.min(self.deadline.saturating_duration_since(Instant::now())));
            pause = (pause * 2).min(self.max_pause);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::auth::{comm_tag, send_verdict, server_handshake, Purpose, Verdict};
    use std::net::TcpListener;

    const SECRET: [u8; 16] = [3; 16];

    fn dial(addr: SocketAddr, secret: &[u8; 16], deadline: Instant) -> Dial<'_> {
        Dial {
            addr,
            secret,
            hello: Hello {
                rank: 1,
                purpose: Purpose::Data,
                tag: comm_tag(&SECRET),
            },
            deadline,
            first_pause: Duration::from_millis(1),
            max_pause: Duration::from_millis(4),
            refused_limit: None,
            connect: |a, t| TcpStream::connect_timeout(&a, t),
            stop: None,
        }
    }

    fn gave_up(g: GaveUp) -> Error {
        Error::Connect {
            rank: 1,
            peer: 0,
            addr: String::new(),
            timeout: Duration::ZERO,
            reason: format!("{} / refused for {:?}", g.last_err, g.refused_for),
        }
    }

    /// An acceptor that serves `n` handshakes and answers each with its verdict.
    fn acceptor(n: usize) -> (SocketAddr, std::thread::JoinHandle<Vec<Result<Hello>>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            (0..n)
                .map(|_| {
                    let (mut s, _) = l.accept().unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                    let r =
                        server_handshake(&mut s, &SECRET, Purpose::Data, comm_tag(&SECRET), 0, "t");
                    if r.is_ok() {
                        send_verdict(&mut s, Verdict::Accepted).unwrap();
                    }
                    r
                })
                .collect()
        });
        (addr, t)
    }

    #[test]
    fn connects_and_authenticates() {
        let (addr, t) = acceptor(1);
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut rounds = 0;
        dial(addr, &SECRET, deadline)
            .run(|_, _| rounds += 1, gave_up)
            .unwrap();
        assert_eq!(rounds, 1);
        let seen = t.join().unwrap();
        assert_eq!(seen[0].as_ref().unwrap().rank, 1);
    }

    #[test]
    fn a_wrong_secret_is_not_retried() {
        let (addr, t) = acceptor(1);
        // Retrying would end in the `gave_up` error at the deadline, not in `Auth`.
        let deadline = Instant::now() + Duration::from_secs(30);
        let r = dial(addr, &[4; 16], deadline).run(|_, _| {}, gave_up);
        assert!(matches!(r, Err(Error::Auth { .. })), "{r:?}");
        assert!(t.join().unwrap()[0].is_err());
    }

    #[test]
    fn gives_up_when_nothing_listens() {
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let mut d = dial(addr, &SECRET, Instant::now() + Duration::from_secs(30));
        d.refused_limit = Some(Duration::ZERO);
        let mut last = Vec::new();
        let e = d
            .run(|_, l| last.push(l.to_string()), gave_up)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("connecting: ") && e.contains("refused for Some(0ns)"),
            "{e}"
        );
        assert_eq!(last, ["no attempt made"]);
    }

    #[test]
    fn gives_up_at_the_deadline_without_an_attempt() {
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let mut rounds = 0;
        let e = dial(addr, &SECRET, Instant::now())
            .run(|_, _| rounds += 1, gave_up)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no attempt made / refused for None"), "{e}");
        assert_eq!(rounds, 0);
    }

    #[test]
    fn a_silent_listener_is_reported_while_the_handshake_waits() {
        // Something accepts on the port and never speaks: the dialer must
        // say so every HANDSHAKE_TICK, not wait silently until the deadline.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let holder = std::thread::spawn(move || {
            let kept = l.accept().ok();
            std::thread::sleep(Duration::from_millis(3500));
            drop(kept);
        });
        let mut said = Vec::new();
        let start = Instant::now();
        let r = dial(addr, &SECRET, start + Duration::from_millis(2500))
            .run(|_, m| said.push(m.to_string()), |g| Error::Env(g.last_err));
        assert!(r.is_err());
        // Ends at the 2.5 s deadline quiet; ten times that for a busy machine.
        assert!(
            start.elapsed() < Duration::from_secs(25),
            "{:?}",
            start.elapsed()
        );
        let reports = said
            .iter()
            .filter(|m| m.contains("has not answered the oxccl handshake"))
            .count();
        assert!(reports >= 1, "{said:?}");
        holder.join().unwrap();
    }
}
