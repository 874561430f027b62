//! Start-up under attack, with real processes: ranks SIGKILLed at every moment of their
//! start-up leave nothing in /dev/shm.
//!
//! The ranks are this test binary, re-executed to run the ignored test `startup_child` with
//! `OXCCL_STARTUP_CHILD` set.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use oxccl::Communicator;

mod proc_common;
use proc_common::{child_ends, files_of, free_port, output_by, rank_command, spawn_reading, Rng};

#[test]
#[ignore = "a rank of the other tests, run by them"]
fn startup_child() {
    if std::env::var("OXCCL_STARTUP_CHILD").is_err() {
        return;
    }
    let comm = Communicator::from_env().unwrap();
    comm.barrier().unwrap();
    let mut v = vec![1.0f32; 1024];
    comm.all_reduce_in_place(&mut v, oxccl::ReduceOp::Sum)
        .unwrap();
    assert_eq!(v[0], comm.world_size() as f32);
    println!("CHILD {} OK", comm.rank());
}

fn spawn_ranks(n: usize, secret: &str, port: u16) -> Vec<Child> {
    (0..n)
        .map(|r| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "startup_child", "--ignored", "--nocapture"])
                .env("OXCCL_STARTUP_CHILD", "1")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("OXCCL_SECRET", secret)
                .env("OXCCL_TRANSPORT", "shm")
                .env("OXCCL_SHM_RING_BYTES", "16M")
                .env("OXCCL_TIMEOUT", "20")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect()
}

#[test]
fn ranks_killed_at_any_moment_of_start_up_leave_nothing_in_dev_shm() {
    let rounds: u64 = std::env::var("OXCCL_KILL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    let seed = 0x9e37_79b9_7f4a_7c15 ^ std::process::id() as u64;
    let mut rng = Rng(seed);
    let mut completed = 0;
    for round in 0..rounds {
        let mut secret = [0u8; 16];
        getrandom::fill(&mut secret).unwrap();
        let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
        let tag = oxccl::testing::auth::comm_tag(&secret);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut kids = spawn_ranks(3, &hex, port);
        // Kill one rank at a random moment of the start-up (spawn to a few hundred ms:
        // before, during and after the rendezvous and the segments' creation).
        let victim = rng.below(3) as usize;
        std::thread::sleep(Duration::from_micros(rng.below(400_000)));
        let _ = kids[victim].kill();
        // Then the others, at another moment.
        std::thread::sleep(Duration::from_micros(rng.below(300_000)));
        let start = Instant::now();
        for (r, k) in kids.iter_mut().enumerate() {
            if r != victim && rng.below(2) == 0 {
                let _ = k.kill();
            }
            while k.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let st = k.wait().unwrap();
            completed += usize::from(st.success());
        }
        let left = files_of(tag);
        assert!(
            left.is_empty(),
            "round {round} (seed {seed:#x}): left in /dev/shm after the kills: {left:?}"
        );
    }
    println!("{rounds} rounds, {completed} ranks completed before being killed");
}

/// A rank of the blame and pid-namespace tests: a start-up, a barrier and a few all_reduce;
/// on error it prints `CHILD_ERR <error>` and exits with 1 (no panic, no backtrace).
#[test]
#[ignore = "a rank of the other tests, run by them"]
fn blame_child() {
    if std::env::var("OXCCL_BLAME_CHILD").is_err() {
        return;
    }
    let run = || -> oxccl::Result<()> {
        let comm = Communicator::from_env()?;
        // When start-up ended (the killing test tells kills during start-up from later ones).
        println!("CHILD INIT {}", unix_micros());
        comm.barrier()?;
        for _ in 0..20 {
            let mut v = vec![1.0f32; 4096];
            comm.all_reduce_in_place(&mut v, oxccl::ReduceOp::Sum)?;
        }
        Ok(())
    };
    child_ends(run());
}

/// Microseconds since the Unix epoch (comparable between processes).
fn unix_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Starts rank `r` of `n` of [`blame_child`]; with `own_pidns`, in a pid namespace of its
/// own (`unshare -p -f --mount-proc`, killed with `unshare` itself); with `direct`, the
/// bootstrap's exchanges go directly between ranks (`OXCCL_BOOTSTRAP_RELAY_MAX=1`), else
/// through rank 0 (the default for small groups).
fn spawn_blame_rank(
    r: usize,
    n: usize,
    secret: &str,
    port: u16,
    own_pidns: bool,
    direct: bool,
) -> Child {
    let exe = std::env::current_exe().unwrap();
    let mut c = if own_pidns {
        let mut c = Command::new("unshare");
        c.args(["-p", "-f", "--mount-proc", "--kill-child=SIGKILL"])
            .arg(exe);
        c
    } else {
        Command::new(exe)
    };
    c.args(["--exact", "blame_child", "--ignored", "--nocapture"])
        .env("OXCCL_BLAME_CHILD", "1")
        .env("RANK", r.to_string())
        .env("WORLD_SIZE", n.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("OXCCL_SECRET", secret)
        .env("OXCCL_TRANSPORT", "shm")
        .env("OXCCL_SHM_RING_BYTES", "1M")
        .env("OXCCL_TIMEOUT", "3")
        .env("OXCCL_RENDEZVOUS_REFUSED_SECS", "1")
        .env("OXCCL_BOOTSTRAP_RELAY_MAX", if direct { "1" } else { "64" })
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn random_secret() -> ([u8; 16], String) {
    let mut secret = [0u8; 16];
    getrandom::fill(&mut secret).unwrap();
    let hex = secret.iter().map(|b| format!("{b:02x}")).collect();
    (secret, hex)
}

/// Waits (at most 30 s) for `k` and returns (success, its stderr's `CHILD_ERR` line).
fn finish(k: Child) -> (bool, Option<String>) {
    let o = output_by(
        k,
        Instant::now() + Duration::from_secs(30),
        Duration::from_millis(5),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("CHILD_ERR "))
        .map(str::to_string);
    (o.status.success(), line)
}

/// One job of `n` ranks whose rank `victim` is SIGKILLed `delay` after they were started
/// (`direct`: as for [`spawn_blame_rank`]); returns the survivors' error lines (rank, line),
/// how many completed, and how long after the start the victim's start-up had ended when it
/// did before the kill (`None`: killed during its start-up).
fn kill_round(
    n: usize,
    victim: usize,
    delay: Duration,
    secret: &str,
    own_pidns: bool,
    direct: bool,
) -> (Vec<(usize, String)>, usize, Option<Duration>) {
    let port = free_port();
    let t0 = unix_micros();
    let mut kids: Vec<Option<Child>> = (0..n)
        .map(|r| Some(spawn_blame_rank(r, n, secret, port, own_pidns, direct)))
        .collect();
    std::thread::sleep(delay);
    let mut v = kids[victim].take().unwrap();
    let _ = v.kill();
    // (Under `unshare` the child is `unshare`: its output is not read.)
    let output = if own_pidns {
        let _ = v.wait();
        None
    } else {
        v.wait_with_output().ok()
    };
    let up = output.and_then(|o| {
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        let at: u64 = out
            .lines()
            .find_map(|l| l.strip_prefix("CHILD INIT "))?
            .trim()
            .parse()
            .ok()?;
        Some(Duration::from_micros(at.saturating_sub(t0)))
    });
    let mut errors = Vec::new();
    let mut ok = 0;
    for (r, k) in kids.into_iter().enumerate() {
        let Some(k) = k else { continue };
        match finish(k) {
            (true, _) => ok += 1,
            (false, Some(line)) => errors.push((r, line)),
            (false, None) => errors.push((r, "(no CHILD_ERR line)".into())),
        }
    }
    (errors, ok, up)
}

/// One rank of 4 SIGKILLed at a random moment of its start-up; every
/// survivor that fails must name that rank (not rank 0, through which the bootstrap relays,
/// nor the rank that a direct exchange waits on). `OXCCL_BLAME_ROUNDS` rounds (default 100
/// in the stress tier, `OXCCL_STRESS=1`, and 24 otherwise), four jobs at a time; odd rounds
/// with the exchanges direct between
/// ranks, even ones through rank 0. The kill lands at a random moment of a span that
/// adapts to the start-up's length (the victim prints when its start-up ended; a
/// machine's load changes that length by a factor of ten), so that most kills land during
/// start-up; at least half of them must.
#[test]
fn survivors_name_the_rank_killed_during_start_up() {
    let rounds: u64 = std::env::var("OXCCL_BLAME_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if proc_common::stress() { 100 } else { 24 });
    let pid = std::process::id() as u64;
    const LANES: u64 = 4;
    let results: Vec<(usize, usize, u64, Vec<String>)> = std::thread::scope(|sc| {
        let lanes: Vec<_> = (0..LANES)
            .map(|lane| {
                sc.spawn(move || {
                    let seed = 0x2545_f491_4f6c_dd1d ^ pid ^ (lane << 40);
                    let mut rng = Rng(seed);
                    let (mut named, mut completed, mut during) = (0, 0, 0);
                    let mut wrong = Vec::new();
                    // Kills land uniformly in [1 ms, 1 ms + span]; the span grows by a tenth
                    // after a kill during start-up and shrinks by a fifth after one later,
                    // so that about 70% land during start-up (ln 1.25 / ln 1.375) whatever
                    // its length on this machine at this moment.
                    let mut span = 30_000f64;
                    for round in (lane..rounds).step_by(LANES as usize) {
                        let (_, secret) = random_secret();
                        // Never rank 0 (its survivors name it trivially): rank 1..3.
                        let victim = 1 + rng.below(3) as usize;
                        let delay = Duration::from_micros(1_000 + rng.below(span as u64 + 1));
                        let direct = round % 2 == 1;
                        let (errors, ok, up) = kill_round(4, victim, delay, &secret, false, direct);
                        if up.is_none() {
                            during += 1;
                            span = (span * 1.1).min(5e6);
                        } else {
                            span = (span * 0.8).max(1_000.0);
                        }
                        completed += ok;
                        for (r, line) in errors {
                            if oxccl::blamed_rank(&line) == Some(victim) {
                                named += 1;
                            } else {
                                wrong.push(format!(
                                    "round {round} (lane {lane}, seed {seed:#x}: rank {victim} killed after {delay:?}, direct: {direct}): rank {r}: {line}"
                                ));
                            }
                        }
                    }
                    (named, completed, during, wrong)
                })
            })
            .collect();
        lanes.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let named: usize = results.iter().map(|r| r.0).sum();
    let completed: usize = results.iter().map(|r| r.1).sum();
    let during: u64 = results.iter().map(|r| r.2).sum();
    let wrong: Vec<String> = results.into_iter().flat_map(|r| r.3).collect();
    println!("{rounds} rounds: {during} kills during the victim's start-up, {named} survivor errors named the killed rank, {completed} survivors completed, {} wrong", wrong.len());
    assert!(
        wrong.is_empty(),
        "survivors blamed the wrong rank:\n{}",
        wrong.join("\n")
    );
    assert!(
        during * 2 >= rounds,
        "only {during} of {rounds} kills landed during start-up"
    );
}

/// A rank of [`a_rank_killed_after_init_is_an_error_on_every_idle_survivor`]: init, a
/// barrier, `CHILD READY` on stdout, then no call at all: it only looks at the
/// communicator's health (what its watchdog hears) every 5 ms for up to 20 s, and prints
/// `CHILD_ERR <error>` (exit 1) once that says it failed.
#[test]
#[ignore = "a rank of the other tests, run by them"]
fn idle_child() {
    if std::env::var("OXCCL_IDLE_CHILD").is_err() {
        return;
    }
    let comm = Communicator::from_env().unwrap();
    comm.barrier().unwrap();
    println!("CHILD READY");
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        if let Err(e) = comm.check() {
            eprintln!("CHILD_ERR {e}");
            std::process::exit(1);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    println!("CHILD OK");
}

/// The watchdog's connections are a graph above
/// `OXCCL_BOOTSTRAP_RELAY_MAX` ranks (every rank passes failures on), a star around rank 0
/// up to it. A rank SIGKILLed after init, while the others make no call, must become an
/// error naming it on every survivor, at once (the killed rank's links close; its
/// neighbours pass the loss on): 12 ranks (4 rounds; each rank linked to 6 others, so that
/// 5 survivors hear of it only through another), directly with rank 3 and with rank 0
/// killed (rank 0 is no hub there), and through rank 0 with rank 3 killed. Then a rank
/// stopped (SIGSTOP) directly: only its two ring neighbours hear its heartbeats
/// (`OXCCL_HEARTBEAT_TIMEOUT=1`); their word must reach every survivor.
#[test]
fn a_rank_killed_after_init_is_an_error_on_every_idle_survivor() {
    const N: usize = 12;
    for (direct, victim, stop) in [
        (true, 3, false),
        (true, 0, false),
        (false, 3, false),
        (true, 5, true),
    ] {
        let (_, secret) = random_secret();
        let port = free_port();
        let (tx, rx) = std::sync::mpsc::channel();
        let mut kids: Vec<Option<Child>> = (0..N)
            .map(|r| {
                let mut c = rank_command("idle_child", r, N, port, &secret);
                c.env("OXCCL_IDLE_CHILD", "1")
                    .env("OXCCL_TRANSPORT", "shm")
                    .env("OXCCL_SHM_RING_BYTES", "1M")
                    .env("OXCCL_TIMEOUT", "10")
                    .env("OXCCL_HEARTBEAT_TIMEOUT", "1")
                    .env("OXCCL_BOOTSTRAP_RELAY_MAX", if direct { "1" } else { "64" })
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                let tx = tx.clone();
                Some(spawn_reading(&mut c, move |line| {
                    if line.as_deref() == Some("CHILD READY") {
                        let _ = tx.send(r);
                    }
                }))
            })
            .collect();
        let mut ready = 0;
        while ready < N {
            match rx.recv_timeout(Duration::from_secs(30)) {
                Ok(_) => ready += 1,
                Err(_) => {
                    for k in kids.iter_mut().flatten() {
                        let _ = k.kill();
                    }
                    panic!("direct {direct}: only {ready} of {N} ranks finished init in 30 s");
                }
            }
        }
        let mut v = kids[victim].take().unwrap();
        let stopped = if stop {
            // Every rank has heard the victim's first heartbeat by now.
            std::thread::sleep(Duration::from_millis(200));
            Command::new("kill")
                .args(["-STOP", &v.id().to_string()])
                .status()
                .is_ok_and(|s| s.success())
        } else {
            // Its links close as it dies (reaped below).
            let _ = v.kill();
            true
        };
        let killed = Instant::now();
        let what = if stop { "stopped" } else { "killed" };
        // Every survivor's end first (each waits after the previous ones'), then the victim's
        // (a stopped one must not outlive a failed assertion), then the checks.
        let ends: Vec<(usize, bool, String, Duration)> = kids
            .into_iter()
            .enumerate()
            .filter_map(|(r, k)| {
                let (ok, line) = finish(k?);
                Some((r, ok, line.unwrap_or_default(), killed.elapsed()))
            })
            .collect();
        let _ = v.kill();
        let _ = v.wait();
        assert!(stopped, "cannot stop rank {victim}");
        for (r, ok, line, took) in &ends {
            assert!(
                !ok && oxccl::blamed_rank(line) == Some(victim),
                "direct {direct}, rank {victim} {what}: rank {r} said {line:?} (success: {ok})"
            );
            // Found by the heartbeat (1 s): ten times that, within the children's 20 s of
            // looking (a busy machine).
            assert!(
                *took < Duration::from_secs(10),
                "direct {direct}, rank {victim} {what}: rank {r} failed only after {took:?}"
            );
        }
        let (_, _, said, last) = ends.last().unwrap();
        println!(
            "direct {direct}, rank {victim} {what}: {} survivors named it, the last {last:?} after; the last said: {said}",
            ends.len()
        );
    }
}

fn unshare_works() -> bool {
    Command::new("unshare")
        .args(["-p", "-f", "--mount-proc", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Ranks each in a pid namespace of their own cannot copy each other's
/// memfds and share named files in /dev/shm. One of 4 is SIGKILLed at a random moment of the
/// start-up; once the survivors exit no file of the job is left, and the next job with the
/// same secret succeeds. `OXCCL_KILL_ROUNDS` rounds (default 6); skipped (with a line saying
/// so) where `unshare -p` is not allowed (not root).
#[test]
fn named_files_of_ranks_in_own_pid_namespaces_never_leak_nor_block_the_next_job() {
    if !unshare_works() {
        println!("SKIPPED: `unshare -p -f --mount-proc` is not allowed here (needs root)");
        return;
    }
    let rounds: u64 = std::env::var("OXCCL_KILL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ std::process::id() as u64);
    for round in 0..rounds {
        let (secret, hex) = random_secret();
        let tag = oxccl::testing::auth::comm_tag(&secret);
        let victim = rng.below(4) as usize;
        let delay = Duration::from_micros(50_000 + rng.below(500_000));
        let (errors, _, _) = kill_round(4, victim, delay, &hex, true, false);
        let left = files_of(tag);
        assert!(
            left.is_empty(),
            "round {round} (rank {victim} killed after {delay:?}): left in /dev/shm: {left:?}\nerrors: {errors:?}"
        );
        // The next job with the same secret: all 4 ranks succeed, over named files.
        let port = free_port();
        let kids: Vec<Child> = (0..4)
            .map(|r| spawn_blame_rank(r, 4, &hex, port, true, false))
            .collect();
        for (r, k) in kids.into_iter().enumerate() {
            let (ok, line) = finish(k);
            assert!(
                ok,
                "round {round}: rank {r} of the next job failed: {line:?}"
            );
        }
        let left = files_of(tag);
        assert!(left.is_empty(), "round {round}: the next job left {left:?}");
    }
}
