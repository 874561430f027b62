//! The flight recorder: the last N calls of a rank (sequence number, fingerprint, state,
//! timing), kept in memory always and written as JSON when something goes wrong.
//!
//! With `OXCCL_FLIGHT_RECORDER=PREFIX` each rank writes `PREFIX.<comm>.<rank>.json` when a
//! call fails (a mismatch, a timeout, a lost peer, ...), when the watchdog learns of another
//! rank's failure, and on `SIGUSR1` (e.g. `pkill -USR1 -f my_training` when a job seems
//! stuck). `oxccl trace PREFIX` merges the files of all ranks and says which rank stopped
//! where. Recording takes no lock: two coarse clock reads (millisecond resolution) and a
//! few relaxed stores per call; `OXCCL_FLIGHT_RECORDER_ENTRIES=0` turns it off.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once, Weak};

use crate::fault::fingerprint::Fingerprint;
use crate::observe::flight_torch::TorchDump;

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

/// A recorded call, as kept: words written with relaxed atomics under a per-slot sequence
/// lock (one writer: calls on a communicator are serialized; readers, e.g. the `SIGUSR1`
/// thread, retry a slot that changes under them), so recording takes no lock.
#[derive(Debug, Default)]
struct Slot {
    /// Odd while being written.
    ver: AtomicU64,
    w: [AtomicU64; W_WORDS],
}

const W_SEQ: usize = 0;
const W_FP: usize = 1;
const W_COUNT: usize = 2;
const W_MSEQ: usize = 3;
const W_START: usize = 4;
const W_DUR: usize = 5;
const W_FAILED: usize = 6;
const W_CALL: usize = 7;
const W_ALGO: usize = 9;
const W_WORDS: usize = 11;

impl Slot {
    fn write(&self, f: impl FnOnce(&[AtomicU64; W_WORDS])) {
        let v = self.ver.load(Ordering::Relaxed);
        self.ver.store(v | 1, Ordering::Relaxed);
        fence(Ordering::Release);
        f(&self.w);
        self.ver.store((v | 1) + 1, Ordering::Release);
    }

    /// A consistent copy of the words, or `None` if it kept changing.
    fn read(&self) -> Option<[u64; W_WORDS]> {
        for _ in 0..1000 {
            let v1 = self.ver.load(Ordering::Acquire);
            if v1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let w = std::array::from_fn(|i| self.w[i].load(Ordering::Relaxed));
            fence(Ordering::Acquire);
            if self.ver.load(Ordering::Relaxed) == v1 {
                return Some(w);
            }
        }
        None
    }
}

fn put_str(w: &[AtomicU64; W_WORDS], at: usize, s: &'static str) {
    w[at].store(s.as_ptr() as u64, Ordering::Relaxed);
    w[at + 1].store(s.len() as u64, Ordering::Relaxed);
}

fn get_str(w: &[u64; W_WORDS], at: usize) -> &'static str {
    if w[at] == 0 {
        return "";
    }
    // SAFETY: the pair was written together by `put_str` from a `&'static str` and read back
    // consistently (the slot's version did not change): it is that string.
    unsafe {
        std::str::from_utf8_unchecked(std::slice::from_raw_parts(
            w[at] as *const u8,
            w[at + 1] as usize,
        ))
    }
}

/// A rank's flight recorder; see the module documentation.
#[derive(Debug)]
pub struct Recorder {
    rank: usize,
    nranks: usize,
    comm: u64,
    path: Option<String>,
    torch: Option<TorchDump>,
    slots: Box<[Slot]>,
    /// Calls recorded so far (the next slot is `count % slots`).
    count: AtomicU64,
    /// The slot of the last call begun (`(count - 1) % slots`), kept so that a call does not
    /// divide by the capacity twice (a 64-bit division is about 15 ns here).
    last: AtomicUsize,
    /// Error texts of the last failed calls, by call number.
    errors: Mutex<Vec<(u64, String)>>,
}

/// Microseconds since the Unix epoch from the coarse clock (a few nanoseconds to read,
/// millisecond resolution: enough to see where a rank hangs, cheap enough for every call).
fn now_us() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::RealtimeCoarse);
    (t.tv_sec as u64).saturating_mul(1_000_000) + (t.tv_nsec as u64) / 1000
}

impl Recorder {
    /// A recorder of the last `cap` calls (0: records nothing), writing under `path`
    /// (`OXCCL_FLIGHT_RECORDER`) and in torch's format (`OXCCL_FR_DUMP`, [`TorchDump`]) if
    /// set. With either, `SIGUSR1` writes every live recorder.
    pub fn new(
        rank: usize,
        nranks: usize,
        comm: u64,
        cap: usize,
        path: Option<String>,
        torch: Option<TorchDump>,
    ) -> Arc<Recorder> {
        let r = Arc::new(Recorder {
            rank,
            nranks,
            comm,
            path,
            torch,
            slots: (0..cap).map(|_| Slot::default()).collect(),
            count: AtomicU64::new(0),
            last: AtomicUsize::new(cap.saturating_sub(1)),
            errors: Mutex::new(Vec::new()),
        });
        if r.path.is_some() || r.torch.is_some() {
            register(&r);
        }
        r
    }

    /// Records the start of a call. Calls of one recorder must not overlap (a communicator
    /// serializes its calls).
    pub fn begin(
        &self,
        seq: u64,
        call: &'static str,
        fp: Fingerprint,
        mseq: u64,
        algo: &'static str,
    ) {
        let cap = self.slots.len() as u64;
        if cap == 0 {
            return;
        }
        let n = self.count.load(Ordering::Relaxed);
        let start = now_us();
        // The slot after the last one, wrapping: `n % cap`.
        let i = match self.last.load(Ordering::Relaxed) + 1 {
            i if i as u64 == cap => 0,
            i => i,
        };
        self.last.store(i, Ordering::Relaxed);
        self.slots[i].write(|w| {
            w[W_SEQ].store(seq, Ordering::Relaxed);
            let packed = fp.kind as u64
                | (fp.dtype as u64) << 8
                | (fp.op as u64) << 16
                | (fp.root as u64) << 32;
            w[W_FP].store(packed, Ordering::Relaxed);
            w[W_COUNT].store(fp.count, Ordering::Relaxed);
            w[W_MSEQ].store(mseq, Ordering::Relaxed);
            w[W_START].store(start, Ordering::Relaxed);
            w[W_DUR].store(u64::MAX, Ordering::Relaxed);
            w[W_FAILED].store(0, Ordering::Relaxed);
            put_str(w, W_CALL, call);
            put_str(w, W_ALGO, algo);
        });
        self.count.store(n + 1, Ordering::Release);
    }

    /// Records the end of call `seq` (the last one begun).
    pub fn end(&self, seq: u64, error: Option<String>) {
        self.finish(seq, None, error);
    }

    /// Records the end of call `seq` (the last one begun), which ran by `algo`: a call whose
    /// plan depended on an agreement among the ranks began with the plan as far as it was
    /// known, and ends with the one that ran.
    pub fn end_as(&self, seq: u64, algo: &'static str, error: Option<String>) {
        self.finish(seq, Some(algo), error);
    }

    fn finish(&self, seq: u64, algo: Option<&'static str>, error: Option<String>) {
        let cap = self.slots.len() as u64;
        let n = self.count.load(Ordering::Relaxed);
        if cap == 0 || n == 0 {
            return;
        }
        let slot = &self.slots[self.last.load(Ordering::Relaxed)];
        if slot.w[W_SEQ].load(Ordering::Relaxed) != seq {
            return;
        }
        let dur = now_us().saturating_sub(slot.w[W_START].load(Ordering::Relaxed));
        let failed = error.is_some();
        if let Some(m) = error {
            let mut errs = self.errors.lock().unwrap_or_else(|e| e.into_inner());
            if errs.len() >= 16 {
                errs.remove(0);
            }
            errs.push((seq, m));
        }
        slot.write(|w| {
            w[W_DUR].store(dur, Ordering::Relaxed);
            w[W_FAILED].store(failed as u64, Ordering::Relaxed);
            if let Some(a) = algo {
                put_str(w, W_ALGO, a);
            }
        });
    }

    /// The recorded calls, oldest first.
    pub fn entries(&self) -> Vec<Entry> {
        let cap = self.slots.len() as u64;
        let count = self.count.load(Ordering::Acquire);
        let n = count.min(cap);
        let errors = self
            .errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        (count - n..count)
            .filter_map(|k| self.slots[(k % cap) as usize].read())
            .map(|w| {
                let seq = w[W_SEQ];
                let fp = Fingerprint {
                    kind: w[W_FP] as u8,
                    dtype: (w[W_FP] >> 8) as u8,
                    op: (w[W_FP] >> 16) as u8,
                    root: (w[W_FP] >> 32) as u32,
                    count: w[W_COUNT],
                };
                Entry {
                    seq,
                    call: get_str(&w, W_CALL),
                    fp,
                    mseq: w[W_MSEQ],
                    algo: get_str(&w, W_ALGO),
                    start_us: w[W_START],
                    dur_us: (w[W_DUR] != u64::MAX).then_some(w[W_DUR]),
                    state: match (w[W_DUR], w[W_FAILED]) {
                        (u64::MAX, _) => CallState::Running,
                        (_, 0) => CallState::Completed,
                        _ => CallState::Failed(
                            errors
                                .iter()
                                .find(|(q, _)| *q == seq)
                                .map_or_else(|| "failed".to_string(), |(_, m)| m.clone()),
                        ),
                    },
                }
            })
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

    /// True before the first call.
    pub fn is_empty(&self) -> bool {
        self.count.load(Ordering::Relaxed) == 0
    }

    /// Writes the record in torch's format (if `OXCCL_FR_DUMP` is set).
    pub fn dump_torch(&self) {
        if let Some(t) = &self.torch {
            t.write(&self.entries(), self.rank, self.nranks, self.comm);
        }
    }

    /// Writes the record to [`file`](Self::file) and in torch's format (where set); errors
    /// are logged, not returned.
    pub fn dump(&self, reason: &str) {
        self.dump_torch();
        let Some(path) = self.file() else { return };
        let tmp = path.with_extension("json.tmp");
        let res =
            std::fs::write(&tmp, self.to_json(reason)).and_then(|_| std::fs::rename(&tmp, &path));
        match res {
            Ok(()) => {
                tracing::info!(rank = self.rank, path = %path.display(), reason, "flight recorder written")
            }
            Err(e) => crate::base::debug::announce(&format!(
                "rank {}: cannot write the flight record {}: {}; check that the directory of OXCCL_FLIGHT_RECORDER exists and is writable (the record is lost)",
                self.rank,
                path.display(),
                crate::base::error::with_explanation(&e)
            )),
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
        // SAFETY: `dump_torch_at_exit` takes no arguments, does not unwind (it catches
        // panics) and touches only statics and what they keep alive.
        if unsafe { libc::atexit(dump_torch_at_exit) } != 0 {
            tracing::warn!("cannot register the flight records' write at exit");
        }
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

/// At process exit (`exit()`, e.g. an interpreter ending without dropping its
/// communicators): the torch-format record of every live recorder that has one.
extern "C" fn dump_torch_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        let Ok(live) = LIVE.try_lock() else { return };
        let live: Vec<Arc<Recorder>> = live.iter().filter_map(|w| w.upgrade()).collect();
        for r in live.iter().filter(|r| !r.is_empty()) {
            r.dump_torch();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A call that begins with the plan as far as known ends with the plan that ran; one
    /// ended without a plan keeps the one it began with.
    #[test]
    fn a_call_ends_with_the_plan_that_ran() {
        let r = Recorder::new(0, 2, 1, 4, None, None);
        r.begin(1, "all_reduce", Fingerprint::default(), 1, "ring");
        r.end_as(1, "cma", None);
        r.begin(2, "all_reduce", Fingerprint::default(), 2, "oneshot");
        r.end(2, None);
        let algos: Vec<_> = r.entries().iter().map(|e| e.algo).collect();
        assert_eq!(algos, ["cma", "oneshot"]);
    }

    #[test]
    fn keeps_the_last_calls_in_order() {
        let r = Recorder::new(1, 4, 7, 3, None, None);
        let fp = Fingerprint {
            kind: 3,
            dtype: 8,
            op: 2,
            count: 1 << 40,
            root: 2,
        };
        for seq in 1..=5 {
            r.begin(seq, "reduce", fp, seq + 10, "chain");
            r.end(seq, (seq == 4).then(|| "boom".to_string()));
        }
        r.begin(6, "barrier", Fingerprint::default(), 16, "dissemination");
        let e = r.entries();
        assert_eq!(e.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![4, 5, 6]);
        assert_eq!(e[0].state, CallState::Failed("boom".into()));
        assert_eq!(e[1].state, CallState::Completed);
        assert_eq!(e[2].state, CallState::Running);
        assert_eq!(
            (e[1].fp, e[1].call, e[1].algo, e[1].mseq),
            (fp, "reduce", "chain", 15)
        );
        let json = r.to_json("test");
        assert!(
            json.contains("\"state\":\"running\"") && json.contains("\"error\":\"boom\""),
            "{json}"
        );
        assert!(Recorder::new(0, 1, 0, 0, None, None).entries().is_empty());
    }
}
