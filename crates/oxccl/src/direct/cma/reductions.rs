//! The single-copy reductions. Rank `r` owns block `r` of the data: for each chunk of it, it
//! reads the chunk of every rank's input (in rank order, so that every element is combined
//! the same way whoever owns it: identical bits on every rank) into cache-resident buffers,
//! folds them, and writes the result straight into the outputs that want it:
//!
//! - all_reduce: into every rank's output (one pass over memory: per rank `S` read and `S`
//!   written whatever the rank count);
//! - reduce_scatter: into the owner's output only;
//! - reduce: into the root's output only, so every rank reduces `1/n` of the data in parallel.
//!
//! The temporaries that the kernel's copies fill or drain start at the page offset of the
//! peer buffer they copy from or to ([`placement`](super::placement): some relative offsets
//! make those copies several times slower).

use std::ops::Range;

use crate::base::error::Result;
use crate::base::op::ReduceOp;
use crate::base::reduce;
use crate::direct::exec::DirectCtx;
use crate::sched::block;

use super::placement::{aligned_to, aligned_to_all, PAGE};
use super::{copy, Call, CHUNK};

/// all_reduce: this rank's block of the inputs, reduced into the same block of every output.
pub(super) fn all_reduce(cx: &DirectCtx<'_>, call: &Call<'_>, tmp: &mut Vec<u64>) -> Result<()> {
    let (start, len) = own_block(call);
    reduce_block(cx, call, tmp, start..start + len, 0..call.c.nranks, start)
}

/// reduce_scatter: this rank's block of the inputs (its `count` elements), reduced into its
/// own output.
pub(super) fn reduce_scatter(
    cx: &DirectCtx<'_>,
    call: &Call<'_>,
    tmp: &mut Vec<u64>,
) -> Result<()> {
    let (me, bytes) = (call.c.rank, call.bytes);
    reduce_block(cx, call, tmp, me * bytes..(me + 1) * bytes, me..me + 1, 0)
}

/// reduce: this rank's block of the inputs, reduced into the same block of the root's output.
pub(super) fn reduce(cx: &DirectCtx<'_>, call: &Call<'_>, tmp: &mut Vec<u64>) -> Result<()> {
    let (start, len) = own_block(call);
    let root = call.c.root;
    reduce_block(cx, call, tmp, start..start + len, root..root + 1, start)
}

/// Where this rank's block of an all_reduce or reduce starts, and its length, in bytes.
fn own_block(call: &Call<'_>) -> (usize, usize) {
    let c = call.c;
    let es = c.dtype.size();
    let (s, l) = block(c.count, c.nranks, c.rank);
    (s * es, l * es)
}

/// Reduces the bytes `block` of every rank's input, in rank order, and writes the result at
/// `at` of the outputs of `dests` (this rank's own included, if it is one of them).
fn reduce_block(
    cx: &DirectCtx<'_>,
    call: &Call<'_>,
    tmp: &mut Vec<u64>,
    block: Range<usize>,
    dests: Range<usize>,
    at: usize,
) -> Result<()> {
    let (c, peers, nt) = (call.c, &call.peers, call.nt);
    let (n, me, es) = (c.nranks, c.rank, c.dtype.size());
    // Three temporaries, each a chunk plus a page so that it can start at any page offset.
    let region = CHUNK + PAGE;
    let words = (3 * region).div_ceil(8);
    if tmp.len() < words {
        tmp.resize(words, 0);
    }
    let (ra, rest) = bytemuck::cast_slice_mut::<u64, u8>(tmp)[..3 * region].split_at_mut(region);
    let (rb, rc) = rest.split_at_mut(region);
    let chunk = CHUNK / es * es;
    let (start, len) = (block.start, block.len());
    // The outputs that the kernel writes `acc` into (peers' outputs not mapped here).
    let written: Vec<usize> = dests
        .clone()
        .filter(|&p| p != me && peers[p][1].local.is_none())
        .collect();
    let mut targets = Vec::with_capacity(written.len());
    let mut off = 0;
    while off < len {
        let k = chunk.min(len - off);
        let at_in = start + off;
        // SAFETY: `at_in + k <= in_len`; the input stays valid and, in this phase, only this
        // rank writes this block of it (after the last use of `own`).
        let own = unsafe { std::slice::from_raw_parts(call.inp.add(at_in), k) };
        targets.clear();
        targets.extend(
            written
                .iter()
                .map(|&p| peers[p][1].addr + (at + off) as u64),
        );
        let o = aligned_to_all(ra.as_ptr() as usize, &targets);
        let acc = &mut ra[o..o + k];
        // Rank order: acc = ((x0 ⊕ x1) ⊕ x2) ...
        if n == 1 {
            acc.copy_from_slice(own);
        } else {
            let x0: &[u8] = if me == 0 {
                own
            } else {
                peers[0][0].view(cx, at_in, k, placed(rb, peers[0][0].addr, at_in))?
            };
            #[allow(clippy::needless_range_loop)]
            // p is a rank, used for more than indexing
            for p in 1..n {
                let xp: &[u8] = if p == me {
                    own
                } else {
                    peers[p][0].view(cx, at_in, k, placed(rc, peers[p][0].addr, at_in))?
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
        for p in dests.clone() {
            if p == me {
                // SAFETY: `at + off + k <= out_len` (this rank's block, or all of its output
                // for reduce_scatter); `acc` is a separate buffer, and `own` is not used past
                // this point.
                let to = unsafe { std::slice::from_raw_parts_mut(call.outp.add(at + off), k) };
                copy(nt, to, acc);
            } else {
                peers[p][1].write(cx, at + off, acc, nt)?;
            }
        }
        off += k;
    }
    Ok(())
}

/// The part of `region` (a chunk plus a page) that starts at the page offset of the peer
/// address `addr + off`, for the kernel to read into.
fn placed(region: &mut [u8], addr: u64, off: usize) -> &mut [u8] {
    let o = aligned_to(region.as_ptr() as usize, addr + off as u64);
    &mut region[o..]
}
