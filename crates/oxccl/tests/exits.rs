//! Ranks that finish their last call and leave at once, with real processes: a rank that
//! completed its part of a call and then dropped its communicator (or exited without
//! dropping it) is not a lost peer, and what it sent before it left must still be delivered
//! to the ranks that are slower to finish that call. Only a later call that needs it fails,
//! promptly and naming it.
//!
//! Each round: `n` ranks make a checked warm-up call, then the survivors enter the final call
//! and sleep in it waiting for the leavers; the test SIGSTOPs the survivors, lets the leavers
//! make the same call, leave and exit, and SIGCONTs the survivors once the leavers are gone
//! (and more than a sleep slice later, so that the survivors' first act is a liveness check
//! of the peers they wait for, whose data is already in their links). Every survivor must
//! complete that call with the right result; its next call must fail naming a leaver, well
//! before its timeout. One leaver (rank 0, the rendezvous's hub, or the last rank) or all but
//! one rank, which drop their communicator and exit; the calls run over shared-memory links,
//! the direct area (one-shot, single-copy), TCP, and two emulated hosts (shared memory inside,
//! TCP between).
//!
//! `OXCCL_EXIT_ROUNDS=N` runs the matrix N times (default 1); `OXCCL_EXIT_CASE=TEXT` only the
//! cases whose name contains TEXT. Each case runs twice: leavers that drop their
//! communicator, and leavers that exit without dropping it (`std::process::exit` with the
//! communicator still alive: the exit hook of `comm/exit.rs` says its goodbye; without it
//! they could not be told from killed ranks, and a survivor still waiting on another rank
//! when the loss was reported failed, 8 of 80 rounds); `OXCCL_EXIT_FORGET=0` runs only the
//! first. The ranks are this test binary, re-executed to run the ignored test `exit_child`
//! with `OXCCL_EXIT_CHILD` set.

use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

use oxccl::{Communicator, ReduceOp};

mod proc_common;
use proc_common::{
    env_u64, files_of, free_port, job_secret, output_by, rank_command, signal, spawn_reading, Rng,
};

/// The value element `i` of rank `rank`'s input has in call `it`.
fn val(rank: usize, i: usize, it: usize) -> f32 {
    (rank * 7 + (i + it) % 13) as f32
}

/// One checked call of `coll` on `bytes` bytes of f32 (broadcast from `root`).
fn call(c: &Communicator, coll: &str, bytes: usize, root: usize, it: usize) -> Result<(), String> {
    let (r, n) = (c.rank(), c.world_size());
    let k = (bytes / 4).max(1);
    let mine: Vec<f32> = (0..k).map(|i| val(r, i, it)).collect();
    let (got, want): (Vec<f32>, Vec<f32>) = match coll {
        "barrier" => {
            c.barrier().map_err(|e| e.to_string())?;
            (vec![], vec![])
        }
        "all_reduce" => {
            let mut v = mine;
            c.all_reduce_in_place(&mut v, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            let want = (0..k)
                .map(|i| (0..n).map(|q| val(q, i, it)).sum())
                .collect();
            (v, want)
        }
        "broadcast" => {
            let mut v = if r == root { mine } else { vec![-1.0; k] };
            c.broadcast_in_place(&mut v, root)
                .map_err(|e| e.to_string())?;
            (v, (0..k).map(|i| val(root, i, it)).collect())
        }
        "all_gather" => {
            let mut v = vec![-1.0; k * n];
            c.all_gather(&mine, &mut v).map_err(|e| e.to_string())?;
            let want = (0..n)
                .flat_map(|q| (0..k).map(move |i| val(q, i, it)))
                .collect();
            (v, want)
        }
        other => panic!("no collective {other}"),
    };
    match got.iter().zip(&want).position(|(a, b)| a != b) {
        Some(i) => Err(format!(
            "WRONG {coll} call {it}: element {i} is {} instead of {}",
            got[i], want[i]
        )),
        None => Ok(()),
    }
}

/// A rank: a warm-up call (`CHILD READY <algo>`), then the final call. A leaver
/// (`OXCCL_EXIT_LEAVERS`, comma-separated) makes it once it reads a line on stdin, says
/// `CHILD LEFT`, and drops its communicator (or forgets it, `OXCCL_EXIT_FORGET=1`: the
/// process exits, through `std::process::exit`, without dropping it); a survivor makes it at once, says `CHILD FINAL OK`,
/// then makes an all-reduce that needs the leavers and says `CHILD NEXT_ERR <ms> <error>`.
/// Anything else is `CHILD_ERR <what>` on stdout and exit status 1.
#[test]
#[ignore = "a rank of the other tests, run by them"]
fn exit_child() {
    let Ok(coll) = std::env::var("OXCCL_EXIT_CHILD") else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let bytes: usize = var("OXCCL_EXIT_BYTES").parse().unwrap_or(8);
    let leavers: Vec<usize> = var("OXCCL_EXIT_LEAVERS")
        .split(',')
        .filter_map(|s| s.parse().ok())
        .collect();
    let forget = var("OXCCL_EXIT_FORGET") == "1";
    let run = || -> Result<(), String> {
        let comm = Communicator::from_env().map_err(|e| e.to_string())?;
        let r = comm.rank();
        let root = leavers[0];
        call(&comm, &coll, bytes, root, 0)?;
        println!("CHILD READY {}", comm.last_algo());
        if leavers.contains(&r) {
            let mut line = String::new();
            std::io::stdin()
                .read_line(&mut line)
                .map_err(|e| e.to_string())?;
            call(&comm, &coll, bytes, root, 1)?;
            println!("CHILD LEFT {}", comm.last_algo());
            if forget {
                std::mem::forget(comm);
                std::process::exit(0);
            } else {
                drop(comm);
            }
            return Ok(());
        }
        call(&comm, &coll, bytes, root, 1)?;
        println!("CHILD FINAL OK {}", comm.last_algo());
        let t = Instant::now();
        let mut v = [1f32; 2];
        match comm.all_reduce_in_place(&mut v, ReduceOp::Sum) {
            Ok(()) => Err("the call after the leavers left succeeded".into()),
            Err(e) => {
                println!("CHILD NEXT_ERR {} {e}", t.elapsed().as_millis());
                Ok(())
            }
        }
    };
    end_child(run());
}

/// Ends a rank of these tests: on an error, `CHILD_ERR <error>` on stdout and exit status 1.
fn end_child(r: Result<(), String>) {
    if let Err(e) = r {
        println!("CHILD_ERR {e}");
        std::process::exit(1);
    }
}

/// Starts a job of `n` ranks running the ignored test `child` with `env` (and no tune file);
/// each rank's `CHILD` lines come to the receiver ([`spawn_child`]). Returns the ranks, the
/// receiver and the job's tag (of its `/dev/shm` files).
fn spawn_job(
    child: &str,
    n: usize,
    env: &[(&str, &str)],
) -> (Vec<Child>, Receiver<(usize, String, Instant)>, u64) {
    let (hex, tag) = job_secret();
    let port = free_port();
    let (tx, rx) = std::sync::mpsc::channel();
    let kids = (0..n)
        .map(|r| {
            let mut c = rank_command(child, r, n, port, &hex);
            c.env("OXCCL_TUNE_FILE", "").envs(env.iter().copied());
            spawn_child(&mut c, r, tx.clone())
        })
        .collect();
    (kids, rx, tag)
}

/// Starts rank `r` (`c`, its stdio piped) and sends each `CHILD` line it prints to `tx`
/// (without the prefix, with when it came), then `EOF` once its stdout ends.
fn spawn_child(c: &mut Command, r: usize, tx: Sender<(usize, String, Instant)>) -> Child {
    c.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    spawn_reading(c, move |line| match line {
        Some(line) => {
            if let Some(l) = line.strip_prefix("CHILD") {
                let _ = tx.send((r, l.trim().to_string(), Instant::now()));
            }
        }
        None => {
            let _ = tx.send((r, "EOF".into(), Instant::now()));
        }
    })
}

/// Where the calls run.
struct Path {
    name: &'static str,
    n: usize,
    env: &'static [(&'static str, &'static str)],
    /// Ranks per emulated host (`OXCCL_HOSTID`).
    per_host: usize,
}

const PATHS: &[Path] = &[
    Path {
        name: "shared-memory links",
        n: 3,
        // No one-shot, no single-copy: the schedules (ring, chain, dissemination).
        env: &[
            ("OXCCL_TRANSPORT", "shm"),
            ("OXCCL_ONESHOT_MAX", "0"),
            ("OXCCL_CMA", "0"),
        ],
        per_host: 3,
    },
    Path {
        name: "direct area",
        n: 3,
        env: &[("OXCCL_TRANSPORT", "shm")],
        per_host: 3,
    },
    Path {
        name: "tcp",
        n: 3,
        env: &[("OXCCL_TRANSPORT", "tcp")],
        per_host: 3,
    },
    Path {
        name: "two hosts",
        n: 4,
        env: &[],
        per_host: 2,
    },
];

/// (collective, bytes)
const CALLS: &[(&str, usize)] = &[
    ("barrier", 0),
    ("all_reduce", 8),
    ("all_reduce", 192 << 10),
    ("broadcast", 64 << 10),
    ("all_gather", 4 << 10),
];

/// Runs one round; returns what went wrong, if anything.
fn run_round(
    path: &Path,
    coll: &str,
    bytes: usize,
    leavers: &[usize],
    forget: bool,
) -> Result<String, String> {
    let n = path.n;
    let (hex, tag) = job_secret();
    let port = free_port();
    let list: Vec<String> = leavers.iter().map(|l| l.to_string()).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let mut kids: Vec<Child> = (0..n)
        .map(|r| {
            let mut c = rank_command("exit_child", r, n, port, &hex);
            c.env("OXCCL_EXIT_CHILD", coll)
                .env("OXCCL_EXIT_BYTES", bytes.to_string())
                .env("OXCCL_EXIT_LEAVERS", list.join(","))
                .env("OXCCL_EXIT_FORGET", if forget { "1" } else { "0" })
                .env("OXCCL_SHM_RING_BYTES", "1M")
                // Long, so that "well before the timeout" (below) holds on a busy machine.
                .env("OXCCL_TIMEOUT", "60")
                .env("OXCCL_HEARTBEAT_TIMEOUT", "5")
                .env("OXCCL_TUNE_FILE", "")
                .env("OXCCL_HOSTID", format!("exits-host-{}", r / path.per_host))
                .envs(path.env.iter().copied());
            spawn_child(&mut c, r, tx.clone())
        })
        .collect();
    let kill_all = |kids: &mut Vec<Child>| {
        for k in kids.iter_mut() {
            let _ = signal(k, "-CONT");
            let _ = k.kill();
            let _ = k.wait();
        }
    };
    let mut said: Vec<Vec<String>> = vec![Vec::new(); n];
    let mut ready = 0;
    while ready < n {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok((r, l, _)) => {
                if l.starts_with("READY") {
                    ready += 1;
                } else {
                    kill_all(&mut kids);
                    return Err(format!("rank {r} before its first call ended: {l}"));
                }
                said[r].push(l);
            }
            Err(_) => {
                kill_all(&mut kids);
                return Err(format!(
                    "only {ready} of {n} ranks made a first call in 60 s"
                ));
            }
        }
    }
    // The survivors enter the final call and sleep in it, waiting for the leavers.
    std::thread::sleep(Duration::from_millis(150));
    let survivors: Vec<usize> = (0..n).filter(|r| !leavers.contains(r)).collect();
    for &s in &survivors {
        assert!(signal(&kids[s], "-STOP"), "cannot stop rank {s}");
    }
    for &l in leavers {
        let mut stdin = kids[l].stdin.take().unwrap();
        let _ = stdin.write_all(b"GO\n");
    }
    // The leavers finish (where they need nothing more from the stopped ranks) and exit.
    let t = Instant::now();
    let mut gone = false;
    while t.elapsed() < Duration::from_secs(1) {
        gone = leavers
            .iter()
            .all(|&l| kids[l].try_wait().ok().flatten().is_some());
        if gone {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    // More than a sleep slice (50 ms) after the survivors' last check.
    std::thread::sleep(Duration::from_millis(80));
    for &s in &survivors {
        signal(&kids[s], "-CONT");
    }
    let by = Instant::now() + Duration::from_secs(75);
    let outs: Vec<_> = kids
        .into_iter()
        .map(|k| output_by(k, by, Duration::from_millis(5)))
        .collect();
    // Every rank's stdout to its end.
    let mut ended = 0;
    while ended < n {
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok((r, l, _)) => {
                ended += (l == "EOF") as usize;
                said[r].push(l);
            }
            Err(_) => break,
        }
    }
    let mut wrong = Vec::new();
    let mut named_a_leaver = false;
    for (r, o) in outs.iter().enumerate() {
        let lines = &said[r];
        let err = String::from_utf8_lossy(&o.stderr);
        let tail: Vec<&str> = err.lines().rev().take(3).collect();
        let line = |p: &str| lines.iter().find(|l| l.starts_with(p)).cloned();
        if leavers.contains(&r) {
            if o.status.code() != Some(0) || line("LEFT").is_none() {
                wrong.push(format!(
                    "leaver {r} ended with {:?}: {lines:?} {tail:?}",
                    o.status.code()
                ));
            }
            continue;
        }
        let next = line("NEXT_ERR ").unwrap_or_default();
        let mut words = next.split_whitespace().skip(1);
        let ms: u64 = words
            .next()
            .and_then(|w| w.parse().ok())
            .unwrap_or(u64::MAX);
        let msg = words.collect::<Vec<_>>().join(" ");
        let blamed = oxccl::blamed_rank(&msg);
        if o.status.code() != Some(0) || line("FINAL OK").is_none() {
            wrong.push(format!(
                "survivor {r} ended with {:?}: {lines:?} {tail:?}",
                o.status.code()
            ));
        } else if msg.contains("timed out") || ms > 30_000 || blamed.is_none_or(|b| b == r) {
            // Quiet, milliseconds; at a load of 10 on 2 cores up to 10 s was seen: 30 s is
            // still half the 60 s timeout.
            wrong.push(format!(
                "survivor {r}'s next call did not fail promptly naming another rank: {next}"
            ));
        }
        // The first to fail names a leaver; the others may name a survivor that failed
        // before them and exited.
        named_a_leaver |= blamed.is_some_and(|b| leavers.contains(&b));
    }
    if wrong.is_empty() && !named_a_leaver {
        wrong.push("no survivor's next call named a leaver".into());
    }
    let left = files_of(tag);
    if !left.is_empty() {
        wrong.push(format!("left in /dev/shm: {left:?}"));
    }
    let algo = said[leavers[0]].first().cloned().unwrap_or_default();
    if wrong.is_empty() {
        Ok(format!(
            "{algo}, leavers {}",
            if gone {
                "gone while the others were stopped"
            } else {
                "waited for the others"
            }
        ))
    } else {
        Err(wrong.join("\n"))
    }
}

/// Every path and call, the leavers one rank (rank 0 or the last) or all but one: every
/// survivor completes the call the leavers completed before they left, and its next call
/// fails (the first to fail naming a leaver).
#[test]
fn ranks_that_finish_their_last_call_and_exit_never_fail_the_slower_ranks() {
    let rounds = env_u64("OXCCL_EXIT_ROUNDS", 1);
    let only = std::env::var("OXCCL_EXIT_CASE").unwrap_or_default();
    let modes: &[bool] = if std::env::var("OXCCL_EXIT_FORGET").is_ok_and(|v| v == "0") {
        &[false]
    } else {
        &[false, true]
    };
    let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ u64::from(std::process::id()));
    let (mut runs, mut failures) = (0, Vec::new());
    for round in 0..rounds {
        for path in PATHS {
            for (j, &(coll, bytes)) in CALLS.iter().enumerate() {
                for &forget in modes {
                    let name = format!(
                        "{}: {coll} {bytes} B, {}",
                        path.name,
                        if forget {
                            "exit without drop"
                        } else {
                            "drop and exit"
                        }
                    );
                    if !name.contains(&only) {
                        continue;
                    }
                    let n = path.n;
                    let leavers: Vec<usize> = match (round + j as u64 + forget as u64) % 3 {
                        0 => vec![0],
                        1 => vec![n - 1],
                        _ => {
                            let keep = rng.below(n as u64) as usize;
                            (0..n).filter(|&r| r != keep).collect()
                        }
                    };
                    runs += 1;
                    match run_round(path, coll, bytes, &leavers, forget) {
                        Ok(s) => println!("{name}, leavers {leavers:?}: ok ({s})"),
                        Err(e) => {
                            let line = format!("{name}, leavers {leavers:?}:\n{e}");
                            eprintln!("FAILED {line}");
                            failures.push(line);
                        }
                    }
                }
            }
        }
    }
    println!("{runs} rounds, {} failed", failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// A rank of [`survivors_hear_of_a_killed_rank_after_the_hub_left`]: a barrier
/// (`CHILD READY`); then a leaver (rank below `OXCCL_HUBLESS_LEAVERS`) drops its communicator
/// once it reads a line on stdin (`CHILD LEFT`); the victim (`OXCCL_HUBLESS_VICTIM`) waits to
/// be killed; a rank named in `OXCCL_HUBLESS_WAITS` (`a:b,...`: rank `a` receives from rank
/// `b`) says `CHILD WAITING`, receives, and says `CHILD ERR <error>` when that fails; every
/// survivor then stays (its process alive, so that no one learns of its failure by its exit)
/// until its stdin ends.
#[test]
#[ignore = "a rank of the other tests, run by them"]
fn hubless_child() {
    if std::env::var("OXCCL_HUBLESS_CHILD").is_err() {
        return;
    }
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let leavers: usize = var("OXCCL_HUBLESS_LEAVERS").parse().unwrap_or(1);
    let victim: usize = var("OXCCL_HUBLESS_VICTIM").parse().unwrap_or(usize::MAX);
    let waits: Vec<(usize, usize)> = var("OXCCL_HUBLESS_WAITS")
        .split(',')
        .filter_map(|w| {
            let (a, b) = w.split_once(':')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .collect();
    let run = || -> Result<(), String> {
        let comm = Communicator::from_env().map_err(|e| e.to_string())?;
        let r = comm.rank();
        comm.barrier().map_err(|e| e.to_string())?;
        println!("CHILD READY");
        let mut line = String::new();
        if r < leavers {
            std::io::stdin()
                .read_line(&mut line)
                .map_err(|e| e.to_string())?;
            drop(comm);
            println!("CHILD LEFT");
            return Ok(());
        }
        if r == victim {
            println!("CHILD WAITING");
            std::thread::sleep(Duration::from_secs(60));
            return Err("the victim was not killed".into());
        }
        if let Some(&(_, from)) = waits.iter().find(|(a, _)| *a == r) {
            println!("CHILD WAITING");
            let mut v = [0f32; 2];
            match comm.recv(&mut v, from) {
                Ok(()) => return Err(format!("the receive from rank {from} succeeded")),
                Err(e) => println!("CHILD ERR {e}"),
            }
        }
        while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {}
        Ok(())
    };
    end_child(run());
}

/// After the hub of the watchdog's star (rank 0, then the ranks that took over) dropped its
/// communicator and left, a rank is killed while the others wait on it, directly (its link
/// ends) or through a rank that waits on it: every waiting survivor fails within 3 s naming
/// the killed rank (without the hub's goodbye handing the star over, the survivors' reports
/// would reach no one, and a rank waiting on a live rank that failed would wait out its
/// timeout).
/// Cases: (ranks, leavers 0..L, victim, waits `a` receives from `b`), on shared-memory links
/// and TCP.
#[test]
fn survivors_hear_of_a_killed_rank_after_the_hub_left() {
    // The new hub waits directly; a member through it.
    // Two handovers (0, then 1): the new hub 2 waits through rank 3.
    // The new hub is a bystander: it passes rank 2's report on to rank 4.
    // The new hub is the victim.
    /// (ranks, leavers, victim, (waiter, waited on) pairs)
    type Case = (usize, usize, usize, &'static [(usize, usize)]);
    const CASES: &[Case] = &[
        (4, 1, 2, &[(1, 2), (3, 1)]),
        (5, 2, 4, &[(3, 4), (2, 3)]),
        (5, 1, 3, &[(2, 3), (4, 2)]),
        (4, 1, 1, &[(2, 1), (3, 2)]),
    ];
    let only = std::env::var("OXCCL_EXIT_CASE").unwrap_or_default();
    let mut failures = Vec::new();
    for transport in ["shm", "tcp"] {
        for &(n, leavers, victim, waits) in CASES {
            let name = format!(
                "{transport}: {n} ranks, {leavers} left, rank {victim} killed, waits {waits:?}"
            );
            if !name.contains(&only) {
                continue;
            }
            match hubless_round(transport, n, leavers, victim, waits) {
                Ok(s) => println!("{name}: ok ({s})"),
                Err(e) => {
                    eprintln!("FAILED {name}: {e}");
                    failures.push(format!("{name}: {e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// One round of [`survivors_hear_of_a_killed_rank_after_the_hub_left`].
fn hubless_round(
    transport: &str,
    n: usize,
    leavers: usize,
    victim: usize,
    waits: &[(usize, usize)],
) -> Result<String, String> {
    let (hex, tag) = job_secret();
    let port = free_port();
    let w: Vec<String> = waits.iter().map(|(a, b)| format!("{a}:{b}")).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let mut kids: Vec<Child> = (0..n)
        .map(|r| {
            let mut c = rank_command("hubless_child", r, n, port, &hex);
            c.env("OXCCL_HUBLESS_CHILD", "1")
                .env("OXCCL_HUBLESS_LEAVERS", leavers.to_string())
                .env("OXCCL_HUBLESS_VICTIM", victim.to_string())
                .env("OXCCL_HUBLESS_WAITS", w.join(","))
                .env("OXCCL_TRANSPORT", transport)
                // Both past the bound below (30 s): the loss is heard from the victim's exit,
                // not by the heartbeat nor the timeout, also on a busy machine.
                .env("OXCCL_TIMEOUT", "60")
                .env("OXCCL_HEARTBEAT_TIMEOUT", "40")
                .env("OXCCL_TUNE_FILE", "");
            spawn_child(&mut c, r, tx.clone())
        })
        .collect();
    let kill_all = |kids: &mut Vec<Child>| {
        for k in kids.iter_mut() {
            let _ = k.kill();
            let _ = k.wait();
        }
    };
    let mut said: Vec<Vec<String>> = vec![Vec::new(); n];
    let mut errs: Vec<Option<(String, Instant)>> = vec![None; n];
    // Every rank ready, and the waiting ones in their receive.
    let expect = n + waits.len() + 1;
    let mut got = 0;
    let wait_for = |got: &mut usize,
                    said: &mut Vec<Vec<String>>,
                    errs: &mut Vec<Option<(String, Instant)>>,
                    until: &dyn Fn(&[Vec<String>]) -> bool,
                    within: Duration|
     -> bool {
        let by = Instant::now() + within;
        while !until(said) {
            let left = by.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((r, l, at)) => {
                    *got += 1;
                    if let Some(e) = l.strip_prefix("ERR ") {
                        errs[r] = Some((e.to_string(), at));
                    }
                    said[r].push(l);
                }
                Err(_) => return false,
            }
        }
        true
    };
    let count = |said: &[Vec<String>], p: &str| {
        said.iter()
            .map(|v| v.iter().filter(|l| l.starts_with(p)).count())
            .sum::<usize>()
    };
    if !wait_for(
        &mut got,
        &mut said,
        &mut errs,
        &|s: &[Vec<String>]| count(s, "READY") + count(s, "WAITING") >= expect,
        Duration::from_secs(60),
    ) {
        kill_all(&mut kids);
        return Err(format!("the ranks did not start: {said:?}"));
    }
    // The hubs leave one after another, each once the one before it is gone.
    for l in 0..leavers {
        let mut stdin = kids[l].stdin.take().unwrap();
        let _ = stdin.write_all(b"GO\n");
        let t = Instant::now();
        while kids[l].try_wait().ok().flatten().is_none() {
            if t.elapsed() > Duration::from_secs(5) {
                kill_all(&mut kids);
                return Err(format!("leaver {l} did not exit: {said:?}"));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // The star has its new hub by now; the victim dies while the others wait.
    std::thread::sleep(Duration::from_millis(200));
    let t_kill = Instant::now();
    let _ = kids[victim].kill();
    let waiting: Vec<usize> = waits.iter().map(|(a, _)| *a).collect();
    let done = wait_for(
        &mut got,
        &mut said,
        &mut errs,
        &|s: &[Vec<String>]| count(s, "ERR ") >= waiting.len(),
        Duration::from_secs(45),
    );
    kill_all(&mut kids);
    let left = files_of(tag);
    let mut wrong = Vec::new();
    let mut times = Vec::new();
    for &a in &waiting {
        match &errs[a] {
            None => wrong.push(format!("rank {a} did not fail: {:?}", said[a])),
            Some((e, at)) => {
                if *at < t_kill {
                    wrong.push(format!("rank {a} failed before the kill: {e}"));
                    continue;
                }
                let ms = at.duration_since(t_kill).as_millis();
                times.push(format!("rank {a} {ms} ms"));
                // Quiet, milliseconds; at a load of 10 on 2 cores up to 9 s was seen.
                if ms > 30_000 || oxccl::blamed_rank(e) != Some(victim) {
                    wrong.push(format!(
                        "rank {a} failed {ms} ms after the kill, not within 30 s naming rank {victim}: {e}"
                    ));
                }
            }
        }
    }
    if !done && wrong.is_empty() {
        wrong.push(format!("not every waiting rank failed: {said:?}"));
    }
    if !left.is_empty() {
        wrong.push(format!("left in /dev/shm: {left:?}"));
    }
    if wrong.is_empty() {
        Ok(times.join(", "))
    } else {
        Err(wrong.join("\n"))
    }
}

/// A rank of [`members_leave_promptly_after_the_star_went_to_a_stopped_rank`]: a barrier
/// (`CHILD READY`), then once it reads a line on stdin it leaves, by a drop or (rank
/// `OXCCL_TEARDOWN_CLOSER`) by [`Communicator::close`] (torch's `destroy_process_group`),
/// and says `CHILD GONE <µs>`, how long that took.
#[test]
#[ignore = "a rank of the other tests, run by them"]
fn teardown_child() {
    if std::env::var("OXCCL_TEARDOWN_CHILD").is_err() {
        return;
    }
    let closer: usize = std::env::var("OXCCL_TEARDOWN_CLOSER")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(usize::MAX);
    let run = || -> Result<(), String> {
        let comm = Communicator::from_env().map_err(|e| e.to_string())?;
        comm.barrier().map_err(|e| e.to_string())?;
        println!("CHILD READY");
        let mut line = String::new();
        std::io::stdin()
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        let t = Instant::now();
        if comm.rank() == closer {
            comm.close();
        }
        drop(comm);
        println!("CHILD GONE {}", t.elapsed().as_micros());
        Ok(())
    };
    end_child(run());
}

/// The hub of the watchdog's star (rank 0) leaves while the rank it hands the star to,
/// rank 1, is stopped (SIGSTOP): the other members, whose watchdogs are dialing that rank,
/// then drop (rank 2) or close (rank 3) their communicator: each returns within 400 ms
/// (their watchdog gives up the dial at once), not when the dial's wait for the stopped
/// rank's answer next looks up (every second, and up to the heartbeat timeout).
#[test]
fn members_leave_promptly_after_the_star_went_to_a_stopped_rank() {
    let mut wrong = Vec::new();
    for transport in ["shm", "tcp"] {
        match teardown_round(transport) {
            Ok(s) => println!("{transport}: ok ({s})"),
            Err(e) => {
                eprintln!("FAILED {transport}: {e}");
                wrong.push(format!("{transport}: {e}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
}

/// One round of [`members_leave_promptly_after_the_star_went_to_a_stopped_rank`].
fn teardown_round(transport: &str) -> Result<String, String> {
    let n = 4;
    let (mut kids, rx, tag) = spawn_job(
        "teardown_child",
        n,
        &[
            ("OXCCL_TEARDOWN_CHILD", "1"),
            ("OXCCL_TEARDOWN_CLOSER", "3"),
            ("OXCCL_TRANSPORT", transport),
            ("OXCCL_TIMEOUT", "30"),
            ("OXCCL_HEARTBEAT_TIMEOUT", "10"),
        ],
    );
    let kill_all = |kids: &mut Vec<Child>| {
        let _ = signal(&kids[1], "-CONT");
        for k in kids.iter_mut() {
            let _ = k.kill();
            let _ = k.wait();
        }
    };
    let mut said: Vec<Vec<String>> = vec![Vec::new(); n];
    let take = |said: &mut Vec<Vec<String>>, until: &dyn Fn(&[Vec<String>]) -> bool| {
        let by = Instant::now() + Duration::from_secs(30);
        while !until(said) {
            match rx.recv_timeout(by.saturating_duration_since(Instant::now())) {
                Ok((r, l, _)) => said[r].push(l),
                Err(_) => return false,
            }
        }
        true
    };
    let has = |s: &[Vec<String>], r: usize, p: &str| s[r].iter().any(|l| l.starts_with(p));
    if !take(&mut said, &|s| (0..n).all(|r| has(s, r, "READY"))) {
        kill_all(&mut kids);
        return Err(format!("the ranks did not start: {said:?}"));
    }
    assert!(signal(&kids[1], "-STOP"), "cannot stop rank 1");
    let go = |k: &mut Child| {
        let mut stdin = k.stdin.take().unwrap();
        let _ = stdin.write_all(b"GO\n");
    };
    go(&mut kids[0]);
    let t = Instant::now();
    while kids[0].try_wait().ok().flatten().is_none() && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(2));
    }
    // Ranks 2 and 3 have the handover by now and dial rank 1, which does not answer.
    std::thread::sleep(Duration::from_millis(100));
    go(&mut kids[2]);
    go(&mut kids[3]);
    let gone = take(&mut said, &|s| {
        (2..n).all(|r| has(s, r, "GONE") || has(s, r, "_ERR"))
    });
    kill_all(&mut kids);
    let mut wrong = Vec::new();
    let mut times = Vec::new();
    for r in [0, 2, 3] {
        let us: Option<u64> = said[r]
            .iter()
            .find_map(|l| l.strip_prefix("GONE ")?.parse().ok());
        match us {
            Some(us) => {
                times.push(format!("rank {r} {} ms", us / 1000));
                if us > 400_000 {
                    wrong.push(format!("rank {r} took {} ms to leave", us / 1000));
                }
            }
            None => wrong.push(format!("rank {r} did not leave: {:?}", said[r])),
        }
    }
    if !gone && wrong.is_empty() {
        wrong.push(format!("ranks 2 and 3 did not leave: {said:?}"));
    }
    let left = files_of(tag);
    if !left.is_empty() {
        wrong.push(format!("left in /dev/shm: {left:?}"));
    }
    if wrong.is_empty() {
        Ok(times.join(", "))
    } else {
        Err(format!("{} ({})", wrong.join("\n"), times.join(", ")))
    }
}

/// A rank of [`a_forked_child_that_exits_leaves_its_parents_communicator_alone`]: a
/// barrier; rank 0 forks a child that exits at once through `exit` (so the exit hooks run
/// there, with the parent's communicator in the registry it inherited) and waits for it
/// (`CHILD FORKED <status>`); then every rank makes checked calls, through the direct area
/// (one-shot, single-copy) and over the shared-memory links (ring), and says `CHILD CALLS
/// OK`.
#[test]
#[ignore = "a rank of the other tests, run by them"]
fn fork_child() {
    if std::env::var("OXCCL_FORK_CHILD").is_err() {
        return;
    }
    let run = || -> Result<(), String> {
        let mut comm = Communicator::from_env().map_err(|e| e.to_string())?;
        comm.barrier().map_err(|e| e.to_string())?;
        if comm.rank() == 0 {
            // SAFETY: the child calls only `exit`; the parent waits for it.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: ends the child, running its exit hooks.
                unsafe { libc::exit(0) };
            }
            if pid < 0 {
                return Err(format!("fork: {}", std::io::Error::last_os_error()));
            }
            let mut status = 0;
            // SAFETY: `pid` is this process's child; `status` is a valid int.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            println!("CHILD FORKED {status}");
        }
        comm.barrier().map_err(|e| e.to_string())?;
        for it in 0..3 {
            call(&comm, "all_reduce", 8, 0, it)?;
            call(&comm, "all_reduce", 192 << 10, 0, it)?;
        }
        comm.set_algo(Some("ring".parse().map_err(|e| format!("{e:?}"))?));
        for it in 0..3 {
            call(&comm, "all_reduce", 64 << 10, 0, it)?;
        }
        println!("CHILD CALLS OK");
        Ok(())
    };
    end_child(run());
}

/// A child forked by a rank, which exits normally (its exit hooks run), does not say its
/// parent's goodbye: the registry of live communicators it inherited names the parent's
/// process, and the parent's communicator, its links and direct area work on (a child that
/// closed them would close the parent's shared-memory rings and direct area for every peer).
#[test]
fn a_forked_child_that_exits_leaves_its_parents_communicator_alone() {
    let n = 3;
    let (kids, rx, tag) = spawn_job(
        "fork_child",
        n,
        &[
            ("OXCCL_FORK_CHILD", "1"),
            ("OXCCL_TRANSPORT", "shm"),
            ("OXCCL_TIMEOUT", "15"),
        ],
    );
    let by = Instant::now() + Duration::from_secs(40);
    let outs: Vec<_> = kids
        .into_iter()
        .map(|k| output_by(k, by, Duration::from_millis(5)))
        .collect();
    let mut said: Vec<Vec<String>> = vec![Vec::new(); n];
    let mut ended = 0;
    while ended < n {
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok((r, l, _)) => {
                ended += (l == "EOF") as usize;
                said[r].push(l);
            }
            Err(_) => break,
        }
    }
    let mut wrong = Vec::new();
    for (r, o) in outs.iter().enumerate() {
        if o.status.code() != Some(0) || !said[r].iter().any(|l| l == "CALLS OK") {
            let err = String::from_utf8_lossy(&o.stderr);
            let tail: Vec<&str> = err.lines().rev().take(3).collect();
            wrong.push(format!(
                "rank {r} ended with {:?}: {:?} {tail:?}",
                o.status.code(),
                said[r]
            ));
        }
    }
    let left = files_of(tag);
    if !left.is_empty() {
        wrong.push(format!("left in /dev/shm: {left:?}"));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// What a forked child gets from one call on its parent's communicator: `Ok(())` when the
/// call was refused as it must be (an error naming the fork), else what happened.
fn refused<T>(what: &str, r: oxccl::Result<T>) -> Result<(), String> {
    match r {
        Err(e) if e.to_string().contains("forked child") => Ok(()),
        Err(e) => Err(format!(
            "{what} failed, but not as a forked child's call: {e}"
        )),
        Ok(_) => Err(format!("{what} ran in the forked child")),
    }
}

/// The calls a child forked from rank 0 makes on the communicator it inherited: each must be
/// refused before anything moves; then it drops the communicator and exits through `exit`
/// (its exit hooks run). Says `CHILD INHERITED REFUSED` or `CHILD INHERITED RAN <what>`.
fn forked_child_calls(comm: Communicator) -> ! {
    let comm = std::sync::Arc::new(comm);
    let calls = || -> Result<(), String> {
        let mut v = vec![1f32; 131_072];
        refused(
            "all_reduce",
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum),
        )?;
        refused("broadcast", comm.broadcast_in_place(&mut v, 0))?;
        refused("send", comm.send(&v[..1024], 1))?;
        refused("recv", comm.recv(&mut v[..1024], 1))?;
        refused("barrier", comm.barrier())?;
        refused("split", comm.split(Some(0), 0))?;
        refused(
            "all_reduce_async",
            comm.all_reduce_async(vec![1f32; 64], ReduceOp::Sum).wait(),
        )?;
        refused("check", comm.check())?;
        comm.synchronize();
        comm.abort();
        comm.close();
        Ok(())
    };
    match calls() {
        Ok(()) => println!("CHILD INHERITED REFUSED"),
        Err(e) => println!("CHILD INHERITED RAN {e}"),
    }
    drop(comm);
    // SAFETY: ends the child, running its exit hooks.
    unsafe { libc::exit(0) }
}

/// A rank of [`a_forked_child_cannot_use_its_parents_communicator`]: a barrier; rank 0 forks
/// a child that calls on the communicator it inherited ([`forked_child_calls`]) and waits
/// for it (`CHILD FORKED <status>`) while the other ranks go on at once to the checked calls
/// every rank then makes (those a child's call would pair with), and says `CHILD CALLS OK`.
#[test]
#[ignore = "a rank of the other tests, run by them"]
fn inherited_child() {
    if std::env::var("OXCCL_INHERITED_CHILD").is_err() {
        return;
    }
    let run = || -> Result<(), String> {
        let comm = Communicator::from_env().map_err(|e| e.to_string())?;
        comm.barrier().map_err(|e| e.to_string())?;
        if comm.rank() == 0 {
            // SAFETY: the child makes calls that must be refused, then exits; the parent
            // waits for it.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                forked_child_calls(comm);
            }
            if pid < 0 {
                return Err(format!("fork: {}", std::io::Error::last_os_error()));
            }
            let mut status = 0;
            // SAFETY: `pid` is this process's child; `status` is a valid int.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            println!("CHILD FORKED {status}");
        }
        for it in 0..3 {
            call(&comm, "all_reduce", 512 << 10, 0, it)?;
            call(&comm, "broadcast", 64 << 10, 0, it)?;
            call(&comm, "all_reduce", 8, 0, it)?;
        }
        let (r, n) = (comm.rank(), comm.world_size());
        let mut v = vec![r as f32; 1024];
        if r == 0 {
            comm.send(&v, 1).map_err(|e| e.to_string())?;
        } else if r == 1 {
            comm.recv(&mut v, 0).map_err(|e| e.to_string())?;
            if v.iter().any(|&x| x != 0.0) {
                return Err("WRONG recv from rank 0".into());
            }
        }
        let sub = comm
            .split(Some((r % 2) as u32), 0)
            .map_err(|e| e.to_string())?
            .ok_or("split gave no communicator")?;
        let mut w = vec![1f32; 16];
        sub.all_reduce_in_place(&mut w, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        let want = (0..n).filter(|q| q % 2 == r % 2).count() as f32;
        if w.iter().any(|&x| x != want) {
            return Err(format!(
                "WRONG split all_reduce: {} instead of {want}",
                w[0]
            ));
        }
        comm.barrier().map_err(|e| e.to_string())?;
        println!("CHILD CALLS OK");
        Ok(())
    };
    end_child(run());
}

/// A child forked from a rank that calls on the communicator it inherited is refused before
/// anything moves, with an error naming the fork, and its peers never see its traffic: over
/// shared memory and over TCP, the parent and its peers then make checked calls (the ones a
/// call of the child would have paired with) and get the right results; the child's drop
/// and exit leave the parent's links, rings and files alone.
#[test]
fn a_forked_child_cannot_use_its_parents_communicator() {
    let mut wrong = Vec::new();
    for transport in ["shm", "tcp"] {
        let n = 3;
        let (kids, rx, tag) = spawn_job(
            "inherited_child",
            n,
            &[
                ("OXCCL_INHERITED_CHILD", "1"),
                ("OXCCL_TRANSPORT", transport),
                ("OXCCL_TIMEOUT", "15"),
            ],
        );
        let by = Instant::now() + Duration::from_secs(60);
        let outs: Vec<_> = kids
            .into_iter()
            .map(|k| output_by(k, by, Duration::from_millis(5)))
            .collect();
        let mut said: Vec<Vec<String>> = vec![Vec::new(); n];
        let mut ended = 0;
        while ended < n {
            match rx.recv_timeout(Duration::from_secs(5)) {
                Ok((r, l, _)) => {
                    ended += (l == "EOF") as usize;
                    said[r].push(l);
                }
                Err(_) => break,
            }
        }
        for (r, o) in outs.iter().enumerate() {
            if o.status.code() != Some(0) || !said[r].iter().any(|l| l == "CALLS OK") {
                let err = String::from_utf8_lossy(&o.stderr);
                let tail: Vec<&str> = err.lines().rev().take(3).collect();
                wrong.push(format!(
                    "{transport}: rank {r} ended with {:?}: {:?} {tail:?}",
                    o.status.code(),
                    said[r]
                ));
            }
        }
        if !said[0].iter().any(|l| l == "INHERITED REFUSED") {
            wrong.push(format!(
                "{transport}: the forked child was not refused: {:?}",
                said[0]
            ));
        }
        let left = files_of(tag);
        if !left.is_empty() {
            wrong.push(format!("{transport}: left in /dev/shm: {left:?}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Where rank 0 of [`fork_snapshot_child`] says that it forks: the path of a file its
/// `prepare` handler creates (empty: none).
static FORKING_FLAG: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

/// Runs first in `fork` (installed last): creates the file named by [`FORKING_FLAG`].
extern "C" fn say_forking() {
    if let Ok(p) = FORKING_FLAG.try_lock() {
        if !p.is_empty() {
            let _ = std::fs::File::create(&*p);
        }
    }
}

/// A rank of [`a_forked_child_sees_pool_memory_as_at_fork`]: rank 0 holds
/// `OXCCL_SNAP_LIVE_MIB` of live pool memory (1.0; rank 1 4 MiB) and a 4 MiB pool block `t`
/// (0.0), allocated first (so copied last: the fork copies by address, and later blocks lie
/// lower). Rank 0 starts a broadcast into `t` from rank 1 on a thread (the call waits for rank
/// 1), then forks; its `prepare` handler tells rank 1 (a file), which broadcasts 7.0 30 ms
/// later, while the fork copies the pool. The child waits until the parent's call is done,
/// then checks that it sees `t` and the live memory as they were at the fork (`CHILD SNAP
/// <exit status>`: 0 ok, 3 saw the broadcast's 7.0, 4 wrong live memory); the parent's `t`
/// must hold 7.0. Then a checked all-reduce on the pool memory (`CHILD CALLS OK`).
#[test]
#[ignore = "a rank of the other tests, run by them"]
fn fork_snapshot_child() {
    let Ok(flag) = std::env::var("OXCCL_SNAP_CHILD") else {
        return;
    };
    let live_mib: usize = std::env::var("OXCCL_SNAP_LIVE_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let run = || -> Result<(), String> {
        let comm = std::sync::Arc::new(Communicator::from_env().map_err(|e| e.to_string())?);
        let pool = oxccl::SharedPool::global();
        let f32s = |p: std::ptr::NonNull<u8>, bytes: usize| {
            // SAFETY: a pool block of at least `bytes` bytes, alive until the process ends.
            unsafe { std::slice::from_raw_parts_mut(p.as_ptr().cast::<f32>(), bytes / 4) }
        };
        let t_bytes = 4 << 20;
        let t = f32s(pool.alloc(t_bytes).map_err(|e| e.to_string())?, t_bytes);
        let big_bytes = if comm.rank() == 0 {
            live_mib << 20
        } else {
            4 << 20
        };
        let big = f32s(pool.alloc(big_bytes).map_err(|e| e.to_string())?, big_bytes);
        big.fill(1.0);
        let r = comm.rank();
        t.fill(if r == 1 { 7.0 } else { 0.0 });
        comm.barrier().map_err(|e| e.to_string())?;
        if r == 1 {
            while !std::path::Path::new(&flag).exists() {
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(30));
            comm.broadcast_in_place(t, 1).map_err(|e| e.to_string())?;
        } else {
            let addr = t.as_mut_ptr() as usize;
            let c = comm.clone();
            let call = std::thread::spawn(move || {
                // SAFETY: the main thread does not touch `t` until this thread is joined.
                let t = unsafe { std::slice::from_raw_parts_mut(addr as *mut f32, t_bytes / 4) };
                c.broadcast_in_place(t, 1).map_err(|e| e.to_string())
            });
            std::thread::sleep(Duration::from_millis(100)); // the call waits for rank 1
            *FORKING_FLAG.lock().unwrap() = flag.clone();
            // SAFETY: a handler that only creates a file; installed once.
            unsafe { libc::pthread_atfork(Some(say_forking), None, None) };
            // SAFETY: the child only reads memory, sleeps and exits.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                std::thread::sleep(Duration::from_millis(1000));
                let code = if t.iter().any(|&x| x != 0.0) {
                    3
                } else if big.iter().step_by(1021).any(|&x| x != 1.0) {
                    4
                } else {
                    0
                };
                // SAFETY: ends the child without running the parent's exit hooks.
                unsafe { libc::_exit(code) };
            }
            if pid < 0 {
                return Err(format!("fork: {}", std::io::Error::last_os_error()));
            }
            call.join().map_err(|_| "the broadcast panicked")??;
            let mut status = 0;
            // SAFETY: `pid` is this process's child; `status` is a valid int.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            println!("CHILD SNAP {}", libc::WEXITSTATUS(status));
            if t.iter().any(|&x| x != 7.0) {
                return Err("WRONG the parent's broadcast result".into());
            }
        }
        comm.all_reduce_in_place(&mut big[..1 << 20], ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        if big[..1 << 20].iter().any(|&x| x != 2.0) {
            return Err("WRONG all_reduce after the fork".into());
        }
        println!("CHILD CALLS OK");
        Ok(())
    };
    end_child(run());
}

/// A child forked while a rank's broadcast into a pool block is in flight, whose peer sends
/// while the fork copies the pool, sees the block as it was at the fork (0.0), never the
/// peer's later write (7.0), nor any change to the live pool memory; the parent gets the
/// broadcast. (Copied in the child after the fork, the block held 7.0.)
#[test]
fn a_forked_child_sees_pool_memory_as_at_fork() {
    let n = 2;
    let dir = std::env::temp_dir().join(format!("oxccl-snap-{}", std::process::id()));
    let _ = std::fs::remove_file(&dir);
    let flag = dir.to_string_lossy().into_owned();
    let live = std::env::var("OXCCL_SNAP_LIVE_MIB").unwrap_or_else(|_| "256".into());
    let (kids, rx, tag) = spawn_job(
        "fork_snapshot_child",
        n,
        &[
            ("OXCCL_SNAP_CHILD", flag.as_str()),
            ("OXCCL_SNAP_LIVE_MIB", live.as_str()),
            ("OXCCL_TRANSPORT", "shm"),
            ("OXCCL_TIMEOUT", "30"),
        ],
    );
    let by = Instant::now() + Duration::from_secs(90);
    let outs: Vec<_> = kids
        .into_iter()
        .map(|k| output_by(k, by, Duration::from_millis(5)))
        .collect();
    let _ = std::fs::remove_file(&dir);
    let mut said: Vec<Vec<String>> = vec![Vec::new(); n];
    let mut ended = 0;
    while ended < n {
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok((r, l, _)) => {
                ended += (l == "EOF") as usize;
                said[r].push(l);
            }
            Err(_) => break,
        }
    }
    let mut wrong = Vec::new();
    for (r, o) in outs.iter().enumerate() {
        if o.status.code() != Some(0) || !said[r].iter().any(|l| l == "CALLS OK") {
            let err = String::from_utf8_lossy(&o.stderr);
            let tail: Vec<&str> = err.lines().rev().take(3).collect();
            wrong.push(format!(
                "rank {r} ended with {:?}: {:?} {tail:?}",
                o.status.code(),
                said[r]
            ));
        }
    }
    if !said[0].iter().any(|l| l == "SNAP 0") {
        wrong.push(format!(
            "the child did not see the pool as at the fork (3: saw the later broadcast, 4: \
             wrong live memory): {:?}",
            said[0]
        ));
    }
    if !files_of(tag).is_empty() {
        wrong.push(format!("left in /dev/shm: {:?}", files_of(tag)));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A rank of [`a_rank_that_exits_inside_a_call_is_lost_not_gone`]: a barrier; rank 2 says
/// `CHILD WAITING` and receives from rank 1 (which never sends: it waits for its stdin to
/// end), saying `CHILD ERR <error>` when that fails; rank 0, once it reads a line on stdin,
/// receives from rank 1 on another thread and, 200 ms into that call, exits
/// (`std::process::exit`) with the call running.
#[test]
#[ignore = "a rank of the other tests, run by them"]
fn inflight_child() {
    if std::env::var("OXCCL_INFLIGHT_CHILD").is_err() {
        return;
    }
    let run = || -> Result<(), String> {
        let comm = std::sync::Arc::new(Communicator::from_env().map_err(|e| e.to_string())?);
        comm.barrier().map_err(|e| e.to_string())?;
        println!("CHILD READY");
        let mut line = String::new();
        match comm.rank() {
            0 => {
                std::io::stdin()
                    .read_line(&mut line)
                    .map_err(|e| e.to_string())?;
                let c = comm.clone();
                std::thread::spawn(move || {
                    let mut v = [0f32; 2];
                    let _ = c.recv(&mut v, 1);
                });
                std::thread::sleep(Duration::from_millis(200));
                std::process::exit(0);
            }
            2 => {
                println!("CHILD WAITING");
                let mut v = [0f32; 2];
                match comm.recv(&mut v, 1) {
                    Ok(()) => return Err("the receive from rank 1 succeeded".into()),
                    Err(e) => println!("CHILD ERR {e}"),
                }
            }
            _ => {}
        }
        while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {}
        Ok(())
    };
    end_child(run());
}

/// A rank that exits while one of its calls runs (on another thread) did not finish its
/// part: the exit hook leaves its communicator alone (no goodbye), so it is lost as a
/// killed rank is, and a survivor waiting on a third, live rank fails within 3 s naming it
/// (after a goodbye that survivor would wait for the live rank until its timeout).
#[test]
fn a_rank_that_exits_inside_a_call_is_lost_not_gone() {
    let n = 3;
    let (mut kids, rx, tag) = spawn_job(
        "inflight_child",
        n,
        &[
            ("OXCCL_INFLIGHT_CHILD", "1"),
            ("OXCCL_TRANSPORT", "shm"),
            // Both past the bound below (30 s): the loss is heard from rank 0's exit, also
            // on a busy machine.
            ("OXCCL_TIMEOUT", "60"),
            ("OXCCL_HEARTBEAT_TIMEOUT", "40"),
        ],
    );
    let mut said: Vec<Vec<String>> = vec![Vec::new(); n];
    let mut err: Option<(String, Instant)> = None;
    let mut t_go = None;
    let by = Instant::now() + Duration::from_secs(75);
    while err.is_none() {
        let Ok((r, l, at)) = rx.recv_timeout(by.saturating_duration_since(Instant::now())) else {
            break;
        };
        if let Some(e) = l.strip_prefix("ERR ") {
            err = Some((e.to_string(), at));
        }
        said[r].push(l);
        let ready = said.iter().all(|s| s.iter().any(|l| l == "READY"));
        if t_go.is_none() && ready && said[2].iter().any(|l| l == "WAITING") {
            let mut stdin = kids[0].stdin.take().unwrap();
            let _ = stdin.write_all(b"GO\n");
            t_go = Some(Instant::now());
        }
    }
    for k in kids.iter_mut() {
        let _ = k.kill();
        let _ = k.wait();
    }
    let left = files_of(tag);
    assert!(left.is_empty(), "left in /dev/shm: {left:?}");
    let (Some((e, at)), Some(go)) = (err, t_go) else {
        panic!("rank 2 did not fail: {said:?}");
    };
    let ms = at.duration_since(go).as_millis();
    assert!(
        // Quiet, milliseconds; at a load of 15 on 2 cores 3.4 s was seen.
        ms < 30_000 && oxccl::blamed_rank(&e) == Some(0),
        "rank 2 failed {ms} ms after rank 0 was told to exit, not within 30 s naming rank 0: {e}"
    );
    println!("rank 2 failed {ms} ms after the go: {e}");
}
