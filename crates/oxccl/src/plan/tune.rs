//! Tuning: which algorithm runs a call on one host ([`choose`]).
//!
//! `OXCCL_ALGO` (or [`crate::Config::algo`]) wins where it can run the call. Otherwise, when
//! every rank shares the host (a direct area), one-shot for small inputs and single-copy for
//! large ones (thresholds: `OXCCL_ONESHOT_MAX` and `OXCCL_CMA_MIN` where set, else what
//! `oxccl tune` measured, else the defaults); under `OXCCL_DETERMINISTIC=1` reductions take
//! a rank-ordered algorithm; else each collective's default schedule ([`default_algo`]).
//! A call that by size runs neither one-shot nor single-copy runs single-copy instead when every
//! rank's buffers are shared ([`mapped_first`], `OXCCL_MAPPED_MIN`). The call's plan is made
//! from these in [`crate::plan::call_plan`].
//! Across hosts the cost model ([`crate::plan::cost`]) picks the all_reduce and defers here
//! for the rest.

use crate::sched::{Algo, CollKind};

/// The algorithm a collective uses unless one is forced.
pub(crate) fn default_algo(kind: CollKind) -> Algo {
    match kind {
        CollKind::AllReduce | CollKind::AllGather | CollKind::ReduceScatter => Algo::Ring,
        CollKind::Broadcast | CollKind::Reduce => Algo::Chain,
        CollKind::AllToAll => Algo::Pairwise,
        CollKind::Barrier => Algo::Dissemination,
        CollKind::Gather | CollKind::Scatter | CollKind::AllToAllV => Algo::Flat,
        CollKind::SendRecv { .. } | CollKind::Send { .. } | CollKind::Recv { .. } => {
            Algo::PointToPoint
        }
    }
}

/// What the tuner knows about a call and the communicator.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Situation {
    /// The collective.
    pub kind: CollKind,
    /// Bytes of one rank's input (the whole buffer for all_reduce, broadcast, reduce).
    pub input_bytes: usize,
    /// Whether every rank shares this host and the direct area is set up.
    pub direct: bool,
    /// Whether ranks can read each other's memory (`process_vm_readv`).
    pub cma: bool,
    /// Capacity of a direct slot (the most one-shot can carry).
    pub slot_bytes: usize,
    /// Ranks in the communicator.
    pub nranks: usize,
    /// Largest input that goes one-shot with two ranks (`OXCCL_ONESHOT_MAX`); with `n` ranks
    /// the limit is `n - 1` times larger (up to a slot): one handshake replaces the ring's
    /// `2(n-1)` steps, which cost more the more ranks share the cores.
    pub oneshot_max: usize,
    /// Smallest input that goes single-copy (`OXCCL_CMA_MIN`).
    pub cma_min: usize,
    /// Smallest input that goes single-copy below `cma_min` when every rank's buffers are
    /// shared (`OXCCL_MAPPED_MIN`, [`mapped_first`]).
    pub mapped_min: usize,
    /// Reductions must combine in rank order (`OXCCL_DETERMINISTIC=1`).
    pub deterministic: bool,
}

/// Whether `algo` can run this call at all.
pub(crate) fn feasible(algo: Algo, s: &Situation) -> bool {
    algo.supports(s.kind)
        && match algo {
            Algo::OneShot => s.direct && s.input_bytes <= s.slot_bytes,
            Algo::Cma => s.direct && s.cma,
            _ => true,
        }
}

/// The algorithm for a call: `forced` where it can run the call, else by size: one-shot for
/// small inputs on one host, single-copy for large ones, the default schedule otherwise.
pub(crate) fn choose(s: &Situation, forced: Option<Algo>) -> Algo {
    let reduces = matches!(
        s.kind,
        CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter
    );
    // Bitwise reproducibility: only algorithms that combine in rank order may reduce.
    let allowed = |a: Algo| feasible(a, s) && (!s.deterministic || !reduces || a.rank_ordered());
    if let Some(a) = forced.filter(|a| allowed(*a)) {
        return a;
    }
    if s.kind == CollKind::Barrier && s.direct {
        return Algo::OneShot;
    }
    let oneshot_max = s
        .oneshot_max
        .saturating_mul(s.nranks.saturating_sub(1).max(1));
    if allowed(Algo::OneShot) && s.input_bytes <= oneshot_max {
        return Algo::OneShot;
    }
    if allowed(Algo::Cma) && s.input_bytes >= s.cma_min {
        return Algo::Cma;
    }
    if s.deterministic && reduces {
        return Algo::Ordered;
    }
    default_algo(s.kind)
}

/// Whether a call that [`choose`] gave `chosen` (with `forced` as `OXCCL_ALGO`) runs
/// single-copy instead where every rank has its input and output in shared buffers: on one
/// host, from `mapped_min` on, for a collective single-copy runs, unless the algorithm was
/// forced or is a direct one already (one-shot has its own threshold,
/// `OXCCL_ONESHOT_MAPPED_MIN`). Whether buffers are shared is each rank's own fact: the ranks
/// agree on it before the call is planned ([`crate::plan::call_plan`]), which runs `chosen`
/// unless every rank shares.
///
/// `cma_min` is measured for the kernel's cross-memory copies (`process_vm_readv`), whose
/// system calls make single-copy slower than the ring up to megabytes on some hosts (what
/// `oxccl tune` saves there); loads and stores into mapped buffers cost no system call.
pub(crate) fn mapped_first(s: &Situation, forced: Option<Algo>, chosen: Algo) -> bool {
    forced != Some(chosen)
        && !chosen.on_direct_area()
        && feasible(Algo::Cma, s)
        && s.input_bytes >= s.mapped_min
        && s.nranks > 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sit(kind: CollKind, input_bytes: usize, direct: bool) -> Situation {
        Situation {
            kind,
            input_bytes,
            direct,
            cma: direct,
            slot_bytes: 65536,
            nranks: 2,
            oneshot_max: 8192,
            cma_min: 65536,
            mapped_min: 8192,
            deterministic: false,
        }
    }

    /// With `cma_min` at 2 MiB (a value `oxccl tune` saves on some hosts), calls from
    /// `mapped_min` that would go by ring try the shared buffers first; forced algorithms,
    /// one-shot and single-copy calls, other hosts and collectives single-copy does not run
    /// do not.
    #[test]
    fn shared_buffers_have_their_own_threshold() {
        let tuned = |kind, bytes| Situation {
            cma_min: 2 << 20,
            ..sit(kind, bytes, true)
        };
        let first = |s: &Situation, forced: Option<Algo>| {
            let a = choose(s, forced);
            (a, mapped_first(s, forced, a))
        };
        assert_eq!(
            first(&tuned(CollKind::AllReduce, 8), None),
            (Algo::OneShot, false)
        );
        for bytes in [64 << 10, 1 << 20, (2 << 20) - 4] {
            assert_eq!(
                first(&tuned(CollKind::AllReduce, bytes), None),
                (Algo::Ring, true),
                "{bytes}"
            );
        }
        assert_eq!(
            first(&tuned(CollKind::AllReduce, 2 << 20), None),
            (Algo::Cma, false)
        );
        for kind in [
            CollKind::Broadcast,
            CollKind::Reduce,
            CollKind::AllGather,
            CollKind::ReduceScatter,
            CollKind::AllToAll,
        ] {
            let (a, m) = first(&tuned(kind, 1 << 20), None);
            assert!(m && a == default_algo(kind), "{kind:?}: {a:?}");
        }
        assert_eq!(
            first(&tuned(CollKind::Barrier, 0), None),
            (Algo::OneShot, false)
        );
        assert_eq!(
            first(&tuned(CollKind::AllReduce, 1 << 20), Some(Algo::Ring)),
            (Algo::Ring, false),
            "forced"
        );
        assert_eq!(
            first(&tuned(CollKind::AllReduce, 1 << 20), Some(Algo::OneShot)),
            (Algo::Ring, true),
            "forced but infeasible: as unforced"
        );
        let other_hosts = Situation {
            direct: false,
            cma: false,
            ..tuned(CollKind::AllReduce, 1 << 20)
        };
        assert_eq!(first(&other_hosts, None), (Algo::Ring, false));
        let no_cma = Situation {
            cma: false,
            ..tuned(CollKind::AllReduce, 1 << 20)
        };
        assert_eq!(first(&no_cma, None), (Algo::Ring, false));
        let high = Situation {
            mapped_min: 4 << 20,
            ..tuned(CollKind::AllReduce, 1 << 20)
        };
        assert_eq!(first(&high, None), (Algo::Ring, false));
        let det = Situation {
            deterministic: true,
            ..tuned(CollKind::AllReduce, 1 << 20)
        };
        assert_eq!(first(&det, None), (Algo::Ordered, true));
    }

    #[test]
    fn forced_only_where_it_fits() {
        assert_eq!(
            choose(&sit(CollKind::AllReduce, 8, false), Some(Algo::Chain)),
            Algo::Ring
        );
        assert_eq!(
            choose(&sit(CollKind::Broadcast, 8, false), Some(Algo::Chain)),
            Algo::Chain
        );
        assert_eq!(
            choose(
                &sit(CollKind::AllReduce, 1 << 20, true),
                Some(Algo::OneShot)
            ),
            Algo::Cma,
            "too big for a slot"
        );
        assert_eq!(
            choose(&sit(CollKind::AllReduce, 8, false), Some(Algo::OneShot)),
            Algo::Ring,
            "no direct area"
        );
    }

    #[test]
    fn by_size_on_one_host() {
        assert_eq!(
            choose(&sit(CollKind::AllReduce, 8, true), None),
            Algo::OneShot
        );
        assert_eq!(
            choose(&sit(CollKind::AllReduce, 16384, true), None),
            Algo::Ring
        );
        assert_eq!(
            choose(&sit(CollKind::AllReduce, 1 << 20, true), None),
            Algo::Cma
        );
        assert_eq!(
            choose(&sit(CollKind::Reduce, 1 << 20, true), None),
            Algo::Cma
        );
        assert_eq!(
            choose(&sit(CollKind::Reduce, 1 << 20, false), None),
            Algo::Chain
        );
        assert_eq!(
            choose(&sit(CollKind::Barrier, 0, true), None),
            Algo::OneShot
        );
        assert_eq!(
            choose(&sit(CollKind::AllReduce, 1 << 20, false), None),
            Algo::Ring
        );
    }

    #[test]
    fn one_shot_reaches_further_with_more_ranks() {
        let eight = |bytes| Situation {
            nranks: 8,
            ..sit(CollKind::AllReduce, bytes, true)
        };
        assert_eq!(choose(&eight(50_000), None), Algo::OneShot);
        assert_eq!(choose(&eight(7 * 8192), None), Algo::OneShot);
        assert_eq!(choose(&eight(7 * 8192 + 1), None), Algo::Ring);
        assert_eq!(choose(&eight(70_000), None), Algo::Cma);
        let big = Situation {
            oneshot_max: 1 << 20,
            ..eight(65537)
        };
        assert_eq!(choose(&big, None), Algo::Cma, "never past a slot");
        assert_eq!(
            choose(&sit(CollKind::AllReduce, 50_000, true), None),
            Algo::Ring
        );
    }

    #[test]
    fn deterministic_reductions_are_rank_ordered() {
        let det = |kind, bytes, direct| Situation {
            deterministic: true,
            ..sit(kind, bytes, direct)
        };
        assert_eq!(
            choose(&det(CollKind::AllReduce, 16384, true), None),
            Algo::Ordered
        );
        assert_eq!(
            choose(&det(CollKind::AllReduce, 8, true), None),
            Algo::OneShot
        );
        assert_eq!(
            choose(&det(CollKind::AllReduce, 1 << 20, true), Some(Algo::Ring)),
            Algo::Cma
        );
        assert_eq!(
            choose(&det(CollKind::Reduce, 1 << 20, true), None),
            Algo::Cma
        );
        assert_eq!(
            choose(&det(CollKind::Reduce, 1 << 20, false), None),
            Algo::Ordered
        );
        assert_eq!(
            choose(&det(CollKind::AllReduce, 1 << 20, false), None),
            Algo::Ordered
        );
        assert_eq!(
            choose(&det(CollKind::AllGather, 1 << 20, false), None),
            Algo::Ring,
            "no reduction"
        );
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
