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
//!
//! The buffer is cut into `K` chunks ([`chunks`]) that go through the three phases as a
//! pipeline: while chunk `c` crosses the network, the host's ranks all-gather chunk `c-1`
//! and reduce-scatter chunk `c+1` over shared memory (different peers, so one step can carry
//! both), leaving only the first chunk's reduce-scatter and the last one's all-gather
//! outside the network's busy time.
//!
//! Hosts with different numbers of ranks get the flat ring instead (labelled `ring`).

use super::placement::levels;
use super::{
    allreduce_ring, block, Buf, BufRange, Coll, Combine, Local, ReduceOp, Schedule, Step, Xfer,
};
use crate::bootstrap::topo::Topology;

/// Smallest chunk worth pipelining separately.
const MIN_CHUNK: usize = 2 << 20;
/// Most chunks.
const MAX_CHUNKS: usize = 8;

/// How many pipeline chunks a buffer of `bytes` gets.
pub(crate) fn chunks(bytes: usize) -> usize {
    (bytes / MIN_CHUNK).clamp(1, MAX_CHUNKS)
}

/// The hierarchical all-reduce schedule for `c` (the ring schedule when `c.topo` is absent
/// or its hosts differ in size).
pub(crate) fn schedule(c: &Coll) -> Schedule {
    let Some((local, j, topo)) = levels(c) else {
        return allreduce_ring::schedule(c);
    };
    let l = local.len();
    if topo.hosts.iter().any(|h| h.len() != l) {
        return allreduce_ring::schedule(c);
    }
    let k = chunks(c.count * c.dtype.size()).min(c.count.max(1));
    let phases: Vec<Phases> = (0..k)
        .map(|i| {
            let (start, len) = block(c.count, k, i);
            phases(c, local, j, topo, start, len)
        })
        .collect();
    let mut s = Schedule::new("hier");
    s.steps.extend(phases[0].rs.iter().cloned());
    for i in 0..k {
        let mut local_steps: Vec<Step> = Vec::new();
        if i > 0 {
            local_steps.extend(phases[i - 1].ag.iter().cloned());
        }
        if i + 1 < k {
            local_steps.extend(phases[i + 1].rs.iter().cloned());
        }
        let net = &phases[i].net;
        for t in 0..net.len().max(local_steps.len()) {
            let mut step = net.get(t).cloned().unwrap_or_default();
            if let Some(ls) = local_steps.get(t) {
                step.before.extend(ls.before.iter().copied());
                step.xfers.extend(ls.xfers.iter().copied());
                step.after.extend(ls.after.iter().copied());
            }
            s.steps.push(step);
        }
    }
    s.steps.extend(phases[k - 1].ag.iter().cloned());
    s
}

/// One chunk's three phases, as step lists.
struct Phases {
    rs: Vec<Step>,
    net: Vec<Step>,
    ag: Vec<Step>,
}

/// The phases for elements `first .. first + count` of the buffer.
fn phases(
    c: &Coll,
    local: &[usize],
    j: usize,
    topo: &Topology,
    first: usize,
    count: usize,
) -> Phases {
    let l = local.len();
    let hn = topo.hosts.len();
    let hi = topo.host_of[c.rank];
    let es = c.dtype.size();
    // Block of local index i, in elements of the whole buffer.
    let lblk = |i: usize| {
        let (st, len) = block(count, l, i % l);
        (first + st, len)
    };
    let region = |buf, (start, len): (usize, usize)| BufRange::new(buf, start * es, len * es);

    // 1. Reduce-scatter inside the host (ring over local indices).
    let mut rs = Schedule::new("hier");
    let (lleft, lright) = (local[(j + l - 1) % l], local[(j + 1) % l]);
    if l == 1 {
        rs.push_local(Local::Copy {
            src: region(Buf::Input, (first, count)),
            dst: region(Buf::Output, (first, count)),
        });
    }
    for step in 0..l.saturating_sub(1) {
        let send_b = lblk(j + l - step);
        let recv_b = lblk(j + l - step - 1);
        let src = region(if step == 0 { Buf::Input } else { Buf::Output }, send_b);
        rs.push_xfers([
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

    // 2. All-reduce of that block across hosts (ring over host indices), in place.
    let mut net = Schedule::new("hier");
    let sub = |i: usize| {
        let (st, len) = block(mine_len, hn, i % hn);
        BufRange::new(Buf::Output, (mine_start + st) * es, len * es)
    };
    let (hleft, hright) = (
        topo.hosts[(hi + hn - 1) % hn][j],
        topo.hosts[(hi + 1) % hn][j],
    );
    for step in 0..hn.saturating_sub(1) {
        let recv = sub(hi + 2 * hn - step - 1);
        net.push_xfers([
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
    if c.op == ReduceOp::Avg {
        // Reduced over every rank now: divide once, here.
        if hn > 1 {
            net.push_local(Local::DivideByRanks(sub(hi + 1)));
        } else {
            rs.push_local(Local::DivideByRanks(region(
                Buf::Output,
                (mine_start, mine_len),
            )));
        }
    }
    for step in 0..hn.saturating_sub(1) {
        net.push_xfers([
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
    let mut ag = Schedule::new("hier");
    for step in 0..l.saturating_sub(1) {
        ag.push_xfers([
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
    Phases {
        rs: rs.steps,
        net: net.steps,
        ag: ag.steps,
    }
}
