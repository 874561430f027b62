//! The bootstrap's exchanges without a relay through rank 0: Bruck's allgather over direct,
//! authenticated TCP connections between ranks.
//!
//! With `n` ranks an exchange takes `R = ceil(log2 n)` rounds; in round `k` rank `r` sends
//! every contribution it has (its own and those of ranks `r+1 .. r+2^k-1`, at most
//! `n - 2^k` of them) to rank `r - 2^k` and receives as many from rank `r + 2^k` (mod `n`).
//! Each rank thus sends and receives `R` messages and `n - 1` contributions per exchange,
//! over `2R` connections made once at init (it dials the `R` ranks it sends to and accepts
//! the `R` it hears from): O(log n) messages and connections and O(n) bytes at every rank,
//! rank 0 included (docs/scale.md, "Start-up").
//!
//! Rank 0 still hosts the rendezvous: every rank joins it (itself, or through its host's
//! leader, `host.rs`) with its address and the port of its exchange listener, and rank 0
//! answers each with only the addresses of the `R` ranks it sends to (and rank 0's
//! settings); the peer table is then the first exchange. The
//! connections to rank 0 stay open (the communicator's watchdog takes them). A rank whose
//! exchange fails tells the ranks it sends to which rank it blames ([`SEQ_LOST`]); they pass
//! it on the same way, so every rank waiting on one that waits on it hears it: a rank that
//! dies is found at once by the ranks that exchange with it (a closed link, or a refused
//! dial), and through them every rank fails at once, naming it. Until the peer table is
//! exchanged the connections to rank 0 carry that news too: a failing rank tells rank 0,
//! rank 0 tells every rank, and every wait watches its connection(s) to rank 0 (a rank
//! waiting for a link from a rank that died before dialing learns it there). Then each
//! rank closes them: once rank 0 has the whole table every rank has made its links and
//! sent its part, and the exchange links carry the rest. After init the exchange links are
//! the watchdog's (heartbeats and failure reports, `fault::control`): no connection per
//! rank stays open at rank 0.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};

use super::{
    take, take_u32, take_u64, tell_all, Bootstrap, Links, MAX_FRAME, MEMBER_GRACE, SEQ_LOST,
};
use crate::base::error::{Error, Result};
use crate::net::accept::{self, Admit, Keys, Strangers};
use crate::net::auth::{self, Deadlined, Hello, Purpose, Verdict};
use crate::net::dial::Dial;

/// How much longer a wait in each later round of an exchange lasts (see [`Bootstrap::swap`]).
const ROUND_GRACE: Duration = Duration::from_millis(200);

/// Rounds of an exchange among `n` ranks: `ceil(log2 n)` (0 for one rank).
pub(super) fn rounds(n: usize) -> usize {
    if n <= 1 {
        0
    } else {
        (usize::BITS - (n - 1).leading_zeros()) as usize
    }
}

/// The rank that `rank` sends to in round `k` (`2^k < n`).
pub(super) fn sends_to(rank: usize, k: usize, n: usize) -> usize {
    (rank + n - (1 << k)) % n
}

/// The rank that `rank` hears from in round `k` (`2^k < n`).
pub(super) fn hears_from(rank: usize, k: usize, n: usize) -> usize {
    (rank + (1 << k)) % n
}

/// A listener for the exchange connections of a rank whose address is `ip`.
pub(super) fn listen(ip: IpAddr) -> io::Result<TcpListener> {
    TcpListener::bind(SocketAddr::new(ip, 0))
}

/// One round's two connections.
pub(super) struct Round {
    /// The rank this rank sends to, and the connection it dialed to it.
    pub to: usize,
    pub tx: TcpStream,
    /// The rank this rank hears from, and the connection it accepted from it.
    pub from: usize,
    pub rx: TcpStream,
}

/// A rank's connections for the exchanges, by round; after init, the watchdog's
/// ([`Bootstrap::take_connections`]).
pub(super) struct Mesh {
    pub rounds: Vec<Round>,
}

/// Counts of what a rank sent and received in the bootstrap's exchanges (and in the
/// rendezvous), for the `bootstrap traffic` debug line.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Traffic {
    /// Messages sent in the exchanges.
    pub messages: u64,
    /// Bytes sent in the exchanges.
    pub bytes: u64,
    /// Rendezvous connections accepted over TCP (rank 0: one per rank or host leader).
    pub rendezvous_accepts: u64,
    /// Rendezvous messages read (rank 0: joins or host leaders' batches; others: answers).
    pub rendezvous_received: u64,
    /// Rendezvous messages sent (rank 0: answers; a host leader: batches and its members'
    /// answers; others: the join).
    pub rendezvous_sent: u64,
    /// A host leader's connections accepted from its members (`host.rs`).
    pub local_accepts: u64,
}

/// The accepting side of [`Bootstrap::connect_mesh`]: takes each round's connection from the
/// rank that sends to this one in that round.
struct MeshAdmit<'a> {
    boot: &'a Bootstrap,
    rx: Vec<Option<TcpStream>>,
    got: usize,
}

impl Admit for MeshAdmit<'_> {
    fn admit(&mut self, hello: Hello, stream: TcpStream, from: SocketAddr) -> Result<bool> {
        let (rank, n) = (self.boot.rank, self.boot.world_size);
        let round = {
            let mut d = Deadlined::new(&stream, Instant::now() + auth::HANDSHAKE_TIMEOUT);
            auth::send_verdict(&mut d, Verdict::Accepted).and_then(|_| auth::read_frame(&mut d, 1))
        };
        let k = match round.as_deref() {
            Ok([k]) => *k as usize,
            _ => {
                tracing::debug!(
                    rank,
                    "exchange link from {from} (rank {}) broke before naming its round",
                    hello.rank
                );
                return Ok(false);
            }
        };
        if k >= self.rx.len() || hello.rank != hears_from(rank, k, n) || self.rx[k].is_some() {
            tracing::debug!(
                rank,
                "refused an exchange link from {from}: rank {} for round {k}",
                hello.rank
            );
            return Ok(false);
        }
        self.rx[k] = Some(stream);
        self.got += 1;
        Ok(self.got == self.rx.len())
    }

    fn tick(&mut self, _strangers: &Strangers) -> Result<()> {
        self.boot.watch("init")
    }
}

impl Bootstrap {
    /// Makes this rank's exchange connections: accepts (on `listener`, in a thread) one from
    /// each rank it hears from, and dials each rank it sends to (`to[k]`: round `k`'s
    /// address). Every wait ends by `deadline` or when rank 0 reports a failure.
    pub(super) fn connect_mesh(
        &self,
        listener: TcpListener,
        to: &[SocketAddr],
        deadline: Instant,
    ) -> Result<Mesh> {
        let (rank, n) = (self.rank, self.world_size);
        let r = rounds(n);
        let keys = Keys {
            secret: self.secret,
            purpose: Purpose::Exchange,
            tag: self.comm_tag(),
            rank,
        };
        let cancel = AtomicBool::new(false);
        // Set when the accepting side failed on what it heard (a failure report, a lost
        // leader): the dials stop, and that error is the one to tell (a dial refused by a
        // rank that failed on the same news would blame that rank).
        let reported = AtomicBool::new(false);
        let stop = || reported.load(Ordering::SeqCst);
        let start = Instant::now();
        let (tx, rx) = std::thread::scope(|sc| {
            let accepter = sc.spawn(|| {
                let mut adm = MeshAdmit {
                    boot: self,
                    rx: (0..r).map(|_| None).collect(),
                    got: 0,
                };
                let res = accept::accept_loop(&listener, deadline, &cancel, &keys, &mut adm);
                // Ranks still dialing this one learn at once that it gave up.
                drop(listener);
                if matches!(res, Ok(Err(_))) {
                    reported.store(true, Ordering::SeqCst);
                }
                match res {
                    Ok(Ok(())) => Ok(adm.rx.into_iter().flatten().collect::<Vec<_>>()),
                    Ok(Err(e)) => Err(e),
                    Err(accept::AcceptStop::Deadline(_)) => Err(Error::Timeout {
                        rank,
                        call: "init",
                        seq: 0,
                        waiting_on: (0..r)
                            .filter(|&k| adm.rx[k].is_none())
                            .map(|k| hears_from(rank, k, n))
                            .collect(),
                        elapsed: deadline.saturating_duration_since(start),
                    }),
                    Err(accept::AcceptStop::Io(source)) => Err(Error::Io {
                        rank,
                        context: "accepting the bootstrap's exchange links".into(),
                        source,
                    }),
                }
            });
            let mut dialed = Vec::with_capacity(r);
            let dial_err = (0..r)
                .map(|k| {
                    let peer = sends_to(rank, k, n);
                    let dial = Dial {
                        addr: to[k],
                        secret: &self.secret,
                        hello: Hello {
                            rank,
                            purpose: Purpose::Exchange,
                            tag: keys.tag,
                        },
                        deadline,
                        first_pause: Duration::from_millis(10),
                        max_pause: Duration::from_millis(200),
                        // Its listener was open before it joined: refused means it is gone.
                        refused_limit: Some(self.timeout.min(Duration::from_secs(2))),
                        connect: |a, t| TcpStream::connect_timeout(&a, t),
                        stop: Some(&stop),
                    };
                    let s = dial.run(
                        |_, _| {},
                        |g| Error::Connect {
                            rank,
                            peer,
                            addr: to[k].to_string(),
                            timeout: Duration::from_millis((g.at - start).as_millis() as u64),
                            reason: format!("bootstrap exchange link: {}", g.last_err),
                        },
                    )?;
                    auth::write_frame(&mut Deadlined::new(&s, deadline), &[k as u8])
                        .map_err(|e| self.lost(peer, "init", e))?;
                    dialed.push(s);
                    Ok(())
                })
                .find_map(|r: Result<()>| r.err());
            if dial_err.is_some() {
                cancel.store(true, Ordering::SeqCst);
            }
            let accepted = accepter.join().unwrap_or_else(|_| {
                Err(Error::Io {
                    rank,
                    context: "accepting the bootstrap's exchange links".into(),
                    source: io::Error::other("the accepting thread panicked"),
                })
            });
            match (dial_err, accepted) {
                (Some(_), Err(e)) if reported.load(Ordering::SeqCst) => {
                    let tx: Vec<&TcpStream> = dialed.iter().collect();
                    tell_lost(&tx, &e);
                    Err(e)
                }
                (Some(e), accepted) => {
                    // A dial that failed once the accepting side was done (refused: the rank
                    // there gave up and exited) may have a cause that is already here, said
                    // before that rank left on a connection no one watches any more: blame
                    // the cause, not the rank that is gone.
                    let e = match &accepted {
                        Ok(rx) => self.report_already_here(rx).unwrap_or(e),
                        Err(_) => e,
                    };
                    // The ranks this one dialed will wait on it: say whom it blames.
                    let tx: Vec<&TcpStream> = dialed.iter().collect();
                    tell_lost(&tx, &e);
                    Err(e)
                }
                (None, Err(e)) => {
                    // The ranks this one dialed will wait on it: say whom it blames.
                    let tx: Vec<&TcpStream> = dialed.iter().collect();
                    tell_lost(&tx, &e);
                    Err(e)
                }
                (None, Ok(rx)) => Ok((dialed, rx)),
            }
        })?;
        let rounds = tx
            .into_iter()
            .zip(rx)
            .enumerate()
            .map(|(k, (tx, rx))| {
                for s in [&tx, &rx] {
                    s.set_nodelay(true)?;
                    s.set_nonblocking(true)?;
                }
                Ok(Round {
                    to: sends_to(rank, k, n),
                    tx,
                    from: hears_from(rank, k, n),
                    rx,
                })
            })
            .collect::<io::Result<Vec<_>>>()
            .map_err(|source| Error::Io {
                rank,
                context: "setting up the bootstrap's exchange links".into(),
                source,
            })?;
        Ok(Mesh { rounds })
    }

    /// A failure report that already arrived, looked for without waiting: on the accepted
    /// exchange links `rx` (round `k`'s from the rank this one hears from in it: a rank that
    /// failed tells the ranks it dialed, then exits) or on the rendezvous connections
    /// ([`watch`](Self::watch)).
    fn report_already_here(&self, rx: &[TcpStream]) -> Option<Error> {
        let (rank, n) = (self.rank, self.world_size);
        let conns: Vec<(usize, &TcpStream)> = rx
            .iter()
            .enumerate()
            .map(|(k, s)| (hears_from(rank, k, n), s))
            .collect();
        for (from, s) in crate::net::readable_now(&conns) {
            let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
            if let Ok(f) = auth::read_frame(&mut &*s, MAX_FRAME) {
                let mut r = &f[..];
                if take_u64(&mut r) == Some(SEQ_LOST) {
                    return Some(self.lost_report(from, r, "init"));
                }
            }
        }
        self.watch("init").err()
    }

    /// Looks (without waiting) at the connection(s) to rank 0 (at rank 0: to every rank):
    /// anything there during an exchange is a failure report.
    pub(super) fn watch(&self, call: &'static str) -> Result<()> {
        if self.joined {
            // After the rendezvous a rank's watchdog may use its connections already.
            return Ok(());
        }
        let conns: Vec<(usize, &TcpStream)> = match &self.links {
            Links::Root(c) => c
                .iter()
                .enumerate()
                .filter_map(|(r, c)| c.as_ref().map(|c| (r, c)))
                .collect(),
            Links::Member(s) => vec![(0, s)],
            Links::Via(..) => Vec::new(),
        };
        for (r, s) in crate::net::readable_now(&conns) {
            // A closed connection is no failure by itself: a rank that finished the last
            // exchange may have gone on and closed it. A rank that died is found by the
            // ranks that exchange with it. But a host leader says when it is done: its
            // members hear rank 0 only through it, and may not be able to tell anyone else.
            let leader = self
                .root_leaders
                .get(r)
                .filter(|l| l.load(Ordering::SeqCst))
                .is_some();
            match s.peek(&mut [0u8; 1]) {
                Ok(1) => {}
                Ok(_) | Err(_) if leader => return Err(self.leader_gone(
                    r,
                    call,
                    "the rendezvous leader of its host's ranks, closed its connection to rank 0",
                )),
                _ => continue,
            }
            let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
            let f = auth::read_frame(&mut &*s, MAX_FRAME);
            let _ = s.set_read_timeout(Some(self.timeout));
            if leader {
                if let Ok(f) = &f {
                    if f[..] == super::host::SEQ_DONE.to_le_bytes() {
                        self.root_leaders[r].store(false, Ordering::SeqCst);
                        continue;
                    }
                }
            }
            return Err(self.report_read(r, f, call));
        }
        // A host leader's members (closing is no failure: a member may have finished), and a
        // member's leader: its connection closing before it said it was done is its death
        // (its members hear no more from rank 0 through it).
        let mut local: Vec<(usize, &UnixStream)> =
            self.local.iter().map(|(r, s)| (*r, s)).collect();
        let leader = match &self.links {
            Links::Via(l, s) if !self.leader_done.load(Ordering::SeqCst) => {
                local.push((*l, s));
                Some(*l)
            }
            _ => None,
        };
        for (r, s) in crate::net::readable_now(&local) {
            match super::host::peek1(s) {
                Ok(0) if Some(r) == leader => {
                    return Err(self.leader_gone(
                        r,
                        call,
                        "this host's leader for the rendezvous, closed its connection",
                    ))
                }
                Ok(1) => {}
                _ => continue,
            }
            let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
            let f = auth::read_frame(&mut &*s, MAX_FRAME);
            let _ = s.set_read_timeout(Some(self.timeout));
            if Some(r) == leader {
                if let Ok(f) = &f {
                    if f[..] == super::host::SEQ_DONE.to_le_bytes() {
                        self.leader_done.store(true, Ordering::SeqCst);
                        continue;
                    }
                }
            }
            return Err(self.report_read(r, f, call));
        }
        Ok(())
    }

    /// Host leader `r` (`who`: which, and whose connection closed) went away before the peer
    /// table was exchanged.
    fn leader_gone(&self, r: usize, call: &'static str, who: &str) -> Error {
        Error::PeerLost {
            rank: self.rank,
            peer: r,
            call,
            seq: self.seq,
            reason: format!(
                "rank {r}, {who} before the peer table was exchanged: it died or was stopped"
            ),
        }
    }

    /// The error for what [`watch`](Self::watch) read from rank `r`'s connection.
    fn report_read(&self, r: usize, f: io::Result<Vec<u8>>, call: &'static str) -> Error {
        match f {
            Ok(f) if f.len() >= 8 && take_u64(&mut &f[..8]) == Some(SEQ_LOST) => {
                self.lost_report(r, &f[8..], call)
            }
            // A host leader that saw a member die just as rank 0's answer came.
            Ok(f) if f.first() == Some(&super::host::HOST_LOST) => {
                self.lost_report(r, &f[1..], call)
            }
            Ok(_) => self.proto(r, call, "unexpected message on the rendezvous connection"),
            Err(e) => self.lost(r, call, e),
        }
    }

    /// Before blaming a rank whose link closed during init: a rank that failed because of
    /// another (and closed its links) told rank 0, which tells every rank; waits briefly
    /// for that word, and returns it as the error.
    fn await_report(&self, call: &'static str) -> Result<()> {
        if self.joined {
            return Ok(());
        }
        let until = Instant::now() + Duration::from_millis(300);
        while Instant::now() < until {
            self.watch(call)?;
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// After this rank's exchange failed with `e`: tells the ranks it sends to, and rank 0
    /// (rank 0: every rank), which rank it blames, so that they fail at once naming it.
    pub(super) fn spread_failure(&mut self, e: &Error) {
        let Some((blamed, msg)) = lost_message(e) else {
            return;
        };
        if let Some(mesh) = &self.mesh {
            let tx: Vec<&TcpStream> = mesh.rounds.iter().map(|rd| &rd.tx).collect();
            tell_lost(&tx, e);
        }
        match &mut self.links {
            // After the rendezvous the watchdogs own these connections: the exchange links
            // alone carry the news.
            _ if self.joined => {}
            Links::Root(conns) => tell_all(conns, blamed, &msg),
            Links::Member(s) if blamed != 0 => {
                let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
                let _ = auth::write_frame(s, &msg);
            }
            Links::Member(_) => {}
            Links::Via(l, s) if blamed != *l => {
                let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
                let _ = auth::write_frame(&mut &*s, &msg);
            }
            Links::Via(..) => {}
        }
        if !self.joined {
            // A host leader: its members hear rank 0 only through it.
            for (r, s) in &self.local {
                if *r != blamed {
                    let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
                    let _ = auth::write_frame(&mut &*s, &msg);
                }
            }
        }
    }

    /// One exchange (Bruck's allgather, see the module documentation) numbered `seq`;
    /// every rank's `mine`, by rank.
    pub(super) fn allgather_mesh(
        &mut self,
        mine: &[u8],
        seq: u64,
        call: &'static str,
    ) -> Result<Vec<Vec<u8>>> {
        let (rank, n) = (self.rank, self.world_size);
        // `have[j]`: the contribution of rank `rank + j`.
        let mut have = vec![mine.to_vec()];
        let Some(mesh) = &self.mesh else {
            return Ok(have);
        };
        let nrounds = mesh.rounds.len();
        let mut traffic = self.traffic;
        for (k, rd) in mesh.rounds.iter().enumerate() {
            let count = (1usize << k).min(n - (1 << k));
            let size = 8 + have[..count].iter().map(|v| 4 + v.len()).sum::<usize>();
            if size > MAX_FRAME {
                return Err(Error::InvalidArgument {
                    rank,
                    call,
                    seq,
                    msg: format!(
                        "{size} bytes in one bootstrap message exceed the limit of {MAX_FRAME}"
                    ),
                });
            }
            let mut out = Vec::with_capacity(size);
            out.extend_from_slice(&seq.to_le_bytes());
            for v in &have[..count] {
                out.extend_from_slice(&(v.len() as u32).to_le_bytes());
                out.extend_from_slice(v);
            }
            let got = self.swap(rd, &out, seq, k, nrounds, call)?;
            traffic.messages += 1;
            traffic.bytes += 4 + out.len() as u64;
            let mut r = &got[..];
            match take_u64(&mut r) {
                Some(SEQ_LOST) => return Err(self.lost_report(rd.from, r, call)),
                Some(s) if s == seq => {}
                Some(s) => {
                    return Err(self.proto(
                        rd.from,
                        call,
                        &format!(
                            "rank {} is at bootstrap exchange #{s}, rank {rank} at #{seq}",
                            rd.from
                        ),
                    ))
                }
                None => return Err(self.proto(rd.from, call, "short message")),
            }
            for _ in 0..count {
                let len =
                    take_u32(&mut r).ok_or_else(|| self.proto(rd.from, call, "short message"))?;
                let v = take(&mut r, len as usize)
                    .ok_or_else(|| self.proto(rd.from, call, "short message"))?;
                have.push(v.to_vec());
            }
            if !r.is_empty() {
                return Err(self.proto(rd.from, call, "trailing bytes in message"));
            }
        }
        self.traffic = traffic;
        // By rank: `have[j]` is rank `rank + j`'s.
        have.rotate_right(rank);
        Ok(have)
    }

    /// Sends `out` on round `rd`'s outgoing link while it receives the message on its
    /// incoming one (both at once: in a round every rank sends before it reads, and a large
    /// message would otherwise wait on a peer that waits to send), watching the connection(s)
    /// to rank 0, saying what it waits for every `report_every`, until the timeout (plus
    /// [`MEMBER_GRACE`], so that the rank nearest a silent one fails first and names it).
    fn swap(
        &self,
        rd: &Round,
        out: &[u8],
        seq: u64,
        k: usize,
        nrounds: usize,
        call: &'static str,
    ) -> Result<Vec<u8>> {
        let mut frame = Vec::with_capacity(4 + out.len());
        frame.extend_from_slice(&(out.len() as u32).to_le_bytes());
        frame.extend_from_slice(out);
        let mut sent = 0;
        let mut hdr = [0u8; 4];
        let mut got_hdr = 0;
        let mut body: Option<Vec<u8>> = None;
        let mut got = 0;
        let start = Instant::now();
        // Later rounds wait a little longer: a rank waiting in round k on a rank that waits
        // in an earlier round on a silent one gives up after it, and hears whom it blames.
        let deadline = start + self.timeout + MEMBER_GRACE + ROUND_GRACE * k as u32;
        let mut next_say = self.report_every.map(|e| start + e);
        let step_err = |peer: usize, e: io::Error| self.lost(peer, call, e);
        loop {
            while sent < frame.len() {
                match (&rd.tx).write(&frame[sent..]) {
                    Ok(0) => return Err(step_err(rd.to, io::ErrorKind::WriteZero.into())),
                    Ok(m) => sent += m,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(step_err(rd.to, e)),
                }
            }
            loop {
                let buf: &mut [u8] = match &mut body {
                    None => &mut hdr[got_hdr..],
                    Some(b) if got < b.len() => &mut b[got..],
                    Some(_) => break,
                };
                match (&rd.rx).read(buf) {
                    Ok(0) => {
                        self.await_report(call)?;
                        return Err(step_err(rd.from, io::ErrorKind::UnexpectedEof.into()));
                    }
                    Ok(m) if body.is_none() => {
                        got_hdr += m;
                        if got_hdr == 4 {
                            let len = u32::from_le_bytes(hdr) as usize;
                            if len > MAX_FRAME {
                                return Err(self.proto(
                                    rd.from,
                                    call,
                                    &format!(
                                        "frame of {len} bytes exceeds the limit of {MAX_FRAME}"
                                    ),
                                ));
                            }
                            body = Some(vec![0; len]);
                        }
                    }
                    Ok(m) => got += m,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        self.await_report(call)?;
                        return Err(step_err(rd.from, e));
                    }
                }
            }
            let received = body.as_ref().is_some_and(|b| got == b.len());
            if sent == frame.len() && received {
                return Ok(body.unwrap_or_default());
            }
            self.watch(call)?;
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    rank: self.rank,
                    call,
                    seq: self.seq,
                    waiting_on: vec![if received { rd.to } else { rd.from }],
                    elapsed: now - start,
                });
            }
            if let (Some(at), Some(every)) = (next_say, self.report_every) {
                if now >= at {
                    next_say = Some(now + every);
                    let what = if received {
                        format!("to take its message (sending to rank {})", rd.to)
                    } else {
                        format!("for rank {}'s message", rd.from)
                    };
                    crate::base::debug::announce(&format!(
                        "rank {}: bootstrap exchange #{seq}, round {} of {nrounds}: waiting {:.0?} {what}; is rank {} stopped or overloaded, or waiting on another?",
                        self.rank,
                        k + 1,
                        now - start,
                        if received { rd.to } else { rd.from },
                    ));
                }
            }
            let mut wait = deadline
                .saturating_duration_since(now)
                .min(Duration::from_millis(50));
            if let Some(at) = next_say {
                wait = wait.min(at.saturating_duration_since(now));
            }
            let mut fds = vec![PollFd::new(&rd.rx, PollFlags::IN)];
            if sent < frame.len() {
                fds.push(PollFd::new(&rd.tx, PollFlags::OUT));
            }
            let ts = Timespec {
                tv_sec: wait.as_secs() as _,
                tv_nsec: wait.subsec_nanos() as _,
            };
            let _ = rustix::event::poll(&mut fds, Some(&ts));
        }
    }
}

/// The failure report for `e` (the rank it blames, and the message saying so), if it blames
/// a rank.
pub(super) fn lost_message(e: &Error) -> Option<(usize, Vec<u8>)> {
    let blamed = blame(e)?;
    let mut msg = SEQ_LOST.to_le_bytes().to_vec();
    msg.extend_from_slice(&(blamed as u32).to_le_bytes());
    msg.extend_from_slice(e.to_string().as_bytes());
    Some((blamed, msg))
}

/// Sends the failure report for `e` on each of `tx` (best effort, briefly).
fn tell_lost(tx: &[&TcpStream], e: &Error) {
    let Some((_, msg)) = lost_message(e) else {
        return;
    };
    for s in tx {
        let _ = s.set_nonblocking(false);
        let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
        let _ = auth::write_frame(&mut &**s, &msg);
    }
}

/// The rank an exchange's error blames, to be told to the others.
pub(super) fn blame(e: &Error) -> Option<usize> {
    e.lost_peer().or(match e {
        Error::Timeout { waiting_on, .. } if waiting_on.len() == 1 => Some(waiting_on[0]),
        Error::Protocol { peer, .. } | Error::Connect { peer, .. } => Some(*peer),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank hears from the rank that sends to it, and in `rounds(n)` rounds of Bruck's
    /// allgather every rank gets every contribution exactly once.
    #[test]
    fn bruck_rounds_reach_every_rank_once() {
        for n in [1usize, 2, 3, 4, 5, 7, 8, 9, 16, 17, 100, 256, 1000] {
            let r = rounds(n);
            assert!(n <= 1 << r && (r == 0 || 1 << (r - 1) < n), "n={n} r={r}");
            for rank in 0..n {
                for k in 0..r {
                    assert_eq!(hears_from(sends_to(rank, k, n), k, n), rank);
                }
            }
            // Simulate: have[rank] = contributions (as ranks) in order of offset.
            let mut have: Vec<Vec<usize>> = (0..n).map(|r| vec![r]).collect();
            for k in 0..r {
                let count = (1usize << k).min(n - (1 << k));
                let sent: Vec<Vec<usize>> = have.iter().map(|h| h[..count].to_vec()).collect();
                for (rank, h) in have.iter_mut().enumerate() {
                    assert_eq!(h.len(), 1 << k);
                    h.extend(&sent[hears_from(rank, k, n)]);
                }
            }
            for (rank, h) in have.iter().enumerate() {
                let want: Vec<usize> = (0..n).map(|j| (rank + j) % n).collect();
                assert_eq!(h, &want, "n={n} rank={rank}");
            }
        }
    }
}
