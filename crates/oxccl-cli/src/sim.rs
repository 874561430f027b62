//! `oxccl sim`: predicts all_reduce on clusters larger than this one, from the cost model
//! the library chooses algorithms with ([`oxccl::predict`]): the time of each algorithm the
//! model covers (ring, hier, tree, halving-doubling), the one a communicator of that shape
//! would run (the library's own choice function), and its algbw/busbw, for every host count
//! and size asked. No rank starts; nothing is measured.
//!
//! The model is the run-time one: its defaults, with `OXCCL_NET_GBPS`, `OXCCL_NET_LAT_US`,
//! `OXCCL_ALGO` and `OXCCL_DETERMINISTIC` where set; `--net-gbps` and `--net-lat-us`
//! replace the network's. The method and its check against measured runs: docs/scale.md,
//! "Predicting larger clusters".

use std::io::Write;

use clap::Args as ClapArgs;
use oxccl::predict::{Predictor, MAX_WORLD, MODELLED};
use serde::Serialize;

use crate::args;

/// The most host counts one run predicts.
const MAX_HOST_COUNTS: usize = 1024;
/// The most sizes one run predicts.
const MAX_SIZES: usize = 1024;

/// `oxccl sim` arguments.
#[derive(ClapArgs, Clone, Debug)]
pub struct Args {
    /// Host counts: a comma-separated list of N (2 or more) and A-B ranges, which double
    /// from A to B (B included): `2-4096` is 2, 4, 8, ..., 4096; `3,6,12-48` works too.
    #[arg(long, default_value = "2-4096", value_parser = args::text(4096))]
    hosts: String,
    /// Ranks on each host (1 to 1024; hosts x ranks at most 65536).
    #[arg(long, default_value_t = 1, value_parser = args::count(1, crate::args::MAX_LOCAL_RANKS))]
    ranks_per_host: usize,
    /// Network bandwidth of one host's link, one direction, in GB/s (1e9 bytes/s, as
    /// OXCCL_NET_GBPS; 10 Gbit/s Ethernet is 1.25, 100 Gbit/s is 12.5). Default: the run-time
    /// model's (OXCCL_NET_GBPS, else 1.2).
    #[arg(long, value_parser = args::number_in(1e-6, 1e6))]
    net_gbps: Option<f64>,
    /// Network latency of one step in microseconds (as OXCCL_NET_LAT_US). Default: the
    /// run-time model's (OXCCL_NET_LAT_US, else 30).
    #[arg(long, value_parser = args::number_in(1e-3, 1e9))]
    net_lat_us: Option<f64>,
    /// The tune file whose measured rates (shared-memory link, reduction, TCP stack; written
    /// by `oxccl tune`) the model uses. Default: the file `oxccl tune` writes
    /// (OXCCL_TUNE_FILE, else ~/.cache/oxccl/tune.conf), the built-in rates where it is
    /// missing or has none.
    #[arg(long)]
    tune_file: Option<std::path::PathBuf>,
    /// Cores shared by all ranks of all hosts (emulated hosts on one machine, as
    /// scripts/cluster.sh makes): every CPU term is ranks/cpus times slower where there are
    /// more ranks than cores. Default: each rank has a core of its own.
    #[arg(long, value_parser = args::number_in(1e-2, 1e6))]
    cpus: Option<f64>,
    /// GB/s the TCP stack moves per core on the path between the hosts, in place of the
    /// tune file's (measured over loopback). For emulated hosts, whose veth, bridge and tbf
    /// cost more per byte: the path's TCP throughput with both directions at once divided by
    /// the cores (`IPERF_ARGS=--bidir scripts/cluster.sh iperf`). Changes the times, not the
    /// choice. Default: the tune file's rate.
    #[arg(long, value_parser = args::number_in(1e-6, 1e6))]
    tcp_gbps: Option<f64>,
    /// Smallest size in bytes (K, M, G suffixes; at most 1024G).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = args::bytes(1, args::MAX_PERF_BYTES))]
    minbytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "256M", value_parser = args::bytes(1, args::MAX_PERF_BYTES))]
    maxbytes: usize,
    /// Multiply the size by this factor between rows (2 to 1024).
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2, value_parser = args::count(2, 1024))]
    stepfactor: usize,
    /// The collective (the model predicts all_reduce only).
    #[arg(long, default_value = "all_reduce", value_parser = args::word(&["all_reduce"]))]
    coll: String,
    /// Print one JSON object per row instead of the table.
    #[arg(long)]
    json: bool,
}

/// One predicted row (`--json`).
#[derive(Serialize)]
struct Row {
    collective: &'static str,
    hosts: usize,
    ranks_per_host: usize,
    ranks: usize,
    bytes: usize,
    net_gbps: f64,
    net_lat_us: f64,
    /// `[per-message µs, GB/s per core]` of the TCP stack charged (null: not charged).
    tcp: Option<(f64, f64)>,
    /// Cores shared by all ranks (`--cpus`; null: one per rank).
    cpus: Option<f64>,
    /// Predicted microseconds per algorithm name (null: does not run on this shape).
    predicted_us: serde_json::Map<String, serde_json::Value>,
    algo: &'static str,
    time_us: Option<f64>,
    algbw_gbps: Option<f64>,
    busbw_gbps: Option<f64>,
}

/// Entry point: 0 on success, 2 on a refused input (one line naming it).
pub fn main(a: Args) -> i32 {
    match run(&a, &mut std::io::stdout().lock()) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("oxccl sim: {e}");
            2
        }
    }
}

/// Parses `--hosts` (see [`Args::hosts`]); every count is checked against `per` ranks per
/// host (hosts x ranks at most [`MAX_WORLD`]).
fn host_counts(spec: &str, per: usize) -> Result<Vec<usize>, String> {
    let shown = oxccl::params::shown;
    let bad = |what: &str, why: String| format!("--hosts {}: {why}", shown(what));
    let max = MAX_WORLD / per;
    // A number of `item` (N, or either end of A-B).
    let one = |s: &str, item: &str| -> Result<usize, String> {
        let n: usize = s.trim().parse().map_err(|_| {
            bad(
                item,
                format!(
                    "'{}' is not a whole number; expected N or A-B, comma-separated",
                    shown(s)
                ),
            )
        })?;
        if n < 2 || n > max {
            return Err(bad(
                item,
                format!(
                    "expected 2 to {max} hosts ({per} rank(s) per host, at most {MAX_WORLD} ranks)"
                ),
            ));
        }
        Ok(n)
    };
    let mut out = Vec::new();
    for item in spec.split(',') {
        match item.split_once('-') {
            Some((lo, hi)) => {
                let (lo, hi) = (one(lo, item)?, one(hi, item)?);
                if lo > hi {
                    return Err(bad(item, format!("{lo} is larger than {hi}")));
                }
                let mut h = lo;
                while h < hi {
                    out.push(h);
                    h *= 2;
                }
                out.push(hi);
            }
            None => out.push(one(item, item)?),
        }
        if out.len() > MAX_HOST_COUNTS {
            return Err(bad(
                spec,
                format!("more than {MAX_HOST_COUNTS} host counts"),
            ));
        }
    }
    Ok(out)
}

/// The sizes from `b` to `e` by factor `f` (`e` included only where reached).
fn sizes(b: usize, e: usize, f: usize) -> Result<Vec<usize>, String> {
    if b > e {
        return Err(format!("-b {b} is larger than -e {e}"));
    }
    let mut v = vec![b];
    while let Some(n) = v[v.len() - 1].checked_mul(f).filter(|&n| n <= e) {
        v.push(n);
    }
    if v.len() > MAX_SIZES {
        return Err(format!(
            "-b {b} to -e {e} makes more than {MAX_SIZES} rows: use a larger -f"
        ));
    }
    Ok(v)
}

/// Predicts every row and writes the table (or JSON lines) to `out`.
fn run(a: &Args, out: &mut dyn Write) -> Result<(), String> {
    let hosts = host_counts(&a.hosts, a.ranks_per_host)?;
    let sizes = sizes(a.minbytes, a.maxbytes, a.stepfactor)?;
    let cfg = oxccl::Config::from_env().map_err(|e| e.to_string())?;
    let mut p = Predictor::from_config(&cfg).map_err(|e| e.to_string())?;
    let rates_from = match &a.tune_file {
        Some(f) => {
            let t = oxccl::Tuning::read(f)
                .map_err(|e| format!("--tune-file: {e}"))?
                .ok_or_else(|| format!("--tune-file {}: no such file", f.display()))?;
            let r = t.rates.ok_or_else(|| {
                format!(
                    "--tune-file {}: no measured rates (written by an older `oxccl tune`, or \
                     implausible as said above: rerun it)",
                    f.display()
                )
            })?;
            p = p.with_rates(&r);
            format!("measured, {}", f.display())
        }
        None => match (&cfg.rates, oxccl::Tuning::path()) {
            (Some(_), Some(f)) => format!("measured, {}", f.display()),
            _ => "built-in (no tune file with rates: run `oxccl tune`)".to_string(),
        },
    };
    let p = p
        .with_net(a.net_gbps, a.net_lat_us)
        .with_cpus(a.cpus)
        .with_path_tcp_gbps(a.tcp_gbps);
    let (lat, gbps) = p.net();
    let (shm_lat, shm_gbps) = p.shm();
    let (mem, cached) = p.local();
    let io = |e: std::io::Error| e.to_string();
    if !a.json {
        writeln!(
            out,
            "# oxccl sim: {} float sum, predicted by the cost model (nothing runs)\n\
             # network {lat} us + {gbps} GB/s ({:.1} Gbit/s) per host link; shared memory \
             {shm_lat:.2} us + {shm_gbps:.2} GB/s; reduce {mem:.2} GB/s ({cached:.2} in cache)\n\
             # TCP stack {}; rates: {rates_from}; cores: {}",
            a.coll,
            gbps * 8.0,
            p.tcp().map_or_else(
                || "not charged".to_string(),
                |(l, g)| format!("{l:.1} us per message, {g:.2} GB/s per core")
            ),
            a.cpus.map_or_else(
                || "one per rank".to_string(),
                |c| format!("{c} shared by all ranks")
            ),
        )
        .map_err(io)?;
    }
    let l = a.ranks_per_host;
    for &h in &hosts {
        let n = h * l;
        let bus = 2.0 * (n as f64 - 1.0) / n as f64;
        if !a.json {
            write!(
                out,
                "#\n# {h} hosts x {l} rank(s) = {n} ranks; times in us, bandwidths in GB/s\n\
                 #{:>12} {:>12}",
                "size", "count"
            )
            .map_err(io)?;
            for algo in MODELLED {
                write!(out, " {:>12}", algo.name()).map_err(io)?;
            }
            writeln!(
                out,
                " {:>8} {:>12} {:>8} {:>8}",
                "chosen", "time", "algbw", "busbw"
            )
            .map_err(io)?;
        }
        for &bytes in &sizes {
            let pr = p.all_reduce(h, l, bytes).map_err(|e| e.to_string())?;
            let algbw = pr.chosen_us.map(|t| bytes as f64 / (t * 1e3));
            if a.json {
                let row = Row {
                    collective: "all_reduce",
                    hosts: h,
                    ranks_per_host: l,
                    ranks: n,
                    bytes,
                    net_gbps: gbps,
                    net_lat_us: lat,
                    tcp: p.tcp(),
                    cpus: a.cpus,
                    predicted_us: pr
                        .times_us
                        .iter()
                        .map(|(a, t)| (a.name().to_string(), (*t).into()))
                        .collect(),
                    algo: pr.chosen.name(),
                    time_us: pr.chosen_us,
                    algbw_gbps: algbw,
                    busbw_gbps: algbw.map(|b| b * bus),
                };
                let line = serde_json::to_string(&row).map_err(|e| e.to_string())?;
                writeln!(out, "{line}").map_err(io)?;
                continue;
            }
            let f = |x: Option<f64>, prec: usize| {
                x.map_or_else(|| "-".to_string(), |v| format!("{v:.prec$}"))
            };
            write!(out, " {bytes:>12} {:>12}", bytes / 4).map_err(io)?;
            for (_, t) in &pr.times_us {
                write!(out, " {:>12}", f(*t, 1)).map_err(io)?;
            }
            writeln!(
                out,
                " {:>8} {:>12} {:>8} {:>8}",
                pr.chosen.name(),
                f(pr.chosen_us, 1),
                f(algbw, 3),
                f(algbw.map(|b| b * bus), 3)
            )
            .map_err(io)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_lists() {
        assert_eq!(host_counts("2-16", 1).unwrap(), vec![2, 4, 8, 16]);
        assert_eq!(host_counts("3-20,5", 8).unwrap(), vec![3, 6, 12, 20, 5]);
        assert_eq!(host_counts("2-4096", 8).unwrap().len(), 12);
        assert_eq!(host_counts("4096", 16).unwrap(), vec![4096]);
        for (bad, why) in [
            ("1", "expected 2 to"),
            ("0-4", "expected 2 to"),
            ("x", "not a whole number"),
            ("", "not a whole number"),
            ("8-4", "larger than"),
            ("4097", "expected 2 to 4096"),
            ("2-", "not a whole number"),
            ("-2", "not a whole number"),
        ] {
            let e = host_counts(bad, 16).unwrap_err();
            assert!(e.starts_with("--hosts") && e.contains(why), "{bad}: {e}");
        }
        let many = vec!["2"; MAX_HOST_COUNTS + 1].join(",");
        assert!(host_counts(&many, 1).unwrap_err().contains("more than"));
    }

    #[test]
    fn size_rows() {
        assert_eq!(sizes(8, 64, 2).unwrap(), vec![8, 16, 32, 64]);
        assert_eq!(sizes(8, 100, 4).unwrap(), vec![8, 32]);
        assert_eq!(sizes(5, 5, 2).unwrap(), vec![5]);
        assert!(sizes(9, 8, 2).unwrap_err().contains("larger"));
        assert_eq!(sizes(1, usize::MAX, 2).unwrap().len(), 64);
    }
}
