//! Failure injection in `oxccl perf` (as torchft's and ULFM's tests): `--kill-rank R`,
//! `--stall-rank R` or `--cut-rank R` with `--at-iter I`. The ranks run the collective (the
//! first size, type and op of the command line) in a loop; at iteration I the victim fails:
//!
//! - kill: it sends itself SIGKILL (no goodbye: its sockets are closed by the kernel and its
//!   shared memory is left as it is); this command's launcher is told to expect it and keeps
//!   the survivors. Under another launcher (torchrun, srun, `oxccl run` without
//!   `--expect-kill`), which would stop the job, it exits at once with status 0 instead,
//!   which its peers cannot tell from SIGKILL;
//! - stall: it stops itself (SIGSTOP: its sockets stay open, its heartbeats stop, as a host
//!   that went away) for `--stall-secs`, then resumes and leaves;
//! - cut (TCP only): a silent network partition, as a pulled cable or a dead switch port: each
//!   of its TCP sockets drops every packet that reaches it and sends at most one more
//!   ([`oxccl::testing::cut_tcp`]); no FIN, no RST. It goes
//!   on calling: its own call must fail too (it reports its time to detect), then it stays
//!   silent for twice the heartbeat timeout and 2 s (an exit would close its sockets and
//!   could turn the silence into a closed connection) and leaves.
//!
//! Each survivor reports the time to detect (from the start of its call at iteration I to the
//! error, which must be a lost peer naming the victim), then the survivors `shrink()` the victim out, re-run the same size, and report the
//! time to recover (the shrink), wrong elements against the exact reference, and whether
//! their results agree bitwise (for collectives whose output is the same on every rank).
//!
//! With `--grow` (after a kill), the survivors' rank 0 then starts a replacement process (this
//! binary again, with `OXCCL_PERF_GROW_JOIN=RANK/SIZE/UNIQUE_ID`), every survivor calls
//! `grow(1, ..)` and the replacement `Communicator::init` with that id; all ranks re-run the
//! same size at the original size and report the time to grow, wrong elements and agreement.

use std::hash::{Hash, Hasher};
use std::io::Write;
use std::process::Child;
use std::time::{Duration, Instant};

use oxccl::check::Case;
use oxccl::TransportChoice;
use oxccl::{CollKind, Communicator, UniqueId};

use super::{dtypes, ops, shape, Args};

#[derive(Clone, Copy, PartialEq)]
enum How {
    Kill,
    Stall,
    Cut,
}

fn fail(how: How, rank: usize, iter: usize, a: &Args) {
    let _ = std::io::stdout().flush();
    match how {
        How::Kill if a.launcher_expects_kill == Some(rank) => {
            eprintln!("rank {rank}: injected failure: SIGKILL at iteration {iter}");
            let _ = rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::KILL,
            );
            // Not reached: SIGKILL cannot be caught.
            // SAFETY: as below.
            unsafe { libc::_exit(0) }
        }
        How::Kill => {
            eprintln!("rank {rank}: injected failure: exiting abruptly at iteration {iter}");
            // SAFETY: `_exit` ends the process at once (no destructors, no atexit handlers:
            // nothing of this process runs after it, as under SIGKILL).
            unsafe { libc::_exit(0) }
        }
        How::Stall => {
            let pid = rustix::process::getpid();
            // Something outside this process must wake it: a shell that sleeps, then sends
            // SIGCONT.
            let waker = std::process::Command::new("sh")
                .args([
                    "-c",
                    &format!(
                        "sleep {}; kill -CONT {}",
                        a.stall_secs,
                        pid.as_raw_nonzero()
                    ),
                ])
                .spawn();
            if let Err(e) = waker {
                eprintln!("rank {rank}: cannot start the waker ({e}); not stalling");
                return;
            }
            eprintln!(
                "rank {rank}: injected failure: stopping (SIGSTOP) for {} s at iteration {iter}",
                a.stall_secs
            );
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::STOP);
            eprintln!("rank {rank}: resumed; leaving");
        }
        How::Cut => unreachable!("a cut rank goes on calling; see `cut`"),
    }
}

/// `--cut-rank`: silences every TCP socket of this process (see the module documentation).
fn cut(rank: usize, iter: usize) -> Result<(), String> {
    let n = oxccl::testing::cut_tcp().map_err(|e| format!("rank {rank}: cutting: {e}"))?;
    eprintln!(
        "rank {rank}: injected failure: cut off the network at iteration {iter} \
         ({n} TCP sockets drop every packet and send at most one more; nothing closed)"
    );
    Ok(())
}

/// The cut rank after its own call failed: stays silent long enough for every survivor to
/// see silence: twice the heartbeat timeout (without heartbeats, the TCP links' dead time,
/// else the call timeout), and 2 s more for a loaded machine.
fn linger(comm: &Communicator, rank: usize) {
    let cfg = comm.config();
    let dead_after = (!cfg.tcp_dead_after.is_zero()).then_some(cfg.tcp_dead_after);
    let wait = 2 * cfg.heartbeat.or(dead_after).unwrap_or(comm.timeout()) + Duration::from_secs(2);
    eprintln!(
        "rank {rank}: staying silent for {:.1} s, then leaving",
        wait.as_secs_f64()
    );
    std::thread::sleep(wait);
}

/// Why `--cut-rank` is refused on shared memory.
pub(super) const CUT_NEEDS_TCP: &str = "--cut-rank needs the TCP transport (--transport tcp): \
     it cuts TCP sockets, and shared memory has no packets to drop";

fn digest(b: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    b.hash(&mut h);
    h.finish()
}

/// The case every rank runs: the first size, type and op of the command line.
fn case_for(
    a: &Args,
    kind: CollKind,
    rank: usize,
    nranks: usize,
    root: usize,
) -> Result<Case, String> {
    let dtype = dtypes(&a.datatype)?[0];
    let op = ops(&a.op, kind, dtype)?[0];
    let (count, _, _) = shape(kind, a.minbytes, dtype.size(), nranks);
    Ok(Case {
        kind,
        dtype,
        op,
        root,
        count,
        in_place: false,
        rank,
        nranks,
    })
}

/// What every rank learns from [`check_run`].
struct Outcome {
    /// Per rank: `times` as given, the call's time (ms), wrong elements.
    rows: Vec<Vec<f64>>,
    wrong: f64,
    /// Whether the outputs are bitwise identical, where they should be.
    agree: bool,
    same_output: bool,
}

impl Outcome {
    fn verdict(&self, who: &str) -> String {
        let agreement = if !self.same_output {
            "differ by design across ranks (checked against the reference only)".to_string()
        } else if self.agree {
            format!("bitwise identical on every {who}")
        } else {
            format!("NOT bitwise identical across {who}s")
        };
        format!(
            "{} wrong element(s) against the reference; results {agreement}",
            self.wrong
        )
    }

    fn ok(&self) -> bool {
        self.wrong == 0.0 && (!self.same_output || self.agree)
    }
}

/// Runs the case of `rank`/`root` on `comm` once, checks it against the exact reference, and
/// gathers everyone's `times` (ms), call time and wrong count, and the outputs' digests.
fn check_run(
    comm: &Communicator,
    a: &Args,
    kind: CollKind,
    root: usize,
    times: &[f64],
) -> Result<Outcome, String> {
    let e = |e: oxccl::Error| e.to_string();
    let m = comm.world_size();
    let case = case_for(a, kind, comm.rank(), m, root)?;
    let mut bufs = case.buffers(None).map_err(e)?;
    let (send, recv) = bufs.get();
    case.fill(send, recv);
    let t = Instant::now();
    case.call(comm, send, recv).map_err(e)?;
    let call = t.elapsed();
    let wrong = case.wrong(recv);
    let mut mine = times.to_vec();
    mine.extend([call.as_secs_f64() * 1e3, wrong as f64]);
    let mut all = vec![0f64; mine.len() * m];
    comm.all_gather(&mine, &mut all).map_err(e)?;
    let mut hashes = vec![0u64; m];
    comm.all_gather(&[digest(recv)], &mut hashes).map_err(e)?;
    let rows: Vec<Vec<f64>> = all.chunks(mine.len()).map(<[f64]>::to_vec).collect();
    Ok(Outcome {
        wrong: rows.iter().map(|r| r[r.len() - 1]).sum(),
        rows,
        agree: hashes.iter().all(|&h| h == hashes[0]),
        same_output: matches!(
            kind,
            CollKind::AllReduce | CollKind::Broadcast | CollKind::AllGather
        ),
    })
}

/// Runs the injection; every rank calls it.
pub(super) fn run(comm: Communicator, a: &Args, kind: CollKind) -> Result<(), String> {
    let (n, rank) = (comm.world_size(), comm.rank());
    let (victim, how) = match (a.kill_rank, a.stall_rank, a.cut_rank) {
        (Some(r), None, None) => (r, How::Kill),
        (None, Some(r), None) => (r, How::Stall),
        (None, None, Some(r)) => (r, How::Cut),
        _ => return Err("give one of --kill-rank, --stall-rank and --cut-rank".into()),
    };
    if how == How::Cut && comm.config().transport != TransportChoice::Tcp {
        return Err(CUT_NEEDS_TCP.into());
    }
    if let Err(e) = super::check_victim(a, n) {
        // Every rank finds it: only rank 0 says it (the others exit with an error too).
        return Err(if rank == 0 { e } else { String::new() });
    }
    let rooted = matches!(kind, CollKind::Broadcast | CollKind::Reduce);
    if rooted && a.root == victim {
        return Err("the root cannot be the victim".into());
    }
    let e = |e: oxccl::Error| e.to_string();
    let case = case_for(a, kind, rank, n, a.root)?;
    let mut bufs = case.buffers(None).map_err(e)?;
    let (send, recv) = bufs.get();
    case.fill(send, recv);
    comm.barrier().map_err(e)?;
    let mut seen = None;
    for i in 0..a.at_iter + 10_000 {
        if i == a.at_iter && rank == victim {
            if how != How::Cut {
                fail(how, rank, i, a);
                return Ok(());
            }
            cut(rank, i)?;
        }
        let t = Instant::now();
        if let Err(err) = case.call(&comm, send, recv) {
            seen = Some((i, t.elapsed(), err));
            break;
        }
    }
    let (iter, detect, err) = seen.ok_or("no failure seen")?;
    let who = if rank == victim { " (cut)" } else { "" };
    println!(
        "rank {rank}{who}: failure seen at iteration {iter}, {:.1} ms into the call: {err}",
        detect.as_secs_f64() * 1e3
    );
    if rank == victim {
        linger(&comm, rank);
        return Ok(());
    }
    if !matches!(err, oxccl::Error::PeerLost { peer, .. } if peer == victim) {
        return Err(format!(
            "rank {rank}: the failure does not name the lost rank {victim}: {err}"
        ));
    }
    let t = Instant::now();
    let new = comm.shrink(&[victim]).map_err(e)?;
    let recover = t.elapsed();
    // Re-run the same size on the survivors (a rooted call keeps its root, renumbered).
    let (m, me) = (new.world_size(), new.rank());
    let root = if a.root > victim { a.root - 1 } else { a.root };
    let times = [
        rank as f64,
        detect.as_secs_f64() * 1e3,
        recover.as_secs_f64() * 1e3,
    ];
    let out = check_run(&new, a, kind, root, &times)?;
    if me == 0 {
        println!(
            "# failure injection: {} {} B {}, {n} ranks, rank {victim} {} at iteration {}",
            kind.name(),
            a.minbytes,
            case.dtype.name(),
            match how {
                How::Kill if a.launcher_expects_kill == Some(victim) => "killed (SIGKILL)",
                How::Kill => "killed (abrupt exit)",
                How::Stall => "stalled (SIGSTOP)",
                How::Cut => "cut off (silent TCP partition)",
            },
            a.at_iter
        );
        println!(
            "# {:>4} {:>12} {:>12} {:>12} {:>7}",
            "rank", "detect(ms)", "recover(ms)", "rerun(ms)", "#wrong"
        );
        for c in &out.rows {
            println!(
                "  {:>4} {:>12.1} {:>12.1} {:>12.3} {:>7}",
                c[0], c[1], c[2], c[3], c[4]
            );
        }
        println!("# re-run on {m} survivors: {}", out.verdict("survivor"));
    }
    new.barrier().map_err(e)?;
    if !out.ok() {
        return Err("the survivors' results are wrong or differ".into());
    }
    if a.grow {
        grow(&new, a, kind, root, n)?;
    }
    Ok(())
}

/// `--grow`: the survivors (`comm`) take in a replacement rank, back to `n` ranks.
fn grow(
    comm: &Communicator,
    a: &Args,
    kind: CollKind,
    root: usize,
    n: usize,
) -> Result<(), String> {
    let e = |e: oxccl::Error| e.to_string();
    let (m, me) = (comm.world_size(), comm.rank());
    let mut child = None;
    let id = if me == 0 {
        let id = UniqueId::new().map_err(e)?;
        let exe = std::env::current_exe().map_err(|e| format!("--grow: {e}"))?;
        let c = std::process::Command::new(exe)
            .args(std::env::args_os().skip(1))
            .env(oxccl::params::PERF_GROW_JOIN.name, format!("{m}/{n}/{id}"))
            .spawn()
            .map_err(|e| format!("--grow: starting the replacement: {e}"))?;
        child = Some(c);
        Some(id)
    } else {
        None
    };
    let t = Instant::now();
    let grown = comm.grow(n - m, id.as_ref());
    let took = t.elapsed();
    let result = grown
        .map_err(e)
        .and_then(|g| grown_check(&g, a, kind, root, took));
    let waited = child.map_or(Ok(()), |c| reap(c, comm.timeout()));
    result.and(waited)
}

/// Waits (at most `timeout`) for the replacement to leave; it must succeed.
fn reap(mut c: Child, timeout: Duration) -> Result<(), String> {
    let end = Instant::now() + timeout;
    loop {
        match c.try_wait() {
            Ok(Some(s)) if s.success() => return Ok(()),
            Ok(Some(s)) => return Err(format!("the replacement rank failed: {s}")),
            Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = c.kill();
                let _ = c.wait();
                return Err("the replacement rank did not leave in time".into());
            }
            Err(e) => return Err(format!("waiting for the replacement rank: {e}")),
        }
    }
}

/// Every rank of the grown communicator: re-run, check, report (rank 0), agree.
fn grown_check(
    comm: &Communicator,
    a: &Args,
    kind: CollKind,
    root: usize,
    took: Duration,
) -> Result<(), String> {
    let rank = comm.rank();
    let out = check_run(
        comm,
        a,
        kind,
        root,
        &[rank as f64, took.as_secs_f64() * 1e3],
    )?;
    if rank == 0 {
        println!(
            "# grow: a replacement joined as rank {}",
            comm.world_size() - 1
        );
        println!(
            "# {:>4} {:>12} {:>12} {:>7}",
            "rank", "grow(ms)", "rerun(ms)", "#wrong"
        );
        for c in &out.rows {
            println!("  {:>4} {:>12.1} {:>12.3} {:>7}", c[0], c[1], c[2], c[3]);
        }
        println!(
            "# re-run on {} ranks after grow: {}",
            comm.world_size(),
            out.verdict("rank")
        );
    }
    comm.barrier().map_err(|e| e.to_string())?;
    if !out.ok() {
        return Err("the grown communicator's results are wrong or differ".into());
    }
    Ok(())
}

/// The replacement rank started by `--grow`: joins with `RANK/SIZE/UNIQUE_ID`.
pub(super) fn join(spec: &str, a: &Args, kind: CollKind) -> Result<(), String> {
    let bad = || {
        format!(
            "OXCCL_PERF_GROW_JOIN: expected RANK/SIZE/UNIQUE_ID, got '{}'",
            oxccl::params::shown(spec)
        )
    };
    let mut it = spec.splitn(3, '/');
    let rank: usize = it.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let size: usize = it.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let id: UniqueId = it.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let t = Instant::now();
    let comm = Communicator::init(&id, rank, size).map_err(|e| e.to_string())?;
    let took = t.elapsed();
    let root = match a.kill_rank {
        Some(v) if a.root > v => a.root - 1,
        _ => a.root,
    };
    grown_check(&comm, a, kind, root, took)
}
