//! The shared-memory budget (`OXCCL_SHM_BUDGET_BYTES`) with real processes: 4 ranks whose
//! segments may hold only 16 KiB of data per ring still get right all_to_all and all_reduce
//! results (rings carrying everything, far more than they hold), and budgets that cannot work
//! give every rank an error naming the variable, without a hang.
//!
//! The ranks are this test binary, re-executed to run the ignored test `budget_child` with
//! `OXCCL_BUDGET_CHILD` set.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use oxccl::{Communicator, ReduceOp};

const N: usize = 4;
/// A rank's segment with 3 peers: a header page and 3 control pages.
const META: usize = 4 * 4096;

/// A rank: all_to_all and all_reduce of sizes up to 64 times a 16 KiB ring, every element
/// checked. Prints `CHILD OK`, or `CHILD_ERR <error>` and exits with 1.
#[test]
#[ignore = "a rank of the other tests, run by them"]
fn budget_child() {
    if std::env::var("OXCCL_BUDGET_CHILD").is_err() {
        return;
    }
    let run = || -> oxccl::Result<()> {
        let comm = Communicator::from_env()?;
        let (rank, n) = (comm.rank(), comm.world_size());
        for per_peer in [1usize, 1000, 70_000] {
            let send: Vec<u64> = (0..n * per_peer)
                .map(|i| (rank * 1_000_000_000 + i) as u64)
                .collect();
            let mut recv = vec![0u64; n * per_peer];
            comm.all_to_all(&send, &mut recv)?;
            for (i, &x) in recv.iter().enumerate() {
                let (src, j) = (i / per_peer, i % per_peer);
                let want = (src * 1_000_000_000 + rank * per_peer + j) as u64;
                assert_eq!(x, want, "all_to_all of {per_peer} per peer, element {i}");
            }
        }
        for len in [1usize, 5000, 130_000] {
            let mut v: Vec<u64> = (0..len).map(|i| (rank * 7 + i) as u64).collect();
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            for (i, &x) in v.iter().enumerate() {
                let want = (0..n).map(|r| (r * 7 + i) as u64).sum::<u64>();
                assert_eq!(x, want, "all_reduce of {len}, element {i}");
            }
        }
        Ok(())
    };
    match run() {
        Ok(()) => println!("CHILD OK"),
        Err(e) => {
            println!("CHILD_ERR {e}");
            std::process::exit(1);
        }
    }
}

/// Runs `N` ranks with a budget of `budget` bytes; each rank's exit status and output, or a
/// failure after 60 s.
fn run_ranks(budget: usize) -> Vec<(bool, String)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut secret = [0u8; 16];
    getrandom::fill(&mut secret).unwrap();
    let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let kids: Vec<Child> = (0..N)
        .map(|r| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "budget_child", "--ignored", "--nocapture"])
                .env("OXCCL_BUDGET_CHILD", "1")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", N.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("OXCCL_SECRET", &hex)
                .env("OXCCL_TRANSPORT", "shm")
                .env("OXCCL_SHM_BUDGET_BYTES", budget.to_string())
                // Everything through the rings: no one-shot area, no single-copy reads.
                .env("OXCCL_ONESHOT_MAX", "0")
                .env("OXCCL_CMA", "0")
                .env("OXCCL_TIMEOUT", "20")
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let start = Instant::now();
    let mut kids = kids;
    while kids.iter_mut().any(|k| k.try_wait().unwrap().is_none()) {
        if start.elapsed() > Duration::from_secs(60) {
            for k in &mut kids {
                let _ = k.kill();
            }
            panic!("ranks still running after 60 s (budget {budget})");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    kids.into_iter()
        .map(|k| {
            let out = k.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            (out.status.success(), text)
        })
        .collect()
}

#[test]
fn a_tiny_budget_gives_right_results_through_small_rings() {
    // 16 KiB of data per ring: the least a ring gets.
    for (r, (ok, out)) in run_ranks(META + 3 * 16384).into_iter().enumerate() {
        assert!(ok && out.contains("CHILD OK"), "rank {r}: {out}");
    }
}

#[test]
fn a_budget_that_cannot_work_is_an_error_on_every_rank() {
    // The control pages fit but no ring data: the first call that writes a ring fails. Less
    // than the control pages: the start-up fails.
    for (budget, want) in [
        (META, "cannot hold a ring for rank"),
        (META - 4096, "bytes of control pages"),
    ] {
        for (r, (ok, out)) in run_ranks(budget).into_iter().enumerate() {
            assert!(!ok, "budget {budget}, rank {r} passed: {out}");
            let err = out
                .lines()
                .find_map(|l| l.strip_prefix("CHILD_ERR "))
                .unwrap_or_else(|| panic!("budget {budget}, rank {r}: no error: {out}"));
            assert!(
                err.contains("OXCCL_SHM_BUDGET_BYTES") && err.contains(want),
                "budget {budget}, rank {r}: {err}"
            );
        }
    }
}
