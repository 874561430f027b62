//! Dissemination barrier: in round `k` rank `r` sends a one-byte token to `r+2^k` and waits
//! for one from `r-2^k`; after `ceil(log2 n)` rounds every rank has heard, directly or not,
//! from every other.

use super::{sub_mod, Buf, BufRange, Coll, Combine, Schedule, Xfer};

/// The dissemination barrier schedule for `c`.
pub(crate) fn schedule(c: &Coll) -> Schedule {
    let (n, r) = (c.nranks, c.rank);
    let mut s = Schedule::new("dissemination");
    s.scratch_bytes = 2;
    let mut dist = 1;
    while dist < n {
        s.push_xfers([
            Xfer::Send {
                peer: (r + dist) % n,
                src: BufRange::new(Buf::Scratch, 0, 1),
            },
            Xfer::Recv {
                peer: sub_mod(r, dist, n),
                dst: BufRange::new(Buf::Scratch, 1, 1),
                combine: Combine::Store,
            },
        ]);
        dist *= 2;
    }
    s
}
