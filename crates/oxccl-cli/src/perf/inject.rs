//! Failure injection in `oxccl perf` (as torchft's and ULFM's tests): `--kill-rank R` or
//! `--stall-rank R` with `--at-iter I`. The ranks run the collective (the first size, type and
//! op of the command line) in a loop; at iteration I the victim fails:
//!
//! - kill: it exits at once, without a goodbye (its sockets are closed by the kernel and its
//!   shared memory is left as it is, as under SIGKILL; the exit status is 0 so that the
//!   launcher, which stops the job when a rank dies by a signal, keeps the survivors);
//! - stall: it stops itself (SIGSTOP: its sockets stay open, its heartbeats stop, as a host
//!   that went away) for `--stall-secs`, then resumes and leaves.
//!
//! Each survivor reports the time to detect (from the start of its call at iteration I to the
//! error), then the survivors `shrink()` the victim out, re-run the same size, and report the
//! time to recover (the shrink), wrong elements against the exact reference, and whether
//! their results agree bitwise (for collectives whose output is the same on every rank).

use std::hash::{Hash, Hasher};
use std::io::Write;
use std::time::Instant;

use oxccl::check::Case;
use oxccl::{CollKind, Communicator};

use super::{dtypes, ops, shape, Args};

#[derive(Clone, Copy, PartialEq)]
enum How {
    Kill,
    Stall,
}

fn fail(how: How, rank: usize, iter: usize, stall_secs: f64) {
    let _ = std::io::stdout().flush();
    match how {
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
                    &format!("sleep {stall_secs}; kill -CONT {}", pid.as_raw_nonzero()),
                ])
                .spawn();
            if let Err(e) = waker {
                eprintln!("rank {rank}: cannot start the waker ({e}); not stalling");
                return;
            }
            eprintln!("rank {rank}: injected failure: stopping (SIGSTOP) for {stall_secs} s at iteration {iter}");
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::STOP);
            eprintln!("rank {rank}: resumed; leaving");
        }
    }
}

fn digest(b: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    b.hash(&mut h);
    h.finish()
}

/// Runs the injection; every rank calls it.
pub(super) fn run(comm: Communicator, a: &Args, kind: CollKind) -> Result<(), String> {
    let (n, rank) = (comm.world_size(), comm.rank());
    let (victim, how) = match (a.kill_rank, a.stall_rank) {
        (Some(r), None) => (r, How::Kill),
        (None, Some(r)) => (r, How::Stall),
        _ => return Err("give one of --kill-rank and --stall-rank".into()),
    };
    if n < 2 || victim >= n {
        return Err(format!(
            "rank {victim} is not one of {n} ranks (at least 2)"
        ));
    }
    let rooted = matches!(kind, CollKind::Broadcast | CollKind::Reduce);
    if rooted && a.root == victim {
        return Err("the root cannot be the victim".into());
    }
    let dtype = dtypes(&a.datatype)?[0];
    let op = ops(&a.op, kind, dtype)?[0];
    let case_for = |rank: usize, nranks: usize, root: usize| {
        let (count, _, _) = shape(kind, a.minbytes, dtype.size(), nranks);
        Case {
            kind,
            dtype,
            op,
            root,
            count,
            in_place: false,
            rank,
            nranks,
        }
    };
    let e = |e: oxccl::Error| e.to_string();
    let case = case_for(rank, n, a.root);
    let mut bufs = case.buffers(None).map_err(e)?;
    let (send, recv) = bufs.get();
    case.fill(send, recv);
    comm.barrier().map_err(e)?;
    let mut seen = None;
    for i in 0..a.at_iter + 10_000 {
        if i == a.at_iter && rank == victim {
            fail(how, rank, i, a.stall_secs);
            return Ok(());
        }
        let t = Instant::now();
        if let Err(err) = case.call(&comm, send, recv) {
            seen = Some((i, t.elapsed(), err));
            break;
        }
    }
    let (iter, detect, err) = seen.ok_or("no failure seen")?;
    println!(
        "rank {rank}: failure seen at iteration {iter}, {:.1} ms into the call: {err}",
        detect.as_secs_f64() * 1e3
    );
    let t = Instant::now();
    let new = comm.shrink(&[victim]).map_err(e)?;
    let recover = t.elapsed();
    // Re-run the same size on the survivors (a rooted call keeps its root, renumbered).
    let (m, me) = (new.world_size(), new.rank());
    let root = if a.root > victim { a.root - 1 } else { a.root };
    let case = case_for(me, m, root);
    let mut bufs = case.buffers(None).map_err(e)?;
    let (send, recv) = bufs.get();
    case.fill(send, recv);
    let t = Instant::now();
    case.call(&new, send, recv).map_err(e)?;
    let rerun = t.elapsed();
    let wrong = case.wrong(recv);
    let mine = [
        rank as f64,
        detect.as_secs_f64() * 1e3,
        recover.as_secs_f64() * 1e3,
        rerun.as_secs_f64() * 1e3,
        wrong as f64,
    ];
    let mut all = vec![0f64; mine.len() * m];
    new.all_gather(&mine, &mut all).map_err(e)?;
    let mut hashes = vec![0u64; m];
    new.all_gather(&[digest(recv)], &mut hashes).map_err(e)?;
    let same_output = matches!(
        kind,
        CollKind::AllReduce | CollKind::Broadcast | CollKind::AllGather
    );
    let agree = hashes.iter().all(|&h| h == hashes[0]);
    let total_wrong: f64 = all.chunks(mine.len()).map(|c| c[4]).sum();
    if me == 0 {
        println!(
            "# failure injection: {} {} B {}, {n} ranks, rank {victim} {} at iteration {}",
            kind.name(),
            a.minbytes,
            dtype.name(),
            if how == How::Kill {
                "killed (abrupt exit)"
            } else {
                "stalled (SIGSTOP)"
            },
            a.at_iter
        );
        println!(
            "# {:>4} {:>12} {:>12} {:>12} {:>7}",
            "rank", "detect(ms)", "recover(ms)", "rerun(ms)", "#wrong"
        );
        for c in all.chunks(mine.len()) {
            println!(
                "  {:>4} {:>12.1} {:>12.1} {:>12.3} {:>7}",
                c[0], c[1], c[2], c[3], c[4]
            );
        }
        println!(
            "# re-run on {m} survivors: {total_wrong} wrong element(s) against the reference; results {}",
            if !same_output {
                "differ by design across ranks (checked against the reference only)".to_string()
            } else if agree {
                "bitwise identical on every survivor".to_string()
            } else {
                "NOT bitwise identical across survivors".to_string()
            }
        );
    }
    new.barrier().map_err(e)?;
    if total_wrong > 0.0 || (same_output && !agree) {
        return Err("the survivors' results are wrong or differ".into());
    }
    Ok(())
}
