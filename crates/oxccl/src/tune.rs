//! Tuning: which algorithm runs a call.
//!
//! Today each collective has one algorithm ([`default_algo`]); `OXCCL_ALGO` (or
//! [`crate::Config::algo`]) forces one for every collective it implements. The cost model
//! that picks among several per call sits here as algorithms are added.

use crate::algo::{Algo, CollKind};

/// The algorithm a collective uses unless one is forced.
pub fn default_algo(kind: CollKind) -> Algo {
    match kind {
        CollKind::AllReduce | CollKind::AllGather | CollKind::ReduceScatter => Algo::Ring,
        CollKind::Broadcast | CollKind::Reduce => Algo::Chain,
        CollKind::AllToAll => Algo::Pairwise,
        CollKind::Barrier => Algo::Dissemination,
        CollKind::SendRecv { .. } | CollKind::Send { .. } | CollKind::Recv { .. } => Algo::Direct,
    }
}

/// The algorithm for `kind`: `forced` where it implements `kind`, else the default.
pub fn choose(kind: CollKind, forced: Option<Algo>) -> Algo {
    match forced {
        Some(a) if a.supports(kind) => a,
        _ => default_algo(kind),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_only_where_it_fits() {
        assert_eq!(choose(CollKind::AllReduce, Some(Algo::Chain)), Algo::Ring);
        assert_eq!(choose(CollKind::Broadcast, Some(Algo::Chain)), Algo::Chain);
        for k in [
            CollKind::AllReduce,
            CollKind::Broadcast,
            CollKind::Reduce,
            CollKind::AllGather,
            CollKind::ReduceScatter,
            CollKind::AllToAll,
            CollKind::Barrier,
            CollKind::Send { peer: 1 },
        ] {
            assert!(default_algo(k).supports(k));
        }
    }
}
