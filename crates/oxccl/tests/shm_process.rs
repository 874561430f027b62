//! Shared-memory transport between real processes: the test binary re-executes itself as the
//! peer (env `OXCCL_SHM_TEST_CHILD` selects the child's role) and the two exchange setup data
//! through files in a temporary directory.

mod shm_common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use oxccl::testing::bootstrap::Exchange;
use oxccl::testing::transport::shm::connect;
use oxccl::testing::transport::{Link, LinkError};
use oxccl::{Config, Error, Result};
use shm_common::*;

const ROLE: &str = "OXCCL_SHM_TEST_CHILD";
const DIR: &str = "OXCCL_SHM_TEST_DIR";
const TAG: &str = "OXCCL_SHM_TEST_TAG";

/// An [`Exchange`] between processes through files: round `k` of rank `r` is the file
/// `<dir>/<k>-<r>`, written to a temporary name and renamed, so a reader never sees half.
struct FileExchange {
    dir: PathBuf,
    rank: usize,
    n: usize,
    round: u64,
}

impl Exchange for FileExchange {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.n
    }
    fn allgather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let err = |msg: String| Error::Rendezvous {
            rank: self.rank,
            addr: self.dir.display().to_string(),
            msg,
        };
        let name = |r: usize| self.dir.join(format!("{}-{r}", self.round));
        let tmp = self.dir.join(format!("{}-{}.tmp", self.round, self.rank));
        std::fs::write(&tmp, mine).map_err(|e| err(e.to_string()))?;
        std::fs::rename(&tmp, name(self.rank)).map_err(|e| err(e.to_string()))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut out = Vec::with_capacity(self.n);
        for r in 0..self.n {
            loop {
                match std::fs::read(name(r)) {
                    Ok(v) => {
                        out.push(v);
                        break;
                    }
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    Err(e) => return Err(err(format!("round {} rank {r}: {e}", self.round))),
                }
            }
        }
        self.round += 1;
        Ok(out)
    }
}

fn cfg() -> Config {
    Config {
        shm_ring_bytes: 64 << 10,
        spin: 500,
        ..Config::default()
    }
}

fn plan(tag: u64, bytes: u64) -> Plan {
    Plan {
        bytes,
        max_send: 200_000,
        max_take: 150_000,
        slice: Duration::from_secs(20),
        deadline: Duration::from_secs(60),
        tag,
    }
}

/// Starts this test binary as rank 1, running `role`.
fn spawn_child(role: &str, dir: &Path, tag: u64) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(DIR, dir)
        .env(TAG, tag.to_string())
        .spawn()
        .unwrap()
}

fn temp_dir(tag: u64) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxccl-shm-test-{}-{tag:016x}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The child's side; a no-op when the test binary runs normally.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let dir = PathBuf::from(std::env::var(DIR).unwrap());
    let tag: u64 = std::env::var(TAG).unwrap().parse().unwrap();
    let mut ex = FileExchange {
        dir,
        rank: 1,
        n: 2,
        round: 0,
    };
    let parent = std::os::unix::process::parent_id();
    let links = connect(&mut ex, &[(0, parent)], tag, &cfg()).unwrap();
    match role.as_str() {
        "stream" => {
            run_rank(1, links, &plan(tag, 32 << 20), 0).unwrap();
            ex.barrier().unwrap();
        }
        "flood" => {
            // Send forever (the parent kills this process), 60 s at most.
            let (_, mut link) = links.into_iter().next().unwrap();
            let seed = pair_seed(tag, 1, 0);
            let mut buf = vec![0u8; 1 << 16];
            let mut pos = 0u64;
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(60) {
                fill(seed, pos, &mut buf);
                match link.try_send(&buf) {
                    Ok(0) => std::thread::sleep(Duration::from_micros(100)),
                    Ok(k) => pos += k as u64,
                    Err(e) => panic!("child: {e}"),
                }
            }
            std::process::exit(3);
        }
        r => panic!("unknown role {r}"),
    }
}

/// Two processes stream 32 MiB each way through 64 KiB rings, every byte verified, sleeping
/// on the (cross-process, shared futex) doorbell whenever a round makes no progress.
#[test]
fn two_processes_stream_both_ways() {
    let tag = random_tag();
    let dir = temp_dir(tag);
    let mut child = spawn_child("stream", &dir, tag);
    let mut ex = FileExchange {
        dir: dir.clone(),
        rank: 0,
        n: 2,
        round: 0,
    };
    let links = connect(&mut ex, &[(1, child.id())], tag, &cfg()).unwrap();
    let t0 = Instant::now();
    let stats = run_rank(0, links, &plan(tag, 32 << 20), 0);
    let elapsed = t0.elapsed();
    if stats.is_ok() {
        ex.barrier().unwrap();
    }
    let status = child.wait().unwrap();
    let stats = stats.unwrap();
    assert!(status.success(), "child failed: {status}");
    eprintln!("2 processes, 32 MiB each way: {elapsed:?}, {stats:?}");
    assert_eq!(stats.sleep_timeouts, 0, "a sleeper was not woken");
    assert!(
        leftover_segments(tag).is_empty(),
        "left in /dev/shm: {:?}",
        leftover_segments(tag)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The child is SIGKILLed mid-stream and reaped at once (as a launcher does): the parent
/// drains what arrived, then its sleeping receive loop sees `Closed` from `check_alive`
/// within 2 seconds.
#[test]
fn killed_peer_is_detected() {
    killed_peer(true);
}

/// As [`killed_peer_is_detected`], but nobody reaps the child until the end (this process is
/// its parent and is busy in the receive loop): the zombie must count as exited.
#[test]
fn killed_unreaped_peer_is_detected() {
    killed_peer(false);
}

fn killed_peer(reap: bool) {
    let tag = random_tag();
    let dir = temp_dir(tag);
    let child = spawn_child("flood", &dir, tag);
    let pid = child.id();
    let (go, reap_now) = std::sync::mpsc::channel::<()>();
    let reaper = std::thread::spawn(move || {
        let mut child = child;
        if !reap {
            reap_now.recv().unwrap();
        }
        child.wait().unwrap()
    });
    let mut ex = FileExchange {
        dir: dir.clone(),
        rank: 0,
        n: 2,
        round: 0,
    };
    let mut links = connect(&mut ex, &[(1, pid)], tag, &cfg()).unwrap();
    let link: &mut Box<dyn Link> = &mut links[0].1;
    let seed = pair_seed(tag, 1, 0);
    let mut got = 0u64;
    let mut killed_at: Option<Instant> = None;
    let start = Instant::now();
    let err = loop {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no data or no error"
        );
        if killed_at.is_none() && got >= 8 << 20 {
            rustix::process::kill_process(
                rustix::process::Pid::from_raw(pid as i32).unwrap(),
                rustix::process::Signal::KILL,
            )
            .unwrap();
            killed_at = Some(Instant::now());
        }
        let tok = bell(&**link).unwrap().prepare();
        let r = link.try_recv(&mut |b| {
            for (i, &x) in b.iter().enumerate() {
                assert_eq!(
                    x,
                    stream_byte(seed, got + i as u64),
                    "byte {}",
                    got + i as u64
                );
            }
            got += b.len() as u64;
            b.len()
        });
        match r {
            Ok(0) => {}
            Ok(_) => {
                bell(&**link).unwrap().cancel(tok);
                continue;
            }
            Err(e) => {
                bell(&**link).unwrap().cancel(tok);
                break e;
            }
        }
        bell(&**link).unwrap().wait(tok, Duration::from_millis(100));
        if let Err(e) = link.check_alive() {
            break e;
        }
    };
    let killed_at = killed_at.expect("an error before the kill");
    let delay = killed_at.elapsed();
    assert!(matches!(err, LinkError::Closed(_)), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("process {pid} of rank 1 exited")),
        "{err}"
    );
    // Quiet, within a 100 ms wait or two; a busy machine gets ten times that and more.
    assert!(
        delay < Duration::from_secs(10),
        "death noticed after {delay:?}"
    );
    eprintln!("killed child noticed after {delay:?}, {got} bytes received");
    let _ = go.send(()); // the reaper may be done already
    let status = reaper.join().unwrap();
    assert!(!status.success());
    drop(links);
    assert!(
        leftover_segments(tag).is_empty(),
        "left in /dev/shm: {:?}",
        leftover_segments(tag)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
