//! Connect on first use (`OXCCL_TCP_CONNECT=lazy`, NCCL's model): init exchanges listen
//! addresses only, and a TCP link is made the first time a call needs it.
//!
//! Every rank runs an acceptor thread on its listener from init until its last TCP link is
//! made (or the communicator ends): it adopts any authenticated connection from a TCP peer
//! without a link at any time, whatever the rank's calls are doing, and keeps it until a
//! call here needs that peer. So no end of a pair has to be in a call for its link to be
//! made, and a link never waits for the peer's program:
//!
//! - a call that needs a link nobody has started dials the peer itself ([`LazyTcp::connect`])
//!   and the peer's acceptor answers at once: a first send goes out whether or not the
//!   receiver is in a call, and a receive from any source dials every peer it lacks, one
//!   after the other, each done in a round trip;
//! - when both ends dial each other at once, the higher rank's connection makes the link:
//!   its acceptor refuses the lower one's with [`Verdict::Crossed`] (it is dialing
//!   itself), the lower one's acceptor adopts it, and the lower rank's call waits for that
//!   adoption (a round trip away; bounded by the call's deadline);
//! - several connections per pair (`OXCCL_TCP_STREAMS`) are all dialed by the end whose
//!   first one was taken, in order, so both ends stripe them alike.
//!
//! Strangers cannot hold up the acceptor ([`crate::net::accept`]: one thread polls every
//! unauthenticated connection, each with its own deadlines and limits). Every wait of a call
//! ends at the call's deadline, or at once when the caller's `stop` says the communicator
//! failed (the watchdog lost a peer), and a peer whose listener refuses connections for
//! [`GONE_AFTER`] is gone. The errors name this rank, the peer, the call and its sequence
//! number. The acceptor thread is stopped and joined when the last link is made or the
//! communicator ends, and its listener closed.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::base::error::{Error, Result};
use crate::net::accept::{self, Admit, Strangers};
use crate::net::auth::{self, Deadlined, Hello, Purpose, Verdict};
use crate::transport::counted::{counted_into, LinkStats};
use crate::transport::Link;

/// A peer whose listener refused every connection for this long is gone.
pub(crate) const GONE_AFTER: Duration = Duration::from_secs(2);

/// How often a call that waits for a peer's connection looks at the communicator's health.
const WAIT_TICK: Duration = Duration::from_millis(20);

/// How long the acceptor runs at most (it is stopped long before).
const FOREVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// Where a pair's link stands, as the acceptor and the calls share it.
#[derive(Debug)]
enum Slot {
    /// Not reached over TCP (this rank, a shared-memory peer).
    Not,
    /// A TCP peer, no connection yet.
    Pending,
    /// A call here is dialing the peer.
    Dialing,
    /// The peer dialed: its connections so far (all of them once there are `streams`),
    /// waiting for a call here to take them.
    Adopted(Vec<TcpStream>),
    /// A call here took the link.
    Made,
}

/// The state the acceptor thread and the calls share.
struct Table {
    me: usize,
    streams: usize,
    slots: Vec<Slot>,
    /// What strangers did to the listener so far (for a wait's error).
    strangers: Option<String>,
    /// Why the acceptor stopped on its own (the listener failed).
    failed: Option<String>,
}

impl Table {
    /// What this rank answers a connection that authenticated as `from`.
    fn verdict(&self, from: usize) -> Verdict {
        match self.slots.get(from) {
            None | Some(Slot::Not) => Verdict::UnexpectedRank,
            Some(Slot::Pending) => Verdict::Accepted,
            // Both dial: the higher rank's connection makes the link (its dial may have
            // ended before the lower one's arrives).
            Some(Slot::Dialing | Slot::Made) if self.me > from => Verdict::Crossed,
            Some(Slot::Dialing) => Verdict::Accepted,
            Some(Slot::Adopted(v)) if v.len() < self.streams => Verdict::Accepted,
            Some(Slot::Adopted(_) | Slot::Made) => Verdict::DuplicateRank,
        }
    }

    /// Whether every connection `from` dials is here.
    fn ready(&self, from: usize) -> bool {
        matches!(self.slots.get(from), Some(Slot::Adopted(v)) if v.len() >= self.streams)
    }
}

struct Shared {
    table: Mutex<Table>,
    /// Signalled when a connection is adopted or the acceptor stops.
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank's TCP links that are not made yet, and what it needs to make them.
pub(crate) struct LazyTcp {
    me: usize,
    /// The listener (the acceptor thread polls it; shut down to stop that thread).
    listener: Arc<TcpListener>,
    /// Every TCP peer, ascending.
    peers: Vec<usize>,
    /// Where each TCP peer listens, ascending by rank.
    addrs: Vec<(usize, SocketAddr)>,
    /// Connections per pair.
    streams: usize,
    secret: [u8; 16],
    tag: u64,
    dead_after: Duration,
    /// Per rank, as the calls see it: `Pending` for a TCP peer whose link no call took yet,
    /// `Made` once one did, `Not` otherwise (read without a lock on every call).
    state: Vec<Peer>,
    /// How many links are made.
    made: usize,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
    /// The status agent's counters of every peer's link, made before the link.
    stats: Vec<(usize, Arc<LinkStats>)>,
}

/// What a rank is to a [`LazyTcp`]'s calls.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Peer {
    Not,
    Pending,
    Made,
}

impl std::fmt::Debug for LazyTcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyTcp")
            .field("me", &self.me)
            .field("peers", &self.peers)
            .field("made", &self.made)
            .finish_non_exhaustive()
    }
}

impl LazyTcp {
    /// The state after init's port exchange: `listener` open, `peers` every TCP peer
    /// (ascending), `addrs` where each one listens; starts the acceptor thread.
    pub(crate) fn new(
        me: usize,
        listener: TcpListener,
        peers: &[usize],
        addrs: &[(usize, SocketAddr)],
        streams: usize,
        secret: &[u8; 16],
        dead_after: Duration,
    ) -> Result<LazyTcp> {
        let n = peers.iter().max().map_or(0, |m| m + 1).max(me + 1);
        let mut state = vec![Peer::Not; n];
        let mut slots: Vec<Slot> = (0..n).map(|_| Slot::Not).collect();
        for &p in peers {
            state[p] = Peer::Pending;
            slots[p] = Slot::Pending;
        }
        let streams = streams.max(1);
        let shared = Arc::new(Shared {
            table: Mutex::new(Table {
                me,
                streams,
                slots,
                strangers: None,
                failed: None,
            }),
            changed: Condvar::new(),
        });
        let listener = Arc::new(listener);
        let stop = Arc::new(AtomicBool::new(false));
        let tag = auth::comm_tag(secret);
        let keys = accept::Keys {
            secret: *secret,
            purpose: Purpose::Data,
            tag,
            rank: me,
        };
        let acceptor = {
            let (listener, shared, stop) = (listener.clone(), shared.clone(), stop.clone());
            std::thread::Builder::new()
                .name(format!("oxccl-tcp-accept-{me}"))
                .spawn(move || acceptor(&listener, &shared, &stop, &keys))
                .map_err(|source| Error::Io {
                    rank: me,
                    context: "starting the TCP acceptor thread".into(),
                    source,
                })?
        };
        let mut addrs = addrs.to_vec();
        addrs.sort_by_key(|a| a.0);
        Ok(LazyTcp {
            me,
            listener,
            peers: peers.to_vec(),
            addrs,
            streams,
            secret: *secret,
            tag,
            dead_after,
            state,
            made: 0,
            shared,
            stop,
            acceptor: Some(acceptor),
            stats: peers
                .iter()
                .map(|&p| (p, Arc::new(LinkStats::default())))
                .collect(),
        })
    }

    /// Every TCP peer, ascending.
    pub(crate) fn peers(&self) -> Vec<usize> {
        self.peers.clone()
    }

    /// Whether `peer` is reached over TCP (its link made or not).
    pub(crate) fn covers(&self, peer: usize) -> bool {
        self.state.get(peer).is_some_and(|s| *s != Peer::Not)
    }

    fn pending(&self, peer: usize) -> bool {
        self.state.get(peer) == Some(&Peer::Pending)
    }

    /// Whether every TCP link is made.
    pub(crate) fn all_made(&self) -> bool {
        self.made == self.peers.len()
    }

    /// The counters of each TCP peer's link (for the status agent).
    pub(crate) fn stats(&self) -> &[(usize, Arc<LinkStats>)] {
        &self.stats
    }

    /// The TCP peers among `wanted` whose links are not made yet, ascending, once each
    /// (no allocation when there are none: a call whose links are all made pays a lookup per
    /// transfer).
    pub(crate) fn missing(&self, wanted: impl IntoIterator<Item = usize>) -> Vec<usize> {
        let mut v: Vec<usize> = wanted.into_iter().filter(|&p| self.pending(p)).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Makes the links to the peers of `need` that are TCP peers without one (call `call`,
    /// number `seq`, on this rank): dials those no connection came from yet, one after the
    /// other, and waits for the others' connections (dialed by the peer, adopted by the
    /// acceptor), until `deadline`, or until `stop` returns an error (returned as is: the
    /// communicator failed). Returns the new links, counted for the status agent, ascending
    /// by peer: those of `need`, and any other peer's whose connections the acceptor holds
    /// complete (so that the listener closes once every link is made).
    pub(crate) fn connect(
        &mut self,
        need: &[usize],
        deadline: Instant,
        stop: &(dyn Fn() -> Option<Error> + Sync),
        call: &'static str,
        seq: u64,
    ) -> Result<Vec<(usize, Box<dyn Link>)>> {
        let need = self.missing(need.iter().copied());
        if need.is_empty() {
            return Ok(Vec::new());
        }
        let start = Instant::now();
        let me = self.me;
        let mut conns: Vec<(usize, TcpStream)> = Vec::new();
        // The peers whose connections this call waits for (they dial, or dialed).
        let mut awaited = Vec::new();
        for &p in &need {
            {
                let mut t = self.shared.lock();
                match t.slots[p] {
                    Slot::Pending => t.slots[p] = Slot::Dialing,
                    _ => {
                        awaited.push(p);
                        continue;
                    }
                }
            }
            // A dial also ends once the peer's own connection arrived (crossed dials: the
            // peer may have finished and closed its listener before this dial came).
            let shared = &self.shared;
            let halt = || stop().is_some() || matches!(shared.lock().slots[p], Slot::Adopted(_));
            let dialed = match self.addrs.binary_search_by_key(&p, |a| a.0) {
                Ok(i) => self.dial(self.addrs[i], deadline, &halt, call, seq),
                Err(_) => Err(Error::Aborted {
                    rank: me,
                    msg: format!(
                        "internal error in {call} (call #{seq}): no address for TCP peer {p}"
                    ),
                }),
            };
            let mut t = self.shared.lock();
            match dialed {
                Ok(streams) if matches!(t.slots[p], Slot::Dialing) => {
                    t.slots[p] = Slot::Made;
                    conns.extend(streams.into_iter().map(|s| (p, s)));
                }
                Ok(_) => {
                    return Err(Error::Aborted {
                        rank: me,
                        msg: format!("internal error in {call} (call #{seq}): rank {p} dialed this rank while its own connection to rank {p} was accepted"),
                    })
                }
                // The peer dials this rank at the same time, and its connection makes the
                // link (it is the higher rank): wait for the acceptor to adopt it.
                Err(e) if auth::is_crossed(&e) || matches!(t.slots[p], Slot::Adopted(_)) => {
                    awaited.push(p)
                }
                Err(e) => {
                    if matches!(t.slots[p], Slot::Dialing) {
                        t.slots[p] = Slot::Pending;
                    }
                    drop(t);
                    // The communicator failed meanwhile (a peer lost): that is the cause.
                    return Err(stop().unwrap_or(e));
                }
            }
        }
        let mut t = self.shared.lock();
        loop {
            let waiting: Vec<usize> = awaited.iter().copied().filter(|&p| !t.ready(p)).collect();
            if waiting.is_empty() {
                break;
            }
            drop(t);
            if let Some(e) = stop() {
                return Err(e);
            }
            t = self.shared.lock();
            let now = Instant::now();
            if now >= deadline || t.failed.is_some() {
                let why = match (&t.failed, &t.strangers) {
                    (Some(f), _) => format!("this rank's TCP acceptor stopped: {f}"),
                    (None, Some(s)) => format!("no connection arrived; {s}"),
                    (None, None) => "no connection arrived".into(),
                };
                return Err(Error::Connect {
                    rank: me,
                    peer: waiting[0],
                    addr: self
                        .listener
                        .local_addr()
                        .map_or_else(|_| "?".into(), |a| a.to_string()),
                    timeout: start.elapsed(),
                    reason: format!(
                        "{call} (call #{seq}) needs the TCP link with rank(s) {} (made on first use), which dial(s) this rank: {why}",
                        crate::base::error::rank_list(&waiting)
                    ),
                });
            }
            let wait = deadline.saturating_duration_since(now).min(WAIT_TICK);
            t = self
                .shared
                .changed
                .wait_timeout(t, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        // Every complete adoption, needed now or not.
        let streams = self.streams;
        for (p, slot) in t.slots.iter_mut().enumerate() {
            if matches!(slot, Slot::Adopted(v) if v.len() >= streams) {
                if let Slot::Adopted(v) = std::mem::replace(slot, Slot::Made) {
                    conns.extend(v.into_iter().map(|s| (p, s)));
                }
            }
        }
        drop(t);
        // Stable: each peer's connections stay in the order they were made.
        conns.sort_by_key(|(r, _)| *r);
        let links = super::into_links(me, conns, self.dead_after)?;
        let mut out = Vec::with_capacity(links.len());
        for (r, link) in links {
            if self.pending(r) {
                self.state[r] = Peer::Made;
                self.made += 1;
            }
            let stats = self
                .stats
                .iter()
                .find(|(p, _)| *p == r)
                .map(|(_, s)| s.clone())
                .unwrap_or_default();
            out.push((r, counted_into(link, stats)));
        }
        tracing::debug!(
            rank = me,
            call,
            seq,
            peers = ?need,
            us = start.elapsed().as_micros() as u64,
            "TCP links made on first use"
        );
        Ok(out)
    }

    /// Dials `peer` (`streams` connections, in turn) until `deadline` or `halt`.
    fn dial(
        &self,
        peer: (usize, SocketAddr),
        deadline: Instant,
        halt: &dyn Fn() -> bool,
        call: &'static str,
        seq: u64,
    ) -> Result<Vec<TcpStream>> {
        let got = dial_all(
            self.me,
            std::slice::from_ref(&peer),
            self.streams,
            &self.secret,
            self.tag,
            deadline,
            halt,
            call,
            seq,
        )?;
        Ok(got.into_iter().map(|(_, s)| s).collect())
    }
}

impl Drop for LazyTcp {
    /// Stops the acceptor (shutting the listener down wakes its poll at once) and joins it;
    /// connections adopted and not taken close with the table.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = socket2::SockRef::from(&*self.listener).shutdown(std::net::Shutdown::Read);
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
    }
}

/// The acceptor thread: adopts authenticated connections into `shared` until `stop`.
fn acceptor(listener: &TcpListener, shared: &Shared, stop: &AtomicBool, keys: &accept::Keys) {
    let mut adopter = Adopter { shared };
    let res = accept::accept_loop(listener, Instant::now() + FOREVER, stop, keys, &mut adopter);
    if stop.load(Ordering::SeqCst) {
        return;
    }
    let why = match res {
        Ok(Ok(())) => "it ended".to_string(),
        Ok(Err(e)) => e.to_string(),
        Err(accept::AcceptStop::Deadline(_)) => "it ran out of time".to_string(),
        Err(accept::AcceptStop::Io(e)) => format!("accepting TCP connections: {e}"),
    };
    tracing::warn!("rank {}: the TCP acceptor stopped: {why}", keys.rank);
    shared.lock().failed = Some(why);
    shared.changed.notify_all();
}

/// The acceptor thread's side of [`accept::accept_loop`].
struct Adopter<'a> {
    shared: &'a Shared,
}

impl Admit for Adopter<'_> {
    fn admit(&mut self, hello: Hello, stream: TcpStream, from: SocketAddr) -> Result<bool> {
        let mut t = self.shared.lock();
        let verdict = t.verdict(hello.rank);
        // One byte into a fresh socket's empty send buffer: it does not block.
        let sent = auth::send_verdict(
            &mut Deadlined::new(&stream, Instant::now() + auth::HANDSHAKE_TIMEOUT),
            verdict,
        );
        match (verdict, sent) {
            (Verdict::Accepted, Ok(())) => {
                match &mut t.slots[hello.rank] {
                    Slot::Adopted(v) => v.push(stream),
                    slot => *slot = Slot::Adopted(vec![stream]),
                }
                drop(t);
                self.shared.changed.notify_all();
            }
            (Verdict::Accepted, Err(e)) => tracing::debug!(
                "rank {}: lost rank {} at {from} after its handshake: {e}",
                t.me,
                hello.rank
            ),
            (Verdict::Crossed, _) => tracing::debug!(
                "rank {}: rank {} dialed while this rank dials it: this rank's connection makes the link",
                t.me,
                hello.rank
            ),
            (v, _) => {
                tracing::warn!(
                    "rank {}: refused a data connection from {from} claiming rank {}: {v:?}",
                    t.me,
                    hello.rank
                );
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        }
        Ok(false)
    }

    fn tick(&mut self, strangers: &Strangers) -> Result<()> {
        if let Some(s) = strangers.summary() {
            self.shared.lock().strangers = Some(s);
        }
        Ok(())
    }
}

/// Dials each peer of `dials` (`streams` connections each, in turn) until `deadline`, or
/// until `halt`.
#[allow(clippy::too_many_arguments)]
fn dial_all(
    me: usize,
    dials: &[(usize, SocketAddr)],
    streams: usize,
    secret: &[u8; 16],
    tag: u64,
    deadline: Instant,
    halt: &dyn Fn() -> bool,
    call: &'static str,
    seq: u64,
) -> Result<Vec<(usize, TcpStream)>> {
    let start = Instant::now();
    let plan = super::DialPlan {
        me,
        secret,
        tag,
        deadline,
        // Its listener is open from init until every link of that rank is made, this one
        // included: refused means it is gone.
        refused_limit: Some(GONE_AFTER),
        stop: Some(halt),
    };
    plan.dial_each_in_turn(dials, streams, |peer, addr, g| {
        let why = if g.refused_for.is_some() {
            format!(
                "nothing listens there any more (refused for {:.1?}): rank {peer} is gone",
                g.refused_for.unwrap_or_default()
            )
        } else {
            g.last_err
        };
        Error::Connect {
            rank: me,
            peer,
            addr: addr.to_string(),
            timeout: start.elapsed(),
            reason: format!("{call} (call #{seq}) needs this TCP link (made on first use): {why}"),
        }
    })
}

#[cfg(test)]
mod tests;
