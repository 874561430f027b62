//! `oxccl status` against a real 3-rank job (processes: this test binary re-executed to run
//! the ignored test `status_child`): every rank does 5 all_reduces, then rank 2 stalls before
//! the 6th while ranks 0 and 1 enter it. `oxccl status` must show ranks 0 and 1 in
//! all_reduce #6 and rank 2 idle after #5, behind; after rank 2 goes on, nobody is behind.
//!
//! Then the agent under load and attack: a job looping all_reduces, with 24 silent
//! connections held open to rank 0's and rank 2's agents, answers 20 queries promptly, every
//! rank alive and nobody behind; a stranger holding the status port before the job starts is
//! reported on rank 0's stderr (without `OXCCL_DEBUG`), and `oxccl status` refuses its answer.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use oxccl::{Communicator, ReduceOp};

const OXCCL: &str = env!("CARGO_BIN_EXE_oxccl");
const CALLS: usize = 5;
const SECRET: &str = "0123456789abcdef0123456789abcdef";

#[test]
#[ignore = "a rank of status_shows_who_is_behind (started by it)"]
fn status_child() {
    let Ok(go) = std::env::var("OXCCL_STATUS_GO") else {
        return;
    };
    let comm = Communicator::from_env().unwrap();
    let mut x = vec![1.0f32; 1024];
    for _ in 0..CALLS {
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
    }
    if comm.rank() == 2 {
        // Stall (bounded) until the test has looked.
        let t = Instant::now();
        while !Path::new(&go).exists() && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
    assert_eq!(x[0], 3f32.powi(CALLS as i32 + 1));
    // Stay a moment for the last query.
    comm.barrier().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    comm.barrier().unwrap();
}

fn status(port: u16, json: bool) -> (bool, String) {
    status_within(port, json, 3)
}

/// `oxccl status` with `--timeout secs`.
fn status_within(port: u16, json: bool, secs: u32) -> (bool, String) {
    let mut c = Command::new(OXCCL);
    c.args(["status", &port.to_string(), "--timeout", &secs.to_string()])
        .env("OXCCL_SECRET", SECRET);
    if json {
        c.arg("--json");
    }
    let o = c.output().unwrap();
    (
        o.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

/// The rendezvous ports of the process tests (below the ephemeral range; see there).
#[path = "../../oxccl/tests/proc_common/port.rs"]
mod port;
use port::free_port;

#[test]
fn status_shows_who_is_behind() {
    let n = 3;
    let (port, status_port) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("oxccl-status-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let go = dir.join("go");
    let _ = std::fs::remove_file(&go);
    let mut kids: Vec<Child> = (0..n)
        .map(|r| {
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "status_child",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("OXCCL_STATUS_GO", &go)
                .env("OXCCL_STATUS", status_port.to_string())
                .env("OXCCL_TIMEOUT", "60")
                // Through the links (not the one-shot slots), so that they carry the bytes.
                .env("OXCCL_ALGO", "ring")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("OXCCL_SECRET", SECRET)
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        })
        .collect();
    // Wait until ranks 0 and 1 are in the 6th call.
    let t = Instant::now();
    let stuck = loop {
        let (ok, out) = status(status_port, true);
        if ok {
            let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
            let in_6th = |r: usize| v["ranks"][r]["current"]["seq"] == CALLS as u64 + 1;
            // Seen once in test.sh at load: a sample showing ranks 0 and 1 in call #6 with
            // max_seq 5 and nobody behind (the agent took the highest call from its first
            // answers only and did not redo it after asking ranks 0 and 1 again: fixed, see
            // observe::status::settle). Ask again until the agent says call #6 too (bounded
            // below); then it must name rank 2 as behind.
            if in_6th(0) && in_6th(1) && v["max_seq"] == CALLS as u64 + 1 {
                break v;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "ranks 0 and 1 never seen in call #6: {out}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let text = status(status_port, false).1;
    std::fs::write(&go, b"").unwrap();
    assert_eq!(stuck["max_seq"], CALLS as u64 + 1, "{stuck}");
    assert_eq!(stuck["behind"], serde_json::json!([2]), "{stuck}");
    for r in 0..2 {
        assert_eq!(
            stuck["ranks"][r]["current"]["call"], "all_reduce",
            "{stuck}"
        );
        assert_eq!(stuck["ranks"][r]["alive"], true);
    }
    assert_eq!(stuck["ranks"][2]["alive"], true, "{stuck}");
    assert_eq!(
        stuck["ranks"][2]["current"],
        serde_json::Value::Null,
        "{stuck}"
    );
    assert_eq!(stuck["ranks"][2]["last_completed"]["seq"], CALLS as u64);
    // Per-link state: rank 1 has sent rank 2 its first ring chunk of call #6, which rank 2,
    // stalled, has not taken: bytes in flight on that link, shown in the table.
    let link = |r: usize, peer: u64| {
        stuck["ranks"][r]["links"]
            .as_array()
            .and_then(|a| a.iter().find(|l| l["peer"] == peer).cloned())
            .unwrap_or_else(|| panic!("no link {r} -> {peer}: {stuck}"))
    };
    let (sent, taken) = (link(1, 2)["sent"].as_u64(), link(2, 1)["received"].as_u64());
    assert!(
        matches!((sent, taken), (Some(s), Some(t)) if s > t),
        "rank 1 -> 2: sent {sent:?}, taken {taken:?}: {stuck}"
    );
    assert_eq!(link(1, 2)["transport"], "shm", "{stuck}");
    assert!(link(1, 2)["progress_ms_ago"].is_u64(), "{stuck}");
    assert!(
        text.contains("link to rank 2 (shm): ") && text.contains("B sent not yet taken by rank 2"),
        "{text}"
    );
    assert!(
        text.contains("behind it: rank(s) 2")
            && text.contains("in all_reduce #6")
            && text.contains("idle after #5"),
        "{text}"
    );
    // Rank 2 goes on: then nobody is behind (the ranks wait in their last barrier pair).
    let t = Instant::now();
    loop {
        let (ok, out) = status(status_port, true);
        if ok && out.contains("\"behind\":[]") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "still behind: {out}");
        std::thread::sleep(Duration::from_millis(50));
    }
    for k in &mut kids {
        assert!(k.wait().unwrap().success());
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
#[ignore = "a rank of the looping tests (started by them)"]
fn status_loop_child() {
    let Ok(stop) = std::env::var("OXCCL_STATUS_STOP") else {
        return;
    };
    let comm = Communicator::from_env().unwrap();
    let t = Instant::now();
    let mut x = vec![0.0f32; 256];
    for i in 0.. {
        // Every rank stops at the same call: when any of them saw the stop file (or after 60 s).
        x.fill(1.0);
        x[0] = f32::from(Path::new(&stop).exists() || t.elapsed() > Duration::from_secs(60));
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x[1], comm.world_size() as f32, "call {i}");
        if x[0] > 0.0 {
            break;
        }
    }
}

/// Starts `n` ranks of [`status_loop_child`] with `OXCCL_STATUS=status_port`, stopping when
/// `stop` exists; stderr piped; `env(rank)` adds variables.
fn looping_job(
    n: usize,
    status_port: u16,
    stop: &Path,
    env: impl Fn(usize) -> Vec<(&'static str, String)>,
) -> Vec<Child> {
    let port = free_port();
    (0..n)
        .map(|r| {
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "status_loop_child",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("OXCCL_STATUS_STOP", stop)
                .env("OXCCL_STATUS", status_port.to_string())
                .env_remove("OXCCL_DEBUG")
                .env_remove("OXCCL_SECRET")
                .env("OXCCL_TIMEOUT", "60")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .envs(env(r))
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect()
}

fn finish(kids: Vec<Child>) -> Vec<String> {
    kids.into_iter()
        .map(|k| {
            let o = k.wait_with_output().unwrap();
            let err = String::from_utf8_lossy(&o.stderr).into_owned();
            assert!(o.status.success(), "{err}");
            err
        })
        .collect()
}

#[test]
fn a_busy_healthy_job_shows_everyone_alive_and_nobody_behind() {
    let n = 3;
    let status_port = free_port();
    let dir = std::env::temp_dir().join(format!("oxccl-status-loop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let stop = dir.join("stop");
    let _ = std::fs::remove_file(&stop);
    // Rank 1 also serves /metrics.
    let metrics_port = free_port();
    let kids = looping_job(n, status_port, &stop, |r| {
        let mut v = vec![("OXCCL_SECRET", SECRET.to_string())];
        if r == 1 {
            v.push(("OXCCL_METRICS_PORT", metrics_port.to_string()));
        }
        v
    });
    // Wait for the agents and the loop.
    let t = Instant::now();
    let first = loop {
        let (ok, out) = status(status_port, true);
        if ok {
            let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
            if v["max_seq"].as_u64().unwrap_or(0) > 20 {
                break v;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the job never ran: {out}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    // 24 silent connections to rank 0's agent and to rank 2's.
    let agent2: std::net::SocketAddr = first["ranks"][2]["agent"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let silent: Vec<std::net::TcpStream> = (0..24)
        .flat_map(|_| {
            [
                std::net::TcpStream::connect(("127.0.0.1", status_port)).unwrap(),
                std::net::TcpStream::connect(agent2).unwrap(),
            ]
        })
        .collect();
    let mut last = 0;
    let mut slowest = Duration::ZERO;
    for q in 0..20 {
        let t = Instant::now();
        // Quiet, a query takes tens of milliseconds; an agent blocked by the silent
        // connections would take their I/O timeout (1 s) each, 24 s or more: the bound is
        // between, and the query's own timeout past both (a busy machine).
        let (ok, out) = status_within(status_port, true, 60);
        let took = t.elapsed();
        assert!(ok, "query {q}: {out}");
        assert!(took < Duration::from_secs(15), "query {q} took {took:?}");
        slowest = slowest.max(took);
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["behind"], serde_json::json!([]), "query {q}: {v}");
        for r in 0..n {
            assert_eq!(v["ranks"][r]["alive"], true, "query {q}: {v}");
            assert_eq!(
                v["ranks"][r]["links"].as_array().map(Vec::len),
                Some(n - 1),
                "{v}"
            );
        }
        let max = v["max_seq"].as_u64().unwrap();
        assert!(max >= last, "query {q}: {v}");
        last = max;
    }
    drop(silent);
    eprintln!("20 queries with 48 silent connections open: slowest {slowest:?} (oxccl status, a process each)");
    // Rank 1's /metrics counts its all_reduces (and has the call-time histogram).
    let metrics = {
        use std::io::{Read, Write};
        let s = std::net::TcpStream::connect(("127.0.0.1", metrics_port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        (&s).write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        (&s).read_to_string(&mut out).unwrap();
        out
    };
    let calls: f64 = metrics
        .lines()
        .find(|l| {
            l.starts_with("oxccl_collective_calls_total{")
                && l.contains("AllReduce")
                && l.contains("rank=\"1\"")
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(calls > 20.0, "{metrics}");
    assert!(
        metrics.contains("oxccl_collective_call_seconds_bucket{"),
        "{metrics}"
    );
    std::fs::write(&stop, b"").unwrap();
    finish(kids);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_stranger_on_the_status_port_is_reported_and_not_believed() {
    // The stranger: holds the port, answers every request with a made-up healthy job.
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let status_port = fake.local_addr().unwrap().port();
    fake.set_nonblocking(true).unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let d = done.clone();
    let liar = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let t = Instant::now();
        while !d.load(std::sync::atomic::Ordering::Relaxed) && t.elapsed() < Duration::from_secs(60)
        {
            match fake.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                    let _ = (&s).read(&mut [0u8; 256]);
                    let _ = (&s).write_all(
                        b"{\"world_size\":2,\"max_seq\":7,\"behind\":[],\"ranks\":[{\"rank\":0,\"alive\":true,\"pid\":666,\"host\":\"liar\"}]}\n",
                    );
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
    let (ok, out) = status(status_port, false);
    assert!(!ok, "{out}");
    assert!(
        out.contains("not this job's agent (authentication failed)") && !out.contains("liar"),
        "{out}"
    );
    // A job started on that port: rank 0 says so on stderr, without OXCCL_DEBUG, and runs.
    let dir = std::env::temp_dir().join(format!("oxccl-status-taken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let stop = dir.join("stop");
    std::fs::write(&stop, b"").unwrap();
    let errs = finish(looping_job(2, status_port, &stop, |_| {
        vec![("OXCCL_SECRET", SECRET.to_string())]
    }));
    let warning = format!(
        "oxccl: warning: OXCCL_STATUS: 127.0.0.1:{status_port} is already taken by another process; the status agent is off for rank 0"
    );
    assert_eq!(errs[0].matches(&warning).count(), 1, "{}", errs[0]);
    assert!(!errs[1].contains("OXCCL_STATUS"), "{}", errs[1]);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    liar.join().unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn without_oxccl_secret_status_derives_the_jobs() {
    // A job without OXCCL_SECRET derives its secret from the rendezvous address; `oxccl
    // status` given the same MASTER_ADDR/MASTER_PORT derives the same, and a wrong one is refused.
    let status_port = free_port();
    let master = free_port();
    let dir = std::env::temp_dir().join(format!("oxccl-status-derived-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let stop = dir.join("stop");
    let _ = std::fs::remove_file(&stop);
    let kids = looping_job(2, status_port, &stop, |_| {
        vec![("MASTER_PORT", master.to_string())]
    });
    let ask = |env: &[(&str, String)]| {
        let mut c = Command::new(OXCCL);
        c.args([
            "status",
            &status_port.to_string(),
            "--timeout",
            "3",
            "--json",
        ])
        .env_remove("OXCCL_SECRET")
        .env_remove("OXCCL_ROOT")
        .env_remove("RANK");
        for (k, v) in env {
            c.env(k, v);
        }
        let o = c.output().unwrap();
        (
            o.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
        )
    };
    let right = [
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", master.to_string()),
    ];
    let t = Instant::now();
    loop {
        let (ok, out) = ask(&right);
        if ok && out.contains("\"alive\":true") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "{out}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (ok, out) = ask(&[
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", "1".to_string()),
    ]);
    assert!(
        !ok && out.contains("not this job's agent (authentication failed)"),
        "{out}"
    );
    let (ok, out) = ask(&[]);
    assert!(
        !ok && out.contains("cannot authenticate the agent"),
        "{out}"
    );
    std::fs::write(&stop, b"").unwrap();
    finish(kids);
    let _ = std::fs::remove_dir_all(dir);
}
