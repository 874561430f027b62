//! The connect-on-first-use state machine: roles, verdicts, which links a call still
//! needs, and links made by subsets in different orders (threads as ranks, loopback).

use super::*;
use crate::base::param::{Config, TcpConnect};
use crate::bootstrap::local::LocalExchange;
use crate::bootstrap::Exchange;
use crate::transport::tcp::{setup, Setup};
use std::net::{IpAddr, Ipv4Addr};
use std::thread;

const SECRET: [u8; 16] = *b"lazy-tcp-secret!";
const LO: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn cfg(timeout_ms: u64) -> Config {
    Config {
        timeout: Duration::from_millis(timeout_ms),
        tcp_connect: TcpConnect::Lazy,
        ..Config::default()
    }
}

fn all_peers(me: usize, n: usize) -> Vec<(usize, IpAddr)> {
    (0..n).filter(|&r| r != me).map(|r| (r, LO)).collect()
}

/// Each rank's lazy state after a real port exchange, in threads; `f(rank, lazy)` runs on
/// each.
fn ranks<T: Send>(n: usize, f: impl Fn(usize, LazyTcp) -> T + Sync) -> Vec<T> {
    let f = &f;
    thread::scope(|s| {
        let hs: Vec<_> = LocalExchange::group(n)
            .into_iter()
            .map(|mut ex| {
                s.spawn(move || {
                    let me = ex.rank();
                    match setup(&mut ex, &all_peers(me, n), &SECRET, &cfg(20_000)).unwrap() {
                        Setup::Later(lazy) => f(me, lazy),
                        Setup::Now(_) => panic!("rank {me}: links made at init under lazy"),
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn never() -> Option<Error> {
    None
}

fn failed<T>(r: Result<T>) -> Error {
    match r {
        Err(e) => e,
        Ok(_) => panic!("succeeded"),
    }
}

/// Sends this rank's number to every peer of `links` and checks each one's.
fn ping(me: usize, links: &mut [(usize, Box<dyn Link>)]) {
    for (_, l) in links.iter_mut() {
        assert_eq!(l.try_send(&[me as u8]).unwrap(), 1);
    }
    let start = Instant::now();
    for (p, l) in links.iter_mut() {
        let mut b = [0u8; 1];
        while l.try_recv_into(&mut b).unwrap() == 0 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "rank {me}: nothing from {p}"
            );
            thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(b[0] as usize, *p);
    }
}

#[test]
fn the_higher_rank_dials() {
    assert_eq!(role(3, 1), Role::Dial);
    assert_eq!(role(1, 3), Role::Accept);
    assert_eq!(role(0, 5), Role::Accept);
}

#[test]
fn verdicts_and_missing_links() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let mut lazy = LazyTcp::new(
        2,
        l,
        &[0, 1, 3, 4],
        &[(0, addr), (1, addr)],
        2,
        &SECRET,
        Duration::ZERO,
    );
    assert_eq!(lazy.peers(), vec![0, 1, 3, 4]);
    assert!(lazy.covers(3) && !lazy.covers(2) && !lazy.covers(5));
    // Not TCP peers (this rank, shared-memory peers, out of range) are never missing.
    assert_eq!(lazy.missing([3, 0, 3, 9, 2]), vec![0, 3]);
    // Lower ranks are dialed, never accepted; strangers to the plan are refused.
    assert_eq!(lazy.verdict(1), Verdict::UnexpectedRank);
    assert_eq!(lazy.verdict(2), Verdict::UnexpectedRank);
    assert_eq!(lazy.verdict(5), Verdict::UnexpectedRank);
    assert_eq!(lazy.verdict(3), Verdict::Accepted);
    // Adopted up to its stream count, then duplicates.
    let pair = || TcpStream::connect(addr).unwrap();
    lazy.adopted.push((3, pair()));
    assert_eq!(lazy.verdict(3), Verdict::Accepted);
    lazy.adopted.push((3, pair()));
    assert_eq!(lazy.verdict(3), Verdict::DuplicateRank);
    lazy.state[4] = Peer::Made;
    lazy.made += 1;
    assert_eq!(lazy.verdict(4), Verdict::DuplicateRank);
    assert_eq!(lazy.missing(0..6), vec![0, 1, 3]);
    assert!(!lazy.all_made());
    // Nothing to make: no wait, no error, whatever the deadline.
    let none = lazy.connect(&[4, 2, 7], Instant::now(), &never, "t", 1);
    assert!(none.unwrap().is_empty());
}

#[test]
fn ring_neighbours_first_then_the_rest() {
    // Every rank needs its ring neighbours (one call), then the others (a later call).
    let n = 4;
    let made = ranks(n, |me, mut lazy| {
        let ring = [(me + 1) % n, (me + n - 1) % n];
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut links = lazy
            .connect(&ring, deadline, &never, "all_reduce", 1)
            .unwrap();
        assert_eq!(links.len(), 2, "rank {me}");
        ping(me, &mut links);
        let after_ring = lazy.missing(0..n);
        let mut rest = lazy
            .connect(&lazy.peers(), deadline, &never, "all_to_all", 2)
            .unwrap();
        ping(me, &mut rest);
        assert!(lazy.all_made());
        // Made links are never made twice.
        assert!(lazy
            .connect(&lazy.peers(), deadline, &never, "x", 3)
            .unwrap()
            .is_empty());
        (after_ring, rest.iter().map(|(p, _)| *p).collect::<Vec<_>>())
    });
    for (me, (left, rest)) in made.into_iter().enumerate() {
        assert_eq!(left, vec![(me + 2) % n], "rank {me}");
        assert_eq!(rest, left, "rank {me}");
    }
}

#[test]
fn a_peer_a_call_ahead_is_adopted_not_refused() {
    // Rank 0 first needs rank 1, then rank 2; rank 2 needs rank 0 at once (it is a call
    // ahead): its connection arrives while rank 0 accepts for rank 1 and waits there.
    let n = 3;
    ranks(n, |me, mut lazy| {
        let deadline = Instant::now() + Duration::from_secs(20);
        let steps: &[&[usize]] = match me {
            0 => &[&[1], &[2]],
            1 => &[&[0]],
            _ => &[&[0]],
        };
        for (i, need) in steps.iter().enumerate() {
            if me == 0 && i == 0 {
                // Let rank 2's dial come first.
                thread::sleep(Duration::from_millis(200));
            }
            let mut links = lazy.connect(need, deadline, &never, "c", i as u64).unwrap();
            assert_eq!(links.len(), 1);
            ping(me, &mut links);
        }
        if me == 0 {
            assert!(lazy.adopted.is_empty() && lazy.all_made());
        }
    });
}

#[test]
fn striped_links_form_lazily() {
    // Several streams per pair (OXCCL_TCP_STREAMS) through `connect`'s lazy path: every link
    // at once, each a striped link.
    let n = 3;
    thread::scope(|s| {
        for mut ex in LocalExchange::group(n) {
            s.spawn(move || {
                let me = ex.rank();
                let c = Config {
                    tcp_streams: 3,
                    ..cfg(20_000)
                };
                let mut links =
                    crate::transport::tcp::connect(&mut ex, &all_peers(me, n), &SECRET, &c)
                        .unwrap();
                assert_eq!(links.len(), n - 1);
                ping(me, &mut links);
            });
        }
    });
}

#[test]
fn rank_zeros_choice_holds() {
    // Rank 1 asks for eager links, rank 0 for lazy: nobody connects at init.
    thread::scope(|s| {
        for mut ex in LocalExchange::group(2) {
            s.spawn(move || {
                let me = ex.rank();
                let c = Config {
                    tcp_connect: if me == 0 {
                        TcpConnect::Lazy
                    } else {
                        TcpConnect::Eager
                    },
                    ..cfg(20_000)
                };
                let got = setup(&mut ex, &all_peers(me, 2), &SECRET, &c).unwrap();
                assert!(matches!(got, Setup::Later(_)), "rank {me}");
            });
        }
    });
}

#[test]
fn a_dialer_that_never_comes_is_an_error_at_the_deadline() {
    let errs = ranks(2, |me, mut lazy| {
        if me == 1 {
            return None; // never needs the link
        }
        let start = Instant::now();
        let e = failed(lazy.connect(
            &[1],
            start + Duration::from_millis(300),
            &never,
            "broadcast",
            7,
        ));
        assert!(start.elapsed() < Duration::from_secs(5));
        Some(e.to_string())
    });
    let e = errs[0].clone().unwrap();
    assert!(
        e.contains("rank 0:") && e.contains("rank 1") && e.contains("broadcast (call #7)"),
        "{e}"
    );
}

#[test]
fn a_gone_peer_is_named_soon() {
    // Rank 0 ends (its listener closes) before rank 1 needs the link.
    let errs = ranks(2, |me, mut lazy| {
        if me == 0 {
            return None;
        }
        thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        let e = failed(lazy.connect(
            &[0],
            start + Duration::from_secs(30),
            &never,
            "all_gather",
            4,
        ));
        assert!(start.elapsed() < GONE_AFTER + Duration::from_secs(3));
        Some(e.to_string())
    });
    let e = errs[1].clone().unwrap();
    assert!(
        e.contains("rank 1:") && e.contains("rank 0 is gone") && e.contains("all_gather (call #4)"),
        "{e}"
    );
}

#[test]
fn a_failed_communicator_stops_both_sides_of_the_wait() {
    // `stop` reports a failure after 200 ms: the accepting rank 0 and the dialing rank 2
    // (whose peer, rank 1, never accepts) both end with that error, long before the deadline.
    let errs = ranks(3, |me, mut lazy| {
        if me == 1 {
            thread::sleep(Duration::from_secs(1));
            return None;
        }
        let start = Instant::now();
        let stop = move || {
            (start.elapsed() > Duration::from_millis(200)).then(|| Error::PeerLost {
                rank: me,
                peer: 1,
                call: "reduce",
                seq: 9,
                reason: "test".into(),
            })
        };
        let e = failed(lazy.connect(&[1], start + Duration::from_secs(30), &stop, "reduce", 9));
        assert!(start.elapsed() < Duration::from_secs(5), "rank {me}");
        Some(e)
    });
    for me in [0, 2] {
        match errs[me].as_ref().unwrap() {
            Error::PeerLost {
                peer: 1, seq: 9, ..
            } => {}
            e => panic!("rank {me}: {e}"),
        }
    }
}

#[test]
fn auto_is_lazy_above_the_threshold_only() {
    assert!(!TcpConnect::Auto.lazy_for(64, 64));
    assert!(TcpConnect::Auto.lazy_for(65, 64));
    assert!(TcpConnect::Lazy.lazy_for(2, 64));
    assert!(!TcpConnect::Eager.lazy_for(1000, 64));
    // Through the port exchange: with the threshold at 2, a group of 2 connects at init and
    // a group of 3 on first use.
    for (n, lazy) in [(2, false), (3, true)] {
        thread::scope(|s| {
            for mut ex in LocalExchange::group(n) {
                s.spawn(move || {
                    let me = ex.rank();
                    let c = Config {
                        tcp_connect: TcpConnect::Auto,
                        tcp_lazy_min_ranks: 2,
                        ..cfg(20_000)
                    };
                    let got = setup(&mut ex, &all_peers(me, n), &SECRET, &c).unwrap();
                    assert_eq!(matches!(got, Setup::Later(_)), lazy, "rank {me} of {n}");
                });
            }
        });
    }
}
