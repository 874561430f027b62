//! Every collective × dtype × op × size class × in/out of place, with ranks as threads over
//! the in-memory transport (small queues, so every stream waits on flow control), checked
//! element by element against the reference in `oxccl::check`.

use std::time::Duration;

use oxccl::check::Case;
use oxccl::testing::transport::mem;
use oxccl::{CollKind, Communicator, Config, DataType, ReduceOp};

use oxccl::check::kinds;

/// How the ranks of a group reach each other besides links.
#[derive(Clone, Copy)]
enum Direct {
    /// Links only: every collective runs a schedule.
    No,
    /// A direct area too: inputs up to `oneshot_max` bytes go one-shot, from `cma_min` on
    /// single-copy. `shared`: buffers from `alloc_shared` (peers reach them with loads and
    /// stores), and results written with streaming stores at every size.
    Yes {
        oneshot_max: usize,
        cma_min: usize,
        shared: bool,
    },
}

/// Runs `cases(rank)` on `n` threads, each with its own communicator.
fn run_group(n: usize, cap: usize, cases: impl Fn(usize) -> Vec<Case> + Sync) {
    run_group_with(n, cap, Direct::No, cases)
}

fn run_group_with(n: usize, cap: usize, direct: Direct, cases: impl Fn(usize) -> Vec<Case> + Sync) {
    run_group_algo(n, cap, direct, None, cases)
}

/// As [`run_group_with`], with `OXCCL_ALGO` set to `algo` (by name, parsed as the variable
/// is): every call it implements must run with it, as `last_algo` reports.
fn run_group_algo(
    n: usize,
    cap: usize,
    direct: Direct,
    algo: Option<&str>,
    cases: impl Fn(usize) -> Vec<Case> + Sync,
) {
    let mut cfg = Config {
        timeout: Duration::from_secs(60),
        spin: 200,
        chunk_bytes: 4096,
        algo: algo.map(str::to_string),
        ..Config::default()
    };
    let forced: Option<oxccl::Algo> = algo.map(|a| a.parse().unwrap());
    let mut areas: Vec<Option<oxccl::testing::link::MemDirect>> = (0..n).map(|_| None).collect();
    let mut shared = false;
    if let Direct::Yes {
        oneshot_max,
        cma_min,
        shared: sh,
    } = direct
    {
        cfg.oneshot_max = oneshot_max;
        cfg.cma_min = cma_min;
        shared = sh;
        if sh {
            cfg.nt_bytes = 0;
        }
        areas = oxccl::testing::link::mem_group(n)
            .into_iter()
            .map(Some)
            .collect();
    }
    let groups = mem::group(n, cap);
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .zip(areas)
            .enumerate()
            .map(|(rank, (links, area))| {
                let cfg = cfg.clone();
                let cases = &cases;
                s.spawn(move || {
                    let mut comm = Communicator::from_links(rank, n, links, cfg).unwrap();
                    if let Some(a) = area {
                        comm = comm.with_direct(Box::new(a));
                    }
                    for case in cases(rank) {
                        let mut bufs = case.buffers(shared.then_some(&comm)).unwrap();
                        let (send, recv) = bufs.get();
                        case.fill(send, recv);
                        case.call(&comm, send, recv)
                            .unwrap_or_else(|e| panic!("{case:?}: {e}"));
                        let wrong = case.wrong(recv);
                        assert_eq!(wrong, 0, "rank {rank} ({}): {case:?}", comm.last_algo());
                        if let Some(a) = forced.filter(|a| a.supports(case.kind)) {
                            assert_eq!(comm.last_algo(), a.name(), "{case:?}");
                        }
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

fn matrix(n: usize) {
    matrix_with(n, Direct::No)
}

fn matrix_with(n: usize, direct: Direct) {
    run_group_with(n, 96, direct, |rank| {
        oxccl::check::matrix(rank, n, &[0, 1, 7, 13, 200])
    });
}

#[test]
fn matrix_1_rank() {
    matrix(1);
}

#[test]
fn matrix_2_ranks() {
    matrix(2);
}

#[test]
fn matrix_3_ranks() {
    matrix(3);
}

#[test]
fn matrix_4_ranks() {
    matrix(4);
}

#[test]
fn matrix_8_ranks() {
    matrix(8);
}

/// Halving-doubling forced (`OXCCL_ALGO=hd`) for every all_reduce of the matrix, on powers of
/// two and not, over small queues (flow control on every stream), in and out of place.
#[test]
fn matrix_halving_doubling() {
    for n in [1, 2, 3, 5, 6, 8] {
        run_group_algo(n, 96, Direct::No, Some("hd"), |rank| {
            oxccl::check::matrix(rank, n, &[0, 1, 7, 13, 200])
                .into_iter()
                .filter(|c| c.kind == CollKind::AllReduce)
                .collect()
        });
    }
}

/// Halving-doubling on buffers larger than the queues and than one pipeline chunk, with
/// counts that do not divide by the number of participants.
#[test]
fn halving_doubling_larger_than_the_queues() {
    for n in [3, 4, 7] {
        run_group_algo(n, 64 << 10, Direct::No, Some("hd"), |rank| {
            [(ReduceOp::Sum, false), (ReduceOp::Avg, true)]
                .into_iter()
                .map(|(op, in_place)| Case {
                    kind: CollKind::AllReduce,
                    dtype: DataType::F32,
                    op,
                    root: 0,
                    count: 300_001,
                    in_place,
                    rank,
                    nranks: n,
                })
                .collect()
        });
    }
}

// With a direct area: the small sizes go one-shot, the larger single-copy where it applies.
#[test]
fn matrix_direct_2_ranks() {
    matrix_with(
        2,
        Direct::Yes {
            oneshot_max: 64,
            cma_min: 100,
            shared: false,
        },
    );
}

#[test]
fn matrix_direct_3_ranks() {
    matrix_with(
        3,
        Direct::Yes {
            oneshot_max: 64,
            cma_min: 100,
            shared: false,
        },
    );
}

#[test]
fn matrix_direct_8_ranks() {
    matrix_with(
        8,
        Direct::Yes {
            oneshot_max: 64,
            cma_min: 100,
            shared: false,
        },
    );
}

// Everything that fits a slot one-shot.
#[test]
fn matrix_oneshot_4_ranks() {
    matrix_with(
        4,
        Direct::Yes {
            oneshot_max: usize::MAX,
            cma_min: usize::MAX,
            shared: false,
        },
    );
}

// Shared buffers: peers' buffers mapped, results written with streaming stores.
#[test]
fn matrix_direct_shared_3_ranks() {
    matrix_with(
        3,
        Direct::Yes {
            oneshot_max: 64,
            cma_min: 100,
            shared: true,
        },
    );
}

#[test]
fn larger_than_the_chunks_single_copy() {
    for (n, shared) in [(2, false), (3, false), (2, true), (3, true)] {
        run_group_with(
            n,
            64 << 10,
            Direct::Yes {
                oneshot_max: 0,
                cma_min: 0,
                shared,
            },
            |rank| {
                kinds(n)
                    .into_iter()
                    .flat_map(|(kind, root)| {
                        [false, true].map(|in_place| Case {
                            kind,
                            dtype: DataType::F32,
                            op: ReduceOp::Avg,
                            root,
                            count: 300_001,
                            in_place,
                            rank,
                            nranks: n,
                        })
                    })
                    .collect()
            },
        );
    }
}

/// One-shot all_reduce on inputs of 16 KiB up to a slot (the matrix stops at 200 elements),
/// counts that do not divide by the ranks, every kind of element and op that takes a
/// different path of the fold, in and out of place.
#[test]
fn oneshot_all_reduce_up_to_a_slot() {
    for n in [2, 3, 5] {
        run_group_algo(
            n,
            4096,
            Direct::Yes {
                oneshot_max: usize::MAX,
                cma_min: usize::MAX,
                shared: false,
            },
            Some("oneshot"),
            |rank| {
                let mut cases = vec![];
                for (dtype, op) in [
                    (DataType::F32, ReduceOp::Sum),
                    (DataType::F32, ReduceOp::Avg),
                    (DataType::Bf16, ReduceOp::Sum),
                    (DataType::I32, ReduceOp::Max),
                    (DataType::U8, ReduceOp::Sum),
                ] {
                    let es = dtype.size();
                    for count in [(16 << 10) / es - 1, (16 << 10) / es, 64_000 / es + 1] {
                        for in_place in [false, true] {
                            cases.push(Case {
                                kind: CollKind::AllReduce,
                                dtype,
                                op,
                                root: 0,
                                count,
                                in_place,
                                rank,
                                nranks: n,
                            });
                        }
                    }
                }
                cases
            },
        );
    }
}

#[test]
fn larger_than_the_queues() {
    for n in [2, 3] {
        run_group(n, 64 << 10, |rank| {
            kinds(n)
                .into_iter()
                .map(|(kind, root)| Case {
                    kind,
                    dtype: DataType::F32,
                    op: ReduceOp::Sum,
                    root,
                    count: 300_001,
                    in_place: false,
                    rank,
                    nranks: n,
                })
                .collect()
        });
    }
}

#[test]
fn bad_arguments_are_errors() {
    let groups = mem::group(2, 1024);
    let mut it = groups.into_iter();
    let comm = Communicator::from_links(0, 2, it.next().unwrap(), Config::default()).unwrap();
    let mut out = vec![0f32; 3];
    let e = comm
        .all_reduce(&[1.0f32; 4], &mut out, ReduceOp::Sum)
        .unwrap_err();
    assert!(
        e.to_string().contains("all_reduce") && e.to_string().contains("rank 0"),
        "{e}"
    );
    let e = comm.broadcast_in_place(&mut out, 2).unwrap_err();
    assert!(e.to_string().contains("root 2 is out of range"), "{e}");
    let e = comm.send(&[1u8], 0).unwrap_err();
    assert!(e.to_string().contains("itself"), "{e}");
    let e = comm.all_gather(&[1i32; 2], &mut [0i32; 3]).unwrap_err();
    assert!(e.to_string().contains("expected world size 2"), "{e}");
    let e = comm
        .reduce_scatter_in_place(&mut [0u64; 3], ReduceOp::Max)
        .unwrap_err();
    assert!(e.to_string().contains("do not divide"), "{e}");
    let e = comm.all_to_all(&[0u8; 4], &mut [0u8; 6]).unwrap_err();
    assert!(e.to_string().contains("divisible"), "{e}");
    // Ops a type does not have.
    let e = comm
        .all_reduce_in_place(&mut [oxccl::Bool(1); 2], ReduceOp::Avg)
        .unwrap_err();
    assert!(e.to_string().contains("avg is not defined on bool"), "{e}");
    let e = comm
        .reduce_in_place(&mut [1.0f32; 2], ReduceOp::BXor, 0)
        .unwrap_err();
    assert!(e.to_string().contains("bitwise op"), "{e}");
    let e = comm
        .reduce_scatter(&[1i64; 4], &mut [0i64; 2], ReduceOp::PreMulSum(0.5))
        .unwrap_err();
    assert!(e.to_string().contains("integer scalar"), "{e}");
    // Sequence numbers advance with every call, rejected or not.
    let e = comm.recv(&mut [0u8; 1], 7).unwrap_err();
    assert!(e.to_string().contains("call #10"), "{e}");
    // Bad arguments do not break the communicator: no error is fatal.
    assert!(!e.is_fatal());
}

/// Point-to-point: send-first exchanges in groups, tags out of order, any source
/// ([`oxccl::check::p2p`]), over queues smaller than every message but the empty ones.
#[test]
fn p2p_groups_tags_and_any_source() {
    for n in [1, 2, 3, 4] {
        let groups = mem::group(n, 96);
        std::thread::scope(|s| {
            for (rank, links) in groups.into_iter().enumerate() {
                s.spawn(move || {
                    let cfg = Config {
                        timeout: Duration::from_secs(60),
                        ..Config::default()
                    };
                    let comm = Communicator::from_links(rank, n, links, cfg).unwrap();
                    let wrong = oxccl::check::p2p(&comm, &[0, 1, 7, 13, 4099], 96);
                    assert_eq!(wrong, 0, "rank {rank} of {n}");
                });
            }
        });
    }
}

/// premul_sum with a different scalar on every rank (as NCCL allows), for each reducing
/// collective, in and out of place, with the callers' inputs left as they were.
#[test]
fn premul_sum_scalars_may_differ_between_ranks() {
    for n in [1, 2, 3] {
        let groups = mem::group(n, 96);
        std::thread::scope(|s| {
            for (rank, links) in groups.into_iter().enumerate() {
                s.spawn(move || {
                    let comm = Communicator::from_links(rank, n, links, Config::default()).unwrap();
                    let count = 7 * n;
                    let input =
                        |r: usize| -> Vec<f32> { (0..count).map(|i| (i + r) as f32).collect() };
                    let scalar = |r: usize| 0.5 * (r + 1) as f64;
                    let want: Vec<f32> = (0..count)
                        .map(|i| (0..n).map(|r| input(r)[i] * scalar(r) as f32).sum())
                        .collect();
                    let op = ReduceOp::PreMulSum(scalar(rank));
                    let send = input(rank);
                    let mut out = vec![0f32; count];
                    comm.all_reduce(&send, &mut out, op).unwrap();
                    assert_eq!(out, want);
                    assert_eq!(send, input(rank), "the input is not scaled in place");
                    let mut buf = input(rank);
                    comm.all_reduce_in_place(&mut buf, op).unwrap();
                    assert_eq!(buf, want);
                    let mut buf = input(rank);
                    comm.reduce_in_place(&mut buf, op, n - 1).unwrap();
                    let kept = if rank == n - 1 {
                        want.clone()
                    } else {
                        input(rank)
                    };
                    assert_eq!(buf, kept, "reduce leaves non-roots' buffers as they were");
                    let block = count / n;
                    let mine = &want[rank * block..(rank + 1) * block];
                    let mut out = vec![0f32; block];
                    comm.reduce_scatter(&send, &mut out, op).unwrap();
                    assert_eq!(out, mine);
                    let mut buf = input(rank);
                    comm.reduce_scatter_in_place(&mut buf, op).unwrap();
                    assert_eq!(&buf[rank * block..(rank + 1) * block], mine);
                });
            }
        });
    }
}

#[test]
fn lost_peer_is_an_error_not_a_hang() {
    let groups = mem::group(2, 1024);
    let mut it = groups.into_iter();
    let cfg = Config {
        timeout: Duration::from_secs(20),
        ..Config::default()
    };
    let comm = Communicator::from_links(0, 2, it.next().unwrap(), cfg).unwrap();
    let peer_links = it.next().unwrap();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        drop(peer_links);
    });
    let mut buf = vec![1.0f32; 10_000];
    let e = comm
        .all_reduce_in_place(&mut buf, ReduceOp::Sum)
        .unwrap_err();
    t.join().unwrap();
    let msg = e.to_string();
    assert!(
        msg.contains("lost peer rank 1") && msg.contains("all_reduce") && msg.contains("call #1"),
        "{msg}"
    );
    // The communicator is now unusable, and says so.
    let e = comm.barrier().unwrap_err();
    assert!(e.to_string().contains("earlier failure"), "{e}");
}

#[test]
fn timeout_names_the_missing_rank() {
    let groups = mem::group(3, 1024);
    let mut it = groups.into_iter();
    let cfg = Config {
        timeout: Duration::from_millis(300),
        ..Config::default()
    };
    let comm = Communicator::from_links(0, 3, it.next().unwrap(), cfg).unwrap();
    let _keep = it.collect::<Vec<_>>(); // peers alive but silent
    let start = std::time::Instant::now();
    let e = comm.barrier().unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5));
    match e {
        oxccl::Error::Timeout {
            rank: 0,
            call: "barrier",
            seq: 1,
            ref waiting_on,
            ..
        } => assert!(!waiting_on.is_empty()),
        e => panic!("unexpected {e}"),
    }
}

/// `OXCCL_DETERMINISTIC=1`: random floats reduce to the same bits on every rank whatever the
/// algorithm (one-shot, single-copy, rank-ordered schedule; a forced ring or halving-doubling
/// is overridden), and equal to a serial fold in rank order.
#[test]
fn deterministic_bits_whatever_the_algorithm() {
    use oxccl::Algo;
    let n = 3;
    let count = 1001;
    let data = |rank: usize, dtype: DataType| -> Vec<u8> {
        let mut v = vec![0u8; count * dtype.size()];
        // A hash of (rank, index): pseudo-random values whose sums round.
        oxccl::check::fill(dtype, &mut v, |i| {
            let mut x = 0x9e3779b97f4a7c15u64
                ^ ((rank * count + i) as u64 + 1).wrapping_mul(0x2545F4914F6CDD1D);
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 1_000_003) as f64 / 997.0 - 500.0
        });
        v
    };
    for dtype in [DataType::F32, DataType::Bf16, DataType::F16, DataType::F64] {
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let mut want = data(0, dtype);
            for r in 1..n {
                oxccl::testing::reduce::reduce_inplace(dtype, op, &mut want, &data(r, dtype));
            }
            if op == ReduceOp::Avg {
                oxccl::testing::reduce::divide_by(dtype, &mut want, n);
            }
            let cfg = Config {
                deterministic: true,
                oneshot_max: 0,
                cma_min: 0,
                ..Config::default()
            };
            let areas = oxccl::testing::link::mem_group(n);
            let groups = mem::group(n, 512);
            let outs: Vec<Vec<(String, Vec<u8>)>> = std::thread::scope(|s| {
                let hs: Vec<_> = groups
                    .into_iter()
                    .zip(areas)
                    .enumerate()
                    .map(|(rank, (links, area))| {
                        let cfg = cfg.clone();
                        s.spawn(move || {
                            let mut comm = Communicator::from_links(rank, n, links, cfg)
                                .unwrap()
                                .with_direct(Box::new(area));
                            let mut outs = Vec::new();
                            for algo in [
                                Some(Algo::OneShot),
                                Some(Algo::Cma),
                                Some(Algo::Ordered),
                                Some(Algo::Ring),
                                Some(Algo::HalvingDoubling),
                                None,
                            ] {
                                comm.set_algo(algo);
                                let mut buf = vec![0u64; (count * dtype.size()).div_ceil(8)];
                                let b = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut buf)
                                    [..count * dtype.size()];
                                b.copy_from_slice(&data(rank, dtype));
                                comm.call_bytes(
                                    CollKind::AllReduce,
                                    dtype,
                                    op,
                                    0,
                                    oxccl::ByteBufs::InPlace(b),
                                )
                                .unwrap();
                                outs.push((comm.last_algo().to_string(), b.to_vec()));
                            }
                            outs
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (rank, o) in outs.iter().enumerate() {
                for (algo, bytes) in o {
                    assert!(
                        algo != "ring" && algo != "hd",
                        "a forced ring or halving-doubling must not reduce in deterministic mode"
                    );
                    assert!(
                        bytes == &want,
                        "{dtype} {op}: rank {rank} with {algo} differs from the rank-order fold"
                    );
                }
            }
            let algos: std::collections::BTreeSet<&str> =
                outs[0].iter().map(|(a, _)| a.as_str()).collect();
            assert_eq!(
                algos.into_iter().collect::<Vec<_>>(),
                vec!["cma", "oneshot", "ordered"]
            );
        }
    }
}

// Parts of shared buffers, at offsets that are not page- or block-aligned, freed and
// reallocated between calls. Threads share one address space, so this checks the offsets; the
// mapping caches of separate processes (address reuse, eviction past PEER_MAPPINGS) are
// exercised by `shared_matrix_*` in oxccl-cli's tests/processes.rs, whose every case allocates
// new buffers.
#[test]
fn parts_of_shared_buffers_and_reused_addresses() {
    let n = 3;
    let cfg = Config {
        oneshot_max: 0,
        cma_min: 0,
        nt_bytes: 0,
        timeout: Duration::from_secs(60),
        ..Config::default()
    };
    let areas = oxccl::testing::link::mem_group(n);
    let groups = mem::group(n, 4096);
    std::thread::scope(|s| {
        for (rank, (links, area)) in groups.into_iter().zip(areas).enumerate() {
            let cfg = cfg.clone();
            s.spawn(move || {
                let comm = Communicator::from_links(rank, n, links, cfg)
                    .unwrap()
                    .with_direct(Box::new(area));
                for round in 0..(oxccl::testing::shared_buffer::PEER_MAPPINGS + 4) {
                    let count = 10_001 + round;
                    let mut buf = comm.alloc_shared((count + 3) * 4).unwrap();
                    let v = &mut buf.as_mut_slice::<f32>()[3..3 + count];
                    for (i, x) in v.iter_mut().enumerate() {
                        *x = (i % 13 + rank * 100 + round) as f32;
                    }
                    let mut out = comm.alloc_shared(count * 4 + 5).unwrap();
                    let o = &mut bytemuck::cast_slice_mut::<u8, f32>(&mut out[..count * 4])[..];
                    comm.all_reduce(v, o, ReduceOp::Sum).unwrap();
                    assert_eq!(comm.last_algo(), "cma");
                    for (i, x) in o.iter().enumerate() {
                        let want = (0..n)
                            .map(|r| (i % 13 + r * 100 + round) as f32)
                            .sum::<f32>();
                        assert_eq!(*x, want, "rank {rank} round {round} element {i}");
                    }
                    comm.barrier().unwrap();
                }
            });
        }
    });
}
