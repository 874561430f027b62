//! The futex doorbell: an event count a rank sleeps on until a peer makes progress, and its
//! publish protocol (the module docs of `base::wait` have the argument).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use rustix::thread::futex;

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

impl Doorbell {
    /// A new doorbell (all zero, which is also the state of fresh shared memory).
    pub const fn new() -> Self {
        Doorbell {
            seq: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
        }
    }

    /// Signals progress (to be called after publishing it); wakes the owner if it sleeps.
    /// Cheap when nobody sleeps: a fence and one load, no write, no system call.
    pub fn ring(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
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

    /// The sleeper count as a ringer reads it (for tests that model a ringer whose read ran
    /// early: [`ring_seen`](Self::ring_seen) then rings as that read decided).
    #[cfg(test)]
    fn sleepers_seen(&self) -> u32 {
        self.sleepers.load(Ordering::SeqCst)
    }

    /// Rings as if the sleeper count read were `seen` (tests; see
    /// [`sleepers_seen`](Self::sleepers_seen)).
    #[cfg(test)]
    fn ring_seen(&self, seen: u32) {
        if seen != 0 {
            self.seq.fetch_add(1, Ordering::SeqCst);
            let _ = futex::wake(&self.seq, futex::Flags::empty(), i32::MAX as u32);
        }
    }

    /// Announces that the caller is about to sleep; call before re-checking the condition.
    pub fn prepare(&self) -> DoorbellToken {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
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

    /// As [`wait`](Self::wait), with a second look: sleeps at most [`RING_GRACE`] first and,
    /// unless rung meanwhile, asks `ready` again before sleeping the rest of `timeout`. A
    /// publish whose ring missed this waiter (a ringer whose read of the sleeper count was
    /// performed before its publish became visible: the module docs) was visible within the
    /// grace of the waiter's announcement, so the second look sees it. Returns whether that
    /// second look found the condition met (a ring the publisher did not make: counted by
    /// tests).
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

/// How long [`Doorbell::wait_rechecking`] sleeps before it looks again: far longer than a
/// store waits in a core's store buffer (well under a microsecond: the buffer drains on its
/// own, whatever the core runs next, and a VM exit or interrupt drains it too), short enough
/// that a missed ring is not felt.
pub const RING_GRACE: Duration = Duration::from_micros(20);

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::Instant;

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

    /// Ping-pong where every wait goes to sleep (no spinning), publishing with a `Release`
    /// store and [`Doorbell::ring`]'s fence: counts the waits that ended by their 5 s timeout
    /// instead of a ring, i.e. lost wake-ups. A smoke test: the
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
    /// its store becomes visible (at most 12 µs: a round preempted for longer rings fenced).
    /// With plain `wait`s, a wait the model misses sleeps to its timeout; `rechecking` uses
    /// `wait_rechecking`. Stops after `max_lost` lost waits.
    fn out_of_step_ping_pong(rechecking: bool, rounds: u64, max_lost: u32) -> Missed {
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

    /// The judge of the second look under real interleavings: the model of a ringer whose
    /// count read runs early loses wake-ups with plain waits (so it does reach the window),
    /// and none with `wait_rechecking`, whose second look finds them. The window is a race: on a loaded machine a batch of rounds may not
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
