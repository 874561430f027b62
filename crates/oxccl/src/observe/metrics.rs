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
//! Sizes and bandwidths follow nccl-tests (as `oxccl perf`): the size is the buffer for
//! all_reduce, broadcast, reduce and point-to-point, the gathered output for all_gather, the
//! input for reduce_scatter and the whole send buffer for all_to_all; `algbw = size / time`,
//! `busbw = algbw × factor`. Recording on the call path is one clock read at the start and one
//! at the end, and a few relaxed atomic stores (calls of a communicator are serialized, so
//! there is one writer); off (the default) it is one branch.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::{Duration, Instant};

use crate::base::dtype::DataType;
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
    base: PathBuf,
    epoch: Instant,
    /// Start of the running call, nanoseconds after `epoch`.
    start_ns: AtomicU64,
    kinds: [KindStats; KINDS.len()],
    /// Serializes writes (the writer thread and the final write at drop).
    write_lock: Mutex<()>,
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
        let host = rustix::system::uname()
            .nodename()
            .to_string_lossy()
            .into_owned();
        if let Err(e) = std::fs::create_dir_all(dir) {
            tracing::warn!(rank = id.rank, "OXCCL_METRICS={dir}: cannot create it: {e}");
        }
        let base = Path::new(dir).join(format!(
            "oxccl-{host}-{}-{:08x}-r{}",
            std::process::id(),
            id.comm as u32,
            id.rank
        ));
        let m = Arc::new(Metrics {
            id,
            host,
            base,
            epoch: Instant::now(),
            start_ns: AtomicU64::new(0),
            kinds: Default::default(),
            write_lock: Mutex::new(()),
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
        s.last_seq.store(seq, Ordering::Relaxed);
        s.last_bytes.store(bytes, Ordering::Relaxed);
        s.last_ns.store(ns, Ordering::Relaxed);
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
        let labels = |k: usize| {
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
        };
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
        let mut out = String::new();
        for (name, ty, help, get) in series {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {ty}");
            for (k, s) in self.kinds.iter().enumerate() {
                if s.calls.load(Ordering::Relaxed) + s.errors.load(Ordering::Relaxed) == 0 {
                    continue;
                }
                let v = get(s, bus_factor(k, self.id.nranks));
                let _ = writeln!(out, "{name}{{{}}} {v}", labels(k));
            }
        }
        out
    }

    /// The files this communicator writes: (JSON lines, Prometheus).
    pub fn files(&self) -> (PathBuf, PathBuf) {
        (
            self.base.with_extension("jsonl"),
            self.base.with_extension("prom"),
        )
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
            let tmp = self.base.with_extension("prom.tmp");
            std::fs::write(&tmp, self.prometheus())?;
            std::fs::rename(&tmp, &prom)
        })();
        if let Err(e) = res {
            tracing::warn!(rank = self.id.rank, path = %self.base.display(), "cannot write metrics: {e}");
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
}
