//! Code shared by the integration tests that start ranks as child processes or as
//! threads of the test process.

#![allow(dead_code)]

use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

mod port;
#[allow(unused_imports)] // not every test binary starts ranks
pub use port::free_port;

/// Waits for `k` until `deadline` (checking every `poll`), kills it if it is still running
/// then, and returns its output: a hung child ends the test instead of hanging it.
pub fn output_by(mut k: Child, deadline: Instant, poll: Duration) -> Output {
    while k.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(poll);
    }
    let _ = k.kill();
    k.wait_with_output().unwrap()
}

/// Starts `c` (its stdout piped) and hands each line it prints to `f` on a thread of its own,
/// then `None` once its stdout ends (it exited or closed it).
pub fn spawn_reading(c: &mut Command, mut f: impl FnMut(Option<String>) + Send + 'static) -> Child {
    use std::io::BufRead;
    let mut k = c.spawn().unwrap();
    let out = k.stdout.take().expect("stdout piped");
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(|l| l.ok()) {
            f(Some(line));
        }
        f(None);
    });
    k
}

/// Runs `f(rank, comm)` on `n` threads, each with a communicator of config `cfg(rank)`,
/// joined by a rendezvous on loopback; returns each rank's result, by rank.
pub fn threads<T: Send>(
    n: usize,
    cfg: impl Fn(usize) -> oxccl::Config + Sync,
    f: impl Fn(usize, oxccl::Communicator) -> T + Sync,
) -> Vec<T> {
    let id = oxccl::UniqueId::new_on("127.0.0.1".parse().unwrap()).unwrap();
    let (f, cfg) = (&f, &cfg);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let id = id.clone();
                s.spawn(move || {
                    f(
                        r,
                        oxccl::Communicator::init_with_config(&id, r, n, cfg(r)).unwrap(),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A xorshift generator: random delays and choices for the kill tests.
pub struct Rng(pub u64);

impl Rng {
    /// A number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Files of communicator `tag` in /dev/shm.
pub fn files_of(tag: u64) -> Vec<String> {
    let prefix = format!("oxccl-{tag:016x}");
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

/// How a child rank ends: `CHILD OK` on stdout, or `CHILD_ERR` and the error on stderr and
/// exit status 1 (what the kill tests read).
pub fn child_ends<E: std::fmt::Display>(r: Result<(), E>) {
    match r {
        Ok(()) => println!("CHILD OK"),
        Err(e) => {
            eprintln!("CHILD_ERR {e}");
            std::process::exit(1);
        }
    }
}

/// A rank of a job of `n`: this test binary re-executed to run the ignored test `child`, with
/// the launcher's variables (rank `r`, rendezvous on 127.0.0.1:`port`, secret `secret_hex`).
pub fn rank_command(child: &str, r: usize, n: usize, port: u16, secret_hex: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", child, "--ignored", "--nocapture"])
        .env("RANK", r.to_string())
        .env("WORLD_SIZE", n.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("OXCCL_SECRET", secret_hex);
    c
}

/// A fresh random secret for a job: its hex form (`OXCCL_SECRET`) and its communicator's tag
/// (the prefix of its `/dev/shm` files).
pub fn job_secret() -> (String, u64) {
    let mut secret = [0u8; 16];
    getrandom::fill(&mut secret).unwrap();
    let hex = secret.iter().map(|b| format!("{b:02x}")).collect();
    (hex, oxccl::testing::auth::comm_tag(&secret))
}

/// Sends signal `sig` (`-STOP`, `-CONT`, ...) to child `k`; false if it could not.
pub fn signal(k: &Child, sig: &str) -> bool {
    Command::new("kill")
        .args([sig, &k.id().to_string()])
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether the stress tier runs this (`OXCCL_STRESS=1`, set by `scripts/test.sh stress`): long
/// random loops then run their full counts.
pub fn stress() -> bool {
    std::env::var("OXCCL_STRESS").is_ok_and(|v| v == "1")
}

/// The whole number in environment variable `name`, or `default` where it is unset or not
/// one (the tests' round counts).
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
