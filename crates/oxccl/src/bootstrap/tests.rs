//! Tests of the TCP rendezvous, all over loopback.

use super::*;
use crate::net::auth::{Hello, Purpose};
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

fn cfg(timeout_ms: u64) -> Config {
    Config {
        timeout: Duration::from_millis(timeout_ms),
        ..Config::default()
    }
}

/// `c` with the exchanges directly between ranks (`mesh.rs`) in any world of two or more.
fn direct(c: Config) -> Config {
    Config {
        bootstrap_relay_max: 1,
        ..c
    }
}

/// `c` with the exchanges directly between ranks and every rank joining rank 0 itself (no
/// host leaders, `host.rs`).
fn direct_no_leaders(c: Config) -> Config {
    Config {
        bootstrap_host_leaders: false,
        ..direct(c)
    }
}

/// Checks that `b`'s exchanges go the way `c` says: through rank 0 up to
/// `bootstrap_relay_max` ranks, else directly.
fn check_path(b: &Bootstrap, c: &Config) {
    let n = b.world_size();
    assert_eq!(
        b.mesh.is_some(),
        n > 1 && n > c.bootstrap_relay_max,
        "{n} ranks"
    );
}

fn loopback_id() -> UniqueId {
    UniqueId::new_on(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap()
}

/// Runs `f(rank)` in `n` threads and returns the results by rank.
fn ranks<T: Send + 'static>(n: usize, f: impl Fn(usize) -> T + Send + Sync + 'static) -> Vec<T> {
    let f = Arc::new(f);
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let f = f.clone();
            thread::spawn(move || f(r))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn check_allgathers(b: &mut Bootstrap) {
    let n = b.world_size();
    for round in 0..20usize {
        let mine: Vec<u8> = (0..(b.rank() * 37 + round * 101) % 3000)
            .map(|i| (i + b.rank() + round) as u8)
            .collect();
        let all = b.allgather(&mine).unwrap();
        assert_eq!(all.len(), n);
        for (r, v) in all.iter().enumerate() {
            let want: Vec<u8> = (0..(r * 37 + round * 101) % 3000)
                .map(|i| (i + r + round) as u8)
                .collect();
            assert_eq!(v, &want, "round {round}, from rank {r}");
        }
    }
    b.barrier().unwrap();
}

#[test]
fn four_ranks_init_and_allgather() {
    four_ranks(cfg(20_000));
}

#[test]
fn four_ranks_init_and_allgather_direct() {
    four_ranks(direct(cfg(20_000)));
}

#[test]
fn four_ranks_init_and_allgather_direct_no_leaders() {
    four_ranks(direct_no_leaders(cfg(20_000)));
}

fn four_ranks(c: Config) {
    let id = loopback_id();
    let tables = ranks(4, move |r| {
        let mut b = Bootstrap::init(&id, r, 4, &c).unwrap();
        check_path(&b, &c);
        assert_eq!((b.rank(), b.world_size()), (r, 4));
        assert_eq!(b.secret(), &id.secret);
        check_allgathers(&mut b);
        (b.peers().to_vec(), b.comm_tag())
    });
    for (peers, tag) in &tables {
        assert_eq!(peers, &tables[0].0);
        assert_eq!(*tag, tables[0].1);
    }
    for (r, p) in tables[0].0.iter().enumerate() {
        assert_eq!(p.rank, r);
        assert_eq!(p.pid, std::process::id());
        assert!(p.ip.is_loopback());
        assert_eq!(p.host_id, tables[0].0[0].host_id);
    }
}

/// A world that is not a power of two: the exchanges' rounds wrap around.
#[test]
fn thirteen_ranks_init_and_allgather() {
    thirteen_ranks(cfg(20_000));
}

#[test]
fn thirteen_ranks_init_and_allgather_direct() {
    thirteen_ranks(direct(cfg(20_000)));
}

#[test]
fn thirteen_ranks_init_and_allgather_direct_no_leaders() {
    thirteen_ranks(direct_no_leaders(cfg(20_000)));
}

/// Also checks what rank 0 sent in the exchanges against the others: through rank 0 it sends
/// every rank everything (more than n-1 times a member's bytes), directly about as much as
/// any rank (each sends n-1 of the n contributions per exchange); and what stays open for
/// the watchdog ([`check_watch_links`]).
fn thirteen_ranks(c: Config) {
    let id = loopback_id();
    let relay = c.bootstrap_relay_max >= 13;
    let led = !relay && c.bootstrap_host_leaders;
    let tables = ranks(13, move |r| {
        let mut b = Bootstrap::init(&id, r, 13, &c).unwrap();
        check_path(&b, &c);
        check_allgathers(&mut b);
        let bytes = b.traffic.bytes;
        let traffic = b.traffic;
        check_watch_links(&mut b, relay);
        (b.peers().to_vec(), bytes, traffic)
    });
    // The rendezvous: rank 0 accepts one connection per rank, or, through host leaders,
    // one (ranks 1 to 12 share this host), whose leader accepted the 11 others.
    let root = tables[0].2;
    let local: Vec<u64> = tables.iter().map(|t| t.2.local_accepts).collect();
    if led {
        assert_eq!(root.rendezvous_accepts, 1, "{root:?}");
        assert!((1..=12).contains(&root.rendezvous_received), "{root:?}");
        assert_eq!(root.rendezvous_sent, 1, "{root:?}");
        let mut l = local.clone();
        l.sort_unstable();
        assert_eq!(l[12], 11, "{local:?}");
        assert_eq!(l[11], 0, "{local:?}");
    } else {
        assert_eq!(root.rendezvous_accepts, 12, "{root:?}");
        assert_eq!(root.rendezvous_received, 12, "{root:?}");
        assert_eq!(root.rendezvous_sent, 12, "{root:?}");
        assert!(local.iter().all(|&a| a == 0), "{local:?}");
    }
    let tables: Vec<(Vec<PeerInfo>, u64)> = tables.into_iter().map(|t| (t.0, t.1)).collect();
    for (peers, _) in &tables {
        assert_eq!(peers, &tables[0].0);
        assert!(peers.iter().enumerate().all(|(r, p)| p.rank == r));
    }
    let root = tables[0].1;
    let most = tables[1..].iter().map(|t| t.1).max().unwrap();
    if relay {
        assert!(
            root > 12 * tables[1].1,
            "rank 0 sent {root} bytes, rank 1 {}",
            tables[1].1
        );
    } else {
        assert!(
            root > 0 && root < 2 * most,
            "rank 0 sent {root} bytes, the most of the others {most}"
        );
    }
}

/// What [`Bootstrap::take_connections`] leaves for the watchdog, after the exchanges: through
/// rank 0 a star (n-1 connections at rank 0, one to rank 0 at the others); directly, at
/// every rank rank 0 included, the `2 ceil(log2 n)` exchange links to the ranks it sends to
/// and hears from, and no other connection to rank 0. Every connection is live and empty:
/// each rank writes its rank on each, and reads from each exactly the byte of the rank at
/// its other end (no exchange data left in them).
fn check_watch_links(b: &mut Bootstrap, relay: bool) {
    let (rank, n) = (b.rank(), b.world_size());
    let (conns, graph) = b.take_connections();
    let mut peers: Vec<usize> = conns.iter().map(|(p, _, _)| *p).collect();
    peers.sort_unstable();
    let mut want: Vec<usize> = if relay {
        if rank == 0 {
            (1..n).collect()
        } else {
            vec![0]
        }
    } else {
        (0..mesh::rounds(n))
            .flat_map(|k| [mesh::sends_to(rank, k, n), mesh::hears_from(rank, k, n)])
            .collect()
    };
    want.sort_unstable();
    assert_eq!(graph, !relay, "rank {rank}");
    assert_eq!(peers, want, "rank {rank}: the watchdog's connections");
    // Heartbeats: over every link of a star; in a graph over the ring (ranks ±1) only.
    let mut beating: Vec<usize> = conns.iter().filter(|c| c.2).map(|c| c.0).collect();
    beating.sort_unstable();
    let mut ring = if relay {
        want.clone()
    } else {
        vec![(rank + n - 1) % n, (rank + 1) % n]
    };
    ring.sort_unstable();
    assert_eq!(beating, ring, "rank {rank}: the links with heartbeats");
    for (_, s, _) in &conns {
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        (&*s).write_all(&[rank as u8]).unwrap();
    }
    for (p, s, _) in &conns {
        let mut got = [0u8; 1];
        std::io::Read::read_exact(&mut &*s, &mut got).unwrap();
        assert_eq!(got[0] as usize, *p, "rank {rank}: the link to rank {p}");
    }
}

/// A rank that leaves after init (its connections close) while the others exchange: every
/// other rank fails at once, naming it, long before the timeout.
#[test]
fn a_rank_gone_during_an_exchange_is_named_by_every_rank_at_once() {
    rank_gone(cfg(30_000));
}

#[test]
fn a_rank_gone_during_a_direct_exchange_is_named_by_every_rank_at_once() {
    rank_gone(direct(cfg(30_000)));
}

#[test]
fn a_rank_gone_during_a_direct_exchange_is_named_by_every_rank_at_once_no_leaders() {
    rank_gone(direct_no_leaders(cfg(30_000)));
}

fn rank_gone(c: Config) {
    let id = loopback_id();
    let start = Instant::now();
    let res = ranks(6, move |r| {
        let mut b = Bootstrap::init(&id, r, 6, &c).unwrap();
        check_path(&b, &c);
        b.barrier().unwrap();
        if r == 3 {
            return None;
        }
        Some(b.allgather(b"x").unwrap_err())
    });
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    for (r, e) in res.into_iter().enumerate() {
        let Some(e) = e else { continue };
        assert_eq!(e.lost_peer(), Some(3), "rank {r}: {e}");
    }
}

/// A rank that stays but never comes to an exchange: every other rank fails within its
/// timeout and a few grace periods, naming it.
#[test]
fn a_silent_rank_in_an_exchange_is_named_after_the_timeout() {
    silent_rank(cfg(1_000));
}

#[test]
fn a_silent_rank_in_a_direct_exchange_is_named_after_the_timeout() {
    silent_rank(direct(cfg(1_000)));
}

fn silent_rank(c: Config) {
    let id = loopback_id();
    let start = Instant::now();
    let res = ranks(6, move |r| {
        let mut b = Bootstrap::init(&id, r, 6, &c).unwrap();
        check_path(&b, &c);
        b.barrier().unwrap();
        if r == 3 {
            thread::sleep(Duration::from_secs(5));
            return None;
        }
        Some(b.allgather(b"x").unwrap_err())
    });
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
    for (r, e) in res.into_iter().enumerate() {
        let Some(e) = e else { continue };
        let named = match &e {
            Error::Timeout { waiting_on, .. } => waiting_on == &vec![3],
            e => e.lost_peer() == Some(3),
        };
        assert!(named, "rank {r}: {e}");
    }
}

/// What rank 0 says at init reaches every rank with the peer table; what the others say is
/// ignored; exchanges after it are unaffected.
#[test]
fn rank_0_says_something_to_every_rank_with_the_peer_table() {
    rank_0_says(cfg(20_000));
}

#[test]
fn rank_0_says_something_to_every_rank_before_direct_exchanges() {
    rank_0_says(direct(cfg(20_000)));
}

fn rank_0_says(c: Config) {
    let id = loopback_id();
    let heard = ranks(3, move |r| {
        let says = vec![r as u8 + 10; 1000 * (r + 1)];
        let mut b = Bootstrap::init_saying(&id, r, 3, &c, &says).unwrap();
        check_path(&b, &c);
        check_allgathers(&mut b);
        b.root_says().to_vec()
    });
    for h in heard {
        assert_eq!(h, vec![10u8; 1000]);
    }
}

/// Rank 0's setting decides the path, and a rank that joins without an exchange listener
/// (its setting says relay) makes rank 0 relay: with settings that differ between ranks,
/// either way, every rank's exchanges go through rank 0 and work. But ranks that join
/// through their host's leader (their setting says direct) make rank 0 exchange directly.
#[test]
fn settings_that_differ_between_ranks_fall_back_to_rank_0() {
    for (root_direct, leaders) in [(true, true), (false, false), (false, true)] {
        let id = loopback_id();
        let relayed = ranks(4, move |r| {
            let c = if (r == 0) == root_direct {
                direct(cfg(20_000))
            } else {
                cfg(20_000)
            };
            let c = Config {
                bootstrap_host_leaders: leaders,
                ..c
            };
            let mut b = Bootstrap::init(&id, r, 4, &c).unwrap();
            check_allgathers(&mut b);
            b.mesh.is_none()
        });
        let want = root_direct || !leaders;
        assert!(
            relayed.iter().all(|&x| x == want),
            "rank 0 direct: {root_direct}, leaders: {leaders}: {relayed:?}"
        );
    }
}

/// A rank that is slow to reach an exchange through rank 0: rank 0 says, every period, that
/// it waits for that rank, the others that they wait for rank 0's answer; the exchange then
/// completes.
#[test]
fn a_slow_rank_in_an_exchange_is_named_in_progress_lines() {
    let lines = slow_rank(Config {
        startup_report: Some(Duration::from_millis(300)),
        ..cfg(20_000)
    });
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("rank 0: bootstrap exchange #2: waiting ")
                && l.contains("for rank 2 (the ranks below it have answered)")),
        "{lines:#?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("rank 1: bootstrap exchange #2: waiting ")
                && l.contains("for rank 0's answer")),
        "{lines:#?}"
    );
}

/// A rank that is slow to reach a direct exchange: the ranks that hear from it (rank 1 in
/// the first round, rank 0 in the second) say, every period, that they wait for its
/// message; the exchange then completes.
#[test]
fn a_slow_rank_in_a_direct_exchange_is_named_in_progress_lines() {
    let lines = slow_rank(direct(Config {
        startup_report: Some(Duration::from_millis(300)),
        ..cfg(20_000)
    }));
    assert!(
        lines.iter().any(|l| l
            .starts_with("rank 0: bootstrap exchange #2, round 2 of 2: waiting ")
            && l.contains("for rank 2's message")),
        "{lines:#?}"
    );
    assert!(
        lines.iter().any(|l| l
            .starts_with("rank 1: bootstrap exchange #2, round 1 of 2: waiting ")
            && l.contains("for rank 2's message")),
        "{lines:#?}"
    );
}

/// Three ranks under `c`, rank 2 1.3 s late to the second exchange; the progress lines
/// announced so far (by every test).
fn slow_rank(c: Config) -> Vec<String> {
    let id = loopback_id();
    let seqs = ranks(3, move |r| {
        let mut b = Bootstrap::init(&id, r, 3, &c).unwrap();
        check_path(&b, &c);
        b.allgather(b"first").unwrap();
        if r == 2 {
            thread::sleep(Duration::from_millis(1300));
        }
        let all = b.allgather(&[r as u8]).unwrap();
        assert_eq!(all, vec![vec![0u8], vec![1], vec![2]]);
        b.comm_tag()
    });
    assert!(seqs.windows(2).all(|w| w[0] == w[1]));
    crate::base::debug::ANNOUNCED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

#[test]
fn world_of_one() {
    let id = loopback_id();
    let mut b = Bootstrap::init(&id, 0, 1, &cfg(1000)).unwrap();
    assert_eq!(b.allgather(b"x").unwrap(), vec![b"x".to_vec()]);
    assert_eq!(b.peers().len(), 1);
    assert!(!format!("{b:?}").contains(&format!("{:?}", id.secret)));
    assert!(matches!(
        Bootstrap::init(&id, 1, 1, &cfg(100)),
        Err(Error::InvalidArgument { rank: 1, .. })
    ));
    assert!(matches!(
        Bootstrap::init(&id, 0, 0, &cfg(100)),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn root_binds_given_address() {
    // No UniqueId::new in this process: rank 0 binds the address itself.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let id = UniqueId::with_addr(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port), [3; 16]);
    let res = ranks(3, move |r| {
        let mut b = Bootstrap::init(&id, r, 3, &cfg(20_000)).unwrap();
        b.allgather(&[r as u8]).unwrap()
    });
    for all in res {
        assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
    }
}

#[test]
fn strangers_hammering_root_do_not_stop_init() {
    let id = loopback_id();
    let stop = Arc::new(AtomicBool::new(false));
    let addr = id.addr;
    let mut strangers = Vec::new();
    // A silent stranger that holds its connections open.
    {
        let stop = stop.clone();
        strangers.push(thread::spawn(move || {
            let mut held = Vec::new();
            while !stop.load(Ordering::SeqCst) && held.len() < 20 {
                if let Ok(s) = TcpStream::connect(addr) {
                    held.push(s);
                }
                thread::sleep(Duration::from_millis(20));
            }
        }));
    }
    // Garbage, huge length prefixes, and a wrong-secret handshake.
    {
        let stop = stop.clone();
        strangers.push(thread::spawn(move || {
            let mut i = 0u32;
            while !stop.load(Ordering::SeqCst) {
                i += 1;
                if let Ok(mut s) = TcpStream::connect(addr) {
                    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
                    match i % 3 {
                        0 => {
                            let _ = s.write_all(&[0xff; 100]);
                        }
                        1 => {
                            let _ = s.write_all(&u32::MAX.to_le_bytes());
                        }
                        _ => {
                            let h = Hello {
                                rank: 1,
                                purpose: Purpose::Rendezvous,
                                tag: 0,
                            };
                            let r = auth::client_handshake(&mut s, &[9; 16], &h, 1, "root");
                            assert!(r.is_err());
                        }
                    }
                }
                thread::sleep(Duration::from_millis(2));
            }
        }));
    }
    thread::sleep(Duration::from_millis(100));
    let res = ranks(4, move |r| {
        thread::sleep(Duration::from_millis(50 * r as u64));
        let mut b = Bootstrap::init(&id, r, 4, &cfg(20_000)).unwrap();
        check_allgathers(&mut b);
    });
    assert_eq!(res.len(), 4);
    stop.store(true, Ordering::SeqCst);
    for s in strangers {
        s.join().unwrap();
    }
}

#[test]
fn wrong_secret_is_refused() {
    let id = loopback_id();
    let mut other = id.clone();
    other.secret[0] ^= 1;
    let root = thread::spawn(move || Bootstrap::init(&id, 0, 2, &cfg(1500)));
    let e = Bootstrap::init(&other, 1, 2, &cfg(1500)).unwrap_err();
    assert!(matches!(e, Error::Auth { rank: 1, .. }), "{e}");
    let e = root.join().unwrap().unwrap_err();
    match &e {
        Error::Rendezvous { rank: 0, msg, .. } => {
            assert!(msg.contains("still waiting on rank(s) [1]"), "{e}");
            assert!(
                msg.contains("1 connection(s) from 127.0.0.1 (1 closed mid-handshake) dropped without a valid handshake"),
                "{e}"
            );
        }
        e => panic!("{e}"),
    }
}

/// Opens connections to `addr` until `stop`, keeping the last `keep` open; each sends `first`
/// (nothing when empty) and then stays silent.
fn flood(
    addr: SocketAddr,
    keep: usize,
    first: Vec<u8>,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<usize> {
    thread::spawn(move || {
        let mut held = std::collections::VecDeque::new();
        let mut opened = 0;
        while !stop.load(Ordering::SeqCst) {
            if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                opened += 1;
                let _ = s.write_all(&first);
                held.push_back(s);
                if held.len() > keep {
                    held.pop_front();
                }
            }
            thread::sleep(Duration::from_micros(500));
        }
        opened
    })
}

/// The challenge a connector sends first: well-formed, so the acceptor answers it and waits
/// for a proof that never comes.
fn valid_challenge() -> Vec<u8> {
    [&auth::MAGIC[..], &auth::VERSION.to_le_bytes(), &[0x5a; 16]].concat()
}

#[test]
fn floods_of_silent_stalled_and_garbage_connections_do_not_stop_init() {
    let id = loopback_id();
    let stop = Arc::new(AtomicBool::new(false));
    let floods = vec![
        flood(id.addr, 300, Vec::new(), stop.clone()),
        flood(id.addr, 300, Vec::new(), stop.clone()),
        flood(id.addr, 300, valid_challenge(), stop.clone()),
        flood(
            id.addr,
            50,
            b"GET / HTTP/1.0\r\n\r\n".to_vec(),
            stop.clone(),
        ),
    ];
    // Rank 0 listens under the flood for a while before the others come.
    let id2 = id.clone();
    let res = ranks(3, move |r| {
        if r > 0 {
            thread::sleep(Duration::from_millis(1500));
        }
        let mut b = Bootstrap::init(&id2, r, 3, &cfg(30_000))?;
        check_allgathers(&mut b);
        Ok::<_, Error>(())
    });
    stop.store(true, Ordering::SeqCst);
    let opened: usize = floods.into_iter().map(|f| f.join().unwrap()).sum();
    for r in res {
        r.unwrap();
    }
    assert!(opened > 500, "the flood opened only {opened} connections");
}

#[test]
fn a_timeout_under_a_flood_names_the_flood() {
    let id = loopback_id();
    let stop = Arc::new(AtomicBool::new(false));
    let f = flood(id.addr, 100, Vec::new(), stop.clone());
    let e = Bootstrap::init(&id, 0, 2, &cfg(2500)).unwrap_err();
    stop.store(true, Ordering::SeqCst);
    f.join().unwrap();
    let msg = e.to_string();
    assert!(msg.contains("still waiting on rank(s) [1]"), "{msg}");
    assert!(msg.contains("from 127.0.0.1 ("), "{msg}");
    assert!(msg.contains("dropped without a valid handshake"), "{msg}");
}

/// Joins the rendezvous of `id` as `rank` by hand and returns the connection, without
/// waiting for the peer table.
fn join_by_hand(id: &UniqueId, rank: usize, world: usize) -> TcpStream {
    let mut s = TcpStream::connect(id.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hello = Hello {
        rank,
        purpose: Purpose::Rendezvous,
        tag: auth::comm_tag(&id.secret),
    };
    auth::client_handshake(&mut s, &id.secret, &hello, rank, "root").unwrap();
    let mut join = vec![JOIN_VERSION];
    join.extend_from_slice(&(world as u32).to_le_bytes());
    PeerInfo {
        rank,
        host_id: "h".into(),
        hostname: "joiner".into(),
        pid: 4242,
        ip: Ipv4Addr::LOCALHOST.into(),
    }
    .encode(&mut join);
    join.extend_from_slice(&0u16.to_le_bytes());
    auth::write_frame(&mut s, &join).unwrap();
    s
}

#[test]
fn root_fails_at_once_when_a_joined_rank_dies() {
    let id = loopback_id();
    let id2 = id.clone();
    let root = thread::spawn(move || Bootstrap::init(&id2, 0, 3, &cfg(60_000)).map(|_| ()));
    let s = join_by_hand(&id, 1, 3);
    thread::sleep(Duration::from_millis(200));
    drop(s);
    let e = root.join().unwrap().unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("rank 1 (joiner, pid 4242) joined the rendezvous at ")
            && msg.contains(" and then closed its connection"),
        "{msg}"
    );
    assert!(msg.contains("rank(s) [2] had not joined yet"), "{msg}");
    assert_eq!(e.lost_peer(), Some(1));
    assert_eq!(crate::base::error::blamed_rank(&msg), Some(1), "{msg}");
}

#[test]
fn a_rank_without_root_fails_when_refused_for_long() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port);
    let c = Config {
        rendezvous_refused: Duration::from_millis(300),
        ..cfg(60_000)
    };
    let e = Bootstrap::init(&UniqueId::with_addr(addr, [1; 16]), 1, 2, &c).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            Error::Connect {
                rank: 1,
                peer: 0,
                ..
            }
        ),
        "{msg}"
    );
    assert!(msg.contains(&addr.to_string()), "{msg}");
    assert!(msg.contains("nothing listens there"), "{msg}");
}

#[test]
fn no_root_fails_after_timeout() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port);
    let start = Instant::now();
    let e = Bootstrap::init(&UniqueId::with_addr(addr, [1; 16]), 2, 3, &cfg(600)).unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(550));
    match &e {
        Error::Connect {
            rank: 2,
            peer: 0,
            addr: a,
            ..
        } => assert_eq!(a, &addr.to_string()),
        e => panic!("{e}"),
    }
    assert!(e.to_string().contains(&addr.to_string()));
}

#[test]
fn duplicate_rank_is_an_error() {
    let id = loopback_id();
    let res = ranks(3, move |r| {
        Bootstrap::init(&id, r.min(1), 3, &cfg(10_000)).map(|_| ())
    });
    match &res[0] {
        Err(Error::Rendezvous { rank: 0, msg, .. }) => {
            assert!(msg.contains("rank 1 joined twice"), "{msg}")
        }
        other => panic!("{other:?}"),
    }
    for r in &res[1..] {
        assert!(matches!(r, Err(Error::Rendezvous { rank: 1, .. })), "{r:?}");
    }
}

#[test]
fn world_size_mismatch_is_an_error() {
    let id = loopback_id();
    let id2 = id.clone();
    let root = thread::spawn(move || Bootstrap::init(&id2, 0, 2, &cfg(10_000)).map(|_| ()));
    let e = Bootstrap::init(&id, 1, 3, &cfg(10_000)).unwrap_err();
    match &e {
        Error::Rendezvous { rank: 1, msg, .. } => assert!(msg.contains("world size"), "{msg}"),
        e => panic!("{e}"),
    }
    let e = root.join().unwrap().unwrap_err();
    assert!(e.to_string().contains("world size 3"), "{e}");
}

#[test]
fn lost_peer_is_named() {
    let id = loopback_id();
    let id2 = id.clone();
    let member = thread::spawn(move || {
        let mut b = Bootstrap::init(&id2, 1, 2, &cfg(10_000)).unwrap();
        b.barrier().unwrap();
    });
    let mut b = Bootstrap::init(&id, 0, 2, &cfg(10_000)).unwrap();
    b.barrier().unwrap();
    member.join().unwrap();
    match b.allgather(b"x").unwrap_err() {
        Error::PeerLost {
            rank: 0, peer: 1, ..
        } => {}
        e => panic!("{e}"),
    }
}

#[test]
fn host_id_and_interfaces() {
    let c = Config {
        host_id: Some("nodeA".into()),
        ..Config::default()
    };
    assert_eq!(local_host_id(&c), "nodeA");
    let h = local_host_id(&Config::default());
    assert!(h.starts_with(&hostname()), "{h}");
    assert_eq!(h, local_host_id(&Config::default()));

    let to: SocketAddr = "127.0.0.1:1".parse().unwrap();
    assert!(local_ip(&Config::default(), to).unwrap().is_loopback());
    let c = Config {
        socket_ifname: Some("lo".into()),
        ..Config::default()
    };
    assert_eq!(local_ip(&c, to).unwrap(), IpAddr::V4(Ipv4Addr::LOCALHOST));
    let c = Config {
        socket_ifname: Some("nonexistent0".into()),
        ..Config::default()
    };
    match local_ip(&c, to) {
        Err(Error::Env(m)) => assert!(m.contains("nonexistent0") && m.contains("lo"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn peer_info_round_trip() {
    let p = PeerInfo {
        rank: 3,
        host_id: "h:b:1:2".into(),
        hostname: "h".into(),
        pid: 42,
        ip: "::1".parse().unwrap(),
    };
    let mut b = Vec::new();
    p.encode(&mut b);
    assert_eq!(PeerInfo::decode(&mut &b[..]), Some(p));
    for cut in 0..b.len() {
        assert_eq!(PeerInfo::decode(&mut &b[..cut]), None);
    }
}

// Host leaders (`host.rs`).

/// The leader socket's name for `id` on this host under `c`.
fn leader_name_of(id: &UniqueId, c: &Config) -> String {
    host::leader_name(auth::comm_tag(&id.secret), id.addr, &local_host_id(c))
}

/// Waits until a leader holds `name` (something accepts connections there).
fn await_leader(name: &str) {
    let until = Instant::now() + Duration::from_secs(20);
    while host::connect_name(name, until).unwrap().is_none() {
        assert!(Instant::now() < until, "no leader bound {name}");
        thread::sleep(Duration::from_millis(5));
    }
}

/// Ranks of three emulated hosts (host ids): rank 0 accepts one connection per host, three
/// (rank 0's host's other ranks have a leader too), and every rank has the right table.
#[test]
fn the_ranks_of_each_host_join_through_one_leader() {
    let id = loopback_id();
    let res = ranks(12, move |r| {
        let c = Config {
            host_id: Some(format!("h{}", r % 3)),
            ..direct(cfg(20_000))
        };
        let mut b = Bootstrap::init(&id, r, 12, &c).unwrap();
        check_path(&b, &c);
        check_allgathers(&mut b);
        (b.peers().to_vec(), b.traffic)
    });
    assert_eq!(res[0].1.rendezvous_accepts, 3, "{:?}", res[0].1);
    let mut leaders: Vec<u64> = res
        .iter()
        .map(|t| t.1.local_accepts)
        .filter(|&a| a > 0)
        .collect();
    leaders.sort_unstable();
    // Host h0: ranks 3, 6, 9 (rank 0 stays out); h1: 1, 4, 7, 10; h2: 2, 5, 8, 11.
    assert_eq!(leaders, vec![2, 3, 3], "{res:?}");
    for (peers, _) in &res {
        assert_eq!(peers, &res[0].0);
        for (r, p) in peers.iter().enumerate() {
            assert_eq!(p.host_id, format!("h{}", r % 3));
        }
    }
}

/// Strangers on the leader's socket (silent, garbage, a wrong secret) are dropped and keep
/// no rank from joining.
#[test]
fn strangers_on_the_leader_socket_do_not_stop_init() {
    let id = loopback_id();
    let c = direct(cfg(30_000));
    let name = leader_name_of(&id, &c);
    let (id2, c2) = (id.clone(), c.clone());
    // Ranks 1 to 5 first: one leads and waits for rank 0.
    let members = thread::spawn(move || {
        ranks(5, move |r| {
            let mut b = Bootstrap::init(&id2, r + 1, 6, &c2)?;
            check_allgathers(&mut b);
            Ok::<_, Error>(b.traffic.local_accepts)
        })
    });
    await_leader(&name);
    let until = Instant::now() + Duration::from_secs(5);
    let mut held = Vec::new();
    for i in 0..30 {
        let mut s = host::connect_name(&name, until).unwrap().unwrap();
        match i % 3 {
            0 => {}
            1 => {
                let _ = s.write_all(b"GET / HTTP/1.0\r\n\r\n");
            }
            _ => {
                let mut other = id.secret;
                other[0] ^= 1;
                let hello = Hello {
                    rank: 2,
                    purpose: Purpose::Rendezvous,
                    tag: auth::comm_tag(&other),
                };
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let e = auth::client_handshake(&mut s, &other, &hello, 2, "leader").unwrap_err();
                assert!(matches!(e, Error::Auth { .. }), "{e}");
            }
        }
        held.push(s);
    }
    let mut b = Bootstrap::init(&id, 0, 6, &c).unwrap();
    check_allgathers(&mut b);
    assert_eq!(b.traffic.rendezvous_accepts, 1);
    let accepted: u64 = members
        .join()
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .sum();
    assert_eq!(accepted, 4, "the leader admitted strangers");
    drop(held);
}

/// Something else holding the leader's name (it fails the handshake): the ranks join rank 0
/// themselves.
#[test]
fn a_squatter_on_the_leader_name_makes_ranks_join_rank_0_directly() {
    let id = loopback_id();
    let c = direct(cfg(20_000));
    let l = host::bind_name(&leader_name_of(&id, &c)).unwrap().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let squatter = thread::spawn(move || {
        l.set_nonblocking(true).unwrap();
        while !stop2.load(Ordering::SeqCst) {
            match l.accept() {
                Ok((mut s, _)) => {
                    let _ = s.write_all(b"not oxccl, not at all, no");
                }
                Err(_) => thread::sleep(Duration::from_millis(2)),
            }
        }
    });
    let res = ranks(5, move |r| {
        let mut b = Bootstrap::init(&id, r, 5, &c).unwrap();
        check_allgathers(&mut b);
        b.traffic
    });
    stop.store(true, Ordering::SeqCst);
    squatter.join().unwrap();
    assert_eq!(res[0].rendezvous_accepts, 4, "{:?}", res[0]);
}

/// This host's leader dies after taking a member's join: the member fails at once naming
/// it (by rank, as the leader said when it accepted), not rank 0, which never started.
#[test]
fn a_leader_killed_mid_join_is_named_by_its_member() {
    let id = loopback_id();
    let c = direct(cfg(20_000));
    let l = host::bind_name(&leader_name_of(&id, &c)).unwrap().unwrap();
    let secret = id.secret;
    let fake = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let tag = auth::comm_tag(&secret);
        let hello =
            auth::server_handshake(&mut s, &secret, Purpose::Rendezvous, tag, 7, "m").unwrap();
        auth::send_verdict(&mut s, auth::Verdict::Accepted).unwrap();
        let mut me = 7u32.to_le_bytes().to_vec();
        me.extend_from_slice(&4242u32.to_le_bytes());
        auth::write_frame(&mut s, &me).unwrap();
        let join = auth::read_frame(&mut s, MAX_JOIN).unwrap();
        assert_eq!(parse_join(&join).unwrap().1.rank, hello.rank);
        // Dies: its connection closes.
    });
    let start = Instant::now();
    let e = Bootstrap::init(&id, 1, 9, &c).unwrap_err();
    fake.join().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(e.lost_peer(), Some(7), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("this host's leader") && msg.contains("pid 4242"),
        "{msg}"
    );
}

/// A member dies after joining through its leader, before rank 0 answered: the leader fails
/// naming it, and tells rank 0, which fails naming it too, long before the timeout.
#[test]
fn a_member_gone_mid_join_is_named_by_its_leader_and_rank_0() {
    let id = loopback_id();
    let c = direct(cfg(30_000));
    let name = leader_name_of(&id, &c);
    let (id0, c0) = (id.clone(), c.clone());
    let root = thread::spawn(move || Bootstrap::init(&id0, 0, 4, &c0).map(|_| ()));
    let (id1, c1) = (id.clone(), c.clone());
    let leader = thread::spawn(move || Bootstrap::init(&id1, 1, 4, &c1).map(|_| ()));
    await_leader(&name);
    let start = Instant::now();
    {
        let mut s = host::connect_name(&name, start + Duration::from_secs(5))
            .unwrap()
            .unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let hello = Hello {
            rank: 2,
            purpose: Purpose::Rendezvous,
            tag: auth::comm_tag(&id.secret),
        };
        auth::client_handshake(&mut s, &id.secret, &hello, 2, "leader").unwrap();
        let who = auth::read_frame(&mut s, 8).unwrap();
        assert_eq!(&who[..4], &1u32.to_le_bytes());
        let mut join = vec![JOIN_VERSION];
        join.extend_from_slice(&4u32.to_le_bytes());
        PeerInfo {
            rank: 2,
            host_id: "h".into(),
            hostname: "joiner".into(),
            pid: 4242,
            ip: Ipv4Addr::LOCALHOST.into(),
        }
        .encode(&mut join);
        join.extend_from_slice(&1u16.to_le_bytes());
        auth::write_frame(&mut s, &join).unwrap();
        thread::sleep(Duration::from_millis(200));
        // Dies.
    }
    let e = leader.join().unwrap().unwrap_err();
    assert_eq!(e.lost_peer(), Some(2), "leader: {e}");
    let e = root.join().unwrap().unwrap_err();
    assert_eq!(e.lost_peer(), Some(2), "rank 0: {e}");
    assert!(e.to_string().contains("host leader rank 1"), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

/// Two communicators on one host at once: two leader names, one leader each, and each rank 0
/// accepts one connection.
#[test]
fn two_jobs_on_one_host_have_a_leader_each() {
    let ids = [loopback_id(), loopback_id()];
    let c = direct(cfg(20_000));
    assert_ne!(leader_name_of(&ids[0], &c), leader_name_of(&ids[1], &c));
    let res = ranks(10, move |i| {
        let (job, r) = (i % 2, i / 2);
        let mut b = Bootstrap::init(&ids[job], r, 5, &c).unwrap();
        check_allgathers(&mut b);
        (job, r, b.traffic)
    });
    for (job, r, t) in &res {
        if *r == 0 {
            assert_eq!(t.rendezvous_accepts, 1, "job {job}: {t:?}");
        }
    }
    for job in 0..2 {
        let led: Vec<u64> = res
            .iter()
            .filter(|x| x.0 == job && x.2.local_accepts > 0)
            .map(|x| x.2.local_accepts)
            .collect();
        assert_eq!(led, vec![3], "job {job}");
    }
}
