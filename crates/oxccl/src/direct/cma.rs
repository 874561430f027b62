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
//! Only the owner of a block touches that block of any buffer in a call, so a rank's in-place
//! buffer is read before it is overwritten, by the same rank. The last event of each call tells
//! every rank that nobody reads or writes its buffers any more, so it may return.

use std::ptr::NonNull;

use crate::base::buffers::Buffers;
use crate::base::error::Result;
use crate::base::op::ReduceOp;
use crate::base::reduce;
use crate::direct::exec::DirectCtx;
use crate::direct::hugepages;
use crate::direct::shared_buffer::{region_of, Region};
use crate::sched::{block, Coll, CollKind};

/// Bytes reduced at a time (the temporary stays in the core's cache).
const CHUNK: usize = 256 << 10;

/// How this rank reaches one buffer of a peer: through a mapping of the peer's shared memory
/// (`local`: where the buffer starts here), or with the kernel's cross-memory copies at `addr`.
#[derive(Clone, Copy)]
struct PeerBuf {
    peer: usize,
    addr: u64,
    local: Option<NonNull<u8>>,
    /// Whether its owner published it as a shared buffer (known alike to every rank, unlike
    /// `local`: a rank that fails to map it falls back to cross-memory copies).
    published: bool,
}

impl PeerBuf {
    /// Copies `dst.len()` bytes at `off` of the buffer into `dst` (with streaming stores if
    /// `nt` and the buffer is mapped).
    fn read(&self, cx: &DirectCtx<'_>, off: usize, dst: &mut [u8], nt: bool) -> Result<()> {
        match self.local {
            // SAFETY: `off + dst.len()` is within the peer's buffer (the header check made
            // every rank's lengths agree), which lies inside the mapping (checked when it was
            // mapped); nobody writes these bytes in this phase, and `dst` is this rank's own
            // memory.
            Some(l) => copy(nt, dst, unsafe {
                std::slice::from_raw_parts(l.as_ptr().add(off), dst.len())
            }),
            None => cx
                .direct
                .read_peer(self.peer, self.addr + off as u64, dst)
                .map_err(|e| cx.read_error(self.peer, e))?,
        }
        Ok(())
    }

    /// Copies `src` to `off` of the buffer (with streaming stores if `nt` and the buffer is
    /// mapped).
    fn write(&self, cx: &DirectCtx<'_>, off: usize, src: &[u8], nt: bool) -> Result<()> {
        match self.local {
            // SAFETY: within the peer's buffer as in `read`; only this rank touches these bytes
            // in this phase, and `src` is this rank's own memory.
            Some(l) => copy(
                nt,
                unsafe { std::slice::from_raw_parts_mut(l.as_ptr().add(off), src.len()) },
                src,
            ),
            None => cx
                .direct
                .write_peer(self.peer, self.addr + off as u64, src)
                .map_err(|e| cx.write_error(self.peer, e))?,
        }
        Ok(())
    }

    /// The `k` bytes at `off`: in place where the buffer is mapped, else read into `tmp`.
    fn view<'t>(
        &self,
        cx: &DirectCtx<'_>,
        off: usize,
        k: usize,
        tmp: &'t mut [u8],
    ) -> Result<&'t [u8]> {
        match self.local {
            // SAFETY: as in `read`; the slice is dropped before this rank's next event, and
            // nobody writes these bytes until then (only their owner, this rank, writes an
            // in-place buffer's block, after its last read of it).
            Some(l) => Ok(unsafe { std::slice::from_raw_parts(l.as_ptr().add(off), k) }),
            None => {
                self.read(cx, off, &mut tmp[..k], false)?;
                Ok(&tmp[..k])
            }
        }
    }
}

/// Copies `src` into `dst`, with streaming stores if `nt`.
fn copy(nt: bool, dst: &mut [u8], src: &[u8]) {
    if nt {
        reduce::copy_streaming(dst, src);
    } else {
        dst.copy_from_slice(src);
    }
}

/// Runs `c` single-copy. `tmp` is reused across calls.
pub(crate) fn run(
    cx: &mut DirectCtx<'_>,
    c: &Coll,
    bufs: &mut Buffers<'_>,
    tmp: &mut Vec<u64>,
) -> Result<()> {
    let (n, me, es) = (c.nranks, c.rank, c.dtype.size());
    let (inp, in_len) = bufs.input_raw();
    let (outp, out_len) = bufs.output_raw();
    // The first event carries the call's header: every rank checks that its peers called the
    // same collective on the same count before touching their memory. Its data: where this
    // rank's buffers lie in shared buffers, if they do, for peers to map.
    let mut regions = [0u64; 8];
    for (i, (p, l)) in [(inp, in_len), (outp.cast_const(), out_len)]
        .into_iter()
        .enumerate()
    {
        match region_of(p, l) {
            Some(r) => regions[4 * i..4 * i + 4].copy_from_slice(&r.to_words()),
            // Private: the peers' cross-memory copies walk its pages (huge ones, once
            // registered).
            None => hugepages::register(p, l),
        }
    }
    let e1 = cx.begin(
        bytemuck::bytes_of(&regions),
        [inp as u64, outp as u64, in_len as u64, out_len as u64],
    )?;
    // Each peer's input and output, mapped where the peer has them in shared buffers.
    let mut peers: Vec<[PeerBuf; 2]> = Vec::with_capacity(n);
    for p in 0..n {
        let a = cx.direct.peer_addrs(p, e1);
        let mut w = regions;
        if p != me {
            bytemuck::bytes_of_mut(&mut w).copy_from_slice(cx.direct.peer_slot(p, e1, 64));
        }
        peers.push([0, 1].map(|i| {
            let region = Region::from_words(w[4 * i..4 * i + 4].try_into().expect("4 words"));
            let local = region
                .filter(|r| p != me && r.covers(a[i], a[2 + i]))
                .and_then(|r| match cx.direct.map_peer(p, &r) {
                    // SAFETY: `a[i] - r.base < r.len`, inside the mapping.
                    Ok(l) => l.map(|l| unsafe { l.add((a[i] - r.base) as usize) }),
                    Err(e) => {
                        tracing::debug!(rank = me, peer = p, "cannot map a shared buffer: {e}");
                        None
                    }
                });
            PeerBuf {
                peer: p,
                addr: a[i],
                local,
                published: region.is_some(),
            }
        }));
    }
    // Streaming stores for results too large for the cache; never in place, where a result
    // overwrites the very lines just read (in the cache: nothing to save).
    let disjoint =
        inp as usize + in_len <= outp as usize || outp as usize + out_len <= inp as usize;
    let nt = disjoint && n.saturating_mul(in_len + out_len) >= cx.nt_bytes;
    let read_own = |off: usize, dst: &mut [u8]| {
        if nt {
            // SAFETY: `off + dst.len() <= in_len` (callers stay within the input), and the
            // input does not overlap the output, where `dst` lies.
            copy(true, dst, unsafe {
                std::slice::from_raw_parts(inp.add(off), dst.len())
            });
        } else {
            // SAFETY: `off + dst.len() <= in_len` and `dst` is a separate buffer or the very
            // same bytes (copy allows overlap).
            unsafe { std::ptr::copy(inp.add(off), dst.as_mut_ptr(), dst.len()) }
        }
    };
    // The whole output, for the cases where no peer writes into it (the reductions build no
    // such reference: there peers write parts of a rank's output).
    let whole_out = || {
        // SAFETY: the output is valid for out_len bytes for the whole call; in these cases no
        // peer touches it, and this rank reads its own input through `read_own` (never through
        // a reference overlapping `out`).
        unsafe { std::slice::from_raw_parts_mut(outp, out_len) }
    };
    let bytes = c.count * es;
    match c.kind {
        CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce => {
            // This rank's block: where it starts in the inputs, its length, and where its
            // result goes: (rank, offset in its output) pairs, this rank's own included.
            let (start, len, dests): (usize, usize, Vec<(usize, usize)>) = match c.kind {
                CollKind::ReduceScatter => (me * bytes, bytes, vec![(me, 0)]),
                _ => {
                    let (s, l) = block(c.count, n, me);
                    let (s, l) = (s * es, l * es);
                    let dests = if c.kind == CollKind::AllReduce {
                        (0..n).map(|p| (p, s)).collect()
                    } else {
                        vec![(c.root, s)]
                    };
                    (s, l, dests)
                }
            };
            let words = (3 * CHUNK).div_ceil(8);
            if tmp.len() < words {
                tmp.resize(words, 0);
            }
            let (acc, rest) =
                bytemuck::cast_slice_mut::<u64, u8>(tmp)[..3 * CHUNK].split_at_mut(CHUNK);
            let (ta, tb) = rest.split_at_mut(CHUNK);
            let chunk = CHUNK / es * es;
            let mut off = 0;
            while off < len {
                let k = chunk.min(len - off);
                let at = start + off;
                // SAFETY: `at + k <= in_len`; the input stays valid and, in this phase, only
                // this rank writes this block of it (after the last use of `own`).
                let own = unsafe { std::slice::from_raw_parts(inp.add(at), k) };
                let acc = &mut acc[..k];
                // Rank order: acc = ((x0 ⊕ x1) ⊕ x2) ...
                if n == 1 {
                    acc.copy_from_slice(own);
                } else {
                    let x0: &[u8] = if me == 0 {
                        own
                    } else {
                        peers[0][0].view(cx, at, k, ta)?
                    };
                    #[allow(clippy::needless_range_loop)]
                    // p is a rank, used for more than indexing
                    for p in 1..n {
                        let xp: &[u8] = if p == me {
                            own
                        } else {
                            peers[p][0].view(cx, at, k, tb)?
                        };
                        if p == 1 {
                            reduce::reduce_into(c.dtype, c.op, acc, x0, xp);
                        } else {
                            reduce::reduce_inplace(c.dtype, c.op, acc, xp);
                        }
                    }
                }
                if c.op == ReduceOp::Avg {
                    reduce::divide_by(c.dtype, acc, n);
                }
                for &(p, base) in &dests {
                    if p == me {
                        // SAFETY: `base + off + k <= out_len` (this rank's block, or all of
                        // its output for reduce_scatter); `acc` is a separate buffer, and
                        // `own` is not used past this point.
                        let to = unsafe { std::slice::from_raw_parts_mut(outp.add(base + off), k) };
                        copy(nt, to, acc);
                    } else {
                        peers[p][1].write(cx, base + off, acc, nt)?;
                    }
                }
                off += k;
            }
        }
        CollKind::AllGather => {
            // Block q of rank p's output is pushed by q where p's output is a shared buffer
            // (q reads each chunk of its input once and writes it into every such output),
            // else pulled by p; every rank knows which outputs were published as shared.
            let pushed = |p: usize| peers[p][1].published;
            // SAFETY: block `me` of this rank's output (`(me + 1) * bytes <= out_len`); only
            // this rank writes it, through this pointer.
            let own_block = unsafe { outp.add(me * bytes) };
            let in_place = own_block.cast_const() == inp;
            let pushing = (0..n).any(|p| p != me && pushed(p));
            let mut off = 0;
            while off < bytes && pushing {
                let k = CHUNK.min(bytes - off);
                // SAFETY: `off + k <= bytes <= in_len`; nobody writes this rank's input.
                let src = unsafe { std::slice::from_raw_parts(inp.add(off), k) };
                if !in_place {
                    // SAFETY: within `own_block`, which only this rank writes.
                    read_own(off, unsafe {
                        std::slice::from_raw_parts_mut(own_block.add(off), k)
                    });
                }
                for p in (0..n).filter(|&p| p != me && pushed(p)) {
                    peers[p][1].write(cx, me * bytes + off, src, nt)?;
                }
                off += k;
            }
            // This rank's own block, unless copied above or already there (in place).
            if !pushing && !in_place {
                // SAFETY: `own_block` is valid for `bytes` bytes and written only here.
                read_own(0, unsafe {
                    std::slice::from_raw_parts_mut(own_block, bytes)
                });
            }
            if !pushed(me) {
                for p in (0..n).filter(|&p| p != me) {
                    // SAFETY: block `p` of this rank's output; nobody pushes into an output
                    // that was not published as shared, and this rank writes it only here.
                    let dst = unsafe { std::slice::from_raw_parts_mut(outp.add(p * bytes), bytes) };
                    peers[p][0].read(cx, 0, dst, nt)?;
                }
            }
        }
        CollKind::AllToAll => {
            let out = whole_out();
            for p in 0..n {
                let dst = &mut out[p * bytes..(p + 1) * bytes];
                if p == me {
                    read_own(me * bytes, dst);
                } else {
                    peers[p][0].read(cx, me * bytes, dst, nt)?;
                }
            }
        }
        CollKind::Broadcast => {
            // The root shares the copying: it writes part of each peer's output itself while
            // the peers read the rest (every rank learns from the root's addresses whether it
            // is in place, so they agree on the parts). In place, the root has nothing of its
            // own to copy and writes block p into each peer p. Out of place it must also copy
            // its input to its output, at memcpy speed, about twice the kernel's
            // cross-process copy here: it writes the last 1/(2n) of every peer's output. Where
            // its input is a shared buffer, peers copy at memcpy speed too, and the root's own
            // copy is its whole share.
            let root = c.root;
            let in_place = peers[root][0].addr == peers[root][1].addr;
            let root_part = |p: usize| {
                let (s, l) = if in_place {
                    block(c.count, n, p)
                } else if peers[root][0].published {
                    (c.count, 0)
                } else {
                    let k = c.count / (2 * n);
                    (c.count - k, k)
                };
                (s * es, l * es)
            };
            if me == root {
                for p in (0..n).filter(|&p| p != root && root_part(p).1 > 0) {
                    let (s, l) = root_part(p);
                    // SAFETY: `s + l <= bytes`, within the root's input, which nobody writes in
                    // this call.
                    let src = unsafe { std::slice::from_raw_parts(inp.add(s), l) };
                    peers[p][1].write(cx, s, src, nt)?;
                }
                if !in_place {
                    read_own(0, &mut whole_out()[..bytes]);
                }
            } else {
                let (s, l) = root_part(me);
                for (from, to) in [(0, s), (s + l, bytes)] {
                    if to > from {
                        // SAFETY: within the output (`to <= bytes <= out_len`); while the root
                        // writes `s..s + l` of it, this rank touches only the other bytes,
                        // through separate slices built here.
                        let dst =
                            unsafe { std::slice::from_raw_parts_mut(outp.add(from), to - from) };
                        peers[root][0].read(cx, from, dst, nt)?;
                    }
                }
            }
        }
        _ => unreachable!("cma::run called for {}", c.kind.name()),
    }
    let done = cx.publish(&[], [0; 4]);
    cx.wait_all(done)
}
