//! Waiting without burning a core: spin briefly, then sleep on a futex ("doorbell") or on
//! sockets.
//!
//! A [`Doorbell`] is an event count in memory that may be shared between processes (a
//! shared-memory segment) or private (the in-memory transport). A rank owns one doorbell;
//! every peer that makes progress that rank may be waiting for (writes data into a ring the
//! rank reads, or frees space in a ring the rank writes) calls [`Doorbell::ring`]. A waiter
//! calls [`Doorbell::prepare`], re-checks its condition, then [`Doorbell::wait`]: the futex
//! only sleeps if nobody rang in between, so no wake-up is lost.
//!
//! Correctness argument (a Dekker handshake; every access below is `SeqCst` or separated by a
//! `SeqCst` fence): the waiter does `sleepers += 1`, fence, reads `seq`, then checks its
//! condition; the ringer publishes its data, fence, then reads `sleepers`, and only if it is
//! non-zero does `seq += 1` and `futex_wake`. The two fences order the two store-then-load
//! pairs, so at least one side sees the other's store: either the ringer sees a sleeper (and
//! bumps `seq` and wakes it: the waiter's `futex_wait(seq, old)` sees the changed value or is
//! woken), or the waiter's re-check sees the published data and it does not sleep. A ringer
//! with nobody asleep writes nothing to the shared line: one fence and one load.
//!
//! Publishes without a fence ([`Doorbell::ring_after_release_store`]; meant for the direct
//! area's events on x86-64, which still publish with a `SeqCst` store: the fence-free publish
//! is measured in docs/decisions.md but not applied): a `SeqCst` store there is an
//! `xchg`, which holds the publisher until every line
//! it wrote is its own again, i.e. until the peer that polls them has given them up; only then
//! can it start polling the peer's. A `Release` store is a plain `mov` that waits in the store
//! buffer while the publisher goes on. The ringer's read of `sleepers` may then be performed
//! before its publish is visible (TSO lets a load pass an older store, and nothing else), so
//! the handshake above can fail: the ringer reads 0, the waiter announces itself and re-checks
//! before the publish drains. Such a waiter sleeps with [`Doorbell::wait_rechecking`]: at
//! most [`RING_GRACE`] (20 µs), then it looks again. The lost case needs the ringer's read
//! before the waiter's `sleepers += 1` (a locked add, visible when done) and its publish after
//! the waiter's re-check; a store becomes visible within a store buffer's drain of the read
//! after it, so by the second look, at least the grace after the add, the publish is visible.
//! A ringer whose read comes after the add sees the sleeper and rings, as above. A missed ring
//! thus costs that waiter the grace, not the sleep slice. `base::wait`'s tests model a ringer
//! whose read runs early by up to 10 µs, with ranks out of step: waits that only `wait` would
//! lose for ever, `wait_rechecking` finds at the second look. Without the model, on the
//! hardware (`release_publishes_on_this_hardware`, run by hand), plain waits lost 1 wake-up in
//! 200,000 out-of-step rounds on an AMD EPYC VM, rechecking waits none.
//!
//! Asymmetric fences (`OXCCL_MEMBARRIER=1`, off by default): where the kernel offers
//! `membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)`, a process registers for it on its first ring
//! and from then on rings with a compiler fence only, and every waiter calls `membarrier` after
//! `sleepers += 1`. The kernel then runs a full barrier on every CPU running a registered
//! process, which should stand in for the ringer's fence (the scheme liburcu and folly use):
//! if the barrier lands between the ringer's publish and its read of `sleepers`, it is the
//! fence; if before the publish, the ringer's read comes after the waiter's `sleepers += 1`
//! was visible; if after the read, the publish is visible before `membarrier` returns and the
//! waiter's re-check sees it. It saved about 0.05 µs on an 8-byte all_reduce (no hardware
//! fence on the ring's fast path) and cost the sleeper about 25 µs per sleep on a VM. It is
//! off by default because it loses wake-ups in practice: `shm_stress`'s `stress_rounded_ring`
//! (2 ranks as threads, 8 MiB each way through 5000-byte rings, spin 50, so both sleep often)
//! saw a 20 s sleep slice run out in 13 of 600 runs with it and in 0 of 900 without (kernel
//! 6.18 on a Firecracker VM, 2 vCPUs). The argument above does not account for it; a
//! suspect is the kernel's per-runqueue registration state, which a CPU idling in lazy-TLB
//! mode on the registered mm may not refresh when it switches back to a thread of that mm,
//! so that CPU would not be sent the barrier. Where a wake-up is lost, the waiter wakes at its
//! timeout slice (50 ms in the executors): slow, never a hang. Reproduce with
//! `for i in $(seq 600); do OXCCL_MEMBARRIER=1 target/debug/deps/shm_stress-* stress_rounded_ring || echo lost; done`.

use std::os::fd::{BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::thread::futex;

use crate::base::error::{Error, Result};

/// An event count used to sleep until a peer makes progress. `repr(C)` so that it can live in
/// shared memory at a fixed layout.
#[repr(C)]
#[derive(Debug, Default)]
pub struct Doorbell {
    seq: AtomicU32,
    sleepers: AtomicU32,
}

/// What [`Doorbell::prepare`] returns: the count seen before re-checking the condition.
#[derive(Debug, Clone, Copy)]
#[must_use = "pass the token to Doorbell::wait or Doorbell::cancel"]
pub struct DoorbellToken(u32);

/// Whether the kernel offers global expedited membarrier (queried once).
fn global_expedited_supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        use rustix::thread::{membarrier_query, MembarrierQuery};
        membarrier_query().contains(
            MembarrierQuery::GLOBAL_EXPEDITED | MembarrierQuery::REGISTER_GLOBAL_EXPEDITED,
        )
    })
}

/// Whether rings may skip the hardware fence (registers this process the first time).
fn fence_free() -> bool {
    static FENCE_FREE: OnceLock<bool> = OnceLock::new();
    *FENCE_FREE.get_or_init(|| {
        use rustix::thread::{membarrier, MembarrierCommand};
        // Fence-free only once registered: a waiter's barrier that ran before registration
        // did not reach this process, but this process still fenced then.
        crate::base::param::membarrier_allowed()
            && global_expedited_supported()
            && membarrier(MembarrierCommand::RegisterGlobalExpedited).is_ok()
    })
}

/// Before sleeping: a full barrier on every CPU running a registered process (see the
/// module's account of asymmetric fences; only where they are on).
fn waiter_barrier() {
    static ON: OnceLock<bool> = OnceLock::new();
    if *ON.get_or_init(|| crate::base::param::membarrier_allowed() && global_expedited_supported())
    {
        use rustix::thread::{membarrier, MembarrierCommand};
        let _ = membarrier(MembarrierCommand::GlobalExpedited);
    }
}

impl Doorbell {
    /// A new doorbell (all zero, which is also the state of fresh shared memory).
    pub const fn new() -> Self {
        Doorbell {
            seq: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
        }
    }

    /// Signals progress (to be called after publishing it); wakes the owner if it sleeps.
    /// Cheap when nobody sleeps: a fence and one load (the fence only a compiler fence with
    /// `OXCCL_MEMBARRIER=1`), no write, no system call.
    pub fn ring(&self) {
        if fence_free() {
            // Sleepers' membarrier provides the hardware barrier (module docs).
            std::sync::atomic::compiler_fence(Ordering::SeqCst);
        } else {
            std::sync::atomic::fence(Ordering::SeqCst);
        }
        self.ring_after_seqcst_store();
    }

    /// As [`ring`](Self::ring), for a caller whose publish was a `SeqCst` store (an `xchg` on
    /// x86, itself a full barrier): it orders the publish before this `SeqCst` load of the
    /// sleeper count, so no fence is needed. (If both the publish and the waiter's re-check
    /// missed each other, `S` would order the publish before this load, the load before the
    /// waiter's `sleepers += 1`, that before the waiter's fence and the fence before the
    /// publish: a cycle.) Several doorbells rung after one publish share its one barrier.
    pub fn ring_after_seqcst_store(&self) {
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            self.seq.fetch_add(1, Ordering::SeqCst);
            // Errors from futex_wake cannot be acted upon (the memory is valid while `self`
            // is borrowed); a lost wake-up is bounded by the waiter's timeout slice.
            let _ = futex::wake(&self.seq, futex::Flags::empty(), i32::MAX as u32);
        }
    }

    /// As [`ring`](Self::ring), for a caller whose publish was a `Release` store with no fence
    /// after it (meant for the direct area's events on x86-64; see the module docs): the load
    /// of the sleeper count may then
    /// be performed before other cores see the publish (store-load reordering, the one
    /// reordering x86 allows), so a waiter that announced itself in that window is not rung
    /// and its re-check may not see the publish yet. Waiters on such a doorbell therefore
    /// sleep with [`wait_rechecking`](Self::wait_rechecking), which looks again after
    /// [`RING_GRACE`], longer than a store waits in a store buffer: a publish that missed a
    /// waiter this way costs that waiter at most the grace, never a lost wake-up. (The module
    /// docs have the argument.)
    pub fn ring_after_release_store(&self) {
        // Keeps the compiler from hoisting the load above the publish: the window is then only
        // the hardware's.
        std::sync::atomic::compiler_fence(Ordering::SeqCst);
        self.ring_after_seqcst_store();
    }

    /// The sleeper count as a ringer reads it (for tests that model a ringer whose read ran
    /// early: [`ring_seen`](Self::ring_seen) then rings as that read decided).
    #[doc(hidden)]
    pub fn sleepers_seen(&self) -> u32 {
        self.sleepers.load(Ordering::SeqCst)
    }

    /// Rings as if the sleeper count read were `seen` (tests; see
    /// [`sleepers_seen`](Self::sleepers_seen)).
    #[doc(hidden)]
    pub fn ring_seen(&self, seen: u32) {
        if seen != 0 {
            self.seq.fetch_add(1, Ordering::SeqCst);
            let _ = futex::wake(&self.seq, futex::Flags::empty(), i32::MAX as u32);
        }
    }

    /// Announces that the caller is about to sleep; call before re-checking the condition.
    pub fn prepare(&self) -> DoorbellToken {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        waiter_barrier();
        DoorbellToken(self.seq.load(Ordering::SeqCst))
    }

    /// Withdraws a [`prepare`](Self::prepare) without sleeping (the condition held).
    pub fn cancel(&self, _token: DoorbellToken) {
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Sleeps until the doorbell rings after `token` was taken, or `timeout` passes, or a
    /// spurious wake-up. The caller re-checks its condition afterwards either way.
    pub fn wait(&self, token: DoorbellToken, timeout: Duration) {
        let ts = rustix::time::Timespec {
            tv_sec: timeout.as_secs() as _,
            tv_nsec: timeout.subsec_nanos() as _,
        };
        // EAGAIN (value changed), ETIMEDOUT and EINTR all mean "re-check": ignore them.
        crate::base::fork_gate::asleep(|| {
            let _ = futex::wait(&self.seq, futex::Flags::empty(), token.0, Some(&ts));
        });
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// As [`wait`](Self::wait), for a doorbell rung with
    /// [`ring_after_release_store`](Self::ring_after_release_store): sleeps at most
    /// [`RING_GRACE`] first and, unless rung meanwhile, asks `ready` again before sleeping the
    /// rest of `timeout`. A publish whose ring missed this waiter was visible within the grace
    /// of the waiter's announcement, so the second look sees it. Returns whether that second
    /// look found the condition met (a ring the publisher did not make: counted by tests).
    pub fn wait_rechecking(
        &self,
        token: DoorbellToken,
        timeout: Duration,
        ready: impl FnOnce() -> bool,
    ) -> bool {
        let grace = RING_GRACE.min(timeout);
        let ts = |d: Duration| rustix::time::Timespec {
            tv_sec: d.as_secs() as _,
            tv_nsec: d.subsec_nanos() as _,
        };
        // As in `wait`: every outcome means "look again".
        crate::base::fork_gate::asleep(|| {
            let _ = futex::wait(&self.seq, futex::Flags::empty(), token.0, Some(&ts(grace)));
        });
        let mut recovered = false;
        if self.seq.load(Ordering::SeqCst) == token.0 {
            // Not rung: still announced (the count is dropped below), so a ring from here on
            // finds this waiter; one that ran before was visible by now.
            recovered = ready();
            if !recovered && timeout > grace {
                crate::base::fork_gate::asleep(|| {
                    let _ = futex::wait(
                        &self.seq,
                        futex::Flags::empty(),
                        token.0,
                        Some(&ts(timeout - grace)),
                    );
                });
            }
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        recovered
    }
}

/// How long a waiter on a doorbell rung after `Release` publishes sleeps before it looks again
/// ([`Doorbell::wait_rechecking`]): far longer than a store waits in a core's store buffer
/// (well under a microsecond: the buffer drains on its own, whatever the core runs next, and
/// a VM exit or interrupt drains it too), short enough that a missed ring is not felt.
pub const RING_GRACE: Duration = Duration::from_micros(20);

/// How a waiting rank spins before it sleeps ([`Backoff`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spin {
    /// Progress checks before sleeping ([`Config::spin`](crate::base::param::Config::spin)).
    pub budget: u32,
    /// Progress checks before sleeping in a wait of the direct path (small calls), the most
    /// its learned budget reaches ([`Cadence`];
    /// [`Config::direct_spin`](crate::base::param::Config::direct_spin)).
    pub direct_budget: u32,
    /// Progress checks before sleeping while a transfer waited on is a socket's, where each
    /// check is a system call ([`Config::tcp_spin`](crate::base::param::Config::tcp_spin)).
    pub socket_budget: u32,
    /// Checks between two yields of the core
    /// ([`Config::yield_every`](crate::base::param::Config::yield_every)).
    pub yield_every: u32,
}

impl Spin {
    /// The waiting policy of the settings `cfg`, for a host where `local_ranks` ranks of the
    /// communicator run.
    pub(crate) fn from_config(cfg: &crate::base::param::Config, local_ranks: usize) -> Spin {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let oversubscribed = local_ranks > cpus;
        Spin {
            budget: cfg.spin,
            direct_budget: cfg.direct_spin.unwrap_or(if oversubscribed {
                cfg.spin
            } else {
                Spin::DIRECT_BUDGET
            }),
            socket_budget: cfg.tcp_spin,
            yield_every: cfg.yield_every.unwrap_or(if oversubscribed {
                1
            } else {
                Spin::YIELD_EVERY
            }),
        }
    }

    /// The direct path's spin where every rank has a CPU: about 3 ms of checks. Sleeping
    /// there costs the waker an idle CPU's wake-up on every call (tens of µs in a VM, the
    /// slow mode of docs/decisions.md, "A short spin on an idle machine"), and a peer with a CPU of its own
    /// arrives within microseconds; [`Cadence`] shortens it when peers do not.
    pub const DIRECT_BUDGET: u32 = 100_000;

    /// Rounds between yields on a host with a core for every rank.
    pub const YIELD_EVERY: u32 = 64;

    /// Spin `budget` rounds (on sockets too), yielding every [`YIELD_EVERY`](Self::YIELD_EVERY).
    pub fn new(budget: u32) -> Spin {
        Spin {
            budget,
            direct_budget: budget,
            socket_budget: budget,
            yield_every: Self::YIELD_EVERY,
        }
    }

    /// The policy of a wait of the direct path: [`direct_budget`](Self::direct_budget) rounds.
    pub fn for_direct(self) -> Spin {
        Spin {
            budget: self.direct_budget,
            ..self
        }
    }

    /// The policy while a socket transfer is pending: [`socket_budget`](Self::socket_budget) rounds.
    pub fn for_sockets(self) -> Spin {
        Spin {
            budget: self.socket_budget,
            ..self
        }
    }
}

/// How long to spin before sleeping, shared by every wait loop.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    spins: u32,
    /// Rounds left before the next yield (a countdown: a division per round, by a
    /// `yield_every` known only at run time, cost about 15 ns of every check here).
    to_yield: u32,
    spin: Spin,
}

impl Backoff {
    /// A backoff that spins `spin.budget` rounds (a round is a cheap progress check) before
    /// [`should_sleep`](Self::should_sleep) says yes, yielding the core every
    /// `spin.yield_every` rounds (every round where ranks outnumber cores: the rank waited for
    /// may need this very core).
    pub fn new(spin: Spin) -> Self {
        Backoff {
            spins: 0,
            to_yield: spin.yield_every.max(1),
            spin,
        }
    }

    /// Call after a round that made progress.
    pub fn reset(&mut self) {
        self.spins = 0;
        self.to_yield = self.spin.yield_every.max(1);
    }

    /// Call after a round without progress. Returns true once the spin budget is spent.
    pub fn should_sleep(&mut self) -> bool {
        if self.spins >= self.spin.budget {
            return true;
        }
        self.spins += 1;
        self.to_yield -= 1;
        if self.to_yield == 0 {
            self.to_yield = self.spin.yield_every.max(1);
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        false
    }
}

/// A spin budget learned across the waits of one rank's calls: how long spinning pays off
/// while the peers keep their current cadence.
///
/// Spinning is worth its CPU only if the awaited peer arrives within the spin. When it does
/// not, wait after wait (a peer that is runnable but has no CPU: queued behind another task,
/// or on this very CPU, where a yield need not hand the CPU over), every call costs the whole
/// budget before the rank sleeps and so frees its CPU, and two ranks taking turns at this
/// keep each other slow: a convoy (seen at 146-158 µs per 8-512 B all_reduce at a load
/// average of 1, about the time 2000 checks with a yield every 64 take here, against 0.5 µs
/// in step). So a wait that spins out its budget while this rank's CPU is contended (the
/// thread was switched out involuntarily since the last spin-out: another task wanted the
/// CPU) or whose peer then stays away long ([`WORTH_SPINNING`](Self::WORTH_SPINNING)) quarters
/// the next wait's budget, down to [`MIN`](Self::MIN) checks.
///
/// The opposite convoy lives on an idle machine: a rank that sleeps is woken by an idle CPU's
/// wake-up (tens of µs in a VM), so its peer, having spun out a short budget, sleeps too, and
/// each call pays a wake-up (measured: 70-150 µs per 8 B all_reduce where a long spin takes
/// 0.6). There a wait whose peer arrived soon after it slept, without contention, shows that a
/// longer spin would have caught the peer: it doubles the budget, as does a wait whose peer
/// arrives while it spins, up to the configured budget. It changes only when a rank sleeps,
/// never whether a wait is bounded.
#[derive(Debug, Clone, Copy)]
pub struct Cadence {
    budget: u32,
    /// This thread's involuntary context switches at the last spin-out.
    switches: u64,
}

impl Default for Cadence {
    fn default() -> Self {
        Cadence::new()
    }
}

/// What a wait that spun out its budget noted before it slept ([`Cadence::spun_out`]).
#[derive(Debug, Clone, Copy)]
pub struct SpunOut {
    spin: Spin,
    at: Instant,
    contended: bool,
}

impl Cadence {
    /// The smallest learned budget: one yield period of a rank with a core of its own.
    pub const MIN: u32 = Spin::YIELD_EVERY;

    /// A peer that arrives within this time after a wait slept would have been caught by a
    /// longer spin (the direct path's full budget spins about 3 ms).
    pub const WORTH_SPINNING: Duration = Duration::from_millis(1);

    /// Nothing learned yet: the configured budget.
    pub const fn new() -> Cadence {
        Cadence {
            budget: u32::MAX,
            switches: 0,
        }
    }

    /// The policy of the next wait: `spin`, its budget at most the learned one.
    pub fn spin(&self, spin: Spin) -> Spin {
        Spin {
            budget: spin.budget.min(self.budget),
            ..spin
        }
    }

    /// A wait spun out the budget of `spin` (what [`spin`](Self::spin) gave) and slept, for a
    /// peer that stayed away or while this rank's CPU was wanted elsewhere: spin a quarter.
    pub fn ran_out(&mut self, spin: Spin) {
        self.budget = (spin.budget / 4).max(Self::MIN.min(spin.budget));
    }

    /// A wait spun out the budget of `spin` and is about to sleep: notes when, and whether
    /// this thread's CPU was contended since the last spin-out (one `getrusage`, on the slow
    /// path only). Hand the note to [`arrived`](Self::arrived) once the peer is there.
    pub fn spun_out(&mut self, spin: Spin) -> SpunOut {
        let switches = involuntary_switches();
        let contended = switches != self.switches;
        self.switches = switches;
        SpunOut {
            spin,
            at: Instant::now(),
            contended,
        }
    }

    /// The peer of a wait that slept after `note` arrived: spin twice as long next time if a
    /// longer spin would have caught it without taking a wanted CPU, else a quarter.
    pub fn arrived(&mut self, note: SpunOut) {
        if !note.contended && note.at.elapsed() <= Self::WORTH_SPINNING {
            self.budget = note.spin.budget.saturating_mul(2).max(Self::MIN);
        } else {
            self.ran_out(note.spin);
        }
    }

    /// A wait's peer arrived while it spun.
    pub fn caught(&mut self) {
        self.budget = self.budget.saturating_mul(2);
    }
}

/// This thread's involuntary context switches so far (`getrusage(RUSAGE_THREAD)`'s
/// `ru_nivcsw`: times it was switched out while runnable, by preemption or by a yield that
/// handed the CPU over); 0 if the call fails.
fn involuntary_switches() -> u64 {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `ru` is a valid, writable `rusage`; RUSAGE_THREAD only reads the calling
    // thread's counters, and on failure the zeroed value is used as is.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, ru.as_mut_ptr()) };
    if rc != 0 {
        return 0;
    }
    // SAFETY: zero-initialised, then filled by a successful getrusage.
    let ru = unsafe { ru.assume_init() };
    u64::try_from(ru.ru_nivcsw).unwrap_or(0)
}

/// How long one sleep lasts at most before a waiting call re-checks its deadline and that the
/// peers it waits for are alive.
pub(crate) const SLEEP_SLICE: Duration = Duration::from_millis(50);

/// How long a short sleep lasts: polling sockets while a doorbell is awaited too, or waiting
/// with nothing to sleep on.
pub(crate) const NAP: Duration = Duration::from_micros(200);

/// Which call waits: what the errors a wait ends with name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CallId {
    /// This rank.
    pub rank: usize,
    /// The call's name.
    pub call: &'static str,
    /// The call's sequence number.
    pub seq: u64,
}

/// One call's waiting discipline, the same in every executor: spin ([`Backoff`]), then sleep
/// in slices of at most [`SLEEP_SLICE`]; between slices, once a slice has passed, the liveness
/// of the peers still awaited (a probe the caller passes) and the call's deadline.
///
/// The fast path costs what a bare [`Backoff`] does: no allocation, no clock read until the
/// spin budget of a wait is spent, no dynamic dispatch (the probe is a generic closure).
#[derive(Debug)]
pub(crate) struct Waiter {
    backoff: Backoff,
    /// The policy each wait starts with ([`rearm`](Self::rearm)).
    base: Spin,
    timeout: Duration,
    id: CallId,
    /// When the call started, for its deadline (`None`: not yet; it starts the first time
    /// the call sleeps).
    start: Option<Instant>,
    /// When this wait last checked (`None`: its spinning is not over yet).
    last_check: Option<Instant>,
    /// The call's hold on the fork gate ([`crate::base::fork_gate`]), let go of at each round
    /// of a wait.
    _busy: crate::base::fork_gate::Busy,
}

impl Waiter {
    /// A waiter for call `id`, spinning by `spin`, that fails the call once `timeout` has
    /// passed since it started: since now if `started`, else since its first sleep (a call
    /// done within its spin budget never reads the clock).
    pub(crate) fn new(id: CallId, spin: Spin, timeout: Duration, started: bool) -> Waiter {
        Waiter {
            backoff: Backoff::new(spin),
            base: spin,
            timeout,
            id,
            start: started.then(Instant::now),
            last_check: None,
            _busy: crate::base::fork_gate::Busy::enter(),
        }
    }

    /// The call this waiter waits for.
    pub(crate) fn id(&self) -> CallId {
        self.id
    }

    /// Begins another wait of the same call (the next event): spinning again, checking a
    /// slice after its first sleep; the deadline stays the call's.
    pub(crate) fn rearm(&mut self) {
        self.backoff = Backoff::new(self.base);
        self.last_check = None;
    }

    /// As [`rearm`](Self::rearm), spinning by `spin` from now on (the next step, whose links
    /// may all be sockets: [`Spin::for_sockets`]).
    pub(crate) fn rearm_spinning(&mut self, spin: Spin) {
        self.base = spin;
        self.rearm();
    }

    /// The policy each wait starts with.
    pub(crate) fn base(&self) -> Spin {
        self.base
    }

    /// Spins by `spin` for the rest of this wait only (the next [`rearm`](Self::rearm)
    /// returns to [`base`](Self::base)), counting afresh.
    pub(crate) fn spin_this_wait(&mut self, spin: Spin) {
        self.backoff = Backoff::new(spin);
    }

    /// Call after a round that made progress: spin afresh.
    #[inline]
    pub(crate) fn progressed(&mut self) {
        self.backoff.reset();
    }

    /// Call after a round without progress. True: spin on (the round spun or yielded);
    /// false: the spin budget is spent, sleep (and then [`check`](Self::check)).
    #[inline]
    pub(crate) fn spin(&mut self) -> bool {
        crate::base::fork_gate::pause_point();
        if !self.backoff.should_sleep() {
            return true;
        }
        if self.last_check.is_none() {
            let now = Instant::now();
            self.start.get_or_insert(now);
            self.last_check = Some(now);
        }
        false
    }

    /// After a sleep: once a slice has passed since the last check, runs `probe` on the peers
    /// still awaited (`waiting()`, computed only then; an error from the probe ends the wait),
    /// then fails the call with [`Error::Timeout`] if its deadline has passed.
    pub(crate) fn check(
        &mut self,
        waiting: impl FnOnce() -> Vec<usize>,
        probe: impl FnOnce(&[usize]) -> Result<()>,
    ) -> Result<()> {
        crate::base::fork_gate::pause_point();
        let now = Instant::now();
        let last = *self.last_check.get_or_insert(now);
        if now.duration_since(last) < SLEEP_SLICE {
            return Ok(());
        }
        self.last_check = Some(now);
        let waiting = waiting();
        probe(&waiting)?;
        let elapsed = self.start.get_or_insert(now).elapsed();
        if elapsed > self.timeout {
            return Err(self.timed_out(waiting, elapsed));
        }
        Ok(())
    }

    /// The error of a call whose deadline passed while it waited for `waiting_on`.
    fn timed_out(&self, mut waiting_on: Vec<usize>, elapsed: Duration) -> Error {
        waiting_on.sort_unstable();
        waiting_on.dedup();
        Error::Timeout {
            rank: self.id.rank,
            call: self.id.call,
            seq: self.id.seq,
            waiting_on,
            elapsed,
        }
    }
}

/// Sleeps in `poll(2)` until one of `fds` is ready or `timeout` passes (a signal counts as
/// a wake-up): the socket half of the executors' waits. `Ok(())` says nothing about which fd
/// is ready; the caller retries its transfers.
///
/// # Safety
///
/// Every fd in `fds` must be open for the whole call (the executors pass the fds of links
/// and health state they borrow for the call).
pub(crate) unsafe fn poll_fds(
    fds: &[(RawFd, PollFlags)],
    timeout: Duration,
) -> rustix::io::Result<()> {
    // SAFETY: the caller keeps every fd open for this call.
    let borrowed: Vec<BorrowedFd<'_>> = fds
        .iter()
        .map(|(fd, _)| unsafe { BorrowedFd::borrow_raw(*fd) })
        .collect();
    let mut pfds: Vec<PollFd<'_>> = borrowed
        .iter()
        .zip(fds)
        .map(|(fd, (_, fl))| PollFd::from_borrowed_fd(*fd, *fl))
        .collect();
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs() as _,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    match crate::base::fork_gate::asleep(|| rustix::event::poll(&mut pfds, Some(&ts))) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e),
    }
}

/// How long a waiter for a queued call polls for its end (yielding the core between polls)
/// before it sleeps: a small call ends within it, and the waiter is not woken by a system
/// call (tens of µs on a loaded host). Used by [`crate::Work`] and the C ABI's work.
pub const WAIT_SPIN: Duration = Duration::from_micros(50);

/// Polls `done` (yielding the core between polls) until `limit` has passed since `start`;
/// true once `done` holds.
pub fn spin_until(done: &AtomicBool, limit: Duration, start: Instant) -> bool {
    loop {
        if done.load(Ordering::Acquire) {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn spinning_yields_every_round_only_when_ranks_outnumber_cpus() {
        let cpus = std::thread::available_parallelism().unwrap().get();
        let c = crate::base::param::Config::default();
        assert_eq!(Spin::from_config(&c, cpus).yield_every, Spin::YIELD_EVERY);
        assert_eq!(Spin::from_config(&c, cpus + 1).yield_every, 1);
        assert_eq!(Spin::from_config(&c, 1).budget, c.spin);
        assert_eq!(Spin::from_config(&c, 1).socket_budget, c.tcp_spin);
        let forced = crate::base::param::Config {
            yield_every: Some(8),
            ..crate::base::param::Config::default()
        };
        assert_eq!(Spin::from_config(&forced, cpus + 1).yield_every, 8);
        assert_eq!(Spin::from_config(&forced, 1).yield_every, 8);
    }

    #[test]
    fn the_direct_path_spins_long_only_where_every_rank_has_a_cpu() {
        let cpus = std::thread::available_parallelism().unwrap().get();
        let c = crate::base::param::Config::default();
        let fits = Spin::from_config(&c, cpus);
        assert_eq!(fits.direct_budget, Spin::DIRECT_BUDGET);
        assert_eq!(fits.for_direct().budget, Spin::DIRECT_BUDGET);
        assert_eq!(fits.budget, c.spin, "other waits keep OXCCL_SPIN");
        assert_eq!(Spin::from_config(&c, cpus + 1).direct_budget, c.spin);
        let set = crate::base::param::Config {
            direct_spin: Some(7),
            ..crate::base::param::Config::default()
        };
        assert_eq!(Spin::from_config(&set, 1).direct_budget, 7);
        assert_eq!(Spin::from_config(&set, cpus + 1).direct_budget, 7);
    }

    #[test]
    fn a_peer_soon_after_an_uncontended_sleep_doubles_the_spin_a_late_one_quarters_it() {
        let full = Spin::new(100_000);
        let mut c = Cadence::new();
        for _ in 0..8 {
            c.ran_out(c.spin(full));
        }
        assert_eq!(c.spin(full).budget, Cadence::MIN, "the idle convoy's start");
        let note = |spin, contended, ago| SpunOut {
            spin,
            at: Instant::now() - ago,
            contended,
        };
        // The idle convoy: each wait sleeps, the peer comes within a wake-up.
        let mut waits = 0;
        while c.spin(full).budget < full.budget {
            let s = c.spin(full);
            c.arrived(note(s, false, Duration::from_micros(60)));
            waits += 1;
            assert!(waits < 20, "never back to the full spin");
        }
        assert_eq!(c.spin(full).budget, full.budget);
        // A contended CPU or a peer that stays away: a quarter, as a spun-out wait.
        c.arrived(note(full, true, Duration::from_micros(60)));
        assert_eq!(c.spin(full).budget, full.budget / 4);
        let s = c.spin(full);
        c.arrived(note(s, false, Cadence::WORTH_SPINNING * 3));
        assert_eq!(c.spin(full).budget, full.budget / 16);
    }

    #[test]
    fn cadence_shrinks_while_waits_spin_out_and_grows_back_while_peers_arrive() {
        let full = Spin::new(2000);
        let mut c = Cadence::new();
        assert_eq!(c.spin(full), full, "nothing learned: the configured budget");
        let mut budgets = Vec::new();
        for _ in 0..5 {
            let s = c.spin(full);
            budgets.push(s.budget);
            c.ran_out(s);
        }
        assert_eq!(budgets, [2000, 500, 125, 64, 64], "quartered down to MIN");
        assert_eq!(c.spin(full).yield_every, full.yield_every);
        for _ in 0..6 {
            c.caught();
        }
        assert_eq!(
            c.spin(full).budget,
            2000,
            "doubled back, never above the configured"
        );
        c.ran_out(c.spin(Spin::new(0)));
        assert_eq!(c.spin(Spin::new(0)).budget, 0, "a zero budget stays zero");
        assert_eq!(c.spin(Spin::new(40)).budget, 0);
        let mut c = Cadence::new();
        c.ran_out(Spin::new(40));
        assert_eq!(
            c.spin(full).budget,
            40,
            "MIN never exceeds the budget that ran out"
        );
        for _ in 0..64 {
            c.caught();
        }
        assert_eq!(
            c.spin(full).budget,
            2000,
            "saturates instead of overflowing"
        );
    }

    #[test]
    fn a_waits_own_spinning_lasts_that_wait_only() {
        let id = CallId {
            rank: 0,
            call: "test",
            seq: 1,
        };
        let mut w = Waiter::new(id, Spin::new(3), Duration::from_secs(1), false);
        w.spin_this_wait(Spin::new(1));
        assert!(w.spin());
        assert!(!w.spin(), "one round of this wait's budget");
        w.rearm();
        assert_eq!(w.base(), Spin::new(3));
        assert!(
            w.spin() && w.spin() && w.spin() && !w.spin(),
            "the base budget again"
        );
        w.rearm_spinning(Spin::new(1));
        w.rearm();
        assert!(w.spin() && !w.spin(), "rearm_spinning sets the base");
    }

    #[test]
    fn waiter_checks_after_a_slice_and_times_out_naming_the_awaited_peers() {
        let id = CallId {
            rank: 3,
            call: "all_reduce",
            seq: 7,
        };
        let mut w = Waiter::new(id, Spin::new(2), Duration::ZERO, false);
        assert!(w.spin() && w.spin(), "spins its budget first");
        assert!(!w.spin(), "then sleeps");
        let mut probed = 0;
        // Within the first slice: neither the probe nor the deadline.
        w.check(
            || vec![1],
            |_| {
                probed += 1;
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(probed, 0);
        std::thread::sleep(SLEEP_SLICE);
        let err = w
            .check(
                || vec![5, 1, 5],
                |peers| {
                    assert_eq!(peers, &[5, 1, 5]);
                    probed += 1;
                    Ok(())
                },
            )
            .unwrap_err();
        assert_eq!(probed, 1);
        match err {
            Error::Timeout {
                rank,
                call,
                seq,
                waiting_on,
                ..
            } => assert_eq!(
                (rank, call, seq, waiting_on),
                (3, "all_reduce", 7, vec![1, 5])
            ),
            e => panic!("expected a timeout, got {e}"),
        }
        // A probe's error ends the wait before the deadline is looked at.
        w.rearm();
        assert!(w.spin() && w.spin() && !w.spin());
        std::thread::sleep(SLEEP_SLICE);
        let err = w
            .check(
                || vec![2],
                |_| {
                    Err(Error::Aborted {
                        rank: 3,
                        msg: "peer 2 lost".into(),
                    })
                },
            )
            .unwrap_err();
        assert!(err.to_string().contains("peer 2 lost"), "{err}");
    }

    #[test]
    fn ring_wakes_sleeper() {
        let bell = Arc::new(Doorbell::new());
        let flag = Arc::new(AtomicBool::new(false));
        let (b2, f2) = (bell.clone(), flag.clone());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            f2.store(true, Ordering::SeqCst);
            b2.ring();
        });
        let start = Instant::now();
        while !flag.load(Ordering::SeqCst) {
            let tok = bell.prepare();
            if flag.load(Ordering::SeqCst) {
                bell.cancel(tok);
                break;
            }
            bell.wait(tok, Duration::from_secs(10));
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "woken by the ring, not the timeout"
        );
        t.join().unwrap();
    }

    /// Ping-pong where every wait goes to sleep (no spinning), with whichever fence scheme
    /// this kernel gives (asymmetric with membarrier, or plain fences): counts the waits that
    /// ended by their 5 s timeout instead of a ring, i.e. lost wake-ups. A smoke test: the
    /// window for a lost wake-up is a few instructions wide, so a broken scheme is not
    /// guaranteed to show here.
    #[test]
    fn no_wake_up_lost_in_sleeping_ping_pong() {
        ping_pong(false);
    }

    /// The same with the publish as a `SeqCst` store and no fence in the ring, as the direct
    /// area publishes its events.
    #[test]
    fn no_wake_up_lost_in_sleeping_ping_pong_seqcst_publish() {
        ping_pong(true);
    }

    fn ping_pong(seqcst_publish: bool) {
        use std::sync::atomic::AtomicU64;
        const ROUNDS: u64 = 5000;
        const TIMEOUT: Duration = Duration::from_secs(5);
        let bells = Arc::new([Doorbell::new(), Doorbell::new()]);
        let turn = Arc::new(AtomicU64::new(0));
        // Set at the first lost wake-up, so that both players stop instead of timing out
        // round after round.
        let failed = Arc::new(AtomicBool::new(false));
        let player =
            |me: u64, bells: Arc<[Doorbell; 2]>, turn: Arc<AtomicU64>, failed: Arc<AtomicBool>| {
                move || {
                    let (mine, other) = (&bells[me as usize], &bells[1 - me as usize]);
                    let mut lost = 0;
                    for _ in 0..ROUNDS {
                        // Wait for my turn (turn % 2 == me), sleeping every time it is not.
                        while turn.load(Ordering::Acquire) % 2 != me {
                            if failed.load(Ordering::Relaxed) {
                                return lost;
                            }
                            let tok = mine.prepare();
                            if turn.load(Ordering::Acquire) % 2 == me {
                                mine.cancel(tok);
                                break;
                            }
                            let t0 = Instant::now();
                            mine.wait(tok, TIMEOUT);
                            if t0.elapsed() >= TIMEOUT {
                                lost += 1;
                                failed.store(true, Ordering::Relaxed);
                            }
                        }
                        // A plain store, as a publish is (a locked add would fence by itself on
                        // x86 and hide a missing fence): only the player whose turn it is writes.
                        let t = turn.load(Ordering::Relaxed);
                        if seqcst_publish {
                            turn.store(t + 1, Ordering::SeqCst);
                            other.ring_after_seqcst_store();
                        } else {
                            turn.store(t + 1, Ordering::Release);
                            other.ring();
                        }
                    }
                    lost
                }
            };
        let a = std::thread::spawn(player(0, bells.clone(), turn.clone(), failed.clone()));
        let b = std::thread::spawn(player(1, bells.clone(), turn.clone(), failed.clone()));
        let lost = a.join().unwrap() + b.join().unwrap();
        assert_eq!(lost, 0, "waits that ended by timeout, not by a ring");
        assert_eq!(turn.load(Ordering::SeqCst), 2 * ROUNDS);
    }

    /// What an out-of-step ping-pong saw: waits that ended unrung with their condition met
    /// (`lost`: slept to the timeout), and waits that `wait_rechecking`'s second look ended
    /// (`recovered`).
    #[derive(Debug, Default)]
    struct Missed {
        lost: u32,
        recovered: u32,
        rounds: u64,
    }

    /// Two players taking turns, every wait asleep at once, out of step (each pauses 0-300 µs at
    /// random after its turn before it waits), and a ringer modelled as a fence-free publish
    /// may run on hardware, stretched: its read of the sleeper count performed 0-10 µs before
    /// its store becomes visible (at most 12 µs: a round preempted for longer rings fenced). With plain `wait`s, a wait the model misses sleeps to its
    /// timeout; `rechecking` uses `wait_rechecking`. Stops after `max_lost` lost waits.
    fn out_of_step_ping_pong(rechecking: bool, rounds: u64, max_lost: u32) -> Missed {
        ping_pong_out_of_step(rechecking, true, rounds, max_lost)
    }

    /// As `out_of_step_ping_pong`, with `model` false: publishes as the direct area's, a
    /// `Release` store and `ring_after_release_store`, nothing stretched.
    fn ping_pong_out_of_step(rechecking: bool, model: bool, rounds: u64, max_lost: u32) -> Missed {
        use std::sync::atomic::AtomicU64;
        const TIMEOUT: Duration = Duration::from_millis(20);
        let bells = Arc::new([Doorbell::new(), Doorbell::new()]);
        let turn = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let player = |me: u64| {
            let (bells, turn, stop) = (bells.clone(), turn.clone(), stop.clone());
            move || {
                let (mine, other) = (&bells[me as usize], &bells[1 - me as usize]);
                let mut seen = Missed::default();
                let mut rng = 0x9e37_79b9_7f4a_7c15_u64 ^ (me + 1);
                let mut pause = |max_ns: u64| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let until = Instant::now() + Duration::from_nanos(rng % max_ns);
                    while Instant::now() < until {
                        std::hint::spin_loop();
                    }
                };
                for _ in 0..rounds {
                    while turn.load(Ordering::Acquire) % 2 != me {
                        if stop.load(Ordering::Relaxed) {
                            return seen;
                        }
                        let tok = mine.prepare();
                        if turn.load(Ordering::Acquire) % 2 == me {
                            mine.cancel(tok);
                            break;
                        }
                        let my_turn = || turn.load(Ordering::Acquire) % 2 == me;
                        let asleep = Instant::now();
                        if rechecking {
                            seen.recovered +=
                                u32::from(mine.wait_rechecking(tok, TIMEOUT, my_turn));
                        } else {
                            mine.wait(tok, TIMEOUT);
                        }
                        if asleep.elapsed() >= TIMEOUT
                            && mine.seq.load(Ordering::SeqCst) == tok.0
                            && my_turn()
                        {
                            // Unrung, slept to the timeout, and it was this player's turn.
                            seen.lost += 1;
                            if seen.lost >= max_lost {
                                stop.store(true, Ordering::Relaxed);
                            }
                        }
                    }
                    // The publish, as the model runs it: the count read early, the store late.
                    // A store buffer drains whatever the core does; a thread can be preempted
                    // for longer: where that stretched the window past the model's bound, this
                    // round rings as a fenced publish would (the model claims no more).
                    if !model {
                        let t = turn.load(Ordering::Relaxed);
                        turn.store(t + 1, Ordering::Release);
                        other.ring_after_release_store();
                        seen.rounds += 1;
                        pause(300_000);
                        continue;
                    }
                    let early = other.sleepers_seen();
                    let read = Instant::now();
                    pause(10_000);
                    let t = turn.load(Ordering::Relaxed);
                    turn.store(t + 1, Ordering::Release);
                    if read.elapsed() > Duration::from_micros(12) {
                        other.ring();
                    } else {
                        other.ring_seen(early);
                    }
                    seen.rounds += 1;
                    pause(300_000);
                }
                seen
            }
        };
        let a = std::thread::spawn(player(0));
        let b = std::thread::spawn(player(1));
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        Missed {
            lost: a.lost + b.lost,
            recovered: a.recovered + b.recovered,
            rounds: a.rounds + b.rounds,
        }
    }

    /// The interleaving the model below hunts for, forced step by step on one thread: the
    /// ringer reads the sleeper count (0) before the waiter announces itself, the waiter
    /// announces itself and re-checks (not its turn yet), then the publish lands and the ring
    /// goes by the early read (no wake-up). A plain wait sleeps to its timeout, unrung with its
    /// condition met (the lost wake-up); `wait_rechecking`'s second look after the grace finds
    /// the publish. Deterministic: no race has to happen, so it holds on a busy machine.
    #[test]
    fn rechecking_waits_find_a_publish_whose_ring_read_the_count_early() {
        const TIMEOUT: Duration = Duration::from_millis(20);
        for rechecking in [false, true] {
            let bell = Doorbell::new();
            let published = AtomicBool::new(false);
            let early = bell.sleepers_seen();
            assert_eq!(early, 0, "nobody sleeps yet");
            let tok = bell.prepare();
            assert!(
                !published.load(Ordering::Acquire),
                "the re-check finds no publish"
            );
            published.store(true, Ordering::Release);
            bell.ring_seen(early);
            assert_eq!(
                bell.seq.load(Ordering::SeqCst),
                tok.0,
                "the early read rang nobody"
            );
            let asleep = Instant::now();
            if rechecking {
                let recovered =
                    bell.wait_rechecking(tok, TIMEOUT, || published.load(Ordering::Acquire));
                assert!(recovered, "the second look did not find the publish");
            } else {
                bell.wait(tok, TIMEOUT);
                // The lost wake-up: the plain wait slept its whole timeout (a lower bound,
                // which load cannot break).
                assert!(
                    asleep.elapsed() >= TIMEOUT,
                    "a plain wait was woken: {:?}",
                    asleep.elapsed()
                );
            }
            assert_eq!(
                bell.sleepers.load(Ordering::SeqCst),
                0,
                "the announcement is withdrawn"
            );
        }
    }

    /// The judge of fence-free publishes (`Doorbell::ring_after_release_store`) under real
    /// interleavings: the model of a ringer whose count read runs early loses wake-ups with
    /// plain waits (so it does reach the window), and none with `wait_rechecking`, whose second
    /// look finds them. The window is a race: on a loaded machine a batch of rounds may not
    /// reach it, so batches are retried (up to `BATCHES`) until both kinds of wait have met it;
    /// every batch must lose no rechecking wait. Stress tier (`./scripts/test.sh stress`):
    /// the forced interleaving above is the normal tiers' check.
    #[test]
    #[ignore = "stress tier: needs a race to happen (scripts/test.sh stress)"]
    fn stress_rechecking_waits_find_what_early_reads_of_the_count_miss() {
        const BATCHES: u32 = 25;
        let (mut plain_seen, mut recovered_seen) = (false, false);
        let (mut plain_rounds, mut rechecking_rounds) = (0, 0);
        for batch in 1..=BATCHES {
            if !plain_seen {
                let plain = out_of_step_ping_pong(false, 4000, 3);
                plain_rounds += plain.rounds;
                plain_seen = plain.lost > 0;
                eprintln!("batch {batch}: plain {plain:?}");
            }
            let rechecking = out_of_step_ping_pong(true, 4000, 1);
            rechecking_rounds += rechecking.rounds;
            assert_eq!(rechecking.lost, 0, "batch {batch}: {rechecking:?}");
            recovered_seen |= rechecking.recovered > 0;
            eprintln!("batch {batch}: rechecking {rechecking:?}");
            if plain_seen && recovered_seen {
                return;
            }
        }
        assert!(
            plain_seen,
            "the model missed no plain wait in {plain_rounds} rounds ({BATCHES} batches): it no longer tests anything"
        );
        assert!(
            recovered_seen,
            "no second look was needed in {rechecking_rounds} rounds ({BATCHES} batches): the model did not reach the window"
        );
    }

    /// Fence-free publishes on this machine's hardware, plain waits, many rounds out of step:
    /// whether the store-load window loses wake-ups without a model stretching it. A
    /// measurement, run by hand: `cargo test -p oxccl --release --lib -- --ignored
    /// release_publishes_on_this_hardware --nocapture`.
    #[test]
    #[ignore]
    fn release_publishes_on_this_hardware() {
        let rounds = 200_000;
        let plain = ping_pong_out_of_step(false, false, rounds, 20);
        eprintln!("plain waits: {plain:?}");
        let rechecking = ping_pong_out_of_step(true, false, rounds, 20);
        eprintln!("rechecking waits: {rechecking:?}");
        assert_eq!(rechecking.lost, 0);
    }

    #[test]
    fn wait_times_out_without_ring() {
        let bell = Doorbell::new();
        let start = Instant::now();
        let tok = bell.prepare();
        bell.wait(tok, Duration::from_millis(20));
        assert!(start.elapsed() >= Duration::from_millis(15));
        assert_eq!(bell.sleepers.load(Ordering::SeqCst), 0);
    }
}
