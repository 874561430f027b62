//! `oxccl perf`: nccl-tests' `*_perf` for oxccl.
//!
//! Columns, sizes and bandwidths follow nccl-tests (doc/PERFORMANCE.md there): `size` is the
//! buffer for all_reduce, broadcast, reduce and sendrecv, the gathered output for all_gather,
//! the input for reduce_scatter, and the whole send buffer for all_to_all; `algbw = size /
//! time`; `busbw = algbw × factor` with factor 2(n-1)/n for all_reduce, (n-1)/n for
//! all_gather, reduce_scatter and all_to_all, and 1 for broadcast, reduce and sendrecv.
//! Times are averages over `-n` iterations after `-w` warm-up ones, the slowest rank's; `cpu`
//! is the CPU time (user + system, all threads) of all ranks together per call, over the same
//! iterations.

use std::fs::File;
use std::io::Write;
use std::time::Instant;

use clap::Args as ClapArgs;
use oxccl::check::Case;
use oxccl::{CollKind, Communicator, DataType, ReduceOp};
use serde::Serialize;

use oxccl::params::{ALGO, TRANSPORT};

use crate::args::{self, MAX_ITERS as MAX_ITER_ARG, MAX_LOCAL_RANKS, MAX_PERF_BYTES, MAX_RANK};
use crate::launch::rank_or_launch;

mod inject;
pub(crate) mod runq;

/// `oxccl perf` arguments (nccl-tests' names).
#[derive(ClapArgs, Clone)]
pub struct Args {
    /// all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all, sendrecv, gather,
    /// scatter or all_to_allv (gather, scatter, all_to_allv: blocks of one size, sizes as
    /// all_gather's: the root's whole buffer, every rank's for all_to_allv).
    collective: String,
    /// Smallest size in bytes (K, M, G suffixes; at most 1024G).
    #[arg(short = 'b', long = "minbytes", default_value = "32M", value_parser = args::bytes(0, MAX_PERF_BYTES))]
    minbytes: usize,
    /// Largest size in bytes (at most 1024G, and what this host's memory holds).
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = args::bytes(0, MAX_PERF_BYTES))]
    maxbytes: usize,
    /// Multiply the size by this factor between rows (2 to 1024; 1 where -b equals -e).
    #[arg(short = 'f', long = "stepfactor", value_parser = args::count(1, 1024))]
    stepfactor: Option<usize>,
    /// Add this many bytes between rows (instead of -f).
    #[arg(short = 'i', long = "stepbytes", value_parser = args::bytes(1, MAX_PERF_BYTES))]
    stepbytes: Option<usize>,
    /// Timed iterations per size. Default: at least 20, more for small sizes, so that each
    /// row times about 20 ms of calls (fewer hiccups of a shared machine in the average).
    #[arg(short = 'n', long = "iters", value_parser = args::count(1, MAX_ITER_ARG))]
    iters: Option<usize>,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5, value_parser = args::count(0, MAX_ITER_ARG))]
    warmup: usize,
    /// Check results (1) and count wrong elements, or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1, value_parser = args::count(0, 1))]
    check: usize,
    /// Buffers: private memory (0), or shared buffers from `Communicator::alloc_shared` (1),
    /// which peers on this host map (nccl-tests' `-R`, registered buffers). Default:
    /// OXCCL_PERF_REGISTER, else 0.
    #[arg(short = 'R', long = "register", value_parser = args::count(0, 1))]
    register: Option<usize>,
    /// Data type (float, half, bfloat16, int32, ...) or `all`.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    datatype: String,
    /// Reduction op (sum, prod, min, max, avg, band, bor, bxor, premul_sum:SCALAR) or `all`.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    op: String,
    /// Root of broadcast, reduce, gather and scatter.
    #[arg(short = 'r', long = "root", default_value_t = 0, value_parser = args::count(0, MAX_RANK))]
    root: usize,
    /// Ranks to start on this host, 1 to 1024 (ignored under a launcher, which says how many).
    #[arg(long, default_value_t = 2, value_parser = args::count(1, MAX_LOCAL_RANKS))]
    ranks: usize,
    /// Transport: auto, shm or tcp (sets OXCCL_TRANSPORT for the ranks).
    #[arg(long, value_parser = args::word(&["auto", "shm", "tcp", "socket"]))]
    transport: Option<String>,
    /// Force an algorithm (sets OXCCL_ALGO for the ranks).
    #[arg(long, value_parser = args::algo)]
    algo: Option<String>,
    /// Also write one JSON object per row and placement to this file.
    #[arg(long, value_parser = args::text(4096))]
    json: Option<String>,
    /// Failure injection: this rank is killed (SIGKILL; under a launcher other than this
    /// command's own, an abrupt exit with status 0) at --at-iter; the survivors report the
    /// time to detect, shrink, re-run and check (see perf/inject.rs).
    #[arg(long, value_name = "RANK", conflicts_with = "stall_rank", value_parser = args::count(0, MAX_RANK))]
    kill_rank: Option<usize>,
    /// Failure injection: this rank stops itself (SIGSTOP) at --at-iter for --stall-secs.
    #[arg(long, value_name = "RANK", value_parser = args::count(0, MAX_RANK))]
    stall_rank: Option<usize>,
    /// Failure injection (TCP only): this rank is cut off the network at --at-iter, as a
    /// silent partition (every packet to its TCP sockets dropped; no FIN, no RST).
    #[arg(long, value_name = "RANK", conflicts_with_all = ["kill_rank", "stall_rank"], value_parser = args::count(0, MAX_RANK))]
    cut_rank: Option<usize>,
    /// The iteration at which the injected failure happens.
    #[arg(long, value_name = "I", default_value_t = 10, value_parser = args::count(0, MAX_ITER_ARG))]
    at_iter: usize,
    /// How long a stalled rank stays stopped before it resumes and leaves (at most an hour).
    #[arg(long, value_name = "SECS", default_value_t = 8.0, value_parser = args::seconds(3600.0))]
    stall_secs: f64,
    /// With --kill-rank: after the survivors' re-run, start a replacement rank, `grow` back to
    /// the original size, re-run the same size and check (see perf/inject.rs).
    #[arg(long, requires = "kill_rank")]
    grow: bool,
    /// Internal (OXCCL_LAUNCH_EXPECTS_KILL, set by this command's launcher): the rank whose
    /// SIGKILL it expects.
    #[arg(skip)]
    launcher_expects_kill: Option<usize>,
    /// Internal (OXCCL_PERF_GROW_JOIN, set by --grow for the replacement it starts):
    /// `RANK/SIZE/UNIQUE_ID` to join.
    #[arg(skip)]
    grow_join: Option<String>,
}

pub(crate) fn under_launcher() -> bool {
    ["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// Entry point: start ranks, or be one.
pub fn main(mut a: Args) -> i32 {
    // The variables some flags default to, through the table (checked at start-up, main.rs).
    use oxccl::params::{LAUNCH_EXPECTS_KILL, PERF_GROW_JOIN, PERF_REGISTER};
    let from_env = (|| -> oxccl::Result<()> {
        if a.register.is_none() {
            a.register = PERF_REGISTER.count()?.map(|n| n as usize);
        }
        a.launcher_expects_kill = LAUNCH_EXPECTS_KILL.count()?.map(|n| n as usize);
        a.grow_join = PERF_GROW_JOIN.text()?;
        Ok(())
    })();
    if let Err(e) = from_env {
        eprintln!("oxccl perf: {e}");
        return 2;
    }
    if let Err(e) = validate(&a) {
        eprintln!("oxccl perf: {e}");
        return 2;
    }
    let rank = under_launcher();
    if !rank {
        // Checked once here, before any rank starts: otherwise every rank would say it.
        if let Err(e) = check_victim(&a, a.ranks) {
            eprintln!("oxccl perf: {e}");
            return 2;
        }
    }
    if rank {
        // One rank of a launched job: --transport and --algo apply to this process.
        // Set before any thread starts.
        if let Some(t) = &a.transport {
            std::env::set_var(TRANSPORT.name, t);
        }
        if let Some(al) = &a.algo {
            std::env::set_var(ALGO.name, al);
        }
    }
    let mut env = Vec::new();
    if let Some(t) = &a.transport {
        env.push((TRANSPORT.name, t.clone()));
    }
    if let Some(al) = &a.algo {
        env.push((ALGO.name, al.clone()));
    }
    rank_or_launch(
        "perf",
        crate::launch::Output::Lines,
        rank,
        a.ranks,
        &env,
        a.kill_rank,
        || rank_main(&a),
    )
}

fn kind_of(name: &str) -> Result<CollKind, String> {
    Ok(match name.trim_end_matches("_perf") {
        "all_reduce" | "allreduce" => CollKind::AllReduce,
        "broadcast" | "bcast" => CollKind::Broadcast,
        "reduce" => CollKind::Reduce,
        "all_gather" | "allgather" => CollKind::AllGather,
        "reduce_scatter" | "reducescatter" => CollKind::ReduceScatter,
        "all_to_all" | "alltoall" => CollKind::AllToAll,
        "sendrecv" => CollKind::SendRecv { to: 0, from: 0 },
        "gather" => CollKind::Gather,
        "scatter" => CollKind::Scatter,
        "all_to_allv" | "alltoallv" => CollKind::AllToAllV,
        _ => {
            return Err(format!(
                "unknown collective '{}' (expected all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all, sendrecv, gather, scatter or all_to_allv)",
                oxccl::params::shown(name)
            ))
        }
    })
}

fn dtypes(s: &str) -> Result<Vec<DataType>, String> {
    if s == "all" {
        return Ok(DataType::ALL.to_vec());
    }
    s.split(',').map(|d| d.parse()).collect()
}

/// The ops of `-o` for `dtype` (`all`: every op defined on it).
fn ops(s: &str, kind: CollKind, dtype: DataType) -> Result<Vec<ReduceOp>, String> {
    if !kind.reduces() {
        return Ok(vec![ReduceOp::Sum]);
    }
    if s == "all" {
        return Ok(oxccl::check::ops(dtype));
    }
    let ops = s
        .split(',')
        .map(|o| o.parse())
        .collect::<Result<Vec<ReduceOp>, String>>()?;
    for op in &ops {
        op.check(dtype)?;
    }
    Ok(ops)
}

/// The rank a failure injection targets (`--kill-rank`, `--stall-rank`, `--cut-rank`) must
/// be one of `n` ranks, at least 2.
pub(crate) fn check_victim(a: &Args, n: usize) -> Result<(), String> {
    let (flag, victim) = match (a.kill_rank, a.stall_rank, a.cut_rank) {
        (Some(r), _, _) => ("--kill-rank", r),
        (_, Some(r), _) => ("--stall-rank", r),
        (_, _, Some(r)) => ("--cut-rank", r),
        _ => return Ok(()),
    };
    if n < 2 || victim >= n {
        return Err(format!(
            "{flag} {victim}: rank {victim} is not one of {n} ranks (at least 2 ranks, numbered 0 to {})",
            n.saturating_sub(1).max(1)
        ));
    }
    Ok(())
}

fn validate(a: &Args) -> Result<(), String> {
    let kind = kind_of(&a.collective)?;
    let shown = oxccl::params::shown;
    for dtype in dtypes(&a.datatype).map_err(|e| format!("-d {}: {e}", shown(&a.datatype)))? {
        ops(&a.op, kind, dtype).map_err(|e| format!("-o {}: {e}", shown(&a.op)))?;
    }
    if a.minbytes > a.maxbytes {
        return Err(format!(
            "-b {} is larger than -e {}",
            a.minbytes, a.maxbytes
        ));
    }
    if a.stepfactor == Some(1) && a.minbytes != a.maxbytes {
        return Err("-f must be at least 2".into());
    }
    let sizes = sizes(a)?;
    // What the largest row needs, before any rank starts (each rank checks again, with the
    // launcher's rank count, before it allocates).
    if !under_launcher() {
        if let Some(&max) = sizes.last() {
            for dtype in dtypes(&a.datatype)? {
                let (count, _, _) = shape(kind, max, dtype.size(), a.ranks);
                let case = Case {
                    kind,
                    dtype,
                    op: ReduceOp::Sum,
                    root: 0,
                    count,
                    in_place: false,
                    rank: 0,
                    nranks: a.ranks,
                };
                let (s, r) = case.sizes();
                let total = (s as u64)
                    .saturating_add(r as u64)
                    .saturating_mul(a.ranks as u64);
                oxccl::check_fits(
                    total,
                    &format!(
                        "-e {max}: {} rank(s) with {s} + {r} bytes of buffers each",
                        a.ranks
                    ),
                )?;
            }
        }
    }
    if a.cut_rank.is_some() {
        // --transport, else OXCCL_TRANSPORT.
        let t = match &a.transport {
            Some(t) => t.parse().ok(),
            None => oxccl::Config::from_env().ok().map(|c| c.transport),
        };
        if t != Some(oxccl::TransportChoice::Tcp) {
            return Err(inject::CUT_NEEDS_TCP.into());
        }
    }
    Ok(())
}

/// The most rows (sizes) one run measures.
const MAX_ROWS: usize = 4096;

/// The sizes of the rows, from -b to -e by -f or -i; more than [`MAX_ROWS`] is an error.
fn sizes(a: &Args) -> Result<Vec<usize>, String> {
    let mut v = Vec::new();
    let mut s = a.minbytes;
    loop {
        if v.len() == MAX_ROWS {
            return Err(format!(
                "-b {} to -e {} makes more than {MAX_ROWS} rows: use a larger -f or -i",
                a.minbytes, a.maxbytes
            ));
        }
        v.push(s);
        let next = match (a.stepbytes, a.stepfactor) {
            (Some(i), None) => s.checked_add(i),
            (_, f) => s.checked_mul(f.unwrap_or(2)).map(|n| n.max(s + 1)),
        };
        match next {
            Some(n) if n <= a.maxbytes => s = n,
            _ => break,
        }
    }
    Ok(v)
}

fn bus_factor(kind: CollKind, n: usize) -> f64 {
    let n = n as f64;
    match kind {
        CollKind::AllReduce => 2.0 * (n - 1.0) / n,
        CollKind::AllGather
        | CollKind::ReduceScatter
        | CollKind::AllToAll
        | CollKind::AllToAllV
        | CollKind::Gather
        | CollKind::Scatter => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// (count for the Case, elements printed in the count column, bytes actually moved).
fn shape(kind: CollKind, bytes: usize, es: usize, n: usize) -> (usize, usize, usize) {
    let elems = bytes / es;
    match kind {
        CollKind::AllGather
        | CollKind::ReduceScatter
        | CollKind::AllToAll
        | CollKind::AllToAllV
        | CollKind::Gather
        | CollKind::Scatter => {
            let per = elems / n;
            (per, per * n, per * n * es)
        }
        _ => (elems, elems, elems * es),
    }
}

#[derive(Serialize)]
struct Row<'a> {
    collective: &'a str,
    bytes: usize,
    count: usize,
    dtype: &'a str,
    op: &'a str,
    root: i64,
    ranks: usize,
    transport: &'a str,
    algo: &'a str,
    in_place: bool,
    time_us: f64,
    cpu_us: f64,
    /// The part of `cpu_us` spent in the kernel (system time), summed over ranks.
    sys_us: f64,
    /// Time the ranks' threads waited for a CPU per call, summed over ranks (absent where
    /// the kernel keeps no scheduler statistics).
    #[serde(skip_serializing_if = "Option::is_none")]
    runq_wait_us: Option<f64>,
    algbw_gbps: f64,
    busbw_gbps: f64,
    wrong: Option<u64>,
}

/// Timed work per row when `-n` is not given.
const ADAPTIVE_TARGET_SECS: f64 = 0.02;
/// nccl-tests' default iteration count: the least a row runs.
const MIN_ITERS: usize = 20;
/// The most a row runs.
const MAX_ITERS: usize = 100_000;

struct Measured {
    time_us: f64,
    cpu_us: f64,
    sys_us: f64,
    runq_wait_us: Option<f64>,
    wrong: Option<u64>,
    algo: &'static str,
}

fn measure(comm: &Communicator, case: &Case, a: &Args) -> oxccl::Result<Measured> {
    let (s, r) = case.sizes();
    let local = comm.local_size() as u64;
    oxccl::check_fits(
        (s as u64 + r as u64).saturating_mul(local),
        &format!("{local} rank(s) on this host with {s} + {r} bytes of buffers each"),
    )
    .map_err(|msg| oxccl::Error::InvalidArgument {
        rank: comm.rank(),
        call: "perf",
        seq: 0,
        msg,
    })?;
    let mut bufs = case.buffers((a.register == Some(1)).then_some(comm))?;
    let (send, recv) = bufs.get();
    case.fill(send, recv);
    let t = time_calls(comm, case, send, recv, a.warmup, a.iters)?;
    let wrong = if a.check == 1 {
        case.fill(send, recv);
        case.call(comm, send, recv)?;
        let mut w = [case.wrong(recv) as u64];
        comm.all_reduce_in_place(&mut w, ReduceOp::Sum)?;
        Some(w[0])
    } else {
        None
    };
    Ok(Measured {
        time_us: t.secs * 1e6,
        cpu_us: t.cpu * 1e6,
        sys_us: t.sys * 1e6,
        runq_wait_us: t.runq_wait.map(|w| w * 1e6),
        wrong,
        algo: t.algo,
    })
}

/// What [`time_calls`] measures, per call.
pub(crate) struct Timed {
    /// The slowest rank's wall time.
    pub(crate) secs: f64,
    /// The algorithm that ran.
    pub(crate) algo: &'static str,
    /// CPU time, summed over ranks.
    cpu: f64,
    /// The part of `cpu` spent in the kernel, summed over ranks.
    sys: f64,
    /// Time the ranks' threads waited for a CPU ([`runq`]), summed over ranks; `None` where
    /// any rank cannot read it.
    pub(crate) runq_wait: Option<f64>,
}

/// This process's CPU time so far (user + system, all threads), in seconds.
fn cpu_now() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// This process's system (kernel) CPU seconds so far, all threads; NaN if unreadable.
fn sys_now() -> f64 {
    // SAFETY: `rusage` is plain old data, valid when zeroed.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a `rusage`, which getrusage fills.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut r) } != 0 {
        return f64::NAN;
    }
    r.ru_stime.tv_sec as f64 + r.ru_stime.tv_usec as f64 * 1e-6
}

/// Seconds one call of `case` takes, the slowest rank's average over `iters` calls (by
/// default as many as fit about 20 ms) after `warmup` calls, the algorithm that ran, and the
/// CPU seconds one call costs and the seconds its ranks waited for a CPU, each summed over
/// all ranks. Collective: every rank calls it.
pub(crate) fn time_calls(
    comm: &Communicator,
    case: &Case,
    send: &[u8],
    recv: &mut [u8],
    warmup: usize,
    iters: Option<usize>,
) -> oxccl::Result<Timed> {
    for _ in 0..warmup {
        case.call(comm, send, recv)?;
    }
    let iters = match iters {
        Some(n) => n,
        None => {
            // Time growing batches until two in a row of the same size last 2 ms each, and
            // size the row by the faster: one batch that caught a preemption (milliseconds
            // on a loaded host) would otherwise set a row of 1 µs calls to the minimum
            // count, which one more preemption then dominates (docs/decisions.md, "A short spin on an idle machine").
            // Every rank must run the same count, so each decision uses the slowest rank's
            // time.
            let mut k = 1;
            let mut long: Option<f64> = None;
            loop {
                let t = Instant::now();
                for _ in 0..k {
                    case.call(comm, send, recv)?;
                }
                let mut secs = [t.elapsed().as_secs_f64()];
                comm.all_reduce_in_place(&mut secs, ReduceOp::Max)?;
                if secs[0] >= 0.002 || k >= MAX_ITERS {
                    if let (None, false) = (long, k >= MAX_ITERS) {
                        long = Some(secs[0]);
                        continue;
                    }
                    let secs = long.map_or(secs[0], |l| l.min(secs[0]));
                    break ((ADAPTIVE_TARGET_SECS * k as f64 / secs.max(1e-9)) as usize)
                        .clamp(MIN_ITERS, MAX_ITERS);
                }
                long = None;
                k *= 4;
            }
        }
    };
    // The CPU, system and run-queue readings (two system calls and a /proc read, tens of
    // microseconds) before the barrier, so that the timed loop starts in step on every rank
    // and without them: with `-n 100` they were a third of an 8-byte call's time.
    let (cpu0, sys0, wait0) = (cpu_now(), sys_now(), runq::wait_secs());
    comm.barrier()?;
    let t = Instant::now();
    for _ in 0..iters {
        case.call(comm, send, recv)?;
    }
    let mut secs = [t.elapsed().as_secs_f64() / iters as f64];
    let per_call = |x: f64| x / iters as f64;
    // A rank without scheduler statistics sends NaN, which makes the sum NaN.
    let wait = match (wait0, runq::wait_secs()) {
        (Some(w0), Some(w1)) => per_call(w1 - w0),
        _ => f64::NAN,
    };
    let mut sums = [per_call(cpu_now() - cpu0), wait, per_call(sys_now() - sys0)];
    // Before the reductions below, which run an algorithm of their own.
    let algo = comm.last_algo();
    comm.all_reduce_in_place(&mut secs, ReduceOp::Max)?;
    comm.all_reduce_in_place(&mut sums, ReduceOp::Sum)?;
    Ok(Timed {
        secs: secs[0],
        algo,
        cpu: sums[0],
        sys: sums[2],
        runq_wait: (!sums[1].is_nan()).then_some(sums[1]),
    })
}

fn rank_main(a: &Args) -> Result<(), String> {
    let kind = kind_of(&a.collective)?;
    if let Some(join) = &a.grow_join {
        return inject::join(join, a, kind);
    }
    let comm = Communicator::from_env().map_err(|e| e.to_string())?;
    let (n, rank) = (comm.world_size(), comm.rank());
    if rank == 0 && n != a.ranks && a.ranks != 2 {
        eprintln!(
            "oxccl perf: running with the launcher's {n} ranks, not --ranks {}",
            a.ranks
        );
    }
    if a.root >= n
        && matches!(
            kind,
            CollKind::Broadcast | CollKind::Reduce | CollKind::Gather | CollKind::Scatter
        )
    {
        return Err(format!("root {} is out of range for {n} ranks", a.root));
    }
    if a.kill_rank.is_some() || a.stall_rank.is_some() || a.cut_rank.is_some() {
        return inject::run(comm, a, kind);
    }
    let transport = comm.transport_summary();
    let mut json = match (&a.json, rank) {
        (Some(p), 0) => Some(File::create(p).map_err(|e| format!("--json {p}: {e}"))?),
        _ => None,
    };
    let name = a.collective.trim_end_matches("_perf");
    let out = &mut std::io::stdout();
    if rank == 0 {
        let _ = writeln!(
            out,
            "# oxccl {} perf: {n} ranks, transport {transport}",
            kind.name()
        );
        let iters = a.iters.map_or(
            format!("adaptive ({MIN_ITERS}..{MAX_ITERS}, ~20 ms a row)"),
            |n| n.to_string(),
        );
        let _ = writeln!(
            out,
            "#  iters {iters} warmup {} check {} buffers {}",
            a.warmup,
            a.check,
            if a.register == Some(1) {
                "shared (-R 1)"
            } else {
                "private"
            }
        );
        let _ = writeln!(out, "#{:>97}{:>47}", "out-of-place", "in-place");
        let _ = writeln!(
            out,
            "#{:>11} {:>12} {:>8} {:>6} {:>6} {:>6} {:>10} {:>10} {:>7} {:>7} {:>6} {:>10} {:>10} {:>7} {:>7} {:>6}",
            "size", "count", "type", "redop", "root", "algo", "time", "cpu", "algbw", "busbw", "#wrong", "time", "cpu", "algbw", "busbw", "#wrong"
        );
        let _ = writeln!(
            out,
            "#{:>11} {:>12} {:>8} {:>6} {:>6} {:>6} {:>10} {:>10} {:>7} {:>7} {:>6} {:>10} {:>10} {:>7} {:>7} {:>6}",
            "(B)", "(elements)", "", "", "", "", "(us)", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "(GB/s)", "(GB/s)", ""
        );
        let _ = out.flush();
    }
    // Warm up the whole job (page faults, lazily started threads, CPU clocks) for about
    // 100 ms before the first row, deciding together when to stop.
    let t = Instant::now();
    loop {
        for _ in 0..100 {
            comm.barrier().map_err(|e| e.to_string())?;
        }
        let mut secs = [t.elapsed().as_secs_f64()];
        comm.all_reduce_in_place(&mut secs, ReduceOp::Max)
            .map_err(|e| e.to_string())?;
        if secs[0] >= 0.1 {
            break;
        }
    }
    let factor = bus_factor(kind, n);
    let (mut bw_sum, mut rows, mut total_wrong) = (0.0, 0usize, 0u64);
    // The largest share of the ranks' timed wall time they spent waiting for a CPU.
    let mut most_waiting: Option<f64> = None;
    let rooted = matches!(
        kind,
        CollKind::Broadcast | CollKind::Reduce | CollKind::Gather | CollKind::Scatter
    );
    for dtype in dtypes(&a.datatype)? {
        for op in ops(&a.op, kind, dtype)? {
            for size in sizes(a)? {
                let (count, elems, bytes) = shape(kind, size, dtype.size(), n);
                let mut line = format!(
                    " {:>11} {:>12} {:>8} {:>6} {:>6}",
                    bytes,
                    elems,
                    dtype.name(),
                    if kind.reduces() || kind == CollKind::Broadcast {
                        op.name()
                    } else {
                        "none"
                    },
                    if rooted { a.root as i64 } else { -1 }
                );
                let mut algo_col = "";
                let mut cols = String::new();
                for in_place in [false, true] {
                    let case = Case {
                        kind,
                        dtype,
                        op,
                        root: a.root,
                        count,
                        in_place,
                        rank,
                        nranks: n,
                    };
                    let m = measure(&comm, &case, a).map_err(|e| e.to_string())?;
                    let algbw = if m.time_us > 0.0 {
                        bytes as f64 / (m.time_us * 1e-6) / 1e9
                    } else {
                        0.0
                    };
                    let busbw = algbw * factor;
                    algo_col = m.algo;
                    let wrong = m.wrong.map_or("N/A".to_string(), |w| w.to_string());
                    total_wrong += m.wrong.unwrap_or(0);
                    cols += &format!(
                        " {:>10.2} {:>10.2} {:>7.3} {:>7.3} {:>6}",
                        m.time_us, m.cpu_us, algbw, busbw, wrong
                    );
                    bw_sum += busbw;
                    rows += 1;
                    if let Some(w) = m.runq_wait_us.filter(|_| m.time_us > 0.0) {
                        let share = w / (m.time_us * n as f64);
                        most_waiting = Some(most_waiting.map_or(share, |s: f64| s.max(share)));
                    }
                    if let Some(f) = json.as_mut() {
                        let row = Row {
                            collective: name,
                            bytes,
                            count: elems,
                            dtype: dtype.name(),
                            op: op.name(),
                            root: if rooted { a.root as i64 } else { -1 },
                            ranks: n,
                            transport: &transport,
                            algo: m.algo,
                            in_place,
                            time_us: m.time_us,
                            cpu_us: m.cpu_us,
                            sys_us: m.sys_us,
                            runq_wait_us: m.runq_wait_us,
                            algbw_gbps: algbw,
                            busbw_gbps: busbw,
                            wrong: m.wrong,
                        };
                        let s = serde_json::to_string(&row).map_err(|e| e.to_string())?;
                        writeln!(f, "{s}").map_err(|e| format!("--json: {e}"))?;
                    }
                }
                line += &format!(" {:>6}", algo_col);
                line += &cols;
                if rank == 0 {
                    let _ = writeln!(out, "{line}");
                    let _ = out.flush();
                }
            }
        }
    }
    if rank == 0 {
        let _ = writeln!(
            out,
            "# Out of bounds values : {} {}",
            total_wrong,
            if total_wrong == 0 { "OK" } else { "FAILED" }
        );
        let _ = writeln!(
            out,
            "# Avg bus bandwidth    : {:.3} ",
            if rows > 0 { bw_sum / rows as f64 } else { 0.0 }
        );
        if let Some(w) = most_waiting {
            // Above a few percent, the times measure the CPU share these ranks got on a
            // shared or oversubscribed machine more than the library.
            let _ = writeln!(
                out,
                "# Waiting for a CPU    : {:.0}% of the ranks' timed wall time (the worst row)",
                w * 100.0
            );
        }
    }
    comm.barrier().map_err(|e| e.to_string())?;
    if total_wrong > 0 {
        return Err(format!("{total_wrong} wrong element(s)"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_follow_nccl_tests() {
        assert_eq!(shape(CollKind::AllGather, 100, 4, 3), (8, 24, 96));
        assert_eq!(shape(CollKind::AllReduce, 100, 4, 3), (25, 25, 100));
        assert_eq!(shape(CollKind::ReduceScatter, 8, 4, 3), (0, 0, 0));
        assert!((bus_factor(CollKind::AllReduce, 4) - 1.5).abs() < 1e-12);
    }
}
