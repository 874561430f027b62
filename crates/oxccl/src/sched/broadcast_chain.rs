//! Pipelined chain broadcast: root → root+1 → ... → root-1, in segments (positions in the
//! host-ordered ring of [`Ring`], so the chain crosses each host boundary once).
//!
//! The buffer is cut into segments of `chunk_bytes`. Each non-root rank receives segment `k`
//! while it forwards segment `k-1`, so after the pipeline fills every link is busy. Each rank
//! but the last sends the whole buffer once; `K + n - 2` segment times in all for `K` segments.

use super::placement::{root_pos, Ring};
use super::{segments, sub_mod, Buf, BufRange, Coll, Combine, Local, Schedule, Xfer};

/// The chain broadcast schedule for `c`.
pub(crate) fn schedule(c: &Coll) -> Schedule {
    let (n, es) = (c.nranks, c.dtype.size());
    let all = c.count * es;
    let mut s = Schedule::new("chain");
    let ring = Ring::of(c);
    let pos = sub_mod(ring.pos, root_pos(&ring, c.root), n);
    if pos == 0 {
        s.push_local(Local::Copy {
            src: BufRange::new(Buf::Input, 0, all),
            dst: BufRange::new(Buf::Output, 0, all),
        });
    }
    if n == 1 {
        return s;
    }
    let (prev, next) = (ring.left(), ring.right());
    let segs: Vec<BufRange> = segments(c.count, es, c.chunk_bytes)
        .map(|(st, len)| BufRange::new(Buf::Output, st * es, len * es))
        .collect();
    if pos == 0 {
        for seg in &segs {
            s.push_xfers([Xfer::Send {
                peer: next,
                src: BufRange {
                    buf: Buf::Input,
                    ..*seg
                },
            }]);
        }
        return s;
    }
    let last = pos == n - 1;
    for k in 0..=segs.len() {
        let mut xfers = Vec::new();
        if let Some(seg) = segs.get(k) {
            xfers.push(Xfer::Recv {
                peer: prev,
                dst: *seg,
                combine: Combine::Store,
            });
        }
        if !last && k >= 1 {
            xfers.push(Xfer::Send {
                peer: next,
                src: segs[k - 1],
            });
        }
        s.push_xfers(xfers);
    }
    s
}
