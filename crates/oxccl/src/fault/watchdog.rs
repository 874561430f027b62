//! The watchdog's decisions, apart from its I/O (the thread, the sockets and `poll(2)` are
//! in [`crate::fault::control`]): when to send a heartbeat, when a peer is lost, what a
//! received frame means, what rank 0 passes on, and what a local error tells the others.
//!
//! [`Watch`] is driven by events and a clock value given by its caller, and answers with
//! frames to send ([`Watch::poll_transmit`], whose outcome the caller reports with
//! [`Watch::sent`]) and failures to record ([`Watch::end_round`]); it never reads the clock,
//! sleeps or touches a socket, so its tests run in memory. One round of the I/O loop:
//! [`report`](Watch::report) the queued local failures (then, when stopping,
//! [`goodbye`](Watch::goodbye), send, and return), [`handle_timeout`](Watch::handle_timeout),
//! send, wait until [`poll_timeout`](Watch::poll_timeout), feed what each watched connection
//! read ([`handle_data`](Watch::handle_data), [`handle_closed`](Watch::handle_closed),
//! [`handle_error`](Watch::handle_error), then [`input_done`](Watch::input_done)), take
//! [`end_round`](Watch::end_round)'s failures, send, record them.
//!
//! Who passes failures on: in a star around rank 0 (the rendezvous connections, up to
//! `OXCCL_BOOTSTRAP_RELAY_MAX` ranks) rank 0 alone; over the bootstrap's exchange links
//! (Bruck's graph, above it: [`Watch::relaying`]) every rank, to every watched connection but
//! the one it came from, once per failure (a failure already seen is neither recorded again
//! nor passed on), so that each failure floods the graph and reaches every survivor; the
//! graph stays connected without any one rank (each rank has links at distances
//! 1, 2, 4, ... both ways). In a graph heartbeats go only over some links (the bootstrap
//! picks the ring of ranks ±1): a silent rank is found by its neighbours on that ring, a
//! closed link on any link, and no rank sends or hears more heartbeats than in a star.
//!
//! A star outlives its hub: the hub that drops its communicator says goodbye with a
//! [`Frame::Handover`] naming the lowest rank it still watched as the new hub, and the ranks
//! it still watched. The new hub accepts a connection from each of them (its control
//! listener, opened at init), the others dial it ([`Watch::take_handover`] says which to do,
//! [`Watch::adopt`] takes the new connection, [`Watch::hub_unreachable`] passes over a new hub
//! that is gone too), each sends what it reported so far and the new hub what it passed on,
//! and the star goes on as before, failures relayed by the new hub. Without it, the failures of
//! the ranks that stay after rank 0 left would reach no one.
//!
//! Two decisions of a failed call live here too: what it tells the others ([`report_frame`])
//! and whether its lost-link error gives way to the recorded cause ([`is_cause`]).

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::base::error::{Error, FailureKind};
use crate::fault::frame::Frame;
use crate::fault::health::Failure;

/// Settings of a watchdog.
#[derive(Clone, Copy, Debug)]
pub struct WatchSettings {
    /// A peer silent this long is lost (`None`: heartbeats are sent but not required).
    pub heartbeat: Option<Duration>,
    /// A peer not heard from yet is lost after this long instead, where it is longer than
    /// `heartbeat`: it may still be finishing its init (its links, its segments) after the
    /// last exchange through rank 0, and ranks leave init at different times.
    pub first_heard: Duration,
}

impl WatchSettings {
    /// How often heartbeats go out: an eighth of the heartbeat timeout (at least 10 ms), or
    /// every 500 ms when heartbeats are not required.
    pub(crate) fn period(&self) -> Duration {
        self.heartbeat.map_or(Duration::from_millis(500), |h| {
            (h / 8).max(Duration::from_millis(10))
        })
    }
}

/// What a failed send of a frame means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// This rank's own frame (a report, a heartbeat): the peer is lost.
    Own,
    /// A frame passed on by rank 0: the peer is no longer watched, nothing more.
    Relay,
    /// A goodbye: nothing (the watchdog is stopping).
    Bye,
}

/// A frame to send on every watched connection but `skip`'s.
#[derive(Debug)]
struct Broadcast {
    frame: Frame,
    kind: Kind,
    skip: Option<usize>,
    /// Only this connection (a newly adopted one).
    only: Option<usize>,
    /// The next connection to consider.
    next: usize,
}

#[derive(Debug)]
struct Peer {
    peer: usize,
    buf: Vec<u8>,
    last_seen: Instant,
    /// Whether anything came from it yet.
    heard: bool,
    /// Closed, lost or said goodbye: no longer watched.
    done: bool,
    /// A frame of this rank's could not be sent to it: nothing more is sent, and once what it
    /// sent is read (a goodbye that came before its close makes its loss no loss) it is
    /// no longer watched.
    unsendable: bool,
    /// Heartbeats go both ways over this connection (and its silence loses the peer).
    beats: bool,
    /// A rank this new hub expects to connect ([`Frame::Handover`]): no connection yet;
    /// watched for silence only.
    pending: bool,
}

impl Peer {
    fn new(peer: usize, now: Instant) -> Peer {
        Peer {
            peer,
            buf: Vec::new(),
            last_seen: now,
            heard: false,
            done: false,
            unsendable: false,
            beats: true,
            pending: false,
        }
    }
}

/// What the I/O loop must do after the hub of a star left ([`Watch::take_handover`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Handover {
    /// Connect to rank `hub`'s control listener and [`adopt`](Watch::adopt) the connection
    /// (or tell [`Watch::hub_unreachable`]).
    Dial {
        /// The new hub.
        hub: usize,
    },
    /// This rank is the hub now: accept the ranks' connections on the control listener and
    /// [`adopt`](Watch::adopt) each.
    Serve,
}

/// What makes two failure frames the same failure, for passing each on once: the lost rank
/// for a lost peer (whoever saw it), else the origin, kind and message.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Seen {
    Lost(u32),
    Other(u32, u8, String),
}

impl Seen {
    fn of(f: &Frame) -> Option<Seen> {
        match f {
            Frame::Fail {
                kind: FailureKind::PeerLost,
                peer: Some(p),
                ..
            } => Some(Seen::Lost(*p)),
            Frame::Fail {
                origin, kind, msg, ..
            } => Some(Seen::Other(*origin, kind.code(), msg.clone())),
            _ => None,
        }
    }
}

/// The watchdog's state; see the module documentation. Connections are named by their index
/// in the `peers` given to [`Watch::new`].
#[derive(Debug)]
pub(crate) struct Watch {
    rank: usize,
    /// Whether this rank passes on the failures it sees or hears of (the hub of a star; every
    /// rank of a graph).
    relay: bool,
    /// The connections are a graph (no hub, no handover).
    graph: bool,
    /// This rank's own failure reports, sent again to a new hub.
    own: Vec<Frame>,
    /// The failures this hub passed on, sent to each rank that connects to it as new hub.
    passed: Vec<Frame>,
    /// What the hub's goodbye asks of this rank, until the I/O loop takes it.
    handover: Option<Handover>,
    /// The ranks the last hub's goodbye named as still watched, and the new hubs that could
    /// not be reached (to choose the next one).
    hub_candidates: Vec<usize>,
    /// The failures already recorded and passed on (see [`Seen`]).
    seen: HashSet<Seen>,
    heartbeat: Option<Duration>,
    first_heard: Duration,
    period: Duration,
    next_beat: Instant,
    peers: Vec<Peer>,
    queue: VecDeque<Broadcast>,
    /// The connection and kind of the frame last given by `poll_transmit`.
    in_flight: Option<(usize, Kind)>,
    /// Peers lost in this round, and why.
    lost: Vec<(usize, String)>,
    /// Failure frames received in this round, with the connection's peer.
    received: Vec<(usize, Frame)>,
}

impl Watch {
    /// The state of `rank`'s watchdog over connections to `peers` (in a star: for rank 0 one
    /// per other rank, for the others rank 0; rank 0 passes failures on), all seen alive at
    /// `now`; the first heartbeat is due at `now`. A peer may have more than one connection.
    pub(crate) fn new(
        rank: usize,
        peers: &[usize],
        settings: WatchSettings,
        now: Instant,
    ) -> Watch {
        Watch {
            rank,
            relay: rank == 0,
            graph: false,
            own: Vec::new(),
            passed: Vec::new(),
            handover: None,
            hub_candidates: Vec::new(),
            seen: HashSet::new(),
            heartbeat: settings.heartbeat,
            first_heard: settings.first_heard,
            period: settings.period(),
            next_beat: now,
            peers: peers.iter().map(|&peer| Peer::new(peer, now)).collect(),
            queue: VecDeque::new(),
            in_flight: None,
            lost: Vec::new(),
            received: Vec::new(),
        }
    }

    /// This watchdog's connections are a graph, not a star: every rank passes failures on
    /// (see the module documentation), and heartbeats go over connection `i` only where
    /// `beats[i]` (all of them where `beats` is shorter).
    pub(crate) fn relaying(mut self, beats: &[bool]) -> Watch {
        self.relay = true;
        self.graph = true;
        for (p, &b) in self.peers.iter_mut().zip(beats) {
            p.beats = b;
        }
        self
    }

    /// True while connection `conn` is watched (read, polled, sent to; a rank expected to
    /// connect to this new hub has no connection yet, but is watched for silence).
    pub(crate) fn is_watched(&self, conn: usize) -> bool {
        !self.peers[conn].done
    }

    /// How many connections there are (the I/O loop keeps one slot per connection; adopted
    /// ones and expected ones add to them).
    pub(crate) fn connections(&self) -> usize {
        self.peers.len()
    }

    /// Whether this rank is the hub of a star.
    fn is_hub(&self) -> bool {
        self.relay && !self.graph
    }

    /// What the I/O loop must do after the hub's goodbye ([`Frame::Handover`]), once.
    pub(crate) fn take_handover(&mut self) -> Option<Handover> {
        self.handover.take()
    }

    /// The handover's next step from the candidates left: dial the lowest, or serve when it
    /// is this rank (expecting the others); nothing when none is left.
    fn next_hub(&mut self, now: Instant) {
        let Some(&hub) = self.hub_candidates.first() else {
            return;
        };
        if hub != self.rank {
            self.handover = Some(Handover::Dial { hub });
            return;
        }
        self.relay = true;
        for r in std::mem::take(&mut self.hub_candidates) {
            if r != self.rank {
                // Not heard from yet: lost only after the longer first wait, so that a rank
                // that left before it could connect (its goodbye went to no one) is not
                // reported while it matters.
                let mut p = Peer::new(r, now);
                p.pending = true;
                self.peers.push(p);
            }
        }
        self.handover = Some(Handover::Serve);
    }

    /// The new hub `hub` could not be reached (nothing listens: it left too, or died): the
    /// next rank of the old hub's list is tried. A rank gone on purpose cannot be told from a
    /// dead one here, so it is not reported; a wait on a dead one fails by its link.
    pub(crate) fn hub_unreachable(&mut self, hub: usize, now: Instant) {
        self.hub_candidates.retain(|&r| r != hub);
        self.next_hub(now);
    }

    /// The new hub `hub` was reached but did not complete the connection: lost.
    pub(crate) fn hub_lost(&mut self, hub: usize, reason: String) {
        self.hub_candidates.clear();
        self.lost.push((hub, reason));
    }

    /// A connection to `peer` was made (this rank dialed the new hub, or, as the new hub,
    /// accepted a rank) at `now`: watched from now on as connection index returned. What
    /// this rank reported, and as hub what it passed on, is queued to it first.
    pub(crate) fn adopt(&mut self, peer: usize, now: Instant) -> usize {
        let i = match self
            .peers
            .iter()
            .position(|p| p.peer == peer && p.pending && !p.done)
        {
            Some(i) => i,
            None => {
                self.peers.push(Peer::new(peer, now));
                self.peers.len() - 1
            }
        };
        let p = &mut self.peers[i];
        p.pending = false;
        p.heard = true;
        p.last_seen = now;
        let hub = self.is_hub();
        let again: Vec<(Frame, Kind)> = self
            .own
            .iter()
            .map(|f| (f.clone(), Kind::Own))
            .chain(
                self.passed
                    .iter()
                    .filter(|_| hub)
                    .map(|f| (f.clone(), Kind::Relay)),
            )
            .collect();
        for (frame, kind) in again {
            self.queue.push_back(Broadcast {
                frame,
                kind,
                skip: None,
                only: Some(i),
                next: 0,
            });
        }
        i
    }

    /// When the next heartbeat is due: the I/O loop waits at most until then.
    pub(crate) fn poll_timeout(&self) -> Instant {
        self.next_beat
    }

    /// Queues a heartbeat to every watched peer if one is due at `now`.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        if now >= self.next_beat {
            self.next_beat = now + self.period;
            self.broadcast(Frame::Heartbeat, Kind::Own, None);
        }
    }

    /// Queues this rank's failure report (see [`report_frame`]) to every watched peer.
    pub(crate) fn report(&mut self, f: Frame) {
        // Its echo from the graph is not passed on again.
        self.seen.extend(Seen::of(&f));
        self.own.push(f.clone());
        self.broadcast(f, Kind::Own, None);
    }

    /// Queues a goodbye to every watched peer (this rank drops its communicator). The hub of
    /// a star hands over: its goodbye names the lowest rank it still watches as the new hub.
    pub(crate) fn goodbye(&mut self) {
        let mut live: Vec<u32> = self
            .peers
            .iter()
            .filter(|p| !p.done)
            .map(|p| p.peer as u32)
            .collect();
        live.sort_unstable();
        live.dedup();
        let frame = match live.first() {
            Some(&next) if self.is_hub() => Frame::Handover { next, live },
            _ => Frame::Bye,
        };
        self.broadcast(frame, Kind::Bye, None);
    }

    fn broadcast(&mut self, frame: Frame, kind: Kind, skip: Option<usize>) {
        self.queue.push_back(Broadcast {
            frame,
            kind,
            skip,
            only: None,
            next: 0,
        });
    }

    /// The next frame to send and its connection, in the order queued; the caller sends it
    /// without blocking and tells [`Watch::sent`] whether the whole frame went out.
    pub(crate) fn poll_transmit(&mut self) -> Option<(usize, &Frame)> {
        loop {
            let b = self.queue.front_mut()?;
            let peers = &self.peers;
            let beat = matches!(b.frame, Frame::Heartbeat);
            let found = (b.next..peers.len()).find(|&i| {
                !peers[i].done
                    && !peers[i].unsendable
                    && !peers[i].pending
                    && b.only.is_none_or(|o| o == i)
                    && Some(peers[i].peer) != b.skip
                    && (peers[i].beats || !beat)
            });
            match found {
                Some(i) => {
                    b.next = i + 1;
                    self.in_flight = Some((i, b.kind));
                    return self.queue.front().map(|b| (i, &b.frame));
                }
                None => {
                    self.queue.pop_front();
                }
            }
        }
    }

    /// The outcome of sending the frame [`Watch::poll_transmit`] gave last.
    pub(crate) fn sent(&mut self, ok: bool) {
        let Some((i, kind)) = self.in_flight.take() else {
            return;
        };
        if ok || kind == Kind::Bye {
            return;
        }
        let p = &mut self.peers[i];
        if kind == Kind::Own {
            // Read once more before it counts ([`Watch::input_done`]): a peer that said
            // goodbye and closed resets the connection when this rank's heartbeat reaches it.
            p.unsendable = true;
            self.lost
                .push((p.peer, "its control connection does not take data".into()));
        } else {
            p.done = true;
        }
    }

    /// Connection `conn` delivered `bytes` at `now`.
    pub(crate) fn handle_data(&mut self, conn: usize, bytes: &[u8], now: Instant) {
        let p = &mut self.peers[conn];
        p.buf.extend_from_slice(bytes);
        p.last_seen = now;
        p.heard = true;
    }

    /// Connection `conn` was closed by the other side.
    pub(crate) fn handle_closed(&mut self, conn: usize) {
        self.lose(
            conn,
            "its process exited or its connection closed".to_string(),
        );
    }

    /// Reading connection `conn` failed with `msg`.
    pub(crate) fn handle_error(&mut self, conn: usize, msg: &str) {
        self.lose(conn, format!("control connection: {msg}"));
    }

    fn lose(&mut self, conn: usize, reason: String) {
        let p = &mut self.peers[conn];
        p.done = true;
        if !p.unsendable {
            // (An unsendable peer's loss is already counted.)
            self.lost.push((p.peer, reason));
        }
    }

    /// Everything connection `conn` had to read in this round was given: decodes its
    /// frames, then checks at `now` that it was not silent for longer than the heartbeat.
    pub(crate) fn input_done(&mut self, conn: usize, now: Instant) {
        let p = &mut self.peers[conn];
        let mut used = 0;
        let mut handover = None;
        loop {
            match Frame::decode(&p.buf[used..]) {
                Ok(Some((f, n))) => {
                    used += n;
                    match f {
                        Frame::Heartbeat => {}
                        Frame::Bye => {
                            // Gone on purpose: not watched any more, not reported.
                            p.done = true;
                            self.lost.retain(|(q, _)| *q != p.peer);
                            break;
                        }
                        Frame::Handover { live, .. } => {
                            // The hub's goodbye (`next` is the lowest of `live`).
                            p.done = true;
                            self.lost.retain(|(q, _)| *q != p.peer);
                            handover = Some(live);
                            break;
                        }
                        f @ Frame::Fail { .. } => self.received.push((p.peer, f)),
                    }
                }
                Ok(None) => break,
                Err(m) => {
                    p.done = true;
                    self.lost
                        .push((p.peer, format!("malformed control data: {m}")));
                    break;
                }
            }
        }
        p.buf.drain(..used.min(p.buf.len()));
        if p.unsendable {
            p.done = true;
        }
        if let (Some(h), true) = (self.heartbeat, p.beats) {
            let silent = now.saturating_duration_since(p.last_seen);
            let limit = if p.heard { h } else { h.max(self.first_heard) };
            if !p.done && silent > limit {
                p.done = true;
                self.lost.push((
                    p.peer,
                    format!("no heartbeat for {silent:?} (host down, link cut or process stopped)"),
                ));
            }
        }
        // Only from the hub of this rank's star (a hub or a rank of a graph has none).
        if let (Some(live), false) = (handover, self.relay) {
            let from = self.peers[conn].peer;
            self.hub_candidates = live
                .iter()
                .map(|&r| r as usize)
                .filter(|&r| r != from)
                .collect();
            self.hub_candidates.sort_unstable();
            self.next_hub(now);
        }
    }

    /// Ends a round: the failures it found, in order (failures reported by others, then lost
    /// peers: a peer that passed a failure on and then exited was not the cause; each failure
    /// once), for the caller to record; a relaying rank (rank 0 of a star, every rank of a
    /// graph) also queues them to the other peers, each failure once. The caller sends what
    /// is queued before it records the failures (a rank that fails may exit at once).
    pub(crate) fn end_round(&mut self) -> Vec<Failure> {
        let mut out = Vec::new();
        for (from, f) in std::mem::take(&mut self.received) {
            if let Some(key) = Seen::of(&f) {
                if !self.seen.insert(key) {
                    // Heard before (by another path of the graph, or its own report's echo).
                    continue;
                }
            }
            if let Frame::Fail {
                origin,
                kind,
                peer,
                ref msg,
            } = f
            {
                out.push(match (kind, peer) {
                    (FailureKind::PeerLost, Some(p)) => Failure::Lost {
                        peer: p as usize,
                        reason: format!("reported by rank {origin}: {msg}"),
                    },
                    _ => Failure::Remote {
                        origin: origin as usize,
                        kind,
                        msg: msg.clone(),
                    },
                });
                if self.relay {
                    if self.is_hub() {
                        self.passed.push(f.clone());
                    }
                    self.broadcast(f, Kind::Relay, Some(from));
                }
            }
        }
        for (peer, reason) in std::mem::take(&mut self.lost) {
            if self.relay && self.seen.insert(Seen::Lost(peer as u32)) {
                let msg = format!("rank {} lost rank {peer}: {reason}", self.rank);
                let f = Frame::Fail {
                    origin: self.rank as u32,
                    kind: FailureKind::PeerLost,
                    peer: Some(peer as u32),
                    msg,
                };
                if self.is_hub() {
                    self.passed.push(f.clone());
                }
                self.broadcast(f, Kind::Relay, Some(peer));
            }
            out.push(Failure::Lost { peer, reason });
        }
        out
    }
}

/// What `rank` tells the others when one of its calls fails with `e`; `None` for another
/// rank's failure (it came from elsewhere: everyone knows).
pub(crate) fn report_frame(rank: usize, e: &Error) -> Option<Frame> {
    if matches!(e, Error::Remote { .. }) {
        return None;
    }
    let peer = match e {
        Error::PeerLost { peer, .. } => Some(*peer as u32),
        _ => None,
    };
    Some(Frame::Fail {
        origin: rank as u32,
        kind: e.failure_kind(),
        peer,
        msg: e.to_string(),
    })
}

/// True when a call that failed with `e` (a lost link or a protocol error) should return
/// the recorded `failure` instead: another rank's failure, or the loss of another peer than
/// the one `e` names, is the cause (a rank that found a mismatch and exited closes its
/// links before its report arrives).
pub(crate) fn is_cause(failure: Option<&Failure>, e: &Error) -> bool {
    match failure {
        Some(Failure::Remote { .. }) => true,
        Some(Failure::Lost { peer, .. }) => Some(*peer) != e.lost_peer(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HB: Duration = Duration::from_secs(8);

    fn settings() -> WatchSettings {
        WatchSettings {
            heartbeat: Some(HB),
            first_heard: Duration::ZERO,
        }
    }

    /// Every frame queued now, each sent with outcome `ok(conn)`.
    fn flush(w: &mut Watch, ok: impl Fn(usize) -> bool) -> Vec<(usize, Frame)> {
        let mut out = Vec::new();
        while let Some((i, f)) = w.poll_transmit() {
            out.push((i, f.clone()));
            w.sent(ok(i));
        }
        out
    }

    fn fail_frame(origin: u32, kind: FailureKind, peer: Option<u32>, msg: &str) -> Frame {
        Frame::Fail {
            origin,
            kind,
            peer,
            msg: msg.into(),
        }
    }

    #[test]
    fn heartbeats_go_out_every_period() {
        let t0 = Instant::now();
        let mut w = Watch::new(0, &[1, 2], settings(), t0);
        assert_eq!(w.poll_timeout(), t0);
        w.handle_timeout(t0);
        let sent = flush(&mut w, |_| true);
        assert_eq!(sent, [(0, Frame::Heartbeat), (1, Frame::Heartbeat)]);
        assert_eq!(w.poll_timeout(), t0 + HB / 8);
        w.handle_timeout(t0 + HB / 8 - Duration::from_millis(1));
        assert!(flush(&mut w, |_| true).is_empty());
        w.handle_timeout(t0 + HB / 8);
        assert_eq!(flush(&mut w, |_| true).len(), 2);
        assert!(w.end_round().is_empty());
        let lazy = WatchSettings {
            heartbeat: None,
            first_heard: Duration::ZERO,
        };
        assert_eq!(lazy.period(), Duration::from_millis(500));
        let fast = WatchSettings {
            heartbeat: Some(Duration::from_millis(1)),
            first_heard: Duration::ZERO,
        };
        assert_eq!(fast.period(), Duration::from_millis(10));
    }

    /// A peer not heard from yet (still in its init) has `first_heard`, not the heartbeat;
    /// once heard, the heartbeat applies.
    #[test]
    fn a_peer_not_heard_from_yet_has_the_longer_first_wait() {
        let t0 = Instant::now();
        let s = WatchSettings {
            heartbeat: Some(HB),
            first_heard: 3 * HB,
        };
        let mut w = Watch::new(0, &[1, 2], s, t0);
        w.handle_data(1, &Frame::Heartbeat.encode(), t0);
        let t1 = t0 + 2 * HB;
        w.input_done(0, t1);
        w.input_done(1, t1);
        let lost: Vec<usize> = w
            .end_round()
            .iter()
            .map(|f| match f {
                Failure::Lost { peer, .. } => *peer,
                _ => usize::MAX,
            })
            .collect();
        assert_eq!(
            lost,
            [2],
            "heard from: the heartbeat applies; not heard: not yet lost"
        );
        let mut w = Watch::new(0, &[1], s, t0);
        w.input_done(0, t0 + 3 * HB + Duration::from_millis(1));
        assert_eq!(w.end_round().len(), 1, "silent past first_heard: lost");
    }

    #[test]
    fn a_silent_peer_is_lost_and_rank_0_tells_the_others() {
        let t0 = Instant::now();
        let mut w = Watch::new(0, &[1, 2], settings(), t0);
        // Peer 2 keeps talking; peer 1 says nothing after t0.
        let late = t0 + HB + Duration::from_millis(1);
        w.handle_data(1, &Frame::Heartbeat.encode(), late);
        w.input_done(0, t0 + HB);
        w.input_done(1, late);
        assert!(
            w.end_round().is_empty(),
            "silent for exactly the heartbeat: not lost yet"
        );
        w.input_done(0, late);
        w.input_done(1, late);
        let f = w.end_round();
        assert_eq!(
            f,
            [Failure::Lost {
                peer: 1,
                reason: format!(
                    "no heartbeat for {:?} (host down, link cut or process stopped)",
                    HB + Duration::from_millis(1)
                ),
            }]
        );
        assert!(!w.is_watched(0) && w.is_watched(1));
        let Failure::Lost { reason, .. } = &f[0] else {
            unreachable!()
        };
        let relayed = flush(&mut w, |_| true);
        assert_eq!(
            relayed,
            [(
                1,
                fail_frame(
                    0,
                    FailureKind::PeerLost,
                    Some(1),
                    &format!("rank 0 lost rank 1: {reason}")
                )
            )]
        );
    }

    #[test]
    fn without_heartbeat_timeout_silence_is_fine() {
        let t0 = Instant::now();
        let settings = WatchSettings {
            heartbeat: None,
            first_heard: Duration::ZERO,
        };
        let mut w = Watch::new(3, &[0], settings, t0);
        w.input_done(0, t0 + Duration::from_secs(3600));
        assert!(w.end_round().is_empty());
        assert!(w.is_watched(0));
    }

    #[test]
    fn a_closed_connection_is_lost_unless_it_said_goodbye() {
        let t0 = Instant::now();
        let mut w = Watch::new(0, &[1, 2, 3], settings(), t0);
        w.handle_data(0, &Frame::Bye.encode(), t0);
        w.handle_closed(0);
        w.input_done(0, t0);
        w.handle_closed(1);
        w.input_done(1, t0);
        w.handle_error(2, "Connection reset by peer");
        w.input_done(2, t0);
        assert_eq!(
            w.end_round(),
            [
                Failure::Lost {
                    peer: 2,
                    reason: "its process exited or its connection closed".into()
                },
                Failure::Lost {
                    peer: 3,
                    reason: "control connection: Connection reset by peer".into()
                },
            ]
        );
        assert!((0..3).all(|i| !w.is_watched(i)));
        // Nobody is left to tell.
        assert!(flush(&mut w, |_| true).is_empty());
    }

    /// A peer that said goodbye and closed resets the connection when a heartbeat reaches
    /// it: the next heartbeat fails to go out before the goodbye is read. Its goodbye, read
    /// in the same round, makes that no loss; a peer that sent none is lost.
    #[test]
    fn a_failed_send_to_a_peer_whose_goodbye_is_unread_is_no_loss() {
        let t0 = Instant::now();
        let mut w = Watch::new(0, &[1, 2], settings(), t0);
        w.handle_timeout(t0);
        assert_eq!(flush(&mut w, |_| false).len(), 2);
        // Not sent to again, but read once more.
        w.handle_timeout(t0 + HB);
        assert!(flush(&mut w, |_| true).is_empty());
        assert!(w.is_watched(0) && w.is_watched(1));
        w.handle_data(0, &Frame::Bye.encode(), t0);
        w.handle_error(0, "Connection reset by peer");
        w.input_done(0, t0);
        w.handle_error(1, "Connection reset by peer");
        w.input_done(1, t0);
        let reason = "its control connection does not take data".to_string();
        assert_eq!(w.end_round(), [Failure::Lost { peer: 2, reason }]);
        assert!(!w.is_watched(0) && !w.is_watched(1));
    }

    #[test]
    fn rank_0_passes_failures_on_to_all_but_the_sender() {
        let t0 = Instant::now();
        let mut w = Watch::new(0, &[1, 2, 3], settings(), t0);
        let mismatch = fail_frame(2, FailureKind::Mismatch, None, "rank 2: mismatch");
        let mut bytes = mismatch.encode();
        // Split across two reads, with a heartbeat in front.
        bytes.splice(0..0, Frame::Heartbeat.encode());
        w.handle_data(1, &bytes[..7], t0);
        w.input_done(1, t0);
        assert!(w.end_round().is_empty());
        w.handle_data(1, &bytes[7..], t0);
        w.input_done(1, t0);
        assert_eq!(
            w.end_round(),
            [Failure::Remote {
                origin: 2,
                kind: FailureKind::Mismatch,
                msg: "rank 2: mismatch".into()
            }]
        );
        assert_eq!(
            flush(&mut w, |_| true),
            [(0, mismatch.clone()), (2, mismatch)]
        );
    }

    #[test]
    fn a_reported_lost_peer_is_lost_here_and_members_do_not_relay() {
        let t0 = Instant::now();
        let mut w = Watch::new(1, &[0], settings(), t0);
        let f = fail_frame(
            0,
            FailureKind::PeerLost,
            Some(3),
            "rank 0 lost rank 3: gone",
        );
        w.handle_data(0, &f.encode(), t0);
        w.input_done(0, t0);
        assert_eq!(
            w.end_round(),
            [Failure::Lost {
                peer: 3,
                reason: "reported by rank 0: rank 0 lost rank 3: gone".into()
            }]
        );
        assert!(flush(&mut w, |_| true).is_empty());
    }

    /// Over a graph every rank passes each failure on once, to every connection but the
    /// sender's: a frame heard again (by another path, or its own report's echo) is neither
    /// recorded nor passed on; a lost peer is one failure whoever saw it.
    #[test]
    fn in_a_graph_every_rank_passes_each_failure_on_once() {
        let t0 = Instant::now();
        // Rank 2's links: to 1, two to 3 (it sends to and hears from 3), to 0.
        let mut w = Watch::new(2, &[1, 3, 3, 0], settings(), t0).relaying(&[]);
        let mismatch = fail_frame(1, FailureKind::Mismatch, None, "rank 1: mismatch");
        w.handle_data(0, &mismatch.encode(), t0);
        w.input_done(0, t0);
        assert_eq!(w.end_round().len(), 1);
        assert_eq!(
            flush(&mut w, |_| true),
            [
                (1, mismatch.clone()),
                (2, mismatch.clone()),
                (3, mismatch.clone())
            ]
        );
        // The same failure again, from rank 0: already passed on.
        w.handle_data(3, &mismatch.encode(), t0);
        w.input_done(3, t0);
        assert!(w.end_round().is_empty());
        assert!(flush(&mut w, |_| true).is_empty());
        // Rank 3 closes one of its links: lost, told to all but rank 3's links.
        w.handle_closed(1);
        w.input_done(1, t0);
        let reason = "its process exited or its connection closed".to_string();
        assert_eq!(
            w.end_round(),
            [Failure::Lost {
                peer: 3,
                reason: reason.clone()
            }]
        );
        let told = fail_frame(
            2,
            FailureKind::PeerLost,
            Some(3),
            &format!("rank 2 lost rank 3: {reason}"),
        );
        assert_eq!(flush(&mut w, |_| true), [(0, told.clone()), (3, told)]);
        // Rank 0 saw it too: the same failure, not passed on again.
        let also = fail_frame(
            0,
            FailureKind::PeerLost,
            Some(3),
            "rank 0 lost rank 3: gone",
        );
        w.handle_data(3, &also.encode(), t0);
        w.input_done(3, t0);
        assert!(w.end_round().is_empty());
        assert!(flush(&mut w, |_| true).is_empty());
        // This rank's own report goes everywhere; its echo stops here.
        let e = Error::Aborted {
            rank: 2,
            msg: "rank 2 called abort()".into(),
        };
        let f = report_frame(2, &e).expect("a local failure is reported");
        w.report(f.clone());
        assert_eq!(
            flush(&mut w, |_| true).len(),
            3,
            "to 1, the second link to 3, 0"
        );
        w.handle_data(0, &f.encode(), t0);
        w.input_done(0, t0);
        assert!(w.end_round().is_empty());
        assert!(flush(&mut w, |_| true).is_empty());
    }

    /// In a graph, heartbeats go over the beating connections only, and only their silence
    /// loses a peer; a closed connection is lost on any.
    #[test]
    fn in_a_graph_heartbeats_go_over_the_ring_only() {
        let t0 = Instant::now();
        let mut w =
            Watch::new(4, &[3, 5, 2, 6], settings(), t0).relaying(&[true, true, false, false]);
        w.handle_timeout(t0);
        assert_eq!(
            flush(&mut w, |_| true),
            [(0, Frame::Heartbeat), (1, Frame::Heartbeat)]
        );
        let late = t0 + HB + Duration::from_millis(1);
        w.handle_data(0, &Frame::Heartbeat.encode(), late);
        for i in 0..4 {
            w.input_done(i, late);
        }
        let lost: Vec<usize> = w
            .end_round()
            .iter()
            .map(|f| match f {
                Failure::Lost { peer, .. } => *peer,
                _ => usize::MAX,
            })
            .collect();
        assert_eq!(
            lost,
            [5],
            "silent on the ring: lost; silent elsewhere: fine"
        );
        w.handle_closed(3);
        w.input_done(3, late);
        assert_eq!(w.end_round().len(), 1, "a closed link is lost anywhere");
    }

    /// A peer that passes a failure on and then exits (its report, then its connection
    /// closed, in one read): the failure it reported comes first, not its loss.
    #[test]
    fn a_report_then_a_close_puts_the_report_first() {
        let t0 = Instant::now();
        let mut w = Watch::new(1, &[0], settings(), t0);
        let f = fail_frame(
            0,
            FailureKind::PeerLost,
            Some(3),
            "rank 0 lost rank 3: gone",
        );
        w.handle_data(0, &f.encode(), t0);
        w.handle_closed(0);
        w.input_done(0, t0);
        let got = w.end_round();
        assert_eq!(got.len(), 2);
        assert!(matches!(got[0], Failure::Lost { peer: 3, .. }), "{got:?}");
        assert!(matches!(got[1], Failure::Lost { peer: 0, .. }), "{got:?}");
    }

    #[test]
    fn malformed_data_loses_the_peer() {
        let t0 = Instant::now();
        let mut w = Watch::new(1, &[0], settings(), t0);
        w.handle_data(0, &[0, 0, 0, 0], t0);
        w.input_done(0, t0);
        let f = w.end_round();
        assert_eq!(
            f,
            [Failure::Lost {
                peer: 0,
                reason: "malformed control data: control frame of 0 bytes (1 to 8192)".into()
            }]
        );
    }

    #[test]
    fn a_peer_that_takes_no_data_is_lost_but_a_failed_relay_only_stops_watching() {
        let t0 = Instant::now();
        let mut w = Watch::new(0, &[1, 2], settings(), t0);
        w.handle_timeout(t0);
        let sent = flush(&mut w, |i| i != 1);
        assert_eq!(sent.len(), 2);
        let f = w.end_round();
        let reason = "its control connection does not take data".to_string();
        assert_eq!(f, [Failure::Lost { peer: 2, reason }]);
        // Relay of that loss: no watched peer but 1, which refuses it: no new failure.
        let relayed = flush(&mut w, |_| false);
        assert_eq!(relayed.len(), 1);
        assert_eq!(relayed[0].0, 0);
        assert!(w.end_round().is_empty());
        assert!(!w.is_watched(0));
    }

    #[test]
    fn reports_go_out_before_the_goodbye() {
        let t0 = Instant::now();
        let mut w = Watch::new(1, &[0], settings(), t0);
        let e = Error::Aborted {
            rank: 1,
            msg: "rank 1 called abort()".into(),
        };
        let f = report_frame(1, &e).expect("a local failure is reported");
        w.report(f.clone());
        w.goodbye();
        // A goodbye that does not go out changes nothing.
        assert_eq!(flush(&mut w, |_| false), [(0, f)]);
        w.input_done(0, t0);
        assert!(!w.is_watched(0));
        let mut w = Watch::new(1, &[0], settings(), t0);
        w.goodbye();
        assert_eq!(flush(&mut w, |_| false), [(0, Frame::Bye)]);
        assert!(w.is_watched(0));
    }

    #[test]
    fn what_a_failed_call_reports() {
        let lost = Error::PeerLost {
            rank: 1,
            peer: 4,
            call: "all_reduce",
            seq: 9,
            reason: "closed".into(),
        };
        assert_eq!(
            report_frame(1, &lost),
            Some(fail_frame(
                1,
                FailureKind::PeerLost,
                Some(4),
                &lost.to_string()
            ))
        );
        let remote = Error::Remote {
            rank: 1,
            call: "all_reduce",
            seq: 9,
            origin: 2,
            kind: FailureKind::Mismatch,
            msg: "m".into(),
        };
        assert_eq!(report_frame(1, &remote), None);
    }

    #[test]
    fn what_replaces_a_lost_link_error() {
        let lost = |peer| Error::PeerLost {
            rank: 1,
            peer,
            call: "all_reduce",
            seq: 2,
            reason: "closed".into(),
        };
        let gone = |peer| Failure::Lost {
            peer,
            reason: "r".into(),
        };
        let remote = Failure::Remote {
            origin: 3,
            kind: FailureKind::Mismatch,
            msg: "m".into(),
        };
        assert!(is_cause(Some(&remote), &lost(2)));
        assert!(is_cause(Some(&gone(3)), &lost(2)));
        assert!(!is_cause(Some(&gone(2)), &lost(2)));
        assert!(!is_cause(None, &lost(2)));
        let local = Failure::Local { msg: "x".into() };
        assert!(!is_cause(Some(&local), &lost(2)));
    }

    /// The hub's goodbye names the lowest rank it still watches as the new hub, and every
    /// rank it still watches; a plain goodbye where it watches none, and from a member.
    #[test]
    fn the_hubs_goodbye_hands_over_to_the_lowest_rank_it_still_watches() {
        let t0 = Instant::now();
        let mut w = Watch::new(0, &[1, 2, 3], settings(), t0);
        // Rank 1 left first.
        w.handle_data(0, &Frame::Bye.encode(), t0);
        w.input_done(0, t0);
        assert!(w.end_round().is_empty());
        w.goodbye();
        let h = Frame::Handover {
            next: 2,
            live: vec![2, 3],
        };
        assert_eq!(flush(&mut w, |_| true), [(1, h.clone()), (2, h)]);
        let mut alone = Watch::new(0, &[1], settings(), t0);
        alone.handle_closed(0);
        alone.handle_data(0, &Frame::Bye.encode(), t0);
        alone.input_done(0, t0);
        alone.goodbye();
        assert!(flush(&mut alone, |_| true).is_empty());
        let mut member = Watch::new(2, &[0], settings(), t0);
        member.goodbye();
        assert_eq!(flush(&mut member, |_| true), [(0, Frame::Bye)]);
    }

    /// A member told of a new hub is not losing its old one, dials the new one, and sends it
    /// its own reports again; heartbeats then go to the new hub.
    #[test]
    fn a_member_dials_the_new_hub_and_tells_it_what_it_reported() {
        let t0 = Instant::now();
        let mut w = Watch::new(3, &[0], settings(), t0);
        let mine = fail_frame(3, FailureKind::Timeout, None, "rank 3: timed out");
        w.report(mine.clone());
        assert_eq!(flush(&mut w, |_| true), [(0, mine.clone())]);
        let h = Frame::Handover {
            next: 1,
            live: vec![1, 3],
        };
        w.handle_data(0, &h.encode(), t0);
        w.handle_closed(0);
        w.input_done(0, t0);
        assert!(w.end_round().is_empty(), "the hub left on purpose");
        assert!(!w.is_watched(0));
        assert_eq!(w.take_handover(), Some(Handover::Dial { hub: 1 }));
        assert_eq!(w.take_handover(), None);
        let i = w.adopt(1, t0);
        assert_eq!(i, 1);
        assert_eq!(flush(&mut w, |_| true), [(1, mine)]);
        w.handle_timeout(t0);
        assert_eq!(flush(&mut w, |_| true), [(1, Frame::Heartbeat)]);
        // The new hub's close is a loss like the old one's.
        w.handle_closed(1);
        w.input_done(1, t0);
        assert_eq!(w.end_round().len(), 1);
    }

    /// The new hub expects every rank the old one watched, relays what one of them reports
    /// to the others connected, and tells a rank that connects later what it passed on.
    #[test]
    fn the_new_hub_takes_the_ranks_and_relays_their_failures() {
        let t0 = Instant::now();
        let mut w = Watch::new(1, &[0], settings(), t0);
        let h = Frame::Handover {
            next: 1,
            live: vec![1, 2, 3],
        };
        w.handle_data(0, &h.encode(), t0);
        w.input_done(0, t0);
        assert!(w.end_round().is_empty());
        assert_eq!(w.take_handover(), Some(Handover::Serve));
        // Connection 1 expects rank 2, connection 2 rank 3.
        assert_eq!(w.connections(), 3);
        assert_eq!(w.adopt(3, t0), 2);
        let lost = fail_frame(
            3,
            FailureKind::PeerLost,
            Some(2),
            "rank 3: lost peer rank 2",
        );
        w.handle_data(2, &lost.encode(), t0);
        w.input_done(1, t0);
        w.input_done(2, t0);
        assert_eq!(w.end_round().len(), 1);
        assert!(
            flush(&mut w, |_| true).is_empty(),
            "nothing back to rank 3, rank 2 not connected"
        );
        assert_eq!(w.adopt(2, t0), 1, "the expected rank's slot");
        assert_eq!(flush(&mut w, |_| true), [(1, lost)]);
        // A rank that never connects is lost only after the longer first wait (the old hub
        // could not know whether it was leaving too).
        let mut w = Watch::new(
            1,
            &[0],
            WatchSettings {
                heartbeat: Some(HB),
                first_heard: 3 * HB,
            },
            t0,
        );
        w.handle_data(0, &h.encode(), t0);
        w.input_done(0, t0);
        assert_eq!(w.take_handover(), Some(Handover::Serve));
        w.adopt(3, t0);
        w.input_done(1, t0 + 2 * HB);
        assert!(w.end_round().is_empty());
        w.input_done(1, t0 + 3 * HB + Duration::from_millis(1));
        assert!(matches!(
            &w.end_round()[..],
            [Failure::Lost { peer: 2, .. }]
        ));
        // Told to rank 3; then the new hub hands over in turn.
        w.goodbye();
        let sent = flush(&mut w, |_| true);
        assert!(
            matches!(&sent[0], (2, Frame::Fail { peer: Some(2), .. })),
            "{sent:?}"
        );
        assert_eq!(
            sent[1],
            (
                2,
                Frame::Handover {
                    next: 3,
                    live: vec![3]
                }
            )
        );
    }

    /// A new hub that cannot be reached (it left too) is passed over, not reported: the next
    /// rank of the list is dialed, or this rank serves when it is the lowest left; a new hub
    /// that does not answer is lost.
    #[test]
    fn an_unreachable_new_hub_is_passed_over_and_a_silent_one_lost() {
        let t0 = Instant::now();
        let mut w = Watch::new(3, &[0], settings(), t0);
        let h = Frame::Handover {
            next: 1,
            live: vec![1, 2, 3, 4],
        };
        w.handle_data(0, &h.encode(), t0);
        w.input_done(0, t0);
        assert_eq!(w.take_handover(), Some(Handover::Dial { hub: 1 }));
        w.hub_unreachable(1, t0);
        assert_eq!(w.take_handover(), Some(Handover::Dial { hub: 2 }));
        w.hub_unreachable(2, t0);
        assert_eq!(w.take_handover(), Some(Handover::Serve));
        assert_eq!(w.connections(), 2, "the old hub and rank 4");
        assert!(w.end_round().is_empty());
        let mut w = Watch::new(3, &[0], settings(), t0);
        w.handle_data(0, &h.encode(), t0);
        w.input_done(0, t0);
        assert_eq!(w.take_handover(), Some(Handover::Dial { hub: 1 }));
        w.hub_lost(1, "no answer".into());
        assert_eq!(w.take_handover(), None);
        assert_eq!(
            w.end_round(),
            [Failure::Lost {
                peer: 1,
                reason: "no answer".into()
            }]
        );
    }
}
