//! Strangers on every port of a live job, with real processes: while rank 0 waits at its
//! rendezvous and later while every rank runs checked all-reduces, attackers hit every port
//! the ranks listen on (the rendezvous, the TCP data and exchange ports, the status agent,
//! `/metrics`, the shrink listener), found from /proc: garbage, a handshake with a wrong
//! secret, a valid challenge followed by a huge length prefix, a request line or HTTP head
//! that never ends, slow-loris clients that send one byte at a time, and hundreds of idle
//! connections at once. The job must start, compute right and end in time, without a panic,
//! and its ranks' threads and memory must stay bounded.
//!
//! The ranks are this test binary, re-executed to run the ignored test `hostile_child` with
//! `OXCCL_HOSTILE_CHILD` set.

use std::collections::BTreeSet;
use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use oxccl::testing::auth;
use oxccl::{Communicator, ReduceOp};

mod proc_common;
use proc_common::{free_port, output_by};

/// How long each rank runs its calls (while the second wave of attacks lasts).
const CALLS_FOR: Duration = Duration::from_secs(4);

/// A rank: init, `CHILD READY`, checked 64 KiB all-reduces for [`CALLS_FOR`], a barrier,
/// `CHILD OK <calls>`. On an error `CHILD_ERR <error>` (exit 1), on a wrong sum exit 2.
#[test]
#[ignore = "a rank of the other tests, run by them"]
fn hostile_child() {
    if std::env::var("OXCCL_HOSTILE_CHILD").is_err() {
        return;
    }
    let run = || -> oxccl::Result<usize> {
        let comm = Communicator::from_env()?;
        let (r, n) = (comm.rank(), comm.world_size());
        comm.barrier()?;
        println!("CHILD READY");
        let start = Instant::now();
        let mut calls = 0;
        let mut v = vec![0f32; 16 << 10];
        loop {
            v.fill((r + 1) as f32);
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            if v.iter().any(|&x| x != (n * (n + 1) / 2) as f32) {
                println!("CHILD_WRONG {:?}", &v[..4]);
                std::process::exit(2);
            }
            calls += 1;
            // Every rank stops when one has run for CALLS_FOR: they agree on the end.
            let mut done = [u32::from(start.elapsed() >= CALLS_FOR)];
            comm.all_reduce_in_place(&mut done, ReduceOp::Max)?;
            if done[0] == 1 {
                break;
            }
        }
        comm.barrier()?;
        Ok(calls)
    };
    match run() {
        Ok(calls) => println!("CHILD OK {calls}"),
        Err(e) => {
            eprintln!("CHILD_ERR {e}");
            std::process::exit(1);
        }
    }
}

/// The TCP addresses process `pid` listens on (its sockets in /proc/PID/fd against the
/// LISTEN entries of /proc/net/tcp and tcp6; a wildcard address as 127.0.0.1).
fn listening(pid: u32) -> BTreeSet<SocketAddr> {
    let mut inodes = BTreeSet::new();
    if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for fd in fds.flatten() {
            if let Ok(l) = std::fs::read_link(fd.path()) {
                let l = l.to_string_lossy().into_owned();
                if let Some(i) = l.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')) {
                    inodes.insert(i.to_string());
                }
            }
        }
    }
    let mut addrs = BTreeSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            if f.len() <= 9 || f[3] != "0A" || !inodes.contains(f[9]) {
                continue;
            }
            let Some((ip, port)) = f[1].split_once(':') else {
                continue;
            };
            let Ok(port) = u16::from_str_radix(port, 16) else {
                continue;
            };
            let ip = match u32::from_str_radix(ip, 16) {
                // /proc/net/tcp prints the address in memory order: little-endian here.
                Ok(v) if ip.len() == 8 && v != 0 => std::net::Ipv4Addr::from(v.swap_bytes()),
                _ if ip.chars().all(|c| c == '0') => std::net::Ipv4Addr::LOCALHOST,
                _ => continue,
            };
            addrs.insert(SocketAddr::from((ip, port)));
        }
    }
    addrs
}

/// (threads, resident KiB) of process `pid`.
fn usage(pid: u32) -> (usize, usize) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("Threads:"), field("VmRSS:"))
}

fn connect(a: SocketAddr) -> Option<TcpStream> {
    let s = TcpStream::connect_timeout(&a, Duration::from_millis(500)).ok()?;
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
    Some(s)
}

/// Reads until the other side closes or 3 s pass (an attacker that waits for the answer).
fn drain(s: &mut TcpStream) {
    let end = Instant::now() + Duration::from_secs(3);
    let mut b = [0u8; 4096];
    while Instant::now() < end {
        match s.read(&mut b) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return,
        }
    }
}

/// One attacker: `kind` against `a` until `stop`, counting its connections in `made`.
fn attack(kind: usize, a: SocketAddr, stop: &AtomicBool, made: &AtomicUsize) {
    let wrong = [0x5a; 16];
    let mut held: Vec<TcpStream> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        match kind {
            // Garbage, then wait for the other side to give up.
            0 => {
                if let Some(mut s) = connect(a) {
                    made.fetch_add(1, Ordering::Relaxed);
                    let _ = s.write_all(&[0xa5u8; 4096]);
                    drain(&mut s);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            // A full handshake with a wrong secret (every purpose).
            1 => {
                if let Some(mut s) = connect(a) {
                    made.fetch_add(1, Ordering::Relaxed);
                    let hello = auth::Hello {
                        rank: 1,
                        purpose: auth::Purpose::Rendezvous,
                        tag: auth::comm_tag(&wrong),
                    };
                    let _ = auth::client_handshake(&mut s, &wrong, &hello, 1, "attacker");
                }
                // (Attackers 0-2 pause between connections: the machine may have only 2 cores.)
                std::thread::sleep(Duration::from_millis(10));
            }
            // A valid challenge, then a 4 GiB length prefix and a trickle; also a request
            // line and an HTTP head that never end (for the status agent and /metrics).
            2 => {
                if let Some(mut s) = connect(a) {
                    made.fetch_add(1, Ordering::Relaxed);
                    let mut m1 = auth::MAGIC.to_vec();
                    m1.extend_from_slice(&auth::VERSION.to_le_bytes());
                    m1.extend_from_slice(&[3; 16]);
                    let _ = s.write_all(&m1);
                    let _ = s.write_all(&u32::MAX.to_le_bytes());
                    let _ = s.write_all(b"status ");
                    let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nX: ");
                    for _ in 0..64 {
                        if s.write_all(&[b'a'; 16 << 10]).is_err() {
                            break;
                        }
                    }
                    drain(&mut s);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            // Slow loris: 8 connections, one byte each every 100 ms.
            3 => {
                while held.len() < 8 {
                    match connect(a) {
                        Some(s) => {
                            made.fetch_add(1, Ordering::Relaxed);
                            held.push(s)
                        }
                        None => break,
                    }
                }
                held.retain_mut(|s| s.write_all(b"O").is_ok());
                std::thread::sleep(Duration::from_millis(100));
            }
            // A flood: up to 300 idle connections held open.
            _ => {
                if held.len() < 300 {
                    if let Some(s) = connect(a) {
                        made.fetch_add(1, Ordering::Relaxed);
                        held.push(s);
                    }
                } else {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
}

/// Starts every kind of attacker against every address of `addrs`; they stop with `stop`.
fn attack_all(
    addrs: &BTreeSet<SocketAddr>,
    stop: &Arc<AtomicBool>,
    made: &Arc<AtomicUsize>,
) -> Vec<std::thread::JoinHandle<()>> {
    let mut v = Vec::new();
    for &a in addrs {
        for kind in 0..5 {
            let (stop, made) = (stop.clone(), made.clone());
            v.push(std::thread::spawn(move || attack(kind, a, &stop, &made)));
        }
    }
    v
}

fn spawn_rank(r: usize, n: usize, port: u16, secret: &str, status: u16, metrics: u16) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "hostile_child", "--ignored", "--nocapture"])
        .env("OXCCL_HOSTILE_CHILD", "1")
        .env("RANK", r.to_string())
        .env("WORLD_SIZE", n.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("OXCCL_SECRET", secret)
        .env("OXCCL_TRANSPORT", "tcp")
        .env("OXCCL_TCP_CONNECT", "eager")
        // Exchanges directly between ranks: their listeners are attacked too.
        .env("OXCCL_BOOTSTRAP_RELAY_MAX", "1")
        .env("OXCCL_TIMEOUT", "30")
        .env("OXCCL_STATUS", status.to_string())
        .env("OXCCL_METRICS_PORT", metrics.to_string())
        .env("OXCCL_TUNE_FILE", "")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c.spawn().unwrap()
}

#[test]
fn strangers_on_every_port_neither_stop_nor_falsify_the_job() {
    const N: usize = 3;
    let mut secret = [0u8; 16];
    getrandom::fill(&mut secret).unwrap();
    let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let port = free_port();
    let stop = Arc::new(AtomicBool::new(false));
    let made = Arc::new(AtomicUsize::new(0));
    // Rank 0 first; its rendezvous (and its status and /metrics ports) are attacked before
    // and while the other ranks join.
    let mut kids: Vec<Child> = vec![spawn_rank(0, N, port, &hex, free_port(), free_port())];
    let start = Instant::now();
    let rendezvous = SocketAddr::from(([127, 0, 0, 1], port));
    while !listening(kids[0].id()).contains(&rendezvous) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "rank 0 does not listen on {port}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let first_ports = listening(kids[0].id());
    let mut attackers = attack_all(&first_ports, &stop, &made);
    std::thread::sleep(Duration::from_millis(1500));
    for r in 1..N {
        kids.push(spawn_rank(r, N, port, &hex, 0, free_port()));
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let mut outs = Vec::new();
    for (r, k) in kids.iter_mut().enumerate() {
        let out = k.stdout.take().unwrap();
        let tx = tx.clone();
        outs.push(std::thread::spawn(move || {
            let mut lines = Vec::new();
            for line in std::io::BufReader::new(out).lines().map_while(|l| l.ok()) {
                if line == "CHILD READY" {
                    let _ = tx.send(r);
                }
                lines.push(line);
            }
            lines
        }));
    }
    let mut ready = 0;
    while ready < N {
        if rx.recv_timeout(Duration::from_secs(60)).is_err() {
            stop.store(true, Ordering::Relaxed);
            for k in &mut kids {
                let _ = k.kill();
            }
            panic!("only {ready} of {N} ranks finished init under attack in 60 s");
        }
        ready += 1;
    }
    let init_took = start.elapsed();
    // Every port of every rank now (the data, exchange, status and shrink listeners).
    let base: Vec<(usize, usize)> = kids.iter().map(|k| usage(k.id())).collect();
    let mut all = BTreeSet::new();
    for k in &kids {
        all.extend(listening(k.id()));
    }
    let fresh: BTreeSet<SocketAddr> = all.difference(&first_ports).copied().collect();
    attackers.extend(attack_all(&fresh, &stop, &made));
    let mut peak = base.clone();
    let by = Instant::now() + CALLS_FOR + Duration::from_secs(40);
    while kids
        .iter_mut()
        .any(|k| k.try_wait().ok().flatten().is_none())
        && Instant::now() < by
    {
        for (i, k) in kids.iter().enumerate() {
            let (t, rss) = usage(k.id());
            peak[i] = (peak[i].0.max(t), peak[i].1.max(rss));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    let ends: Vec<(std::process::Output, Vec<String>)> = kids
        .into_iter()
        .zip(outs)
        .map(|(k, o)| {
            let out = output_by(
                k,
                Instant::now() + Duration::from_secs(1),
                Duration::from_millis(5),
            );
            (out, o.join().unwrap())
        })
        .collect();
    for a in attackers {
        a.join().unwrap();
    }
    println!(
        "init under attack in {init_took:?}; {} attacking connections to {} ports ({:?} then {:?}); threads and RSS (KiB) per rank before {base:?}, peak {peak:?}",
        made.load(Ordering::Relaxed),
        all.len(),
        first_ports,
        fresh
    );
    for (r, (o, lines)) in ends.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            o.status.success() && lines.iter().any(|l| l.starts_with("CHILD OK")),
            "rank {r} ended with {:?}: {lines:?}\n{err}",
            o.status
        );
        assert!(!err.contains("panicked"), "rank {r}: {err}");
        // Strangers cost no thread each (a few bounded pools at most) and little memory.
        assert!(
            peak[r].0 <= base[r].0 + 96,
            "rank {r}: {} threads under attack, {} before",
            peak[r].0,
            base[r].0
        );
        assert!(
            peak[r].1 <= base[r].1 + (128 << 10),
            "rank {r}: {} KiB resident under attack, {} before",
            peak[r].1,
            base[r].1
        );
    }
}
