//! Single-copy transfers over a shared-memory link: instead of copying a large message into
//! the ring (and the receiver copying it out again, two passes over the bytes), the sender
//! *lends* it: it writes a small descriptor (where the message lies in its memory, and its
//! length) into the ring, and the receiver copies or reduces the message straight out of the
//! sender's memory with `process_vm_readv` (cross-memory attach), chunk by chunk, then
//! consumes the descriptor. The sender's transfer completes when the ring's `tail` passes the
//! descriptor: from then on nobody reads its memory. One pass over the bytes, by the receiver;
//! the sender copies nothing.
//!
//! A transfer goes this way when it is at least [`LEND_MIN`] bytes and the receiver may read
//! the sender's memory (the kernel's ptrace rules, `OXCCL_CMA`): both ends of a link learn
//! that alike at connection time ([`Probe`]), so both decide alike for every transfer.

use crate::base::cross_memory::read_remote;
use crate::base::error::Result;
use crate::transport::LinkError;

/// Smallest transfer lent instead of copied through the ring. Both ends of a link must use
/// the same value: it is a constant, not a setting.
pub(crate) const LEND_MIN: usize = 256 << 10;

/// Bytes of a descriptor in the ring: magic, address, length.
pub(crate) const DESC_BYTES: usize = 24;

/// The descriptor's first word ("oxlend" and a version).
const MAGIC: u64 = u64::from_le_bytes(*b"oxlend\x00\x01");

/// The descriptor of a lent message at `addr` of `len` bytes.
pub(crate) fn descriptor(addr: u64, len: u64) -> [u8; DESC_BYTES] {
    let mut d = [0u8; DESC_BYTES];
    d[..8].copy_from_slice(&MAGIC.to_le_bytes());
    d[8..16].copy_from_slice(&addr.to_le_bytes());
    d[16..].copy_from_slice(&len.to_le_bytes());
    d
}

/// The address and length a descriptor names, or a protocol error.
pub(crate) fn parse(d: &[u8; DESC_BYTES], want: usize) -> Result<(u64, u64), LinkError> {
    let word = |i: usize| u64::from_le_bytes(d[8 * i..8 * i + 8].try_into().expect("8 bytes"));
    let (addr, len) = (word(1), word(2));
    if word(0) != MAGIC || len != want as u64 {
        return Err(LinkError::Protocol(format!(
            "expected the descriptor of a lent message of {want} bytes, got {d:02x?}"
        )));
    }
    Ok((addr, len))
}

/// This rank's side of the agreement on which shared-memory peers may lend to this rank and
/// borrow from it, carried by the two exchanges that set up the segments (no exchange of its
/// own): the first carries [`Probe::addr`], the address of a value peers try to read; between
/// the two, [`Probe::check`] reads each peer's, and each rank records what it could read of a
/// peer in the control page of the ring that peer writes in its segment; after the second
/// (which carries nothing of it), each rank reads its peers' verdicts about it there, and
/// [`verdicts`] turns both into each link's `(may borrow, may lend)`. The probe must live
/// until the second exchange has returned (every peer has read it by then).
pub(crate) struct Probe {
    /// The value at the published address (alike on every rank: derived from the tag).
    value: u64,
    /// `None` when lending is off (`OXCCL_CMA=0`, alike on every rank): address 0.
    cell: Option<Box<std::sync::atomic::AtomicU64>>,
}

impl Probe {
    /// A probe for the communicator of `tag`; `allow` must be alike on every rank.
    pub(crate) fn new(tag: u64, allow: bool) -> Probe {
        let value = 0x6c65_6e64_u64 ^ tag;
        Probe {
            value,
            cell: allow.then(|| Box::new(std::sync::atomic::AtomicU64::new(value))),
        }
    }

    /// The address peers read (0: lending is off).
    pub(crate) fn addr(&self) -> u64 {
        self.cell.as_ref().map_or(0, |c| c.as_ptr() as u64)
    }

    /// Which ranks' memory this rank may read: one byte per rank of a world of `world`
    /// (1: readable), for `peers` (`(rank, pid)`) given every rank's [`Probe::addr`] in
    /// `addrs` (missing or 0: not readable).
    pub(crate) fn check(&self, world: usize, peers: &[(usize, u32)], addrs: &[u64]) -> Vec<u8> {
        let mut readable = vec![0u8; world];
        if self.cell.is_none() {
            return readable;
        }
        for &(p, pid) in peers {
            let addr = addrs.get(p).copied().unwrap_or(0);
            let mut v = [0u8; 8];
            if p < world
                && addr != 0
                && read_remote(pid, addr, &mut v).is_ok()
                && u64::from_ne_bytes(v) == self.value
            {
                readable[p] = 1;
            }
        }
        readable
    }
}

/// For each of `peers`: `(this rank may read the peer's memory, the peer may read this
/// rank's)`, from this rank's [`Probe::check`] (`mine`, by rank) and each peer's verdict
/// about this rank (`theirs`, in the order of `peers`: what the peer recorded in the control
/// page of the ring this rank writes, `Segment::set_verdict`).
pub(crate) fn verdicts(peers: &[(usize, u32)], mine: &[u8], theirs: &[bool]) -> Vec<(bool, bool)> {
    peers
        .iter()
        .zip(theirs)
        .map(|(&(p, _), &theirs)| (mine.get(p) == Some(&1), theirs))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_reads_peers_and_verdicts_pair_both_directions() {
        let me = std::process::id();
        let a = Probe::new(7, true);
        let b = Probe::new(7, true);
        assert_ne!(a.addr(), 0);
        // Rank 0 (a) reads rank 1's probe (b) in this very process: readable; rank 2 has no
        // address; rank 3 published the address of a value of another communicator.
        let other = Probe::new(8, true);
        let addrs = [a.addr(), b.addr(), 0, other.addr()];
        let peers = [(1, me), (2, me), (3, me)];
        let mine = a.check(4, &peers, &addrs);
        assert_eq!(mine, vec![0, 1, 0, 0]);
        // Rank 1 could read rank 0, rank 2 could not, rank 3 could.
        assert_eq!(
            verdicts(&peers, &mine, &[true, false, true]),
            vec![(true, true), (false, false), (false, true)]
        );
    }

    #[test]
    fn a_probe_that_is_off_publishes_nothing_and_reads_nothing() {
        let on = Probe::new(7, true);
        let off = Probe::new(7, false);
        assert_eq!(off.addr(), 0);
        let me = std::process::id();
        assert_eq!(off.check(2, &[(1, me)], &[0, on.addr()]), vec![0, 0]);
    }
}
