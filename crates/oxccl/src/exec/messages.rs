//! Collectives made of messages in the executor: gather, scatter and all_to_allv
//! ([`crate::sched::blocks`]) run their schedules here like every collective, but each
//! transfer is one message, framed as the point-to-point engine frames one ([`super::p2p`]):
//! its own header (a message of this call, its element type and count, the collective's
//! number on the communicator's count of collectives) before its data. So their messages are
//! told apart from the user's on the same links, whatever the order they arrive in:
//!
//! - a receive of this call that reads a user message first keeps it in the communicator's
//!   stash, for a later user receive, and reads on;
//! - a message of this call that an earlier user receive from any source kept in the stash
//!   (the peer was ahead) is taken from there;
//! - a message of any other collective, or one of this call that differs from what this rank
//!   receives, is an [`Error::Mismatch`] naming both calls and both numbers, found before any
//!   of its bytes are used.
//!
//! Transfers are copied through the links (never lent: a user receive of the peer may read
//! the message).

use super::{Runner, XState};
use crate::base::dtype::DataType;
use crate::base::error::{Error, Result};
use crate::exec::p2p::{message_call, tagged, Stash, TAG_BYTES};
use crate::fault::fingerprint::{
    Fingerprint, Header, HeaderState, P2pCall, Sequencer, HEADER_BYTES,
};
use crate::sched::{Step, Xfer};

/// What a collective made of messages needs of the communicator.
pub(crate) struct Messages<'a> {
    /// Which collective (never [`P2pCall::User`]).
    pub call: P2pCall,
    /// Its number on the communicator's count of collectives.
    pub coll_seq: u64,
    /// The numbers of user messages (a user message read here is numbered as the point-to-point
    /// engine numbers it).
    pub seqr: &'a mut Sequencer,
    /// Messages no receive has asked for yet.
    pub stash: &'a mut Stash,
    /// The most bytes the stash may hold ([`crate::Config::p2p_stash_bytes`]).
    pub stash_limit: usize,
}

/// A receive reading what comes before its own message: a header, or a user message.
#[derive(Default)]
pub(super) enum Before {
    /// Nothing read yet.
    #[default]
    Nothing,
    /// A header, and its tag if it announces one.
    Header {
        buf: [u8; HEADER_BYTES + TAG_BYTES],
        got: usize,
    },
    /// A user message, read into the stash.
    User {
        fp: Fingerprint,
        mseq: u64,
        tag: u32,
        data: Vec<u8>,
        got: usize,
    },
}

impl Messages<'_> {
    /// The header of this call's message of `len` bytes of `dtype` (an empty one is of no
    /// element type: 0 x uint8, as the word that a rank has begun).
    pub(super) fn header(&self, dtype: DataType, len: usize) -> Header {
        let (dt, count) = if len == 0 {
            (DataType::U8, 0)
        } else {
            (dtype, len / dtype.size())
        };
        Header {
            fp: Fingerprint::p2p(dt, count, false, self.call),
            mseq: self.coll_seq,
        }
    }
}

impl Runner<'_, '_, '_> {
    fn protocol(&self, peer: usize, msg: String) -> Error {
        Error::Protocol {
            rank: self.ctx.rank,
            peer,
            call: self.ctx.call,
            seq: self.ctx.seq,
            msg,
        }
    }

    /// The error for a message from `peer` (`fp`, numbered `mseq`) of another collective, or
    /// of another number, where this call expects its own.
    fn foreign(&self, m: &Messages<'_>, peer: usize, fp: &Fingerprint, mseq: u64) -> Error {
        let theirs = match fp.p2p_call() {
            Some(c) if c.is_collective() => format!("{fp} as its collective #{mseq}"),
            _ => format!("{fp} as its message #{mseq} (a point-to-point send)"),
        };
        Error::Mismatch {
            rank: self.ctx.rank,
            peer,
            seq: self.ctx.seq,
            mine: format!(
                "{} (its collective #{}, call #{})",
                m.call.name(),
                m.coll_seq,
                self.ctx.seq
            ),
            theirs,
        }
    }

    /// This call's message from `peer` (`fp`) where a receive of `len` bytes waits: it must
    /// have the receive's element type and count.
    fn check_message(
        &self,
        m: &Messages<'_>,
        peer: usize,
        fp: &Fingerprint,
        mseq: u64,
        len: usize,
    ) -> Result<()> {
        let want = m.header(self.ctx.dtype, len).fp;
        if fp.data_type() == want.data_type() && fp.count == want.count {
            return Ok(());
        }
        let dt = want.data_type().unwrap_or(DataType::U8);
        Err(Error::Mismatch {
            rank: self.ctx.rank,
            peer,
            seq: self.ctx.seq,
            mine: format!(
                "{}, receiving {} x {dt} from rank {peer} (its collective #{}, call #{})",
                m.call.name(),
                want.count,
                m.coll_seq,
                self.ctx.seq
            ),
            theirs: format!("{fp} as its collective #{mseq}"),
        })
    }

    /// At the call's start: a message of another collective this rank has begun, kept by an
    /// earlier receive, can never be taken.
    pub(super) fn messages_begin(&mut self) -> Result<()> {
        let Some(m) = self.ctx.messages.as_ref() else {
            return Ok(());
        };
        if let Some((peer, fp, mseq)) = m.stash.past_collective(m.call, m.coll_seq) {
            return Err(self.foreign(m, peer, &fp, mseq));
        }
        Ok(())
    }

    /// At a step's start: each transfer's header; receives that a message kept in the stash
    /// satisfies are done at once.
    pub(super) fn messages_step(&mut self, step: &Step, st: &mut [XState]) -> Result<()> {
        if self.ctx.messages.is_none() {
            return Ok(());
        }
        self.before = (0..step.xfers.len()).map(|_| Before::Nothing).collect();
        for (x, s) in step.xfers.iter().zip(st.iter_mut()) {
            let m = self.ctx.messages.as_ref().expect("checked above");
            match *x {
                Xfer::Send { src, .. } => {
                    s.hdr = HeaderState::sending(m.header(self.ctx.dtype, src.len).encode());
                }
                Xfer::Recv { peer, dst, .. } => {
                    if m.stash.is_held(peer) {
                        return Err(self.protocol(
                            peer,
                            "expected a point-to-point message, the peer is in a collective".into(),
                        ));
                    }
                    s.hdr = HeaderState::awaited();
                    let Some(kept) = self.ctx.messages.as_mut().and_then(|m| {
                        let (call, n) = (m.call, m.coll_seq);
                        m.stash.take_collective(peer, call, n)
                    }) else {
                        continue;
                    };
                    let (fp, mseq, data) = kept;
                    let m = self.ctx.messages.as_ref().expect("checked above");
                    self.check_message(m, peer, &fp, mseq, dst.len)?;
                    let d = self.mem.ptr(dst).map_err(|e| self.internal(e))?;
                    // SAFETY: `dst` is in bounds (checked by `ptr`) and `data` has its length
                    // (checked just above); nothing else touches it before the step runs.
                    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), d, dst.len) };
                    s.done = dst.len;
                    s.hdr.done();
                }
            }
        }
        Ok(())
    }

    /// One pass over what arrives from the peer of receive `i` (`x`) before its own message:
    /// headers, user messages (into the stash), until this call's header is taken and
    /// checked. Returns whether bytes moved.
    pub(super) fn message_header(&mut self, i: usize, x: &Xfer, s: &mut XState) -> Result<bool> {
        let (peer, len) = (x.peer(), x.len());
        let (rank, call, seq) = (self.ctx.rank, self.ctx.call, self.ctx.seq);
        let err = |e: crate::transport::LinkError| e.into_error(rank, peer, call, seq);
        let mut moved = false;
        loop {
            let Some(link) = self.ctx.links.get_mut(peer).and_then(|l| l.as_mut()) else {
                return Err(self.internal(format!("no link to rank {peer}")));
            };
            let state = &mut self.before[i];
            if matches!(state, Before::Nothing) {
                *state = Before::Header {
                    buf: [0; HEADER_BYTES + TAG_BYTES],
                    got: 0,
                };
            }
            match state {
                Before::Nothing => unreachable!("set above"),
                Before::Header { buf, got } => {
                    let need = if *got >= HEADER_BYTES && tagged(buf) {
                        HEADER_BYTES + TAG_BYTES
                    } else {
                        HEADER_BYTES
                    };
                    let k = link.try_recv_into(&mut buf[*got..need]).map_err(err)?;
                    *got += k;
                    moved |= k > 0;
                    if *got < need {
                        return Ok(moved);
                    }
                    if *got == HEADER_BYTES && tagged(buf) {
                        continue; // the tag follows
                    }
                    let (buf, got) = (*buf, *got);
                    let h =
                        Header::decode(&buf[..HEADER_BYTES]).map_err(|e| self.protocol(peer, e))?;
                    let mcall = message_call(&h).map_err(|e| self.protocol(peer, e))?;
                    let m = self.ctx.messages.as_mut().expect("message mode");
                    if mcall == P2pCall::User {
                        // A user message sent before this call's: kept for a user receive.
                        let want = m.seqr.next_recv(peer);
                        let tag = if got > HEADER_BYTES {
                            u32::from_le_bytes(
                                buf[HEADER_BYTES..HEADER_BYTES + 4]
                                    .try_into()
                                    .expect("4 bytes"),
                            )
                        } else {
                            0
                        };
                        let dt = h.fp.data_type();
                        let bytes =
                            dt.map_or(0, |d| (h.fp.count as usize).saturating_mul(d.size()));
                        let over = m.stash.bytes() + bytes > m.stash_limit;
                        let limit = m.stash_limit;
                        let stashed = m.stash.bytes();
                        if h.mseq != want & 0xffff_ffff {
                            return Err(self.protocol(
                                peer,
                                format!(
                                    "message #{} arrived where #{want} was expected (the streams are out of step)",
                                    h.mseq
                                ),
                            ));
                        }
                        if dt.is_none() {
                            return Err(
                                self.protocol(peer, format!("bad element type in {}", h.fp))
                            );
                        }
                        if over {
                            return Err(self.protocol(
                                peer,
                                format!(
                                    "an unexpected message ({}, tag {tag}) would grow the stash of messages no receive has asked for to {} bytes, over the limit of {limit} (OXCCL_P2P_STASH_BYTES)",
                                    h.fp,
                                    stashed + bytes,
                                ),
                            ));
                        }
                        m.stash.reserve(bytes);
                        self.before[i] = Before::User {
                            fp: h.fp,
                            mseq: h.mseq,
                            tag,
                            data: vec![0; bytes],
                            got: 0,
                        };
                        continue;
                    }
                    if mcall != m.call || h.mseq as u32 != m.coll_seq as u32 {
                        let m = self.ctx.messages.as_ref().expect("message mode");
                        return Err(self.foreign(m, peer, &h.fp, h.mseq));
                    }
                    let m = self.ctx.messages.as_ref().expect("message mode");
                    self.check_message(m, peer, &h.fp, h.mseq, len)?;
                    s.hdr.done();
                    self.before[i] = Before::Nothing;
                    return Ok(true);
                }
                Before::User { data, got, .. } => {
                    if *got < data.len() {
                        let k = link.try_recv_into(&mut data[*got..]).map_err(err)?;
                        *got += k;
                        moved |= k > 0;
                    }
                    if *got < data.len() {
                        return Ok(moved);
                    }
                    let Before::User {
                        fp,
                        mseq,
                        tag,
                        data,
                        ..
                    } = std::mem::take(&mut self.before[i])
                    else {
                        unreachable!("matched above")
                    };
                    let m = self.ctx.messages.as_mut().expect("message mode");
                    m.stash.keep_user(peer, tag, fp, mseq, data);
                    moved = true;
                }
            }
        }
    }
}
