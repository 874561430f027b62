//! Runs every Rust example with 1, 2 and 3 ranks (this test is their launcher: it sets the
//! torchrun variables `oxccl run` would), so the examples cannot rot.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The rendezvous ports of the process tests (below the ephemeral range; see there).
#[path = "../../crates/oxccl/tests/proc_common/port.rs"]
mod port;
use port::free_port;

/// Runs `exe` with `n` ranks, again on a fresh port when another process took the port
/// between `free_port` and rank 0's bind (tests run in parallel).
fn launch(exe: &str, n: usize) {
    for _ in 0..3 {
        if try_launch(exe, n) {
            return;
        }
    }
    panic!("{exe} with {n} ranks: the rendezvous port was taken 3 times in a row");
}

/// One launch; false only when rank 0 could not bind its port (taken meanwhile), the other
/// ranks then stopped at once.
fn try_launch(exe: &str, n: usize) -> bool {
    let port = free_port();
    let mut kids: Vec<Child> = (0..n)
        .map(|r| {
            Command::new(exe)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("OXCCL_SECRET", "000102030405060708090a0b0c0d0e0f")
                .env("OXCCL_TIMEOUT", "60")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut failed = Vec::new();
    let mut rank0_failed = false;
    for (r, k) in kids.iter_mut().enumerate() {
        loop {
            if let Some(st) = k.try_wait().unwrap() {
                if !st.success() {
                    failed.push(format!("rank {r}: {st}"));
                    rank0_failed |= r == 0;
                }
                break;
            }
            if rank0_failed {
                // The others would wait for rank 0's rendezvous until their timeout.
                let _ = k.kill();
                break;
            }
            if Instant::now() > deadline {
                let _ = k.kill();
                failed.push(format!("rank {r}: timed out"));
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let mut log = String::new();
    for k in kids {
        let out = k.wait_with_output().unwrap();
        log += &String::from_utf8_lossy(&out.stdout);
        log += &String::from_utf8_lossy(&out.stderr);
    }
    if rank0_failed && log.contains("binding the rendezvous address") && log.contains("AddrInUse") {
        return false;
    }
    assert!(failed.is_empty(), "{exe} with {n} ranks: {failed:?}\n{log}");
    assert_eq!(log.matches(&format!("/{n}: ")).count(), n, "{log}");
    true
}

#[test]
fn broadcast_weights() {
    for n in [1, 2, 3] {
        launch(env!("CARGO_BIN_EXE_broadcast_weights"), n);
    }
}

#[test]
fn dp_sgd() {
    for n in [1, 2, 3] {
        launch(env!("CARGO_BIN_EXE_dp_sgd"), n);
    }
}

#[test]
fn sharded_optimizer() {
    for n in [1, 2, 3] {
        launch(env!("CARGO_BIN_EXE_sharded_optimizer"), n);
    }
}
