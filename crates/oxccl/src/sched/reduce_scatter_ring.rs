//! Ring reduce-scatter: partial sums travel around the ring and end at their owner.
//!
//! In step `s` (0..n-1) rank `r` sends the partial sum of block `r-s-1` to the right and
//! receives that of block `r-s-2` from the left, adding its own input block. Partial sums live
//! in two alternating scratch blocks; the last step (block `r`) lands in the output. Each rank
//! sends `(n-1)/n` of the input in `n-1` steps. The ring follows host order when the
//! topology is known ([`Ring`]); "block `r-s-1`" is then the block of the rank `s+1` places to
//! the left.

use super::placement::Ring;
use super::{Buf, BufRange, Coll, Combine, Local, ReduceOp, Schedule, Xfer};

/// The ring reduce-scatter schedule for `c` (`c.count` = elements per rank's block).
pub(crate) fn schedule(c: &Coll) -> Schedule {
    let n = c.nranks;
    let bytes = c.count * c.dtype.size();
    let input = |i: usize| BufRange::new(Buf::Input, i * bytes, bytes);
    let out = BufRange::new(Buf::Output, 0, bytes);
    let mut s = Schedule::new("ring");
    if n == 1 {
        s.push_local(Local::Copy {
            src: input(0),
            dst: out,
        });
        return s;
    }
    s.scratch_bytes = if n > 2 { 2 * bytes } else { 0 };
    let scratch = |i: usize| BufRange::new(Buf::Scratch, (i % 2) * bytes, bytes);
    let ring = Ring::of(c);
    let (left, right) = (ring.left(), ring.right());
    for step in 0..n - 1 {
        let send_b = ring.at(-(step as isize) - 1);
        let recv_b = ring.at(-(step as isize) - 2);
        let src = if step == 0 {
            input(send_b)
        } else {
            scratch(step - 1)
        };
        let dst = if step == n - 2 { out } else { scratch(step) };
        s.push_xfers([
            Xfer::Send { peer: right, src },
            Xfer::Recv {
                peer: left,
                dst,
                combine: Combine::Reduce {
                    with: input(recv_b),
                },
            },
        ]);
    }
    if c.op == ReduceOp::Avg {
        s.push_local(Local::DivideByRanks(out));
    }
    s
}
