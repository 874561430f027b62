//! The declared table of every `OXCCL_*` variable: name, kind, accepted range, default and
//! meaning, and the one parser every read goes through (as NCCL's `NCCL_PARAM`).
//!
//! Every value is checked against its entry: a value out of range, of the wrong form or not
//! valid UTF-8 is an [`Error::Env`] naming the variable, the value (cut to
//! [`MAX_SHOWN_VALUE`] characters) and the accepted range; nothing here panics. An empty
//! value counts as unset (the default), except where an entry says otherwise.
//! docs/environment.md lists the same variables (a test checks it).

use std::time::Duration;

use crate::base::error::{Error, Result};

/// What a variable holds, and the values it accepts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    /// Seconds, fractions allowed (`1.5`, `1e3`): 0 when `zero` is true, and from `min`
    /// (just above 0 where `min` is 0) up to `max`.
    Seconds {
        /// Whether 0 is accepted (it then means "off" or "none", as the entry says).
        zero: bool,
        /// The smallest accepted value above 0 (0: any above 0).
        min: f64,
        /// The largest accepted value.
        max: f64,
    },
    /// A byte size with an optional K, M or G suffix (powers of 1024), `min..=max`.
    Bytes {
        /// The smallest accepted size.
        min: u64,
        /// The largest accepted size.
        max: u64,
    },
    /// A whole number, `min..=max`.
    Count {
        /// The smallest accepted number.
        min: u64,
        /// The largest accepted number.
        max: u64,
    },
    /// A number from `min` (just above 0 where `min` is 0; fractions allowed) to `max`.
    Number {
        /// The smallest accepted value (0: any above 0).
        min: f64,
        /// The largest accepted value.
        max: f64,
    },
    /// `0`/`1` (also `false`/`true`, `no`/`yes`, `off`/`on`).
    Bool,
    /// One of these words (case-insensitive).
    Enum(&'static [&'static str]),
    /// Free text (a path, a name, an address) of at most this many bytes.
    Text {
        /// The longest accepted value, in bytes.
        max_len: usize,
    },
}

/// Who reads a variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Each communicator, in [`Config::from_env`](super::Config::from_env).
    Comm,
    /// The library, once per process (logging, the doorbell, the shared-buffer pool, the
    /// tuning file).
    Process,
    /// The launcher environment (`Communicator::from_env`, `bootstrap/env.rs`).
    Launch,
    /// The `oxccl` command-line tool.
    Cli,
    /// The Python package (`python/oxccl`); listed here so that one table names every
    /// variable, parsed there.
    Python,
    /// The scripts (`scripts/cluster.sh`); listed here so that one table names every
    /// variable, read there.
    Script,
}

/// A further check of a text value: what is wrong with it.
type Check = fn(&str) -> std::result::Result<(), String>;

/// One variable of the table.
#[derive(Clone, Copy, Debug)]
pub struct Param {
    /// The variable's name, `OXCCL_...`.
    pub name: &'static str,
    /// What it holds and which values are accepted.
    pub kind: Kind,
    /// The default, as a user would write it (or in words, where it depends on the host).
    pub default: &'static str,
    /// Who reads it.
    pub scope: Scope,
    /// What it does, in one line (docs/environment.md says more).
    pub doc: &'static str,
    /// A further check of a `Text` value, beyond its length.
    check: Option<Check>,
}

/// A parsed value, of the entry's [`Kind`].
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// [`Kind::Seconds`].
    Seconds(Duration),
    /// [`Kind::Bytes`].
    Bytes(u64),
    /// [`Kind::Count`].
    Count(u64),
    /// [`Kind::Number`].
    Number(f64),
    /// [`Kind::Bool`].
    Bool(bool),
    /// [`Kind::Enum`]: the table's spelling of the word.
    Choice(&'static str),
    /// [`Kind::Text`].
    Text(String),
}

/// The most characters of a rejected value an error message repeats.
pub const MAX_SHOWN_VALUE: usize = 64;

/// The largest number of seconds any variable accepts (about 115 days): far beyond any
/// useful timeout, and small enough that deadlines computed from it never overflow.
pub const MAX_SECS: f64 = 1e7;
/// The largest byte size a threshold accepts (1 TiB).
/// The largest threshold a size variable (`OXCCL_CMA_MIN`, `OXCCL_ONESHOT_MAX`, a tune file)
/// accepts: 1 TiB, past any buffer; `oxccl tune` writes it for "never".
pub const MAX_THRESHOLD: u64 = 1 << 40;
/// The largest number of progress checks a spin setting accepts.
const MAX_SPIN: u64 = 1_000_000_000;
/// The longest path or name accepted (Linux's `PATH_MAX`).
const MAX_PATH: usize = 4096;

const fn p(
    name: &'static str,
    kind: Kind,
    default: &'static str,
    scope: Scope,
    doc: &'static str,
) -> Param {
    Param {
        name,
        kind,
        default,
        scope,
        doc,
        check: None,
    }
}

const fn checked(
    name: &'static str,
    kind: Kind,
    default: &'static str,
    scope: Scope,
    doc: &'static str,
    check: Check,
) -> Param {
    Param {
        name,
        kind,
        default,
        scope,
        doc,
        check: Some(check),
    }
}

/// The shortest time a timeout or an interval may be set to: shorter ones (`1e-9`) are
/// typing errors, not settings, and would fail every call or spin a thread.
pub const MIN_SECS: f64 = 1e-3;
const fn secs(zero: bool, max: f64) -> Kind {
    Kind::Seconds {
        zero,
        min: MIN_SECS,
        max,
    }
}
const fn bytes(min: u64, max: u64) -> Kind {
    Kind::Bytes { min, max }
}
const fn count(min: u64, max: u64) -> Kind {
    Kind::Count { min, max }
}
const TEXT: Kind = Kind::Text { max_len: MAX_PATH };

use Scope::{Cli, Comm, Launch, Process, Python, Script};

/// `OXCCL_TIMEOUT`.
pub const TIMEOUT: Param = p(
    "OXCCL_TIMEOUT",
    secs(false, MAX_SECS),
    "600",
    Comm,
    "seconds a call, a connection attempt or the rendezvous may wait for peers",
);
/// `OXCCL_TRANSPORT`.
pub const TRANSPORT: Param = p(
    "OXCCL_TRANSPORT",
    Kind::Enum(&["auto", "shm", "tcp", "socket"]),
    "auto",
    Comm,
    "auto: shared memory inside a host, TCP between hosts; shm; tcp (socket)",
);
/// `OXCCL_SHM_RING_BYTES`.
pub const SHM_RING_BYTES: Param = p(
    "OXCCL_SHM_RING_BYTES",
    bytes(4096, 1 << 30),
    "4M",
    Comm,
    "capacity of each shared-memory ring",
);
/// `OXCCL_SHM_BUDGET_BYTES`.
pub const SHM_BUDGET_BYTES: Param = p(
    "OXCCL_SHM_BUDGET_BYTES",
    bytes(0, 1 << 40),
    "12M",
    Comm,
    "shared memory per rank, enforced: rings shrink (to 64K) to fit, stop growing at it; 0: none",
);
/// `OXCCL_SPIN`.
pub const SPIN: Param = p(
    "OXCCL_SPIN",
    count(0, MAX_SPIN),
    "2000",
    Comm,
    "progress checks a waiting rank makes before it sleeps",
);
/// `OXCCL_DIRECT_SPIN`.
pub const DIRECT_SPIN: Param = p(
    "OXCCL_DIRECT_SPIN",
    count(0, MAX_SPIN),
    "100000 if a CPU per rank, else OXCCL_SPIN",
    Comm,
    "progress checks before sleeping in a small (direct) call, then learned per rank",
);
/// `OXCCL_TCP_SPIN`.
pub const TCP_SPIN: Param = p(
    "OXCCL_TCP_SPIN",
    count(0, MAX_SPIN),
    "0",
    Comm,
    "progress checks before sleeping in poll while waiting on a socket",
);
/// `OXCCL_YIELD_EVERY`.
pub const YIELD_EVERY: Param = p(
    "OXCCL_YIELD_EVERY",
    count(1, MAX_SPIN),
    "1 oversubscribed, else 64",
    Comm,
    "progress checks between two yields of a spinning rank",
);
/// `OXCCL_HOSTID`.
pub const HOSTID: Param = p(
    "OXCCL_HOSTID",
    TEXT,
    "host name, boot id, /dev/shm identity",
    Comm,
    "ranks with equal host ids use shared memory",
);
/// `OXCCL_SOCKET_IFNAME`.
pub const SOCKET_IFNAME: Param = p(
    "OXCCL_SOCKET_IFNAME",
    Kind::Text { max_len: 15 },
    "the interface routing to the rendezvous",
    Comm,
    "network interface for data connections",
);
/// `OXCCL_ALGO` (the algorithm names are checked at init, `sched`).
pub const ALGO: Param = p(
    "OXCCL_ALGO",
    Kind::Text { max_len: 64 },
    "chosen per call",
    Comm,
    "force an algorithm for every collective it can run",
);
/// `OXCCL_CHUNK_BYTES`.
pub const CHUNK_BYTES: Param = p(
    "OXCCL_CHUNK_BYTES",
    bytes(64, 1 << 30),
    "256K",
    Comm,
    "pipeline segment of the chained algorithms",
);
/// `OXCCL_ONESHOT_MAX`.
pub const ONESHOT_MAX: Param = p(
    "OXCCL_ONESHOT_MAX",
    bytes(0, MAX_THRESHOLD),
    "32K, or oxccl tune's",
    Comm,
    "largest input sent one-shot through shared slots",
);
/// `OXCCL_ONESHOT_MAPPED_MIN`.
pub const ONESHOT_MAPPED_MIN: Param = p(
    "OXCCL_ONESHOT_MAPPED_MIN",
    bytes(0, MAX_THRESHOLD),
    "8K",
    Comm,
    "one-shot input from which shared buffers are used in place of the slots",
);
/// `OXCCL_MAPPED_MIN`.
pub const MAPPED_MIN: Param = p(
    "OXCCL_MAPPED_MIN",
    bytes(0, MAX_THRESHOLD),
    "8K",
    Comm,
    "input from which calls whose ranks all use shared buffers go single-copy",
);
/// `OXCCL_CMA_MIN`.
pub const CMA_MIN: Param = p(
    "OXCCL_CMA_MIN",
    bytes(0, MAX_THRESHOLD),
    "64K, or oxccl tune's",
    Comm,
    "smallest input copied straight between ranks' buffers",
);
/// `OXCCL_CMA`.
pub const CMA: Param = p(
    "OXCCL_CMA",
    Kind::Bool,
    "1",
    Comm,
    "0 forbids reading and writing peers' memory",
);
/// `OXCCL_NT_BYTES`.
pub const NT_BYTES: Param = p(
    "OXCCL_NT_BYTES",
    bytes(0, MAX_THRESHOLD),
    "a quarter of the last-level cache",
    Comm,
    "footprint from which single-copy results use streaming stores",
);
/// `OXCCL_DETERMINISTIC`.
pub const DETERMINISTIC: Param = p(
    "OXCCL_DETERMINISTIC",
    Kind::Bool,
    "0",
    Comm,
    "1: reductions combine values in rank order",
);
/// `OXCCL_HEARTBEAT_TIMEOUT`.
pub const HEARTBEAT_TIMEOUT: Param = p(
    "OXCCL_HEARTBEAT_TIMEOUT",
    // Below 0.1 s, the watchdog's beats (a few per timeout) would come faster than a loaded
    // host schedules them: every peer lost at once.
    Kind::Seconds {
        zero: true,
        min: 0.1,
        max: MAX_SECS,
    },
    "1.5",
    Comm,
    "seconds of watchdog silence after which a rank is lost (0: off)",
);
/// `OXCCL_FLIGHT_RECORDER`.
pub const FLIGHT_RECORDER: Param = p(
    "OXCCL_FLIGHT_RECORDER",
    TEXT,
    "off",
    Comm,
    "file prefix of the flight recorder's dumps",
);
/// `OXCCL_FLIGHT_RECORDER_ENTRIES`.
pub const FLIGHT_RECORDER_ENTRIES: Param = p(
    "OXCCL_FLIGHT_RECORDER_ENTRIES",
    count(0, 100_000),
    "256",
    Comm,
    "calls the flight recorder keeps per rank",
);
/// `OXCCL_TRACE`.
pub const TRACE: Param = p(
    "OXCCL_TRACE",
    TEXT,
    "off",
    Comm,
    "file of a Chrome/Perfetto timeline per rank",
);
/// `OXCCL_METRICS`.
pub const METRICS: Param = p(
    "OXCCL_METRICS",
    TEXT,
    "off",
    Comm,
    "directory of per-rank call metrics",
);
/// `OXCCL_METRICS_INTERVAL`.
pub const METRICS_INTERVAL: Param = p(
    "OXCCL_METRICS_INTERVAL",
    secs(false, MAX_SECS),
    "10",
    Comm,
    "seconds between two writes of the metrics",
);
/// `OXCCL_FR_DUMP`.
pub const FR_DUMP: Param = p(
    "OXCCL_FR_DUMP",
    TEXT,
    "off",
    Comm,
    "file prefix of flight records in PyTorch's format",
);
/// `OXCCL_METRICS_PORT`.
pub const METRICS_PORT: Param = checked(
    "OXCCL_METRICS_PORT",
    Kind::Text { max_len: 300 },
    "off",
    Comm,
    "PORT or HOST:PORT where each process serves Prometheus /metrics (taken: off, with a warning)",
    check_port_or_addr,
);
/// `OXCCL_STATUS`.
pub const STATUS: Param = checked(
    "OXCCL_STATUS",
    Kind::Text { max_len: 300 },
    "off",
    Comm,
    "PORT or HOST:PORT where rank 0 answers oxccl status",
    check_port_or_addr,
);
/// `OXCCL_NET_GBPS`.
pub const NET_GBPS: Param = p(
    "OXCCL_NET_GBPS",
    Kind::Number {
        min: 1e-6,
        max: 1e6,
    },
    "1.2",
    Comm,
    "the cost model's network bandwidth per host link, GB/s",
);
/// `OXCCL_NET_LAT_US`.
pub const NET_LAT_US: Param = p(
    "OXCCL_NET_LAT_US",
    Kind::Number {
        min: 1e-3,
        max: 1e9,
    },
    "30",
    Comm,
    "the cost model's network latency per step, microseconds",
);
/// `OXCCL_TCP_STREAMS`.
pub const TCP_STREAMS: Param = p(
    "OXCCL_TCP_STREAMS",
    count(1, 16),
    "1",
    Comm,
    "TCP connections per pair of ranks on different hosts",
);
/// `OXCCL_TCP_CONNECT`.
pub const TCP_CONNECT: Param = p(
    "OXCCL_TCP_CONNECT",
    Kind::Enum(&["auto", "eager", "lazy"]),
    "auto",
    Comm,
    "eager: every TCP link is made at init; lazy: when a call first needs it; auto: lazy \
     above OXCCL_TCP_LAZY_MIN_RANKS ranks, else eager",
);
/// `OXCCL_TCP_LAZY_MIN_RANKS`.
pub const TCP_LAZY_MIN_RANKS: Param = p(
    "OXCCL_TCP_LAZY_MIN_RANKS",
    count(1, 1 << 24),
    "64",
    Comm,
    "OXCCL_TCP_CONNECT=auto makes TCP links on first use in communicators of more ranks than this",
);
/// `OXCCL_TCP_DEAD_AFTER` (keepalive idle time is half of it, and Linux takes at most
/// 32767 s).
pub const TCP_DEAD_AFTER: Param = p(
    "OXCCL_TCP_DEAD_AFTER",
    secs(true, 65_000.0),
    "20",
    Comm,
    "seconds without acknowledgement after which a TCP peer is lost (0: the kernel's)",
);
/// `OXCCL_P2P_STASH_BYTES`.
pub const P2P_STASH_BYTES: Param = p(
    "OXCCL_P2P_STASH_BYTES",
    bytes(0, MAX_THRESHOLD),
    "1G",
    Comm,
    "bytes of early point-to-point messages a rank keeps",
);
/// `OXCCL_STARTUP_REPORT_SECS`.
pub const STARTUP_REPORT_SECS: Param = p(
    "OXCCL_STARTUP_REPORT_SECS",
    secs(true, MAX_SECS),
    "10",
    Comm,
    "seconds between two words on what init waits for (0: silent)",
);
/// `OXCCL_RENDEZVOUS_REFUSED_SECS`.
pub const RENDEZVOUS_REFUSED_SECS: Param = p(
    "OXCCL_RENDEZVOUS_REFUSED_SECS",
    secs(true, MAX_SECS),
    "60",
    Comm,
    "seconds of refused rendezvous connections before failing",
);
/// `OXCCL_BOOTSTRAP_RELAY_MAX`.
pub const BOOTSTRAP_RELAY_MAX: Param = p(
    "OXCCL_BOOTSTRAP_RELAY_MAX",
    count(0, 1 << 16),
    "64",
    Comm,
    "most ranks whose bootstrap exchanges go through rank 0 (above: directly between ranks)",
);
/// `OXCCL_BOOTSTRAP_HOST_LEADERS`.
pub const BOOTSTRAP_HOST_LEADERS: Param = p(
    "OXCCL_BOOTSTRAP_HOST_LEADERS",
    Kind::Bool,
    "1",
    Comm,
    "1: with direct exchanges, one rank per host joins rank 0 for its host's ranks",
);
/// `OXCCL_HUGEPAGES`.
pub const HUGEPAGES: Param = p(
    "OXCCL_HUGEPAGES",
    Kind::Bool,
    "1",
    Process,
    "0: no transparent huge pages for large single-copy buffers",
);
/// `OXCCL_SHM_POOL_CACHE`.
pub const SHM_POOL_CACHE: Param = p(
    "OXCCL_SHM_POOL_CACHE",
    bytes(0, MAX_THRESHOLD),
    "1G",
    Process,
    "bytes of freed shared buffers the process keeps for reuse",
);
/// `OXCCL_DEBUG`.
pub const DEBUG: Param = p(
    "OXCCL_DEBUG",
    Kind::Enum(&["error", "warn", "info", "debug", "trace"]),
    "off",
    Process,
    "log to stderr at this level",
);
/// `OXCCL_DEBUG_SUBSYS`.
pub const DEBUG_SUBSYS: Param = checked(
    "OXCCL_DEBUG_SUBSYS",
    Kind::Text { max_len: 256 },
    "all",
    Process,
    "comma-separated subsystems to log",
    check_subsys,
);
/// `OXCCL_TUNE_FILE` (set empty: read no file).
pub const TUNE_FILE: Param = p(
    "OXCCL_TUNE_FILE",
    TEXT,
    "~/.cache/oxccl/tune.conf",
    Process,
    "where oxccl tune saves its thresholds and communicators read them",
);
/// `OXCCL_ROOT`.
pub const ROOT: Param = p(
    "OXCCL_ROOT",
    Kind::Text { max_len: 300 },
    "MASTER_ADDR:MASTER_PORT",
    Launch,
    "host:port where rank 0 hosts the rendezvous",
);
/// `OXCCL_SECRET` (set empty: an error).
pub const SECRET: Param = p(
    "OXCCL_SECRET",
    Kind::Text { max_len: 32 },
    "derived from the job identity",
    Launch,
    "32 hex digits every connection must prove it knows",
);
/// `OXCCL_BIND`.
pub const BIND: Param = p(
    "OXCCL_BIND",
    Kind::Enum(&["auto", "none"]),
    "auto",
    Cli,
    "whether oxccl run/perf/tune bind oversubscribed ranks to CPUs",
);
/// `OXCCL_PERF_REGISTER`.
pub const PERF_REGISTER: Param = p(
    "OXCCL_PERF_REGISTER",
    count(0, 1),
    "0",
    Cli,
    "oxccl perf -R's default",
);
/// `OXCCL_LAUNCH_EXPECTS_KILL` (set by the launcher).
pub const LAUNCH_EXPECTS_KILL: Param = p(
    "OXCCL_LAUNCH_EXPECTS_KILL",
    count(0, 65_535),
    "unset",
    Cli,
    "the rank whose SIGKILL the launcher expects",
);
/// `OXCCL_PERF_GROW_JOIN` (set by `oxccl perf --grow`).
pub const PERF_GROW_JOIN: Param = p(
    "OXCCL_PERF_GROW_JOIN",
    Kind::Text { max_len: 1024 },
    "unset",
    Cli,
    "RANK/SIZE/UNIQUE_ID a replacement rank joins",
);
/// `OXCCL_USER_TUNE_FILE` (set by `oxccl tune` for its ranks).
pub const USER_TUNE_FILE: Param = p(
    "OXCCL_USER_TUNE_FILE",
    TEXT,
    "unset",
    Cli,
    "where oxccl tune's ranks save what they measured",
);
/// `OXCCL_TORCH_ALLOCATOR`.
pub const TORCH_ALLOCATOR: Param = p(
    "OXCCL_TORCH_ALLOCATOR",
    Kind::Bool,
    "1",
    Python,
    "serve large CPU tensors from the shared-buffer pool",
);
/// `OXCCL_TORCH_SHM_MIN`.
pub const TORCH_SHM_MIN: Param = p(
    "OXCCL_TORCH_SHM_MIN",
    bytes(0, MAX_THRESHOLD),
    "8K",
    Python,
    "smallest tensor the shared-memory allocator serves",
);
/// `OXCCL_TORCH_EXT_BUILD`.
pub const TORCH_EXT_BUILD: Param = p(
    "OXCCL_TORCH_EXT_BUILD",
    Kind::Bool,
    "1",
    Python,
    "build the C++ torch backend on first import when no usable build exists",
);
/// `OXCCL_TORCH_EXT_DIR`.
pub const TORCH_EXT_DIR: Param = p(
    "OXCCL_TORCH_EXT_DIR",
    TEXT,
    "~/.cache/oxccl/torch-ext",
    Python,
    "the cache the C++ torch backend is built into on first import",
);
/// `OXCCL_TORCH_EXT_TIMEOUT`.
pub const TORCH_EXT_TIMEOUT: Param = p(
    "OXCCL_TORCH_EXT_TIMEOUT",
    Kind::Seconds {
        zero: false,
        min: 0.0,
        max: 1e7,
    },
    "600",
    Python,
    "bounds the C++ torch backend's build on import and the wait for another rank's",
);
/// `OXCCL_TORCH_EXT_SANITIZE`.
pub const TORCH_EXT_SANITIZE: Param = p(
    "OXCCL_TORCH_EXT_SANITIZE",
    Kind::Enum(&["address"]),
    "unset",
    Python,
    "the sanitizer the C++ torch backend is built with and loaded for",
);
/// `OXCCL_ROOT_IP`.
pub const ROOT_IP: Param = p(
    "OXCCL_ROOT_IP",
    Kind::Text { max_len: 300 },
    "this host's default address",
    Python,
    "the address of the unique id a Python rank 0 makes",
);
/// `OXCCL_BIN`.
pub const BIN: Param = p(
    "OXCCL_BIN",
    TEXT,
    "target/release/oxccl",
    Script,
    "the binary scripts/cluster.sh runs",
);
/// `OXCCL_CLUSTER_RATE`.
pub const CLUSTER_RATE: Param = p(
    "OXCCL_CLUSTER_RATE",
    Kind::Text { max_len: 64 },
    "10gbit",
    Script,
    "tbf rate of every emulated link",
);
/// `OXCCL_CLUSTER_MTU`.
pub const CLUSTER_MTU: Param = p(
    "OXCCL_CLUSTER_MTU",
    count(68, 65_535),
    "9000",
    Script,
    "MTU of the emulated links",
);
/// `OXCCL_CLUSTER_TBF`.
pub const CLUSTER_TBF: Param = p(
    "OXCCL_CLUSTER_TBF",
    Kind::Text { max_len: 256 },
    "burst 512k latency 2ms",
    Script,
    "the emulated links' tbf parameters after the rate",
);
/// `OXCCL_CLUSTER_HOST_QDISC`.
pub const CLUSTER_HOST_QDISC: Param = p(
    "OXCCL_CLUSTER_HOST_QDISC",
    Kind::Text { max_len: 256 },
    "tbf rate OXCCL_CLUSTER_RATE OXCCL_CLUSTER_TBF",
    Script,
    "root qdisc of each emulated host's link (tc words; none: the veth's default)",
);
/// `OXCCL_CLUSTER_PORT_QDISC`.
pub const CLUSTER_PORT_QDISC: Param = p(
    "OXCCL_CLUSTER_PORT_QDISC",
    Kind::Text { max_len: 256 },
    "tbf rate OXCCL_CLUSTER_RATE OXCCL_CLUSTER_TBF",
    Script,
    "root qdisc of each emulated switch port (tc words; none: the veth's default)",
);
/// `OXCCL_CLUSTER_CC`.
pub const CLUSTER_CC: Param = p(
    "OXCCL_CLUSTER_CC",
    Kind::Text { max_len: 64 },
    "the machine's",
    Script,
    "TCP congestion control of the emulated hosts",
);
/// `OXCCL_CLUSTER_SSAI`.
pub const CLUSTER_SSAI: Param = p(
    "OXCCL_CLUSTER_SSAI",
    count(0, 1),
    "the machine's",
    Script,
    "net.ipv4.tcp_slow_start_after_idle of the emulated hosts",
);
/// `OXCCL_CLUSTER_SYSCTL`.
pub const CLUSTER_SYSCTL: Param = p(
    "OXCCL_CLUSTER_SYSCTL",
    Kind::Text { max_len: 1024 },
    "unset",
    Script,
    "sysctl key=value words set in every emulated host",
);
/// `OXCCL_CLUSTER_STATS`.
pub const CLUSTER_STATS: Param = p(
    "OXCCL_CLUSTER_STATS",
    TEXT,
    "unset",
    Script,
    "folder where scripts/cluster.sh perf writes the links' and sockets' counters",
);

/// Every `OXCCL_*` variable, in the order of docs/environment.md's tables.
pub const PARAMS: &[Param] = &[
    ROOT,
    SECRET,
    TIMEOUT,
    TRANSPORT,
    SHM_RING_BYTES,
    SHM_BUDGET_BYTES,
    STARTUP_REPORT_SECS,
    RENDEZVOUS_REFUSED_SECS,
    BOOTSTRAP_RELAY_MAX,
    BOOTSTRAP_HOST_LEADERS,
    SPIN,
    DIRECT_SPIN,
    TCP_SPIN,
    BIND,
    YIELD_EVERY,
    HOSTID,
    SOCKET_IFNAME,
    ALGO,
    ONESHOT_MAX,
    ONESHOT_MAPPED_MIN,
    MAPPED_MIN,
    CMA_MIN,
    CMA,
    NT_BYTES,
    SHM_POOL_CACHE,
    HUGEPAGES,
    PERF_REGISTER,
    LAUNCH_EXPECTS_KILL,
    PERF_GROW_JOIN,
    USER_TUNE_FILE,
    DETERMINISTIC,
    TUNE_FILE,
    CHUNK_BYTES,
    TCP_DEAD_AFTER,
    P2P_STASH_BYTES,
    TCP_STREAMS,
    TCP_CONNECT,
    TCP_LAZY_MIN_RANKS,
    NET_GBPS,
    NET_LAT_US,
    DEBUG,
    DEBUG_SUBSYS,
    HEARTBEAT_TIMEOUT,
    FLIGHT_RECORDER,
    FLIGHT_RECORDER_ENTRIES,
    TRACE,
    METRICS,
    METRICS_INTERVAL,
    METRICS_PORT,
    FR_DUMP,
    STATUS,
    TORCH_ALLOCATOR,
    TORCH_SHM_MIN,
    TORCH_EXT_BUILD,
    TORCH_EXT_DIR,
    TORCH_EXT_TIMEOUT,
    TORCH_EXT_SANITIZE,
    ROOT_IP,
    BIN,
    CLUSTER_RATE,
    CLUSTER_MTU,
    CLUSTER_TBF,
    CLUSTER_HOST_QDISC,
    CLUSTER_PORT_QDISC,
    CLUSTER_CC,
    CLUSTER_SSAI,
    CLUSTER_SYSCTL,
    CLUSTER_STATS,
];

/// The entry named `name`, if the table has one.
pub fn find(name: &str) -> Option<&'static Param> {
    PARAMS.iter().find(|p| p.name == name)
}

/// `OXCCL_STATUS`: a port, or `host:port`.
fn check_port_or_addr(v: &str) -> std::result::Result<(), String> {
    let port = v.rsplit_once(':').map_or(v, |(_, p)| p);
    port.parse::<u16>()
        .map(|_| ())
        .map_err(|_| format!("'{port}' is not a port (0 to 65535)"))
}

/// `OXCCL_DEBUG_SUBSYS`: known subsystem names.
fn check_subsys(v: &str) -> std::result::Result<(), String> {
    crate::base::debug::directives("info", Some(v)).map(|_| ())
}

/// `v` cut to [`MAX_SHOWN_VALUE`] characters (error lines stay short whatever was set).
pub fn shown(v: &str) -> String {
    match v.char_indices().nth(MAX_SHOWN_VALUE) {
        Some((i, _)) => format!("{}... ({} bytes)", &v[..i], v.len()),
        None => v.to_string(),
    }
}

/// `n` bytes as a user would write them: with the largest exact suffix.
fn show_bytes(n: u64) -> String {
    for (shift, s) in [(30, "G"), (20, "M"), (10, "K")] {
        if n >= 1 << shift && n.is_multiple_of(1 << shift) {
            return format!("{}{s}", n >> shift);
        }
    }
    n.to_string()
}

/// Parses a byte size with an optional K, M or G suffix (powers of 1024), as nccl-tests;
/// a size that does not fit 64 bits is an error.
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
                        "unknown size suffix '{c}' in '{}' (use K, M or G)",
                        shown(s)
                    ))
                }
            };
            (&s[..i], m)
        }
        _ => (s, 1),
    };
    let num = num.trim();
    let n: usize = num.parse().map_err(|_| {
        if !num.is_empty() && num.bytes().all(|b| b.is_ascii_digit()) {
            format!("'{}' is too large", shown(s))
        } else {
            format!("'{}' is not a size", shown(s))
        }
    })?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("'{}' is too large", shown(s)))
}

/// Parses `0`/`1` (also `false`/`true`, `no`/`yes`, `off`/`on`).
pub(crate) fn parse_bool(v: &str) -> std::result::Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "0" | "false" | "no" | "off" => Ok(false),
        "1" | "true" | "yes" | "on" => Ok(true),
        _ => Err("not 0 or 1".to_string()),
    }
}

impl Kind {
    /// The accepted values, in words (every error message ends with it).
    pub fn range(&self) -> String {
        match *self {
            Kind::Seconds { zero, min, max } if min > 0.0 => format!(
                "seconds {} {min}, at most {max} (fractions allowed)",
                if zero { "0 or from" } else { "above 0: from" }
            ),
            Kind::Seconds { zero, max, .. } => format!(
                "seconds {} {max} (fractions allowed)",
                if zero {
                    "from 0 to"
                } else {
                    "above 0, at most"
                }
            ),
            Kind::Bytes { min, max } => format!(
                "bytes from {} to {} (K, M, G suffixes)",
                show_bytes(min),
                show_bytes(max)
            ),
            Kind::Count { min, max } => format!("a whole number from {min} to {max}"),
            Kind::Number { min, max } if min > 0.0 => format!("a number from {min}, at most {max}"),
            Kind::Number { max, .. } => format!("a number above 0, at most {max}"),
            Kind::Bool => "0 or 1 (also false/true, no/yes, off/on)".into(),
            Kind::Enum(words) => format!("one of {}", words.join(", ")),
            Kind::Text { max_len } => format!("text of at most {max_len} bytes"),
        }
    }

    /// Parses `raw` (trimmed); the error says what is wrong (the caller adds the name, the
    /// value and the range, see [`Param::error`] and [`Kind::arg_error`]).
    pub fn parse(&self, raw: &str) -> std::result::Result<Value, String> {
        let v = raw.trim();
        match *self {
            Kind::Seconds { zero, min, max } => {
                let s: f64 = v
                    .parse()
                    .map_err(|_| "not a number of seconds".to_string())?;
                if !s.is_finite()
                    || s < 0.0
                    || (s == 0.0 && !zero)
                    || (s > 0.0 && s < min)
                    || s > max
                {
                    return Err("out of range".into());
                }
                Ok(Value::Seconds(Duration::from_secs_f64(s)))
            }
            Kind::Bytes { min, max } => {
                let b = parse_bytes(v)? as u64;
                if b < min || b > max {
                    return Err("out of range".into());
                }
                Ok(Value::Bytes(b))
            }
            Kind::Count { min, max } => {
                let n: u64 = v.parse().map_err(|_| {
                    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
                        "out of range".to_string()
                    } else {
                        "not a whole number".to_string()
                    }
                })?;
                if n < min || n > max {
                    return Err("out of range".into());
                }
                Ok(Value::Count(n))
            }
            Kind::Number { min, max } => {
                let x: f64 = v.parse().map_err(|_| "not a number".to_string())?;
                if !x.is_finite() || x <= 0.0 || x < min || x > max {
                    return Err("out of range".into());
                }
                Ok(Value::Number(x))
            }
            Kind::Bool => parse_bool(v).map(Value::Bool),
            Kind::Enum(words) => words
                .iter()
                .find(|w| w.eq_ignore_ascii_case(v))
                .map(|w| Value::Choice(w))
                .ok_or_else(|| "unknown word".to_string()),
            Kind::Text { max_len } => {
                if v.len() > max_len {
                    return Err("too long".into());
                }
                Ok(Value::Text(v.to_string()))
            }
        }
    }

    /// The error line of a command-line flag: the value (cut short), what is wrong and the
    /// accepted range (clap adds the flag's name).
    pub fn arg_error(&self, raw: &str, why: &str) -> String {
        format!("'{}': {why}; expected {}", shown(raw.trim()), self.range())
    }
}

impl Param {
    /// The accepted values, in words (every error message ends with it).
    pub fn range(&self) -> String {
        self.kind.range()
    }

    /// Parses `raw` (trimmed) against this entry; the error says what is wrong (the caller
    /// adds the name, the value and the range, see [`Param::error`]).
    pub fn parse(&self, raw: &str) -> std::result::Result<Value, String> {
        let v = self.kind.parse(raw)?;
        if let (Some(check), Value::Text(t)) = (self.check, &v) {
            check(t)?;
        }
        Ok(v)
    }

    /// The error for value `raw` of this variable: its name, the value (cut short), what is
    /// wrong and the accepted range.
    pub fn error(&self, raw: &str, why: &str) -> Error {
        Error::Env(format!(
            "{}={}: {why}; expected {}",
            self.name,
            shown(raw.trim()),
            self.range()
        ))
    }

    /// This variable's value in the environment: `None` when unset or empty, an error when
    /// it is not valid UTF-8 or not accepted.
    pub fn read(&self) -> Result<Option<Value>> {
        match std::env::var(self.name) {
            Ok(v) => self.parse_set(&v),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(Error::Env(format!(
                "{} is not valid UTF-8; expected {}",
                self.name,
                self.range()
            ))),
        }
    }

    /// As [`read`](Self::read), for a value already looked up (`None`: unset).
    pub fn parse_set(&self, v: &str) -> Result<Option<Value>> {
        if v.trim().is_empty() {
            return Ok(None);
        }
        self.parse(v).map(Some).map_err(|why| self.error(v, &why))
    }

    fn kind_error(&self, want: &str) -> Error {
        Error::Env(format!(
            "{}: read as {want}, but the table declares {:?} (a bug in oxccl)",
            self.name, self.kind
        ))
    }

    /// A [`Kind::Seconds`] variable.
    pub fn seconds(&self) -> Result<Option<Duration>> {
        match self.read()? {
            None => Ok(None),
            Some(Value::Seconds(d)) => Ok(Some(d)),
            Some(_) => Err(self.kind_error("seconds")),
        }
    }

    /// A [`Kind::Bytes`] variable.
    pub fn bytes(&self) -> Result<Option<usize>> {
        match self.read()? {
            None => Ok(None),
            // The table's maxima are far below `usize::MAX` on 64-bit hosts.
            Some(Value::Bytes(b)) => usize::try_from(b)
                .map(Some)
                .map_err(|_| self.error(&b.to_string(), "too large for this host")),
            Some(_) => Err(self.kind_error("bytes")),
        }
    }

    /// A [`Kind::Count`] variable.
    pub fn count(&self) -> Result<Option<u64>> {
        match self.read()? {
            None => Ok(None),
            Some(Value::Count(n)) => Ok(Some(n)),
            Some(_) => Err(self.kind_error("a count")),
        }
    }

    /// A [`Kind::Number`] variable.
    pub fn number(&self) -> Result<Option<f64>> {
        match self.read()? {
            None => Ok(None),
            Some(Value::Number(x)) => Ok(Some(x)),
            Some(_) => Err(self.kind_error("a number")),
        }
    }

    /// A [`Kind::Bool`] variable.
    pub fn flag(&self) -> Result<Option<bool>> {
        match self.read()? {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(_) => Err(self.kind_error("0 or 1")),
        }
    }

    /// A [`Kind::Enum`] variable: the table's spelling of the word.
    pub fn choice(&self) -> Result<Option<&'static str>> {
        match self.read()? {
            None => Ok(None),
            Some(Value::Choice(w)) => Ok(Some(w)),
            Some(_) => Err(self.kind_error("a word")),
        }
    }

    /// A [`Kind::Text`] variable.
    pub fn text(&self) -> Result<Option<String>> {
        match self.read()? {
            None => Ok(None),
            Some(Value::Text(t)) => Ok(Some(t)),
            Some(_) => Err(self.kind_error("text")),
        }
    }
}

/// The table as the Markdown of docs/environment.md's "Accepted values" section (a test
/// checks that the file holds exactly this).
pub fn markdown() -> String {
    let mut out = String::from("| variable | read by | accepted | default |\n|---|---|---|---|\n");
    for p in PARAMS {
        let scope = match p.scope {
            Scope::Comm => "each communicator",
            Scope::Process => "the library, once per process",
            Scope::Launch => "the launcher environment",
            Scope::Cli => "the `oxccl` tool",
            Scope::Python => "the Python package",
            Scope::Script => "`scripts/cluster.sh`",
        };
        out += &format!(
            "| `{}` | {scope} | {} | {} |\n",
            p.name,
            p.range(),
            p.default
        );
    }
    out
}

/// Checks every variable of the given scopes that is set in the environment against the
/// table; the first one that is not accepted is the error. Communicators check
/// [`Scope::Comm`] and [`Scope::Process`] at init; the `oxccl` tool checks those and
/// [`Scope::Cli`] when it starts.
pub fn check_env(scopes: &[Scope]) -> Result<()> {
    for p in PARAMS.iter().filter(|p| scopes.contains(&p.scope)) {
        p.read()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values every variable must survive: garbage, negative, zero, huge, empty.
    const HOSTILE: &[&str] = &[
        "garbage",
        "-3",
        "-1e99",
        "0",
        "1e99",
        "18446744073709551615",
        "18446744073709551616",
        "99999999999",
        "inf",
        "NaN",
        "",
        " ",
        "1K",
        "99999999999G",
        "0x10",
        "1.5",
    ];

    #[test]
    fn every_entry_accepts_or_names_itself() {
        for p in PARAMS {
            assert!(p.name.starts_with("OXCCL_"), "{}", p.name);
            assert!(!p.doc.is_empty() && !p.default.is_empty(), "{}", p.name);
            for v in HOSTILE {
                match p.parse_set(v) {
                    Ok(None) => assert!(v.trim().is_empty(), "{}={v:?}", p.name),
                    Ok(Some(val)) => match (p.kind, val) {
                        (Kind::Seconds { zero, min, max }, Value::Seconds(d)) => {
                            let s = d.as_secs_f64();
                            assert!(
                                s <= max && (zero || s > 0.0) && (s == 0.0 || s >= min),
                                "{}={v}",
                                p.name
                            );
                        }
                        (Kind::Bytes { min, max }, Value::Bytes(b))
                        | (Kind::Count { min, max }, Value::Count(b)) => {
                            assert!((min..=max).contains(&b), "{}={v}", p.name)
                        }
                        (Kind::Number { min, max }, Value::Number(x)) => {
                            assert!(x > 0.0 && x >= min && x <= max, "{}={v}", p.name)
                        }
                        (Kind::Bool, Value::Bool(_)) | (Kind::Enum(_), Value::Choice(_)) => {}
                        (Kind::Text { max_len }, Value::Text(t)) => {
                            assert!(t.len() <= max_len, "{}={v}", p.name)
                        }
                        (k, val) => panic!("{}={v}: {val:?} is not a {k:?}", p.name),
                    },
                    Err(e) => {
                        let m = e.to_string();
                        assert!(
                            m.contains(p.name) && m.contains(v.trim()) && m.contains(&p.range()),
                            "{m}"
                        );
                        assert!(m.len() < 400, "{m}");
                    }
                }
            }
        }
    }

    #[test]
    fn huge_and_negative_are_refused() {
        for p in [
            TIMEOUT,
            HEARTBEAT_TIMEOUT,
            TCP_DEAD_AFTER,
            METRICS_INTERVAL,
            STARTUP_REPORT_SECS,
            RENDEZVOUS_REFUSED_SECS,
        ] {
            for v in ["1e99", "-3", "inf", "NaN", "x"] {
                let m = p.parse_set(v).unwrap_err().to_string();
                assert!(m.contains(p.name) && m.contains("seconds"), "{m}");
            }
        }
        let m = FLIGHT_RECORDER_ENTRIES
            .parse_set("99999999999")
            .unwrap_err()
            .to_string();
        assert!(m.contains("from 0 to 100000"), "{m}");
        let m = SPIN.parse_set("-3").unwrap_err().to_string();
        assert!(
            m.starts_with("environment: OXCCL_SPIN=-3: not a whole number"),
            "{m}"
        );
        assert_eq!(SPIN.parse_set(" 7 ").unwrap(), Some(Value::Count(7)));
        assert_eq!(
            TIMEOUT.parse_set("1e7").unwrap(),
            Some(Value::Seconds(Duration::from_secs(10_000_000)))
        );
        assert!(TIMEOUT.parse_set("0").is_err());
        assert_eq!(
            HEARTBEAT_TIMEOUT.parse_set("0").unwrap(),
            Some(Value::Seconds(Duration::ZERO))
        );
        assert_eq!(
            TRANSPORT.parse_set("TCP").unwrap(),
            Some(Value::Choice("tcp"))
        );
        let long = "x".repeat(10_000);
        let m = SPIN.parse_set(&long).unwrap_err().to_string();
        assert!(m.len() < 300 && m.contains("10000 bytes"), "{m}");
        assert!(STATUS.parse_set("127.0.0.1:29600").is_ok());
        assert!(STATUS.parse_set("99999").is_err());
        assert!(DEBUG_SUBSYS.parse_set("shm,net").is_ok());
        assert!(DEBUG_SUBSYS.parse_set("gpu").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("8").unwrap(), 8);
        assert_eq!(parse_bytes("64M").unwrap(), 64 << 20);
        assert_eq!(parse_bytes("1k").unwrap(), 1024);
        assert_eq!(parse_bytes("2G").unwrap(), 2 << 30);
        assert!(parse_bytes("12Q").is_err());
        assert!(parse_bytes("x").is_err());
        assert!(parse_bytes("18446744073709551616")
            .unwrap_err()
            .contains("too large"));
        assert!(parse_bytes("18446744073709551615G")
            .unwrap_err()
            .contains("too large"));
        assert_eq!(show_bytes(4096), "4K");
        assert_eq!(show_bytes(1 << 40), "1024G");
        assert_eq!(show_bytes(100), "100");
    }

    const BEGIN: &str = "<!-- generated from crates/oxccl/src/base/param/table.rs: begin -->\n";
    const END: &str = "<!-- generated: end -->";

    /// docs/environment.md's "Accepted values" section is the table's [`markdown`]; set
    /// `OXCCL_WRITE_DOCS=1` to rewrite it.
    #[test]
    fn docs_hold_the_generated_table() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/environment.md");
        let doc = std::fs::read_to_string(&path).unwrap();
        let (head, rest) = doc
            .split_once(BEGIN)
            .expect("docs/environment.md: no generated section");
        let (block, tail) = rest
            .split_once(END)
            .expect("docs/environment.md: no end of the generated section");
        if std::env::var_os("OXCCL_WRITE_DOCS").is_some() {
            std::fs::write(&path, format!("{head}{BEGIN}{}{END}{tail}", markdown())).unwrap();
            return;
        }
        assert_eq!(
            block,
            markdown(),
            "docs/environment.md is out of date: rerun this test with OXCCL_WRITE_DOCS=1"
        );
    }

    /// docs/environment.md's prose tables list exactly the table's variables.
    #[test]
    fn docs_list_the_table() {
        let whole = include_str!("../../../../../docs/environment.md");
        let doc = match whole.split_once(BEGIN) {
            Some((head, rest)) => format!("{head}{}", rest.split_once(END).map_or("", |r| r.1)),
            None => whole.to_string(),
        };
        let mut in_doc: Vec<&str> = doc
            .lines()
            .filter(|l| l.starts_with("| `OXCCL_"))
            .filter_map(|l| l[3..].split(['`', '=']).next())
            .collect();
        in_doc.sort_unstable();
        in_doc.dedup();
        let mut in_table: Vec<&str> = PARAMS.iter().map(|p| p.name).collect();
        in_table.sort_unstable();
        let before = in_table.len();
        in_table.dedup();
        assert_eq!(before, in_table.len(), "a variable is in the table twice");
        assert_eq!(
            in_doc, in_table,
            "docs/environment.md's tables and base/param/table.rs differ"
        );
    }

    /// Every `OXCCL_*` name in the crates' sources and the Python package is in the table.
    #[test]
    fn sources_read_only_declared_variables() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut unknown = Vec::new();
        let mut stack: Vec<std::path::PathBuf> = [
            "crates/oxccl/src",
            "crates/oxccl-cli/src",
            "crates/oxccl-capi/src",
            "python/src",
            "python/oxccl",
        ]
        .iter()
        .map(|d| root.join(d))
        .collect();
        while let Some(d) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in entries.flatten() {
                let path = e.path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                if !matches!(
                    path.extension().and_then(|x| x.to_str()),
                    Some("rs" | "py" | "cpp")
                ) {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                for (i, _) in text.match_indices("OXCCL_") {
                    let name: String = text[i..]
                        .chars()
                        .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                        .collect();
                    // Not environment variables: the C header's macros; and this module's
                    // own test switch.
                    if [
                        "OXCCL_API_VERSION",
                        "OXCCL_H",
                        "OXCCL_UNIQUE_ID_BYTES",
                        "OXCCL_",
                        "OXCCL_WRITE_DOCS",
                    ]
                    .contains(&name.as_str())
                    {
                        continue;
                    }
                    if find(&name).is_none() {
                        unknown.push(format!("{name} in {}", path.display()));
                    }
                }
            }
        }
        assert!(
            unknown.is_empty(),
            "not in base/param/table.rs: {unknown:?}"
        );
    }
}
