//! `oxccl status` against a real 3-rank job (processes: this test binary re-executed to run
//! the ignored test `status_child`): every rank does 5 all_reduces, then rank 2 stalls before
//! the 6th while ranks 0 and 1 enter it. `oxccl status` must show ranks 0 and 1 in
//! all_reduce #6 and rank 2 idle after #5, behind; after rank 2 goes on, nobody is behind.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use oxccl::{Communicator, ReduceOp};

const OXCCL: &str = env!("CARGO_BIN_EXE_oxccl");
const CALLS: usize = 5;

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
    let mut c = Command::new(OXCCL);
    c.args(["status", &port.to_string(), "--timeout", "3"]);
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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

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
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("OXCCL_SECRET", "0123456789abcdef0123456789abcdef")
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
            if in_6th(0) && in_6th(1) {
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
