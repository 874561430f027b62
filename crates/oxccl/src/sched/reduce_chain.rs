//! Pipelined chain reduce: root+1 → root+2 → ... → root, in segments (positions in the
//! host-ordered ring of [`Ring`], so the chain crosses each host boundary once).
//!
//! The first rank of the chain sends its input; each middle rank receives segment `k`, adds
//! its input into a scratch accumulator and forwards segment `k-1`; the root adds its input
//! into the output. Each non-root rank sends the whole buffer once.

use super::placement::{root_pos, Ring};
use super::{segments, sub_mod, Buf, BufRange, Coll, Combine, Local, ReduceOp, Schedule, Xfer};

/// The chain reduce schedule for `c`.
pub(crate) fn schedule(c: &Coll) -> Schedule {
    let (n, es) = (c.nranks, c.dtype.size());
    let all = c.count * es;
    let mut s = Schedule::new("chain");
    if n == 1 {
        s.push_local(Local::Copy {
            src: BufRange::new(Buf::Input, 0, all),
            dst: BufRange::new(Buf::Output, 0, all),
        });
        return s;
    }
    let ring = Ring::of(c);
    let pos = sub_mod(ring.pos, root_pos(&ring, c.root) + 1, n);
    let (prev, next) = (ring.left(), ring.right());
    let segs: Vec<(usize, usize)> = segments(c.count, es, c.chunk_bytes)
        .map(|(st, l)| (st * es, l * es))
        .collect();
    let input = |(off, len): (usize, usize)| BufRange::new(Buf::Input, off, len);
    if pos == 0 {
        for &seg in &segs {
            s.push_xfers([Xfer::Send {
                peer: next,
                src: input(seg),
            }]);
        }
    } else if c.rank == c.root {
        for &seg in &segs {
            s.push_xfers([Xfer::Recv {
                peer: prev,
                dst: BufRange::new(Buf::Output, seg.0, seg.1),
                combine: Combine::Reduce { with: input(seg) },
            }]);
        }
        if c.op == ReduceOp::Avg {
            s.push_local(Local::DivideByRanks(BufRange::new(Buf::Output, 0, all)));
        }
    } else {
        s.scratch_bytes = all;
        let acc = |(off, len): (usize, usize)| BufRange::new(Buf::Scratch, off, len);
        for k in 0..=segs.len() {
            let mut xfers = Vec::new();
            if let Some(&seg) = segs.get(k) {
                xfers.push(Xfer::Recv {
                    peer: prev,
                    dst: acc(seg),
                    combine: Combine::Reduce { with: input(seg) },
                });
            }
            if k >= 1 {
                xfers.push(Xfer::Send {
                    peer: next,
                    src: acc(segs[k - 1]),
                });
            }
            s.push_xfers(xfers);
        }
    }
    s
}
