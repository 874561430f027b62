//! Ring all-reduce: a reduce-scatter around the ring, then an all-gather around it.
//!
//! The buffer is split into `n` blocks. In reduce-scatter step `s` (0..n-1) rank `r` sends
//! block `r-s` to its right neighbour and receives block `r-s-1` from its left, reducing it
//! with its own input; after `n-1` steps it holds block `r+1` fully reduced. In all-gather step
//! `s` it sends block `r+1-s` and stores block `r-s`. Each rank sends `2(n-1)/n` of the buffer
//! in `2(n-1)` steps: bandwidth-optimal, latency linear in `n`.
//!
//! "Rank" above means position in the ring, which follows host order when the topology is
//! known ([`placement::Ring`]): the ring then crosses each host boundary once.

use super::placement::{self, Ring};
use super::{block, sub_mod, Buf, BufRange, Coll, Combine, Local, ReduceOp, Schedule, Xfer};

/// The ring all-reduce schedule for `c`.
pub(crate) fn schedule(c: &Coll) -> Schedule {
    let ring: Ring = placement::Ring::of(c);
    let (n, r, es) = (c.nranks, ring.pos, c.dtype.size());
    let mut s = Schedule::new("ring");
    let blk = |buf, i| {
        let (start, len) = block(c.count, n, i);
        BufRange::new(buf, start * es, len * es)
    };
    let all = c.count * es;
    if n == 1 {
        s.push_local(Local::Copy {
            src: BufRange::new(Buf::Input, 0, all),
            dst: BufRange::new(Buf::Output, 0, all),
        });
        return s;
    }
    let (left, right) = (ring.left(), ring.right());
    for step in 0..n - 1 {
        let send_b = sub_mod(r, step, n);
        let recv_b = sub_mod(r, step + 1, n);
        let src = blk(if step == 0 { Buf::Input } else { Buf::Output }, send_b);
        s.push_xfers([
            Xfer::Send { peer: right, src },
            Xfer::Recv {
                peer: left,
                dst: blk(Buf::Output, recv_b),
                combine: Combine::Reduce {
                    with: blk(Buf::Input, recv_b),
                },
            },
        ]);
    }
    if c.op == ReduceOp::Avg {
        s.push_local(Local::DivideByRanks(blk(Buf::Output, (r + 1) % n)));
    }
    for step in 0..n - 1 {
        s.push_xfers([
            Xfer::Send {
                peer: right,
                src: blk(Buf::Output, sub_mod(r + 1, step, n)),
            },
            Xfer::Recv {
                peer: left,
                dst: blk(Buf::Output, sub_mod(r, step, n)),
                combine: Combine::Store,
            },
        ]);
    }
    s
}
