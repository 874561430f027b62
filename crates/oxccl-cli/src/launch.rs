//! Starting local ranks: `oxccl run`, and `oxccl perf` re-executing itself.
//!
//! Every rank gets the variables torchrun sets (`RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE
//! MASTER_ADDR MASTER_PORT`) plus a fresh random `OXCCL_SECRET`. When a rank fails, the
//! others are stopped (SIGTERM, then SIGKILL after a grace period) and the launcher says
//! which rank failed and how. A failure drill may name one rank whose death by SIGKILL is
//! expected (`oxccl run --expect-kill R`, `oxccl perf --kill-rank R`): that death does not
//! stop the others, as torchrun's elastic agent keeps a job whose survivors go on; every
//! rank then gets [`EXPECT_KILL_ENV`]`=R`.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;

/// `oxccl run` arguments.
#[derive(Args)]
pub struct RunArgs {
    /// Number of ranks to start on this host.
    #[arg(short = 'n', long = "nproc", default_value_t = 2,
          value_parser = crate::args::count(1, crate::args::MAX_LOCAL_RANKS))]
    nproc: usize,
    /// Do not prefix output lines with the rank.
    #[arg(long)]
    no_prefix: bool,
    /// Failure drills: this rank's death by SIGKILL is expected and does not stop the other
    /// ranks (any other failure still does; the ranks get OXCCL_LAUNCH_EXPECTS_KILL=RANK).
    #[arg(long, value_name = "RANK", value_parser = crate::args::count(0, crate::args::MAX_RANK))]
    expect_kill: Option<usize>,
    /// The program and its arguments.
    #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

/// Set by the launcher for every rank when one rank's death by SIGKILL is expected: that
/// rank's number.
pub const EXPECT_KILL_ENV: &str = oxccl::params::LAUNCH_EXPECTS_KILL.name;

/// How the launcher treats the ranks' output.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Prefix each line with `[rank] `.
    Prefixed,
    /// Pass it through unchanged, a whole line at a time (stdout and stderr go through the
    /// launcher, which also reads the errors to blame the right rank).
    Lines,
    /// Leave the ranks' stdout and stderr the launcher's own (a rank may draw a progress bar
    /// on the terminal); the launcher reads no error line.
    Raw,
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The job's secret: `OXCCL_SECRET` when it is exported (32 hex digits; so that `oxccl
/// status` can authenticate the job's agents), else drawn at random. An exported value that
/// is not a secret is an error: replaced silently, `oxccl status` with it would be refused by
/// every agent with no hint why.
fn job_secret() -> Result<String, String> {
    if let Some(v) = std::env::var_os(oxccl::params::SECRET.name) {
        let v = v.to_string_lossy();
        return match oxccl::status::parse_secret(&v) {
            Some(_) => Ok(v.trim().to_string()),
            None => Err(format!(
                "{}={}: expected 32 hex digits (unset it for a random one)",
                oxccl::params::SECRET.name,
                oxccl::params::shown(&v)
            )),
        };
    }
    let mut s = [0u8; 16];
    getrandom::fill(&mut s).map_err(|e| format!("cannot draw a secret: {e}"))?;
    Ok(s.iter().map(|b| format!("{b:02x}")).collect())
}

/// The name of signal `s`, where it is a common one.
fn signal_name(s: i32) -> Option<&'static str> {
    Some(match s {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        5 => "SIGTRAP",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        10 => "SIGUSR1",
        11 => "SIGSEGV",
        12 => "SIGUSR2",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        24 => "SIGXCPU",
        25 => "SIGXFSZ",
        31 => "SIGSYS",
        _ => return None,
    })
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => match signal_name(s) {
            Some(name) => format!("was killed by signal {s} ({name})"),
            None => format!("was killed by signal {s}"),
        },
        _ => "ended abnormally".into(),
    }
}

/// A rank's end, as its waiter thread saw it.
struct Death {
    rank: usize,
    status: std::io::Result<ExitStatus>,
    at: Instant,
}

impl Death {
    fn failed(&self) -> bool {
        !matches!(&self.status, Ok(s) if s.success())
    }

    fn by_signal(&self) -> bool {
        use std::os::unix::process::ExitStatusExt;
        matches!(&self.status, Ok(s) if s.signal().is_some())
    }

    fn by_sigkill(&self) -> bool {
        use std::os::unix::process::ExitStatusExt;
        matches!(&self.status, Ok(s) if s.signal() == Some(libc::SIGKILL))
    }

    fn describe(&self) -> String {
        match &self.status {
            Ok(s) => describe(*s),
            Err(e) => format!("could not be waited for ({e})"),
        }
    }
}

/// How long after the first failure the launcher waits for others before it blames one: the
/// survivors of a killed rank see its death and fail within milliseconds, and the waiter
/// threads may wake in either order (and the ranks' last error lines must be read).
const BLAME_WINDOW: Duration = Duration::from_millis(200);

/// The rank to blame, and how the launcher knows.
struct Blame {
    rank: usize,
    why: String,
}

/// The rank to blame among `failures` (in the order seen), given what each rank's last error
/// line names (`named[r]`, see [`oxccl::blamed_rank`]) and the ranks still `alive`:
/// 1. the first rank killed by a signal (a rank that exits with an error is most often
///    reporting a peer's death);
/// 2. else the rank that the failed ranks' errors name most (a stopped or hung rank does not
///    exit: the others time out waiting on it and say so);
/// 3. else the first failure.
fn blame(failures: &[Death], named: &[Option<usize>], alive: &[usize]) -> Option<Blame> {
    let first = failures.first()?;
    if let Some(d) = failures.iter().find(|d| d.by_signal()) {
        return Some(Blame {
            rank: d.rank,
            why: "it died by a signal; the others' errors followed".into(),
        });
    }
    let mut counts: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
    for d in failures {
        if let Some(Some(b)) = named.get(d.rank) {
            if *b != d.rank {
                counts.entry(*b).or_default().push(d.rank);
            }
        }
    }
    if let Some((&rank, by)) = counts
        .iter()
        .max_by_key(|(r, by)| (by.len(), usize::MAX - **r))
    {
        let state = if alive.contains(&rank) {
            "; it has not exited: stopped, hung or unreachable"
        } else {
            ""
        };
        return Some(Blame {
            rank,
            why: format!(
                "the errors of {} of the {} failed rank(s) name it ({}){state}",
                by.len(),
                failures.len(),
                oxccl::rank_list(by)
            ),
        });
    }
    Some(Blame {
        rank: first.rank,
        why: "it failed first and no error names another rank".into(),
    })
}

/// What each rank's latest error line names ([`oxccl::blamed_rank`]), by rank.
type Named = Arc<std::sync::Mutex<Vec<Option<usize>>>>;

fn pump(
    rank: usize,
    src: impl std::io::Read + Send + 'static,
    to_stderr: bool,
    mode: Output,
    named: Option<Named>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(src);
        let mut line = Vec::new();
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if let Some(named) = &named {
                        if let Some(b) = oxccl::blamed_rank(&String::from_utf8_lossy(&line)) {
                            if let Some(slot) = named
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .get_mut(rank)
                            {
                                *slot = Some(b);
                            }
                        }
                    }
                    let mut out: Box<dyn Write> = if to_stderr {
                        Box::new(std::io::stderr().lock())
                    } else {
                        Box::new(std::io::stdout().lock())
                    };
                    if mode == Output::Prefixed {
                        let _ = write!(out, "[{rank}] ");
                    }
                    let _ = out.write_all(&line);
                    let _ = out.flush();
                }
            }
        }
    })
}

/// Where the launched ranks outnumber the CPUs this launcher may use, each is bound to one of
/// them, round-robin (`OXCCL_BIND=none` turns it off), as `mpirun` binds its ranks: unbound,
/// the kernel's balancer moves ranks between CPUs, and an uneven split (5 ranks on one CPU, 3
/// on the other) slows every collective for as long as it lasts (8 ranks on 2 CPUs, 8 B to
/// 128 B all_reduce: 10 of 54 rows at 7.4–9.7 µs unbound, none above 6.5 µs bound, 18 runs
/// each; the other rows 5.3–6.2 µs either way). With a CPU or more
/// per rank nothing is bound (a rank's own threads may need several).
struct Binding {
    /// The launcher's CPUs, and its own mask to restore.
    cpus: Vec<usize>,
    saved: Option<rustix::thread::CpuSet>,
}

impl Binding {
    fn new(n: usize) -> Binding {
        let off = Binding {
            cpus: Vec::new(),
            saved: None,
        };
        // Checked at start-up (main.rs): a refused value never gets here.
        if oxccl::params::BIND.choice().ok().flatten() == Some("none") {
            return off;
        }
        let Ok(mask) = rustix::thread::sched_getaffinity(None) else {
            return off;
        };
        let cpus: Vec<usize> = (0..rustix::thread::CpuSet::MAX_CPU)
            .filter(|&c| mask.is_set(c))
            .collect();
        if cpus.is_empty() || n <= cpus.len() {
            return off;
        }
        Binding {
            cpus,
            saved: Some(mask),
        }
    }

    /// Restricts this thread to rank `rank`'s CPU, so that the child spawned next inherits it.
    fn before_spawn(&self, rank: usize) {
        if self.saved.is_some() {
            let mut one = rustix::thread::CpuSet::new();
            one.set(self.cpus[rank % self.cpus.len()]);
            let _ = rustix::thread::sched_setaffinity(None, &one);
        }
    }
}

impl Drop for Binding {
    fn drop(&mut self) {
        if let Some(m) = &self.saved {
            let _ = rustix::thread::sched_setaffinity(None, m);
        }
    }
}

/// Starts `n` ranks of `program args`, waits for them, and returns the exit code: 0 when all
/// succeed; otherwise the failing rank is reported, the others stopped, and 1 returned. The
/// death of rank `expect_kill` by SIGKILL is not a failure.
pub fn launch(
    n: usize,
    program: &str,
    args: &[String],
    mode: Output,
    extra_env: &[(&str, String)],
    expect_kill: Option<usize>,
) -> i32 {
    if n == 0 {
        eprintln!("oxccl: need at least one rank");
        return 2;
    }
    let secret = match job_secret() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("oxccl: {e}");
            return 2;
        }
    };
    let port = match free_port() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("oxccl: cannot prepare the rendezvous: {e}");
            return 1;
        }
    };
    // SAFETY: getpid has no preconditions.
    let launcher = unsafe { libc::getpid() };
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut pumps = Vec::new();
    let named: Named = Arc::new(std::sync::Mutex::new(vec![None; n]));
    let binding = Binding::new(n);
    for rank in 0..n {
        binding.before_spawn(rank);
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env(oxccl::params::SECRET.name, &secret)
            .stdin(Stdio::null())
            // Each rank leads its own process group, so that stopping a rank stops whatever it
            // started too; the launcher forwards SIGINT/SIGTERM/SIGHUP to every group.
            .process_group(0);
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        if let Some(r) = expect_kill {
            cmd.env(EXPECT_KILL_ENV, r.to_string());
        }
        if mode != Output::Raw {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        // A rank never outlives its launcher: killed (even by SIGKILL, which no handler
        // sees), the launcher can stop no one, so the kernel kills each rank when the thread
        // that started it (this one, the launcher's main thread) ends. A launcher killed
        // between fork and the prctl is caught by the parent check after it.
        // SAFETY: the closure runs in the child between fork and exec and calls only
        // async-signal-safe functions (prctl, getppid, _exit), allocating nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != launcher {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        match cmd.spawn() {
            Ok(mut child) => {
                if let Some(o) = child.stdout.take() {
                    pumps.push(pump(rank, o, false, mode, None));
                }
                // (Each pump writes a whole line under the stream's lock: ranks' lines do
                // not interleave mid-line.)
                if let Some(e) = child.stderr.take() {
                    pumps.push(pump(rank, e, true, mode, Some(named.clone())));
                }
                children.push((rank, child));
            }
            Err(e) => {
                eprintln!("oxccl: cannot start rank {rank} ({program}): {e}");
                for (_, c) in &mut children {
                    if let Some(pid) = rustix::process::Pid::from_raw(c.id() as i32) {
                        let _ =
                            rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
                    }
                    let _ = c.wait();
                }
                return 1;
            }
        }
    }
    // The launcher itself goes back to all its CPUs.
    drop(binding);
    let signal = Arc::new(AtomicUsize::new(0));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        // Registration only fails for forbidden signals; these are not.
        let _ = signal_hook::flag::register_usize(sig, signal.clone(), sig as usize);
    }
    // One waiter thread per rank reports its end with the time it saw it, so that the
    // launcher can tell which rank failed first.
    let (tx, rx) = std::sync::mpsc::channel::<Death>();
    let mut alive: Vec<(usize, u32)> = Vec::with_capacity(children.len());
    for (rank, mut child) in children {
        alive.push((rank, child.id()));
        let tx = tx.clone();
        std::thread::spawn(move || {
            let status = child.wait();
            let _ = tx.send(Death {
                rank,
                status,
                at: Instant::now(),
            });
        });
    }
    drop(tx);
    let mut code = 0;
    let mut failures: Vec<Death> = Vec::new();
    while !alive.is_empty() {
        let sig = signal.load(Ordering::Relaxed);
        if sig != 0 {
            eprintln!("oxccl: got signal {sig}; stopping {} rank(s)", alive.len());
            stop_all(&mut alive, &rx);
            code = 128 + sig as i32;
            break;
        }
        if let Some(first) = failures.first() {
            if first.at.elapsed() >= BLAME_WINDOW {
                let still: Vec<usize> = alive.iter().map(|(r, _)| *r).collect();
                let named = named.lock().unwrap_or_else(|e| e.into_inner()).clone();
                eprintln!(
                    "oxccl: {}; stopping the other {} rank(s)",
                    summary(&failures, &named, &still),
                    alive.len()
                );
                stop_all(&mut alive, &rx);
                code = 1;
                break;
            }
        }
        match rx.recv_timeout(Duration::from_millis(10)) {
            Ok(d) => {
                alive.retain(|(r, _)| *r != d.rank);
                if Some(d.rank) == expect_kill && d.by_sigkill() {
                    eprintln!(
                        "oxccl: rank {} {}, as expected; the other ranks go on",
                        d.rank,
                        d.describe()
                    );
                } else if d.failed() {
                    failures.push(d);
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    for p in pumps {
        let _ = p.join();
    }
    if code == 0 && !failures.is_empty() {
        let named = named.lock().unwrap_or_else(|e| e.into_inner()).clone();
        eprintln!("oxccl: {}", summary(&failures, &named, &[]));
        code = 1;
    }
    code
}

/// "rank 1 was killed by signal 9 (SIGKILL) first (then rank 0 exited with code 1); blamed:
/// it died by a signal; the others' errors followed". At most 8 other ranks are listed.
fn summary(failures: &[Death], named: &[Option<usize>], alive: &[usize]) -> String {
    let Some(b) = blame(failures, named, alive) else {
        return "no rank failed".into();
    };
    let others: Vec<String> = failures
        .iter()
        .filter(|o| o.rank != b.rank)
        .map(|o| format!("rank {} {}", o.rank, o.describe()))
        .collect();
    let then = match others.len() {
        0 => String::new(),
        n if n <= 8 => format!(" (then {})", others.join(", ")),
        n => format!(" (then {} and {} more)", others[..8].join(", "), n - 8),
    };
    let what = match failures.iter().find(|d| d.rank == b.rank) {
        Some(d) => format!("rank {} {} first{then}", d.rank, d.describe()),
        None => format!(
            "rank {} is to blame{}",
            b.rank,
            then.replacen(" (then ", " (failed: ", 1)
        ),
    };
    format!("{what}; blamed: {}", b.why)
}

/// Stops the ranks still `alive` (SIGTERM to each one's process group, SIGKILL after 3 s)
/// and waits for their waiter threads to see them end.
fn stop_all(alive: &mut Vec<(usize, u32)>, ended: &std::sync::mpsc::Receiver<Death>) {
    let signal_all = |sig: rustix::process::Signal, alive: &[(usize, u32)]| {
        for (_, pid) in alive {
            if let Some(pid) = rustix::process::Pid::from_raw(*pid as i32) {
                // The child leads its own process group (see `launch`): signal the group.
                let _ = rustix::process::kill_process_group(pid, sig);
            }
        }
    };
    let reap = |alive: &mut Vec<(usize, u32)>, until: Instant| {
        while !alive.is_empty() {
            let left = until.saturating_duration_since(Instant::now());
            match ended.recv_timeout(left) {
                Ok(d) => alive.retain(|(r, _)| *r != d.rank),
                Err(_) => break,
            }
        }
    };
    signal_all(rustix::process::Signal::TERM, alive);
    reap(alive, Instant::now() + Duration::from_secs(3));
    signal_all(rustix::process::Signal::KILL, alive);
    reap(alive, Instant::now() + Duration::from_secs(10));
    alive.clear();
}

/// A subcommand that is either one rank of a launched job (under torchrun, srun, mpirun or
/// `oxccl run`: `rank_main` runs here) or the launcher of `ranks` local copies of this very
/// command line, each with `env` added (and `expect_kill` as in [`launch`]), their output
/// treated as `mode` says. Returns the exit code; `name` prefixes messages.
pub fn rank_or_launch(
    name: &str,
    mode: Output,
    under_launcher: bool,
    ranks: usize,
    env: &[(&str, String)],
    expect_kill: Option<usize>,
    rank_main: impl FnOnce() -> Result<(), String>,
) -> i32 {
    if under_launcher {
        return match rank_main() {
            Ok(()) => 0,
            Err(e) => {
                // An empty message: another rank (rank 0) reports the same error.
                if !e.is_empty() {
                    eprintln!("oxccl {name}: {e}");
                }
                1
            }
        };
    }
    let exe = match std::env::current_exe() {
        Ok(p) => p.to_string_lossy().into_owned(),
        Err(e) => {
            eprintln!("oxccl {name}: cannot find my own executable: {e}");
            return 1;
        }
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    launch(ranks, &exe, &args, mode, env, expect_kill)
}

/// `oxccl run`.
pub fn run_main(a: RunArgs) -> i32 {
    let mode = if a.no_prefix {
        Output::Raw
    } else {
        Output::Prefixed
    };
    launch(
        a.nproc,
        &a.command[0],
        &a.command[1..],
        mode,
        &[],
        a.expect_kill,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn death(rank: usize, raw: i32) -> Death {
        Death {
            rank,
            status: Ok(ExitStatus::from_raw(raw)),
            at: Instant::now(),
        }
    }

    #[test]
    fn the_killed_rank_is_blamed_over_the_first_to_exit() {
        // Rank 0 exits with an error naming rank 0's link (relayed), then rank 2 is seen
        // killed: rank 2 is blamed.
        let f = [death(0, 1 << 8), death(2, libc::SIGKILL)];
        let s = summary(&f, &[Some(0), None, None, None], &[1, 3]);
        assert!(
            s.starts_with("rank 2 was killed by signal 9 (SIGKILL) first (then rank 0 exited with code 1); blamed: it died by a signal"),
            "{s}"
        );
    }

    #[test]
    fn a_stopped_rank_is_blamed_by_the_errors_that_name_it() {
        // Rank 2 is stopped: the others time out and name it; rank 1 happened to exit first.
        let f = [death(1, 1 << 8), death(0, 1 << 8), death(3, 1 << 8)];
        let s = summary(&f, &[Some(2), Some(2), None, Some(1)], &[2]);
        assert!(s.starts_with("rank 2 is to blame (failed: rank 1 exited with code 1, rank 0 exited with code 1, rank 3 exited with code 1); blamed: the errors of 2 of the 3 failed rank(s) name it ([1, 0]); it has not exited"), "{s}");
        // Nothing named: the first failure.
        let s = summary(&f, &[None; 4], &[]);
        assert!(s.starts_with("rank 1 exited with code 1 first"), "{s}");
        assert!(s.ends_with("no error names another rank"), "{s}");
    }

    #[test]
    fn the_summary_stays_short_for_many_ranks() {
        let f: Vec<Death> = (0..1000).map(|r| death(r, 1 << 8)).collect();
        let s = summary(&f, &[], &[]);
        assert!(s.len() < 600 && s.contains("and 991 more"), "{}", s.len());
    }
}
