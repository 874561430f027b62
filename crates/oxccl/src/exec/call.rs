//! One call as the executors see it: which call, how it waits, its fingerprint and failure
//! hooks, and the communicator state it runs over. The communicator builds one [`Call`] per
//! collective; [`Call::collective`] gathers what the call's plan depends on (the agreement on
//! shared buffers, where [`Planner::ask`] asks for one), makes the plan
//! ([`crate::plan::call_plan`]) and hands the call to the one executor the plan names:
//! one-shot or single-copy in the direct area, or the schedule over the links.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::base::error::Result;
use crate::base::wait::{CallId, Spin, Waiter};
use crate::bootstrap::topo::Topology;
use crate::direct::agree::agree;
use crate::direct::exec::DirectCtx;
use crate::direct::link::Direct;
use crate::direct::{cma, oneshot};
use crate::exec::{execute, Buffers, Ctx, FaultHooks};
use crate::fault::fingerprint::{CallPrint, HEADER_BYTES};
use crate::fault::health::Health;
use crate::plan::call_plan::{Plan, Planner};
use crate::sched::{Algo, Coll};
use crate::transport::tcp::lazy::LazyTcp;
use crate::transport::Link;

/// One collective call: everything either executor needs besides the algorithm, the
/// collective and the buffers.
pub(crate) struct Call<'a> {
    /// This rank, the call's name and sequence number (for errors).
    pub id: CallId,
    /// Number of ranks.
    pub nranks: usize,
    /// How to spin before sleeping.
    pub spin: Spin,
    /// How long the whole call may take.
    pub timeout: Duration,
    /// The call's fingerprint, checked against every peer's.
    pub print: &'a CallPrint,
    /// The communicator's health: a failure elsewhere wakes and fails a waiting call.
    pub health: &'a Health,
    /// When set, receives the end time of each step or event (the timeline, `OXCCL_TRACE`).
    pub step_ends: Option<&'a mut Vec<Instant>>,
    /// Links indexed by peer rank (`None` for this rank).
    pub links: &'a mut [Option<Box<dyn Link>>],
    /// The host's direct area, when the communicator has one.
    pub direct: Option<&'a mut (dyn Direct + 'static)>,
    /// Scratch memory, grown to a schedule's need and reused across calls.
    pub scratch: &'a mut Vec<u64>,
    /// Call headers a point-to-point receive from any source read off peers' links before
    /// this call ([`FaultHooks::held`]).
    pub held: &'a mut [Option<[u8; HEADER_BYTES]>],
    /// Out-of-place results are written with streaming stores from this footprint on
    /// ([`Config::nt_bytes`](crate::base::param::Config::nt_bytes)).
    pub nt_bytes: usize,
    /// The TCP links not made yet (`OXCCL_TCP_CONNECT=lazy`): a schedule's missing links are
    /// made before its first step, within the call's timeout.
    pub lazy: Option<&'a mut LazyTcp>,
}

impl Call<'_> {
    /// Plans `coll` with `planner` and runs it as planned: first, where the plan depends on it
    /// ([`Planner::ask`]), the agreement on shared buffers in the direct area; then one-shot or
    /// single-copy in the direct area, or the algorithm's schedule over the links (`topo`
    /// joins `coll` for that), in what is left of the call's time. `first` is the plan before
    /// any agreement (`planner.plan(Sharing::NotAsked)`, what the call was recorded with as it
    /// began). Returns the plan that ran, the same on every rank.
    pub(crate) fn collective(
        self,
        planner: &Planner<'_>,
        first: Plan,
        mut coll: Coll,
        topo: Option<&Arc<Topology>>,
        bufs: &mut Buffers<'_>,
    ) -> Result<Plan> {
        let Call {
            id,
            nranks,
            spin,
            timeout,
            print,
            health,
            step_ends,
            links,
            direct,
            scratch,
            held,
            nt_bytes,
            lazy,
        } = self;
        let (mut step_ends, mut timeout, mut direct) = (step_ends, timeout, direct);
        let mut plan = first;
        if let Some(d) = direct.as_deref_mut() {
            let ask = planner.ask();
            if ask.is_some() || !matches!(plan, Plan::Schedule(_)) {
                let t0 = ask.is_some().then(Instant::now);
                let mut cx = DirectCtx {
                    direct: d,
                    nranks,
                    wait: Waiter::new(id, spin, timeout, false),
                    print: Some(print),
                    health: Some(health),
                    links: Some(&mut *links),
                    step_ends: step_ends.as_deref_mut(),
                    nt_bytes,
                };
                let agreed = match ask {
                    Some(ask) => {
                        let a = agree(&mut cx, ask, bufs)?;
                        plan = planner.plan(a.sharing);
                        Some(a)
                    }
                    None => None,
                };
                match (plan, agreed) {
                    (Plan::OneShot(slots), _) => {
                        oneshot::run(&mut cx, &coll, bufs, slots, agreed.map(|a| a.event))?;
                        return Ok(plan);
                    }
                    (Plan::SingleCopy { .. }, Some(a)) => {
                        cma::run(&mut cx, &coll, bufs, scratch, &a)?;
                        return Ok(plan);
                    }
                    (Plan::SingleCopy { .. }, None) => {
                        unreachable!("single-copy is planned only after an agreement")
                    }
                    // Some rank's buffers are private: every rank runs the schedule, in what
                    // is left of the call's time.
                    (Plan::Schedule(_), _) => {}
                }
                timeout = timeout.saturating_sub(t0.map_or(Duration::ZERO, |t| t.elapsed()));
            }
        }
        let Plan::Schedule(algo) = plan else {
            unreachable!("{plan:?} is planned only with a direct area")
        };
        coll.topo = topo.cloned();
        let sched = algo.schedule(&coll);
        debug_assert!(
            sched.validate(id.rank).is_ok(),
            "{:?}",
            sched.validate(id.rank)
        );
        if let Some(lazy) = lazy {
            let peers = sched
                .steps
                .iter()
                .flat_map(|s| s.xfers.iter().map(|x| x.peer()));
            let need = lazy.missing(peers);
            if !need.is_empty() {
                let t0 = Instant::now();
                let stop = || {
                    health
                        .is_failed()
                        .then(|| health.error(id.rank, id.call, id.seq))
                };
                for (p, link) in lazy.connect(&need, t0 + timeout, &stop, id.call, id.seq)? {
                    links[p] = Some(link);
                }
                // The links took part of the call's time.
                timeout = timeout.saturating_sub(t0.elapsed());
            }
        }
        let mut ctx = Ctx {
            rank: id.rank,
            links,
            dtype: coll.dtype,
            op: coll.op,
            nranks,
            spin,
            timeout,
            call: id.call,
            seq: id.seq,
            // Point-to-point peers may run the p2p engine, which copies through links.
            single_copy: algo != Algo::PointToPoint,
            guard: FaultHooks {
                print: Some(print),
                health: Some(health),
                step_ends,
                direct: direct.map(|d| &*d as &dyn Direct),
                held: Some(held),
            },
            messages: None,
        };
        execute(&mut ctx, &sched, bufs, scratch)?;
        Ok(plan)
    }
}
