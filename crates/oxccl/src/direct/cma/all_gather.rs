//! Single-copy all_gather: each rank pulls its peers' inputs into its output, or, into outputs
//! that are shared buffers, each rank pushes: it reads each chunk of its input once and writes
//! it into every such output.

use crate::base::error::Result;
use crate::direct::exec::DirectCtx;

use super::{Call, CHUNK};

/// Block `q` of rank `p`'s output is pushed by `q` where `p`'s output is a shared buffer, else
/// pulled by `p`; every rank knows which outputs were published as shared.
pub(super) fn run(cx: &DirectCtx<'_>, call: &Call<'_>) -> Result<()> {
    let (n, me, bytes, nt) = (call.c.nranks, call.c.rank, call.bytes, call.nt);
    let peers = &call.peers;
    let pushed = |p: usize| peers[p][1].published;
    // SAFETY: block `me` of this rank's output (`(me + 1) * bytes <= out_len`); only this rank
    // writes it, through this pointer.
    let own_block = unsafe { call.outp.add(me * bytes) };
    let in_place = own_block.cast_const() == call.inp;
    let pushing = (0..n).any(|p| p != me && pushed(p));
    let mut off = 0;
    while off < bytes && pushing {
        let k = CHUNK.min(bytes - off);
        // SAFETY: `off + k <= bytes <= in_len`; nobody writes this rank's input.
        let src = unsafe { std::slice::from_raw_parts(call.inp.add(off), k) };
        if !in_place {
            // SAFETY: within `own_block`, which only this rank writes.
            call.read_own(off, unsafe {
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
        call.read_own(0, unsafe {
            std::slice::from_raw_parts_mut(own_block, bytes)
        });
    }
    if !pushed(me) {
        for p in (0..n).filter(|&p| p != me) {
            // SAFETY: block `p` of this rank's output; nobody pushes into an output that was
            // not published as shared, and this rank writes it only here.
            let dst = unsafe { std::slice::from_raw_parts_mut(call.outp.add(p * bytes), bytes) };
            peers[p][0].read(cx, 0, dst, nt)?;
        }
    }
    Ok(())
}
