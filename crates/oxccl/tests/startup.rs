//! Start-up under attack, with real processes: ranks SIGKILLed at every moment of their
//! start-up leave nothing in /dev/shm.
//!
//! The ranks are this test binary, re-executed to run the ignored test `startup_child` with
//! `OXCCL_STARTUP_CHILD` set.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use oxccl::Communicator;

#[test]
#[ignore = "a rank of the other tests, run by them"]
fn startup_child() {
    if std::env::var("OXCCL_STARTUP_CHILD").is_err() {
        return;
    }
    let comm = Communicator::from_env().unwrap();
    comm.barrier().unwrap();
    let mut v = vec![1.0f32; 1024];
    comm.all_reduce_in_place(&mut v, oxccl::ReduceOp::Sum)
        .unwrap();
    assert_eq!(v[0], comm.world_size() as f32);
    println!("CHILD {} OK", comm.rank());
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn spawn_ranks(n: usize, secret: &str, port: u16) -> Vec<Child> {
    (0..n)
        .map(|r| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "startup_child", "--ignored", "--nocapture"])
                .env("OXCCL_STARTUP_CHILD", "1")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("OXCCL_SECRET", secret)
                .env("OXCCL_TRANSPORT", "shm")
                .env("OXCCL_SHM_RING_BYTES", "16M")
                .env("OXCCL_TIMEOUT", "20")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect()
}

/// Files of communicator `tag` in /dev/shm.
fn files_of(tag: u64) -> Vec<String> {
    let prefix = format!("oxccl-{tag:016x}");
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

#[test]
fn ranks_killed_at_any_moment_of_start_up_leave_nothing_in_dev_shm() {
    let rounds: u64 = std::env::var("OXCCL_KILL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ std::process::id() as u64);
    let mut completed = 0;
    for round in 0..rounds {
        let mut secret = [0u8; 16];
        getrandom::fill(&mut secret).unwrap();
        let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
        let tag = oxccl::testing::auth::comm_tag(&secret);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut kids = spawn_ranks(3, &hex, port);
        // Kill one rank at a random moment of the start-up (spawn to a few hundred ms:
        // before, during and after the rendezvous and the segments' creation).
        let victim = rng.below(3) as usize;
        std::thread::sleep(Duration::from_micros(rng.below(400_000)));
        let _ = kids[victim].kill();
        // Then the others, at another moment.
        std::thread::sleep(Duration::from_micros(rng.below(300_000)));
        let start = Instant::now();
        for (r, k) in kids.iter_mut().enumerate() {
            if r != victim && rng.below(2) == 0 {
                let _ = k.kill();
            }
            while k.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let st = k.wait().unwrap();
            completed += usize::from(st.success());
        }
        let left = files_of(tag);
        assert!(
            left.is_empty(),
            "round {round}: left in /dev/shm after the kills: {left:?}"
        );
    }
    println!("{rounds} rounds, {completed} ranks completed before being killed");
}
