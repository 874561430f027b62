//! Multi-host placements in one process: ranks are threads, `Config::host_id` makes groups of
//! them "hosts" (shared memory inside, TCP over loopback between), and every call's result is
//! checked. Long sequences of different collectives, sizes and algorithms back to back show
//! that no call leaves bytes behind in a link that the next would misread (a leftover byte
//! would shift every later result), also with TCP striped over several connections.

use std::time::Duration;

use oxccl::check::Case;
use oxccl::Algo;
use oxccl::{CollKind, Communicator, Config, DataType, ReduceOp, UniqueId};

fn cases(rank: usize, n: usize) -> Vec<(Option<Algo>, Case)> {
    let mut v = Vec::new();
    let sizes = [1usize, 7, 1000, 70_000, 300_001];
    // Fifteen rounds rotate through the tuner's choice and three forced algorithms; five
    // more force halving-doubling, once at every size.
    let rounds = sizes
        .iter()
        .cycle()
        .take(15)
        .enumerate()
        .map(|(i, &count)| {
            let algo = [None, Some(Algo::Ring), Some(Algo::Hier), Some(Algo::Tree)][i % 4];
            (i, count, algo)
        })
        .chain(
            sizes
                .iter()
                .enumerate()
                .map(|(i, &count)| (i, count, Some(Algo::HalvingDoubling))),
        );
    for (i, count, algo) in rounds {
        let (dtype, op) = [
            (DataType::F32, ReduceOp::Sum),
            (DataType::I32, ReduceOp::Max),
            (DataType::Bf16, ReduceOp::Avg),
        ][i % 3];
        for kind in [
            CollKind::AllReduce,
            CollKind::AllGather,
            CollKind::ReduceScatter,
            CollKind::Broadcast,
            CollKind::Reduce,
        ] {
            let count = match kind {
                CollKind::AllGather | CollKind::ReduceScatter => count / n + 1,
                _ => count,
            };
            v.push((
                algo,
                Case {
                    kind,
                    dtype,
                    op,
                    root: i % n,
                    count,
                    in_place: i % 2 == 1,
                    rank,
                    nranks: n,
                },
            ));
        }
    }
    v
}

/// Runs the case list on ranks placed on hosts `host_of`, with `streams` TCP connections per
/// pair of ranks on different hosts.
fn run(host_of: &[usize], streams: usize) {
    run_connecting(host_of, streams, false);
}

/// As [`run`]; `lazy`: TCP links made on first use (`OXCCL_TCP_CONNECT=lazy`).
fn run_connecting(host_of: &[usize], streams: usize, lazy: bool) {
    let n = host_of.len();
    let id = UniqueId::new_on("127.0.0.1".parse().unwrap()).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let id = id.clone();
                let cfg = Config {
                    timeout: Duration::from_secs(120),
                    host_id: Some(format!(
                        "test-host-{}-{}",
                        host_of[rank],
                        std::process::id()
                    )),
                    tcp_streams: streams,
                    tcp_connect: if lazy {
                        oxccl::TcpConnect::Lazy
                    } else {
                        oxccl::TcpConnect::Eager
                    },
                    chunk_bytes: 8192,
                    ..Config::default()
                };
                s.spawn(move || {
                    let mut comm = Communicator::init_with_config(&id, rank, n, cfg).unwrap();
                    let hosts = comm.topology().map(|t| t.hosts.len());
                    assert_eq!(hosts, Some(host_of.iter().max().unwrap() + 1));
                    for (algo, case) in cases(rank, n) {
                        comm.set_algo(algo);
                        let mut bufs = case.buffers(None).unwrap();
                        let (send, recv) = bufs.get();
                        case.fill(send, recv);
                        case.call(&comm, send, recv)
                            .unwrap_or_else(|e| panic!("{case:?} {algo:?}: {e}"));
                        assert_eq!(case.wrong(recv), 0, "rank {rank}: {case:?} {algo:?}");
                    }
                    comm.barrier().unwrap();
                })
            })
            .collect();
        for h in handles {
            h.join().expect("rank thread panicked");
        }
    });
}

#[test]
fn two_hosts_of_two_block() {
    run(&[0, 0, 1, 1], 1);
}

#[test]
fn two_hosts_of_two_round_robin_striped() {
    run(&[0, 1, 0, 1], 3);
}

#[test]
fn three_uneven_hosts() {
    run(&[0, 0, 1, 2, 1], 1);
}

#[test]
fn links_made_on_first_use_two_hosts_round_robin() {
    run_connecting(&[0, 1, 0, 1], 1, true);
}

#[test]
fn links_made_on_first_use_three_uneven_hosts_striped() {
    run_connecting(&[0, 0, 1, 2, 1], 2, true);
}

#[test]
fn differing_stream_counts_are_an_error_on_every_rank() {
    let id = UniqueId::new_on("127.0.0.1".parse().unwrap()).unwrap();
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let id = id.clone();
                let cfg = Config {
                    timeout: Duration::from_secs(60),
                    host_id: Some(format!("streams-{rank}-{}", std::process::id())),
                    tcp_streams: rank + 1,
                    ..Config::default()
                };
                s.spawn(move || {
                    let start = std::time::Instant::now();
                    let e = Communicator::init_with_config(&id, rank, 2, cfg).unwrap_err();
                    assert!(start.elapsed() < Duration::from_secs(30), "not a timeout");
                    e.to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errs {
        assert!(e.contains("OXCCL_TCP_STREAMS"), "{e}");
    }
}
