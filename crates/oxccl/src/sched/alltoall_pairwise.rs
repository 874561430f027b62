//! Pairwise-exchange all-to-all: in step `s` (1..n) rank `r` sends its block for `r+s` and
//! receives the block of `r-s`. Every rank sends `(n-1)/n` of its input in `n-1` steps, one
//! peer at a time, so no link is asked for more than one message at once.

use super::{sub_mod, Buf, BufRange, Coll, Combine, Local, Schedule, Xfer};

/// The pairwise all-to-all schedule for `c` (`c.count` = elements per peer block).
pub(crate) fn schedule(c: &Coll) -> Schedule {
    let (n, r) = (c.nranks, c.rank);
    let bytes = c.count * c.dtype.size();
    let blk = |buf, i: usize| BufRange::new(buf, i * bytes, bytes);
    let mut s = Schedule::new("pairwise");
    s.push_local(Local::Copy {
        src: blk(Buf::Input, r),
        dst: blk(Buf::Output, r),
    });
    for step in 1..n {
        let to = (r + step) % n;
        let from = sub_mod(r, step, n);
        s.push_xfers([
            Xfer::Send {
                peer: to,
                src: blk(Buf::Input, to),
            },
            Xfer::Recv {
                peer: from,
                dst: blk(Buf::Output, from),
                combine: Combine::Store,
            },
        ]);
    }
    s
}
