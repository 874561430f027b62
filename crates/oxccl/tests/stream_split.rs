//! Non-blocking collectives (`crate::stream`) and `Communicator::split`, with ranks as threads
//! of this process over real transports (TCP and shared memory, rendezvous on loopback).

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use oxccl::TransportChoice;
use oxccl::{Communicator, Config, Error, ReduceOp, UniqueId};

fn cfg(transport: TransportChoice) -> Config {
    Config {
        timeout: Duration::from_secs(60),
        transport,
        spin: 100,
        host_id: Some("stream-split-test".into()),
        ..Config::default()
    }
}

/// Runs `f(comm)` on `n` threads, each a rank of one communicator.
fn ranks<T: Send + 'static>(
    n: usize,
    transport: TransportChoice,
    f: impl Fn(Arc<Communicator>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let id = UniqueId::new_on(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (id, f) = (id.clone(), Arc::clone(&f));
            std::thread::spawn(move || {
                let comm = Communicator::init_with_config(&id, r, n, cfg(transport)).unwrap();
                f(Arc::new(comm))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn async_collectives_in_order_with_blocking_ones() {
    for transport in [TransportChoice::Tcp, TransportChoice::Shm] {
        let n = 3;
        ranks(n, transport, move |comm| {
            let r = comm.rank();
            let len = 100_003; // not a multiple of anything
                               // Queued, then a blocking call on another buffer, then more queued calls.
            let w1 = comm.all_reduce_async(vec![r as f32 + 1.0; len], ReduceOp::Sum);
            let w2 = comm.broadcast_async(vec![r as i64; 7], 2);
            let mut b = vec![r as u8; 5];
            comm.all_reduce_in_place(&mut b, ReduceOp::Max).unwrap();
            // The blocking call ran after the queued ones.
            assert!(w1.is_completed() && w2.is_completed());
            assert_eq!(b, vec![(n - 1) as u8; 5]);
            let w3 = comm.all_gather_async(vec![r as i32; 3]);
            let w4 = comm.reduce_scatter_async(vec![1.0f64; 3 * n], ReduceOp::Sum);
            let w5 = comm.all_to_all_async((0..n as u32).map(|p| 10 * r as u32 + p).collect());
            let w6 = comm.reduce_async(vec![2u64; 4], ReduceOp::Prod, 1);
            let ws = comm.send_async(vec![r as u32; 1000], (r + 1) % n);
            let wr = comm.recv_async(vec![0u32; 1000], (r + n - 1) % n);
            let wb = comm.barrier_async();
            assert_eq!(w1.wait().unwrap(), vec![6.0; len]);
            assert_eq!(w2.wait().unwrap(), vec![2; 7]);
            let g = w3.wait().unwrap();
            assert_eq!(g, (0..n as i32).flat_map(|p| [p; 3]).collect::<Vec<_>>());
            assert_eq!(w4.wait().unwrap(), vec![n as f64; 3]);
            let a = w5.wait().unwrap();
            assert_eq!(
                a,
                (0..n as u32).map(|p| 10 * p + r as u32).collect::<Vec<_>>()
            );
            let red = w6.wait().unwrap();
            if r == 1 {
                assert_eq!(red, vec![8; 4]);
            }
            assert_eq!(ws.wait().unwrap(), vec![r as u32; 1000]);
            assert_eq!(wr.wait().unwrap(), vec![((r + n - 1) % n) as u32; 1000]);
            wb.wait().unwrap();
            comm.synchronize();
            assert_eq!(comm.pending_calls(), 0);
        });
    }
}

#[test]
fn many_queued_calls_and_handles_dropped_early() {
    ranks(2, TransportChoice::Tcp, |comm| {
        let mut works = Vec::new();
        for i in 0..200u32 {
            let w = comm.all_reduce_async(vec![i; 64], ReduceOp::Sum);
            if i % 3 == 0 {
                drop(w); // still runs, in its turn
            } else {
                works.push((i, w));
            }
        }
        for (i, w) in works {
            assert_eq!(w.wait().unwrap(), vec![2 * i; 64]);
        }
        // The communicator outlives its last user handle: queued work holds it.
        let last = comm.all_reduce_async(vec![1u8; 3], ReduceOp::Sum);
        drop(comm);
        assert_eq!(last.wait().unwrap(), vec![2; 3]);
    });
}

/// A waiter runs a queued call that has not started itself (`Work::run_here`, done by
/// `wait`), only when nothing queued before it is still to run, and calls still run in
/// queue order wherever they run.
#[test]
fn a_waiter_runs_a_call_not_yet_started_in_order() {
    ranks(2, TransportChoice::Shm, |comm| {
        use std::sync::mpsc;
        use std::sync::Mutex;
        let r = comm.rank();
        // An earlier call still running: the later one is not run by its waiter.
        let (tx, rx) = mpsc::channel::<()>();
        let rx = Mutex::new(rx);
        let first = comm.submit(move |c| {
            rx.lock().unwrap().recv().unwrap();
            c.barrier()
        });
        let second = comm.all_reduce_async(vec![r as u32 + 1; 5], ReduceOp::Sum);
        std::thread::sleep(Duration::from_millis(50)); // the stream has taken `first` by now
        assert!(!second.run_here(), "ran ahead of a running call");
        tx.send(()).unwrap();
        assert_eq!(second.wait().unwrap(), vec![3; 5]);
        first.wait().unwrap();
        // Queue-and-wait at once, many times: calls run in order, and some on this thread
        // (the stream leaves a fresh call to a waiter for a moment; 200 tries all missing it
        // would mean the waiter never runs one).
        let order = Arc::new(Mutex::new(Vec::new()));
        let me = std::thread::current().id();
        let mut here = 0;
        for i in 0..200u32 {
            let o = Arc::clone(&order);
            let w = comm.submit(move |c| {
                let mut x = [i + r as u32];
                c.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
                o.lock().unwrap().push(i);
                Ok((x[0], std::thread::current().id()))
            });
            let (x, ran_on) = w.wait().unwrap();
            assert_eq!(x, 2 * i + 1);
            here += usize::from(ran_on == me);
        }
        assert_eq!(*order.lock().unwrap(), (0..200).collect::<Vec<_>>());
        assert!(here > 0, "no call ran on its waiting thread");
        // A blocking call after queued ones runs them first (here or on the stream).
        let w1 = comm.all_reduce_async(vec![1u8; 3], ReduceOp::Sum);
        let w2 = comm.broadcast_async(vec![r as u16; 2], 1);
        let mut b = [r as u64];
        comm.all_reduce_in_place(&mut b, ReduceOp::Max).unwrap();
        assert!(w1.is_completed() && w2.is_completed());
        assert_eq!(
            (w1.wait().unwrap(), w2.wait().unwrap(), b),
            (vec![2; 3], vec![1; 2], [1])
        );
    });
}

/// Queuing does not wake the stream thread (a waiter may run the call itself), yet a call
/// nobody waits for runs on its own: while the stream thread naps between looks, and after it
/// has slept for good (idle past `WORKER_IDLE`), when the next call wakes it.
#[test]
fn calls_nobody_waits_for_still_run() {
    ranks(2, TransportChoice::Shm, |comm| {
        let me = std::thread::current().id();
        let on_its_own = |comm: &Arc<Communicator>| {
            let w = comm.submit(|_| Ok(std::thread::current().id()));
            let start = std::time::Instant::now();
            while !w.is_completed() {
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "a queued call nobody waited for did not run"
                );
                std::thread::yield_now();
            }
            assert_ne!(w.wait().unwrap(), me, "ran on the stream thread");
        };
        on_its_own(&comm); // the stream thread's first call
        on_its_own(&comm); // napping
        std::thread::sleep(Duration::from_millis(200)); // past WORKER_IDLE: asleep for good
        on_its_own(&comm);
        // And collectives queued on every rank and waited for late complete in order.
        let a = comm.all_reduce_async(vec![1u32; 4], ReduceOp::Sum);
        let b = comm.all_reduce_async(vec![2u32; 4], ReduceOp::Sum);
        std::thread::sleep(Duration::from_millis(100));
        assert!(a.is_completed() && b.is_completed());
        assert_eq!(
            (a.wait().unwrap(), b.wait().unwrap()),
            (vec![2; 4], vec![4; 4])
        );
    });
}

#[test]
fn errors_come_back_through_the_handle() {
    ranks(2, TransportChoice::Tcp, |comm| {
        // A rejected argument: the communicator stays usable.
        let bad = comm.reduce_scatter_async(vec![1.0f32; 3], ReduceOp::Sum);
        assert!(matches!(bad.wait(), Err(Error::InvalidArgument { .. })));
        // A panic in submitted work is an error, not a dead stream.
        let p = comm.submit(|_| -> oxccl::Result<()> { panic!("boom") });
        match p.wait() {
            Err(Error::Aborted { msg, .. }) => assert!(msg.contains("boom"), "{msg}"),
            other => panic!("{other:?}"),
        }
        let w = comm.all_reduce_async(vec![1i32; 4], ReduceOp::Sum);
        let w = w.wait_timeout(Duration::from_secs(30)).expect("finished");
        assert_eq!(w.unwrap(), vec![2; 4]);
    });
}

#[test]
fn split_follows_nccl_comm_split() {
    let n = 5;
    let out = ranks(n, TransportChoice::Tcp, move |comm| {
        let r = comm.rank();
        // Even ranks: color 0, ordered by descending rank (key = -rank). Odd ranks: color 7,
        // keys equal (ties by rank). Rank 4: no color.
        let (color, key) = match r {
            4 => (None, 0),
            r if r % 2 == 0 => (Some(0), -(r as i64)),
            _ => (Some(7), 0),
        };
        let sub = comm.split(color, key).unwrap();
        let got = sub.as_ref().map(|s| (s.rank(), s.world_size()));
        if let Some(s) = &sub {
            // The new communicator works, and so does the parent.
            let mut v = vec![r as u32; 10];
            s.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
            let mut g = vec![0u32; s.world_size()];
            s.all_gather(&[r as u32], &mut g).unwrap();
            let s = Arc::new(sub.unwrap());
            let w = s
                .all_reduce_async(vec![1u8; 1], ReduceOp::Sum)
                .wait()
                .unwrap();
            assert_eq!(w[0] as usize, s.world_size());
            let mut p = vec![1u32; 3];
            comm.all_reduce_in_place(&mut p, ReduceOp::Sum).unwrap();
            assert_eq!(p, vec![n as u32; 3]);
            return (got, v[0], g);
        }
        let mut p = vec![1u32; 3];
        comm.all_reduce_in_place(&mut p, ReduceOp::Sum).unwrap();
        (got, 0, Vec::new())
    });
    // Even group {0, 2}, ordered by key -rank: old 2 is new rank 0.
    assert_eq!(out[0].0, Some((1, 2)));
    assert_eq!(out[2].0, Some((0, 2)));
    assert_eq!(out[0].1, 2);
    assert_eq!(out[0].2, vec![2, 0]);
    // Odd group {1, 3}: equal keys, by rank.
    assert_eq!(out[1].0, Some((0, 2)));
    assert_eq!(out[3].0, Some((1, 2)));
    assert_eq!(out[3].1, 4);
    assert_eq!(out[3].2, vec![1, 3]);
    assert_eq!(out[4].0, None);
}
