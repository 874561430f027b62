//! Failure handling with ranks as threads of this process, joined through a real rendezvous
//! (loopback TCP) and real links (shared memory or TCP): mismatched calls are errors on
//! every rank, abort wakes blocked calls, timeouts name the call and the missing ranks,
//! shrink goes on without a rank, dropping never hangs. Every test is bounded in time.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use oxccl::TransportChoice;
use oxccl::{Communicator, Config, Error, FailureKind, ReduceOp, UniqueId};

fn cfg(transport: TransportChoice) -> Config {
    Config {
        timeout: Duration::from_secs(20),
        transport,
        shm_ring_bytes: 64 << 10,
        spin: 100,
        ..Config::default()
    }
}

mod proc_common;

/// Runs `f(rank, comm)` on `n` threads with communicators joined by a rendezvous.
fn group<T: Send>(
    n: usize,
    transport: TransportChoice,
    f: impl Fn(usize, Communicator) -> T + Sync,
) -> Vec<T> {
    proc_common::threads(n, |_| cfg(transport), f)
}

const BOTH: [TransportChoice; 2] = [TransportChoice::Shm, TransportChoice::Tcp];

/// One way of calling: what a rank does in the call under test.
#[derive(Clone, Copy, Debug)]
enum Call {
    AllReduce(usize, ReduceOp),
    AllReduceU8(usize),
    AllReduceI32(usize, ReduceOp),
    Broadcast(usize, usize),
    Reduce(usize, usize),
    AllGather(usize),
    ReduceScatter(usize),
    AllToAll(usize),
    Barrier,
    /// A ring shift: send `count` to rank+1, receive `count2` from rank-1.
    Shift(usize, usize),
    /// Nothing (the rank skips the call).
    Skip,
}

fn make(comm: &Communicator, c: Call) -> oxccl::Result<()> {
    let (r, n) = (comm.rank(), comm.world_size());
    match c {
        Call::AllReduce(k, op) => comm.all_reduce_in_place(&mut vec![1.0f32; k], op),
        Call::AllReduceU8(k) => comm.all_reduce_in_place(&mut vec![1u8; k], ReduceOp::Sum),
        Call::AllReduceI32(k, op) => comm.all_reduce_in_place(&mut vec![1i32; k], op),
        Call::Broadcast(k, root) => comm.broadcast_in_place(&mut vec![1.0f32; k], root),
        Call::Reduce(k, root) => comm.reduce_in_place(&mut vec![1.0f32; k], ReduceOp::Sum, root),
        Call::AllGather(k) => comm.all_gather_in_place(&mut vec![1.0f32; k * n]),
        Call::ReduceScatter(k) => {
            comm.reduce_scatter_in_place(&mut vec![1.0f32; k * n], ReduceOp::Sum)
        }
        Call::AllToAll(k) => comm.all_to_all_in_place(&mut vec![1.0f32; k * n]),
        Call::Barrier => comm.barrier(),
        Call::Shift(k, k2) => {
            let send = vec![1.0f32; k];
            let mut recv = vec![0.0f32; k2];
            if k == k2 {
                comm.sendrecv(&send, (r + 1) % n, &mut recv, (r + n - 1) % n)
            } else {
                // Lengths differ: send and receive as separate calls (ranks alternate order).
                if r % 2 == 0 {
                    comm.send(&send, (r + 1) % n)?;
                    comm.recv(&mut recv, (r + n - 1) % n)
                } else {
                    comm.recv(&mut recv, (r + n - 1) % n)?;
                    comm.send(&send, (r + 1) % n)
                }
            }
        }
        Call::Skip => Ok(()),
    }
}

/// Every rank makes `good`, except `bad` which makes `other`; then every rank makes a
/// barrier. Each rank must see a mismatch error (in the call, or, if its part of the call
/// completed correctly before the news arrived, in the barrier), and the detecting ranks'
/// errors name both ranks and both calls.
fn mismatch_case(transport: TransportChoice, n: usize, good: Call, other: Call, bad: usize) {
    let start = Instant::now();
    let errs = group(n, transport, |r, comm| {
        comm.all_reduce_in_place(&mut [1.0f32; 3], ReduceOp::Sum)
            .unwrap();
        let c = if r == bad { other } else { good };
        match make(&comm, c) {
            Err(e) => e,
            Ok(()) => comm
                .barrier()
                .expect_err("a mismatch must reach every rank"),
        }
    });
    let case = format!("{transport:?}: rank {bad} calls {other:?}, the others {good:?}");
    for (r, e) in errs.iter().enumerate() {
        assert!(e.is_mismatch(), "{case}: rank {r}: {e}");
        let text = e.to_string();
        assert!(text.contains(&format!("rank {r}")), "{case}: {text}");
        if let Error::Mismatch { mine, theirs, .. } = e {
            assert!(
                !mine.is_empty() && !theirs.is_empty() && mine != theirs,
                "{text}"
            );
        }
    }
    assert!(
        errs.iter().any(|e| matches!(e, Error::Mismatch { .. })),
        "{case}: some rank must have found it itself: {errs:?}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{case}: took {:?}",
        start.elapsed()
    );
}

#[test]
fn every_tried_mismatch_is_an_error_on_every_rank() {
    use Call::*;
    let cases: Vec<(Call, Call)> = vec![
        (AllReduce(64, ReduceOp::Sum), AllReduce(65, ReduceOp::Sum)),
        (AllReduce(64, ReduceOp::Sum), AllReduce(64, ReduceOp::Max)),
        (AllReduce(64, ReduceOp::Sum), AllReduceU8(256)),
        (AllReduce(64, ReduceOp::Sum), Broadcast(64, 0)),
        (AllReduce(64, ReduceOp::Sum), Barrier),
        (AllReduce(64, ReduceOp::Sum), Skip),
        (Broadcast(100, 0), Broadcast(100, 1)),
        (Broadcast(100, 0), Broadcast(99, 0)),
        (Reduce(100, 2), Reduce(100, 1)),
        (AllGather(10), ReduceScatter(10)),
        (AllToAll(10), AllToAll(11)),
        (AllGather(10), AllGather(12)),
        (ReduceScatter(8), AllReduce(32, ReduceOp::Sum)),
        (Barrier, AllToAll(1)),
        (Shift(20, 20), Shift(21, 20)),
        (Shift(20, 20), AllReduce(20, ReduceOp::Sum)),
        // Large enough for the single-copy algorithms, which touch peers' memory: the check
        // must come before any byte moves.
        (
            AllReduce(1 << 18, ReduceOp::Sum),
            AllReduce((1 << 18) + 1, ReduceOp::Sum),
        ),
        (Broadcast(1 << 18, 0), Broadcast(1 << 18, 1)),
        (Reduce(1 << 18, 0), Reduce((1 << 18) + 4, 0)),
        (AllGather(1 << 17), AllGather((1 << 17) + 1)),
        (ReduceScatter(1 << 16), ReduceScatter((1 << 16) - 1)),
        // Ops: premul_sum is not a sum (its scalar is no part of the check: ranks may differ).
        (
            AllReduce(64, ReduceOp::Sum),
            AllReduce(64, ReduceOp::PreMulSum(0.5)),
        ),
        (
            AllReduceI32(64, ReduceOp::BAnd),
            AllReduceI32(64, ReduceOp::BOr),
        ),
        (
            AllReduceI32(64, ReduceOp::BXor),
            AllReduceI32(64, ReduceOp::Sum),
        ),
    ];
    for transport in BOTH {
        for (i, (good, other)) in cases.iter().enumerate() {
            mismatch_case(transport, 4, *good, *other, i % 4);
        }
    }
}

/// `close` on a communicator others still hold (an `Arc`, as torch's backend shares it):
/// it waits for the call queued before it (the others join that call 300 ms later), which
/// completes with the right result; then later calls fail at once naming the close, a second
/// close does nothing, and the others' next call fails within 3 s naming rank 0 (it said
/// goodbye and closed its links), not at its timeout. Three ranks (rank 0 the watchdog's hub,
/// which hands over as it leaves).
#[test]
fn close_waits_for_queued_calls_then_leaves() {
    for transport in BOTH {
        let res = group(3, transport, |r, comm| {
            let comm = std::sync::Arc::new(comm);
            if r != 0 {
                std::thread::sleep(Duration::from_millis(300));
            }
            let work = comm.all_reduce_async(vec![r as f32 + 1.0; 1 << 16], ReduceOp::Sum);
            if r == 0 {
                let t0 = Instant::now();
                comm.close();
                let took = t0.elapsed();
                let v = work.wait().map_err(|e| e.to_string())?;
                if took < Duration::from_millis(200) || v.iter().any(|&x| x != 6.0) {
                    return Err(format!("close took {took:?}; result {}", v[0]));
                }
                let e = comm.barrier().unwrap_err();
                if !matches!(e, Error::Aborted { .. }) || !e.to_string().contains("closed") {
                    return Err(format!("a call after close: {e}"));
                }
                comm.close();
                Ok(e.to_string())
            } else {
                let v = work.wait().map_err(|e| e.to_string())?;
                if v.iter().any(|&x| x != 6.0) {
                    return Err(format!("result {}", v[0]));
                }
                std::thread::sleep(Duration::from_millis(200));
                let t0 = Instant::now();
                let e = comm.barrier().unwrap_err();
                let took = t0.elapsed();
                if took > Duration::from_secs(3) || oxccl::blamed_rank(&e.to_string()) != Some(0) {
                    return Err(format!("after {took:?}: {e}"));
                }
                Ok(e.to_string())
            }
        });
        for (r, x) in res.iter().enumerate() {
            assert!(x.is_ok(), "{transport:?} rank {r}: {res:?}");
        }
    }
}

#[test]
fn abort_wakes_a_blocked_call_and_tells_the_others() {
    for transport in BOTH {
        let go = Barrier::new(2);
        // Each rank meets the other at `go` before it asserts anything: a rank that panicked
        // first would leave the other blocked there for ever.
        let res = group(2, transport, |r, comm| {
            if r == 0 {
                std::thread::scope(|s| {
                    let t = s.spawn(|| {
                        let start = Instant::now();
                        let e = comm
                            .all_reduce_in_place(&mut vec![1.0f32; 1 << 16], ReduceOp::Sum)
                            .unwrap_err();
                        (e, start.elapsed())
                    });
                    std::thread::sleep(Duration::from_millis(300));
                    let t0 = Instant::now();
                    comm.abort();
                    let aborting = t0.elapsed();
                    let (e, took) = t.join().unwrap();
                    go.wait();
                    // Quiet, the abort returns in microseconds and wakes the call at once;
                    // the bounds leave room for a busy machine.
                    assert!(
                        aborting < Duration::from_secs(2),
                        "abort blocked for {aborting:?}"
                    );
                    assert!(matches!(e, Error::Aborted { .. }), "{e}");
                    // Within the communicators' 20 s timeout: woken by the abort.
                    assert!(took < Duration::from_secs(15), "woken after {took:?}");
                    format!("{e}")
                })
            } else {
                // Rank 1 never joins the call; it learns of the abort from the watchdog
                // (quiet, within a heartbeat period; 30 s at most here, a busy machine).
                let start = Instant::now();
                while comm.check().is_ok() && start.elapsed() < Duration::from_secs(30) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                let waited = start.elapsed();
                let barrier = comm.check().err().map(|_| comm.barrier());
                go.wait();
                let e = barrier
                    .unwrap_or_else(|| panic!("no news of the abort in {waited:?}"))
                    .unwrap_err();
                assert!(
                    matches!(
                        e,
                        Error::Remote {
                            origin: 0,
                            kind: FailureKind::Aborted,
                            ..
                        }
                    ),
                    "{e}"
                );
                // The failure was noticed before the call began; later calls still say
                // that the communicator is unusable.
                let later = comm.barrier().unwrap_err();
                format!("{e} | later: {}", matches!(later, Error::Aborted { .. }))
            }
        });
        assert!(res[1].contains("rank 0 called abort()"), "{res:?}");
        assert!(res[1].ends_with("later: true"), "{res:?}");
    }
}

#[test]
fn timeout_names_the_call_its_number_and_the_missing_ranks() {
    for transport in BOTH {
        let done = Barrier::new(3);
        let res = group(3, transport, |r, comm| {
            comm.barrier().unwrap();
            if r == 0 {
                comm.set_timeout(Duration::from_millis(400));
                let start = Instant::now();
                let got = comm.all_reduce_in_place(&mut [1.0f32; 100], ReduceOp::Sum);
                let took = start.elapsed();
                // Every rank meets the others before it asserts: one that panicked first
                // would leave the others blocked at `done`.
                done.wait();
                let e = got.unwrap_err();
                // A 400 ms timeout, then the error: a bound well past it (a busy machine).
                assert!(took < Duration::from_secs(5), "timed out after {took:?}");
                Some(e)
            } else {
                // Late (10 s: far past rank 0's 400 ms timeout, also when a busy machine
                // delays rank 0): the others give up first; then this rank learns of it.
                std::thread::sleep(Duration::from_secs(10));
                let got = comm.all_reduce_in_place(&mut [1.0f32; 100], ReduceOp::Sum);
                done.wait();
                let e = got.unwrap_err();
                assert_eq!(e.failure_kind(), FailureKind::Timeout, "{e}");
                None
            }
        });
        match &res[0] {
            Some(Error::Timeout {
                call,
                seq,
                waiting_on,
                ..
            }) => {
                assert_eq!(*call, "all_reduce");
                assert_eq!(*seq, 2);
                assert!(
                    waiting_on.contains(&2) || waiting_on.contains(&1),
                    "{waiting_on:?}"
                );
            }
            e => panic!("{e:?}"),
        }
    }
}

#[test]
fn shrink_goes_on_without_an_aborted_rank() {
    for transport in BOTH {
        let res = group(4, transport, |r, comm| {
            comm.all_reduce_in_place(&mut [1.0f32; 10], ReduceOp::Sum)
                .unwrap();
            if r == 2 {
                comm.abort();
                return None;
            }
            let e = comm
                .all_reduce_in_place(&mut [1.0f32; 1000], ReduceOp::Sum)
                .unwrap_err();
            // The abort, or (if rank 2's links closed first) the loss of rank 2.
            assert!(
                e.failure_kind() == FailureKind::Aborted || e.lost_peer() == Some(2),
                "{e}"
            );
            let small = comm.shrink(&[2]).unwrap();
            assert_eq!(small.world_size(), 3);
            let mut v = vec![small.rank() as f32 + 1.0; 1000];
            small.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
            assert!(v.iter().all(|&x| x == 6.0));
            assert!(comm.shrink(&[r]).is_err(), "a rank cannot exclude itself");
            Some(small.rank())
        });
        assert_eq!(res, vec![Some(0), Some(1), None, Some(2)]);
    }
}

#[test]
fn dropping_never_hangs() {
    for transport in BOTH {
        let start = Instant::now();
        group(3, transport, |r, comm| {
            if r == 1 {
                drop(comm);
                return;
            }
            // The others may or may not notice rank 1 is gone before their call ends, but
            // they never hang, and dropping their communicators returns promptly.
            let _ = comm.all_reduce_in_place(&mut [1.0f32; 64], ReduceOp::Sum);
            let t = Instant::now();
            drop(comm);
            let took = t.elapsed();
            assert!(took < Duration::from_secs(10), "dropping took {took:?}");
        });
        let took = start.elapsed();
        assert!(
            took < Duration::from_secs(60),
            "{transport:?}: took {took:?}"
        );
    }
}

#[test]
fn overlapping_and_mismatched_buffers_are_errors() {
    group(2, TransportChoice::Shm, |_, comm| {
        let mut v = vec![0u8; 64];
        let p = v.as_mut_ptr();
        // SAFETY (test): two views of one buffer, as an FFI caller could pass; the call
        // must refuse them before touching memory.
        let (send, recv) = unsafe {
            (
                std::slice::from_raw_parts(p, 32),
                std::slice::from_raw_parts_mut(p.add(16), 32),
            )
        };
        let e = comm
            .call_bytes(
                oxccl::CollKind::AllReduce,
                oxccl::DataType::U8,
                ReduceOp::Sum,
                0,
                oxccl::ByteBufs::Separate { send, recv },
            )
            .unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        let e = comm
            .all_reduce(&[1u8; 4], &mut [0u8; 5], ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        // A length that is no multiple of the element size, and a buffer not aligned for it.
        let words = [0u64; 4];
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        let mut out = [0u64; 4];
        let out: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        for (dtype, send, recv_at, what) in [
            (oxccl::DataType::F32, &bytes[..6], 0, "multiples"),
            (oxccl::DataType::U16, &bytes[..6], 1, "aligned"),
            (oxccl::DataType::F64, &bytes[4..12], 0, "aligned"),
        ] {
            let recv = &mut out[recv_at..recv_at + send.len()];
            let e = comm
                .call_bytes(
                    oxccl::CollKind::AllReduce,
                    dtype,
                    ReduceOp::Sum,
                    0,
                    oxccl::ByteBufs::Separate { send, recv },
                )
                .unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains(what),
                "{dtype}: {e}"
            );
        }
        // Argument errors leave the communicator usable.
        comm.all_reduce_in_place(&mut [1u8; 4], ReduceOp::Sum)
            .unwrap();
    });
}

#[test]
fn flight_recorder_and_timeline_files() {
    let dir = std::env::temp_dir().join(format!("oxccl-fr-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("fr").to_string_lossy().into_owned();
    let trace = dir.join("tl.json").to_string_lossy().into_owned();
    let id = UniqueId::new_on("127.0.0.1".parse().unwrap()).unwrap();
    std::thread::scope(|s| {
        for r in 0..2 {
            let (id, prefix, trace) = (id.clone(), prefix.clone(), trace.clone());
            s.spawn(move || {
                let mut c = cfg(TransportChoice::Shm);
                c.flight_recorder = Some(prefix);
                c.trace = Some(trace);
                let comm = Communicator::init_with_config(&id, r, 2, c).unwrap();
                for _ in 0..5 {
                    comm.all_reduce_in_place(&mut [1.0f32; 10], ReduceOp::Sum)
                        .unwrap();
                }
                let k = if r == 0 { 10 } else { 11 };
                let e = comm.broadcast_in_place(&mut vec![0u8; k], 0);
                let e = e.err().or_else(|| comm.barrier().err()).unwrap();
                assert!(e.is_mismatch());
                let json = comm.flight_record();
                assert!(json.contains("\"state\":\"failed\""), "{json}");
            });
        }
    });
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let fr: Vec<_> = files
        .iter()
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("fr."))
        .collect();
    assert_eq!(fr.len(), 2, "{files:?}");
    for f in fr {
        let text = std::fs::read_to_string(f).unwrap();
        assert!(
            text.contains("\"call\":\"all_reduce\"") && text.contains("broadcast("),
            "{text}"
        );
    }
    for r in 0..2 {
        let t = std::fs::read_to_string(dir.join(format!("tl.{r}.json"))).unwrap();
        assert!(
            t.contains("\"traceEvents\"") && t.contains("\"step 0\""),
            "{t}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
