//! The connect-on-first-use state machine: verdicts, which links a call still needs, links
//! made by subsets in different orders, crossed dials, a peer in no call, strangers (threads
//! as ranks, loopback).

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

/// A table for rank 2 of TCP peers 0, 1, 3, 4 with 2 streams a pair.
fn table() -> Table {
    let mut slots: Vec<Slot> = (0..5).map(|_| Slot::Pending).collect();
    slots[2] = Slot::Not;
    Table {
        me: 2,
        streams: 2,
        slots,
        strangers: None,
        failed: None,
    }
}

#[test]
fn verdicts() {
    let pair = || {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        TcpStream::connect(l.local_addr().unwrap()).unwrap()
    };
    let mut t = table();
    // Any TCP peer without a connection is accepted, lower or higher; not TCP peers (this
    // rank, out of range) are refused.
    for p in [0, 1, 3, 4] {
        assert_eq!(t.verdict(p), Verdict::Accepted, "{p}");
    }
    assert_eq!(t.verdict(2), Verdict::UnexpectedRank);
    assert_eq!(t.verdict(5), Verdict::UnexpectedRank);
    // Both dial at once: the higher rank's connection makes the link.
    t.slots[1] = Slot::Dialing;
    t.slots[3] = Slot::Dialing;
    assert_eq!(t.verdict(1), Verdict::Crossed);
    assert_eq!(t.verdict(3), Verdict::Accepted);
    // Adopted up to the stream count, then duplicates; ready once complete.
    t.slots[3] = Slot::Adopted(vec![pair()]);
    assert_eq!(t.verdict(3), Verdict::Accepted);
    assert!(!t.ready(3));
    if let Slot::Adopted(v) = &mut t.slots[3] {
        v.push(pair());
    }
    assert!(t.ready(3) && !t.ready(4));
    assert_eq!(t.verdict(3), Verdict::DuplicateRank);
    t.slots[4] = Slot::Made;
    assert_eq!(t.verdict(4), Verdict::DuplicateRank);
    // A lower rank's dial after this rank's own made the link: it crossed that dial.
    t.slots[1] = Slot::Made;
    assert_eq!(t.verdict(1), Verdict::Crossed);
}

#[test]
fn missing_links() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let mut lazy = LazyTcp::new(
        2,
        l,
        &[0, 1, 3, 4],
        &[(0, addr), (1, addr), (3, addr), (4, addr)],
        2,
        &SECRET,
        Duration::ZERO,
    )
    .unwrap();
    assert_eq!(lazy.peers(), vec![0, 1, 3, 4]);
    assert!(lazy.covers(3) && !lazy.covers(2) && !lazy.covers(5));
    // Not TCP peers (this rank, shared-memory peers, out of range) are never missing.
    assert_eq!(lazy.missing([3, 0, 3, 9, 2]), vec![0, 3]);
    lazy.state[4] = Peer::Made;
    lazy.made += 1;
    assert_eq!(lazy.missing(0..6), vec![0, 1, 3]);
    assert!(!lazy.all_made());
    // Nothing to make: no wait, no error, whatever the deadline.
    let none = lazy.connect(&[4, 2, 7], Instant::now(), &never, "t", 1);
    assert!(none.unwrap().is_empty());
}

#[test]
fn ring_neighbours_first_then_the_rest() {
    // Every rank needs its ring neighbours (one call), then the others (a later call). Both
    // ends of each pair dial at once (crossed dials, every pair).
    let n = 4;
    let made = ranks(n, |me, mut lazy| {
        let ring = [(me + 1) % n, (me + n - 1) % n];
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut links = lazy
            .connect(&ring, deadline, &never, "all_reduce", 1)
            .unwrap();
        ping(me, &mut links);
        let first: Vec<usize> = links.iter().map(|(p, _)| *p).collect();
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
        (first, rest.iter().map(|(p, _)| *p).collect::<Vec<_>>())
    });
    for (me, (first, rest)) in made.into_iter().enumerate() {
        // The first call made its ring neighbours' links (and may have taken the third
        // peer's, dialed by that peer's second call meanwhile); every link once.
        let (l, r) = ((me + n - 1) % n, (me + 1) % n);
        assert!(
            first.contains(&l) && first.contains(&r),
            "rank {me}: {first:?}"
        );
        let mut all: Vec<usize> = first.iter().chain(&rest).copied().collect();
        all.sort_unstable();
        let peers: Vec<usize> = (0..n).filter(|&p| p != me).collect();
        assert_eq!(all, peers, "rank {me}: {first:?} then {rest:?}");
    }
}

#[test]
fn a_peer_a_call_ahead_is_adopted_not_refused() {
    // Rank 0 first needs rank 1, then rank 2; rank 2 needs rank 0 at once (it is a call
    // ahead): its connection is adopted while rank 0 is in no call, and rank 0's first call
    // takes it along.
    let n = 3;
    ranks(n, |me, mut lazy| {
        let deadline = Instant::now() + Duration::from_secs(20);
        let steps: &[&[usize]] = match me {
            0 => &[&[1], &[2]],
            1 => &[&[0]],
            _ => &[&[0]],
        };
        let mut got = Vec::new();
        for (i, need) in steps.iter().enumerate() {
            if me == 0 && i == 0 {
                // Let rank 2's dial come first.
                thread::sleep(Duration::from_millis(200));
            }
            let mut links = lazy.connect(need, deadline, &never, "c", i as u64).unwrap();
            ping(me, &mut links);
            got.extend(links.iter().map(|(p, _)| *p));
        }
        got.sort_unstable();
        let want: Vec<usize> = if me == 0 { vec![1, 2] } else { vec![0] };
        assert_eq!(got, want, "rank {me}");
        if me == 0 {
            assert!(lazy.all_made());
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
fn a_peer_in_no_call_is_connected_by_its_acceptor() {
    // Rank 1 is in no call while rank 0 makes their link (limit (1) and (2) of the earlier
    // design: the link waited for rank 1's call); rank 1 takes it later at once.
    ranks(2, |me, mut lazy| {
        let start = Instant::now();
        if me == 0 {
            let mut links = lazy
                .connect(&[1], start + Duration::from_secs(20), &never, "send", 1)
                .unwrap();
            assert!(
                start.elapsed() < Duration::from_secs(1),
                "{:?}",
                start.elapsed()
            );
            ping(me, &mut links);
        } else {
            thread::sleep(Duration::from_millis(1500));
            // Already adopted: nothing to wait for, whatever the deadline.
            let mut links = lazy
                .connect(&[0], Instant::now(), &never, "recv", 1)
                .unwrap();
            ping(me, &mut links);
        }
        assert!(lazy.all_made());
    });
}

#[test]
fn a_crossed_dial_that_never_comes_is_an_error_at_the_deadline() {
    // Rank 1 claims to dial rank 0 and never does: its acceptor refuses rank 0's dial as
    // crossed, and rank 0 waits for a connection that does not come, until its deadline.
    let errs = ranks(2, |me, mut lazy| {
        if me == 1 {
            lazy.shared.lock().slots[0] = Slot::Dialing;
            thread::sleep(Duration::from_millis(1000));
            return None;
        }
        thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        let e = failed(lazy.connect(
            &[1],
            start + Duration::from_millis(400),
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
fn strangers_do_not_hold_up_the_acceptor() {
    // Rank 0's listener holds 20 silent connections and one with the wrong secret when rank 1
    // dials it: rank 1's link is made at once (an acceptor that served connections one at a
    // time would wait out each stranger's 1 s first-bytes timeout: 20 s).
    let took = ranks(2, |me, mut lazy| {
        let deadline = Instant::now() + Duration::from_secs(20);
        if me == 0 {
            let addr = lazy.listener.local_addr().unwrap();
            let silent: Vec<TcpStream> =
                (0..20).map(|_| TcpStream::connect(addr).unwrap()).collect();
            let wrong = crate::net::dial::Dial {
                addr,
                secret: &[9; 16],
                hello: Hello {
                    rank: 1,
                    purpose: Purpose::Data,
                    tag: auth::comm_tag(&SECRET),
                },
                deadline,
                first_pause: Duration::from_millis(1),
                max_pause: Duration::from_millis(1),
                refused_limit: None,
                connect: |a, t| TcpStream::connect_timeout(&a, t),
                stop: None,
            }
            .run(|_, _| {}, |g| Error::Env(g.last_err));
            assert!(matches!(wrong, Err(Error::Auth { .. })), "{wrong:?}");
            thread::sleep(Duration::from_millis(500));
            let mut links = lazy.connect(&[1], deadline, &never, "c", 1).unwrap();
            ping(me, &mut links);
            drop(silent);
            None
        } else {
            thread::sleep(Duration::from_millis(200));
            let start = Instant::now();
            let mut links = lazy.connect(&[0], deadline, &never, "c", 1).unwrap();
            let took = start.elapsed();
            ping(me, &mut links);
            Some(took)
        }
    });
    let took = took[1].unwrap();
    assert!(took < 5 * accept::FIRST_BYTES_TIMEOUT, "{took:?}");
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
fn a_failed_communicator_stops_the_wait() {
    // Rank 2 claims to dial ranks 0 and 1 and never does (their dials are refused as
    // crossed); `stop` reports a failure after 200 ms: both waits end with that error, long
    // before the deadline.
    let errs = ranks(3, |me, mut lazy| {
        if me == 2 {
            {
                let mut t = lazy.shared.lock();
                t.slots[0] = Slot::Dialing;
                t.slots[1] = Slot::Dialing;
            }
            thread::sleep(Duration::from_secs(1));
            return None;
        }
        thread::sleep(Duration::from_millis(50));
        let start = Instant::now();
        let stop = move || {
            (start.elapsed() > Duration::from_millis(200)).then(|| Error::PeerLost {
                rank: me,
                peer: 2,
                call: "reduce",
                seq: 9,
                reason: "test".into(),
            })
        };
        let e = failed(lazy.connect(&[2], start + Duration::from_secs(30), &stop, "reduce", 9));
        assert!(start.elapsed() < Duration::from_secs(5), "rank {me}");
        Some(e)
    });
    for me in [0, 1] {
        match errs[me].as_ref().unwrap() {
            Error::PeerLost {
                peer: 2, seq: 9, ..
            } => {}
            e => panic!("rank {me}: {e}"),
        }
    }
}

#[test]
fn crossed_striped_links_pair_their_streams_alike() {
    // Both ends of every pair dial at once with 3 streams a pair: one end's connections make
    // each link, striped in the same order on both ends (the pings would cross otherwise).
    let n = 3;
    for _ in 0..3 {
        thread::scope(|s| {
            for mut ex in LocalExchange::group(n) {
                s.spawn(move || {
                    let me = ex.rank();
                    let c = Config {
                        tcp_streams: 3,
                        ..cfg(20_000)
                    };
                    let Setup::Later(mut lazy) =
                        setup(&mut ex, &all_peers(me, n), &SECRET, &c).unwrap()
                    else {
                        panic!("rank {me}: links made at init under lazy")
                    };
                    let deadline = Instant::now() + Duration::from_secs(20);
                    let mut links = lazy
                        .connect(&lazy.peers(), deadline, &never, "c", 1)
                        .unwrap();
                    assert_eq!(links.len(), n - 1);
                    // Larger than one stream's share: every stream carries part of it.
                    let msg: Vec<u8> = (0..800_000u32).map(|i| (i * 7 + me as u32) as u8).collect();
                    for (p, l) in links.iter_mut() {
                        let mut sent = 0;
                        let mut got = Vec::new();
                        let start = Instant::now();
                        let want: Vec<u8> =
                            (0..800_000u32).map(|i| (i * 7 + *p as u32) as u8).collect();
                        while sent < msg.len() || got.len() < want.len() {
                            if sent < msg.len() {
                                sent += l.try_send(&msg[sent..]).unwrap();
                            }
                            let mut b = vec![0u8; 65536];
                            let k = l.try_recv_into(&mut b).unwrap();
                            got.extend_from_slice(&b[..k]);
                            assert!(start.elapsed() < Duration::from_secs(10), "rank {me}");
                        }
                        assert!(got == want, "rank {me}: garbled from {p}");
                    }
                    assert!(lazy.all_made());
                });
            }
        });
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
