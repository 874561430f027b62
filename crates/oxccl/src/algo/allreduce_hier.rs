//! Hierarchical all-reduce for ranks on several hosts (`H` hosts of `L` ranks each):
//!
//! 1. reduce-scatter inside each host (a ring over the host's ranks, shared memory): local
//!    rank `j` ends with block `j+1` of `L` reduced over its host;
//! 2. all-reduce of that block across hosts (a ring over the ranks with local index `j`, one
//!    per host, TCP), in place: reduce-scatter then all-gather of `H` sub-blocks;
//! 3. all-gather inside each host (the ring of step 1).
//!
//! Each host's network link carries `2(H-1)/H` of the buffer each way, against `2(n-1)/n`
//! for a flat ring of all `n = H·L` ranks, and the `L` ranks of a host drive it together.
//! Hosts with different numbers of ranks get the flat ring instead (labelled `ring`).

use super::placement::levels;
use super::{allreduce_ring, block, Buf, Coll, Combine, Local, ReduceOp, Region, Schedule, Xfer};

/// The hierarchical all-reduce schedule for `c` (the ring schedule when `c.topo` is absent
/// or its hosts differ in size).
pub fn schedule(c: &Coll) -> Schedule {
    let Some((local, j, topo)) = levels(c) else {
        return allreduce_ring::schedule(c);
    };
    let l = local.len();
    if topo.hosts.iter().any(|h| h.len() != l) {
        return allreduce_ring::schedule(c);
    }
    let hn = topo.hosts.len();
    let hi = topo.host_of[c.rank];
    let es = c.dtype.size();
    let mut s = Schedule::new("hier");
    // Blocks of the buffer owned by local index i, in elements.
    let lblk = |i: usize| block(c.count, l, i % l);
    let region = |buf, (start, len): (usize, usize)| Region::new(buf, start * es, len * es);
    let all = c.count * es;

    // 1. Reduce-scatter inside the host (ring over local indices).
    let (lleft, lright) = (local[(j + l - 1) % l], local[(j + 1) % l]);
    if l == 1 {
        s.push_local(Local::Copy {
            src: Region::new(Buf::Input, 0, all),
            dst: Region::new(Buf::Output, 0, all),
        });
    }
    for step in 0..l.saturating_sub(1) {
        let send_b = lblk(j + l - step);
        let recv_b = lblk(j + l - step - 1);
        let src = region(if step == 0 { Buf::Input } else { Buf::Output }, send_b);
        s.push_xfers([
            Xfer::Send { peer: lright, src },
            Xfer::Recv {
                peer: lleft,
                dst: region(Buf::Output, recv_b),
                combine: Combine::Reduce {
                    with: region(Buf::Input, recv_b),
                },
            },
        ]);
    }
    // This rank now holds block j+1 reduced over its host.
    let (mine_start, mine_len) = lblk(j + 1);
    let avg = c.op == ReduceOp::Avg;

    // 2. All-reduce of that block across hosts (ring over host indices), in place.
    let sub = |i: usize| {
        let (st, len) = block(mine_len, hn, i % hn);
        Region::new(Buf::Output, (mine_start + st) * es, len * es)
    };
    let (hleft, hright) = (
        topo.hosts[(hi + hn - 1) % hn][j],
        topo.hosts[(hi + 1) % hn][j],
    );
    for step in 0..hn.saturating_sub(1) {
        let recv = sub(hi + 2 * hn - step - 1);
        s.push_xfers([
            Xfer::Send {
                peer: hright,
                src: sub(hi + hn - step),
            },
            Xfer::Recv {
                peer: hleft,
                dst: recv,
                combine: Combine::Reduce { with: recv },
            },
        ]);
    }
    if avg {
        // Sub-block hi+1 is now reduced over every rank: divide it once, here.
        let done = if hn > 1 {
            sub(hi + 1)
        } else {
            region(Buf::Output, (mine_start, mine_len))
        };
        s.push_local(Local::DivideByRanks(done));
    }
    for step in 0..hn.saturating_sub(1) {
        s.push_xfers([
            Xfer::Send {
                peer: hright,
                src: sub(hi + 1 + hn - step),
            },
            Xfer::Recv {
                peer: hleft,
                dst: sub(hi + hn - step),
                combine: Combine::Store,
            },
        ]);
    }

    // 3. All-gather inside the host.
    for step in 0..l.saturating_sub(1) {
        s.push_xfers([
            Xfer::Send {
                peer: lright,
                src: region(Buf::Output, lblk(j + 1 + l - step)),
            },
            Xfer::Recv {
                peer: lleft,
                dst: region(Buf::Output, lblk(j + l - step)),
                combine: Combine::Store,
            },
        ]);
    }
    s
}
