//! Ranks SIGKILLed or SIGSTOPped in the middle of collectives, with real processes: one rank
//! of a job that loops checked all-reduces is killed (or stopped) while the others are in
//! their calls; every survivor must fail with an error naming it, well within the timeout,
//! never a wrong result or a hang, and the job must leave nothing in /dev/shm. A stopped rank
//! that is continued after the survivors have gone must fail too, not hang. One case per
//! path a call takes: one-shot (8 B, 16 KiB), the ring over shared-memory links (also after
//! the direct event that finds private buffers, `OXCCL_MAPPED_MIN`), single-copy (CMA),
//! hierarchical (two emulated hosts: TCP between them, shared memory inside), TCP eager and
//! lazy; and one where the ranks loop `split`, a call on the new communicator and its drop,
//! so that the kill lands in set-up, calls and destroy.
//!
//! (Kills during the start-up are `startup.rs`'s, a rank killed while the others are idle
//! too; a rank killed before its lazy TCP links are made is `tcp_lazy.rs`'s.)
//!
//! `OXCCL_KILL_SWEEP=N` runs every case N times with a random victim and delay (a long
//! sweep: `scripts/kill_loop.sh`); by default each case runs once, 5 times in the stress tier
//! (`OXCCL_STRESS=1`). Every failure names the seed, the case, the victim and each rank's end. `OXCCL_KILL_CASE=TEXT`
//! runs only the cases whose name contains TEXT; `OXCCL_KILL_SIGNAL=STOP` or `KILL`,
//! `OXCCL_KILL_VICTIM` and `OXCCL_KILL_DELAY_MS` (start-up: the longest delay) fix what the
//! sweep draws.
//!
//! The ranks are this test binary, re-executed to run the ignored test `kill_child` with
//! `OXCCL_KILL_CHILD` set.

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use oxccl::{Communicator, ReduceOp};

mod proc_common;
use proc_common::{
    child_ends, env_u64, files_of, free_port, job_secret, output_by, rank_command, signal,
    spawn_reading, stress, Rng,
};

/// How long a child loops its calls at most.
const CHILD_LOOP: Duration = Duration::from_secs(60);

/// A rank: init, a barrier, then checked all-reduces of `OXCCL_KILL_BYTES` bytes of f32
/// (`OXCCL_KILL_CHILD=call`), or `split` + one all-reduce on the new communicator + its drop
/// (`=split`), in a loop; `CHILD READY <algo>` once the first call is done. On an error it
/// prints `CHILD_ERR <error>` and exits with 1; on a wrong result `CHILD_WRONG ...`, exit 2.
#[test]
#[ignore = "a rank of the other tests, run by them"]
fn kill_child() {
    let Ok(mode) = std::env::var("OXCCL_KILL_CHILD") else {
        return;
    };
    let bytes: usize = std::env::var("OXCCL_KILL_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4096);
    let run = || -> oxccl::Result<()> {
        let comm = Communicator::from_env()?;
        let (r, n) = (comm.rank(), comm.world_size());
        comm.barrier()?;
        let mut v = vec![0f32; (bytes / 4).max(1)];
        let call = |c: &Communicator, v: &mut [f32], it: usize| -> oxccl::Result<()> {
            for (i, x) in v.iter_mut().enumerate() {
                *x = (r + 1) as f32 + ((i + it) % 7) as f32;
            }
            c.all_reduce_in_place(v, ReduceOp::Sum)?;
            let base = (n * (n + 1) / 2) as f32;
            if let Some((i, x)) = v
                .iter()
                .enumerate()
                .find(|(i, x)| **x != base + (n * ((i + it) % 7)) as f32)
            {
                println!("CHILD_WRONG iteration {it} element {i}: {x}");
                std::process::exit(2);
            }
            Ok(())
        };
        call(&comm, &mut v, 0)?;
        println!("CHILD READY {}", comm.last_algo());
        let start = Instant::now();
        let mut it = 1;
        while start.elapsed() < CHILD_LOOP {
            if mode == "split" {
                let sub = comm
                    .split(Some(0), r as i64)?
                    .expect("every rank passes color 0");
                call(&sub, &mut v, it)?;
                drop(sub);
            } else {
                call(&comm, &mut v, it)?;
            }
            it += 1;
        }
        Ok(())
    };
    child_ends(run());
}

/// One case: `n` ranks running `mode` (`call` or `split`) with `bytes` per call and `env`.
struct Case {
    name: &'static str,
    n: usize,
    mode: &'static str,
    bytes: usize,
    /// The algorithm the first call must have run (the case tests that path).
    algo: &'static str,
    env: &'static [(&'static str, &'static str)],
}

const CASES: &[Case] = &[
    Case {
        name: "one-shot 8 B",
        n: 3,
        mode: "call",
        bytes: 8,
        algo: "oneshot",
        env: &[("OXCCL_TRANSPORT", "shm")],
    },
    Case {
        name: "one-shot 16 KiB",
        n: 3,
        mode: "call",
        bytes: 16 << 10,
        algo: "oneshot",
        env: &[("OXCCL_TRANSPORT", "shm")],
    },
    Case {
        name: "ring over shared memory 1 MiB",
        n: 3,
        mode: "call",
        bytes: 1 << 20,
        algo: "ring",
        env: &[("OXCCL_TRANSPORT", "shm"), ("OXCCL_ALGO", "ring")],
    },
    Case {
        // Private buffers below a tune-sized `cma_min`: the direct event that finds out
        // whether every rank's buffers are shared (`OXCCL_MAPPED_MIN`), then the ring.
        name: "shared-buffer check, then the ring 256 KiB",
        n: 3,
        mode: "call",
        bytes: 256 << 10,
        algo: "ring",
        env: &[("OXCCL_TRANSPORT", "shm"), ("OXCCL_CMA_MIN", "2M")],
    },
    Case {
        name: "single-copy 4 MiB",
        n: 3,
        mode: "call",
        bytes: 4 << 20,
        algo: "cma",
        env: &[("OXCCL_TRANSPORT", "shm")],
    },
    Case {
        name: "hierarchical, 2 emulated hosts, 256 KiB",
        n: 4,
        mode: "call",
        bytes: 256 << 10,
        algo: "hier",
        env: &[("OXCCL_ALGO", "hier")],
    },
    Case {
        name: "TCP eager 1 MiB",
        n: 3,
        mode: "call",
        bytes: 1 << 20,
        algo: "ring",
        env: &[
            ("OXCCL_TRANSPORT", "tcp"),
            ("OXCCL_TCP_CONNECT", "eager"),
            ("OXCCL_ALGO", "ring"),
        ],
    },
    Case {
        name: "TCP lazy 64 KiB",
        n: 4,
        mode: "call",
        bytes: 64 << 10,
        algo: "ring",
        env: &[
            ("OXCCL_TRANSPORT", "tcp"),
            ("OXCCL_TCP_CONNECT", "lazy"),
            ("OXCCL_ALGO", "ring"),
        ],
    },
    Case {
        name: "split, call, destroy",
        n: 3,
        mode: "split",
        bytes: 4096,
        algo: "oneshot",
        env: &[("OXCCL_TRANSPORT", "shm")],
    },
];

/// A seed that differs from run to run (and is never 0, which xorshift keeps).
fn seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    (t ^ (std::process::id() as u64) << 32).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
}

/// What a rank's end said: (exit code, `CHILD_ERR` line or other last stderr line, stdout).
fn ended(k: Child, by: Instant) -> (Option<i32>, String, String) {
    let o = output_by(k, by, Duration::from_millis(5));
    let err = String::from_utf8_lossy(&o.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("CHILD_ERR "))
        .or_else(|| err.lines().last())
        .unwrap_or("")
        .to_string();
    (
        o.status.code(),
        line,
        String::from_utf8_lossy(&o.stdout).into_owned(),
    )
}

/// Runs `case` once: rank `victim` gets SIGKILL (or SIGSTOP, then SIGCONT once the survivors
/// have ended) `delay` after every rank's first call (with `in_start_up`, `delay` after the
/// ranks were started: during their start-up); returns what went wrong, if anything.
fn run_case(
    case: &Case,
    victim: usize,
    delay: Duration,
    stop: bool,
    in_start_up: bool,
) -> Result<String, String> {
    let (hex, tag) = job_secret();
    let port = free_port();
    // Start-up waits are bounded by the timeout alone (no heartbeats yet): a short one. A
    // call's far past the bound below (quiet, a survivor fails within the heartbeat timeout,
    // 1 s; at a load of 30 on 2 cores, 11 s was seen).
    let timeout = if in_start_up { 4 } else { 60 };
    let (tx, rx) = std::sync::mpsc::channel();
    let mut kids: Vec<Option<Child>> = (0..case.n)
        .map(|r| {
            let mut c = rank_command("kill_child", r, case.n, port, &hex);
            c.env("OXCCL_KILL_CHILD", case.mode)
                .env("OXCCL_KILL_BYTES", case.bytes.to_string())
                .env("OXCCL_SHM_RING_BYTES", "1M")
                .env("OXCCL_TIMEOUT", timeout.to_string())
                .env("OXCCL_HEARTBEAT_TIMEOUT", "1")
                .env("OXCCL_TUNE_FILE", "")
                // Two emulated hosts for the hierarchical case, one host for the others.
                .env(
                    "OXCCL_HOSTID",
                    if case.algo == "hier" {
                        format!("kills-host-{}", r / 2)
                    } else {
                        "kills-host".to_string()
                    },
                )
                .envs(case.env.iter().copied())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let tx = tx.clone();
            let mut rest = String::new();
            Some(spawn_reading(&mut c, move |line| match line {
                Some(line) => {
                    if let Some(algo) = line.strip_prefix("CHILD READY ") {
                        let _ = tx.send(Ok((r, algo.to_string())));
                    } else {
                        rest.push_str(&line);
                        rest.push('\n');
                    }
                }
                None => {
                    let _ = tx.send(Err((r, std::mem::take(&mut rest))));
                }
            }))
        })
        .collect();
    let kill_all = |kids: &mut Vec<Option<Child>>| {
        for k in kids.iter_mut().flatten() {
            let _ = k.kill();
            let _ = k.wait();
        }
    };
    let mut ready = 0;
    while ready < case.n && !in_start_up {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Ok((r, algo))) => {
                if algo != case.algo {
                    kill_all(&mut kids);
                    return Err(format!(
                        "rank {r}'s first call ran {algo}, not {}",
                        case.algo
                    ));
                }
                ready += 1;
            }
            Ok(Err((r, out))) => {
                kill_all(&mut kids);
                return Err(format!("rank {r} ended before its first call: {out}"));
            }
            Err(_) => {
                kill_all(&mut kids);
                return Err(format!(
                    "only {ready} of {} ranks made a first call in 60 s",
                    case.n
                ));
            }
        }
    }
    std::thread::sleep(delay);
    let mut v = kids[victim].take().unwrap();
    let hit = if stop {
        signal(&v, "-STOP")
    } else {
        v.kill().is_ok()
    };
    let at = Instant::now();
    let by = at + Duration::from_secs(timeout + 60);
    // A start-up wait ends by the timeout; a call's by the heartbeats, the links or the timeout.
    // Ten times that (a busy machine reported a start-up's after 8.4 s).
    let bound = Duration::from_secs(if in_start_up { 10 * timeout } else { 30 });
    let ends: Vec<(usize, Option<i32>, String, String, Duration)> = kids
        .into_iter()
        .enumerate()
        .filter_map(|(r, k)| {
            let (code, line, out) = ended(k?, by);
            Some((r, code, line, out, at.elapsed()))
        })
        .collect();
    // A stopped victim is continued once every survivor has ended: it must fail too.
    let victim_end = if stop {
        signal(&v, "-CONT");
        Some(ended(v, Instant::now() + Duration::from_secs(timeout + 20)))
    } else {
        let _ = v.wait();
        None
    };
    if !hit {
        return Err(format!("cannot signal rank {victim}"));
    }
    let mut wrong = Vec::new();
    for (r, code, line, out, took) in &ends {
        if *code != Some(1) || oxccl::blamed_rank(line) != Some(victim) {
            wrong.push(format!(
                "rank {r} ended with {code:?} after {took:?}: {line} {out}"
            ));
        } else if *took > bound {
            wrong.push(format!("rank {r} failed only after {took:?}: {line}"));
        }
    }
    if let Some((code, line, out)) = &victim_end {
        if *code != Some(1) {
            wrong.push(format!(
                "the stopped rank {victim}, continued, ended with {code:?}: {line} {out}"
            ));
        }
    }
    let left = files_of(tag);
    if !left.is_empty() {
        wrong.push(format!("left in /dev/shm: {left:?}"));
    }
    if wrong.is_empty() {
        let (_, _, said, _, last) = ends.last().unwrap();
        Ok(format!("the last survivor failed {last:?} after: {said}"))
    } else {
        Err(wrong.join("\n"))
    }
}

/// Every case once (or `OXCCL_KILL_SWEEP` times): a rank SIGKILLed, or SIGSTOPped and
/// continued later, 0-50 ms into the loop of calls; cases alternate the signal, the victim
/// turns (rank 0, the rendezvous and the watchdog's hub, included).
#[test]
fn a_rank_killed_or_stopped_mid_call_fails_every_survivor_naming_it() {
    let sweep = env_u64("OXCCL_KILL_SWEEP", if stress() { 5 } else { 1 });
    let only = std::env::var("OXCCL_KILL_CASE").unwrap_or_default();
    let seed = seed();
    println!("seed {seed:#x}");
    let mut rng = Rng(seed);
    let mut failures = Vec::new();
    let mut runs = 0;
    for round in 0..sweep {
        for (i, case) in CASES.iter().enumerate() {
            if !case.name.contains(&only) {
                continue;
            }
            let (victim, stop) = if round == 0 {
                ((i + 1) % case.n, i % 2 == 1)
            } else {
                (
                    rng.below(case.n as u64) as usize,
                    std::env::var("OXCCL_KILL_SIGNAL").map_or(rng.below(2) == 1, |s| s == "STOP"),
                )
            };
            let delay = Duration::from_millis(rng.below(50));
            let what = if stop { "stopped" } else { "killed" };
            runs += 1;
            match run_case(case, victim, delay, stop, false) {
                Ok(said) => println!(
                    "{}: rank {victim} {what} after {delay:?}: {said}",
                    case.name
                ),
                Err(e) => {
                    let line = format!(
                        "{} (round {round}, seed {seed:#x}): rank {victim} {what} after {delay:?}:\n{e}",
                        case.name
                    );
                    eprintln!("FAILED {line}");
                    failures.push(line);
                }
            }
        }
    }
    println!("{runs} runs, {} failed", failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// A rank SIGSTOPped (or SIGKILLed) 0-120 ms after the ranks were started, during the
/// rendezvous, the exchanges or the links' set-up (or, when late, its first calls): every
/// survivor must fail within the timeout naming it (no heartbeats yet: a start-up wait is
/// bounded by the timeout alone), and a stopped rank, continued, must fail too.
/// `OXCCL_KILL_SWEEP` multiplies the rounds (default 6: every victim of 3 twice).
#[test]
fn a_rank_stopped_or_killed_during_start_up_fails_every_survivor_naming_it() {
    let sweep = env_u64("OXCCL_KILL_SWEEP", if stress() { 5 } else { 1 });
    let seed = seed();
    println!("seed {seed:#x}");
    let mut rng = Rng(seed);
    let cases = [&CASES[0], &CASES[5]];
    let mut failures = Vec::new();
    for round in 0..6 * sweep {
        let case = cases[round as usize % 2];
        let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
        let victim = var("OXCCL_KILL_VICTIM").unwrap_or(round % 3) as usize;
        let stop = std::env::var("OXCCL_KILL_SIGNAL").map_or(round % 4 != 3, |s| s == "STOP");
        // A start-up takes 30-150 ms here: most signals land in it.
        let delay = Duration::from_millis(rng.below(var("OXCCL_KILL_DELAY_MS").unwrap_or(120)));
        let what = if stop { "stopped" } else { "killed" };
        match run_case(case, victim, delay, stop, true) {
            Ok(said) => println!(
                "{} start-up: rank {victim} {what} after {delay:?}: {said}",
                case.name
            ),
            Err(e) => {
                let line = format!(
                    "{} start-up (round {round}, seed {seed:#x}): rank {victim} {what} after {delay:?}:\n{e}",
                    case.name
                );
                eprintln!("FAILED {line}");
                failures.push(line);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
