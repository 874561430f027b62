//! Every tunable read from the environment, in one place (as NCCL's `NCCL_PARAM`).
//!
//! [`Config::from_env`] reads them once per communicator (over the thresholds and rates
//! `oxccl tune` measured: `plan/tuning.rs`); tests and embedders build a [`Config`] by hand
//! instead. docs/environment.md lists them for users.

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
    /// The cost model's rates measured by `oxccl tune` on this host, as the tune file gives
    /// them (in the file's order: `Rates::KEYS` in `plan/tuning.rs`, which reads them back
    /// as a `Rates`); `None`: the model's built-in values.
    pub rates: Option<[f64; RATE_COUNT]>,
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
    // Start-up settings (bootstrap/).
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

/// How many rates of the cost model a tune file holds ([`Config::rates`]).
pub(crate) const RATE_COUNT: usize = 8;

/// `OXCCL_ONESHOT_MAX`'s built-in value: 32 KiB.
pub(crate) const ONESHOT_MAX_DEFAULT: usize = 32 << 10;
/// `OXCCL_CMA_MIN`'s built-in value: 64 KiB.
pub(crate) const CMA_MIN_DEFAULT: usize = 64 << 10;

impl Config {
    /// `c` with every `OXCCL_*` setting the environment sets; unset ones keep their values
    /// in `c`. The variables' values are not checked against the table here:
    /// [`Config::from_env`] (`plan/tuning.rs`, since it starts from the tune file's values)
    /// checks them first.
    pub(crate) fn from_env_over(mut c: Config) -> Result<Config> {
        use table::*;
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
