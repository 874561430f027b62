//! How a waiting rank spins before it sleeps: the policy ([`Spin`]), the countdown of one wait
//! ([`Backoff`]) and the budget learned across waits ([`Cadence`]); and the short poll of a
//! waiter for a queued call ([`spin_until`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

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
}
