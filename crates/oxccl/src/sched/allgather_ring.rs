//! Ring all-gather: each rank's block travels once around the ring.
//!
//! Rank `r` first places its input at block `r` of the output. In step `s` (0..n-1) it sends
//! block `r-s` to the right and stores block `r-s-1` from the left. Each rank sends
//! `(n-1)/n` of the output in `n-1` steps. The ring follows host order when the topology is
//! known ([`Ring`]): position `p` forwards the block of the rank `s` places to its left.

use super::placement::Ring;
use super::{Buf, BufRange, Coll, Combine, Local, Schedule, Xfer};

/// The ring all-gather schedule for `c` (`c.count` = elements per rank).
pub(crate) fn schedule(c: &Coll) -> Schedule {
    let (n, r) = (c.nranks, c.rank);
    let bytes = c.count * c.dtype.size();
    let blk = |i: usize| BufRange::new(Buf::Output, i * bytes, bytes);
    let mut s = Schedule::new("ring");
    s.push_local(Local::Copy {
        src: BufRange::new(Buf::Input, 0, bytes),
        dst: blk(r),
    });
    let ring = Ring::of(c);
    let (left, right) = (ring.left(), ring.right());
    for step in 0..n.saturating_sub(1) {
        let step = step as isize;
        s.push_xfers([
            Xfer::Send {
                peer: right,
                src: blk(ring.at(-step)),
            },
            Xfer::Recv {
                peer: left,
                dst: blk(ring.at(-step - 1)),
                combine: Combine::Store,
            },
        ]);
    }
    s
}
