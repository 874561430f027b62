//! Waiting without burning a core: spin briefly, then sleep on a futex ("doorbell") or on
//! sockets.
//!
//! A [`Doorbell`] (`doorbell.rs`) is an event count in memory that may be shared between
//! processes (a shared-memory segment) or private (the in-memory transport). A rank owns one
//! doorbell; every peer that makes progress that rank may be waiting for (writes data into a
//! ring the rank reads, or frees space in a ring the rank writes) calls [`Doorbell::ring`]. A
//! waiter calls [`Doorbell::prepare`], re-checks its condition, then [`Doorbell::wait`]: the
//! futex only sleeps if nobody rang in between, so no wake-up is lost.
//!
//! Correctness argument (a Dekker handshake; every access below is `SeqCst` or separated by a
//! `SeqCst` fence): the waiter does `sleepers += 1`, fence, reads `seq`, then checks its
//! condition; the ringer publishes its data, fence, then reads `sleepers`, and only if it is
//! non-zero does `seq += 1` and `futex_wake`. The two fences order the two store-then-load
//! pairs, so at least one side sees the other's store: either the ringer sees a sleeper (and
//! bumps `seq` and wakes it: the waiter's `futex_wait(seq, old)` sees the changed value or is
//! woken), or the waiter's re-check sees the published data and it does not sleep. A ringer
//! with nobody asleep writes nothing to the shared line: one fence and one load. A publish
//! that is itself a `SeqCst` store (the direct area's events, `direct/shm.rs`) rings with
//! [`Doorbell::ring_after_seqcst_store`], whose `SeqCst` load needs no fence after it.
//!
//! The direct path's waiters sleep with [`Doorbell::wait_rechecking`], which looks at the
//! condition once more [`RING_GRACE`] (20 µs) after announcing itself. With the `SeqCst`
//! publish the ring reaches every sleeper and the second look finds nothing new; it bounds
//! what a ringer whose read of `sleepers` was performed before its publish became visible
//! would cost (the grace, not the sleep slice): the case of a publish without a fence, which
//! docs/decisions.md measured and did not apply. The lost case needs the ringer's read before
//! the waiter's `sleepers += 1` (a locked add, visible when done) and its publish after the
//! waiter's re-check; a store becomes visible within a store buffer's drain of the read after
//! it, so by the second look, at least the grace after the add, the publish is visible. The
//! doorbell's tests model such a ringer (its read early by up to 10 µs, ranks out of step):
//! waits that only `wait` would lose for ever, `wait_rechecking` finds at the second look.
//!
//! How long to spin before sleeping is [`Spin`], [`Backoff`] and the learned [`Cadence`]
//! (`spin.rs`); one call's waiting discipline, sleep slices between checks of its deadline and
//! its peers, is the `Waiter` (`waiter.rs`), with `poll_fds` for sockets.

mod doorbell;
mod spin;
mod waiter;

pub use doorbell::{Doorbell, DoorbellToken, RING_GRACE};
pub use spin::{spin_until, Backoff, Cadence, Spin, SpunOut, WAIT_SPIN};
pub(crate) use waiter::{poll_fds, CallId, Waiter, NAP, SLEEP_SLICE};
