//! Single-copy collectives for large messages between the ranks of one host: every rank
//! publishes the addresses of its buffers and moves what it needs straight between its own
//! memory and its peers' with `process_vm_readv` / `process_vm_writev` (cross-memory attach, as
//! Open MPI's CMA path), instead of streaming everything through shared-memory rings (two
//! copies).
//!
//! - all_reduce: rank `r` owns block `r`. For each chunk of it, it reads the chunk of every
//!   rank's input (in rank order, so that every element is combined the same way whoever owns
//!   it: identical bits on every rank) into cache-resident buffers, folds them, and writes the
//!   result straight into every rank's output. One pass over memory: per rank `S` read and `S`
//!   written whatever the rank count (a reduce-scatter followed by an all-gather reads and
//!   writes the owned blocks twice). Two events.
//! - reduce_scatter: the same with the result written to the owner's output only.
//! - reduce: the same with the result written to the root's output only, so every rank
//!   reduces `1/n` of the data in parallel.
//! - all_gather, all_to_all: each rank reads its peers' inputs into its output, two events;
//!   all_gather into outputs that are shared buffers is pushed instead: each rank reads each
//!   chunk of its input once and writes it into every output.
//! - broadcast: every rank reads the root's input while the root writes part of each peer's
//!   output itself: block `p` into peer `p` when it is in place (it has nothing of its own to
//!   copy), the last `1/(2n)` when it also copies its input to its output. Two events.
//!
//! Each collective's part is in a file of its own ([`reductions`], [`all_gather`],
//! [`all_to_all`], [`broadcast`]); this one sets up the call from its first event, the
//! agreement every rank published its buffers in ([`agree`](crate::direct::agree)), each
//! peer's buffers as [`PeerBuf`]s, and ends it (the last event).
//!
//! Only the owner of a block touches that block of any buffer in a call, so a rank's in-place
//! buffer is read before it is overwritten, by the same rank. The last event of each call tells
//! every rank that nobody reads or writes its buffers any more, so it may return. A rank that
//! fails publishes it too, marked failed, and still waits for its living peers' (a peer may be
//! writing into its output): so no rank, however the call ends, returns while a peer may touch
//! its buffers, and no rank returns success from a call a peer left failed.

use crate::base::buffers::Buffers;
use crate::base::error::{Error, Result};
use crate::direct::agree::{self, Agreed};
use crate::direct::exec::DirectCtx;
use crate::direct::link::EventRecord;
use crate::sched::{Coll, CollKind};

mod all_gather;
mod all_to_all;
mod broadcast;
mod peer_buf;
mod placement;
mod reductions;

use peer_buf::{copy, PeerBuf};

/// Bytes reduced or pushed at a time (the temporary stays in the core's cache).
const CHUNK: usize = 256 << 10;

/// One single-copy call as its parts see it: the collective, this rank's buffers and every
/// rank's buffers as this rank reaches them.
struct Call<'c> {
    c: &'c Coll,
    /// Each rank's input (`[0]`) and output (`[1]`), mapped where the rank has them in shared
    /// buffers.
    peers: Vec<[PeerBuf; 2]>,
    /// This rank's input and its length.
    inp: *const u8,
    in_len: usize,
    /// This rank's output and its length.
    outp: *mut u8,
    out_len: usize,
    /// Bytes of one rank's block (`count` elements).
    bytes: usize,
    /// Whether results are written with streaming stores.
    nt: bool,
}

impl Call<'_> {
    /// Copies `dst.len()` bytes at `off` of this rank's own input into `dst`.
    fn read_own(&self, off: usize, dst: &mut [u8]) {
        debug_assert!(off + dst.len() <= self.in_len, "outside the input");
        if self.nt {
            // SAFETY: `off + dst.len() <= in_len` (callers stay within the input), and the
            // input does not overlap the output, where `dst` lies.
            copy(true, dst, unsafe {
                std::slice::from_raw_parts(self.inp.add(off), dst.len())
            });
        } else {
            // SAFETY: `off + dst.len() <= in_len` and `dst` is a separate buffer or the very
            // same bytes (copy allows overlap).
            unsafe { std::ptr::copy(self.inp.add(off), dst.as_mut_ptr(), dst.len()) }
        }
    }
}

/// Fails unless `peer`'s buffers as it published them (`rec`) hold at least the bytes of its
/// input and output that this call reads and writes. Every access to a peer's buffer stays
/// inside what it published (a mapping of a shared buffer is only used for a published range
/// that lies inside the buffer), so a peer that published less than the call needs, buggy or
/// hostile, would otherwise have this rank reach past that range: through a mapping, into
/// whatever this process has mapped after it.
fn check_lengths(cx: &DirectCtx<'_>, c: &Coll, peer: usize, rec: &EventRecord) -> Result<()> {
    let theirs = Coll {
        rank: peer,
        topo: None,
        blocks: None,
        ..*c
    };
    let need = [theirs.input_bytes() as u64, theirs.output_bytes() as u64];
    let have = [rec.input_len, rec.output_len];
    if have[0] >= need[0] && have[1] >= need[1] {
        return Ok(());
    }
    let id = cx.wait.id();
    Err(Error::Protocol {
        rank: id.rank,
        peer,
        call: id.call,
        seq: id.seq,
        msg: format!(
            "it published a {}-byte input and a {}-byte output for a {} of {} elements, which \
             needs {} and {}",
            have[0],
            have[1],
            c.kind.name(),
            c.count,
            need[0],
            need[1]
        ),
    })
}

/// Runs `c` single-copy from the agreement on (`agreed`: every rank has published its
/// [`EventRecord::buffers`] and its [`regions`](agree::regions) in it). Each peer's buffer is
/// reached through a mapping where the peer published a shared one, by the kernel's
/// cross-memory copies otherwise. `tmp` is reused across calls.
///
/// Whatever the outcome, the call ends with its last event ([`DirectCtx::finish`]): a rank
/// that fails returns only once its living peers have stopped writing into its buffers.
pub(crate) fn run(
    cx: &mut DirectCtx<'_>,
    c: &Coll,
    bufs: &mut Buffers<'_>,
    tmp: &mut Vec<u64>,
    agreed: &Agreed,
) -> Result<()> {
    let work = work(cx, c, bufs, tmp, agreed);
    cx.finish(work)
}

/// This rank's part of the call, between the agreement and the last event.
fn work(
    cx: &mut DirectCtx<'_>,
    c: &Coll,
    bufs: &mut Buffers<'_>,
    tmp: &mut Vec<u64>,
    agreed: &Agreed,
) -> Result<()> {
    let (e1, regions) = (agreed.event, agreed.regions);
    let (n, me) = (c.nranks, c.rank);
    let (inp, in_len) = bufs.input_raw();
    let (outp, out_len) = bufs.output_raw();
    // Each peer's input and output, mapped where the peer has them in shared buffers.
    let mut peers: Vec<[PeerBuf; 2]> = Vec::with_capacity(n);
    for p in 0..n {
        let rec = cx.direct.peer_record(p, e1);
        if p != me {
            check_lengths(cx, c, p, &rec)?;
        }
        let bufs = [(rec.input, rec.input_len), (rec.output, rec.output_len)];
        let w = agree::regions_of(cx, me, p, e1, regions);
        peers.push([0, 1].map(|i| {
            let (addr, len) = bufs[i];
            let region = w[i];
            let local = region
                .filter(|r| p != me && r.covers(addr, len))
                .and_then(|r| match cx.direct.map_peer(p, &r) {
                    // SAFETY: `addr - r.base < r.len`, inside the mapping.
                    Ok(l) => l.map(|l| unsafe { l.add((addr - r.base) as usize) }),
                    Err(e) => {
                        tracing::debug!(rank = me, peer = p, "cannot map a shared buffer: {e}");
                        None
                    }
                });
            PeerBuf {
                peer: p,
                addr,
                local,
                published: region.is_some(),
            }
        }));
    }
    // Streaming stores for results too large for the cache; never in place, where a result
    // overwrites the very lines just read (in the cache: nothing to save).
    let disjoint =
        inp as usize + in_len <= outp as usize || outp as usize + out_len <= inp as usize;
    let call = Call {
        c,
        peers,
        inp,
        in_len,
        outp,
        out_len,
        bytes: c.count * c.dtype.size(),
        nt: disjoint && n.saturating_mul(in_len + out_len) >= cx.nt_bytes,
    };
    let cx_ = &*cx;
    match c.kind {
        CollKind::AllReduce => reductions::all_reduce(cx_, &call, tmp)?,
        CollKind::ReduceScatter => reductions::reduce_scatter(cx_, &call, tmp)?,
        CollKind::Reduce => reductions::reduce(cx_, &call, tmp)?,
        CollKind::AllGather => all_gather::run(cx_, &call)?,
        CollKind::AllToAll => all_to_all::run(cx_, &call)?,
        CollKind::Broadcast => broadcast::run(cx_, &call)?,
        _ => unreachable!("cma::run called for {}", c.kind.name()),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::dtype::DataType;
    use crate::base::error::Error;
    use crate::base::op::ReduceOp;
    use crate::base::wait::{CallId, Spin, Waiter};
    use crate::direct::link::{mem_group, Direct, MemDirect};
    use crate::direct::shared_buffer::{Region, SharedBuffer};
    use crate::plan::call_plan::Ask;
    use std::time::Duration;

    /// Rank 0's single-copy all_reduce of `out` (in place) as call `seq` of `n` ranks, from
    /// its agreement on.
    fn all_reduce_rank0(mine: &mut MemDirect, n: usize, seq: u64, out: &mut [f32]) -> Result<()> {
        let c = Coll {
            kind: CollKind::AllReduce,
            rank: 0,
            nranks: n,
            count: out.len(),
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            root: 0,
            chunk_bytes: 1 << 20,
            topo: None,
            blocks: None,
        };
        let id = CallId {
            rank: 0,
            call: "all_reduce",
            seq,
        };
        let mut cx = DirectCtx {
            direct: mine,
            nranks: n,
            wait: Waiter::new(id, Spin::new(1), Duration::from_secs(30), false),
            print: None,
            health: None,
            links: None,
            step_ends: None,
            nt_bytes: usize::MAX,
        };
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
        let len = bytes.len();
        let mut bufs = Buffers::in_place(bytes, 0..len, 0..len);
        agree::agree(&mut cx, Ask::SingleCopy, &mut bufs)
            .and_then(|a| run(&mut cx, &c, &mut bufs, &mut Vec::new(), &a))
    }

    /// A peer (buggy or hostile) publishes a shared buffer and a record whose input and output
    /// are 8 bytes long for an all_reduce of 16 KiB: this rank must refuse to touch more than
    /// was published (through a mapping, the bytes past it are whatever this process mapped
    /// there), not read and write 8 KiB of it.
    #[test]
    fn a_peer_that_publishes_short_buffers_is_a_protocol_error_and_nothing_is_touched() {
        let mut g = mem_group(2);
        let mut peer = g.pop().expect("two");
        let mut mine = g.pop().expect("two");
        // The peer's memory: 64 KiB, of which it publishes 8 bytes (as a shared buffer of
        // 64 KiB, so that the region covers what is published).
        let theirs: Vec<u64> = vec![0x5a5a_5a5a_5a5a_5a5a; 8 << 10];
        let base = theirs.as_ptr() as u64;
        let region = Region {
            id: 1,
            base,
            len: 64 << 10,
            fd: 0,
        };
        let mut words = [0u64; 8];
        words[..4].copy_from_slice(&region.to_words());
        words[4..].copy_from_slice(&region.to_words());
        let hostile = std::thread::spawn(move || {
            let rec = EventRecord::buffers(base as *const u8, 8, base as *const u8, 8);
            peer.publish(bytemuck::bytes_of(&words), &rec);
            // The call's last event, so that a rank that went on does not wait for it.
            peer.publish(&[], &EventRecord::default());
            std::thread::sleep(Duration::from_millis(200));
            drop(peer);
        });
        let count = 4096;
        let mut buf = SharedBuffer::new(count * 4, 0).unwrap();
        buf.as_mut_slice::<f32>().fill(1.0);
        let res = all_reduce_rank0(&mut mine, 2, 1, buf.as_mut_slice::<f32>());
        hostile.join().unwrap();
        match res {
            Err(Error::Protocol {
                rank: 0,
                peer: 1,
                ref msg,
                ..
            }) => {
                assert!(msg.contains("8-byte input"), "{msg}")
            }
            other => panic!("expected a protocol error naming rank 1, got {other:?}"),
        }
        assert!(
            theirs.iter().all(|&w| w == 0x5a5a_5a5a_5a5a_5a5a),
            "the peer's bytes past what it published were written"
        );
        assert!(buf.as_slice::<f32>().iter().all(|&x| x == 1.0));
    }

    /// Rank 0's call fails after the agreement (rank 2 published short buffers, and then
    /// left), while rank 1, honest and slow, is still to write its share of the result into
    /// rank 0's output. Rank 0 must not return before rank 1 has done so and ended the call:
    /// its caller would free or reuse the output while rank 1 writes into it (across
    /// processes, a cross-memory write into a freed heap chunk).
    #[test]
    fn a_rank_that_fails_mid_call_returns_only_after_its_living_peers_stopped_writing() {
        let mut g = mem_group(3);
        let hostile = g.pop().expect("three");
        let slow = g.pop().expect("three");
        let mut mine = g.pop().expect("three");
        let count = 3 * 1024;
        let mut out = vec![1.0f32; count];
        // Where rank 1 writes, and what: the first element of its block.
        let (at, mark) = (1024, 7.0f32);
        let hostile = std::thread::spawn(move || {
            let mut peer = hostile;
            let tiny = [0u64; 1];
            let p = tiny.as_ptr().cast::<u8>();
            peer.publish(&[0u8; 64], &EventRecord::buffers(p, 8, p, 8));
            std::thread::sleep(Duration::from_millis(100));
            drop(peer);
        });
        let writer = std::thread::spawn(move || {
            let mut peer = slow;
            let own = vec![1.0f32; count];
            let p = own.as_ptr().cast::<u8>();
            let e = peer.publish(
                &[0u8; 64],
                &EventRecord::buffers(p, count * 4, p, count * 4),
            );
            while !peer.reached(0, e) {
                std::thread::yield_now();
            }
            let theirs = peer.peer_record(0, e).output;
            std::thread::sleep(Duration::from_millis(300));
            peer.write_peer(0, theirs + 4 * at as u64, &mark.to_le_bytes())
                .unwrap();
            peer.publish(&[], &EventRecord::left_failed());
            std::thread::sleep(Duration::from_millis(100));
            drop((peer, own));
        });
        let res = all_reduce_rank0(&mut mine, 3, 1, &mut out);
        // Read as the call returned, before waiting for the peers' threads.
        let seen = out[at];
        writer.join().unwrap();
        hostile.join().unwrap();
        assert!(
            matches!(res, Err(Error::Protocol { peer: 2, .. })),
            "expected the short buffers of rank 2 to fail the call, got {res:?}"
        );
        assert_eq!(
            seen, mark,
            "the call returned while rank 1 was still to write into its output"
        );
    }

    /// A peer that leaves the call failed (its last event says so) fails the call of a rank
    /// that did its own part: its share of the result is missing.
    #[test]
    fn a_call_a_peer_left_failed_is_an_error_not_a_success() {
        let mut g = mem_group(2);
        let mut peer = g.pop().expect("two");
        let mut mine = g.pop().expect("two");
        let count = 2 * 1024;
        let mut out = vec![1.0f32; count];
        let failing = std::thread::spawn(move || {
            let own = vec![1.0f32; count];
            let p = own.as_ptr().cast::<u8>();
            peer.publish(
                &[0u8; 64],
                &EventRecord::buffers(p, count * 4, p, count * 4),
            );
            // It writes nothing of its block, and leaves failed.
            peer.publish(&[], &EventRecord::left_failed());
            std::thread::sleep(Duration::from_millis(100));
            drop((peer, own));
        });
        let res = all_reduce_rank0(&mut mine, 2, 3, &mut out);
        failing.join().unwrap();
        match res {
            Err(Error::Remote {
                rank: 0,
                origin: 1,
                seq: 3,
                ..
            }) => {}
            other => panic!("expected an error naming rank 1, which left failed: {other:?}"),
        }
    }
}
