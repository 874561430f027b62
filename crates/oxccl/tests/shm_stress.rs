//! Shared-memory transport between threads: real /dev/shm segments, every ordered pair
//! streaming verified bytes through small rings, sleeping on doorbells.

mod shm_common;

use std::time::{Duration, Instant};

use oxccl::testing::bootstrap::local::LocalExchange;
use oxccl::testing::bootstrap::Exchange;
use oxccl::testing::transport::shm::{self, connect};
use oxccl::testing::transport::{LinkError, TransportKind};
use oxccl::{Config, Error};
use shm_common::*;

fn cfg(ring: usize) -> Config {
    Config {
        shm_ring_bytes: ring,
        spin: 200,
        ..Config::default()
    }
}

/// `n` ranks in threads, all pairs over shm, each streaming `bytes` to every other; a rank
/// spins `spin` rounds before it sleeps (0: sleeps at once, the hardest case for wake-ups).
/// A sleep slice of 20 s that runs out means a lost wake-up (nothing here legitimately waits
/// that long), and fails the test, as does the overall deadline.
fn stress(n: usize, bytes: u64, ring: usize, spin: u32) {
    let tag = random_tag();
    let start = Instant::now();
    let threads: Vec<_> = LocalExchange::group(n)
        .into_iter()
        .map(|mut ex| {
            std::thread::spawn(move || {
                let rank = ex.rank();
                let pid = std::process::id();
                let peers: Vec<(usize, u32)> =
                    (0..n).filter(|&r| r != rank).map(|r| (r, pid)).collect();
                let links = connect(&mut ex, &peers, tag, &cfg(ring)).unwrap();
                assert_eq!(
                    links.iter().map(|l| l.0).collect::<Vec<_>>(),
                    (0..n).filter(|&r| r != rank).collect::<Vec<_>>()
                );
                assert!(links.iter().all(|l| l.1.kind() == TransportKind::Shm));
                assert!(
                    leftover_segments(tag).is_empty(),
                    "nothing of the communicator in /dev/shm after connect ({})",
                    shm::segment_name(tag, rank)
                );
                let plan = Plan {
                    bytes,
                    max_send: 3 * ring as u64,
                    max_take: 2 * ring as u64,
                    slice: Duration::from_secs(20),
                    deadline: Duration::from_secs(60),
                    tag,
                };
                run_rank(rank, links, &plan, spin).unwrap_or_else(|e| panic!("rank {rank}: {e}"))
            })
        })
        .collect();
    let stats: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    eprintln!(
        "{n} ranks, {bytes} B per pair, ring {ring}, spin {spin}: {:?}, {stats:?}",
        start.elapsed()
    );
    assert!(
        stats.iter().all(|s| s.sleep_timeouts == 0),
        "a sleeper was not woken: {stats:?}"
    );
    assert!(
        leftover_segments(tag).is_empty(),
        "left in /dev/shm: {:?}",
        leftover_segments(tag)
    );
}

#[test]
fn stress_2_ranks() {
    stress(2, 32 << 20, 4096, 200);
}

#[test]
fn stress_2_ranks_always_sleep() {
    stress(2, 8 << 20, 4096, 0);
}

#[test]
fn stress_3_ranks() {
    stress(3, 16 << 20, 4096, 200);
}

#[test]
fn stress_3_ranks_always_sleep() {
    stress(3, 6 << 20, 4096, 0);
}

#[test]
fn stress_4_ranks() {
    stress(4, 12 << 20, 4096, 200);
}

#[test]
fn stress_4_ranks_always_sleep() {
    stress(4, 4 << 20, 4096, 0);
}

/// A larger, non-power-of-two ring request is rounded up and works the same.
#[test]
fn stress_rounded_ring() {
    stress(2, 8 << 20, 5000, 50);
}

/// Runs `f(rank, exchange)` in `n` threads and returns the results by rank.
fn in_threads<T: Send + 'static>(
    n: usize,
    f: impl Fn(&mut LocalExchange) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = std::sync::Arc::new(f);
    let ts: Vec<_> = LocalExchange::group(n)
        .into_iter()
        .map(|mut ex| {
            let f = f.clone();
            std::thread::spawn(move || f(&mut ex))
        })
        .collect();
    ts.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Ranks 0 and 1 share memory, rank 2 has no shm peers but still takes part.
#[test]
fn rank_without_shm_peers_takes_part() {
    let tag = random_tag();
    let pid = std::process::id();
    let out = in_threads(3, move |ex| {
        let peers: Vec<(usize, u32)> = match ex.rank() {
            0 => vec![(1, pid)],
            1 => vec![(0, pid)],
            _ => vec![],
        };
        let mut links = connect(ex, &peers, tag, &cfg(4096)).unwrap();
        let n = links.len();
        if ex.rank() == 0 {
            assert_eq!(links[0].1.try_send(b"hello").unwrap(), 5);
        }
        ex.barrier().unwrap();
        if ex.rank() == 1 {
            let mut got = Vec::new();
            links[0]
                .1
                .try_recv(&mut |b| {
                    got.extend_from_slice(b);
                    b.len()
                })
                .unwrap();
            assert_eq!(got, b"hello");
        }
        ex.barrier().unwrap();
        n
    });
    assert_eq!(out, vec![1, 1, 0]);
    assert!(leftover_segments(tag).is_empty());
}

/// If one rank's setup fails, every rank gets an error and nothing is left behind.
#[test]
fn asymmetric_peer_lists_fail_on_every_rank() {
    let tag = random_tag();
    let pid = std::process::id();
    let out = in_threads(2, move |ex| {
        let peers = if ex.rank() == 0 {
            vec![(1, pid)]
        } else {
            vec![]
        };
        connect(ex, &peers, tag, &cfg(4096))
            .map(|l| l.len())
            .map_err(|e| e.to_string())
    });
    for r in &out {
        let e = r.as_ref().unwrap_err();
        assert!(
            e.contains("rank 1 has no shared-memory segment") || e.contains("rank 0 failed"),
            "{e}"
        );
    }
    assert!(leftover_segments(tag).is_empty());
}

#[test]
fn bad_peer_list_is_invalid_argument_everywhere() {
    let tag = random_tag();
    let pid = std::process::id();
    let out = in_threads(2, move |ex| {
        // Rank 0 lists itself (invalid); rank 1 lists rank 0 (valid).
        let peers = vec![(0, pid)];
        connect(ex, &peers, tag, &cfg(4096)).map(|l| l.len())
    });
    assert!(
        matches!(out[0], Err(Error::InvalidArgument { .. })),
        "{:?}",
        out[0]
    );
    assert!(
        matches!(out[1], Err(Error::SharedMemory { .. })),
        "{:?}",
        out[1]
    );
    assert!(leftover_segments(tag).is_empty());
}

/// The peer pid given to connect must be the segment's creator.
#[test]
fn wrong_peer_pid_rejected() {
    let tag = random_tag();
    let pid = std::process::id();
    let out = in_threads(2, move |ex| {
        let peer = 1 - ex.rank();
        connect(ex, &[(peer, pid + 1)], tag, &cfg(4096))
            .map(|l| l.len())
            .map_err(|e| e.to_string())
    });
    assert!(
        out.iter()
            .all(|r| r.as_ref().unwrap_err().contains("created by pid")),
        "{out:?}"
    );
    assert!(leftover_segments(tag).is_empty());
}

/// Dropping a link closes it: the peer drains what was sent, then sees Closed on receive,
/// send and check_alive.
#[test]
fn drop_closes_link() {
    let tag = random_tag();
    let pid = std::process::id();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let out = in_threads(2, move |ex| {
        let peer = 1 - ex.rank();
        let mut links = connect(ex, &[(peer, pid)], tag, &cfg(4096)).unwrap();
        let (_, mut link) = links.pop().unwrap();
        if ex.rank() == 0 {
            assert_eq!(link.try_send(b"last words").unwrap(), 10);
            drop(link);
            tx.send(()).unwrap();
            return Ok(());
        }
        rx.lock().unwrap().recv().unwrap();
        link.check_alive()
            .expect("closed, but data is still to be received");
        let mut got = Vec::new();
        let n = link
            .try_recv(&mut |b| {
                got.extend_from_slice(b);
                b.len()
            })
            .unwrap();
        assert_eq!((n, &got[..]), (10, &b"last words"[..]));
        let e = link.try_recv(&mut |b| b.len()).unwrap_err();
        assert!(matches!(e, LinkError::Closed(_)), "{e}");
        let e = link.try_send(b"x").unwrap_err();
        assert!(matches!(e, LinkError::Closed(_)), "{e}");
        Err(link.check_alive().unwrap_err().to_string())
    });
    assert!(
        out[1].as_ref().unwrap_err().contains("rank 0 closed"),
        "{:?}",
        out[1]
    );
}

/// A sleeper on the doorbell is woken by the peer's send, well before its time slice.
#[test]
fn sender_wakes_sleeping_receiver() {
    let tag = random_tag();
    let pid = std::process::id();
    in_threads(2, move |ex| {
        let peer = 1 - ex.rank();
        let mut links = connect(ex, &[(peer, pid)], tag, &cfg(4096)).unwrap();
        let link = &mut links[0].1;
        ex.barrier().unwrap();
        if ex.rank() == 0 {
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(link.try_send(&[1, 2, 3]).unwrap(), 3);
        } else {
            let t0 = Instant::now();
            let mut got = 0;
            while got < 3 {
                let tok = bell(&**link).unwrap().prepare();
                let n = link.try_recv(&mut |b| b.len()).unwrap();
                if n > 0 {
                    bell(&**link).unwrap().cancel(tok);
                    got += n;
                    continue;
                }
                bell(&**link).unwrap().wait(tok, Duration::from_secs(20));
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "woken by the doorbell"
            );
        }
        ex.barrier().unwrap();
    });
}

/// Single-pair throughput, one direction (run with `--ignored --nocapture`):
/// `cargo test --release -p oxccl --test shm_stress -- --ignored --nocapture throughput`
#[test]
#[ignore]
fn throughput() {
    let total: u64 = std::env::var("OXCCL_BENCH_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8 << 30);
    let ring =
        oxccl::parse_bytes(&std::env::var("OXCCL_SHM_RING_BYTES").unwrap_or("4M".into())).unwrap();
    let chunk = 1usize << 20;
    let tag = random_tag();
    let pid = std::process::id();
    let out = in_threads(2, move |ex| {
        let peer = 1 - ex.rank();
        let mut links = connect(ex, &[(peer, pid)], tag, &cfg(ring)).unwrap();
        let link = &mut links[0].1;
        let mut buf = vec![7u8; chunk];
        let ex_rank = ex.rank();
        ex.barrier().unwrap();
        let t0 = Instant::now();
        let mut done = 0u64;
        let mut backoff = oxccl::testing::wait::Backoff::new(oxccl::testing::wait::Spin::new(2000));
        let mut pos = 0usize;
        let mut step = |link: &mut Box<dyn oxccl::testing::transport::Link>, done: u64| {
            if ex_rank == 0 {
                link.try_send(&buf[..chunk.min((total - done) as usize)])
                    .unwrap()
            } else {
                link.try_recv(&mut |b| {
                    // Copy out, as a real receive into a user buffer does.
                    let mut taken = 0;
                    while taken < b.len() {
                        let k = (b.len() - taken).min(chunk - pos);
                        buf[pos..pos + k].copy_from_slice(&b[taken..taken + k]);
                        pos = (pos + k) % chunk;
                        taken += k;
                    }
                    b.len()
                })
                .unwrap()
            }
        };
        while done < total {
            let mut n = step(link, done);
            if n == 0 && backoff.should_sleep() {
                let tok = bell(&**link).unwrap().prepare();
                n = step(link, done);
                if n > 0 {
                    bell(&**link).unwrap().cancel(tok);
                } else {
                    bell(&**link).unwrap().wait(tok, Duration::from_millis(100));
                }
            }
            if n > 0 {
                backoff.reset();
            }
            done += n as u64;
        }
        let dt = t0.elapsed();
        std::hint::black_box(&buf);
        ex.barrier().unwrap();
        dt
    });
    let secs = out[1].as_secs_f64();
    eprintln!(
        "shm throughput: {} MiB in {:.3} s = {:.2} GB/s (ring {ring} B, {chunk} B sends)",
        total >> 20,
        secs,
        total as f64 / secs / 1e9
    );
}
