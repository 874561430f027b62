//! Direct access between the ranks of one host: the interface of the intra-host algorithms
//! that do not stream bytes through links (one-shot all-reduce, single-copy all-reduce).
//!
//! Each rank owns a small published area that every other rank of the host can read: an
//! event counter, two data slots and two [`EventRecord`]s (slot `e % 2` belongs to event `e`).
//! A rank [`publish`](Direct::publish)es event `e` (its data and/or the addresses of its
//! buffers), then waits until every peer has published `e` too, then reads what they
//! published, and may copy straight out of their buffers ([`read_peer`](Direct::read_peer),
//! `process_vm_readv`, single copy), or map a peer's shared buffer and use it in place
//! ([`map_peer`](Direct::map_peer)).
//!
//! Reuse of a slot is safe without acknowledgements because every algorithm keeps one rule:
//! **before publishing event `e + 1`, a rank has waited for every peer to publish `e`** (and
//! has finished reading their event-`e` data before publishing `e + 1`). Then slot `e % 2` is
//! next overwritten at `e + 2`, by a rank that has seen every peer publish `e + 1`, i.e.
//! finish reading event `e`.
//!
//! `direct::shm` implements it over `/dev/shm`; [`mem::group`](mem_group) over heap
//! memory for threads of one process (tests).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::base::wait::{Cadence, Doorbell};
use crate::direct::shared_buffer::Region;
use crate::fault::fingerprint::HEADER_BYTES;
use crate::transport::LinkError;

/// What a rank publishes with an event besides its data: where its buffers lie (for the
/// single-copy algorithms) and, with a call's first event, the call's header (its fingerprint
/// and sequence number, see [`crate::fault::fingerprint`]), checked by every peer before any
/// data is combined. Fields a call does not use are zero.
///
/// In shared memory it travels as [`WORDS`](Self::WORDS) words ([`encode`](Self::encode),
/// [`decode`](Self::decode)): the four buffer words, then the two header words.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventRecord {
    /// Address of the publisher's input, in its address space.
    pub input: u64,
    /// Address of the publisher's output.
    pub output: u64,
    /// Length of the input in bytes.
    pub input_len: u64,
    /// Length of the output in bytes.
    pub output_len: u64,
    /// The call's header (all zero: none).
    pub header: [u8; HEADER_BYTES],
}

impl EventRecord {
    /// Number of words of an encoded record.
    pub const WORDS: usize = Self::BUFFER_WORDS + 2;
    /// Number of leading words that describe the buffers (the rest carry the header).
    pub const BUFFER_WORDS: usize = 4;

    /// A record of the publisher's input and output buffers, without a header.
    pub fn buffers(
        input: *const u8,
        input_len: usize,
        output: *const u8,
        output_len: usize,
    ) -> Self {
        EventRecord {
            input: input as u64,
            output: output as u64,
            input_len: input_len as u64,
            output_len: output_len as u64,
            header: [0; HEADER_BYTES],
        }
    }

    /// The record of a call's last event published by a rank that leaves the call failed
    /// (see [`crate::direct::cma`]): its input word is [`LEFT_FAILED`](Self::LEFT_FAILED), the
    /// rest zero. A clean last event is all zero.
    pub fn left_failed() -> Self {
        EventRecord {
            input: Self::LEFT_FAILED,
            ..Default::default()
        }
    }

    /// Whether this is the record of [`left_failed`](Self::left_failed).
    pub fn is_left_failed(&self) -> bool {
        self.input == Self::LEFT_FAILED && self.input_len == 0
    }

    /// The input word that marks [`left_failed`](Self::left_failed) ("oxfailed"): never a
    /// buffer's address with a length of zero in a last event, which carries no buffers.
    pub const LEFT_FAILED: u64 = u64::from_le_bytes(*b"oxfailed");

    /// The record as words: input, output, input length, output length, then the header as
    /// two little-endian words.
    pub fn encode(&self) -> [u64; Self::WORDS] {
        let [h0, h1] = Self::header_words(&self.header);
        [
            self.input,
            self.output,
            self.input_len,
            self.output_len,
            h0,
            h1,
        ]
    }

    /// The record that [`encode`](Self::encode) made these words of.
    pub fn decode(w: [u64; Self::WORDS]) -> Self {
        EventRecord {
            input: w[0],
            output: w[1],
            input_len: w[2],
            output_len: w[3],
            header: Self::header_of_words([w[4], w[5]]),
        }
    }

    /// The header's two words (the last two of [`encode`](Self::encode)).
    pub fn header_words(header: &[u8; HEADER_BYTES]) -> [u64; 2] {
        let (a, b) = header.split_at(8);
        [
            u64::from_le_bytes(a.try_into().expect("8 bytes")),
            u64::from_le_bytes(b.try_into().expect("8 bytes")),
        ]
    }

    /// The header of its two words (see [`header_words`](Self::header_words)).
    pub fn header_of_words(w: [u64; 2]) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[..8].copy_from_slice(&w[0].to_le_bytes());
        b[8..].copy_from_slice(&w[1].to_le_bytes());
        b
    }
}

/// Direct access to the published areas and memory of the other ranks of one host.
pub trait Direct: Send {
    /// Capacity of one data slot in bytes.
    fn slot_bytes(&self) -> usize;

    /// Publishes the next event: copies `data` (at most [`slot_bytes`](Self::slot_bytes)) into
    /// this rank's slot for it, records `record`, advances this rank's counter and wakes
    /// sleeping peers. Returns the event number.
    fn publish(&mut self, data: &[u8], record: &EventRecord) -> u64;

    /// Whether `peer` has published event `e`.
    fn reached(&self, peer: usize, e: u64) -> bool;

    /// The last event this rank published.
    fn event(&self) -> u64;

    /// The first `len` bytes `peer` published with event `e`. Valid until this rank publishes
    /// `e + 1` (see the module's reuse rule); the caller has seen [`reached`](Self::reached).
    fn peer_slot(&self, peer: usize, e: u64, len: usize) -> &[u8];

    /// The record `peer` published with event `e`.
    fn peer_record(&self, peer: usize, e: u64) -> EventRecord;

    /// The header of the record `peer` published with event `e`: what every call checks, so
    /// an implementation may keep it where it is cheapest to read.
    fn peer_header(&self, peer: usize, e: u64) -> [u8; HEADER_BYTES] {
        self.peer_record(peer, e).header
    }

    /// Copies `dst.len()` bytes at `addr` in `peer`'s address space into `dst`.
    fn read_peer(&self, peer: usize, addr: u64, dst: &mut [u8]) -> std::io::Result<()>;

    /// Copies `src` to `addr` in `peer`'s address space. The peer published `addr` as a buffer
    /// that it does not touch until the algorithm's next event.
    fn write_peer(&self, peer: usize, addr: u64, src: &[u8]) -> std::io::Result<()>;

    /// Before writing into `peer`'s buffers (mapped or with cross-memory copies): waits while
    /// `peer`'s process is forking (it copies its shared buffers for the child, which must
    /// not see this write), and holds its fork off until
    /// [`leave_peer_writes`](Self::leave_peer_writes). Nothing where the ranks are threads of one process.
    fn enter_peer_writes(&self, _peer: usize) {}

    /// After the writes [`enter_peer_writes`](Self::enter_peer_writes) let through.
    fn leave_peer_writes(&self, _peer: usize) {}

    /// A pointer, in this process, to the start of `peer`'s shared buffer `region` (which the
    /// peer published, see [`crate::direct::shared_buffer`]), mapping it on first use; `Ok(None)` where
    /// this implementation does not map peers' memory. The mapping stays valid at least until
    /// this rank's next event after the one that maps it.
    fn map_peer(
        &mut self,
        peer: usize,
        region: &Region,
    ) -> std::io::Result<Option<std::ptr::NonNull<u8>>> {
        let _ = (peer, region);
        Ok(None)
    }

    /// Whether [`read_peer`](Self::read_peer) and [`write_peer`](Self::write_peer) work between
    /// these processes (checked at setup).
    fn can_read_peers(&self) -> bool;

    /// This rank's doorbell, rung by peers when they publish.
    fn doorbell(&self) -> &Doorbell;

    /// An error if `peer` is known to be gone.
    fn check_alive(&self, peer: usize) -> Result<(), LinkError>;

    /// Whether `peer` last published from the CPU this rank last published from: then it
    /// can only run when this rank leaves the CPU, and spinning for it is lost time. A hint
    /// (never decides correctness); `false` where unknown.
    fn peer_shares_cpu(&self, peer: usize) -> bool {
        let _ = peer;
        false
    }

    /// The spin budget this rank has learned across its waits ([`Cadence`]).
    fn cadence(&mut self) -> &mut Cadence;
}

/// Slot capacity of the in-memory implementation.
const MEM_SLOT: usize = 64 << 10;

struct MemArea {
    progress: AtomicU64,
    slots: [std::sync::Mutex<Vec<u8>>; 2],
    records: [[AtomicU64; EventRecord::WORDS]; 2],
    bell: Doorbell,
    closed: std::sync::atomic::AtomicBool,
}

/// The in-memory implementation, for ranks that are threads of one process.
pub struct MemDirect {
    rank: usize,
    areas: Arc<Vec<MemArea>>,
    event: u64,
    cadence: Cadence,
}

/// `n` handles for `n` threads.
pub fn mem_group(n: usize) -> Vec<MemDirect> {
    let areas: Arc<Vec<MemArea>> = Arc::new(
        (0..n)
            .map(|_| MemArea {
                progress: AtomicU64::new(0),
                slots: [
                    std::sync::Mutex::new(vec![0; MEM_SLOT]),
                    std::sync::Mutex::new(vec![0; MEM_SLOT]),
                ],
                records: Default::default(),
                bell: Doorbell::new(),
                closed: Default::default(),
            })
            .collect(),
    );
    (0..n)
        .map(|rank| MemDirect {
            rank,
            areas: areas.clone(),
            event: 0,
            cadence: Cadence::new(),
        })
        .collect()
}

impl Direct for MemDirect {
    fn slot_bytes(&self) -> usize {
        MEM_SLOT
    }

    fn publish(&mut self, data: &[u8], record: &EventRecord) -> u64 {
        self.event += 1;
        let e = self.event;
        let me = &self.areas[self.rank];
        let p = (e % 2) as usize;
        me.slots[p].lock().unwrap_or_else(|e| e.into_inner())[..data.len()].copy_from_slice(data);
        for (a, v) in me.records[p].iter().zip(record.encode()) {
            a.store(v, Ordering::Relaxed);
        }
        me.progress.store(e, Ordering::Release);
        for (r, a) in self.areas.iter().enumerate() {
            if r != self.rank {
                a.bell.ring();
            }
        }
        e
    }

    fn reached(&self, peer: usize, e: u64) -> bool {
        self.areas[peer].progress.load(Ordering::Acquire) >= e
    }

    fn event(&self) -> u64 {
        self.event
    }

    fn peer_slot(&self, peer: usize, e: u64, len: usize) -> &[u8] {
        let slot = self.areas[peer].slots[(e % 2) as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // SAFETY: the Vec is never resized and lives as long as `areas`; by the reuse rule the
        // owner does not write this slot again until we publish e + 1, which needs `&mut self`
        // and so ends this borrow first.
        unsafe { std::slice::from_raw_parts(slot.as_ptr(), len) }
    }

    fn peer_record(&self, peer: usize, e: u64) -> EventRecord {
        let a = &self.areas[peer].records[(e % 2) as usize];
        EventRecord::decode(std::array::from_fn(|i| a[i].load(Ordering::Relaxed)))
    }

    fn read_peer(&self, _peer: usize, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
        // SAFETY: threads share one address space; the peer published `addr` as a buffer of at
        // least this length that stays valid and unwritten until the algorithm's next event.
        unsafe {
            std::ptr::copy_nonoverlapping(addr as usize as *const u8, dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    fn write_peer(&self, _peer: usize, addr: u64, src: &[u8]) -> std::io::Result<()> {
        // SAFETY: threads share one address space; the peer published `addr` as a buffer of at
        // least this length that it neither reads nor writes until the algorithm's next event,
        // and that no other rank writes in the same phase.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), addr as usize as *mut u8, src.len()) };
        Ok(())
    }

    fn map_peer(
        &mut self,
        _peer: usize,
        region: &Region,
    ) -> std::io::Result<Option<std::ptr::NonNull<u8>>> {
        // Threads share one address space: the peer's buffer is where the peer has it.
        Ok(std::ptr::NonNull::new(region.base as usize as *mut u8))
    }

    fn can_read_peers(&self) -> bool {
        true
    }

    fn doorbell(&self) -> &Doorbell {
        &self.areas[self.rank].bell
    }

    fn check_alive(&self, peer: usize) -> Result<(), LinkError> {
        if self.areas[peer].closed.load(Ordering::Acquire) {
            return Err(LinkError::Closed(format!(
                "rank {peer} dropped its communicator"
            )));
        }
        Ok(())
    }

    fn cadence(&mut self) -> &mut Cadence {
        &mut self.cadence
    }
}

impl Drop for MemDirect {
    fn drop(&mut self) {
        self.areas[self.rank].closed.store(true, Ordering::Release);
        for (r, a) in self.areas.iter().enumerate() {
            if r != self.rank {
                a.bell.ring();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_record_round_trips_through_its_words() {
        let r = EventRecord {
            input: 0x1122_3344_5566_7788,
            output: 0x99aa_bbcc_ddee_ff00,
            input_len: 3,
            output_len: 1 << 40,
            header: std::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(1)),
        };
        let w = r.encode();
        assert_eq!(
            &w[..EventRecord::BUFFER_WORDS],
            &[r.input, r.output, 3, 1 << 40]
        );
        // The header's words are its bytes, little-endian: what a peer that reads only those
        // two words (ShmDirect::peer_header) decodes.
        assert_eq!(w[4].to_le_bytes(), r.header[..8]);
        assert_eq!(w[5].to_le_bytes(), r.header[8..]);
        assert_eq!(EventRecord::header_of_words([w[4], w[5]]), r.header);
        assert_eq!(EventRecord::decode(w), r);
        assert_eq!(
            EventRecord::decode([0; EventRecord::WORDS]),
            EventRecord::default()
        );
    }

    #[test]
    fn mem_direct_hands_peers_the_published_record() {
        let mut g = mem_group(2);
        let r = EventRecord {
            header: [7; HEADER_BYTES],
            ..EventRecord::buffers(16 as *const u8, 8, 64 as *const u8, 24)
        };
        let e = g[0].publish(b"abc", &r);
        assert!(g[1].reached(0, e));
        assert_eq!(g[1].peer_record(0, e), r);
        assert_eq!(g[1].peer_header(0, e), [7; HEADER_BYTES]);
        assert_eq!(g[1].peer_slot(0, e, 3), b"abc");
    }
}
