//! Every tunable read from the environment, in one place (as NCCL's `NCCL_PARAM`).
//!
//! [`Config::from_env`] reads them once per communicator; tests and embedders build a
//! [`Config`] by hand instead. docs/environment.md lists them for users.

use std::time::Duration;

use crate::base::error::{Error, Result};

/// Which transport to use between ranks of one host.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory inside a host, TCP between hosts.
    Auto,
    /// Shared memory only; an error if some peer is on another host.
    Shm,
    /// TCP everywhere, also inside a host.
    Tcp,
}

impl std::str::FromStr for TransportChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(TransportChoice::Auto),
            "shm" => Ok(TransportChoice::Shm),
            "tcp" | "socket" => Ok(TransportChoice::Tcp),
            _ => Err(format!(
                "unknown transport '{s}' (expected auto, shm or tcp)"
            )),
        }
    }
}

/// A communicator's settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// `OXCCL_TIMEOUT` (seconds): how long a call or a connection attempt may wait for a
    /// peer before failing. Default 600 s, as torch.distributed's default.
    pub timeout: Duration,
    /// `OXCCL_TRANSPORT`: `auto` (default), `shm` or `tcp`.
    pub transport: TransportChoice,
    /// `OXCCL_SHM_RING_BYTES`: capacity of each shared-memory ring (one per ordered pair of
    /// ranks on a host). Default 4 MiB.
    pub shm_ring_bytes: usize,
    /// `OXCCL_SPIN`: progress checks a waiting rank makes before it sleeps. Default 2000.
    pub spin: u32,
    /// `OXCCL_TCP_SPIN`: progress checks before sleeping in `poll(2)` while a transfer a
    /// waiting rank waits on is a socket's, also in steps that mix sockets and shared memory
    /// (each check is a system call). Default 0: sleep at once (on 2 shared cores spinning
    /// cost CPU and latency, README "CPU per byte").
    pub tcp_spin: u32,
    /// `OXCCL_YIELD_EVERY`: progress checks between two yields of the core while spinning.
    /// Default (`None`): 1 where this host's ranks of the communicator outnumber the CPUs this
    /// process may run on (the rank waited for may be waiting for this very core, as Open
    /// MPI's `mpi_yield_when_idle` when oversubscribed), else 64.
    pub yield_every: Option<u32>,
    /// `OXCCL_HOSTID`: overrides the host identity that decides who shares memory.
    pub host_id: Option<String>,
    /// `OXCCL_SOCKET_IFNAME`: the network interface to listen on; by default the one that
    /// routes to the rendezvous address.
    pub socket_ifname: Option<String>,
    /// `OXCCL_ALGO`: force an algorithm by name (e.g. `ring`), for every collective it fits.
    pub algo: Option<String>,
    /// `OXCCL_CHUNK_BYTES`: pipeline segment of chained algorithms (broadcast, reduce).
    /// Default 256 KiB.
    pub chunk_bytes: usize,
    /// `OXCCL_ONESHOT_MAX`: with two ranks, inputs up to this many bytes go one-shot through
    /// shared slots when every rank shares a host; with `n` ranks, `n - 1` times as many (up
    /// to a slot, 64 KiB). Default 32 KiB.
    pub oneshot_max: usize,
    /// `OXCCL_CMA_MIN`: inputs from this many bytes on are copied straight from peers' buffers
    /// (`process_vm_readv`) when every rank shares a host. Default 64 KiB.
    pub cma_min: usize,
    /// `OXCCL_CMA=0` forbids reading peers' memory (`process_vm_readv`: the single-copy
    /// algorithms, and single-copy shared-memory transfers in schedules); default allowed.
    pub cma: bool,
    /// `OXCCL_NT_BYTES`: the single-copy algorithms write out-of-place results with streaming
    /// (non-temporal) stores when the call's footprint on the host (ranks × (input + output))
    /// reaches this many bytes, so that results too large for the cache are not first read
    /// into it. Default a quarter of the last-level cache (from sysfs; 8 MiB where unknown).
    pub nt_bytes: usize,
    /// `OXCCL_DETERMINISTIC=1`: floating-point reductions combine the ranks' values in rank
    /// order, so results are bitwise identical on every rank, from run to run and whatever
    /// algorithm runs. Default off.
    pub deterministic: bool,
    /// `OXCCL_HEARTBEAT_TIMEOUT` (seconds): a rank whose watchdog sends nothing for this long
    /// (host down, link cut, process stopped) is lost. Default 1.5 s; `0` turns the deadline
    /// off (heartbeats are still sent, and closed connections are still seen at once).
    pub heartbeat: Option<Duration>,
    /// `OXCCL_FLIGHT_RECORDER`: file prefix; each rank writes `PREFIX.<comm>.<rank>.json` on
    /// an error, a timeout and `SIGUSR1`.
    pub flight_recorder: Option<String>,
    /// `OXCCL_FLIGHT_RECORDER_ENTRIES`: how many recent calls the flight recorder keeps
    /// (default 256; 0 records nothing).
    pub flight_entries: usize,
    /// `OXCCL_TRACE`: write a Chrome/Perfetto timeline of every call and step to this file
    /// (`file.<rank>.json`, or `%r` replaced by the rank).
    pub trace: Option<String>,
    /// `OXCCL_METRICS`: directory where each rank writes its call metrics (JSON lines and a
    /// Prometheus text file, see `observe::metrics`). Default off.
    pub metrics: Option<String>,
    /// `OXCCL_METRICS_INTERVAL` (seconds): how often the metrics are written. Default 10 s.
    pub metrics_interval: Duration,
    /// `OXCCL_FR_DUMP`: file prefix; each rank writes its flight record in PyTorch's format
    /// to `PREFIX<rank>` (see `observe::flight_torch`) on an error, a timeout, `SIGUSR1` and
    /// when the communicator is dropped. Default off.
    pub fr_dump: Option<String>,
    /// `OXCCL_STATUS`: a port (on 127.0.0.1) or `host:port` where rank 0 answers status
    /// queries (`oxccl status`, `observe::status`); the other ranks where it is set answer
    /// on an ephemeral port. Default off.
    pub status: Option<String>,
    // Multi-host settings (transport/tcp.rs, cost.rs).
    /// `OXCCL_NET_GBPS`: network bandwidth per host link in GB/s for the cost model
    /// (default: `plan::cost::CostModel`'s, 1.2).
    pub net_gbps: Option<f64>,
    /// `OXCCL_NET_LAT_US`: network latency per step in microseconds for the cost model.
    pub net_lat_us: Option<f64>,
    /// `OXCCL_TCP_STREAMS`: TCP connections per pair of ranks on different hosts, striped.
    /// Default 1.
    pub tcp_streams: usize,
    /// `OXCCL_TCP_DEAD_AFTER` (seconds): a TCP peer that acknowledges nothing for this long
    /// (sent data, or keepalive probes on an idle connection) is lost. Default 20 s; 0 leaves
    /// the kernel's defaults (minutes).
    pub tcp_dead_after: Duration,
    // Start-up settings (bootstrap/mod.rs).
    /// `OXCCL_STARTUP_REPORT_SECS`: while a rank waits in init, it says every this many
    /// seconds what it waits for. Default 10 s; 0 says nothing.
    pub startup_report: Option<Duration>,
    /// `OXCCL_RENDEZVOUS_REFUSED_SECS`: a rank whose connections to the rendezvous are refused
    /// (nothing listens there: rank 0 not started yet, or dead) for this long fails. Default
    /// 60 s (never more than `OXCCL_TIMEOUT`).
    pub rendezvous_refused: Duration,
    /// `OXCCL_P2P_STASH_BYTES`: how many bytes of point-to-point messages that arrived before
    /// a receive asked for them (another tag, or read while waiting for any source) a rank
    /// keeps; past it the call fails. Default 1 GiB.
    pub p2p_stash_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: Duration::from_secs(600),
            transport: TransportChoice::Auto,
            shm_ring_bytes: 4 << 20,
            spin: 2000,
            tcp_spin: 0,
            yield_every: None,
            host_id: None,
            socket_ifname: None,
            algo: None,
            chunk_bytes: 256 << 10,
            oneshot_max: 32 << 10,
            cma_min: 64 << 10,
            cma: true,
            nt_bytes: last_level_cache().unwrap_or(32 << 20) / 4,
            deterministic: false,
            heartbeat: Some(Duration::from_millis(1500)),
            flight_recorder: None,
            flight_entries: 256,
            trace: None,
            metrics: None,
            metrics_interval: Duration::from_secs(10),
            fr_dump: None,
            status: None,
            net_gbps: None,
            net_lat_us: None,
            tcp_streams: 1,
            tcp_dead_after: Duration::from_secs(20),
            startup_report: Some(Duration::from_secs(10)),
            rendezvous_refused: Duration::from_secs(60),
            p2p_stash_bytes: 1 << 30,
        }
    }
}

/// `OXCCL_MEMBARRIER=1`: asymmetric fences in the doorbell ([`crate::base::wait`]): rings without a
/// hardware fence, sleepers issue `membarrier`. Off by default: a stress test lost wake-ups
/// with it (see `crate::base::wait`). Read once per process; set it on every rank of a host or none.
pub(crate) fn membarrier_allowed() -> bool {
    matches!(
        std::env::var("OXCCL_MEMBARRIER").as_deref().map(str::trim),
        Ok("1")
    )
}

/// `OXCCL_HUGEPAGES=0`: no transparent huge pages for large private buffers on the single-copy
/// path (`direct::hugepages`); default on (so is an unreadable value). Read once per process
/// (an address space's buffers are the process's, whatever communicator uses them).
pub(crate) fn hugepages_allowed() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("OXCCL_HUGEPAGES")
            .ok()
            .and_then(|v| parse_bool(v.trim()).ok())
            .unwrap_or(true)
    })
}

/// `OXCCL_SHM_POOL_CACHE`: how many bytes of freed blocks the process's pool of shared
/// buffers (`direct::shared_pool`, `oxcclMemAlloc`, the torch allocator) keeps for reuse;
/// default 1 GiB (so is an unreadable value). Read once per process.
pub(crate) fn shm_pool_cache_bytes() -> usize {
    std::env::var("OXCCL_SHM_POOL_CACHE")
        .ok()
        .and_then(|v| parse_bytes(v.trim()).ok())
        .unwrap_or(1 << 30)
}

/// The size of the largest data cache of CPU 0 (sysfs), in bytes; read once per process
/// (every `Config::default()` asks).
fn last_level_cache() -> Option<usize> {
    static LLC: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *LLC.get_or_init(|| {
        let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
        dir.filter_map(|e| {
            let p = e.ok()?.path();
            let kind = std::fs::read_to_string(p.join("type")).ok()?;
            if kind.trim() == "Instruction" {
                return None;
            }
            parse_bytes(std::fs::read_to_string(p.join("size")).ok()?.trim()).ok()
        })
        .max()
    })
}

/// Reads `name` and parses it with `parse`; a malformed value is an error naming it.
fn env_parse<T>(
    name: &str,
    parse: impl FnOnce(&str) -> std::result::Result<T, String>,
) -> Result<Option<T>> {
    match std::env::var(name) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => parse(v.trim())
            .map(Some)
            .map_err(|e| Error::Env(format!("{name}={v}: {e}"))),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(Error::Env(format!("{name} is not valid UTF-8")))
        }
    }
}

/// What `oxccl tune` measured on this host: the sizes where one algorithm overtakes another.
/// Saved as `key=value` lines in `OXCCL_TUNE_FILE` (default `~/.cache/oxccl/tune.conf`) and
/// read by [`Config::from_env`]; `OXCCL_ONESHOT_MAX` and `OXCCL_CMA_MIN` override it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Largest input (bytes) that one-shot handles fastest.
    pub oneshot_max: usize,
    /// Smallest input (bytes) from which single-copy is fastest.
    pub cma_min: usize,
}

impl Tuning {
    /// Where the measured tuning lives (`None` when `OXCCL_TUNE_FILE` is set empty: no file).
    pub fn path() -> Option<std::path::PathBuf> {
        if let Some(p) = std::env::var_os("OXCCL_TUNE_FILE") {
            return (!p.is_empty()).then(|| p.into());
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache"))
            })?;
        Some(base.join("oxccl").join("tune.conf"))
    }

    /// The saved tuning, if any; a malformed file is an error naming it.
    pub fn load() -> Result<Option<Tuning>> {
        let Some(path) = Self::path() else {
            return Ok(None);
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::Env(format!("{}: {e}", path.display()))),
        };
        Self::parse(&text).map(Some).map_err(|e| {
            Error::Env(format!(
                "{}: {e} (rerun `oxccl tune` or delete it)",
                path.display()
            ))
        })
    }

    /// Parses the `key=value` form (`#` starts a comment).
    pub fn parse(text: &str) -> std::result::Result<Tuning, String> {
        let (mut oneshot, mut cma) = (None, None);
        for line in text
            .lines()
            .map(|l| l.split('#').next().unwrap_or("").trim())
            .filter(|l| !l.is_empty())
        {
            let (k, v) = line
                .split_once('=')
                .ok_or_else(|| format!("'{line}' is not key=value"))?;
            let v = parse_bytes(v)?;
            match k.trim() {
                "oneshot_max" => oneshot = Some(v),
                "cma_min" => cma = Some(v),
                other => return Err(format!("unknown key '{other}'")),
            }
        }
        Ok(Tuning {
            oneshot_max: oneshot.ok_or("oneshot_max missing")?,
            cma_min: cma.ok_or("cma_min missing")?,
        })
    }

    /// The file's text.
    pub fn render(&self, comment: &str) -> String {
        format!(
            "# {comment}\noneshot_max={}\ncma_min={}\n",
            self.oneshot_max, self.cma_min
        )
    }
}

/// Parses `0`/`1` (also `false`/`true`, `no`/`yes`).
fn parse_bool(v: &str) -> std::result::Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "0" | "false" | "no" | "off" => Ok(false),
        "1" | "true" | "yes" | "on" => Ok(true),
        _ => Err("expected 0 or 1".to_string()),
    }
}

/// Parses a number of seconds, fractions allowed, greater than 0.
fn parse_positive_secs(v: &str) -> std::result::Result<Duration, String> {
    v.parse::<f64>()
        .ok()
        .filter(|s| *s > 0.0 && s.is_finite())
        .map(Duration::from_secs_f64)
        .ok_or_else(|| "expected a positive number of seconds".to_string())
}

/// Parses a number of seconds, fractions allowed, 0 or more.
fn parse_secs(v: &str) -> std::result::Result<Duration, String> {
    v.parse::<f64>()
        .ok()
        .filter(|s| *s >= 0.0 && s.is_finite())
        .map(Duration::from_secs_f64)
        .ok_or_else(|| "expected a number of seconds".to_string())
}

/// Parses a byte size with an optional K, M or G suffix (powers of 1024), as nccl-tests.
pub fn parse_bytes(s: &str) -> std::result::Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_uppercase() {
                'K' => 1usize << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'B' => 1,
                _ => {
                    return Err(format!(
                        "unknown size suffix '{c}' in '{s}' (use K, M or G)"
                    ))
                }
            };
            (&s[..i], m)
        }
        _ => (s, 1),
    };
    let n: usize = num
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a size"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("'{s}' is too large"))
}

impl Config {
    /// Reads every `OXCCL_*` setting from the environment; unset ones keep their defaults.
    pub fn from_env() -> Result<Config> {
        let mut c = Config::default();
        // Measured thresholds (`oxccl tune`) first; explicit variables override them.
        if let Some(t) = Tuning::load()? {
            c.oneshot_max = t.oneshot_max;
            c.cma_min = t.cma_min;
        }
        if let Some(t) = env_parse("OXCCL_TIMEOUT", parse_positive_secs)? {
            c.timeout = t;
        }
        if let Some(t) = env_parse("OXCCL_TRANSPORT", |v| v.parse())? {
            c.transport = t;
        }
        if let Some(b) = env_parse("OXCCL_SHM_RING_BYTES", parse_bytes)? {
            if b < 4096 {
                return Err(Error::Env(format!(
                    "OXCCL_SHM_RING_BYTES={b}: at least 4096 bytes"
                )));
            }
            c.shm_ring_bytes = b;
        }
        if let Some(s) = env_parse("OXCCL_SPIN", |v| {
            v.parse::<u32>().map_err(|e| e.to_string())
        })? {
            c.spin = s;
        }
        if let Some(s) = env_parse("OXCCL_TCP_SPIN", |v| {
            v.parse::<u32>().map_err(|e| e.to_string())
        })? {
            c.tcp_spin = s;
        }
        if let Some(y) = env_parse("OXCCL_YIELD_EVERY", |v| {
            v.parse::<u32>()
                .ok()
                .filter(|&y| y > 0)
                .ok_or_else(|| "expected a positive number of checks".to_string())
        })? {
            c.yield_every = Some(y);
        }
        c.host_id = env_parse("OXCCL_HOSTID", |v| Ok(v.to_string()))?;
        c.socket_ifname = env_parse("OXCCL_SOCKET_IFNAME", |v| Ok(v.to_string()))?;
        c.algo = env_parse("OXCCL_ALGO", |v| Ok(v.to_ascii_lowercase()))?;
        if let Some(b) = env_parse("OXCCL_CHUNK_BYTES", parse_bytes)? {
            if b < 64 {
                return Err(Error::Env(format!(
                    "OXCCL_CHUNK_BYTES={b}: at least 64 bytes"
                )));
            }
            c.chunk_bytes = b;
        }
        if let Some(b) = env_parse("OXCCL_ONESHOT_MAX", parse_bytes)? {
            c.oneshot_max = b;
        }
        if let Some(b) = env_parse("OXCCL_CMA_MIN", parse_bytes)? {
            c.cma_min = b;
        }
        if let Some(b) = env_parse("OXCCL_NT_BYTES", parse_bytes)? {
            c.nt_bytes = b;
        }
        if let Some(b) = env_parse("OXCCL_CMA", parse_bool)? {
            c.cma = b;
        }
        if let Some(b) = env_parse("OXCCL_DETERMINISTIC", parse_bool)? {
            c.deterministic = b;
        }
        if let Some(h) = env_parse("OXCCL_HEARTBEAT_TIMEOUT", |v| {
            v.parse::<f64>()
                .ok()
                .filter(|s| *s >= 0.0 && s.is_finite())
                .map(|s| (s > 0.0).then(|| Duration::from_secs_f64(s)))
                .ok_or_else(|| "expected a number of seconds (0: off)".to_string())
        })? {
            c.heartbeat = h;
        }
        c.flight_recorder = env_parse("OXCCL_FLIGHT_RECORDER", |v| Ok(v.to_string()))?;
        if let Some(n) = env_parse("OXCCL_FLIGHT_RECORDER_ENTRIES", |v| {
            v.parse::<usize>().map_err(|e| e.to_string())
        })? {
            c.flight_entries = n;
        }
        c.trace = env_parse("OXCCL_TRACE", |v| Ok(v.to_string()))?;
        c.read_ops_env()?;
        c.read_net_env()?;
        c.read_startup_env()?;
        Ok(c)
    }

    /// Operations settings: metrics, status agent, torch flight records.
    fn read_ops_env(&mut self) -> Result<()> {
        self.metrics = env_parse("OXCCL_METRICS", |v| Ok(v.to_string()))?;
        if let Some(t) = env_parse("OXCCL_METRICS_INTERVAL", parse_positive_secs)? {
            self.metrics_interval = t;
        }
        self.fr_dump = env_parse("OXCCL_FR_DUMP", |v| Ok(v.to_string()))?;
        self.status = env_parse("OXCCL_STATUS", |v| Ok(v.to_string()))?;
        Ok(())
    }

    fn read_net_env(&mut self) -> Result<()> {
        let positive = |v: &str| {
            v.parse::<f64>()
                .ok()
                .filter(|x| *x > 0.0 && x.is_finite())
                .ok_or_else(|| "expected a positive number".to_string())
        };
        self.net_gbps = env_parse("OXCCL_NET_GBPS", positive)?;
        self.net_lat_us = env_parse("OXCCL_NET_LAT_US", positive)?;
        if let Some(k) = env_parse("OXCCL_TCP_STREAMS", |v| {
            v.parse::<usize>()
                .ok()
                .filter(|k| (1..=16).contains(k))
                .ok_or_else(|| "expected 1 to 16".to_string())
        })? {
            self.tcp_streams = k;
        }
        if let Some(t) = env_parse("OXCCL_TCP_DEAD_AFTER", |v| {
            v.parse::<f64>()
                .ok()
                .filter(|s| *s >= 0.0 && s.is_finite())
                .map(Duration::from_secs_f64)
                .ok_or_else(|| "expected seconds (0: the kernel's defaults)".to_string())
        })? {
            self.tcp_dead_after = t;
        }
        if let Some(b) = env_parse("OXCCL_P2P_STASH_BYTES", parse_bytes)? {
            self.p2p_stash_bytes = b;
        }
        Ok(())
    }

    fn read_startup_env(&mut self) -> Result<()> {
        if let Some(t) = env_parse("OXCCL_STARTUP_REPORT_SECS", parse_secs)? {
            self.startup_report = (!t.is_zero()).then_some(t);
        }
        if let Some(t) = env_parse("OXCCL_RENDEZVOUS_REFUSED_SECS", parse_secs)? {
            self.rendezvous_refused = t;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuning_file() {
        let t = Tuning {
            oneshot_max: 4096,
            cma_min: 1 << 20,
        };
        assert_eq!(Tuning::parse(&t.render("measured")).unwrap(), t);
        assert!(Tuning::parse("oneshot_max=1\n").is_err());
        assert!(Tuning::parse("oneshot_max=1\ncma_min=2\nfoo=3").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("8").unwrap(), 8);
        assert_eq!(parse_bytes("64M").unwrap(), 64 << 20);
        assert_eq!(parse_bytes("1k").unwrap(), 1024);
        assert_eq!(parse_bytes("2G").unwrap(), 2 << 30);
        assert!(parse_bytes("12Q").is_err());
        assert!(parse_bytes("x").is_err());
    }
}
