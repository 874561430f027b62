//! Every input has a clear error, never a panic, an abort or a hang: each `OXCCL_*` variable
//! of the table and each value-taking flag of `oxccl perf/run/tune/status/sim` gets garbage,
//! negative, zero, huge (1e99, 2^64-1, 2^64) and empty values in a real `oxccl` process.
//! A refused value must end the process with status 2 (or 1 where the library refuses it at
//! init) and a line naming the variable or flag; an accepted one must run.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use oxccl::params::{Scope, PARAMS};

const OXCCL: &str = env!("CARGO_BIN_EXE_oxccl");

const HOSTILE: &[&str] = &[
    "garbage",
    "-3",
    "0",
    "1e99",
    "18446744073709551615",
    "18446744073709551616",
    "",
];

/// A small, quick benchmark run.
const PERF: &[&str] = &[
    "perf",
    "all_reduce",
    "-b",
    "1K",
    "-e",
    "1K",
    "-n",
    "2",
    "-w",
    "1",
];

struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `oxccl ARGS` with `env` in a fresh directory (some variables name files), at most
/// `limit`; a run past it is killed and fails the test as a hang.
fn run(args: &[&str], env: &[(&str, &str)], limit: Duration) -> Ran {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let k = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("oxccl-inputs-{}-{k}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut cmd = Command::new(OXCCL);
    cmd.args(args)
        .current_dir(&dir)
        .env("OXCCL_TIMEOUT", "30")
        .env("OXCCL_TUNE_FILE", "")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for v in [
        "RANK",
        "WORLD_SIZE",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
    ] {
        cmd.env_remove(v);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("oxccl {args:?} with {env:?} hung (killed after {limit:?})");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = std::fs::remove_dir_all(&dir);
    Ran {
        code: status.code(),
        stdout: t_out.join().unwrap(),
        stderr: t_err.join().unwrap(),
    }
}

fn what(r: &Ran) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        r.code, r.stdout, r.stderr
    )
}

/// A refused value: status 2 (or 1, refused by the ranks at init), `name` on stderr, no
/// panic, one short line per error.
fn assert_refused(r: &Ran, name: &str, ctx: &str) {
    assert!(
        matches!(r.code, Some(1 | 2)) && r.stderr.contains(name),
        "{ctx}: expected a refusal naming {name}: {}",
        what(r)
    );
    assert!(!r.stderr.contains("panicked"), "{ctx}: {}", what(r));
    assert!(
        r.stderr.lines().all(|l| l.len() < 1000),
        "{ctx}: an error line of more than 1000 characters: {}",
        what(r)
    );
}

fn assert_ran(r: &Ran, ctx: &str) {
    assert!(
        r.code == Some(0) && r.stdout.contains("Out of bounds values : 0 OK"),
        "{ctx}: expected a good run: {}",
        what(r)
    );
}

/// The variables a process of this crate or the library reads.
fn read_here(scope: Scope) -> bool {
    matches!(
        scope,
        Scope::Comm | Scope::Process | Scope::Cli | Scope::Launch
    )
}

#[test]
fn every_variable_refused_or_run() {
    let limit = Duration::from_secs(90);
    let (mut refused, mut ran) = (0, 0);
    for p in PARAMS.iter().filter(|p| read_here(p.scope)) {
        let mut ran_one = false;
        for v in HOSTILE {
            let ctx = format!("{}={v:?}", p.name);
            let accepted = p.parse_set(v).is_ok();
            if !accepted {
                // Refused at start-up, before any rank starts: cheap, so every value.
                let r = run(PERF, &[(p.name, v)], limit);
                assert_refused(&r, p.name, &ctx);
                assert!(
                    r.stderr.contains(&p.range()),
                    "{ctx}: the accepted range is not named: {}",
                    what(&r)
                );
                refused += 1;
            } else if !ran_one && !v.is_empty() {
                // Accepted: one full run per variable (a run costs about a second). Some
                // accepted values still fail at init, naming the variable (an interface or
                // an algorithm that does not exist, an address that does not resolve).
                ran_one = true;
                let r = run(PERF, &[(p.name, v)], limit);
                if r.code == Some(0) {
                    assert_ran(&r, &ctx);
                    ran += 1;
                } else {
                    assert_refused(&r, p.name, &ctx);
                }
            }
        }
    }
    assert!(
        refused > 100 && ran > 20,
        "only {refused} refusals and {ran} runs"
    );
    eprintln!("{refused} values refused, {ran} accepted ones ran");
    // Every variable set empty at once: all count as unset, and the run works.
    let empty: Vec<(&str, &str)> = PARAMS
        .iter()
        .filter(|p| read_here(p.scope))
        .map(|p| (p.name, ""))
        .filter(|(n, _)| *n != "OXCCL_SECRET") // set empty, an error (docs/environment.md)
        .collect();
    assert_ran(&run(PERF, &empty, limit), "every variable empty");
}

/// (subcommand and its other arguments, the flag, the name its errors may use instead).
fn flags() -> Vec<(Vec<&'static str>, &'static str, &'static str)> {
    let perf = |rest: &[&'static str]| {
        let mut v = vec!["perf", "all_reduce"];
        v.extend_from_slice(rest);
        v
    };
    vec![
        (perf(&["-e", "1K", "-n", "2"]), "--minbytes", "-b"),
        (perf(&["-b", "0", "-n", "2"]), "--maxbytes", "-e"),
        (
            perf(&["-b", "1K", "-e", "4K", "-n", "2"]),
            "--stepfactor",
            "-f",
        ),
        (
            perf(&["-b", "1K", "-e", "4K", "-n", "2"]),
            "--stepbytes",
            "-i",
        ),
        (perf(&["-b", "1K", "-e", "1K"]), "--iters", "-n"),
        (
            perf(&["-b", "1K", "-e", "1K", "-n", "2"]),
            "--warmup_iters",
            "-w",
        ),
        (perf(&["-b", "1K", "-e", "1K", "-n", "2"]), "--check", "-c"),
        (
            perf(&["-b", "1K", "-e", "1K", "-n", "2"]),
            "--register",
            "-R",
        ),
        (perf(&["-b", "1K", "-e", "1K", "-n", "2"]), "--root", "-r"),
        (
            perf(&["-b", "1K", "-e", "1K", "-n", "2"]),
            "--datatype",
            "-d",
        ),
        (perf(&["-b", "1K", "-e", "1K", "-n", "2"]), "--op", "-o"),
        (
            perf(&["-b", "1K", "-e", "1K", "-n", "2"]),
            "--ranks",
            "--ranks",
        ),
        (
            perf(&["-b", "1K", "-e", "1K", "-n", "2"]),
            "--transport",
            "--transport",
        ),
        (
            perf(&["-b", "1K", "-e", "1K", "-n", "2"]),
            "--algo",
            "--algo",
        ),
        (
            perf(&["-b", "1K", "-e", "1K", "-n", "2"]),
            "--kill-rank",
            "--kill-rank",
        ),
        (
            perf(&["-b", "1K", "-e", "1K", "-n", "2"]),
            "--stall-rank",
            "--stall-rank",
        ),
        (
            perf(&["-b", "1K", "-e", "1K", "-n", "2"]),
            "--cut-rank",
            "--cut-rank",
        ),
        (
            perf(&["-b", "1K", "-e", "1K", "-n", "2", "--kill-rank", "1"]),
            "--at-iter",
            "--at-iter",
        ),
        (
            perf(&["-b", "1K", "-e", "1K", "-n", "2", "--stall-rank", "1"]),
            "--stall-secs",
            "--stall-secs",
        ),
        (vec!["run"], "--nproc", "-n"),
        (vec!["run"], "--expect-kill", "--expect-kill"),
        (vec!["tune", "--dry-run"], "--ranks", "--ranks"),
        (vec!["tune", "--dry-run"], "--max-bytes", "--max-bytes"),
        (
            vec!["tune", "--dry-run", "--max-bytes", "64K"],
            "--repeats",
            "--repeats",
        ),
        (
            vec!["tune", "--dry-run", "--max-bytes", "64K"],
            "--max-wait",
            "--max-wait",
        ),
        (vec!["status", "127.0.0.1:9"], "--timeout", "--timeout"),
        (vec!["status", "127.0.0.1:9"], "--watch", "--watch"),
        (vec!["sim", "--hosts", "2", "-e", "8"], "--minbytes", "-b"),
        (vec!["sim", "--hosts", "2"], "--maxbytes", "-e"),
        (vec!["sim", "--hosts", "2", "-e", "8"], "--stepfactor", "-f"),
        (vec!["sim", "-e", "8"], "--hosts", "--hosts"),
        (
            vec!["sim", "-e", "8"],
            "--ranks-per-host",
            "--ranks-per-host",
        ),
        (vec!["sim", "-e", "8"], "--net-gbps", "--net-gbps"),
        (vec!["sim", "-e", "8"], "--net-lat-us", "--net-lat-us"),
        (vec!["sim", "-e", "8"], "--coll", "--coll"),
    ]
}

#[test]
fn every_flag_refused_or_run() {
    let limit = Duration::from_secs(90);
    let mut refused = 0;
    for (base, flag, alias) in flags() {
        for v in HOSTILE {
            // Accepted, but a failure drill (a killed or stopped rank): not run here.
            if *v == "0" && (flag.ends_with("-rank") || flag == "--at-iter") {
                continue;
            }
            let mut args: Vec<String> = base.iter().map(|s| s.to_string()).collect();
            // `--flag=VALUE`: so that clap hands "-3" to the flag, not as an option.
            args.push(format!("{flag}={v}"));
            if base[0] == "run" {
                args.extend(["--".to_string(), "true".to_string()]);
            }
            let ctx = format!("oxccl {args:?}");
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let r = run(&args, &[], limit);
            if r.code == Some(2) {
                let name = if r.stderr.contains(flag) { flag } else { alias };
                assert_refused(&r, name, &ctx);
                refused += 1;
                continue;
            }
            // Accepted: it ran (perf -b 0, -w 0, -c 0, -R 0, -r 0; run --expect-kill 0).
            assert!(!r.stderr.contains("panicked"), "{ctx}: {}", what(&r));
            match base[0] {
                "perf" => assert_ran(&r, &ctx),
                "run" => assert!(r.code == Some(0), "{ctx}: {}", what(&r)),
                "status" => assert!(
                    r.code == Some(1) && r.stderr.contains("no answer"),
                    "{ctx}: {}",
                    what(&r)
                ),
                _ => assert!(matches!(r.code, Some(0 | 1)), "{ctx}: {}", what(&r)),
            }
        }
    }
    assert!(refused > 100, "only {refused} refusals");
}

/// The perf size list is bounded, and a size this host cannot hold is refused before any
/// rank starts.
#[test]
fn perf_sizes_bounded() {
    let limit = Duration::from_secs(30);
    let max = "18446744073709551615";
    let r = run(&["perf", "all_reduce", "-b", max, "-e", max], &[], limit);
    assert_refused(&r, "--minbytes", "-b = -e = 2^64-1");
    let r = run(&["perf", "all_reduce", "-e", max], &[], limit);
    assert_refused(&r, "--maxbytes", "-e 2^64-1");
    let r = run(
        &["perf", "all_reduce", "-b", "1", "-e", "1G", "-i", "1"],
        &[],
        limit,
    );
    assert!(
        r.code == Some(2) && r.stderr.contains("rows"),
        "a million rows: {}",
        what(&r)
    );
    // 1 TiB per buffer on 2 ranks: more than any test machine has.
    let r = run(
        &["perf", "all_reduce", "-b", "1024G", "-e", "1024G"],
        &[],
        limit,
    );
    assert!(
        r.code == Some(2) && r.stderr.contains("MemAvailable"),
        "1 TiB: {}",
        what(&r)
    );
}

/// A world far larger than the ranks that came: the timeout names a few missing ranks and
/// counts the rest, on one short line.
#[test]
fn error_lines_bounded() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let r = run(
        PERF,
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "65536"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", &port),
            ("OXCCL_SECRET", "00112233445566778899aabbccddeeff"),
            ("OXCCL_TIMEOUT", "1"),
            ("OXCCL_STARTUP_REPORT_SECS", "0.5"),
        ],
        Duration::from_secs(60),
    );
    assert_eq!(r.code, Some(1), "{}", what(&r));
    assert!(r.stderr.contains("and 65527 more"), "{}", what(&r));
    assert!(r.stderr.lines().all(|l| l.len() < 1000), "{}", what(&r));
    assert!(r.stderr.len() < 10_000, "{}", what(&r));
}

/// A tune file that is a device (`/dev/zero`), a FIFO or far too big is refused at once with
/// its name, by `oxccl sim --tune-file` and by every rank of `oxccl perf` (not read until
/// memory runs out, not waited on in `open` forever).
#[test]
fn a_tune_file_that_is_a_device_a_fifo_or_huge_is_refused() {
    let dir = std::env::temp_dir().join(format!("oxccl-tunefile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("fifo.conf");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let huge = dir.join("huge.conf");
    std::fs::write(&huge, "# padding\n".repeat(300_000)).unwrap();
    let limit = Duration::from_secs(60);
    for (file, why) in [
        ("/dev/zero", "a device"),
        (fifo.to_str().unwrap(), "a FIFO"),
        (huge.to_str().unwrap(), "larger than"),
    ] {
        let r = run(
            &["sim", "--hosts", "2", "-e", "8", "--tune-file", file],
            &[],
            limit,
        );
        assert_refused(&r, file, "sim --tune-file");
        assert!(r.stderr.contains(why), "{}", what(&r));
        let mut perf = PERF.to_vec();
        perf.extend(["--ranks", "2"]);
        let r = run(&perf, &[("OXCCL_TUNE_FILE", file)], limit);
        assert_refused(&r, file, "perf --ranks 2 with OXCCL_TUNE_FILE");
        assert!(r.stderr.contains(why), "{}", what(&r));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `OXCCL_SECRET` exported but malformed is an error of `oxccl run` and `oxccl perf --ranks`,
/// not silently replaced by a random secret (with which `oxccl status` would then fail).
#[test]
fn a_malformed_secret_is_refused_by_the_launchers() {
    let mut perf = PERF.to_vec();
    perf.extend(["--ranks", "2"]);
    for args in [perf, vec!["run", "-n", "2", "true"]] {
        for bad in ["garbage", "0011", ""] {
            let r = run(&args, &[("OXCCL_SECRET", bad)], Duration::from_secs(60));
            assert_eq!(r.code, Some(2), "{args:?} {bad:?}: {}", what(&r));
            assert!(
                r.stderr.contains("OXCCL_SECRET") && r.stderr.contains("32 hex digits"),
                "{args:?} {bad:?}: {}",
                what(&r)
            );
        }
    }
}

/// Values in range by type but nonsense (a heartbeat timeout of a nanosecond, a network of
/// 1e-300 GB/s, a status timeout of 1e-300 s) are refused with the accepted range.
#[test]
fn absurdly_small_values_are_refused() {
    let limit = Duration::from_secs(60);
    let r = run(PERF, &[("OXCCL_HEARTBEAT_TIMEOUT", "1e-9")], limit);
    assert_refused(&r, "OXCCL_HEARTBEAT_TIMEOUT", "1e-9");
    assert!(r.stderr.contains("0 or from 0.1"), "{}", what(&r));
    for (args, flag) in [
        (vec!["sim", "-e", "8", "--net-gbps", "1e-300"], "--net-gbps"),
        (
            vec!["sim", "-e", "8", "--net-lat-us", "1e-300"],
            "--net-lat-us",
        ),
        (
            vec!["status", "127.0.0.1:9", "--timeout", "1e-300"],
            "--timeout",
        ),
        (
            vec!["status", "127.0.0.1:9", "--watch", "1e-300"],
            "--watch",
        ),
    ] {
        let r = run(&args, &[], limit);
        assert_refused(&r, flag, flag);
        assert_eq!(r.code, Some(2), "{}", what(&r));
    }
}
