//! The flight recorder: the last N calls of a rank (sequence number, fingerprint, state,
//! timing), kept in memory always and written as JSON when something goes wrong.
//!
//! With `OXCCL_FLIGHT_RECORDER=PREFIX` each rank writes `PREFIX.<comm>.<rank>.json` when a
//! call fails (a mismatch, a timeout, a lost peer, ...), when the watchdog learns of another
//! rank's failure, and on `SIGUSR1` (e.g. `pkill -USR1 -f my_training` when a job seems
//! stuck). `oxccl trace PREFIX` merges the files of all ranks and says which rank stopped
//! where. Recording costs two clock reads and two uncontended lock round trips per call;
//! `OXCCL_FLIGHT_RECORDER_ENTRIES=0` turns it off.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::fingerprint::Fingerprint;

/// The state of a recorded call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallState {
    /// Started, not finished (at the time of the dump: where the rank is now).
    Running,
    /// Returned successfully.
    Completed,
    /// Returned this error.
    Failed(String),
}

/// One recorded call.
#[derive(Clone, Debug)]
pub struct Entry {
    /// This rank's call number.
    pub seq: u64,
    /// The call's name.
    pub call: &'static str,
    /// Its fingerprint.
    pub fp: Fingerprint,
    /// Its matching sequence number (collective number, or message number on its pair).
    pub mseq: u64,
    /// The algorithm.
    pub algo: &'static str,
    /// Wall-clock start, microseconds since the Unix epoch.
    pub start_us: u64,
    /// Duration in microseconds, once finished.
    pub dur_us: Option<u64>,
    /// State.
    pub state: CallState,
}

/// A rank's flight recorder; see the module documentation.
#[derive(Debug)]
pub struct Recorder {
    rank: usize,
    nranks: usize,
    comm: u64,
    cap: usize,
    path: Option<String>,
    ring: Mutex<VecDeque<Entry>>,
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl Recorder {
    /// A recorder of the last `cap` calls (0: records nothing), writing under `path`
    /// (`OXCCL_FLIGHT_RECORDER`) if set. With a path, `SIGUSR1` writes every live recorder.
    pub fn new(
        rank: usize,
        nranks: usize,
        comm: u64,
        cap: usize,
        path: Option<String>,
    ) -> Arc<Recorder> {
        let r = Arc::new(Recorder {
            rank,
            nranks,
            comm,
            cap,
            path,
            ring: Mutex::new(VecDeque::with_capacity(cap.min(4096))),
        });
        if r.path.is_some() {
            register(&r);
        }
        r
    }

    /// Records the start of a call.
    pub fn begin(
        &self,
        seq: u64,
        call: &'static str,
        fp: Fingerprint,
        mseq: u64,
        algo: &'static str,
    ) {
        if self.cap == 0 {
            return;
        }
        let e = Entry {
            seq,
            call,
            fp,
            mseq,
            algo,
            start_us: now_us(),
            dur_us: None,
            state: CallState::Running,
        };
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() >= self.cap {
            ring.pop_front();
        }
        ring.push_back(e);
    }

    /// Records the end of call `seq`.
    pub fn end(&self, seq: u64, error: Option<String>) {
        if self.cap == 0 {
            return;
        }
        let now = now_us();
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = ring.iter_mut().rev().find(|e| e.seq == seq) {
            e.dur_us = Some(now.saturating_sub(e.start_us));
            e.state = match error {
                None => CallState::Completed,
                Some(m) => CallState::Failed(m),
            };
        }
    }

    /// The recorded calls, oldest first.
    pub fn entries(&self) -> Vec<Entry> {
        self.ring
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// The file this rank writes, if `OXCCL_FLIGHT_RECORDER` is set.
    pub fn file(&self) -> Option<PathBuf> {
        self.path
            .as_ref()
            .map(|p| PathBuf::from(format!("{p}.{:08x}.{}.json", self.comm as u32, self.rank)))
    }

    /// The record as JSON, with `reason` saying why it was written.
    pub fn to_json(&self, reason: &str) -> String {
        let mut s = String::new();
        let host = rustix::system::uname()
            .nodename()
            .to_string_lossy()
            .into_owned();
        let _ = write!(
            s,
            "{{\"version\":1,\"rank\":{},\"world_size\":{},\"comm\":\"{:08x}\",\"pid\":{},\"host\":{},\"reason\":{},\"time_us\":{},\"entries\":[",
            self.rank,
            self.nranks,
            self.comm as u32,
            std::process::id(),
            json_str(&host),
            json_str(reason),
            now_us()
        );
        for (i, e) in self.entries().iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            let (state, err) = match &e.state {
                CallState::Running => ("running", None),
                CallState::Completed => ("completed", None),
                CallState::Failed(m) => ("failed", Some(m)),
            };
            let _ = write!(
                s,
                "\n{{\"seq\":{},\"call\":{},\"fingerprint\":{},\"kind\":{},\"dtype\":{},\"op\":{},\"count\":{},\"root\":{},\"mseq\":{},\"algo\":{},\"state\":\"{state}\",\"start_us\":{},\"duration_us\":{}",
                e.seq,
                json_str(e.call),
                json_str(&e.fp.to_string()),
                e.fp.kind,
                e.fp.dtype,
                e.fp.op,
                e.fp.count,
                e.fp.root,
                e.mseq,
                json_str(e.algo),
                e.start_us,
                e.dur_us.map_or("null".to_string(), |d| d.to_string())
            );
            if let Some(m) = err {
                let _ = write!(s, ",\"error\":{}", json_str(m));
            }
            s.push('}');
        }
        s.push_str("\n]}\n");
        s
    }

    /// Writes the record to [`file`](Self::file) (if set); errors are logged, not returned.
    pub fn dump(&self, reason: &str) {
        let Some(path) = self.file() else { return };
        let tmp = path.with_extension("json.tmp");
        let res =
            std::fs::write(&tmp, self.to_json(reason)).and_then(|_| std::fs::rename(&tmp, &path));
        match res {
            Ok(()) => {
                tracing::info!(rank = self.rank, path = %path.display(), reason, "flight recorder written")
            }
            Err(e) => {
                tracing::warn!(rank = self.rank, path = %path.display(), "cannot write the flight recorder: {e}")
            }
        }
    }
}

/// A JSON string literal.
pub fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            '\t' => o.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

static LIVE: Mutex<Vec<Weak<Recorder>>> = Mutex::new(Vec::new());
static SIGNAL: Once = Once::new();

fn register(r: &Arc<Recorder>) {
    {
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(r));
    }
    SIGNAL.call_once(|| {
        match signal_hook::iterator::Signals::new([signal_hook::consts::SIGUSR1]) {
            Ok(mut sigs) => {
                let spawned = std::thread::Builder::new()
                    .name("oxccl-sigusr1".into())
                    .spawn(move || {
                        for _ in sigs.forever() {
                            dump_all("SIGUSR1");
                        }
                    });
                if let Err(e) = spawned {
                    tracing::warn!("cannot start the SIGUSR1 thread: {e}");
                }
            }
            Err(e) => tracing::warn!("cannot handle SIGUSR1: {e}"),
        }
    });
}

/// Writes every live recorder of this process that has a path.
pub fn dump_all(reason: &str) {
    let live: Vec<Arc<Recorder>> = LIVE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(|w| w.upgrade())
        .collect();
    for r in live {
        r.dump(reason);
    }
}
