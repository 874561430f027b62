//! Single-copy broadcast: every rank reads the root's input while the root writes part of each
//! peer's output itself.
//!
//! Every rank learns from the root's addresses whether it is in place, so they agree on the
//! parts. In place, the root has nothing of its own to copy and writes block `p` into each
//! peer `p`. Out of place it must also copy its input to its output, at memcpy speed, about
//! twice the kernel's cross-process copy here: it writes the last `1/(2n)` of every peer's
//! output. Where its input is a shared buffer, peers copy at memcpy speed too, and the root's
//! own copy is its whole share.

use crate::base::error::Result;
use crate::direct::exec::DirectCtx;
use crate::sched::block;

use super::Call;

/// Runs the broadcast's part of this rank.
pub(super) fn run(cx: &DirectCtx<'_>, call: &Call<'_>) -> Result<()> {
    let c = call.c;
    let (n, me, es, bytes, nt) = (c.nranks, c.rank, c.dtype.size(), call.bytes, call.nt);
    let (root, peers) = (c.root, &call.peers);
    let in_place = peers[root][0].addr == peers[root][1].addr;
    // The bytes of peer `p`'s output that the root writes.
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
            // SAFETY: `s + l <= bytes`, within the root's input, which nobody writes in this
            // call.
            let src = unsafe { std::slice::from_raw_parts(call.inp.add(s), l) };
            peers[p][1].write(cx, s, src, nt)?;
        }
        if !in_place {
            // SAFETY: the output is valid for out_len >= bytes bytes for the whole call; no
            // peer touches the root's output, and this rank reads its own input through
            // `read_own` (never through a reference overlapping it).
            let out = unsafe { std::slice::from_raw_parts_mut(call.outp, bytes) };
            call.read_own(0, out);
        }
    } else {
        let (s, l) = root_part(me);
        for (from, to) in [(0, s), (s + l, bytes)] {
            if to > from {
                // SAFETY: within the output (`to <= bytes <= out_len`); while the root writes
                // `s..s + l` of it, this rank touches only the other bytes, through separate
                // slices built here.
                let dst = unsafe { std::slice::from_raw_parts_mut(call.outp.add(from), to - from) };
                peers[root][0].read(cx, from, dst, nt)?;
            }
        }
    }
    Ok(())
}
