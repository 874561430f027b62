//! Connect on first use (`OXCCL_TCP_CONNECT=lazy`, NCCL's model): init exchanges listen
//! addresses only, and a TCP link is made the first time a call needs it.
//!
//! The handshake needs no coordination of its own and cannot deadlock:
//!
//! - both ends of a pair learn that a call needs their link from the same deterministic
//!   source (they run the same schedule for the same call; a point-to-point call names its
//!   peer), so both come to [`LazyTcp::connect`] for it;
//! - as at init, the higher rank of the pair dials and the lower accepts ([`Role`]); the
//!   dialer's connection waits in the lower rank's listen backlog until that rank accepts,
//!   and the dialer's handshake waits for it (bounded by the dialer's call's deadline);
//! - whenever a rank accepts, it adopts every authenticated connection from any higher TCP
//!   peer it has no link with, needed now or not ([`LazyTcp::verdict`]): a peer that is
//!   already a call ahead is never refused, its connection waits in [`LazyTcp`] until a call
//!   here needs it;
//! - a call connects every link it lacks before it moves any byte, and a rank only waits in
//!   [`LazyTcp::connect`] for peers that need the same links in the same call (or in a later
//!   one, which the earlier calls do not wait for), so no cycle of waits can form.
//!
//! Every wait ends at the call's deadline, or at once when the caller's `stop` says the
//! communicator failed (the watchdog lost a peer: a peer killed before the first connection
//! is seen there, not on a link), and a peer whose listener refuses connections for
//! [`GONE_AFTER`] is gone (the listener is open from init until the communicator ends). The
//! errors name this rank, the peer, the call and its sequence number.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::base::error::{Error, Result};
use crate::net::accept::{self, AcceptStop, Admit, Strangers};
use crate::net::auth::{self, Deadlined, Hello, Purpose, Verdict};
use crate::transport::counted::{counted_into, LinkStats};
use crate::transport::Link;

/// A peer whose listener refused every connection for this long is gone.
pub(crate) const GONE_AFTER: Duration = Duration::from_secs(2);

/// Who makes the connection of a pair.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// This rank dials the peer (it is the higher rank).
    Dial,
    /// The peer dials this rank (it is the higher rank).
    Accept,
}

/// The role of `me` in its pair with `peer`: the higher rank dials.
pub(crate) fn role(me: usize, peer: usize) -> Role {
    if peer < me {
        Role::Dial
    } else {
        Role::Accept
    }
}

/// What a rank is to a [`LazyTcp`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Peer {
    /// Not reached over TCP (this rank, a shared-memory peer).
    Not,
    /// A TCP peer without a link yet.
    Pending,
    /// A TCP peer whose link is made.
    Made,
}

/// One rank's TCP links that are not made yet, and what it needs to make them.
pub(crate) struct LazyTcp {
    me: usize,
    listener: TcpListener,
    /// Every TCP peer, ascending.
    peers: Vec<usize>,
    /// Where each lower-ranked peer listens, ascending by rank.
    lower: Vec<(usize, SocketAddr)>,
    /// Connections per pair.
    streams: usize,
    secret: [u8; 16],
    tag: u64,
    dead_after: Duration,
    /// Per rank: whether it is a TCP peer, and whether its link is made.
    state: Vec<Peer>,
    /// How many links are made.
    made: usize,
    /// Connections from higher peers accepted before a call here needed them, in the order
    /// they came (a peer's streams stay in the order it dialed them).
    adopted: Vec<(usize, TcpStream)>,
    /// The status agent's counters of every peer's link, made before the link.
    stats: Vec<(usize, Arc<LinkStats>)>,
}

impl std::fmt::Debug for LazyTcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyTcp")
            .field("me", &self.me)
            .field("peers", &self.peers)
            .field("made", &self.made)
            .field("adopted", &self.adopted.len())
            .finish_non_exhaustive()
    }
}

impl LazyTcp {
    /// The state after init's port exchange: `listener` open, `peers` every TCP peer
    /// (ascending), `lower` where each lower-ranked one listens.
    pub(crate) fn new(
        me: usize,
        listener: TcpListener,
        peers: &[usize],
        lower: &[(usize, SocketAddr)],
        streams: usize,
        secret: &[u8; 16],
        dead_after: Duration,
    ) -> LazyTcp {
        LazyTcp {
            me,
            listener,
            peers: peers.to_vec(),
            lower: lower.to_vec(),
            streams: streams.max(1),
            secret: *secret,
            tag: auth::comm_tag(secret),
            dead_after,
            state: {
                let mut v = vec![Peer::Not; peers.iter().max().map_or(0, |m| m + 1)];
                for &p in peers {
                    v[p] = Peer::Pending;
                }
                v
            },
            made: 0,
            adopted: Vec::new(),
            stats: peers
                .iter()
                .map(|&p| (p, Arc::new(LinkStats::default())))
                .collect(),
        }
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

    fn adopted_from(&self, peer: usize) -> usize {
        self.adopted.iter().filter(|(r, _)| *r == peer).count()
    }

    /// What this rank answers a connection that authenticated as `from`: adopted when it is
    /// a higher TCP peer whose link is not made and that has not dialed all its streams yet.
    pub(crate) fn verdict(&self, from: usize) -> Verdict {
        if from <= self.me || !self.covers(from) {
            Verdict::UnexpectedRank
        } else if !self.pending(from) || self.adopted_from(from) >= self.streams {
            Verdict::DuplicateRank
        } else {
            Verdict::Accepted
        }
    }

    /// Makes the links to the peers of `need` that are TCP peers without one (call `call`,
    /// number `seq`, on this rank): dials the lower ones, waits for the higher ones to dial,
    /// until `deadline`, or until `stop` returns an error (returned as is: the communicator
    /// failed). Returns the new links, counted for the status agent, ascending by peer.
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
        let dials: Vec<(usize, SocketAddr)> = need
            .iter()
            .filter(|&&r| role(me, r) == Role::Dial)
            .filter_map(|r| {
                self.lower
                    .binary_search_by_key(r, |l| l.0)
                    .ok()
                    .map(|i| self.lower[i])
            })
            .collect();
        let awaited: Vec<usize> = need
            .iter()
            .copied()
            .filter(|&r| role(me, r) == Role::Accept)
            .collect();
        if dials.len() + awaited.len() != need.len() {
            return Err(Error::Aborted {
                rank: me,
                msg: format!("internal error in {call} (call #{seq}): no address for a lower TCP peer among {need:?}"),
            });
        }
        // Set by whichever side fails first, to stop the other; `dial_first`: the dialer did.
        let (cancel, dial_first) = (AtomicBool::new(false), AtomicBool::new(false));
        let (secret, tag, streams) = (self.secret, self.tag, self.streams);
        let timeout = deadline.saturating_duration_since(start);
        let (dialed, accepted) = std::thread::scope(|scope| {
            let dialer = (!dials.is_empty()).then(|| {
                let (dials, cancel, dial_first) = (&dials, &cancel, &dial_first);
                scope.spawn(move || {
                    let halt = || cancel.load(Ordering::SeqCst) || stop().is_some();
                    let r = dial_each(me, dials, streams, &secret, tag, deadline, &halt, call, seq);
                    if r.is_err() && !cancel.swap(true, Ordering::SeqCst) {
                        dial_first.store(true, Ordering::SeqCst);
                    }
                    r
                })
            });
            let accepted = if awaited.iter().any(|&r| self.adopted_from(r) < streams) {
                self.accept(&awaited, deadline, &cancel, stop, call, seq, start)
            } else {
                Ok(())
            };
            if accepted.is_err() {
                cancel.store(true, Ordering::SeqCst);
            }
            let dialed = match dialer {
                Some(h) => h.join().unwrap_or_else(|_| {
                    Err(Error::Aborted {
                        rank: me,
                        msg: format!("{call} (call #{seq}): the TCP dial thread panicked"),
                    })
                }),
                None => Ok(Vec::new()),
            };
            (dialed, accepted)
        });
        if dialed.is_err() || accepted.is_err() {
            // The communicator failed meanwhile (a peer lost): that is the cause.
            if let Some(e) = stop() {
                return Err(e);
            }
        }
        // The side that failed first has the cause; the other was stopped.
        let mut conns = match (dialed, accepted) {
            (Ok(c), Ok(())) => c,
            (Err(e), _) if dial_first.load(Ordering::SeqCst) => return Err(e),
            (_, Err(e)) | (Err(e), Ok(())) => return Err(e),
        };
        let mut kept = Vec::with_capacity(self.adopted.len());
        for (r, s) in std::mem::take(&mut self.adopted) {
            if awaited.contains(&r) {
                conns.push((r, s));
            } else {
                kept.push((r, s));
            }
        }
        self.adopted = kept;
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
            timeout_ms = timeout.as_millis() as u64,
            "TCP links made on first use"
        );
        Ok(out)
    }

    /// Accepts until every peer of `awaited` has dialed all its streams (adopting any other
    /// higher peer that dials meanwhile).
    #[allow(clippy::too_many_arguments)]
    fn accept(
        &mut self,
        awaited: &[usize],
        deadline: Instant,
        cancel: &AtomicBool,
        stop: &(dyn Fn() -> Option<Error> + Sync),
        call: &'static str,
        seq: u64,
        start: Instant,
    ) -> Result<()> {
        let keys = accept::Keys {
            secret: self.secret,
            purpose: Purpose::Data,
            tag: self.tag,
            rank: self.me,
        };
        // The listener moves out for the loop: `Adopter` holds the rest of the state.
        let listener = self.listener.try_clone().map_err(|source| Error::Io {
            rank: self.me,
            context: format!("{call} (call #{seq}): the TCP listener"),
            source,
        })?;
        let mut adopter = Adopter {
            lazy: self,
            awaited,
            stop,
        };
        let res = accept::accept_loop(&listener, deadline, cancel, &keys, &mut adopter);
        let me = self.me;
        match res {
            Ok(r) => r,
            Err(AcceptStop::Deadline(strangers)) => {
                let waiting_on: Vec<usize> = awaited
                    .iter()
                    .copied()
                    .filter(|&r| self.adopted_from(r) < self.streams)
                    .collect();
                let extra = strangers
                    .summary()
                    .map_or(String::new(), |s| format!("; {s}"));
                Err(Error::Connect {
                    rank: me,
                    peer: waiting_on.first().copied().unwrap_or(me),
                    addr: listener
                        .local_addr()
                        .map_or_else(|_| "?".into(), |a| a.to_string()),
                    timeout: start.elapsed(),
                    reason: format!(
                        "{call} (call #{seq}) needs the TCP link from rank(s) {} (made on first use, the higher rank dials), and no connection arrived{extra}",
                        crate::base::error::rank_list(&waiting_on)
                    ),
                })
            }
            Err(AcceptStop::Io(source)) => Err(Error::Io {
                rank: me,
                context: format!("{call} (call #{seq}): accepting TCP connections"),
                source,
            }),
        }
    }
}

/// The acceptor's side of [`LazyTcp::accept`].
struct Adopter<'a> {
    lazy: &'a mut LazyTcp,
    awaited: &'a [usize],
    stop: &'a (dyn Fn() -> Option<Error> + Sync),
}

impl Admit for Adopter<'_> {
    fn admit(&mut self, hello: Hello, stream: TcpStream, from: SocketAddr) -> Result<bool> {
        let lazy = &mut *self.lazy;
        let verdict = lazy.verdict(hello.rank);
        let sent = auth::send_verdict(
            &mut Deadlined::new(&stream, Instant::now() + auth::HANDSHAKE_TIMEOUT),
            verdict,
        );
        match (verdict, sent) {
            (Verdict::Accepted, Ok(())) => lazy.adopted.push((hello.rank, stream)),
            (Verdict::Accepted, Err(e)) => tracing::debug!(
                "rank {}: lost rank {} at {from} after its handshake: {e}",
                lazy.me,
                hello.rank
            ),
            (v, _) => {
                tracing::warn!(
                    "rank {}: refused a data connection from {from} claiming rank {}: {v:?}",
                    lazy.me,
                    hello.rank
                );
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        }
        Ok(self
            .awaited
            .iter()
            .all(|&r| lazy.adopted_from(r) >= lazy.streams))
    }

    fn tick(&mut self, _strangers: &Strangers) -> Result<()> {
        match (self.stop)() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Dials the peers of `dials` at once, one thread each (a receive from any source dials
/// every lower peer, and each handshake waits until that peer accepts: in turn, a peer that
/// comes late would hold up the others); see [`dial_all`].
#[allow(clippy::too_many_arguments)]
fn dial_each(
    me: usize,
    dials: &[(usize, SocketAddr)],
    streams: usize,
    secret: &[u8; 16],
    tag: u64,
    deadline: Instant,
    halt: &(dyn Fn() -> bool + Sync),
    call: &'static str,
    seq: u64,
) -> Result<Vec<(usize, TcpStream)>> {
    if dials.len() <= 1 {
        return dial_all(me, dials, streams, secret, tag, deadline, halt, call, seq);
    }
    // The index of the first dial to fail (its error is the cause; the others were stopped).
    let first = AtomicUsize::new(usize::MAX);
    let results: Vec<Result<Vec<(usize, TcpStream)>>> = std::thread::scope(|scope| {
        let hs: Vec<_> = dials
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let first = &first;
                scope.spawn(move || {
                    let halt = || first.load(Ordering::SeqCst) != usize::MAX || halt();
                    let r = dial_all(
                        me,
                        std::slice::from_ref(d),
                        streams,
                        secret,
                        tag,
                        deadline,
                        &halt,
                        call,
                        seq,
                    );
                    if r.is_err() {
                        let _ = first.compare_exchange(
                            usize::MAX,
                            i,
                            Ordering::SeqCst,
                            Ordering::SeqCst,
                        );
                    }
                    r
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Aborted {
                        rank: me,
                        msg: format!("{call} (call #{seq}): a TCP dial thread panicked"),
                    })
                })
            })
            .collect()
    });
    let first = first.load(Ordering::SeqCst);
    let mut out = Vec::with_capacity(dials.len() * streams);
    let mut cause = None;
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok(c) => out.extend(c),
            Err(e) if i == first || cause.is_none() => cause = Some(e),
            Err(_) => {}
        }
    }
    match cause {
        Some(e) => Err(e),
        None => Ok(out),
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
        // Its listener is open from init on: refused means it is gone.
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
