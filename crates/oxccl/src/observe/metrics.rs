//! Per-communicator call metrics, in NCCL Inspector's formats: with `OXCCL_METRICS=DIR` each
//! rank counts, per collective, its calls, bytes, time and errors, and writes them every
//! `OXCCL_METRICS_INTERVAL` seconds, when the communicator is dropped, and at process exit
//! (`exit()`) for those still alive:
//!
//! - `DIR/oxccl-<host>-<pid>-<comm>-r<rank>.jsonl`: JSON lines shaped as NCCL Inspector's
//!   (`header`, `metadata`, `coll_perf` with `coll`, `coll_sn`, `coll_msg_size_bytes`,
//!   `coll_exec_time_us`, `coll_algobw_gbs`, `coll_busbw_gbs` of the latest call), one per
//!   collective that ran since the last write, with the running totals under `oxccl`;
//! - `DIR/oxccl-<host>-<pid>-<comm>-r<rank>.prom`: the same as a Prometheus text file for
//!   node-exporter's textfile collector, rewritten (atomically) at every write.
//!
//! With `OXCCL_METRICS_PORT=PORT` (on 127.0.0.1) or `HOST:PORT`, each process also serves
//! every live communicator's metrics over HTTP/1.1 at `GET /metrics`, in Prometheus' text
//! exposition format (version 0.0.4): counters of calls, bytes, time and errors per
//! collective, and a histogram of call times (`oxccl_collective_call_seconds`, buckets
//! [`BUCKETS`]). The server ([`serve`]) runs on its own thread, one thread per connection (at
//! most [`MAX_HTTP_CONNECTIONS`]), each bounded by [`HTTP_TIMEOUT`]: silent clients cannot
//! block it.
//!
//! Sizes and bandwidths follow nccl-tests (as `oxccl perf`): the size is the buffer for
//! all_reduce, broadcast, reduce and point-to-point, the gathered output for all_gather, the
//! input for reduce_scatter and the whole send buffer for all_to_all; `algbw = size / time`,
//! `busbw = algbw × factor`. Recording on the call path is one clock read at the start and one
//! at the end, and a few relaxed atomic stores (calls of a communicator are serialized, so
//! there is one writer); off (the default) it is one branch.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::{Duration, Instant};

use crate::base::dtype::DataType;
use crate::base::error::FailureKind;
use crate::fault::fingerprint::Fingerprint;
use crate::observe::flight::json_str;

/// The calls counted, by name, with NCCL Inspector's names for them.
const KINDS: [(&str, &str); 10] = [
    ("all_reduce", "AllReduce"),
    ("broadcast", "Broadcast"),
    ("reduce", "Reduce"),
    ("all_gather", "AllGather"),
    ("reduce_scatter", "ReduceScatter"),
    ("all_to_all", "AllToAll"),
    ("barrier", "Barrier"),
    ("send", "Send"),
    ("recv", "Recv"),
    ("sendrecv", "SendRecv"),
];

fn kind_index(call: &str) -> Option<usize> {
    KINDS.iter().position(|(n, _)| *n == call)
}

/// Upper bounds (seconds) of the buckets of the call-time histogram (and `+Inf`).
pub const BUCKETS: [f64; 8] = [1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0];
/// Bucket upper bounds in nanoseconds.
const BUCKETS_NS: [u64; 8] = [
    10_000,
    100_000,
    1_000_000,
    10_000_000,
    100_000_000,
    1_000_000_000,
    10_000_000_000,
    100_000_000_000,
];

/// The kinds of failure counted apart, by [`FailureKind::code`] − 1, with their label.
const ERROR_KINDS: [&str; 6] = [
    "mismatch",
    "peer_lost",
    "timeout",
    "aborted",
    "protocol",
    "other",
];

/// One collective's counters. Written by the communicator's calls only (serialized), read by
/// the writer thread: relaxed loads and stores suffice (a write may see a call half-counted;
/// the next write sees it whole).
#[derive(Debug, Default)]
struct KindStats {
    calls: AtomicU64,
    errors: AtomicU64,
    bytes: AtomicU64,
    time_ns: AtomicU64,
    last_seq: AtomicU64,
    last_bytes: AtomicU64,
    last_ns: AtomicU64,
    /// Failed calls per kind of failure ([`FailureKind::code`] − 1).
    errors_by: [AtomicU64; ERROR_KINDS.len()],
    /// Completed calls per time bucket (not cumulative; the last is above every bound).
    hist: [AtomicU64; BUCKETS.len() + 1],
    /// `calls + errors` at the last write (the writer's own).
    written: AtomicU64,
}

fn bump(a: &AtomicU64, by: u64) {
    a.store(
        a.load(Ordering::Relaxed).wrapping_add(by),
        Ordering::Relaxed,
    );
}

/// What one rank's communicator is, for the labels.
#[derive(Clone, Debug)]
pub struct Identity {
    /// The communicator's tag (its id in file names and labels).
    pub comm: u64,
    /// This rank.
    pub rank: usize,
    /// Ranks of the communicator.
    pub nranks: usize,
    /// Hosts of the communicator.
    pub nnodes: usize,
}

/// A communicator's metrics; see the module documentation.
#[derive(Debug)]
pub struct Metrics {
    id: Identity,
    host: String,
    /// Files' path without extension; `None`: served only (no `OXCCL_METRICS`).
    base: Option<PathBuf>,
    epoch: Instant,
    /// Start of the running call, nanoseconds after `epoch`.
    start_ns: AtomicU64,
    kinds: [KindStats; KINDS.len()],
    /// Serializes writes (the writer thread and the final write at drop).
    write_lock: Mutex<()>,
    /// Whether a failed write has been reported on stderr (once per communicator).
    warned: std::sync::atomic::AtomicBool,
}

/// nccl-tests' bus bandwidth factor of a collective of `n` ranks (by [`KINDS`] index).
fn bus_factor(kind: usize, n: usize) -> f64 {
    let n = n.max(1) as f64;
    match KINDS[kind].0 {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "reduce_scatter" | "all_to_all" => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// nccl-tests' size of a call (see the module documentation), from its fingerprint.
fn call_bytes(kind: usize, fp: &Fingerprint, nranks: usize) -> u64 {
    let es = DataType::ALL
        .get(fp.dtype as usize)
        .map_or(0, |d| d.size() as u64);
    let per = fp.count.saturating_mul(es);
    match KINDS[kind].0 {
        "all_gather" | "reduce_scatter" | "all_to_all" => per.saturating_mul(nranks as u64),
        "barrier" => 0,
        _ => per,
    }
}

/// GB/s of `bytes` in `ns`.
fn gbps(bytes: u64, ns: u64) -> f64 {
    if ns == 0 {
        0.0
    } else {
        bytes as f64 / ns as f64
    }
}

impl Metrics {
    /// Metrics of a communicator written under `dir` every `interval` (by one thread per
    /// process, started with the first).
    pub fn new(id: Identity, dir: &str, interval: Duration) -> Arc<Metrics> {
        Metrics::with_files(id, Some(dir), interval)
    }

    /// Metrics of a communicator, written under `dir` every `interval` if given, else only
    /// served (see [`serve`]).
    pub fn with_files(id: Identity, dir: Option<&str>, interval: Duration) -> Arc<Metrics> {
        let host = rustix::system::uname()
            .nodename()
            .to_string_lossy()
            .into_owned();
        let base = dir.map(|dir| {
            if let Err(e) = std::fs::create_dir_all(dir) {
                crate::base::debug::announce(&format!(
                    "rank {}: OXCCL_METRICS={dir}: cannot create the directory: {}; no metrics files will be written \
                     (set OXCCL_METRICS to a writable directory)",
                    id.rank,
                    crate::base::error::with_explanation(&e)
                ));
            }
            Path::new(dir).join(format!(
                "oxccl-{host}-{}-{:08x}-r{}",
                std::process::id(),
                id.comm as u32,
                id.rank
            ))
        });
        let m = Arc::new(Metrics {
            id,
            host,
            base,
            epoch: Instant::now(),
            start_ns: AtomicU64::new(0),
            kinds: Default::default(),
            write_lock: Mutex::new(()),
            warned: std::sync::atomic::AtomicBool::new(false),
        });
        register(&m, interval);
        m
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Records the start of a call (calls of one communicator do not overlap).
    #[inline]
    pub fn begin(&self) {
        self.start_ns.store(self.now_ns(), Ordering::Relaxed);
    }

    /// Records the end of call `seq` named `call`.
    #[inline]
    pub fn end(&self, seq: u64, call: &str, fp: &Fingerprint, failed: bool) {
        let ns = self
            .now_ns()
            .saturating_sub(self.start_ns.load(Ordering::Relaxed));
        let Some(k) = kind_index(call) else { return };
        let s = &self.kinds[k];
        if failed {
            bump(&s.errors, 1);
            return;
        }
        let bytes = call_bytes(k, fp, self.id.nranks);
        bump(&s.calls, 1);
        bump(&s.bytes, bytes);
        bump(&s.time_ns, ns);
        let b = BUCKETS_NS
            .iter()
            .position(|&ub| ns <= ub)
            .unwrap_or(BUCKETS.len());
        bump(&s.hist[b], 1);
        s.last_seq.store(seq, Ordering::Relaxed);
        s.last_bytes.store(bytes, Ordering::Relaxed);
        s.last_ns.store(ns, Ordering::Relaxed);
    }

    /// Counts the failure of call `call` by its kind (after [`end`](Self::end) counted it
    /// failed; the failure path only).
    pub fn failed_with(&self, call: &str, kind: FailureKind) {
        let Some(k) = kind_index(call) else { return };
        let i = usize::from(kind.code().saturating_sub(1)).min(ERROR_KINDS.len() - 1);
        bump(&self.kinds[k].errors_by[i], 1);
    }

    /// The JSON lines of the collectives that ran since the last call (all of them with
    /// `all`), and marks them written.
    pub fn json_lines(&self, all: bool) -> String {
        let mut out = String::new();
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        for (k, s) in self.kinds.iter().enumerate() {
            let (calls, errors) = (
                s.calls.load(Ordering::Relaxed),
                s.errors.load(Ordering::Relaxed),
            );
            let seen = calls + errors;
            if seen == 0 || (!all && s.written.load(Ordering::Relaxed) == seen) {
                continue;
            }
            s.written.store(seen, Ordering::Relaxed);
            let (bytes, time_ns) = (
                s.bytes.load(Ordering::Relaxed),
                s.time_ns.load(Ordering::Relaxed),
            );
            let (lb, lns) = (
                s.last_bytes.load(Ordering::Relaxed),
                s.last_ns.load(Ordering::Relaxed),
            );
            let f = bus_factor(k, self.id.nranks);
            let _ = writeln!(
                out,
                "{{\"header\":{{\"id\":\"0x{:x}\",\"rank\":{},\"n_ranks\":{},\"nnodes\":{}}},\
                 \"metadata\":{{\"inspector_output_format_version\":\"v4.0\",\"git_rev\":\"\",\
                 \"rec_mechanism\":\"oxccl_metrics\",\"dump_timestamp_us\":{now_us},\
                 \"hostname\":{},\"pid\":{}}},\
                 \"coll_perf\":{{\"coll\":\"{}\",\"coll_sn\":{},\"coll_msg_size_bytes\":{lb},\
                 \"coll_exec_time_us\":{},\"coll_timing_source\":\"cpu_wall\",\
                 \"coll_algobw_gbs\":{:.6},\"coll_busbw_gbs\":{:.6}}},\
                 \"oxccl\":{{\"call\":\"{}\",\"calls\":{calls},\"errors\":{errors},\
                 \"bytes\":{bytes},\"time_us\":{},\"algbw_gbs\":{:.6},\"busbw_gbs\":{:.6}}}}}",
                self.id.comm,
                self.id.rank,
                self.id.nranks,
                self.id.nnodes,
                json_str(&self.host),
                std::process::id(),
                KINDS[k].1,
                s.last_seq.load(Ordering::Relaxed),
                lns / 1000,
                gbps(lb, lns),
                gbps(lb, lns) * f,
                KINDS[k].0,
                time_ns / 1000,
                gbps(bytes, time_ns),
                gbps(bytes, time_ns) * f,
            );
        }
        out
    }

    /// The metrics as a Prometheus text file (node-exporter textfile collector).
    pub fn prometheus(&self) -> String {
        exposition(&[self])
    }

    /// This communicator's labels of collective `k`.
    fn labels(&self, k: usize) -> String {
        format!(
            "comm_id=\"0x{:x}\",collective=\"{}\",hostname={},rank=\"{}\",n_ranks=\"{}\",n_nodes=\"{}\",pid=\"{}\"",
            self.id.comm,
            KINDS[k].1,
            json_str(&self.host),
            self.id.rank,
            self.id.nranks,
            self.id.nnodes,
            std::process::id()
        )
    }

    /// The files this communicator writes: (JSON lines, Prometheus).
    pub fn files(&self) -> (PathBuf, PathBuf) {
        let base = self.base.clone().unwrap_or_default();
        (base.with_extension("jsonl"), base.with_extension("prom"))
    }

    /// Appends the new JSON lines and rewrites the Prometheus file (nothing before the first
    /// call); errors are logged.
    pub fn write(&self, all: bool) {
        let _g = self.write_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.write_locked(all);
    }

    /// [`write`](Self::write), with the write lock held.
    fn write_locked(&self, all: bool) {
        let idle = self
            .kinds
            .iter()
            .all(|s| s.calls.load(Ordering::Relaxed) + s.errors.load(Ordering::Relaxed) == 0);
        let Some(base) = &self.base else { return };
        if idle {
            return;
        }
        let (jsonl, prom) = self.files();
        let lines = self.json_lines(all);
        let res = (|| -> std::io::Result<()> {
            if !lines.is_empty() {
                use std::io::Write;
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&jsonl)?
                    .write_all(lines.as_bytes())?;
            }
            let tmp = base.with_extension("prom.tmp");
            std::fs::write(&tmp, self.prometheus())?;
            std::fs::rename(&tmp, &prom)
        })();
        if let Err(e) = res {
            if !self.warned.swap(true, Ordering::Relaxed) {
                crate::base::debug::announce(&format!(
                    "rank {}: cannot write the metrics files {}.{{jsonl,prom}}: {}; check that the OXCCL_METRICS \
                     directory exists and is writable (said once; later failures go to OXCCL_DEBUG)",
                    self.id.rank,
                    base.display(),
                    crate::base::error::with_explanation(&e)
                ));
            } else {
                tracing::warn!(rank = self.id.rank, path = %base.display(), "cannot write metrics: {e}");
            }
        }
    }
}

impl Drop for Metrics {
    fn drop(&mut self) {
        self.write(false);
    }
}

static LIVE: Mutex<Vec<Weak<Metrics>>> = Mutex::new(Vec::new());
static WRITER: Once = Once::new();

fn register(m: &Arc<Metrics>, interval: Duration) {
    {
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(m));
    }
    let interval = interval.max(Duration::from_millis(10));
    WRITER.call_once(|| {
        // SAFETY: `write_at_exit` takes no arguments, does not unwind (it catches panics) and
        // touches only statics and what they keep alive; `atexit` may be called any time.
        if unsafe { libc::atexit(write_at_exit) } != 0 {
            tracing::warn!("cannot register the metrics' last write at exit");
        }
        let spawned = std::thread::Builder::new()
            .name("oxccl-metrics".into())
            .spawn(move || loop {
                std::thread::sleep(interval);
                let live: Vec<Arc<Metrics>> = LIVE
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .filter_map(|w| w.upgrade())
                    .collect();
                for m in live {
                    m.write(false);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start the metrics thread: {e}");
        }
    });
}

/// At process exit (`exit()`, e.g. an interpreter ending without dropping its
/// communicators): the last write of every live communicator's metrics. Skips what another
/// thread holds rather than wait.
extern "C" fn write_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        let Ok(live) = LIVE.try_lock() else { return };
        let live: Vec<Arc<Metrics>> = live.iter().filter_map(|w| w.upgrade()).collect();
        for m in live {
            if let Ok(_g) = m.write_lock.try_lock() {
                m.write_locked(false);
            }
        }
    });
}

/// The Prometheus text exposition (format 0.0.4) of these communicators' metrics: each
/// family's `HELP` and `TYPE` once, then its series for every communicator and collective
/// that ran.
pub fn exposition(ms: &[&Metrics]) -> String {
    type Get = fn(&KindStats, f64) -> f64;
    let series: [(&str, &str, &str, Get); 7] = [
        (
            "oxccl_collective_calls_total",
            "counter",
            "Completed calls.",
            |s, _| s.calls.load(Ordering::Relaxed) as f64,
        ),
        (
            "oxccl_collective_errors_total",
            "counter",
            "Failed calls.",
            |s, _| s.errors.load(Ordering::Relaxed) as f64,
        ),
        (
            "oxccl_collective_bytes_total",
            "counter",
            "Bytes of completed calls (nccl-tests sizes).",
            |s, _| s.bytes.load(Ordering::Relaxed) as f64,
        ),
        (
            "oxccl_collective_time_seconds_total",
            "counter",
            "Time in completed calls.",
            |s, _| s.time_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        ),
        (
            "oxccl_collective_exec_time_microseconds",
            "gauge",
            "Time of the latest call.",
            |s, _| s.last_ns.load(Ordering::Relaxed) as f64 * 1e-3,
        ),
        (
            "oxccl_algorithm_bandwidth_gbs",
            "gauge",
            "Algorithm bandwidth of the latest call, GB/s.",
            |s, _| {
                gbps(
                    s.last_bytes.load(Ordering::Relaxed),
                    s.last_ns.load(Ordering::Relaxed),
                )
            },
        ),
        (
            "oxccl_bus_bandwidth_gbs",
            "gauge",
            "Bus bandwidth of the latest call, GB/s.",
            |s, f| {
                gbps(
                    s.last_bytes.load(Ordering::Relaxed),
                    s.last_ns.load(Ordering::Relaxed),
                ) * f
            },
        ),
    ];
    let ran =
        |s: &KindStats| s.calls.load(Ordering::Relaxed) + s.errors.load(Ordering::Relaxed) > 0;
    let mut out = String::new();
    for (name, ty, help, get) in series {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {ty}");
        for m in ms {
            for (k, s) in m.kinds.iter().enumerate().filter(|(_, s)| ran(s)) {
                let v = get(s, bus_factor(k, m.id.nranks));
                let _ = writeln!(out, "{name}{{{}}} {v}", m.labels(k));
            }
        }
    }
    let name = "oxccl_collective_errors_by_kind_total";
    let _ = writeln!(
        out,
        "# HELP {name} Failed calls by kind of failure.\n# TYPE {name} counter"
    );
    for m in ms {
        for (k, s) in m.kinds.iter().enumerate().filter(|(_, s)| ran(s)) {
            let l = m.labels(k);
            for (i, kind) in ERROR_KINDS.iter().enumerate() {
                let v = s.errors_by[i].load(Ordering::Relaxed);
                let _ = writeln!(out, "{name}{{{l},kind=\"{kind}\"}} {v}");
            }
        }
    }
    let name = "oxccl_collective_call_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} Time of completed calls.\n# TYPE {name} histogram"
    );
    for m in ms {
        for (k, s) in m.kinds.iter().enumerate().filter(|(_, s)| ran(s)) {
            let l = m.labels(k);
            let mut cum = 0u64;
            for (b, ub) in BUCKETS.iter().enumerate() {
                cum += s.hist[b].load(Ordering::Relaxed);
                let _ = writeln!(out, "{name}_bucket{{{l},le=\"{ub:?}\"}} {cum}");
            }
            cum += s.hist[BUCKETS.len()].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{l},le=\"+Inf\"}} {cum}");
            let sum = s.time_ns.load(Ordering::Relaxed) as f64 * 1e-9;
            let _ = writeln!(out, "{name}_sum{{{l}}} {sum}\n{name}_count{{{l}}} {cum}");
        }
    }
    out
}

/// Every live communicator's metrics in this process, as [`exposition`].
pub fn exposition_all() -> String {
    let live: Vec<Arc<Metrics>> = LIVE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(|w| w.upgrade())
        .collect();
    let refs: Vec<&Metrics> = live.iter().map(|m| &**m).collect();
    exposition(&refs)
}

/// Bound of reading a request and writing an answer of the `/metrics` server.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections the `/metrics` server serves at once; more get `503`.
pub const MAX_HTTP_CONNECTIONS: usize = 16;
/// The longest request head read.
const MAX_HTTP_HEAD: usize = 8192;

/// The address of this process's `/metrics` server (the first [`serve`] started).
static SERVER: Mutex<Option<SocketAddr>> = Mutex::new(None);

/// Starts this process's `/metrics` server on `addr` (`OXCCL_METRICS_PORT`) unless it runs:
/// where it listens. The server lives as long as the process.
pub fn serve(addr: SocketAddr) -> std::io::Result<SocketAddr> {
    let mut server = SERVER.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(a) = *server {
        return Ok(a);
    }
    let l = TcpListener::bind(addr)?;
    let at = l.local_addr()?;
    l.set_nonblocking(true)?;
    let active = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("oxccl-metrics-http".into())
        .spawn(move || loop {
            match l.accept() {
                Ok((s, _)) => {
                    if active.fetch_add(1, Ordering::AcqRel) >= MAX_HTTP_CONNECTIONS {
                        active.fetch_sub(1, Ordering::AcqRel);
                        let _ = s.set_nonblocking(true);
                        let _ = (&s).write_all(&http_answer(
                            "503 Service Unavailable",
                            "too many connections\n",
                        ));
                        continue;
                    }
                    let a = active.clone();
                    let spawned = std::thread::Builder::new()
                        .name("oxccl-metrics-conn".into())
                        .spawn(move || {
                            http_serve(&s);
                            a.fetch_sub(1, Ordering::AcqRel);
                        });
                    if spawned.is_err() {
                        active.fetch_sub(1, Ordering::AcqRel);
                    }
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        })?;
    tracing::info!(addr = %at, "metrics served at /metrics");
    *server = Some(at);
    Ok(at)
}

fn http_answer(status: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Answers one HTTP request (the head read within [`HTTP_TIMEOUT`]).
fn http_serve(s: &TcpStream) {
    let _ = s.set_nonblocking(false);
    let _ = s.set_write_timeout(Some(HTTP_TIMEOUT));
    let deadline = Instant::now() + HTTP_TIMEOUT;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    let complete = loop {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            break false;
        };
        if s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .is_err()
        {
            break false;
        }
        match (&*s).read(&mut buf) {
            Ok(0) | Err(_) => break false,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
        if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
            break true;
        }
        if head.len() > MAX_HTTP_HEAD {
            break false;
        }
    };
    let text = String::from_utf8_lossy(&head);
    let mut first = text.lines().next().unwrap_or("").split_whitespace();
    let (method, path) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
    let answer = if !complete {
        http_answer("400 Bad Request", "incomplete request\n")
    } else if method != "GET" && method != "HEAD" {
        http_answer("405 Method Not Allowed", "only GET /metrics\n")
    } else if path != "/metrics" && !path.starts_with("/metrics?") {
        http_answer("404 Not Found", "see /metrics\n")
    } else {
        let mut a = http_answer("200 OK", &exposition_all());
        if method == "HEAD" {
            if let Some(p) = a.windows(4).position(|w| w == b"\r\n\r\n") {
                a.truncate(p + 4);
            }
        }
        a
    };
    let _ = (&*s).write_all(&answer);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CollKind, ReduceOp};

    #[test]
    fn counts_sizes_and_formats() {
        let dir = std::env::temp_dir().join(format!("oxccl-metrics-{}", std::process::id()));
        let id = Identity {
            comm: 0xabc,
            rank: 1,
            nranks: 4,
            nnodes: 1,
        };
        let m = Metrics::new(id, dir.to_str().unwrap(), Duration::from_secs(3600));
        let fp = Fingerprint::of(CollKind::AllGather, DataType::F32, ReduceOp::Sum, 256, 0);
        for seq in 1..=3 {
            m.begin();
            m.end(seq, "all_gather", &fp, seq == 2);
        }
        let lines = m.json_lines(false);
        assert_eq!(lines.lines().count(), 1, "{lines}");
        let v = lines.lines().next().unwrap();
        // 256 f32 per rank, 4 ranks: 4 KiB gathered; two completed calls, one failed.
        for want in [
            "\"coll\":\"AllGather\"",
            "\"coll_sn\":3",
            "\"coll_msg_size_bytes\":4096",
            "\"calls\":2,\"errors\":1,\"bytes\":8192",
            "\"n_ranks\":4",
        ] {
            assert!(v.contains(want), "{want} not in {v}");
        }
        assert!(m.json_lines(false).is_empty(), "nothing new since");
        let prom = m.prometheus();
        assert!(
            prom.contains(
                "oxccl_collective_calls_total{comm_id=\"0xabc\",collective=\"AllGather\""
            ) && prom.contains("oxccl_collective_errors_total{")
                && prom.contains("} 1\n"),
            "{prom}"
        );
        let (jsonl, promf) = m.files();
        drop(m);
        assert!(std::fs::read_to_string(promf)
            .unwrap()
            .contains("oxccl_bus_bandwidth_gbs"));
        let _ = std::fs::remove_file(jsonl);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A directory that cannot be made, or files that cannot be written, are said on stderr
    /// (once per communicator for the files), not only through `tracing`.
    #[test]
    fn an_unwritable_directory_is_said() {
        let id = Identity {
            comm: 0xdead,
            rank: 3,
            nranks: 4,
            nnodes: 1,
        };
        let m = Metrics::new(id, "/proc/oxccl-no-such-dir", Duration::from_secs(3600));
        let fp = Fingerprint::of(CollKind::AllReduce, DataType::F32, ReduceOp::Sum, 4, 0);
        m.begin();
        m.end(1, "all_reduce", &fp, false);
        m.write(false);
        m.write(false);
        let said: Vec<String> = crate::base::debug::ANNOUNCED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|l| l.contains("oxccl-no-such-dir"))
            .cloned()
            .collect();
        assert!(
            said.iter().any(|l| l.starts_with(
                "rank 3: OXCCL_METRICS=/proc/oxccl-no-such-dir: cannot create the directory: "
            )),
            "{said:#?}"
        );
        let files = said
            .iter()
            .filter(|l| l.starts_with("rank 3: cannot write the metrics files "))
            .count();
        assert_eq!(files, 1, "said once: {said:#?}");
    }

    /// Checks `text` against the Prometheus text format 0.0.4 strictly: every line a comment
    /// (`# HELP`/`# TYPE` once per family, before its samples) or `name{labels} value`, with
    /// valid names, quoted label values, float values; histograms cumulative, ending in
    /// `+Inf` equal to `_count`. Returns the samples.
    fn parse_strictly(text: &str) -> Vec<(String, String, f64)> {
        use std::collections::HashMap;
        let name_ok = |n: &str| {
            !n.is_empty()
                && n.chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        };
        let mut types: HashMap<String, String> = HashMap::new();
        let mut helps: HashMap<String, ()> = HashMap::new();
        let mut samples = Vec::new();
        assert!(text.ends_with('\n'), "the exposition ends with a newline");
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap();
                assert!(name_ok(name), "{line}");
                assert!(
                    helps.insert(name.into(), ()).is_none(),
                    "HELP twice: {line}"
                );
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut it = rest.split(' ');
                let (name, ty) = (it.next().unwrap(), it.next().unwrap());
                assert!(["counter", "gauge", "histogram"].contains(&ty), "{line}");
                assert!(
                    types.insert(name.into(), ty.into()).is_none(),
                    "TYPE twice: {line}"
                );
                continue;
            }
            assert!(
                !line.starts_with('#') && !line.is_empty(),
                "stray line: {line:?}"
            );
            let open = line.find('{').expect("labels");
            let close = line.rfind('}').expect("labels");
            let name = &line[..open];
            assert!(name_ok(name), "{line}");
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    name.strip_suffix(s)
                        .filter(|f| types.get(*f).is_some_and(|t| t == "histogram"))
                })
                .unwrap_or(name);
            assert!(types.contains_key(family), "sample before its TYPE: {line}");
            let labels = &line[open + 1..close];
            let mut rest = labels;
            while !rest.is_empty() {
                let eq = rest.find("=\"").expect("label=\"value\"");
                assert!(name_ok(&rest[..eq]), "{line}");
                let after = &rest[eq + 2..];
                let mut end = None;
                let mut esc = false;
                for (i, c) in after.char_indices() {
                    match (esc, c) {
                        (true, _) => esc = false,
                        (false, '\\') => esc = true,
                        (false, '"') => {
                            end = Some(i);
                            break;
                        }
                        _ => {}
                    }
                }
                let end = end.expect("closing quote");
                rest = &after[end + 1..];
                rest = rest.strip_prefix(',').unwrap_or(rest);
            }
            let v = line[close + 1..]
                .strip_prefix(' ')
                .expect("one space before the value");
            let v: f64 = match v {
                "+Inf" => f64::INFINITY,
                v => v.parse().unwrap_or_else(|_| panic!("value of {line}")),
            };
            samples.push((name.to_string(), labels.to_string(), v));
        }
        for (f, t) in &types {
            assert!(helps.contains_key(f), "{f} has no HELP");
            if t != "histogram" {
                continue;
            }
            let mut last = 0.0;
            for (n, l, v) in samples
                .iter()
                .filter(|(n, _, _)| n == &format!("{f}_bucket"))
            {
                if l.contains("le=\"1e-5\"") {
                    last = 0.0;
                }
                assert!(*v >= last, "{n}{{{l}}} not cumulative");
                last = *v;
                if l.contains("le=\"+Inf\"") {
                    let count = l.replace(",le=\"+Inf\"", "");
                    assert!(
                        samples
                            .iter()
                            .any(|(n2, l2, v2)| n2 == &format!("{f}_count")
                                && *l2 == count
                                && v2 == v),
                        "+Inf bucket differs from _count: {l}"
                    );
                }
            }
        }
        samples
    }

    #[test]
    fn serves_the_exposition_format_over_http() {
        let id = |comm| Identity {
            comm,
            rank: 0,
            nranks: 2,
            nnodes: 1,
        };
        let a = Metrics::with_files(id(0xa1), None, Duration::from_secs(3600));
        let b = Metrics::with_files(id(0xb2), None, Duration::from_secs(3600));
        let fp = Fingerprint::of(CollKind::AllReduce, DataType::F32, ReduceOp::Sum, 1024, 0);
        for seq in 1..=5 {
            a.begin();
            a.end(seq, "all_reduce", &fp, seq == 5);
        }
        a.failed_with("all_reduce", FailureKind::Timeout);
        b.begin();
        std::thread::sleep(Duration::from_millis(2));
        b.end(1, "broadcast", &fp, false);
        let at = serve("127.0.0.1:0".parse().unwrap()).unwrap();
        // Silent connections do not block it.
        let silent: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(at).unwrap()).collect();
        let get = |req: &str| {
            let s = TcpStream::connect(at).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            (&s).write_all(req.as_bytes()).unwrap();
            let mut out = String::new();
            (&s).read_to_string(&mut out).unwrap();
            out
        };
        let t = Instant::now();
        let r = get("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        // Quiet, an answer takes a millisecond; a server blocked by the 8 silent connections
        // would take their timeout (`HTTP_TIMEOUT`, 2 s) each, 16 s.
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        drop(silent);
        let (head, body) = r.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(
            head.contains("Content-Type: text/plain; version=0.0.4"),
            "{head}"
        );
        assert!(
            head.contains(&format!("Content-Length: {}", body.len())),
            "{head}"
        );
        let samples = parse_strictly(body);
        let find = |name: &str, comm: &str, coll: &str| {
            samples
                .iter()
                .find(|(n, l, _)| {
                    n == name
                        && l.contains(&format!("comm_id=\"{comm}\""))
                        && l.contains(&format!("collective=\"{coll}\""))
                        && !l.contains("le=")
                })
                .map(|s| s.2)
        };
        assert_eq!(
            find("oxccl_collective_calls_total", "0xa1", "AllReduce"),
            Some(4.0)
        );
        assert_eq!(
            find("oxccl_collective_errors_total", "0xa1", "AllReduce"),
            Some(1.0)
        );
        assert_eq!(
            find("oxccl_collective_bytes_total", "0xa1", "AllReduce"),
            Some(4.0 * 4096.0)
        );
        assert_eq!(
            find("oxccl_collective_call_seconds_count", "0xa1", "AllReduce"),
            Some(4.0)
        );
        let by_kind = |kind: &str| {
            samples
                .iter()
                .find(|(n, l, _)| {
                    n == "oxccl_collective_errors_by_kind_total"
                        && l.contains("0xa1")
                        && l.ends_with(&format!("kind=\"{kind}\""))
                })
                .map(|s| s.2)
        };
        assert_eq!(by_kind("timeout"), Some(1.0));
        assert_eq!(by_kind("peer_lost"), Some(0.0));
        assert_eq!(
            find("oxccl_collective_calls_total", "0xb2", "Broadcast"),
            Some(1.0)
        );
        // The broadcast took 2 ms or more: not in the buckets up to 1 ms, in the 10 ms one or above.
        let bucket = |le: &str| {
            samples
                .iter()
                .find(|(n, l, _)| {
                    n == "oxccl_collective_call_seconds_bucket"
                        && l.contains("0xb2")
                        && l.contains(&format!("le=\"{le}\""))
                })
                .map(|s| s.2)
        };
        assert_eq!(bucket("0.001"), Some(0.0));
        assert_eq!(bucket("+Inf"), Some(1.0));
        assert!(get("GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get("POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        // The same server for a second start.
        assert_eq!(serve("127.0.0.1:0".parse().unwrap()).unwrap(), at);
    }
}
