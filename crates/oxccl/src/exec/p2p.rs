//! Point-to-point messages: groups of sends and receives that progress together, tags, and
//! receives from any source.
//!
//! Every message on a link is framed as the executor frames a `send`: the 16-byte call
//! [`Header`] (point-to-point, element type, count, the message's number on this ordered pair
//! of ranks), then, for a message with a nonzero tag (marked in the header's op field), 8
//! bytes of tag (u32 little-endian and 4 zero bytes), then the data. Every message has its
//! header, empty ones included. Plain `send`, `recv` and `sendrecv` are groups with tag 0.
//!
//! A group ([`Communicator::group_p2p`](crate::Communicator::group_p2p)) moves all its sends
//! and receives in one loop, each as far as its link allows, so two ranks that both send
//! first complete at any size (the links' buffers are bounded: a send larger than one waits
//! for the peer to read). Sends to one peer go in order, one after the other; every peer with
//! a receive pending is read from, message by message. A message whose (source, tag) matches
//! no pending receive is kept in the communicator's stash (at most
//! [`Config::p2p_stash_bytes`](crate::Config::p2p_stash_bytes) bytes, past which the call
//! fails) and a later receive takes it from there: messages of one source and tag are
//! received in the order they were sent, whatever the order of the tags.
//!
//! A group runs the user's own messages ([`P2pCall::User`]). The collectives made of
//! messages ([`P2pCall::Gather`], ...:
//! [`Communicator::group_p2p_as`](crate::Communicator::group_p2p_as)) run as schedules in the
//! executor, each transfer framed as a message here (`exec::messages`): every message says
//! which call it is of, and a collective's messages carry the collective's number (the
//! communicator's count of collectives, the one every collective's header carries) instead
//! of the pair's message number. A user receive takes only a user message: one that finds a
//! collective's message keeps it in the stash if that collective is still to come on this
//! rank (the peer is ahead), and fails if it is past (the message can never be taken;
//! [`Error::Mismatch`], naming both calls and both numbers). So a call refused on one rank
//! (bad arguments there only) never lets a later call take the messages its peers sent for
//! it.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use rustix::event::PollFlags;

use crate::base::dtype::DataType;
use crate::base::error::{Error, Result};
use crate::base::wait::{CallId, Doorbell, Spin, Waiter, NAP, SLEEP_SLICE};
use crate::fault::fingerprint::{CallPrint, Fingerprint, Header, P2pCall, Sequencer, HEADER_BYTES};
use crate::fault::health::Health;
use crate::transport::{Link, WaitSource};

/// Bytes of the tag that follows the header of a tagged message.
pub(crate) const TAG_BYTES: usize = 8;
/// Data sent in the same write as the header.
const WITH_HEADER: usize = 4096 - HEADER_BYTES - TAG_BYTES;

/// One operation of a point-to-point group. Buffers are bytes of `dtype` elements (their
/// length a multiple of its size).
#[derive(Debug)]
pub enum P2pOp<'a> {
    /// Send `buf` to `peer` with `tag`.
    Send {
        /// Destination rank.
        peer: usize,
        /// Tag: the receive must name the same one.
        tag: u32,
        /// Element type.
        dtype: DataType,
        /// The message.
        buf: &'a [u8],
    },
    /// Receive into `buf` a message with `tag` from `peer` (`None`: from any rank). The
    /// message must have exactly `buf`'s length and `dtype`.
    Recv {
        /// Source rank, or `None` for any.
        peer: Option<usize>,
        /// Tag.
        tag: u32,
        /// Element type.
        dtype: DataType,
        /// Where the message goes.
        buf: &'a mut [u8],
        /// Set when the receive completes: the rank the message came from.
        from: Option<usize>,
    },
}

/// Messages that arrived before a receive asked for them.
#[derive(Debug, Default)]
pub(crate) struct Stash {
    msgs: VecDeque<Stashed>,
    bytes: usize,
    /// Per peer: the header of a collective read while waiting for a message from any
    /// source (the peer had gone on to a collective); the executor takes it from here.
    held: Vec<Option<[u8; HEADER_BYTES]>>,
}

#[derive(Debug)]
struct Stashed {
    peer: usize,
    call: P2pCall,
    tag: u32,
    fp: Fingerprint,
    mseq: u64,
    data: Vec<u8>,
}

impl Stash {
    /// The headers held per peer (see [`crate::exec::FaultHooks::held`]).
    pub(crate) fn held_mut(&mut self) -> &mut [Option<[u8; HEADER_BYTES]>] {
        &mut self.held
    }

    /// Whether a collective's header read off `peer`'s link is held (the peer is in a
    /// collective whose messages are not point-to-point ones).
    pub(crate) fn is_held(&self, peer: usize) -> bool {
        self.held.get(peer).is_some_and(|h| h.is_some())
    }

    /// Bytes of the messages kept.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Counts `n` bytes of a message being read into the stash ([`Stash::keep_user`] adds
    /// it once read).
    pub(crate) fn reserve(&mut self, n: usize) {
        self.bytes += n;
    }

    /// Keeps a user message read by a collective's receive (its bytes already counted by
    /// [`Stash::reserve`]).
    pub(crate) fn keep_user(
        &mut self,
        peer: usize,
        tag: u32,
        fp: Fingerprint,
        mseq: u64,
        data: Vec<u8>,
    ) {
        self.msgs.push_back(Stashed {
            peer,
            call: P2pCall::User,
            tag,
            fp,
            mseq,
            data,
        });
    }

    /// Takes the message of collective `call` numbered `n` from `peer`, if one is kept:
    /// its header's fingerprint, its number and its bytes.
    pub(crate) fn take_collective(
        &mut self,
        peer: usize,
        call: P2pCall,
        n: u64,
    ) -> Option<(Fingerprint, u64, Vec<u8>)> {
        let k = self
            .msgs
            .iter()
            .position(|m| m.peer == peer && m.call == call && m.mseq as u32 == n as u32)?;
        let m = self.msgs.remove(k).expect("found above");
        self.bytes -= m.data.len();
        Some((m.fp, m.mseq, m.data))
    }

    /// A kept message of a collective other than `call` numbered `n` that is numbered `n` or
    /// before (begun: no receive can take it any more): its peer, fingerprint and number.
    pub(crate) fn past_collective(
        &self,
        call: P2pCall,
        n: u64,
    ) -> Option<(usize, Fingerprint, u64)> {
        self.msgs
            .iter()
            .find(|m| {
                m.call.is_collective()
                    && !(m.call == call && m.mseq as u32 == n as u32)
                    && begun(n, m.mseq)
            })
            .map(|m| (m.peer, m.fp, m.mseq))
    }
}

/// Whether a collective's message numbered `mseq` (low 32 bits) is of a collective begun by
/// a rank whose last collective begun is `cur`: numbers within 2^31 behind count as begun
/// (they wrap at 2^32).
fn begun(cur: u64, mseq: u64) -> bool {
    (cur as u32).wrapping_sub(mseq as u32) < 1 << 31
}

/// What a group needs of the communicator.
pub(crate) struct Ctx<'a> {
    pub rank: usize,
    pub links: &'a mut [Option<Box<dyn Link>>],
    pub seqr: &'a mut Sequencer,
    pub stash: &'a mut Stash,
    pub stash_limit: usize,
    pub spin: Spin,
    pub timeout: Duration,
    pub health: Option<&'a Health>,
    /// The host's direct area, if any: a peer awaited here that publishes a call there is
    /// in a collective (a mismatch, found as the executor finds it), described with this
    /// call's print.
    pub direct: Option<(&'a dyn crate::direct::link::Direct, CallPrint)>,
    pub call: &'static str,
    pub seq: u64,
}

/// A group's progress: operations done, sends queued and in flight per peer, the message
/// being read from each peer.
struct Progress {
    done: Vec<bool>,
    outq: Vec<VecDeque<usize>>,
    out: Vec<Option<Out>>,
    inc: Vec<Option<In>>,
}

impl Progress {
    fn finished(&self) -> bool {
        self.done.iter().all(|d| *d) && self.inc.iter().all(|i| i.is_none())
    }
}

/// An outgoing message in progress.
struct Out {
    op: usize,
    hdr: [u8; HEADER_BYTES + TAG_BYTES],
    hdr_len: usize,
    hdr_sent: usize,
    sent: usize,
}

/// Where an incoming message's data goes.
enum Target {
    Op(usize),
    Stash(Vec<u8>),
}

/// Reading one peer's next message.
enum In {
    Header {
        buf: [u8; HEADER_BYTES + TAG_BYTES],
        got: usize,
    },
    Data {
        target: Target,
        fp: Fingerprint,
        call: P2pCall,
        mseq: u64,
        tag: u32,
        len: usize,
        done: usize,
    },
}

impl Default for In {
    fn default() -> Self {
        In::Header {
            buf: [0; HEADER_BYTES + TAG_BYTES],
            got: 0,
        }
    }
}

impl Ctx<'_> {
    fn bad(&self, msg: String) -> Error {
        Error::InvalidArgument {
            rank: self.rank,
            call: self.call,
            seq: self.seq,
            msg,
        }
    }

    fn protocol(&self, peer: usize, msg: String) -> Error {
        Error::Protocol {
            rank: self.rank,
            peer,
            call: self.call,
            seq: self.seq,
            msg,
        }
    }

    /// Runs the group to completion: every send taken by its link, every receive filled.
    pub(crate) fn run(&mut self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        let n = self.links.len();
        let mut done = vec![false; ops.len()];
        self.validate(ops)?;
        self.local(ops, &mut done)?;
        self.take_stashed(ops, &mut done)?;
        // Sends, in order per peer.
        let mut outq: Vec<VecDeque<usize>> = (0..n).map(|_| VecDeque::new()).collect();
        for (i, op) in ops.iter().enumerate() {
            if let P2pOp::Send { peer, .. } = op {
                if !done[i] {
                    outq[*peer].push_back(i);
                }
            }
        }
        let mut st = Progress {
            done,
            outq,
            out: (0..n).map(|_| None).collect(),
            inc: (0..n).map(|_| None).collect(),
        };
        let id = CallId {
            rank: self.rank,
            call: self.call,
            seq: self.seq,
        };
        let mut wait = Waiter::new(id, self.spin, self.timeout, true);
        loop {
            let progressed = self.pass(ops, &mut st)?;
            if st.finished() {
                return Ok(());
            }
            if progressed {
                wait.progressed();
                continue;
            }
            if wait.spin() {
                continue;
            }
            if let Some(h) = self.health.filter(|h| h.is_failed()) {
                return Err(h.error(self.rank, self.call, self.seq));
            }
            if self.sleep(ops, &mut st)? {
                wait.progressed();
                continue;
            }
            let me = self.rank;
            let (links, direct) = (&mut *self.links, self.direct);
            wait.check(
                || waiting_on(ops, &st.done, &st.inc, me, true),
                |waiting| {
                    for &p in waiting {
                        if let Some(l) = links.get_mut(p).and_then(|l| l.as_mut()) {
                            l.check_alive()
                                .map_err(|e| e.into_error(id.rank, p, id.call, id.seq))?;
                        }
                    }
                    if let Some((d, print)) = direct {
                        // Not the peers only a receive from any source waits for: those may
                        // rightly be in a collective meanwhile.
                        let named = waiting_on(ops, &st.done, &st.inc, me, false);
                        if let Some(e) = crate::direct::exec::direct_mismatch(
                            d,
                            &named,
                            &print,
                            id.rank,
                            id.seq,
                            |p| super::unread(links, p),
                        ) {
                            return Err(e);
                        }
                    }
                    Ok(())
                },
            )?;
        }
    }

    /// One pass over every send and every peer to read from. Returns whether bytes moved.
    fn pass(&mut self, ops: &mut [P2pOp<'_>], st: &mut Progress) -> Result<bool> {
        let n = self.links.len();
        let mut progressed = false;
        for peer in 0..n {
            progressed |= self.send_some(
                ops,
                &mut st.done,
                &mut st.outq[peer],
                &mut st.out[peer],
                peer,
            )?;
        }
        let me = self.rank;
        for peer in (0..n).filter(|&p| p != me) {
            if self.reads_from(ops, st, peer)? {
                progressed |= self.recv_some(ops, &mut st.done, &mut st.inc[peer], peer)?;
            }
        }
        Ok(progressed)
    }

    /// Whether this pass reads from `peer`: a receive waits for it (or for any rank), or one
    /// of its messages is half read (once started, a message is read to its end).
    fn reads_from(&self, ops: &[P2pOp<'_>], st: &Progress, peer: usize) -> Result<bool> {
        let named = named(ops, &st.done, peer);
        if self.stash.is_held(peer) {
            if named {
                return Err(self.protocol(
                    peer,
                    "expected a point-to-point message, the peer is in a collective".into(),
                ));
            }
            return Ok(false); // in a collective: any-source receives look elsewhere
        }
        let any = ops
            .iter()
            .zip(&st.done)
            .any(|(o, d)| !d && matches!(o, P2pOp::Recv { peer: None, .. }));
        Ok(any || named || st.inc[peer].is_some())
    }

    /// Sleeps until a link the group waits on may move (its doorbell, or its socket) or a
    /// slice passes, as the executor does. Returns true if the last look before sleeping
    /// made progress (no sleep happened).
    fn sleep(&mut self, ops: &mut [P2pOp<'_>], st: &mut Progress) -> Result<bool> {
        let mut bell: Option<*const Doorbell> = None;
        let mut fds: Vec<(RawFd, PollFlags)> = Vec::new();
        let n = self.links.len();
        for peer in (0..n).filter(|&p| p != self.rank) {
            let sending = st.out[peer].is_some() || !st.outq[peer].is_empty();
            let reading = self.reads_from(ops, st, peer)?;
            let Some(link) = self.links[peer].as_ref() else {
                continue;
            };
            let mut add = |src: WaitSource<'_>, flags| match src {
                WaitSource::Doorbell(b) => bell = Some(b as *const Doorbell),
                WaitSource::Fd(fd) => fds.push((fd.as_raw_fd(), flags)),
            };
            if sending {
                add(link.send_wait(), PollFlags::OUT);
            }
            if reading {
                add(link.recv_wait(), PollFlags::IN);
            }
        }
        if fds.is_empty() {
            let Some(bell) = bell else {
                std::thread::sleep(NAP);
                return Ok(false);
            };
            // SAFETY: the doorbell lives in a link (or its shared segment) owned by
            // `self.links`, which outlives this call; links are not dropped during a call.
            let bell = unsafe { &*bell };
            let _registered = self.health.map(|h| h.sleeping_on(bell));
            let token = bell.prepare();
            if self.health.is_some_and(|h| h.is_failed()) {
                bell.cancel(token);
                return Ok(false);
            }
            match self.pass(ops, st) {
                Ok(true) => {
                    bell.cancel(token);
                    return Ok(true);
                }
                Ok(false) if st.finished() => {
                    bell.cancel(token);
                    return Ok(true);
                }
                Ok(false) => {}
                Err(e) => {
                    bell.cancel(token);
                    return Err(e);
                }
            }
            bell.wait(token, SLEEP_SLICE);
            return Ok(false);
        }
        let timeout = if bell.is_some() { NAP } else { SLEEP_SLICE };
        if let Some(fd) = self.health.and_then(|h| h.poll_fd()) {
            fds.push((fd.as_raw_fd(), PollFlags::IN));
        }
        // SAFETY: each fd belongs to a link in `self.links` (or to the health state), alive
        // for this call.
        match unsafe { crate::base::wait::poll_fds(&fds, timeout) } {
            Ok(()) => Ok(false),
            Err(e) => Err(Error::Io {
                rank: self.rank,
                context: "poll".into(),
                source: e.into(),
            }),
        }
    }

    fn validate(&self, ops: &[P2pOp<'_>]) -> Result<()> {
        let n = self.links.len();
        for op in ops {
            let (peer, dtype, len) = match op {
                P2pOp::Send {
                    peer, dtype, buf, ..
                } => (Some(*peer), *dtype, buf.len()),
                P2pOp::Recv {
                    peer, dtype, buf, ..
                } => (*peer, *dtype, buf.len()),
            };
            if let Some(p) = peer.filter(|&p| p >= n) {
                return Err(self.bad(format!("peer {p} is out of range (world size {n})")));
            }
            if len % dtype.size() != 0 {
                return Err(self.bad(format!(
                    "a buffer of {len} bytes is not a whole number of {dtype} elements"
                )));
            }
        }
        Ok(())
    }

    /// Whether a collective's message numbered `mseq` is of a collective this rank has begun
    /// (the last begun or before).
    fn begun(&self, mseq: u64) -> bool {
        begun(self.seqr.colls(), mseq)
    }

    /// Whether a message of `call` belongs to this group: the user's.
    fn ours(&self, call: P2pCall, _mseq: u64) -> bool {
        call == P2pCall::User
    }

    /// The error for a message from `peer` (`fp`, numbered `mseq`) of a collective that no
    /// receive of this rank can take any more.
    fn foreign(&self, peer: usize, fp: &Fingerprint, mseq: u64) -> Error {
        let mine = format!(
            "{} (call #{}), a point-to-point receive, after beginning its collective #{}",
            self.call,
            self.seq,
            self.seqr.colls()
        );
        let theirs = match fp.p2p_call() {
            Some(c) if c.is_collective() => format!("{fp} as its collective #{mseq}"),
            _ => format!("{fp} as its message #{mseq} (a point-to-point send)"),
        };
        Error::Mismatch {
            rank: self.rank,
            peer,
            seq: self.seq,
            mine,
            theirs,
        }
    }

    /// Sends to this rank itself, matched with its receives from itself (same tag, in order).
    fn local(&self, ops: &mut [P2pOp<'_>], done: &mut [bool]) -> Result<()> {
        let me = self.rank;
        for i in 0..ops.len() {
            let P2pOp::Send {
                peer, tag, dtype, ..
            } = ops[i]
            else {
                continue;
            };
            if peer != me {
                continue;
            }
            let j = (0..ops.len()).find(|&j| {
                !done[j] && matches!(ops[j], P2pOp::Recv { peer: Some(p), tag: t, .. } if p == me && t == tag)
            });
            let Some(j) = j else {
                return Err(self.bad(format!(
                    "a send to this rank itself (tag {tag}) needs a receive from itself in the same group"
                )));
            };
            let (
                P2pOp::Send { buf: src, .. },
                P2pOp::Recv {
                    buf: dst,
                    dtype: rd,
                    from,
                    ..
                },
            ) = pair(ops, i, j)
            else {
                continue;
            };
            if src.len() != dst.len() || *rd != dtype {
                return Err(self.bad(format!(
                    "a send to itself of {} x {dtype} into a receive of {} x {rd}",
                    src.len() / dtype.size(),
                    dst.len() / rd.size()
                )));
            }
            dst.copy_from_slice(src);
            *from = Some(me);
            done[i] = true;
            done[j] = true;
        }
        if (0..ops.len())
            .any(|j| !done[j] && matches!(ops[j], P2pOp::Recv { peer: Some(p), .. } if p == me))
        {
            return Err(self.bad(
                "a receive from this rank itself needs a send to itself in the same group".into(),
            ));
        }
        Ok(())
    }

    /// Receives that messages already stashed satisfy, in posting order.
    fn take_stashed(&mut self, ops: &mut [P2pOp<'_>], done: &mut [bool]) -> Result<()> {
        if self.stash.msgs.is_empty() {
            return Ok(());
        }
        // A kept message of a collective this rank has begun, and that is not this group's:
        // no receive can ever take it.
        if let Some(m) =
            self.stash.msgs.iter().find(|m| {
                m.call.is_collective() && !self.ours(m.call, m.mseq) && self.begun(m.mseq)
            })
        {
            return Err(self.foreign(m.peer, &m.fp, m.mseq));
        }
        for i in 0..ops.len() {
            if done[i] || self.stash.msgs.is_empty() {
                continue;
            }
            let P2pOp::Recv { peer, tag, .. } = ops[i] else {
                continue;
            };
            let Some(k) = self.stash.msgs.iter().position(|m| {
                self.ours(m.call, m.mseq) && m.tag == tag && peer.is_none_or(|p| p == m.peer)
            }) else {
                continue;
            };
            let m = self.stash.msgs.remove(k).expect("found above");
            self.stash.bytes -= m.data.len();
            self.check_match(&ops[i], m.peer, &m.fp, m.mseq, m.tag)?;
            if let P2pOp::Recv { buf, from, .. } = &mut ops[i] {
                buf.copy_from_slice(&m.data);
                *from = Some(m.peer);
            }
            done[i] = true;
        }
        Ok(())
    }

    /// A message (`fp`, `tag`) from `peer` matched receive `op`: its type and length must be
    /// the receive's.
    fn check_match(
        &self,
        op: &P2pOp<'_>,
        peer: usize,
        fp: &Fingerprint,
        mseq: u64,
        tag: u32,
    ) -> Result<()> {
        let P2pOp::Recv { dtype, buf, .. } = op else {
            return Ok(());
        };
        let count = buf.len() / dtype.size();
        if fp.data_type() == Some(*dtype) && fp.count == count as u64 {
            return Ok(());
        }
        let (mine, theirs) = (
            format!("recv({count} x {dtype}, tag {tag}) (call #{})", self.seq),
            format!("{fp} with tag {tag} as its message #{mseq}"),
        );
        Err(Error::Mismatch {
            rank: self.rank,
            peer,
            seq: self.seq,
            mine,
            theirs,
        })
    }

    /// Moves what the link to `peer` takes of the current send. Returns whether bytes moved.
    fn send_some(
        &mut self,
        ops: &[P2pOp<'_>],
        done: &mut [bool],
        queue: &mut VecDeque<usize>,
        cur: &mut Option<Out>,
        peer: usize,
    ) -> Result<bool> {
        let mut moved = false;
        loop {
            if cur.is_none() {
                let Some(i) = queue.pop_front() else {
                    return Ok(moved);
                };
                let P2pOp::Send {
                    tag, dtype, buf, ..
                } = &ops[i]
                else {
                    continue;
                };
                let h = Header {
                    fp: Fingerprint::p2p(
                        *dtype,
                        buf.len() / dtype.size(),
                        *tag != 0,
                        P2pCall::User,
                    ),
                    mseq: self.seqr.next_send(peer),
                };
                let mut hdr = [0u8; HEADER_BYTES + TAG_BYTES];
                hdr[..HEADER_BYTES].copy_from_slice(&h.encode());
                hdr[HEADER_BYTES..HEADER_BYTES + 4].copy_from_slice(&tag.to_le_bytes());
                *cur = Some(Out {
                    op: i,
                    hdr,
                    hdr_len: if *tag != 0 {
                        HEADER_BYTES + TAG_BYTES
                    } else {
                        HEADER_BYTES
                    },
                    hdr_sent: 0,
                    sent: 0,
                });
            }
            let o = cur.as_mut().expect("set above");
            let P2pOp::Send { buf, .. } = &ops[o.op] else {
                return Ok(moved);
            };
            let (rank, call, seq) = (self.rank, self.call, self.seq);
            let link = self.links[peer]
                .as_mut()
                .ok_or_else(|| Error::InvalidArgument {
                    rank,
                    call,
                    seq,
                    msg: format!("no link to rank {peer}"),
                })?;
            let err = |e: crate::transport::LinkError| e.into_error(rank, peer, call, seq);
            if o.hdr_sent < o.hdr_len {
                // The header and a first piece of data in one write.
                let mut first = [0u8; HEADER_BYTES + TAG_BYTES + WITH_HEADER];
                let h = &o.hdr[o.hdr_sent..o.hdr_len];
                let d = &buf[..buf.len().min(WITH_HEADER)];
                first[..h.len()].copy_from_slice(h);
                first[h.len()..h.len() + d.len()].copy_from_slice(d);
                let k = link.try_send(&first[..h.len() + d.len()]).map_err(err)?;
                let hk = k.min(h.len());
                o.hdr_sent += hk;
                o.sent += k - hk;
                moved |= k > 0;
                if k == 0 {
                    return Ok(moved);
                }
            }
            if o.hdr_sent == o.hdr_len && o.sent < buf.len() {
                let k = link.try_send(&buf[o.sent..]).map_err(err)?;
                o.sent += k;
                moved |= k > 0;
            }
            if o.hdr_sent == o.hdr_len && o.sent == buf.len() {
                done[o.op] = true;
                *cur = None;
                continue;
            }
            return Ok(moved);
        }
    }

    /// Reads what has arrived from `peer`: headers, data into the matching receive or the
    /// stash. Returns whether bytes moved.
    fn recv_some(
        &mut self,
        ops: &mut [P2pOp<'_>],
        done: &mut [bool],
        cur: &mut Option<In>,
        peer: usize,
    ) -> Result<bool> {
        let (rank, call, seq) = (self.rank, self.call, self.seq);
        let mut moved = false;
        loop {
            let state = cur.get_or_insert_with(In::default);
            let Some(link) = self.links[peer].as_mut() else {
                return Err(self.bad(format!("no link to rank {peer}")));
            };
            let err = |e: crate::transport::LinkError| e.into_error(rank, peer, call, seq);
            match state {
                In::Header { buf, got } => {
                    let need = if *got >= HEADER_BYTES && tagged(buf) {
                        HEADER_BYTES + TAG_BYTES
                    } else {
                        HEADER_BYTES
                    };
                    let k = link.try_recv_into(&mut buf[*got..need]).map_err(err)?;
                    *got += k;
                    moved |= k > 0;
                    if *got < need {
                        if *got == 0 {
                            *cur = None; // between messages: nothing started
                        }
                        return Ok(moved);
                    }
                    if *got == HEADER_BYTES && tagged(buf) {
                        continue; // the tag follows
                    }
                    let (buf, got) = (*buf, *got);
                    let h =
                        Header::decode(&buf[..HEADER_BYTES]).map_err(|m| self.protocol(peer, m))?;
                    if !h.fp.is_p2p() && got == HEADER_BYTES && !named(ops, done, peer) {
                        // A peer gone on to a collective while this rank waits for any
                        // source: keep its header for that collective.
                        if self.stash.held.len() <= peer {
                            self.stash.held.resize(peer + 1, None);
                        }
                        let mut hb = [0u8; HEADER_BYTES];
                        hb.copy_from_slice(&buf[..HEADER_BYTES]);
                        self.stash.held[peer] = Some(hb);
                        *cur = None;
                        return Ok(moved);
                    }
                    let mcall = message_call(&h).map_err(|e| self.protocol(peer, e))?;
                    if mcall == P2pCall::User {
                        let want = self.seqr.next_recv(peer);
                        if h.mseq != want & 0xffff_ffff {
                            return Err(self.protocol(
                                peer,
                                format!(
                                    "message #{} arrived where #{want} was expected (the streams are out of step)",
                                    h.mseq
                                ),
                            ));
                        }
                    } else if self.begun(h.mseq) {
                        // A message of a collective this rank is past: no receive can take
                        // it.
                        return Err(self.foreign(peer, &h.fp, h.mseq));
                    }
                    let tag = if got > HEADER_BYTES {
                        u32::from_le_bytes(
                            buf[HEADER_BYTES..HEADER_BYTES + 4]
                                .try_into()
                                .expect("4 bytes"),
                        )
                    } else {
                        0
                    };
                    let Some(dt) = h.fp.data_type() else {
                        return Err(self.protocol(peer, format!("bad element type in {}", h.fp)));
                    };
                    let len = (h.fp.count as usize).saturating_mul(dt.size());
                    // Only a user message goes to one of the group's receives; a collective's
                    // message that came early waits in the stash for its call.
                    let ours = self.ours(mcall, h.mseq);
                    let matched = (0..ops.len()).find(|&i| {
                        ours && !done[i]
                            && matches!(ops[i], P2pOp::Recv { peer: p, tag: t, from: None, .. }
                                if t == tag && p.is_none_or(|p| p == peer))
                    });
                    let target = match matched {
                        Some(i) => {
                            self.check_match(&ops[i], peer, &h.fp, h.mseq, tag)?;
                            if let P2pOp::Recv { from, .. } = &mut ops[i] {
                                *from = Some(peer); // taken: no other message goes here
                            }
                            Target::Op(i)
                        }
                        None => {
                            if self.stash.bytes + len > self.stash_limit {
                                return Err(self.protocol(
                                    peer,
                                    format!(
                                        "an unexpected message ({}, tag {tag}) would grow the stash of messages no receive has asked for to {} bytes, over the limit of {} (OXCCL_P2P_STASH_BYTES)",
                                        h.fp,
                                        self.stash.bytes + len,
                                        self.stash_limit
                                    ),
                                ));
                            }
                            self.stash.bytes += len;
                            Target::Stash(vec![0; len])
                        }
                    };
                    *state = In::Data {
                        target,
                        fp: h.fp,
                        call: mcall,
                        mseq: h.mseq,
                        tag,
                        len,
                        done: 0,
                    };
                }
                In::Data {
                    target,
                    len,
                    done: got,
                    ..
                } => {
                    if *got < *len {
                        let dst: &mut [u8] = match target {
                            Target::Op(i) => match &mut ops[*i] {
                                P2pOp::Recv { buf, .. } => &mut buf[*got..],
                                P2pOp::Send { .. } => &mut [],
                            },
                            Target::Stash(v) => &mut v[*got..],
                        };
                        let k = link.try_recv_into(dst).map_err(err)?;
                        *got += k;
                        moved |= k > 0;
                    }
                    if *got < *len {
                        return Ok(moved);
                    }
                    let Some(In::Data {
                        target,
                        fp,
                        call,
                        mseq,
                        tag,
                        ..
                    }) = cur.take()
                    else {
                        return Ok(moved);
                    };
                    match target {
                        Target::Op(i) => done[i] = true,
                        Target::Stash(data) => self.stash.msgs.push_back(Stashed {
                            peer,
                            call,
                            tag,
                            fp,
                            mseq,
                            data,
                        }),
                    }
                    return Ok(true);
                }
            }
        }
    }
}

/// Whether a receive naming `peer` is pending.
fn named(ops: &[P2pOp<'_>], done: &[bool], peer: usize) -> bool {
    ops.iter()
        .zip(done)
        .any(|(o, d)| !d && matches!(o, P2pOp::Recv { peer: Some(p), .. } if *p == peer))
}

/// Whether a complete 16-byte header announces a tag.
pub(crate) fn tagged(buf: &[u8]) -> bool {
    buf[0] & 0x0f == 15 && buf[1] >> 4 == 1
}

/// Two distinct operations of a group, mutably.
fn pair<'o, 'a>(
    ops: &'o mut [P2pOp<'a>],
    i: usize,
    j: usize,
) -> (&'o mut P2pOp<'a>, &'o mut P2pOp<'a>) {
    debug_assert_ne!(i, j);
    if i < j {
        let (a, b) = ops.split_at_mut(j);
        (&mut a[i], &mut b[0])
    } else {
        let (a, b) = ops.split_at_mut(i);
        (&mut b[0], &mut a[j])
    }
}

/// The ranks a waiting group still needs (`any`: every other rank for a receive from any
/// source).
fn waiting_on(
    ops: &[P2pOp<'_>],
    done: &[bool],
    inc: &[Option<In>],
    me: usize,
    any: bool,
) -> Vec<usize> {
    let mut v: Vec<usize> = Vec::new();
    for (op, d) in ops.iter().zip(done) {
        if *d {
            continue;
        }
        match op {
            P2pOp::Send { peer, .. } => v.push(*peer),
            P2pOp::Recv { peer: Some(p), .. } => v.push(*p),
            P2pOp::Recv { peer: None, .. } if any => v.extend((0..inc.len()).filter(|&p| p != me)),
            P2pOp::Recv { peer: None, .. } => {}
        }
    }
    v.extend((0..inc.len()).filter(|&p| inc[p].is_some()));
    v.sort_unstable();
    v.dedup();
    v
}

/// The point-to-point call a message's header says it belongs to; why not, for a header that
/// starts a collective (begun while this rank waits for messages) or names no known call.
pub(crate) fn message_call(h: &Header) -> std::result::Result<P2pCall, String> {
    if !h.fp.is_p2p() {
        return Err(format!(
            "expected a point-to-point message, got the start of {} (a collective begun while this rank waits for messages)",
            h.fp
        ));
    }
    h.fp.p2p_call()
        .ok_or_else(|| format!("a message of an unknown call (code {})", h.fp.root))
}
