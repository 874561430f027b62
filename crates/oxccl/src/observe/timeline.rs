//! The timeline: with `OXCCL_TRACE=file.json`, every call and every step of its schedule, as
//! a Chrome/Perfetto trace (`chrome://tracing`, <https://ui.perfetto.dev>), one file per
//! rank: `file.<rank>.json` (or `%r` in the name replaced by the rank). Timestamps are
//! microseconds since the Unix epoch, so the files of all ranks line up;
//! `oxccl trace timeline FILES... -o all.json` merges them. Process = rank; thread 0 holds
//! the calls, thread 1 their steps. Written when the communicator is dropped.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::fault::fingerprint::Fingerprint;
use crate::observe::flight::json_str;

/// At most this many calls are kept (the rest are counted, not recorded).
const MAX_CALLS: usize = 1 << 20;

struct Call {
    seq: u64,
    name: &'static str,
    fp: Fingerprint,
    algo: &'static str,
    start: Instant,
    end: Instant,
    steps: Vec<Instant>,
    error: Option<String>,
}

/// A rank's timeline; see the module documentation.
pub(crate) struct Timeline {
    rank: usize,
    path: PathBuf,
    epoch: (Instant, u64),
    calls: Mutex<(Vec<Call>, u64)>,
}

impl std::fmt::Debug for Timeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timeline")
            .field("rank", &self.rank)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// The file rank `rank` writes for `OXCCL_TRACE=path`.
pub(crate) fn rank_path(path: &str, rank: usize) -> PathBuf {
    if path.contains("%r") {
        return PathBuf::from(path.replace("%r", &rank.to_string()));
    }
    match path.strip_suffix(".json") {
        Some(stem) => PathBuf::from(format!("{stem}.{rank}.json")),
        None => PathBuf::from(format!("{path}.{rank}.json")),
    }
}

impl Timeline {
    /// A timeline of `rank` written to [`rank_path`]`(path, rank)`.
    pub(crate) fn new(rank: usize, path: &str) -> Timeline {
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        Timeline {
            rank,
            path: rank_path(path, rank),
            epoch: (Instant::now(), unix),
            calls: Mutex::new((Vec::new(), 0)),
        }
    }

    /// Records a finished call.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn record(
        &self,
        seq: u64,
        name: &'static str,
        fp: Fingerprint,
        algo: &'static str,
        start: Instant,
        steps: Vec<Instant>,
        error: Option<String>,
    ) {
        let mut c = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        if c.0.len() >= MAX_CALLS {
            c.1 += 1;
            return;
        }
        c.0.push(Call {
            seq,
            name,
            fp,
            algo,
            start,
            end: Instant::now(),
            steps,
            error,
        });
    }

    fn us(&self, t: Instant) -> f64 {
        let d = t.saturating_duration_since(self.epoch.0);
        self.epoch.1 as f64 + d.as_nanos() as f64 / 1000.0
    }

    /// The trace as Chrome JSON.
    pub(crate) fn to_json(&self) -> String {
        let c = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        let mut s = String::from("{\"displayTimeUnit\":\"ns\",\"traceEvents\":[");
        let _ = write!(
            s,
            "\n{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{r},\"tid\":0,\"args\":{{\"name\":\"rank {r}\"}}}}",
            r = self.rank
        );
        for call in &c.0 {
            let (ts, end) = (self.us(call.start), self.us(call.end));
            let _ = write!(
                s,
                ",\n{{\"name\":{},\"cat\":\"call\",\"ph\":\"X\",\"pid\":{},\"tid\":0,\"ts\":{ts:.3},\"dur\":{:.3},\"args\":{{\"seq\":{},\"fingerprint\":{},\"algo\":{}{}}}}}",
                json_str(call.name),
                self.rank,
                end - ts,
                call.seq,
                json_str(&call.fp.to_string()),
                json_str(call.algo),
                call.error
                    .as_ref()
                    .map_or(String::new(), |e| format!(",\"error\":{}", json_str(e)))
            );
            let mut prev = ts;
            for (k, t) in call.steps.iter().enumerate() {
                let t = self.us(*t);
                let _ = write!(
                    s,
                    ",\n{{\"name\":\"step {k}\",\"cat\":\"step\",\"ph\":\"X\",\"pid\":{},\"tid\":1,\"ts\":{prev:.3},\"dur\":{:.3},\"args\":{{\"seq\":{}}}}}",
                    self.rank,
                    t - prev,
                    call.seq
                );
                prev = t;
            }
        }
        s.push_str("\n]}\n");
        s
    }

    /// Writes the file; errors are logged.
    pub(crate) fn write(&self) {
        if let Err(e) = std::fs::write(&self.path, self.to_json()) {
            crate::base::debug::announce(&format!(
                "rank {}: cannot write the trace {}: {}; check that its directory exists and is writable",
                self.rank,
                self.path.display(),
                crate::base::error::with_explanation(&e)
            ));
        }
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        self.write();
    }
}
