//! TCP links made on first use (`OXCCL_TCP_CONNECT=lazy`), with real processes on loopback
//! (`OXCCL_TRANSPORT=tcp`): every collective and point-to-point call gives the right results,
//! a rank holds only the sockets its calls needed (counted in `/proc/self/fd`, against
//! `eager`), a rank killed before any link to it was made is an error on every survivor
//! within the timeout, no link waits for a call on the peer (first sends, receives from any
//! source, mismatched calls), and no descriptor or thread outlives the communicators.
//!
//! The ranks are this test binary, re-executed to run the ignored test `lazy_child` with
//! `OXCCL_LAZY_CHILD` set to what it should do.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use oxccl::check;
use oxccl::{Algo, Communicator, ReduceOp};

mod proc_common;
use proc_common::{free_port, output_by};

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// This process's open sockets.
fn sockets() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.to_string_lossy().starts_with("socket:"))
        .count()
}

#[test]
#[ignore = "a rank of the other tests, run by them"]
fn lazy_child() {
    let Ok(mode) = std::env::var("OXCCL_LAZY_CHILD") else {
        return;
    };
    let mut comm = Communicator::from_env().unwrap();
    let (r, n) = (comm.rank(), comm.world_size());
    match mode.as_str() {
        "leave_early" => {
            // A chain broadcast lets the ranks near the root run ahead (their sends sit in
            // socket buffers) and leave while later ranks are still receiving: rank 0, the
            // hub of the control star, leaves first, then each new hub in turn.
            comm.set_algo(Some(Algo::Chain));
            let mut v = vec![0.0f32; 16384];
            for i in 0..40 {
                if r == 0 {
                    v.iter_mut().for_each(|x| *x = i as f32);
                }
                comm.broadcast_in_place(&mut v, 0)
                    .unwrap_or_else(|e| panic!("rank {r}: broadcast {i}: {e}"));
                assert!(v.iter().all(|&x| x == i as f32), "rank {r}: call {i}");
            }
            drop(comm);
            println!("CHILD {r} left");
        }
        "check" => {
            let s0 = sockets();
            // The acceptor adopts a peer's connection whenever it comes: the peers' first
            // calls must not dial this rank before it counted.
            std::thread::sleep(Duration::from_millis(500));
            // A ring all-reduce needs the two ring neighbours only.
            comm.set_algo(Some(Algo::Ring));
            let mut v = vec![1.0f32; 1000];
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
            assert!(v.iter().all(|&x| x == n as f32), "rank {r}: {:?}", &v[..4]);
            let s1 = sockets();
            // No peer ends this second all-reduce (which needs this rank's input) before this
            // rank counted, so none is in a call that needs a new link yet.
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
            comm.set_algo(None);
            let mut wrong = 0;
            for algo in [None, Some(Algo::Tree), Some(Algo::Chain)] {
                comm.set_algo(algo);
                for case in check::matrix(r, n, &[1, 1000]) {
                    let mut bufs = case.buffers(None).unwrap();
                    let (send, recv) = bufs.get();
                    case.fill(send, recv);
                    case.call(&comm, send, recv)
                        .unwrap_or_else(|e| panic!("rank {r}: {case:?} {algo:?}: {e}"));
                    wrong += case.wrong(recv);
                }
            }
            comm.set_algo(None);
            wrong += check::p2p(&comm, &[1, 1000], 0);
            comm.barrier().unwrap();
            let s2 = sockets();
            // No rank leaves before every rank counted (rank 0, the watchdog's hub, hands
            // over as it leaves: the others then connect to the new hub).
            comm.barrier().unwrap();
            println!("CHILD {r} sockets {s0} {s1} {s2} wrong {wrong}");
        }
        "kill" => {
            let victim: usize = std::env::var("OXCCL_LAZY_VICTIM").unwrap().parse().unwrap();
            if r == victim {
                // Dies before any call: no link to it is ever made.
                std::thread::sleep(Duration::from_millis(300));
                std::process::abort();
            }
            comm.set_algo(Some(Algo::Ring));
            let start = Instant::now();
            let mut v = vec![1.0f32; 1000];
            let e = comm
                .all_reduce_in_place(&mut v, ReduceOp::Sum)
                .expect_err("an all-reduce with a dead rank completed");
            println!("CHILD {r} ERR {} ms {e}", start.elapsed().as_millis());
        }
        "any_kill" => {
            // Rank 1 receives from any source before any link is made; the victim dies
            // first, the other rank sends to it later.
            let victim: usize = std::env::var("OXCCL_LAZY_VICTIM").unwrap().parse().unwrap();
            if r == victim {
                std::thread::sleep(Duration::from_millis(300));
                std::process::abort();
            }
            let start = Instant::now();
            if r == 1 {
                let mut b = [0u32; 1];
                let e = comm
                    .recv_any(&mut b, 0)
                    .expect_err("a receive from any source with a dead rank completed");
                println!("CHILD {r} ERR {} ms {e}", start.elapsed().as_millis());
            } else {
                // Late, so that the receive cannot take it first; then stays (the barrier
                // fails with the victim gone): a rank that leaves early would take the
                // watchdog's news with it.
                std::thread::sleep(Duration::from_millis(2000));
                let res = comm.send(&[r as u32], 1).and_then(|()| comm.barrier());
                println!("CHILD {r} SENT {} ms {res:?}", start.elapsed().as_millis());
            }
        }
        m => panic!("unknown mode {m}"),
    }
}

/// Starts `n` ranks in `mode` with `OXCCL_TCP_CONNECT=connect` (and `extra` variables).
fn spawn(n: usize, mode: &str, connect: &str, extra: &[(&str, String)]) -> Vec<Child> {
    let port = free_port();
    let secret = format!("{:032x}", (std::process::id() as u128) << 64 | port as u128);
    (0..n)
        .map(|r| {
            let mut c = Command::new(std::env::current_exe().unwrap());
            c.args(["--exact", "lazy_child", "--ignored", "--nocapture"])
                .env("OXCCL_LAZY_CHILD", mode)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("OXCCL_SECRET", &secret)
                .env("OXCCL_TRANSPORT", "tcp")
                .env("OXCCL_TCP_CONNECT", connect)
                .env("OXCCL_TIMEOUT", "30")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in extra {
                c.env(k, v);
            }
            c.spawn().unwrap()
        })
        .collect()
}

/// Waits (at most 60 s in all) for every child; returns each one's `CHILD` line.
fn lines(kids: Vec<Child>) -> Vec<Option<String>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    kids.into_iter()
        .map(|k| {
            let o = output_by(k, deadline, Duration::from_millis(10));
            let out = String::from_utf8_lossy(&o.stdout);
            let line = out
                .lines()
                .find(|l| l.starts_with("CHILD "))
                .map(str::to_string);
            if line.is_none() {
                eprintln!("{}", String::from_utf8_lossy(&o.stderr));
            }
            line
        })
        .collect()
}

/// Each rank's (sockets before any call, after a ring all-reduce, after everything).
fn check_run(connect: &str, extra: &[(&str, String)]) -> Vec<(usize, usize, usize)> {
    let n = 4;
    lines(spawn(n, "check", connect, extra))
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let l = l.unwrap_or_else(|| panic!("rank {r} ({connect}) printed no result"));
            eprintln!("{connect}: {l}");
            let w: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(w[7], "0", "rank {r} ({connect}): wrong elements: {l}");
            let num = |i: usize| w[i].parse::<usize>().unwrap();
            (num(3), num(4), num(5))
        })
        .collect()
}

/// Ranks that leave one after another while later ranks still finish their calls: the hub
/// of the control star hands over to a rank that leaves in turn, and every rank it admitted
/// meanwhile must hear its goodbye, not a closed connection (which would fail the call as
/// a lost peer).
#[test]
fn ranks_leaving_one_after_another_fail_no_rank_still_in_a_call() {
    for round in 0..3 {
        let n = 8;
        for (r, l) in lines(spawn(n, "leave_early", "eager", &[]))
            .into_iter()
            .enumerate()
        {
            assert_eq!(
                l.as_deref(),
                Some(format!("CHILD {r} left").as_str()),
                "round {round}: rank {r} failed (its error is above)"
            );
        }
    }
}

#[test]
fn every_collective_is_right_and_only_needed_links_are_made() {
    let lazy = check_run("lazy", &[]);
    let eager = check_run("eager", &[]);
    lazy_against_eager(&lazy, &eager);
}

#[test]
fn auto_is_eager_in_a_small_group_and_lazy_above_the_threshold() {
    // 4 ranks: eager under the default threshold (64), lazy with it at 3.
    let eager = check_run("auto", &[]);
    let lazy = check_run("auto", &[("OXCCL_TCP_LAZY_MIN_RANKS", "3".into())]);
    lazy_against_eager(&lazy, &eager);
}

/// Socket counts (see [`check_run`]) of a lazy run against an eager one.
fn lazy_against_eager(lazy: &[(usize, usize, usize)], eager: &[(usize, usize, usize)]) {
    for (r, (&(l0, l1, l2), &(e0, e1, e2))) in lazy.iter().zip(eager).enumerate() {
        // Eager: all 3 links at init, nothing later.
        assert_eq!(
            (e1, e2),
            (e0, e0),
            "rank {r}: eager opened sockets after init"
        );
        // Lazy: a listener and no link at init; the ring's 2 links with the first call; the
        // third later, and the listener closed once every link is made.
        assert_eq!(l0 + 2, e0, "rank {r}: lazy {lazy:?} eager {eager:?}");
        assert_eq!(l1, l0 + 2, "rank {r}: lazy {lazy:?}");
        assert_eq!(l2, e0, "rank {r}: lazy {lazy:?} eager {eager:?}");
    }
}

fn killed_before_any_link(victim: usize) {
    let n = 3;
    let got = lines(spawn(
        n,
        "kill",
        "lazy",
        &[("OXCCL_LAZY_VICTIM", victim.to_string())],
    ));
    for (r, l) in got.iter().enumerate().filter(|(r, _)| *r != victim) {
        let l = l
            .as_ref()
            .unwrap_or_else(|| panic!("rank {r} printed no error"));
        eprintln!("{l}");
        let ms: u64 = l.split_whitespace().nth(3).unwrap().parse().unwrap();
        // Well within the 30 s timeout, and naming the dead rank.
        assert!(ms < 15_000, "rank {r}: {l}");
        assert!(l.contains(&format!("rank {victim}")), "rank {r}: {l}");
    }
}

#[test]
fn a_rank_killed_before_its_links_fails_the_survivors_that_await_it() {
    // Rank 2 is the higher rank of both its pairs (its dial wins when both dial).
    killed_before_any_link(2);
}

#[test]
fn a_rank_killed_before_its_links_fails_the_survivors_that_dial_it() {
    // Rank 0 is the lower rank of both its pairs (and the rendezvous).
    killed_before_any_link(0);
}

/// A measurement rank, not a test: `scripts/cluster.sh connect` runs this binary with
/// `OXCCL_COST_CHILD=COLL:BYTES:ITERS` (COLL: all_reduce, all_gather or broadcast) and prints
/// one `COST` line per rank: init's time, the first call's, start to the first call's end,
/// this process's sockets after init and after the first call, and the mean of ITERS
/// further calls.
#[test]
#[ignore = "a measurement rank: scripts/cluster.sh connect runs it"]
fn cost_child() {
    let Ok(spec) = std::env::var("OXCCL_COST_CHILD") else {
        return;
    };
    let w: Vec<&str> = spec.split(':').collect();
    let (coll, bytes, iters): (&str, usize, u32) =
        (w[0], w[1].parse().unwrap(), w[2].parse().unwrap());
    let t0 = Instant::now();
    let comm = Communicator::from_env().unwrap();
    let init = t0.elapsed();
    let s_init = sockets();
    let (r, n) = (comm.rank(), comm.world_size());
    let count = (bytes / 4).max(n);
    let mut buf = vec![1.0f32; count - count % n];
    let mut call = || match coll {
        "all_reduce" => comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap(),
        "all_gather" => comm.all_gather_in_place(&mut buf).unwrap(),
        "broadcast" => comm.broadcast_in_place(&mut buf, 0).unwrap(),
        c => panic!("unknown collective {c}"),
    };
    let t1 = Instant::now();
    call();
    let (first, to_first) = (t1.elapsed(), t0.elapsed());
    let s_first = sockets();
    let t2 = Instant::now();
    for _ in 0..iters {
        call();
    }
    let steady = t2.elapsed() / iters.max(1);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "COST rank {r} connect {} coll {coll} bytes {bytes} init_ms {:.2} first_ms {:.3} to_first_ms {:.2} sockets_init {s_init} sockets_first {s_first} steady_us {:.1}",
        std::env::var("OXCCL_TCP_CONNECT").unwrap_or_else(|_| "auto".into()),
        ms(init),
        ms(first),
        ms(to_first),
        steady.as_secs_f64() * 1e6
    );
}

/// A rank's config: TCP everywhere, links made on first use, calls failing after `timeout`.
fn lazy_cfg(timeout: Duration) -> oxccl::Config {
    oxccl::Config {
        timeout,
        transport: oxccl::TransportChoice::Tcp,
        tcp_connect: oxccl::TcpConnect::Lazy,
        ..oxccl::Config::default()
    }
}

/// Runs `f(rank, comm)` on `n` threads joined by a rendezvous, TCP everywhere, links made on
/// first use.
fn threads<T: Send>(n: usize, f: impl Fn(usize, Communicator) -> T + Sync) -> Vec<T> {
    proc_common::threads(n, |_| lazy_cfg(Duration::from_secs(20)), f)
}

#[test]
fn point_to_point_makes_the_links_it_names() {
    threads(3, |r, comm| {
        // Before any call: a send and a receive between ranks 1 and 2 make their link.
        match r {
            1 => comm.send(&[7u32, 8, 9], 2).unwrap(),
            2 => {
                let mut got = [0u32; 3];
                comm.recv(&mut got, 1).unwrap();
                assert_eq!(got, [7, 8, 9]);
            }
            _ => {}
        }
        // An all-to-all makes every link; then any source works.
        let send: Vec<u32> = (0..3).map(|p| (r * 10 + p) as u32).collect();
        let mut recv = [0u32; 3];
        comm.all_to_all(&send, &mut recv).unwrap();
        assert_eq!(
            recv.to_vec(),
            (0..3).map(|p| (p * 10 + r) as u32).collect::<Vec<_>>()
        );
        if r == 0 {
            let mut b = [0u32; 1];
            let mut from = Vec::new();
            for _ in 0..2 {
                from.push(comm.recv_any(&mut b, 5).unwrap());
                assert_eq!(b[0] as usize, from[from.len() - 1] * 100);
            }
            from.sort_unstable();
            assert_eq!(from, [1, 2]);
        } else {
            comm.send_tagged(&[(r * 100) as u32], 0, 5).unwrap();
        }
        // Nobody leaves (closing its links) before rank 0 has read from it.
        comm.barrier().unwrap();
    });
}

#[test]
fn recv_any_makes_every_missing_link() {
    threads(4, |r, comm| {
        // Rank 1 receives from any source before any link is made: it dials ranks 0, 2 and 3,
        // whose sends dial it at the same time (crossed dials: the higher rank's makes each
        // link).
        if r == 1 {
            let mut from = Vec::new();
            for _ in 0..3 {
                let mut b = [0u32; 1];
                from.push(comm.recv_any(&mut b, 7).unwrap());
                assert_eq!(b[0] as usize, from[from.len() - 1] * 100);
            }
            from.sort_unstable();
            assert_eq!(from, [0, 2, 3]);
        } else {
            comm.send_tagged(&[(r * 100) as u32], 1, 7).unwrap();
        }
        // Then rank 2's receive from any source lacks the links to 0 and 3 only (1's made).
        if r == 2 {
            let mut from = Vec::new();
            for _ in 0..3 {
                let mut b = [0u32; 1];
                from.push(comm.recv_any(&mut b, 8).unwrap());
                assert_eq!(b[0] as usize, from[from.len() - 1] + 1);
            }
            from.sort_unstable();
            assert_eq!(from, [0, 1, 3]);
        } else {
            comm.send_tagged(&[(r + 1) as u32], 2, 8).unwrap();
        }
        // Nobody leaves (closing its links) before the receivers have read from it.
        comm.barrier().unwrap();
    });
}

fn recv_any_with_a_dead_rank(victim: usize) {
    let got = lines(spawn(
        3,
        "any_kill",
        "lazy",
        &[("OXCCL_LAZY_VICTIM", victim.to_string())],
    ));
    let l = got[1].as_ref().expect("rank 1 printed no error");
    eprintln!("{l}");
    let ms: u64 = l.split_whitespace().nth(3).unwrap().parse().unwrap();
    // Well within the 30 s timeout, and naming the dead rank.
    assert!(ms < 15_000, "{l}");
    assert!(l.contains(&format!("rank {victim}")), "{l}");
}

#[test]
fn recv_any_fails_when_a_higher_rank_it_awaits_is_dead() {
    recv_any_with_a_dead_rank(2);
}

#[test]
fn recv_any_fails_when_a_lower_rank_it_dials_is_dead() {
    recv_any_with_a_dead_rank(0);
}

#[test]
fn a_first_send_waits_for_no_receiver() {
    // Before any call, rank 0 sends to rank 2 (the lower end dials) and rank 2 to rank 1 (the
    // higher end dials) while each receiver is in no call for 6 s: both sends return at
    // once (the earlier design made each wait for its receiver's call).
    let took = threads(3, |r, comm| {
        let start = Instant::now();
        let took = match r {
            0 => {
                comm.send(&[1u32, 2], 2).unwrap();
                Some(start.elapsed())
            }
            2 => {
                comm.send(&[3u32], 1).unwrap();
                let took = start.elapsed();
                std::thread::sleep(Duration::from_millis(6000));
                let mut b = [0u32; 2];
                comm.recv(&mut b, 0).unwrap();
                assert_eq!(b, [1, 2]);
                Some(took)
            }
            _ => {
                std::thread::sleep(Duration::from_millis(6000));
                let mut b = [0u32; 1];
                comm.recv(&mut b, 2).unwrap();
                assert_eq!(b, [3]);
                None
            }
        };
        comm.barrier().unwrap();
        took
    });
    for (r, t) in took.iter().enumerate() {
        if let Some(t) = t {
            // Quiet, milliseconds; a send that waited for the receiver would take its 6 s.
            assert!(
                *t < Duration::from_millis(4000),
                "rank {r}'s send took {t:?}"
            );
        }
    }
}

#[test]
fn recv_any_waits_for_no_peer_call() {
    // Rank 1 receives from any source before any link is made while rank 0 is in no call
    // until it is done (the earlier design failed this receive at its deadline: rank 0's
    // link waited for a call there).
    let done = AtomicBool::new(false);
    threads(4, |r, comm| {
        match r {
            1 => {
                let mut from = Vec::new();
                for _ in 0..2 {
                    let mut b = [0u32; 1];
                    from.push(comm.recv_any(&mut b, 7).unwrap());
                    assert_eq!(b[0] as usize, from[from.len() - 1] * 100);
                }
                from.sort_unstable();
                assert_eq!(from, [2, 3]);
                done.store(true, Ordering::SeqCst);
            }
            0 => {
                let start = Instant::now();
                while !done.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(15) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                assert!(done.load(Ordering::SeqCst), "rank 1's receive did not end");
            }
            _ => comm.send_tagged(&[(r * 100) as u32], 1, 7).unwrap(),
        }
        comm.barrier().unwrap();
    });
}

#[test]
fn calls_needing_different_links_fail_as_under_eager() {
    // Ranks 0 and 1 run a ring all-reduce (rank 0 receives from rank 2) while rank 2 sends to
    // rank 1 and then waits: no link waits for a call, so rank 0 fails as under eager
    // (waiting for rank 2's data), not with a connection timeout (the earlier design: rank 0
    // waited for rank 2 to dial).
    let run = |connect: oxccl::TcpConnect| {
        let failed = AtomicUsize::new(0);
        proc_common::threads(
            3,
            // Rank 0 times out first, on its own.
            |r| oxccl::Config {
                tcp_connect: connect,
                ..lazy_cfg(Duration::from_secs(if r == 0 { 3 } else { 10 }))
            },
            |r, mut comm| {
                if r == 2 {
                    comm.send(&[5u32], 1).unwrap();
                    // Stay until the others have failed (leaving would be their failure).
                    let start = Instant::now();
                    while failed.load(Ordering::SeqCst) < 2
                        && start.elapsed() < Duration::from_secs(30)
                    {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    return None;
                }
                comm.set_algo(Some(Algo::Ring));
                let mut v = vec![1.0f32; 1000];
                let e = comm
                    .all_reduce_in_place(&mut v, ReduceOp::Sum)
                    .expect_err("a mismatched all-reduce completed");
                failed.fetch_add(1, Ordering::SeqCst);
                Some(e)
            },
        )
    };
    let lazy = run(oxccl::TcpConnect::Lazy);
    let eager = run(oxccl::TcpConnect::Eager);
    for r in 0..2 {
        let (l, e) = (lazy[r].as_ref().unwrap(), eager[r].as_ref().unwrap());
        eprintln!("rank {r}: lazy: {l}\n        eager: {e}");
        assert!(
            !matches!(l, oxccl::Error::Connect { .. }),
            "rank {r}: a connection error under lazy: {l}"
        );
    }
    let (l, e) = (lazy[0].as_ref().unwrap(), eager[0].as_ref().unwrap());
    assert_eq!(
        std::mem::discriminant(l),
        std::mem::discriminant(e),
        "rank 0: lazy {l} / eager {e}"
    );
}

/// This process's open file descriptors and threads.
fn fds_and_threads() -> (usize, usize) {
    let count = |d: &str| std::fs::read_dir(d).unwrap().count();
    (count("/proc/self/fd"), count("/proc/self/task"))
}

#[test]
#[ignore = "run by no_descriptor_or_thread_outlives_a_lazy_communicator, alone in its process"]
fn leak_child() {
    if std::env::var("OXCCL_LEAK_CHILD").is_err() {
        return;
    }
    // 4 ranks: a ring all-reduce makes 4 of the 6 links, a send one more; one pair's link is
    // never made, so its two ranks end with their acceptors running.
    let round = || {
        threads(4, |r, mut comm| {
            comm.set_algo(Some(Algo::Ring));
            let mut v = vec![1.0f32; 100];
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
            match r {
                0 => comm.send(&[1u8], 2).unwrap(),
                2 => comm.recv(&mut [0u8], 0).unwrap(),
                _ => {}
            }
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
        })
    };
    round();
    let before = fds_and_threads();
    for _ in 0..3 {
        round();
    }
    // Threads that were joined are gone from /proc at once; give anything else a moment.
    let start = Instant::now();
    let mut after = fds_and_threads();
    while after != before && start.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(50));
        after = fds_and_threads();
    }
    println!("LEAK {} {} {} {}", before.0, after.0, before.1, after.1);
}

#[test]
fn no_descriptor_or_thread_outlives_a_lazy_communicator() {
    let k = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "leak_child", "--ignored", "--nocapture"])
        .env("OXCCL_LEAK_CHILD", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let o = output_by(
        k,
        Instant::now() + Duration::from_secs(90),
        Duration::from_millis(10),
    );
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out
        .lines()
        .find(|l| l.starts_with("LEAK "))
        .unwrap_or_else(|| panic!("{out}\n{}", String::from_utf8_lossy(&o.stderr)));
    let w: Vec<usize> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap())
        .collect();
    assert_eq!(
        w[0], w[1],
        "descriptors before/after 3 rounds of 4 ranks: {line}"
    );
    assert_eq!(
        w[2], w[3],
        "threads before/after 3 rounds of 4 ranks: {line}"
    );
}
