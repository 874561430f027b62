//! Helpers shared by the integration tests that start ranks as child processes.

#![allow(dead_code)]

use std::process::{Child, Output};
use std::time::{Duration, Instant};

/// A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous address).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits for `k` until `deadline` (checking every `poll`), kills it if it is still running
/// then, and returns its output: a hung child ends the test instead of hanging it.
pub fn output_by(mut k: Child, deadline: Instant, poll: Duration) -> Output {
    while k.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(poll);
    }
    let _ = k.kill();
    k.wait_with_output().unwrap()
}
