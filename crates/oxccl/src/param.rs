//! Every tunable read from the environment, in one place (as NCCL's `NCCL_PARAM`).
//!
//! [`Config::from_env`] reads them once per communicator; tests and embedders build a
//! [`Config`] by hand instead. docs/environment.md lists them for users.

use std::time::Duration;

use crate::error::{Error, Result};

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
    // Multi-host settings (transport/tcp.rs, cost.rs).
    /// `OXCCL_NET_GBPS`: network bandwidth per host link in GB/s for the cost model
    /// (default: [`crate::cost::CostModel`]'s, 1.2).
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
}

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: Duration::from_secs(600),
            transport: TransportChoice::Auto,
            shm_ring_bytes: 4 << 20,
            spin: 2000,
            host_id: None,
            socket_ifname: None,
            algo: None,
            chunk_bytes: 256 << 10,
            net_gbps: None,
            net_lat_us: None,
            tcp_streams: 1,
            tcp_dead_after: Duration::from_secs(20),
        }
    }
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
        if let Some(t) = env_parse("OXCCL_TIMEOUT", |v| {
            v.parse::<f64>()
                .ok()
                .filter(|s| *s > 0.0 && s.is_finite())
                .map(Duration::from_secs_f64)
                .ok_or_else(|| "expected a positive number of seconds".to_string())
        })? {
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
        c.read_net_env()?;
        Ok(c)
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
