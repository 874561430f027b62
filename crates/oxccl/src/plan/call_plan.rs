//! One plan per call: how a collective runs, decided before any of its data moves
//! ([`plan`]), from the call, the communicator's tuning and cost model ([`Facts`]) and, where
//! the plan depends on it, what every rank said about its buffers ([`Sharing`]).
//!
//! The plan is one of three ways ([`Plan`]): one-shot through the direct area's slots,
//! single-copy straight between the ranks' buffers (loads and stores into peers' mapped shared
//! buffers, the kernel's cross-memory copies for private ones), or an algorithm's schedule over
//! the links. The executors only carry it out: none of them changes the way.
//!
//! Whether a rank's buffers lie in shared buffers is that rank's own fact, and the plan may
//! depend on every rank's: a call that would run one-shot or by a schedule goes single-copy
//! instead where every rank's buffers are shared. Where it does ([`ask`]), the ranks first
//! agree: each publishes where its buffers lie in the call's first direct event and reads
//! every peer's (`direct::agree`), and the agreement is an input of the plan. The agreement
//! is the event the call would publish first anyway (single-copy's buffers, one-shot's
//! input), so it costs no event more than the call did when the choice was made inside the
//! executors; a call whose plan does not depend on it (below `OXCCL_ONESHOT_MAPPED_MIN` and
//! `OXCCL_MAPPED_MIN`, on several hosts, without cross-memory access) agrees on nothing.
//!
//! Neither function does I/O or allocates: a call plans twice at most (the plan as far as it
//! is known when the call begins, for the flight recorder, and the final one after the
//! agreement), each a few comparisons on one host.

use crate::bootstrap::topo::Topology;
use crate::plan::cost::CostModel;
use crate::plan::tune::{self, Situation};
use crate::sched::{Algo, CollKind};

/// What the planner knows of a call before it runs, the same on every rank.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Facts {
    /// The call and the communicator's tuning, as the tuner sees them.
    pub situation: Situation,
    /// `OXCCL_ALGO`, where set.
    pub forced: Option<Algo>,
    /// One-shot calls from this input size on may run single-copy through shared buffers
    /// ([`Config::oneshot_mapped_min`](crate::base::param::Config::oneshot_mapped_min)).
    pub oneshot_mapped_min: usize,
}

/// What the ranks agreed about their buffers before the call was planned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sharing {
    /// Not asked: the plan does not depend on it ([`ask`] said `None`), or the agreement has
    /// not happened yet (the plan is then the one that runs unless every rank shares).
    NotAsked,
    /// Every rank's buffers are shared.
    All,
    /// Some ranks' are, some ranks' are not.
    Mixed,
    /// No rank's are.
    Nobody,
}

impl Sharing {
    /// The agreement from the number of ranks whose buffers are shared, out of `n`.
    pub(crate) fn of(sharing: usize, n: usize) -> Sharing {
        match sharing {
            s if s == n => Sharing::All,
            0 => Sharing::Nobody,
            _ => Sharing::Mixed,
        }
    }
}

/// What the ranks agree on before the call is planned: what each publishes in the call's
/// first direct event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ask {
    /// Where each rank's input and output lie in shared buffers; a rank shares when each of
    /// its buffers that is not empty does. The single-copy call's first event (large private
    /// buffers are registered for huge pages first: peers copy from them right after it).
    SingleCopy,
    /// The same, for a call that runs by a schedule unless every rank shares (nothing is
    /// registered: the schedule's executor registers what its links lend).
    Mapped,
    /// A rank whose input and output are both shared publishes where they lie, any other
    /// its input (in the slot, as one-shot does): where no rank shares, one-shot folds from
    /// this very event.
    OneShot,
}

/// How a one-shot call gets every rank's input into the slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Slots {
    /// Every rank publishes its input in the call's first event.
    Publish,
    /// Every rank published its input in the agreement ([`Ask::OneShot`]): fold from it.
    Agreed,
    /// Some ranks published their buffers in the agreement: every rank publishes its input
    /// in a second event.
    Again,
}

/// How a call runs: decided by [`plan`] before any data moves, carried out as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// One-shot through the direct area's slots (`direct::oneshot`).
    OneShot(Slots),
    /// Single-copy straight between the ranks' buffers (`direct::cma`), always after an
    /// agreement ([`Ask::SingleCopy`], [`Ask::Mapped`], [`Ask::OneShot`]) whose event it
    /// starts from. `mapped`: every rank's buffers are shared, so every access is a load or
    /// store into a mapping; else private buffers are reached by the kernel's cross-memory
    /// copies.
    SingleCopy {
        /// Every rank's buffers are shared.
        mapped: bool,
    },
    /// The algorithm's schedule over the links (`exec::execute`).
    Schedule(Algo),
}

impl Plan {
    /// The algorithm the plan runs ([`Algo::Cma`] for single-copy).
    pub(crate) fn algo(self) -> Algo {
        match self {
            Plan::OneShot(_) => Algo::OneShot,
            Plan::SingleCopy { .. } => Algo::Cma,
            Plan::Schedule(a) => a,
        }
    }

    /// The plan's name, as `oxccl perf`'s `algo` column, the flight recorder, the timeline
    /// and [`Communicator::last_algo`](crate::Communicator::last_algo) show it.
    pub(crate) fn name(self) -> &'static str {
        self.algo().name()
    }
}

/// A communicator's planner for one call: its cost model and topology, and the call's facts.
#[derive(Clone, Copy)]
pub(crate) struct Planner<'a> {
    /// The communicator's cost model (and through it the tuner).
    pub model: &'a CostModel,
    /// Which ranks share a host, where known.
    pub topo: Option<&'a Topology>,
    /// The call.
    pub facts: Facts,
}

impl Planner<'_> {
    /// [`ask`] for this call.
    pub(crate) fn ask(&self) -> Option<Ask> {
        ask(self.model, self.topo, &self.facts)
    }

    /// [`plan`] for this call.
    pub(crate) fn plan(&self, sharing: Sharing) -> Plan {
        plan(self.model, self.topo, &self.facts, sharing)
    }
}

/// The algorithm the tuner (one host) or the cost model (several) picks by size and shape.
fn chosen(model: &CostModel, topo: Option<&Topology>, f: &Facts) -> Algo {
    model.choose(&f.situation, topo, f.forced)
}

/// Whether a one-shot call may go single-copy through shared buffers: from
/// `oneshot_mapped_min` on, for the collectives single-copy folds from mapped buffers, where
/// ranks can reach each other's memory.
fn oneshot_may_map(f: &Facts) -> bool {
    let s = &f.situation;
    s.nranks > 1
        && s.input_bytes >= f.oneshot_mapped_min
        && matches!(
            s.kind,
            CollKind::AllReduce | CollKind::ReduceScatter | CollKind::AllGather
        )
        && s.cma
}

/// What the ranks must agree on before the call can be planned, or `None` where the plan
/// does not depend on their buffers ([`plan`] with [`Sharing::NotAsked`] is then final).
pub(crate) fn ask(model: &CostModel, topo: Option<&Topology>, f: &Facts) -> Option<Ask> {
    if !f.situation.direct {
        return None;
    }
    match chosen(model, topo, f) {
        Algo::OneShot => oneshot_may_map(f).then_some(Ask::OneShot),
        Algo::Cma => Some(Ask::SingleCopy),
        a => tune::mapped_first(&f.situation, f.forced, a).then_some(Ask::Mapped),
    }
}

/// The plan of a call: the tuner's or the cost model's algorithm, turned single-copy where
/// every rank's buffers are shared (`sharing`, agreed as [`ask`] says). Every rank plans
/// alike: every input is the same on all.
///
/// With [`Sharing::NotAsked`] where [`ask`] asks, the plan is the one that runs unless every
/// rank shares: what the call is known to run when it begins.
pub(crate) fn plan(
    model: &CostModel,
    topo: Option<&Topology>,
    f: &Facts,
    sharing: Sharing,
) -> Plan {
    let all = sharing == Sharing::All;
    match chosen(model, topo, f) {
        Algo::OneShot if f.situation.direct => {
            if !oneshot_may_map(f) {
                return Plan::OneShot(Slots::Publish);
            }
            match sharing {
                Sharing::All => Plan::SingleCopy { mapped: true },
                Sharing::Nobody => Plan::OneShot(Slots::Agreed),
                Sharing::Mixed => Plan::OneShot(Slots::Again),
                Sharing::NotAsked => Plan::OneShot(Slots::Publish),
            }
        }
        Algo::Cma if f.situation.direct => Plan::SingleCopy { mapped: all },
        a if all && f.situation.direct && tune::mapped_first(&f.situation, f.forced, a) => {
            Plan::SingleCopy { mapped: true }
        }
        a => Plan::Schedule(a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call of `bytes` on one host of two ranks (a direct area, cross-memory access), with
    /// the default thresholds but `cma_min` at 1 MiB.
    fn facts(kind: CollKind, bytes: usize) -> Facts {
        Facts {
            situation: Situation {
                kind,
                input_bytes: bytes,
                direct: true,
                cma: true,
                slot_bytes: 65536,
                nranks: 2,
                oneshot_max: 8192,
                cma_min: 1 << 20,
                mapped_min: 16384,
                deterministic: false,
            },
            forced: None,
            oneshot_mapped_min: 8192,
        }
    }

    fn topo(host_of: Vec<usize>) -> Topology {
        Topology::of_hosts(host_of)
    }

    /// The table: a call's facts and agreement, what it asks, and its plan.
    #[test]
    fn table() {
        use Sharing::*;
        let m = CostModel::default();
        let ar = CollKind::AllReduce;
        let one = |k, b| facts(k, b);
        let other_hosts = |k, b| Facts {
            situation: Situation {
                direct: false,
                cma: false,
                ..facts(k, b).situation
            },
            ..facts(k, b)
        };
        let no_cma = |k, b| Facts {
            situation: Situation {
                cma: false,
                ..facts(k, b).situation
            },
            ..facts(k, b)
        };
        let forced = |k, b, a| Facts {
            forced: Some(a),
            ..facts(k, b)
        };
        let det = |k, b| Facts {
            situation: Situation {
                deterministic: true,
                ..facts(k, b).situation
            },
            ..facts(k, b)
        };
        let sc = |mapped| Plan::SingleCopy { mapped };
        let ring = Plan::Schedule(Algo::Ring);
        #[rustfmt::skip]
        let rows: Vec<(&str, Facts, Option<Ask>, Sharing, Plan)> = vec![
            // Tiny calls: one-shot, nothing to agree on.
            ("8 B", one(ar, 8), None, NotAsked, Plan::OneShot(Slots::Publish)),
            ("barrier", one(CollKind::Barrier, 0), None, NotAsked, Plan::OneShot(Slots::Publish)),
            ("broadcast 8 KiB", one(CollKind::Broadcast, 8192), None, NotAsked,
                Plan::OneShot(Slots::Publish)),
            // One-shot from oneshot_mapped_min: agree, then slots or shared buffers.
            ("8 KiB, not yet agreed", one(ar, 8192), Some(Ask::OneShot), NotAsked,
                Plan::OneShot(Slots::Publish)),
            ("8 KiB, all shared", one(ar, 8192), Some(Ask::OneShot), All, sc(true)),
            ("8 KiB, none shared", one(ar, 8192), Some(Ask::OneShot), Nobody,
                Plan::OneShot(Slots::Agreed)),
            ("8 KiB, some shared", one(ar, 8192), Some(Ask::OneShot), Mixed,
                Plan::OneShot(Slots::Again)),
            ("8 KiB, no cma", no_cma(ar, 8192), None, NotAsked, Plan::OneShot(Slots::Publish)),
            // By size a schedule: single-copy from mapped_min where every rank shares.
            ("12 KiB", one(ar, 12288), None, NotAsked, ring),
            ("64 KiB, all shared", one(ar, 64 << 10), Some(Ask::Mapped), All, sc(true)),
            ("64 KiB, some shared", one(ar, 64 << 10), Some(Ask::Mapped), Mixed, ring),
            ("64 KiB, none shared", one(ar, 64 << 10), Some(Ask::Mapped), Nobody, ring),
            ("64 KiB, not yet agreed", one(ar, 64 << 10), Some(Ask::Mapped), NotAsked, ring),
            ("all_to_all 64 KiB, shared", one(CollKind::AllToAll, 64 << 10), Some(Ask::Mapped),
                All, sc(true)),
            ("deterministic 64 KiB", det(ar, 64 << 10), Some(Ask::Mapped), Mixed,
                Plan::Schedule(Algo::Ordered)),
            ("forced ring", forced(ar, 64 << 10, Algo::Ring), None, NotAsked, ring),
            ("forced ring, shared", forced(ar, 64 << 10, Algo::Ring), None, All, ring),
            // Large: single-copy, through mappings where every rank shares.
            ("1 MiB", one(ar, 1 << 20), Some(Ask::SingleCopy), Mixed, sc(false)),
            ("1 MiB, all shared", one(ar, 1 << 20), Some(Ask::SingleCopy), All, sc(true)),
            ("reduce 1 MiB", one(CollKind::Reduce, 1 << 20), Some(Ask::SingleCopy), Nobody,
                sc(false)),
            // No direct area, or no cross-memory access.
            ("other hosts", other_hosts(ar, 1 << 20), None, NotAsked, ring),
            ("other hosts, 8 B", other_hosts(ar, 8), None, NotAsked, ring),
            ("no cma, 1 MiB", no_cma(ar, 1 << 20), None, NotAsked, ring),
            ("broadcast, other hosts", other_hosts(CollKind::Broadcast, 1 << 20), None,
                NotAsked, Plan::Schedule(Algo::Chain)),
        ];
        for (what, f, asks, sharing, want) in rows {
            assert_eq!(ask(&m, None, &f), asks, "{what}: ask");
            assert_eq!(plan(&m, None, &f, sharing), want, "{what}: plan");
        }
    }

    /// On several hosts the cost model's all_reduce is the plan, and nothing is agreed.
    #[test]
    fn several_hosts_take_the_cost_model() {
        let m = CostModel::default();
        let four = topo(vec![0, 1, 2, 3]);
        let f = |bytes| Facts {
            situation: Situation {
                direct: false,
                cma: false,
                nranks: 4,
                ..facts(CollKind::AllReduce, bytes).situation
            },
            ..facts(CollKind::AllReduce, bytes)
        };
        for (bytes, algo) in [(8, Algo::Tree), (512 << 10, Algo::HalvingDoubling)] {
            assert_eq!(ask(&m, Some(&four), &f(bytes)), None);
            assert_eq!(
                plan(&m, Some(&four), &f(bytes), Sharing::NotAsked),
                Plan::Schedule(algo)
            );
        }
    }

    #[test]
    fn names_are_the_algorithms() {
        assert_eq!(Plan::OneShot(Slots::Again).name(), "oneshot");
        assert_eq!(Plan::SingleCopy { mapped: true }.name(), "cma");
        assert_eq!(Plan::Schedule(Algo::Tree).name(), "tree");
        assert_eq!(Sharing::of(2, 2), Sharing::All);
        assert_eq!(Sharing::of(0, 2), Sharing::Nobody);
        assert_eq!(Sharing::of(1, 2), Sharing::Mixed);
    }
}
