//! `Communicator::grow` with ranks as threads of this process, joined through a real
//! rendezvous (loopback TCP) and real links: a new rank joins, the grown communicator's
//! all_reduce matches a plain reference, the old one stays usable, and disagreeing ranks get
//! an error naming the rank at odds (or a mismatch, against another collective), and a new rank
//! that never comes is a timeout naming it.

use std::time::Duration;

use oxccl::TransportChoice;
use oxccl::{Communicator, Config, Error, ReduceOp, UniqueId};

fn cfg(transport: TransportChoice) -> Config {
    Config {
        timeout: Duration::from_secs(20),
        transport,
        ..Config::default()
    }
}

fn loopback_id() -> UniqueId {
    UniqueId::new_on("127.0.0.1".parse().unwrap()).unwrap()
}

/// `n` old ranks (threads) run `old(rank, comm)`, `k` new ones `new(rank)`, all at once.
fn run<T: Send>(
    n: usize,
    k: usize,
    transport: TransportChoice,
    old: impl Fn(usize, Communicator) -> T + Sync,
    new: impl Fn(usize) -> T + Sync,
) -> Vec<T> {
    let id = loopback_id();
    let (old, new) = (&old, &new);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n + k)
            .map(|r| {
                let id = id.clone();
                s.spawn(move || {
                    if r < n {
                        old(
                            r,
                            Communicator::init_with_config(&id, r, n, cfg(transport)).unwrap(),
                        )
                    } else {
                        new(r)
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn contribution(rank: usize, len: usize) -> Vec<f64> {
    (0..len).map(|i| ((rank + 1) * (i + 3)) as f64).collect()
}

fn reference(n: usize, len: usize) -> Vec<f64> {
    let mut sum = vec![0.0; len];
    for r in 0..n {
        for (s, x) in sum.iter_mut().zip(contribution(r, len)) {
            *s += x;
        }
    }
    sum
}

#[test]
fn new_ranks_join_and_the_sum_matches_the_reference() {
    const LEN: usize = 5000;
    for transport in [TransportChoice::Shm, TransportChoice::Tcp] {
        // Made here, in rank 0's process, before anyone needs it; the new ranks get it "out
        // of band" (a clone), the other old ranks from rank 0 inside grow.
        let gid = loopback_id();
        let grown = |r: usize, g: Communicator| {
            assert_eq!((g.rank(), g.world_size()), (r, 4));
            let mut v = contribution(r, LEN);
            g.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
            v
        };
        let res = run(
            2,
            2,
            transport,
            |r, comm| {
                let id = (r == 0).then_some(&gid);
                let g = comm.grow(2, id).unwrap();
                let v = grown(r, g);
                // The old communicator stays usable.
                let mut w = contribution(r, 10);
                comm.all_reduce_in_place(&mut w, ReduceOp::Sum).unwrap();
                assert_eq!(w, reference(2, 10));
                v
            },
            |r| {
                grown(
                    r,
                    Communicator::init_with_config(&gid, r, 4, cfg(transport)).unwrap(),
                )
            },
        );
        let want = reference(4, LEN);
        for (r, v) in res.iter().enumerate() {
            assert_eq!(v, &want, "rank {r} over {transport:?}");
        }
    }
}

#[test]
fn disagreeing_ranks_are_an_error_on_every_rank() {
    let gid = loopback_id();
    let other = loopback_id();
    for (case, want) in [
        (0, "rank 1 grows by 2 rank(s), rank 0 by 1"),
        (1, "rank 1 passed a UniqueId other than rank 0's"),
        (2, "rank 0 must pass the new communicator's UniqueId"),
        (3, ""),
    ] {
        let res = run(
            2,
            0,
            TransportChoice::Shm,
            |r, comm| {
                if (case, r) == (3, 1) {
                    let mut v = [1.0f32; 53];
                    return comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
                }
                let (k, id) = match (case, r) {
                    (0, 1) => (2, None),
                    (1, 1) => (1, Some(&other)),
                    (2, 0) => (1, None),
                    _ => (1, Some(&gid)),
                };
                comm.grow(k, id).map(|_| ()).unwrap_err()
            },
            |_| unreachable!(),
        );
        for (r, e) in res.iter().enumerate() {
            if case == 3 {
                // Grow against an all_reduce: the call check finds the mismatch on both.
                assert!(e.is_mismatch(), "rank {r}: {e}");
                continue;
            }
            assert!(
                matches!(e, Error::InvalidArgument { call: "grow", .. }),
                "{e}"
            );
            assert!(e.to_string().contains(want), "case {case}, rank {r}: {e}");
        }
    }
}

#[test]
fn a_new_rank_that_never_comes_is_a_timeout_naming_it() {
    let gid = loopback_id();
    let res = run(
        2,
        0,
        TransportChoice::Shm,
        |r, comm| {
            comm.set_timeout(Duration::from_secs(2));
            comm.grow(1, (r == 0).then_some(&gid))
                .map(|_| ())
                .unwrap_err()
        },
        |_| unreachable!(),
    );
    // Rank 0 hosts the rendezvous and knows who is missing; rank 1 waits on rank 0.
    assert!(
        res[0].to_string().contains("still waiting on rank(s) [2]"),
        "{}",
        res[0]
    );
    assert!(
        res[1].to_string().contains("rank 1: rendezvous"),
        "{}",
        res[1]
    );
}
