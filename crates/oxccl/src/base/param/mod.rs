//! Every tunable read from the environment, in one place (as NCCL's `NCCL_PARAM`).
//!
//! [`Config::from_env`] reads them once per communicator; tests and embedders build a
//! [`Config`] by hand instead. docs/environment.md lists them for users.

use std::time::Duration;

use crate::base::error::{Error, Result};

pub mod table;

pub use table::parse_bytes;

/// When TCP links are made (`OXCCL_TCP_CONNECT`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TcpConnect {
    /// Every TCP link at init (O(n) sockets per rank, any point-to-point pattern at once).
    Eager,
    /// A link when a call first needs it (NCCL's connect on first use).
    Lazy,
    /// [`TcpConnect::Lazy`] in communicators of more than `OXCCL_TCP_LAZY_MIN_RANKS` ranks,
    /// else [`TcpConnect::Eager`] (the default).
    Auto,
}

impl TcpConnect {
    /// Whether a communicator of `ranks` ranks makes its links on first use, `min_ranks`
    /// being `OXCCL_TCP_LAZY_MIN_RANKS`.
    pub fn lazy_for(self, ranks: usize, min_ranks: usize) -> bool {
        match self {
            TcpConnect::Eager => false,
            TcpConnect::Lazy => true,
            TcpConnect::Auto => ranks > min_ranks,
        }
    }
}

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
                "unknown transport '{}' (expected auto, shm or tcp)",
                table::shown(s)
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
    /// `OXCCL_SHM_BUDGET_BYTES`: most bytes of ring data one rank's shared-memory segment
    /// holds; with many local peers the rings shrink (halving, to 64 KiB at least) to fit, so
    /// a rank's shared memory does not grow with the rank count. 0: no budget. Default 12 MiB
    /// (2 to 4 ranks keep 4 MiB rings).
    pub shm_budget_bytes: usize,
    /// `OXCCL_SPIN`: progress checks a waiting rank makes before it sleeps. Default 2000.
    pub spin: u32,
    /// `OXCCL_DIRECT_SPIN`: progress checks a rank waiting in a small call of the direct
    /// path makes before it sleeps, the start of the budget each rank then learns
    /// ([`Cadence`](crate::base::wait::Cadence)). Default (`None`): 100000 (about 3 ms) where
    /// this host's ranks of the communicator have a CPU each, since waking a sleeping rank
    /// costs an idle CPU's wake-up (tens of µs in a VM) on every call, else `spin`.
    pub direct_spin: Option<u32>,
    /// `OXCCL_TCP_SPIN`: progress checks before sleeping in `poll(2)` while a transfer a
    /// waiting rank waits on is a socket's, also in steps that mix sockets and shared memory
    /// (each check is a system call). Default 0: sleep at once (on 2 shared cores spinning
    /// cost CPU and latency, docs/decisions.md, "Spinning on sockets").
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
    /// `OXCCL_ONESHOT_MAPPED_MIN`: a one-shot all_reduce, reduce_scatter or all_gather of at
    /// least this many bytes whose ranks all have their buffers in shared buffers runs
    /// through those buffers (single-copy) instead of the slots (`direct/oneshot.rs`).
    /// Default 8 KiB.
    pub oneshot_mapped_min: usize,
    /// `OXCCL_MAPPED_MIN`: a call of at least this many bytes that would run neither one-shot
    /// nor single-copy by size (below `cma_min`) runs single-copy after all when every rank
    /// has its input and output in shared buffers, which its first event tells every rank
    /// (`direct/cma/`): loads and stores into mapped buffers cost no system call, so the
    /// threshold measured for `process_vm_readv` (`cma_min`, which `oxccl tune` may set to
    /// megabytes) does not hold for them. Default 8 KiB.
    pub mapped_min: usize,
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
    /// `OXCCL_METRICS_PORT`: a port (on 127.0.0.1) or `host:port` where each process serves
    /// its communicators' metrics as Prometheus `/metrics` over HTTP (`observe::metrics`).
    /// Default off.
    pub metrics_port: Option<String>,
    // Multi-host settings (transport/tcp.rs, cost.rs).
    /// `OXCCL_NET_GBPS`: network bandwidth per host link in GB/s for the cost model
    /// (default: `plan::cost::CostModel`'s, 1.2).
    pub net_gbps: Option<f64>,
    /// `OXCCL_NET_LAT_US`: network latency per step in microseconds for the cost model.
    pub net_lat_us: Option<f64>,
    /// The cost model's rates measured by `oxccl tune` on this host (the tune file's
    /// `Tuning::rates`); `None`: the model's built-in values.
    pub rates: Option<Rates>,
    /// `OXCCL_TCP_STREAMS`: TCP connections per pair of ranks on different hosts, striped.
    /// Default 1.
    pub tcp_streams: usize,
    /// `OXCCL_TCP_CONNECT`: when TCP links are made ([`TcpConnect`]; default `auto`). Rank
    /// 0's choice holds for every rank (it rides in the TCP transport's port exchange).
    pub tcp_connect: TcpConnect,
    /// `OXCCL_TCP_LAZY_MIN_RANKS`: [`TcpConnect::Auto`] makes links on first use in
    /// communicators of more ranks than this. Default 64.
    pub tcp_lazy_min_ranks: usize,
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
    /// `OXCCL_BOOTSTRAP_RELAY_MAX`: in a communicator of at most this many ranks the
    /// bootstrap's exchanges go through rank 0 (one round trip, O(n^2) bytes there); above it
    /// directly between ranks (Bruck's allgather, `ceil(log2 n)` rounds, O(n log n) bytes at
    /// rank 0). Rank 0's value decides. Default 64.
    pub bootstrap_relay_max: usize,
    /// `OXCCL_BOOTSTRAP_HOST_LEADERS`: with the exchanges directly between ranks (above
    /// `bootstrap_relay_max`), the ranks of a host other than rank 0 find one leader through
    /// an abstract Unix socket, and only the leader joins rank 0, for all of them: rank 0
    /// accepts one connection per host instead of one per rank. Default on.
    pub bootstrap_host_leaders: bool,
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
            shm_budget_bytes: 12 << 20,
            spin: 2000,
            direct_spin: None,
            tcp_spin: 0,
            yield_every: None,
            host_id: None,
            socket_ifname: None,
            algo: None,
            chunk_bytes: 256 << 10,
            oneshot_max: ONESHOT_MAX_DEFAULT,
            oneshot_mapped_min: 8 << 10,
            mapped_min: 8 << 10,
            cma_min: CMA_MIN_DEFAULT,
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
            metrics_port: None,
            net_gbps: None,
            net_lat_us: None,
            rates: None,
            tcp_streams: 1,
            tcp_connect: TcpConnect::Auto,
            tcp_lazy_min_ranks: 64,
            tcp_dead_after: Duration::from_secs(20),
            startup_report: Some(Duration::from_secs(10)),
            rendezvous_refused: Duration::from_secs(60),
            bootstrap_relay_max: 64,
            bootstrap_host_leaders: true,
            p2p_stash_bytes: 1 << 30,
        }
    }
}

/// `OXCCL_MEMBARRIER=1`: asymmetric fences in the doorbell ([`crate::base::wait`]): rings without a
/// hardware fence, sleepers issue `membarrier`. Off by default: a stress test lost wake-ups
/// with it (see `crate::base::wait`). Read once per process; set it on every rank of a host or none.
/// A value the table refuses counts as the default here; [`Config::from_env`] reports it.
pub(crate) fn membarrier_allowed() -> bool {
    table::MEMBARRIER.flag().ok().flatten().unwrap_or(false)
}

/// `OXCCL_HUGEPAGES=0`: no transparent huge pages for large private buffers on the single-copy
/// path (`direct::hugepages`); default on. Read once per process (an address space's buffers
/// are the process's, whatever communicator uses them). A value the table refuses counts as
/// the default here; [`Config::from_env`] reports it.
pub(crate) fn hugepages_allowed() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| table::HUGEPAGES.flag().ok().flatten().unwrap_or(true))
}

/// `OXCCL_SHM_POOL_CACHE`: how many bytes of freed blocks the process's pool of shared
/// buffers (`direct::shared_pool`, `oxcclMemAlloc`, the torch allocator) keeps for reuse;
/// default 1 GiB. Read once per process. A value the table refuses counts as the default
/// here; [`Config::from_env`] reports it.
pub(crate) fn shm_pool_cache_bytes() -> usize {
    table::SHM_POOL_CACHE
        .bytes()
        .ok()
        .flatten()
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

/// `OXCCL_ONESHOT_MAX`'s built-in value: 32 KiB.
const ONESHOT_MAX_DEFAULT: usize = 32 << 10;
/// `OXCCL_CMA_MIN`'s built-in value: 64 KiB.
const CMA_MIN_DEFAULT: usize = 64 << 10;

/// What `oxccl tune` measured on this host: the sizes where one algorithm overtakes another.
/// Saved as `key=value` lines in `OXCCL_TUNE_FILE` (default `~/.cache/oxccl/tune.conf`) and
/// read by [`Config::from_env`]; `OXCCL_ONESHOT_MAX` and `OXCCL_CMA_MIN` override it.
#[derive(Clone, Debug, PartialEq)]
pub struct Tuning {
    /// Largest input (bytes) that one-shot handles fastest, with [`Tuning::ranks`] ranks
    /// (what a communicator makes of it: [`Tuning::two_rank_oneshot_max`]).
    pub oneshot_max: usize,
    /// Smallest input (bytes) from which single-copy is fastest.
    pub cma_min: usize,
    /// How many ranks `oxccl tune` measured with (`ranks=`). `None` in files written before
    /// tune saved it, which [`Tuning::read`] takes as measured with the count the file's
    /// first comment names, else 2, with a warning.
    pub ranks: Option<usize>,
    /// The rates the multi-host cost model uses (`plan/cost.rs`), measured on this host;
    /// `None` in files written before `oxccl tune` measured them.
    pub rates: Option<Rates>,
}

/// What one rank does per second on this host, measured by `oxccl tune` for the cost
/// model of multi-host all_reduce (`plan/cost.rs`) and `oxccl sim`: the shared-memory
/// link, reduction and copy of float32 sums, and the TCP stack over loopback. Rates are in
/// GB/s (1e9 bytes per second), latencies in microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    /// Per-step latency of the shared-memory link (from the ring's time at 8 B).
    pub shm_lat_us: f64,
    /// Bandwidth of the shared-memory link (from the ring's time at the largest size).
    pub shm_gbps: f64,
    /// `dst += src` of float32 on buffers larger than the caches (bytes of `dst` per second).
    pub reduce_gbps: f64,
    /// The same on buffers that fit in the caches.
    pub reduce_cached_gbps: f64,
    /// Memory copy on buffers larger than the caches.
    pub copy_gbps: f64,
    /// Memory copy on buffers that fit in the caches.
    pub copy_cached_gbps: f64,
    /// One-way time of a small message over loopback TCP (half a ping-pong's round trip).
    pub tcp_lat_us: f64,
    /// Bytes per second one core moves through the TCP stack, sending and receiving
    /// (one thread writing to and reading from one loopback connection).
    pub tcp_gbps: f64,
}

/// A [`Rates`] field, for reading and writing the file.
type RateField = fn(&mut Rates) -> &mut f64;

impl Rates {
    /// The file's keys, in the order they are written, with each field.
    const KEYS: [(&'static str, RateField); 8] = [
        ("shm_lat_us", |r| &mut r.shm_lat_us),
        ("shm_gbps", |r| &mut r.shm_gbps),
        ("reduce_gbps", |r| &mut r.reduce_gbps),
        ("reduce_cached_gbps", |r| &mut r.reduce_cached_gbps),
        ("copy_gbps", |r| &mut r.copy_gbps),
        ("copy_cached_gbps", |r| &mut r.copy_cached_gbps),
        ("tcp_lat_us", |r| &mut r.tcp_lat_us),
        ("tcp_gbps", |r| &mut r.tcp_gbps),
    ];

    /// What the cost model assumes without a tune file (`plan/cost.rs` takes its
    /// shared-memory link and reduction rates from here), and typical values for the rates
    /// it has no built-in use for (copy; the loopback TCP stack). A tune file's rate more than
    /// [`Tuning::TRUST_FACTOR`] times away from its nominal value, either way, is not used.
    pub const NOMINAL: Rates = Rates {
        shm_lat_us: 4.0,
        shm_gbps: 3.0,
        reduce_gbps: 2.0,
        reduce_cached_gbps: 10.0,
        copy_gbps: 4.0,
        copy_cached_gbps: 20.0,
        tcp_lat_us: 10.0,
        tcp_gbps: 2.0,
    };

    /// Every rate as `(key, value)`, in the file's order.
    pub fn entries(&self) -> Vec<(&'static str, f64)> {
        let mut r = *self;
        Self::KEYS.iter().map(|(k, f)| (*k, *f(&mut r))).collect()
    }
}

/// `why` when `value` lies outside `lo..=hi`: `KEY=VALUE is outside LO to HI (RULE)`.
fn outside(key: &str, value: f64, lo: f64, hi: f64, rule: &str) -> Option<String> {
    (!(lo..=hi).contains(&value)).then(|| {
        let shown = if value >= table::MAX_THRESHOLD as f64 {
            format!("{value} (never)")
        } else {
            format!("{value}")
        };
        format!("{key}={shown} is outside {lo} to {hi} ({rule})")
    })
}

/// Announces `msg` once per process (a tune file is read by every communicator).
fn warn_once(msg: String) {
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if !seen.contains(&msg) {
        crate::base::debug::announce(&msg);
        seen.push(msg);
    }
}

impl Tuning {
    /// How far from its built-in value (a factor, either way) a threshold or a rate in a tune
    /// file may lie and still be used: a file from an `oxccl tune` run that other processes
    /// disturbed (single-copy never the fastest, link latencies of milliseconds) must not
    /// make a host worse than no file would. 32, not 16: on a quiet 2-core VM (load 0.6)
    /// four `oxccl tune` runs saved `cma_min` 2 MiB, 2 MiB, 1 MiB and never (ring and
    /// single-copy within noise of each other from 512 KiB on); under three busy loops
    /// `shm_lat_us` came out 1000 to 5400 µs.
    pub const TRUST_FACTOR: f64 = 32.0;
    /// The largest `oneshot_max` a tune file may set: one-shot carries at most a slot of the
    /// direct area (64 KiB).
    pub const ONESHOT_MAX_LIMIT: usize = 64 << 10;
    /// The most ranks a `ranks=` line may name.
    pub const MAX_RANKS: usize = 1 << 16;
    /// The largest tune file read (`oxccl tune` writes about 400 bytes): a bigger one, or a
    /// FIFO or device (`/dev/zero`), is refused before it is read.
    pub const MAX_FILE_BYTES: u64 = 1 << 20;

    /// The measured `oneshot_max` as `OXCCL_ONESHOT_MAX` means it: the limit with two
    /// ranks, which a communicator of `n` ranks multiplies by `n - 1`. A crossover `V`
    /// measured with `N` ranks is `V / (N - 1)` of it, rounded up so that `N` ranks take one-shot
    /// up to `V` again; other rank counts scale as the built-in value does (one handshake
    /// replaces the ring's `2(n-1)` steps). Files without a rank count: as measured with 2.
    pub fn two_rank_oneshot_max(&self) -> usize {
        let peers = self.ranks.unwrap_or(2).max(2) - 1;
        self.oneshot_max.div_ceil(peers)
    }

    /// The rank count an old file's first comment names (`oxccl tune on HOST, N ranks`),
    /// for files written before `ranks=`.
    fn ranks_in_comment(text: &str) -> Option<usize> {
        let first = text.lines().find_map(|l| l.trim().strip_prefix('#'))?;
        let head = first.trim().strip_prefix("oxccl tune on ")?;
        let (before, _) = head.split_once(" ranks")?;
        before
            .rsplit(' ')
            .next()?
            .parse()
            .ok()
            .filter(|n| (1..=Self::MAX_RANKS).contains(n))
    }

    /// Every value of `self` this library does not use, as `(key, why)`: a threshold more
    /// than [`Tuning::TRUST_FACTOR`] times away from its built-in value (`oneshot_max`
    /// beyond a slot, [`Tuning::ONESHOT_MAX_LIMIT`]; `cma_min` "never"), a rate more than
    /// that away from [`Rates::NOMINAL`]. `oxccl tune` refuses to save such values, and
    /// [`Tuning::read`] ignores them.
    pub fn implausible(&self) -> Vec<(&'static str, String)> {
        let f = Self::TRUST_FACTOR;
        let mut out = Vec::new();
        let thresholds = [
            (
                "oneshot_max",
                self.oneshot_max,
                ONESHOT_MAX_DEFAULT,
                Self::ONESHOT_MAX_LIMIT,
                format!("the built-in 32 KiB ÷/× {f}, at most a slot"),
            ),
            (
                "cma_min",
                self.cma_min,
                CMA_MIN_DEFAULT,
                CMA_MIN_DEFAULT * f as usize,
                format!("the built-in 64 KiB ÷/× {f}"),
            ),
        ];
        for (key, v, default, hi, rule) in thresholds {
            let lo = (default as f64 / f) as usize;
            if let Some(why) = outside(key, v as f64, lo as f64, hi as f64, &rule) {
                out.push((key, why));
            }
        }
        if let Some(r) = &self.rates {
            for ((key, v), (_, nominal)) in r.entries().into_iter().zip(Rates::NOMINAL.entries()) {
                let rule = format!("the nominal {nominal} ÷/× {f}");
                if let Some(why) = outside(key, v, nominal / f, nominal * f, &rule) {
                    out.push((key, why));
                }
            }
        }
        out
    }

    /// `self` without the values [`Tuning::implausible`] finds, and those values as
    /// `(key, why)`: a threshold takes its built-in value, and one implausible rate drops
    /// them all (the cost model's built-in ones stand).
    pub fn trusted(mut self) -> (Tuning, Vec<(&'static str, String)>) {
        let doubts = self.implausible();
        for (key, _) in &doubts {
            match *key {
                "oneshot_max" => self.oneshot_max = ONESHOT_MAX_DEFAULT,
                "cma_min" => self.cma_min = CMA_MIN_DEFAULT,
                _ => self.rates = None,
            }
        }
        (self, doubts)
    }

    /// Where the measured tuning lives (`None` when `OXCCL_TUNE_FILE` is set empty: no file).
    pub fn path() -> Option<std::path::PathBuf> {
        if let Some(p) = std::env::var_os(table::TUNE_FILE.name) {
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
        match Self::path() {
            Some(path) => Self::read(&path),
            None => Ok(None),
        }
    }

    /// The tuning saved in `path` (`None` when there is no such file); a malformed file is
    /// an error naming it. Values outside sane bounds ([`Tuning::implausible`]) are not
    /// used: a warning names the file and the key, once per process, and the threshold
    /// takes its built-in value (the rates: none of them).
    pub fn read(path: &std::path::Path) -> Result<Option<Tuning>> {
        let text = match crate::base::file::read_bounded(path, Self::MAX_FILE_BYTES) {
            Ok(Some(t)) => t,
            Ok(None) => return Ok(None),
            Err(e) => return Err(Error::Env(format!("tune file {}: {e}", path.display()))),
        };
        let t = Self::parse(&text).map_err(|e| {
            Error::Env(format!(
                "{}: {e} (rerun `oxccl tune` or delete it)",
                path.display()
            ))
        })?;
        let (mut t, dropped) = t.trusted();
        if t.ranks.is_none() {
            let (n, from) = match Self::ranks_in_comment(&text) {
                Some(n) => (n, "as its first comment says"),
                None => (2, "no comment says otherwise"),
            };
            warn_once(format!(
                "{}: no ranks= line (written before `oxccl tune` saved how many ranks it \
                 measured with): oneshot_max={} taken as measured with {n} ranks ({from}); \
                 rerun `oxccl tune`",
                path.display(),
                t.oneshot_max
            ));
            t.ranks = Some(n);
        }
        for (key, why) in dropped {
            let instead = if Rates::KEYS.iter().any(|(k, _)| *k == key) {
                "no rate of the file is used"
            } else {
                "the built-in value is used"
            };
            warn_once(format!(
                "{}: {why}: not used, {instead} (a disturbed `oxccl tune`? rerun it on a quiet \
                 machine, or delete the file)",
                path.display()
            ));
        }
        Ok(Some(t))
    }

    /// Parses the `key=value` form (`#` starts a comment).
    pub fn parse(text: &str) -> std::result::Result<Tuning, String> {
        let (mut oneshot, mut cma, mut ranks) = (None, None, None);
        let mut rates = Rates {
            shm_lat_us: f64::NAN,
            shm_gbps: f64::NAN,
            reduce_gbps: f64::NAN,
            reduce_cached_gbps: f64::NAN,
            copy_gbps: f64::NAN,
            copy_cached_gbps: f64::NAN,
            tcp_lat_us: f64::NAN,
            tcp_gbps: f64::NAN,
        };
        let mut rates_seen = 0;
        for line in text
            .lines()
            .map(|l| l.split('#').next().unwrap_or("").trim())
            .filter(|l| !l.is_empty())
        {
            let (k, v) = line
                .split_once('=')
                .ok_or_else(|| format!("'{line}' is not key=value"))?;
            if let Some((key, field)) = Rates::KEYS.iter().find(|(key, _)| *key == k.trim()) {
                let x: f64 = v
                    .trim()
                    .parse()
                    .ok()
                    .filter(|x: &f64| x.is_finite() && *x > 0.0 && *x <= 1e9)
                    .ok_or_else(|| {
                        format!(
                            "{key}={}: expected a number above 0, at most 1e9",
                            table::shown(v.trim())
                        )
                    })?;
                let slot = field(&mut rates);
                if slot.is_nan() {
                    rates_seen += 1;
                }
                *slot = x;
                continue;
            }
            if k.trim() == "ranks" {
                let n = v
                    .trim()
                    .parse()
                    .ok()
                    .filter(|n| (1..=Self::MAX_RANKS).contains(n))
                    .ok_or_else(|| {
                        format!(
                            "ranks={}: expected a whole number from 1 to {}",
                            table::shown(v.trim()),
                            Self::MAX_RANKS
                        )
                    })?;
                ranks = Some(n);
                continue;
            }
            let (key, param) = match k.trim() {
                "oneshot_max" => ("oneshot_max", &table::ONESHOT_MAX),
                "cma_min" => ("cma_min", &table::CMA_MIN),
                other => return Err(format!("unknown key '{}'", table::shown(other))),
            };
            let v = match param.parse(v) {
                Ok(table::Value::Bytes(b)) => usize::try_from(b).map_err(|e| e.to_string())?,
                Ok(_) => return Err(format!("{key}: not a size")),
                Err(why) => {
                    return Err(format!(
                        "{key}={}: {why}; expected {}",
                        table::shown(v.trim()),
                        param.range()
                    ))
                }
            };
            match key {
                "oneshot_max" => oneshot = Some(v),
                "cma_min" => cma = Some(v),
                other => return Err(format!("unknown key '{other}'")),
            }
        }
        // The rates come all together or not at all (files of older versions have none).
        let rates = match rates_seen {
            0 => None,
            n if n == Rates::KEYS.len() => Some(rates),
            _ => {
                let missing: Vec<&str> = rates
                    .entries()
                    .into_iter()
                    .filter(|(_, v)| v.is_nan())
                    .map(|(k, _)| k)
                    .collect();
                return Err(format!("{} missing", missing.join(", ")));
            }
        };
        Ok(Tuning {
            oneshot_max: oneshot.ok_or("oneshot_max missing")?,
            cma_min: cma.ok_or("cma_min missing")?,
            ranks,
            rates,
        })
    }

    /// The file's text.
    pub fn render(&self, comment: &str) -> String {
        let mut s = format!(
            "# {comment}\noneshot_max={}\ncma_min={}\n",
            self.oneshot_max, self.cma_min
        );
        if let Some(n) = self.ranks {
            s.push_str(&format!(
                "# the ranks the thresholds were measured with\nranks={n}\n"
            ));
        }
        if let Some(r) = &self.rates {
            s.push_str("# rates for the multi-host cost model (oxccl sim, plan/cost.rs)\n");
            for (k, v) in r.entries() {
                s.push_str(&format!("{k}={v}\n"));
            }
        }
        s
    }
}

impl Config {
    /// Reads every `OXCCL_*` setting from the environment; unset ones keep their defaults.
    /// Every variable the library reads (also those read once per process) is checked
    /// against the table first: a value it refuses is an error naming the variable, the
    /// value and the accepted range.
    pub fn from_env() -> Result<Config> {
        use table::*;
        check_env(&[Scope::Comm, Scope::Process])?;
        let mut c = Config::default();
        // Measured thresholds (`oxccl tune`) first; explicit variables override them.
        if let Some(t) = Tuning::load()? {
            c.oneshot_max = t.two_rank_oneshot_max();
            c.cma_min = t.cma_min;
            c.rates = t.rates;
        }
        if let Some(t) = TIMEOUT.seconds()? {
            c.timeout = t;
        }
        if let Some(t) = TRANSPORT.choice()? {
            c.transport = t.parse().map_err(Error::Env)?;
        }
        let u32_of = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
        if let Some(b) = SHM_RING_BYTES.bytes()? {
            c.shm_ring_bytes = b;
        }
        if let Some(b) = SHM_BUDGET_BYTES.bytes()? {
            c.shm_budget_bytes = b;
        }
        if let Some(s) = SPIN.count()? {
            c.spin = u32_of(s);
        }
        if let Some(s) = DIRECT_SPIN.count()? {
            c.direct_spin = Some(u32_of(s));
        }
        if let Some(s) = TCP_SPIN.count()? {
            c.tcp_spin = u32_of(s);
        }
        if let Some(y) = YIELD_EVERY.count()? {
            c.yield_every = Some(u32_of(y));
        }
        c.host_id = HOSTID.text()?;
        c.socket_ifname = SOCKET_IFNAME.text()?;
        c.algo = ALGO.text()?.map(|a| a.to_ascii_lowercase());
        if let Some(b) = CHUNK_BYTES.bytes()? {
            c.chunk_bytes = b;
        }
        if let Some(b) = ONESHOT_MAX.bytes()? {
            c.oneshot_max = b;
        }
        if let Some(b) = ONESHOT_MAPPED_MIN.bytes()? {
            c.oneshot_mapped_min = b;
        }
        if let Some(b) = MAPPED_MIN.bytes()? {
            c.mapped_min = b;
        }
        if let Some(b) = CMA_MIN.bytes()? {
            c.cma_min = b;
        }
        if let Some(b) = NT_BYTES.bytes()? {
            c.nt_bytes = b;
        }
        if let Some(b) = CMA.flag()? {
            c.cma = b;
        }
        if let Some(b) = DETERMINISTIC.flag()? {
            c.deterministic = b;
        }
        if let Some(h) = HEARTBEAT_TIMEOUT.seconds()? {
            c.heartbeat = (!h.is_zero()).then_some(h);
        }
        c.flight_recorder = FLIGHT_RECORDER.text()?;
        if let Some(n) = FLIGHT_RECORDER_ENTRIES.count()? {
            c.flight_entries = usize::try_from(n).unwrap_or(usize::MAX);
        }
        c.trace = TRACE.text()?;
        c.metrics = METRICS.text()?;
        if let Some(t) = METRICS_INTERVAL.seconds()? {
            c.metrics_interval = t;
        }
        c.fr_dump = FR_DUMP.text()?;
        c.status = STATUS.text()?;
        c.metrics_port = METRICS_PORT.text()?;
        c.net_gbps = NET_GBPS.number()?;
        c.net_lat_us = NET_LAT_US.number()?;
        if let Some(k) = TCP_STREAMS.count()? {
            c.tcp_streams = usize::try_from(k).unwrap_or(1);
        }
        if let Some(w) = TCP_CONNECT.choice()? {
            c.tcp_connect = match w {
                "eager" => TcpConnect::Eager,
                "lazy" => TcpConnect::Lazy,
                _ => TcpConnect::Auto,
            };
        }
        if let Some(k) = TCP_LAZY_MIN_RANKS.count()? {
            c.tcp_lazy_min_ranks = usize::try_from(k).unwrap_or(usize::MAX);
        }
        if let Some(t) = TCP_DEAD_AFTER.seconds()? {
            c.tcp_dead_after = t;
        }
        if let Some(b) = P2P_STASH_BYTES.bytes()? {
            c.p2p_stash_bytes = b;
        }
        if let Some(t) = STARTUP_REPORT_SECS.seconds()? {
            c.startup_report = (!t.is_zero()).then_some(t);
        }
        if let Some(t) = RENDEZVOUS_REFUSED_SECS.seconds()? {
            c.rendezvous_refused = t;
        }
        if let Some(k) = BOOTSTRAP_RELAY_MAX.count()? {
            c.bootstrap_relay_max = usize::try_from(k).unwrap_or(usize::MAX);
        }
        if let Some(b) = BOOTSTRAP_HOST_LEADERS.flag()? {
            c.bootstrap_host_leaders = b;
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The warnings this test process announced about the file `path`.
    fn announced_about(path: &std::path::Path) -> Vec<String> {
        crate::base::debug::ANNOUNCED
            .lock()
            .unwrap()
            .iter()
            .filter(|m| m.starts_with(&path.display().to_string()))
            .cloned()
            .collect()
    }

    #[test]
    fn tuning_file() {
        let t = Tuning {
            oneshot_max: 4096,
            cma_min: 1 << 20,
            ranks: Some(2),
            rates: None,
        };
        assert_eq!(Tuning::parse(&t.render("measured")).unwrap(), t);
        // With the cost model's rates: every one reads back; all or none must be there.
        let rates = Rates {
            shm_lat_us: 1.5,
            shm_gbps: 3.25,
            reduce_gbps: 2.0,
            reduce_cached_gbps: 9.5,
            copy_gbps: 4.0,
            copy_cached_gbps: 20.0,
            tcp_lat_us: 12.125,
            tcp_gbps: 1.75,
        };
        let full = Tuning {
            rates: Some(rates),
            ..t.clone()
        };
        let text = full.render("measured");
        assert_eq!(Tuning::parse(&text).unwrap(), full);
        assert!(text.contains("tcp_gbps=1.75\n"), "{text}");
        let partial: String = text
            .lines()
            .filter(|l| !l.starts_with("tcp_"))
            .map(|l| format!("{l}\n"))
            .collect();
        let e = Tuning::parse(&partial).unwrap_err();
        assert!(e.contains("tcp_lat_us, tcp_gbps missing"), "{e}");
        for bad in ["0", "-1", "nan", "inf", "x", "2e9"] {
            let e = Tuning::parse(&text.replace("tcp_gbps=1.75", &format!("tcp_gbps={bad}")))
                .unwrap_err();
            assert!(e.starts_with("tcp_gbps="), "{bad}: {e}");
        }
        assert!(Tuning::parse("oneshot_max=1\n").is_err());
        assert!(Tuning::parse("oneshot_max=1\ncma_min=2\nfoo=3").is_err());
        // "never" as oxccl tune writes it reads back
        let never = Tuning {
            oneshot_max: 0,
            cma_min: table::MAX_THRESHOLD as usize,
            ranks: None,
            rates: None,
        };
        assert_eq!(Tuning::parse(&never.render("never")).unwrap(), never);
        for bad in ["0", "x", "65537"] {
            let e = Tuning::parse(&format!("oneshot_max=1\ncma_min=2\nranks={bad}")).unwrap_err();
            assert!(e.starts_with("ranks="), "{bad}: {e}");
        }
    }

    /// `oneshot_max` measured with n ranks: a communicator takes it as n-1 times its
    /// two-rank limit (the measured size again at n ranks), and a file from before `ranks=`
    /// says its rank count only in its comment: read from there, with a warning.
    #[test]
    fn oneshot_max_says_the_ranks_it_was_measured_with() {
        let four = Tuning {
            oneshot_max: 64 << 10,
            cma_min: 1 << 20,
            ranks: Some(4),
            rates: None,
        };
        let text = four.render("oxccl tune on host, 4 ranks");
        assert!(text.contains("\nranks=4\n"), "{text}");
        assert_eq!(Tuning::parse(&text).unwrap(), four);
        // 21846 with two ranks; 3 x 21846 >= 64 KiB with four.
        assert_eq!(four.two_rank_oneshot_max(), 21846);
        assert!(3 * four.two_rank_oneshot_max() >= 64 << 10);
        let two = Tuning {
            ranks: Some(2),
            ..four.clone()
        };
        assert_eq!(two.two_rank_oneshot_max(), 64 << 10);
        let one = Tuning {
            ranks: Some(1),
            ..four.clone()
        };
        assert_eq!(one.two_rank_oneshot_max(), 64 << 10);

        let path = std::env::temp_dir().join(format!("oxccl-old-tune-{}.conf", std::process::id()));
        let old: String = text
            .lines()
            .filter(|l| !l.contains("ranks=") && !l.contains("measured with"))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&path, &old).unwrap();
        for _ in 0..2 {
            let read = Tuning::read(&path).unwrap().unwrap();
            assert_eq!(read.ranks, Some(4), "from the comment: {old}");
            assert_eq!(read.two_rank_oneshot_max(), 21846);
        }
        std::fs::write(&path, old.replace("4 ranks", "many ranks")).unwrap();
        assert_eq!(Tuning::read(&path).unwrap().unwrap().ranks, Some(2));
        let said = announced_about(&path);
        assert_eq!(said.len(), 2, "once per file content: {said:?}");
        assert!(
            said[0].contains("taken as measured with 4 ranks"),
            "{said:?}"
        );
        assert!(
            said[1].contains("taken as measured with 2 ranks"),
            "{said:?}"
        );
        let _ = std::fs::remove_file(path);
    }

    /// A tune file from a disturbed `oxccl tune` (single-copy never the fastest, a link
    /// latency of 56 ms) is read without its implausible values, each named once.
    #[test]
    fn implausible_values_of_a_tune_file_are_not_used() {
        let path =
            std::env::temp_dir().join(format!("oxccl-implausible-{}.conf", std::process::id()));
        let good = Rates {
            shm_lat_us: 2.0,
            ..Rates::NOMINAL
        };
        let t = Tuning {
            oneshot_max: 16 << 10,
            cma_min: table::MAX_THRESHOLD as usize,
            ranks: Some(2),
            rates: Some(good),
        };
        std::fs::write(&path, t.render("loaded")).unwrap();
        let read = Tuning::read(&path).unwrap().unwrap();
        assert_eq!(
            read.cma_min, CMA_MIN_DEFAULT,
            "never single-copy is not used"
        );
        assert_eq!(read.oneshot_max, 16 << 10, "a sane threshold stays");
        assert_eq!(read.rates, Some(good), "sane rates stay");
        let bad = Tuning {
            oneshot_max: 1 << 20,
            cma_min: 128 << 10,
            ranks: Some(2),
            rates: Some(Rates {
                shm_lat_us: 56_000.0,
                ..good
            }),
        };
        std::fs::write(&path, bad.render("loaded")).unwrap();
        for _ in 0..2 {
            let read = Tuning::read(&path).unwrap().unwrap();
            assert_eq!(read.oneshot_max, ONESHOT_MAX_DEFAULT, "past a slot");
            assert_eq!(read.cma_min, 128 << 10);
            assert_eq!(read.rates, None, "one absurd rate drops them all");
        }
        let said = announced_about(&path);
        assert_eq!(said.len(), 3, "once each, naming file and key: {said:?}");
        for key in [
            "cma_min=1099511627776 (never)",
            "oneshot_max=1048576",
            "shm_lat_us=56000",
        ] {
            assert!(said.iter().any(|m| m.contains(key)), "{key}: {said:?}");
        }
        assert!(bad.implausible().len() == 2 && t.implausible().len() == 1);
        let _ = std::fs::remove_file(path);
    }
}
