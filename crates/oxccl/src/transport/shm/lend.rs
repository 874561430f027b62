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
//! that alike at connection time ([`agree`]), so both decide alike for every transfer.

use crate::base::cross_memory::read_remote;
use crate::base::error::Result;
use crate::bootstrap::Exchange;
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

/// Which shared-memory peers may lend to this rank and borrow from it: for each of `peers`
/// (`(rank, pid)`), `(this rank may read the peer's memory, the peer may read this rank's)`.
/// Collective over `ex` (two exchanges) when `allow`; all false without exchanging otherwise
/// (`allow` must be alike on every rank).
pub(crate) fn agree(
    ex: &mut dyn Exchange,
    peers: &[(usize, u32)],
    tag: u64,
    allow: bool,
) -> Result<Vec<(bool, bool)>> {
    if !allow {
        return Ok(vec![(false, false); peers.len()]);
    }
    let (rank, world) = (ex.rank(), ex.world_size());
    // A value at an address peers try to read: it tells whether they may.
    let value = 0x6c65_6e64_u64 ^ tag;
    let probe = Box::new(std::sync::atomic::AtomicU64::new(value));
    let all = ex.allgather(&(probe.as_ptr() as u64).to_le_bytes())?;
    let mut readable = vec![0u8; world];
    for &(p, pid) in peers {
        let addr = all
            .get(p)
            .and_then(|m| m.get(..8))
            .map_or(0, |m| u64::from_le_bytes(m.try_into().expect("8 bytes")));
        let mut v = [0u8; 8];
        if addr != 0 && read_remote(pid, addr, &mut v).is_ok() && u64::from_ne_bytes(v) == value {
            readable[p] = 1;
        }
    }
    let all = ex.allgather(&readable)?;
    drop(probe);
    Ok(peers
        .iter()
        .map(|&(p, _)| {
            let theirs = all.get(p).and_then(|m| m.get(rank)) == Some(&1);
            (readable[p] == 1, theirs)
        })
        .collect())
}
