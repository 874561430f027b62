//! Soak and fault injection with real processes: hundreds (thousands in the stress tier) of
//! random collectives on 4 ranks over shared memory and TCP, every result checked; a random rank killed (SIGKILL) at a
//! random moment, inside or between calls, and every survivor must report it within seconds;
//! a rank frozen (SIGSTOP: sockets open, no FIN, as a host that went away) reported by the
//! heartbeat within seconds ([`BOUND`]); survivors shrinking and going on.
//!
//! The ranks are this test binary, re-executed to run the ignored test `fault_child` with
//! `OXCCL_FAULT_CHILD` set. The soak runs under `oxccl run`; the fault tests start the ranks
//! themselves (the launcher would stop the survivors as soon as one rank dies).
//! `OXCCL_SOAK_CALLS` sets the soak's calls per transport (default 300, 1500 in the stress
//! tier: `OXCCL_STRESS=1`), `OXCCL_FAULT_ROUNDS` the number of random kills per transport
//! (default 3, 20 in the stress tier). Every failure names the seed, the victim and each
//! rank's output.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use oxccl::check::Case;
use oxccl::{CollKind, Communicator, DataType, ReduceOp};

const OXCCL: &str = env!("CARGO_BIN_EXE_oxccl");
/// How long after a rank's death each survivor must have reported it: quiet, a kill is seen in
/// milliseconds and a frozen rank by the heartbeat (`OXCCL_HEARTBEAT_TIMEOUT`, 1.5 s); ten
/// times that, far under the ranks' `OXCCL_TIMEOUT` (60 s): the error came from the
/// watchdog, not from a call's timeout, also on a busy machine. (The delays are printed.)
const BOUND: Duration = Duration::from_secs(15);

/// Whether the stress tier runs this (`OXCCL_STRESS=1`): long loops run their full counts.
fn stress() -> bool {
    std::env::var("OXCCL_STRESS").is_ok_and(|v| v == "1")
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A random case; every rank draws the same sequence.
fn random_case(rng: &mut Rng, rank: usize, n: usize) -> Case {
    let kinds = [
        CollKind::AllReduce,
        CollKind::AllGather,
        CollKind::ReduceScatter,
        CollKind::AllToAll,
        CollKind::SendRecv { to: 0, from: 0 },
        CollKind::Broadcast,
        CollKind::Reduce,
    ];
    let kind = kinds[rng.below(kinds.len())];
    let dtype = DataType::ALL[rng.below(DataType::ALL.len())];
    let ops = oxccl::check::ops(dtype);
    let op = ops[rng.below(ops.len())];
    let count = match rng.below(10) {
        0 => 0,
        1..=6 => rng.below(64),
        7 | 8 => rng.below(5000),
        _ => rng.below(300_000),
    };
    Case {
        kind,
        dtype,
        op,
        root: rng.below(n),
        count,
        in_place: rng.below(2) == 0,
        rank,
        nranks: n,
    }
}

fn run_case(comm: &Communicator, case: &Case) -> oxccl::Result<usize> {
    let mut bufs = case.buffers(None)?;
    let (send, recv) = bufs.get();
    case.fill(send, recv);
    case.call(comm, send, recv)?;
    Ok(case.wrong(recv))
}

/// The rank side.
#[test]
#[ignore = "runs only as a rank started by the fault tests"]
fn fault_child() {
    let Ok(mode) = std::env::var("OXCCL_FAULT_CHILD") else {
        return;
    };
    let comm = Communicator::from_env().unwrap();
    let (rank, n) = (comm.rank(), comm.world_size());
    let seed = env_num("OXCCL_FAULT_SEED", 1);
    let victim = env_num("OXCCL_VICTIM", 1) as usize;
    let mut rng = Rng(seed);
    match mode.as_str() {
        "soak" => {
            let calls = env_num("OXCCL_SOAK_CALLS", if stress() { 1500 } else { 300 });
            let mut wrong = 0;
            for i in 0..calls {
                let case = random_case(&mut rng, rank, n);
                let w = run_case(&comm, &case).unwrap_or_else(|e| panic!("call {i} {case:?}: {e}"));
                if w > 0 {
                    eprintln!("WRONG {w} in call {i}: {case:?}");
                    wrong += w;
                }
            }
            comm.barrier().unwrap();
            assert_eq!(wrong, 0, "rank {rank}: wrong results");
            println!(
                "SOAK rank {rank}: {calls} calls over {} all correct",
                comm.transport_summary()
            );
        }
        "hang" => {
            // Rank 1 is late for the second collective; the test sends SIGUSR1 meanwhile.
            comm.all_reduce_in_place(&mut [1.0f32; 8], ReduceOp::Sum)
                .unwrap();
            if rank == 1 {
                std::thread::sleep(Duration::from_secs(3));
            }
            let _ = comm.all_reduce_in_place(&mut [1.0f32; 8], ReduceOp::Sum);
        }
        "differ" => {
            comm.all_reduce_in_place(&mut [1.0f32; 8], ReduceOp::Sum)
                .unwrap();
            let e = comm
                .broadcast_in_place(&mut vec![0u8; 10 + rank], 0)
                .err()
                .or_else(|| comm.barrier().err())
                .unwrap();
            assert!(e.is_mismatch(), "{e}");
        }
        "kill" | "between" | "stop" | "shrink" => {
            let kill_at = rng.below(40) + 5;
            let delay_us = rng.below(3000) as u64;
            let kill_file = std::env::var("OXCCL_KILL_FILE").unwrap();
            let mut i = 0usize;
            loop {
                if rank == victim && i == kill_at {
                    let kf = kill_file.clone();
                    let between = mode == "between";
                    let stop = mode == "stop";
                    let go = move || {
                        std::fs::write(&kf, now_ns().to_string()).unwrap();
                        let me = rustix::process::getpid();
                        let sig = if stop {
                            rustix::process::Signal::STOP
                        } else {
                            rustix::process::Signal::KILL
                        };
                        let _ = rustix::process::kill_process(me, sig);
                    };
                    if between {
                        go();
                    } else {
                        // A random moment: likely inside one of the next calls.
                        std::thread::spawn(move || {
                            std::thread::sleep(Duration::from_micros(delay_us));
                            go()
                        });
                    }
                }
                if mode == "between" && i == kill_at {
                    // Survivors wait between calls, watching the communicator.
                    let start = Instant::now();
                    while comm.check().is_ok() && start.elapsed() < Duration::from_secs(20) {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    let e = comm.check().unwrap_err();
                    println!("SURVIVOR {rank} {} {e}", now_ns());
                    return;
                }
                let case = random_case(&mut rng, rank, n);
                let case = Case {
                    count: case.count.min(20_000),
                    ..case
                };
                if rng.below(3) == 0 {
                    std::thread::sleep(Duration::from_micros(rng.below(2000) as u64));
                }
                match run_case(&comm, &case) {
                    Ok(0) => {}
                    Ok(w) => panic!("rank {rank}: {w} wrong in {case:?}"),
                    Err(e) => {
                        println!("SURVIVOR {rank} {} {e}", now_ns());
                        if mode == "shrink" {
                            let small = comm.shrink(&[victim]).unwrap();
                            let mut v = vec![1.0f32; 4099];
                            small.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
                            assert!(v.iter().all(|&x| x == (n - 1) as f32));
                            println!(
                                "SHRUNK {rank} -> {} of {}",
                                small.rank(),
                                small.world_size()
                            );
                        }
                        return;
                    }
                }
                i += 1;
                assert!(i < 100_000, "rank {rank}: no failure seen");
            }
        }
        "die_and_fail" => {
            // The victim is SIGKILLed at call 30; the survivors fail (exit code 1) at once.
            for i in 0.. {
                if rank == victim && i == 30 {
                    let _ = rustix::process::kill_process(
                        rustix::process::getpid(),
                        rustix::process::Signal::KILL,
                    );
                }
                if let Err(e) = comm.all_reduce_in_place(&mut [1.0f32; 64], ReduceOp::Sum) {
                    eprintln!("rank {rank}: {e}");
                    std::process::exit(1);
                }
            }
        }
        m => panic!("unknown mode {m}"),
    }
}

fn child_command(mode: &str, transport: &str) -> Command {
    let me = std::env::current_exe().unwrap();
    let mut c = Command::new(me);
    c.args([
        "--exact",
        "fault_child",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("OXCCL_FAULT_CHILD", mode)
    .env("OXCCL_TRANSPORT", transport)
    .env("OXCCL_TIMEOUT", "60");
    c
}

#[test]
fn soak_random_collectives_every_result_checked() {
    for transport in ["shm", "tcp"] {
        let seed = now_ns() as u64 % 1000;
        let out = Command::new(OXCCL)
            .args(["run", "-n", "4", "--"])
            .arg(std::env::current_exe().unwrap())
            .args(child_command("soak", transport).get_args())
            .envs(
                child_command("soak", transport)
                    .get_envs()
                    .map(|(k, v)| (k, v.unwrap())),
            )
            .env("OXCCL_FAULT_SEED", seed.to_string())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{transport}, seed {seed}: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            stdout.matches("all correct").count(),
            4,
            "{transport}, seed {seed}: {stdout}"
        );
    }
}

/// Starts `n` ranks of `mode` directly; returns their stdout once all exited (bounded).
fn run_ranks(
    n: usize,
    mode: &str,
    transport: &str,
    seed: u64,
    victim: usize,
) -> (Vec<String>, String, u128) {
    run_ranks_with(n, mode, transport, seed, victim, &[], |_| {})
}

/// As [`run_ranks`], with extra environment and `during(pids)` run once the ranks started
/// (`victim >= n`: nobody dies).
fn run_ranks_with(
    n: usize,
    mode: &str,
    transport: &str,
    seed: u64,
    victim: usize,
    env: &[(&str, &str)],
    during: impl FnOnce(&[u32]),
) -> (Vec<String>, String, u128) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = std::env::temp_dir().join(format!("oxccl-fault-{}-{seed}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kill_file = dir.join("killed_at");
    let _ = std::fs::remove_file(&kill_file);
    let mut kids: Vec<Child> = (0..n)
        .map(|r| {
            child_command(mode, transport)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("OXCCL_SECRET", format!("{:032x}", seed as u128 * 7919 + 17))
                .env("OXCCL_FAULT_SEED", seed.to_string())
                .env("OXCCL_VICTIM", victim.to_string())
                .env("OXCCL_KILL_FILE", &kill_file)
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let pids: Vec<u32> = kids.iter().map(|k| k.id()).collect();
    during(&pids);
    let start = Instant::now();
    let mut outs = vec![String::new(); n];
    let mut errs = String::new();
    for (r, k) in kids.iter_mut().enumerate() {
        if r == victim {
            continue;
        }
        loop {
            if k.try_wait().unwrap().is_some() {
                break;
            }
            if start.elapsed() > Duration::from_secs(60) {
                let _ = k.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // The victim is dead or stopped: make sure it is gone.
    if let Some(k) = kids.get_mut(victim) {
        let _ = k.kill();
    }
    for (r, k) in kids.iter_mut().enumerate() {
        let _ = k.wait();
        k.stdout
            .take()
            .unwrap()
            .read_to_string(&mut outs[r])
            .unwrap();
        let mut e = String::new();
        k.stderr.take().unwrap().read_to_string(&mut e).unwrap();
        errs.push_str(&format!("--- rank {r} stderr\n{e}"));
    }
    let killed: u128 = std::fs::read_to_string(&kill_file)
        .map(|s| s.trim().parse().unwrap())
        .unwrap_or(0);
    let _ = std::fs::remove_dir_all(&dir);
    (outs, errs, killed)
}

/// Checks that every survivor reported the victim within [`BOUND`] of its death.
fn check_survivors(outs: &[String], errs: &str, killed: u128, victim: usize, what: &str) {
    assert!(
        killed > 0,
        "{what}: the victim never died\n{outs:?}\n{errs}"
    );
    for (r, out) in outs.iter().enumerate() {
        if r == victim {
            continue;
        }
        let line = out
            .lines()
            .find_map(|l| l.find("SURVIVOR").map(|i| &l[i..]))
            .unwrap_or_else(|| panic!("{what}: rank {r} reported nothing\n{out}\n{errs}"));
        let mut parts = line.splitn(4, ' ');
        let (_, _, at, msg) = (
            parts.next(),
            parts.next(),
            parts.next().unwrap(),
            parts.next().unwrap(),
        );
        let at: u128 = at.parse().unwrap();
        let delay = Duration::from_nanos(at.saturating_sub(killed) as u64);
        assert!(
            msg.contains(&format!("lost peer rank {victim}")),
            "{what}: rank {r} got another error: {msg}"
        );
        assert!(delay < BOUND, "{what}: rank {r} took {delay:?}: {msg}");
        println!("{what}: rank {r} reported rank {victim} after {delay:?}: {msg}");
    }
}

#[test]
fn a_rank_killed_at_a_random_moment_is_reported_by_every_survivor() {
    let rounds = env_num("OXCCL_FAULT_ROUNDS", if stress() { 20 } else { 3 });
    let base = now_ns() as u64;
    for transport in ["shm", "tcp"] {
        for k in 0..rounds {
            let seed = base.wrapping_add(k * 7 + transport.len() as u64) % 100_000;
            let victim = (seed % 4) as usize;
            let (outs, errs, killed) = run_ranks(4, "kill", transport, seed, victim);
            let what = format!("{transport}, seed {seed}, victim {victim}");
            check_survivors(&outs, &errs, killed, victim, &what);
        }
    }
}

#[test]
fn oxccl_run_blames_the_killed_rank_not_the_survivors_that_fail_after_it() {
    for round in 0..3 {
        let c = child_command("die_and_fail", "shm");
        let out = Command::new(OXCCL)
            .args(["run", "-n", "3", "--"])
            .arg(std::env::current_exe().unwrap())
            .args(c.get_args())
            .envs(c.get_envs().map(|(k, v)| (k, v.unwrap())))
            .env("OXCCL_VICTIM", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "round {round}: {err}");
        let summary = err
            .lines()
            .find(|l| l.starts_with("oxccl: rank"))
            .unwrap_or_else(|| panic!("round {round}: no summary\n{err}"));
        assert!(
            summary.starts_with("oxccl: rank 1 was killed by signal 9 (SIGKILL) first"),
            "round {round}: {summary}\n{err}"
        );
    }
}

/// The pids of `launcher`'s children, by their `RANK`.
fn ranks_of(launcher: u32) -> Vec<(usize, i32)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{launcher}/task"))
        .unwrap()
        .flatten()
    {
        let kids = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        for pid in kids
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            if let Some(r) = env
                .split(|&b| b == 0)
                .find_map(|kv| kv.strip_prefix(b"RANK="))
                .and_then(|r| std::str::from_utf8(r).ok()?.parse().ok())
            {
                out.push((r, pid));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn oxccl_run_blames_the_killed_rank_even_when_it_sees_every_death_at_once() {
    // The launcher is stopped while rank 1 is killed and the others fail after it: when it
    // goes on, every death is there at once, and rank 0 is the first in rank order.
    let c = child_command("die_and_fail", "shm");
    let launcher = Command::new(OXCCL)
        .args(["run", "-n", "3", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(c.get_args())
        .envs(c.get_envs().map(|(k, v)| (k, v.unwrap())))
        .env("OXCCL_VICTIM", "99")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lpid = rustix::process::Pid::from_raw(launcher.id() as i32).unwrap();
    let start = Instant::now();
    let mut kids = ranks_of(launcher.id());
    while kids.len() < 3 && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
        kids = ranks_of(launcher.id());
    }
    assert_eq!(kids.len(), 3, "{kids:?}");
    // Let them get into their calls.
    std::thread::sleep(Duration::from_millis(1500));
    rustix::process::kill_process(lpid, rustix::process::Signal::STOP).unwrap();
    let victim = rustix::process::Pid::from_raw(kids[1].1).unwrap();
    rustix::process::kill_process(victim, rustix::process::Signal::KILL).unwrap();
    // The others fail after it (quiet, within a second): until each has ended (a zombie of
    // the stopped launcher), at most 60 s on a busy machine.
    let ended = |pid: i32| match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|t| t.trim_start().starts_with('Z')),
    };
    let t = Instant::now();
    while !kids.iter().all(|&(_, pid)| ended(pid)) && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    rustix::process::kill_process(lpid, rustix::process::Signal::CONT).unwrap();
    let out = launcher.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let summary = err
        .lines()
        .find(|l| l.starts_with("oxccl: rank"))
        .unwrap_or_else(|| panic!("no summary\n{err}"));
    assert!(
        summary.starts_with("oxccl: rank 1 was killed by signal 9 (SIGKILL) first"),
        "{summary}\n{err}"
    );
    assert!(summary.contains("rank 0 exited with code 1"), "{summary}");
}

#[test]
fn a_rank_killed_between_calls_is_reported_by_the_watchdog() {
    for transport in ["shm", "tcp"] {
        let seed = 11;
        let (outs, errs, killed) = run_ranks(4, "between", transport, seed, 2);
        check_survivors(
            &outs,
            &errs,
            killed,
            2,
            &format!("between calls, {transport}"),
        );
    }
}

#[test]
fn a_frozen_rank_is_reported_by_the_heartbeat() {
    for transport in ["shm", "tcp"] {
        let (outs, errs, killed) = run_ranks(3, "stop", transport, 5, 1);
        check_survivors(&outs, &errs, killed, 1, &format!("SIGSTOP, {transport}"));
    }
}

#[test]
fn survivors_shrink_and_go_on() {
    // Rank 3 dies over shm; rank 0, which hosted the rendezvous, dies over tcp (the new
    // communicator's rendezvous moves to rank 1).
    for (transport, victim) in [("shm", 3), ("tcp", 0)] {
        let (outs, errs, killed) = run_ranks(4, "shrink", transport, 23, victim);
        check_survivors(
            &outs,
            &errs,
            killed,
            victim,
            &format!("shrink, {transport}"),
        );
        let survivors = (0..4).filter(|&r| r != victim);
        for (new, r) in survivors.enumerate() {
            assert!(
                outs[r].contains(&format!("SHRUNK {r} -> {new} of 3")),
                "{}\n{errs}",
                outs[r]
            );
        }
    }
}

#[test]
fn flight_recorder_on_sigusr1_and_on_mismatch_then_oxccl_trace_names_the_culprit() {
    let dir = std::env::temp_dir().join(format!("oxccl-fr-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("fr").to_string_lossy().into_owned();
    // A rank late for a call: SIGUSR1 while rank 0 waits.
    let (outs, errs, _) = run_ranks_with(
        2,
        "hang",
        "shm",
        31,
        9,
        &[("OXCCL_FLIGHT_RECORDER", &prefix)],
        |pids| {
            std::thread::sleep(Duration::from_millis(1500));
            for &p in pids {
                let pid = rustix::process::Pid::from_raw(p as i32).unwrap();
                rustix::process::kill_process(pid, rustix::process::Signal::USR1).unwrap();
            }
            std::thread::sleep(Duration::from_millis(300));
        },
    );
    let trace = |what: &str| {
        let out = Command::new(OXCCL)
            .args(["trace", &prefix])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{what}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let report = trace("hang");
    assert!(
        report.contains(
            "WAITING: rank(s) [0] wait in collective #2 all_reduce(8 x float, sum) for rank(s) [1]"
        ),
        "{report}\n{outs:?}\n{errs}"
    );
    assert!(report.contains("written on SIGUSR1"), "{report}");
    for f in std::fs::read_dir(&dir).unwrap() {
        std::fs::remove_file(f.unwrap().path()).unwrap();
    }
    // A mismatch: every rank writes its record on the error.
    let (outs, errs, _) = run_ranks_with(
        3,
        "differ",
        "tcp",
        37,
        9,
        &[("OXCCL_FLIGHT_RECORDER", &prefix)],
        |_| {},
    );
    let report = trace("differ");
    assert!(
        report.contains("MISMATCH at collective #2") && report.contains("broadcast(10 x uint8"),
        "{report}\n{outs:?}\n{errs}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether process `pid` is gone (or a zombie: ended, not yet reaped by its new parent).
fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

/// Waits until `launcher` has started `n` ranks; their pids by rank.
fn wait_ranks(launcher: u32, n: usize) -> Vec<(usize, i32)> {
    let start = Instant::now();
    let mut kids = ranks_of(launcher);
    while kids.len() < n && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
        kids = ranks_of(launcher);
    }
    assert_eq!(kids.len(), n, "{kids:?}");
    kids
}

/// A long `oxccl perf` of `ranks` ranks (millions of tiny calls).
fn long_perf(ranks: usize) -> Command {
    let mut c = Command::new(OXCCL);
    c.args([
        "perf",
        "all_reduce",
        "-b",
        "1K",
        "-e",
        "1K",
        "-n",
        "10000000",
    ])
    .args(["--ranks", &ranks.to_string()])
    .env("OXCCL_TIMEOUT", "60")
    .env("OXCCL_TUNE_FILE", "");
    c
}

/// `oxccl run` and `oxccl perf --ranks` killed by SIGKILL (no handler can stop the ranks):
/// the kernel ends the ranks with it.
#[test]
fn ranks_end_when_their_launcher_is_killed() {
    let mut run = Command::new(OXCCL);
    run.args(["run", "-n", "2", "--", "sleep", "1000"]);
    for (what, mut cmd) in [("oxccl run", run), ("oxccl perf", long_perf(2))] {
        let mut launcher = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let kids = wait_ranks(launcher.id(), 2);
        std::thread::sleep(Duration::from_millis(500));
        launcher.kill().unwrap();
        launcher.wait().unwrap();
        let killed = Instant::now();
        while !kids.iter().all(|(_, p)| gone(*p)) && killed.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let left: Vec<_> = kids.iter().filter(|(_, p)| !gone(*p)).collect();
        for (_, p) in &left {
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_raw(*p).unwrap(),
                rustix::process::Signal::KILL,
            );
        }
        assert!(
            left.is_empty(),
            "{what}: ranks {left:?} outlived their launcher"
        );
        eprintln!(
            "{what}: ranks gone {:?} after the launcher",
            killed.elapsed()
        );
    }
}

/// `oxccl perf --ranks 3` with rank 0 stopped (SIGSTOP): the survivors fail naming rank 0,
/// and perf's launcher blames rank 0 as `oxccl run` does, not the first survivor to exit.
#[test]
fn perf_blames_the_stopped_rank_that_the_survivors_name() {
    let launcher = long_perf(3)
        .env("OXCCL_HEARTBEAT_TIMEOUT", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let kids = wait_ranks(launcher.id(), 3);
    std::thread::sleep(Duration::from_millis(1500));
    let victim = rustix::process::Pid::from_raw(kids[0].1).unwrap();
    rustix::process::kill_process(victim, rustix::process::Signal::STOP).unwrap();
    let out = launcher.wait_with_output().unwrap();
    let _ = rustix::process::kill_process(victim, rustix::process::Signal::KILL);
    let err = String::from_utf8_lossy(&out.stderr);
    let summary = err
        .lines()
        .find(|l| l.starts_with("oxccl: rank"))
        .unwrap_or_else(|| panic!("no summary\n{err}"));
    assert!(
        summary.starts_with("oxccl: rank 0 is to blame"),
        "{summary}\n{err}"
    );
}
