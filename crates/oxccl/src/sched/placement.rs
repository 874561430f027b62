//! Where ranks sit: the ring order that crosses each host boundary once, and each rank's
//! place among its host's ranks and among the hosts.
//!
//! Without a topology (one host, or the in-process tests) the ring order is rank order.
//! With one, it is the ranks of host 0 (in rank order), then those of host 1, and so on
//! (hosts numbered by their lowest rank, as [`Topology`] does), so a ring of `n` ranks on `H`
//! hosts uses each host's network link once in each direction instead of up to `n` times
//! when a launcher places ranks round-robin.

use super::Coll;
use crate::bootstrap::topo::Topology;

/// A ring of all ranks in host order, seen from one rank.
#[derive(Clone, Debug)]
pub(crate) struct Ring {
    order: Vec<usize>,
    /// This rank's position in the ring.
    pub pos: usize,
}

impl Ring {
    /// The ring for `c`'s rank: host order when `c.topo` is known, else rank order.
    pub(crate) fn of(c: &Coll) -> Ring {
        let order: Vec<usize> = match c.topo.as_deref() {
            Some(t) if t.host_of.len() == c.nranks => ring_order(t),
            _ => (0..c.nranks).collect(),
        };
        let pos = order.iter().position(|&r| r == c.rank).unwrap_or(0);
        Ring { order, pos }
    }

    /// The rank at position `pos + delta` (mod n; `delta` may be negative).
    pub(crate) fn at(&self, delta: isize) -> usize {
        let n = self.order.len() as isize;
        self.order[((self.pos as isize + delta).rem_euclid(n)) as usize]
    }

    /// The rank at position `pos` (`pos < len()`).
    pub(crate) fn rank_at(&self, pos: usize) -> usize {
        self.order[pos]
    }

    /// The left neighbour (sends to this rank).
    pub(crate) fn left(&self) -> usize {
        self.at(-1)
    }

    /// The right neighbour (this rank sends to it).
    pub(crate) fn right(&self) -> usize {
        self.at(1)
    }
}

/// The position of rank `root` in `ring`. Chains (broadcast, reduce) run in ring order from
/// the root, so they too cross each host boundary once.
pub(crate) fn root_pos(ring: &Ring, root: usize) -> usize {
    ring.order.iter().position(|&r| r == root).unwrap_or(0)
}

/// Every rank, host by host: the ring order that crosses each host boundary once.
pub(crate) fn ring_order(t: &Topology) -> Vec<usize> {
    t.hosts.iter().flatten().copied().collect()
}

/// `c.rank`'s view of a two-level placement: its host's ranks (in rank order), its index
/// among them, and for each host its ranks. `None` when `c.topo` is absent or does not
/// describe `c.nranks` ranks.
pub(crate) fn levels(c: &Coll) -> Option<(&[usize], usize, &Topology)> {
    let t = c.topo.as_deref()?;
    if t.host_of.len() != c.nranks || c.rank >= c.nranks {
        return None;
    }
    let h = t.host_of[c.rank];
    let local = &t.hosts[h];
    let j = local.iter().position(|&r| r == c.rank)?;
    Some((local, j, t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::dtype::DataType;
    use crate::base::op::ReduceOp;
    use crate::sched::CollKind;
    use std::sync::Arc;

    #[test]
    fn cyclic_placement_crosses_each_host_once() {
        // Ranks 0,2 on host 0; 1,3 on host 1 (round-robin placement).
        let t = Topology {
            host_of: vec![0, 1, 0, 1],
            hosts: vec![vec![0, 2], vec![1, 3]],
        };
        assert_eq!(ring_order(&t), vec![0, 2, 1, 3]);
        let c = Coll {
            kind: CollKind::AllReduce,
            rank: 2,
            nranks: 4,
            count: 8,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            root: 0,
            chunk_bytes: 64,
            topo: Some(Arc::new(t)),
            blocks: None,
        };
        let ring = Ring::of(&c);
        assert_eq!((ring.pos, ring.left(), ring.right()), (1, 0, 1));
        let crossings = (0..4)
            .filter(|&p| {
                let o = ring_order(c.topo.as_deref().unwrap());
                let t = c.topo.as_deref().unwrap();
                t.host_of[o[p]] != t.host_of[o[(p + 1) % 4]]
            })
            .count();
        assert_eq!(
            crossings, 2,
            "one crossing per host boundary each way round"
        );
    }
}
