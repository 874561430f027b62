//! Running the intra-host direct algorithms ([`crate::direct::oneshot`], [`crate::direct::cma`]):
//! publishing events and waiting for peers, with the executors' waiting discipline
//! ([`Waiter`]: spin, then sleep on this rank's doorbell in slices, checking the deadline and
//! that the awaited peers are alive between slices).

use std::time::{Duration, Instant};

use crate::base::error::{Error, FailureKind, Result};
use crate::base::wait::{CallId, Waiter, SLEEP_SLICE};
use crate::direct::link::{Direct, EventRecord};
use crate::fault::fingerprint::{CallPrint, Header, HEADER_BYTES};
use crate::fault::health::Health;
use crate::transport::{Link, LinkError};

/// How long a rank that finds a living peer's buffer gone (EFAULT), or its loan withdrawn
/// (`exec`), looks for the failure that made the peer leave the call, before it names the
/// peer: the watchdog's heartbeat timeout (1.5 s by default) and a peer's relayed failure
/// come within it.
pub(crate) const FAILURE_SETTLE: Duration = Duration::from_secs(3);

/// One call's view of the direct area.
pub(crate) struct DirectCtx<'a> {
    /// The direct area of this rank.
    pub direct: &'a mut dyn Direct,
    /// Number of ranks (all on this host).
    pub nranks: usize,
    /// How the call waits: spin, sleep slices, and its deadline, from the first time it
    /// sleeps (a call done within its spin budget never reads the clock). Its
    /// [`CallId`] (this rank, the call's name and sequence number) names the call in errors.
    pub wait: Waiter,
    /// The call's fingerprint, published with its first event and checked against every
    /// peer's (`None`: unchecked).
    pub print: Option<&'a CallPrint>,
    /// The communicator's health: a failure elsewhere wakes and fails a waiting call.
    pub health: Option<&'a Health>,
    /// The links to the peers: a peer that sends bytes over a link while this call waits for
    /// it in the direct area is in another call (a mismatch).
    pub links: Option<&'a mut [Option<Box<dyn Link>>]>,
    /// When set, receives the time each event completes (the timeline's steps).
    pub step_ends: Option<&'a mut Vec<Instant>>,
    /// Out-of-place results are written with streaming stores from this footprint on
    /// ([`Config::nt_bytes`](crate::base::param::Config::nt_bytes)).
    pub nt_bytes: usize,
}

fn mismatch(
    print: &CallPrint,
    b: &[u8; HEADER_BYTES],
    rank: usize,
    peer: usize,
    seq: u64,
) -> Error {
    let (mine, theirs) = match Header::decode(b) {
        Ok(h) => print
            .check(&h)
            .err()
            .unwrap_or_else(|| (print.fp.to_string(), h.fp.to_string())),
        Err(msg) => (
            print.fp.to_string(),
            format!("an unreadable header ({msg})"),
        ),
    };
    Error::Mismatch {
        rank,
        peer,
        seq,
        mine,
        theirs,
    }
}

/// For the link executor: a peer among `waiting` that has published a direct event this rank
/// has not is running a direct-area call while this rank runs a link call — a mismatch,
/// described by the header the peer published with that event — unless bytes from it wait
/// unread on its link (`unread(peer)`).
///
/// A peer that has finished this call (its last bytes written into the link) and gone on to
/// a direct-area call is not a mismatch while this rank, late, has not yet taken those bytes:
/// the peer writes its bytes before it publishes the event (release), and the event is read
/// here (acquire) before `unread` looks at the link, so a peer seen in the direct area whose
/// link holds nothing unread sent nothing more for this call. (Found at 32 ranks on 2 cores:
/// rank 0, asleep past a slice in a one-element ring all-reduce, blamed rank 31, which had
/// sent its last block and entered the next call's barrier.)
pub(crate) fn direct_mismatch(
    d: &dyn Direct,
    waiting: &[usize],
    print: &CallPrint,
    rank: usize,
    seq: u64,
    mut unread: impl FnMut(usize) -> bool,
) -> Option<Error> {
    let next = d.event() + 1;
    let peer = *waiting
        .iter()
        .find(|&&p| d.reached(p, next) && !unread(p))?;
    // The peer's call starts at `next` (its header travels with its first event).
    Some(mismatch(print, &d.peer_header(peer, next), rank, peer, seq))
}

/// For the direct executor: a peer among `waiting` that has sent bytes over its link is
/// running a link call while this rank runs a direct one (no call leaves bytes unread): a
/// mismatch, described by the header those bytes begin with — unless, looked at after the
/// bytes, the peer has reached the awaited event after all (`reached(peer)`).
///
/// `waiting` was taken before the links are peeked: meanwhile the peer may have published
/// the event, finished this call and sent its next (link) call's header. It publishes before
/// it sends (release), and the bytes are seen here (acquire) before `reached` looks, so a
/// peer whose bytes are seen and that has still not reached the event sent them from
/// another call.
fn link_mismatch(
    print: &CallPrint,
    links: Option<&mut [Option<Box<dyn Link>>]>,
    waiting: &[usize],
    id: CallId,
    reached: impl Fn(usize) -> bool,
) -> Option<Error> {
    let links = links?;
    for &p in waiting {
        let Some(link) = links.get_mut(p).and_then(|l| l.as_mut()) else {
            continue;
        };
        let mut head = [0u8; HEADER_BYTES];
        let mut have = 0;
        // Peek: copy what has arrived but take nothing.
        let _ = link.try_recv(&mut |b: &[u8]| {
            let k = b.len().min(HEADER_BYTES - have);
            head[have..have + k].copy_from_slice(&b[..k]);
            have += k;
            0
        });
        if have == HEADER_BYTES && !reached(p) {
            return Some(mismatch(print, &head, id.rank, p, id.seq));
        }
    }
    None
}

impl DirectCtx<'_> {
    /// Publishes the next event (see [`Direct::publish`]); the record carries no header.
    pub(crate) fn publish(&mut self, data: &[u8], record: &EventRecord) -> u64 {
        self.direct.publish(data, record)
    }

    /// Publishes the call's first event, carrying its header, waits for every peer's, and
    /// checks that every peer called the same collective: a mismatch is an error on every
    /// rank (each reads every other's header) before any data is combined.
    pub(crate) fn begin(&mut self, data: &[u8], record: EventRecord) -> Result<u64> {
        let record = EventRecord {
            header: self.print.map_or([0; HEADER_BYTES], |p| p.header()),
            ..record
        };
        let e = self.direct.publish(data, &record);
        self.wait_all(e)?;
        if let Some(p) = self.print {
            let id = self.wait.id();
            for peer in (0..self.nranks).filter(|&q| q != id.rank) {
                let b = self.direct.peer_header(peer, e);
                if p.matches(&b) {
                    continue;
                }
                let (mine, theirs) = match Header::decode(&b) {
                    Ok(h) => p.check(&h).err().unwrap_or_default(),
                    Err(msg) => (p.fp.to_string(), format!("an unreadable header ({msg})")),
                };
                return Err(Error::Mismatch {
                    rank: id.rank,
                    peer,
                    seq: id.seq,
                    mine,
                    theirs,
                });
            }
        }
        Ok(e)
    }

    fn lost(&self, peer: usize, e: LinkError) -> Error {
        let id = self.wait.id();
        e.into_error(id.rank, peer, id.call, id.seq)
    }

    /// An error for a failed read of a peer's memory.
    pub(crate) fn read_error(&self, peer: usize, e: std::io::Error) -> Error {
        self.access_error(peer, "reading", e)
    }

    /// An error for a failed write into a peer's memory.
    pub(crate) fn write_error(&self, peer: usize, e: std::io::Error) -> Error {
        self.access_error(peer, "writing", e)
    }

    fn access_error(&self, peer: usize, what: &str, e: std::io::Error) -> Error {
        // ESRCH: the peer (in this pid namespace: cross-memory access was probed at init) is
        // gone, or exiting: its memory is released before it becomes a zombie, so `kill(pid,
        // 0)` and `/proc` may still show it for a while (seen: a rank killed mid-call named as
        // an I/O error, not a lost peer, in kills.rs under load).
        if e.raw_os_error() == Some(libc::ESRCH) || self.direct.check_alive(peer).is_err() {
            return self.lost(peer, LinkError::Io(e));
        }
        // The peer lives, but its buffer is gone (EFAULT): it left the call, which it does
        // early only when the call fails (a third rank lost: the peer failed on it and
        // released or reused its buffer while this rank was still reading it). The call's
        // real cause is that failure: a lost rank seen here, or the failure the watchdog or
        // the peer passes on, within a bound; only without one is it a bad address.
        if let Some(cause) = self.failure_behind(peer, &e) {
            return cause;
        }
        let id = self.wait.id();
        Error::Io {
            rank: id.rank,
            context: format!(
                "{} (call #{}): {what} rank {peer}'s buffer",
                id.call, id.seq
            ),
            source: e,
        }
    }

    /// The failure of the call that explains access error `e` to living `peer`'s memory:
    /// another rank lost, or the communicator's failure, looked for up to
    /// [`FAILURE_SETTLE`] where `e` is EFAULT (at once otherwise).
    fn failure_behind(&self, peer: usize, e: &std::io::Error) -> Option<Error> {
        let settle = if e.raw_os_error() == Some(libc::EFAULT) {
            FAILURE_SETTLE
        } else {
            Duration::ZERO
        };
        self.failure_within(peer, settle)
    }

    /// The communicator's failure, or a rank other than `peer` lost, looked for up to
    /// `settle`.
    fn failure_within(&self, peer: usize, settle: Duration) -> Option<Error> {
        let id = self.wait.id();
        let until = Instant::now() + settle;
        loop {
            if let Some(h) = self.health.filter(|h| h.is_failed()) {
                return Some(h.error(id.rank, id.call, id.seq));
            }
            for q in (0..self.nranks).filter(|&q| q != id.rank && q != peer) {
                if let Err(le) = self.direct.check_alive(q) {
                    return Some(self.lost(q, le));
                }
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Ends a call in which peers read and write this rank's buffers (single-copy): publishes
    /// the call's last event, clean where `work` succeeded, else
    /// [`EventRecord::left_failed`], and returns only once no peer can still touch this
    /// rank's buffers: each has published that event too, or is gone, or the watchdog
    /// reported it lost (a stopped process), or the call's time is up. A rank that failed
    /// mid-call and returned at once would let a living peer, still writing its share of the
    /// result into this rank's output, write into memory the caller had freed or reused
    /// since (a corrupted heap, another tensor overwritten).
    ///
    /// Returns `work`'s error; else the loss of a peer that left before the event; else, for
    /// a peer that left failed, the failure behind it (the watchdog's, within
    /// [`FAILURE_SETTLE`]) or [`Error::Remote`] naming it; else `Ok`.
    pub(crate) fn finish(&mut self, work: Result<()>) -> Result<()> {
        let record = match work {
            Ok(()) => EventRecord::default(),
            Err(_) => EventRecord::left_failed(),
        };
        let e = self.direct.publish(&[], &record);
        let waited = self.wait_all(e);
        if waited.is_err() {
            self.drain(e);
        }
        work?;
        waited?;
        let me = self.wait.id().rank;
        let failed =
            (0..self.nranks).find(|&p| p != me && self.direct.peer_record(p, e).is_left_failed());
        match failed {
            Some(p) => Err(self.left_failed(p)),
            None => Ok(()),
        }
    }

    /// After a wait for event `e` that failed: waits on until every peer has published `e`,
    /// is gone, or was reported lost by the watchdog (any such report, not only the
    /// communicator's first failure: a second rank stopped mid-call), or the call's time is
    /// up.
    fn drain(&self, e: u64) {
        let me = self.wait.id().rank;
        let until = Instant::now() + self.wait.remaining();
        while Instant::now() < until {
            let pending = (0..self.nranks).any(|p| {
                p != me
                    && !self.health.is_some_and(|h| h.is_lost(p))
                    && !self.direct.reached(p, e)
                    && self.direct.check_alive(p).is_ok()
            });
            if !pending {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The error of a call that `peer` left failed: the failure behind it as it reaches this
    /// rank (the watchdog passes on the peer's error, or a rank is lost), else
    /// [`Error::Remote`] naming the peer.
    fn left_failed(&self, peer: usize) -> Error {
        if let Some(e) = self.failure_within(peer, FAILURE_SETTLE) {
            return e;
        }
        let id = self.wait.id();
        Error::Remote {
            rank: id.rank,
            call: id.call,
            seq: id.seq,
            origin: peer,
            kind: FailureKind::Other,
            msg: "it left the call failed".into(),
        }
    }

    /// Waits until every peer has published event `e`.
    ///
    /// How it spins adapts to the peers (a convoy of ranks that each spin out their budget
    /// before the other can run is what it avoids): the budget is the one learned across
    /// this rank's waits ([`Cadence`](crate::base::wait::Cadence)), and a wait for a peer that
    /// last published from this rank's CPU yields at every check, since that peer can only
    /// run once this rank leaves the CPU.
    pub(crate) fn wait_all(&mut self, e: u64) -> Result<()> {
        let n = self.nranks;
        let id = self.wait.id();
        let me = id.rank;
        let pending = |d: &dyn Direct| (0..n).find(|&p| p != me && !d.reached(p, e));
        self.wait.rearm();
        // What this wait spins by once its first check has failed; what it noted when it
        // spun that out and slept.
        let mut spin = None;
        let mut slept = None;
        loop {
            let Some(p) = pending(&*self.direct) else {
                match (spin, slept) {
                    (Some(_), None) => self.direct.cadence().caught(),
                    (_, Some(note)) => self.direct.cadence().arrived(note),
                    (None, None) => {}
                }
                if let Some(v) = self.step_ends.as_mut() {
                    v.push(Instant::now());
                }
                return Ok(());
            };
            if spin.is_none() {
                let mut s = self.direct.cadence().spin(self.wait.base().for_direct());
                if self.direct.peer_shares_cpu(p) {
                    s.yield_every = 1;
                }
                self.wait.spin_this_wait(s);
                spin = Some(s);
            }
            if self.wait.spin() {
                continue;
            }
            if let (Some(s), None) = (spin, slept) {
                slept = Some(self.direct.cadence().spun_out(s));
            }
            {
                let bell = self.direct.doorbell();
                // A failure elsewhere (abort, a lost rank, a mismatch) rings this doorbell.
                let _registered = self.health.map(|h| h.sleeping_on(bell));
                if let Some(h) = self.health.filter(|h| h.is_failed()) {
                    return Err(h.error(me, id.call, id.seq));
                }
                let token = bell.prepare();
                if pending(&*self.direct).is_none() {
                    bell.cancel(token);
                    continue;
                }
                let asleep = Instant::now();
                // Rechecking: what a publish that rings without a fence needs (crate::base::wait).
                // direct/shm.rs still publishes with a SeqCst store, whose ring reaches every
                // sleeper; then the second look finds nothing new and costs one wake-up a sleep.
                bell.wait_rechecking(token, SLEEP_SLICE, || pending(&*self.direct).is_none());
                if asleep.elapsed() >= SLEEP_SLICE && pending(&*self.direct).is_none() {
                    // Every peer had published, yet no ring woke this rank: a lost wake-up
                    // (never expected; the doorbell's protocol is in crate::base::wait).
                    tracing::warn!(
                        rank = me,
                        call = id.call,
                        seq = id.seq,
                        "no ring within the sleep slice although every peer had published: a lost wake-up (or a publish just as the slice ended)"
                    );
                }
            }
            if pending(&*self.direct).is_none() {
                continue; // (every peer is there: nothing to check)
            }
            let (direct, print, links) = (&*self.direct, self.print, self.links.as_deref_mut());
            self.wait.check(
                || {
                    (0..n)
                        .filter(|&p| p != me && !direct.reached(p, e))
                        .collect()
                },
                |waiting| {
                    if let Some(err) = print.and_then(|print| {
                        link_mismatch(print, links, waiting, id, |p| direct.reached(p, e))
                    }) {
                        return Err(err);
                    }
                    for &p in waiting {
                        if let Err(err) = direct.check_alive(p) {
                            // Looked at after its close or exit: a peer that published the
                            // event before it left did its part (`waiting` may predate it).
                            if direct.reached(p, e) {
                                continue;
                            }
                            return Err(err.into_error(id.rank, p, id.call, id.seq));
                        }
                    }
                    Ok(())
                },
            )?;
        }
    }
}

/// The direct executor's between-sleeps check against a peer that sent link bytes, with the
/// interleaving forced: the peer acts when this rank first peeks its link.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::dtype::DataType;
    use crate::base::op::ReduceOp;
    use crate::base::wait::Spin;
    use crate::direct::link::{mem_group, MemDirect};
    use crate::fault::fingerprint::Fingerprint;
    use crate::sched::CollKind;
    use crate::transport::{TransportKind, WaitSource};
    use std::time::Duration;

    /// Rank 0's link from rank 1; on its first read rank 1 acts.
    struct HookLink {
        mine: Box<dyn Link>,
        peer: Option<(MemDirect, Box<dyn Link>)>,
        /// Whether rank 1 publishes this call's first event before it sends its next call's
        /// header (it finished this call) or not (it is in a link call instead).
        publish_first: bool,
        /// Whether rank 1 instead publishes this call's event, then drops its communicator
        /// and sends nothing (it finished the call and left).
        leave: bool,
        /// Rank 1's header of this call (its event) and of its next call (its link bytes).
        this_call: [u8; HEADER_BYTES],
        next_call: [u8; HEADER_BYTES],
        fired: bool,
    }

    impl Link for HookLink {
        fn kind(&self) -> TransportKind {
            self.mine.kind()
        }
        fn try_send(&mut self, data: &[u8]) -> std::result::Result<usize, LinkError> {
            self.mine.try_send(data)
        }
        fn try_recv(
            &mut self,
            consume: &mut dyn FnMut(&[u8]) -> usize,
        ) -> std::result::Result<usize, LinkError> {
            if !self.fired && self.leave {
                self.fired = true;
                let (mut d, link) = self.peer.take().expect("the peer's ends");
                let rec = EventRecord {
                    header: self.this_call,
                    ..Default::default()
                };
                d.publish(&[], &rec);
                drop((d, link));
            }
            if !self.fired {
                self.fired = true;
                let (d, link) = self.peer.as_mut().expect("the peer's ends");
                if self.publish_first {
                    let rec = EventRecord {
                        header: self.this_call,
                        ..Default::default()
                    };
                    d.publish(&[], &rec);
                }
                assert_eq!(link.try_send(&self.next_call).unwrap(), HEADER_BYTES);
            }
            self.mine.try_recv(consume)
        }
        fn send_wait(&self) -> WaitSource<'_> {
            self.mine.send_wait()
        }
        fn recv_wait(&self) -> WaitSource<'_> {
            self.mine.recv_wait()
        }
    }

    /// Rank 0 begins a direct-area all-reduce (call #2) and waits for rank 1's first event;
    /// rank 1 acts (see [`HookLink`]) once rank 0's check peeks its link.
    fn run(publish_first: bool, leave: bool) -> (Result<u64>, bool) {
        let mut g = crate::transport::mem::group(2, 1 << 16);
        let (_, peer_link) = g[1].pop().unwrap();
        let (_, my_link) = g[0].pop().unwrap();
        let mut areas = mem_group(2);
        let peer_area = areas.pop().unwrap();
        let mut my_area = areas.pop().unwrap();
        let print = CallPrint {
            fp: Fingerprint::of(CollKind::AllReduce, DataType::U64, ReduceOp::Sum, 1, 0),
            send_seq: 2,
            recv_seq: 2,
            call_seq: 2,
        };
        let next = CallPrint {
            send_seq: 3,
            call_seq: 3,
            ..print
        };
        let mut links: Vec<Option<Box<dyn Link>>> = vec![
            None,
            Some(Box::new(HookLink {
                mine: my_link,
                peer: Some((peer_area, peer_link)),
                publish_first,
                leave,
                this_call: print.header(),
                next_call: next.header(),
                fired: false,
            })),
        ];
        let id = CallId {
            rank: 0,
            call: "all_reduce",
            seq: 2,
        };
        let res = {
            let mut cx = DirectCtx {
                direct: &mut my_area,
                nranks: 2,
                wait: Waiter::new(id, Spin::new(1), Duration::from_millis(400), false),
                print: Some(&print),
                health: None,
                links: Some(&mut links),
                step_ends: None,
                nt_bytes: usize::MAX,
            };
            cx.begin(&[], EventRecord::default())
        };
        let fired = links[1]
            .as_mut()
            .map(|l| {
                // The hook link is the only one; read back whether it fired via a peek.
                let mut seen = 0;
                let _ = l.try_recv(&mut |b| {
                    seen = b.len();
                    0
                });
                seen == HEADER_BYTES
            })
            .unwrap_or(false);
        (res, fired)
    }

    #[test]
    fn a_peer_that_finished_and_began_a_link_call_is_no_mismatch() {
        // Rank 0 saw rank 1 short of the event, then rank 1 published it, finished the
        // call and sent its next call's header, then rank 0 peeked the link.
        let (res, fired) = run(true, false);
        assert!(fired, "the check never peeked the link");
        res.expect("rank 1 finished this call before it sent its next call's header");
    }

    /// Rank 0 saw rank 1 short of the event; then rank 1 published it, finished the call and
    /// dropped its communicator; then rank 0 checked that rank 1 is alive: it did its part,
    /// the wait ends (rank 1 publishes only when rank 0 first peeks its link, so a wait that
    /// ends did not end before the check).
    #[test]
    fn a_peer_that_published_and_then_left_did_its_part() {
        let (res, _) = run(false, true);
        res.expect("rank 1 published the event before it left");
    }

    #[test]
    fn a_peer_in_a_link_call_instead_is_a_mismatch() {
        let (res, fired) = run(false, false);
        assert!(fired, "the check never peeked the link");
        match res {
            Err(Error::Mismatch {
                rank: 0, peer: 1, ..
            }) => {}
            other => panic!("expected a mismatch naming rank 1, got {other:?}"),
        }
    }
}

/// A living peer's buffer gone mid-call (EFAULT) is reported as the call's real cause.
#[cfg(test)]
mod access_error_tests {
    use super::*;
    use crate::base::wait::Spin;
    use crate::direct::link::mem_group;
    use crate::fault::health::Failure;

    fn efault() -> std::io::Error {
        std::io::Error::from_raw_os_error(libc::EFAULT)
    }

    fn read_error(d: &mut dyn Direct, health: Option<&Health>, peer: usize) -> Error {
        let id = CallId {
            rank: 0,
            call: "all_reduce",
            seq: 4,
        };
        let cx = DirectCtx {
            direct: d,
            nranks: 3,
            wait: Waiter::new(id, Spin::new(1), Duration::from_secs(30), false),
            print: None,
            health,
            links: None,
            step_ends: None,
            nt_bytes: 0,
        };
        cx.read_error(peer, efault())
    }

    #[test]
    fn a_bad_address_while_a_third_rank_is_lost_names_the_lost_rank() {
        // Rank 2 is gone; rank 1 (alive) left the call on it: reading rank 1's buffer fails.
        let mut g = mem_group(3);
        drop(g.pop());
        let e = read_error(&mut g[0], None, 1);
        assert!(
            matches!(
                e,
                Error::PeerLost {
                    peer: 2,
                    seq: 4,
                    ..
                }
            ),
            "{e}"
        );
        // The communicator already failed on rank 2 (the watchdog): that failure.
        let g = &mut mem_group(3);
        let h = Health::new();
        h.fail(Failure::Lost {
            peer: 2,
            reason: "heartbeat".into(),
        });
        let e = read_error(&mut g[0], Some(&h), 1);
        assert!(matches!(e, Error::PeerLost { peer: 2, .. }), "{e}");
        // The failure comes a little later (relayed by the peer): still that failure.
        let h = std::sync::Arc::new(Health::new());
        let h2 = h.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            h2.fail(Failure::Lost {
                peer: 2,
                reason: "relayed".into(),
            });
        });
        let e = read_error(&mut g[0], Some(&h), 1);
        t.join().unwrap();
        assert!(matches!(e, Error::PeerLost { peer: 2, .. }), "{e}");
        // Nothing failed: a bad address it is.
        let e = read_error(&mut g[0], Some(&Health::new()), 1);
        assert!(e.to_string().contains("Bad address"), "{e}");
    }
}

/// The end of a failed single-copy call: whom the rank still waits for.
#[cfg(test)]
mod drain_tests {
    use super::*;
    use crate::base::wait::Spin;
    use crate::direct::link::mem_group;
    use crate::fault::health::Failure;

    /// Ranks 1 and 2 stopped mid-call (alive, silent), and the watchdog reported both lost:
    /// rank 1 first (the communicator's failure), rank 2 later. Rank 0, whose call failed,
    /// waits for neither: before, only the first failure's rank released the wait, and a
    /// second stopped rank held it until the call's timeout.
    #[test]
    fn every_rank_reported_lost_releases_the_drain_not_only_the_first() {
        let mut g = mem_group(4);
        let e = g[3].publish(&[], &EventRecord::default());
        assert_eq!(g[0].publish(&[], &EventRecord::left_failed()), e);
        let h = Health::new();
        for peer in [1, 2] {
            h.fail(Failure::Lost {
                peer,
                reason: "no heartbeat".into(),
            });
        }
        let id = CallId {
            rank: 0,
            call: "all_reduce",
            seq: 4,
        };
        let timeout = Duration::from_secs(60);
        let cx = DirectCtx {
            direct: &mut g[0],
            nranks: 4,
            wait: Waiter::new(id, Spin::new(1), timeout, false),
            print: None,
            health: Some(&h),
            links: None,
            step_ends: None,
            nt_bytes: 0,
        };
        let start = Instant::now();
        cx.drain(e);
        // Quiet, it returns at once; held by rank 2 it would take the whole timeout.
        assert!(start.elapsed() < timeout / 2, "{:?}", start.elapsed());
        assert!(h.is_lost(2) && !h.is_lost(3));
    }
}

/// The direct executor's learned spin (`Cadence`) against a late peer.
#[cfg(test)]
mod cadence_tests {
    use super::*;
    use crate::base::wait::{Cadence, Spin};
    use crate::direct::link::mem_group;
    use std::time::Duration;

    /// A rank whose peer publishes each event long after the rank has spun out its budget
    /// learns to spin less (the convoy of `Cadence`), and its waits still end.
    #[test]
    fn waits_for_a_late_peer_learn_a_shorter_spin() {
        let mut g = mem_group(2);
        let mut late = g.pop().expect("two");
        let mut d = g.pop().expect("two");
        const EVENTS: u64 = 8;
        let peer = std::thread::spawn(move || {
            for _ in 0..EVENTS {
                std::thread::sleep(Duration::from_millis(500));
                late.publish(&[], &EventRecord::default());
            }
            late
        });
        let base = Spin::new(2000);
        let id = CallId {
            rank: 0,
            call: "test",
            seq: 1,
        };
        let mut cx = DirectCtx {
            direct: &mut d,
            nranks: 2,
            wait: Waiter::new(id, base, Duration::from_secs(30), true),
            print: None,
            health: None,
            links: None,
            step_ends: None,
            nt_bytes: 0,
        };
        for _ in 0..EVENTS {
            let e = cx.direct.publish(&[], &EventRecord::default());
            cx.wait_all(e).expect("the peer publishes every event");
        }
        let learned = cx.direct.cadence().spin(base).budget;
        // Every wait (500 ms; 2000 checks with a yield every 64 take about a millisecond
        // quiet, some 100 ms where each yield gives the CPU away for a time slice) outlasts
        // 2000 checks unless this thread lost its CPU meanwhile, which the doubling of a
        // caught wait undoes at most once per wait.
        assert!(
            learned < base.budget,
            "learned {learned} after {EVENTS} spun-out waits"
        );
        assert!(learned >= Cadence::MIN);
        let _ = peer.join();
    }
}
