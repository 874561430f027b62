//! Single-copy all_to_all: each rank reads block `me` of every peer's input into its output.

use crate::base::error::Result;
use crate::direct::exec::DirectCtx;

use super::Call;

/// Block `p` of this rank's output is block `me` of rank `p`'s input.
pub(super) fn run(cx: &DirectCtx<'_>, call: &Call<'_>) -> Result<()> {
    let (n, me, bytes) = (call.c.nranks, call.c.rank, call.bytes);
    // SAFETY: the output is valid for out_len bytes for the whole call; no peer touches it,
    // and this rank reads its own input through `read_own` (never through a reference
    // overlapping `out`).
    let out = unsafe { std::slice::from_raw_parts_mut(call.outp, call.out_len) };
    for p in 0..n {
        let dst = &mut out[p * bytes..(p + 1) * bytes];
        if p == me {
            call.read_own(me * bytes, dst);
        } else {
            call.peers[p][0].read(cx, me * bytes, dst, call.nt)?;
        }
    }
    Ok(())
}
