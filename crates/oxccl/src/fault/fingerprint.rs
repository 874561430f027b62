//! Call fingerprints: every rank checks that its peers make the same call before it combines
//! any of their data.
//!
//! Before the first data byte of a call on each link, in each direction, the executor sends a
//! 16-byte [`Header`]: the call's [`Fingerprint`] (collective, element type, count, op,
//! root) and its matching sequence number. The receiver reads the header before the first
//! data byte of that peer in the call and compares it with its own call: any difference is
//! an [`Error::Mismatch`] naming both ranks and both calls, found
//! before a byte of the peer's data is stored or reduced. The header rides in the same
//! write as the first data (one `send` for small messages), and no reply is awaited.
//!
//! Sequence numbers: collectives count collectives on the communicator; point-to-point
//! messages count messages per ordered pair of ranks (so that ranks not involved in a send
//! do not fall out of step), and a send's fingerprint (`p2p`, element type, count) must equal
//! the matching receive's. A point-to-point message also says which call it belongs to
//! ([`P2pCall`], in the root field, unused by messages): the user's own sends, or one
//! collective made of sends and receives (gather, scatter, uneven all_to_all), whose
//! messages carry the collective's number instead of the pair's message number, so that no
//! receive of another call ever takes them.
//!
//! Layout (little-endian, 16 bytes so that small messages stay small): `0` `0xA0` | collective
//! code, `1` element type code | op code << 4, `2..4` root (low 16 bits), `4..8` matching
//! sequence number (low 32 bits), `8..16` count.

use std::fmt;

use crate::base::dtype::DataType;
use crate::base::error::Error;
use crate::base::op::ReduceOp;
use crate::sched::CollKind;
use crate::transport::{Link, LinkError};

/// Bytes of a [`Header`] on the wire.
pub const HEADER_BYTES: usize = 16;
const P2P: u8 = 15;

/// Which call a point-to-point message belongs to (its header's root field): the user's own
/// sends and receives ([`Communicator::group_p2p`](crate::Communicator::group_p2p)), or a
/// collective made of them ([`Communicator::group_p2p_as`](crate::Communicator::group_p2p_as)).
/// A receive takes only messages of its own call: a user receive never takes a gather's
/// message, and a gather's receive takes only the messages of that gather (same number on
/// the communicator's count of collectives).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum P2pCall {
    /// The user's own point-to-point messages: matched by source and tag, in send order.
    #[default]
    User,
    /// A gather: every rank sends its block to the root.
    Gather,
    /// A scatter: the root sends every rank its block.
    Scatter,
    /// An all_to_all with blocks of different sizes: every rank sends to every rank.
    AllToAllV,
}

impl P2pCall {
    /// Every call, in code order.
    pub const ALL: [P2pCall; 4] = [
        P2pCall::User,
        P2pCall::Gather,
        P2pCall::Scatter,
        P2pCall::AllToAllV,
    ];

    /// The wire code (the root field of a message's header).
    pub fn code(self) -> u32 {
        match self {
            P2pCall::User => 0,
            P2pCall::Gather => 1,
            P2pCall::Scatter => 2,
            P2pCall::AllToAllV => 3,
        }
    }

    /// The call of a wire code.
    pub fn from_code(c: u32) -> Option<Self> {
        P2pCall::ALL.get(c as usize).copied()
    }

    /// Its name in errors: also the name of the call ([`Error`]'s `call`).
    pub fn name(self) -> &'static str {
        match self {
            P2pCall::User => "group_p2p",
            P2pCall::Gather => "gather",
            P2pCall::Scatter => "scatter",
            P2pCall::AllToAllV => "all_to_allv",
        }
    }

    /// True for the collectives: their messages carry the collective's number.
    pub fn is_collective(self) -> bool {
        self != P2pCall::User
    }
}

/// What every rank of a call must agree on. Fields that do not matter for a collective are
/// zero (the op of a broadcast, the root of an all_reduce, ...).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub struct Fingerprint {
    /// Collective code (see [`kind_code`]), 15 for point-to-point.
    pub kind: u8,
    /// Index of the element type in [`DataType::ALL`].
    pub dtype: u8,
    /// The op's [`ReduceOp::code`] (0 where the call does not reduce; a premul_sum's scalar
    /// is not part of it: ranks may pass different ones).
    pub op: u8,
    /// Elements, as the algorithms count them.
    pub count: u64,
    /// Root (broadcast, reduce), else 0.
    pub root: u32,
}

/// The wire code of a collective.
pub fn kind_code(kind: CollKind) -> u8 {
    match kind {
        CollKind::AllReduce => 1,
        CollKind::Broadcast => 2,
        CollKind::Reduce => 3,
        CollKind::AllGather => 4,
        CollKind::ReduceScatter => 5,
        CollKind::AllToAll => 6,
        CollKind::Barrier => 7,
        // Messages, each with its own header (`exec::messages`).
        CollKind::SendRecv { .. }
        | CollKind::Send { .. }
        | CollKind::Recv { .. }
        | CollKind::Gather
        | CollKind::Scatter
        | CollKind::AllToAllV => P2P,
    }
}

fn kind_name(code: u8) -> &'static str {
    match code {
        1 => "all_reduce",
        2 => "broadcast",
        3 => "reduce",
        4 => "all_gather",
        5 => "reduce_scatter",
        6 => "all_to_all",
        7 => "barrier",
        P2P => "send/recv",
        _ => "unknown",
    }
}

fn dtype_code(d: DataType) -> u8 {
    DataType::ALL.iter().position(|&x| x == d).unwrap_or(0) as u8
}

fn op_code(o: ReduceOp) -> u8 {
    o.code()
}

impl Fingerprint {
    /// The fingerprint of a call, normalized so that arguments a collective ignores do not
    /// count.
    pub fn of(kind: CollKind, dtype: DataType, op: ReduceOp, count: usize, root: usize) -> Self {
        let (reduces, rooted) = match kind {
            CollKind::AllReduce | CollKind::ReduceScatter => (true, false),
            CollKind::Reduce => (true, true),
            CollKind::Broadcast => (false, true),
            _ => (false, false),
        };
        let barrier = kind == CollKind::Barrier;
        Fingerprint {
            kind: kind_code(kind),
            dtype: if barrier { 0 } else { dtype_code(dtype) },
            op: if reduces { op_code(op) } else { 0 },
            count: if barrier { 0 } else { count as u64 },
            root: if rooted { root as u32 } else { 0 },
        }
    }

    /// True for point-to-point messages.
    pub fn is_p2p(&self) -> bool {
        self.kind == P2P
    }

    /// A point-to-point message of `count` elements of `dtype`, of `call`; `tagged`: an
    /// 8-byte tag follows the header (`exec::p2p`), marked in the op field (unused by
    /// messages).
    pub fn p2p(dtype: DataType, count: usize, tagged: bool, call: P2pCall) -> Self {
        Fingerprint {
            kind: P2P,
            dtype: dtype_code(dtype),
            op: tagged as u8,
            count: count as u64,
            root: call.code(),
        }
    }

    /// The call a point-to-point message belongs to (`None`: not a message, or an unknown
    /// code).
    pub fn p2p_call(&self) -> Option<P2pCall> {
        if self.is_p2p() {
            P2pCall::from_code(self.root)
        } else {
            None
        }
    }

    /// A message's element type.
    pub fn data_type(&self) -> Option<DataType> {
        DataType::ALL.get(self.dtype as usize).copied()
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = kind_name(self.kind);
        if self.kind == 7 {
            return f.write_str(name);
        }
        let dt = DataType::ALL
            .get(self.dtype as usize)
            .map_or("?", |d| d.name());
        if self.kind == P2P && self.root != 0 {
            let call = P2pCall::from_code(self.root).map_or("?", |c| c.name());
            return write!(f, "a message of {call}({} x {dt})", self.count);
        }
        write!(f, "{name}({} x {dt}", self.count)?;
        if matches!(self.kind, 1 | 3 | 5) {
            let op = ReduceOp::from_code(self.op).map_or("?", |o| o.name());
            write!(f, ", {op}")?;
        }
        if matches!(self.kind, 2 | 3) {
            write!(f, ", root {}", self.root)?;
        }
        f.write_str(")")
    }
}

/// One direction's header: fingerprint and matching sequence number.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub struct Header {
    /// The call (its root as the low 16 bits).
    pub fp: Fingerprint,
    /// Collective number (collectives) or message number on this ordered pair (p2p), as
    /// the low 32 bits.
    pub mseq: u64,
}

/// The high nibble of byte 0 of every header.
const TAG: u8 = 0xA0;

impl Header {
    /// The wire form.
    #[inline]
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0] = TAG | (self.fp.kind & 0x0f);
        b[1] = (self.fp.dtype & 0x0f) | (self.fp.op << 4);
        b[2..4].copy_from_slice(&(self.fp.root as u16).to_le_bytes());
        b[4..8].copy_from_slice(&(self.mseq as u32).to_le_bytes());
        b[8..16].copy_from_slice(&self.fp.count.to_le_bytes());
        b
    }

    /// Reads a header; anything that is not one (a stream out of step) is an error that
    /// shows the bytes.
    pub fn decode(b: &[u8]) -> Result<Header, String> {
        if b.len() != HEADER_BYTES {
            return Err(format!(
                "a call header has {HEADER_BYTES} bytes, got {}",
                b.len()
            ));
        }
        let (kind, dtype, op) = (b[0] & 0x0f, b[1] & 0x0f, b[1] >> 4);
        let known = (1..=7).contains(&kind) || kind == P2P;
        if b[0] & 0xf0 != TAG
            || !known
            || dtype as usize >= DataType::ALL.len()
            || ReduceOp::from_code(op).is_none()
        {
            let shown: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
            return Err(format!(
                "expected a call header, got bytes {} (the streams are out of step: did an earlier call differ in length?)",
                shown.join(" ")
            ));
        }
        Ok(Header {
            fp: Fingerprint {
                kind,
                dtype,
                op,
                count: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
                root: u16::from_le_bytes([b[2], b[3]]) as u32,
            },
            mseq: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")) as u64,
        })
    }
}

/// A call as the executor checks it: this rank's fingerprint and the sequence numbers of
/// what it sends and expects.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CallPrint {
    /// The call.
    pub fp: Fingerprint,
    /// The sequence number of what this rank sends.
    pub send_seq: u64,
    /// The sequence number this rank expects from its peers.
    pub recv_seq: u64,
    /// This rank's call number.
    pub call_seq: u64,
}

impl CallPrint {
    /// The header this rank sends.
    #[inline]
    pub fn header(&self) -> [u8; HEADER_BYTES] {
        Header {
            fp: self.fp,
            mseq: self.send_seq,
        }
        .encode()
    }

    /// True when `b` is a header of this call (on the bytes: no decoding on the common
    /// path).
    #[inline]
    pub fn matches(&self, b: &[u8; HEADER_BYTES]) -> bool {
        *b == Header {
            fp: self.fp,
            mseq: self.recv_seq,
        }
        .encode()
    }

    /// Compares a peer's header with this call: `Err((mine, theirs))` describing both when
    /// they differ.
    pub fn check(&self, theirs: &Header) -> Result<(), (String, String)> {
        let mine = Fingerprint {
            root: self.fp.root & 0xffff,
            ..self.fp
        };
        if theirs.fp == mine && theirs.mseq == self.recv_seq & 0xffff_ffff {
            return Ok(());
        }
        let what = if self.fp.is_p2p() && !self.fp.p2p_call().is_some_and(|c| c.is_collective()) {
            "message"
        } else {
            "collective"
        };
        Err((
            format!(
                "{} as its {what} #{} (call #{})",
                self.fp, self.recv_seq, self.call_seq
            ),
            format!("{} as its {what} #{}", theirs.fp, theirs.mseq),
        ))
    }
}

/// Which peers a call has sent its header to and received theirs from: bits on the stack
/// for up to 128 ranks, else a vector (the executor asks once per transfer of each step).
#[derive(Debug)]
pub enum HeaderFlags {
    /// Headers are not exchanged.
    Off,
    /// Up to 128 ranks.
    Small {
        /// Bit p: header sent to p.
        sent: u128,
        /// Bit p: header from p taken.
        received: u128,
    },
    /// More ranks: per peer, bit 0 sent, bit 1 received.
    Large(Vec<u8>),
}

impl HeaderFlags {
    /// Flags for a call over `nranks` ranks (`on`: the call exchanges headers).
    pub fn new(on: bool, nranks: usize) -> Self {
        match (on, nranks) {
            (false, _) => HeaderFlags::Off,
            (true, 0..=128) => HeaderFlags::Small {
                sent: 0,
                received: 0,
            },
            (true, n) => HeaderFlags::Large(vec![0; n]),
        }
    }

    /// True the first time it is asked for (`peer`, direction) in this call.
    pub fn first(&mut self, peer: usize, send: bool) -> bool {
        match self {
            HeaderFlags::Off => false,
            HeaderFlags::Small { sent, received } => {
                let f = if send { sent } else { received };
                let bit = 1u128 << (peer & 127);
                let first = *f & bit == 0;
                *f |= bit;
                first
            }
            HeaderFlags::Large(v) => {
                let bit = if send { 1 } else { 2 };
                match v.get_mut(peer) {
                    Some(h) if *h & bit == 0 => {
                        *h |= bit;
                        true
                    }
                    _ => false,
                }
            }
        }
    }

    /// The header state of a transfer with `peer`: the header to send (or to receive) when
    /// it is the call's first in that direction, else nothing.
    pub fn start(&mut self, print: &CallPrint, peer: usize, send: bool) -> HeaderState {
        if !self.first(peer, send) {
            return HeaderState::default();
        }
        HeaderState {
            left: HEADER_BYTES,
            buf: if send {
                print.header()
            } else {
                [0; HEADER_BYTES]
            },
        }
    }
}

/// Largest data prefix sent in one write together with a header.
const WITH_HEADER: usize = 4096 - HEADER_BYTES;

/// A header in transit on one transfer: bytes still to send, or bytes received so far.
#[derive(Clone, Copy, Debug, Default)]
pub struct HeaderState {
    left: usize,
    buf: [u8; HEADER_BYTES],
}

/// What was wrong with a peer's header.
#[derive(Debug)]
pub enum HeaderFault {
    /// A header of another call: (this rank's call, the peer's).
    Mismatch(String, String),
    /// Not a header at all.
    Garbled(String),
}

impl HeaderFault {
    /// The error of this rank (`rank`, in `call` number `seq`) about `peer`'s header.
    pub fn error(self, rank: usize, peer: usize, call: &'static str, seq: u64) -> Error {
        match self {
            HeaderFault::Mismatch(mine, theirs) => Error::Mismatch {
                rank,
                peer,
                seq,
                mine,
                theirs,
            },
            HeaderFault::Garbled(msg) => Error::Protocol {
                rank,
                peer,
                call,
                seq,
                msg,
            },
        }
    }
}

impl HeaderState {
    /// A header to send: `bytes`, before the data.
    pub fn sending(bytes: [u8; HEADER_BYTES]) -> Self {
        HeaderState {
            left: HEADER_BYTES,
            buf: bytes,
        }
    }

    /// A header to receive before the data, read and checked by the caller (a message's,
    /// `exec::messages`); pending until [`HeaderState::done`].
    pub fn awaited() -> Self {
        HeaderState {
            left: HEADER_BYTES,
            buf: [0; HEADER_BYTES],
        }
    }

    /// Marks the header as taken.
    pub fn done(&mut self) {
        self.left = 0;
    }

    /// True while header bytes remain to be sent or received.
    #[inline]
    pub fn pending(&self) -> bool {
        self.left > 0
    }

    /// Sends the rest of the header and a first piece of `data` in one write. Returns the
    /// data bytes sent and whether anything moved.
    pub fn send_with(
        &mut self,
        link: &mut dyn Link,
        data: &[u8],
    ) -> Result<(usize, bool), LinkError> {
        let mut buf = std::mem::MaybeUninit::<[u8; HEADER_BYTES + WITH_HEADER]>::uninit();
        let h = &self.buf[HEADER_BYTES - self.left..];
        let d = &data[..data.len().min(WITH_HEADER)];
        let b = buf.as_mut_ptr() as *mut u8;
        // SAFETY: `h.len() + d.len() <= HEADER_BYTES + WITH_HEADER`; both sources are
        // initialized and do not overlap the stack buffer; only the written prefix is read
        // (not zeroing 4 KiB keeps small calls cheap).
        let both = unsafe {
            std::ptr::copy_nonoverlapping(h.as_ptr(), b, h.len());
            std::ptr::copy_nonoverlapping(d.as_ptr(), b.add(h.len()), d.len());
            std::slice::from_raw_parts(b, h.len() + d.len())
        };
        let k = link.try_send(both)?;
        let hk = k.min(self.left);
        self.left -= hk;
        Ok((k - hk, k > 0))
    }

    /// Takes header bytes from the front of `data` (returns how many); once the header is
    /// complete, checks it against `print` and sets `fault` if it differs.
    pub fn take(
        &mut self,
        data: &[u8],
        print: Option<&CallPrint>,
        fault: &mut Option<HeaderFault>,
    ) -> usize {
        if self.left == 0 {
            return 0;
        }
        let k = self.left.min(data.len());
        let at = HEADER_BYTES - self.left;
        self.buf[at..at + k].copy_from_slice(&data[..k]);
        self.left -= k;
        if self.left == 0 {
            if let Some(p) = print.filter(|p| !p.matches(&self.buf)) {
                *fault = match Header::decode(&self.buf) {
                    Ok(h) => p.check(&h).err().map(|(m, t)| HeaderFault::Mismatch(m, t)),
                    Err(m) => Some(HeaderFault::Garbled(m)),
                };
            }
        }
        k
    }
}

/// Per-communicator sequence counters.
#[derive(Debug, Default)]
pub struct Sequencer {
    colls: u64,
    sent: Vec<u64>,
    received: Vec<u64>,
}

impl Sequencer {
    /// Counters for `nranks` ranks.
    pub fn new(nranks: usize) -> Self {
        Sequencer {
            colls: 0,
            sent: vec![0; nranks],
            received: vec![0; nranks],
        }
    }

    /// The next call's [`CallPrint`] (advancing the counters it uses).
    pub fn next(
        &mut self,
        rank: usize,
        call_seq: u64,
        kind: CollKind,
        fp: Fingerprint,
    ) -> CallPrint {
        let (send_seq, recv_seq) = match kind {
            CollKind::Send { peer } => (bump(&mut self.sent, peer), 0),
            CollKind::Recv { peer } => (0, bump(&mut self.received, peer)),
            CollKind::SendRecv { to, from } if to == rank && from == rank => (0, 0),
            CollKind::SendRecv { to, from } => {
                (bump(&mut self.sent, to), bump(&mut self.received, from))
            }
            _ => {
                self.colls += 1;
                (self.colls, self.colls)
            }
        };
        CallPrint {
            fp,
            send_seq,
            recv_seq,
            call_seq,
        }
    }
}

impl Sequencer {
    /// The number of the next collective (advancing the count), for a collective that is
    /// made of point-to-point messages ([`P2pCall`]).
    pub fn next_coll(&mut self) -> u64 {
        self.colls += 1;
        self.colls
    }

    /// The number of the last collective begun.
    pub fn colls(&self) -> u64 {
        self.colls
    }

    /// The sequence number of the next message sent to `peer`.
    pub fn next_send(&mut self, peer: usize) -> u64 {
        bump(&mut self.sent, peer)
    }

    /// The sequence number expected of the next message read from `peer`.
    pub fn next_recv(&mut self, peer: usize) -> u64 {
        bump(&mut self.received, peer)
    }
}

fn bump(v: &mut [u64], i: usize) -> u64 {
    match v.get_mut(i) {
        Some(x) => {
            *x += 1;
            *x
        }
        None => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_display() {
        let fp = Fingerprint::of(CollKind::Reduce, DataType::F32, ReduceOp::Max, 1024, 3);
        let h = Header { fp, mseq: 77 };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        assert_eq!(fp.to_string(), "reduce(1024 x float, max, root 3)");
        let b = Fingerprint::of(CollKind::Broadcast, DataType::U8, ReduceOp::Max, 8, 1);
        assert_eq!(b.op, 0, "broadcast ignores the op");
        assert!(Header::decode(&[0u8; HEADER_BYTES]).is_err());
        assert!(Header::decode(&[0u8; 3]).is_err());
    }

    #[test]
    fn matches_agrees_with_decode_and_check() {
        let fp = Fingerprint::of(CollKind::Broadcast, DataType::F64, ReduceOp::Sum, 99, 2);
        let p = CallPrint {
            fp,
            send_seq: 5,
            recv_seq: 5,
            call_seq: 9,
        };
        let h = p.header();
        assert!(p.matches(&h));
        for i in 0..HEADER_BYTES {
            for bit in 0..8 {
                let mut g = h;
                g[i] ^= 1 << bit;
                let by_decode = Header::decode(&g).is_ok_and(|d| p.check(&d).is_ok());
                assert_eq!(p.matches(&g), by_decode, "byte {i} bit {bit}");
                assert!(!p.matches(&g));
            }
        }
    }

    #[test]
    fn p2p_messages_name_their_call() {
        for call in P2pCall::ALL {
            assert_eq!(P2pCall::from_code(call.code()), Some(call));
            let fp = Fingerprint::p2p(DataType::F32, 3, false, call);
            let h = Header { fp, mseq: 9 };
            let back = Header::decode(&h.encode()).unwrap();
            assert_eq!(back.fp.p2p_call(), Some(call));
            assert_eq!(back, h);
        }
        assert_eq!(P2pCall::from_code(4), None);
        let user = Fingerprint::p2p(DataType::F32, 3, true, P2pCall::User);
        assert_eq!(user.to_string(), "send/recv(3 x float)");
        assert_eq!(
            Fingerprint::of(
                CollKind::Send { peer: 1 },
                DataType::F32,
                ReduceOp::Sum,
                3,
                0
            ),
            Fingerprint { op: 0, ..user },
            "the executor's sends are the user's messages"
        );
        let g = Fingerprint::p2p(DataType::F32, 3, false, P2pCall::Gather);
        assert_eq!(g.to_string(), "a message of gather(3 x float)");
        assert_ne!(
            g,
            Fingerprint::p2p(DataType::F32, 3, false, P2pCall::Scatter)
        );
        let fp = Fingerprint::of(CollKind::AllReduce, DataType::F32, ReduceOp::Sum, 3, 0);
        assert_eq!(fp.p2p_call(), None);
        // One count for every collective, whichever way it runs.
        let mut s = Sequencer::new(2);
        assert_eq!(s.next(0, 1, CollKind::AllReduce, fp).send_seq, 1);
        assert_eq!(s.next_coll(), 2);
        assert_eq!(s.colls(), 2);
        assert_eq!(s.next(0, 3, CollKind::AllReduce, fp).send_seq, 3);
    }

    #[test]
    fn p2p_counts_per_pair() {
        let mut s = Sequencer::new(3);
        let fp = Fingerprint::of(
            CollKind::Send { peer: 1 },
            DataType::U8,
            ReduceOp::Sum,
            4,
            0,
        );
        assert_eq!(s.next(0, 1, CollKind::Send { peer: 1 }, fp).send_seq, 1);
        assert_eq!(s.next(0, 2, CollKind::Send { peer: 2 }, fp).send_seq, 1);
        let c = s.next(0, 3, CollKind::AllReduce, fp);
        assert_eq!((c.send_seq, c.recv_seq), (1, 1));
        let r = s.next(0, 4, CollKind::SendRecv { to: 1, from: 2 }, fp);
        assert_eq!((r.send_seq, r.recv_seq), (2, 1));
    }
}
